"""HSTU backbone: incremental append equals full encode, padding and causality, gradients."""
from __future__ import annotations

import pytest
import torch

from backend_src.model.hstu import HistoryCache, merge_rows

from hstu_helpers import make_batch, make_encoder, tiny_config  # noqa: E402

ATOL = 1e-5


def cut(items, actions, timestamps, lengths, splits):
    """First part = events [0, split), second part = events [split, length), both left-aligned."""
    splits = torch.tensor(splits, dtype=torch.long)
    B, N = items.shape
    n2 = lengths - splits
    j = torch.arange(N)[None, :]
    src = (splits[:, None] + j).clamp(max=N - 1)
    second = [t.gather(1, src) for t in (items, actions, timestamps)]
    return (items, actions, timestamps, splits), (*second, n2)


def assert_cache_close(a: HistoryCache, b: HistoryCache, atol=ATOL):
    a, b = a.trim(), b.trim()
    assert torch.equal(a.lengths, b.lengths)
    assert torch.equal(a.timestamps, b.timestamps)
    torch.testing.assert_close(a.states, b.states, atol=atol, rtol=0)
    torch.testing.assert_close(a.keys, b.keys, atol=atol, rtol=0)
    torch.testing.assert_close(a.values, b.values, atol=atol, rtol=0)


@pytest.fixture(scope="module")
def cfg():
    return tiny_config()


@pytest.fixture(scope="module")
def enc(cfg):
    return make_encoder(cfg)


def test_forward_shapes(cfg, enc):
    batch = make_batch([5, 9, 1])
    c = enc(*batch)
    assert c.keys.shape == (2, 3, 9, 2, 16) and c.values.shape == (2, 3, 9, 2, 16)
    assert c.states.shape == (3, 9, 32) and c.timestamps.shape == (3, 9)
    # padding rows are zeros in the cache
    assert c.states[2, 1:].abs().sum() == 0 and c.keys[:, 0, 5:].abs().sum() == 0


@pytest.mark.parametrize(
    "lengths,splits",
    [
        ([10, 1, 25, 7, 40, 64], [3, 0, 25, 6, 17, 63]),  # includes empty first part and empty second part
        ([12, 12, 12], [1, 6, 11]),
        ([30, 2], [29, 1]),
    ],
)
def test_two_part_identity(enc, lengths, splits):
    batch = make_batch(lengths, seed=sum(splits))
    first, second = cut(*batch, splits)
    with torch.no_grad():
        full = enc(*batch)
        inc = enc.append(enc(*first), *second)
    assert_cache_close(full, inc)


def test_three_parts_and_from_empty(cfg, enc):
    batch = make_batch([20, 8, 33], seed=3)
    a, rest = cut(*batch, [5, 8, 0])
    with torch.no_grad():
        full = enc(*batch)
        b, c = cut(*rest, [7, 0, 10])
        inc = enc.append(enc.append(enc(*a), *b), *c)
        from_empty = enc.append(HistoryCache.empty(cfg, 3), *batch)
    assert_cache_close(full, inc)
    assert_cache_close(full, from_empty)


def test_append_to_cat_of_single_user_caches(enc):
    """Serving keeps one cache per user and batches them for an append."""
    batch = make_batch([14, 3, 22], seed=4)
    first, second = cut(*batch, [9, 2, 5])
    with torch.no_grad():
        full = enc(*batch)
        per_user = enc(*first).split()
        assert [c.num_rows for c in per_user] == [9, 2, 5]
        batched = HistoryCache.cat(per_user[::-1]).select([2, 1, 0])
        inc = enc.append(batched, *second)
    assert_cache_close(full, inc)


def test_append_in_place_grows_into_spare_rows(cfg, enc):
    """One event at a time into the spare rows: equal to encoding at once, the old cache's rows
    untouched, no copy while capacity lasts, geometric regrowth (capped at max_seq_len) when full."""
    items, actions, ts, lengths = make_batch([40], seed=12)
    with torch.no_grad():
        full = enc(items, actions, ts, lengths)
        cache = enc(items[:, :5], actions[:, :5], ts[:, :5], torch.tensor([5]))
        assert cache.capacity() == 5  # fresh from forward: no spare rows
        first = cache.states.clone()
        grown = enc.append(cache, items[:, 5:6], actions[:, 5:6], ts[:, 5:6], torch.tensor([1]), in_place=True)
        assert grown.capacity() == 12 and torch.equal(cache.states, first)  # regrown to 2 x 6 rows
        for j in range(6, 40, 3):  # 3 events at a time (the last append takes 1)
            e = min(3, 40 - j)
            before = grown.states.data_ptr(), grown.capacity()
            grown = enc.append(grown, items[:, j:j + e], actions[:, j:j + e], ts[:, j:j + e], torch.tensor([e]),
                               in_place=True)
            if before[1] >= j + e:  # room was left: same buffer
                assert grown.states.data_ptr() == before[0]
            else:
                assert grown.capacity() == min(cfg.max_seq_len, 2 * (j + e))
    assert_cache_close(full, grown)
    assert grown.capacity() == 64 and grown.num_bytes() > grown.clone().num_bytes()  # spare rows are counted


