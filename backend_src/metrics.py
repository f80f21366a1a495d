"""Full-catalog top-K ranking metrics with one held-out item per user (leave-one-out).

With a single relevant item, Recall@k is the hit rate (is the target among the first k?) and
NDCG@k = 1 / log2(rank + 2) for a 0-based rank < k, else 0 (the ideal DCG is 1).
Item index 0 is padding: it is never a valid recommendation and marks an empty slot in a ranking.
"""
from __future__ import annotations

from typing import Dict, Iterable, Optional

import torch

METRIC_NAMES = ("recall@5", "ndcg@5", "recall@10", "ndcg@10")  # what the default ks=(5, 10) reports, in order


def topk_full_catalog(
    scores: torch.Tensor,  # [B, I+1] a score for every item index (column 0 = padding)
    k: int,
    exclude: Optional[torch.Tensor] = None,  # [B, N] item indices to leave out (0 = padding)
) -> torch.Tensor:
    """The k best item indices per row, [B, k] long, best first.

    Padding index 0 is never returned as an item; items in `exclude` (e.g. the user's already-seen
    history) are masked out. Slots left without any allowed item hold 0.
    """
    scores = scores.detach().to(torch.float32).clone()
    scores[:, 0] = float("-inf")
    if exclude is not None:
        # index 0 in the padded history only re-masks the padding column
        scores.scatter_(1, exclude.to(scores.device, torch.long), float("-inf"))
    k = min(k, scores.shape[1])
    values, ranked = torch.topk(scores, k, dim=1)
    return ranked.masked_fill(torch.isneginf(values), 0)


def _per_user(ranked: torch.Tensor, targets: torch.Tensor, ks: Iterable[int]) -> Dict[str, torch.Tensor]:
    """Per-user recall@k / ndcg@k values, each [B] float64."""
    ks = tuple(ks)
    if ranked.dim() != 2 or targets.dim() != 1 or ranked.shape[0] != targets.shape[0]:
        raise ValueError(f"need ranked [B, K] and targets [B], got {tuple(ranked.shape)} and {tuple(targets.shape)}")
    if ranked.shape[1] < max(ks):
        raise ValueError(f"ranking holds {ranked.shape[1]} items, fewer than k={max(ks)}")
    targets = targets.to(ranked.device, torch.long)
    # [B, K] True where the slot holds the target; empty slots (0) and padding targets never hit
    hit = (ranked == targets[:, None]) & (ranked != 0)
    discount = 1.0 / torch.log2(torch.arange(ranked.shape[1], device=ranked.device, dtype=torch.float64) + 2.0)
    out = {}
    for k in ks:
        h = hit[:, :k].to(torch.float64)
        out[f"recall@{k}"] = h.amax(dim=1)  # any hit among the first k
        out[f"ndcg@{k}"] = (h * discount[:k]).amax(dim=1)  # one relevant item: its discount, or 0
    return out


def ranking_metrics(
    ranked: torch.Tensor,  # [B, K] item indices, best first; 0 = empty slot
    targets: torch.Tensor,  # [B] the held-out item of each user
    ks: Iterable[int] = (5, 10),
) -> Dict[str, float]:
    """Mean recall@k and ndcg@k over the batch, keys "recall@5", "ndcg@5", ..."""
    return {name: float(v.mean()) for name, v in _per_user(ranked, targets, ks).items()}


class MetricAccumulator:
    """Sums per-user metric values over batches; `compute()` gives the means and the user count."""

    def __init__(self, ks: Iterable[int] = (5, 10)):
        self.ks = tuple(ks)
        self.sums: Dict[str, float] = {}
        self.count = 0

    def update(self, ranked: torch.Tensor, targets: torch.Tensor) -> None:
        for name, v in _per_user(ranked, targets, self.ks).items():
            self.sums[name] = self.sums.get(name, 0.0) + float(v.sum())
        self.count += int(targets.shape[0])

    def compute(self) -> Dict[str, float]:
        out = {name: (s / self.count if self.count else 0.0) for name, s in self.sums.items()}
        out["count"] = self.count
        return out
