"""Candidates from two sources ranked together (as in "Unifying Generative and Dense Retrieval for
Sequential Recommendation", LIGER): does adding the dense head's top items to the beam's lift the
served order? On the validation split of all users of each trained model:

- candidates: the beam's W (PFA, beam 100) and the dense head's top M items not already among them;
- every candidate gets its M-FALCON logit, the dense head's log-softmax and its retrieval
  log-probability: the decoder scored along the candidate's own semantic ID (teacher forcing, full
  attention, the same constrained softmax as the beam; for the beam's own candidates it equals the
  beam's log-probability wherever PFA keeps every history row, as at histories of 50);
- the order w_retrieval * log-prob + w_rank * logit + w_dense * dense log-prob on a grid, over the
  union and over the beam's candidates alone (the dense head as a third score, no new candidates),
  against the served order over the beam (the checkpoint's fusion weights).

Needs trained models (`make train-beauty`, `make train-scientific`). Run from the repository root:
    python -m perf.experiments.multi_source_candidates      # -> perf/results/multi_source_candidates.json
    python -m perf.experiments.multi_source_candidates --users 300 --out -   # quick check
"""
import argparse
import itertools
from pathlib import Path

import numpy as np
import torch

from backend_src import ops
from backend_src.config import DecodeOptions
from backend_src.data.loaders import load_dataset
from backend_src.data.sequences import eval_batches
from backend_src.evaluation import SEEN_POLICIES
from backend_src.metrics import METRIC_NAMES, MetricAccumulator
from backend_src.model.recommender import GenerativeRecommender, fuse, served_order
from perf.common import RESULTS_DIR, host_load, log, save_result

NEG_INF = float("-inf")
GRID = {"w_rank": (0.25, 0.5, 0.75, 1.0, 1.5), "w_dense": (0.0, 0.25, 0.5, 1.0), "w_retrieval": (0.5, 1.0)}


@torch.no_grad()
def retrieval_log_probs(model, states, lengths, items, per_level=False):
    """log p(semantic ID of item | history) [B, C] for items [B, C] (0 = none: -inf): the decoder
    run along each item's codes, full attention, each step's softmax over the codes that continue
    an item (as the constrained beam search normalizes). per_level: each code's term, [B, C, L]."""
    dec, cb = model.decoder, model.codebook
    B, C = items.shape
    codes = cb.codes[items].clamp_min(0)  # [B, C, L]
    user_state = states[torch.arange(B), lengths - 1]
    prefix = torch.zeros(B, C, dtype=torch.long)
    prefix_emb = torch.zeros(B, C, dec.d_model)
    lp = torch.zeros(B, C, dec.num_steps)
    for t in range(dec.num_steps):
        x, q = dec.query(user_state, prefix_emb, t)
        K, V = dec.project_step(states, t)
        nodes = cb.next_prefixes(prefix, t) if dec.has_node_output(t) else None
        logits = dec.head(x, ops.decode_attention(q, K, V, lengths), t, nodes=nodes) + cb.code_bias(prefix, t)
        lp[..., t] = torch.log_softmax(logits.float(), -1).gather(2, codes[..., t, None])[..., 0]
        prefix = cb.advance(prefix, codes[..., t], t)
        if t + 1 < dec.num_steps:
            prefix_emb = prefix_emb + dec.code_embedding(codes[..., t], t)
    lp = lp.masked_fill((items == 0)[..., None], NEG_INF)
    return lp if per_level else lp.sum(-1)


@torch.no_grad()
def collect(model, data, dense_top, users=None):
    """Per validation user: the union of candidates (the beam's first, then the dense head's new
    ones; 0 = a duplicate) with each one's three scores (and its retrieval log-probability code by
    code, "levels"), the history and the target."""
    opts = DecodeOptions(mode="pfa", beam_width=100, k=256)
    parts = {k: [] for k in ("union", "log_prob", "levels", "rank", "dense", "covisit", "history", "target", "beam_gap")}
    for b in eval_batches(data, split="valid", batch_size=128, max_len=model.cfg.max_seq_len, users=users):
        cache = model.encode(b.items, b.actions, b.timestamps, b.lengths)
        beams = model.retrieve(cache, opts)
        dense = torch.log_softmax(model.dense_scores(cache.last_states()), -1)
        top = torch.topk(dense, dense_top, 1).indices
        new = top.masked_fill((top[:, :, None] == beams.item_ids[:, None, :]).any(-1), 0)
        union = torch.cat([beams.item_ids, new], 1)
        levels = retrieval_log_probs(model, cache.states, cache.lengths, union, per_level=True)
        log_prob = levels.sum(-1)
        live = torch.isfinite(beams.log_probs)
        parts["beam_gap"].append((log_prob[:, :beams.log_probs.shape[1]][live] - beams.log_probs[live]).abs().max()[None])
        history = torch.zeros(len(b.lengths), model.cfg.max_seq_len, dtype=torch.long)
        history[:, :b.items.shape[1]] = b.items
        covisit = model.covisit_scores(history, union)
        for k, v in (("union", union), ("log_prob", log_prob), ("levels", levels), ("rank", model.rank(cache, union)),
                     ("dense", dense.gather(1, union)), ("history", history), ("target", b.target_items),
                     ("covisit", torch.zeros(union.shape) if covisit is None else covisit)):
            parts[k].append(v)
    return {k: torch.cat(v) for k, v in parts.items()}


