"""The request store: one SQLite row per routed request (store_schema.py), written by the receiver through
`TelemetryStore`, read by the dashboard and `telemetry dump` through `store_reader.StoreReader`.

Concurrency: SQLite in WAL mode, exactly one writer (`TelemetryStore`, owned by the receiver's writer
thread) and any number of readers in other processes (`StoreReader`, opened read-only). Readers never
block the writer and see committed batches only.

Retention: `TelemetryStore.enforce_retention` deletes rows older than `max_age_s`, the oldest rows
beyond `max_rows`, and the oldest rows while the pages in use (``(page_count - freelist_count) x
page_size``: rows, indexes and attrs JSON together) exceed `max_bytes`; the receiver calls it
periodically (not per insert). Deleted rows' pages go to SQLite's freelist and are reused by later
inserts, so the file stays near max_bytes plus one retention interval of inserts (plus the WAL, whose
size after a checkpoint is capped by ``journal_size_limit``) instead of growing.
"""

from __future__ import annotations

import contextlib
import math
import os
import sqlite3
import time
from collections.abc import Iterable, Mapping
from typing import Any

from prefixroute.telemetry.records import RequestRecord
from prefixroute.telemetry.store_schema import (ADDED_COLUMNS, INSERT_SQL, SCHEMA_SQL, SCHEMA_VERSION,
                                                TIMING_UPDATE_SQL, complete_row, record_to_row)

DEFAULT_MAX_BYTES = 1 << 30
"""Default byte cap of the store (1 GiB): what the default row cap (500,000) really held at the ~2.2 KB a
realistic row takes (measured: 1.1 GB); a store of rows at every attribute's cap (~35 KB each) now stops
at ~30,000 rows instead of growing to 17 GB before the row cap."""
WAL_SIZE_LIMIT_BYTES = 64 << 20


