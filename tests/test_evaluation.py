"""The fused order (weighted ranker logit + retrieval log-probability) and how its weight is chosen."""
import math

import pytest
import torch

from backend_src.config import DecodeOptions, ModelConfig
from backend_src.data.synthetic import generate_synthetic
from backend_src.evaluation import evaluate, tune_fusion_weights
from backend_src.model.recommender import fuse, served_order
from backend_src.training import build_model

DECODE = DecodeOptions(mode="pfa", beam_width=12, k=8)


@pytest.fixture(scope="module")
def small():
    data = generate_synthetic(num_users=60, num_items=80, seed=3)
    cfg = ModelConfig(num_items=data.num_items, d_model=16, num_layers=1, num_heads=2, max_seq_len=24,
                      codebook_sizes=(6, 6, 6, 1), dropout=0.0, covisit_window=2)
    torch.manual_seed(0)
    return data, build_model(data, cfg, embedding_dim=16).eval()


def test_fuse_weights_the_ranker_and_keeps_empty_slots_empty():
    rank = torch.tensor([[2.0, -1.0, float("-inf")]])
    lp = torch.tensor([[-3.0, -0.5, -9.0]])
    assert torch.equal(fuse(rank, lp, 0.5), torch.tensor([[-2.0, -1.0, float("-inf")]]))
    # weight 0 is the beam order, but an empty slot still never outranks a real candidate
    assert torch.equal(fuse(rank, lp, 0.0), torch.tensor([[-3.0, -0.5, float("-inf")]]))
    # the dense head's log-softmax is a third term, weighted on its own
    dense = torch.tensor([[-1.0, -4.0, -2.0]])
    assert torch.equal(fuse(rank, lp, 0.5, dense, 0.25), torch.tensor([[-2.25, -2.0, float("-inf")]]))
    # and the co-visitation score a fourth
    covisit = torch.tensor([[0.0, 1.0, 2.0]])
    assert torch.equal(fuse(rank, lp, 0.5, dense, 0.25, covisit, 2.0), torch.tensor([[-2.25, 0.0, float("-inf")]]))


def test_fused_order_uses_the_checkpoint_weights_of_each_seen_policy(small):
    data, model = small
    model.cfg.set_fusion_weights((0.25, 0.0, 1.0), (2.0, 0.5, 0.0))
    try:
        res = evaluate(model, data, "test", DECODE, dense=False,
                       fusion_weights=((0.25, 0.0, 1.0), (2.0, 0.5, 0.0), (2.0, 0.0, 0.0)), progress=False)
    finally:
        model.cfg.set_fusion_weights((1.0, 0.0, 0.0), (1.0, 0.0, 0.0))
    assert res["fused/seen_included"] == res["fused@0.25,0,1/seen_included"]
    assert res["fused/seen_excluded"] == res["fused@2,0.5,0/seen_excluded"]
    assert "fused@1,0,0/seen_included" not in res  # only the requested weights are added


def test_one_fusion_weight_serves_both_policies_unless_a_second_is_set():
    from backend_src.config import ModelConfig

    cfg = ModelConfig(num_items=5, rank_fusion_weight=0.5)
    # checkpoints from before the second policy's weights, and before the dense and co-visitation weights
    assert cfg.fusion_weights(False) == cfg.fusion_weights(True) == (0.5, 0.0, 0.0)
    cfg.rank_fusion_weight_seen_excluded, cfg.dense_fusion_weight, cfg.covisit_fusion_weight = 1.0, 0.25, 2.0
    assert (cfg.fusion_weights(False), cfg.fusion_weights(True)) == ((0.5, 0.25, 2.0), (1.0, 0.25, 2.0))
    assert ModelConfig.from_dict(cfg.to_dict()).fusion_weights(True) == (1.0, 0.25, 2.0)


