"""The durable per-user event log behind the history encoder's session cache.

What it stores
    For every user key (an opaque, non-empty ``str`` such as ``"i:123"`` or ``"s:user-abc"``):
    ``count``, the number of events ever accepted for the user, and the most recent events,
    each ``(item_id: str, action: int, timestamp: int seconds)``, in the order they were
    accepted. Event ``seq`` (0-based) is its index in the user's whole log, so the retained
    events are always ``seq in [count - len(retained), count)``.

Guarantees
    * Compare-and-append: a write names the count it expects the log to have (the client's
      offset). A write whose expected count differs is not applied and reports the real count
      (``LogConflict``). This makes retries safe: a write whose reply was lost and is sent
      again conflicts instead of duplicating events.
    * Each write is atomic on its own: all its events or none.
    * Durable when the call returns. SQLite: ``durability="full"`` (``synchronous=FULL``)
      survives power loss, ``"normal"`` survives a crash of the process. Redis: as durable as
      the server is configured (``appendonly yes`` + ``appendfsync always`` for the same
      guarantee as "full"; ``RedisServer`` starts it that way); ``durability`` is not used.
    * Safe for several threads and several processes (SQLite: one file shared through WAL
      and ``BEGIN IMMEDIATE`` transactions; Redis: each write is one Lua script, atomic on
      the server). Open one ``EventLog`` per process.

Retention
    * ``retain_events``: at most this many most recent events are kept per user; older ones
      are deleted on append. ``count`` keeps counting every event ever accepted.
    * ``ttl_s``: a user with no write for ``ttl_s`` seconds is dropped (count back to 0).
      Redis: both keys carry an EXPIRE renewed by each write, the server drops them itself.
      SQLite: ``sweep()`` deletes them; the owner of the log calls it periodically (until
      then, expired users are still readable). ``ttl_s=None`` keeps logs forever.

Deleting a user's log (data deletion requests)
    ``delete(user)`` erases the user's count and every retained event at once; afterwards the
    user reads as unknown (count 0). SQLite: the user's row and event rows are deleted in one
    transaction; the freed pages keep the old bytes until reused, so run ``VACUUM`` (after a
    WAL checkpoint) where they must be gone from disk at once. Redis: both keys are deleted;
    the old writes stay in the append-only file until the server rewrites it
    (``BGREWRITEAOF``). ``replace(user, ...)`` starts the user's log afresh instead.

Errors
    ``LogConflict`` for a stale expected count; ``ValueError`` for bad input or URLs;
    ``EventLogUnavailable`` (a ``ConnectionError`` naming the Redis URL, password hidden)
    when Redis cannot be reached, which the caller answers as UNAVAILABLE.

Backends, chosen by URL in ``open_event_log`` (``memory:`` keeps the log in the process, NOT
durable: only to measure what the others cost):
    ``sqlite:///abs/path.db``, ``sqlite:relative/path.db`` or a bare path -> SQLiteEventLog
    ``redis://[user:password@]host:port/db[?prefix=...]``            -> RedisEventLog
"""
from __future__ import annotations

import abc
import functools
import hashlib
import json
import numbers
import os
import sqlite3
import threading
import time
from dataclasses import dataclass
from itertools import chain, repeat
from pathlib import Path
from typing import Callable, Optional
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import numpy as np

DURABILITY = ("full", "normal")
DEFAULT_RETAIN_EVENTS = 4096
DEFAULT_REDIS_PREFIX = "eventlog:"
_INT64 = (-(2**63), 2**63 - 1)


# A write of this many events or more is worth a thread of its own beside the model's work (an open's
# history: mostly SQLite and fsync with the GIL let go); a few events' write costs less than the hand-off.
WRITE_ASIDE_EVENTS = 16


class LogConflict(Exception):
    """A write's expected count differed from the log's; nothing was applied.

    ``count`` is the log's count for the user at the time of the write."""

    def __init__(self, count: int, user: Optional[str] = None, expected: Optional[int] = None):
        self.count = int(count)
        self.user = user
        self.expected = expected
        super().__init__(f"event log of {user!r} has {count} events, the write expected {expected}")

    def __reduce__(self):  # keep .count etc. when pickled across processes
        return (type(self), (self.count, self.user, self.expected))


class EventLogUnavailable(ConnectionError):
    """The log's store cannot be reached (the message names where it was looked for)."""


