"""PFA's selection of the history rows to keep ("PFA: Attention Can Be Progressively Focused ..."),
and the copy of kept rows into contiguous memory, as Triton kernels.

The scores pool every beam's head-mean attention weight into one score per row (one program per
(user, head, block of beams), adding into the user's row of scores); one program per user then
ranks its scores in registers and copies the kept rows of up to two tensors (the selection fused
with its gather), and ``gather_rows`` copies any rows by a given order.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .common import beam_block, beam_tiles, key_logits, load_beam_queries, pow2, softmax_stats


# --------------------------------------------------------------------------------------------
# PFA scores: head-averaged attention pooled over the beams
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
    b, h, offs_w, offs_d, w_mask, d_mask = beam_block(H, W, D, BLOCK_W, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    q = load_beam_queries(q_ptr, b, h, offs_w, offs_d, w_mask, d_mask, sq_b, sq_w, sq_h, sq_d)
    L = tl.minimum(tl.load(len_ptr + b), N)
    k_base = k_ptr + b * sk_b + h * sk_h

    m, l = softmax_stats(q, k_base, sk_n, sk_d, offs_d, d_mask, L, qk_scale, BLOCK_W, BLOCK_N, DOT_PRECISION)
    wb = tl.load(w_ptr + b * sw_b + offs_w * sw_w, mask=w_mask, other=0.0).to(tl.float32)
    scale_w = wb * inv_heads / tl.where(l > 0.0, l, 1.0)  # w_b / (H l)
    for start in range(0, L, BLOCK_N):
        n = start + offs_n
        n_mask = n < L
        s = key_logits(q, k_base, n, n_mask, sk_n, sk_d, offs_d, d_mask, qk_scale, DOT_PRECISION)
        p = tl.exp2(tl.where(n_mask[None, :], s, float("-inf")) - m[:, None]) * scale_w[:, None]
        tl.atomic_add(out_ptr + b * so_b + n * so_n, tl.sum(p, axis=0), mask=n_mask)
    if (tl.program_id(1) == 0) and (h == 0):
        # rows past the length: no program adds to them, so one plain store is race-free
        for start in range(L // BLOCK_N * BLOCK_N, N, BLOCK_N):
            n = start + offs_n
            tl.store(out_ptr + b * so_b + n * so_n, tl.full([BLOCK_N], float("-inf"), tl.float32),
                     mask=(n >= L) & (n < N))


def pfa_scores(q, k, lengths, beam_weights):
    """[B, N] fp32 PFA scores, -inf past the length."""
    t = beam_tiles(q, k)
    out = torch.zeros((t.B, t.N), device=q.device, dtype=torch.float32)
    _pfa_scores_kernel[t.grid()](
        q, k, lengths, beam_weights, out, t.W, t.H, t.N, t.D,
        *q.stride(), *k.stride(), *beam_weights.stride(), *out.stride(),
        t.qk_scale, 1.0 / t.H, **t.constexprs,
    )
    return out


def pfa_select(q: torch.Tensor, k: torch.Tensor, lengths: torch.Tensor, beam_weights: torch.Tensor, keep: int):
    """PFA selection: s_n = sum_w w_w mean_h a_{w,h,n}; order = top `keep` rows by s.
    Returns order [B, keep'], kept_lengths [B] = min(keep', lengths)."""
    N = k.shape[1]
    scores = pfa_scores(q, k, lengths, beam_weights)  # [B, N] fp32, -inf past the length
    keep = min(keep, N)
    order = torch.topk(scores, keep, dim=1, sorted=True).indices  # [B, keep]
    return order, torch.clamp(lengths, max=keep)


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


def _rows_view(x: torch.Tensor):
    """x [B, N, ...] -> [B, N, F] (bool as uint8: the kernels copy bytes)."""
    B, N = x.shape[:2]
    xf = x.reshape(B, N, math.prod(x.shape[2:]))  # a view whenever the trailing dims merge (K/V caches)
    return xf.view(torch.uint8) if xf.dtype == torch.bool else xf


def gather_rows(x: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """x [B, N, ...], order [B, k] -> contiguous [B, k, ...] (rows in the given order)."""
    xf = _rows_view(x)
    B, N, F = xf.shape
    keep = order.shape[1]
    out = torch.empty((B, keep, F), device=x.device, dtype=xf.dtype)
    if B == 0 or keep == 0 or F == 0:
        return out.view(x.dtype).reshape(B, keep, *x.shape[2:])
    BLOCK_F = pow2(F, 16, 512)
    BLOCK_J = max(1, min(pow2(keep, 1, 64), 4096 // BLOCK_F))
    grid = (B, triton.cdiv(keep, BLOCK_J), triton.cdiv(F, BLOCK_F))
    _gather_rows_kernel[grid](
        xf, order, out, N, keep, F,
        *xf.stride(), *order.stride(), out.stride(0), out.stride(1),
        BLOCK_J=BLOCK_J, BLOCK_F=BLOCK_F, num_warps=4,
    )
    return out.view(x.dtype).reshape(B, keep, *x.shape[2:])


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


def select_rows(scores: torch.Tensor, keep: int, rows: tuple) -> tuple:
    """scores [B, N] fp32, rows: tensors [B, N, ...] -> (order [B, keep], the rows of each at that
    order, contiguous [B, keep, ...]). order: the top `keep` (<= N) rows by score, best first, ties
    to the lower row. The selecting kernel copies the first two tensors' rows, gather_rows any more."""
    B, N = scores.shape
    order = torch.empty((B, keep), device=scores.device, dtype=torch.int64)
    flat = [_rows_view(x) for x in rows[:2]]
    outs = [torch.empty((B, keep, xf.shape[2]), device=xf.device, dtype=xf.dtype) for xf in flat]
    x, xo = flat[0], outs[0]
    y, yo = (flat[1], outs[1]) if len(flat) > 1 else (x, xo)  # one tensor: y is x, never read (HAS_Y)
    n_pow2 = pow2(N)
    block_fx, block_fy = pow2(x.shape[2], 16, 512), pow2(y.shape[2], 16, 512)
    _pfa_select_rows_kernel[(B,)](
        scores, order, x, xo, y, yo,
        N, keep, x.shape[2], y.shape[2],
        *scores.stride(), *order.stride(),
        *x.stride(), xo.stride(0), xo.stride(1), *y.stride(), yo.stride(0), yo.stride(1),
        N_POW2=n_pow2, KEEP_POW2=min(pow2(keep), n_pow2), HAS_Y=len(flat) > 1,
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
    SELECT_ROWS_MAX_N rows (and calls with no rows to gather) take the unfused composition."""
    rows = tuple(rows)
    N = k.shape[1]
    if N > SELECT_ROWS_MAX_N or keep < 1 or not rows:
        order, kept = pfa_select(q, k, lengths, beam_weights, keep)
        return tuple(gather_rows(x, order) for x in rows), kept
    keep = min(keep, N)
    scores = pfa_scores(q, k, lengths, beam_weights)  # [B, N] fp32, -inf past the length
    _, kept_rows = select_rows(scores, keep, rows)
    return kept_rows, torch.clamp(lengths, max=keep)
