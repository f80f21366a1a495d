"""What do the served order's third and fourth experts, the dense head's log-softmax over all items
and the co-visitation score at the beam's candidates, add to the ranker stage's model work? One
request at a time (batch 1, one torch thread, as the stage runs it), the user's cached history and
the beam's 100 candidates prepared once; timed side by side: the M-FALCON scores of the candidates
(`rank`, torch), the dense head's log-softmax at them (`dense_log_probs`: the last state against
every item's embedding) and their co-visitation scores (`covisit_scores`: one `searchsorted` of the
candidates after each of the last three history items in the sorted pair keys).

Needs a trained model (`make train-beauty`). Run from the repository root:
    python -m perf.experiments.expert_cost     # -> perf/results/expert_cost.json
    python -m perf.experiments.expert_cost --reps 20 --out -   # quick check
"""
import argparse
from pathlib import Path

import numpy as np
import torch

from backend_src.config import DecodeOptions
from backend_src.data.loaders import load_dataset
from backend_src.data.sequences import eval_batches
from backend_src.model.recommender import GenerativeRecommender
from perf.common import RESULTS_DIR, host_load, interleaved, log, ratio, save_result, summary_ms


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", default="amazon-beauty")
    ap.add_argument("--checkpoint", default="runs/beauty/model.pt")
    ap.add_argument("--users", type=int, default=8, help="requests timed in turn (validation users, longest first)")
    ap.add_argument("--reps", type=int, default=300)
    ap.add_argument("--out", type=Path, default=RESULTS_DIR / "expert_cost.json", help="'-': print only")
    args = ap.parse_args()
    torch.set_num_threads(1)
    load_start = host_load()
    model = GenerativeRecommender.load(args.checkpoint).eval()
    if model.covisitation is None:
        raise SystemExit(f"{args.checkpoint} has no co-visitation table (trained with --covisit-window 0)")
    data = load_dataset(args.data)
    # the longest histories: the ranker's work grows with them, the dense head's does not
    users = np.sort(np.argsort(-data.lengths, kind="stable")[: args.users])
    batch = next(eval_batches(data, split="valid", batch_size=args.users, max_len=model.cfg.max_seq_len, users=users))
    with torch.inference_mode():
        cache = model.encode(batch.items, batch.actions, batch.timestamps, batch.lengths)
        beams = model.retrieve(cache, DecodeOptions(mode="pfa", beam_width=100, k=256))
    requests = [(cache.select([b]), beams.item_ids[b : b + 1], batch.items[b : b + 1, : int(batch.lengths[b])])
                for b in range(len(batch.lengths))]

    def one(fn):  # each call serves the next request in turn
        turn = iter(range(10**9))

        def run():
            fn(*requests[next(turn) % len(requests)])
        return run

    times = interleaved({"rank": one(lambda c, cands, h: model.rank(c, cands)),
                         "dense_log_probs": one(lambda c, cands, h: model.dense_log_probs(c.last_states(), cands)),
                         "covisit_scores": one(lambda c, cands, h: model.covisit_scores(h, cands))},
                        reps=args.reps, warmup=5)
    rows = [dict(part=k, **summary_ms(v)) for k, v in times.items()]
    p50 = {r["part"]: r["latency_ms_p50"] for r in rows}
    shares = {f"{k}_over_rank": ratio(p50[k], p50["rank"]) for k in ("dense_log_probs", "covisit_scores")}
    for r in rows:
        log(f"{r['part']}: p50 {r['latency_ms_p50']:.3f} ms")
    log(" ".join(f"{k}: {v:.3f}" for k, v in shares.items()))
    if str(args.out) != "-":
        save_result(args.out, rows, "perf.experiments.expert_cost", None, load_start, checkpoint=args.checkpoint,
                    num_items=model.cfg.num_items, covisit_pairs=model.covisitation.pairs,
                    history_lengths=batch.lengths.tolist(), **shares)


if __name__ == "__main__":
    main()
