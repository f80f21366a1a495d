"""Does the dense head's log-softmax, as a third expert beside the ranker logit and the retrieval
log-probability, lift the served order on Amazon Beauty? Weights chosen on the validation split of all
users (NDCG@10), then the test split, beside the checkpoint's own fusion weights. Needs a trained model
(`make train-beauty`). Run from the repository root:
    python -m perf.experiments.dense_expert_beauty    # writes perf/results/dense_expert_beauty.txt
    python -m perf.experiments.dense_expert_beauty --users 200 --out -   # quick check
"""
import argparse
import itertools
from pathlib import Path

import numpy as np
import torch

from backend_src.config import DecodeOptions
from backend_src.data.loaders import load_dataset
from backend_src.data.sequences import eval_batches
from backend_src.evaluation import drop_seen
from backend_src.metrics import METRIC_NAMES, MetricAccumulator
from backend_src.model.recommender import GenerativeRecommender
from perf.common import RESULTS_DIR


def collect(model, data, split, opts, users=None):
    """Per batch: candidates, their retrieval log-probs, ranker logits, dense log-softmax, history, target."""
    out = []
    with torch.no_grad():
        for b in eval_batches(data, split=split, batch_size=256, max_len=model.cfg.max_seq_len, users=users):
            cache = model.encode(b.items, b.actions, b.timestamps, b.lengths)
            beams = model.retrieve(cache, opts)
            rank = model.rank(cache, beams.item_ids)
            last = cache.states[torch.arange(len(b.lengths)), b.lengths - 1]
            dense = torch.gather(torch.log_softmax(model.dense_scores(last), -1), 1, beams.item_ids)
            out.append((beams.item_ids, beams.log_probs, rank, dense, b.items, b.target_items))
    return out


def score(parts, w_rank, w_dense, exclude_seen):
    acc = MetricAccumulator((5, 10))
    for cands, log_probs, rank, dense, history, target in parts:
        s = (log_probs + w_rank * rank + w_dense * dense).masked_fill(rank == float("-inf"), float("-inf"))
        acc.update(drop_seen(cands, s, history, exclude=exclude_seen)[:, :10], target)
    return acc.compute()


def line(metrics):
    return " ".join(f"{k}={metrics[k]:.4f}" for k in METRIC_NAMES)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("checkpoint", nargs="?", default="runs/beauty/model.pt")
    ap.add_argument("--data", default="amazon-beauty")
    ap.add_argument("--max-users", type=int, default=None, help="load only the first N users (as the checkpoint was trained)")
    ap.add_argument("--users", type=int, default=0, help="first N users of each split (default 0: all)")
    ap.add_argument("--out", type=Path, default=RESULTS_DIR / "dense_expert_beauty.txt", help="text file ('-': stdout only)")
    args = ap.parse_args()
    torch.set_num_threads(2)
    model = GenerativeRecommender.load(args.checkpoint)
    data = load_dataset(args.data, max_users=args.max_users)
    users = np.arange(min(args.users, data.num_users)) if args.users else None
    opts = DecodeOptions(mode="pfa", beam_width=100, k=256)
    valid, test = collect(model, data, "valid", opts, users), collect(model, data, "test", opts, users)
    lines = []

    def say(text):
        lines.append(text)
        print(text, flush=True)

    grid = list(itertools.product([0.5, 0.75, 1.0, 1.5], [0.0, 0.1, 0.25, 0.5, 0.75, 1.0]))
    res = {}
    for w_rank, w_dense in grid:
        res[w_rank, w_dense] = score(valid, w_rank, w_dense, False)
        say(f"valid wr={w_rank} wd={w_dense}: {line(res[w_rank, w_dense])}")
    best = max(grid, key=lambda g: res[g]["ndcg@10"])
    say(f"best on valid {best}")
    for excl in (False, True):  # the checkpoint's weight for the policy, no dense expert; then the best
        for weights in [(model.cfg.fusion_weight(excl), 0.0), best]:
            say(f"test {weights} excl={excl}: {line(score(test, *weights, excl))}")
    if str(args.out) != "-":
        args.out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
