"""What the Triton kernels share: the dtypes they take, block sizes, dot precision, the softmax
statistics of a block of queries, and the set-up of the kernels over blocks of beams: on the host
(BeamTiles: grid, block sizes) and on the device (a program's user, head, rows and queries)."""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634
# finite start for running maxima, so a tile without valid keys rescales by exp2(0) = 1, not NaN
NEG_BIG = tl.constexpr(-1.0e30)
# the kernels load these and accumulate in fp32; other dtypes (float64) take the reference
KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def computable(t) -> bool:
    """A tensor the kernels compute with: one of KERNEL_DTYPES and not empty (any strides)."""
    return isinstance(t, torch.Tensor) and t.dtype in KERNEL_DTYPES and t.numel() > 0


# --------------------------------------------------------------------------------------------
# block-size choices (powers of two, at least 16 where a tile feeds tl.dot)
# --------------------------------------------------------------------------------------------
def pow2(x: int, lo: int = 16, hi: int | None = None) -> int:
    p = max(lo, triton.next_power_of_2(max(int(x), 1)))
    return min(p, hi) if hi is not None else p


def block_keys(n: int) -> int:
    """Key tile: half the rows for short histories (so the online softmax sees several tiles), 64 beyond."""
    return pow2(triton.next_power_of_2(max(n, 1)) // 2, 16, 64)


def dot_precision(t: torch.Tensor) -> str:
    # fp32 inputs: exact products (tf32 would lose ~3 digits against the reference)
    return "ieee" if t.dtype == torch.float32 else "tf32"


class BeamTiles(NamedTuple):
    """Launch set-up of a kernel over blocks of a user's beams, q [B, W, H, d] against k [B, N, H, d]."""

    B: int
    W: int
    H: int
    N: int
    D: int
    qk_scale: float  # d^-1/2 for base-2 logits
    constexprs: dict  # BLOCK_W, BLOCK_N, BLOCK_D, DOT_PRECISION and the warps, as every beam kernel takes them

    def grid(self, per_head: bool = True) -> tuple:
        """One program per (user, head) or per user, and block of beams."""
        return (self.B * self.H if per_head else self.B, triton.cdiv(self.W, self.constexprs["BLOCK_W"]))


def beam_tiles(q: torch.Tensor, k: torch.Tensor) -> BeamTiles:
    B, W, H, D = q.shape
    N = k.shape[1]
    return BeamTiles(B, W, H, N, D, (D ** -0.5) * LOG2E,
                     dict(BLOCK_W=pow2(W, 16, 64), BLOCK_N=block_keys(N), BLOCK_D=pow2(D),
                          DOT_PRECISION=dot_precision(q), num_warps=4))


# --------------------------------------------------------------------------------------------
# shared device helpers (inlined into each kernel: the same device code as written in place)
# --------------------------------------------------------------------------------------------
@triton.jit
def beam_offsets(pid_w, W, D, BLOCK_W: tl.constexpr, BLOCK_D: tl.constexpr):
    """The rows of block pid_w (beams, or HSTU's queries), the head-dim offsets, and their masks:
    (offs_w, offs_d, w_mask, d_mask)."""
    offs_w = pid_w * BLOCK_W + tl.arange(0, BLOCK_W)
    offs_d = tl.arange(0, BLOCK_D)
    return offs_w, offs_d, offs_w < W, offs_d < D


@triton.jit
def beam_block(H, W, D, BLOCK_W: tl.constexpr, BLOCK_D: tl.constexpr):
    """The (user b, head h) of a program on the grid BeamTiles.grid() (int64, so that offsets of
    large tensors do not overflow) and its block of rows: (b, h, offs_w, offs_d, w_mask, d_mask)."""
    pid_bh = tl.program_id(0).to(tl.int64)
    pid_w = tl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    offs_w, offs_d, w_mask, d_mask = beam_offsets(pid_w, W, D, BLOCK_W, BLOCK_D)
    return b, h, offs_w, offs_d, w_mask, d_mask


@triton.jit
def load_beam_queries(q_ptr, b, h, offs_w, offs_d, w_mask, d_mask, sq_b, sq_w, sq_h, sq_d):
    """q[b, offs_w, h, offs_d] as a [BLOCK_W, BLOCK_D] tile, 0 outside the masks."""
    return tl.load(q_ptr + b * sq_b + h * sq_h + offs_w[:, None] * sq_w + offs_d[None, :] * sq_d,
                   mask=w_mask[:, None] & d_mask[None, :], other=0.0)


@triton.jit
def key_logits(q, k_base, n, n_mask, sk_n, sk_d, offs_d, d_mask, qk_scale, DOT_PRECISION: tl.constexpr):
    """Base-2 logits [BLOCK_W, BLOCK_N] of the queries q against key rows n of k_base (rows
    outside n_mask load as 0: the caller masks their logits)."""
    k = tl.load(k_base + n[:, None] * sk_n + offs_d[None, :] * sk_d,
                mask=n_mask[:, None] & d_mask[None, :], other=0.0)
    return tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale


@triton.jit
def softmax_stats(q, k_base, sk_n, sk_d, offs_d, d_mask, L, qk_scale,
                  BLOCK_W: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Running max m and sum l of exp2(logits - m) over the first L keys (base-2 logits)."""
    m = tl.full([BLOCK_W], NEG_BIG, tl.float32)
    l = tl.zeros([BLOCK_W], tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    for start in range(0, L, BLOCK_N):
        n = start + offs_n
        n_mask = n < L
        s = key_logits(q, k_base, n, n_mask, sk_n, sk_d, offs_d, d_mask, qk_scale, DOT_PRECISION)  # [BW, BN]
        s = tl.where(n_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        l = l * tl.exp2(m - m_new) + tl.sum(tl.exp2(s - m_new[:, None]), axis=1)
        m = m_new
    return m, l
