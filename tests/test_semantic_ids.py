"""Semantic IDs: residual k-means, collision codes, embeddings and the valid-prefix codebook."""
import io
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from backend_src.model.kmeans import balanced_assign, kmeans
from backend_src.model.semantic_ids import (
    SemanticIdCodebook,
    assign_collision_codes,
    build_item_embeddings,
    collaborative_embeddings,
    residual_kmeans,
    text_embeddings,
)


def _blobs(n=300, d=8, centers=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    c = torch.randn(centers, d, generator=g) * 5
    return c[torch.randint(centers, (n,), generator=g)] + 0.1 * torch.randn(n, d, generator=g)


def test_kmeans_recovers_blobs():
    x = _blobs()
    assign, centers = kmeans(x, 6, iters=30, seed=1)
    # points of a blob share a cluster: within-cluster spread is the noise level
    resid = (x - centers[assign]).norm(dim=1)
    assert resid.max() < 1.0


def test_kmeans_more_clusters_than_points_and_duplicates():
    x = torch.zeros(5, 3)  # identical points
    assign, centers = kmeans(x, 256, iters=5)
    assert centers.shape[0] == 5 and assign.shape == (5,)
    codes = residual_kmeans(torch.randn(7, 4), sizes=(16, 16, 16), iters=5)
    assert codes.shape == (7, 3) and int(codes.max()) < 7 and int(codes.min()) >= 0


def test_residual_kmeans_and_collision_codes_unique():
    x = _blobs(400, 8, 5)
    codes3 = residual_kmeans(x, sizes=(4, 4, 4), iters=10, seed=0)
    assert codes3.shape == (400, 3)
    assert all(int(codes3[:, level].max()) < 4 for level in range(3))
    codes = assign_collision_codes(codes3)
    assert codes.shape == (400, 4)
    assert torch.equal(codes[:, :3], codes3)
    assert len({tuple(r) for r in codes.tolist()}) == 400
    # the last code counts 0, 1, 2, ... inside every group of equal first codes, in item order
    for key in {tuple(r) for r in codes3.tolist()}:
        rows = (codes3 == torch.tensor(key)).all(1).nonzero().flatten()
        assert codes[rows, 3].tolist() == list(range(len(rows)))


def test_balanced_assignment_caps_every_cluster():
    g = torch.Generator().manual_seed(0)
    d = torch.rand(500, 7, generator=g)
    d[:, 3] -= 1.0  # every point's nearest cluster is 3
    assign = balanced_assign(d, 72)  # 7 * 72 >= 500
    counts = torch.bincount(assign, minlength=7)
    assert int(counts.max()) <= 72 and int(counts.sum()) == 500
    # cluster 3 keeps the 72 points closest to it
    assert set((assign == 3).nonzero().flatten().tolist()) == set(torch.topk(-d[:, 3], 72).indices.tolist())
    assert torch.equal(balanced_assign(d, 500), d.argmin(1))  # room for all: the nearest cluster
    with pytest.raises(ValueError):
        balanced_assign(d, 71)
    x = _blobs(300, 8, 3)  # 3 blobs of about 100 points, 6 codes: each code at most 50
    codes = residual_kmeans(x, sizes=(6, 6), iters=10, balanced=True)
    assert all(int(torch.bincount(codes[:, level]).max()) <= 50 for level in range(2))


def _random_codes(n=80, sizes=(4, 3, 3), seed=0):
    g = torch.Generator().manual_seed(seed)
    codes3 = torch.stack([torch.randint(c, (n,), generator=g) for c in sizes], 1)
    return assign_collision_codes(codes3)


def test_codebook_tables_consistent_with_codes():
    codes = _random_codes()
    cb = SemanticIdCodebook.from_codes(codes)
    n = codes.shape[0]
    assert cb.num_items == n
    assert (cb.codes[0] < 0).all() and torch.equal(cb.codes[1:], codes)
    assert cb.codebook_sizes == tuple(int(codes[:, t].max()) + 1 for t in range(4))
    # walking every item's codes reaches that item
    assert torch.equal(cb.items_of_codes(codes), torch.arange(1, n + 1))
    # valid_mask at every level equals the set of continuations of existing prefixes
    prefix = torch.zeros(n, dtype=torch.long)
    for t in range(4):
        mask = cb.valid_mask(prefix, t)  # [n, C_t]
        for i in range(n):
            expected = {tuple(r[t:t + 1]) for r in codes.tolist() if r[:t] == codes[i, :t].tolist()}
            got = {(c,) for c in mask[i].nonzero().flatten().tolist()}
            assert got == expected
        prefix = cb.advance(prefix, codes[:, t], t)
        assert (prefix >= 0).all()
    assert torch.equal(cb.items_of(prefix), torch.arange(1, n + 1))
    # invalid continuations and dead prefixes
    dead = torch.tensor([-1, -1])
    assert not cb.valid_mask(dead, 0).any()
    assert (cb.advance(dead, torch.tensor([0, 1]), 0) == -1).all()
    assert cb.items_of(torch.tensor([-1])).item() == 0
    root = torch.zeros(1, dtype=torch.long)
    missing = (~cb.valid_mask(root, 0)).nonzero()
    if len(missing):
        assert cb.advance(root, missing[0, 1:], 0).item() == -1
    bogus = codes[:1].clone()
    bogus[0, 3] = cb.codebook_sizes[3] + 5  # out of range code
    assert cb.items_of_codes(bogus).item() == 0


def test_codebook_state_dict_round_trip():
    cb = SemanticIdCodebook.from_codes(_random_codes(50))
    buf = io.BytesIO()
    torch.save(cb.state_dict(), buf)
    buf.seek(0)
    loaded = SemanticIdCodebook()  # empty placeholder adopts the stored shapes
    loaded.load_state_dict(torch.load(buf))
    for name, b in cb.named_buffers():
        assert torch.equal(b, dict(loaded.named_buffers())[name])
    assert loaded.codebook_sizes == cb.codebook_sizes
    assert torch.equal(loaded.items_of_codes(cb.codes[1:]), torch.arange(1, 51))
    # from_codes accepts the padded [I+1, 4] layout too
    again = SemanticIdCodebook.from_codes(cb.codes)
    assert torch.equal(again.codes, cb.codes)


def test_duplicate_ids_rejected():
    with pytest.raises(ValueError):
        SemanticIdCodebook(torch.zeros(3, 4, dtype=torch.long))


def test_text_embeddings_similarity():
    texts = ["space war robots", "robots in space war", "romantic comedy paris", "comedy romance in paris", ""]
    e = text_embeddings(texts, dim=4)
    assert e.shape == (5, 4)
    e = e / e.norm(dim=1, keepdim=True).clamp_min(1e-9)
    assert e[0] @ e[1] > e[0] @ e[2]
    assert e[2] @ e[3] > e[2] @ e[1]


def test_text_encoder_embeddings_follow_meaning_not_words():
    """The pretrained sentence encoder ties texts that mean the same with no word in common, which
    TF-IDF cannot; as a source of item embeddings it is the encoder's unit vectors (plus jitter)."""
    pytest.importorskip("transformers")
    from backend_src.model.text_encoder import sentence_embeddings

    texts = ["digital caliper for measuring thickness", "micrometer gauge to measure how thick something is",
             "nitrile lab gloves, powder free", "disposable rubber hand protection for the laboratory", ""]
    e = sentence_embeddings(texts, batch_size=2)  # several batches, sorted by length
    assert e.shape == (5, 384) and torch.allclose(e.norm(dim=1), torch.ones(5), atol=1e-5)
    sim = e @ e.T
    assert sim[0, 1] > sim[0, 2] + 0.2 and sim[0, 1] > sim[0, 3] + 0.2
    assert sim[2, 3] > sim[2, 0] + 0.2 and sim[2, 3] > sim[2, 1] + 0.2
    assert torch.allclose(sentence_embeddings(texts[:1]), e[:1], atol=1e-5)  # batching changes nothing
    data = SimpleNamespace(**{**vars(_toy_sequences()), "num_items": 5, "item_text": dict(enumerate(texts, 1))})
    emb = build_item_embeddings(data, sources="text-encoder")
    assert emb.shape == (5, 384) and torch.allclose(emb, e, atol=1e-2)
    # the catalog model runs the encoder in a process of its own (the same embeddings)
    from backend_src.model.text_encoder import embed_in_subprocess
    from backend_src.results import REPO_ROOT

    assert torch.allclose(embed_in_subprocess(texts[:2], sys.executable, REPO_ROOT), e[:2], atol=1e-5)


def _toy_sequences():
    # items 1..3 co-occur, items 4..6 co-occur
    seqs = [[1, 2, 3, 1, 2], [4, 5, 6, 5], [2, 3, 1], [6, 4, 5, 4]]
    offsets = np.cumsum([0] + [len(s) for s in seqs])
    items = np.concatenate(seqs)
    return SimpleNamespace(
        offsets=offsets, lengths=np.diff(offsets), items=items, actions=np.zeros_like(items),
        timestamps=np.zeros_like(items), num_items=6, item_text=None, item_attributes=None,
    )


def test_collaborative_embeddings_groups_co_occurring_items():
    data = _toy_sequences()
    e = collaborative_embeddings(data.offsets, data.items, 6, dim=4, window=2)
    assert e.shape == (6, 4)
    e = e / e.norm(dim=1, keepdim=True).clamp_min(1e-9)
    sim = e @ e.T
    assert sim[0, 1] > sim[0, 4] and sim[3, 4] > sim[3, 1]


@pytest.mark.parametrize("sources", ["collaborative", "sequential"])
@pytest.mark.parametrize("end_offset", [2, 1])
def test_item_embeddings_never_see_validation_or_test_events(end_offset, sources):
    """The tokenizer is fit before training: each user's last end_offset events (2: the
    validation and test targets; 1: a refit's test target) must not move the collaborative or
    sequential embeddings, while the earlier events do."""
    data = _toy_sequences()
    build = lambda d: build_item_embeddings(d, dim=4, end_offset=end_offset, sources=sources)  # noqa: E731
    base = build(data)
    held_out = np.concatenate([np.arange(e - end_offset, e) for e in data.offsets[1:]])
    changed = SimpleNamespace(**vars(data))
    changed.items = data.items.copy()
    changed.items[held_out] = 7 - changed.items[held_out]  # other items in the targets' place
    assert torch.equal(build(changed), base)
    trained = 0 if end_offset == 2 else data.offsets[1] - 2  # a training event (for the refit: a validation target)
    changed.items[trained] = 7 - changed.items[trained]
    assert not torch.equal(build(changed), base)


def test_build_item_embeddings_and_codebook_build():
    data = _toy_sequences()
    e = build_item_embeddings(data, dim=4)
    assert e.shape == (6, 4)
    data.item_attributes = {1: [10, 11], 2: [10], 4: [12], 6: [12, 13]}
    assert build_item_embeddings(data, dim=4).shape == (6, 8)
    data.item_text = {i: f"item number {i} {'red' if i < 4 else 'blue'}" for i in range(1, 7)}
    cb = SemanticIdCodebook.build(data, SimpleNamespace(codebook_sizes=(2, 2, 2, 1)), dim=4, iters=5)
    assert cb.num_items == 6
    # text where it exists (auto), or beside the co-occurrence embeddings, each half the weight
    data.item_attributes = None
    text, collab = (build_item_embeddings(data, dim=4, sources=s) for s in ("text", "collaborative"))
    assert torch.equal(build_item_embeddings(data, dim=4), text)
    both = build_item_embeddings(data, dim=4, sources="text+collaborative")
    assert torch.allclose(both, torch.cat([text, collab], 1) / 2**0.5, atol=1e-3)
    with pytest.raises(ValueError, match="no item text"):
        build_item_embeddings(SimpleNamespace(**{**vars(data), "item_text": None}), dim=4, sources="text")
    assert len({tuple(r) for r in cb.codes[1:].tolist()}) == 6
    assert torch.equal(cb.items_of_codes(cb.codes[1:]), torch.arange(1, 7))
