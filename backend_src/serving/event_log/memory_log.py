"""The event log in this process's memory: the same semantics, NOT durable."""
from __future__ import annotations

import threading

from backend_src.serving.event_log.base import EventLog, EventRange, LogConflict, UserLog

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

    def _event_ranges(self, reads):
        with self._lock:
            out = []
            for user, start, stop in reads:
                count, items, actions, ts = self._logs.get(user, (0, [], [], []))
                first = count - len(items)  # the position of the oldest retained event
                lo, hi = max(start, first), min(stop, count)
                if lo >= hi:
                    out.append(EventRange(count, stop, [], [], []))
                    continue
                cut = slice(lo - first, hi - first)
                out.append(EventRange(count, lo, items[cut], actions[cut], ts[cut]))
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
