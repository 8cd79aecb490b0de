import os
import signal
import sqlite3
import subprocess
import sys
import textwrap

import pytest

from aurakernel.db import Record, TuningDB
from aurakernel.errors import UserError


def record(**over):
    r = dict(op="rms_norm", variant="weighted", shape="64x64", dtype="fp32", target="host", source_hash="abc",
             hardware="hw", plan={"knobs": {"tile_rows": 4}}, predicted_us=1.0, measured_us=2.0, eager_us=4.0,
             compiled_us=3.0, verified=True, status="ok", detail={})
    r.update(over)
    return Record(**r)


def test_round_trip_and_best(db_path):
    db = TuningDB(db_path)
    db.add(record())
    db.add(record(source_hash="def", measured_us=1.5))
    db.add(record(source_hash="bad", measured_us=0.1, verified=False, status="verify_failed"))
    frame = db.frame()
    assert len(frame) == 3
    best = db.best("rms_norm", "weighted", "64x64", "fp32", "host")
    assert best["source_hash"] == "def"   # fastest *verified* record, never the failed one


def test_same_key_replaces_instead_of_duplicating(db_path):
    db = TuningDB(db_path)
    db.add(record(measured_us=2.0))
    db.add(record(measured_us=1.0))
    assert len(db.frame()) == 1 and db.frame().iloc[0]["measured_us"] == 1.0


def test_not_a_database_is_a_clear_error(tmp_path):
    bad = tmp_path / "junk.sqlite"
    bad.write_bytes(b"this is not sqlite" * 100)
    with pytest.raises(UserError, match="not a usable SQLite database"):
        TuningDB(bad)


def test_killed_writer_leaves_no_half_row(db_path):
    """A process SIGKILLed in the middle of a write transaction leaves the DB as before it."""
    TuningDB(db_path).add(record(source_hash="kept"))
    script = textwrap.dedent(f"""
        import os, signal, sqlite3
        conn = sqlite3.connect({db_path!r})
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("BEGIN")
        for i in range(500):
            conn.execute("INSERT INTO records (op, variant, shape, dtype, target, source_hash, version, hardware,"
                         " plan, verified, status, detail, created) VALUES ('rms_norm','weighted','1x1','fp32',"
                         " 'host', ?, 'v', 'hw', '{{}}', 1, 'ok', '{{}}', 0)", (f"h{{i}}",))
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    proc = subprocess.run([sys.executable, "-c", script])
    assert proc.returncode == -signal.SIGKILL
    frame = TuningDB(db_path).frame()
    assert list(frame["source_hash"]) == ["kept"]
    with sqlite3.connect(db_path) as conn:
        assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    assert os.path.exists(db_path)


def _foreign(path, sql):
    import sqlite3
    with sqlite3.connect(path) as conn:
        conn.executescript(sql)
    return path.read_bytes()


def test_a_foreign_sqlite_file_is_refused_and_left_unchanged(tmp_path):
    """Another program's SQLite file (other tables, or a records table of another schema) gets one
    line and not a byte written: no records table added, no journal mode changed."""
    for name, sql in (("app.db", "CREATE TABLE users (id INTEGER, name TEXT); INSERT INTO users VALUES (1, 'a');"),
                      ("other.db", "CREATE TABLE records (id INTEGER, payload TEXT);")):
        path = tmp_path / name
        before = _foreign(path, sql)
        with pytest.raises(UserError, match="not an AuraKernel tuning DB|not a tuning DB's"):
            TuningDB(path)
        assert path.read_bytes() == before


def test_our_db_is_marked_and_a_newer_schema_is_refused(db_path):
    import sqlite3
    TuningDB(db_path).add(record())
    with sqlite3.connect(db_path) as conn:
        assert conn.execute("PRAGMA application_id").fetchone()[0] == 0x414B4442
        conn.execute("PRAGMA user_version=99")
    with pytest.raises(UserError, match="written by a newer AuraKernel"):
        TuningDB(db_path)


def test_an_unmarked_db_of_an_older_aurakernel_is_still_ours(db_path):
    import sqlite3
    from aurakernel.db import SCHEMA
    with sqlite3.connect(db_path) as conn:
        conn.executescript(SCHEMA)
    db = TuningDB(db_path)
    db.add(record())
    assert len(db.frame()) == 1
