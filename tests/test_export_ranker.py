"""Ranker export: the ONNX graph scores like ``MFalconRanker.score`` at shapes other than the
tracing example, the runtime's backends agree (with microbatching), TensorRT where available."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from backend_src.config import ModelConfig
from backend_src.model.hstu import HistoryCache
from backend_src.model.ranker import MFalconRanker
from backend_src.serving.ranker_runtime import INPUT_NAMES, OUTPUT_NAME, RankerRuntime
from export.onnx_ranker import EXAMPLE_SHAPE, export_ranker_onnx
from export.tensorrt_ranker import build_tensorrt_plan, tensorrt_available
from hstu_helpers import make_encoder  # noqa: E402

ort = pytest.importorskip("onnxruntime")

ATOL = 1e-5


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny graphs: one intra-op thread is fastest and keeps timings steady on a busy machine."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def tiny_config() -> ModelConfig:
    return ModelConfig(num_items=50, d_model=32, num_layers=2, num_heads=2, max_seq_len=64,
                       num_time_buckets=16, dropout=0.1, codebook_sizes=(4, 4, 4, 1))


@pytest.fixture(scope="module")
def ranker() -> MFalconRanker:
    """A ranker whose position/time biases are large enough that a wrong index shows."""
    cfg = tiny_config()
    return MFalconRanker(make_encoder(cfg), cfg).eval()


@pytest.fixture(scope="module")
def onnx_path(ranker, tmp_path_factory):
    return export_ranker_onnx(ranker, tmp_path_factory.mktemp("ranker") / "ranker.onnx")


def make_cache(ranker, lengths, n=None, seed=1) -> HistoryCache:
    """A real cache: random left-aligned histories encoded by the backbone."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor(lengths, dtype=torch.long)
    B = len(lengths)
    n = n or max(int(lengths.max()), 1)
    items = torch.randint(1, ranker.cfg.num_items + 1, (B, n), generator=g)
    actions = torch.randint(0, 6, (B, n), generator=g)
    gaps = torch.randint(0, 10**6, (B, n), generator=g) * (torch.rand(B, n, generator=g) < 0.7)
    with torch.no_grad():
        return ranker.backbone(items, actions, 1_600_000_000 + gaps.cumsum(1), lengths)


