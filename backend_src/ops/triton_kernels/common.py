"""What the Triton kernels share: the dtypes they take, block sizes, dot precision, the softmax
statistics of a block of queries, and the launch set-up of the kernels over blocks of beams."""
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
# shared device helpers
# --------------------------------------------------------------------------------------------
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
        k = tl.load(k_base + n[:, None] * sk_n + offs_d[None, :] * sk_d,
                    mask=n_mask[:, None] & d_mask[None, :], other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # [BW, BN]
        s = tl.where(n_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        l = l * tl.exp2(m - m_new) + tl.sum(tl.exp2(s - m_new[:, None]), axis=1)
        m = m_new
    return m, l
