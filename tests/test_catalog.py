"""The living catalog on a loaded model (backend_src/model/catalog.py): items added with content get a
semantic ID from the version's own quantizer, a vector from their codes' embeddings and a row, and enter
the decoder's valid-prefix tables, the item table and the vocabulary; retired items are never generated
again; every stage's parts place an item alike; with no change the model answers as before."""
import numpy as np
import pytest
import torch

from backend_src.config import DecodeOptions, ModelConfig
from backend_src.model.catalog import ItemCatalog
from backend_src.model.recommender import STAGE_PARTS, GenerativeRecommender
from backend_src.model.semantic_ids import SemanticIdCodebook
from backend_src.serving.catalog_store import CatalogChange, CatalogEntry

NUM_ITEMS, E = 60, 8
FULL = DecodeOptions(mode="full", beam_width=64)


def _embeddings(n, seed):
    return torch.nn.functional.normalize(torch.randn(n, E, generator=torch.Generator().manual_seed(seed)), dim=-1)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A model whose semantic IDs were fit by residual k-means on content embeddings, trained with code
    embeddings (folded at save, the code table kept), written as a checkpoint and as each stage's part."""
    content = _embeddings(NUM_ITEMS, 0)
    codebook = SemanticIdCodebook.build(None, ModelConfig(num_items=NUM_ITEMS, codebook_sizes=(4, 4, 4, 1)),
                                        embeddings=content)
    cfg = ModelConfig(num_items=NUM_ITEMS, d_model=16, num_layers=1, num_heads=2, max_seq_len=16, dropout=0.0,
                      codebook_sizes=tuple(int(c) for c in codebook.codebook_sizes), decoder_heads=2,
                      code_embedding_levels=3, semantic_id_source="text-encoder",
                      node_output_sizes=(0,) + codebook.prefix_counts()[1:])
    torch.manual_seed(0)
    model = GenerativeRecommender(cfg, codebook, [None] + [f"i{i}" for i in range(1, NUM_ITEMS + 1)]).eval()
    tmp = tmp_path_factory.mktemp("catalog")
    model.save(tmp / "model.pt")
    whole = GenerativeRecommender.load(tmp / "model.pt")
    for stage in STAGE_PARTS:
        whole.save_stage(tmp / f"{stage}.pt", stage)
    return tmp, content


HISTORY = torch.arange(1, 6)[None]


def _history(model):
    return model.encode(HISTORY, torch.ones_like(HISTORY), 1000 + 60 * torch.arange(5)[None], torch.tensor([5]))


def Change(version, adds=(), retires=()):
    return CatalogChange(version, tuple(adds), tuple(retires), 0.0)


def CatalogItem(item_id, embedding, text):
    return CatalogEntry(item_id, {"text": text}, np.asarray(embedding, np.float32))


def _near(content, item, seed):
    """A new item's content next to trained item `item`'s."""
    noise = 0.01 * _embeddings(1, seed)[0]
    return (content[item - 1] + noise).numpy()


def test_no_change_answers_as_before_and_the_checkpoint_keeps_the_quantizer(checkpoint):
    tmp, _ = checkpoint
    model = GenerativeRecommender.load(tmp / "model.pt")
    assert model.codebook.has_quantizer and model.backbone.catalog_code_embedding.numel() > 0
    assert model.cfg.catalog_code_levels == 3 and model.cfg.code_embedding_levels == 0
    before = model.recommend(_history(model), FULL, top_k=10, history_items=HISTORY)
    catalog = ItemCatalog(model, capacity=20)
    catalog.apply([Change(1, retires=("not-an-item",))])  # a change that touches nothing the model has
    after = model.recommend(_history(model), FULL, top_k=10, history_items=HISTORY)
    assert torch.equal(before.items, after.items) and torch.allclose(before.rank_scores, after.rank_scores)