def test_in_place_append_stays_inside_each_users_rows(enc):
    """A user's cache split off a batch may grow into its own padding rows, never the next user's."""
    batch = make_batch([9, 4, 7], seed=13)
    new = make_batch([2], seed=14)
    with torch.no_grad():
        users = enc(*batch).split()
        assert [c.capacity() for c in users] == [9, 9, 9]
        others = [c.clone() for c in users]
        alone = enc(*cut(*batch, [4, 4, 4])[0]).select([1]).trim()  # user 1's own 4 events
        grown = enc.append(users[1], *new, in_place=True)
        reference = enc.append(alone, *new)
    assert_cache_close(grown, reference)
    for b in (0, 2):
        assert_cache_close(users[b], others[b])


def test_in_place_append_falls_back_for_ragged_batches(enc):
    batch = make_batch([10, 6, 8], seed=15)
    first, second = cut(*batch, [4, 2, 8])
    with torch.no_grad():
        full = enc(*batch)
        inc = enc.append(enc(*first).reserve(16), *second, in_place=True)
    assert_cache_close(full, inc)


# ---- the fused CPU kernel of the streaming step (one event per user, in place) ----------------
@pytest.fixture
def kernel_calls(monkeypatch):
    """Counts calls of the fused kernel (which still runs)."""
    from backend_src.ops import cpu_kernels

    if not cpu_kernels.available():
        pytest.skip("numba is not installed: the torch path serves")
    calls = []
    kernel = cpu_kernels.append_one_event
    monkeypatch.setattr(cpu_kernels, "append_one_event", lambda *args: calls.append(1) or kernel(*args))
    return calls


def one_more_event(batch, n):
    """(first n events, the event n) of each user of a batch whose users all have n + 1 events."""
    users = len(batch[3])
    first, second = cut(*batch, [n] * users)
    return (*(t[:, :n] for t in first[:3]), first[3]), (*(t[:, :1] for t in second[:3]), torch.ones(users, dtype=torch.long))


@pytest.mark.parametrize("users", [1, 3])
def test_fused_append_equals_full_encode_and_torch_path(enc, kernel_calls, monkeypatch, users):
    """The kernel writes the K/V, state and timestamp of encoding at once, and of the torch path."""
    batch = make_batch([30] * users, seed=16)
    first, new = one_more_event(batch, 29)
    with torch.no_grad():
        full = enc(*batch)
        fused = enc.append(enc(*first).reserve(40), *new, in_place=True)
        assert len(kernel_calls) == 1
        monkeypatch.setenv("GENREC_OPS_BACKEND", "torch")
        torch_path = enc.append(enc(*first).reserve(40), *new, in_place=True)
    assert len(kernel_calls) == 1
    assert_cache_close(fused, full)
    assert_cache_close(fused, torch_path)


def test_fused_append_onto_histories_of_different_lengths(enc, kernel_calls, monkeypatch):
    """One event each onto single-user caches of different lengths, batched as serving batches them
    (the copying path): one kernel call, equal to encoding at once and to the torch path, and the
    users' own caches unchanged."""
    batch = make_batch([14, 3, 22], seed=19)
    first, new = cut(*batch, [13, 2, 21])
    new = (*(t[:, :1] for t in new[:3]), new[3])
    with torch.no_grad():
        full = enc(*batch)
        per_user = enc(*first).split()
        before = [c.clone() for c in per_user]
        fused = enc.append(HistoryCache.cat(per_user), *new)
        assert len(kernel_calls) == 1
        monkeypatch.setenv("GENREC_OPS_BACKEND", "torch")
        torch_path = enc.append(HistoryCache.cat(per_user), *new)
    assert len(kernel_calls) == 1
    assert_cache_close(fused, full)
    assert_cache_close(fused, torch_path)
    for c, b in zip(per_user, before):
        assert_cache_close(c, b, atol=0)


