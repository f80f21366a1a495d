"""The history encoder's numbers on Triton's /metrics endpoint: its session cache and event log.

Each update is a round trip to the server process, made from the thread that runs the stage's requests
(never from another thread: one blocked there at unload would hang the stub), and only for a value that
changed, so a request that changes nothing makes none. Without a metric maker (a stage driven in one
process) the counts are kept and nothing is sent.
"""
from __future__ import annotations

from typing import Callable

COUNTERS = {
    "restored": ("genrec_sessions_restored_total", "sessions rebuilt from the event log"),
    "logged": ("genrec_events_logged_total", "events written to the event log"),
    "replayed": ("genrec_events_replayed_total", "events of retried requests not applied again"),
}
GAUGES = {  # keys of SessionStore.stats()
    "bytes": ("genrec_session_cache_bytes", "bytes of the cached sessions"),
    "peak_bytes": ("genrec_session_cache_peak_bytes", "most bytes the session cache has held"),
    "sessions": ("genrec_session_cache_sessions", "sessions in the cache"),
}
BOUND = ("genrec_session_cache_bound_bytes", "the session cache's memory bound")


class SessionMetrics:
    """Counts made while requests are handled (`count`), sent with the cache's gauges by `publish`."""

    def __init__(self, make: Callable | None, bound_bytes: int):
        self._make = make  # keeps the metrics' families alive
        self.pending = dict.fromkeys(COUNTERS, 0)  # counted, not yet sent
        self.totals = dict.fromkeys(COUNTERS, 0)  # sent (or, without a maker, published)
        self._metrics, self._bound = {}, None
        if make is not None:
            self._metrics = {key: make(name, "counter", doc) for key, (name, doc) in COUNTERS.items()}
            self._metrics |= {key: make(name, "gauge", doc) for key, (name, doc) in GAUGES.items()}
            self._bound = make(BOUND[0], "gauge", BOUND[1])
            self._bound.set(bound_bytes)
        self._shown = {}

    def count(self, key: str, n: int) -> None:
        self.pending[key] += n

    def publish(self, stats: dict) -> None:
        """Send the counts made since the last call and the cache's gauges (`stats`: SessionStore.stats())."""
        for key, n in self.pending.items():
            if n:
                if self._metrics:
                    self._metrics[key].increment(n)
                self.totals[key] += n
                self.pending[key] = 0
        resync = self._shown.get("sessions") != stats["sessions"]
        for key in GAUGES:
            value, shown = stats[key], self._shown.get(key)
            # a session's bytes grow a little with every event: the byte gauges are sent when the
            # session count changes or they move by over 1/256, not on every append
            if shown != value and (resync or shown is None or abs(value - shown) * 256 > shown):
                if self._metrics:
                    self._metrics[key].set(value)
                self._shown[key] = value
