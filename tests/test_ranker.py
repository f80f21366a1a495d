"""M-FALCON ranker: the mask gives each candidate exactly the state it would get appended alone."""
from __future__ import annotations

import pytest
import torch

from backend_src.model.hstu import HistoryCache
from backend_src.model.ranker import RANK_ACTION, MFalconRanker

from hstu_helpers import make_batch, make_encoder, tiny_config  # noqa: E402

ATOL = 1e-5


@pytest.fixture(scope="module")
def setup():
    cfg = tiny_config()
    enc = make_encoder(cfg, seed=5)
    torch.manual_seed(6)
    ranker = MFalconRanker(enc, cfg).eval()
    batch = make_batch([10, 1, 25, 0, 40], seed=21)
    with torch.no_grad():
        cache = enc(*batch)
    g = torch.Generator().manual_seed(22)
    candidates = torch.randint(1, cfg.num_items + 1, (5, 11), generator=g)
    return cfg, enc, ranker, batch, cache, candidates


def append_candidate(batch, cand):
    """The history with one candidate token appended at row lengths[b] (slow reference input)."""
    items, actions, ts, lengths = batch
    B, N = items.shape
    pad = lambda x: torch.cat([x, torch.zeros(B, 1, dtype=x.dtype)], 1)  # noqa: E731
    items, actions, ts = pad(items), pad(actions), pad(ts)
    rows = torch.arange(B)
    last_ts = torch.where(lengths > 0, ts[rows, (lengths - 1).clamp(min=0)], torch.zeros_like(lengths))
    items[rows, lengths] = cand
    actions[rows, lengths] = RANK_ACTION
    ts[rows, lengths] = last_ts
    return items, actions, ts, lengths + 1


def test_scores_equal_candidates_alone(setup):
    _, _, ranker, _, cache, cands = setup
    with torch.no_grad():
        together = ranker.score(cache, cands, microbatch_size=64)
        alone = torch.cat([ranker.score(cache, cands[:, j : j + 1], microbatch_size=1) for j in range(cands.shape[1])], 1)
    assert together.shape == cands.shape
    torch.testing.assert_close(together, alone, atol=ATOL, rtol=0)


@pytest.mark.parametrize("bm", [1, 3, 7, 11, 1000])
def test_microbatch_size_and_permutation_invariance(setup, bm):
    _, _, ranker, _, cache, cands = setup
    perm = torch.randperm(cands.shape[1], generator=torch.Generator().manual_seed(bm))
    with torch.no_grad():
        ref = ranker.score(cache, cands, microbatch_size=64)
        got = ranker.score(cache, cands[:, perm], microbatch_size=bm)
    torch.testing.assert_close(got, ref[:, perm], atol=ATOL, rtol=0)


def test_equals_causal_forward_with_candidate_appended(setup):
    """The candidate's final state equals the plain causal encode of history + candidate."""
    cfg, enc, ranker, batch, cache, cands = setup
    with torch.no_grad():
        states = ranker.candidate_states(
            cache, cands, cache.lengths, append_candidate(batch, torch.zeros(5, dtype=torch.long))[2][
                torch.arange(5), cache.lengths
            ], microbatch_size=4,
        )
        scores = ranker.score(cache, cands, microbatch_size=4)
        for j in range(cands.shape[1]):
            ext = append_candidate(batch, cands[:, j])
            full = enc(*ext)
            ref_state = full.states[torch.arange(5), cache.lengths]  # [B, D]
            torch.testing.assert_close(states[:, j], ref_state, atol=ATOL, rtol=0)
            ref_score = ranker.head_logits(ref_state[:, None], cands[:, j : j + 1])[:, 0]
            torch.testing.assert_close(scores[:, j], ref_score, atol=ATOL, rtol=0)


def test_mask_matters(setup):
    """Sanity: without the M-FALCON mask (plain causal among candidates) scores would differ."""
    _, _, ranker, _, cache, cands = setup
    with torch.no_grad():
        a = ranker.score(cache, cands, microbatch_size=64)
        b = ranker.score(cache, cands.roll(1, dims=0), microbatch_size=64)  # other users' candidates
    assert (a - b).abs().max() > 1e-3


def test_history_is_never_reencoded(setup, monkeypatch):
    _, enc, ranker, _, cache, cands = setup
    calls = []
    for name in ("forward", "append"):
        orig = getattr(enc, name)
        monkeypatch.setattr(enc, name, lambda *a, _o=orig, _n=name, **k: calls.append(_n) or _o(*a, **k))
    before = cache.clone()
    ptrs = [cache.keys.data_ptr(), cache.values.data_ptr(), cache.states.data_ptr()]
    with torch.no_grad():
        ranker.score(cache, cands, microbatch_size=3)
    assert calls == []
    assert ptrs == [cache.keys.data_ptr(), cache.values.data_ptr(), cache.states.data_ptr()]
    for name in ("keys", "values", "states", "timestamps", "lengths"):
        assert torch.equal(getattr(cache, name), getattr(before, name)), name


