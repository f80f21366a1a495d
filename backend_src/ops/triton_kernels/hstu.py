"""HSTU pointwise attention ("Actions Speak Louder than Words: Trillion-Parameter Sequential
Transducers for Generative Recommendations") as a Triton kernel, with the relative position / time
bias and the M-FALCON mask computed in the kernel.

One program per (user, head, block of queries); every per-pair value is 32 bits (its profile on an
H200: perf/gpu_kernels.py).
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from backend_src.ops import reference

from .common import beam_block, block_keys, dot_precision, load_beam_queries, pow2

_THRESHOLDS: dict = {}


def _bucket_thresholds(num_buckets: int, base: float, device: torch.device):
    """(float32 thresholds [T + 1], integer thresholds [T + 1]) on the device, built once per table."""
    key = (num_buckets, float(base), str(device))
    if key not in _THRESHOLDS:
        _THRESHOLDS[key] = (reference.time_bucket_thresholds(num_buckets, float(base)).to(device),
                            reference.time_bucket_int_thresholds(num_buckets, float(base)).to(device))
    return _THRESHOLDS[key]


@triton.jit
def _time_bucket(dt_abs, thr_ptr, T, inv_log2_base):
    """Reference time bucket of float32 |dt|: a fast log estimate L lowered by a margin larger than
    its error and the reference's rounding (both ~1e-6 relative), so it is the bucket or the one
    below; one threshold lookup then decides exactly."""
    est = tl.floor(tl.log2(1.0 + dt_abs) * inv_log2_base * (1.0 - 1.0e-5) - 1.0e-3)
    bkt = tl.minimum(tl.maximum(est, 0.0), T - 1).to(tl.int32)
    return tl.where(dt_abs >= tl.load(thr_ptr + bkt + 1), bkt + 1, bkt)


@triton.jit
def _time_bias_pairs(qt, kt, thr_ptr, tb_base, stb_t, T, inv_log2_base):
    """Per-pair time bias: each pair's bucket (a log and a threshold lookup), then a table lookup."""
    dt = (qt[:, None] - kt[None, :]).to(tl.float32)  # int64 difference, then rounded
    bkt = _time_bucket(tl.abs(dt), thr_ptr, T, inv_log2_base)
    return tl.load(tb_base + bkt * stb_t)


