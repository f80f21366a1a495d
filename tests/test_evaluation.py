"""The fused order (weighted ranker logit + retrieval log-probability) and how its weight is chosen."""
import math

import pytest
import torch

from backend_src.config import DecodeOptions, ModelConfig
from backend_src.data.synthetic import generate_synthetic
from backend_src.evaluation import evaluate, tune_fusion_weight
from backend_src.model.recommender import fuse
from backend_src.training import build_model

DECODE = DecodeOptions(mode="pfa", beam_width=12, k=8)


@pytest.fixture(scope="module")
def small():
    data = generate_synthetic(num_users=60, num_items=80, seed=3)
    cfg = ModelConfig(num_items=data.num_items, d_model=16, num_layers=1, num_heads=2, max_seq_len=24,
                      codebook_sizes=(6, 6, 6, 1), dropout=0.0)
    torch.manual_seed(0)
    return data, build_model(data, cfg, embedding_dim=16).eval()


def test_fuse_weights_the_ranker_and_keeps_empty_slots_empty():
    rank = torch.tensor([[2.0, -1.0, float("-inf")]])
    lp = torch.tensor([[-3.0, -0.5, -9.0]])
    assert torch.equal(fuse(rank, lp, 0.5), torch.tensor([[-2.0, -1.0, float("-inf")]]))
    # weight 0 is the beam order, but an empty slot still never outranks a real candidate
    assert torch.equal(fuse(rank, lp, 0.0), torch.tensor([[-3.0, -0.5, float("-inf")]]))


def test_fused_order_uses_the_checkpoint_weight(small):
    data, model = small
    model.cfg.rank_fusion_weight = 0.25
    try:
        res = evaluate(model, data, "test", DECODE, dense=False, fusion_weights=(0.25, 2.0), progress=False)
    finally:
        model.cfg.rank_fusion_weight = 1.0
    assert res["fused/seen_included"] == res["fused@0.25/seen_included"]
    assert "fused@1/seen_included" not in res  # only the requested weights are added


def test_recommend_ranks_by_the_weighted_sum(small):
    data, model = small
    from backend_src.data.sequences import eval_batches

    batch = next(eval_batches(data, "test", batch_size=8, max_len=model.cfg.max_seq_len))
    cache = model.encode(batch.items, batch.actions, batch.timestamps, batch.lengths)
    beams = model.retrieve(cache, DECODE)
    expected = fuse(model.rank(cache, beams.item_ids), beams.log_probs, 0.3)
    model.cfg.rank_fusion_weight = 0.3
    try:
        rec = model.recommend(cache, DECODE, top_k=5)
    finally:
        model.cfg.rank_fusion_weight = 1.0
    top = torch.topk(expected, 5, dim=1)
    torch.testing.assert_close(rec.rank_scores, top.values)
    assert torch.equal(rec.items, torch.gather(beams.item_ids, 1, top.indices).masked_fill(torch.isinf(top.values), 0))


def test_tuning_picks_the_best_validation_weight(small):
    data, model = small
    weights = (0.0, 0.5, 1.0, 3.0)
    best, table = tune_fusion_weight(model, data, DECODE, weights=weights, progress=False)
    assert set(table) == set(weights)
    assert best in weights
    assert table[best]["ndcg@10"] == max(m["ndcg@10"] for m in table.values())
    assert all(0.0 <= m["ndcg@10"] <= 1.0 and not math.isnan(m["ndcg@10"]) for m in table.values())
