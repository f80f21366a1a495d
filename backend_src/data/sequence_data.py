"""`SequenceData`: per-user chronological event sequences in a jagged (CSR) layout, what every
loader and the synthetic generator return (both import it from here)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

DAY = 86400  # seconds (Amazon data only has day offsets or positions)


@dataclass
class SequenceData:
    """Chronological per-user event sequences in a jagged (CSR) layout.

    user u's events are rows offsets[u]:offsets[u+1] of items/actions/timestamps.
    Item indices run 1..num_items; index 0 is padding (item_ids[0] is None).
    """

    name: str
    user_ids: np.ndarray  # [U] raw user ids (as in the source file)
    item_ids: np.ndarray  # [I+1] object: raw item id of each item index; [0] = None (padding)
    offsets: np.ndarray  # [U+1] int64
    items: np.ndarray  # [E] int64 item index in 1..I, time-ordered within a user
    actions: np.ndarray  # [E] int64 action id (ratings 1..5; 0 = none)
    timestamps: np.ndarray  # [E] int64 seconds
    item_text: dict | None = None  # item index -> text
    item_attributes: dict | None = None  # item index -> list of attribute ids

    @property
    def num_items(self) -> int:
        return len(self.item_ids) - 1

    @property
    def num_users(self) -> int:
        return len(self.user_ids)

    @property
    def num_events(self) -> int:
        return len(self.items)

    @property
    def lengths(self) -> np.ndarray:
        """[U] number of events per user."""
        return np.diff(self.offsets)

    def item_index(self, raw_id) -> int:
        """Item index (1..I) of a raw item id as written in the source file."""
        lookup = self.__dict__.get("_item_lookup")
        if lookup is None:
            lookup = {raw: i for i, raw in enumerate(self.item_ids.tolist()) if i > 0}
            self.__dict__["_item_lookup"] = lookup
        try:
            return lookup[raw_id]
        except KeyError:
            # ids read from text may be asked for as strings or ints
            for alt in _id_variants(raw_id):
                if alt in lookup:
                    return lookup[alt]
            raise KeyError(f"item {raw_id!r} is not in data set {self.name!r} "
                           f"({self.num_items} items)") from None

    def user_events(self, u: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(items, actions, timestamps) of user row u."""
        s, e = self.offsets[u], self.offsets[u + 1]
        return self.items[s:e], self.actions[s:e], self.timestamps[s:e]

    def select_users(self, rows) -> "SequenceData":
        """A copy holding only the given user rows (in the given order); items keep their indices."""
        rows = np.asarray(rows, dtype=np.int64)
        lengths = self.lengths[rows]
        offsets = np.zeros(len(rows) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        idx = _ragged_arange(self.offsets[rows], lengths)
        return SequenceData(self.name, self.user_ids[rows], self.item_ids, offsets, self.items[idx],
                            self.actions[idx], self.timestamps[idx], self.item_text,
                            self.item_attributes)

    def __repr__(self) -> str:
        return (f"SequenceData({self.name!r}, users={self.num_users}, items={self.num_items}, "
                f"events={self.num_events})")


def _id_variants(raw_id):
    if isinstance(raw_id, str):
        try:
            yield int(raw_id)
        except ValueError:
            pass
    elif isinstance(raw_id, (int, np.integer)):
        yield int(raw_id)
        yield str(raw_id)


def _ragged_arange(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """concat(arange(s, s + n) for s, n in zip(starts, lengths)), vectorized."""
    starts = np.asarray(starts, dtype=np.int64)
    lengths = np.asarray(lengths, dtype=np.int64)
    seg_starts = np.cumsum(lengths) - lengths  # where each segment begins in the output
    return (np.arange(int(lengths.sum()), dtype=np.int64)
            + np.repeat(starts - seg_starts, lengths))
