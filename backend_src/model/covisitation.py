"""Item-to-item co-visitation: the served order's fourth expert.

The beam, the ranker and the dense head all read the history through the backbone; none of them
keeps the plainest evidence a sequential catalog has, how often item b was the next (or one of the
next few) after item a in the training events. Counting it is the oldest candidate and ranking
signal of large recommenders (item-to-item "co-visitation" tables); here it scores the beam's
candidates beside the three learned experts.

Counts, over the training events of every user (the events the model was trained on, nothing of
the held-out targets), for each pair of events `a` at position i and `b` at position i + g,
1 <= g <= window:

    C[a, b] = sum over such pairs of DECAY^(g - 1)

and a candidate c after a history h_1..h_n is scored by how often it followed the last `window`
items at the same distance:

    covisit(h, c) = log(1 + sum_{g=1..window} DECAY^(g - 1) * C[h_{n+1-g}, c])

The table is stored as the sorted pair keys a * (num_items + 1) + b with their weights: the
lookups of a batch (every user, window position and candidate) are one `searchsorted`, never a loop
over users or candidates.
"""
from __future__ import annotations

import numpy as np
import torch
from torch import nn

from backend_src import ops

DECAY = 0.5  # the weight of a pair one event further apart, in the counts and in the score


class CoVisitation(nn.Module):
    def __init__(self, num_items: int, window: int):
        super().__init__()
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self.num_items, self.window = num_items, window
        self.register_buffer("pair_keys", torch.zeros(0, dtype=torch.long))  # sorted a * (I + 1) + b
        self.register_buffer("pair_weights", torch.zeros(0))  # C[a, b] of each key

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        for name in ("pair_keys", "pair_weights"):  # the stored table's size, not the empty one's
            if prefix + name in state_dict:
                setattr(self, name, torch.empty_like(state_dict[prefix + name]))
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def fit(self, offsets: np.ndarray, items: np.ndarray) -> "CoVisitation":
        """Count the pairs of the events `items` (item indices), user u's being
        items[offsets[u]:offsets[u + 1]] in time order (the CSR of `sequences.training_events`)."""
        offsets, items = np.asarray(offsets, dtype=np.int64), np.asarray(items, dtype=np.int64)
        user = np.repeat(np.arange(len(offsets) - 1), np.diff(offsets))
        keys, weights = [], []
        for g in range(1, self.window + 1):
            same = user[:-g] == user[g:]
            keys.append(items[:-g][same] * (self.num_items + 1) + items[g:][same])
            weights.append(np.full(int(same.sum()), DECAY ** (g - 1)))
        unique, inverse = np.unique(np.concatenate(keys), return_inverse=True)
        self.pair_keys = torch.from_numpy(unique)
        self.pair_weights = torch.from_numpy(np.bincount(inverse, weights=np.concatenate(weights))).float()
        return self

    @property
    def pairs(self) -> int:
        return int(self.pair_keys.numel())

    def scores(self, history: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
        """history [B, N] item indices, each row's events first and 0 after them (padding);
        candidates [B, W] item indices (0 = empty) -> [B, W] covisit(history, candidate)."""
        candidates = candidates.to(self.pair_keys.device)
        if not self.pairs or history.shape[1] == 0:
            return torch.zeros(candidates.shape, dtype=torch.float32, device=candidates.device)
        history = history.to(candidates.device)
        kernels = ops.fused_cpu_kernels(self.pair_weights) if candidates.device.type == "cpu" else None
        if kernels is not None:  # one compiled call (cpu_kernels) instead of ~15 op calls
            out = torch.empty(candidates.shape, dtype=torch.float32)
            kernels.covisit_scores(history.long().contiguous().numpy(), candidates.long().contiguous().numpy(), self.pair_keys.numpy(),
                                   self.pair_weights.numpy(), self.num_items, self.window, DECAY, out.numpy())
            return out
        gaps = torch.arange(1, self.window + 1, device=candidates.device)  # [G]
        at = (history > 0).sum(1, keepdim=True) - gaps  # [B, G]: where h_{n+1-g} is, < 0 where the history is shorter
        before = history.gather(1, at.clamp_min(0)).masked_fill(at < 0, 0)  # [B, G], 0 = none
        # an item the counts never saw (the unknown item, a catalog addition: rows past num_items) has none
        before = before.masked_fill(before > self.num_items, 0)
        candidates = candidates.masked_fill(candidates > self.num_items, 0)
        query = before[:, :, None] * (self.num_items + 1) + candidates[:, None, :]  # [B, G, W]; item 0 never in a key
        found = torch.searchsorted(self.pair_keys, query).clamp_max(self.pairs - 1)
        counts = torch.where(self.pair_keys[found] == query, self.pair_weights[found], 0.0)
        decay = DECAY ** (gaps - 1).float()  # [G]
        return torch.log1p((counts * decay[None, :, None]).sum(1))
