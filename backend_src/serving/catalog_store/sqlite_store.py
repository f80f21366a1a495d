"""The embedded catalog store: tables ``catalog_*`` in the event log's SQLite file (WAL mode), shared
by several processes through ``BEGIN IMMEDIATE`` transactions. A damaged file raises the event log's
``EventLogDamaged``."""
from __future__ import annotations

import json
import os
import sqlite3
import threading
import time
from pathlib import Path
from typing import Callable, Optional

from backend_src.serving.catalog_store.base import (
    LIVE, RETIRED, CatalogChange, CatalogEntry, CatalogStore, _embedding, _item, _plan,
)
from backend_src.serving.event_log import DURABILITY
from backend_src.serving.event_log.sqlite_log import damaged, is_damage

_SCHEMA = """
CREATE TABLE IF NOT EXISTS catalog_meta (key TEXT PRIMARY KEY, value INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS catalog_changes (
    version INTEGER PRIMARY KEY,  -- 1, 2, 3, ...: the catalog version after the change
    time REAL NOT NULL,
    retires TEXT NOT NULL         -- JSON array of the retired ids, in the order given
);
CREATE TABLE IF NOT EXISTS catalog_adds (
    version INTEGER NOT NULL,
    pos INTEGER NOT NULL,         -- the add's place in its change
    item_id TEXT NOT NULL,
    content TEXT NOT NULL,        -- canonical JSON
    content_hash TEXT NOT NULL,
    embedding BLOB NOT NULL,      -- little-endian float32
    PRIMARY KEY (version, pos)
);
CREATE TABLE IF NOT EXISTS catalog_items (
    item_id TEXT PRIMARY KEY,
    status TEXT NOT NULL,         -- 'live' or 'retired'
    version INTEGER NOT NULL,     -- the version that last changed it
    add_version INTEGER,          -- its last add in catalog_adds (NULL: retired, never added)
    add_pos INTEGER,
    content_hash TEXT
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS catalog_items_order ON catalog_items(version, item_id);
CREATE INDEX IF NOT EXISTS catalog_items_status ON catalog_items(status, version, item_id);
"""
_SCHEMA_VERSION = 1
_MAX_PARAMS = 500  # ids per IN (...) query, well under SQLite's variable limit
_ITEM_SELECT = ("SELECT i.item_id, i.status, i.version, a.content, i.content_hash FROM catalog_items i "
                "LEFT JOIN catalog_adds a ON a.version = i.add_version AND a.pos = i.add_pos")
_EDGE_QUERIES = ("SELECT version FROM catalog_changes ORDER BY version DESC LIMIT 1",
                 "SELECT version, pos FROM catalog_adds ORDER BY version DESC, pos DESC LIMIT 1",
                 "SELECT item_id FROM catalog_items ORDER BY item_id DESC LIMIT 1")