class TelemetryStore:
    """The single writer. Not thread-safe: use from one thread (the receiver's writer thread).

    `max_age_s` / `max_rows` / `max_bytes` bound the store (<= 0 disables that limit); enforced by
    `enforce_retention`. `run_id`: recorded in ``runs`` (started now, unless that run is already there) and
    written into every row inserted that carries none (None: rows keep what they carry).
    """

    def __init__(self, path: str | os.PathLike, *, max_age_s: float = 86400.0, max_rows: int = 500_000,
                 max_bytes: int = DEFAULT_MAX_BYTES, run_id: str | None = None) -> None:
        self.path = os.fspath(path)
        self.run_id = run_id or None
        self.max_age_s = max_age_s
        self.max_rows = max_rows
        self.max_bytes = max_bytes
        parent = os.path.dirname(os.path.abspath(self.path))
        if not os.path.isdir(parent):
            os.makedirs(parent, mode=0o700, exist_ok=True)
        # Private: the records hold what the query API serves only with its token (paths, tenants'
        # hashes, models, timings). The file and its WAL and shared-memory companions are created 0600 (SQLite
        # gives its companions the main file's mode) and an existing file is tightened to 0600.
        if self.path != ":memory:":
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
            with contextlib.suppress(OSError):
                os.fchmod(fd, 0o600)
            os.close(fd)
            for suffix in ("-wal", "-shm"):
                with contextlib.suppress(OSError):
                    os.chmod(self.path + suffix, 0o600)
        # Readers never block a WAL writer; the long busy timeout only rides out another writer (e.g. a backup).
        self._conn = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False, timeout=30.0)
        self._conn.execute("PRAGMA journal_mode=WAL")
        # NORMAL in WAL: a power loss may lose the last commits, never corrupt; telemetry can afford that.
        self._conn.execute("PRAGMA synchronous=NORMAL")
        # After a checkpoint the WAL is truncated to this, so it cannot keep the size of a past burst.
        self._conn.execute(f"PRAGMA journal_size_limit={WAL_SIZE_LIMIT_BYTES}")
        self._conn.executescript(SCHEMA_SQL)
        self._migrate()
        if self.run_id is not None:
            self._conn.execute("INSERT OR IGNORE INTO runs(run_id, started_at) VALUES (?, ?)",
                               (self.run_id, time.time()))

    def _migrate(self) -> None:
        """Bring an older file to SCHEMA_VERSION: add the columns it lacks (one transaction; another
        writer upgrading the same file at once finds them present and adds nothing)."""
        with _transaction(self._conn):
            have = {r[1] for r in self._conn.execute("PRAGMA table_info(requests)")}
            for name, sql_type in ADDED_COLUMNS:
                if name not in have:
                    self._conn.execute(f"ALTER TABLE requests ADD COLUMN {name} {sql_type}")
            # After the column exists (an older file gains it just above).
            self._conn.execute("CREATE INDEX IF NOT EXISTS requests_run_start ON requests(run_id, start_time)")
            self._conn.execute("INSERT OR REPLACE INTO meta(key, value) VALUES ('schema_version', ?)",
                               (str(SCHEMA_VERSION),))

    def insert_rows(self, rows: Iterable[Mapping[str, Any]]) -> int:
        """Insert (or replace, by trace_id+span_id) rows in one transaction; returns how many."""
        rows = [complete_row(r) for r in rows]
        if not rows:
            return 0
        if self.run_id is not None:
            for r in rows:
                r["run_id"] = r["run_id"] or self.run_id
        with _transaction(self._conn):
            self._conn.executemany(INSERT_SQL, rows)
        return len(rows)

    def update_timing(self, updates: Iterable[Mapping[str, Any]]) -> int:
        """Set Envoy's timing (``ttft_ms``, ``latency_ms``, ``end_time``; a None keeps the row's) on stored rows
        (by ``trace_id`` + ``span_id``), in one transaction; returns how many rows changed."""
        updates = list(updates)
        if not updates:
            return 0
        with _transaction(self._conn):
            return self._conn.executemany(TIMING_UPDATE_SQL, updates).rowcount

    def insert_records(self, records: Iterable[RequestRecord]) -> int:
        return self.insert_rows(record_to_row(r) for r in records)

    def used_bytes(self) -> int:
        """Bytes of the database pages in use (tables + indexes; free pages excluded)."""
        page_size = self._conn.execute("PRAGMA page_size").fetchone()[0]
        pages = self._conn.execute("PRAGMA page_count").fetchone()[0]
        free = self._conn.execute("PRAGMA freelist_count").fetchone()[0]
        return (pages - free) * page_size

    def enforce_retention(self, now: float | None = None) -> int:
        """Delete rows older than max_age_s, then the oldest beyond max_rows, then the oldest while the
        pages in use exceed max_bytes; returns rows deleted."""
        now = time.time() if now is None else now
        deleted = 0
        with _transaction(self._conn):
            if self.max_age_s > 0:
                deleted += self._conn.execute("DELETE FROM requests WHERE start_time < ?",
                                              (now - self.max_age_s,)).rowcount
            if self.max_rows > 0:
                # Ordered by the start_time index; ties at the cut are resolved by id (oldest inserted first).
                deleted += self._conn.execute(
                    "DELETE FROM requests WHERE id IN (SELECT id FROM requests ORDER BY start_time DESC, id DESC "
                    "LIMIT -1 OFFSET ?)", (self.max_rows,)).rowcount
        if self.max_bytes > 0:
            deleted += self._enforce_bytes()
        if deleted:
            with _transaction(self._conn):  # runs left without a row, except the one being written
                self._conn.execute("DELETE FROM runs WHERE run_id IS NOT :own AND NOT EXISTS "
                                   "(SELECT 1 FROM requests WHERE requests.run_id = runs.run_id)", {"own": self.run_id})
        return deleted

    def _enforce_bytes(self) -> int:
        # Rows vary in size (attrs JSON), so delete by the mean row size, a few rounds at most: each round
        # aims 5 % under the cap, so a store at its cap is not trimmed again at every retention run.
        deleted = 0
        for _ in range(8):
            used = self.used_bytes()
            if used <= self.max_bytes:
                break
            n = self.num_rows()
            if n == 0:
                break
            per_row = used / n
            excess = min(n, max(1, math.ceil((used - 0.95 * self.max_bytes) / per_row)))
            with _transaction(self._conn):
                deleted += self._conn.execute(
                    "DELETE FROM requests WHERE id IN (SELECT id FROM requests ORDER BY start_time, id LIMIT ?)",
                    (excess,)).rowcount
        return deleted

    def num_rows(self) -> int:
        return self._conn.execute("SELECT COUNT(*) FROM requests").fetchone()[0]

    def close(self) -> None:
        try:
            self._conn.execute("PRAGMA wal_checkpoint(PASSIVE)")
        finally:
            self._conn.close()


class _transaction:
    def __init__(self, conn: sqlite3.Connection) -> None:
        self.conn = conn

    def __enter__(self) -> None:
        self.conn.execute("BEGIN IMMEDIATE")

    def __exit__(self, exc_type, exc, tb) -> None:
        self.conn.execute("COMMIT" if exc_type is None else "ROLLBACK")
