"""The learned residual quantizer (RQ-VAE) behind `--quantizer rq-vae` / `rq-vae-collaborative`."""
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from backend_src.model.rq_vae import RQVAE, rq_vae_codes
from backend_src.model.semantic_ids import SemanticIdCodebook


def _blobs(n=400, d=8, centers=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    c = torch.randn(centers, d, generator=g) * 5
    label = torch.randint(centers, (n,), generator=g)
    return c[label] + 0.1 * torch.randn(n, d, generator=g), label


def _purity(codes: torch.Tensor, label: torch.Tensor) -> float:
    """Share of items whose code holds a majority of their label."""
    table = torch.zeros(int(codes.max()) + 1, int(label.max()) + 1).index_put_(
        (codes, label), torch.ones(len(codes)), accumulate=True)
    return float(table.max(1).values.sum() / len(codes))


def test_first_level_separates_blobs_and_codes_are_in_range():
    x, label = _blobs()
    codes = rq_vae_codes(x, sizes=(4, 8), steps=300, batch_size=128, reseed_every=100)
    assert codes.shape == (400, 2)
    assert int(codes[:, 0].max()) < 4 and int(codes[:, 1].max()) < 8 and int(codes.min()) >= 0
    assert _purity(codes[:, 0], label) > 0.95


def test_training_lowers_the_loss_and_codebooks_follow_the_latents():
    x, _ = _blobs()
    torch.manual_seed(0)
    model = RQVAE(8, (4, 4), latent_dim=4, hidden=(16,))
    model.init_codebooks(x)
    model.eval()
    with torch.no_grad():
        _, before, _ = model(x)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    model.train()
    for _ in range(200):
        _, loss, _ = model(x)
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    with torch.no_grad():
        _, after, _ = model(x)
    assert float(after) < 0.5 * float(before)


def test_unused_codes_are_reseeded_on_residuals():
    model = RQVAE(8, (4,), latent_dim=3, hidden=(8,))
    codes = torch.zeros(10, 1, dtype=torch.long)  # every item on code 0: codes 1..3 unused
    residuals = torch.randn(1, 10, 3)
    before = model.codebooks[0][0].clone()
    assert model.reseed_unused(codes, residuals, torch.Generator().manual_seed(0)) == 3
    assert torch.equal(model.codebooks[0][0], before)
    for row in model.codebooks[0][1:]:  # each moved code now sits on some item's residual
        assert bool((residuals[0] == row).all(1).any())


def test_collaborative_alignment_pulls_codes_toward_the_groups():
    """Item features where a 4-group factor is small beside a clustered factor and noise, and
    collaborative embeddings that are those groups: unaligned, the 16 (first, second) codes barely
    follow the groups; pulled toward them, nearly all of their items share a group."""
    g = torch.Generator().manual_seed(0)
    clustered, group = torch.randint(4, (400,), generator=g), torch.randint(4, (400,), generator=g)
    x = torch.cat([(torch.randn(4, 4, generator=g) * 4)[clustered] + 0.1 * torch.randn(400, 4, generator=g),
                   torch.randn(400, 4, generator=g), (torch.randn(4, 2, generator=g))[group]], 1)
    aligned = torch.eye(4)[group]
    joint = lambda c: c[:, 0] * 4 + c[:, 1]  # noqa: E731
    kw = dict(sizes=(4, 4), steps=600, batch_size=128, reseed_every=100, seed=0)
    plain, pulled = rq_vae_codes(x, **kw), rq_vae_codes(x, **kw, aligned=aligned, align_weight=1.0)
    assert _purity(plain[:, 0], clustered) == 1.0 and _purity(pulled[:, 0], clustered) == 1.0
    assert _purity(joint(plain), group) < 0.5 and _purity(joint(pulled), group) > 0.8


@pytest.mark.parametrize("quantizer", ["rq-vae", "rq-vae-collaborative"])
def test_codebook_build_with_a_learned_quantizer(quantizer):
    seqs = [[1, 2, 3, 1, 2], [4, 5, 6, 5], [2, 3, 1], [6, 4, 5, 4]]
    offsets = np.cumsum([0] + [len(s) for s in seqs])
    items = np.concatenate(seqs)
    data = SimpleNamespace(offsets=offsets, lengths=np.diff(offsets), items=items, num_items=6,
                           item_text=None, item_attributes={1: [10], 2: [10], 4: [12], 6: [12, 13]})
    cb = SemanticIdCodebook.build(data, SimpleNamespace(codebook_sizes=(2, 2, 2, 1)), dim=4, quantizer=quantizer)
    assert cb.num_items == 6 and len({tuple(r) for r in cb.codes[1:].tolist()}) == 6
    assert torch.equal(cb.items_of_codes(cb.codes[1:]), torch.arange(1, 7))
    with pytest.raises(ValueError, match="quantizer"):
        SemanticIdCodebook.build(data, SimpleNamespace(codebook_sizes=(2, 2, 2, 1)), dim=4, quantizer="vq")
    with pytest.raises(ValueError, match="balanced"):
        SemanticIdCodebook.build(data, SimpleNamespace(codebook_sizes=(2, 2, 2, 1)), dim=4, quantizer=quantizer,
                                 balanced=True)
