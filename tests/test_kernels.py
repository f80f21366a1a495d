"""Triton kernels against the torch reference ops, run on the CPU by Triton's interpreter.

Triton picks interpreter or compile mode when @triton.jit functions are decorated, for its own
language library (at `import triton`) as well as for our kernels. So this file sets
TRITON_INTERPRET=1 before Triton's first import, loads its own copy of the kernels package, and
puts the variable back. If Triton was already imported in compile mode by an earlier test file,
the tests rerun in a fresh interpreter process instead. The kernel ops are called directly (not
through the dispatcher), except in the tests of the dispatcher's one backend decision.
"""
from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

# Must precede the first import of triton in the process: Triton fixes interpreter mode for its
# own language library and for every kernel when they are decorated, i.e. at import time.
_SAVED_INTERPRET = os.environ.get("TRITON_INTERPRET")
if "triton" not in sys.modules:
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
# False when an earlier test file imported Triton for compiling: then this file reruns in a
# fresh process (test_in_fresh_interpreter_process) instead of mixing the two modes.
INTERPRETED = not isinstance(tl.zeros, triton.runtime.JITFunction)


def _load_interpreted_kernels():
    """A private copy of the kernels package whose kernels run in the interpreter."""
    from backend_src.ops.kernel_copies import KERNELS_PACKAGE, load_copy

    os.environ["TRITON_INTERPRET"] = "1"
    try:
        return load_copy(KERNELS_PACKAGE, "_genrec_triton_kernels_interpreted")
    finally:  # put the variable back so it does not leak into later test files
        if _SAVED_INTERPRET is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = _SAVED_INTERPRET


K = _load_interpreted_kernels() if INTERPRETED else None


@pytest.fixture(scope="module", autouse=True)
def _interpreter_env():
    """Triton also reads the variable while launching, so it is set for this file's tests only."""
    os.environ["TRITON_INTERPRET"] = "1"
    yield
    if _SAVED_INTERPRET is None:
        os.environ.pop("TRITON_INTERPRET", None)
    else:
        os.environ["TRITON_INTERPRET"] = _SAVED_INTERPRET


@pytest.fixture(autouse=True)
def _needs_interpreter(request):
    if not INTERPRETED and request.node.name != "test_in_fresh_interpreter_process":
        pytest.skip("Triton was imported in compile mode earlier in this process; "
                    "test_in_fresh_interpreter_process runs these tests in a fresh one")


def test_in_fresh_interpreter_process():
    if INTERPRETED:
        return  # the tests below run here
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    env.pop("GENREC_OPS_BACKEND", None)
    res = subprocess.run([sys.executable, "-m", "pytest", str(Path(__file__)), "-q", "-p", "no:cacheprovider"],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-6000:] + res.stderr[-3000:]


from backend_src.ops import dispatch  # noqa: E402
from backend_src.ops import reference as R  # noqa: E402

# fp32: kernel vs reference on the same inputs; fp16: kernel (fp32 accumulation) vs the reference
# on the same values upcast to fp32, within fp16 output rounding
TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.float16: dict(atol=1e-2, rtol=1e-2)}
PROB_TOL = {torch.float32: dict(atol=1e-5, rtol=1e-4), torch.float16: dict(atol=2e-3, rtol=1e-2)}
DTYPES = [torch.float32, torch.float16]
# (B, W, H, N, d, lengths): lengths cover 1, N and values in between
SHAPES = [
    (3, 5, 2, 40, 16, [1, 40, 17]),
    (2, 3, 1, 33, 32, [33, 2]),
]


def _decode_inputs(B, W, H, N, d, lengths, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, W, H, d, generator=g).to(dtype)
    k = torch.randn(B, N, H, d, generator=g).to(dtype)
    v = torch.randn(B, N, H, d, generator=g).to(dtype)
    return q, k, v, torch.tensor(lengths, dtype=torch.long)


def _f32(*ts):
    return [t.float() for t in ts]


def _close(actual, expected, tol):
    torch.testing.assert_close(actual.float(), expected.float(), **tol)


# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_decode_attention(shape, dtype):
    q, k, v, lengths = _decode_inputs(*shape, dtype)
    out = K.decode_attention(q, k, v, lengths)
    assert out.dtype == dtype and out.shape == q.shape
    _close(out, R.decode_attention(*_f32(q, k, v), lengths), TOL[dtype])


def test_decode_attention_strided_and_expanded():
    """Non-contiguous q, and K/V broadcast with stride 0 when every beam becomes its own batch row."""
    B, W, H, N, d = 2, 3, 2, 24, 16
    q, k, v, _ = _decode_inputs(B, W, H, N, d, [N] * B, torch.float32, seed=1)
    q_t = q.transpose(1, 2).contiguous().transpose(1, 2)  # same values, permuted strides
    lengths = torch.tensor([5, 24])
    _close(K.decode_attention(q_t, k, v, lengths), R.decode_attention(q, k, v, lengths), TOL[torch.float32])
    # beams as batch rows: q [B*W, 1, H, d]; user 0's K/V seen by all of them through stride 0
    qb = q.reshape(B * W, 1, H, d)
    kb = k[:1].expand(B * W, N, H, d)
    vb = v[:1].expand(B * W, N, H, d)
    assert kb.stride(0) == 0
    lb = torch.arange(1, B * W + 1) * 4
    _close(K.decode_attention(qb, kb, vb, lb), R.decode_attention(qb, kb.contiguous(), vb.contiguous(), lb),
           TOL[torch.float32])


