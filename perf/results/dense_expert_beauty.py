"""Does the dense head's log-softmax, as a third expert beside the ranker logit and the retrieval
log-probability, lift the served order on Amazon Beauty? Weights chosen on the validation split of all
users (NDCG@10), then the test split. Run from the repository root:
    python perf/results/dense_expert_beauty.py runs/beauty/model.pt > perf/results/dense_expert_beauty.txt
"""
import itertools
import sys

import torch

sys.path.insert(0, ".")
from backend_src.config import DecodeOptions  # noqa: E402
from backend_src.data.loaders import load_dataset  # noqa: E402
from backend_src.data.sequences import eval_batches  # noqa: E402
from backend_src.evaluation import drop_seen  # noqa: E402
from backend_src.metrics import METRIC_NAMES, MetricAccumulator  # noqa: E402
from backend_src.model.recommender import GenerativeRecommender  # noqa: E402


def collect(model, data, split, opts):
    """Per batch: candidates, their retrieval log-probs, ranker logits, dense log-softmax, history, target."""
    out = []
    with torch.no_grad():
        for b in eval_batches(data, split=split, batch_size=256, max_len=model.cfg.max_seq_len):
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
    torch.set_num_threads(2)
    model = GenerativeRecommender.load(sys.argv[1] if len(sys.argv) > 1 else "runs/beauty/model.pt")
    data = load_dataset("amazon-beauty")
    opts = DecodeOptions(mode="pfa", beam_width=100, k=256)
    valid, test = collect(model, data, "valid", opts), collect(model, data, "test", opts)
    grid = list(itertools.product([0.5, 0.75, 1.0, 1.5], [0.0, 0.1, 0.25, 0.5, 0.75, 1.0]))
    res = {}
    for w_rank, w_dense in grid:
        res[w_rank, w_dense] = score(valid, w_rank, w_dense, False)
        print(f"valid wr={w_rank} wd={w_dense}: {line(res[w_rank, w_dense])}", flush=True)
    best = max(grid, key=lambda g: res[g]["ndcg@10"])
    print("best on valid", best)
    for weights in [(model.cfg.rank_fusion_weight, 0.0), best]:
        for excl in (False, True):
            print(f"test {weights} excl={excl}: {line(score(test, *weights, excl))}", flush=True)


if __name__ == "__main__":
    main()
