"""Semantic-ID decoder and constrained beam search: validity, PFA against a slow reference,
mode equivalences, attention statistics."""
import math

import pytest
import torch

from backend_src import ops
from backend_src.config import DecodeOptions, ModelConfig
from backend_src.decoding import attention_stats, generate, plot_attention_stats
from backend_src.decoding.attention_stats import masked_spearman
from backend_src.model.decoder import SemanticIdDecoder
from backend_src.model.semantic_ids import SemanticIdCodebook, assign_collision_codes

D, H = 16, 2


def _codebook(n=60, sizes=(4, 3, 3), seed=0):
    g = torch.Generator().manual_seed(seed)
    codes3 = torch.stack([torch.randint(c, (n,), generator=g) for c in sizes], 1)
    return SemanticIdCodebook.from_codes(assign_collision_codes(codes3))


def _decoder(cb, seed=0, shared=False, nodes=False):
    torch.manual_seed(seed)
    cfg = ModelConfig(num_items=cb.num_items, d_model=D, decoder_heads=H, codebook_sizes=cb.codebook_sizes,
                      shared_kv_projection=shared,
                      node_output_sizes=(0,) + cb.prefix_counts()[1:] if nodes else ())
    dec = SemanticIdDecoder(cfg).eval()
    with torch.no_grad():  # sharper attention and logits than the default init, so selection matters
        for p in dec.kv_proj:
            p.weight.mul_(3.0)
        for p in dec.code_emb:
            p.weight.normal_(0, 1.0)
        for p in dec.out:
            p.weight.mul_(4.0)
        for e in dec.node_emb.values():  # as large as the code vectors' part, the padding row kept 0
            e.weight[:-1].normal_(0, 1.0)
    return dec


def _history(B=3, N=12, seed=0, lengths=None):
    g = torch.Generator().manual_seed(seed)
    states = torch.randn(B, N, D, generator=g)
    if lengths is None:
        lengths = torch.randint(1, N + 1, (B,), generator=g)
        lengths[0] = N
    return states, torch.as_tensor(lengths)


# ---------------------------------------------------------------------------------------------
# constrained decoding
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["full", "pfa", "pfa_per_beam", "dynamic_topk"])
def test_only_real_items(mode):
    cb = _codebook()
    dec = _decoder(cb)
    states, lengths = _history()
    res = generate(dec, cb, states, lengths, DecodeOptions(mode=mode, beam_width=8, k=5, r=0.5))
    assert res.item_ids.shape == (3, 8) and res.codes.shape == (3, 8, 4)
    assert (res.item_ids > 0).all()
    assert torch.equal(cb.codes[res.item_ids], res.codes)
    assert (res.log_probs[:, :-1] >= res.log_probs[:, 1:]).all()
    for row in res.item_ids.tolist():
        assert len(set(row)) == len(row)


@pytest.mark.parametrize("sizes", [(8, 6), (3, 2, 2, 2, 2), (2, 2, 2, 2, 2, 2, 2)])
def test_semantic_ids_of_any_length_decode_and_load(sizes):
    """3, 6 and 8 codes per item: the tables, a state-dict round trip into a placeholder of that
    length, and constrained decoding that returns real items with codes of that length."""
    import io

    cb = _codebook(sizes=sizes)
    L = len(sizes) + 1
    assert cb.num_levels == L and len(cb.codebook_sizes) == L
    buf = io.BytesIO()
    torch.save(cb.state_dict(), buf)
    buf.seek(0)
    loaded = SemanticIdCodebook(num_levels=L)
    loaded.load_state_dict(torch.load(buf))
    assert torch.equal(loaded.items_of_codes(cb.codes[1:]), torch.arange(1, cb.num_items + 1))
    dec = _decoder(loaded)
    states, lengths = _history()
    res = generate(dec, loaded, states, lengths, DecodeOptions(mode="pfa", beam_width=8, k=5, r=0.5))
    assert res.codes.shape == (3, 8, L) and (res.item_ids > 0).all()
    assert torch.equal(loaded.codes[res.item_ids], res.codes)