def test_recommend_ranks_by_the_weighted_sum(small):
    data, model = small
    from backend_src.data.sequences import eval_batches

    batch = next(eval_batches(data, "test", batch_size=8, max_len=model.cfg.max_seq_len))
    cache = model.encode(batch.items, batch.actions, batch.timestamps, batch.lengths)
    beams = model.retrieve(cache, DECODE)
    rank = model.rank(cache, beams.item_ids)
    # the dense head's log-softmax over all items, at each candidate
    dense = torch.log_softmax(model.dense_scores(cache.states[torch.arange(8), cache.lengths - 1]), -1)
    dense = dense.gather(1, beams.item_ids)
    seen = (beams.item_ids[:, :, None] == batch.items[:, None, :]).any(-1)
    covisit = model.covisit_scores(batch.items, beams.item_ids)
    assert covisit.shape == rank.shape and (covisit > 0).any()  # the table scores some candidates
    model.cfg.set_fusion_weights((0.3, 0.0, 0.0), (2.0, 0.75, 1.5))
    try:
        rec = model.recommend(cache, DECODE, top_k=5)
        # every beam, so that the list holds excluded (empty) slots too
        rec_excl = model.recommend(cache, DECODE, top_k=DECODE.beam_width, exclude_seen=True, history_items=batch.items)
    finally:
        model.cfg.set_fusion_weights((1.0, 0.0, 0.0), (1.0, 0.0, 0.0))
    excluded = fuse(rank, beams.log_probs, 2.0, dense, 0.75, covisit, 1.5).masked_fill(seen, float("-inf"))
    for got, expected in ((rec, fuse(rank, beams.log_probs, 0.3)), (rec_excl, excluded)):
        top = torch.topk(expected, got.items.shape[1], dim=1)
        torch.testing.assert_close(got.rank_scores, top.values)
        assert torch.equal(got.items, torch.gather(beams.item_ids, 1, top.indices).masked_fill(torch.isinf(top.values), 0))
        empty = got.items == 0  # an empty slot carries no log-probability and no semantic ID
        assert torch.isneginf(got.log_probs[empty]).all() and (got.codes[empty] == -1).all()
    assert (rec_excl.items == 0).any()  # the check above saw excluded slots


# ---- served_order: the one served order (model.recommend, the mfalcon_ranker model, evaluate)

INF = float("-inf")


def order(rank, lp, cands, history=None, **kw):
    kw = {"fusion_weight": 1.0, "rank_by": "fused", "exclude_seen": False, "top_k": 10, **kw}
    return served_order(torch.tensor(rank), torch.tensor(lp), torch.tensor(cands),
                        None if history is None else torch.tensor(history), **kw)


def test_served_order_fuses_and_sorts_best_first():
    items, scores, lp, pos = order([[1.0, 3.0, 2.0]], [[-1.0, -2.0, -0.5]], [[7, 8, 9]], fusion_weight=0.5, top_k=3)
    # 0.5 * rank + lp = [-0.5, -0.5, 0.5]: 9 first, then the tie 7, 8 in candidate order
    assert items.tolist() == [[9, 7, 8]] and pos.tolist() == [[2, 0, 1]]
    assert scores.tolist() == [[0.5, -0.5, -0.5]] and lp.tolist() == [[-0.5, -1.0, -2.0]]
    items, scores, _, _ = order([[1.0, 3.0, 2.0]], [[-1.0, -2.0, -0.5]], [[7, 8, 9]], rank_by="ranker", top_k=3)
    assert items.tolist() == [[8, 9, 7]] and scores.tolist() == [[3.0, 2.0, 1.0]]  # the logit alone
    with pytest.raises(ValueError, match="rank_by"):
        order([[1.0]], [[0.0]], [[1]], rank_by="retrieval")


