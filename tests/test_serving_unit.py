"""Serving pieces without a server: session store, request validation, generated configs,
publishing and rollback of model versions."""
import shutil

import numpy as np
import pytest
import torch
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

from backend_src.config import DecodeOptions, ModelConfig
from backend_src.serving import protocol as P
from backend_src.serving.session_store import Session, SessionStore, SessionTooLarge
from backend_src.serving.validation import Limits, RequestError, check_events, check_shape, parse_options
from export import publish as pub
from export.triton_configs import ServingOptions, render, write_configs

CFG = ModelConfig(num_items=50, d_model=16, num_layers=2, num_heads=2, max_seq_len=20, codebook_sizes=(4, 4, 4, 3))
SIZES = P.model_sizes(CFG)
LIMITS = Limits(max_history=20, num_actions=8, num_codes=4)


# ------------------------------------------------------------------------------ session store
class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def _session(n_bytes_rows: int) -> Session:
    ev = torch.arange(4)
    return Session(cache=torch.zeros(n_bytes_rows, dtype=torch.uint8), items=ev, actions=ev, timestamps=ev)


def test_store_lru_bound_evicts_least_recent():
    per = _session(1000).nbytes
    store = SessionStore(max_bytes=3 * per, idle_timeout_s=100)
    for k in ("a", "b", "c"):
        store.put(k, _session(1000))
    store.get("a")  # a becomes most recent: b is now the oldest
    evicted = store.put("d", _session(1000))
    assert evicted == ["b"]
    assert set(store._sessions) == {"a", "c", "d"} and store.total_bytes == 3 * per
    assert "evicted to keep session memory" in store.why_missing("b")
    assert store.stats()["evicted_memory"] == 1


def test_store_replace_keeps_byte_count_and_refuses_oversized():
    store = SessionStore(max_bytes=10_000)
    store.put(1, _session(100))
    store.put(1, _session(200))
    assert len(store) == 1 and store.total_bytes == _session(200).nbytes
    with pytest.raises(SessionTooLarge):
        store.put(2, _session(20_000))
    assert 2 not in store and len(store) == 1


def test_store_idle_timeout_and_end():
    clock = Clock()
    store = SessionStore(max_bytes=1 << 20, idle_timeout_s=10, clock=clock)
    store.put("old", _session(10))
    clock.t = 8
    store.put("new", _session(10))
    clock.t = 15
    assert store.sweep() == ["old"]
    assert "idle" in store.why_missing("old") and "new" in store
    assert store.end("new") and len(store) == 0 and store.total_bytes == 0
    assert "already ended" in store.why_missing("new")
    assert "never started" in store.why_missing("other")
    store.put("old", _session(10))  # a restarted session is known again
    assert store.get("old") is not None


# ------------------------------------------------------------------------------ validation
def test_shape_guard_rejects_overflowing_shape_without_touching_data():
    with pytest.raises(RequestError, match="too large"):
        check_shape(P.ACTIONS, [1, 2**62], SIZES, max_elements=1000)
    with pytest.raises(RequestError, match=r"batch dimension must be 1"):
        check_shape(P.ACTIONS, [3, 5], SIZES, 1000)
    with pytest.raises(RequestError, match=r"must have shape \[1, n\]"):
        check_shape(P.ACTIONS, [5], SIZES, 1000)
    with pytest.raises(RequestError, match="HISTORY_KEYS"):
        check_shape(P.HISTORY_KEYS, [1, 2, 7, 3, 8], SIZES, 10**6)  # H should be 2
    assert check_shape(P.HISTORY_KEYS, [1, 2, 7, 2, 8], SIZES, 10**6) == (1, 2, 7, 2, 8)


