"""Where a Beauty training step's time goes (forward + backward, 2 threads, the same 12 batches each
time), with the dense head over the whole catalog and 64 ranker negatives (the previous recipe) and
with 1,024 sampled items and 32 negatives (`make train-beauty`). Run from the repository root:
    python perf/results/train_step_beauty.py runs/beauty/model.pt > perf/results/train_step_beauty.txt
"""
import sys
import time

import numpy as np
import torch

sys.path.insert(0, ".")
from backend_src.config import TrainConfig  # noqa: E402
from backend_src.data.loaders import load_dataset  # noqa: E402
from backend_src.data.sequences import length_bucketed, train_batches  # noqa: E402
from backend_src.model.recommender import GenerativeRecommender  # noqa: E402
from backend_src.training import NegativeSampler, losses  # noqa: E402


ROUNDS = 5


def main():
    torch.set_num_threads(2)
    model = GenerativeRecommender.load(sys.argv[1] if len(sys.argv) > 1 else "runs/beauty/model.pt").train()
    data = load_dataset("amazon-beauty")
    rng, gen = np.random.default_rng(0), torch.Generator().manual_seed(0)
    sampler = NegativeSampler(model.codebook.codes, model.cfg.num_items)
    chunk = train_batches(data, 128 * 16, model.cfg.max_seq_len, rng)
    batches = list(length_bucketed(chunk, 128, rng))[:12]

    def ms_per_step(parts, dense_negatives, ranker_negatives):
        """parts: which losses enter the backward pass (the backbone always runs)."""
        model.cfg.ranker_negatives = ranker_negatives
        tcfg = TrainConfig(ranker_weight=1.0, extra={"dense_weight": 1.0, "dense_negatives": dense_negatives})
        t0 = time.perf_counter()
        for batch in batches:
            loss = {k: v for k, v in losses(model, batch, sampler, tcfg, gen).items() if k in parts}
            sum(loss.values()).backward()
            model.zero_grad(set_to_none=True)
        return (time.perf_counter() - t0) / len(batches) * 1e3

    every = ("retrieval", "ranking", "dense")
    recipes = {"previous recipe": (0, 64), "current recipe": (1024, 32)}
    # every recipe with all losses and with each loss left out, timed round-robin, median of ROUNDS
    runs = [(name, left_out) for name in recipes for left_out in (None, *every)]
    times = {run: [] for run in runs}
    ms_per_step(every, 0, 64)  # warm up
    for _ in range(ROUNDS):
        for name, left_out in runs:
            parts = tuple(p for p in every if p != left_out)
            times[name, left_out].append(ms_per_step(parts, *recipes[name]))
    median = {run: float(np.median(t)) for run, t in times.items()}
    for name, (dense_neg, rank_neg) in recipes.items():
        total = median[name, None]
        print(f"{name} (dense negatives {dense_neg or 'all items'}, ranker negatives {rank_neg}): "
              f"{total:.1f} ms/step (median of {ROUNDS} rounds of {len(batches)} steps)")
        for part in every:
            cost = total - median[name, part]
            print(f"  {part} (the step minus the step without it): {cost:.1f} ms ({cost / total:.0%})")


if __name__ == "__main__":
    main()