def test_padding_candidates_get_minus_inf(setup):
    _, _, ranker, _, cache, cands = setup
    c = cands.clone()
    c[:, -3:] = 0
    with torch.no_grad():
        s = ranker.score(cache, c, microbatch_size=4)
        ref = ranker.score(cache, cands[:, :-3], microbatch_size=4)
    assert torch.isneginf(s[:, -3:]).all()
    torch.testing.assert_close(s[:, :-3], ref, atol=ATOL, rtol=0)


def test_works_on_batched_single_user_caches(setup):
    """Serving batches per-user caches of different lengths; scores must not change."""
    _, _, ranker, _, cache, cands = setup
    with torch.no_grad():
        ref = ranker.score(cache, cands)
        batched = HistoryCache.cat(cache.split())
        got = ranker.score(batched, cands)
    torch.testing.assert_close(got, ref, atol=ATOL, rtol=0)


def test_training_loss_matches_prefix_scoring(setup):
    """Training candidates at positions[b] see exactly the prefix rows <= positions[b]."""
    cfg, enc, ranker, batch, cache, _ = setup
    items, actions, ts, lengths = batch
    keep = torch.tensor([0, 1, 1, 1, 1]).bool()  # user 3 has an empty history
    positions = torch.tensor([4, 0, 24, 0, 17])
    g = torch.Generator().manual_seed(23)
    positives = torch.randint(1, cfg.num_items + 1, (5,), generator=g)
    negatives = torch.randint(1, cfg.num_items + 1, (5, 6), generator=g)
    positives[0] = 0  # skipped user
    negatives[:, 2] = positives  # a sampled negative equal to the positive is masked
    with torch.no_grad():
        loss = ranker.training_loss(cache, positions, positives, negatives)
        prefix = enc(items, actions, ts, torch.minimum(positions + 1, lengths))
        logits = ranker.score(prefix, torch.cat([positives[:, None], negatives], 1))
    logits[:, 1:][negatives == positives[:, None]] = float("-inf")
    assert torch.isneginf(logits[:, 3]).all()
    ref = torch.nn.functional.cross_entropy(logits[keep & (lengths > 0)], torch.zeros(3, dtype=torch.long))
    torch.testing.assert_close(loss, ref, atol=ATOL, rtol=0)


def test_training_loss_at_several_positions_per_user(setup):
    """[B, P] positions: the mean over every (user, position), the same as each user's rows
    repeated P times with one position each."""
    cfg = tiny_config()
    enc = make_encoder(cfg, seed=7).eval()
    ranker = MFalconRanker(enc, cfg).eval()
    items, actions, ts, lengths = make_batch([12, 30, 5], seed=25)
    g = torch.Generator().manual_seed(5)
    positions = torch.tensor([[10, 2], [3, 28], [0, 4]])
    positives = torch.randint(1, cfg.num_items + 1, (3, 2), generator=g)
    negatives = torch.randint(1, cfg.num_items + 1, (3, 2, 6), generator=g)
    positives[1, 0] = 0  # skipped
    rows = torch.tensor([0, 0, 1, 1, 2, 2])
    with torch.no_grad():
        loss = ranker.training_loss(enc(items, actions, ts, lengths), positions, positives, negatives)
        ref = ranker.training_loss(enc(items[rows], actions[rows], ts[rows], lengths[rows]), positions.reshape(-1),
                                   positives.reshape(-1), negatives.reshape(6, 6))
    torch.testing.assert_close(loss, ref, atol=ATOL, rtol=0)
    with torch.no_grad():  # not the first position's loss alone
        first = ranker.training_loss(enc(items, actions, ts, lengths), positions[:, 0], positives[:, 0], negatives[:, 0])
    assert abs(float(first) - float(loss)) > 1e-4


def test_training_loss_backward(setup):
    cfg = tiny_config()
    enc = make_encoder(cfg, seed=7).train()
    ranker = MFalconRanker(enc, cfg).train()
    items, actions, ts, lengths = make_batch([12, 30, 5], seed=24)
    cache = enc(items, actions, ts, lengths)
    positions = torch.tensor([10, 3, 4])
    positives = items[torch.arange(3), positions + 1].clamp(min=1)
    negatives = torch.randint(1, cfg.num_items + 1, (3, 8))
    loss = ranker.training_loss(cache, positions, positives, negatives)
    assert torch.isfinite(loss)
    loss.backward()
    assert ranker.head[0].weight.grad is not None
    assert enc.layers[0].f1.weight.grad.abs().sum() > 0
    assert enc.layers[-1].pos_bias.grad.abs().sum() > 0