def test_wide_beam_returns_every_item_once():
    cb = _codebook(n=40)
    dec = _decoder(cb)
    states, lengths = _history()
    res = generate(dec, cb, states, lengths, DecodeOptions(mode="full", beam_width=50))
    for b in range(3):
        got = res.item_ids[b][res.item_ids[b] > 0]
        assert sorted(got.tolist()) == list(range(1, 41))
        assert (res.item_ids[b, 40:] == 0).all() and torch.isinf(res.log_probs[b, 40:]).all()
        assert (res.codes[b, 40:] == -1).all()
        # constrained steps are normalized over valid codes: the item distribution sums to 1
        assert math.isclose(res.log_probs[b, :40].exp().sum().item(), 1.0, rel_tol=1e-4)


def test_decoder_codebook_size_mismatch():
    cb = _codebook()
    other = _codebook(sizes=(5, 3, 3), seed=1)
    with pytest.raises(ValueError):
        generate(_decoder(other), cb, *_history(), DecodeOptions(mode="full", beam_width=4))


@pytest.mark.parametrize("shared", [False, True])
def test_state_space_attention_equals_projected(shared):
    """Attending with W_k, W_v folded into the query equals attending over projected rows."""
    cb = _codebook()
    dec = _decoder(cb, shared=shared)
    states, lengths = _history(B=4, N=12)
    q = torch.randn(4, 3, H, D // H)
    for t in range(dec.num_steps):
        K, V = dec.project_step(states, t)
        want = ops.decode_attention(q, K, V, lengths)
        torch.testing.assert_close(dec.attend_states(q, states, lengths, t), want, rtol=1e-4, atol=1e-5)


SPARSE_SIZES = (4, 40, 32)  # levels 1 and 2 have short lists of continuations (kids tables)


def test_continuations_list_exactly_the_valid_codes():
    cb = _codebook(sizes=SPARSE_SIZES)
    listed = 0
    for t in range(4):
        prefix = torch.arange(-1, cb.child(t).shape[0])
        codes, bias = cb.continuations(prefix, t)
        if codes is None:  # a dense level: all codes, constrained by the additive bias
            assert torch.equal(bias, cb.code_bias(prefix, t))
            continue
        listed += 1
        assert codes.shape[1] <= cb.child(t).shape[1] // 2
        assert (bias[0] == 0).all()  # dead prefix: finite row (its beam carries -inf)
        valid = cb.valid_mask(prefix[1:], t)
        for p in range(valid.shape[0]):
            kept = codes[1 + p][bias[1 + p] == 0]
            assert sorted(kept.tolist()) == valid[p].nonzero().squeeze(1).tolist()
    assert listed == 2


def test_listed_continuations_decode_like_all_codes():
    """Scoring only the listed codes equals scoring all codes with -inf on the invalid ones."""
    cb = _codebook(sizes=SPARSE_SIZES)
    dec = _decoder(cb)
    states, lengths = _history(B=4, N=10)
    dense = SemanticIdCodebook.from_codes(cb.codes)
    dense.kids_1 = dense.kids_2 = None  # every level scores all its codes
    for mode in ("full", "pfa"):
        opts = DecodeOptions(mode=mode, beam_width=7, k=4, r=0.5)
        listed = generate(dec, cb, states, lengths, opts)
        dense_res = generate(dec, dense, states, lengths, opts)
        assert torch.equal(listed.item_ids, dense_res.item_ids), mode
        assert torch.allclose(listed.log_probs, dense_res.log_probs, atol=1e-5), mode


def test_code_bias_matches_valid_mask():
    cb = _codebook()
    for t in range(4):
        prefix = torch.arange(-1, cb.child(t).shape[0])
        bias = cb.code_bias(prefix, t)
        assert (bias[0] == 0).all()  # dead prefix: finite row (its beam carries -inf)
        assert torch.equal(bias[1:] == 0, cb.valid_mask(prefix[1:], t))
        assert torch.isneginf(bias[1:][~cb.valid_mask(prefix[1:], t)]).all()


# ---------------------------------------------------------------------------------------------
# PFA
# ---------------------------------------------------------------------------------------------
def test_budget_schedule():
    opt = DecodeOptions(k=256, r=0.5, selection_step=1)
    assert [opt.budget(t) for t in (1, 2, 3)] == [256, 128, 64]
    opt = DecodeOptions(k=5, r=0.3, selection_step=1)
    assert [opt.budget(t) for t in (1, 2, 3)] == [max(1, math.ceil(5 * 0.3 ** (t - 1))) for t in (1, 2, 3)]
    assert opt.budget(3) == 1


def test_pfa_reads_budget_prefixes(monkeypatch):
    """Steps after selection read only the first k_t rows of the gathered block."""
    cb = _codebook()
    dec = _decoder(cb)
    states, lengths = _history(B=3, N=12, lengths=[12, 7, 2])
    seen = []
    real = ops.decode_attention

    def spy(q, k, v, lens):
        seen.append((k.shape[1], lens.tolist()))
        return real(q, k, v, lens)

    monkeypatch.setattr(ops, "decode_attention", spy)
    generate(dec, cb, states, lengths, DecodeOptions(mode="pfa", beam_width=6, k=8, r=0.5, selection_step=1))
    # step 0 (one beam) attends in state space; step 1 selects 8 rows (the second user has 7, the
    # third 2) and attends over them; steps 2, 3 read prefixes of 4 and 2 rows
    assert seen == [(8, [8, 7, 2]), (4, [4, 4, 2]), (2, [2, 2, 2])]


def _item_codes(cb):
    return {tuple(r): i + 1 for i, r in enumerate(cb.codes[1:].tolist())}


def _slow_pfa(dec, cb, states, lengths, W, k, r, s):
    """Loop-based PFA decoding: per user, per beam, per step, written from the paper's formulas."""
    T = cb.num_levels
    K, V = dec.project_history(states)
    items = _item_codes(cb)
    prefixes = [set(c[:t] for c in items) for t in range(T + 1)]
    out_items, out_lp = [], []
    for b in range(states.shape[0]):
        L = int(lengths[b])
        h = states[b, L - 1]
        beams = [(0.0, ())]  # (log-prob, codes so far)
        prefix_id = {(): 0}  # codes so far -> their prefix id in the codebook
        order = None
        for t in range(T):
            kt = max(1, math.ceil(k * r ** (t - s)))
            queries, weights = [], []
            for lp, codes in beams:
                emb = torch.zeros(D)
                for level, c in enumerate(codes):
                    emb = emb + dec.code_emb[level].weight[c]
                x, q = dec.query(h[None], emb[None, None], t)  # [1, 1, D], [1, 1, H, dh]
                a = torch.stack([torch.softmax(K[t, b, :L, hh] @ q[0, 0, hh] / math.sqrt(q.shape[-1]), 0)
                                 for hh in range(H)])  # [H, L] over the full history
                queries.append((x, q))
                weights.append(a)
            if t == s:
                z = sum(math.exp(lp) for lp, _ in beams)
                score = [sum(math.exp(lp) / z * weights[j][:, i].mean().item() for j, (lp, _) in enumerate(beams))
                         for i in range(L)]
                order = sorted(range(L), key=lambda i: -score[i])[:k]
            cands = []
            for j, (lp, codes) in enumerate(beams):
                x, q = queries[j]
                if t < s:
                    rows, a = list(range(L)), weights[j]
                elif t == s:  # reuse this step's weights over the kept rows, renormalized
                    rows = order
                    a = weights[j][:, rows]
                    a = a / a.sum(1, keepdim=True)
                else:  # later steps: softmax over the first k_t kept rows only
                    rows = order[:kt]
                    a = torch.stack([torch.softmax(K[t, b, rows, hh] @ q[0, 0, hh] / math.sqrt(q.shape[-1]), 0)
                                     for hh in range(H)])
                o = torch.stack([(a[hh][:, None] * V[t, b, rows, hh]).sum(0) for hh in range(H)])  # [H, dh]
                nodes = cb.child(t)[prefix_id[codes]][None, None] if dec.has_node_output(t) else None
                logits = dec.head(x, o[None, None], t, nodes=nodes)[0, 0]
                valid = [c for c in range(logits.shape[0]) if codes + (c,) in prefixes[t + 1]]
                prefix_id.update({codes + (c,): int(cb.child(t)[prefix_id[codes], c]) for c in valid})
                lse = torch.logsumexp(logits[valid], 0).item()
                cands += [(lp + logits[c].item() - lse, codes + (c,)) for c in valid]
            beams = sorted(cands, key=lambda x: -x[0])[:W]
        out_items.append([items[c] for _, c in beams])
        out_lp.append([lp for lp, _ in beams])
    return out_items, out_lp


@pytest.mark.parametrize(
    "seed,s,k,r,sizes",
    [(0, 1, 5, 0.5, (4, 3, 3)), (1, 1, 3, 0.3, (4, 3, 3)), (2, 0, 6, 0.5, (4, 3, 3)), (3, 2, 4, 0.5, (4, 3, 3)),
     (4, 1, 20, 1.0, (4, 3, 3)), (5, 1, 5, 0.5, SPARSE_SIZES),
     (6, 1, 5, 0.5, (8, 6)), (7, 2, 4, 0.5, (3, 2, 2, 2, 2)), (8, 3, 4, 0.5, (2, 2, 2, 2, 2, 2, 2))],
)
@pytest.mark.parametrize("nodes", [False, True])
def test_pfa_matches_slow_reference(seed, s, k, r, sizes, nodes):
    cb = _codebook(n=60, seed=seed, sizes=sizes)
    dec = _decoder(cb, seed=seed, nodes=nodes)
    states, lengths = _history(B=3, N=10, seed=seed)
    W = 5
    with torch.no_grad():
        res = generate(dec, cb, states, lengths, DecodeOptions(mode="pfa", beam_width=W, k=k, r=r, selection_step=s))
        ref_items, ref_lp = _slow_pfa(dec, cb, states, lengths, W, k, r, s)
    assert res.item_ids.tolist() == ref_items
    assert torch.allclose(res.log_probs, torch.tensor(ref_lp), atol=1e-4)


def test_node_output_by_parent_blocks_equals_per_pair(monkeypatch):
    """Levels with few prefixes score node output by parent blocks; it gives what the gather per
    (beam, code) gives, and the cached blocks follow the weights when they change."""
    from backend_src.model import decoder as decoder_module
    cb = _codebook(sizes=SPARSE_SIZES)
    dec = _decoder(cb, nodes=True)
    states, lengths = _history(B=4, N=10)
    options = DecodeOptions(mode="pfa", beam_width=6, k=5)

    def both():
        by_blocks = generate(dec, cb, states, lengths, options)
        with monkeypatch.context() as m:
            m.setattr(decoder_module, "NODE_BLOCK_MAX_PARENTS", 0)
            assert dec.node_blocks(1, cb) is None
            per_pair = generate(dec, cb, states, lengths, options)
        assert torch.equal(by_blocks.item_ids, per_pair.item_ids)
        assert torch.allclose(by_blocks.log_probs, per_pair.log_probs, atol=1e-5)
        return by_blocks

    monkeypatch.setenv("GENREC_OPS_BACKEND", "torch")  # the torch composition (the CPU kernel has its own)
    assert dec.node_blocks(1, cb) is not None and dec.node_blocks(2, cb) is not None
    before = both()
    with torch.no_grad():
        for e in dec.node_emb.values():
            e.weight[:-1].mul_(-2.0)
    after = both()
    assert not torch.allclose(before.log_probs, after.log_probs)


@pytest.mark.parametrize("sizes,nodes,B,W", [(SPARSE_SIZES, True, 4, 6), ((4, 3, 3), False, 3, 5), (SPARSE_SIZES, True, 1, 40)])
def test_cpu_kernels_decode_as_the_torch_composition(monkeypatch, sizes, nodes, B, W):
    """The compiled CPU kernel of a beam search's expansion (cpu_kernels.expand_beams) gives
    the torch composition's beams: same items, same order, log-probabilities equal to rounding."""
    from backend_src.ops import dispatch

    if dispatch.fused_cpu_kernels(torch.zeros(1)) is None:
        pytest.skip("numba is not importable")
    cb = _codebook(sizes=sizes)
    dec = _decoder(cb, nodes=nodes)
    states, lengths = _history(B=B, N=10)
    for mode in ("full", "pfa"):
        opts = DecodeOptions(mode=mode, beam_width=W, k=4, r=0.5)
        compiled = generate(dec, cb, states, lengths, opts)
        with monkeypatch.context() as m:
            m.setenv("GENREC_OPS_BACKEND", "torch")
            composed = generate(dec, cb, states, lengths, opts)
        assert torch.equal(compiled.item_ids, composed.item_ids), mode
        assert torch.equal(compiled.codes, composed.codes), mode
        assert torch.allclose(compiled.log_probs, composed.log_probs, atol=1e-5), mode


def test_compiled_expansion_breaks_ties_in_continuation_order():
    """Equal scores: the compiled expansion keeps the first continuations, best first, names a dead
    beam's codes and prefix -1, and carries the codes and their embeddings to the new beams."""
    from backend_src.decoding.beam_search import Beams, expand_beams
    from backend_src.ops import dispatch

    if dispatch.fused_cpu_kernels(torch.zeros(1)) is None:
        pytest.skip("numba is not importable")
    cb = _codebook(sizes=(4, 3, 3))
    dec = _decoder(cb)
    with torch.no_grad():
        dec.out[0].weight.zero_()  # every code of level 0 scores the same
        dec.out[0].bias.zero_()
    beams = Beams(lp=torch.tensor([[0.0, float("-inf")]]), prefix=torch.tensor([[0, -1]]),  # the second beam is dead
                  codes=torch.zeros(1, 2, 0, dtype=torch.long), prefix_emb=torch.zeros(1, 2, D))
    new, parent = expand_beams(dec, cb, 0, torch.randn(1, 2, D), beams, 6)
    assert parent.tolist() == [[0, 0, 0, 0, 1, 1]] and new.codes[..., 0].tolist() == [[0, 1, 2, 3, -1, -1]]
    assert torch.allclose(new.lp[0, :4], torch.full((4,), -math.log(4))) and torch.isinf(new.lp[0, 4:]).all()
    assert new.prefix[0, :4].tolist() == cb.child(0)[0].tolist() and new.prefix[0, 4:].tolist() == [-1, -1]
    assert torch.equal(new.prefix_emb[0, :4], dec.code_emb[0].weight) and (new.prefix_emb[0, 4:] == 0).all()


def test_pfa_keeping_every_row_attends_as_full_attention(monkeypatch):
    """A history no longer than every step's budget keeps all its rows: PFA does no ranking and
    decodes as full attention does."""
    from backend_src import ops as ops_module

    cb = _codebook()
    dec = _decoder(cb)
    states, lengths = _history(B=3, N=8)
    calls = []
    monkeypatch.setattr(ops_module, "pfa_select_rows", lambda *a, **k: calls.append(1))
    pfa = generate(dec, cb, states, lengths, DecodeOptions(mode="pfa", beam_width=5, k=32, r=0.5))  # budgets 32, 16, 8
    full = generate(dec, cb, states, lengths, DecodeOptions(mode="full", beam_width=5))
    assert not calls
    assert torch.equal(pfa.item_ids, full.item_ids) and torch.allclose(pfa.log_probs, full.log_probs, atol=1e-5)


def test_pfa_selection_changes_output():
    """Sanity: with a small budget PFA is not just full attention."""
    cb = _codebook()
    dec = _decoder(cb)
    states, lengths = _history(B=3, N=12, lengths=[12, 12, 12])
    full = generate(dec, cb, states, lengths, DecodeOptions(mode="full", beam_width=6))
    pfa = generate(dec, cb, states, lengths, DecodeOptions(mode="pfa", beam_width=6, k=2, r=0.5))
    assert not torch.allclose(full.log_probs, pfa.log_probs)


@pytest.mark.parametrize("s", [0, 1, 2])
@pytest.mark.parametrize("shared", [False, True])
def test_all_modes_equal_full_without_pruning(s, shared):
    cb = _codebook()
    dec = _decoder(cb, shared=shared)
    states, lengths = _history(B=4, N=10)
    full = generate(dec, cb, states, lengths, DecodeOptions(mode="full", beam_width=7))
    for mode in ("pfa", "pfa_per_beam", "dynamic_topk"):
        res = generate(dec, cb, states, lengths, DecodeOptions(mode=mode, beam_width=7, k=10, r=1.0, selection_step=s))
        assert torch.equal(res.item_ids, full.item_ids), mode
        assert torch.allclose(res.log_probs, full.log_probs, atol=1e-5), mode


def test_per_beam_equals_shared_ranking_with_one_beam():
    cb = _codebook()
    dec = _decoder(cb)
    states, lengths = _history(B=3, N=12)
    a = generate(dec, cb, states, lengths, DecodeOptions(mode="pfa", beam_width=1, k=4, r=0.5))
    b = generate(dec, cb, states, lengths, DecodeOptions(mode="pfa_per_beam", beam_width=1, k=4, r=0.5))
    assert torch.equal(a.item_ids, b.item_ids)
    assert torch.allclose(a.log_probs, b.log_probs, atol=1e-5)


def test_shared_kv_projection_is_one_projection():
    cb = _codebook()
    dec = _decoder(cb, shared=True)
    assert len(dec.kv_proj) == 1
    K, V = dec.project_history(torch.randn(2, 5, D))
    assert K.shape == (4, 2, 5, H, D // H)
    assert all(torch.equal(K[0], K[t]) and torch.equal(V[0], V[t]) for t in range(4))
    K2, _ = _decoder(cb, shared=False).project_history(torch.randn(2, 5, D))
    assert not torch.allclose(K2[0], K2[1])


# ---------------------------------------------------------------------------------------------
# training path
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("sizes", [(4, 3, 3), SPARSE_SIZES])
@pytest.mark.parametrize("nodes", [False, True])
def test_training_logits_causal_and_consistent_with_decoding(sizes, nodes):
    cb = _codebook(sizes=sizes)
    dec = _decoder(cb, nodes=nodes)
    B, N = 2, 9
    states, lengths = _history(B=B, N=N, lengths=[9, 6])
    target = cb.codes[torch.randint(1, cb.num_items + 1, (B, N))]  # [B, N, 4]
    with torch.no_grad():
        logits = dec.training_logits(states, lengths, target, cb)
        # the head on the rows of a mask alone: those rows' logits
        valid = torch.rand(B, N) < 0.5
        assert all(torch.allclose(a, b[valid], atol=1e-6)
                   for a, b in zip(dec.training_logits(states, lengths, target, cb, valid), logits))
        assert [lg.shape for lg in logits] == [(B, N, c) for c in cb.codebook_sizes]
        i = 4
        changed = states.clone()
        changed[:, i + 1:] += torch.randn_like(changed[:, i + 1:])
        other = dec.training_logits(changed, lengths, target, cb)
        for a, b in zip(logits, other):
            assert torch.allclose(a[:, : i + 1], b[:, : i + 1], atol=1e-6)
            assert not torch.allclose(a[:, i + 1:], b[:, i + 1:])
        # the query at the last position equals a decoding query with the same code prefix
        K, V = dec.project_history(states)
        last = lengths - 1
        ids = cb.level_prefixes(target[torch.arange(B), last])  # [B, 5]
        for t in range(4):
            prefix = sum((dec.code_embedding(target[torch.arange(B), last, l], l) for l in range(t)),
                         torch.zeros(B, D))
            x, q = dec.query(states[torch.arange(B), last], prefix[:, None], t)
            nxt = cb.next_prefixes(ids[:, t, None], t) if dec.has_node_output(t) else None  # every code's
            dl = dec.head(x, ops.decode_attention(q, K[t], V[t], lengths), t, nodes=nxt)[:, 0]
            assert torch.allclose(dl, logits[t][torch.arange(B), last], atol=1e-5)
    loss = dec.training_loss(states, lengths, target, cb)
    loss.backward()
    assert torch.isfinite(loss) and all(p.grad is not None for p in dec.kv_proj.parameters())
    if nodes:  # the vectors of prefixes that continue an item learn; -1's rows stay 0
        assert sum(e.weight.grad[:-1].abs().sum() for e in dec.node_emb.values()) > 0
        assert not any(e.weight.grad[-1].any() for e in dec.node_emb.values())


# ---------------------------------------------------------------------------------------------
# attention statistics
# ---------------------------------------------------------------------------------------------
def _records(weights):
    return [dict(step=t, weights=w) for t, w in enumerate(weights)]


def test_attention_stats_exact_on_constructed_attention():
    N = 8
    lengths = torch.tensor([8, 4])
    uniform = torch.zeros(2, N)
    uniform[0, :8] = 1 / 8
    uniform[1, :4] = 1 / 4
    one_hot = torch.zeros(2, N)
    one_hot[:, 0] = 1.0  # all mass on the oldest row
    stats = attention_stats(_records([uniform, one_hot, one_hot, one_hot]), lengths)
    # top 10%: ceil(0.8) = 1 row of 8 -> 1/8; ceil(0.4) = 1 row of 4 -> 1/4
    assert stats["top10_share_step0"] == pytest.approx((1 / 8 + 1 / 4) / 2)
    for t in (1, 2, 3):
        assert stats[f"top10_share_step{t}"] == pytest.approx(1.0)
    for t in (2, 3):
        assert stats[f"kept_top25_share_step{t}"] == pytest.approx(1.0)
        assert stats[f"reselect_top25_share_step{t}"] == pytest.approx(1.0)
        assert stats[f"recent25_share_step{t}"] == pytest.approx(0.0)
        assert stats[f"kept_minus_reselect_step{t}"] == pytest.approx(0.0)

    # rankings: step 2 keeps the step-1 order, step 3 reverses it; mass moves to the recent rows
    lengths = torch.tensor([8])
    desc = torch.arange(8, 0, -1.0)[None] / 36
    asc = torch.arange(1, 9.0)[None] / 36
    stats = attention_stats(_records([desc, desc, desc, asc]), lengths)
    assert stats["spearman_step1_vs_step2"] == pytest.approx(1.0)
    assert stats["spearman_step1_vs_step3"] == pytest.approx(-1.0)
    assert stats["spearman_top25_step1_vs_step3"] == pytest.approx(-1.0)
    assert stats["kept_top25_share_step3"] == pytest.approx((1 + 2) / 36)  # rows 0, 1
    assert stats["recent25_share_step3"] == pytest.approx((7 + 8) / 36)
    assert stats["reselect_top25_share_step3"] == pytest.approx((7 + 8) / 36)
    assert stats["top10_share_step0"] == pytest.approx(8 / 36)


def test_masked_spearman_matches_formula():
    g = torch.Generator().manual_seed(0)
    x, y = torch.rand(5, 20, generator=g), torch.rand(5, 20, generator=g)
    lengths = torch.tensor([20, 15, 10, 5, 2])
    mask = torch.arange(20)[None] < lengths[:, None]
    rho = masked_spearman(x, y, mask)
    for b in range(5):
        n = int(lengths[b])
        rx = x[b, :n].argsort().argsort().double()
        ry = y[b, :n].argsort().argsort().double()
        expected = 1 - 6 * ((rx - ry) ** 2).sum() / (n * (n * n - 1))
        assert rho[b].item() == pytest.approx(expected.item(), abs=1e-9)


def test_collect_attention_records_and_plot(tmp_path):
    cb = _codebook()
    dec = _decoder(cb)
    states, lengths = _history(B=3, N=12)
    res = generate(dec, cb, states, lengths, DecodeOptions(mode="full", beam_width=6, collect_attention=True))
    plain = generate(dec, cb, states, lengths, DecodeOptions(mode="full", beam_width=6))
    assert torch.equal(res.item_ids, plain.item_ids)
    assert [r["step"] for r in res.attention] == [0, 1, 2, 3]
    for rec in res.attention:
        w = rec["weights"]
        assert w.shape == (3, 12)
        assert torch.allclose(w.sum(1), torch.ones(3), atol=1e-5)
        beyond = torch.arange(12)[None] >= lengths[:, None]
        assert (w[beyond] == 0).all()
        assert torch.allclose(rec["beam_weights"].sum(1), torch.ones(3), atol=1e-5)
    stats = attention_stats(res.attention, lengths)
    assert 0 < stats["top10_share_step1"] <= 1
    path = tmp_path / "stats.png"
    plot_attention_stats(stats, path)
    assert path.stat().st_size > 1000
    with pytest.raises(ValueError):
        generate(dec, cb, states, lengths, DecodeOptions(mode="pfa", collect_attention=True))