def test_fused_append_time_buckets_at_their_edges(kernel_calls):
    """Gaps on both sides of every bucket edge, up to 1.6^63 s (edges past 2^24 s are whole
    floats, hit exactly), with a large time bias per bucket: the kernel's float32 thresholds
    bucket as the reference's log formula does."""
    from backend_src import ops

    cfg = tiny_config(num_time_buckets=64, max_seq_len=160)
    enc = make_encoder(cfg, seed=3)
    thr = ops.time_bucket_thresholds(cfg.num_time_buckets, cfg.time_bucket_base)[1:-1]
    edges = thr[torch.isfinite(thr)].double().ceil().long()
    gaps = torch.cat([edges, edges - 1]).clamp(min=0).unique().flip(0)
    assert len(gaps) < cfg.max_seq_len
    n, now = len(gaps), 10**13
    ts = torch.cat([now - gaps, torch.tensor([now])])[None]
    items, actions, _, _ = make_batch([n + 1], seed=18)
    batch = (items, actions, ts, torch.tensor([n + 1]))
    first, new = one_more_event(batch, n)
    with torch.no_grad():
        assert_cache_close(enc.append(enc(*first).reserve(n + 2), *new, in_place=True), enc(*batch))
    assert len(kernel_calls) == 1


def test_fused_append_follows_weight_changes(cfg, kernel_calls):
    """Parameters updated in place (an optimizer step) and replaced (load_state_dict(assign=True))
    reach the kernel; in training mode the torch path runs (dropout)."""
    enc, other = make_encoder(cfg, seed=4), make_encoder(cfg, seed=5)
    batch = make_batch([20], seed=17)
    first, new = one_more_event(batch, 19)

    def check():
        with torch.no_grad():
            assert_cache_close(enc.append(enc(*first).reserve(32), *new, in_place=True), enc(*batch))

    check()
    with torch.no_grad():
        enc.layers[0].f1.weight.mul_(1.5)
    check()
    enc.load_state_dict(other.state_dict(), assign=True)
    check()
    assert len(kernel_calls) == 3
    enc.train()
    with torch.no_grad():
        enc.append(enc(*first).reserve(32), *new, in_place=True)
    assert len(kernel_calls) == 3


def test_append_overflow_raises(cfg, enc):
    batch = make_batch([60, 3], seed=5)
    with torch.no_grad():
        cache = enc(*batch)
        new = make_batch([5, 5], seed=6)
        with pytest.raises(ValueError, match="max_seq_len"):
            enc.append(cache, *new)
        with pytest.raises(ValueError, match="max_seq_len"):
            enc(*make_batch([65], seed=7))


def test_padding_invariance(enc):
    items, actions, ts, lengths = make_batch([6, 11, 3], n=11, seed=8)
    junk_items, junk_actions, junk_ts, _ = make_batch([20, 20, 20], n=20, seed=9)
    pad = lambda x, junk: torch.cat([x, junk[:, 11:]], 1)  # noqa: E731
    valid = torch.arange(20)[None] < lengths[:, None]
    j_items = torch.where(valid, pad(items, junk_items), junk_items)
    j_actions = torch.where(valid, pad(actions, junk_actions), junk_actions)
    j_ts = torch.where(valid, pad(ts, junk_ts), junk_ts)
    with torch.no_grad():
        a = enc(items, actions, ts, lengths)
        b = enc(j_items, j_actions, j_ts, lengths)
        alone = enc(items[1:2], actions[1:2], ts[1:2], lengths[1:2])
    assert_cache_close(a, b)
    assert_cache_close(a.select([1]), alone)


def test_causality(enc):
    items, actions, ts, lengths = make_batch([16, 16], seed=10)
    t = 9
    items2, actions2, ts2 = items.clone(), actions.clone(), ts.clone()
    items2[:, t] = items[:, t] % 50 + 1
    actions2[:, t] = (actions[:, t] + 1) % 6
    ts2[:, t:] += 12345
    with torch.no_grad():
        a = enc(items, actions, ts, lengths)
        b = enc(items2, actions2, ts2, lengths)
    torch.testing.assert_close(a.states[:, :t], b.states[:, :t], atol=ATOL, rtol=0)
    torch.testing.assert_close(a.keys[:, :, :t], b.keys[:, :, :t], atol=ATOL, rtol=0)
    assert (a.states[:, t:] - b.states[:, t:]).abs().amax(-1).min() > 1e-4  # later rows do change


