"""Decode latency of the semantic-ID beam search per attention mode (seed 000's ablations).

A batch of users with full histories of 128 / 512 / 2048 rows decodes 4-code semantic IDs
(codebook sizes about (256, 256, 256, 8), over a synthetic catalogue whose random unique codes
build a SemanticIdCodebook) with beam 100. The decoder is randomly initialized: the work done
per step -- and so the latency -- does not depend on the weights being trained. Every timed
decode includes the history K/V projection (part of decoding); it is also timed on its own.

Besides measured latency, every variant gets its attention multiply-accumulates counted
analytically (QK and AV over the rows each step actually reads), next to the paper's numbers:
PFA 1.45x faster than full attention measured, 2.65x fewer attention MACs in theory.

    python -m perf.bench_decode            # default configuration (a few minutes on 2 cores)
    python -m perf.bench_decode --quick    # tiny smoke configuration
"""
from __future__ import annotations

import argparse
import math

import torch

from backend_src import ops
from backend_src.config import DecodeOptions, ModelConfig
from backend_src.decoding.beam_search import generate
from backend_src.model.decoder import SemanticIdDecoder
from backend_src.model.semantic_ids import SemanticIdCodebook
from perf.common import (
    add_common_args, cuda_graphed, device_sync, fill_defaults, host_load, interleaved, log, median_s, ratio,
    save_result, setup_torch, summary_ms,
)

# Seed 000, industrial data, history 512, beam 100, 512 users a batch on L20 GPUs (anchors.md)
PAPER_LATENCY_MS = {
    "full": 90.0,
    "dynamic_topk": 212.0,
    "pfa": 62.0,
    "pfa_no_shrink": 65.0,
    "pfa_per_beam": 118.0,
    "pfa_shared_kv": 59.0,
    "pfa_k128": 52.0,
}
PAPER_MEASURED_SPEEDUP = 1.45  # PFA vs full attention
PAPER_THEORETICAL_MAC_RATIO = 2.65  # full / PFA attention MACs
PAPER_THEORETICAL_VS_DYNAMIC = 1.99  # dynamic top-k / PFA attention MACs

# variant -> (DecodeOptions fields, decoder with one shared K/V projection?)
VARIANTS = {
    "full": (dict(mode="full"), False),
    "pfa": (dict(mode="pfa", k=256, r=0.5, selection_step=1), False),
    "pfa_per_beam": (dict(mode="pfa_per_beam", k=256, r=0.5, selection_step=1), False),
    "pfa_no_shrink": (dict(mode="pfa", k=256, r=1.0, selection_step=1), False),
    "pfa_shared_kv": (dict(mode="pfa", k=256, r=0.5, selection_step=1), True),
    "pfa_sel0": (dict(mode="pfa", k=256, r=0.5, selection_step=0), False),
    "pfa_sel2": (dict(mode="pfa", k=256, r=0.5, selection_step=2), False),
    "pfa_k128": (dict(mode="pfa", k=128, r=0.5, selection_step=1), False),
    "pfa_k192": (dict(mode="pfa", k=192, r=0.5, selection_step=1), False),
    # the paper's dynamic top-k keeps k rows at every step (its 1.99x MAC ratio needs r = 1)
    "dynamic_topk": (dict(mode="dynamic_topk", k=256, r=1.0, selection_step=1), False),
    "dynamic_topk_shrink": (dict(mode="dynamic_topk", k=256, r=0.5, selection_step=1), False),
}


# --------------------------------------------------------------------------------------------
# Synthetic catalogue
# --------------------------------------------------------------------------------------------
def synthetic_codes(num_items: int, prefix_sizes=(256, 256, 256), max_group: int = 8, seed: int = 0) -> torch.Tensor:
    """Random unique 4-code semantic IDs [num_items, 4]: random distinct 3-code prefixes, each
    shared by a group of 1..max_group items told apart by the last (collision) code."""
    gen = torch.Generator().manual_seed(seed)
    groups = torch.randint(1, max_group + 1, (num_items,), generator=gen)
    groups[0] = max_group  # the collision level has exactly max_group codes
    cum = groups.cumsum(0)
    n_groups = int(torch.searchsorted(cum, torch.tensor(num_items))) + 1
    groups = groups[:n_groups].clone()
    groups[-1] -= int(cum[n_groups - 1]) - num_items  # sizes sum to num_items
    cum = groups.cumsum(0)
    space = math.prod(prefix_sizes)
    keys = torch.unique(torch.randint(0, space, (2 * n_groups + 16,), generator=gen))
    keys = keys[torch.randperm(keys.numel(), generator=gen)[:n_groups]]  # distinct prefixes
    prefix = []
    for size in reversed(prefix_sizes):  # mixed radix -> codes, last level first
        prefix.append(keys % size)
        keys = keys // size
    prefix = torch.stack(prefix[::-1], dim=1)  # [G, 3]
    first = torch.repeat_interleave(prefix, groups, dim=0)  # [I, 3]
    start = torch.repeat_interleave(cum - groups, groups)
    collision = torch.arange(num_items) - start
    return torch.cat([first, collision[:, None]], dim=1)


