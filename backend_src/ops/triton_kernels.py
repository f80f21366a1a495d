"""Triton-lang kernels for the ops in ``reference.py``: same names, signatures and results.

Every wrapper takes the tensors as the reference does (any strides; fp32, fp16, bf16 on GPUs;
fp32 accumulation; output in the input dtype) and launches ``@triton.jit`` kernels for the heavy work.
Torch glue is limited to allocation and the top-k over a score matrix (``torch.topk``; PFA's selection
with the gather of its kept rows ranks in a kernel instead).
Calls needing gradients (the kernels are forward-only), other dtypes (float64) and empty inputs
are handed to the reference.

Decode attention (the PFA paper's) is one program per (user, head, block of beams): the beams of a user
share one K/V block, so each key tile is loaded once and multiplied against all beams of the block
with ``tl.dot``; an online softmax runs over key tiles up to ``lengths[b]`` (the PFA prefix budget),
so a shorter budget reads fewer rows. The selections score the history with the same tiles: PFA
pools every beam's head-mean weight into one score per row; dynamic top-k keeps each beam's own
weights and then masks every beam's rows by its k-th weight in one dense pass. HSTU attention (seed
001) is one program per (batch, head, block of queries) with the relative position / time bias and
the M-FALCON mask computed in the kernel, every per-pair value in 32 bits (its profile on an H200:
perf/gpu_kernels.py).
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from backend_src.ops import reference

_LOG2E = 1.4426950408889634
# finite start for running maxima, so a tile without valid keys rescales by exp2(0) = 1, not NaN
_NEG_BIG = tl.constexpr(-1.0e30)


# --------------------------------------------------------------------------------------------
# block-size choices (powers of two, at least 16 where a tile feeds tl.dot)
# --------------------------------------------------------------------------------------------
def _pow2(x: int, lo: int = 16, hi: int | None = None) -> int:
    p = max(lo, triton.next_power_of_2(max(int(x), 1)))
    return min(p, hi) if hi is not None else p


def _block_keys(n: int) -> int:
    """Key tile: half the rows for short histories (so the online softmax sees several tiles), 64 beyond."""
    return _pow2(triton.next_power_of_2(max(n, 1)) // 2, 16, 64)


def _dot_precision(t: torch.Tensor) -> str:
    # fp32 inputs: exact products (tf32 would lose ~3 digits against the reference)
    return "ieee" if t.dtype == torch.float32 else "tf32"


def _use_reference(*ts: torch.Tensor) -> bool:
    """Calls the kernels do not serve go to the reference: other dtypes (float64), empty tensors,
    and calls that need gradients (the kernels are forward-only; training goes through autograd)."""
    if torch.is_grad_enabled() and any(t.requires_grad for t in ts):
        return True
    return any(t.dtype not in (torch.float32, torch.float16, torch.bfloat16) or t.numel() == 0 for t in ts)


# --------------------------------------------------------------------------------------------
# shared device helpers
# --------------------------------------------------------------------------------------------
@triton.jit
def _softmax_stats(q, k_base, sk_n, sk_d, offs_d, d_mask, L, qk_scale,
                   BLOCK_W: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Running max m and sum l of exp2(logits - m) over the first L keys (base-2 logits)."""
    m = tl.full([BLOCK_W], _NEG_BIG, tl.float32)
    l = tl.zeros([BLOCK_W], tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    for start in range(0, L, BLOCK_N):
        n = start + offs_n
        n_mask = n < L
        k = tl.load(k_base + n[:, None] * sk_n + offs_d[None, :] * sk_d,
                    mask=n_mask[:, None] & d_mask[None, :], other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # [BW, BN]
        s = tl.where(n_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        l = l * tl.exp2(m - m_new) + tl.sum(tl.exp2(s - m_new[:, None]), axis=1)
        m = m_new
    return m, l


# --------------------------------------------------------------------------------------------
# decode attention: beams of a user over one contiguous K/V block
# --------------------------------------------------------------------------------------------
@triton.jit
def _decode_attention_kernel(
    q_ptr, k_ptr, v_ptr, len_ptr, sel_ptr, tau_ptr, o_ptr,
    W, H, N, D, DV,
    sq_b, sq_w, sq_h, sq_d,
    sk_b, sk_n, sk_h, sk_d,
    sv_b, sv_n, sv_h, sv_d,
    ss_b, ss_w, ss_n,
    st_b, st_w,
    so_b, so_w, so_h, so_d,
    qk_scale,
    HAS_THRESH: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """out[b, w, h] = softmax over rows j < lengths[b] of q.k_j, times v_j.

    HAS_THRESH: beam w only keeps the rows whose score sel[b, w, j] reaches its threshold
    tau[b, w] (dynamic top-k: every beam its own rows, read densely from one K/V block)."""
    pid_bh = tl.program_id(0).to(tl.int64)
    pid_w = tl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    offs_w = pid_w * BLOCK_W + tl.arange(0, BLOCK_W)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    offs_n = tl.arange(0, BLOCK_N)
    w_mask = offs_w < W
    d_mask = offs_d < D
    dv_mask = offs_dv < DV

    q = tl.load(q_ptr + b * sq_b + h * sq_h + offs_w[:, None] * sq_w + offs_d[None, :] * sq_d,
                mask=w_mask[:, None] & d_mask[None, :], other=0.0)
    L = tl.minimum(tl.load(len_ptr + b), N)
    k_base = k_ptr + b * sk_b + h * sk_h
    v_base = v_ptr + b * sv_b + h * sv_h

    if HAS_THRESH:
        tau = tl.load(tau_ptr + b * st_b + offs_w * st_w, mask=w_mask, other=float("inf"))
    m = tl.full([BLOCK_W], _NEG_BIG, tl.float32)
    l = tl.zeros([BLOCK_W], tl.float32)
    acc = tl.zeros([BLOCK_W, BLOCK_DV], tl.float32)
    for start in range(0, L, BLOCK_N):
        n = start + offs_n
        n_mask = n < L
        k = tl.load(k_base + n[:, None] * sk_n + offs_d[None, :] * sk_d,
                    mask=n_mask[:, None] & d_mask[None, :], other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # [BW, BN] base-2 logits
        keep = n_mask[None, :]
        if HAS_THRESH:
            sel = tl.load(sel_ptr + b * ss_b + offs_w[:, None] * ss_w + n[None, :] * ss_n,
                          mask=w_mask[:, None] & n_mask[None, :], other=float("-inf"))
            keep = keep & (sel >= tau[:, None])
        s = tl.where(keep, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        l = l * alpha + tl.sum(p, axis=1)
        v = tl.load(v_base + n[:, None] * sv_n + offs_dv[None, :] * sv_d,
                    mask=n_mask[:, None] & dv_mask[None, :], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m = m_new
    l = tl.where(l > 0.0, l, 1.0)  # no valid row: output 0
    out = acc / l[:, None]
    tl.store(o_ptr + b * so_b + h * so_h + offs_w[:, None] * so_w + offs_dv[None, :] * so_d,
             out.to(o_ptr.dtype.element_ty), mask=w_mask[:, None] & dv_mask[None, :])


def _launch_decode(q, k, v, lengths, sel=None, tau=None):
    """sel [B, W, N] and tau [B, W]: beam w keeps the rows with sel >= tau (see the kernel)."""
    B, W, H, D = q.shape
    N = k.shape[1]
    DV = v.shape[-1]
    out = torch.empty((B, W, H, DV), device=q.device, dtype=q.dtype)
    BLOCK_W = _pow2(W, 16, 64)
    BLOCK_N = _block_keys(N)
    # pointers a mode does not use get any tensor and zero strides
    sel_arg, ss = (sel, sel.stride()) if sel is not None else (lengths, (0, 0, 0))
    tau_arg, st = (tau, tau.stride()) if tau is not None else (lengths, (0, 0))
    grid = (B * H, triton.cdiv(W, BLOCK_W))
    _decode_attention_kernel[grid](
        q, k, v, lengths, sel_arg, tau_arg, out,
        W, H, N, D, DV,
        *q.stride(), *k.stride(), *v.stride(), *ss, *st, *out.stride(),
        (D ** -0.5) * _LOG2E,
        HAS_THRESH=sel is not None, BLOCK_W=BLOCK_W, BLOCK_N=BLOCK_N,
        BLOCK_D=_pow2(D), BLOCK_DV=_pow2(DV), DOT_PRECISION=_dot_precision(q),
        num_warps=4,
    )
    return out


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """All beams of a user attend over the first lengths[b] rows of one contiguous K/V block.
    q [B, W, H, d], k/v [B, N, H, d], lengths [B] -> [B, W, H, d]."""
    if _use_reference(q, k, v):
        return reference.decode_attention(q, k, v, lengths)
    return _launch_decode(q, k, v, lengths)


# --------------------------------------------------------------------------------------------
# attention probabilities: two passes (max/sum, then normalized write)
# --------------------------------------------------------------------------------------------
@triton.jit
def _attention_probs_kernel(
    q_ptr, k_ptr, len_ptr, p_ptr,
    W, H, N, D,
    sq_b, sq_w, sq_h, sq_d,
    sk_b, sk_n, sk_h, sk_d,
    sp_b, sp_w, sp_h, sp_n,
    qk_scale,
    BLOCK_W: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    pid_bh = tl.program_id(0).to(tl.int64)
    pid_w = tl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    offs_w = pid_w * BLOCK_W + tl.arange(0, BLOCK_W)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    w_mask = offs_w < W
    d_mask = offs_d < D
    q = tl.load(q_ptr + b * sq_b + h * sq_h + offs_w[:, None] * sq_w + offs_d[None, :] * sq_d,
                mask=w_mask[:, None] & d_mask[None, :], other=0.0)
    L = tl.minimum(tl.load(len_ptr + b), N)
    k_base = k_ptr + b * sk_b + h * sk_h
    p_base = p_ptr + b * sp_b + h * sp_h + offs_w[:, None] * sp_w

    # pass 1: softmax statistics over the valid rows
    m, l = _softmax_stats(q, k_base, sk_n, sk_d, offs_d, d_mask, L, qk_scale, BLOCK_W, BLOCK_N, DOT_PRECISION)
    inv_l = 1.0 / tl.where(l > 0.0, l, 1.0)
    # pass 2: normalized weights of the valid tiles
    for start in range(0, L, BLOCK_N):
        n = start + offs_n
        n_mask = n < L
        k = tl.load(k_base + n[:, None] * sk_n + offs_d[None, :] * sk_d,
                    mask=n_mask[:, None] & d_mask[None, :], other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
        p = tl.exp2(tl.where(n_mask[None, :], s, float("-inf")) - m[:, None]) * inv_l[:, None]
        tl.store(p_base + n[None, :] * sp_n, p.to(p_ptr.dtype.element_ty),
                 mask=w_mask[:, None] & (n < N)[None, :])
    # rows past the budget: zeros, without reading K
    for start in range(tl.cdiv(L, BLOCK_N) * BLOCK_N, N, BLOCK_N):
        n = start + offs_n
        zero = tl.zeros([BLOCK_W, BLOCK_N], tl.float32)
        tl.store(p_base + n[None, :] * sp_n, zero.to(p_ptr.dtype.element_ty),
                 mask=w_mask[:, None] & (n < N)[None, :])


def attention_probs(q: torch.Tensor, k: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """q [B, W, H, d], k [B, N, H, d], lengths [B] -> probs [B, W, H, N] (0 beyond lengths[b])."""
    if _use_reference(q, k):
        return reference.attention_probs(q, k, lengths)
    B, W, H, D = q.shape
    N = k.shape[1]
    out = torch.empty((B, W, H, N), device=q.device, dtype=q.dtype)
    BLOCK_W = _pow2(W, 16, 64)
    grid = (B * H, triton.cdiv(W, BLOCK_W))
    _attention_probs_kernel[grid](
        q, k, lengths, out, W, H, N, D,
        *q.stride(), *k.stride(), *out.stride(),
        (D ** -0.5) * _LOG2E,
        BLOCK_W=BLOCK_W, BLOCK_N=_block_keys(N), BLOCK_D=_pow2(D), DOT_PRECISION=_dot_precision(q),
        num_warps=4,
    )
    return out


# --------------------------------------------------------------------------------------------
# head-averaged attention, pooled over beams (PFA scores) or kept per beam (dynamic top-k)
# --------------------------------------------------------------------------------------------
@triton.jit
def _pfa_scores_kernel(
    q_ptr, k_ptr, len_ptr, w_ptr, out_ptr,
    W, H, N, D,
    sq_b, sq_w, sq_h, sq_d,
    sk_b, sk_n, sk_h, sk_d,
    sw_b, sw_w,
    so_b, so_n,
    qk_scale, inv_heads,
    BLOCK_W: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """PFA importance s_n = sum_w w[b, w] mean_h a[b, w, h, n]: this (user, head, beam block) adds
    its part into out[b, n] (fp32, zero-initialized); rows n >= lengths[b] get -inf, so that a
    top-k never picks them."""
    pid_bh = tl.program_id(0).to(tl.int64)
    pid_w = tl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    offs_w = pid_w * BLOCK_W + tl.arange(0, BLOCK_W)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    w_mask = offs_w < W
    d_mask = offs_d < D
    q = tl.load(q_ptr + b * sq_b + h * sq_h + offs_w[:, None] * sq_w + offs_d[None, :] * sq_d,
                mask=w_mask[:, None] & d_mask[None, :], other=0.0)
    L = tl.minimum(tl.load(len_ptr + b), N)
    k_base = k_ptr + b * sk_b + h * sk_h

    m, l = _softmax_stats(q, k_base, sk_n, sk_d, offs_d, d_mask, L, qk_scale, BLOCK_W, BLOCK_N, DOT_PRECISION)
    wb = tl.load(w_ptr + b * sw_b + offs_w * sw_w, mask=w_mask, other=0.0).to(tl.float32)
    scale_w = wb * inv_heads / tl.where(l > 0.0, l, 1.0)  # w_b / (H l)
    for start in range(0, L, BLOCK_N):
        n = start + offs_n
        n_mask = n < L
        k = tl.load(k_base + n[:, None] * sk_n + offs_d[None, :] * sk_d,
                    mask=n_mask[:, None] & d_mask[None, :], other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
        p = tl.exp2(tl.where(n_mask[None, :], s, float("-inf")) - m[:, None]) * scale_w[:, None]
        tl.atomic_add(out_ptr + b * so_b + n * so_n, tl.sum(p, axis=0), mask=n_mask)
    if (pid_w == 0) and (h == 0):
        # rows past the length: no program adds to them, so one plain store is race-free
        for start in range(L // BLOCK_N * BLOCK_N, N, BLOCK_N):
            n = start + offs_n
            tl.store(out_ptr + b * so_b + n * so_n, tl.full([BLOCK_N], float("-inf"), tl.float32),
                     mask=(n >= L) & (n < N))


def _pfa_scores(q, k, lengths, beam_weights):
    """[B, N] fp32 PFA scores, -inf past the length."""
    B, W, H, D = q.shape
    N = k.shape[1]
    out = torch.zeros((B, N), device=q.device, dtype=torch.float32)
    BLOCK_W = _pow2(W, 16, 64)
    grid = (B * H, triton.cdiv(W, BLOCK_W))
    _pfa_scores_kernel[grid](
        q, k, lengths, beam_weights, out, W, H, N, D,
        *q.stride(), *k.stride(), *beam_weights.stride(), *out.stride(),
        (D ** -0.5) * _LOG2E, 1.0 / H,
        BLOCK_W=BLOCK_W, BLOCK_N=_block_keys(N), BLOCK_D=_pow2(D), DOT_PRECISION=_dot_precision(q), num_warps=4,
    )
    return out


@triton.jit
def _beam_head_mean_kernel(
    q_ptr, k_ptr, len_ptr, stat_ptr, out_ptr,
    W, H, N, D,
    sq_b, sq_w, sq_h, sq_d,
    sk_b, sk_n, sk_h, sk_d,
    st_b, st_h, st_w,
    so_b, so_w, so_n,
    qk_scale, inv_heads,
    BLOCK_W: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """out[b, w, n] = mean_h a[b, w, h, n] (each beam's own ranking; 0 past the length).

    One program per (user, beam block) loops over the heads, so every output is written once
    (no atomics, no zero fill): pass 1 keeps each head's softmax statistics in a small scratch
    buffer stat [B, H, W, 2], pass 2 sums the heads' weights tile by tile."""
    b = tl.program_id(0).to(tl.int64)
    pid_w = tl.program_id(1)
    offs_w = pid_w * BLOCK_W + tl.arange(0, BLOCK_W)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    w_mask = offs_w < W
    d_mask = offs_d < D
    L = tl.minimum(tl.load(len_ptr + b), N)
    q_rows = q_ptr + b * sq_b + offs_w[:, None] * sq_w + offs_d[None, :] * sq_d
    qw_mask = w_mask[:, None] & d_mask[None, :]
    stat = stat_ptr + b * st_b + offs_w * st_w
    for h in range(H):
        q = tl.load(q_rows + h * sq_h, mask=qw_mask, other=0.0)
        m, l = _softmax_stats(q, k_ptr + b * sk_b + h * sk_h, sk_n, sk_d, offs_d, d_mask, L, qk_scale,
                              BLOCK_W, BLOCK_N, DOT_PRECISION)
        tl.store(stat + h * st_h, m, mask=w_mask)
        tl.store(stat + h * st_h + 1, inv_heads / tl.where(l > 0.0, l, 1.0), mask=w_mask)
    tl.debug_barrier()  # the statistics are read back below by other threads of this program
    o_rows = out_ptr + b * so_b + offs_w[:, None] * so_w
    for start in range(0, L, BLOCK_N):
        n = start + offs_n
        n_mask = n < L
        acc = tl.zeros([BLOCK_W, BLOCK_N], tl.float32)
        for h in range(H):
            q = tl.load(q_rows + h * sq_h, mask=qw_mask, other=0.0)
            m = tl.load(stat + h * st_h, mask=w_mask, other=0.0)
            c = tl.load(stat + h * st_h + 1, mask=w_mask, other=0.0)  # 1 / (H l)
            k = tl.load(k_ptr + b * sk_b + h * sk_h + n[:, None] * sk_n + offs_d[None, :] * sk_d,
                        mask=n_mask[:, None] & d_mask[None, :], other=0.0)
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
            acc += tl.exp2(tl.where(n_mask[None, :], s, float("-inf")) - m[:, None]) * c[:, None]
        tl.store(o_rows + n[None, :] * so_n, acc, mask=w_mask[:, None] & (n < N)[None, :])
    for start in range(tl.cdiv(L, BLOCK_N) * BLOCK_N, N, BLOCK_N):  # rows past the length: 0
        n = start + offs_n
        tl.store(o_rows + n[None, :] * so_n, tl.zeros([BLOCK_W, BLOCK_N], tl.float32),
                 mask=w_mask[:, None] & (n < N)[None, :])


def _beam_head_mean(q, k, lengths):
    """[B, W, N] fp32 head-mean attention weights of every beam, 0 past the length."""
    B, W, H, D = q.shape
    N = k.shape[1]
    out = torch.empty((B, W, N), device=q.device, dtype=torch.float32)
    stat = torch.empty((B, H, W, 2), device=q.device, dtype=torch.float32)
    BLOCK_W = _pow2(W, 16, 64)
    grid = (B, triton.cdiv(W, BLOCK_W))
    _beam_head_mean_kernel[grid](
        q, k, lengths, stat, out, W, H, N, D,
        *q.stride(), *k.stride(), *stat.stride()[:3], *out.stride(),
        (D ** -0.5) * _LOG2E, 1.0 / H,
        BLOCK_W=BLOCK_W, BLOCK_N=_block_keys(N), BLOCK_D=_pow2(D), DOT_PRECISION=_dot_precision(q), num_warps=4,
    )
    return out


def pfa_select(q: torch.Tensor, k: torch.Tensor, lengths: torch.Tensor, beam_weights: torch.Tensor, keep: int):
    """PFA selection: s_n = sum_w w_w mean_h a_{w,h,n}; order = top `keep` rows by s.
    Returns order [B, keep'], kept_lengths [B] = min(keep', lengths)."""
    if _use_reference(q, k, beam_weights):
        return reference.pfa_select(q, k, lengths, beam_weights, keep)
    N = k.shape[1]
    scores = _pfa_scores(q, k, lengths, beam_weights)  # [B, N] fp32, -inf past the length
    keep = min(keep, N)
    order = torch.topk(scores, keep, dim=1, sorted=True).indices  # [B, keep]
    return order, torch.clamp(lengths, max=keep)


# --------------------------------------------------------------------------------------------
# dynamic top-k baseline: every beam over its own rows
# --------------------------------------------------------------------------------------------
def dynamic_topk_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor, keep: int, return_indices: bool = False
):
    """Baseline: every beam ranks the history by its own head-averaged weights and attends
    (renormalized) over its own top `keep` rows. q [B,W,H,d], k/v [B,N,H,d] -> [B,W,H,d].

    A beam's kept rows are those whose head-mean weight reaches its keep-th largest: the
    attention then reads the user's K/V block once, densely (tensor-core products), with each
    beam's rows masked by that threshold, instead of gathering W*keep rows per user. (A row tied
    with the threshold is kept too; with real-valued weights ties are vanishingly rare.)"""
    if _use_reference(q, k, v):
        return reference.dynamic_topk_attention(q, k, v, lengths, keep, return_indices)
    N = k.shape[1]
    mean_probs = _beam_head_mean(q, k, lengths)  # [B, W, N] fp32, 0 beyond lengths
    keep = min(keep, N)
    top = torch.topk(mean_probs, keep, dim=-1, sorted=return_indices)  # order only when read
    tau = top.values.amin(-1)  # [B, W]; 0 when the user has no more than `keep` rows
    out = _launch_decode(q, k, v, lengths, sel=mean_probs, tau=tau)
    return (out, top.indices) if return_indices else out


# --------------------------------------------------------------------------------------------
# gather_rows: copy the kept rows into contiguous memory
# --------------------------------------------------------------------------------------------
@triton.jit
def _gather_rows_kernel(
    x_ptr, idx_ptr, o_ptr,
    N, KEEP, F,
    sx_b, sx_n, sx_f,
    si_b, si_j,
    so_b, so_j,
    BLOCK_J: tl.constexpr, BLOCK_F: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    offs_j = tl.program_id(1) * BLOCK_J + tl.arange(0, BLOCK_J)
    offs_f = tl.program_id(2) * BLOCK_F + tl.arange(0, BLOCK_F)
    j_mask = offs_j < KEEP
    f_mask = offs_f < F
    rows = tl.load(idx_ptr + b * si_b + offs_j * si_j, mask=j_mask, other=0)
    row_ok = j_mask & (rows >= 0) & (rows < N)
    x = tl.load(x_ptr + b * sx_b + rows[:, None] * sx_n + offs_f[None, :] * sx_f,
                mask=row_ok[:, None] & f_mask[None, :], other=0)
    tl.store(o_ptr + b * so_b + offs_j[:, None] * so_j + offs_f[None, :], x,
             mask=j_mask[:, None] & f_mask[None, :])


def gather_rows(x: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """x [B, N, ...], order [B, k] -> contiguous [B, k, ...] (rows in the given order)."""
    if torch.is_grad_enabled() and x.requires_grad:
        return reference.gather_rows(x, order)
    B, N = x.shape[:2]
    tail = x.shape[2:]
    F = math.prod(tail)
    xf = x.reshape(B, N, F)  # a view whenever the trailing dims merge (they do for K/V caches)
    if xf.dtype == torch.bool:
        xf = xf.view(torch.uint8)
    keep = order.shape[1]
    out = torch.empty((B, keep, F), device=x.device, dtype=xf.dtype)
    if B == 0 or keep == 0 or F == 0:
        return out.view(x.dtype).reshape(B, keep, *tail)
    BLOCK_F = _pow2(F, 16, 512)
    BLOCK_J = max(1, min(_pow2(keep, 1, 64), 4096 // BLOCK_F))
    grid = (B, triton.cdiv(keep, BLOCK_J), triton.cdiv(F, BLOCK_F))
    _gather_rows_kernel[grid](
        xf, order, out, N, keep, F,
        *xf.stride(), *order.stride(), out.stride(0), out.stride(1),
        BLOCK_J=BLOCK_J, BLOCK_F=BLOCK_F, num_warps=4,
    )
    return out.view(x.dtype).reshape(B, keep, *tail)


# --------------------------------------------------------------------------------------------
# PFA selection fused with the gather of the kept rows
# --------------------------------------------------------------------------------------------
# One program sorts a user's scores in registers: N_POW2 64-bit keys over its threads. Longer
# histories take the unfused composition (scores kernel, torch.topk, gather_rows).
SELECT_ROWS_MAX_N = 8192


def _select_rows_warps(n_pow2: int) -> int:
    # at most 8 keys (16 registers) a thread for the sort up to 4096 rows, 16 at 8192 (ptxas: no
    # spills, tests/test_kernels_compile.py); the warps also keep more row copies in flight
    return max(4, min(16, n_pow2 // 256))


@triton.jit
def _copy_kept_rows(x_ptr, o_ptr, idx_row, si_j, b, KEEP, F,
                    sx_b, sx_n, sx_f, so_b, so_j,
                    BLOCK_J: tl.constexpr, BLOCK_F: tl.constexpr):
    """o[b, j] = x[b, order[b, j]] for j < KEEP (contiguous feature dim in o)."""
    for j0 in range(0, KEEP, BLOCK_J):
        offs_j = j0 + tl.arange(0, BLOCK_J)
        j_mask = offs_j < KEEP
        rows = tl.load(idx_row + offs_j * si_j, mask=j_mask, other=0)
        for f0 in range(0, F, BLOCK_F):
            offs_f = f0 + tl.arange(0, BLOCK_F)
            mask = j_mask[:, None] & (offs_f < F)[None, :]
            x = tl.load(x_ptr + b * sx_b + rows[:, None] * sx_n + offs_f[None, :] * sx_f, mask=mask, other=0)
            tl.store(o_ptr + b * so_b + offs_j[:, None] * so_j + offs_f[None, :], x, mask=mask)


@triton.jit
def _pfa_select_rows_kernel(
    s_ptr, idx_ptr, x_ptr, xo_ptr, y_ptr, yo_ptr,
    N, KEEP, FX, FY,
    ss_b, ss_n,
    si_b, si_j,
    sx_b, sx_n, sx_f, sxo_b, sxo_j,
    sy_b, sy_n, sy_f, syo_b, syo_j,
    N_POW2: tl.constexpr, KEEP_POW2: tl.constexpr, HAS_Y: tl.constexpr,
    BLOCK_J: tl.constexpr, BLOCK_FX: tl.constexpr, BLOCK_FY: tl.constexpr,
):
    """order[b] = the KEEP rows of largest score s[b, :N], best first (ties: lower row first);
    then xo[b, j] = x[b, order[b, j]] (and yo from y with HAS_Y). One program per user.

    Each row is one 64-bit key: the score's float bits made order-preserving as a signed int32
    (negative floats get their magnitude bits flipped) in the high half, N_POW2 - 1 - row in the
    low half, so one descending integer top-k ranks by score, then by lower row. Padding rows
    (n >= N) score -inf and rank after every real row: the first min(KEEP, N) entries are rows < N."""
    b = tl.program_id(0).to(tl.int64)
    offs_n = tl.arange(0, N_POW2)
    s = tl.load(s_ptr + b * ss_b + offs_n * ss_n, mask=offs_n < N, other=float("-inf"))
    bits = s.to(tl.int32, bitcast=True)
    key = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    packed = (key.to(tl.int64) << 32) | (N_POW2 - 1 - offs_n).to(tl.int64)
    top = tl.topk(packed, KEEP_POW2)  # [KEEP_POW2], descending
    rows = (N_POW2 - 1) - top.to(tl.int32)  # truncation keeps the low half
    offs_j = tl.arange(0, KEEP_POW2)
    idx_row = idx_ptr + b * si_b
    tl.store(idx_row + offs_j * si_j, rows.to(tl.int64), mask=offs_j < KEEP)
    # the order is read back below in the copy's own layout, by other threads of this program
    tl.debug_barrier()
    _copy_kept_rows(x_ptr, xo_ptr, idx_row, si_j, b, KEEP, FX, sx_b, sx_n, sx_f, sxo_b, sxo_j, BLOCK_J, BLOCK_FX)
    if HAS_Y:
        _copy_kept_rows(y_ptr, yo_ptr, idx_row, si_j, b, KEEP, FY, sy_b, sy_n, sy_f, syo_b, syo_j, BLOCK_J, BLOCK_FY)


def _rows_view(x: torch.Tensor):
    """x [B, N, ...] -> [B, N, F] (bool as uint8: the kernel copies bytes)."""
    B, N = x.shape[:2]
    xf = x.reshape(B, N, math.prod(x.shape[2:]))  # a view whenever the trailing dims merge
    return xf.view(torch.uint8) if xf.dtype == torch.bool else xf


def _select_rows(scores: torch.Tensor, keep: int, rows: tuple) -> tuple:
    """scores [B, N] fp32, rows: tensors [B, N, ...] -> (order [B, keep], the rows of each at that
    order, contiguous [B, keep, ...]). order: the top `keep` (<= N) rows by score, best first, ties
    to the lower row. The selecting kernel copies the first two tensors' rows, gather_rows any more."""
    B, N = scores.shape
    order = torch.empty((B, keep), device=scores.device, dtype=torch.int64)
    flat = [_rows_view(x) for x in rows[:2]]
    outs = [torch.empty((B, keep, xf.shape[2]), device=xf.device, dtype=xf.dtype) for xf in flat]
    x, xo = flat[0], outs[0]
    y, yo = (flat[1], outs[1]) if len(flat) > 1 else (x, xo)  # one tensor: y is x, never read (HAS_Y)
    n_pow2 = _pow2(N)
    block_fx, block_fy = _pow2(x.shape[2], 16, 512), _pow2(y.shape[2], 16, 512)
    _pfa_select_rows_kernel[(B,)](
        scores, order, x, xo, y, yo,
        N, keep, x.shape[2], y.shape[2],
        *scores.stride(), *order.stride(),
        *x.stride(), xo.stride(0), xo.stride(1), *y.stride(), yo.stride(0), yo.stride(1),
        N_POW2=n_pow2, KEEP_POW2=min(_pow2(keep), n_pow2), HAS_Y=len(flat) > 1,
        BLOCK_J=max(1, 4096 // max(block_fx, block_fy)), BLOCK_FX=block_fx, BLOCK_FY=block_fy,
        num_warps=_select_rows_warps(n_pow2),
    )
    kept = [o.view(x.dtype).reshape(B, keep, *x.shape[2:]) for o, x in zip(outs, rows)]
    kept += [gather_rows(x, order) for x in rows[2:]]
    return order, tuple(kept)


def pfa_select_rows(q: torch.Tensor, k: torch.Tensor, lengths: torch.Tensor, beam_weights: torch.Tensor,
                    keep: int, rows: tuple):
    """pfa_select, then gather_rows of each tensor of `rows` ([B, N, ...]) by its order.
    Returns (the kept rows of each, contiguous [B, keep', ...]; kept_lengths [B]).

    After the pooled-scores kernel, one program per user takes its top keep' rows (a bitonic top-k
    of its N scores in registers) and copies those rows of the first two tensors: one launch
    instead of torch.topk and a gather launch per tensor. Histories longer than
    SELECT_ROWS_MAX_N rows, and rows that need gradients, take the unfused composition."""
    rows = tuple(rows)
    if _use_reference(q, k, beam_weights) or not rows:
        return reference.pfa_select_rows(q, k, lengths, beam_weights, keep, rows)
    N = k.shape[1]
    if N > SELECT_ROWS_MAX_N or keep < 1 or (torch.is_grad_enabled() and any(x.requires_grad for x in rows)):
        order, kept = pfa_select(q, k, lengths, beam_weights, keep)
        return tuple(gather_rows(x, order) for x in rows), kept
    keep = min(keep, N)
    scores = _pfa_scores(q, k, lengths, beam_weights)  # [B, N] fp32, -inf past the length
    _, kept_rows = _select_rows(scores, keep, rows)
    return kept_rows, torch.clamp(lengths, max=keep)


# --------------------------------------------------------------------------------------------
# HSTU pointwise attention (the HSTU paper) with in-kernel relative bias and the M-FALCON mask
# --------------------------------------------------------------------------------------------
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
    pid_bh = tl.program_id(0).to(tl.int64)
    pid_m = tl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    offs_n = tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    d_mask = offs_d < D
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

    q = tl.load(q_ptr + b * sq_b + h * sq_h + offs_m[:, None] * sq_m + offs_d[None, :] * sq_d,
                mask=m_mask[:, None] & d_mask[None, :], other=0.0)  # [BM, BD]
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
    if _use_reference(q, k, v, pos_bias, time_bias):
        return reference.hstu_attention(q, k, v, q_pos, k_pos, q_ts, k_ts, num_history, q_self,
                                        pos_bias, time_bias, time_base, scale, norm, shared)
    return _launch_hstu(q, k, v, q_pos, k_pos, q_ts, k_ts, num_history, q_self, pos_bias, time_bias,
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


def _launch_hstu(q, k, v, q_pos, k_pos, q_ts, k_ts, num_history, q_self, pos_bias, time_bias,
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
        tiles = (min(bm, _pow2(M)), min(bn, _block_keys(NK)), warps, stages)
    bm, bn, warps, stages = tiles
    _hstu_attention_kernel[(B * H, triton.cdiv(M, bm))](
        q, k, v, q_pos, k_pos, q_ts, k_ts, num_history, q_self, pos_bias, time_bias, thr, cthr, out,
        M, H, NK, P, T,
        *q.stride(), *k.stride(), *v.stride(),
        *q_pos.stride(), *k_pos.stride(), *q_ts.stride(), *k_ts.stride(), *q_self.stride(),
        *pos_bias.stride(), *time_bias.stride(), *out.stride(),
        float(scale), 1.0 / float(norm), 1.0 / math.log2(float(time_base)),
        D=D, DV=DV, BLOCK_M=bm, BLOCK_N=bn, BLOCK_D=_pow2(D), BLOCK_DV=_pow2(DV),
        DOT_PRECISION=_dot_precision(q), BIASES=biases, TIME_STEPS=time_steps, num_warps=warps, num_stages=stages,
    )
    return out
