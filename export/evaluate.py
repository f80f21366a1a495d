"""Evaluate a checkpoint over the full item catalog (test split by default).

    python -m export.evaluate --checkpoint runs/beauty/model.pt --data amazon-beauty \
        --out perf/results/quality_beauty_eval.json

Orders reported: retrieval (beam log-probability), ranked (M-FALCON score over the beams),
fused (the served order: retrieval log-probability + w * ranker logit + v * dense log-softmax
+ u * co-visitation score, (w, v, u) = the checkpoint's weights for the seen-item policy) and
dense (the auxiliary head's own top items, a diagnostic), each with already-seen items included
and excluded. --tune-fusion first picks (w, v, u) per policy on the validation split and saves
them into the checkpoint (export.train does this after training); --fusion-weight W|CHECKPOINT
saves given weights instead (a final fit has no validation split left to pick them on).
"""
from __future__ import annotations

import argparse
from pathlib import Path

from backend_src.config import DecodeOptions
from backend_src.data.loaders import load_dataset
from backend_src.evaluation import SEEN_POLICIES, evaluate, fused_name, tune_fusion_weights
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


FusionWeights = tuple[tuple[float, float, float], tuple[float, float, float]]  # (w, v, u) seen included, excluded


def fusion_weights(value: str) -> FusionWeights:
    """--fusion-weight: a number (the ranker weight w under both seen-item policies, no dense or
    co-visitation weight) or a checkpoint whose weights to take -> ((w, v, u) seen included,
    (w, v, u) excluded)."""
    try:
        return (float(value), 0.0, 0.0), (float(value), 0.0, 0.0)
    except ValueError:
        if not Path(value).is_file():
            raise argparse.ArgumentTypeError(f"{value!r} is neither a number nor a checkpoint file") from None
        cfg = GenerativeRecommender.load(value).cfg
        return cfg.fusion_weights(False), cfg.fusion_weights(True)


def save_fusion_weights(model: GenerativeRecommender, checkpoint, weights: FusionWeights, **metadata) -> None:
    model.cfg.set_fusion_weights(*weights)
    model.metadata = {**getattr(model, "metadata", {}), **metadata}
    model.save(checkpoint, model.metadata)


def tune_fusion(model: GenerativeRecommender, data, checkpoint, options: DecodeOptions) -> dict:
    """Pick the fused order's (ranker, dense, co-visitation) weights on the validation split
    (NDCG@10), once per seen-item policy, and save them into the checkpoint's config ->
    {policy: (w, v, u)}."""
    best, tables = tune_fusion_weights(model, data, options)
    for policy in SEEN_POLICIES:
        for wvu, m in tables[policy].items():
            scores = " ".join(f"{k}={m[k]:.4f}" for k in METRIC_NAMES)
            print(f"  valid {policy} {fused_name(*wvu)}: {scores}" + ("  <- chosen" if wvu == best[policy] else ""))
    save_fusion_weights(model, checkpoint, (best["seen_included"], best["seen_excluded"]),
                        rank_fusion_valid={p: {fused_name(*wvu): m for wvu, m in t.items()} for p, t in tables.items()})
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
    fusion = p.add_mutually_exclusive_group()
    fusion.add_argument("--tune-fusion", action="store_true",
                        help="first choose the fused order's ranker, dense and co-visitation weights on the "
                             "validation split, saved into the checkpoint")
    fusion.add_argument("--fusion-weight", type=fusion_weights, metavar="W|CHECKPOINT",
                        help="first save these weights into the checkpoint: a ranker weight (no other weight), or "
                             "the checkpoint of the validation run that chose them (for a final fit)")
    args = p.parse_args(argv)
    model = GenerativeRecommender.load(args.checkpoint)
    data = load_dataset(args.data)
    opts = DecodeOptions(mode=args.mode, beam_width=args.beam, k=args.k)
    if args.tune_fusion:
        tune_fusion(model, data, args.checkpoint, opts)
    elif args.fusion_weight is not None:
        save_fusion_weights(model, args.checkpoint, args.fusion_weight)
    res = evaluate(model, data, args.split, opts, max_users=args.max_users)
    rows = result_rows(data.name, res, args.mode)
    if args.out:
        write_result(args.out, rows, checkpoint=args.checkpoint, checkpoint_metadata=getattr(model, "metadata", {}),
                     config=model.cfg.to_dict(), split=args.split, options=vars(opts), timing=res["timing"])
    print(markdown_table(rows, ["model", "seen_excluded", *METRIC_NAMES]))


if __name__ == "__main__":
    main()
