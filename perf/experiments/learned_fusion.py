"""A learned served order: would a linear scorer over more of what the model knows about each of the
beam's candidates order them better than the served order (retrieval log-probability + w * ranker
logit + v * dense log-softmax + u * co-visitation score)?

On the validation split of all users of a validation-run model (its training never saw the split):
every candidate of the beam (PFA, beam 100) gets nine features: the log-probability of each of its
semantic ID's codes (the decoder run along the ID, as `multi_source_candidates` does; their sum is
the beam's score), the M-FALCON logit, the dense head's log-softmax, the co-visitation score (0 for
a model without that expert), log(1 + the item's count in the training events), and whether the user
has already seen it. A linear scorer, started at the served order's weights (1 per code, the
checkpoint's w, v and u for the logit, the dense head and co-visitation, 0 for the rest), is fit by a
softmax cross-entropy over each user's candidates (users whose target is among them), on one half of the users,
and measured on the other half, and the other way round (two folds, split at random with a fixed seed),
against the served order on the same users, once per seen-item policy.

With --retrieval-only the scorer sees only what generative retrieval knows (the four codes'
log-probabilities and the item's popularity), started at the beam order (1 per code, 0 for popularity)
and measured against it: can a re-weighting of its own levels lift retrieval alone?

Needs the validation-run model (`make train-beauty`). Run from the repository root:
    python -m perf.experiments.learned_fusion        # -> perf/results/learned_fusion.json
    python -m perf.experiments.learned_fusion --retrieval-only   # -> perf/results/learned_fusion_retrieval.json
    python -m perf.experiments.learned_fusion --users 2000 --out -   # quick check
"""
import argparse
from pathlib import Path

import numpy as np
import torch

from backend_src.data.loaders import load_dataset
from backend_src.data.sequences import item_popularity
from backend_src.evaluation import SEEN_POLICIES
from backend_src.metrics import METRIC_NAMES
from backend_src.model.recommender import GenerativeRecommender, seen_in_history
from perf.common import RESULTS_DIR, host_load, log, save_result
from perf.experiments.multi_source_candidates import NEG_INF, collect, metrics

FEATURES = ("log_prob_code0", "log_prob_code1", "log_prob_code2", "log_prob_code3", "ranker_logit",
            "dense_log_softmax", "covisit", "log_popularity", "seen")
RETRIEVAL_FEATURES = ("log_prob_code0", "log_prob_code1", "log_prob_code2", "log_prob_code3", "log_popularity")


def features(model, data, dense_top=0, users=None):
    """Per validation user: multi_source_candidates' candidates (the beam's, then the dense head's top
    `dense_top` items not among them; 0 = a duplicate), their FEATURES [U, C, F], the history and the target."""
    p = collect(model, data, dense_top, users)
    log_popularity = torch.from_numpy(np.log1p(item_popularity(data, end_offset=2))).float()
    seen = seen_in_history(p["union"], p["history"]).float()
    x = torch.cat([p["levels"], p["rank"][..., None], p["dense"][..., None], p["covisit"][..., None],
                   log_popularity[p["union"]][..., None], seen[..., None]], -1)
    return {"union": p["union"], "features": x, "history": p["history"], "target": p["target"]}


