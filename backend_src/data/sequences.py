"""Leave-one-out splits and padded batches of user histories.

Leave-one-out per user: test target = last event, valid target = second last, training sequence =
all but the last `end_offset` (= 2) events. Batches are left-aligned: row b holds its events in
columns 0..lengths[b]-1 and zeros after; a history longer than max_len keeps its most recent events.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Sequence

import numpy as np
import torch

from .sequence_data import SequenceData

SPLITS = ("valid", "test")


@dataclass
class Batch:
    items: torch.Tensor  # [B, N] long item index, 0 = padding
    actions: torch.Tensor  # [B, N] long
    timestamps: torch.Tensor  # [B, N] long
    lengths: torch.Tensor  # [B] long
    targets: torch.Tensor | None  # [B, N] next item per position (0 = none), training
    target_items: torch.Tensor | None  # [B] the held-out item, evaluation
    users: np.ndarray  # [B] user row indices (-1 = not a data set user)

    def __len__(self) -> int:
        return self.items.shape[0]

    def to(self, device) -> "Batch":
        move = lambda t: None if t is None else t.to(device)  # noqa: E731
        return Batch(move(self.items), move(self.actions), move(self.timestamps), move(self.lengths),
                     move(self.targets), move(self.target_items), self.users)


def _as_rng(rng) -> np.random.Generator:
    return rng if isinstance(rng, np.random.Generator) else np.random.default_rng(rng)


def _gather(data: SequenceData, rows: np.ndarray, lengths: np.ndarray, width: int):
    """Left-aligned [B, width] item/action/timestamp matrices from event rows [B, width]."""
    valid = np.arange(width)[None, :] < lengths[:, None]
    rows = np.where(valid, rows, 0)
    pick = lambda a: torch.from_numpy(np.where(valid, a[rows], 0).astype(np.int64))  # noqa: E731
    return pick(data.items), pick(data.actions), pick(data.timestamps)


def _recent_rows(starts: np.ndarray, ends: np.ndarray, max_len: int, width: int):
    """Event rows of the most recent min(ends - starts, max_len) events, [B, width], and lengths."""
    lengths = np.minimum(ends - starts, max_len)
    rows = (ends - lengths)[:, None] + np.arange(width)[None, :]
    return rows, lengths


def target_rows(data: SequenceData, split: str) -> np.ndarray:
    """[U] event row of each user's held-out item for split 'test' (last) or 'valid' (second last)."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    return data.offsets[1:] - (1 if split == "test" else 2)


def train_batches(data: SequenceData, batch_size: int, max_len: int, rng=None,
                  stochastic_length_alpha: float = 2.0, end_offset: int = 2, shuffle: bool = True,
                  pad_to_max: bool = False) -> Iterator[Batch]:
    """Next-item training batches: position i of a row predicts the event after it.

    A user's training sequence is events[:len - end_offset]; a row takes its last up to max_len+1
    events, inputs = events[:-1], targets = events[1:] (0 at padding). Users with fewer than two
    training events give no row.
    Stochastic length (HSTU, alpha in (0, 2]; 2 = off): a sequence of n > max_len^(alpha/2) events
    is kept whole with probability max_len^alpha / n^2, else replaced by a random order-preserving
    subsample of max_len^(alpha/2) events.
    pad_to_max: width max_len instead of the longest row in the batch.
    """
    if not 0.0 < stochastic_length_alpha <= 2.0:
        raise ValueError(f"stochastic_length_alpha must be in (0, 2], got {stochastic_length_alpha}")
    rng = _as_rng(rng)
    starts = data.offsets[:-1]
    n_train = data.lengths - end_offset
    users = np.flatnonzero(n_train >= 2)
    if shuffle:
        users = rng.permutation(users)
    sl_len = max(2, int(max_len ** (stochastic_length_alpha / 2)))
    for b in range(0, len(users), batch_size):
        u = users[b:b + batch_size]
        start, n = starts[u], n_train[u]
        # default: the most recent max_len+1 events
        m = np.minimum(n, max_len + 1)  # events in the row (inputs + final target)
        width = int(m.max())
        rel = (n - m)[:, None] + np.arange(width)[None, :]  # [B, width] offsets in the sequence
        if stochastic_length_alpha < 2.0:
            long = n > sl_len
            keep_p = np.minimum(1.0, float(max_len) ** stochastic_length_alpha / n.astype(float) ** 2)
            sub = np.flatnonzero(long & (rng.random(len(u)) >= keep_p))
            if len(sub):
                # random order-preserving subsample of sl_len events: smallest random keys
                keys = rng.random((len(sub), int(n[sub].max())))
                keys[np.arange(keys.shape[1])[None, :] >= n[sub][:, None]] = np.inf
                chosen = np.sort(np.argpartition(keys, sl_len - 1, axis=1)[:, :sl_len], axis=1)
                m[sub] = sl_len
                rel[sub, :sl_len] = chosen
                width = int(m.max())
                rel = rel[:, :width]
        rows = start[:, None] + rel
        lengths = m - 1
        out_w = max_len if pad_to_max else max(int(lengths.max()), 1)
        items, actions, timestamps = _gather(data, _fit(rows[:, :-1], out_w), lengths, out_w)
        targets, _, _ = _gather(data, _fit(rows[:, 1:], out_w), lengths, out_w)
        yield Batch(items, actions, timestamps, torch.from_numpy(lengths.astype(np.int64)),
                    targets=targets, target_items=None, users=u)


