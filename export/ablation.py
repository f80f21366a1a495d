"""Seed 000's ablation on real data, and its attention statistics.

    python -m export.ablation --data ml-1m --checkpoint runs/ml1m/model.pt \
        --shared-checkpoint runs/ml1m-shared/model.pt --out perf/results/ablation_ml1m.json

Every variant decodes the same users from the same cached history states, one after another
inside each batch (round-robin), so machine noise hits all alike; latency is the median over
batches of the decode time (history K/V projection included), beam 100 by default.
The attention statistics come from a full-attention decode of the same users.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from pathlib import Path

import torch
from tqdm import tqdm

from backend_src.config import DecodeOptions
from backend_src.data.loaders import load_dataset
from backend_src.data.sequences import eval_batches
from backend_src.decoding.attention_stats import attention_stats, plot_attention_stats
from backend_src.evaluation import drop_seen
from backend_src.metrics import MetricAccumulator
from backend_src.model.recommender import GenerativeRecommender
from backend_src.results import markdown_table, write_result


def variants(beam: int, shared: bool) -> dict[str, tuple[str, DecodeOptions]]:
    """name -> (which model, options). The shared-projection model is trained separately."""
    v = {
        "full attention": ("main", DecodeOptions(mode="full", beam_width=beam)),
        "dynamic top-k (k=256)": ("main", DecodeOptions(mode="dynamic_topk", beam_width=beam, k=256)),
        "PFA (s=1, k=256, r=0.5)": ("main", DecodeOptions(mode="pfa", beam_width=beam, k=256)),
        "PFA per-beam ranking": ("main", DecodeOptions(mode="pfa_per_beam", beam_width=beam, k=256)),
        "PFA no shrinking (r=1)": ("main", DecodeOptions(mode="pfa", beam_width=beam, k=256, r=1.0)),
        "PFA select at step 0": ("main", DecodeOptions(mode="pfa", beam_width=beam, k=256, selection_step=0)),
        "PFA select at step 2": ("main", DecodeOptions(mode="pfa", beam_width=beam, k=256, selection_step=2)),
        "PFA k=192": ("main", DecodeOptions(mode="pfa", beam_width=beam, k=192)),
        "PFA k=128": ("main", DecodeOptions(mode="pfa", beam_width=beam, k=128)),
    }
    if shared:
        v["PFA shared K/V projection"] = ("shared", DecodeOptions(mode="pfa", beam_width=beam, k=256))
        v["full attention, shared K/V projection"] = ("shared", DecodeOptions(mode="full", beam_width=beam))
    return v


@torch.no_grad()
def run(models: dict, data, chosen: dict, batch_size: int, max_users, min_events: int, stats: bool, ks=(5, 10)):
    main = models["main"]
    users = range(data.num_users) if max_users is None else range(min(max_users, data.num_users))
    if min_events:
        users = [u for u in users if data.offsets[u + 1] - data.offsets[u] >= min_events]
    acc = {name: {excl: MetricAccumulator(ks) for excl in (False, True)} for name in chosen}
    times = {name: [] for name in chosen}
    stat_sums, stat_users = {}, 0
    batches = eval_batches(data, "test", batch_size=batch_size, max_len=main.cfg.max_seq_len, users=users)
    for batch in tqdm(batches, desc="ablation", mininterval=5.0):
        caches = {key: m.encode(batch.items, batch.actions, batch.timestamps, batch.lengths) for key, m in models.items()}
        for name, (key, opts) in chosen.items():  # side by side, same batch
            t0 = time.perf_counter()
            beams = models[key].retrieve(caches[key], opts)
            times[name].append(1000 * (time.perf_counter() - t0))
            for excl in (False, True):
                ranked = drop_seen(beams.item_ids, beams.log_probs, batch.items, exclude=excl)
                acc[name][excl].update(ranked[:, : max(ks)], batch.target_items)
        if stats:
            full = main.retrieve(caches["main"], DecodeOptions(mode="full", beam_width=chosen_beam(chosen), collect_attention=True))
            s = attention_stats(full.attention, caches["main"].lengths)
            b = len(batch.lengths)
            for k, v in s.items():
                if isinstance(v, float) and not math.isnan(v):
                    stat_sums[k] = stat_sums.get(k, 0.0) + v * b
            stat_users += b
    rows = []
    for name, (key, opts) in chosen.items():
        for excl in (False, True):
            m = acc[name][excl].compute()
            rows.append({
                "dataset": data.name, "mode": name, "model": "hstu-pfa-decoder" + ("-shared-kv" if key == "shared" else ""),
                "seen_excluded": excl, "users": m.pop("count"), **m,
                "latency_ms_p50": statistics.median(times[name]), "batch_users": batch_size, "beam": opts.beam_width,
                "options": {"mode": opts.mode, "k": opts.k, "r": opts.r, "selection_step": opts.selection_step},
            })
    full_ms = next(r["latency_ms_p50"] for r in rows if r["mode"] == "full attention")
    for r in rows:
        r["speedup_vs_full"] = full_ms / r["latency_ms_p50"]
    att = {k: v / stat_users for k, v in stat_sums.items()} if stats else None
    if att is not None:
        att["num_users"] = stat_users
        att["ref_step"] = 1
    return rows, att


def chosen_beam(chosen: dict) -> int:
    return next(iter(chosen.values()))[1].beam_width


PAPER_STATS = {  # the PFA paper's, industrial data
    "top10_share_step1": 0.9298, "kept_top25_share_step2": 0.9703, "kept_top25_share_step3": 0.9862,
    "spearman_step1_vs_step2": 0.746, "spearman_step1_vs_step3": 0.713,
}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", required=True)
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--shared-checkpoint", help="a model trained with --shared-kv (PFA's shared-projection ablation)")
    p.add_argument("--out", required=True, help="result JSON; a .md and a stats PNG are written beside it")
    p.add_argument("--beam", type=int, default=100)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--max-users", type=int)
    p.add_argument("--min-events", type=int, default=0, help="only users with at least this many events")
    p.add_argument("--only", nargs="*", help="variant names to run (default all)")
    p.add_argument("--no-stats", action="store_true")
    args = p.parse_args(argv)

    data = load_dataset(args.data)
    models = {"main": GenerativeRecommender.load(args.checkpoint)}
    if args.shared_checkpoint:
        models["shared"] = GenerativeRecommender.load(args.shared_checkpoint)
    chosen = variants(args.beam, "shared" in models)
    if args.only:
        chosen = {k: v for k, v in chosen.items() if k in args.only or k == "full attention"}
    rows, att = run(models, data, chosen, args.batch_size, args.max_users, args.min_events, not args.no_stats)
    out = Path(args.out)
    write_result(out, rows, attention_stats=att, paper_attention_stats=PAPER_STATS,
                 checkpoint=str(args.checkpoint), min_events=args.min_events)
    cols = ["mode", "seen_excluded", "recall@10", "ndcg@10", "latency_ms_p50", "speedup_vs_full"]
    md = markdown_table([r for r in rows if not r["seen_excluded"]], cols)
    if att:
        plot_attention_stats(att, out.with_suffix(".attention.png"))
        md += "\n\nattention statistics (ours vs the PFA paper):\n\n" + markdown_table(
            [{"statistic": k, "ours": att.get(k), "paper": v} for k, v in PAPER_STATS.items()], ["statistic", "ours", "paper"])
    out.with_suffix(".md").write_text(md + "\n")
    print(md)
    if att:
        print(json.dumps(att, indent=1))


if __name__ == "__main__":
    main()