def fit(x, valid, target_pos, w0, steps=300, l2=1e-3):
    """Linear weights [F] by the mean softmax cross-entropy of the target over each row's valid
    candidates (rows with the target among them), plus l2 * |w - w0|^2. x: features, 0 where not valid."""
    rows = target_pos >= 0
    x, valid, target_pos = x[rows], valid[rows], target_pos[rows]
    w = w0.clone().requires_grad_(True)
    opt = torch.optim.LBFGS([w], lr=0.5, max_iter=steps, line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        scores = (x @ w).masked_fill(~valid, NEG_INF)
        loss = torch.nn.functional.cross_entropy(scores, target_pos) + l2 * (w - w0).square().sum()
        loss.backward()
        return loss

    opt.step(closure)
    return w.detach()


def two_folds(p, w0, exclude, names=FEATURES, reference="served", seed=0):
    """The reference order (weights w0 over the features `names`) and the learned one, each measured on the half
    of the users the weights were not fit on, both folds; means over the folds weighted by users."""
    x = p["features"]
    seen = x[..., FEATURES.index("seen")] > 0
    valid = (p["union"] > 0) & torch.isfinite(x).all(-1) & ~(seen & exclude)
    hit = (p["union"] == p["target"][:, None]) & valid
    target_pos = torch.where(hit.any(1), hit.float().argmax(1), torch.full_like(p["target"], -1))
    x = torch.where(valid[..., None], x, torch.zeros(()))  # -inf features of empty slots never enter
    x = x[..., [FEATURES.index(f) for f in names]]
    order = torch.from_numpy(np.random.default_rng(seed).permutation(len(x)))
    halves = (order[: len(x) // 2], order[len(x) // 2:])
    sums = {reference: {}, "learned": {}}
    weights = []
    for fit_on, test_on in (halves, halves[::-1]):
        w = fit(x[fit_on], valid[fit_on], target_pos[fit_on], w0)
        weights.append([round(float(v), 4) for v in w])
        sub = {k: v[test_on] for k, v in p.items()}
        for name, wv in ((reference, w0), ("learned", w)):
            scores = x[test_on] @ wv
            m = metrics(sub, scores.masked_fill(~valid[test_on], NEG_INF), sub["union"], exclude)
            for k in METRIC_NAMES:
                sums[name][k] = sums[name].get(k, 0.0) + m[k] * len(test_on)
    out = {name: {k: v / len(x) for k, v in s.items()} for name, s in sums.items()}
    out["weights_per_fold"] = weights
    out["target_among_candidates"] = float((target_pos >= 0).float().mean())
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", default="amazon-beauty")
    ap.add_argument("--checkpoint", default="runs/beauty/model.pt", help="a validation-run model")
    ap.add_argument("--dense-top", type=int, default=0,
                    help="also the dense head's top N items not among the beam's (multi_source_candidates' union)")
    ap.add_argument("--users", type=int, default=0, help="the first N users (default 0: all)")
    ap.add_argument("--retrieval-only", action="store_true",
                    help="only the codes' log-probabilities and popularity, against the beam order")
    ap.add_argument("--out", type=Path, default=None, help="'-': print only (default perf/results/learned_fusion.json, "
                                                          "learned_fusion_retrieval.json with --retrieval-only)")
    args = ap.parse_args()
    out = args.out or RESULTS_DIR / ("learned_fusion_retrieval.json" if args.retrieval_only else "learned_fusion.json")
    torch.set_num_threads(2)
    load_start = host_load()
    model = GenerativeRecommender.load(args.checkpoint).eval()
    data = load_dataset(args.data)
    users = np.arange(min(args.users, data.num_users)) if args.users else None
    p = features(model, data, args.dense_top, users)
    rows = []
    names, reference = (RETRIEVAL_FEATURES, "beam") if args.retrieval_only else (FEATURES, "served")
    for exclude in (False, True):
        if args.retrieval_only:
            w0 = torch.tensor([1.0, 1.0, 1.0, 1.0, 0.0])  # the beam's score: the sum of its codes' log-probabilities
        else:
            w_rank, w_dense, w_covisit = model.cfg.fusion_weights(exclude)  # the served order's
            w0 = torch.tensor([1.0, 1.0, 1.0, 1.0, w_rank, w_dense, w_covisit, 0.0, 0.0])
        r = two_folds(p, w0, exclude, names, reference)
        rows.append(dict(dataset=args.data, checkpoint=args.checkpoint, seen=SEEN_POLICIES[exclude], users=len(p["target"]),
                         dense_top=args.dense_top, features=list(names), **r))
        for name in (reference, "learned"):
            log(f"{SEEN_POLICIES[exclude]} {name}: " + " ".join(f"{m}={r[name][m]:.4f}" for m in METRIC_NAMES))
        log(f"weights per fold: {r['weights_per_fold']}")
    if str(out) != "-":
        save_result(out, rows, "perf.experiments.learned_fusion", None, load_start)


if __name__ == "__main__":
    main()