def test_time_and_position_matter(enc):
    items, actions, ts, lengths = make_batch([12], seed=11)
    with torch.no_grad():
        a = enc(items, actions, ts, lengths)
        b = enc(items, actions, ts * 0 + ts[:, :1], lengths)  # same events, all at one time
    assert (a.states[0, 1:] - b.states[0, 1:]).abs().max() > 1e-3


def test_gradient_flows(cfg):
    enc = make_encoder(cfg, seed=2).train()
    items, actions, ts, lengths = make_batch([7, 13, 2], seed=12)
    cache = enc(items, actions, ts, lengths)
    loss = cache.states.pow(2).mean() + cache.keys.mean() + cache.values.mean()
    loss.backward()
    for name, p in enc.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
        assert p.grad.abs().sum() > 0, name
    assert enc.item_embedding.weight.grad[0].abs().sum() == 0  # padding id learns nothing
    # Q and K reach the output only through the attention op: their f1 rows must learn too
    for layer in enc.layers:
        hdv = layer.num_heads * layer.dv
        assert layer.f1.weight.grad[2 * hdv :].abs().sum() > 0


def test_gradient_through_append(cfg):
    enc = make_encoder(cfg, seed=3).train()
    batch = make_batch([9, 5], seed=13)
    first, second = cut(*batch, [4, 2])
    cache = enc.append(enc(*first), *second)
    cache.states.sum().backward()
    assert all(p.grad is not None for p in enc.parameters())


def test_cache_helpers(cfg, enc):
    with torch.no_grad():
        cache = enc(*make_batch([4, 9, 1], seed=14))
    assert cache.num_bytes() == sum(
        t.numel() * t.element_size() for t in (cache.keys, cache.values, cache.states, cache.timestamps, cache.lengths)
    )
    parts = cache.split()
    assert [p.num_rows for p in parts] == [4, 9, 1]
    assert_cache_close(HistoryCache.cat(parts), cache)
    sel = cache.select(torch.tensor([2, 0]))
    assert sel.lengths.tolist() == [1, 4]
    torch.testing.assert_close(sel.states[1], cache.states[0])
    moved = cache.to("cpu", dtype=torch.float64)
    assert moved.states.dtype == torch.float64 and moved.lengths.dtype == torch.long
    e = HistoryCache.empty(cfg, 2)
    assert e.num_rows == 0 and e.lengths.tolist() == [0, 0]
    padded = cache.resize(15)
    assert padded.num_rows == 15
    assert_cache_close(padded, cache)


def test_merge_rows():
    old = torch.tensor([[1, 2, 0], [5, 0, 0]])
    new = torch.tensor([[7, 8], [9, 0]])
    out = merge_rows(old, new, torch.tensor([2, 1]), torch.tensor([2, 1]), 4)
    assert out.tolist() == [[1, 2, 7, 8], [5, 9, 0, 0]]


def test_a_long_history_encoded_in_query_blocks_equals_the_whole_matrix(monkeypatch):
    """Past CAUSAL_BLOCK rows the full pass computes its attention a block of queries at a time, each
    against the keys up to its last query: the same cache as the whole [N, N] matrix (padding rows,
    ragged lengths and a last block shorter than the others included), and the same gradients."""
    from backend_src.ops import reference

    cfg = tiny_config(max_seq_len=200, dropout=0.0)  # train mode below: no random masks to differ
    enc = make_encoder(cfg, seed=4)
    batch = make_batch([200, 131, 57], seed=14)
    monkeypatch.setattr(reference, "CAUSAL_BLOCK", 64)  # blocks [0, 64), [64, 128), [128, 192), [192, 200)
    blocked = enc(*batch)
    monkeypatch.setattr(reference, "CAUSAL_BLOCK", 10**9)
    whole = enc(*batch)
    for name in ("states", "keys", "values"):
        assert torch.allclose(getattr(blocked, name), getattr(whole, name), atol=1e-5), name
    grads = []
    for block in (64, 10**9):
        monkeypatch.setattr(reference, "CAUSAL_BLOCK", block)
        enc.zero_grad()
        enc.train()(*batch).states.pow(2).sum().backward()
        grads.append([p.grad.clone() for p in enc.parameters()])
    for a, b in zip(*grads):
        assert torch.allclose(a, b, atol=1e-5)