class SQLiteCatalogStore(CatalogStore):
    """Tables ``catalog_*`` in one SQLite file in WAL mode (the event log's file), shareable by
    several processes: each commit is one ``BEGIN IMMEDIATE`` transaction."""

    def __init__(self, path, *, durability: str = "full", busy_timeout_s: float = 10.0,
                 clock: Callable[[], float] = time.time):
        if durability not in DURABILITY:
            raise ValueError(f"durability must be one of {DURABILITY}, got {durability!r}")
        self.path = Path(path)
        self.durability = durability
        self.busy_timeout_s = float(busy_timeout_s)
        self._clock = clock
        self._lock = threading.RLock()
        self._conn = None
        self._pid = None
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._guard(self._open)

    def _guard(self, fn, *args):
        """fn(*args), a damaged file's error as EventLogDamaged (no retry can help)."""
        try:
            return fn(*args)
        except sqlite3.DatabaseError as e:
            if is_damage(e):
                raise damaged(self.path, f"catalog tables: {e}") from e
            raise

    def _open(self):
        conn = sqlite3.connect(str(self.path), timeout=self.busy_timeout_s, isolation_level=None,
                               check_same_thread=False)
        try:
            conn.execute(f"PRAGMA busy_timeout = {int(self.busy_timeout_s * 1000)}")
            deadline = time.monotonic() + self.busy_timeout_s
            while True:  # switching to WAL may answer "locked" at once while others open the file
                try:
                    conn.execute("PRAGMA journal_mode = WAL")
                    break
                except sqlite3.OperationalError as e:
                    if "locked" not in str(e) or time.monotonic() > deadline:
                        raise
                    time.sleep(0.01)
            conn.execute(f"PRAGMA synchronous = {'FULL' if self.durability == 'full' else 'NORMAL'}")
            conn.execute("PRAGMA journal_size_limit = 67108864")
            if not conn.execute("SELECT 1 FROM sqlite_master WHERE name = 'catalog_meta'").fetchone():
                conn.execute("BEGIN IMMEDIATE")
                try:
                    for statement in _SCHEMA.split(";"):
                        if statement.strip():
                            conn.execute(statement)
                    conn.execute("INSERT OR IGNORE INTO catalog_meta VALUES ('schema', ?)", (_SCHEMA_VERSION,))
                    conn.execute("COMMIT")
                except BaseException:
                    conn.execute("ROLLBACK")
                    raise
            schema = conn.execute("SELECT value FROM catalog_meta WHERE key = 'schema'").fetchone()[0]
            if schema > _SCHEMA_VERSION:
                raise RuntimeError(f"catalog store {self.path} has schema version {schema}, newer than "
                                   f"this code's {_SCHEMA_VERSION}")
            for query in _EDGE_QUERIES:  # reaches each b-tree's root and last page
                conn.execute(query).fetchall()
        except BaseException:
            conn.close()
            raise
        self._conn, self._pid = conn, os.getpid()

    def _db(self) -> sqlite3.Connection:
        if self._conn is None:
            raise ValueError(f"catalog store {self.path} is closed")
        if self._pid != os.getpid():  # a SQLite connection must not cross a fork
            self._open()
        return self._conn

    def _transaction(self, fn, begin: Optional[str]):
        with self._lock:
            db = self._db()
            if begin is None:  # one statement reads one snapshot by itself
                return fn(db)
            db.execute(begin)
            try:
                result = fn(db)
                db.execute("COMMIT")
            except BaseException:
                if db.in_transaction:  # also when COMMIT itself failed
                    db.execute("ROLLBACK")
                raise
            return result

    def _read(self, fn, one_statement: bool = False):
        return self._guard(self._transaction, fn, None if one_statement else "BEGIN")

    def _write(self, fn):
        # IMMEDIATE takes the write lock first: what the rules read cannot change before the commit
        return self._guard(self._transaction, fn, "BEGIN IMMEDIATE")

    @staticmethod
    def _chunks(ids):
        for i in range(0, len(ids), _MAX_PARAMS):
            chunk = ids[i:i + _MAX_PARAMS]
            yield chunk, ",".join("?" * len(chunk))

    def version(self) -> int:
        return self._read(lambda db: db.execute("SELECT MAX(version) FROM catalog_changes").fetchone()[0] or 0, True)

    def _commit(self, adds, retires, replace):
        def write(db):
            version = db.execute("SELECT MAX(version) FROM catalog_changes").fetchone()[0] or 0
            current = {}
            for chunk, marks in self._chunks([a.item_id for a in adds] + retires):
                for item_id, status, content_hash in db.execute(
                        f"SELECT item_id, status, content_hash FROM catalog_items WHERE item_id IN ({marks})", chunk):
                    current[item_id] = (status, content_hash)
            changed_adds, changed_retires = _plan(adds, retires, current, replace)
            if not changed_adds and not changed_retires:
                return version
            new = version + 1
            db.execute("INSERT INTO catalog_changes (version, time, retires) VALUES (?, ?, ?)",
                       (new, float(self._clock()), json.dumps(changed_retires, ensure_ascii=False)))
            db.executemany("INSERT INTO catalog_adds VALUES (?, ?, ?, ?, ?, ?)",
                           ((new, pos, a.item_id, a._json, a.content_hash, a.embedding.astype("<f4").tobytes())
                            for pos, a in enumerate(changed_adds)))
            db.executemany(
                "INSERT INTO catalog_items VALUES (?, 'live', ?, ?, ?, ?) ON CONFLICT(item_id) DO UPDATE SET "
                "status = 'live', version = excluded.version, add_version = excluded.add_version, "
                "add_pos = excluded.add_pos, content_hash = excluded.content_hash",
                ((a.item_id, new, new, pos, a.content_hash) for pos, a in enumerate(changed_adds)))
            db.executemany(
                "INSERT INTO catalog_items (item_id, status, version) VALUES (?, 'retired', ?) "
                "ON CONFLICT(item_id) DO UPDATE SET status = 'retired', version = excluded.version",
                ((r, new) for r in changed_retires))
            return new

        return self._write(write)

    def _changes(self, since, limit):
        def read(db):
            heads = db.execute("SELECT version, time, retires FROM catalog_changes WHERE version > ? "
                               "ORDER BY version LIMIT ?", (since, -1 if limit is None else limit)).fetchall()
            if not heads:
                return []
            adds = {v: [] for v, _, _ in heads}
            rows = db.execute("SELECT version, item_id, content, content_hash, embedding FROM catalog_adds "
                              "WHERE version > ? AND version <= ? ORDER BY version, pos", (since, heads[-1][0]))
            for v, item_id, content, content_hash, embedding in rows:
                adds[v].append(CatalogEntry._stored(item_id, content, content_hash, _embedding(embedding), v))
            return [CatalogChange(v, tuple(adds[v]), tuple(json.loads(retires)), t) for v, t, retires in heads]

        return self._read(read)

    def _get(self, ids):
        def read(db):
            found = {}
            for chunk, marks in self._chunks(ids):
                for row in db.execute(f"{_ITEM_SELECT} WHERE i.item_id IN ({marks})", chunk):
                    found[row[0]] = _item(*row)
            return {i: found[i] for i in ids if i in found}

        return self._read(read, one_statement=len(ids) <= _MAX_PARAMS)

    def _list(self, offset, limit, status):
        where, args = ("WHERE i.status = ? ", (status,)) if status else ("", ())
        sql = f"{_ITEM_SELECT} {where}ORDER BY i.version, i.item_id LIMIT ? OFFSET ?"
        return self._read(lambda db: [_item(*row) for row in db.execute(sql, (*args, limit, offset))], True)

    def stats(self) -> dict:
        def read(db):
            counts = dict(db.execute("SELECT status, COUNT(*) FROM catalog_items GROUP BY status").fetchall())
            version = db.execute("SELECT MAX(version) FROM catalog_changes").fetchone()[0] or 0
            return {"backend": "sqlite", "path": str(self.path), "version": version,
                    "live": counts.get(LIVE, 0), "retired": counts.get(RETIRED, 0)}

        return self._read(read)

    def close(self) -> None:
        """Close the connection (the event log's close checkpoints the shared file's WAL)."""
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None
