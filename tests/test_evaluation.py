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


def test_fused_order_uses_the_checkpoint_weight_of_each_seen_policy(small):
    data, model = small
    model.cfg.rank_fusion_weight, model.cfg.rank_fusion_weight_seen_excluded = 0.25, 2.0
    try:
        res = evaluate(model, data, "test", DECODE, dense=False, fusion_weights=(0.25, 2.0), progress=False)
    finally:
        model.cfg.rank_fusion_weight, model.cfg.rank_fusion_weight_seen_excluded = 1.0, None
    assert res["fused/seen_included"] == res["fused@0.25/seen_included"]
    assert res["fused/seen_excluded"] == res["fused@2/seen_excluded"]
    assert "fused@1/seen_included" not in res  # only the requested weights are added


def test_one_fusion_weight_serves_both_policies_unless_a_second_is_set():
    from backend_src.config import ModelConfig

    cfg = ModelConfig(num_items=5, rank_fusion_weight=0.5)
    assert cfg.fusion_weight(False) == cfg.fusion_weight(True) == 0.5  # checkpoints from before the second
    cfg.rank_fusion_weight_seen_excluded = 1.0
    assert (cfg.fusion_weight(False), cfg.fusion_weight(True)) == (0.5, 1.0)
    assert ModelConfig.from_dict(cfg.to_dict()).fusion_weight(True) == 1.0


def test_recommend_ranks_by_the_weighted_sum(small):
    data, model = small
    from backend_src.data.sequences import eval_batches

    batch = next(eval_batches(data, "test", batch_size=8, max_len=model.cfg.max_seq_len))
    cache = model.encode(batch.items, batch.actions, batch.timestamps, batch.lengths)
    beams = model.retrieve(cache, DECODE)
    rank = model.rank(cache, beams.item_ids)
    seen = (beams.item_ids[:, :, None] == batch.items[:, None, :]).any(-1)
    model.cfg.rank_fusion_weight, model.cfg.rank_fusion_weight_seen_excluded = 0.3, 2.0
    try:
        rec = model.recommend(cache, DECODE, top_k=5)
        rec_excl = model.recommend(cache, DECODE, top_k=5, exclude_seen=True, history_items=batch.items)
    finally:
        model.cfg.rank_fusion_weight, model.cfg.rank_fusion_weight_seen_excluded = 1.0, None
    for got, expected in ((rec, fuse(rank, beams.log_probs, 0.3)),
                          (rec_excl, fuse(rank, beams.log_probs, 2.0).masked_fill(seen, float("-inf")))):
        top = torch.topk(expected, 5, dim=1)
        torch.testing.assert_close(got.rank_scores, top.values)
        assert torch.equal(got.items, torch.gather(beams.item_ids, 1, top.indices).masked_fill(torch.isinf(top.values), 0))


def test_tuning_picks_the_best_validation_weight(small):
    data, model = small
    weights = (0.0, 0.5, 1.0, 3.0)
    best, tables = tune_fusion_weight(model, data, DECODE, weights=weights, progress=False)
    assert set(best) == set(tables) == {"seen_included", "seen_excluded"}
    for policy, table in tables.items():  # each policy's weight is chosen with that policy applied
        assert set(table) == set(weights)
        assert table[best[policy]]["ndcg@10"] == max(m["ndcg@10"] for m in table.values())
        assert all(0.0 <= m["ndcg@10"] <= 1.0 and not math.isnan(m["ndcg@10"]) for m in table.values())
