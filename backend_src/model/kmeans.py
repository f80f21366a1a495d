"""k-means for vector quantization: Lloyd's algorithm with k-means++ seeding ("k-means++: The
Advantages of Careful Seeding"), optionally with a cap on each cluster's size. Shared by the residual
k-means of semantic_ids.py and the codebook start of the RQ-VAE (rq_vae.py)."""
from __future__ import annotations

import torch


def sq_dists(x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """Squared euclidean distances [n, k] via one matmul: |x|^2 - 2 x.c + |c|^2."""
    d = (x * x).sum(1, keepdim=True) - 2.0 * x @ c.T + (c * c).sum(1)[None, :]
    return d.clamp_min_(0.0)


def kmeans_pp_init(x: torch.Tensor, k: int, gen: torch.Generator) -> torch.Tensor:
    """k-means++ seeding: each new center drawn with probability proportional to D(x)^2."""
    n = x.shape[0]
    centers = torch.empty(k, x.shape[1], dtype=x.dtype)
    centers[0] = x[torch.randint(n, (1,), generator=gen)]
    d2 = sq_dists(x, centers[:1]).squeeze(1)
    for j in range(1, k):
        total = d2.sum()
        if total <= 0:  # every point already coincides with a center: pick uniformly
            idx = torch.randint(n, (1,), generator=gen)
        else:
            idx = torch.multinomial(d2 / total, 1, generator=gen)
        centers[j] = x[idx]
        d2 = torch.minimum(d2, sq_dists(x, centers[j : j + 1]).squeeze(1))
    return centers


def balanced_assign(d: torch.Tensor, capacity: int) -> torch.Tensor:
    """d [n, k] distances -> assignments [n] with at most `capacity` points a cluster (capacity * k >= n).
    Rounds of proposals: every unassigned point proposes to its nearest cluster with room, and each
    cluster takes its closest proposers up to its room; a point turned away proposes again."""
    n, k = d.shape
    if capacity * k < n:
        raise ValueError(f"{k} clusters of {capacity} cannot hold {n} points")
    assign = torch.full((n,), -1, dtype=torch.long)
    room = torch.full((k,), capacity, dtype=torch.long)
    todo = torch.arange(n)
    while len(todo):
        dt = d[todo].masked_fill(room[None, :] == 0, float("inf"))
        dist, choice = dt.min(1)
        # each cluster's proposers, closest first: sort by distance, then (stably) by cluster
        order = torch.argsort(dist)
        order = order[torch.sort(choice[order], stable=True).indices]
        chosen = choice[order]
        first = torch.searchsorted(chosen, torch.arange(k))  # where each cluster's run starts
        rank = torch.arange(len(order)) - first[chosen]
        taken = order[rank < room[chosen]]
        assign[todo[taken]] = choice[taken]
        room -= torch.bincount(choice[taken], minlength=k)
        todo = todo[assign[todo] < 0]
    return assign


def kmeans(x: torch.Tensor, k: int, iters: int = 25, seed: int = 0, balanced: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Lloyd's k-means with k-means++ seeding. x [n, D] -> (assignments [n], centers [k', D]),
    k' = min(k, n). An empty cluster is re-seeded with the point farthest from its center.
    balanced: every cluster holds at most ceil(n / k') points (balanced_assign at every step)."""
    x = x.float()
    n = x.shape[0]
    k = max(1, min(k, n))
    capacity = -(-n // k)
    gen = torch.Generator().manual_seed(seed)
    centers = kmeans_pp_init(x, k, gen)
    assign = torch.zeros(n, dtype=torch.long)
    for _ in range(iters):
        d = sq_dists(x, centers)
        if balanced:
            assign = balanced_assign(d, capacity)
            dmin = d.gather(1, assign[:, None]).squeeze(1)
        else:
            dmin, assign = d.min(1)
        counts = torch.bincount(assign, minlength=k)
        sums = torch.zeros_like(centers).index_add_(0, assign, x)
        new = sums / counts.clamp_min(1)[:, None].to(x.dtype)
        empty = counts == 0
        if empty.any():
            # reseed empty clusters on the worst-fit points (distinct points for distinct clusters)
            far = torch.topk(dmin, int(empty.sum()), sorted=True).indices
            new[empty] = x[far]
        if torch.allclose(new, centers):
            centers = new
            break
        centers = new
    d = sq_dists(x, centers)
    assign = balanced_assign(d, capacity) if balanced else d.argmin(1)
    return assign, centers
