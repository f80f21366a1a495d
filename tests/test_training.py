"""The learning-rate schedule of training."""
from __future__ import annotations

import pytest

from backend_src.config import TrainConfig
from backend_src.training import lr_scale


def test_constant_schedule_keeps_the_rate():
    assert all(lr_scale(TrainConfig(), p) == 1.0 for p in (0.0, 0.3, 1.0, 2.0))


def test_cosine_schedule_decays_to_the_floor():
    tcfg = TrainConfig(lr_schedule="cosine", lr_min_ratio=0.05)
    scales = [lr_scale(tcfg, i / 20) for i in range(21)]
    assert scales[0] == pytest.approx(1.0) and scales[-1] == pytest.approx(0.05)
    assert scales[10] == pytest.approx(0.525)
    assert all(a > b for a, b in zip(scales, scales[1:]))
    assert lr_scale(tcfg, 1.5) == pytest.approx(0.05)  # past the budget: stays at the floor


def test_unknown_schedule_is_an_error():
    with pytest.raises(ValueError, match="lr_schedule"):
        lr_scale(TrainConfig(lr_schedule="step"), 0.5)


def test_sampled_dense_loss_over_every_item_is_the_full_softmax():
    """With every item as a shared negative (the target among them, masked) the sampled softmax is
    the softmax over the whole catalog; with a few negatives it is a smaller loss over fewer items."""
    import torch

    from backend_src.config import ModelConfig
    from backend_src.model.recommender import GenerativeRecommender
    from backend_src.model.semantic_ids import SemanticIdCodebook
    from backend_src.training import dense_loss

    torch.manual_seed(0)
    cfg = ModelConfig(num_items=40, d_model=16, num_layers=1, num_heads=2, max_seq_len=8)
    model = GenerativeRecommender(cfg, SemanticIdCodebook(), [None] + [str(i) for i in range(40)])
    states, targets = torch.randn(6, 16), torch.randint(1, 41, (6,))
    full = dense_loss(model, states, targets)
    assert torch.allclose(dense_loss(model, states, targets, torch.randperm(40) + 1), full, atol=1e-6)
    assert dense_loss(model, states, targets, torch.tensor([1, 2, 3])) < full
    # cosine / temperature: the same identity, and the scores are the normalized products
    model.cfg.dense_temperature = 0.05
    cos = dense_loss(model, states, targets)
    assert torch.allclose(dense_loss(model, states, targets, torch.randperm(40) + 1), cos, atol=1e-5)
    emb = torch.nn.functional.normalize(model.backbone.item_embedding.weight[1:], dim=-1)
    logits = torch.nn.functional.normalize(states, dim=-1) @ emb.T / 0.05
    assert torch.allclose(cos, torch.nn.functional.cross_entropy(logits, targets - 1), atol=1e-5)


@pytest.mark.parametrize("fraction", [0.0, 0.25, 0.5, 1.0])
def test_ranker_negatives_share_the_first_code_in_the_asked_fraction(fraction):
    """The first int(n * fraction) negatives of a positive share its first semantic-ID code, the
    rest are uniform over the catalog; a fraction outside [0, 1] is refused."""
    import torch

    from backend_src.training import NegativeSampler

    gen = torch.Generator().manual_seed(0)
    first = torch.arange(400) % 8  # items 1..400 in 8 first-code groups of 50
    codes = torch.cat([torch.tensor([[-1, -1, -1, -1]]), torch.stack([first, first, first, first], 1)])
    sampler = NegativeSampler(codes, 400, fraction)
    positives = torch.randint(1, 401, (64,), generator=gen)
    neg = sampler.sample(positives, 32, gen)
    assert neg.shape == (64, 32) and int(neg.min()) >= 1 and int(neg.max()) <= 400
    n_hard = int(32 * fraction)
    same = codes[neg, 0] == codes[positives, 0][:, None]
    assert bool(same[:, :n_hard].all())
    if n_hard < 32:  # uniform draws over 8 groups: about 1 in 8 share the code by chance
        assert float(same[:, n_hard:].float().mean()) < 0.3
    with pytest.raises(ValueError, match="hard_fraction"):
        NegativeSampler(codes, 400, 1.5)


def test_code_loss_over_valid_codes_is_the_softmax_beam_search_takes():
    """'valid': each level's cross-entropy is over the codes continuing the target's prefix, i.e.
    minus the log-probability a constrained beam step gives the target's code; a level whose
    prefix has one child adds 0; 'all' is the plain cross-entropy over every code."""
    import torch
    import torch.nn.functional as F

    from backend_src.model.semantic_ids import SemanticIdCodebook
    from backend_src.training import code_loss

    # items: (0,0,0,0) (0,0,1,0) (0,2,0,0) (1,1,0,0) (1,1,0,1); sizes 2 / 3 / 2 / 2
    cb = SemanticIdCodebook.from_codes(torch.tensor([[0, 0, 0, 0], [0, 0, 1, 0], [0, 2, 0, 0], [1, 1, 0, 0],
                                                     [1, 1, 0, 1]]))
    codes = cb.codes[1:]  # [5, 4]
    torch.manual_seed(0)
    logits = [torch.randn(5, c) for c in cb.codebook_sizes]
    plain = sum(F.cross_entropy(lt, codes[:, t]) for t, lt in enumerate(logits))
    assert torch.allclose(code_loss(cb, logits, codes, "all"), plain)

    # by hand: per item, the sibling codes at each level (the target's own included)
    siblings = {1: {0: [0, 2], 1: [1]}, 2: {(0, 0): [0, 1], (0, 2): [0], (1, 1): [0]},
                3: {(0, 0, 0): [0], (0, 0, 1): [0], (0, 2, 0): [0], (1, 1, 0): [0, 1]}}
    expected = F.cross_entropy(logits[0], codes[:, 0])  # every level-0 code continues some item
    for t in (1, 2, 3):
        terms = []
        for i, c in enumerate(codes.tolist()):
            key = c[0] if t == 1 else tuple(c[:t])
            allowed = siblings[t][key]
            terms.append(-torch.log_softmax(logits[t][i, allowed], 0)[allowed.index(c[t])])
        expected = expected + torch.stack(terms).mean()
    valid = code_loss(cb, logits, codes, "valid")
    assert torch.allclose(valid, expected, atol=1e-6)
    assert valid < plain  # fewer competitors at every level
    with pytest.raises(ValueError, match="'all' or 'valid'"):
        code_loss(cb, logits, codes, "siblings")


def test_level_prefixes_follow_the_codes_and_end_at_the_item():
    import torch

    from backend_src.model.semantic_ids import SemanticIdCodebook

    cb = SemanticIdCodebook.from_codes(torch.tensor([[0, 0, 0, 0], [0, 2, 0, 0], [1, 1, 0, 0]]))
    p = cb.level_prefixes(torch.tensor([[0, 2, 0, 0], [1, 1, 0, 0], [1, 0, 0, 0]]))
    assert p[:, 0].tolist() == [0, 0, 0]  # the root
    assert cb.items_of(p[:, -1]).tolist() == [2, 3, 0]  # (1, 0, ...) is no item
    assert p[2, 2].item() == -1  # it leaves every item at level 1