def make_candidates(ranker, B, M, seed=2, pad_last=True):
    g = torch.Generator().manual_seed(seed)
    c = torch.randint(1, ranker.cfg.num_items + 1, (B, M), generator=g)
    if pad_last:
        c[:, -1] = 0  # a padding candidate in every row
        c[0, : M // 2] = 0  # and a row that is half padding
    return c


def assert_scores_match(got, ref, atol=ATOL):
    got, ref = np.asarray(got), np.asarray(ref)
    assert not np.isnan(got).any()
    np.testing.assert_array_equal(np.isneginf(got), np.isneginf(ref))  # padding: -inf in both
    fin = np.isfinite(ref)
    assert np.abs(got[fin] - ref[fin]).max() < atol


def ort_scores(path, ranker, cache, cands):
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    sess = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
    with torch.no_grad():  # the graph reads the candidates' vectors; padding candidates are the runtime's to mask
        vectors = ranker.backbone.item_vectors(cands)
    feed = dict(zip(INPUT_NAMES, (cache.keys, cache.values, cache.timestamps, cache.lengths, vectors)))
    out = sess.run([OUTPUT_NAME], {k: v.numpy() for k, v in feed.items()})[0]
    return np.where(cands.numpy() == 0, -np.inf, out)


# ------------------------------------------------------------------------------------------
def test_graph_contract(onnx_path, ranker):
    import onnx

    model = onnx.load(str(onnx_path))
    onnx.checker.check_model(model)
    assert [i.name for i in model.graph.input] == list(INPUT_NAMES)
    assert [o.name for o in model.graph.output] == [OUTPUT_NAME]
    dims = {i.name: [d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim] for i in model.graph.input}
    cfg = ranker.cfg
    L, H, d = cfg.num_layers, cfg.num_heads, cfg.d_model // cfg.num_heads
    assert dims["history_keys"] == [L, "B", "n", H, d]
    assert dims["history_timestamps"] == ["B", "n"]
    assert dims["candidate_vectors"] == ["B", "m", cfg.d_model]


@pytest.mark.parametrize(
    "lengths,M",
    [
        ([1], 1),  # n = 1, one candidate (not padding)
        ([1, 1, 1, 1], 6),  # n = 1, B = 4
        ([3, 9, 1], 4),
        ([20, 7, 13, 2, 20], 17),
        ([0, 4], 5),  # an empty history next to a real one
    ],
)
def test_onnx_matches_torch_score(onnx_path, ranker, lengths, M):
    cache = make_cache(ranker, lengths)
    assert (len(lengths), cache.num_rows, M) != tuple(EXAMPLE_SHAPE.values())
    cands = make_candidates(ranker, len(lengths), M, pad_last=M > 1)
    with torch.no_grad():
        ref = ranker.score(cache, cands, microbatch_size=M).numpy()
    assert_scores_match(ort_scores(onnx_path, ranker, cache, cands), ref)


def test_runtime_torch_vs_onnxruntime_microbatched(onnx_path, ranker):
    cache = make_cache(ranker, [12, 5, 1], seed=3)
    cands = make_candidates(ranker, 3, 23, seed=4)
    with torch.no_grad():
        ref = ranker.score(cache, cands, microbatch_size=64).numpy()
    rt_torch = RankerRuntime.torch(ranker)
    rt_ort = RankerRuntime.onnxruntime(onnx_path, ranker.backbone.item_vectors, num_threads=1)
    assert rt_ort.provider == "CPUExecutionProvider"
    for bm in (1, 5, 8, 23, 64):  # uneven last microbatch, one microbatch, b_m > M
        a = rt_torch.score_cache(cache, cands, microbatch_size=bm)
        b = rt_ort.score_cache(cache, cands, microbatch_size=bm)
        assert isinstance(a, torch.Tensor) and a.shape == (3, 23)
        assert_scores_match(a.numpy(), ref)
        assert_scores_match(b.numpy(), ref)
    # numpy in -> numpy out; an empty history (n = 0) is handled by the runtime
    empty = HistoryCache.empty(ranker.cfg, batch_size=2)
    c2 = make_candidates(ranker, 2, 4, seed=5)
    with torch.no_grad():
        ref2 = ranker.score(empty, c2).numpy()
    out = rt_ort.score(*(t.numpy() for t in (empty.keys, empty.values, empty.timestamps, empty.lengths, c2)), 3)
    assert isinstance(out, np.ndarray)
    assert_scores_match(out, ref2)


def test_from_version_dir(onnx_path, ranker, tmp_path):
    assert RankerRuntime.from_version_dir(tmp_path, ranker).backend == "torch"
    with pytest.raises(ValueError):
        RankerRuntime.from_version_dir(tmp_path, None)
    rt = RankerRuntime.from_version_dir(onnx_path.parent, ranker)
    # with both ONNX Runtime and torch at hand, each history length goes to the faster of them
    expected = "tensorrt" if (onnx_path.parent / "ranker.plan").exists() else "routed"
    assert rt.backend == expected
    assert RankerRuntime.from_version_dir(onnx_path.parent, ranker, backend="onnxruntime").backend == "onnxruntime"


def test_routed_runtime_scores_as_torch_at_every_length(onnx_path, ranker):
    rt = RankerRuntime.fastest_by_history(
        [RankerRuntime.onnxruntime(onnx_path, ranker.backbone.item_vectors), RankerRuntime.torch(ranker)], ranker.cfg, max_history=40, candidates=4, reps=1
    )
    assert rt.backend == "routed" and rt.provider.count("n<=") == 3  # 16, 32, 40
    for lengths in ([3], [20, 7], [40]):
        cache = make_cache(ranker, lengths)
        cands = make_candidates(ranker, len(lengths), 5)
        with torch.no_grad():
            ref = ranker.score(cache, cands).numpy()
        assert_scores_match(rt.score_cache(cache, cands, 2).numpy(), ref)


def test_cli_exports_checkpoint(tmp_path):
    recommender = pytest.importorskip("backend_src.model.recommender")
    from backend_src.model.semantic_ids import SemanticIdCodebook
    from export.onnx_ranker import main

    cfg = tiny_config()
    model = recommender.GenerativeRecommender(cfg, SemanticIdCodebook(), [None] + [str(i) for i in range(cfg.num_items)]).eval()
    model.save(tmp_path / "model.pt")
    main(["--checkpoint", str(tmp_path / "model.pt"), "--out", str(tmp_path / "ranker.onnx")])
    rt = RankerRuntime.from_version_dir(tmp_path, model, backend="onnxruntime")
    assert rt.backend == "onnxruntime"
    cache = make_cache(model.ranker, [6, 2])
    cands = make_candidates(model.ranker, 2, 5)
    with torch.no_grad():
        ref = model.rank(cache, cands).numpy()
    assert_scores_match(rt.score_cache(cache, cands, 2).numpy(), ref)


def test_tensorrt_plan_matches_torch(onnx_path, ranker, tmp_path):
    ok, why = tensorrt_available()
    if not ok:
        pytest.skip(f"TensorRT unavailable: {why}")
    if not torch.cuda.is_available():
        pytest.skip("TensorRT needs a CUDA GPU")
    plan = build_tensorrt_plan(onnx_path, tmp_path / "ranker.plan", {"B": (1, 2, 4), "n": (1, 16, 32), "m": (1, 8, 8)}, fp16=False)
    rt = RankerRuntime.tensorrt(plan, ranker.backbone.item_vectors)
    cache = make_cache(ranker, [12, 5, 1])
    cands = make_candidates(ranker, 3, 11)
    with torch.no_grad():
        ref = ranker.score(cache, cands).numpy()
    assert_scores_match(rt.score_cache(cache, cands, 8).cpu().numpy(), ref, atol=1e-3)


def test_tensorrt_missing_is_a_clear_error(onnx_path, tmp_path):
    if tensorrt_available()[0]:
        pytest.skip("TensorRT is installed")
    with pytest.raises(RuntimeError, match="tensorrt"):
        build_tensorrt_plan(onnx_path, tmp_path / "ranker.plan", {"B": (1, 1, 1), "n": (1, 1, 1), "m": (1, 1, 1)})
