"""Semantic-ID code embeddings (HSTUEncoder.item_vectors): while training, an item's vector adds
the embeddings of its codes; a written checkpoint holds them folded into the item table, and the
model it loads scores exactly as the training model did."""
import dataclasses

import pytest
import torch

from backend_src.config import DecodeOptions
from backend_src.model.recommender import GenerativeRecommender


def _model(levels=2, seed=0):
    base = GenerativeRecommender.untrained([None] + [f"i{j}" for j in range(40)], max_history=16, seed=seed,
                                           levels=3, codes_per_level=4)
    cfg = dataclasses.replace(base.cfg, code_embedding_levels=levels)
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
    assert not any(k.endswith(("backbone.code_embedding.weight", "item_code_rows")) for k in loaded.state_dict())
    # the code embeddings stay beside the folded table: an item added to the catalog is built from its codes'
    assert loaded.cfg.catalog_code_levels == 2
    assert torch.equal(loaded.backbone.catalog_code_embedding, model.backbone.code_embedding.weight.detach())
    codes = model.codebook.codes[1:4]
    assert torch.allclose(loaded.backbone.code_vectors(codes), model.backbone.code_vectors(codes))
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


def test_node_output_survives_the_checkpoint(tmp_path):
    """A model with the decoder's node output (a learned vector per prefix of steps 1..L-1) writes
    and loads them with its configuration, and the loaded model decodes exactly as it did."""
    base = _model(levels=2)
    counts = base.codebook.prefix_counts()
    cfg = dataclasses.replace(base.cfg, node_output_sizes=(0,) + counts[1:])
    torch.manual_seed(0)
    model = GenerativeRecommender(cfg, base.codebook, list(base.item_ids)).eval()
    assert sorted(model.decoder.node_emb) == [str(t) for t in range(1, len(counts))]
    with torch.no_grad():
        for e in model.decoder.node_emb.values():
            e.weight[:-1].normal_(0, 1.0)
    before = _outputs(model)
    model.save(tmp_path / "m.pt")
    loaded = GenerativeRecommender.load(tmp_path / "m.pt")
    assert loaded.cfg.node_output_sizes == cfg.node_output_sizes
    assert torch.equal(_outputs(loaded)[3], before[3])
