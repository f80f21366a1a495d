"""What the decoder's node output costs: the beam search (PFA, beam 100) at 1, 16 and 64 users a
call and a training step (forward + backward, all three losses), each with the checkpoint's node
vectors and with them removed (the same model scoring codes by their code vectors alone), alternated
round by round, 2 threads. Needs a model trained with node output (`make train-beauty`). Run from the
repository root, alone on the machine:
    python -m perf.experiments.node_output_cost                  # writes perf/results/node_output_cost.json
    python -m perf.experiments.node_output_cost --quick --out -  # 1 round (a check that it runs)
"""
import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

from backend_src.config import DecodeOptions, TrainConfig
from backend_src.data.loaders import load_dataset
from backend_src.data.sequences import eval_batches, length_bucketed, train_batches
from backend_src.decoding.beam_search import generate
from backend_src.model.recommender import GenerativeRecommender
from backend_src.training import NegativeSampler, losses
from perf.common import RESULTS_DIR, host_load, save_result


def measure(args) -> tuple[list[dict], dict]:
    rounds = 1 if args.quick else args.rounds
    torch.set_num_threads(2)
    model = GenerativeRecommender.load(args.checkpoint)
    dec, cb = model.decoder, model.codebook
    if not len(dec.node_emb):
        raise SystemExit(f"{args.checkpoint} has no node output")
    node_vectors, without = dec.node_emb, torch.nn.ModuleDict()
    data = load_dataset(args.data)
    rng, gen = np.random.default_rng(0), torch.Generator().manual_seed(0)
    # decoding: the test histories of the users with the most events, their states from the model
    longest = np.argsort(-np.diff(np.asarray(data.offsets)), kind="stable")
    model.eval()
    calls = {}  # name -> (call, repetitions a round, units a call: users decoded or training steps)
    for users in args.users:
        batch = next(eval_batches(data, "test", users, model.cfg.max_seq_len, users=longest[:users]))
        with torch.no_grad():
            cache = model.encode(batch.items, batch.actions, batch.timestamps, batch.lengths)
        decode = lambda c=cache: generate(dec, cb, c.states, c.lengths, DecodeOptions())  # noqa: E731
        calls[f"decode, {users} users"] = (decode, max(2, 60 // users), 1)
    sampler = NegativeSampler(cb.codes, model.cfg.num_items, model.cfg.ranker_hard_fraction)
    steps = 2 if args.quick else 6
    batches = list(length_bucketed(train_batches(data, 128 * 16, model.cfg.max_seq_len, rng), 128, rng))[:steps]
    tcfg = TrainConfig(dense_negatives=1024)  # the recipe's; ranker negatives are the checkpoint's own

    def train_steps():
        model.train()
        for b in batches:
            sum(losses(model, b, sampler, tcfg, gen).values()).backward()
            model.zero_grad(set_to_none=True)
        model.eval()
    calls[f"training step ({len(batches)} batches of 128)"] = (train_steps, 1, len(batches))

    times = {(name, form): [] for name in calls for form in ("node output", "without")}
    for call, _, _ in calls.values():  # warm up both forms
        for vectors in (node_vectors, without):
            dec.node_emb = vectors
            call()
    for _ in range(rounds):
        for name, (call, reps, units) in calls.items():
            for form, vectors in (("node output", node_vectors), ("without", without)):
                dec.node_emb = vectors
                t0 = time.perf_counter()
                for _ in range(reps):
                    call()
                times[name, form].append((time.perf_counter() - t0) / reps / units * 1e3)
    dec.node_emb = node_vectors
    rows = []
    for name in calls:
        a, b = float(np.median(times[name, "node output"])), float(np.median(times[name, "without"]))
        rows.append({"what": name, "node_output_ms": round(a, 2), "without_ms": round(b, 2), "ratio": round(a / b, 3)})
        print(f"{name}: node output {a:.2f} ms, without {b:.2f} ms ({a / b:.2f}x), median of {rounds} rounds")
    return rows, {"node_vectors": {t: int(e.num_embeddings - 1) for t, e in node_vectors.items()}}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("checkpoint", nargs="?", default="runs/beauty/model.pt")
    ap.add_argument("--data", default="amazon-beauty")
    ap.add_argument("--users", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="1 round (a check that it runs)")
    ap.add_argument("--out", default=str(RESULTS_DIR / "node_output_cost.json"), help="'-': print only")
    args = ap.parse_args()
    load_start = host_load()
    rows, extra = measure(args)
    if args.out != "-":
        save_result(Path(args.out), rows, "perf.experiments.node_output_cost", sys.argv[1:], load_start,
                    checkpoint=args.checkpoint, data=args.data, rounds=1 if args.quick else args.rounds, **extra)


if __name__ == "__main__":
    main()