@dataclass(frozen=True)
class UserLog:
    """``count``: events ever accepted for the user; the lists: the most recent retained events
    (at most the number asked for), oldest first."""

    count: int
    items: list
    actions: list
    timestamps: list


# ------------------------------------------------------------------------------------------
# Input checks shared by the backends
# ------------------------------------------------------------------------------------------
def _check_user(user) -> str:
    if not isinstance(user, str) or not user:
        raise ValueError(f"a user key must be a non-empty str, got {user!r}")
    return user


def _as_item(item) -> str:
    if isinstance(item, str):
        return str(item)  # numpy.str_ -> str
    if isinstance(item, bytes):  # Triton BYTES tensors hand over bytes
        return item.decode("utf-8")
    if isinstance(item, numbers.Integral):
        return str(int(item))
    raise ValueError(f"an item id must be a str, got {type(item).__name__}")


def _as_int64(value, what: str) -> int:
    if not isinstance(value, numbers.Integral):
        raise ValueError(f"{what} must be an integer, got {value!r}")
    value = int(value)
    if not _INT64[0] <= value <= _INT64[1]:
        raise ValueError(f"{what} {value} does not fit in 64 bits")
    return value


def _check_events(items, actions, timestamps, retain: int):
    """(total, items, actions, timestamps) with only the last ``retain`` events kept: events that
    retention would delete at once are never written."""
    if not len(items) == len(actions) == len(timestamps):
        raise ValueError(
            f"items, actions and timestamps must have the same length, "
            f"got {len(items)}, {len(actions)}, {len(timestamps)}"
        )
    total = len(items)
    start = max(0, total - retain)
    items = items[start:]
    return (
        total,
        list(items) if all(type(x) is str for x in items) else [_as_item(x) for x in items],
        _as_int64_list(actions[start:], "an action"),
        _as_int64_list(timestamps[start:], "a timestamp"),
    )


def _as_int64_list(values, what: str) -> list:
    """Integers as a list of Python ints; a numpy integer array (what the server hands over) is
    converted at once, anything else is checked value by value."""
    arr = values if isinstance(values, np.ndarray) else None
    if arr is not None and arr.ndim == 1 and arr.dtype.kind == "i":  # signed, at most 64 bits: fits
        return arr.astype(np.int64, copy=False).tolist()
    return [_as_int64(x, what) for x in values]


class EventLog(abc.ABC):
    """Compare-and-append store of per-user event logs (see the module docstring)."""

    def __init__(self, *, retain_events: int = DEFAULT_RETAIN_EVENTS, ttl_s: Optional[float] = None,
                 durability: str = "full"):
        if not isinstance(retain_events, numbers.Integral) or retain_events < 1:
            raise ValueError(f"retain_events must be an integer >= 1, got {retain_events!r}")
        if ttl_s is not None and not ttl_s > 0:
            raise ValueError(f"ttl_s must be > 0 seconds or None, got {ttl_s!r}")
        if durability not in DURABILITY:
            raise ValueError(f"durability must be one of {DURABILITY}, got {durability!r}")
        self.retain_events = int(retain_events)
        self.ttl_s = None if ttl_s is None else float(ttl_s)
        self.durability = durability

    # -- reads
    def counts(self, users: list) -> list:
        """Each user's count (0 for unknown users), read in one round trip / read transaction."""
        users = [_check_user(u) for u in users]
        return self._counts(users) if users else []

    def count(self, user: str) -> int:
        return self.counts([user])[0]

    def tails(self, users: list, n: int) -> list:
        """Each user's count and last ``n`` retained events, read in one round trip."""
        users = [_check_user(u) for u in users]
        if not isinstance(n, numbers.Integral) or n < 0:
            raise ValueError(f"n must be an integer >= 0, got {n!r}")
        return self._tails(users, int(n)) if users else []

    def tail(self, user: str, n: int) -> UserLog:
        return self.tails([user], n)[0]

    # -- writes
    def append_many(self, writes: list) -> list:
        """Apply ``(user, expected_count, items, actions, timestamps)`` writes in order, in one
        transaction / pipeline. Per write: the new count, or a ``LogConflict`` (returned, not
        raised) when ``expected_count`` was not the log's count; that write is not applied and
        the others still are. Several writes for one user chain (the second sees the first)."""
        checked = []
        for user, expected, items, actions, timestamps in writes:  # check all before applying any
            checked.append((_check_user(user), _as_int64(expected, "an expected count"),
                            *_check_events(items, actions, timestamps, self.retain_events)))
        return self._append_many(checked) if checked else []

    def append(self, user: str, expected: int, items, actions, timestamps) -> int:
        """One compare-and-append; returns the new count or raises ``LogConflict``."""
        result = self.append_many([(user, expected, items, actions, timestamps)])[0]
        if isinstance(result, LogConflict):
            raise result
        return result

    def replace(self, user: str, items, actions, timestamps) -> int:
        """The user's log starts afresh with these events; returns the count, ``len(items)``."""
        return self._replace(_check_user(user), *_check_events(items, actions, timestamps, self.retain_events))

    def delete(self, user: str) -> bool:
        """Erase the user's log entirely; True if there was one."""
        return self._delete(_check_user(user))

    @abc.abstractmethod
    def sweep(self) -> int:
        """Retention: drop users with no write for ``ttl_s``; returns how many were dropped."""

    @abc.abstractmethod
    def stats(self) -> dict:
        """At least ``backend`` and ``users`` (None where counting them is not cheap)."""

    @abc.abstractmethod
    def close(self) -> None: ...

    # -- backend parts; inputs already checked, event lists already cut to retain_events
    @abc.abstractmethod
    def _counts(self, users: list) -> list: ...

    @abc.abstractmethod
    def _tails(self, users: list, n: int) -> list: ...

    @abc.abstractmethod
    def _append_many(self, writes: list) -> list:
        """writes: (user, expected, total, items, actions, timestamps); ``total`` counts every
        event of the write, the lists hold only its last ``retain_events``."""

    @abc.abstractmethod
    def _replace(self, user: str, total: int, items: list, actions: list, timestamps: list) -> int: ...

    @abc.abstractmethod
    def _delete(self, user: str) -> bool: ...

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


