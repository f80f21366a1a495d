"""Semantic-ID code embeddings (HSTUEncoder.item_vectors): while training, an item's vector adds
the embeddings of its codes; a written checkpoint holds them folded into the item table, and the
model it loads scores exactly as the training model did."""
import dataclasses

import pytest
import torch

from backend_src.config import DecodeOptions
from backend_src.model.recommender import GenerativeRecommender


def _model(levels=2, seed=0, node_output=False):
    base = GenerativeRecommender.untrained([None] + [f"i{j}" for j in range(40)], max_history=16, seed=seed,
                                           levels=3, codes_per_level=4)
    cfg = dataclasses.replace(base.cfg, code_embedding_levels=levels, node_output=node_output)
    torch.manual_seed(seed)
    model = GenerativeRecommender(cfg, base.codebook, list(base.item_ids))
    with torch.no_grad():  # code embeddings that matter (they start small)
        model.backbone.code_embedding.weight[:-1].normal_(0, 0.5)
    return model.eval()


def _history(B=3, N=9, seed=1):
    g = torch.Generator().manual_seed(seed)
    items = torch.randint(1, 41, (B, N), generator=g)
    ts = torch.cumsum(torch.randint(1, 5000, (B, N), generator=g), 1)
    lengths = torch.tensor([N, 5, 1])[:B]
    return items, torch.ones_like(items), ts, lengths


def _outputs(model):
    items, actions, ts, lengths = _history()
    with torch.no_grad():
        cache = model.encode(items, actions, ts, lengths)
        cands = torch.arange(1, 41).expand(3, 40)
        return cache.states, model.rank(cache, cands), model.dense_scores(cache.states[:, 0]), \
            model.recommend(cache, DecodeOptions(mode="full", beam_width=5)).items


def test_items_sharing_codes_share_vectors():
    model = _model(levels=2)
    bb = model.backbone
    codes = model.codebook.codes
    assert torch.equal(bb.item_vectors(torch.tensor([0])), torch.zeros(1, bb.cfg.d_model))  # padding
    a, b = 1, next(j for j in range(2, 41) if torch.equal(codes[j, :2], codes[1, :2]))
    with torch.no_grad():
        bb.item_embedding.weight.zero_()
    assert torch.equal(bb.item_vectors(torch.tensor(a)), bb.item_vectors(torch.tensor(b)))
    assert torch.allclose(bb.item_table()[[a, b]], bb.item_vectors(torch.tensor([a, b])))


def test_checkpoint_folds_code_embeddings(tmp_path):
    model = _model(levels=2)
    before = _outputs(model)
    model.save(tmp_path / "m.pt")
    loaded = GenerativeRecommender.load(tmp_path / "m.pt")
    assert loaded.cfg.code_embedding_levels == 0 and loaded.backbone.code_embedding is None
    assert not any("code_embedding" in k or "item_code_rows" in k for k in loaded.state_dict())
    after = _outputs(loaded)
    for x, y in zip(before[:3], after[:3]):
        assert torch.allclose(x, y, atol=1e-5), (x - y).abs().max()
    assert torch.equal(before[3], after[3])
    # a training state keeps them apart, to resume from
    model.save(tmp_path / "s.pt", fold_codes=False)
    state = GenerativeRecommender.load(tmp_path / "s.pt")
    assert state.cfg.code_embedding_levels == 2
    assert torch.equal(state.backbone.item_code_rows, model.backbone.item_code_rows)
    assert torch.equal(_outputs(state)[1], before[1])
    with pytest.raises(ValueError, match="folded"):
        model.save_stage(tmp_path / "enc.pt", "encoder")


def test_code_embeddings_change_the_model():
    """The codes' part is not a no-op: without it the same weights score otherwise."""
    model = _model(levels=2)
    with_codes = _outputs(model)[1]
    with torch.no_grad():
        model.backbone.code_embedding.weight.zero_()
    assert not torch.allclose(_outputs(model)[1], with_codes)


def test_node_output_tied_to_the_item_table(tmp_path):
    """The decoder's node output (SemanticIdDecoder): step t >= 1 scores a code by the mean item
    vector under the prefix it makes, read off the item table with its code embeddings, cached while
    the weights stay, and a checkpoint (codes folded) decodes exactly as the training model."""
    model = _model(levels=2, node_output=True)
    cb, table = model.codebook, model.backbone.item_table()
    with torch.no_grad():
        tables = model.node_tables()
        assert tables[0] is None and len(tables) == cb.num_levels
        prefixes = cb.level_prefixes(cb.codes[1:])
        for t in range(1, cb.num_levels):
            assert tables[t].shape == (cb.prefix_counts()[t] + 1, table.shape[1]) and not tables[t][-1].any()
            for p in prefixes[:, t + 1].unique()[:5].tolist():
                under = 1 + torch.nonzero(prefixes[:, t + 1] == p)[:, 0]
                assert torch.allclose(tables[t][p], table[under].mean(0), atol=1e-6)
        assert model.node_tables() is tables  # cached
        before = _outputs(model)
        model.backbone.item_embedding.weight.mul_(2.0)  # a changed table is read again
        assert not torch.allclose(model.node_tables()[1], tables[1])
        model.backbone.item_embedding.weight.mul_(0.5)
    assert not torch.equal(before[3], _outputs(_model(levels=2))[3])  # the node term changes the decode
    model.save(tmp_path / "m.pt")
    loaded = GenerativeRecommender.load(tmp_path / "m.pt")
    assert loaded.cfg.node_output
    assert torch.equal(_outputs(loaded)[3], before[3])
    with torch.no_grad():
        assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(loaded.node_tables()[1:], tables[1:]))