def test_decode_attention_lengths_prefix_only():
    """Rows at or past lengths[b] are never read: poisoning them changes nothing."""
    q, k, v, lengths = _decode_inputs(2, 4, 2, 40, 16, [7, 30], torch.float32, seed=2)
    k2, v2 = k.clone(), v.clone()
    for b, n in enumerate(lengths.tolist()):
        k2[b, n:] = float("nan")
        v2[b, n:] = float("nan")
    _close(K.decode_attention(q, k2, v2, lengths), R.decode_attention(q, k, v, lengths), TOL[torch.float32])


# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_attention_probs(shape, dtype):
    q, k, _, lengths = _decode_inputs(*shape, dtype, seed=3)
    probs = K.attention_probs(q, k, lengths)
    assert probs.dtype == dtype and probs.shape == (*q.shape[:3], k.shape[1])
    ref = R.attention_probs(*_f32(q, k), lengths)
    _close(probs, ref, PROB_TOL[dtype])
    n = torch.arange(k.shape[1])
    assert (probs.float()[(n[None, :] >= lengths[:, None])[:, None, None, :].expand_as(probs)] == 0).all()
    _close(probs.float().sum(-1), torch.ones(probs.shape[:3]), PROB_TOL[dtype])


# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_selection_scores(shape, dtype):
    """The scores the two selections rank by: PFA's beam-pooled head mean (-inf past the length)
    and every beam's own head mean (0 past the length)."""
    q, k, _, lengths = _decode_inputs(*shape, dtype, seed=22)
    B, W = q.shape[:2]
    w = torch.softmax(torch.randn(B, W, generator=torch.Generator().manual_seed(23)), -1)
    mean = R.attention_probs(*_f32(q, k), lengths).mean(2)  # [B, W, N]
    past = torch.arange(k.shape[1])[None, :] >= lengths[:, None]
    pooled = torch.einsum("bw,bwn->bn", w, mean).masked_fill(past, float("-inf"))
    _close(K.decode.beam_head_mean(q, k, lengths), mean, PROB_TOL[dtype])
    _close(K.selection.pfa_scores(q, k, lengths, w), pooled, PROB_TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("keep", [8, 64])
@pytest.mark.parametrize("shape", SHAPES)
def test_pfa_select(shape, keep, dtype):
    q, k, v, lengths = _decode_inputs(*shape, dtype, seed=4)
    B, W = q.shape[:2]
    beam_weights = torch.softmax(torch.randn(B, W, generator=torch.Generator().manual_seed(5)), -1)
    order, kept = K.pfa_select(q, k, lengths, beam_weights, keep)
    r_order, r_kept = R.pfa_select(*_f32(q, k), lengths, beam_weights, keep)
    assert order.shape == r_order.shape == (B, min(keep, k.shape[1]))
    assert torch.equal(kept, r_kept)
    for b in range(B):  # entries past kept_lengths[b] are padding
        assert torch.equal(order[b, : kept[b]], r_order[b, : kept[b]])


def test_pfa_select_then_prefix_steps():
    """The PFA pipeline: select once, gather the kept rows contiguously, later steps read prefixes."""
    q, k, v, lengths = _decode_inputs(3, 4, 2, 40, 16, [1, 40, 23], torch.float32, seed=6)
    w = torch.softmax(torch.randn(3, 4, generator=torch.Generator().manual_seed(7)), -1)
    order, kept = K.pfa_select(q, k, lengths, w, 16)
    kg, vg = K.gather_rows(k, order), K.gather_rows(v, order)
    assert kg.is_contiguous() and torch.equal(kg, R.gather_rows(k, order))
    budget = torch.clamp(kept, max=8)
    _close(K.decode_attention(q, kg, vg, budget), R.decode_attention(q, kg, vg, budget), TOL[torch.float32])


# (B, W, H, N, d, lengths): N not a power of two; an empty history, histories shorter than keep
SELECT_ROWS_SHAPES = SHAPES + [(4, 3, 2, 37, 16, [0, 37, 5, 12])]


def _iota_rows(B, N, dtype):
    """[B, N, 1] holding each row's index (exact in fp16 up to 2048): gathered, it is the order."""
    return torch.arange(N, dtype=dtype)[None, :, None].expand(B, N, 1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("keep", [8, 64])
@pytest.mark.parametrize("shape", SELECT_ROWS_SHAPES)
def test_pfa_select_rows(shape, keep, dtype):
    """The fused selection + gather against the reference composition (pfa_select, then
    gather_rows): the same kept lengths and order (distinct scores), and the rows of its own
    order gathered exactly, for K and V as a decoder projects them (strided views of one tensor),
    the states, and every kept entry including the padding past kept_lengths."""
    B, W, H, N, d, lens = shape
    q, k, _, lengths = _decode_inputs(*shape, dtype, seed=24)
    w = torch.softmax(torch.randn(B, W, generator=torch.Generator().manual_seed(25)), -1)
    kv = torch.randn(B, N, 2, H, d, generator=torch.Generator().manual_seed(26)).to(dtype)
    kk, vv = kv[:, :, 0], kv[:, :, 1]  # as project_step returns them
    states = torch.randn(B, N, 24, generator=torch.Generator().manual_seed(27))
    (k_kept, v_kept), kept = K.pfa_select_rows(q, kk, lengths, w, keep, (kk, vv))
    (s_kept, order), kept2 = K.pfa_select_rows(q, kk, lengths, w, keep, (states, _iota_rows(B, N, dtype)))
    (r_k, r_v), r_kept = R.pfa_select_rows(*_f32(q, kk), lengths, w, keep, (kk, vv))
    r_order, _ = R.pfa_select(*_f32(q, kk), lengths, w, keep)
    order = order[..., 0].long()
    assert torch.equal(kept, r_kept) and torch.equal(kept2, r_kept)
    assert k_kept.shape == (B, min(keep, N), H, d) and k_kept.dtype == dtype and k_kept.is_contiguous()
    assert order.min() >= 0 and order.max() < N  # padding entries are real rows too
    for b in range(B):  # entries past kept_lengths[b] are padding
        n = int(kept[b])
        assert torch.equal(order[b, :n], r_order[b, :n])
        assert torch.equal(k_kept[b, :n], r_k[b, :n]) and torch.equal(v_kept[b, :n], r_v[b, :n])
    assert torch.equal(k_kept, R.gather_rows(kk, order)) and torch.equal(v_kept, R.gather_rows(vv, order))
    assert torch.equal(s_kept, R.gather_rows(states, order))


@pytest.mark.parametrize("N,keep", [(20, 7), (33, 33), (16, 16), (5, 3)])
def test_select_rows_ties_and_padding(N, keep):
    """The selecting kernel on given scores: best first, ties to the lower row (a stable
    descending sort), -inf rows after every finite one; more than two tensors (the third gathered
    by gather_rows), int64 and bool rows copied bit for bit."""
    g = torch.Generator().manual_seed(28)
    B = 3
    scores = torch.randint(0, 4, (B, N), generator=g).float() * 0.25  # many ties
    scores[0, N // 2:] = float("-inf")  # a short history
    scores[1] = 0.0  # every row tied
    scores[2, 0] = float("-inf")
    x = torch.randn(B, N, 3, 5, generator=g)
    ids = torch.randint(0, 10**12, (B, N), generator=g)
    flags = torch.rand(B, N, 2, generator=g) > 0.5
    order, (xk, idk, fk) = K.selection.select_rows(scores, keep, (x, ids, flags))
    expected = torch.sort(scores, dim=1, descending=True, stable=True).indices[:, :keep]
    assert torch.equal(order, expected)
    assert torch.equal(xk, R.gather_rows(x, expected)) and xk.is_contiguous()
    assert torch.equal(idk, R.gather_rows(ids, expected)) and torch.equal(fk, R.gather_rows(flags, expected))
    _, (fk, xk) = K.selection.select_rows(scores, keep, (flags, x))  # bool rows in the kernel
    assert torch.equal(fk, R.gather_rows(flags, expected)) and torch.equal(xk, R.gather_rows(x, expected))


def test_pfa_select_rows_long_histories_unfused(monkeypatch):
    """Past the longest history one program sorts, the op is the unfused composition."""
    q, k, v, lengths = _decode_inputs(2, 3, 2, 40, 16, [40, 9], torch.float32, seed=29)
    w = torch.softmax(torch.randn(2, 3, generator=torch.Generator().manual_seed(30)), -1)
    fused = K.pfa_select_rows(q, k, lengths, w, 16, (k, v))
    monkeypatch.setattr(K.selection, "SELECT_ROWS_MAX_N", 32)
    launches = []
    real = K.selection.select_rows
    monkeypatch.setattr(K.selection, "select_rows", lambda *a: launches.append(1) or real(*a))
    unfused = K.pfa_select_rows(q, k, lengths, w, 16, (k, v))
    assert not launches
    assert torch.equal(fused[1], unfused[1])
    for a, b in zip(fused[0], unfused[0]):  # past kept_lengths: padding (torch.topk's order of -inf)
        assert all(torch.equal(a[u, :n], b[u, :n]) for u, n in enumerate(fused[1].tolist()))


def test_pfa_select_rows_without_rows():
    """Nothing to gather: the kept lengths of the selection, as the reference returns them."""
    q, k, _, lengths = _decode_inputs(2, 3, 2, 40, 16, [40, 9], torch.float32, seed=31)
    w = torch.softmax(torch.randn(2, 3, generator=torch.Generator().manual_seed(32)), -1)
    rows, kept = K.pfa_select_rows(q, k, lengths, w, 16, ())
    r_rows, r_kept = R.pfa_select_rows(q, k, lengths, w, 16, ())
    assert rows == r_rows == () and torch.equal(kept, r_kept)


# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("keep", [1, 6, 64])
@pytest.mark.parametrize("shape", SHAPES)
def test_dynamic_topk_attention(shape, keep, dtype):
    q, k, v, lengths = _decode_inputs(*shape, dtype, seed=8)
    out = K.dynamic_topk_attention(q, k, v, lengths, keep)
    assert out.dtype == dtype and out.shape == q.shape
    _close(out, R.dynamic_topk_attention(*_f32(q, k, v), lengths, keep), TOL[dtype])


# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "dtype,tail", [(torch.float32, (2, 16)), (torch.float16, (2, 32)), (torch.int64, ()), (torch.float32, (3,))]
)
def test_gather_rows(dtype, tail):
    B, N, keep = 3, 40, 12
    g = torch.Generator().manual_seed(9)
    x = (torch.randn(B, N, *tail, generator=g) * 100).to(dtype)
    order = torch.stack([torch.randperm(N, generator=g)[:keep] for _ in range(B)])
    out = K.gather_rows(x, order)
    assert out.is_contiguous() and out.dtype == dtype
    assert torch.equal(out, R.gather_rows(x, order))


def test_gather_rows_strided_source():
    """A layer slice of a stacked [L, B, N, H, d] cache (batch stride not B-major)."""
    cache = torch.randn(2, 3, 40, 2, 16)
    x = cache[1]
    order = torch.randint(0, 40, (3, 9))
    assert torch.equal(K.gather_rows(x, order), R.gather_rows(x, order))
    xt = torch.randn(40, 3, 2, 16).transpose(0, 1)  # [B, N, H, d] with N-major storage
    assert torch.equal(K.gather_rows(xt, order), R.gather_rows(xt, order))


# --------------------------------------------------------------------------------------------
def _hstu_bias(H, P, T, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(H, P, generator=g), torch.randn(H, T, generator=g)


def _history_case(B, N, H, d, dv, num_history, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, N, H, d, generator=g).to(dtype)
    k = torch.randn(B, N, H, d, generator=g).to(dtype)
    v = torch.randn(B, N, H, dv, generator=g).to(dtype)
    pos = torch.arange(N)[None].expand(B, N)
    # gaps in seconds: exact bucket boundaries (0, 1, 2, 4, ...) and day-scale gaps
    gaps = torch.randint(0, 6, (B, N), generator=g) ** 3 + torch.randint(0, 3, (B, N), generator=g) * 86400
    ts = torch.cumsum(gaps, 1)
    nh = torch.tensor(num_history, dtype=torch.long)
    q_self = torch.full((B, N), -1, dtype=torch.long)
    return q, k, v, pos, pos, ts, ts, nh, q_self


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d,dv", [(16, 16), (32, 16)])
def test_hstu_attention_causal_history(d, dv, dtype):
    B, N, H, P, T = 2, 37, 2, 16, 20
    args = _history_case(B, N, H, d, dv, [37, 11], dtype, seed=10)
    pb, tb = _hstu_bias(H, P, T, seed=11)
    extra = (1.6, d ** -0.5, 40.0)
    out = K.hstu_attention(*args, pb, tb, *extra)
    assert out.dtype == dtype and out.shape == (B, N, H, dv)
    ref = R.hstu_attention(*_f32(*args[:3]), *args[3:], pb, tb, *extra)
    _close(out, ref, TOL[dtype] if dtype == torch.float32 else dict(atol=2e-3, rtol=1e-2))


@pytest.mark.parametrize("dtype", DTYPES)
def test_hstu_attention_mfalcon_candidates(dtype):
    """Candidates see the whole history plus themselves, never each other; history rows stay causal."""
    B, Nh, M, H, d, P, T = 3, 30, 6, 2, 16, 16, 24
    q_h, k_h, v_h, pos, _, ts, _, nh, _ = _history_case(B, Nh, H, d, d, [30, 1, 19], dtype, seed=12)
    g = torch.Generator().manual_seed(13)
    q_c = torch.randn(B, M, H, d, generator=g).to(dtype)
    k_c = torch.randn(B, M, H, d, generator=g).to(dtype)
    v_c = torch.randn(B, M, H, d, generator=g).to(dtype)
    k = torch.cat([k_h, k_c], 1)
    v = torch.cat([v_h, v_c], 1)
    last_ts = ts.gather(1, (nh - 1)[:, None])
    k_pos = torch.cat([pos, nh[:, None].expand(B, M)], 1)
    k_ts = torch.cat([ts, (last_ts + 7).expand(B, M)], 1)
    # candidates alone, then history and candidates in one call (full encode with targets)
    cand = (q_c, k, v, nh[:, None].expand(B, M), k_pos, last_ts.expand(B, M), k_ts, nh,
            (Nh + torch.arange(M))[None].expand(B, M))
    both = (torch.cat([q_h, q_c], 1), k, v, k_pos, k_pos, torch.cat([ts, last_ts.expand(B, M)], 1), k_ts, nh,
            torch.cat([torch.full((B, Nh), -1), (Nh + torch.arange(M))[None].expand(B, M)], 1))
    pb, tb = _hstu_bias(H, P, T, seed=14)
    extra = (1.6, d ** -0.5, 36.0)
    tol = TOL[dtype] if dtype == torch.float32 else dict(atol=2e-3, rtol=1e-2)
    for args in (cand, both):
        out = K.hstu_attention(*args, pb, tb, *extra)
        ref = R.hstu_attention(*_f32(*args[:3]), *args[3:], pb, tb, *extra)
        _close(out, ref, tol)


@pytest.mark.parametrize("Nh,num_history", [(30, [30, 1, 19]), (1, [1, 1, 1])])
def test_hstu_attention_own_keys_equals_the_general_mask(Nh, num_history):
    """shared["own_keys"] (the ranker's layout: query i's own key is the i-th of the last M) skips
    the [M, M] block among the candidates' keys; the answer is the general mask's, in every layer
    of a pass (the layout computed once and reused)."""
    B, M, H, d = 3, 7, 2, 16
    _, k_h, v_h, pos, _, ts, _, nh, _ = _history_case(B, Nh, H, d, d, num_history, torch.float32, seed=21)
    g = torch.Generator().manual_seed(22)
    q_c, k_c, v_c = (torch.randn(B, M, H, d, generator=g) for _ in range(3))
    last_ts = ts.gather(1, (nh - 1)[:, None])
    args = (q_c, torch.cat([k_h, k_c], 1), torch.cat([v_h, v_c], 1), nh[:, None].expand(B, M),
            torch.cat([pos, nh[:, None].expand(B, M)], 1), last_ts.expand(B, M),
            torch.cat([ts, last_ts.expand(B, M)], 1), nh, (Nh + torch.arange(M))[None].expand(B, M),
            *_hstu_bias(H, 16, 24, seed=23), 1.6, d ** -0.5, 36.0)
    ref = R.hstu_attention(*args)
    shared = {"own_keys": M}
    for _ in range(2):
        _close(R.hstu_attention(*args, shared=shared), ref, TOL[torch.float32])
    assert "hstu_own_layout" in shared and "hstu_layout" not in shared
    # the history block's biases are computed for one query per row: queries at other positions are refused
    moved = list(args)
    moved[3] = moved[3] + torch.arange(M)[None]
    with pytest.raises(ValueError, match="share one position"):
        R.hstu_attention(*moved, shared={"own_keys": M})


@pytest.mark.parametrize("shuffle", [False, True])
def test_hstu_attention_several_query_blocks(shuffle):
    """More queries than one block: later key tiles are skipped for early query blocks (causal),
    which must also hold when positions are not in index order."""
    B, N, H, d = 1, 80, 1, 16
    q, k, v, pos, _, ts, _, nh, q_self = _history_case(B, N, H, d, d, [80], torch.float32, seed=17)
    if shuffle:
        pos = torch.randperm(N, generator=torch.Generator().manual_seed(18))[None]
    pb, tb = _hstu_bias(H, 16, 20, seed=19)
    args = (q, k, v, pos, pos, ts, ts, nh, q_self, pb, tb, 1.6, d ** -0.5, 80.0)
    _close(K.hstu_attention(*args), R.hstu_attention(*args), TOL[torch.float32])


def test_time_bucket_thresholds_match_reference():
    """thr[t] is the first float32 whose reference bucket is t: the float just below it is in t - 1."""
    for T, base in [(64, 1.6), (20, 2.0), (8, 10.0)]:
        thr = R.time_bucket_thresholds(T, base)
        assert thr.dtype == torch.float32 and thr[0] == 0 and thr[-1] == math.inf
        inner = thr[1:-1]
        reach = torch.isfinite(inner)
        assert reach.any()
        below = torch.nextafter(inner[reach], torch.tensor(0.0))
        assert torch.equal(R.time_bucket(inner[reach], T, base), torch.arange(1, T)[reach])
        assert torch.equal(R.time_bucket(below, T, base), torch.arange(0, T - 1)[reach])


def test_time_bucket_by_thresholds_equals_the_formula():
    """What a GPU computes (the thresholds counted) equals the CPU's formula, boundaries included."""
    g = torch.Generator().manual_seed(24)
    for T, base in [(64, 1.6), (20, 2.0)]:
        thr = R.time_bucket_thresholds(T, base)
        edges = thr[1:-1][torch.isfinite(thr[1:-1])]
        dt = torch.cat([edges, torch.nextafter(edges, torch.tensor(0.0)), torch.zeros(1),
                        torch.randint(0, 1 << 40, (20000,), generator=g).to(torch.float32)])
        assert torch.equal(R.bucket_by_thresholds(dt, T, base), R.time_bucket(dt, T, base))


def test_hstu_time_buckets_exact_for_large_timestamps():
    """Epoch-second timestamps and gaps beyond float32's exact integers: same buckets as the reference."""
    B, N, H, d = 1, 24, 1, 16
    q, k, v, pos, _, _, _, nh, q_self = _history_case(B, N, H, d, d, [N], torch.float32, seed=22)
    g = torch.Generator().manual_seed(23)
    ts = 1_700_000_000 + torch.cumsum(torch.randint(0, 1 << 27, (B, N), generator=g), 1)
    tb = torch.randn(H, 64, generator=g) * 3  # large time bias: a wrong bucket shows
    pb = torch.zeros(H, 16)
    args = (q, k, v, pos, pos, ts, ts, nh, q_self, pb, tb, 1.6, d ** -0.5, float(N))
    _close(K.hstu_attention(*args), R.hstu_attention(*args), TOL[torch.float32])


def test_time_bucket_int_thresholds_match_reference():
    """c[t] is the first integer |dt| whose reference bucket is t: the integer below it is in a lower one."""
    for T, base in [(64, 1.6), (20, 2.0), (8, 10.0)]:
        c = R.time_bucket_int_thresholds(T, base)
        assert c.dtype == torch.int64 and c[0] == 0 and c[-1] == R.INT_THRESHOLD_INF
        reach = c[1:-1] < R.INT_THRESHOLD_INF
        assert reach.any() and torch.all(c[1:][reach.nonzero()[:, 0] + 1] > c[:-1][reach.nonzero()[:, 0] + 1] - 1)
        inner = c[1:-1][reach]
        assert torch.equal(R.time_bucket(inner, T, base), torch.arange(1, T)[reach])
        assert torch.all(R.time_bucket(inner - 1, T, base) < torch.arange(1, T)[reach])
    # past 2^24 float32 rounds the integer: the threshold is where the rounded value reaches thr
    c = R.time_bucket_int_thresholds(64, 1.6)
    big = c[(c > (1 << 25)) & (c < R.INT_THRESHOLD_INF)]
    assert len(big) > 0 and torch.all(big.to(torch.float32) >= R.time_bucket_thresholds(64, 1.6)[
        torch.searchsorted(c, big)])


def _fast_tiles(q_ts, k_ts, num_q, num_k, block, steps, T=64, base=1.6):
    """(tiles on the per-row path, all tiles) of a causal encode with index-ordered positions, as
    the kernel decides them: every query row after the tile's keys, its buckets spanning <= steps."""
    fast = total = 0
    for m0 in range(0, num_q, block):
        qt = q_ts[m0:m0 + block]
        for n0 in range(0, min(num_k, m0 + block), block):
            kt = k_ts[n0:min(n0 + block, num_k)]
            near, far = qt - kt.max(), qt - kt.min()
            span = R.time_bucket(far, T, base) - R.time_bucket(near, T, base)
            fast += bool(torch.all((near >= 0) & (span <= steps)))
            total += 1
    return fast, total


@pytest.mark.parametrize("epoch", [0, 1_700_000_000])
def test_hstu_time_bias_per_row_path(epoch):
    """The per-row bucket path takes most tiles of a long history and gives the same output, bit for
    bit, as every pair's own bucket, and the reference's within tolerance; with epoch timestamps and
    gaps past float32's exact integers the integer thresholds must reproduce the float rounding."""
    B, N, H, d, T = 1, 256, 1, 16, 64
    q, k, v, pos, _, _, _, nh, q_self = _history_case(B, N, H, d, d, [N], torch.float32, seed=30)
    g = torch.Generator().manual_seed(31)
    # mixed gaps: seconds to days, some beyond 2^24 s, so tiles span few or many buckets
    gaps = torch.randint(0, 1 << 12, (B, N), generator=g) * torch.randint(1, 1 << 13, (B, N), generator=g)
    ts = epoch + torch.cumsum(gaps, 1)
    pb = torch.randn(H, N, generator=g)
    tb = torch.randn(H, T, generator=g) * 3  # large time bias: a wrong bucket shows
    args = (q, k, v, pos, pos, ts, ts, nh, q_self, pb, tb, 1.6, d ** -0.5, float(N))
    fast, total = _fast_tiles(ts[0], ts[0], N, N, 64, 3)
    # 10 tiles: 4 diagonal, 3 next to it (per pair); the 3 others take the per-row path
    assert (fast, total) == (3, 10)
    tile = (64, 64, 4, 1)  # the tiles _fast_tiles counts
    out = K.hstu.launch_hstu(*args, tiles=tile, time_steps=3)
    assert torch.equal(out, K.hstu.launch_hstu(*args, tiles=tile, time_steps=0))
    _close(out, R.hstu_attention(*args), TOL[torch.float32])


@pytest.mark.parametrize("t0", [20, 40])
def test_hstu_time_bias_per_row_path_at_thresholds(t0):
    """Keys at |dt| = c[t] - 1, c[t], c[t] + 1 of the later query rows (bucket 40: past 2^24 s, where
    float32 rounds the integer): the per-row path decides every boundary as the reference does."""
    B, N, H, d, T = 1, 256, 1, 16, 64
    q, k, v, pos, _, _, _, nh, q_self = _history_case(B, N, H, d, d, [N], torch.float32, seed=34)
    c = R.time_bucket_int_thresholds(T, 1.6)
    Q = 1_700_000_000_000
    j = torch.arange(64)
    ts = torch.full((N,), Q - 10)
    ts[:64] = Q - c[t0 + j % 3] + (j // 3) % 3 - 1  # first key tile: three thresholds, each +-1
    ts[128:] = Q + torch.arange(128) % 2  # the last two query blocks: at Q and one second later
    ts = ts[None]
    g = torch.Generator().manual_seed(35)
    pb, tb = torch.randn(H, N, generator=g), torch.randn(H, T, generator=g) * 3
    args = (q, k, v, pos, pos, ts, ts, nh, q_self, pb, tb, 1.6, d ** -0.5, float(N))
    assert _fast_tiles(ts[0], ts[0], N, N, 64, 3)[0] >= 2  # (block 2 or 3, key tile 0)
    tile = (64, 64, 4, 1)
    out = K.hstu.launch_hstu(*args, tiles=tile, time_steps=3)
    assert torch.equal(out, K.hstu.launch_hstu(*args, tiles=tile, time_steps=0))
    _close(K.hstu_attention(*args), out, TOL[torch.float32])  # the op's own tile
    _close(out, R.hstu_attention(*args), TOL[torch.float32])


def test_hstu_time_bias_per_row_path_candidates_and_fp16():
    """M-FALCON candidates after a long history (every history tile on the per-row path) in fp16."""
    B, Nh, M, H, d, T = 2, 192, 5, 2, 16, 64
    q_h, k_h, v_h, pos, _, _, _, nh, _ = _history_case(B, Nh, H, d, d, [192, 130], torch.float16, seed=32)
    g = torch.Generator().manual_seed(33)
    ts = torch.cumsum(torch.randint(0, 5 * 86400, (B, Nh), generator=g), 1)
    q_c = torch.randn(B, M, H, d, generator=g).half()
    k = torch.cat([k_h, torch.randn(B, M, H, d, generator=g).half()], 1)
    v = torch.cat([v_h, torch.randn(B, M, H, d, generator=g).half()], 1)
    last_ts = ts.gather(1, (nh - 1)[:, None]) + 3600
    k_pos = torch.cat([pos, nh[:, None].expand(B, M)], 1)
    k_ts = torch.cat([ts, last_ts.expand(B, M)], 1)
    args = (q_c, k, v, nh[:, None].expand(B, M), k_pos, last_ts.expand(B, M), k_ts, nh,
            (Nh + torch.arange(M))[None].expand(B, M), torch.randn(H, Nh + 1, generator=g).half(),
            (torch.randn(H, T, generator=g) * 3).half(), 1.6, d ** -0.5, float(Nh))
    out = K.hstu.launch_hstu(*args, time_steps=3)
    assert torch.equal(out, K.hstu.launch_hstu(*args, time_steps=0))
    ref = R.hstu_attention(*_f32(*args[:3]), *args[3:9], args[9].float(), args[10].float(), *args[11:])
    _close(out, ref, dict(atol=2e-3, rtol=1e-2))


# --------------------------------------------------------------------------------------------
def test_dispatcher_routes_to_kernels(monkeypatch):
    """With the backend forced to Triton, the public ops run these kernels under the same names."""
    monkeypatch.setenv("GENREC_OPS_BACKEND", "triton")
    monkeypatch.setattr(dispatch, "_triton_module", lambda: K)
    calls = []
    real = K.decode_attention
    monkeypatch.setattr(K, "decode_attention", lambda *a: calls.append(1) or real(*a))
    q, k, v, lengths = _decode_inputs(2, 3, 2, 20, 16, [20, 4], torch.float32, seed=15)
    out = dispatch.decode_attention(q, k, v, lengths)
    assert calls and torch.allclose(out, R.decode_attention(q, k, v, lengths), atol=1e-4)
    for name in ("hstu_attention", "attention_probs", "decode_attention", "pfa_select", "pfa_select_rows",
                 "dynamic_topk_attention", "gather_rows"):
        assert callable(getattr(K, name)) and callable(getattr(dispatch, name))


def test_unsupported_inputs_use_reference(monkeypatch):
    """Other dtypes (float64) and empty inputs: the dispatcher's one decision sends them to the
    reference, even with the backend forced to Triton (the kernels' supports says no)."""
    monkeypatch.setenv("GENREC_OPS_BACKEND", "triton")
    monkeypatch.setattr(dispatch, "_triton_module", lambda: K)
    q, k, v, lengths = _decode_inputs(2, 3, 2, 20, 16, [20, 4], torch.float64, seed=16)
    assert not K.supports("decode_attention", (q, k, v, lengths), {})
    torch.testing.assert_close(dispatch.decode_attention(q, k, v, lengths), R.decode_attention(q, k, v, lengths))
    empty = torch.empty(0, 3, 2, 16)
    assert dispatch.attention_probs(empty, torch.empty(0, 20, 2, 16), torch.empty(0, dtype=torch.long)).shape \
        == (0, 3, 2, 20)
    q32, k32, v32 = _f32(q, k, v)
    assert K.supports("decode_attention", (q32, k32, v32, lengths), {})
    assert K.supports("dynamic_topk_attention", (q32, k32, v32, lengths, 4), {"return_indices": True})
    assert K.supports("gather_rows", (q, lengths[:, None]), {})  # rows are copied in any dtype
    assert not K.supports("no_such_op", (q32,), {})


def test_calls_needing_gradients_use_reference(monkeypatch):
    """The kernels are forward-only: training through the ops must keep its autograd graph, and
    without gradients the same call runs the kernel."""
    monkeypatch.setenv("GENREC_OPS_BACKEND", "triton")
    monkeypatch.setattr(dispatch, "_triton_module", lambda: K)
    calls = []
    real = K.hstu_attention
    monkeypatch.setattr(K, "hstu_attention", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    args = list(_history_case(1, 12, 1, 16, 16, [12], torch.float32, seed=20))
    pb, tb = _hstu_bias(1, 8, 8, seed=21)
    pb.requires_grad_(True)
    out = dispatch.hstu_attention(*args, pb, tb, 1.6, 0.25, 12.0)
    assert out.grad_fn is not None and not calls
    out.sum().backward()
    assert pb.grad is not None
    with torch.no_grad():
        assert dispatch.hstu_attention(*args, pb, tb, 1.6, 0.25, 12.0).grad_fn is None
    assert calls == [1]
    rows = torch.randn(1, 12, 4, requires_grad=True)  # a tensor of the rows tuple counts too
    w = torch.ones(1, 12)
    (kept,), _ = dispatch.pfa_select_rows(args[0], args[1], args[7], w, 4, (rows,))
    assert kept.grad_fn is not None


def test_the_kernels_do_not_choose_a_backend():
    """dispatch.kernels_for is the one backend decision: no kernel module hands a call to the
    reference's ops or looks at autograd (the reference serves only its tables to the HSTU kernel)."""
    from backend_src.ops.kernel_copies import KERNELS_PACKAGE

    ops = ("hstu_attention", "attention_probs", "decode_attention", "pfa_select", "pfa_select_rows",
           "dynamic_topk_attention", "gather_rows")
    for path in sorted(KERNELS_PACKAGE.glob("*.py")):
        text = path.read_text()
        assert "is_grad_enabled" not in text and "requires_grad" not in text, path.name
        assert not [op for op in ops if f"reference.{op}(" in text], path.name


@pytest.mark.parametrize("mode", ["full", "pfa", "pfa_per_beam", "dynamic_topk"])
def test_beam_search_through_kernels_matches_reference(monkeypatch, mode):
    """A whole semantic-ID decode with every op on the kernels (as on a GPU) returns the items and
    scores of the decode on the torch reference: the kernels fit the decoder's calls, not only
    the shapes of the op tests."""
    from backend_src.config import DecodeOptions, ModelConfig
    from backend_src.decoding.beam_search import generate
    from backend_src.model.decoder import SemanticIdDecoder
    from backend_src.model.semantic_ids import SemanticIdCodebook
    from perf.bench_decode import synthetic_codes

    codebook = SemanticIdCodebook.from_codes(synthetic_codes(300, prefix_sizes=(8, 8, 8), max_group=4))
    cfg = ModelConfig(num_items=300, d_model=32, decoder_heads=2, max_seq_len=40,
                      codebook_sizes=codebook.codebook_sizes)
    torch.manual_seed(0)
    decoder = SemanticIdDecoder(cfg).eval()
    states = torch.randn(3, 40, 32, generator=torch.Generator().manual_seed(1))
    lengths = torch.tensor([40, 17, 3])
    opts = DecodeOptions(mode=mode, beam_width=6, k=12, r=0.5)
    with torch.inference_mode():
        monkeypatch.setenv("GENREC_OPS_BACKEND", "torch")
        ref = generate(decoder, codebook, states, lengths, opts)
        monkeypatch.setenv("GENREC_OPS_BACKEND", "triton")
        monkeypatch.setattr(dispatch, "_triton_module", lambda: K)
        calls = []
        for name in ("decode_attention", "pfa_select", "pfa_select_rows", "dynamic_topk_attention", "gather_rows"):
            real = getattr(K, name)
            monkeypatch.setattr(K, name, lambda *a, _f=real, _n=name, **kw: calls.append(_n) or _f(*a, **kw))
        got = generate(decoder, codebook, states, lengths, opts)
    characteristic = {"full": "decode_attention", "pfa": "pfa_select_rows", "pfa_per_beam": "dynamic_topk_attention",
                      "dynamic_topk": "dynamic_topk_attention"}
    assert characteristic[mode] in calls
    assert torch.equal(got.item_ids, ref.item_ids)
    torch.testing.assert_close(got.log_probs, ref.log_probs, atol=1e-4, rtol=1e-4)