# ------------------------------------------------------------------------------------------
# SQLite
# ------------------------------------------------------------------------------------------
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
                 clock: Callable[[], float] = time.time):
        super().__init__(retain_events=retain_events, ttl_s=ttl_s, durability=durability)
        self.path = Path(path)
        self.busy_timeout_s = float(busy_timeout_s)
        self._clock = clock  # injectable so retention can be tested without sleeping
        self._lock = threading.RLock()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._conn = None
        self._pid = None
        self._connect()

    def _connect(self):
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
        users = self._read(lambda db: db.execute("SELECT COUNT(*) FROM users").fetchone()[0])
        return {"backend": "sqlite", "path": str(self.path), "users": users, "retain_events": self.retain_events,
                "ttl_s": self.ttl_s, "durability": self.durability}

    def close(self) -> None:
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None


# ------------------------------------------------------------------------------------------
# Redis
# ------------------------------------------------------------------------------------------
# KEYS: count key, events key. ARGV: expected count, events in the write (may be more than are
# stored: only the last retain_events are sent), retain_events, ttl in ms (0: none), events...
# Returns {1, new count} or {0, the count} when the expected count is not the log's.
_APPEND_LUA = """
local n = tonumber(redis.call('GET', KEYS[1]) or '0')
if n ~= tonumber(ARGV[1]) then return {0, n} end
local total = tonumber(ARGV[2])
for i = 5, #ARGV, 1000 do
  redis.call('RPUSH', KEYS[2], unpack(ARGV, i, math.min(i + 999, #ARGV)))
end
if total > 0 then
  n = redis.call('INCRBY', KEYS[1], total)
  redis.call('LTRIM', KEYS[2], -tonumber(ARGV[3]), -1)
end
local ttl = tonumber(ARGV[4])
if ttl > 0 and n > 0 then
  redis.call('PEXPIRE', KEYS[1], ttl)
  redis.call('PEXPIRE', KEYS[2], ttl)
end
return {1, n}
"""
# ARGV: count, ttl in ms, events... Returns the count.
_REPLACE_LUA = """
redis.call('DEL', KEYS[1], KEYS[2])
if tonumber(ARGV[1]) == 0 then return 0 end
for i = 3, #ARGV, 1000 do
  redis.call('RPUSH', KEYS[2], unpack(ARGV, i, math.min(i + 999, #ARGV)))
end
redis.call('SET', KEYS[1], ARGV[1])
local ttl = tonumber(ARGV[2])
if ttl > 0 then
  redis.call('PEXPIRE', KEYS[1], ttl)
  redis.call('PEXPIRE', KEYS[2], ttl)
end
return tonumber(ARGV[1])
"""
# ARGV: n. Returns {count, the last n events joined by ','} (each event is a JSON array).
_TAIL_LUA = """
local n = tonumber(redis.call('GET', KEYS[1]) or '0')
local want = tonumber(ARGV[1])
if n == 0 or want <= 0 then return {n, ''} end
return {n, table.concat(redis.call('LRANGE', KEYS[2], -want, -1), ',')}
"""


