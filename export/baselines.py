"""Reference baselines on a leave-one-out split: popularity, co-visitation and a plain SASRec.

Trains on every user's training sequence (all but the last two events), picks the best SASRec
checkpoint by validation NDCG@10 (target = second-last event), then ranks the FULL catalog for
the test target (last event), once with already-seen items allowed and once with them excluded.
--refit trains SASRec on the validation targets too for exactly --epochs (the validation run's
best epoch) and keeps the last, the final fit that `export.train --refit` makes of our model.

    python -m export.baselines --data amazon-beauty --model sasrec --minutes 15 \
        --out perf/results/baseline_sasrec_beauty_28min.json

Co-visitation ranks every item by the served order's fourth expert alone (model/covisitation.py:
how often it followed the user's last `--covisit-window` items in the training events), popularity
breaking its ties: how much of the served order a count table gives by itself.
"""
from __future__ import annotations

import argparse
import copy
import json
import time
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from backend_src.data import (
    SequenceData, eval_batches, item_popularity, length_bucketed, load_dataset, target_rows, train_batches,
)
from backend_src.data.sequences import training_events
from backend_src.metrics import MetricAccumulator, topk_full_catalog
from backend_src.model.covisitation import CoVisitation
from backend_src.model.sasrec import SASRec, SASRecConfig
from backend_src.results import write_result

KS = (5, 10)


def seen_items(data: SequenceData, split: str) -> torch.Tensor:
    """[U, L] every event a user had before the split's target (padded with 0), for exclusion."""
    n = target_rows(data, split) - data.offsets[:-1]  # events before the target
    width = max(int(n.max()), 1)
    col = np.arange(width)[None, :]
    rows = data.offsets[:-1, None] + col
    valid = col < n[:, None]
    return torch.from_numpy(np.where(valid, data.items[np.where(valid, rows, 0)], 0).astype(np.int64))


def evaluate(score_fn, data: SequenceData, split: str, max_len: int, batch_size: int,
             seen: torch.Tensor | None = None, desc: str = "eval") -> dict:
    """Full-catalog metrics; `seen` [U, L] given -> a second set with seen items excluded.

    Returns {"all": metrics} or {"all": ..., "seen_excluded": ...}.
    """
    accs = {"all": MetricAccumulator(KS)}
    if seen is not None:
        accs["seen_excluded"] = MetricAccumulator(KS)
    k = max(KS)
    # users ordered by history length so each batch is only as wide as its longest history
    n_hist = target_rows(data, split) - data.offsets[:-1]
    users = np.argsort(np.minimum(n_hist, max_len), kind="stable")
    batches = eval_batches(data, split=split, batch_size=batch_size, max_len=max_len, users=users)
    total = (data.num_users + batch_size - 1) // batch_size
    for batch in tqdm(batches, total=total, desc=desc, leave=False, mininterval=2.0):
        scores = score_fn(batch)  # [B, I+1]
        accs["all"].update(topk_full_catalog(scores, k), batch.target_items)
        if seen is not None:
            excl = seen[torch.from_numpy(batch.users)]
            accs["seen_excluded"].update(topk_full_catalog(scores, k, exclude=excl), batch.target_items)
    return {name: acc.compute() for name, acc in accs.items()}


# --------------------------------------------------------------------------------------------
def run_popularity(data: SequenceData, args) -> tuple[dict, dict]:
    """Scores = item counts over the events before the target (training events; + valid for test)."""
    t0 = time.time()
    train_counts = item_popularity(data, end_offset=2)
    test_counts = item_popularity(data, end_offset=1)
    info = {"train_seconds": time.time() - t0}

    def scorer(counts):
        s = torch.from_numpy(counts.astype(np.float32))
        return lambda batch: s[None].expand(len(batch), -1)

    valid = evaluate(scorer(train_counts), data, "valid", args.max_len, args.eval_batch_size, desc="valid")
    test = evaluate(scorer(test_counts), data, "test", args.max_len, args.eval_batch_size,
                    seen=seen_items(data, "test"), desc="test")
    info["valid"] = valid["all"]
    return test, info


def run_covisitation(data: SequenceData, args) -> tuple[dict, dict]:
    """Scores = the co-visitation score of every item after the history, + at most 1e-4 by
    popularity so that it only breaks ties. Pairs and popularity are counted over the training
    events (all but the last two of each user), with --refit over the validation targets too."""
    t0 = time.time()
    counted = {"valid": 2, "test": 1 if args.refit else 2}  # events held out of the counts, per split
    tables = {split: CoVisitation(data.num_items, args.covisit_window).fit(*training_events(data, end_offset))
              for split, end_offset in counted.items()}
    info = {"train_seconds": time.time() - t0, "pairs": tables["test"].pairs}

    def scorer(split):
        pop = np.log1p(item_popularity(data, end_offset=counted[split]))
        tie = torch.from_numpy(1e-4 * pop / max(pop.max(), 1e-9)).float()
        every = torch.arange(data.num_items + 1)[None]
        return lambda batch: tables[split].scores(batch.items, every.expand(len(batch), -1)) + tie

    valid = evaluate(scorer("valid"), data, "valid", args.max_len, args.eval_batch_size, desc="valid")
    test = evaluate(scorer("test"), data, "test", args.max_len, args.eval_batch_size,
                    seen=seen_items(data, "test"), desc="test")
    info["valid"] = valid["all"]
    return test, info