def test_served_order_ties_keep_the_candidate_order():
    n = 40  # long enough that an unstable sort would shuffle some ties
    rank = torch.tensor([[1.0, 2.0] * (n // 2)])
    items, _, _, pos = served_order(rank, torch.zeros(1, n), torch.arange(1, n + 1)[None], rank_by="ranker", top_k=n)
    assert pos.tolist() == [list(range(1, n, 2)) + list(range(0, n, 2))]
    assert torch.equal(items, pos + 1)


def test_served_order_empty_and_unscored_candidates_become_empty_slots():
    # an empty beam (0) with a finite log-prob, a real item the ranker scores -inf, a NaN, and
    # weight 0 (0 * -inf is NaN, never a score): all four end up last as item 0 / -inf / -inf
    rank = [[2.0, 1.0, INF, float("nan"), 0.5]]
    lp = [[-1.0, -1.0, -1.0, -1.0, -2.0]]
    cands = [[4, 0, 5, 6, 7]]
    for w in (1.0, 0.0):
        items, scores, out_lp, _ = order(rank, lp, cands, fusion_weight=w, top_k=5)
        assert items.tolist() == [[4, 7, 0, 0, 0]]
        assert torch.isfinite(scores[0, :2]).all() and torch.isneginf(scores[0, 2:]).all()
        assert out_lp.tolist() == [[-1.0, -2.0, INF, INF, INF]]


def test_served_order_exclude_seen_removes_history_items():
    rank, lp, cands = [[3.0, 2.0, 1.0], [3.0, 2.0, 1.0]], [[0.0] * 3] * 2, [[5, 6, 7], [5, 6, 7]]
    history = [[6, 9, 0], [5, 0, 0]]  # padded with 0
    items, _, _, _ = order(rank, lp, cands, history, exclude_seen=True, top_k=3)
    assert items.tolist() == [[5, 7, 0], [6, 7, 0]]
    items, _, _, _ = order(rank, lp, cands, history, exclude_seen=False, top_k=3)
    assert items.tolist() == [[5, 6, 7], [5, 6, 7]]
    # one policy per row (the server batches requests of both)
    items, _, _, _ = order(rank, lp, cands, history, exclude_seen=torch.tensor([False, True]), top_k=3)
    assert items.tolist() == [[5, 6, 7], [6, 7, 0]]
    with pytest.raises(ValueError, match="history_items"):
        order(rank, lp, cands, None, exclude_seen=True)


def test_served_order_top_k_larger_than_the_candidates():
    items, scores, lp, pos = order([[1.0, INF, 2.0]], [[0.0, INF, 0.0]], [[3, 0, 4]], top_k=10)
    assert items.shape == scores.shape == lp.shape == pos.shape == (1, 3)  # every candidate, none invented
    assert items.tolist() == [[4, 3, 0]] and torch.isneginf(scores[0, 2])
    assert order([[1.0, 2.0]], [[0.0, 0.0]], [[3, 4]], top_k=1)[0].tolist() == [[4]]


def test_served_order_of_a_padded_batch_equals_each_request_alone():
    """The ranker model pads requests of different lengths into one batch, each with its own
    weight and seen-item policy; each request's first min(top_k, W) slots are its own order."""
    g = torch.Generator().manual_seed(0)
    reqs = []
    for w_len, excl, weight, dense_weight in ((6, False, 0.5, 0.0), (3, True, 2.0, 0.5), (5, True, 0.0, 1.0)):
        cands = torch.randint(1, 9, (w_len,), generator=g)
        cands[-1] = 0  # an empty beam
        rank = torch.randn(w_len, generator=g).round().masked_fill(cands == 0, INF)  # rounded: ties
        reqs.append((rank, torch.randn(w_len, generator=g).round(), cands, torch.randint(0, 9, (4,), generator=g), excl,
                     weight, torch.randn(w_len, generator=g).round(), dense_weight))
    pad = torch.nn.utils.rnn.pad_sequence
    batched = served_order(
        pad([r[0] for r in reqs], batch_first=True, padding_value=INF),
        pad([r[1] for r in reqs], batch_first=True, padding_value=INF),
        pad([r[2] for r in reqs], batch_first=True), torch.stack([r[3] for r in reqs]),
        fusion_weight=torch.tensor([[r[5]] for r in reqs]), rank_by="fused",
        dense_log_probs=pad([r[6] for r in reqs], batch_first=True, padding_value=INF),
        dense_weight=torch.tensor([[r[7]] for r in reqs]),
        exclude_seen=torch.tensor([r[4] for r in reqs]), top_k=5,
    )
    for b, (rank, lp, cands, hist, excl, weight, dense, dense_weight) in enumerate(reqs):
        alone = served_order(rank[None], lp[None], cands[None], hist[None], fusion_weight=weight, rank_by="fused",
                             dense_log_probs=dense[None], dense_weight=dense_weight, exclude_seen=excl, top_k=5)
        k = alone[0].shape[1]
        for got, want in zip(batched, alone):
            assert torch.equal(got[b, :k], want[0]), b


def test_tuning_picks_the_best_validation_weights(small):
    data, model = small
    weights = ((0.0, 0.0, 0.0), (0.5, 0.0, 2.0), (1.0, 0.5, 0.0), (3.0, 1.0, 1.0))
    best, tables = tune_fusion_weights(model, data, DECODE, weights=weights, progress=False)
    assert set(best) == set(tables) == {"seen_included", "seen_excluded"}
    for policy, table in tables.items():  # each policy's weight is chosen with that policy applied
        assert set(table) == set(weights)
        assert table[best[policy]]["ndcg@10"] == max(m["ndcg@10"] for m in table.values())
        assert all(0.0 <= m["ndcg@10"] <= 1.0 and not math.isnan(m["ndcg@10"]) for m in table.values())
