"""The embedded event log: one SQLite file in WAL mode, shared by several processes through
``BEGIN IMMEDIATE`` transactions; ``durability="full"`` (``synchronous=FULL``) survives power loss.

A damaged file (not a database, or pages that do not parse) raises ``EventLogDamaged`` naming the
file and how to recover, at open (``verify``: SQLite's ``quick_check`` up to ``QUICK_CHECK_MAX_BYTES``,
0.14 s on a 1,000,000-event log of 28 MB; beyond that the first and last entries of every table and
index) and on any later read or write. ``close`` checkpoints the WAL into the main file."""
from __future__ import annotations

import functools
import os
import sqlite3
import threading
import time
from itertools import chain, repeat
from pathlib import Path
from typing import Callable, Optional

from backend_src.serving.event_log.base import (
    DEFAULT_RETAIN_EVENTS, PROBE_KEY, EventLog, EventLogDamaged, EventRange, LogConflict, UserLog,
)

_SCHEMA = """
CREATE TABLE IF NOT EXISTS users (
    user TEXT PRIMARY KEY,
    count INTEGER NOT NULL,
    updated REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS users_updated ON users(updated);
CREATE TABLE IF NOT EXISTS events (
    user TEXT NOT NULL,
    seq INTEGER NOT NULL,
    item TEXT NOT NULL,
    action INTEGER NOT NULL,
    ts INTEGER NOT NULL,
    PRIMARY KEY (user, seq)
) WITHOUT ROWID;
"""
_SCHEMA_VERSION = 1
_MAX_PARAMS = 500  # users per IN (...) query, well under SQLite's variable limit
_SWEEP_BATCH = 1000  # users per sweep transaction, so other writers are not held up long
_MAX_ROWS_PER_INSERT = 1024  # event rows per INSERT statement (5 parameters each), where the build allows
QUICK_CHECK_MAX_BYTES = 256 << 20  # files up to this size are checked whole at open (quick_check reads every page)
# the first and last entry of each b-tree: a bounded check for larger files (reaches the root and edge pages)
_EDGE_QUERIES = tuple(
    f"SELECT {cols} FROM {table} ORDER BY {order} LIMIT 1"
    for table, cols, key in (("users", "user, count", "user"), ("users INDEXED BY users_updated", "updated", "updated"),
                             ("events", "user, seq, item", "user, seq"))
    for order in (key, ", ".join(f"{k.strip()} DESC" for k in key.split(",")))
)


def is_damage(exc: BaseException) -> bool:
    """Whether a SQLite error says the file is damaged (SQLITE_CORRUPT, SQLITE_NOTADB): retrying cannot help."""
    code = getattr(exc, "sqlite_errorcode", None)
    return isinstance(exc, sqlite3.DatabaseError) and code is not None and code & 0xFF in (
        sqlite3.SQLITE_CORRUPT, sqlite3.SQLITE_NOTADB)


def damaged(path, detail) -> EventLogDamaged:
    return EventLogDamaged(
        f"event log {path} is damaged ({detail}); nothing can be read or written until it is repaired. Stop the "
        f"server, move the file and its -wal and -shm files aside (mv {path} {path}.damaged; likewise -wal, -shm), "
        f"then restore a backup in its place, or salvage what is readable with "
        f"`sqlite3 {path}.damaged .recover | sqlite3 {path}`, or start without it (every session's events are lost)")


@functools.lru_cache(maxsize=None)
def _insert_events_sql(rows: int) -> str:
    return "INSERT INTO events (user, seq, item, action, ts) VALUES " + ",".join(["(?, ?, ?, ?, ?)"] * rows)


