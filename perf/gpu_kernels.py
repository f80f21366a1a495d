"""GPU benchmark of the Triton kernels against the torch reference ops.

For every configuration it first checks the kernels against the reference, then times both
(median over repetitions, L2 flushed before each, CUDA events) and reports achieved memory
bandwidth / FLOP rate against the device peak. It also times a whole 4-step semantic-ID decode
(attention only) in the three modes of the PFA paper -- full attention, PFA (select once at step 1,
contiguous prefixes after) and dynamic top-k (every beam reselects every step) -- with both
backends, and writes JSON + Markdown to --out.

    python perf/gpu_kernels.py                 # default configurations
    python perf/gpu_kernels.py --preset quick  # a few small configurations
    python perf/gpu_kernels.py --preset full   # users x heads x dims x history grid

Needs a CUDA GPU. ``--cpu-smoke`` runs tiny shapes through Triton's CPU interpreter to check the
script itself (timings then mean nothing).
"""
from __future__ import annotations

import argparse
import functools
import itertools
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_PEAK_BW = 4.8e12  # H200 HBM3e, bytes/s, when the device does not report its memory clock
NUM_CODES = 4  # semantic-ID length: decode steps per item

# (users B, heads H, head dim d, history N); beam width comes from --beam
PRESETS = {
    "quick": [(64, 2, 32, 128), (64, 2, 64, 512), (128, 4, 64, 2048)],
    "default": [(64, 2, 32, 128), (64, 2, 32, 512), (256, 2, 64, 512), (64, 4, 64, 2048),
                (256, 4, 64, 2048), (512, 2, 32, 2048), (512, 4, 64, 512)],
    "full": list(itertools.product((64, 256, 512), (2, 4), (32, 64), (128, 512, 2048))),
    "smoke": [(2, 2, 16, 40)],
}
# HSTU: (batch, heads, head dim, history N, candidates M; 0 = causal history encode)
HSTU_PRESETS = {
    "quick": [(64, 2, 32, 512, 0), (64, 2, 64, 512, 128)],
    "default": [(64, 2, 32, 512, 0), (64, 2, 64, 2048, 0), (256, 4, 32, 512, 0), (256, 2, 64, 2048, 128),
                (512, 2, 32, 512, 128)],
    "full": [(b, h, d, n, m) for b in (64, 256) for h in (2, 4) for d in (32, 64) for n in (512, 2048)
             for m in (0, 128)],
    "smoke": [(2, 2, 16, 30, 0), (2, 2, 16, 30, 5)],
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--out", type=Path, default=None,
                   help="directory for gpu_kernels.json and gpu_kernels.md (default: perf/results; "
                        "a temporary directory with --cpu-smoke)")
    p.add_argument("--preset", choices=["quick", "default", "full"], default="default")
    p.add_argument("--dtype", choices=["fp16", "bf16", "fp32"], default="fp16")
    p.add_argument("--beam", type=int, default=100, help="beam width W (default 100)")
    p.add_argument("--k", type=int, default=256, help="PFA rows kept at the selection step (default 256)")
    p.add_argument("--r", type=float, default=0.5, help="PFA budget ratio per later step (default 0.5)")
    p.add_argument("--ragged", action="store_true",
                   help="history lengths uniform in [N/2, N] instead of all N")
    p.add_argument("--rep-ms", type=float, default=100.0, help="timed milliseconds per measurement")
    p.add_argument("--no-reference-timing", action="store_true", help="time the kernels only")
    p.add_argument("--skip-hstu", action="store_true")
    p.add_argument("--no-hstu-profile", action="store_true",
                   help="skip timing the HSTU kernel per tile shape and without its biases")
    p.add_argument("--baseline-kernels", type=Path, default=None,
                   help="another version of the kernels (a backend_src/ops/triton_kernels package directory, "
                        "or a single-file version) whose hstu_attention is checked and timed beside this one "
                        "(side by side in one run)")
    p.add_argument("--skip-decode", action="store_true")
    p.add_argument("--peak-bw", type=float, default=None,
                   help="device memory bandwidth in bytes/s (default: from the device, else 4.8e12)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--served-decode", action="store_true",
                   help="instead of the kernels: the served decode (backend_src.decoding.cuda_graphs) checked "
                        "against the eager decode and timed, eager vs CUDA-graph replays, into OUT/graphs")
    p.add_argument("--cpu-smoke", action="store_true",
                   help="tiny shapes on the CPU through Triton's interpreter: checks this script only")
    return p.parse_args(argv)