def run_sasrec(data: SequenceData, args) -> tuple[dict, dict]:
    torch.manual_seed(args.seed)
    rng = np.random.default_rng(args.seed)
    cfg = SASRecConfig(num_items=data.num_items, hidden=args.hidden, num_blocks=args.blocks,
                       num_heads=args.heads, max_len=args.max_len, dropout=args.dropout)
    model = SASRec(cfg)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr, betas=(0.9, 0.98), weight_decay=args.weight_decay)
    score = lambda batch: model.score_last(batch.items, batch.lengths)  # noqa: E731

    deadline = time.time() + args.minutes * 60
    end_offset = 1 if args.refit else 2  # refit: only the test target held out
    n_rows = int((data.lengths - end_offset >= 2).sum())
    steps_per_epoch = (n_rows + args.batch_size - 1) // args.batch_size
    best = {"ndcg@10": -1.0, "epoch": 0, "state": None}
    history = []
    t0 = time.time()
    stale = 0
    epoch = 0
    stop_reason = "epochs"
    for epoch in range(1, args.epochs + 1):
        model.train()
        total, count = 0.0, 0
        batches = train_batches(data, args.batch_size * args.bucket_chunk, args.max_len, rng=rng,
                                end_offset=end_offset)
        bar = tqdm(length_bucketed(batches, args.batch_size, rng), total=steps_per_epoch,
                   desc=f"epoch {epoch}", leave=False, mininterval=2.0)
        for batch in bar:
            loss = model.loss(batch.items, batch.targets)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            total += loss.item()
            count += 1
            if time.time() > deadline:
                break
        row = {"epoch": epoch, "loss": total / max(count, 1), "seconds": round(time.time() - t0, 1)}
        out_of_time = time.time() > deadline
        if not args.refit and (epoch % args.eval_every == 0 or out_of_time or epoch == args.epochs):
            model.eval()
            valid = evaluate(score, data, "valid", args.max_len, args.eval_batch_size, desc="valid")["all"]
            row.update({k: round(v, 5) for k, v in valid.items() if k != "count"})
            if valid["ndcg@10"] > best["ndcg@10"]:
                best = {"ndcg@10": valid["ndcg@10"], "epoch": epoch, "state": copy.deepcopy(model.state_dict())}
                stale = 0
            else:
                stale += 1
        history.append(row)
        tqdm.write(json.dumps(row))
        if out_of_time:
            stop_reason = "time limit"
            break
        if stale >= args.patience:
            stop_reason = "early stop"
            break
    train_seconds = time.time() - t0
    model.eval()
    if args.refit:
        best["epoch"], valid = epoch, None  # the last epoch: no validation is left to choose one on
    else:
        model.load_state_dict(best["state"])
        valid = evaluate(score, data, "valid", args.max_len, args.eval_batch_size, desc="valid")["all"]
    test = evaluate(score, data, "test", args.max_len, args.eval_batch_size,
                    seen=seen_items(data, "test"), desc="test")
    info = {"train_seconds": round(train_seconds, 1), "epochs_run": epoch, "stop_reason": stop_reason,
            "trained_on": "all but the test target" if args.refit else "all but the validation and test targets",
            "best_epoch": best["epoch"], "valid": valid, "config": cfg.to_dict(),
            "optimizer": {"name": "Adam", "lr": args.lr, "betas": [0.9, 0.98], "weight_decay": args.weight_decay,
                          "batch_size": args.batch_size},
            "history": history}
    if args.save:
        Path(args.save).parent.mkdir(parents=True, exist_ok=True)
        torch.save({"config": cfg.to_dict(), "state_dict": model.state_dict()}, args.save)
    return test, info


RUNS = {"sasrec": run_sasrec, "popularity": run_popularity, "covisitation": run_covisitation}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", default="amazon-beauty", help="data set name or path")
    p.add_argument("--model", choices=tuple(RUNS), default="sasrec")
    p.add_argument("--covisit-window", type=int, default=3, help="co-visitation: pairs within this many events")
    p.add_argument("--epochs", type=int, default=200)
    p.add_argument("--minutes", type=float, default=15.0, help="training time limit")
    p.add_argument("--out", default=None, help="JSON results file")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-len", type=int, default=50)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--blocks", type=int, default=2)
    p.add_argument("--heads", type=int, default=1)
    p.add_argument("--dropout", type=float, default=0.3)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--bucket-chunk", type=int, default=16,
                   help="shuffle this many batches' rows together, then batch them by length")
    p.add_argument("--eval-batch-size", type=int, default=512)
    p.add_argument("--eval-every", type=int, default=2, help="validate every this many epochs")
    p.add_argument("--patience", type=int, default=10, help="validations without improvement before stopping")
    p.add_argument("--save", default=None, help="optional path for the best SASRec checkpoint")
    p.add_argument("--refit", action="store_true",
                   help="train (co-visitation: count) on validation targets too; SASRec for exactly --epochs, "
                        "keeping the last epoch")
    return p.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    data = load_dataset(args.data)
    test, info = RUNS[args.model](data, args)
    rows = []
    for name, seen_excluded in (("all", False), ("seen_excluded", True)):
        m = test[name]
        rows.append({"dataset": data.name, "model": args.model, "seen_excluded": seen_excluded,
                     **{f"{kind}@{k}": round(m[f"{kind}@{k}"], 5) for k in KS for kind in ("recall", "ndcg")},
                     "users": m["count"]})
    dataset = {"name": data.name, "users": data.num_users, "items": data.num_items, "events": data.num_events,
               "split": "leave-one-out (test = last, valid = second last)", "ranking": "full catalog"}
    extra = dict(dataset_info=dataset, training_time_seconds=info["train_seconds"], details=info)
    result = write_result(args.out, rows, **extra) if args.out else {"rows": rows, **extra}
    for r in rows:
        print(json.dumps(r))
    return result


if __name__ == "__main__":
    main()
