"""The attention policies behind `generate` (decoding/attention_policies.py): the refactored
single-loop beam search returns what the pre-refactor four-way mode switch returned.

REFERENCE was computed from the previous `beam_search.generate` (before the policies) on the
small random decoders built below: for every mode x selection step {0, 1, 2} x (k, r) x
per-step/shared K/V projections, plus collect_attention. Item ids and codes are compared exactly
(sha256), log-probabilities and attention records by sums (float rounding only); the new code
was also checked bitwise against the old one on these cases and more seeds when it was written.
"""
import hashlib

import pytest
import torch

from backend_src import ops
from backend_src.config import DecodeOptions
from backend_src.decoding import generate
from backend_src.decoding.attention_policies import (
    POLICIES,
    DynamicTopK,
    FullAttention,
    ProgressiveFocus,
    ProgressiveFocusPerBeam,
    attention_policy,
    beam_weights,
)
from backend_src.model.semantic_ids import SemanticIdCodebook, assign_collision_codes
from test_decoding import D, H, _decoder  # the decoder the decoding tests use
MODES = ("full", "pfa", "pfa_per_beam", "dynamic_topk")
KR = ((3, 0.5), (5, 0.3), (8, 1.0))


def setup(shared, sizes=(4, 3, 3), seed=0):
    g = torch.Generator().manual_seed(seed)
    codes3 = torch.stack([torch.randint(c, (60,), generator=g) for c in sizes], 1)
    cb = SemanticIdCodebook.from_codes(assign_collision_codes(codes3))
    dec = _decoder(cb, seed=seed, shared=shared)
    g = torch.Generator().manual_seed(seed + 1)
    states = torch.randn(4, 12, D, generator=g)
    lengths = torch.tensor([12, 7, 2, 1])
    return dec, cb, states, lengths


def cases():
    for shared in (False, True):
        for mode in MODES:
            for s in (0, 1, 2):
                for k, r in KR:
                    yield f"{mode}-s{s}-k{k}-r{r}-{'shared' if shared else 'step'}", shared, DecodeOptions(
                        mode=mode, beam_width=6, k=k, r=r, selection_step=s)
        yield f"full-collect-{'shared' if shared else 'step'}", shared, DecodeOptions(
            mode="full", beam_width=6, collect_attention=True)


def digest(res):
    """exact: item ids and codes (sha256); floats: sums."""
    h = hashlib.sha256(res.item_ids.numpy().astype("int64").tobytes() + res.codes.numpy().astype("int64").tobytes())
    lp = res.log_probs.double()
    fin = torch.isfinite(lp)
    pos = torch.arange(1, lp.numel() + 1, dtype=torch.float64).view_as(lp)
    att = []
    for rec in res.attention:
        n = rec["weights"].shape[-1]
        wpos = torch.arange(1, n + 1, dtype=torch.float64)
        att.append((rec["step"], tuple(rec["per_beam"].shape),
                    round(float((rec["weights"].double() * wpos).sum()), 6),
                    round(float((rec["beam_weights"].double()).sum()), 6),
                    round(float((rec["per_beam"].double() * wpos).sum()), 6)))
    return (h.hexdigest()[:20], int(fin.sum()), round(float(lp[fin].sum()), 6),
            round(float((lp[fin] * pos[fin]).sum()), 6), tuple(att))


