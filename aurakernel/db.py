"""The tuning DB: one SQLite row per (op, variant, shape, dtype, target, source hash, version).

Every write is a single statement inside a transaction (sqlite's journal makes it atomic), so a
process killed mid-write leaves either the whole row or none. Readers get pandas DataFrames.
"""

from __future__ import annotations

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


class TuningDB:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        if self.path.exists() and not self.path.is_file():
            raise UserError(f"--db {self.path}: not a file")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            with self._connect() as conn:
                conn.executescript(SCHEMA)
        except sqlite3.DatabaseError as exc:
            raise UserError(f"--db {self.path}: not a usable SQLite database ({exc})") from None

    def _connect(self) -> sqlite3.Connection:
        conn = sqlite3.connect(self.path, timeout=30)
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=FULL")
        return conn

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