def test_event_checks_name_the_problem():
    a = np.array([1, 2, 3])
    with pytest.raises(RequestError, match="empty history on sequence start"):
        check_events(0, a[:0], a[:0], LIMITS, start=True, session_last_timestamp=None)
    with pytest.raises(RequestError, match="same length"):
        check_events(3, a[:2], a, LIMITS, True, None)
    with pytest.raises(RequestError, match=r"TIMESTAMPS out of order: event 2 at 5"):
        check_events(3, a, np.array([10, 20, 5]), LIMITS, True, None)
    with pytest.raises(RequestError, match="before the session's last event at 100"):
        check_events(3, a, np.array([50, 60, 70]), LIMITS, False, 100)
    with pytest.raises(RequestError, match=r"ACTIONS out of range.*7"):
        check_events(3, np.array([1, 7, 2]), np.array([1, 2, 3]), LIMITS, True, None)
    with pytest.raises(RequestError, match="too many events"):
        check_events(10, np.ones(10, int), np.arange(10), Limits(20, 8, 4, max_request_events=5), True, None)
    check_events(0, a[:0], a[:0], LIMITS, start=False, session_last_timestamp=100)  # nothing new is fine
    check_events(3, a, np.array([100, 100, 101]), LIMITS, False, 100)


def test_options_defaults_and_ranges():
    d = DecodeOptions(mode="pfa", beam_width=16, k=32, r=0.5, selection_step=1)
    top_k, o = parse_options({}, d, 10, LIMITS)
    assert top_k == 10 and (o.mode, o.beam_width, o.k, o.r, o.selection_step) == ("pfa", 16, 32, 0.5, 1)
    top_k, o = parse_options(
        {"TOP_K": np.array([[4]]), "DECODE_MODE": np.array([[b"full"]], dtype=object), "PFA_R": np.array([[1.0]])}, d, 10, LIMITS
    )
    assert top_k == 4 and o.mode == "full" and o.r == 1.0
    bad = [
        ({"TOP_K": np.array([[0]])}, "TOP_K must be in"),
        ({"BEAM_WIDTH": np.array([[5000]])}, "BEAM_WIDTH must be in"),
        ({"PFA_K": np.array([[0]])}, "PFA_K must be in"),
        ({"PFA_R": np.array([[0.0]])}, r"PFA_R must be in \(0, 1\]"),
        ({"PFA_R": np.array([[np.nan]])}, "PFA_R"),
        ({"SELECTION_STEP": np.array([[4]])}, r"SELECTION_STEP must be in \[0, 3\]"),
        ({"DECODE_MODE": np.array([[b"beam"]], dtype=object)}, "DECODE_MODE must be one of"),
        ({"TOP_K": np.array([[20]])}, r"TOP_K \(20\) must not exceed BEAM_WIDTH \(16\)"),
    ]
    for values, msg in bad:
        with pytest.raises(RequestError, match=msg):
            parse_options(values, d, 10, LIMITS)


# ------------------------------------------------------------------------------ configs
def _parse(text: str):
    return text_format.Parse(text, model_config_pb2.ModelConfig())


def test_generated_configs_parse_and_follow_the_contract():
    texts = render(CFG, ServingOptions(idle_timeout_s=30, encoder_instances=2, code_root="/code"))
    enc = _parse(texts[P.ENCODER])
    assert enc.backend == "python" and enc.max_batch_size > 0
    sb = enc.sequence_batching
    assert sb.HasField("oldest") and sb.max_sequence_idle_microseconds == 30_000_000
    kinds = {c.name: c.control[0].kind for c in sb.control_input}
    assert set(kinds) == {"START", "END", "READY"}
    assert "CORRID" not in texts[P.ENCODER]  # a CORRID control input can crash the server
    assert not sb.state  # implicit state does not reach a Python model
    assert enc.instance_group[0].count == 2
    keys = next(o for o in enc.output if o.name == "HISTORY_KEYS")
    assert list(keys.dims) == [2, -1, 2, 8]  # [L, n, H, dh]
    ins = {i.name: i for i in enc.input}
    assert ins["ITEM_IDS"].data_type == model_config_pb2.TYPE_STRING and ins["ITEM_IDS"].allow_ragged_batch
    assert ins["TOP_K"].optional and not ins["ITEM_IDS"].optional
    assert enc.parameters["code_root"].string_value == "/code"
    assert enc.version_policy.latest.num_versions == 1

    dec, rank = _parse(texts[P.DECODER]), _parse(texts[P.RANKER])
    assert dec.HasField("dynamic_batching") and rank.HasField("dynamic_batching")
    assert [o.name for o in dec.output] == ["CANDIDATE_ITEMS", "CANDIDATE_LOG_PROBS", "CANDIDATE_CODES"]
    sem = next(o for o in rank.output if o.name == "SEMANTIC_IDS")
    assert list(sem.dims) == [-1, 4]

    ens = _parse(texts[P.ENSEMBLE])
    assert ens.platform == "ensemble"
    steps = ens.ensemble_scheduling.step
    assert [s.model_name for s in steps] == [P.ENCODER, P.DECODER, P.RANKER]
    produced = {t.name for t in ens.input}
    for s in steps:  # every step input is an ensemble input or an earlier step's output
        assert set(s.input_map.values()) <= produced, s.model_name
        produced |= set(s.output_map.values())
    assert {o.name for o in ens.output} <= produced


