"""The catalog store's interface (the package docstring says what every backend guarantees), its
data classes, its error, and the input checks every backend shares: a backend gets checked inputs only."""
from __future__ import annotations

import abc
import hashlib
import json
import numbers
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from genrec_contract import protocol as P

LIVE, RETIRED = "live", "retired"
MAX_ID_BYTES = P.MAX_ITEM_ID_BYTES  # the contract's: an event's item id is a catalog id
MAX_CONTENT_BYTES = 1 << 20
DEFAULT_MAX_ITEMS = 10_000


class CatalogConflict(ValueError):
    """An add of an id that is live with other content, without ``replace=True``; nothing was written."""

    def __init__(self, item_id: str):
        self.item_id = item_id
        super().__init__(f"catalog item {item_id!r} is live with other content; "
                         f"commit with replace=True to replace it")

    def __reduce__(self):
        return (type(self), (self.item_id,))


def _check_id(item_id, what: str = "a catalog item id") -> str:
    if not isinstance(item_id, str) or not item_id:
        raise ValueError(f"{what} must be a non-empty str, got {item_id!r}")
    try:
        size = len(item_id.encode("utf-8"))
    except UnicodeEncodeError:
        raise ValueError(f"{what} must be valid UTF-8 text, got {item_id!r}") from None
    if size > MAX_ID_BYTES:
        raise ValueError(f"{what} is {size} bytes of UTF-8, over the limit of {MAX_ID_BYTES}: {item_id[:32]!r}...")
    return str(item_id)  # numpy.str_ -> str


