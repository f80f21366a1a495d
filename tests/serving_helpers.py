"""A tiny untrained recommender checkpoint for the tests that start a real server."""
from __future__ import annotations

import pytest
import torch

from backend_src.config import ModelConfig


def build_tiny_checkpoint(path, item_ids, max_history: int, seed: int) -> None:
    """Random-weight model with random unique semantic IDs over `item_ids` (index 0 = None):
    the serving tests check plumbing and served == offline, not quality."""
    from backend_src.model.recommender import GenerativeRecommender
    from backend_src.model.semantic_ids import SemanticIdCodebook, assign_collision_codes

    num_items = len(item_ids) - 1
    g = torch.Generator().manual_seed(0)
    codebook = SemanticIdCodebook(assign_collision_codes(torch.randint(0, 4, (num_items, 3), generator=g)))
    cfg = ModelConfig(
        num_items=num_items, d_model=16, num_layers=2, num_heads=2, max_seq_len=max_history,
        codebook_sizes=tuple(int(s) for s in codebook.codebook_sizes), decoder_heads=2, dropout=0.0,
    )
    torch.manual_seed(seed)
    GenerativeRecommender(cfg, codebook, list(item_ids)).eval().save(path)


def require_tritonserver() -> None:
    """Skip the calling test (or fixture) when the Triton server binaries are not installed."""
    from backend_src.serving.server import triton_home

    try:
        triton_home()
    except RuntimeError as e:
        pytest.skip(str(e))
