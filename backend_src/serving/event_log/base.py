"""The event log's interface (the package docstring says what every backend guarantees), its
errors, and the input checks every backend shares: a backend gets checked inputs only."""
from __future__ import annotations

import abc
import numbers
from dataclasses import dataclass
from typing import Optional

import numpy as np

DURABILITY = ("full", "normal")
DEFAULT_RETAIN_EVENTS = 4096
DEFAULT_REDIS_PREFIX = "eventlog:"
_INT64 = (-(2**63), 2**63 - 1)
# The key the watchdog's readiness probe writes and reads (serving/log_probe.py): no session's key
# (those begin with "i:" or "s:"), so never served; left out of the count of users.
PROBE_KEY = "~probe:readiness"


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


class EventLogDamaged(RuntimeError):
    """The log's file is damaged (not a database, or pages that do not parse): no retry can
    succeed until it is repaired. The message names the file and how to recover."""


@dataclass(frozen=True)
class UserLog:
    """``count``: events ever accepted for the user; the lists: the most recent retained events
    (at most the number asked for), oldest first."""

    count: int
    items: list
    actions: list
    timestamps: list


@dataclass(frozen=True)
class EventRange:
    """``count``: events ever accepted for the user; the lists: the retained events at positions
    ``start, start + 1, ...`` of the asked range: positions older than retention keeps are left out,
    so ``start`` may be past the range's first position; with none held, ``start`` is the range's stop."""

    count: int
    start: int
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

    def event_ranges(self, reads: list) -> list:
        """Per ``(user, start, stop)``: the user's count and the retained events at positions
        ``[start, stop)`` (0-based, the order they were accepted in), read in one round trip."""
        checked = []
        for user, start, stop in reads:
            start, stop = _as_int64(start, "a start position"), _as_int64(stop, "a stop position")
            if not 0 <= start <= stop:
                raise ValueError(f"positions must satisfy 0 <= start <= stop, got {start}, {stop}")
            checked.append((_check_user(user), start, stop))
        return self._event_ranges(checked) if checked else []

    def events(self, user: str, start: int, stop: int) -> EventRange:
        return self.event_ranges([(user, start, stop)])[0]

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
    def _event_ranges(self, reads: list) -> list:
        """reads: (user, start, stop), checked; each answer an EventRange."""

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
