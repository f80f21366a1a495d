"""Tiny HSTU models and histories shared by the backbone, ranker and export tests."""
from __future__ import annotations

import torch

from backend_src.config import ModelConfig
from backend_src.model.hstu import HSTUEncoder


def tiny_config(**kw) -> ModelConfig:
    base = dict(num_items=50, d_model=32, num_layers=2, num_heads=2, max_seq_len=64, num_time_buckets=16, dropout=0.1)
    base.update(kw)
    return ModelConfig(**base)


def make_encoder(cfg: ModelConfig, seed: int = 0) -> HSTUEncoder:
    """An encoder whose biases are large enough that a wrong position or time index shows."""
    torch.manual_seed(seed)
    enc = HSTUEncoder(cfg)
    with torch.no_grad():
        for layer in enc.layers:
            layer.pos_bias.normal_(0.0, 1.0)
            layer.time_bias.normal_(0.0, 1.0)
        enc.item_embedding.weight[1:].normal_(0.0, 0.3)
        enc.action_embedding.weight.normal_(0.0, 0.3)
    return enc.eval()


def make_batch(lengths, n=None, num_items=50, seed=1):
    """Left-aligned random histories with irregular time gaps; padding rows hold junk (they
    must not matter)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor(lengths, dtype=torch.long)
    B = len(lengths)
    n = n or int(lengths.max())
    items = torch.randint(1, num_items + 1, (B, n), generator=g)
    actions = torch.randint(0, 6, (B, n), generator=g)
    gaps = torch.randint(0, 10**6, (B, n), generator=g) * (torch.rand(B, n, generator=g) < 0.7)
    timestamps = 1_600_000_000 + gaps.cumsum(1)
    return items, actions, timestamps, lengths