@triton.jit
def _hstu_tile(acc, q, qp, qt, rows, row_ok, allowed,
               k_base, v_base, kpos_base, kts_base, pb_base, tb_base, thr_ptr, cthr_ptr,
               sk_n, sk_d, sv_n, sv_d, skp_n, skt_n, spb_p, stb_t, P, T,
               scale, inv_log2_base, offs_d, d_mask, offs_dv, dv_mask,
               DOT_PRECISION: tl.constexpr, BIASES: tl.constexpr, CAUSAL: tl.constexpr,
               TIME_STEPS: tl.constexpr):
    """acc += (allowed & causal) silu(scale q k_rows^T + biases) @ v_rows for one key tile.
    q [BM, BD]; rows/row_ok [BN]: key indices and which exist; allowed [BM, BN] or broadcastable.
    The bias tables are fp32 (converted once by the wrapper)."""
    kp = tl.load(kpos_base + rows * skp_n, mask=row_ok, other=0).to(tl.int32)
    k = tl.load(k_base + rows[:, None] * sk_n + offs_d[None, :] * sk_d,
                mask=row_ok[:, None] & d_mask[None, :], other=0.0)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale  # [BM, BN]
    if BIASES >= 1:
        rel = tl.minimum(tl.maximum(qp[:, None] - kp[None, :], 0), P - 1)
        s += tl.load(pb_base + rel * spb_p)
    if BIASES >= 2:
        kt = tl.load(kts_base + rows * skt_n, mask=row_ok, other=0)
        if TIME_STEPS > 0:
            # Per-row bucket boundaries: a query row after every key of the tile has its |dt| in
            # [near, far] (the tile's last and first key), so its buckets run from bucket(near) to
            # bucket(far). Where that span is at most TIME_STEPS buckets for every row (all tiles
            # but those at or next to the diagonal), a pair's bucket is bucket(near) plus the
            # row's integer thresholds it reaches: one 32-bit compare and select per step and pair
            # instead of a log and two lookups. Other tiles take the per-pair path.
            kt_lo = tl.min(tl.where(row_ok, kt, 1 << 62), axis=0)
            kt_hi = tl.max(tl.where(row_ok, kt, -(1 << 62)), axis=0)
            near = qt - kt_hi  # [BM] int64
            far = qt - kt_lo
            # (a row before some key, near < 0, takes the per-pair path: its buckets are not read)
            b_near = _time_bucket(tl.maximum(near, 0).to(tl.float32), thr_ptr, T, inv_log2_base)
            b_far = _time_bucket(tl.maximum(far, 0).to(tl.float32), thr_ptr, T, inv_log2_base)
            row_fast = (near >= 0) & (b_far - b_near <= TIME_STEPS)  # (rows past M: qt is 2^61)
            fast = (tl.min(row_fast.to(tl.int32), axis=0) > 0) & (kt_hi - kt_lo < (1 << 31))
            if fast:
                u = tl.where(row_ok, kt - kt_lo, 0).to(tl.int32)  # [BN] key time after the tile's first
                tv = tl.zeros(s.shape, tl.float32) + tl.load(tb_base + b_near * stb_t)[:, None]
                for r in tl.static_range(1, TIME_STEPS + 1):
                    br = tl.minimum(b_near + r, T)
                    # |dt| = far - u >= c[br]  <=>  u <= far - c[br]
                    e = tl.minimum(tl.maximum(far - tl.load(cthr_ptr + br), -1), (1 << 31) - 1).to(tl.int32)
                    tr = tl.load(tb_base + tl.minimum(br, T - 1) * stb_t)
                    tv = tl.where(u[None, :] <= e[:, None], tr[:, None], tv)
            else:
                tv = _time_bias_pairs(qt, kt, thr_ptr, tb_base, stb_t, T, inv_log2_base)
            s += tv
        else:
            s += _time_bias_pairs(qt, kt, thr_ptr, tb_base, stb_t, T, inv_log2_base)
    # silu with the approximate reciprocal (2 ulp): the IEEE division was a third of the tile's
    # instructions; 1/N is applied once to the output
    a = tl.fdiv(s, 1.0 + tl.exp2(-s * 1.4426950408889634), ieee_rounding=False)
    allowed = allowed & row_ok[None, :]
    if CAUSAL:
        allowed = allowed & (kp[None, :] <= qp[:, None])
    a = tl.where(allowed, a, 0.0)
    v = tl.load(v_base + rows[:, None] * sv_n + offs_dv[None, :] * sv_d,
                mask=row_ok[:, None] & dv_mask[None, :], other=0.0)
    return acc + tl.dot(a.to(v.dtype), v, input_precision=DOT_PRECISION)