def metrics(p, scores, candidates, exclude):
    items = served_order(scores, scores, candidates, p["history"], rank_by="ranker", exclude_seen=exclude, top_k=10)[0]
    acc = MetricAccumulator((5, 10))
    acc.update(items, p["target"])
    return acc.compute()


def compare(p, beam_width, weights):
    """Rows: the served order over the beam (the checkpoint's weights), and the best order on the
    grid over the beam's candidates and over the union, for each seen-item policy."""
    beam = slice(0, beam_width)
    covered = lambda c: float((c == p["target"][:, None]).any(1).float().mean())  # noqa: E731
    out = {"coverage_beam": covered(p["union"][:, beam]), "coverage_union": covered(p["union"]),
           "candidates_union_mean": float((p["union"] > 0).sum(1).float().mean())}
    for exclude in (False, True):
        policy = SEEN_POLICIES[exclude]
        w, v, u = weights[exclude]
        base = fuse(p["rank"][:, beam], p["log_prob"][:, beam], w, p["dense"][:, beam], v, p["covisit"][:, beam], u)
        out[f"beam_fused/{policy}"] = dict(metrics(p, base, p["union"][:, beam], exclude), w_rank=w, w_dense=v,
                                           w_covisit=u)
        for name, cols in (("beam_dense_best", beam), ("union_best", slice(None))):
            grid = []
            for wr, wd, wl in itertools.product(*GRID.values()):
                s = (wl * p["log_prob"][:, cols] + wr * p["rank"][:, cols] + wd * p["dense"][:, cols]
                     + u * p["covisit"][:, cols])  # the co-visitation expert at the served weight
                s = s.masked_fill((p["union"][:, cols] == 0) | (p["rank"][:, cols] == NEG_INF), NEG_INF)
                grid.append(dict(metrics(p, s, p["union"][:, cols], exclude), w_rank=wr, w_dense=wd, w_retrieval=wl))
            out[f"{name}/{policy}"] = max(grid, key=lambda r: r["ndcg@10"])
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", nargs="+", default=["amazon-beauty=runs/beauty/model.pt",
                                                  "amazon-scientific=runs/scientific/model.pt"],
                    help="DATA=CHECKPOINT pairs (validation-run models: the split must be unseen by training)")
    ap.add_argument("--dense-top", type=int, default=100, help="the dense head's top items added (before duplicates)")
    ap.add_argument("--users", type=int, default=0, help="the first N users (default 0: all)")
    ap.add_argument("--out", type=Path, default=RESULTS_DIR / "multi_source_candidates.json", help="'-': print only")
    args = ap.parse_args()
    torch.set_num_threads(2)
    load_start = host_load()
    rows = []
    for run in args.runs:
        data_name, checkpoint = run.split("=", 1)
        model = GenerativeRecommender.load(checkpoint).eval()
        data = load_dataset(data_name)
        users = np.arange(min(args.users, data.num_users)) if args.users else None
        p = collect(model, data, args.dense_top, users)
        row = dict(dataset=data_name, checkpoint=checkpoint, users=len(p["target"]), dense_top=args.dense_top,
                   beam_log_prob_max_gap=float(p["beam_gap"].max()),
                   **compare(p, 100, {e: model.cfg.fusion_weights(e) for e in (False, True)}))
        rows.append(row)
        for k, v in row.items():
            if isinstance(v, dict):
                log(f"{data_name} {k}: " + " ".join(f"{m}={v[m]:.4f}" for m in METRIC_NAMES)
                    + " " + " ".join(f"{n}={v[n]}" for n in v if n.startswith("w_")))
        log(f"{data_name} coverage beam {row['coverage_beam']:.4f} union {row['coverage_union']:.4f}")
    if str(args.out) != "-":
        save_result(args.out, rows, "perf.experiments.multi_source_candidates", None, load_start)


if __name__ == "__main__":
    main()
