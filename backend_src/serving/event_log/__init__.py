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
    when Redis cannot be reached, which the caller answers as UNAVAILABLE. ``EventLogDamaged``
    when the SQLite file is damaged, at open or later (the message names the file and how to
    recover): no retry can succeed.

Backends, chosen by URL in ``open_event_log`` (``memory:`` keeps the log in the process, NOT
durable: only to measure what the others cost):
    ``sqlite:///abs/path.db``, ``sqlite:relative/path.db`` or a bare path -> SQLiteEventLog
    ``redis://[user:password@]host:port/db[?prefix=...]``            -> RedisEventLog

The backends are modules of their own (``sqlite_log``, ``redis_log``, ``memory_log``) over the
interface in ``base``; this package exposes their public names. The command line
(``python -m backend_src.serving.event_log show|delete|sweep``) is ``cli``.
"""
from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Optional
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from backend_src.serving.event_log.base import (
    DEFAULT_REDIS_PREFIX, DEFAULT_RETAIN_EVENTS, DURABILITY, PROBE_KEY, WRITE_ASIDE_EVENTS, EventLog, EventLogDamaged,
    EventLogUnavailable, EventRange, LogConflict, UserLog,
)
from backend_src.serving.event_log.memory_log import MemoryEventLog
from backend_src.serving.event_log.redis_log import RedisEventLog, redact_url
from backend_src.serving.event_log.sqlite_log import SQLiteEventLog

__all__ = [
    "DEFAULT_REDIS_PREFIX", "DEFAULT_RETAIN_EVENTS", "DURABILITY", "EVENT_LOG_ENV", "PROBE_KEY", "WRITE_ASIDE_EVENTS",
    "EventLog", "EventLogDamaged", "EventLogUnavailable", "EventRange", "LogConflict", "MemoryEventLog", "RedisEventLog",
    "SQLiteEventLog", "UserLog", "checkpoint", "open_event_log", "served_log_url", "sqlite_path",
]


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
        raise ValueError(f"bad Redis URL {redact_url(url)!r}: the port is not a number") from None
    if not parts.hostname:
        raise ValueError(f"bad Redis URL {redact_url(url)!r}: no host (expected redis://host:port/db)")
    db = parts.path.strip("/")
    if db and not db.isdigit():
        raise ValueError(f"bad Redis URL {redact_url(url)!r}: the database {db!r} is not a number")
    query = parse_qsl(parts.query, keep_blank_values=True)
    prefix = DEFAULT_REDIS_PREFIX
    rest = []
    for key, value in query:
        if key == "prefix":
            prefix = value
        else:
            rest.append((key, value))
    return urlunsplit(parts._replace(query=urlencode(rest))), prefix


EVENT_LOG_ENV = "GENREC_EVENT_LOG"  # the server's setting of its event log's URL


def served_log_url(params, repository) -> str:
    """The URL of the log a server of `repository` writes: GENREC_EVENT_LOG (the server's setting) >
    the encoder config's ``event_log`` parameter (`params`: name -> value) > a SQLite file beside the
    repository, ``<repository>-events/events.sqlite3`` (nothing to start)."""
    url = os.environ.get(EVENT_LOG_ENV) or (params or {}).get("event_log", "")
    if url:
        return str(url)
    repository = Path(repository).resolve()
    return str(repository.parent / f"{repository.name}-events" / "events.sqlite3")


def sqlite_path(url) -> Optional[str]:
    """The file a SQLite log's URL names, as open_event_log opens it; None for another backend."""
    if not url:
        return None
    url = os.fspath(url)
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme == "sqlite":
        return _sqlite_path(url)
    return None if scheme in ("redis", "rediss") or "://" in url or url in ("memory:", ":memory:") else url


def checkpoint(url) -> None:
    """Move a SQLite log's WAL into its main file and remove the WAL (a stopped server's last step:
    the file alone then holds every event). Nothing for another backend or a missing file; errors are
    left to the next start."""
    path = sqlite_path(url)
    if path and Path(path).exists():
        try:
            SQLiteEventLog(path, verify=False).close()
        except Exception as e:  # noqa: BLE001
            logging.getLogger("genrec.event_log").warning("event log %s: no checkpoint at stop (%s)", path, e)


def open_event_log(url: str, *, retain_events: int = DEFAULT_RETAIN_EVENTS, ttl_s: Optional[float] = None,
                   durability: str = "full", verify: bool = True) -> EventLog:
    """Open the event log at ``url``:

    ``sqlite:///abs/path.db``, ``sqlite:relative/path.db`` or a bare file path: SQLiteEventLog
    (the file and its parent directories are created; `verify`: an existing file is checked first);
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
        raise ValueError(f"TLS Redis URLs are not supported ({redact_url(url)!r}): reach Redis over a private network or a TLS proxy")
    if scheme == "redis":
        if not url.lower().startswith(scheme + "://"):
            raise ValueError(f"bad Redis URL {redact_url(url)!r}: expected {scheme}://host:port/db")
        client_url, prefix = _split_redis_url(url)
        return RedisEventLog(client_url, prefix=prefix, **options)
    if scheme == "sqlite":
        return SQLiteEventLog(_sqlite_path(url), verify=verify, **options)
    if url == "memory:":
        return MemoryEventLog(**options)
    if "://" in url:
        raise ValueError(f"unsupported event log URL {redact_url(url)!r}: use sqlite:///path.db, a file path "
                         f"or redis://host:port/db")
    if url == ":memory:":
        raise ValueError("an in-memory SQLite event log is not durable; give a file path")
    return SQLiteEventLog(url, verify=verify, **options)