@triton.jit
def _hstu_attention_kernel(
    q_ptr, k_ptr, v_ptr, qpos_ptr, kpos_ptr, qts_ptr, kts_ptr, nh_ptr, qself_ptr,
    pb_ptr, tb_ptr, thr_ptr, cthr_ptr, o_ptr,
    M, H, NK, P, T,
    sq_b, sq_m, sq_h, sq_d,
    sk_b, sk_n, sk_h, sk_d,
    sv_b, sv_n, sv_h, sv_d,
    sqp_b, sqp_m, skp_b, skp_n,
    sqt_b, sqt_m, skt_b, skt_n,
    sqs_b, sqs_m,
    spb_h, spb_p, stb_h, stb_t,
    so_b, so_m, so_h, so_d,
    scale, inv_norm, inv_log2_base,
    D: tl.constexpr, DV: tl.constexpr,  # head dims are compile-time: no masks on full-width tiles
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    DOT_PRECISION: tl.constexpr, BIASES: tl.constexpr = 2, TIME_STEPS: tl.constexpr = 3,
):
    """out[b,i,h] = sum_j allowed(i,j) silu(scale q.k + pos_bias + time_bias) / norm * v_j.

    History keys j < num_history[b] with k_pos[j] <= q_pos[i] are scanned tile by tile; the one
    extra key a candidate sees (itself, q_self[b, i]) comes first, as one tile of the block's
    own keys kept on its diagonal.
    Per-pair values are 32-bit: positions as int32, |dt| rounded to float32 as the reference does
    (timestamps are subtracted in int64 first, so large epochs lose nothing).
    BIASES = 2 adds both biases (the op); 1 (position only) and 0 (none) exist for the GPU
    efficiency profile, which times what each bias costs."""
    b, h, offs_m, offs_d, m_mask, d_mask = beam_block(H, M, D, BLOCK_M, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    offs_n = tl.arange(0, BLOCK_N)
    dv_mask = offs_dv < DV

    qp = tl.load(qpos_ptr + b * sqp_b + offs_m * sqp_m, mask=m_mask, other=0).to(tl.int32)
    # int64; rows past M get a time after every key, so they never force a tile's per-pair path
    qt = tl.load(qts_ptr + b * sqt_b + offs_m * sqt_m, mask=m_mask, other=1 << 61)
    qs = tl.load(qself_ptr + b * sqs_b + offs_m * sqs_m, mask=m_mask, other=-1)
    nh = tl.minimum(tl.load(nh_ptr + b), NK).to(tl.int32)
    k_base = k_ptr + b * sk_b + h * sk_h  # this (user, head)'s rows of every input
    v_base = v_ptr + b * sv_b + h * sv_h
    kpos_base = kpos_ptr + b * skp_b
    kts_base = kts_ptr + b * skt_b
    pb_base = pb_ptr + h * spb_h
    tb_base = tb_ptr + h * stb_h

    # causal bound: one pass over the key positions finds the last history key any query of the
    # block may see, so the main loop never visits tiles after it (no branch inside the loop,
    # which keeps it pipelined); positions need not be sorted, sorted ones skip the most
    qp_max = tl.max(tl.where(m_mask, qp, -1), axis=0)
    end = 0
    for start in range(0, nh, BLOCK_N):
        n = start + offs_n
        kp = tl.load(kpos_base + n * skp_n, mask=n < nh, other=0).to(tl.int32)
        end = tl.maximum(end, tl.max(tl.where((n < nh) & (kp <= qp_max), n + 1, 0), axis=0))

    q = load_beam_queries(q_ptr, b, h, offs_m, offs_d, m_mask, d_mask, sq_b, sq_m, sq_h, sq_d)  # [BM, BD]
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    # the query's own key (M-FALCON candidates), unless the history scan counts it: one more tile
    # whose keys are the queries' own rows, kept on its diagonal
    has_self = m_mask & (qs >= 0) & (qs < NK)
    if tl.max(has_self.to(tl.int32), axis=0) > 0:
        sp = tl.load(kpos_base + qs * skp_n, mask=has_self, other=0).to(tl.int32)
        has_self = has_self & ~((qs < nh) & (sp <= qp))
        diag = (offs_m[:, None] == offs_m[None, :]) & has_self[None, :]
        acc = _hstu_tile(acc, q, qp, qt, qs, has_self, diag,
                         k_base, v_base, kpos_base, kts_base, pb_base, tb_base, thr_ptr, cthr_ptr,
                         sk_n, sk_d, sv_n, sv_d, skp_n, skt_n, spb_p, stb_t, P, T,
                         scale, inv_log2_base, offs_d, d_mask, offs_dv, dv_mask,
                         DOT_PRECISION, BIASES, False, TIME_STEPS)

    for start in range(0, end, BLOCK_N):
        n = start + offs_n
        acc = _hstu_tile(acc, q, qp, qt, n, n < end, m_mask[:, None],
                         k_base, v_base, kpos_base, kts_base, pb_base, tb_base, thr_ptr, cthr_ptr,
                         sk_n, sk_d, sv_n, sv_d, skp_n, skt_n, spb_p, stb_t, P, T,
                         scale, inv_log2_base, offs_d, d_mask, offs_dv, dv_mask,
                         DOT_PRECISION, BIASES, True, TIME_STEPS)

    tl.store(o_ptr + b * so_b + h * so_h + offs_m[:, None] * so_m + offs_dv[None, :] * so_d,
             (acc * inv_norm).to(o_ptr.dtype.element_ty), mask=m_mask[:, None] & dv_mask[None, :])


def hstu_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    q_ts: torch.Tensor,
    k_ts: torch.Tensor,
    num_history: torch.Tensor,
    q_self: torch.Tensor,
    pos_bias: torch.Tensor,
    time_bias: torch.Tensor,
    time_base: float,
    scale: float,
    norm: float,
    shared: dict | None = None,
) -> torch.Tensor:
    """HSTU pointwise attention with relative position/time bias and the M-FALCON mask (see the
    reference for the rule). q [B, M, H, d], k [B, Nk, H, d], v [B, Nk, H, dv] -> [B, M, H, dv].
    `shared` is the reference's (the kernel derives biases and mask in registers)."""
    return launch_hstu(q, k, v, q_pos, k_pos, q_ts, k_ts, num_history, q_self, pos_bias, time_bias,
                       time_base, scale, norm)