# --------------------------------------------------------------------------------------------
# Analytical attention cost
# --------------------------------------------------------------------------------------------
def attention_macs(mode: str, n: int, beams: int, heads: int, head_dim: int, k: int, r: float,
                   selection_step: int, steps: int = 4) -> dict:
    """Multiply-accumulates of the history attention of one user's decode, counted over the rows
    each step actually reads: sum over steps t, beams (1 at step 0) and heads of
    head_dim * (rows for QK + rows for AV). Selection work (head averaging, beam pooling,
    renormalizing the kept weights, top-k comparisons ~ rows * log2 k) is counted separately.

    full         every step QK and AV over n
    pfa          t < s: n; t = s: QK over n, AV over the kept k; t > s: QK and AV over k_t
    pfa_per_beam same rows as pfa; the top-k runs per beam
    dynamic_topk t < s: n; t >= s: QK over n, AV over k_t, a top-k per beam every step
    """
    opts = DecodeOptions(mode=mode, beam_width=beams, k=k, r=r, selection_step=selection_step)
    kk = min(k, n)
    qk = av = sel = 0.0
    for t in range(steps):
        w = 1 if t == 0 else beams
        if mode == "full" or t < selection_step:
            nq = na = n
        elif mode in ("pfa", "pfa_per_beam"):
            if t == selection_step:
                nq, na = n, kk
                if mode == "pfa":  # head mean, beam-weighted pooling, renormalize, one top-k
                    sel += w * heads * n + w * n + w * heads * kk + n * math.log2(max(kk, 2))
                else:  # head mean, a top-k per beam, renormalize
                    sel += w * heads * n + w * n * math.log2(max(kk, 2)) + w * heads * kk
            else:
                nq = na = min(opts.budget(t), kk)
        elif mode == "dynamic_topk":
            kt = min(opts.budget(t), n)
            nq, na = n, kt
            sel += w * heads * n + w * n * math.log2(max(kt, 2)) + w * heads * kt
        else:
            raise ValueError(mode)
        qk += w * heads * nq * head_dim
        av += w * heads * na * head_dim
    return {"attn_macs": qk + av, "qk_macs": qk, "av_macs": av, "selection_ops": sel}


# --------------------------------------------------------------------------------------------
# Benchmark
# --------------------------------------------------------------------------------------------
def build(num_items: int, d_model: int, heads: int, max_seq_len: int, seed: int, device: str = "cpu"):
    codebook = SemanticIdCodebook.from_codes(synthetic_codes(num_items, seed=seed)).to(device)
    decoders = {}
    for shared in (False, True):
        cfg = ModelConfig(
            num_items=num_items, d_model=d_model, decoder_heads=heads, max_seq_len=max_seq_len,
            codebook_sizes=codebook.codebook_sizes, shared_kv_projection=shared,
        )
        torch.manual_seed(seed)
        decoders[shared] = SemanticIdDecoder(cfg).eval().to(device)
    return codebook, decoders


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_args(p)
    p.add_argument("--histories", type=int, nargs="+", default=None, help="history lengths (default 128 512 2048)")
    p.add_argument("--users", type=int, nargs="+", default=None,
                   help="users per batch, one per history length (default 32 32 8)")
    p.add_argument("--items", type=int, default=None, help="catalogue size (default 16384)")
    p.add_argument("--beam", type=int, default=100)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--variants", nargs="+", default=None, choices=list(VARIANTS), help="subset of variants")
    p.add_argument("--max-seconds", type=float, default=None,
                   help="time budget per history length for the timed repetitions (default 90)")
    p.add_argument("--cuda-graphs", action="store_true",
                   help="on a GPU, time replays of each decode captured into a CUDA graph (the device's work "
                        "without per-op launch cost) instead of eager calls")
    p.add_argument("--profile", action="store_true",
                   help="also record the slowest ops of full vs pfa per history length (torch profiler)")
    args = p.parse_args(argv)
    if args.quick:
        d = dict(histories=[32, 64], users=[2, 2], items=600, reps=2, warmup=1, max_seconds=5.0, beam=16)
        args.beam = d.pop("beam")
    else:
        d = dict(histories=[128, 512, 2048], users=[32, 32, 8], items=16384, reps=7, warmup=1, max_seconds=90.0)
    fill_defaults(args, d)
    if args.cuda_graphs and not args.device.startswith("cuda"):
        p.error("--cuda-graphs needs --device cuda")
    if len(args.users) == 1:
        args.users = args.users * len(args.histories)
    if len(args.users) != len(args.histories):
        p.error("--users needs one value per history length (or a single value)")
    return args


