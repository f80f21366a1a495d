"""Evaluate a checkpoint over the full item catalog (test split by default).

    python -m export.evaluate --checkpoint runs/beauty/model.pt --data amazon-beauty \
        --out perf/results/quality_beauty_eval.json

Orders reported: retrieval (beam log-probability), ranked (M-FALCON score over the beams),
fused (the served order: w * ranker logit + retrieval log-probability, w = the checkpoint's
rank_fusion_weight) and dense (the auxiliary head, a diagnostic), each with already-seen items
included and excluded. --tune-fusion first picks w on the validation split and saves it into
the checkpoint (export.train does this after training).
"""
from __future__ import annotations

import argparse

from backend_src.config import DecodeOptions
from backend_src.data.loaders import load_dataset
from backend_src.evaluation import evaluate, tune_fusion_weight
from backend_src.metrics import METRIC_NAMES
from backend_src.model.recommender import GenerativeRecommender
from backend_src.results import markdown_table, write_result


def result_rows(dataset: str, results: dict, mode: str) -> list[dict]:
    return [
        {"dataset": dataset, "model": f"hstu-{order}", "mode": mode, "seen_excluded": seen == "seen_excluded", **m}
        for key, m in results.items()
        if key != "timing"
        for order, seen in [key.split("/")]
    ]


def tune_fusion(model: GenerativeRecommender, data, checkpoint, options: DecodeOptions) -> float:
    """Pick the fused order's ranker weight on the validation split (NDCG@10, seen items
    included) and save it into the checkpoint's config."""
    best, table = tune_fusion_weight(model, data, options)
    for w, m in table.items():
        scores = " ".join(f"{k}={m[k]:.4f}" for k in METRIC_NAMES)
        print(f"  valid fused@{w:g}: {scores}" + ("  <- chosen" if w == best else ""))
    model.cfg.rank_fusion_weight = float(best)
    metadata = dict(getattr(model, "metadata", {}))
    metadata["rank_fusion_valid"] = {f"{w:g}": m for w, m in table.items()}
    model.save(checkpoint, metadata)
    model.metadata = metadata
    return best


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--data", required=True)
    p.add_argument("--split", default="test", choices=["test", "valid"])
    p.add_argument("--mode", default="pfa")
    p.add_argument("--beam", type=int, default=100)
    p.add_argument("--k", type=int, default=256)
    p.add_argument("--max-users", type=int)
    p.add_argument("--out")
    p.add_argument("--tune-fusion", action="store_true",
                   help="first choose the fused order's ranker weight on the validation split, saved into the checkpoint")
    args = p.parse_args(argv)
    model = GenerativeRecommender.load(args.checkpoint)
    data = load_dataset(args.data)
    opts = DecodeOptions(mode=args.mode, beam_width=args.beam, k=args.k)
    if args.tune_fusion:
        tune_fusion(model, data, args.checkpoint, opts)
    res = evaluate(model, data, args.split, opts, max_users=args.max_users)
    rows = result_rows(data.name, res, args.mode)
    if args.out:
        write_result(args.out, rows, checkpoint=args.checkpoint, checkpoint_metadata=getattr(model, "metadata", {}),
                     config=model.cfg.to_dict(), split=args.split, options=vars(opts), timing=res["timing"])
    print(markdown_table(rows, ["model", "seen_excluded", *METRIC_NAMES]))


if __name__ == "__main__":
    main()
