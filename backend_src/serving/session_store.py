"""Per-session state of the history encoder, keyed by the sequence (correlation) id.

A session holds the user's encoded history (a single-user ``HistoryCache``: per-layer K/V and
final states) and the raw events behind it (item indices, actions, timestamps), so that a
history that would grow past the maximum length can be re-encoded from its most recent
events.

Bounds: the total bytes of all sessions (least recently used sessions are evicted first) and
an idle timeout (sessions not touched for that long are evicted by ``sweep``). A session ends
at the sequence's END. The store remembers, for a while, why a session went away, so that a
later request for it gets a useful error instead of "unknown".

Thread-safe (one lock); tensors are stored as given, the caller must not mutate them.
"""
from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, fields
from typing import Any, Callable, Hashable

import torch

DEFAULT_MAX_BYTES = 2 << 30  # 2 GiB: a tenth of a 24 GiB machine
DEFAULT_IDLE_TIMEOUT_S = 600.0
_FORGOTTEN_MAX = 100_000  # how many gone sessions keep their reason


def tensor_bytes(obj: Any) -> int:
    """Bytes held by a tensor, or by the tensor fields of a dataclass (e.g. HistoryCache)."""
    if obj is None:
        return 0
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if hasattr(obj, "num_bytes"):
        return int(obj.num_bytes())
    return sum(tensor_bytes(getattr(obj, f.name)) for f in fields(obj))


@dataclass
class Session:
    cache: Any  # HistoryCache of one user, cut to its length
    items: torch.Tensor  # [n] long item indices (the most recent n <= max history events)
    actions: torch.Tensor  # [n] long
    timestamps: torch.Tensor  # [n] long seconds
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
        self._forgotten: "OrderedDict[Hashable, str]" = OrderedDict()
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

    def why_missing(self, key: Hashable) -> str:
        """Why there is no session for `key`, phrased for an error message."""
        with self._lock:
            reason = self._forgotten.get(key)
        if reason is None:
            return "was never started (send the first request with sequence_start and the full history)"
        return f"{reason}; start it again with sequence_start and the full history"

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
            self._sessions[key] = session
            self._bytes[key] = nbytes
            self._total += nbytes
            self._forgotten.pop(key, None)
            evicted = []
            while self._total > self.max_bytes:
                old = next(iter(self._sessions))  # least recently used; never `key` (it is last)
                self._remove(old)
                self._forget(old, "was evicted to keep session memory within its bound")
                self.evictions["memory"] += 1
                evicted.append(old)
            return evicted

    def end(self, key: Hashable) -> bool:
        """Free a session at the sequence's END. True if it existed."""
        with self._lock:
            found = self._remove(key)
            self._forget(key, "has already ended")
            return found

    def sweep(self) -> list:
        """Evict sessions idle for longer than the timeout. Returns their keys."""
        now = self._clock()
        evicted = []
        with self._lock:
            for key, s in list(self._sessions.items()):  # LRU order: stop at the first fresh one
                if now - s.last_access <= self.idle_timeout_s:
                    break
                self._remove(key)
                self._forget(key, f"was evicted after {self.idle_timeout_s:g} s idle")
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

    def _forget(self, key, reason: str) -> None:
        self._forgotten[key] = reason
        self._forgotten.move_to_end(key)
        while len(self._forgotten) > _FORGOTTEN_MAX:
            self._forgotten.popitem(last=False)

    def stats(self) -> dict:
        with self._lock:
            return {
                "sessions": len(self._sessions),
                "bytes": self._total,
                "max_bytes": self.max_bytes,
                "evicted_memory": self.evictions["memory"],
                "evicted_idle": self.evictions["idle"],
            }
