"""Ranking metrics against hand-computed values."""
import math

import pytest
import torch

from backend_src.metrics import MetricAccumulator, ranking_metrics, topk_full_catalog


def test_ranking_metrics_hand_computed():
    ranked = torch.tensor(
        [
            [7, 3, 9, 1, 2, 4, 5, 6, 8, 10],  # target 7 at rank 0
            [1, 2, 3, 4, 5, 6, 7, 8, 9, 10],  # target 5 at rank 4
            [1, 2, 3, 4, 5, 6, 7, 8, 9, 10],  # target 9 at rank 8
            [1, 2, 3, 4, 5, 6, 7, 8, 9, 10],  # target 11 missing
        ]
    )
    targets = torch.tensor([7, 5, 9, 11])
    m = ranking_metrics(ranked, targets)
    assert list(m) == ["recall@5", "ndcg@5", "recall@10", "ndcg@10"]
    assert m["recall@5"] == pytest.approx(2 / 4)
    assert m["recall@10"] == pytest.approx(3 / 4)
    assert m["ndcg@5"] == pytest.approx((1.0 + 1 / math.log2(6)) / 4)
    assert m["ndcg@10"] == pytest.approx((1.0 + 1 / math.log2(6) + 1 / math.log2(10)) / 4)


def test_empty_slots_and_padding_target_never_hit():
    ranked = torch.tensor([[3, 0, 0], [0, 0, 0]])
    m = ranking_metrics(ranked, torch.tensor([0, 0]), ks=(1, 3))
    assert m == {"recall@1": 0.0, "ndcg@1": 0.0, "recall@3": 0.0, "ndcg@3": 0.0}
    m = ranking_metrics(ranked, torch.tensor([3, 4]), ks=(1, 3))
    assert m["recall@1"] == 0.5 and m["ndcg@3"] == 0.5


def test_ranking_too_short_raises():
    with pytest.raises(ValueError):
        ranking_metrics(torch.tensor([[1, 2, 3]]), torch.tensor([1]), ks=(5,))


def test_topk_full_catalog_masks_padding_and_seen():
    # item indices 0..5; padding column has the highest score but must never come out
    scores = torch.tensor([[9.0, 1.0, 5.0, 3.0, 4.0, 2.0], [9.0, 5.0, 4.0, 3.0, 2.0, 1.0]])
    assert topk_full_catalog(scores, 3).tolist() == [[2, 4, 3], [1, 2, 3]]
    seen = torch.tensor([[2, 4, 0], [1, 0, 0]])  # padded histories
    assert topk_full_catalog(scores, 3, exclude=seen).tolist() == [[3, 5, 1], [2, 3, 4]]
    # more slots than allowed items: the rest are empty (0)
    all_seen = torch.tensor([[1, 2, 3, 4], [1, 2, 3, 0]])
    assert topk_full_catalog(scores, 3, exclude=all_seen).tolist() == [[5, 0, 0], [4, 5, 0]]
    assert scores[0, 0] == 9.0  # input untouched


def test_accumulator_equals_one_big_batch():
    g = torch.Generator().manual_seed(0)
    scores = torch.randn(37, 21, generator=g)
    targets = torch.randint(1, 21, (37,), generator=g)
    ranked = topk_full_catalog(scores, 10)
    acc = MetricAccumulator()
    for lo in range(0, 37, 8):
        acc.update(ranked[lo : lo + 8], targets[lo : lo + 8])
    out = acc.compute()
    assert out["count"] == 37
    for name, value in ranking_metrics(ranked, targets).items():
        assert out[name] == pytest.approx(value)
