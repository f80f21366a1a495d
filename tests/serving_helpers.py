"""A tiny untrained recommender checkpoint for the tests that start a real server."""
from __future__ import annotations

import pytest


def build_tiny_checkpoint(path, item_ids, max_history: int, seed: int) -> None:
    """Random-weight model with random unique semantic IDs over `item_ids` (index 0 = None):
    the serving tests check plumbing and served == offline, not quality. Its fused order takes
    every expert (ranker and dense weights above 0), so the served path computes each one."""
    from backend_src.model.recommender import GenerativeRecommender

    model = GenerativeRecommender.untrained(item_ids, max_history, seed)
    model.cfg.set_fusion_weights((1.0, 0.5, 0.0), (1.0, 0.5, 0.0))
    model.save(path)


def require_tritonserver() -> None:
    """Skip the calling test (or fixture) when the Triton server binaries are not installed."""
    from backend_src.serving.server import triton_home

    try:
        triton_home()
    except RuntimeError as e:
        pytest.skip(str(e))
