"""The co-visitation expert: its counts and scores against a direct count, and its table through
checkpoints and the ranker stage's artifact."""
import math

import numpy as np
import pytest
import torch

from backend_src.config import ModelConfig
from backend_src.data.sequences import training_events
from backend_src.data.synthetic import generate_synthetic
from backend_src.model.covisitation import DECAY, CoVisitation
from backend_src.model.recommender import GenerativeRecommender
from backend_src.training import build_model


def direct_scores(users: list[list[int]], window: int, history: list[int], candidates: list[int]) -> list[float]:
    """covisit(history, c) by its definition, one pair at a time."""
    counts = {}
    for events in users:
        for i, a in enumerate(events):
            for g in range(1, window + 1):
                if i + g < len(events):
                    counts[a, events[i + g]] = counts.get((a, events[i + g]), 0.0) + DECAY ** (g - 1)
    recent = history[::-1][:window]  # h_n, h_{n-1}, ...
    return [math.log1p(sum(DECAY ** g * counts.get((a, c), 0.0) for g, a in enumerate(recent))) for c in candidates]


@pytest.mark.parametrize("backend", ["auto", "torch"])  # the compiled CPU kernel (where numba imports), the composition
def test_scores_equal_a_direct_count(monkeypatch, backend):
    monkeypatch.setenv("GENREC_OPS_BACKEND", backend)
    rng = np.random.default_rng(0)
    users = [list(rng.integers(1, 9, size=rng.integers(1, 12))) for _ in range(40)]
    offsets = np.concatenate([[0], np.cumsum([len(u) for u in users])])
    table = CoVisitation(num_items=8, window=3).fit(offsets, np.concatenate(users))
    histories = [[3], [1, 2, 3, 4, 5], [], [7, 7]]
    candidates = torch.tensor([[1, 2, 3, 0], [5, 6, 7, 8], [1, 2, 3, 4], [7, 1, 0, 2]])
    padded = torch.zeros(len(histories), 5, dtype=torch.long)  # each row's events first, 0 after
    for b, h in enumerate(histories):
        padded[b, :len(h)] = torch.tensor(h, dtype=torch.long)
    got = table.scores(padded, candidates)
    want = torch.tensor([direct_scores(users, 3, h, c) for h, c in zip(histories, candidates.tolist())])
    torch.testing.assert_close(got, want.float())
    assert (got[candidates == 0] == 0).all()  # an empty slot, and no history, score 0
    assert (got[2] == 0).all() and (got > 0).any()


def test_a_user_never_pairs_with_the_next_user():
    table = CoVisitation(num_items=4, window=2).fit(np.array([0, 2, 4]), np.array([1, 2, 3, 4]))
    assert table.scores(torch.tensor([[2]]), torch.tensor([[3]])).item() == 0.0  # 2 ends user 0, 3 starts user 1
    assert table.scores(torch.tensor([[1]]), torch.tensor([[2]])).item() == pytest.approx(math.log1p(1.0))


def test_the_table_counts_training_events_only_and_travels_with_the_ranker(tmp_path):
    data = generate_synthetic(num_users=30, num_items=40, seed=1)
    cfg = ModelConfig(num_items=data.num_items, d_model=16, num_layers=1, num_heads=2, max_seq_len=16,
                      codebook_sizes=(4, 4, 4, 1), dropout=0.0, covisit_window=2)
    model = build_model(data, cfg, embedding_dim=8)
    for end_offset in (1, 2):  # the final fit's events, and the validation run's
        expected = CoVisitation(data.num_items, 2).fit(*training_events(data, end_offset))
        built = build_model(data, cfg, embedding_dim=8, end_offset=end_offset).covisitation
        assert torch.equal(built.pair_keys, expected.pair_keys) and torch.equal(built.pair_weights, expected.pair_weights)
    ckpt, stage = tmp_path / "model.pt", tmp_path / "ranker.pt"
    model.save(ckpt)
    GenerativeRecommender.load(ckpt).save_stage(stage, "ranker")
    history, candidates = torch.tensor([[3, 5, 7, 0]]), torch.arange(1, data.num_items + 1)[None]
    for path in (ckpt, stage):
        loaded = GenerativeRecommender.load(path)
        assert loaded.covisitation.pairs == model.covisitation.pairs > 0
        assert torch.equal(loaded.covisit_scores(history, candidates), model.covisit_scores(history, candidates))
    assert GenerativeRecommender.load(tmp_path / "model.pt").covisit_scores(history, candidates).gt(0).any()
    # a model without the expert has no table and scores nothing
    plain = build_model(data, ModelConfig(num_items=data.num_items, d_model=16, num_layers=1, num_heads=2,
                                          max_seq_len=16, codebook_sizes=(4, 4, 4, 1)), embedding_dim=8)
    assert plain.covisitation is None and plain.covisit_scores(history, candidates) is None
    assert not any(k.startswith("covisitation.") for k in plain.state_dict())
