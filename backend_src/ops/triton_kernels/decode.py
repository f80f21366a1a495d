"""Decode attention of the PFA paper ("PFA: Attention Can Be Progressively Focused ..."), its
attention probabilities, and the dynamic top-k baseline, as Triton kernels over blocks of beams.

One program per (user, head, block of beams): the beams of a user share one K/V block, so each key
tile is loaded once and multiplied against all beams of the block with ``tl.dot``; an online
softmax runs over key tiles up to ``lengths[b]`` (the PFA prefix budget), so a shorter budget reads
fewer rows. Dynamic top-k keeps each beam's own head-mean weights and then masks every beam's rows
by its k-th weight in one dense pass of the decode kernel.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import NEG_BIG, beam_block, beam_offsets, beam_tiles, key_logits, load_beam_queries, pow2, softmax_stats


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
    b, h, offs_w, offs_d, w_mask, d_mask = beam_block(H, W, D, BLOCK_W, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    offs_n = tl.arange(0, BLOCK_N)
    dv_mask = offs_dv < DV

    q = load_beam_queries(q_ptr, b, h, offs_w, offs_d, w_mask, d_mask, sq_b, sq_w, sq_h, sq_d)
    L = tl.minimum(tl.load(len_ptr + b), N)
    k_base = k_ptr + b * sk_b + h * sk_h
    v_base = v_ptr + b * sv_b + h * sv_h

    if HAS_THRESH:
        tau = tl.load(tau_ptr + b * st_b + offs_w * st_w, mask=w_mask, other=float("inf"))
    m = tl.full([BLOCK_W], NEG_BIG, tl.float32)
    l = tl.zeros([BLOCK_W], tl.float32)
    acc = tl.zeros([BLOCK_W, BLOCK_DV], tl.float32)
    for start in range(0, L, BLOCK_N):
        n = start + offs_n
        n_mask = n < L
        s = key_logits(q, k_base, n, n_mask, sk_n, sk_d, offs_d, d_mask, qk_scale, DOT_PRECISION)  # [BW, BN]
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
    t = beam_tiles(q, k)
    DV = v.shape[-1]
    out = torch.empty((t.B, t.W, t.H, DV), device=q.device, dtype=q.dtype)
    # pointers a mode does not use get any tensor and zero strides
    sel_arg, ss = (sel, sel.stride()) if sel is not None else (lengths, (0, 0, 0))
    tau_arg, st = (tau, tau.stride()) if tau is not None else (lengths, (0, 0))
    _decode_attention_kernel[t.grid()](
        q, k, v, lengths, sel_arg, tau_arg, out,
        t.W, t.H, t.N, t.D, DV,
        *q.stride(), *k.stride(), *v.stride(), *ss, *st, *out.stride(),
        t.qk_scale,
        HAS_THRESH=sel is not None, BLOCK_DV=pow2(DV), **t.constexprs,
    )
    return out


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """All beams of a user attend over the first lengths[b] rows of one contiguous K/V block.
    q [B, W, H, d], k/v [B, N, H, d], lengths [B] -> [B, W, H, d]."""
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
    b, h, offs_w, offs_d, w_mask, d_mask = beam_block(H, W, D, BLOCK_W, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    q = load_beam_queries(q_ptr, b, h, offs_w, offs_d, w_mask, d_mask, sq_b, sq_w, sq_h, sq_d)
    L = tl.minimum(tl.load(len_ptr + b), N)
    k_base = k_ptr + b * sk_b + h * sk_h
    p_base = p_ptr + b * sp_b + h * sp_h + offs_w[:, None] * sp_w

    # pass 1: softmax statistics over the valid rows
    m, l = softmax_stats(q, k_base, sk_n, sk_d, offs_d, d_mask, L, qk_scale, BLOCK_W, BLOCK_N, DOT_PRECISION)
    inv_l = 1.0 / tl.where(l > 0.0, l, 1.0)
    # pass 2: normalized weights of the valid tiles
    for start in range(0, L, BLOCK_N):
        n = start + offs_n
        n_mask = n < L
        s = key_logits(q, k_base, n, n_mask, sk_n, sk_d, offs_d, d_mask, qk_scale, DOT_PRECISION)
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
    t = beam_tiles(q, k)
    out = torch.empty((t.B, t.W, t.H, t.N), device=q.device, dtype=q.dtype)
    _attention_probs_kernel[t.grid()](
        q, k, lengths, out, t.W, t.H, t.N, t.D,
        *q.stride(), *k.stride(), *out.stride(),
        t.qk_scale, **t.constexprs,
    )
    return out


# --------------------------------------------------------------------------------------------
# dynamic top-k baseline: every beam over its own rows
# --------------------------------------------------------------------------------------------
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
    offs_w, offs_d, w_mask, d_mask = beam_offsets(tl.program_id(1), W, D, BLOCK_W, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    L = tl.minimum(tl.load(len_ptr + b), N)
    q_rows = q_ptr + b * sq_b + offs_w[:, None] * sq_w + offs_d[None, :] * sq_d
    qw_mask = w_mask[:, None] & d_mask[None, :]
    stat = stat_ptr + b * st_b + offs_w * st_w
    for h in range(H):
        q = tl.load(q_rows + h * sq_h, mask=qw_mask, other=0.0)
        m, l = softmax_stats(q, k_ptr + b * sk_b + h * sk_h, sk_n, sk_d, offs_d, d_mask, L, qk_scale,
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
            s = key_logits(q, k_ptr + b * sk_b + h * sk_h, n, n_mask, sk_n, sk_d, offs_d, d_mask, qk_scale,
                           DOT_PRECISION)
            acc += tl.exp2(tl.where(n_mask[None, :], s, float("-inf")) - m[:, None]) * c[:, None]
        tl.store(o_rows + n[None, :] * so_n, acc, mask=w_mask[:, None] & (n < N)[None, :])
    for start in range(tl.cdiv(L, BLOCK_N) * BLOCK_N, N, BLOCK_N):  # rows past the length: 0
        n = start + offs_n
        tl.store(o_rows + n[None, :] * so_n, tl.zeros([BLOCK_W, BLOCK_N], tl.float32),
                 mask=w_mask[:, None] & (n < N)[None, :])


def beam_head_mean(q, k, lengths):
    """[B, W, N] fp32 head-mean attention weights of every beam, 0 past the length."""
    t = beam_tiles(q, k)
    out = torch.empty((t.B, t.W, t.N), device=q.device, dtype=torch.float32)
    stat = torch.empty((t.B, t.H, t.W, 2), device=q.device, dtype=torch.float32)
    _beam_head_mean_kernel[t.grid(per_head=False)](
        q, k, lengths, stat, out, t.W, t.H, t.N, t.D,
        *q.stride(), *k.stride(), *stat.stride()[:3], *out.stride(),
        t.qk_scale, 1.0 / t.H, **t.constexprs,
    )
    return out


def dynamic_topk_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor, keep: int, return_indices: bool = False
):
    """Baseline: every beam ranks the history by its own head-averaged weights and attends
    (renormalized) over its own top `keep` rows. q [B,W,H,d], k/v [B,N,H,d] -> [B,W,H,d].

    A beam's kept rows are those whose head-mean weight reaches its keep-th largest: the
    attention then reads the user's K/V block once, densely (tensor-core products), with each
    beam's rows masked by that threshold, instead of gathering W*keep rows per user. (A row tied
    with the threshold is kept too; with real-valued weights ties are vanishingly rare.)"""
    N = k.shape[1]
    mean_probs = beam_head_mean(q, k, lengths)  # [B, W, N] fp32, 0 beyond lengths
    keep = min(keep, N)
    top = torch.topk(mean_probs, keep, dim=-1, sorted=return_indices)  # order only when read
    tau = top.values.amin(-1)  # [B, W]; 0 when the user has no more than `keep` rows
    out = _launch_decode(q, k, v, lengths, sel=mean_probs, tau=tau)
    return (out, top.indices) if return_indices else out