# from the pre-refactor generate: name -> (sha256 of items+codes, #finite log-probs, sum, position-weighted
# sum, attention records (step, per_beam shape, weighted sums))
REFERENCE = {
    'full-s0-k3-r0.5-step': ('5a21b897d8d221580025', 24, -59.374923, -785.890158, ()),
    'full-s0-k5-r0.3-step': ('5a21b897d8d221580025', 24, -59.374923, -785.890158, ()),
    'full-s0-k8-r1.0-step': ('5a21b897d8d221580025', 24, -59.374923, -785.890158, ()),
    'full-s1-k3-r0.5-step': ('5a21b897d8d221580025', 24, -59.374923, -785.890158, ()),
    'full-s1-k5-r0.3-step': ('5a21b897d8d221580025', 24, -59.374923, -785.890158, ()),
    'full-s1-k8-r1.0-step': ('5a21b897d8d221580025', 24, -59.374923, -785.890158, ()),
    'full-s2-k3-r0.5-step': ('5a21b897d8d221580025', 24, -59.374923, -785.890158, ()),
    'full-s2-k5-r0.3-step': ('5a21b897d8d221580025', 24, -59.374923, -785.890158, ()),
    'full-s2-k8-r1.0-step': ('5a21b897d8d221580025', 24, -59.374923, -785.890158, ()),
    'pfa-s0-k3-r0.5-step': ('4e86d6d4939bce01f8e1', 24, -58.091335, -768.066925, ()),
    'pfa-s0-k5-r0.3-step': ('e1e20a9a016fd25472e0', 24, -59.473121, -768.863488, ()),
    'pfa-s0-k8-r1.0-step': ('4976381b2e20aaa7eb5e', 24, -59.780704, -786.583522, ()),
    'pfa-s1-k3-r0.5-step': ('a19dd96ba54eab984712', 24, -58.484433, -767.657528, ()),
    'pfa-s1-k5-r0.3-step': ('a19dd96ba54eab984712', 24, -58.642183, -769.209327, ()),
    'pfa-s1-k8-r1.0-step': ('6e411016886891532b9c', 24, -59.721663, -787.234685, ()),
    'pfa-s2-k3-r0.5-step': ('9b74bb46a5c3e4696861', 24, -59.766621, -788.109325, ()),
    'pfa-s2-k5-r0.3-step': ('47d85b9ae335c3875b32', 24, -60.611477, -795.564556, ()),
    'pfa-s2-k8-r1.0-step': ('d09acf1d46c764dfd213', 24, -59.710598, -787.878188, ()),
    'pfa_per_beam-s0-k3-r0.5-step': ('4e86d6d4939bce01f8e1', 24, -58.091335, -768.066919, ()),
    'pfa_per_beam-s0-k5-r0.3-step': ('e1e20a9a016fd25472e0', 24, -59.47312, -768.863476, ()),
    'pfa_per_beam-s0-k8-r1.0-step': ('4976381b2e20aaa7eb5e', 24, -59.780703, -786.583508, ()),
    'pfa_per_beam-s1-k3-r0.5-step': ('554e484d34473c39cd3e', 24, -59.621647, -777.975114, ()),
    'pfa_per_beam-s1-k5-r0.3-step': ('8d703c75d1f9a12d40ad', 24, -59.391214, -776.036193, ()),
    'pfa_per_beam-s1-k8-r1.0-step': ('d71e97d1b3b0a01a40b5', 24, -59.586216, -786.91568, ()),
    'pfa_per_beam-s2-k3-r0.5-step': ('ed88ed6fd8a1d6903d9b', 24, -59.283902, -785.067343, ()),
    'pfa_per_beam-s2-k5-r0.3-step': ('ecf62293e59abb063624', 24, -59.350762, -787.065734, ()),
    'pfa_per_beam-s2-k8-r1.0-step': ('3ee3604fcfb231a0f25f', 24, -59.775646, -788.026962, ()),
    'dynamic_topk-s0-k3-r0.5-step': ('0991052fbbcf552a38ca', 24, -61.667968, -785.804664, ()),
    'dynamic_topk-s0-k5-r0.3-step': ('b5f9baa248a9ae1e08dd', 24, -58.703339, -770.984778, ()),
    'dynamic_topk-s0-k8-r1.0-step': ('6156d393f865404b6fc8', 24, -59.486929, -784.513466, ()),
    'dynamic_topk-s1-k3-r0.5-step': ('a03bbe8521bf4358525b', 24, -58.918586, -782.669457, ()),
    'dynamic_topk-s1-k5-r0.3-step': ('d6d463c16f350471a608', 24, -58.875537, -783.024042, ()),
    'dynamic_topk-s1-k8-r1.0-step': ('b17cd37a8f3563f2fbe6', 24, -59.691342, -788.113294, ()),
    'dynamic_topk-s2-k3-r0.5-step': ('a794e570bcf7ebc4b1e7', 24, -58.932856, -782.702724, ()),
    'dynamic_topk-s2-k5-r0.3-step': ('cb60acbc8590eedbd370', 24, -58.999716, -784.446793, ()),
    'dynamic_topk-s2-k8-r1.0-step': ('5a21b897d8d221580025', 24, -59.426735, -786.195538, ()),
    'full-collect-step': ('5a21b897d8d221580025', 24, -59.374923, -785.890139, ((0, (4, 1, 12), 12.962089, 4.0, 12.962089), (1, (4, 4, 12), 12.75401, 4.0, 52.358843), (2, (4, 6, 12), 13.433263, 4.0, 80.274722), (3, (4, 6, 12), 13.316587, 4.0, 79.651444))),
    'full-s0-k3-r0.5-shared': ('92b62ca5b1ad57891682', 24, -52.92056, -690.569014, ()),
    'full-s0-k5-r0.3-shared': ('92b62ca5b1ad57891682', 24, -52.92056, -690.569014, ()),
    'full-s0-k8-r1.0-shared': ('92b62ca5b1ad57891682', 24, -52.92056, -690.569014, ()),
    'full-s1-k3-r0.5-shared': ('92b62ca5b1ad57891682', 24, -52.92056, -690.569014, ()),
    'full-s1-k5-r0.3-shared': ('92b62ca5b1ad57891682', 24, -52.92056, -690.569014, ()),
    'full-s1-k8-r1.0-shared': ('92b62ca5b1ad57891682', 24, -52.92056, -690.569014, ()),
    'full-s2-k3-r0.5-shared': ('92b62ca5b1ad57891682', 24, -52.92056, -690.569014, ()),
    'full-s2-k5-r0.3-shared': ('92b62ca5b1ad57891682', 24, -52.92056, -690.569014, ()),
    'full-s2-k8-r1.0-shared': ('92b62ca5b1ad57891682', 24, -52.92056, -690.569014, ()),
    'pfa-s0-k3-r0.5-shared': ('5be3a0ba6ca94a04d647', 24, -54.531249, -716.006077, ()),
    'pfa-s0-k5-r0.3-shared': ('b5b4ce5ca0f6104eef08', 24, -55.607521, -727.400133, ()),
    'pfa-s0-k8-r1.0-shared': ('49c5eff778df767d93dd', 24, -52.148189, -687.301872, ()),
    'pfa-s1-k3-r0.5-shared': ('bdb09928310e22a6dc55', 24, -53.963643, -702.731245, ()),
    'pfa-s1-k5-r0.3-shared': ('1422b34fee1aa6116dbe', 24, -54.100868, -703.653034, ()),
    'pfa-s1-k8-r1.0-shared': ('92b62ca5b1ad57891682', 24, -53.203614, -692.051646, ()),
    'pfa-s2-k3-r0.5-shared': ('93af4f40004d5a455a93', 24, -53.468383, -697.309229, ()),
    'pfa-s2-k5-r0.3-shared': ('9e6b82456ec3671c0890', 24, -53.511492, -696.225058, ()),
    'pfa-s2-k8-r1.0-shared': ('92b62ca5b1ad57891682', 24, -53.053033, -691.20772, ()),
    'pfa_per_beam-s0-k3-r0.5-shared': ('5be3a0ba6ca94a04d647', 24, -54.531246, -716.006043, ()),
    'pfa_per_beam-s0-k5-r0.3-shared': ('b5b4ce5ca0f6104eef08', 24, -55.607521, -727.400123, ()),
    'pfa_per_beam-s0-k8-r1.0-shared': ('49c5eff778df767d93dd', 24, -52.14819, -687.301883, ()),
    'pfa_per_beam-s1-k3-r0.5-shared': ('7437d5be81453fe5b0d9', 24, -53.533433, -698.149396, ()),
    'pfa_per_beam-s1-k5-r0.3-shared': ('88360961c9082ba391f8', 24, -54.167406, -704.077119, ()),
    'pfa_per_beam-s1-k8-r1.0-shared': ('92b62ca5b1ad57891682', 24, -53.170577, -691.90567, ()),
    'pfa_per_beam-s2-k3-r0.5-shared': ('1d9722d61605e8346148', 24, -54.105617, -705.783672, ()),
    'pfa_per_beam-s2-k5-r0.3-shared': ('13b89a9b74ab4c0d11c5', 24, -53.823075, -702.196219, ()),
    'pfa_per_beam-s2-k8-r1.0-shared': ('92b62ca5b1ad57891682', 24, -53.077312, -691.349809, ()),
    'dynamic_topk-s0-k3-r0.5-shared': ('ba7f1abdc277f7a6653f', 24, -53.70479, -698.485318, ()),
    'dynamic_topk-s0-k5-r0.3-shared': ('b2c22ba2b530b1195389', 24, -55.076311, -711.344246, ()),
    'dynamic_topk-s0-k8-r1.0-shared': ('534c509007573033703d', 24, -53.092186, -691.675187, ()),
    'dynamic_topk-s1-k3-r0.5-shared': ('ca160b8178c384b94c0a', 24, -55.281913, -713.319349, ()),
    'dynamic_topk-s1-k5-r0.3-shared': ('ca160b8178c384b94c0a', 24, -55.49269, -715.6069, ()),
    'dynamic_topk-s1-k8-r1.0-shared': ('df6201cc8af01970f001', 24, -53.072096, -691.087748, ()),
    'dynamic_topk-s2-k3-r0.5-shared': ('46ad35c4181419d9e9f1', 24, -53.965906, -701.032184, ()),
    'dynamic_topk-s2-k5-r0.3-shared': ('e628c5d1b35f4695c297', 24, -53.545048, -696.234275, ()),
    'dynamic_topk-s2-k8-r1.0-shared': ('ed53d3412d8f04a687e7', 24, -53.104646, -691.417004, ()),
    'full-collect-shared': ('92b62ca5b1ad57891682', 24, -52.920559, -690.569, ((0, (4, 1, 12), 12.763364, 4.0, 12.763364), (1, (4, 4, 12), 14.86875, 4.0, 59.261842), (2, (4, 6, 12), 13.956152, 4.0, 81.697595), (3, (4, 6, 12), 13.060905, 4.0, 78.868367))),
}