# --------------------------------------------------------------------------------------------
# device facts
# --------------------------------------------------------------------------------------------
def device_info(torch, args, timer) -> dict:
    if args.cpu_smoke:
        return {"name": "cpu (interpreter smoke run)", "peak_bw": args.peak_bw or DEFAULT_PEAK_BW,
                "peak_flops": {"tensor_fp16": None, "tf32": None, "fp32": None}}
    props = torch.cuda.get_device_properties(0)
    sms = props.multi_processor_count
    mem_clock = getattr(props, "memory_clock_rate", 0) or 0  # kHz
    bus = getattr(props, "memory_bus_width", 0) or 0  # bits
    bw_dev = 2 * mem_clock * 1e3 * bus / 8 if mem_clock and bus else None  # double data rate
    peak_bw = args.peak_bw or bw_dev or DEFAULT_PEAK_BW
    clock = getattr(props, "clock_rate", 0) or 0  # kHz
    clock_hz = clock * 1e3 if clock else 1.98e9  # H200 boost clock when not reported
    # dense FLOPs per SM per clock: Hopper tensor cores 4096 (fp16/bf16), 2048 (tf32); FP32 FMA 256
    per_sm = {"tensor_fp16": 4096, "tf32": 2048, "fp32": 256} if props.major >= 9 else \
        {"tensor_fp16": 2048, "tf32": 1024, "fp32": 256}
    # the achievable ceiling: a 1 GiB device-to-device copy, bytes read + written
    src = torch.randint(0, 256, (2**30,), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    copy_bw = 2 * src.numel() / (timer(lambda: dst.copy_(src)) * 1e-3)
    del src, dst
    return {
        "name": props.name, "capability": f"{props.major}.{props.minor}", "sms": sms,
        "copy_bw_measured": copy_bw,
        "total_memory_gib": round(props.total_memory / 2**30, 1),
        "l2_mib": round(getattr(props, "L2_cache_size", 0) / 2**20, 1),
        "clock_hz": clock_hz, "clock_reported": bool(clock),
        "peak_bw": peak_bw, "peak_bw_source": "--peak-bw" if args.peak_bw else ("device" if bw_dev else "default"),
        "peak_flops": {k: sms * v * clock_hz for k, v in per_sm.items()},
    }


# --------------------------------------------------------------------------------------------
# timing
# --------------------------------------------------------------------------------------------
class Timer:
    """Median wall time of fn in ms: CUDA events around each call, L2 flushed before each."""

    def __init__(self, torch, rep_ms: float, cpu: bool):
        self.torch, self.rep_ms, self.cpu = torch, rep_ms, cpu
        self.flush = None if cpu else torch.empty(256 * 2**20, dtype=torch.int8, device="cuda")

    def __call__(self, fn) -> float:
        torch = self.torch
        if self.cpu:
            t = time.perf_counter()
            fn()
            return (time.perf_counter() - t) * 1e3
        fn()  # compile / warm up
        torch.cuda.synchronize()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(3):
            fn()
        e.record()
        torch.cuda.synchronize()
        est = max(s.elapsed_time(e) / 3, 1e-3)
        reps = int(min(200, max(5, self.rep_ms / est)))
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
        for i in range(reps):
            self.flush.zero_()
            starts[i].record()
            fn()
            ends[i].record()
        torch.cuda.synchronize()
        return statistics.median(a.elapsed_time(b) for a, b in zip(starts, ends))


# --------------------------------------------------------------------------------------------
# correctness
# --------------------------------------------------------------------------------------------
def tolerance(dtype_name: str) -> float:
    return {"fp32": 2e-4, "fp16": 1e-2, "bf16": 5e-2}[dtype_name]


def max_err(a, b) -> float:
    return float((a.float() - b.float()).abs().max()) if a.numel() else 0.0


# --------------------------------------------------------------------------------------------
# decode-time ops (PFA paper)
# --------------------------------------------------------------------------------------------
def budgets(args, n: int) -> list[int]:
    """Rows read per step in PFA / dynamic top-k: k at step 1, k r^(t-1) after (capped at N)."""
    return [n] + [min(n, max(1, math.ceil(args.k * args.r ** (t - 1)))) for t in range(1, NUM_CODES)]


def bench_decode(torch, R, K, timer, args, cfg, dtype, dev, info) -> dict:
    B, H, d, N = cfg
    W = args.beam
    g = torch.Generator(device=dev).manual_seed(args.seed)  # random data made on the device
    esize = torch.finfo(dtype).bits // 8

    def rnd(*shape):
        return torch.randn(*shape, generator=g, device=dev).to(dtype)

    if args.ragged:
        lengths = torch.randint(N // 2, N + 1, (B,), generator=g, device=dev)
    else:
        lengths = torch.full((B,), N, dtype=torch.long, device=dev)
    # one query and one K/V projection of the history per decode step (the PFA paper's per-step K/V)
    qs = [rnd(B, W, H, d) for _ in range(NUM_CODES)]
    ks = [rnd(B, N, H, d) for _ in range(NUM_CODES)]
    vs = [rnd(B, N, H, d) for _ in range(NUM_CODES)]
    w = torch.softmax(torch.randn(B, W, generator=g, device=dev), -1)
    q, k, v = qs[1], ks[1], vs[1]
    states = rnd(B, N, H * d)  # the decoder's history states, gathered at the selection step
    bud = budgets(args, N)
    keep = bud[1]
    valid_rows = float(lengths.sum())
    res = {"config": dict(users=B, beam=W, heads=H, head_dim=d, history=N, keep=keep, budgets=bud,
                          ragged=args.ragged), "checks": {}, "kernels": {}, "decode": {}}
    tol = tolerance(args.dtype)

    # ---- correctness: kernels vs the reference on the same values in fp32
    q32, k32, v32 = q.float(), k.float(), v.float()
    chk = res["checks"]
    chk["decode_attention"] = max_err(K.decode_attention(q, k, v, lengths), R.decode_attention(q32, k32, v32, lengths))
    chk["attention_probs"] = max_err(K.attention_probs(q, k, lengths), R.attention_probs(q32, k32, lengths))
    order, kept = K.pfa_select(q, k, lengths, w, keep)
    r_order, r_kept = R.pfa_select(q32, k32, lengths, w, keep)
    pos = torch.arange(order.shape[1], device=dev)[None, :] < kept[:, None]
    same = [(set(order[b][pos[b]].tolist()) == set(r_order[b][pos[b]].tolist())) for b in range(min(B, 64))]
    chk["pfa_select_kept_lengths_equal"] = bool(torch.equal(kept, r_kept))
    chk["pfa_select_same_kept_set_frac"] = sum(same) / len(same)
    dyn = K.dynamic_topk_attention(q, k, v, lengths, keep)
    r_dyn = R.dynamic_topk_attention(q32, k32, v32, lengths, keep)
    row_err = (dyn.float() - r_dyn).abs().amax(-1)  # [B, W, H]; a near-tie may pick another row
    chk["dynamic_topk_rows_over_tol_frac"] = float((row_err > tol).float().mean())
    chk["gather_rows_exact"] = bool(torch.equal(K.gather_rows(k, order), R.gather_rows(k, order)))
    # PFA's selection fused with the gather of the kept states, against the unfused composition:
    # on the same scores the same order (torch.topk, distinct scores) and exactly its rows; the op
    # against pfa_select + gather_rows (each scoring anew: float atomics may break a near-tie differently)
    scores = K.selection.pfa_scores(q, k, lengths, w)
    f_order, (f_rows,) = K.selection.select_rows(scores, keep, (states,))
    chk["pfa_select_rows_same_order"] = bool(torch.equal(f_order[pos], torch.topk(scores, keep, dim=1).indices[pos]))
    chk["pfa_select_rows_exact"] = bool(torch.equal(f_rows, K.gather_rows(states, f_order)))
    (f_rows,), f_kept = K.pfa_select_rows(q, k, lengths, w, keep, (states,))
    u_rows = K.gather_rows(states, order)
    same = [torch.equal(f_rows[b, : kept[b]], u_rows[b, : kept[b]]) for b in range(min(B, 64))]
    chk["pfa_select_rows_same_rows_frac"] = sum(same) / len(same) if torch.equal(f_kept, kept) else 0.0
    del scores, f_order, f_rows, u_rows
    ok = (chk["decode_attention"] <= tol and chk["attention_probs"] <= tol / 4
          and chk["pfa_select_kept_lengths_equal"] and chk["pfa_select_same_kept_set_frac"] >= 0.95
          and chk["dynamic_topk_rows_over_tol_frac"] <= 1e-3
          and chk["gather_rows_exact"] and chk["pfa_select_rows_same_order"] and chk["pfa_select_rows_exact"]
          and chk["pfa_select_rows_same_rows_frac"] >= 0.95)
    chk["ok"] = bool(ok)
    del q32, k32, v32, r_dyn

    # ---- per-op timings; bytes = what the op must read and write at least
    bytes_ = {
        "decode_attention": esize * (2 * B * W * H * d + 2 * valid_rows * H * d),
        "attention_probs": esize * (B * W * H * d + valid_rows * H * d + B * W * H * N),
        "pfa_select": esize * (B * W * H * d + valid_rows * H * d),  # q and the keys
        # every beam's rows are masked in one dense pass over the user's K/V (no per-beam gather)
        "dynamic_topk_attention": esize * (2 * B * W * H * d + 2 * valid_rows * H * d),
        "gather_rows": esize * 2 * B * keep * H * d,
        # the selection, then the kept states read and written (fused: one launch after the scores)
        "pfa_select_rows": esize * (B * W * H * d + valid_rows * H * d + 2 * B * keep * H * d),
        "pfa_select+gather_rows": esize * (B * W * H * d + valid_rows * H * d + 2 * B * keep * H * d),
    }
    flops = {
        "decode_attention": 4 * W * valid_rows * H * d,
        "attention_probs": 2 * W * valid_rows * H * d,
        "pfa_select": 4 * W * valid_rows * H * d,  # QK twice: softmax statistics, then weights
        "dynamic_topk_attention": 8 * W * valid_rows * H * d,  # QK for statistics and weights, then QK + AV
        "gather_rows": 0.0,
        "pfa_select_rows": 4 * W * valid_rows * H * d,
        "pfa_select+gather_rows": 4 * W * valid_rows * H * d,
    }
    calls = {
        "decode_attention": lambda m: m.decode_attention(q, k, v, lengths),
        "attention_probs": lambda m: m.attention_probs(q, k, lengths),
        "pfa_select": lambda m: m.pfa_select(q, k, lengths, w, keep),
        "dynamic_topk_attention": lambda m: m.dynamic_topk_attention(q, k, v, lengths, keep),
        "gather_rows": lambda m: m.gather_rows(k, order),
        "pfa_select_rows": lambda m: m.pfa_select_rows(q, k, lengths, w, keep, (states,)),
        "pfa_select+gather_rows": lambda m: m.gather_rows(states, m.pfa_select(q, k, lengths, w, keep)[0]),
    }
    fp_peak = info["peak_flops"]["fp32" if args.dtype == "fp32" else "tensor_fp16"]
    for name, call in calls.items():
        t_k = timer(lambda: call(K))
        t_r = None if args.no_reference_timing else timer(lambda: call(R))
        res["kernels"][name] = {
            "triton_ms": t_k, "torch_ms": t_r, "speedup": (t_r / t_k) if t_r else None,
            "bytes": bytes_[name], "triton_tb_s": bytes_[name] / t_k / 1e9,
            "bw_frac": bytes_[name] / (t_k * 1e-3) / info["peak_bw"],
            "triton_tflops": flops[name] / t_k / 1e9,
            "flop_frac": (flops[name] / (t_k * 1e-3) / fp_peak) if fp_peak else None,
        }
    kern = res["kernels"]
    res["fused_selection"] = {"fused_ms": kern["pfa_select_rows"]["triton_ms"],
                              "unfused_ms": kern["pfa_select+gather_rows"]["triton_ms"],
                              "unfused_over_fused": kern["pfa_select+gather_rows"]["triton_ms"]
                              / kern["pfa_select_rows"]["triton_ms"]}

    # ---- where the selection ops spend their time: scores kernel, then torch.topk (and the gather
    # of the kept states), or the fused top-k + gather kernel
    pfa_scores = K.selection.pfa_scores(q, k, lengths, w)
    beam_scores = K.decode.beam_head_mean(q, k, lengths)
    parts = {
        "pfa_scores": lambda: K.selection.pfa_scores(q, k, lengths, w),
        "pfa_topk": lambda: torch.topk(pfa_scores, keep, dim=1),
        "pfa_topk_gather": lambda: K.gather_rows(states, torch.topk(pfa_scores, keep, dim=1).indices),
        "pfa_select_rows_kernel": lambda: K.selection.select_rows(pfa_scores, keep, (states,)),
        "beam_scores": lambda: K.decode.beam_head_mean(q, k, lengths),
        "beam_topk": lambda: torch.topk(beam_scores, keep, dim=-1),
    }
    res["parts_ms"] = {name: timer(fn) for name, fn in parts.items()}
    del pfa_scores, beam_scores

    # ---- a whole decode (4 steps, attention only) in the three modes
    def full(m):
        return [m.decode_attention(qs[t], ks[t], vs[t], lengths) for t in range(NUM_CODES)]

    def pfa(m):
        outs = [m.decode_attention(qs[0], ks[0], vs[0], lengths)]
        order_, kept_ = m.pfa_select(qs[1], ks[1], lengths, w, keep)
        for t in range(1, NUM_CODES):  # the kept rows gathered once, then contiguous prefixes
            kg, vg = m.gather_rows(ks[t], order_), m.gather_rows(vs[t], order_)
            outs.append(m.decode_attention(qs[t], kg, vg, torch.clamp(kept_, max=bud[t])))
        return outs

    def dynamic(m):
        outs = [m.decode_attention(qs[0], ks[0], vs[0], lengths)]
        for t in range(1, NUM_CODES):
            outs.append(m.dynamic_topk_attention(qs[t], ks[t], vs[t], lengths, bud[t]))
        return outs

    for impl, mod in (("triton", K), ("torch", R)):
        if impl == "torch" and args.no_reference_timing:
            continue
        modes = (("full", full), ("pfa", pfa), ("dynamic_topk", dynamic))
        times = {name: timer(lambda f=f: f(mod)) for name, f in modes}
        times["full_over_pfa"] = times["full"] / times["pfa"]
        times["dynamic_topk_over_pfa"] = times["dynamic_topk"] / times["pfa"]
        res["decode"][impl] = times
    return res


# --------------------------------------------------------------------------------------------
# HSTU attention (HSTU paper)
# --------------------------------------------------------------------------------------------
def bench_hstu(torch, R, K, timer, args, cfg, dtype, dev, info, baseline=None) -> dict:
    B, H, d, N, M = cfg
    g = torch.Generator(device=dev).manual_seed(args.seed + 1)
    esize = torch.finfo(dtype).bits // 8
    P, T = N, 64

    def rnd(*shape):
        return (torch.randn(*shape, generator=g, device=dev) * 0.5).to(dtype)

    nh = torch.full((B,), N, dtype=torch.long, device=dev)
    pos = torch.arange(N, device=dev)[None].expand(B, N)
    ts = torch.cumsum(torch.randint(0, 3 * 86400, (B, N), generator=g, device=dev), 1)
    pb = (torch.randn(H, P, generator=g, device=dev) * 0.1).to(dtype)  # the reference adds
    tb = (torch.randn(H, T, generator=g, device=dev) * 0.1).to(dtype)  # them in the input dtype
    if M == 0:  # causal encode of the history
        q, k, v = rnd(B, N, H, d), rnd(B, N, H, d), rnd(B, N, H, d)
        call_args = (q, k, v, pos, pos, ts, ts, nh, torch.full((B, N), -1, device=dev))
        pairs = B * N * (N + 1) / 2
        n_q, n_k = N, N
    else:  # M-FALCON: M candidates over the cached history plus themselves
        q, k, v = rnd(B, M, H, d), rnd(B, N + M, H, d), rnd(B, N + M, H, d)
        k_pos = torch.cat([pos, nh[:, None].expand(B, M)], 1)
        k_ts = torch.cat([ts, ts[:, -1:].expand(B, M)], 1)
        call_args = (q, k, v, nh[:, None].expand(B, M), k_pos, ts[:, -1:].expand(B, M), k_ts, nh,
                     (N + torch.arange(M, device=dev))[None].expand(B, M))
        pairs = B * M * (N + 1)
        n_q, n_k = M, N + M
    extra = (pb, tb, 1.6, d ** -0.5, float(N))
    res = {"config": dict(batch=B, heads=H, head_dim=d, history=N, candidates=M), "checks": {}}
    # the reference materializes several [B, H, M, Nk] tensors: only run it where they fit
    ref_bytes = B * n_q * n_k * (H * 4 * 6 + 8 * 4)
    free = torch.cuda.mem_get_info()[0] if dev != "cpu" else 1 << 40
    run_ref = ref_bytes < 0.6 * free
    ref = None
    if run_ref:
        ref = R.hstu_attention(*(t.float() for t in call_args[:3]), *call_args[3:], pb.float(), tb.float(),
                               *extra[2:])

    def check(out) -> dict:
        if ref is None:
            return {"ok": True, "note": f"reference skipped (needs ~{ref_bytes / 2**30:.0f} GiB)"}
        err, scale = max_err(out, ref), float(ref.abs().max()) or 1.0
        return {"max_abs_err": err, "ref_max_abs": scale,
                "ok": bool(err <= tolerance(args.dtype) * max(1.0, scale))}

    nbytes = esize * (B * n_q * H * d * 2 + B * n_k * H * d * 2) + 8 * B * (2 * n_q + 2 * n_k)
    flops = 4 * pairs * H * d
    fp_peak = info["peak_flops"]["fp32" if args.dtype == "fp32" else "tensor_fp16"]

    def rates(t_ms: float) -> dict:
        return {"ms": t_ms, "tflops": flops / t_ms / 1e9,
                "flop_frac": (flops / (t_ms * 1e-3) / fp_peak) if fp_peak else None}

    res["checks"] = check(K.hstu_attention(*call_args, *extra))
    t_k = timer(lambda: K.hstu_attention(*call_args, *extra))
    t_r = timer(lambda: R.hstu_attention(*call_args, *extra)) if run_ref and not args.no_reference_timing else None
    r_k = rates(t_k)
    res["timing"] = {
        "triton_ms": t_k, "torch_ms": t_r, "speedup": (t_r / t_k) if t_r else None,
        "bytes": nbytes, "triton_tb_s": nbytes / t_k / 1e9, "bw_frac": nbytes / (t_k * 1e-3) / info["peak_bw"],
        "triton_tflops": r_k["tflops"], "flop_frac": r_k["flop_frac"],
    }
    if baseline is not None:  # another version of the kernels, side by side
        res["baseline"] = {**rates(timer(lambda: baseline.hstu_attention(*call_args, *extra))),
                           "checks": check(baseline.hstu_attention(*call_args, *extra))}
    if not args.no_hstu_profile:
        # every tile shape of the dtype's list (the op uses K.hstu.hstu_tile), then the best one with
        # every pair's own time bucket (the per-pair path alone), without the time bias and without
        # both biases: what each part of the kernel costs
        def name(tile):
            return "x".join(map(str, tile))

        tile_list = K.hstu.HSTU_TILES_FP32 if dtype == torch.float32 else K.hstu.HSTU_TILES
        tiles = {}
        for tile in tile_list:
            launch = lambda tile=tile: K.hstu.launch_hstu(*call_args, *extra, tiles=tile)  # noqa: E731
            tiles[name(tile)] = {**rates(timer(launch)), "checks": check(launch())}
        best = min(tile_list, key=lambda tile: tiles[name(tile)]["ms"])
        parts = {f"biases={n}": rates(timer(lambda n=n: K.hstu.launch_hstu(*call_args, *extra, tiles=best, biases=n)))
                 for n in (1, 0)}
        per_pair = lambda: K.hstu.launch_hstu(*call_args, *extra, tiles=best, time_steps=0)  # noqa: E731
        parts["per_pair_time"] = {**rates(timer(per_pair)), "checks": check(per_pair())}
        parts["op_at_best"] = rates(timer(lambda: K.hstu.launch_hstu(*call_args, *extra, tiles=best)))
        res["profile"] = {"tiles": tiles, "best": name(best), "parts_at_best": parts}
    return res


# --------------------------------------------------------------------------------------------
# report
# --------------------------------------------------------------------------------------------
def _f(x, spec=".3f"):
    return "-" if x is None else format(x, spec)


GOAL_HSTU = (64, 2, 64, 2048, 0)  # batch, heads, d, N, candidates: the TFLOP/s goal's shape


def goals(report: dict) -> list:
    """The kernel goals against this run: HSTU with its biases >= 60% of its no-bias
    throughput and >= 100 TFLOP/s at 64x2x64x2048; decode_attention and gather_rows >= 70% of the
    measured copy bandwidth at the largest shape (most bytes)."""
    copy_bw = report["device"].get("copy_bw_measured")
    lines = ["", "## Goals", "", "| goal | measured | met |", "|---|---|---|"]
    for r in report["hstu"]:
        c, parts = r["config"], r.get("profile", {}).get("parts_at_best", {})
        key = tuple(c[k] for k in ("batch", "heads", "head_dim", "history", "candidates"))
        if "op_at_best" in parts:  # the same tile with and without its biases
            frac = parts["biases=0"]["ms"] / parts["op_at_best"]["ms"]
            lines.append(f"| HSTU {'x'.join(map(str, key))}: op >= 60% of its no-bias throughput | "
                         f"{frac:.0%} | {frac >= 0.6} |")
        if key == GOAL_HSTU:
            tf = r["timing"]["triton_tflops"]
            lines.append(f"| HSTU {'x'.join(map(str, key))}: >= 100 TFLOP/s | {tf:.0f} | {tf >= 100} |")
    for op in ("decode_attention", "gather_rows"):
        rows = [r["kernels"][op] for r in report["decode"] if op in r.get("kernels", {})]
        if rows and copy_bw:
            t = max(rows, key=lambda x: x["bytes"])
            frac = t["triton_tb_s"] * 1e12 / copy_bw
            lines.append(f"| {op} at its largest shape: >= 70% of the copy bandwidth | {frac:.0%} | {frac >= 0.7} |")
    return lines if len(lines) > 5 else []


def markdown(report: dict) -> str:
    info = report["device"]
    lines = [
        "# Triton kernels vs torch reference on the GPU", "",
        f"- device: {info['name']}; peak memory bandwidth {info['peak_bw'] / 1e12:.2f} TB/s "
        f"({info.get('peak_bw_source', '-')}); a device-to-device copy moved "
        f"{_f(info.get('copy_bw_measured', 0) / 1e12, '.2f')} TB/s (read + write); peak dense fp16 tensor "
        f"{_f((info['peak_flops']['tensor_fp16'] or 0) / 1e12, '.0f')} TFLOP/s, fp32 "
        f"{_f((info['peak_flops']['fp32'] or 0) / 1e12, '.0f')} TFLOP/s (from SM count x clock; approximate)",
        f"- torch {report['versions']['torch']}, triton {report['versions']['triton']}, "
        f"python {report['versions']['python']}; dtype {report['args']['dtype']}, beam {report['args']['beam']}, "
        f"PFA k={report['args']['k']} r={report['args']['r']}; times are medians (ms), L2 flushed",
        f"- all correctness checks passed: **{report['all_ok']}**", "",
    ]
    failed = [r for r in report["decode"] + report["hstu"] if "error" in r]
    lines += [f"- FAILED {r['config']['raw']}: {r['error'][:300]}" for r in failed] + ([""] if failed else [])
    report = {**report, "decode": [r for r in report["decode"] if "error" not in r],
              "hstu": [r for r in report["hstu"] if "error" not in r]}
    if report["decode"]:
        lines += ["## Whole decode (4 steps, attention only)", "",
                  "| users | heads | d | N | budgets | impl | full ms | PFA ms | dyn top-k ms | full/PFA | dyn/PFA |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in report["decode"]:
            c = r["config"]
            for impl, t in r["decode"].items():
                lines.append(f"| {c['users']} | {c['heads']} | {c['head_dim']} | {c['history']} | "
                             f"{'/'.join(map(str, c['budgets']))} | {impl} | {_f(t['full'])} | {_f(t['pfa'])} | "
                             f"{_f(t['dynamic_topk'])} | {_f(t['full_over_pfa'], '.2f')} | "
                             f"{_f(t['dynamic_topk_over_pfa'], '.2f')} |")
        lines += ["", "## Decode ops", "",
                  "| users | heads | d | N | op | triton ms | torch ms | speedup | TB/s | % peak BW | TFLOP/s | ok |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in report["decode"]:
            c = r["config"]
            for name, t in r["kernels"].items():
                lines.append(f"| {c['users']} | {c['heads']} | {c['head_dim']} | {c['history']} | {name} | "
                             f"{_f(t['triton_ms'])} | {_f(t['torch_ms'])} | {_f(t['speedup'], '.2f')} | "
                             f"{_f(t['triton_tb_s'], '.2f')} | {_f(100 * t['bw_frac'], '.1f')} | "
                             f"{_f(t['triton_tflops'], '.1f')} | {r['checks']['ok']} |")
        lines += ["", "## Parts of the selection ops (Triton path, ms)", "",
                  "PFA's selection with the gather of the kept states: torch.topk + gather_rows, or the fused "
                  "top-k + gather kernel (after the same scores kernel); the whole op, unfused over fused.", "",
                  "| users | heads | d | N | PFA scores kernel | PFA top-k | top-k + gather | fused top-k + gather | "
                  "op unfused / fused | per-beam scores kernel | per-beam top-k |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in report["decode"]:
            c, t = r["config"], r.get("parts_ms", {})
            fused = r.get("fused_selection", {})
            lines.append(f"| {c['users']} | {c['heads']} | {c['head_dim']} | {c['history']} | "
                         f"{_f(t.get('pfa_scores'))} | {_f(t.get('pfa_topk'))} | {_f(t.get('pfa_topk_gather'))} | "
                         f"{_f(t.get('pfa_select_rows_kernel'))} | {_f(fused.get('unfused_over_fused'), '.2f')} | "
                         f"{_f(t.get('beam_scores'))} | {_f(t.get('beam_topk'))} |")
    if report["hstu"]:
        lines += ["", "## HSTU attention", "",
                  "| batch | heads | d | N | candidates | triton ms | torch ms | speedup | TB/s | % peak BW | "
                  "TFLOP/s | % peak FLOP | ok |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in report["hstu"]:
            c, t = r["config"], r["timing"]
            lines.append(f"| {c['batch']} | {c['heads']} | {c['head_dim']} | {c['history']} | {c['candidates']} | "
                         f"{_f(t['triton_ms'])} | {_f(t['torch_ms'])} | {_f(t['speedup'], '.2f')} | "
                         f"{_f(t['triton_tb_s'], '.2f')} | {_f(100 * t['bw_frac'], '.1f')} | "
                         f"{_f(t['triton_tflops'], '.1f')} | "
                         f"{_f(100 * t['flop_frac'] if t['flop_frac'] is not None else None, '.1f')} | "
                         f"{r['checks']['ok']} |")
    profiled = [r for r in report["hstu"] if "profile" in r or "baseline" in r]
    if profiled:
        tiles = list(next((r["profile"]["tiles"] for r in profiled if "profile" in r), {}))
        lines += ["", "## HSTU kernel profile (ms; TFLOP/s in brackets)", "",
                  "Each tile shape of the dtype's list (BLOCK_M x BLOCK_N x warps x stages; the op uses "
                  "hstu_tile(dtype, d)); at the best one: every pair's own time bucket (no per-row path), "
                  "only the position bias, no bias (what the biases cost; the op / no bias column compares "
                  "the same tile), and the baseline "
                  f"kernels ({report['args'].get('baseline_kernels') or 'none'}) on the same inputs.", "",
                  "| batch | heads | d | N | cand. | " + " | ".join(tiles) + " | best | per-pair time bucket | "
                  "pos. bias only | no bias | op | op / no bias throughput | baseline | op vs baseline |",
                  "|" + "---|" * (5 + len(tiles) + 8)]
        for r in profiled:
            c, pr = r["config"], r.get("profile", {})

            def cell(x):
                ok = "" if x.get("checks", {}).get("ok", True) else " FAIL"
                return f"{x['ms']:.3f} ({x['tflops']:.0f}){ok}"
            row = [str(c[k]) for k in ("batch", "heads", "head_dim", "history", "candidates")]
            row += [cell(pr["tiles"][t]) if t in pr.get("tiles", {}) else "-" for t in tiles]
            parts = pr.get("parts_at_best", {})
            row += [pr.get("best", "-"), cell(parts["per_pair_time"]) if "per_pair_time" in parts else "-",
                    cell(parts["biases=1"]) if parts else "-", cell(parts["biases=0"]) if parts else "-",
                    f"{r['timing']['triton_ms']:.3f}",
                    f"{parts['biases=0']['ms'] / parts['op_at_best']['ms']:.0%}" if "op_at_best" in parts else "-"]
            b = r.get("baseline")
            row += [cell(b), f"{b['ms'] / r['timing']['triton_ms']:.2f}x"] if b else ["-", "-"]
            lines.append("| " + " | ".join(row) + " |")
    lines += goals(report)
    lines += ["", "Bytes count what an op must move at least (queries, the valid K/V rows, kept rows, "
              "outputs); PFA scoring reads K twice (statistics, then weights), so its fraction is a lower bound. "
              "Where N <= k the selection keeps every row, so PFA cannot beat full attention there.",
              ""]
    return "\n".join(lines)


# (users, history) of the served-decode run: the whole-decode benchmark's batches
SERVED_DECODE = [(512, 128), (512, 512), (128, 2048)]


def served_decode(torch, args) -> int:
    """The served decode path: DecodeGraphs (padding to a bucket, then a replay of its CUDA graph)
    against the eager, unpadded decode of the same batch, per mode; the same items and
    log-probabilities first, then latency per batch (host included, as a server sees it)."""
    import types

    from backend_src.config import DecodeOptions
    from backend_src.decoding import generate
    from backend_src.decoding.cuda_graphs import DecodeGraphs
    from backend_src.results import git_commit
    from perf.bench_decode import build

    dev = "cpu" if args.cpu_smoke else "cuda"  # the smoke run: padded eager decode, tiny batches
    batches = [(3, 24)] if args.cpu_smoke else SERVED_DECODE
    codebook, decoders = build(512 if args.cpu_smoke else 16384, 64, 2, max(n for _, n in batches), args.seed, dev)
    model = types.SimpleNamespace(decoder=decoders[False], codebook=codebook)
    out_dir = args.out / "graphs"
    out_dir.mkdir(parents=True, exist_ok=True)
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
    report = {"commit": git_commit(), "versions": {"torch": torch.__version__},
              "device": torch.cuda.get_device_name(0) if dev == "cuda" else "cpu (smoke run)",
              "beam": args.beam, "k": args.k, "r": args.r, "rows": []}
    ok = True

    def timed(fn, reps=15):
        times = []
        for _ in range(reps + 2):
            sync()
            t = time.perf_counter()
            fn()
            sync()
            times.append((time.perf_counter() - t) * 1e3)
        return statistics.median(times[2:])

    for users, n in batches:
        g = torch.Generator().manual_seed(args.seed + n)
        states = torch.randn(users, n, 64, generator=g).to(dev)
        ragged = torch.randint(n // 2, n + 1, (users,), generator=g)
        for lengths, shape in ((torch.full((users,), n), "full"), (ragged, "ragged")):
            lengths = lengths.to(dev)
            row = {"users": users, "history": n, "lengths": shape, "modes": {}}
            for mode in ("full", "pfa", "dynamic_topk"):
                opts = DecodeOptions(mode=mode, beam_width=args.beam, k=args.k, r=args.r, selection_step=1)
                graphs = DecodeGraphs(model, batch_buckets=(users + 1,), history_buckets=(n + 8,), pad=True) \
                    if args.cpu_smoke else DecodeGraphs(model, batch_buckets=(users,), history_buckets=(n,))
                t0 = time.time()
                graphs.warmup(opts)
                capture_s = time.time() - t0
                with torch.inference_mode():
                    ref = generate(model.decoder, codebook, states, lengths, opts)
                    got = graphs.retrieve(states, lengths, opts)
                    same = float((ref.item_ids == got.item_ids).float().mean())
                    fin = torch.isfinite(ref.log_probs)
                    lp_err = float((ref.log_probs - got.log_probs)[fin].abs().max()) if fin.any() else 0.0
                    eager_ms = timed(lambda: generate(model.decoder, codebook, states, lengths, opts))
                    graph_ms = timed(lambda: graphs.retrieve(states, lengths, opts))
                ok &= same == 1.0 and lp_err < 1e-3
                row["modes"][mode] = dict(eager_ms=eager_ms, graph_ms=graph_ms, capture_s=capture_s,
                                          same_items=same, max_log_prob_err=lp_err)
                print(f"served decode {users}x{n} {shape} {mode}: eager {eager_ms:.2f} ms, graph {graph_ms:.2f} ms, "
                      f"same items {same:.4f}, log-prob err {lp_err:.1e}", flush=True)
                del graphs
                if dev == "cuda":
                    torch.cuda.empty_cache()
            m = row["modes"]
            row["full_over_pfa"] = {k: m["full"][k] / m["pfa"][k] for k in ("eager_ms", "graph_ms")}
            report["rows"].append(row)
            report["all_ok"] = ok
            (out_dir / "served_decode.json").write_text(json.dumps(report, indent=1))
    for row in report["rows"]:
        goal = {512: 1.45, 2048: 3.0}.get(row["history"])
        print(f"PFA speedup {row['users']}x{row['history']} ({row['lengths']}): graphed "
              f"{row['full_over_pfa']['graph_ms']:.2f}x, eager {row['full_over_pfa']['eager_ms']:.2f}x"
              + (f" (goal {goal}x)" if goal else ""))
    print(f"wrote {out_dir / 'served_decode.json'}; graphs equal the eager decode: {ok}")
    return 0 if ok else 1


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.out is None:
        args.out = Path(tempfile.gettempdir()) / "gpu_kernels_smoke" if args.cpu_smoke else REPO / "perf" / "results"
    if args.cpu_smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported
    import torch

    if not args.cpu_smoke and not torch.cuda.is_available():
        print("gpu_kernels: no CUDA GPU is visible (torch.cuda.is_available() is False); this benchmark "
              "needs one. Use --cpu-smoke to check the script on the CPU.", file=sys.stderr)
        return 2
    try:
        import triton
    except ImportError:
        print("gpu_kernels: triton is not installed", file=sys.stderr)
        return 2
    sys.path.insert(0, str(REPO))
    from backend_src.ops import reference as R
    from backend_src.ops import triton_kernels as K
    from backend_src.results import git_commit

    baseline = None
    if args.baseline_kernels is not None:  # a module of its own, beside ours
        from backend_src.ops.kernel_copies import load_copy
        baseline = load_copy(args.baseline_kernels, "baseline_triton_kernels")

    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    dev = "cpu" if args.cpu_smoke else "cuda"
    preset = "smoke" if args.cpu_smoke else args.preset
    if args.cpu_smoke:
        args.beam = min(args.beam, 5)
        args.k = min(args.k, 16)
    timer = Timer(torch, args.rep_ms, cpu=args.cpu_smoke)
    info = device_info(torch, args, timer)
    if not args.cpu_smoke:  # an idle GPU runs at a low clock: raise it before the first timing
        a = torch.randn(4096, 4096, device="cuda", dtype=torch.float16)
        t_end = time.time() + 2.0
        while time.time() < t_end:
            for _ in range(20):
                a @ a
            torch.cuda.synchronize()
        del a
    torch.backends.cuda.matmul.allow_tf32 = False  # the fp32 reference stays exact
    if args.served_decode:
        args.out.mkdir(parents=True, exist_ok=True)
        return served_decode(torch, args)
    report = {
        "device": info,
        "versions": {"torch": torch.__version__, "triton": triton.__version__, "python": platform.python_version()},
        "commit": git_commit(),
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "decode": [], "hstu": [],
    }
    t0 = time.time()
    args.out.mkdir(parents=True, exist_ok=True)

    def save():  # after every configuration: a run cut short still leaves what it measured
        entries = report["decode"] + report["hstu"]
        report["all_ok"] = bool(entries) and all(r["checks"]["ok"] for r in entries)
        report["seconds"] = time.time() - t0
        (args.out / "gpu_kernels.json").write_text(json.dumps(report, indent=1))
        (args.out / "gpu_kernels.md").write_text(markdown(report))

    def run(kind, bench, cfg):
        try:
            r = bench(torch, R, K, timer, args, cfg, dtype, dev, info)
        except Exception as exc:  # one configuration failing (compile error, memory) must not end the run
            r = {"config": {"raw": list(cfg)}, "checks": {"ok": False}, "error": f"{type(exc).__name__}: {exc}"}
            print(f"{kind} {cfg}: FAILED {r['error'][:2000]}", flush=True)
        report[kind].append(r)
        if dev == "cuda":
            torch.cuda.empty_cache()
        save()
        return r

    with torch.no_grad():
        if not args.skip_decode:
            for cfg in PRESETS[preset]:
                r = run("decode", bench_decode, cfg)
                if "error" not in r:
                    d = r["decode"].get("triton", {})
                    print(f"decode {cfg}: ok={r['checks']['ok']} full/pfa={d.get('full_over_pfa', 0):.2f} "
                          f"dyn/pfa={d.get('dynamic_topk_over_pfa', 0):.2f} ({time.time() - t0:.0f}s)", flush=True)
        if not args.skip_hstu:
            for cfg in HSTU_PRESETS[preset]:
                r = run("hstu", functools.partial(bench_hstu, baseline=baseline), cfg)
                if "error" not in r:
                    print(f"hstu {cfg}: ok={r['checks']['ok']} triton {r['timing']['triton_ms']:.3f} ms "
                          f"torch {_f(r['timing']['torch_ms'])} ms ({time.time() - t0:.0f}s)", flush=True)
    save()
    print(f"wrote {args.out / 'gpu_kernels.json'} and {args.out / 'gpu_kernels.md'}; all checks ok: {report['all_ok']}")
    return 0 if report["all_ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