def _canonical_json(content, item_id: str) -> str:
    if not isinstance(content, dict):
        raise ValueError(f"the content of catalog item {item_id!r} must be a dict, got {type(content).__name__}")
    try:
        text = json.dumps(content, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
        size = len(text.encode("utf-8"))
    except (TypeError, ValueError, RecursionError) as e:
        raise ValueError(f"the content of catalog item {item_id!r} is not JSON-able: {e}") from None
    if size > MAX_CONTENT_BYTES:
        raise ValueError(f"the content of catalog item {item_id!r} is {size} bytes of JSON, "
                         f"over the limit of {MAX_CONTENT_BYTES}")
    return text


def _check_embedding(embedding, item_id: str) -> np.ndarray:
    arr = np.asarray(embedding)
    if arr.ndim != 1 or arr.size == 0 or arr.dtype.kind != "f":
        raise ValueError(f"the embedding of catalog item {item_id!r} must be a non-empty 1-D float array, "
                         f"got shape {arr.shape} of {arr.dtype}")
    with np.errstate(over="ignore"):  # a value beyond float32 becomes inf: refused below
        arr = np.array(arr, dtype=np.float32)  # a copy of our own
    if not np.isfinite(arr).all():
        raise ValueError(f"the embedding of catalog item {item_id!r} has values that are not finite (as float32)")
    arr.setflags(write=False)
    return arr


@dataclass(frozen=True, eq=False)
class CatalogEntry:
    """One added item. Checked when made (``ValueError``): ``item_id`` a non-empty str of at most
    ``MAX_ID_BYTES`` UTF-8 bytes; ``content`` a JSON-able dict (kept as JSON reads it back, a copy);
    ``embedding`` a 1-D finite float array (kept as a read-only float32 copy).

    Derived: ``content_hash``, the sha256 of the content's canonical JSON (sorted keys, no spaces);
    ``version``, the catalog version that added it (0 until read back from a store)."""

    item_id: str
    content: dict
    embedding: np.ndarray
    version: int = field(default=0, init=False)
    content_hash: str = field(default="", init=False, repr=False)

    def __post_init__(self):
        item_id = _check_id(self.item_id)
        text = _canonical_json(self.content, item_id)
        self._set(item_id, text, hashlib.sha256(text.encode("utf-8")).hexdigest(),
                  _check_embedding(self.embedding, item_id), 0)

    def _set(self, item_id, text, content_hash, embedding, version):
        for name, value in (("item_id", item_id), ("content", json.loads(text)), ("embedding", embedding),
                            ("version", version), ("content_hash", content_hash), ("_json", text)):
            object.__setattr__(self, name, value)

    @classmethod
    def _stored(cls, item_id: str, text: str, content_hash: str, embedding: np.ndarray, version: int):
        """An entry read back from a store: checked when committed, not again."""
        self = object.__new__(cls)
        self._set(item_id, text, content_hash, embedding, version)
        return self

    def __eq__(self, other):
        if not isinstance(other, CatalogEntry):
            return NotImplemented
        return (self.item_id, self.content_hash, self.version) == (other.item_id, other.content_hash, other.version) \
            and np.array_equal(self.embedding, other.embedding)

    __hash__ = None


@dataclass(frozen=True)
class CatalogChange:
    """One committed change: ``version`` is the catalog's version after it; ``adds`` in the order
    given (each entry's ``version`` is this one); ``retires`` raw ids; ``time`` unix seconds."""

    version: int
    adds: tuple
    retires: tuple
    time: float


def _check_commit(adds, retires, max_items) -> tuple:
    if isinstance(adds, (CatalogEntry, str, bytes)) or isinstance(retires, (str, bytes)):
        raise ValueError("adds must be a list of CatalogEntry and retires a list of ids")
    adds, retires = list(adds), [_check_id(r, "a retired id") for r in retires]
    for a in adds:
        if not isinstance(a, CatalogEntry):
            raise ValueError(f"an add must be a CatalogEntry, got {type(a).__name__}")
    if not isinstance(max_items, numbers.Integral) or max_items < 1:
        raise ValueError(f"max_items must be an integer >= 1, got {max_items!r}")
    if len(adds) + len(retires) > max_items:
        raise ValueError(f"a change holds at most {max_items} adds and retires, got {len(adds)} + {len(retires)}")
    added = set()
    for a in adds:
        if a.item_id in added:
            raise ValueError(f"catalog item {a.item_id!r} is added twice in one change")
        added.add(a.item_id)
    retired = set()
    for r in retires:
        if r in added:
            raise ValueError(f"catalog item {r!r} is both added and retired in one change")
        if r in retired:
            raise ValueError(f"catalog item {r!r} is retired twice in one change")
        retired.add(r)
    return adds, retires


def _plan(adds: list, retires: list, current: dict, replace: bool) -> tuple:
    """The adds and retires that change something, given ``current``: id -> (status, content_hash)
    of the ids the store knows. Raises CatalogConflict (see the module docstring's rules)."""
    changed_adds = []
    for a in adds:
        status, content_hash = current.get(a.item_id, (None, None))
        if status == LIVE:
            if content_hash == a.content_hash:
                continue
            if not replace:
                raise CatalogConflict(a.item_id)
        changed_adds.append(a)
    return changed_adds, [r for r in retires if current.get(r, (None,))[0] != RETIRED]


def _item(item_id, status, version, content_json, content_hash) -> dict:
    return {"item_id": item_id, "status": status, "version": int(version),
            "content": None if content_json is None else json.loads(content_json), "content_hash": content_hash}


def _embedding(buf) -> np.ndarray:
    return np.frombuffer(buf, dtype="<f4")  # read-only: it shares the bytes read


class CatalogStore(abc.ABC):
    """The durable, numbered, atomic store of catalog changes (see the module docstring)."""

    def commit(self, adds: list, retires: list, replace: bool = False, max_items: int = DEFAULT_MAX_ITEMS) -> int:
        """Commit ``adds`` (CatalogEntry) and ``retires`` (raw ids) as one change; returns the new
        version, or the current one when nothing changes."""
        adds, retires = _check_commit(adds, retires, max_items)
        if not adds and not retires:
            return self.version()
        return self._commit(adds, retires, bool(replace))

    def changes(self, since: int, limit: Optional[int] = None) -> list:
        """The committed changes with version > ``since``, oldest first, at most ``limit`` of them."""
        if not isinstance(since, numbers.Integral) or since < 0:
            raise ValueError(f"since must be an integer >= 0, got {since!r}")
        if limit is not None and (not isinstance(limit, numbers.Integral) or limit < 0):
            raise ValueError(f"limit must be an integer >= 0 or None, got {limit!r}")
        return [] if limit == 0 else self._changes(int(since), None if limit is None else int(limit))

    def get(self, ids: list) -> dict:
        """id -> {"item_id", "status", "version" (that last changed it), "content", "content_hash"}
        for each of ``ids`` the store knows (content None: retired, never added)."""
        if isinstance(ids, (str, bytes)):
            raise ValueError("ids must be a list of ids, not one str")
        ids = list(dict.fromkeys(_check_id(i) for i in ids))
        return self._get(ids) if ids else {}

    def list(self, offset: int = 0, limit: int = 100, status: Optional[str] = None) -> list:
        """The items as ``get`` gives them, ordered by the version that last changed them, then id."""
        for name, value in (("offset", offset), ("limit", limit)):
            if not isinstance(value, numbers.Integral) or value < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
        if status not in (None, LIVE, RETIRED):
            raise ValueError(f"status must be None, {LIVE!r} or {RETIRED!r}, got {status!r}")
        return self._list(int(offset), int(limit), status) if limit else []

    @abc.abstractmethod
    def version(self) -> int:
        """The number of committed changes (0: none); one indexed read."""

    @abc.abstractmethod
    def stats(self) -> dict:
        """``version``, ``live`` and ``retired`` (counts of items), ``backend``."""

    @abc.abstractmethod
    def close(self) -> None: ...

    # -- backend parts; inputs already checked
    @abc.abstractmethod
    def _commit(self, adds: list, retires: list, replace: bool) -> int: ...

    @abc.abstractmethod
    def _changes(self, since: int, limit: Optional[int]) -> list: ...

    @abc.abstractmethod
    def _get(self, ids: list) -> dict: ...

    @abc.abstractmethod
    def _list(self, offset: int, limit: int, status: Optional[str]) -> list: ...

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
