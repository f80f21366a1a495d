"""The bucketed decode (backend_src/decoding/cuda_graphs.py): padded decode == unpadded decode on
the CPU, no host reads inside the decode, and, on a GPU, graph replays == the eager decode."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from backend_src.config import DecodeOptions
from backend_src.decoding import generate
from backend_src.decoding.cuda_graphs import DecodeGraphs, HostReadDetector
from test_decoding import D, SPARSE_SIZES, _codebook, _decoder, _history  # the decoder and histories the decoding tests use

REPO = Path(__file__).resolve().parents[1]
MODES = ["full", "pfa", "pfa_per_beam", "dynamic_topk"]


def _model(device="cpu", shared=False, nodes=False, sizes=(5, 4, 4)):
    cb = _codebook(n=80, sizes=sizes)
    return types.SimpleNamespace(decoder=_decoder(cb, seed=1, shared=shared, nodes=nodes).to(device),
                                 codebook=cb.to(device))


def _same(a, b):
    assert torch.equal(a.item_ids, b.item_ids)
    assert torch.equal(a.codes, b.codes)
    torch.testing.assert_close(a.log_probs, b.log_probs, atol=1e-5, rtol=1e-5)


def test_buckets():
    g = DecodeGraphs(_model(), batch_buckets=(1, 4, 16), history_buckets=(32, 64, 512), max_history=200)
    assert g.history_buckets == (32, 64, 200)  # the served maximum replaces the buckets above it
    assert g.bucket(3, 37) == (4, 64)
    assert g.bucket(4, 64) == (4, 64)
    assert g.bucket(1, 1) == (1, 32)
    assert g.bucket(17, 10) is None and g.bucket(2, 201) is None
    assert not g.use_graphs and not g.pad  # CPU: unpadded eager by default
    with pytest.raises(ValueError):
        DecodeGraphs(_model(), use_graphs=True)


@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("mode", MODES)
def test_padded_decode_equals_unpadded(mode, shared):
    """Padding users and history rows to the bucket changes no beam (CPU, eager)."""
    model = _model(shared=shared)
    opts = DecodeOptions(mode=mode, beam_width=6, k=9, r=0.5, selection_step=1)
    graphs = DecodeGraphs(model, batch_buckets=(2, 8), history_buckets=(16, 64), pad=True)
    for B, n, seed in [(3, 37, 0), (2, 16, 1), (1, 5, 2)]:
        states, lengths = _history(B, n, seed)
        ref = generate(model.decoder, model.codebook, states, lengths, opts)
        out = graphs.retrieve(states, lengths, opts)
        assert out.item_ids.shape == (B, 6)
        _same(out, ref)
        assert (ref.item_ids > 0).any()  # real beams, not only empty slots
    assert graphs.stats["eager"] == 3 and graphs.stats["replays"] == 0


def test_pad_inputs_layout():
    graphs = DecodeGraphs(_model(), batch_buckets=(4,), history_buckets=(8,), pad=True)
    states, lengths = _history(2, 5, 3, lengths=[5, 2])
    s, ln = graphs.pad_inputs(states, lengths, 4, 8)
    assert s.shape == (4, 8, D) and torch.equal(s[:2, :5], states)
    assert not s[:2, 5:].any() and not s[2:].any()
    assert ln.tolist() == [5, 2, 1, 1]


def test_beyond_the_buckets_decodes_unpadded():
    model = _model()
    opts = DecodeOptions(mode="pfa", beam_width=4, k=5)
    graphs = DecodeGraphs(model, batch_buckets=(2,), history_buckets=(8,), pad=True)
    states, lengths = _history(3, 12, 4)
    _same(graphs.retrieve(states, lengths, opts), generate(model.decoder, model.codebook, states, lengths, opts))
    assert graphs.stats["eager"] == 1


def test_host_read_detector_finds_reads():
    """The detector below must be able to fail: it records the reads a CUDA graph cannot capture."""
    t = torch.arange(6)
    with HostReadDetector() as det:
        int(t.max())
        _ = t[t > 2]
        if t[0] == 0:
            pass
        t.sum().item()
        _ = t.nonzero()
        _ = t[1:3] + 1  # no read: slicing by Python ints
    kinds = [c.split(" at ")[0] for c in det.calls]
    assert kinds == ["__int__", "__getitem__", "__bool__", "item", "nonzero"]


def _decode_reads() -> dict:
    """{mode: host reads} of generate() with the ops on the Triton kernels: the GPU's code path, on
    the GPU where there is one, else in Triton's interpreter. Runs in a fresh process (the
    interpreter must be chosen before Triton's import)."""
    import triton

    device = "cuda" if torch.cuda.is_available() else "cpu"
    # and with node output, by parent blocks (levels 1 and 2 of SPARSE_SIZES) and per slot (level 3)
    models = (_model(device), _model(device, nodes=True, sizes=SPARSE_SIZES))
    states, lengths = (t.to(device) for t in _history(3, 40, 5))
    out = {}
    for mode in MODES:
        opts = DecodeOptions(mode=mode, beam_width=5, k=12, r=0.5, selection_step=1)
        with HostReadDetector(ignore=(str(Path(triton.__file__).parent),)) as det:
            for model in models:
                generate(model.decoder, model.codebook, states, lengths, opts)
        out[mode] = det.calls
    return out


def test_decode_has_no_host_reads():
    """Every mode's decode on the GPU's code path (the Triton ops) reads no device value on the
    host, so a whole decode can be captured as one CUDA graph."""
    pytest.importorskip("triton")
    env = dict(os.environ, GENREC_OPS_BACKEND="triton")
    if not torch.cuda.is_available():
        env["TRITON_INTERPRET"] = "1"
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(REPO / "tests"), env.get("PYTHONPATH", "")])
    res = subprocess.run([sys.executable, str(Path(__file__))], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-4000:]
    reads = json.loads(res.stdout.strip().splitlines()[-1])
    assert set(reads) == set(MODES)
    assert reads == {m: [] for m in MODES}


# ------------------------------------------------------------------------------------------
# GPU only: the captured graphs against the eager decode
# ------------------------------------------------------------------------------------------
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA GPU")


@needs_cuda
@pytest.mark.parametrize("mode", MODES)
def test_graph_replay_equals_eager_decode(mode):
    """Each replay (static buffers reused across batches of one bucket, and another bucket in
    between) returns what the eager, unpadded decode of the same batch returns."""
    model = _model("cuda")
    opts = DecodeOptions(mode=mode, beam_width=6, k=9, r=0.5, selection_step=1)
    graphs = DecodeGraphs(model, batch_buckets=(4, 8), history_buckets=(64, 128))
    assert graphs.use_graphs and graphs.warmup(opts, batch_sizes=(4,), histories=(64,)) == 1
    for B, n, seed in [(3, 37, 0), (4, 64, 1), (7, 100, 2), (2, 5, 3)]:
        states, lengths = _history(B, n, seed)
        ref = generate(model.decoder, model.codebook, states.cuda(), lengths.cuda(), opts)
        _same(graphs.retrieve(states, lengths, opts), ref)
    assert graphs.stats["replays"] == 4 and graphs.stats["captures"] == 2


if __name__ == "__main__":  # the fresh-process run of test_decode_has_no_host_reads
    print(json.dumps(_decode_reads()))