def test_max_history_cannot_exceed_model_length(tmp_path):
    with pytest.raises(ValueError, match="max_history"):
        render(CFG, ServingOptions(max_history=CFG.max_seq_len + 1))
    paths = write_configs(tmp_path, CFG)
    assert all(p.exists() for p in paths.values())
    assert not list(tmp_path.rglob("*.tmp"))


# ------------------------------------------------------------------------------ publish
@pytest.fixture()
def fake_checkpoint(tmp_path):
    path = tmp_path / "ckpt.pt"
    torch.save({"format": 1, "config": CFG.to_dict()}, path)
    return path


def test_publish_rollback_and_version_numbers(tmp_path, fake_checkpoint):
    repo = tmp_path / "repo"
    assert pub.publish(fake_checkpoint, repo, export_ranker=False) == {m: 1 for m in P.PYTHON_MODELS}
    onnx = tmp_path / "r.onnx"
    onnx.write_bytes(b"onnx")
    assert pub.publish(fake_checkpoint, repo, ranker_onnx=onnx) == {m: 2 for m in P.PYTHON_MODELS}
    for m in P.PYTHON_MODELS:
        v = repo / m / "2"
        assert (v / "model.py").exists() and (v / "model.pt").read_bytes() == fake_checkpoint.read_bytes()
        assert (repo / m / "config.pbtxt").exists()
    assert (repo / P.RANKER / "2" / "ranker.onnx").exists() and not (repo / P.RANKER / "1" / "ranker.onnx").exists()
    assert (repo / P.ENSEMBLE / "1").is_dir() and (repo / P.ENSEMBLE / "config.pbtxt").exists()
    assert not [p for p in tmp_path.iterdir() if "staging" in p.name]  # staging cleaned up

    plan = pub.rollback(repo)
    assert plan == {m: (2, 1) for m in P.PYTHON_MODELS}
    assert pub.describe(repo)[P.RANKER] == {"versions": [1], "retired": [2]}
    with pytest.raises(RuntimeError, match="nothing to roll back"):
        pub.rollback(repo)
    assert pub.publish(fake_checkpoint, repo, export_ranker=False)[P.DECODER] == 3  # numbers never reused


def test_publish_failure_leaves_repository_untouched(tmp_path, fake_checkpoint, monkeypatch):
    repo = tmp_path / "repo"
    pub.publish(fake_checkpoint, repo, export_ranker=False)
    before = sorted(str(p.relative_to(repo)) for p in repo.rglob("*"))
    real_copy = shutil.copy2

    def failing_copy(src, dst, *a, **k):
        if str(dst).endswith("ranker.onnx"):
            raise OSError("disk full")
        return real_copy(src, dst, *a, **k)

    monkeypatch.setattr(pub.shutil, "copy2", failing_copy)
    with pytest.raises(OSError):
        pub.publish(fake_checkpoint, repo, ranker_onnx=fake_checkpoint)
    assert sorted(str(p.relative_to(repo)) for p in repo.rglob("*")) == before
    assert not [p for p in tmp_path.iterdir() if "staging" in p.name]
