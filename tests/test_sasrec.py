"""SASRec baseline: it learns a simple sequential pattern, and it is causal."""
import pytest
import torch

from backend_src.metrics import ranking_metrics, topk_full_catalog
from backend_src.model.sasrec import SASRec, SASRecConfig


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny tensors: one thread avoids thread-synchronisation stalls on a busy machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _cyclic_sequences(num_users: int, length: int, num_items: int, gen: torch.Generator):
    """Each user walks the items in order from a random start: next = item % I + 1."""
    start = torch.randint(0, num_items, (num_users, 1), generator=gen)
    return (start + torch.arange(length)[None]) % num_items + 1  # [U, length] in 1..I


def test_tiny_sasrec_loss_falls_and_learns_next_item():
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    num_items, n = 30, 12
    seqs = _cyclic_sequences(64, n + 1, num_items, gen)
    lengths = torch.randint(4, n + 1, (64,), generator=gen)
    valid = torch.arange(n)[None] < lengths[:, None]
    items = torch.where(valid, seqs[:, :n], 0)  # left-aligned, padded with 0
    targets = torch.where(valid, seqs[:, 1 : n + 1], 0)

    model = SASRec(SASRecConfig(num_items=num_items, hidden=32, num_blocks=2, num_heads=2, max_len=16, dropout=0.1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(40):
        loss = model.loss(items, targets)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]

    model.eval()
    scores = model.score_last(items, lengths)
    assert torch.isneginf(scores[:, 0]).all()
    ranked = topk_full_catalog(scores, 10)
    next_item = seqs[torch.arange(64), lengths]
    assert ranking_metrics(ranked, next_item)["recall@5"] > 0.8


def test_outputs_at_position_i_ignore_later_items():
    torch.manual_seed(0)
    model = SASRec(SASRecConfig(num_items=50, hidden=16, num_blocks=2, num_heads=2, max_len=10)).eval()
    items = torch.randint(1, 51, (3, 10))
    changed = items.clone()
    changed[:, 6:] = torch.randint(1, 51, (3, 4))
    changed[2, 6:] = 0  # padding after position 5 too
    a, b = model(items), model(changed)
    assert torch.allclose(a[:, :6], b[:, :6], atol=1e-6)
    assert not torch.allclose(a[:, 6:], b[:, 6:])
    # the score of a user's last position only depends on its own history
    lengths = torch.tensor([6, 6, 6])
    assert torch.allclose(model.score_last(items, lengths), model.score_last(changed, lengths))