def profile_ops(fn, top: int = 12) -> list[dict]:
    """Self CPU time per op over one run of fn, slowest first."""
    from torch.profiler import ProfilerActivity, profile

    with torch.inference_mode(), profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    rows = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[:top]
    return [{"op": e.key, "self_ms": e.self_cpu_time_total / 1e3, "calls": e.count} for e in rows]


def graph_all(calls: dict) -> dict:
    """Each call replaced by the replay of its CUDA graph; a variant that cannot be captured is
    reported and dropped (its eager time would not compare with replays)."""
    out = {}
    for name, fn in calls.items():
        try:
            out[name] = cuda_graphed(fn)
        except Exception as exc:  # e.g. an op that reads a value back to the host
            if name not in VARIANTS or name == "full":  # the reference points of every ratio
                raise
            log(f"    {name}: not captured into a CUDA graph ({type(exc).__name__}: {str(exc)[:200]})")
            torch.cuda.synchronize()
    return out


def main(argv=None) -> dict:
    args = parse_args(argv)
    load_start = host_load()
    setup_torch(args.threads, args.seed, args.device)
    dev = args.device
    names = args.variants or list(VARIANTS)
    if "full" not in names:
        names = ["full", *names]
    codebook, decoders = build(args.items, args.d_model, args.heads, max(args.histories), args.seed, dev)
    sizes = codebook.codebook_sizes
    log(f"decode: {args.items} items, codebook sizes {sizes}, beam {args.beam}, threads {args.threads}, "
        f"device {dev} (ops backend {ops.backend_for(torch.empty(0, device=dev))})")
    dataset = f"synthetic-{args.items}-items-sid{'x'.join(map(str, sizes))}"
    model_name = f"SemanticIdDecoder(random init, d{args.d_model}, {args.heads} heads)"
    head_dim = args.d_model // args.heads
    rows, profiles = [], {}
    for n, users in zip(args.histories, args.users):
        gen = torch.Generator().manual_seed(args.seed + n)
        states = torch.randn(users, n, args.d_model, generator=gen).to(dev)  # like LayerNorm outputs
        lengths = torch.full((users,), n, dtype=torch.long, device=dev)
        calls = {}
        for name in names:
            fields, shared = VARIANTS[name]
            opts = DecodeOptions(beam_width=args.beam, **fields)
            calls[name] = (lambda o=opts, dec=decoders[shared]: generate(dec, codebook, states, lengths, o))
        # the K/V projection of all N rows that full attention does (steps 1..3; step 0 attends
        # in state space), or the one projection of a shared-projection decoder
        calls["project_history"] = lambda: [decoders[False].project_step(states, t) for t in (1, 2, 3)]
        calls["project_history_shared"] = lambda: decoders[True].project_step(states, 0)
        # the history attention of one full-attention step with all beams (full runs 3 such steps
        # after the one-beam step 0): its share of the full decode bounds what fewer MACs can buy
        k1, v1 = decoders[False].project_step(states, 1)
        q1 = torch.randn(users, args.beam, args.heads, head_dim, generator=gen).to(dev)
        calls["attention_step"] = lambda: ops.decode_attention(q1, k1, v1, lengths)
        if args.cuda_graphs:
            calls = graph_all(calls)
        times = interleaved(calls, args.reps, args.warmup, max_seconds=args.max_seconds, sync=device_sync(dev))
        full_s = median_s(times["full"])
        attn_share = min(1.0, 3 * median_s(times["attention_step"]) / full_s)
        full_cost = attention_macs("full", n, args.beam, args.heads, head_dim, 256, 1.0, 1)
        proj_s = {False: median_s(times["project_history"]), True: median_s(times["project_history_shared"])}
        log(f"  history {n}, {users} users: full {full_s * 1e3:.1f} ms/batch "
            f"(K/V projection {proj_s[False] * 1e3:.1f} ms, attention {attn_share:.0%} of it), "
            f"reps {len(times['full'])}")
        for name in (v for v in names if v in times):  # a variant not captured has no times
            fields, shared = VARIANTS[name]
            opts = DecodeOptions(beam_width=args.beam, **fields)
            cost = attention_macs(opts.mode, n, args.beam, args.heads, head_dim, opts.k, opts.r, opts.selection_step)
            stats = summary_ms(times[name])
            med = median_s(times[name])
            row = {
                "dataset": dataset, "mode": name, "model": model_name,
                "attention_mode": opts.mode, "history": n, "users": users, "beam": args.beam,
                "k": opts.k if opts.mode != "full" else None,
                "r": opts.r if opts.mode != "full" else None,
                "selection_step": opts.selection_step if opts.mode != "full" else None,
                "shared_kv_projection": shared,
                **stats,
                "latency_ms_per_user_p50": stats["latency_ms_p50"] / users,
                "speedup_vs_full": ratio(full_s, med),
                # Amdahl: full attention's measured share f of the full decode, cut by the MAC ratio
                "full_attention_share": attn_share,
                "project_history_ms_p50": proj_s[shared] * 1e3,
                "project_history_share": ratio(proj_s[shared], med),
                "attn_macs_per_user": cost["attn_macs"],
                "selection_ops_per_user": cost["selection_ops"],
                "attn_mac_ratio_vs_full": ratio(full_cost["attn_macs"], cost["attn_macs"]),
                "total_ops_ratio_vs_full": ratio(full_cost["attn_macs"], cost["attn_macs"] + cost["selection_ops"]),
                "paper_latency_ms": PAPER_LATENCY_MS.get(name),
                "paper_speedup_vs_full": ratio(PAPER_LATENCY_MS["full"], PAPER_LATENCY_MS[name])
                if name in PAPER_LATENCY_MS else None,
            }
            row["speedup_bound_from_attention"] = 1.0 / (1.0 - attn_share + attn_share / row["attn_mac_ratio_vs_full"])
            if name == "pfa":
                row["paper_theoretical_mac_ratio"] = PAPER_THEORETICAL_MAC_RATIO
            rows.append(row)
            log(f"    {name:20s} {stats['latency_ms_p50']:9.1f} ms  x{row['speedup_vs_full']:.2f} vs full  "
                f"MACs x{row['attn_mac_ratio_vs_full']:.2f} fewer")
        if args.profile:
            for name in ("full", "pfa"):
                fields, shared = VARIANTS[name]
                opts = DecodeOptions(beam_width=args.beam, **fields)
                profiles[f"{name}@{n}"] = profile_ops(
                    lambda o=opts, dec=decoders[shared]: generate(dec, codebook, states, lengths, o)
                )
    # the paper's default setting (history 512, k 256, r 0.5, s 1), counted by the same rule
    ref = {m: attention_macs(m, 512, 100, 2, 32, 256, r, 1) for m, r in (("full", 1.0), ("pfa", 0.5))}
    dyn = attention_macs("dynamic_topk", 512, 100, 2, 32, 256, 1.0, 1)
    extra = dict(
        benchmark="decode",
        note="randomly initialized decoder: latency does not depend on training; every decode includes "
             "the history K/V projection; project_history is the projection of all rows that full attention "
             "does (steps 1-3), timed on its own",
        config=dict(items=args.items, codebook_sizes=list(sizes), beam=args.beam, d_model=args.d_model,
                    heads=args.heads, histories=args.histories, users=args.users, threads=args.threads,
                    device=dev, ops_backend=ops.backend_for(torch.empty(0, device=dev)),
                    cuda_graphs=args.cuda_graphs,
                    warmup=args.warmup, reps_requested=args.reps, quick=args.quick),
        paper=dict(measured_speedup_pfa_vs_full=PAPER_MEASURED_SPEEDUP,
                   theoretical_mac_ratio_pfa_vs_full=PAPER_THEORETICAL_MAC_RATIO,
                   theoretical_mac_ratio_dynamic_vs_pfa=PAPER_THEORETICAL_VS_DYNAMIC,
                   latency_ms_per_batch=PAPER_LATENCY_MS,
                   our_count_at_paper_setting=dict(
                       full_vs_pfa=ref["full"]["attn_macs"] / ref["pfa"]["attn_macs"],
                       dynamic_vs_pfa=dyn["attn_macs"] / ref["pfa"]["attn_macs"])),
    )
    if profiles:
        extra["profile_self_ms"] = profiles
    path = args.out / "decode_latency.json"
    return save_result(path, rows, "perf.bench_decode", argv, load_start, **extra)


if __name__ == "__main__":
    main()
