"""Is the working tree's M-FALCON ranker cheaper than an earlier commit's, in training and in serving? Both
versions of the package are loaded into this one process (`ab_served_decode.old_and_new`), each loads the same
checkpoint, and they alternate on the same inputs so that the drift of a shared machine's speed cancels:
  * a training step (the loss terms' forward and backward, 2 threads, the same batches and random draws) with
    the ranker at 1 and at 2 history positions per user; the two versions' losses are checked equal first;
  * the served ranker call (one user, 100 candidates, 1 thread, as the ranker stage runs) at histories 50 and
    512, on a randomly initialized ranker of the served ML-1M model's shape; the scores are checked equal first.
Run from the repository root, alone on the machine (needs a trained Beauty model, `make train-beauty`):
    python -m perf.experiments.ab_ranker OLD_COMMIT      # -> perf/results/ab_ranker.json
    python -m perf.experiments.ab_ranker OLD_COMMIT --quick --out -
"""
import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

from perf.common import RESULTS_DIR, host_load, interleaved, log, save_result, summary_ms
from perf.experiments.ab_served_decode import PACKAGE, old_and_new

MODULES = ("config", "model.hstu", "model.ranker", "model.recommender", "training", "data.loaders", "data.sequences")


def training_steps(versions, models, args):
    """Median ms per training step of each version, for each number of ranker positions."""
    torch.set_num_threads(2)
    new = versions["new"]
    data = new[f"{PACKAGE}.data.loaders"].load_dataset(args.data)
    seq = new[f"{PACKAGE}.data.sequences"]
    rng = np.random.default_rng(0)
    batches = list(seq.length_bucketed(seq.train_batches(data, 128 * 16, models["new"].cfg.max_seq_len, rng), 128, rng))
    batches = batches[: 3 if args.quick else args.steps]
    samplers = {name: mods[f"{PACKAGE}.training"].NegativeSampler(m.codebook.codes, m.cfg.num_items, m.cfg.ranker_hard_fraction)
                for (name, mods), m in zip(versions.items(), models.values())}
    rows = []
    for positions in args.positions:
        tcfgs = {name: mods[f"{PACKAGE}.config"].TrainConfig(ranker_positions=positions, dense_negatives=1024)
                 for name, mods in versions.items()}

        def step(name, batch, seed):
            model = models[name]
            torch.manual_seed(seed)
            parts = versions[name][f"{PACKAGE}.training"].losses(model, batch, samplers[name], tcfgs[name],
                                                                  torch.Generator().manual_seed(seed))
            sum(parts.values()).backward()
            model.zero_grad(set_to_none=True)
            return {k: float(v.detach()) for k, v in parts.items()}

        for m in models.values():
            m.eval()  # no dropout: the two versions' losses must agree
        a, b = step("old", batches[0], 0), step("new", batches[0], 0)
        if any(abs(a[k] - b[k]) > 1e-4 * max(1.0, abs(a[k])) for k in a):
            raise SystemExit(f"ranker positions {positions}: the two versions' losses differ: {a} vs {b}")
        for m in models.values():
            m.train()
        times = {"old": [], "new": []}
        for r in range(1 if args.quick else args.rounds):
            for name in (("old", "new") if r % 2 == 0 else ("new", "old")):
                t0 = time.perf_counter()
                for i, batch in enumerate(batches):
                    step(name, batch, i)
                times[name].append((time.perf_counter() - t0) / len(batches) * 1e3)
        old, new_ms = statistics.median(times["old"]), statistics.median(times["new"])
        rows.append(dict(what="training step", ranker_positions=positions, steps=len(batches), rounds=len(times["old"]),
                         old_ms=old, new_ms=new_ms, speedup=old / new_ms, losses_equal=True))
        log(f"training step, ranker positions {positions}: old {old:.1f} ms, new {new_ms:.1f} ms ({old / new_ms:.2f}x)")
    return rows


def served_calls(versions, args):
    """The served ranker call of each version, on one randomly initialized ranker of the served model's shape
    (its time does not depend on training), built alike from one seed in both versions."""
    torch.set_num_threads(1)
    rankers = {}
    for name, mods in versions.items():
        cfg = mods[f"{PACKAGE}.config"].ModelConfig(num_items=args.served_items, d_model=64, max_seq_len=max(args.histories))
        torch.manual_seed(0)
        backbone = mods[f"{PACKAGE}.model.hstu"].HSTUEncoder(cfg).eval()
        rankers[name] = mods[f"{PACKAGE}.model.ranker"].MFalconRanker(backbone, cfg).eval()
    rows = []
    for n in args.histories:
        g = torch.Generator().manual_seed(n)
        idx = torch.randint(1, args.served_items + 1, (1, n), generator=g)
        cand = torch.randint(1, args.served_items + 1, (1, args.candidates), generator=g)
        with torch.inference_mode():
            cache = rankers["new"].backbone(idx, torch.zeros(1, n, dtype=torch.long), torch.arange(n)[None] * 60,
                                            torch.tensor([n]))
            a, b = rankers["old"].score(cache, cand), rankers["new"].score(cache, cand)
        gap = (a - b).abs().max().item()
        if gap > 1e-5:
            raise SystemExit(f"history {n}: the two versions' scores differ by {gap}")
        t = interleaved({name: (lambda r=r: r.score(cache, cand)) for name, r in rankers.items()},
                        reps=10 if args.quick else args.reps, warmup=3)
        old, new = summary_ms(t["old"]), summary_ms(t["new"])
        rows.append(dict(what="served ranker call", history=n, candidates=args.candidates, max_abs_diff=gap, old=old,
                         new=new, speedup=old["latency_ms_p50"] / new["latency_ms_p50"]))
        log(f"ranker call, history {n}, {args.candidates} candidates: old {old['latency_ms_p50']:.3f} ms, "
            f"new {new['latency_ms_p50']:.3f} ms ({rows[-1]['speedup']:.2f}x), scores differ by {gap:.1e}")
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("old", help="the earlier commit")
    ap.add_argument("--checkpoint", type=Path, default=Path("runs/beauty/model.pt"))
    ap.add_argument("--data", default="amazon-beauty")
    ap.add_argument("--positions", type=int, nargs="+", default=[1, 2], help="ranker positions per user in training")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--histories", type=int, nargs="+", default=[50, 512])
    ap.add_argument("--candidates", type=int, default=100)
    ap.add_argument("--served-items", type=int, default=3706, help="catalog size of the served ranker (ML-1M's)")
    ap.add_argument("--reps", type=int, default=300)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=str(RESULTS_DIR / "ab_ranker.json"), help="'-': print only")
    args = ap.parse_args(argv)
    load_start = host_load()
    old_rev = subprocess.run(["git", "rev-parse", "--short", args.old], capture_output=True, text=True, check=True).stdout.strip()
    versions = old_and_new(args.old, MODULES)
    models = {name: mods[f"{PACKAGE}.model.recommender"].GenerativeRecommender.load(args.checkpoint)
              for name, mods in versions.items()}
    if type(models["old"]) is type(models["new"]):
        raise SystemExit("the two versions share one package: the earlier one was not loaded")
    rows = training_steps(versions, models, args) + served_calls(versions, args)
    if args.out != "-":
        argv = [old_rev if a == args.old else a for a in (sys.argv[1:] if argv is None else argv)]
        save_result(Path(args.out), rows, "perf.experiments.ab_ranker", argv, load_start, old=old_rev,
                    checkpoint=str(args.checkpoint))


if __name__ == "__main__":
    main()
