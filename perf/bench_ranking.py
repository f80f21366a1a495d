"""Ranking throughput: M-FALCON over a cached history vs one full forward pass per candidate.

Naive baseline (the HSTU paper's O(m n^2)): every candidate is scored by encoding the history plus
that one candidate token as a full causal HSTUEncoder.forward; the forwards are batched across
candidates (B = candidates, in chunks of --naive-batch) so the baseline is not a Python loop.
M-FALCON (O(n^2 + m n)): the history is encoded once into a HistoryCache and
MFalconRanker.score runs only the candidate tokens, in microbatches, against the cached K/V.
Both produce the same scores (checked, reported as max_abs_diff_vs_naive).

The naive forward over 1024 candidates x 512 history rows takes minutes on 2 cores, so it is
timed on the first --naive-max candidates and scaled linearly (chunks are independent and the
same size); such rows say so in "extrapolated_from".

    python -m perf.bench_ranking            # default configuration (a few minutes on 2 cores)
    python -m perf.bench_ranking --quick    # tiny smoke configuration
"""
from __future__ import annotations

import argparse

import torch

from backend_src.model.ranker import RANK_ACTION, MFalconRanker
from perf.common import (
    add_checkpoint_arg, add_common_args, device_sync, fill_defaults, host_load, interleaved, log, median_s, random_hstu,
    ratio, result_name, save_result, trained_model,
    setup_torch, summary_ms,
)

