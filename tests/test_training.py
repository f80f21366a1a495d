"""The learning-rate schedule of training."""
from __future__ import annotations

import pytest

from backend_src.config import TrainConfig
from backend_src.training import lr_scale


def test_constant_schedule_keeps_the_rate():
    assert all(lr_scale(TrainConfig(), p) == 1.0 for p in (0.0, 0.3, 1.0, 2.0))


def test_cosine_schedule_decays_to_the_floor():
    tcfg = TrainConfig(lr_schedule="cosine", lr_min_ratio=0.05)
    scales = [lr_scale(tcfg, i / 20) for i in range(21)]
    assert scales[0] == pytest.approx(1.0) and scales[-1] == pytest.approx(0.05)
    assert scales[10] == pytest.approx(0.525)
    assert all(a > b for a, b in zip(scales, scales[1:]))
    assert lr_scale(tcfg, 1.5) == pytest.approx(0.05)  # past the budget: stays at the floor


def test_unknown_schedule_is_an_error():
    with pytest.raises(ValueError, match="lr_schedule"):
        lr_scale(TrainConfig(lr_schedule="step"), 0.5)
