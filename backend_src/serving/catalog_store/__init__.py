"""The durable store of catalog changes behind the living catalog: items added and retired while
the server runs, as numbered changes every replica replays.

What it stores
    A log of changes numbered 1, 2, 3, ... (the catalog ``version`` is the number of committed
    changes; 0: none). A change adds items (``CatalogEntry``: raw id, JSON content, float32 content
    embedding computed by the caller) and retires raw ids. Beside the log, each id's current state:
    ``live`` or ``retired``, the version that last changed it and its last content.

Guarantees
    * A commit is one atomic change: all of it or nothing, also when the process is killed in the
      middle (SQLite: one ``BEGIN IMMEDIATE`` transaction; Redis: one Lua script, and the server
      writes a script's effects to its append-only file as one transaction). Every rule below is
      checked inside that transaction / script, against the state it changes.
    * Versions are consecutive with no change lost, also when several processes (replicas) commit
      at once: the write lock (SQLite) or the server (Redis) orders them.
    * Durable when ``commit`` returns. SQLite: ``durability="full"`` survives power loss, ``"normal"``
      a crash of the process. Redis: as durable as the server is configured (``RedisServer`` starts
      it with ``appendfsync always``).
    * A committed change never changes: ``changes(since)`` replays exactly what was committed.
    * Retrying is safe: a commit whose reply was lost, sent again, is a no-op by the rules below.

Rules of ``commit(adds, retires, replace=False)``
    * Adding an id that is live with the same ``content_hash`` does nothing for it; with other
      content it raises ``CatalogConflict`` (nothing written) unless ``replace=True``, which
      replaces the entry (the change records it as an add).
    * Adding a retired id makes it live again (new content allowed).
    * Retiring a live id retires it; an id the store does not know is recorded as given (the caller
      has checked it against the model's trained items); retiring a retired id does nothing for it.
    * A commit that changes nothing makes no version and returns the current one.
    * Bad input raises ``ValueError`` and writes nothing: more than ``max_items`` adds + retires,
      an id twice in one call (or both added and retired), an id that is empty or over
      ``MAX_ID_BYTES`` of UTF-8; ``CatalogEntry`` itself refuses an embedding that is not a 1-D
      finite float array and content that is not a JSON-able dict of at most ``MAX_CONTENT_BYTES``.

Where it lives: the event log's URL (``open_catalog_store`` reads URLs as ``open_event_log`` does),
so the catalog shares its store: SQLite tables ``catalog_*`` in the same file, Redis keys
``<prefix>catalog:{catalog}:*`` in the same database (one hash tag: one cluster slot, as a script
needs). ``memory:`` keeps it in the process, NOT durable (tests, measurements).

Errors
    ``CatalogConflict`` (a ``ValueError``) naming the id; ``ValueError`` for bad input or URLs;
    the event log's ``EventLogUnavailable`` when Redis cannot be reached and ``EventLogDamaged``
    when the SQLite file is damaged.

The backends are modules of their own (``sqlite_store``, ``redis_store``, ``memory_store``) over the
interface in ``base``; this package exposes their public names.
"""
from __future__ import annotations

import os

from backend_src.serving.catalog_store.base import (
    DEFAULT_MAX_ITEMS, LIVE, MAX_CONTENT_BYTES, MAX_ID_BYTES, RETIRED, CatalogChange, CatalogConflict, CatalogEntry,
    CatalogStore,
)
from backend_src.serving.catalog_store.memory_store import MemoryCatalogStore
from backend_src.serving.catalog_store.redis_store import RedisCatalogStore
from backend_src.serving.catalog_store.sqlite_store import SQLiteCatalogStore
from backend_src.serving.event_log import _split_redis_url, sqlite_path
from backend_src.serving.event_log.redis_log import redact_url

__all__ = [
    "DEFAULT_MAX_ITEMS",
    "LIVE", "MAX_CONTENT_BYTES", "MAX_ID_BYTES", "RETIRED", "CatalogChange", "CatalogConflict", "CatalogEntry",
    "CatalogStore", "MemoryCatalogStore", "RedisCatalogStore", "SQLiteCatalogStore", "open_catalog_store",
]


def open_catalog_store(url, **options) -> CatalogStore:
    """Open the catalog store at the event log's ``url`` (read as ``open_event_log`` reads it):
    ``sqlite:///abs/path.db``, ``sqlite:relative/path.db`` or a bare path: SQLiteCatalogStore;
    ``redis://[user:password@]host:port/db[?prefix=...]``: RedisCatalogStore (connects on first use);
    ``memory:``: MemoryCatalogStore. ``options`` go to the backend (``clock``; SQLite ``durability``,
    ``busy_timeout_s``; Redis ``socket_timeout_s``)."""
    if not isinstance(url, (str, os.PathLike)):
        raise ValueError(f"a catalog store URL must be a str, got {type(url).__name__}")
    url = os.fspath(url)
    if not url.strip():
        raise ValueError("an empty catalog store URL")
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme == "rediss":
        raise ValueError(f"TLS Redis URLs are not supported ({redact_url(url)!r}): reach Redis over a private network or a TLS proxy")
    if scheme == "redis":
        if not url.lower().startswith("redis://"):
            raise ValueError(f"bad Redis URL {redact_url(url)!r}: expected redis://host:port/db")
        client_url, prefix = _split_redis_url(url)
        return RedisCatalogStore(client_url, prefix=prefix, **options)
    if url == "memory:":
        return MemoryCatalogStore(**options)
    if url == ":memory:":
        raise ValueError("an in-memory SQLite catalog store is not durable; give a file path")
    path = sqlite_path(url)  # None: another scheme
    if path is None:
        raise ValueError(f"unsupported catalog store URL {redact_url(url)!r}: use sqlite:///path.db, a file path "
                         f"or redis://host:port/db")
    return SQLiteCatalogStore(path, **options)
