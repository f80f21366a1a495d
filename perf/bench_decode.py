"""Decode latency of the semantic-ID beam search per attention mode (the PFA paper's ablations).

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
import statistics
import time
from pathlib import Path

import torch

from backend_src import ops
from backend_src.config import DecodeOptions, ModelConfig
from backend_src.decoding.beam_search import generate
from backend_src.model.decoder import SemanticIdDecoder
from backend_src.model.semantic_ids import SemanticIdCodebook
from perf.common import (
    add_checkpoint_arg, add_common_args, cuda_graphed, device_sync, fill_defaults, host_load, interleaved, log, median_s,
    ratio, result_name, save_result, setup_torch, summary_ms, trained_model,
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


def decode_macs(opts: DecodeOptions, n: int, d_model: int, heads: int, code_sizes, shared_kv: bool = False) -> dict:
    """Multiply-accumulates of one user's whole decode as ``generate`` executes it on the CPU:
    the history K/V projections, the history attention and the beams' own layers. Unlike
    attention_macs (the paper's rule) it counts the work done, not the rows that matter: step 0's
    one beam attends in state space, dynamic top-k multiplies its zeroed weights densely, PFA
    recomputes the selection step's logits over the kept rows. Elementwise work (softmax, norms,
    GELU, top-k) is not counted: the ratio of two counts is what the decode could gain if every
    multiply ran at one rate.

    head       per beam and step: q_proj D^2, o_proj D^2, MLP 4 D^2, output layer D C_t (dense)
    projection D x D per row for a key alone, 2 D^2 for a key and a value
    """
    D, H, W, T = d_model, heads, opts.beam_width, len(code_sizes)
    dh, s = D // H, opts.selection_step
    proj = attn = head = 0.0
    kv_projected = set()  # steps whose every row has a key and value (a shared decoder: one pair)
    for t in range(T):
        beams = 1 if t == 0 else W  # (enough items continue every level here)
        head += beams * (6 * D * D + D * code_sizes[t])
        kt = min(opts.budget(t), n)
        full_step = opts.mode == "full" or t < s
        if full_step and beams == 1:  # state space: W_k^T q, logits and pooling over D, W_v
            attn += H * (2 * dh * D + 2 * n * D)
            continue
        if not (opts.mode == "pfa" and t > s):  # every row's K/V (only the key when PFA selects)
            pair = 0 if shared_kv else t
            if opts.mode == "pfa" and t == s and not shared_kv:
                proj += n * D * D
            elif pair not in kv_projected:
                kv_projected.add(pair)
                proj += n * 2 * D * D
        if full_step:
            attn += 2 * beams * H * n * dh
        elif opts.mode == "pfa":
            if t == s:  # pooled selection over every row, then the kept rows' K/V for steps >= s
                attn += beams * H * n * (dh + 1)
                if not shared_kv:
                    proj += sum(min(opts.budget(u), n) for u in range(s, T)) * 2 * D * D
            attn += 2 * beams * H * kt * dh
        elif opts.mode == "pfa_per_beam":  # each beam's own ranking: dense at s, its own rows later
            attn += 2 * beams * H * (n if t == s else kt) * dh
        else:  # dynamic_topk: every beam's top k_t by dense weights, the others zeroed
            attn += 2 * beams * H * n * dh
    return {"decode_macs": proj + attn + head, "projection_macs": proj, "attention_macs": attn, "head_macs": head}


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
    add_checkpoint_arg(p, "decode_latency_<its folder>.json (its decoder and semantic IDs; a shared-K/V variant "
                          "needs a model trained that way: left out)")
    p.add_argument("--max-seconds", type=float, default=None,
                   help="time budget per history length for the timed repetitions (default 90)")
    p.add_argument("--cuda-graphs", action="store_true",
                   help="on a GPU, time replays of each decode captured into a CUDA graph (the device's work "
                        "without per-op launch cost) instead of eager calls")
    p.add_argument("--phase-runs", type=int, default=None,
                   help="decodes of full and pfa timed by phase per history length (default 7; 0: none)")
    args = p.parse_args(argv)
    if args.quick:
        d = dict(histories=[32, 64], users=[2, 2], items=600, reps=2, warmup=1, max_seconds=5.0, beam=16,
                 phase_runs=1)
        args.beam = d.pop("beam")
    else:
        d = dict(histories=[128, 512, 2048], users=[32, 32, 8], items=16384, reps=7, warmup=1, max_seconds=90.0,
                 phase_runs=7)
    fill_defaults(args, d)
    if args.cuda_graphs and not args.device.startswith("cuda"):
        p.error("--cuda-graphs needs --device cuda")
    if len(args.users) == 1:
        args.users = args.users * len(args.histories)
    if len(args.users) != len(args.histories):
        p.error("--users needs one value per history length (or a single value)")
    return args


# where a decode's time goes: phase -> the calls of ``generate`` timed under it (the ops module's
# attention ops, the decoder's methods); the rest of the decode is its beam bookkeeping. On the CPU
# the code scores are part of the compiled expansion (cpu_kernels.expand_beams), so they count as
# bookkeeping there; the torch composition's code_logits and code_embedding count as beam layers.
PHASES = {
    "history_attention": [(ops, "decode_attention"), (ops, "pfa_select_rows"), (ops, "dynamic_topk_attention"),
                          ("decoder", "attend_states")],
    "kv_projection": [("decoder", "project_step")],
    "beam_layers": [("decoder", "query"), ("decoder", "head_state"), ("decoder", "code_logits"),
                    ("decoder", "code_embedding")],
}


def phase_times_ms(decode, decoder, runs: int) -> dict:
    """Median ms per phase over `runs` calls of decode() on the CPU, each call timed whole and by
    phase: the calls listed in PHASES are wrapped with a clock for the duration (and unwrapped
    after); "beam_bookkeeping" is the rest (constrained log-softmax, top-k, the codebook's tables,
    reordering the beams). CPU ops return when done, so a call's clock is its work."""
    spent = dict.fromkeys(PHASES, 0.0)
    patched = []

    def clocked(fn, phase):
        def call(*args, **kwargs):
            start = time.perf_counter()
            out = fn(*args, **kwargs)
            spent[phase] += time.perf_counter() - start
            return out
        return call

    for phase, targets in PHASES.items():
        for owner, name in targets:
            owner = decoder if owner == "decoder" else owner
            patched.append((owner, name, owner.__dict__.get(name)))
            setattr(owner, name, clocked(getattr(owner, name), phase))
    samples = []
    try:
        decode()  # warm
        for _ in range(runs):
            for phase in spent:
                spent[phase] = 0.0
            start = time.perf_counter()
            decode()
            total = time.perf_counter() - start
            samples.append({**spent, "beam_bookkeeping": total - sum(spent.values()), "total": total})
    finally:
        for owner, name, original in reversed(patched):
            if original is None:
                delattr(owner, name)  # the class's method again
            else:
                setattr(owner, name, original)
    return {k: statistics.median(s[k] for s in samples) * 1e3 for k in samples[0]}


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
    if args.checkpoint:  # the recipe's trained decoder and semantic IDs (the decoder reads histories of any length)
        model = trained_model(args, max_seq_len=0)
        args.heads = model.cfg.decoder_heads
        codebook, decoders = model.codebook.to(dev), {False: model.decoder.to(dev)}
        dataset = f"{Path(args.checkpoint).parent.name} (trained semantic IDs)"
        names = [n for n in names if not VARIANTS[n][1]]
        model_name = f"SemanticIdDecoder(trained: {args.checkpoint}, d{args.d_model}, {args.heads} heads)"
    else:
        codebook, decoders = build(args.items, args.d_model, args.heads, max(args.histories), args.seed, dev)
        dataset = f"synthetic-{args.items}-items-sid{'x'.join(map(str, codebook.codebook_sizes))}"
        model_name = f"SemanticIdDecoder(random init, d{args.d_model}, {args.heads} heads)"
    sizes = codebook.codebook_sizes
    log(f"decode: {args.items} items, codebook sizes {sizes}, beam {args.beam}, threads {args.threads}, "
        f"device {dev} (ops backend {ops.backend_for(torch.empty(0, device=dev))})")
    head_dim = args.d_model // args.heads
    rows, phases = [], []
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
        if True in decoders:
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
        works = {name: decode_macs(DecodeOptions(beam_width=args.beam, **VARIANTS[name][0]), n, args.d_model,
                                   args.heads, sizes, VARIANTS[name][1]) for name in names}
        proj_s = {shared: median_s(times[call]) for shared, call in ((False, "project_history"), (True, "project_history_shared"))
                  if call in times}
        log(f"  history {n}, {users} users: full {full_s * 1e3:.1f} ms/batch "
            f"(K/V projection {proj_s[False] * 1e3:.1f} ms, attention {attn_share:.0%} of it), "
            f"reps {len(times['full'])}")
        for name in (v for v in names if v in times):  # a variant not captured has no times
            fields, shared = VARIANTS[name]
            opts = DecodeOptions(beam_width=args.beam, **fields)
            cost = attention_macs(opts.mode, n, args.beam, args.heads, head_dim, opts.k, opts.r, opts.selection_step)
            work = works[name]
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
                "decode_macs_per_user": work["decode_macs"],
                "decode_mac_ratio_vs_full": ratio(works["full"]["decode_macs"], work["decode_macs"]),
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
        if args.phase_runs and "pfa" in names and not dev.startswith("cuda"):  # (a GPU: a sync per call)
            timed = {}
            for name in ("full", "pfa"):
                timed[name] = phase_times_ms(calls[name], decoders[VARIANTS[name][1]], args.phase_runs)
                timed[name]["history_macs"] = works[name]["projection_macs"] + works[name]["attention_macs"]
            # PFA if its history side (attention and projections) ran at full attention's time per
            # multiply-accumulate, the rest as measured: the most fewer MACs can give this decode
            f, p = timed["full"], timed["pfa"]
            history_ms = (f["history_attention"] + f["kv_projection"]) * p["history_macs"] / f["history_macs"]
            p["speedup_bound_at_full_mac_rate"] = f["total"] / (p["beam_layers"] + p["beam_bookkeeping"] + history_ms)
            f["speedup_bound_at_full_mac_rate"] = 1.0
            for name, t in timed.items():
                phases.append({"history": n, "users": users, "mode": name, **t})
                spent = ", ".join(f"{k} {t[k]:.1f}" for k in (*PHASES, "beam_bookkeeping", "total"))
                log(f"    phases of {name} (ms): {spent}; "
                    f"bound at full attention's time per MAC x{t['speedup_bound_at_full_mac_rate']:.2f}")
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
    if phases:
        extra["phases_ms"] = phases
    path = args.out / result_name(args, "decode_latency")
    return save_result(path, rows, "perf.bench_decode", argv, load_start, **extra)


if __name__ == "__main__":
    main()