CASES = list(cases())


def test_reference_covers_every_case():
    assert sorted(REFERENCE) == sorted(name for name, _, _ in CASES)
    assert len(REFERENCE) == 2 * (len(MODES) * 3 * len(KR) + 1)


@pytest.mark.parametrize("name,shared,opts", CASES, ids=[c[0] for c in CASES])
def test_generate_matches_pre_refactor_outputs(name, shared, opts):
    dec, cb, states, lengths = setup(shared)
    got = digest(generate(dec, cb, states, lengths, opts))
    ref = REFERENCE[name]
    assert got[:2] == ref[:2], "item ids / codes / live beams differ"
    assert got[2:4] == pytest.approx(ref[2:4], rel=1e-5, abs=1e-4)
    assert len(got[4]) == len(ref[4])
    for g, r in zip(got[4], ref[4]):
        assert g[:2] == r[:2] and g[2:] == pytest.approx(r[2:], rel=1e-5, abs=1e-4)


def test_one_policy_per_mode():
    assert POLICIES == {"full": FullAttention, "pfa": ProgressiveFocus,
                        "pfa_per_beam": ProgressiveFocusPerBeam, "dynamic_topk": DynamicTopK}
    dec, cb, states, lengths = setup(False)
    for mode, cls in POLICIES.items():
        assert type(attention_policy(dec, states, lengths, DecodeOptions(mode=mode))) is cls
    with pytest.raises(ValueError, match="collect_attention"):
        attention_policy(dec, states, lengths, DecodeOptions(mode="pfa", collect_attention=True))