GOAL_SPEEDUP_AT_1024 = 100.0


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_args(p)
    add_checkpoint_arg(p, "ranking_throughput_<its folder>.json")
    p.add_argument("--history", type=int, default=None, help="history length (default 512)")
    p.add_argument("--candidates", type=int, nargs="+", default=None, help="default 64 256 1024")
    p.add_argument("--microbatches", type=int, nargs="+", default=None, help="default 16 64 256")
    p.add_argument("--naive-batch", type=int, default=None, help="candidates per naive forward (default 32)")
    p.add_argument("--naive-max", type=int, default=None,
                   help="time the naive forward on at most this many candidates, scale linearly (default 64)")
    p.add_argument("--items", type=int, default=16384)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--max-seconds", type=float, default=None,
                   help="time budget per candidate count for the timed repetitions (default 80)")
    args = p.parse_args(argv)
    if args.quick:
        d = dict(history=32, candidates=[8, 32], microbatches=[4, 16], naive_batch=8, naive_max=8, reps=2,
                 warmup=1, max_seconds=3.0)
    else:
        d = dict(history=512, candidates=[64, 256, 1024], microbatches=[16, 64, 256], naive_batch=32,
                 naive_max=64, reps=5, warmup=1, max_seconds=80.0)
    fill_defaults(args, d)
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    load_start = host_load()
    setup_torch(args.threads, args.seed, args.device)
    dev = args.device
    n = args.history
    if args.checkpoint:  # the recipe's trained backbone and ranking head
        model = trained_model(args, max_seq_len=n + 1)
        cfg, encoder, ranker = model.cfg, model.backbone.to(dev), model.ranker.eval().to(dev)
    else:
        cfg, encoder = random_hstu(args, max_seq_len=n + 1)
        ranker = MFalconRanker(encoder, cfg).eval().to(dev)
    gen = torch.Generator().manual_seed(args.seed)
    hist_items = torch.randint(1, args.items + 1, (1, n), generator=gen).to(dev)
    hist_actions = torch.randint(1, 6, (1, n), generator=gen).to(dev)
    hist_ts = torch.sort(torch.randint(0, 90 * 86400, (1, n), generator=gen), dim=1).values.to(dev)
    hist_len = torch.tensor([n], device=dev)
    with torch.inference_mode():
        cache = encoder(hist_items, hist_actions, hist_ts, hist_len)
    log(f"ranking: history {n}, d{args.d_model}, {args.layers} layers, {args.heads} heads, threads {args.threads}")

    def naive(cands: torch.Tensor) -> torch.Tensor:
        """Scores [m] from full causal forwards of history + one candidate, batched over candidates."""
        out = []
        for s in range(0, cands.numel(), args.naive_batch):
            c = cands[s : s + args.naive_batch]
            b = c.numel()
            items = torch.cat([hist_items.expand(b, n), c[:, None]], dim=1)  # [b, n+1]
            actions = torch.cat([hist_actions.expand(b, n), torch.full((b, 1), RANK_ACTION, device=dev)], dim=1)
            ts = torch.cat([hist_ts.expand(b, n), hist_ts[:, -1:].expand(b, 1)], dim=1)
            states = encoder(items, actions, ts, torch.full((b,), n + 1, device=dev)).states[:, n:]  # [b, 1, D]
            out.append(ranker.head_logits(states, c[:, None])[:, 0])
        return torch.cat(out)

    rows = []
    model_name = (f"HSTU({'trained: ' + args.checkpoint if args.checkpoint else 'random init'}, d{args.d_model}, "
                  f"{args.layers} layers, {args.heads} heads)")
    dataset = f"synthetic-history-{n}"
    for m in args.candidates:
        cands = torch.randint(1, args.items + 1, (m,), generator=gen).to(dev)
        m_naive = min(m, args.naive_max)
        with torch.inference_mode():  # same scores either way (the M-FALCON mask)
            ref = naive(cands[:m_naive])
            got = ranker.score(cache, cands[None], microbatch_size=args.microbatches[0])[0, :m_naive]
            max_diff = float((ref - got).abs().max())
        calls = {"naive": lambda c=cands[:m_naive]: naive(c)}
        for mb in args.microbatches:
            calls[f"mfalcon_mb{mb}"] = lambda mb=mb, c=cands[None]: ranker.score(cache, c, microbatch_size=mb)
        calls["history_encode"] = lambda: encoder(hist_items, hist_actions, hist_ts, hist_len)
        times = interleaved(calls, args.reps, args.warmup, max_seconds=args.max_seconds, sync=device_sync(dev))
        naive_s = median_s(times["naive"]) * m / m_naive  # whole candidate set (scaled if subset)
        enc_s = median_s(times["history_encode"])
        base = {"dataset": dataset, "model": model_name, "history": n, "candidates": m}
        stats = summary_ms(times["naive"])
        naive_row = {
            **base, "mode": "naive_full_forward", "microbatch": None, "naive_batch": args.naive_batch,
            "measured_candidates": m_naive,
            **{k: (v * m / m_naive if k.startswith("latency") else v) for k, v in stats.items()},
            "candidates_per_s": m / naive_s,
            "speedup_vs_naive": 1.0,
        }
        if m_naive < m:
            naive_row["extrapolated_from"] = m_naive
        rows.append(naive_row)
        log(f"  {m} candidates: naive {naive_s * 1e3:.0f} ms"
            f"{f' (scaled from {m_naive})' if m_naive < m else ''}, history encode {enc_s * 1e3:.1f} ms, "
            f"reps {len(times['naive'])}, max |diff| {max_diff:.2e}")
        for mb in args.microbatches:
            t = median_s(times[f"mfalcon_mb{mb}"])
            row = {
                **base, "mode": f"mfalcon_mb{mb}", "microbatch": mb, "effective_microbatch": min(mb, m),
                **summary_ms(times[f"mfalcon_mb{mb}"]),
                "candidates_per_s": m / t,
                "speedup_vs_naive": ratio(naive_s, t),
                # the cache usually exists already (handed over from retrieval); if it must be
                # built for this request, one history forward is added
                "latency_ms_incl_history_encode": (t + enc_s) * 1e3,
                "candidates_per_s_incl_history_encode": m / (t + enc_s),
                "speedup_vs_naive_incl_history_encode": ratio(naive_s, t + enc_s),
                "max_abs_diff_vs_naive": max_diff,
            }
            if m == 1024:
                row["goal_speedup"] = GOAL_SPEEDUP_AT_1024
            rows.append(row)
            log(f"    mb {mb:4d}: {t * 1e3:8.1f} ms  {m / t:10.0f} cand/s  x{row['speedup_vs_naive']:.0f} vs naive "
                f"(x{row['speedup_vs_naive_incl_history_encode']:.0f} with the history encode)")
        rows.append({**base, "mode": "history_encode", "microbatch": None, **summary_ms(times["history_encode"])})
    extra = dict(
        benchmark="ranking",
        note="randomly initialized HSTU: throughput does not depend on training. speedup_vs_naive uses the "
             "cached history (as handed over from retrieval); *_incl_history_encode adds one history forward",
        config=dict(history=n, candidates=args.candidates, microbatches=args.microbatches,
                    naive_batch=args.naive_batch, naive_max=args.naive_max, d_model=args.d_model,
                    layers=args.layers, heads=args.heads, threads=args.threads, device=dev, warmup=args.warmup,
                    reps_requested=args.reps, quick=args.quick),
        goal=dict(speedup_at_1024_candidates=GOAL_SPEEDUP_AT_1024),
    )
    path = args.out / result_name(args, "ranking_throughput")
    return save_result(path, rows, "perf.bench_ranking", argv, load_start, **extra)


if __name__ == "__main__":
    main()
