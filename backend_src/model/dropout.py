"""Inverted dropout whose mask costs a byte per element on the CPU.

torch's CPU dropout draws its mask with `bernoulli_`, one Mersenne Twister number at a time: on
two cores it was the largest single cost of a training step (17% of a Beauty step's CPU time,
more than every matrix product of the backward pass). Here the mask is a block of random bytes
from numpy's PCG64, compared with a threshold: element i is kept when byte_i >= round(256 p), and
kept elements are scaled by 256 / (256 - round(256 p)), so E[output] = input exactly, at the drop
rate p rounded to a multiple of 1/256 (0.3 -> 77/256 = 0.3008).

The generator of each call is seeded from torch's global generator, so `torch.manual_seed`, a
saved RNG state and per-rank seeds govern these masks as they govern torch's own. On a GPU (and
with p = 0 or in eval mode) this is `F.dropout`. The SASRec baseline keeps torch's own dropout, so
that its recorded results reproduce draw for draw.
"""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn


def byte_mask_dropout(x: torch.Tensor, p: float) -> torch.Tensor:
    """x * keep / (1 - p') with keep_i = (random byte_i >= round(256 p)), p' = round(256 p) / 256."""
    threshold = round(256 * p)
    if threshold >= 256:
        return x * 0.0
    seed = int(torch.randint(0, 2**62, (1,)))  # from torch's global generator
    raw = np.random.Generator(np.random.PCG64(seed)).bytes(x.numel())
    random_bytes = torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(x.shape)
    keep = (random_bytes >= threshold).to(x.dtype) * (256.0 / (256 - threshold))
    return x * keep


class Dropout(nn.Module):
    """Drop-in for nn.Dropout (no parameters, the same state dict)."""

    def __init__(self, p: float = 0.5):
        super().__init__()
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"dropout probability must be in [0, 1], got {p}")
        self.p = float(p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        if x.device.type != "cpu":
            return F.dropout(x, self.p, True)
        return byte_mask_dropout(x, self.p)

    def extra_repr(self) -> str:
        return f"p={self.p}"