def _rows_per_insert(db: sqlite3.Connection) -> int:
    """The most event rows one INSERT may bind: a power of two, at most _MAX_ROWS_PER_INSERT, within this
    SQLite's limit on parameters per statement (32766 by default since 3.32, 999 before; Python < 3.11
    cannot ask, and gets the older limit's)."""
    limit = db.getlimit(sqlite3.SQLITE_LIMIT_VARIABLE_NUMBER) if hasattr(db, "getlimit") else 999
    return min(_MAX_ROWS_PER_INSERT, 1 << ((limit // 5).bit_length() - 1))


class SQLiteEventLog(EventLog):
    """The embedded log: one SQLite file in WAL mode, shareable by several processes."""

    def __init__(self, path, *, retain_events: int = DEFAULT_RETAIN_EVENTS, ttl_s: Optional[float] = None,
                 durability: str = "full", busy_timeout_s: float = 10.0,
                 clock: Callable[[], float] = time.time, verify: bool = True):
        super().__init__(retain_events=retain_events, ttl_s=ttl_s, durability=durability)
        self.path = Path(path)
        self.busy_timeout_s = float(busy_timeout_s)
        self._clock = clock  # injectable so retention can be tested without sleeping
        self._lock = threading.RLock()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._conn = None
        self._pid = None
        self._connect(verify)

    def _connect(self, verify: bool = False):
        try:
            self._open(verify)
        except sqlite3.DatabaseError as e:
            if is_damage(e):
                raise damaged(self.path, e) from e
            raise

    def verify(self) -> None:
        """Raise EventLogDamaged unless the file reads as a whole (up to QUICK_CHECK_MAX_BYTES) or, beyond
        that size, the first and last entries of each table and index read."""
        def check(db):
            for query in _EDGE_QUERIES:
                db.execute(query).fetchall()
            if self.path.stat().st_size <= QUICK_CHECK_MAX_BYTES:
                problems = [r[0] for r in db.execute("PRAGMA quick_check(5)").fetchall()]
                if problems != ["ok"]:
                    raise damaged(self.path, "; ".join(problems))

        self._read(check)

    def _open(self, verify: bool):
        # isolation_level=None: transactions are begun and ended explicitly below
        conn = sqlite3.connect(str(self.path), timeout=self.busy_timeout_s, isolation_level=None,
                               check_same_thread=False)
        try:
            conn.execute(f"PRAGMA busy_timeout = {int(self.busy_timeout_s * 1000)}")
            self._retry_locked(lambda: conn.execute("PRAGMA journal_mode = WAL"))
            conn.execute(f"PRAGMA synchronous = {'FULL' if self.durability == 'full' else 'NORMAL'}")
            conn.execute("PRAGMA journal_size_limit = 67108864")  # WAL shrinks back after checkpoints
            version = conn.execute("PRAGMA user_version").fetchone()[0]
            if version > _SCHEMA_VERSION:
                raise RuntimeError(f"event log {self.path} has schema version {version}, newer than "
                                   f"this code's {_SCHEMA_VERSION}")
            if version < _SCHEMA_VERSION:
                conn.execute("BEGIN IMMEDIATE")
                try:
                    for statement in _SCHEMA.split(";"):
                        if statement.strip():
                            conn.execute(statement)
                    conn.execute(f"PRAGMA user_version = {_SCHEMA_VERSION}")
                    conn.execute("COMMIT")
                except BaseException:
                    conn.execute("ROLLBACK")
                    raise
        except BaseException:
            conn.close()
            raise
        self._conn = conn
        self._pid = os.getpid()
        if verify:
            try:
                self.verify()
            except BaseException:
                self.close(checkpoint=False)
                raise

    def _retry_locked(self, fn):
        # switching to WAL needs a moment of exclusive access, and SQLite may answer "locked"
        # at once instead of waiting when several processes open a new file together
        deadline = time.monotonic() + self.busy_timeout_s
        while True:
            try:
                return fn()
            except sqlite3.OperationalError as e:
                if "locked" not in str(e) or time.monotonic() > deadline:
                    raise
                time.sleep(0.01)

    def _db(self) -> sqlite3.Connection:
        if self._conn is None:
            raise ValueError(f"event log {self.path} is closed")
        if self._pid != os.getpid():  # a SQLite connection must not cross a fork
            self._connect()
        return self._conn

    def _read(self, fn, one_statement: bool = False):
        try:
            return self._read_locked(fn, one_statement)
        except sqlite3.DatabaseError as e:
            if is_damage(e):
                raise damaged(self.path, e) from e
            raise

    def _read_locked(self, fn, one_statement: bool):
        with self._lock:
            db = self._db()
            if one_statement:  # a single statement reads one snapshot by itself
                return fn(db)
            db.execute("BEGIN")  # one snapshot for the whole read
            try:
                return fn(db)
            finally:
                if db.in_transaction:
                    db.execute("COMMIT")

    def _write(self, fn):
        try:
            return self._write_locked(fn)
        except sqlite3.DatabaseError as e:
            if is_damage(e):
                raise damaged(self.path, e) from e
            raise

    def _write_locked(self, fn):
        with self._lock:
            db = self._db()
            # IMMEDIATE takes the write lock first, so the count checked below cannot change
            # under us (another process's append waits on busy_timeout instead)
            db.execute("BEGIN IMMEDIATE")
            try:
                result = fn(db)
                db.execute("COMMIT")
            except BaseException:
                if db.in_transaction:  # also when COMMIT itself failed (e.g. a disk error)
                    db.execute("ROLLBACK")
                raise
            return result

    @staticmethod
    def _count_map(db, users) -> dict:
        unique = list(dict.fromkeys(users))
        found = {}
        for i in range(0, len(unique), _MAX_PARAMS):
            chunk = unique[i:i + _MAX_PARAMS]
            marks = ",".join("?" * len(chunk))
            found.update(db.execute(f"SELECT user, count FROM users WHERE user IN ({marks})", chunk).fetchall())
        return found

    def _counts(self, users):
        return self._read(lambda db: [self._count_map(db, users).get(u, 0) for u in users],
                          one_statement=len(set(users)) <= _MAX_PARAMS)  # _count_map's one query

    def _tails(self, users, n):
        def read(db):
            counts = self._count_map(db, users)
            out = []
            for user in users:
                count = counts.get(user, 0)
                rows = []
                if count and n:
                    rows = db.execute(
                        "SELECT item, action, ts FROM events WHERE user = ? AND seq >= ? ORDER BY seq",
                        (user, count - n),
                    ).fetchall()
                out.append(UserLog(count, [r[0] for r in rows], [r[1] for r in rows], [r[2] for r in rows]))
            return out

        return self._read(read)

    def _event_ranges(self, reads):
        def read(db):
            counts = self._count_map(db, [user for user, _, _ in reads])
            out = []
            for user, start, stop in reads:
                count = counts.get(user, 0)
                rows = []
                if count and start < stop:
                    rows = db.execute(
                        "SELECT seq, item, action, ts FROM events WHERE user = ? AND seq >= ? AND seq < ? ORDER BY seq",
                        (user, start, stop),
                    ).fetchall()
                first = rows[0][0] if rows else stop
                out.append(EventRange(count, first, [r[1] for r in rows], [r[2] for r in rows], [r[3] for r in rows]))
            return out

        return self._read(read)

    def _put_events(self, db, user, first_seq, items, actions, timestamps):
        # Rows go in as few multi-row INSERTs as possible (a power of two rows each, so their few
        # statement texts stay in the connection's statement cache), not one statement per row:
        # an open's 512 events are one step of SQLite instead of 512, and the GIL is let go and
        # taken back once instead of 512 times, while the encoder's thread wants it too.
        done, n, most = 0, len(items), _rows_per_insert(db)
        while done < n:
            rows = min(1 << ((n - done).bit_length() - 1), most)
            part = slice(done, done + rows)
            params = chain.from_iterable(zip(repeat(user), range(first_seq + done, first_seq + done + rows),
                                             items[part], actions[part], timestamps[part]))
            db.execute(_insert_events_sql(rows), tuple(params))
            done += rows

    def _append_many(self, writes):
        def write(db):
            now = self._clock()
            results = []
            for user, expected, total, items, actions, timestamps in writes:
                row = db.execute("SELECT count FROM users WHERE user = ?", (user,)).fetchone()
                count = row[0] if row else 0
                if count != expected:
                    results.append(LogConflict(count, user, expected))
                    continue
                if total == 0:  # nothing to add; still counts as a write for retention
                    if row:
                        db.execute("UPDATE users SET updated = ? WHERE user = ?", (now, user))
                    results.append(count)
                    continue
                new_count = count + total
                self._put_events(db, user, new_count - len(items), items, actions, timestamps)
                db.execute(
                    "INSERT INTO users (user, count, updated) VALUES (?, ?, ?) "
                    "ON CONFLICT(user) DO UPDATE SET count = excluded.count, updated = excluded.updated",
                    (user, new_count, now),
                )
                if new_count > self.retain_events:
                    db.execute("DELETE FROM events WHERE user = ? AND seq < ?",
                               (user, new_count - self.retain_events))
                results.append(new_count)
            return results

        return self._write(write)

    def _replace(self, user, total, items, actions, timestamps):
        def write(db):
            db.execute("DELETE FROM events WHERE user = ?", (user,))
            if total == 0:
                db.execute("DELETE FROM users WHERE user = ?", (user,))
                return 0
            self._put_events(db, user, total - len(items), items, actions, timestamps)
            db.execute("INSERT OR REPLACE INTO users (user, count, updated) VALUES (?, ?, ?)",
                       (user, total, self._clock()))
            return total

        return self._write(write)

    def _delete(self, user):
        def write(db):
            found = db.execute("DELETE FROM users WHERE user = ?", (user,)).rowcount > 0
            db.execute("DELETE FROM events WHERE user = ?", (user,))
            return found

        return self._write(write)

    def sweep(self) -> int:
        """Delete the users with no write for ttl_s, a batch per transaction."""
        if self.ttl_s is None:
            return 0
        cutoff = self._clock() - self.ttl_s
        dropped = 0
        while True:
            def write(db):
                users = [r[0] for r in db.execute("SELECT user FROM users WHERE updated < ? LIMIT ?",
                                                  (cutoff, _SWEEP_BATCH)).fetchall()]
                for i in range(0, len(users), _MAX_PARAMS):
                    chunk = users[i:i + _MAX_PARAMS]
                    marks = ",".join("?" * len(chunk))
                    db.execute(f"DELETE FROM events WHERE user IN ({marks})", chunk)
                    db.execute(f"DELETE FROM users WHERE user IN ({marks})", chunk)
                return len(users)

            n = self._write(write)
            dropped += n
            if n < _SWEEP_BATCH:
                return dropped

    def stats(self) -> dict:
        users = self._read(lambda db: db.execute("SELECT COUNT(*) FROM users WHERE user != ?", (PROBE_KEY,)).fetchone()[0])
        return {"backend": "sqlite", "path": str(self.path), "users": users, "retain_events": self.retain_events,
                "ttl_s": self.ttl_s, "durability": self.durability}

    def close(self, checkpoint: bool = True) -> None:
        """Close the connection; first (``checkpoint``) move the WAL's pages into the main file and
        truncate the WAL, so the file alone holds every event (the last connection to close also
        removes the WAL; one still open elsewhere keeps it, and the checkpoint does what it can)."""
        with self._lock:
            if self._conn is not None:
                try:
                    if checkpoint and self._pid == os.getpid():
                        self._conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchall()
                except sqlite3.Error:
                    pass  # busy, read-only, damaged: closing is all that is left to do
                finally:
                    self._conn.close()
                    self._conn = None
