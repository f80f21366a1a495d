"""The history encoder's cache of encoded sessions, keyed by the user's session id.

A session holds the user's encoded history (a single-user ``HistoryCache``: per-layer K/V and
final states), the events behind it (item indices, actions, timestamps of the most recent
``n <= max history`` events, so that a history that would grow past the maximum length can be
re-encoded from its most recent events) and ``count``, the number of events the durable event
log held when this cache was made. The cache is only ever a copy of the log: the encoder
compares ``count`` with the log's count on every request, so a stale entry (another instance or
replica appended since) is re-built rather than served.

The cache outlives Triton's sequences (a sequence is one visit); it is bounded by the total
bytes of all sessions (least recently used sessions are evicted first) and an idle timeout
(``sweep``). Eviction loses nothing: the next request re-builds the session from the log.

Thread-safe (one lock); tensors are stored as given, the caller must not mutate them.
"""
from __future__ import annotations

import os
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, fields
from typing import Any, Callable, Hashable

import torch

DEFAULT_MAX_BYTES = 2 << 30  # 2 GiB: a tenth of a 24 GiB machine
DEFAULT_IDLE_TIMEOUT_S = 3600.0
DEFAULT_PREFAULT_BYTES = 256 << 20  # about 250 sessions of 512 events at d 64, 2 layers
PREFAULT_CHUNK = 16 << 20


def tensor_bytes(obj: Any) -> int:
    """Bytes held by a tensor, or by the tensor fields of a dataclass (e.g. HistoryCache)."""
    if obj is None:
        return 0
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if hasattr(obj, "num_bytes"):
        return int(obj.num_bytes())
    return sum(tensor_bytes(getattr(obj, f.name)) for f in fields(obj))


def prefault_heap(nbytes: int, chunk: int = PREFAULT_CHUNK) -> int:
    """Touch ``nbytes`` of the C heap once and free them, so that the sessions a young store takes
    in land on pages already mapped. A store that only grows maps fresh pages for every new
    session (about 200 first-touch faults for a 512-event open: 0.6 ms of its 7.7 ms here); a full
    store reuses its evicted sessions' memory and pays none. Effective only when glibc keeps what is
    freed (chunks under MALLOC_MMAP_THRESHOLD_, the total under MALLOC_TRIM_THRESHOLD_, as the
    server sets them); otherwise nothing is done. Returns the bytes touched."""
    mmap_threshold = int(os.environ.get("MALLOC_MMAP_THRESHOLD_", 0))
    trim_threshold = int(os.environ.get("MALLOC_TRIM_THRESHOLD_", 0))
    if nbytes <= 0 or mmap_threshold <= chunk or trim_threshold <= nbytes:
        return 0
    chunks = [torch.zeros(chunk, dtype=torch.uint8) for _ in range(nbytes // chunk)]  # zeros: every page written
    touched = len(chunks) * chunk
    del chunks  # back to the allocator's free memory, still mapped
    return touched


@dataclass
class Session:
    cache: Any  # HistoryCache of one user, cut to its length
    items: torch.Tensor  # [n] long item indices (the most recent n <= max history events)
    actions: torch.Tensor  # [n] long
    timestamps: torch.Tensor  # [n] long seconds
    count: int = 0  # events in the event log when this cache was made (all ever accepted)
    last_access: float = 0.0

    @property
    def length(self) -> int:
        return int(self.items.shape[0])

    @property
    def last_timestamp(self) -> int | None:
        return int(self.timestamps[-1]) if self.length else None

    @property
    def nbytes(self) -> int:
        return tensor_bytes(self.cache) + tensor_bytes(self.items) + tensor_bytes(self.actions) + tensor_bytes(self.timestamps)


class SessionTooLarge(Exception):
    """One session alone is larger than the store's whole memory bound."""


class SessionStore:
    def __init__(
        self,
        max_bytes: int = DEFAULT_MAX_BYTES,
        idle_timeout_s: float = DEFAULT_IDLE_TIMEOUT_S,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.max_bytes = int(max_bytes)
        self.idle_timeout_s = float(idle_timeout_s)
        self._clock = clock
        self._lock = threading.RLock()
        self._sessions: "OrderedDict[Hashable, Session]" = OrderedDict()  # LRU first
        self._bytes: dict = {}
        self._total = 0
        self.peak_bytes = 0
        self.evictions = {"memory": 0, "idle": 0}

    # ---- queries --------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._sessions)

    def __contains__(self, key) -> bool:
        return key in self._sessions

    @property
    def total_bytes(self) -> int:
        return self._total

    def get(self, key: Hashable) -> Session | None:
        """The session (marked as just used), or None."""
        with self._lock:
            s = self._sessions.get(key)
            if s is not None:
                s.last_access = self._clock()
                self._sessions.move_to_end(key)
            return s

    # ---- updates --------------------------------------------------------------------------
    def put(self, key: Hashable, session: Session) -> list:
        """Insert or replace a session; evicts least recently used others to stay within the
        memory bound. Returns the evicted keys. Raises SessionTooLarge (nothing changes) if
        the session alone exceeds the bound."""
        nbytes = session.nbytes
        if nbytes > self.max_bytes:
            raise SessionTooLarge(f"session needs {nbytes} bytes, more than the store's bound of {self.max_bytes}")
        with self._lock:
            self._remove(key)
            session.last_access = self._clock()
            evicted = []
            while self._total + nbytes > self.max_bytes:  # make room first: the bound is never exceeded
                old = next(iter(self._sessions))  # least recently used
                self._remove(old)
                self.evictions["memory"] += 1
                evicted.append(old)
            self._sessions[key] = session
            self._bytes[key] = nbytes
            self._total += nbytes
            self.peak_bytes = max(self.peak_bytes, self._total)
            return evicted

    def discard(self, key: Hashable) -> bool:
        """Drop a session's cache (stale, or its log was deleted). True if it existed."""
        with self._lock:
            return self._remove(key)

    def sweep(self) -> list:
        """Evict sessions idle for longer than the timeout. Returns their keys."""
        now = self._clock()
        evicted = []
        with self._lock:
            while self._sessions:  # LRU order: stop at the first fresh one (no walk over the others)
                key, s = next(iter(self._sessions.items()))
                if now - s.last_access <= self.idle_timeout_s:
                    break
                self._remove(key)
                self.evictions["idle"] += 1
                evicted.append(key)
        return evicted

    def clear(self) -> None:
        with self._lock:
            self._sessions.clear()
            self._bytes.clear()
            self._total = 0

    # ---- internals ------------------------------------------------------------------------
    def _remove(self, key) -> bool:
        s = self._sessions.pop(key, None)
        if s is None:
            return False
        self._total -= self._bytes.pop(key)
        return True

    def stats(self) -> dict:
        with self._lock:
            return {
                "sessions": len(self._sessions),
                "bytes": self._total,
                "peak_bytes": self.peak_bytes,
                "max_bytes": self.max_bytes,
                "evicted_memory": self.evictions["memory"],
                "evicted_idle": self.evictions["idle"],
            }
