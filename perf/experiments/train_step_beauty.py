"""Where a Beauty training step's time goes (forward + backward, 2 threads, the same 12 batches each
time), with the dense head over the whole catalog and 64 ranker negatives (the previous recipe) and
with 1,024 sampled items and 32 negatives (`make train-beauty`); and the recipe's step with torch's
own dropout (its CPU mask is drawn by `bernoulli_`) against the byte-mask dropout the model uses
(`backend_src/model/dropout.py`). Needs a trained model (`make train-beauty`). Run from the repository root,
alone on the machine:
    python -m perf.experiments.train_step_beauty                   # writes perf/results/train_step_beauty.txt
    python -m perf.experiments.train_step_beauty --wait-policies   # the same under OMP_WAIT_POLICY=PASSIVE,
                                                                   # then the runtime default: train_step_beauty_omp.txt
    python -m perf.experiments.train_step_beauty --quick --out -   # 1 round of 3 steps
"""
import argparse
import contextlib
import io
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from backend_src.config import TrainConfig
from backend_src.data.loaders import load_dataset
from backend_src.data.sequences import length_bucketed, train_batches
from backend_src.model.dropout import Dropout
from backend_src.model.recommender import GenerativeRecommender
from backend_src.training import NegativeSampler, losses
from perf.common import REPO_ROOT, RESULTS_DIR


def measure(args):
    rounds, steps = (1, 3) if args.quick else (5, 12)
    torch.set_num_threads(2)
    model = GenerativeRecommender.load(args.checkpoint).train()
    data = load_dataset(args.data, max_users=args.max_users)
    rng, gen = np.random.default_rng(0), torch.Generator().manual_seed(0)
    sampler = NegativeSampler(model.codebook.codes, model.cfg.num_items)
    chunk = train_batches(data, 128 * 16, model.cfg.max_seq_len, rng)
    batches = list(length_bucketed(chunk, 128, rng))[:steps]

    byte_mask = Dropout.forward

    def torch_mask(self, x):
        return F.dropout(x, self.p, self.training)

    def ms_per_step(parts, dense_negatives, ranker_negatives, torch_dropout=False):
        """parts: which losses enter the backward pass (the backbone always runs)."""
        model.cfg.ranker_negatives = ranker_negatives
        tcfg = TrainConfig(ranker_weight=1.0, dense_weight=1.0, dense_negatives=dense_negatives)
        Dropout.forward = torch_mask if torch_dropout else byte_mask
        try:
            t0 = time.perf_counter()
            for batch in batches:
                loss = {k: v for k, v in losses(model, batch, sampler, tcfg, gen).items() if k in parts}
                sum(loss.values()).backward()
                model.zero_grad(set_to_none=True)
            return (time.perf_counter() - t0) / len(batches) * 1e3
        finally:
            Dropout.forward = byte_mask

    every = ("retrieval", "ranking", "dense")
    recipes = {"previous recipe": (0, 64), "current recipe": (1024, 32)}
    settings = {**recipes, "torch dropout": (1024, 32, True)}  # the current recipe with torch's dropout mask
    # every recipe with all losses and with each loss left out, timed round-robin, median of `rounds`
    runs = [(name, left_out) for name in recipes for left_out in (None, *every)] + [("torch dropout", None)]
    times = {run: [] for run in runs}
    ms_per_step(every, 0, 64)  # warm up
    for _ in range(rounds):
        for name, left_out in runs:
            parts = tuple(p for p in every if p != left_out)
            times[name, left_out].append(ms_per_step(parts, *settings[name]))
    median = {run: float(np.median(t)) for run, t in times.items()}
    for name, (dense_neg, rank_neg) in recipes.items():
        total = median[name, None]
        print(f"{name} (dense negatives {dense_neg or 'all items'}, ranker negatives {rank_neg}): "
              f"{total:.1f} ms/step (median of {rounds} rounds of {len(batches)} steps)")
        for part in every:
            cost = total - median[name, part]
            print(f"  {part} (the step minus the step without it): {cost:.1f} ms ({cost / total:.0%})")
    ours, theirs = median["current recipe", None], median["torch dropout", None]
    print(f"current recipe with torch's dropout: {theirs:.1f} ms/step against {ours:.1f} with the byte mask "
          f"({theirs / ours:.2f}x)")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("checkpoint", nargs="?", default="runs/beauty/model.pt")
    ap.add_argument("--data", default="amazon-beauty")
    ap.add_argument("--max-users", type=int, default=None, help="load only the first N users (as the checkpoint was trained)")
    ap.add_argument("--quick", action="store_true", help="1 round of 3 steps (a check that it runs)")
    ap.add_argument("--wait-policies", action="store_true",
                    help="run the measurement twice, in child processes: OMP_WAIT_POLICY=PASSIVE, then the runtime default")
    ap.add_argument("--out", default=None, help="text file ('-': stdout only; default perf/results/train_step_beauty.txt, "
                                                "with --wait-policies train_step_beauty_omp.txt)")
    args = ap.parse_args()
    out = args.out or str(RESULTS_DIR / ("train_step_beauty_omp.txt" if args.wait_policies else "train_step_beauty.txt"))
    if args.wait_policies:
        child_args = [args.checkpoint, "--data", args.data, *(["--quick"] if args.quick else []),
                      *(["--max-users", str(args.max_users)] if args.max_users else [])]
        text = "# the measurement run twice in a row: OMP_WAIT_POLICY=PASSIVE, then unset (runtime default)\n"
        for title, policy in (("PASSIVE", "PASSIVE"), ("default", None)):
            env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
            if policy:
                env["OMP_WAIT_POLICY"] = policy
            child = subprocess.run([sys.executable, "-m", "perf.experiments.train_step_beauty", *child_args, "--out", "-"],
                                   cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, text=True, check=True)
            text += f"## {title}\n{child.stdout}"
    else:
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            measure(args)
        text = buf.getvalue()
    sys.stdout.write(text)
    if out != "-":
        Path(out).write_text(text)


if __name__ == "__main__":
    main()