# Tile shapes (BLOCK_M, BLOCK_N, warps, pipeline stages) that perf/gpu_kernels.py profiles the kernel
# with. The op uses hstu_tile(dtype, head dim). fp16/bf16: 64 x 64, 4 warps, 1 stage, measured on an
# H200 (perf/results/gpu/: the fastest of the nine profiled tiles in all four profiled shapes, 1.18-1.37x
# faster than 3 stages).
# fp32: exact products run on the FMA units with q, k, v, the logits and the accumulator all in
# registers; ptxas (sm_90) spills the 64 x 64 tile (5-7 KB of spill traffic per thread at head dim
# 64) and any tile with 2+ stages, so fp32 takes one stage and a tile per head dim that ptxas keeps in
# registers (0 spills, checked in tests/test_kernels_compile.py). Few queries or keys take smaller tiles.
HSTU_TILES = [(64, 32, 4, 1), (64, 32, 4, 2), (64, 64, 4, 1), (64, 64, 4, 2), (64, 64, 4, 3), (64, 64, 8, 3),
              (128, 32, 8, 2), (128, 64, 8, 2), (128, 64, 8, 3)]
HSTU_TILES_FP32 = [(16, 32, 8, 1), (32, 32, 4, 1), (32, 32, 8, 1), (32, 64, 4, 1), (64, 32, 4, 1), (64, 64, 4, 1)]
HSTU_TILE = {torch.float16: (64, 64, 4, 1), torch.bfloat16: (64, 64, 4, 1), torch.float32: (32, 32, 4, 1)}
# fp32 by head dim: (the most it serves, tile); 32 x 32 spills at head dim 32 (ptxas then caps at 128
# registers), 16 x 32 with 4 warps at 128
_HSTU_TILES_FP32_BY_DIM = ((32, (32, 64, 4, 1)), (64, (32, 32, 4, 1)), (None, (16, 32, 8, 1)))


def hstu_tile(dtype: torch.dtype, head_dim: int) -> tuple:
    """(BLOCK_M, BLOCK_N, warps, stages) the op uses for this dtype and head dim (q and v alike)."""
    if dtype == torch.float32:
        return next(t for most, t in _HSTU_TILES_FP32_BY_DIM if most is None or head_dim <= most)
    return HSTU_TILE[dtype]


def launch_hstu(q, k, v, q_pos, k_pos, q_ts, k_ts, num_history, q_self, pos_bias, time_bias,
                time_base, scale, norm, tiles=None, biases=2, time_steps=3):
    """tiles: (BLOCK_M, BLOCK_N, warps, stages), default hstu_tile(dtype, head dim); biases < 2 only for the
    profile; time_steps: the most buckets a tile's rows may span on the per-row path (0: every pair
    takes the per-pair bucket, for tests and the profile)."""
    B, M, H, D = q.shape
    NK = k.shape[1]
    DV = v.shape[-1]
    P = pos_bias.shape[1]
    T = time_bias.shape[1]
    out = torch.empty((B, M, H, DV), device=q.device, dtype=q.dtype)
    thr, cthr = _bucket_thresholds(T, time_base, q.device)
    # fp32 tables: exact for fp16/bf16 values, and no conversion per pair in the kernel
    pos_bias, time_bias = pos_bias.float(), time_bias.float()
    if tiles is None:
        bm, bn, warps, stages = hstu_tile(q.dtype, max(D, DV))
        tiles = (min(bm, pow2(M)), min(bn, block_keys(NK)), warps, stages)
    bm, bn, warps, stages = tiles
    _hstu_attention_kernel[(B * H, triton.cdiv(M, bm))](
        q, k, v, q_pos, k_pos, q_ts, k_ts, num_history, q_self, pos_bias, time_bias, thr, cthr, out,
        M, H, NK, P, T,
        *q.stride(), *k.stride(), *v.stride(),
        *q_pos.stride(), *k_pos.stride(), *q_ts.stride(), *k_ts.stride(), *q_self.stride(),
        *pos_bias.stride(), *time_bias.stride(), *out.stride(),
        float(scale), 1.0 / float(norm), 1.0 / math.log2(float(time_base)),
        D=D, DV=DV, BLOCK_M=bm, BLOCK_N=bn, BLOCK_D=pow2(D), BLOCK_DV=pow2(DV),
        DOT_PRECISION=dot_precision(q), BIASES=biases, TIME_STEPS=time_steps, num_warps=warps, num_stages=stages,
    )
    return out
