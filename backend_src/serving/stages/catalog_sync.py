"""A stage's copy of the living catalog (model/catalog.py): it follows the durable store of catalog
changes (serving/catalog_store, beside the event log, so every replica reads the same one).

At load the stage replays every change so far (a restarted stage, server or replica catches up
before it serves); then, between requests, it looks at the store's version at most every
`catalog_poll_s` seconds and applies what is new, and at once when a request names a version it
has not applied yet (MIN_CATALOG_VERSION, from the encoder: the later stages apply at least the
encoder's version). A request is handled whole at one version. When the store cannot be read the
stage serves at the version it has and says so on stderr; it tries again at the next poll.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Mapping

from backend_src.model.catalog import DEFAULT_CAPACITY, ItemCatalog
from backend_src.serving.catalog_store import open_catalog_store
from backend_src.serving.event_log import served_log_url

DEFAULT_POLL_S = 0.5


class CatalogSync:
    def __init__(self, model, params: Mapping, version_dir: Path, name: str):
        self.name = name
        self.catalog = ItemCatalog(model, capacity=int(params.get("catalog_capacity", DEFAULT_CAPACITY)))
        self.poll_s = float(params.get("catalog_poll_s", DEFAULT_POLL_S))
        # the event log's URL: its SQLite file or its Redis, which every replica shares
        self.store = open_catalog_store(served_log_url(params, Path(version_dir).resolve().parent.parent))
        self._next_poll = 0.0
        self.sync()

    @property
    def version(self) -> int:
        return self.catalog.version

    def sync(self, at_least: int = 0) -> bool:
        """Apply the store's new changes when a poll is due or a request needs a newer version; True
        when the catalog changed."""
        now = time.monotonic()
        if at_least <= self.catalog.version and now < self._next_poll:
            return False
        self._next_poll = now + self.poll_s
        try:
            if self.store.version() <= self.catalog.version:
                return False
            changes = self.store.changes(self.catalog.version)
        except Exception as e:  # noqa: BLE001 - serve at the version applied; the next poll tries again
            print(f"{self.name}: the catalog store cannot be read, serving catalog version {self.catalog.version}: {e}",
                  file=sys.stderr)
            return False
        before = self.catalog.version
        try:
            self.catalog.apply(changes)
        except Exception as e:  # noqa: BLE001 - the changes before the one that failed stay applied
            print(f"{self.name}: catalog change {self.catalog.version + 1} not applied: {e}", file=sys.stderr)
        return self.catalog.version != before

    def close(self) -> None:
        self.store.close()
