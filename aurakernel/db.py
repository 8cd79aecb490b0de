"""The tuning DB: one SQLite row per (op, variant, shape, dtype, target, source hash, version).

Every write is a single statement inside a transaction (sqlite's journal makes it atomic), so a
process killed mid-write leaves either the whole row or none. Readers get pandas DataFrames.
"""

from __future__ import annotations

import contextlib
import json
import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from .version import __version__
from .errors import UserError

SCHEMA = """
CREATE TABLE IF NOT EXISTS records (
    id            INTEGER PRIMARY KEY,
    op            TEXT NOT NULL,
    variant       TEXT NOT NULL,
    shape         TEXT NOT NULL,
    dtype         TEXT NOT NULL,
    target        TEXT NOT NULL,
    source_hash   TEXT NOT NULL,
    version       TEXT NOT NULL,
    hardware      TEXT NOT NULL,
    plan          TEXT NOT NULL,      -- JSON: knobs, predicted pipes, binding constraint, solver
    predicted_us  REAL,
    measured_us   REAL,
    eager_us      REAL,
    compiled_us   REAL,
    verified      INTEGER NOT NULL,
    status        TEXT NOT NULL,      -- ok | build_failed | verify_failed | slower | infeasible
    detail        TEXT NOT NULL,      -- JSON: verification summary, reasons
    created       REAL NOT NULL,
    UNIQUE (op, variant, shape, dtype, target, source_hash, version)
);
"""


@dataclass
class Record:
    op: str
    variant: str
    shape: str
    dtype: str
    target: str
    source_hash: str
    hardware: str
    plan: dict
    predicted_us: float | None
    measured_us: float | None
    eager_us: float | None
    compiled_us: float | None
    verified: bool
    status: str
    detail: dict
    version: str = __version__
    created: float = 0.0


# Our files carry SQLite's application_id ("AKDB") and their schema version in user_version, so a
# foreign SQLite file or one a newer AuraKernel wrote is refused before anything is written to it.
APPLICATION_ID = 0x414B4442
SCHEMA_VERSION = 1
COLUMNS = ("id", "op", "variant", "shape", "dtype", "target", "source_hash", "version", "hardware", "plan",
           "predicted_us", "measured_us", "eager_us", "compiled_us", "verified", "status", "detail", "created")


def plan_knobs(plan_text: str) -> dict | None:
    """A row's knobs, or None when its plan column is not a JSON object with a knobs mapping (a row
    another tool wrote or edited): readers skip it instead of failing on it."""
    try:
        plan = json.loads(plan_text)
    except (TypeError, ValueError):
        return None
    knobs = plan.get("knobs", {}) if isinstance(plan, dict) else None
    return knobs if isinstance(knobs, dict) else None


class TuningDB:
    """`readonly`: for commands that only read (show, fit), which must work on a read-only file and
    create nothing; writers check the path can be written before any tuning starts."""

    def __init__(self, path: str | Path, readonly: bool = False):
        from .paths import check_writable
        self.path = Path(path)
        self.readonly = readonly
        if self.path.exists() and not self.path.is_file():
            raise UserError(f"--db {self.path}: not a file")
        if readonly and not self.path.exists():
            raise UserError(f"--db {self.path}: no such tuning DB (tune and autotune create one)")
        if not readonly:
            check_writable(self.path, "--db")
            self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            with contextlib.closing(self._open_plain()) as plain:   # before WAL: it writes the header
                self._check_ours(plain)
            if readonly:
                return
            with self._connect() as conn:
                conn.executescript(SCHEMA)
                conn.execute(f"PRAGMA application_id={APPLICATION_ID}")
                conn.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
        except sqlite3.DatabaseError as exc:
            raise UserError(f"--db {self.path}: not a usable SQLite database ({exc})") from None

    def _check_ours(self, conn: sqlite3.Connection) -> None:
        """Refuse a file that is not an AuraKernel tuning DB (another program's SQLite file, one whose
        records table has another schema) or that a newer AuraKernel wrote; an unmarked file holding
        only our records table (an older AuraKernel's) is ours."""
        app = conn.execute("PRAGMA application_id").fetchone()[0]
        version = conn.execute("PRAGMA user_version").fetchone()[0]
        tables = sorted(r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'"))
        if app == APPLICATION_ID:
            if version > SCHEMA_VERSION:
                raise UserError(f"--db {self.path}: written by a newer AuraKernel (schema {version}; this one reads "
                                f"{SCHEMA_VERSION}): upgrade, or pass another --db")
            return
        if app != 0 or any(t != "records" for t in tables):
            raise UserError(f"--db {self.path}: not an AuraKernel tuning DB (it holds "
                            f"{', '.join(tables) or 'another application id'}): pass another --db; it was left unchanged")
        if tables:
            columns = tuple(r[1] for r in conn.execute("PRAGMA table_info(records)"))
            if columns != COLUMNS:
                raise UserError(f"--db {self.path}: its records table is not a tuning DB's (columns "
                                f"{', '.join(columns)}): pass another --db; it was left unchanged")

    def _open_plain(self) -> sqlite3.Connection:
        if self.readonly:
            return sqlite3.connect(f"{self.path.resolve().as_uri()}?mode=ro", uri=True, timeout=30)
        return sqlite3.connect(self.path, timeout=30)

    @contextlib.contextmanager
    def _connect(self):
        """A connection for one transaction (committed on success), closed after it."""
        if self.readonly:
            conn = self._open_plain()
        else:
            conn = sqlite3.connect(self.path, timeout=30)
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA synchronous=FULL")
        with contextlib.closing(conn), conn:
            yield conn

    def add(self, rec: Record) -> None:
        rec.created = rec.created or time.time()
        row = (rec.op, rec.variant, rec.shape, rec.dtype, rec.target, rec.source_hash, rec.version, rec.hardware,
               json.dumps(rec.plan), rec.predicted_us, rec.measured_us, rec.eager_us, rec.compiled_us,
               int(rec.verified), rec.status, json.dumps(rec.detail), rec.created)
        with self._connect() as conn:  # one transaction: the row lands whole or not at all
            conn.execute(
                "INSERT OR REPLACE INTO records (op, variant, shape, dtype, target, source_hash, version, hardware,"
                " plan, predicted_us, measured_us, eager_us, compiled_us, verified, status, detail, created)"
                " VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)", row)

    def frame(self) -> pd.DataFrame:
        with self._connect() as conn:
            if conn.execute("SELECT 1 FROM sqlite_master WHERE type='table' AND name='records'").fetchone() is None:
                return pd.DataFrame(columns=list(COLUMNS))   # an empty file nothing was recorded into yet
            return pd.read_sql_query("SELECT * FROM records ORDER BY created", conn)

    def best(self, op: str, variant: str, shape: str, dtype: str, target: str) -> dict | None:
        """The fastest verified record for a problem, if any."""
        with self._connect() as conn:
            conn.row_factory = sqlite3.Row
            row = conn.execute(
                "SELECT * FROM records WHERE op=? AND variant=? AND shape=? AND dtype=? AND target=?"
                " AND verified=1 AND status='ok' ORDER BY measured_us LIMIT 1",
                (op, variant, shape, dtype, target)).fetchone()
        return dict(row) if row else None