def test_an_added_item_is_placed_by_its_content_and_can_be_generated(checkpoint):
    tmp, content = checkpoint
    model = GenerativeRecommender.load(tmp / "model.pt")
    catalog = ItemCatalog(model, capacity=20)
    row0 = NUM_ITEMS + 2
    assert catalog.apply([Change(1, adds=(CatalogItem("new-a", _near(content, 7, 1), "h1"),
                                          CatalogItem("new-b", _near(content, 7, 2), "h2")))]) == 1
    codes = model.codebook.codes
    # the nearest centers: the trained neighbour's codes, then a collision code no item holds (the second
    # item, where the prefix has none left: the last level's next-nearest center)
    assert torch.equal(codes[row0, :2], codes[7, :2]) and torch.equal(codes[row0 + 1, :2], codes[7, :2])
    for row in (row0, row0 + 1):
        same = codes[1 : NUM_ITEMS + 1, :3].eq(codes[row, :3]).all(1)
        assert int(codes[row, 3]) not in set(codes[1 : NUM_ITEMS + 1][same, 3].tolist())
    assert int(codes[row0 + 1, 3]) < model.cfg.codebook_sizes[3]
    placed = torch.cat([codes[1 : NUM_ITEMS + 1], codes[row0 : row0 + 2]])
    assert len(torch.unique(placed, dim=0)) == NUM_ITEMS + 2  # every ID unique
    # the decoder's tables lead to the new rows; a full beam over every item generates them
    assert model.codebook.items_of_codes(codes[[row0, row0 + 1]]).tolist() == [row0, row0 + 1]
    beams = model.retrieve(_history(model), FULL)
    assert {row0, row0 + 1} <= set(beams.item_ids[0].tolist())
    # its vector: its codes' embeddings; the vocabulary maps its id; the dense head scores it
    want = model.backbone.code_vectors(codes[[row0]])
    assert torch.allclose(model.backbone.item_embedding.weight[row0], want[0])
    assert model.item_indices(["new-a", "i3", "never-seen"], strict=False).tolist() == [row0, 3, model.unknown_index]
    dense = model.dense_scores(_history(model).last_states())
    assert torch.isfinite(dense[0, row0]) and dense.shape[1] == row0 + 2
    rec = model.recommend(_history(model), FULL, top_k=NUM_ITEMS + 2, history_items=HISTORY)
    assert {row0, row0 + 1} <= set(rec.items[0].tolist())
    assert model.row_ids()[row0] == "new-a"


def test_retired_items_are_never_generated_and_histories_holding_them_still_encode(checkpoint):
    tmp, content = checkpoint
    model = GenerativeRecommender.load(tmp / "model.pt")
    catalog = ItemCatalog(model, capacity=5)
    history = _history(model)
    catalog.apply([Change(1, adds=(CatalogItem("new-a", _near(content, 3, 1), "h"),)),
                   Change(2, retires=("i3", "new-a", "i9"))])
    beams = model.retrieve(history, FULL)
    generated = set(beams.item_ids[0].tolist())
    assert generated.isdisjoint({3, 9, NUM_ITEMS + 2}) and len(generated - {0}) == NUM_ITEMS - 2
    rec = model.recommend(history, FULL, top_k=NUM_ITEMS, history_items=HISTORY)
    assert set(rec.items[0].tolist()).isdisjoint({3, 9, NUM_ITEMS + 2})
    dense = model.dense_scores(history.last_states())
    assert torch.isinf(dense[0, [3, 9, NUM_ITEMS + 2]]).all()
    # item 3 is in the history: it encodes with its own vector as before
    assert torch.allclose(_history(model).states, history.states)
    # back on sale: generated again, with its ID of before
    code_before = model.codebook.codes[NUM_ITEMS + 2].clone()
    catalog.apply([Change(3, adds=(CatalogItem("new-a", _near(content, 3, 1), "h"), CatalogItem("i3", np.zeros(E), "")))])
    assert torch.equal(model.codebook.codes[NUM_ITEMS + 2], code_before)
    assert {3, NUM_ITEMS + 2} <= set(model.retrieve(history, FULL).item_ids[0].tolist())


