"""Offline evaluation over the full item catalog (never sampled metrics).

For every test user: encode the history once, retrieve `beam_width` items by constrained
semantic-ID beam search (retrieval order = beam log-probability), rank the same candidates with
M-FALCON against the cached history, and score the held-out item in each order: the beam's, the
ranker's and the served (fused) one, which adds the auxiliary dense head's log-softmax (state .
item embedding over all items) as a third expert and the co-visitation score as a fourth. The
dense head's own top items are reported as a diagnostic.
"""
from __future__ import annotations

import time

import torch
from tqdm import tqdm

from backend_src.config import DecodeOptions
from backend_src.data.sequences import eval_batches
from backend_src.metrics import MetricAccumulator
from backend_src.model.recommender import log_softmax_at, served_order

SEEN_POLICIES = ("seen_included", "seen_excluded")  # indexed by exclude (False, True)


def drop_seen(cands: torch.Tensor, scores: torch.Tensor, history: torch.Tensor, exclude: bool = True,
              top_k: int | None = None) -> torch.Tensor:
    """Candidates [B, W] ordered by one score [B, W] (the beam's log-probability, the dense head's)
    under the served order's rules (`served_order` with that score as the ranker's): best first,
    ties in candidate order, empty slots (item 0, a score of -inf and, with `exclude`, items
    already in the history [B, N]) at the end as 0. The first top_k (default: all W)."""
    top_k = cands.shape[1] if top_k is None else top_k
    return served_order(scores, scores, cands, history, rank_by="ranker", exclude_seen=exclude, top_k=top_k)[0]


@torch.no_grad()
def evaluate(
    model,
    data,
    split: str = "test",
    options: DecodeOptions | None = None,
    batch_size: int = 64,
    max_users: int | None = None,
    users=None,  # explicit user rows (overrides max_users)
    rank: bool = True,
    dense: bool = True,
    fusion_weights=(),  # extra orders "fused@w,v,u": (w, v, u) weights of the fused order (`fuse`)
    ks=(5, 10),
    progress: bool = True,
) -> dict:
    """Returns {"<order>/<seen policy>": {"recall@5": ..., ...}, "timing": {...}}."""
    options = options or DecodeOptions()
    model.eval()
    if users is None and max_users is not None:
        users = range(min(max_users, data.num_users))
    acc: dict[str, MetricAccumulator] = {}
    t_retrieve = t_rank = 0.0
    batches = eval_batches(data, split=split, batch_size=batch_size, max_len=model.cfg.max_seq_len, users=users)
    for batch in tqdm(batches, desc=f"eval {split}", disable=not progress, leave=False, mininterval=2.0):
        cache = model.encode(batch.items, batch.actions, batch.timestamps, batch.lengths)
        t0 = time.perf_counter()
        beams = model.retrieve(cache, options)
        t_retrieve += time.perf_counter() - t0
        # each order ranks through served_order, the server's own: {name: exclude_seen -> items [B, max(ks)]}
        orders = {"retrieval": lambda excl: drop_seen(beams.item_ids, beams.log_probs, batch.items, excl, max(ks))}
        dense_scores = model.dense_scores(cache.last_states())  # [B, I+1]: every item, once per batch
        if rank:
            t0 = time.perf_counter()
            rank_scores = model.rank(cache, beams.item_ids)
            dense_log_probs = log_softmax_at(dense_scores, beams.item_ids)
            covisit = model.covisit_scores(batch.items, beams.item_ids)
            t_rank += time.perf_counter() - t0

            def served(excl, rank_by, weights=(0.0, 0.0, 0.0)):
                return served_order(rank_scores, beams.log_probs, beams.item_ids, batch.items, rank_by=rank_by,
                                    fusion_weight=weights[0], dense_log_probs=dense_log_probs, dense_weight=weights[1],
                                    covisit_scores=covisit, covisit_weight=weights[2], exclude_seen=excl,
                                    top_k=max(ks))[0]

            orders["ranked"] = lambda excl: served(excl, "ranker")
            # the product of the experts, with the weights the checkpoint holds for each seen-item
            # policy (as served)
            orders["fused"] = lambda excl: served(excl, "fused", model.cfg.fusion_weights(excl))
            for wv in fusion_weights:
                orders[fused_name(*wv)] = lambda excl, wv=wv: served(excl, "fused", wv)
        if dense:
            top = torch.topk(dense_scores, max(options.beam_width, max(ks)) + batch.items.shape[1], dim=1)
            orders["dense"] = lambda excl: drop_seen(top.indices, top.values, batch.items, excl, max(ks))
        for name, ranked in orders.items():
            for excl in (False, True):
                key = f"{name}/{SEEN_POLICIES[excl]}"
                acc.setdefault(key, MetricAccumulator(ks)).update(ranked(excl), batch.target_items)
    out = {k: a.compute() for k, a in acc.items()}
    n = next(iter(acc.values())).count if acc else 0
    out["timing"] = {"users": n, "retrieve_s": t_retrieve, "rank_s": t_rank}
    return out


# the fused order's weights tried on validation: every ranker weight w, dense weight v and, where
# the model has the co-visitation expert, co-visitation weight u
RANK_WEIGHTS = (0.0, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0)
DENSE_WEIGHTS = (0.0, 0.25, 0.5, 0.75, 1.0, 1.5)
COVISIT_WEIGHTS = (0.0, 1.0, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0)


def fusion_grid(model) -> tuple[tuple[float, float, float], ...]:
    covisit = COVISIT_WEIGHTS if model.covisitation is not None else (0.0,)
    return tuple((w, v, u) for w in RANK_WEIGHTS for v in DENSE_WEIGHTS for u in covisit)


def fused_name(w: float, v: float, u: float) -> str:
    """The evaluation's name of the fused order with ranker weight w, dense weight v and
    co-visitation weight u."""
    return f"fused@{w:g},{v:g},{u:g}"


def tune_fusion_weights(model, data, options: DecodeOptions | None = None, weights=None,
                        metric: str = "ndcg@10", progress: bool = True) -> tuple[dict, dict]:
    """For each seen-item policy, the (ranker, dense, co-visitation) weights of the fused order
    with the best validation `metric` with that policy applied (over `weights`, default
    `fusion_grid(model)`): ({policy: (w, v, u)}, {policy: {(w, v, u): validation metrics}}). Ties
    go to the smaller co-visitation weight, then the smaller dense weight, then the ranker weight
    nearest 1. Never looks at the test split."""
    weights = fusion_grid(model) if weights is None else weights
    res = evaluate(model, data, "valid", options, dense=False, fusion_weights=weights, progress=progress)
    best, tables = {}, {}
    for policy in SEEN_POLICIES:
        table = tables[policy] = {wvu: res[f"{fused_name(*wvu)}/{policy}"] for wvu in weights}
        best[policy] = max(weights, key=lambda wvu: (table[wvu][metric], -wvu[2], -wvu[1], -abs(wvu[0] - 1.0)))
    return best, tables