def _redact(url: str) -> str:
    """The URL without its password, for messages."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.rsplit("@", 1)[1]
    user = parts.username or ""
    return urlunsplit(parts._replace(netloc=f"{user}:***@{netloc}"))


class RedisEventLog(EventLog):
    """The shared log: per-user keys in Redis (or Redis Cluster: a user's keys share a hash tag)."""

    def __init__(self, url: str, *, prefix: str = DEFAULT_REDIS_PREFIX,
                 retain_events: int = DEFAULT_RETAIN_EVENTS, ttl_s: Optional[float] = None,
                 durability: str = "full", socket_timeout_s: float = 5.0):
        super().__init__(retain_events=retain_events, ttl_s=ttl_s, durability=durability)
        if "{" in prefix or "}" in prefix:
            raise ValueError(f"the Redis key prefix must not contain '{{' or '}}', got {prefix!r}")
        from backend_src.serving.resp import RespConnection

        self.url = url
        self.prefix = prefix
        self._where = _redact(url)
        self._ttl_ms = 0 if self.ttl_s is None else max(1, int(round(self.ttl_s * 1000)))
        parts = urlsplit(url)
        self._client = RespConnection(parts.hostname, parts.port or 6379, int(parts.path.strip("/") or 0),
                                      password=parts.password, username=parts.username or None, timeout_s=socket_timeout_s)
        self._scripts = {name: (src, hashlib.sha1(src.encode()).hexdigest())
                         for name, src in (("append", _APPEND_LUA), ("replace", _REPLACE_LUA),
                                           ("tail", _TAIL_LUA))}
        self._loaded = False

    def _keys(self, user: str):
        # the user is the hash tag, so a user's two keys live in one cluster slot; braces are
        # escaped so the tag always ends where the user does
        tag = user.replace("%", "%25").replace("{", "%7B").replace("}", "%7D")
        base = f"{self.prefix}{{{tag}}}"
        return base + ":n", base + ":ev"

    def _unavailable(self, e) -> EventLogUnavailable:
        return EventLogUnavailable(f"event log Redis at {self._where} is unavailable: {e}")

    def _call(self, commands) -> list:
        """One pipeline; a lost or refused connection becomes EventLogUnavailable."""
        from backend_src.serving.resp import RespError

        try:
            return self._client.pipeline(commands)
        except (OSError, RespError) as e:  # ConnectionError and socket timeouts are OSErrors
            raise self._unavailable(e) from e

    def _load_scripts(self):
        from backend_src.serving.resp import RespError

        for reply in self._call([("SCRIPT", "LOAD", src) for src, _ in self._scripts.values()]):
            if isinstance(reply, RespError):
                raise self._unavailable(reply)
        self._loaded = True  # registered once; later calls send only the sha

    def _run(self, calls):
        """Send ``calls`` (name, keys, args) as one non-transactional pipeline of EVALSHAs.

        Each script is atomic on the server. If the server lost its scripts (restart), only the
        calls answered NOSCRIPT (which therefore did nothing) are sent again."""
        from backend_src.serving.resp import RespError

        if not self._loaded:
            self._load_scripts()
        results = [None] * len(calls)
        todo = list(range(len(calls)))
        for attempt in range(2):
            answers = self._call([("EVALSHA", self._scripts[calls[i][0]][1], len(calls[i][1]), *calls[i][1], *calls[i][2])
                                  for i in todo])
            retry = []
            for i, answer in zip(todo, answers):
                if isinstance(answer, RespError) and str(answer).startswith("NOSCRIPT") and attempt == 0:
                    retry.append(i)
                elif isinstance(answer, RespError):
                    raise RuntimeError(f"event log Redis at {self._where}: {answer}")
                else:
                    results[i] = answer
            if not retry:
                return results
            self._load_scripts()
            todo = retry
        return results

    @staticmethod
    def _encode(items, actions, timestamps):
        return [json.dumps([i, a, t], ensure_ascii=False, separators=(",", ":"))
                for i, a, t in zip(items, actions, timestamps)]

    def _counts(self, users):
        return [int(v) if v is not None else 0 for v in self._call([("GET", self._keys(u)[0]) for u in users])]

    def _tails(self, users, n):
        answers = self._run([("tail", self._keys(u), (n,)) for u in users])
        out = []
        for count, joined in answers:
            events = json.loads(b"[" + joined + b"]") if joined else []
            out.append(UserLog(int(count), [e[0] for e in events], [e[1] for e in events],
                               [e[2] for e in events]))
        return out

    def _append_many(self, writes):
        calls = [("append", self._keys(user),
                  (expected, total, self.retain_events, self._ttl_ms, *self._encode(items, actions, ts)))
                 for user, expected, total, items, actions, ts in writes]
        results = []
        for (user, expected, *_), (applied, count) in zip(writes, self._run(calls)):
            results.append(int(count) if applied else LogConflict(int(count), user, expected))
        return results

    def _replace(self, user, total, items, actions, timestamps):
        args = (total, self._ttl_ms, *self._encode(items, actions, timestamps))
        return int(self._run([("replace", self._keys(user), args)])[0])

    def _delete(self, user):
        return self._call([("DEL", *self._keys(user))])[0] > 0

    def sweep(self) -> int:
        return 0  # keys carry EXPIRE; the server drops them itself

    def stats(self) -> dict:
        keys = self._call([("DBSIZE",)])[0]
        # counting users would need a SCAN of the keyspace: not cheap, so not done
        return {"backend": "redis", "url": self._where, "prefix": self.prefix, "users": None,
                "db_keys": keys, "retain_events": self.retain_events, "ttl_s": self.ttl_s}

    def close(self) -> None:
        self._client.close()


# ------------------------------------------------------------------------------------------
# In memory (not durable)
# ------------------------------------------------------------------------------------------
class MemoryEventLog(EventLog):
    """The same semantics in this process's memory, lost with it: NOT durable. It exists to
    measure what a durable log costs (benchmarks run it beside SQLite and Redis)."""

    def __init__(self, **options):
        super().__init__(**options)
        self._lock = threading.Lock()
        self._logs: dict = {}  # user -> [count, items, actions, timestamps]

    def _counts(self, users):
        with self._lock:
            return [self._logs[u][0] if u in self._logs else 0 for u in users]

    def _tails(self, users, n):
        with self._lock:
            out = []
            for u in users:
                count, items, actions, ts = self._logs.get(u, (0, [], [], []))
                cut = slice(len(items) - min(n, len(items)), None)
                out.append(UserLog(count, items[cut], actions[cut], ts[cut]))
            return out

    def _append_many(self, writes):
        with self._lock:
            results = []
            for user, expected, total, items, actions, ts in writes:
                log = self._logs.setdefault(user, [0, [], [], []])
                if log[0] != expected:
                    results.append(LogConflict(log[0], user, expected))
                    continue
                log[0] += total
                for i, new in enumerate((items, actions, ts), start=1):
                    log[i] = (log[i] + list(new))[-self.retain_events:]
                results.append(log[0])
            return results

    def _replace(self, user, total, items, actions, timestamps):
        with self._lock:
            self._logs[user] = [total, list(items), list(actions), list(timestamps)]
            return total

    def _delete(self, user):
        with self._lock:
            return self._logs.pop(user, None) is not None

    def sweep(self) -> int:
        return 0

    def stats(self) -> dict:
        return {"backend": "memory", "users": len(self._logs), "retain_events": self.retain_events}

    def close(self) -> None:
        pass


# ------------------------------------------------------------------------------------------
# Opening by URL
# ------------------------------------------------------------------------------------------
def _sqlite_path(url: str) -> str:
    rest = url[len("sqlite:"):]
    if rest.startswith("//"):
        rest = rest[2:]
        if not rest.startswith("/"):
            raise ValueError(f"bad SQLite URL {url!r}: use sqlite:///absolute/path.db or sqlite:relative/path.db")
    if not rest:
        raise ValueError(f"bad SQLite URL {url!r}: no file path")
    return rest


def _split_redis_url(url: str):
    """(url for the client, key prefix); checks the parts the client would misread quietly."""
    parts = urlsplit(url)
    try:
        parts.port  # raises on a port that is not a number
    except ValueError:
        raise ValueError(f"bad Redis URL {_redact(url)!r}: the port is not a number") from None
    if not parts.hostname:
        raise ValueError(f"bad Redis URL {_redact(url)!r}: no host (expected redis://host:port/db)")
    db = parts.path.strip("/")
    if db and not db.isdigit():
        raise ValueError(f"bad Redis URL {_redact(url)!r}: the database {db!r} is not a number")
    query = parse_qsl(parts.query, keep_blank_values=True)
    prefix = DEFAULT_REDIS_PREFIX
    rest = []
    for key, value in query:
        if key == "prefix":
            prefix = value
        else:
            rest.append((key, value))
    return urlunsplit(parts._replace(query=urlencode(rest))), prefix


def open_event_log(url: str, *, retain_events: int = DEFAULT_RETAIN_EVENTS, ttl_s: Optional[float] = None,
                   durability: str = "full") -> EventLog:
    """Open the event log at ``url``:

    ``sqlite:///abs/path.db``, ``sqlite:relative/path.db`` or a bare file path: SQLiteEventLog
    (the file and its parent directories are created);
    ``redis://[user:password@]host:port/db``, optionally ``?prefix=...`` for the keys:
    RedisEventLog (connects on first use)."""
    if not isinstance(url, (str, os.PathLike)):
        raise ValueError(f"an event log URL must be a str, got {type(url).__name__}")
    url = os.fspath(url)
    if not url.strip():
        raise ValueError("an empty event log URL")
    options = dict(retain_events=retain_events, ttl_s=ttl_s, durability=durability)
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme == "rediss":
        raise ValueError(f"TLS Redis URLs are not supported ({_redact(url)!r}): reach Redis over a private network or a TLS proxy")
    if scheme == "redis":
        if not url.lower().startswith(scheme + "://"):
            raise ValueError(f"bad Redis URL {_redact(url)!r}: expected {scheme}://host:port/db")
        client_url, prefix = _split_redis_url(url)
        return RedisEventLog(client_url, prefix=prefix, **options)
    if scheme == "sqlite":
        return SQLiteEventLog(_sqlite_path(url), **options)
    if url == "memory:":
        return MemoryEventLog(**options)
    if "://" in url:
        raise ValueError(f"unsupported event log URL {_redact(url)!r}: use sqlite:///path.db, a file path "
                         f"or redis://host:port/db")
    if url == ":memory:":
        raise ValueError("an in-memory SQLite event log is not durable; give a file path")
    return SQLiteEventLog(url, **options)


# ------------------------------------------------------------------------------------------
# Command line: look at, delete or expire users' logs
# ------------------------------------------------------------------------------------------
def main(argv=None) -> int:
    """python -m backend_src.serving.event_log {show,delete,sweep} --log URL [--session ID] [--ttl-s S]

    delete erases a session's whole log (a data deletion request); servers drop their cached
    copy of it at the session's next request (its count no longer matches the log's)."""
    import argparse

    from genrec_contract.protocol import session_key

    ap = argparse.ArgumentParser(prog="python -m backend_src.serving.event_log", description=main.__doc__.split("\n")[0])
    ap.add_argument("action", choices=["show", "delete", "sweep"])
    ap.add_argument("--log", required=True, help="the server's event log: a SQLite path or redis://host:port/db")
    ap.add_argument("--session", help="session id (digits: an integer id)")
    ap.add_argument("--ttl-s", type=float, default=None, help="sweep: drop users with no event for this long")
    ap.add_argument("--events", type=int, default=20, help="show: the most recent events shown")
    a = ap.parse_args(argv)
    if a.action != "sweep" and not a.session:
        ap.error(f"{a.action} needs --session")
    key = session_key(int(a.session) if a.session and a.session.lstrip("-").isdigit() else a.session)
    with open_event_log(a.log, ttl_s=a.ttl_s) as log:
        if a.action == "show":
            t = log.tail(key, a.events)
            print(json.dumps({"session": a.session, "events": t.count, "recent": list(zip(t.items, t.actions, t.timestamps))}))
        elif a.action == "delete":
            print(json.dumps({"session": a.session, "deleted": log.delete(key)}))
        else:
            print(json.dumps({"swept_users": log.sweep()}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