def test_every_stage_places_items_alike_and_capacity_is_a_clear_error(checkpoint):
    tmp, content = checkpoint
    changes = [Change(1, adds=tuple(CatalogItem(f"n{j}", _near(content, 1 + j % 7, j), f"h{j}") for j in range(6))),
               Change(2, retires=("n2",)), Change(3, adds=(CatalogItem("n2", _near(content, 40, 99), "other"),))]
    placed = []
    for stage in STAGE_PARTS:
        model = GenerativeRecommender.load(tmp / f"{stage}.pt")
        catalog = ItemCatalog(model, capacity=8)
        assert catalog.apply(changes) == 3
        placed.append((catalog.codes[: catalog.rows_in_use].clone(), catalog.live.clone(), dict(catalog.row_of)))
        assert model.item_indices(["n5"]).tolist() == [NUM_ITEMS + 2 + 5]
    for codes, live, rows in placed[1:]:
        assert torch.equal(codes, placed[0][0]) and torch.equal(live, placed[0][1]) and rows == placed[0][2]
    # replay never stops at an item it cannot place (here: no row left): every stage leaves the same ones out
    model = GenerativeRecommender.load(tmp / "decoder.pt")
    catalog = ItemCatalog(model, capacity=2)
    assert catalog.apply(changes[:1]) == 1 and catalog.ids == ["n0", "n1"]
    assert sorted(catalog.unplaced) == ["n2", "n3", "n4", "n5"] and catalog.rows_in_use == NUM_ITEMS + 4
    assert catalog.unplaceable(np.stack([_near(content, 1, 7)])) == []  # an ID is free; a row is not (the caller's check)
    with pytest.raises(ValueError, match="missing"):
        catalog.apply(changes[2:])


def test_an_item_with_no_free_semantic_id_near_its_content_is_left_out_alike_everywhere(checkpoint):
    """Items whose nearest prefixes are all full are not placed (the catalog model refuses them before it commits:
    unplaceable), and replaying such a change still reaches its version."""
    tmp, content = checkpoint
    crowd = tuple(CatalogItem(f"c{j}", _near(content, 3, j), f"h{j}") for j in range(200))
    model = GenerativeRecommender.load(tmp / "model.pt")
    catalog = ItemCatalog(model, capacity=300)
    dry = catalog.unplaceable(np.stack([np.asarray(i.embedding) for i in crowd]))
    assert dry and catalog.version == 0 and not catalog.ids  # the dry run changes nothing
    assert catalog.apply([Change(1, adds=crowd)]) == 1
    assert sorted(catalog.unplaced) == sorted(f"c{j}" for j in dry) and len(catalog.ids) == 200 - len(dry)
    placed = catalog.codes[catalog.first_row : catalog.rows_in_use]
    assert len(torch.unique(torch.cat([catalog.codes[1 : NUM_ITEMS + 1], placed]), dim=0)) == NUM_ITEMS + len(placed)


def test_added_items_nearest_in_content_join_the_candidates(checkpoint):
    """A beam too narrow to reach an added item: the served order still puts the added items nearest in
    content to the user's last items among the candidates, scored with the content weight; with no item
    added the order is as before."""
    tmp, content = checkpoint
    narrow = DecodeOptions(mode="full", beam_width=4)
    model = GenerativeRecommender.load(tmp / "model.pt")
    model.cfg.catalog_candidates, model.cfg.catalog_content_weight = 2, 50.0
    history = _history(model)
    before = model.recommend(history, narrow, top_k=4, history_items=HISTORY)
    catalog = ItemCatalog(model, capacity=5)
    near_last = _near(content, 5, 1)  # next to the history's last item
    catalog.apply([Change(1, adds=(CatalogItem("near", near_last, "a"), CatalogItem("far", -near_last, "b")))])
    assert NUM_ITEMS + 2 not in model.retrieve(history, narrow).item_ids[0].tolist()
    rec = model.recommend(history, narrow, top_k=6, history_items=HISTORY)
    items = rec.items[0].tolist()
    assert items[0] == NUM_ITEMS + 2 and NUM_ITEMS + 3 in items  # both added candidates; the near one first
    assert torch.equal(rec.codes[0, 0], model.codebook.codes[NUM_ITEMS + 2])
    # trained candidates keep their order and scores
    trained = [i for i in items if i <= NUM_ITEMS]
    assert trained == [i for i in before.items[0].tolist() if i in trained]