def length_bucketed(batches, batch_size: int, rng: np.random.Generator):
    """Re-split large shuffled training batches into `batch_size` rows of similar length, each cut to
    its longest row, in random order: most Beauty histories are short, so this skips most padding."""
    for big in batches:
        order = torch.from_numpy(np.argsort(big.lengths.numpy(), kind="stable"))
        parts = list(order.split(batch_size))
        for i in rng.permutation(len(parts)):
            idx = parts[i]
            width = max(int(big.lengths[idx].max()), 1)
            yield Batch(big.items[idx, :width], big.actions[idx, :width], big.timestamps[idx, :width],
                        big.lengths[idx], big.targets[idx, :width], None, big.users[idx.numpy()])


def _fit(rows: np.ndarray, width: int) -> np.ndarray:
    """Pad (with row 0) or cut a [B, w] row matrix to [B, width]."""
    if rows.shape[1] >= width:
        return rows[:, :width]
    return np.pad(rows, ((0, 0), (0, width - rows.shape[1])))


def eval_batches(data: SequenceData, split: str = "test", batch_size: int = 256,
                 max_len: int = 200, users: Sequence[int] | None = None,
                 pad_to_max: bool = False) -> Iterator[Batch]:
    """Evaluation batches: history = the last max_len events before the held-out target.

    users: user rows to evaluate (default all); users without any history event are skipped.
    """
    target = target_rows(data, split)
    starts = data.offsets[:-1]
    users = np.arange(data.num_users) if users is None else np.asarray(users, dtype=np.int64)
    users = users[target[users] - starts[users] >= 1]
    for b in range(0, len(users), batch_size):
        u = users[b:b + batch_size]
        hist_len = np.minimum(target[u] - starts[u], max_len)
        width = max_len if pad_to_max else int(hist_len.max())
        rows, lengths = _recent_rows(starts[u], target[u], max_len, width)
        items, actions, timestamps = _gather(data, rows, lengths, width)
        yield Batch(items, actions, timestamps, torch.from_numpy(lengths.astype(np.int64)),
                    targets=None, target_items=torch.from_numpy(data.items[target[u]].astype(np.int64)),
                    users=u)


def pad_histories(histories: Sequence[tuple], max_len: int, pad_to_max: bool = False,
                  users: np.ndarray | None = None) -> Batch:
    """Batch arbitrary (items, actions, timestamps) histories, keeping the last max_len events each."""
    B = len(histories)
    if B == 0:
        raise ValueError("pad_histories needs at least one history")
    parts = [np.concatenate([np.asarray(h[k], dtype=np.int64).reshape(-1) for h in histories])
             for k in range(3)]
    full = np.array([len(np.asarray(h[0]).reshape(-1)) for h in histories], dtype=np.int64)
    for k, name in ((1, "actions"), (2, "timestamps")):
        if len(parts[k]) != len(parts[0]):
            raise ValueError(f"every history needs as many {name} as items")
    ends = np.cumsum(full)
    lengths = np.minimum(full, max_len)
    width = max_len if pad_to_max else max(int(lengths.max()), 1)
    rows = (ends - lengths)[:, None] + np.arange(width)[None, :]
    valid = np.arange(width)[None, :] < lengths[:, None]
    rows = np.where(valid, rows, 0)
    out = [torch.from_numpy(np.where(valid, p[rows] if len(p) else 0, 0).astype(np.int64))
           for p in parts]
    return Batch(out[0], out[1], out[2], torch.from_numpy(lengths), targets=None, target_items=None,
                 users=np.full(B, -1, dtype=np.int64) if users is None else np.asarray(users))


def training_events(data: SequenceData, end_offset: int = 2) -> tuple[np.ndarray, np.ndarray]:
    """Each user's events but the last end_offset (validation and test targets) -> CSR
    (offsets [U+1], items [E']): what anything fit on the data before training may see.
    `data` needs only CSR offsets and items."""
    offsets, items = np.asarray(data.offsets), np.asarray(data.items)
    lengths = np.diff(offsets)
    kept = np.maximum(lengths - end_offset, 0)  # training events per user
    pos = np.arange(len(items)) - np.repeat(offsets[:-1], lengths)  # each event's place in its user's list
    return np.concatenate([[0], np.cumsum(kept)]).astype(np.int64), items[pos < np.repeat(kept, lengths)]


def item_popularity(data: SequenceData, end_offset: int = 2) -> np.ndarray:
    """[I+1] int64 count of each item over training events (all but the last end_offset per user)."""
    return np.bincount(training_events(data, end_offset)[1], minlength=data.num_items + 1).astype(np.int64)
