"""The catalog store in this process's memory: the same semantics, NOT durable."""
from __future__ import annotations

import threading
import time
from typing import Callable

from backend_src.serving.catalog_store.base import (
    LIVE, RETIRED, CatalogChange, CatalogEntry, CatalogStore, _item, _plan,
)


class MemoryCatalogStore(CatalogStore):
    """The same semantics in this process's memory, lost with it: NOT durable."""

    def __init__(self, *, clock: Callable[[], float] = time.time):
        self._clock = clock
        self._lock = threading.Lock()
        self._log: list = []  # per version: (time, adds: [CatalogEntry], retires: tuple)
        self._items: dict = {}  # id -> (status, version, CatalogEntry of its last add or None)

    def version(self) -> int:
        return len(self._log)

    def _commit(self, adds, retires, replace):
        with self._lock:
            current = {}
            for item_id in [a.item_id for a in adds] + retires:
                if item_id in self._items:
                    status, _, entry = self._items[item_id]
                    current[item_id] = (status, entry and entry.content_hash)
            adds, retires = _plan(adds, retires, current, replace)
            if not adds and not retires:
                return len(self._log)
            new = len(self._log) + 1
            self._log.append((float(self._clock()), adds, tuple(retires)))
            for a in adds:
                self._items[a.item_id] = (LIVE, new, a)
            for r in retires:  # a retired item keeps its last content
                self._items[r] = (RETIRED, new, self._items[r][2] if r in self._items else None)
            return new

    def _changes(self, since, limit):
        with self._lock:
            log = self._log[since:None if limit is None else since + limit]
        return [CatalogChange(v, tuple(CatalogEntry._stored(a.item_id, a._json, a.content_hash, a.embedding, v)
                                       for a in adds), retires, t)
                for v, (t, adds, retires) in enumerate(log, start=since + 1)]

    def _as_dict(self, item_id, status, version, entry):
        return _item(item_id, status, version, entry and entry._json, entry and entry.content_hash)

    def _get(self, ids):
        with self._lock:
            return {i: self._as_dict(i, *self._items[i]) for i in ids if i in self._items}

    def _list(self, offset, limit, status):
        with self._lock:
            rows = sorted((v, i, s, e) for i, (s, v, e) in self._items.items() if status in (None, s))
            return [self._as_dict(i, s, v, e) for v, i, s, e in rows[offset:offset + limit]]

    def stats(self) -> dict:
        with self._lock:
            live = sum(s == LIVE for s, _, _ in self._items.values())
            return {"backend": "memory", "version": len(self._log), "live": live, "retired": len(self._items) - live}

    def close(self) -> None:
        pass