@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("s", [0, 1, 2])
def test_pfa_selects_once_and_gathers_once(monkeypatch, s, shared):
    """One pfa_select_rows at the selection step, which gathers the kept rows in the same call,
    then prefixes of k_t rows."""
    dec, cb, states, lengths = setup(shared)
    calls = {"pfa_select_rows": [], "gather_rows": []}
    real_select, real_gather, real_attend = ops.pfa_select_rows, ops.gather_rows, ops.decode_attention
    budgets = []

    def select(q, k, lens, w, keep, rows):
        calls["pfa_select_rows"].append([tuple(x.shape) for x in rows])
        return real_select(q, k, lens, w, keep, rows)

    def separate_select(*a, **kw):
        raise AssertionError("a selection outside pfa_select_rows")

    def gather(x, idx):
        calls["gather_rows"].append(tuple(x.shape))
        return real_gather(x, idx)

    def attend(q, k, v, lens):
        budgets.append(k.shape[1])
        return real_attend(q, k, v, lens)

    monkeypatch.setattr(ops, "pfa_select_rows", select)
    monkeypatch.setattr(ops, "pfa_select", separate_select)
    monkeypatch.setattr(ops, "gather_rows", gather)
    monkeypatch.setattr(ops, "decode_attention", attend)
    opts = DecodeOptions(mode="pfa", beam_width=6, k=8, r=0.5, selection_step=s)
    generate(dec, cb, states, lengths, opts)
    assert len(calls["pfa_select_rows"]) == 1
    gathered = calls["pfa_select_rows"][0]  # [B, N, ...]: the kept K and V, or the kept states
    B, N = states.shape[:2]
    assert gathered == ([(B, N, H, D // H)] * 2 if shared else [tuple(states.shape)])
    assert not [shp for shp in calls["gather_rows"] if shp[1] == N]  # no gather of history rows besides
    # steps >= s read k_t = max(1, ceil(k r^(t-s))) rows; steps < s with several beams read all N
    expected = [states.shape[1]] * max(0, s - 1) + [opts.budget(t) for t in range(s, 4)]
    assert budgets == expected


def test_per_beam_orders_follow_their_parents():
    dec, cb, states, lengths = setup(False)
    opts = DecodeOptions(mode="pfa_per_beam", beam_width=6, k=5, r=0.5, selection_step=1)
    policy = attention_policy(dec, states, lengths, opts).prepare()
    q = torch.randn(4, 3, H, D // H)
    policy.attend(1, q, torch.zeros(4, 3))
    order, kept_len = policy.order.clone(), policy.kept_len.clone()
    parent = torch.tensor([[2, 0, 0, 1]] * 4)
    policy.reorder(parent)
    assert torch.equal(policy.order, torch.stack([order[b, parent[b]] for b in range(4)]))
    assert torch.equal(policy.kept_len, torch.gather(kept_len, 1, parent))


def test_beam_weights_pool_to_one():
    lp = torch.tensor([[-1.0, -2.0, float("-inf")], [float("-inf")] * 3])
    w = beam_weights(lp)
    assert torch.allclose(w[0].sum(), torch.tensor(1.0)) and w[0, 2] == 0 and (w[1] == 0).all()
