"""Serving pieces without a server: request validation, generated configs,
publishing and rollback of model versions, the watchdog's keeper."""
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

from backend_src.config import DecodeOptions, ModelConfig
from genrec_contract import protocol as P
from backend_src.serving.validation import (
    MAX_TIMESTAMP, Limits, RequestError, check_continues, check_decoder_inputs, check_events, check_ranker_inputs, check_shape,
    check_timestamps, error_code, parse_options,
)
from export import publish as pub
from export.triton_configs import ServingOptions, render, write_configs
from serving_helpers import running, watchdogs

CFG = ModelConfig(num_items=50, d_model=16, num_layers=2, num_heads=2, max_seq_len=20, codebook_sizes=(4, 4, 4, 3))
SIZES = P.model_sizes(CFG)
LIMITS = Limits(max_history=20, num_actions=8, num_codes=4)


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
    # the encoder's second look, once the session's last event is known, checks only that
    with pytest.raises(RequestError, match="before the session's last event at 100"):
        check_continues(np.array([99, 150]), 100)
    check_continues(np.array([100]), 100)
    check_continues(a[:0], 100)  # nothing new
    check_continues(np.array([5]), None)  # a new session
    with pytest.raises(RequestError, match=r"ACTIONS out of range at positions 0, 1, 2 \(values -1, 7, 8\)"):
        check_events(3, np.array([-1, 7, 8]), np.array([1, 2, 3]), LIMITS, True, None)  # 7: reserved


def test_timestamps_compared_without_overflow():
    a = np.array([1, 2, 3])
    # np.diff wraps around on these: -2**63 after 200 looked in order, and a refusal of
    # [-10, 2**63 - 1] called it out of order
    with pytest.raises(RequestError, match=r"TIMESTAMPS out of range at positions 2 \(values -9223372036854775808\)"):
        check_events(3, a, np.array([100, 200, -(2**63)], np.int64), LIMITS, True, None)
    with pytest.raises(RequestError, match=r"TIMESTAMPS out of range at positions 0, 1 .*\[0, 9007199254740991\]"):
        check_events(2, a[:2], np.array([-10, 2**63 - 1], np.int64), LIMITS, True, None)
    with pytest.raises(RequestError, match="out of range at positions 1"):
        check_events(2, a[:2], np.array([0, MAX_TIMESTAMP + 1], np.int64), LIMITS, True, None)
    with pytest.raises(RequestError, match=rf"out of order: event 1 at 0 is before event 0 at {MAX_TIMESTAMP}"):
        check_events(2, a[:2], np.array([MAX_TIMESTAMP, 0], np.int64), LIMITS, True, None)
    check_events(3, a, np.array([0, MAX_TIMESTAMP, MAX_TIMESTAMP], np.int64), LIMITS, True, None)  # the whole range
    with pytest.raises(RequestError, match="HISTORY_TIMESTAMPS out of order: row 2 at 5 is before row 1 at 9"):
        check_timestamps(np.array([1, 9, 5], np.int64), "HISTORY_TIMESTAMPS", what="row")


def test_decoder_input_checks():
    states = np.zeros((1, 5, CFG.d_model), np.float32)
    check_decoder_inputs(states, max_history=20)
    for bad in (np.nan, np.inf, -np.inf):
        s = states.copy()
        s[0, 3, 7] = bad
        with pytest.raises(RequestError, match=r"HISTORY_STATES holds 1 non-finite value\(s\).* index \[0, 3, 7\]"):
            check_decoder_inputs(s, 20)
    with pytest.raises(RequestError, match="HISTORY_STATES has no rows"):
        check_decoder_inputs(states[:, :0], 20)
    with pytest.raises(RequestError, match="HISTORY_STATES has 5 history rows, more than the model's max history 4"):
        check_decoder_inputs(states, 4)


def _ranker_inputs(n=3, W=4):
    """A valid ranker request (batch dim 1) for CFG; the last candidate is an empty beam."""
    L, H, DH, C = SIZES["L"], SIZES["H"], SIZES["DH"], SIZES["C"]
    codes = np.tile(np.arange(C, dtype=np.int32) % 3, (1, W, 1))
    codes[0, -1] = -1
    return dict(
        states=np.zeros((1, n, SIZES["D"]), np.float32),
        keys=np.zeros((1, L, n, H, DH), np.float32),
        values=np.ones((1, L, n, H, DH), np.float32),
        timestamps=1000 + np.arange(n, dtype=np.int64)[None],
        history_items=np.arange(1, n + 1, dtype=np.int64)[None],
        candidates=np.array([list(range(1, W)) + [0]], np.int64),
        log_probs=np.array([[-1.0] * (W - 1) + [-np.inf]], np.float32),  # -inf: empty beam, allowed
        codes=codes,
    )


def _rank_check(max_history=20, max_candidates=16, **replace):
    inputs = {**_ranker_inputs(), **replace}
    check_ranker_inputs(
        **inputs, item_rows=CFG.num_items + 2, codebook_sizes=CFG.codebook_sizes,
        max_history=max_history, max_candidates=max_candidates,
    )


def _with(name, index, value):
    x = _ranker_inputs()[name].copy()
    x[index] = value
    return x


def test_ranker_input_checks():
    _rank_check()
    good = _ranker_inputs()
    few, more = _ranker_inputs(n=2, W=3), _ranker_inputs(n=4, W=5)
    int64_max = np.iinfo(np.int64).max
    cases = [
        # shapes that disagree between inputs, and sizes out of bounds
        (dict(values=few["values"]), r"disagree on the number of rows n: .*HISTORY_KEYS has 3, HISTORY_VALUES has 2"),
        (dict(timestamps=more["timestamps"]), "HISTORY_TIMESTAMPS has 4"),
        (dict(states=few["states"]), r"HISTORY_STATES has 2, HISTORY_KEYS has 3"),
        (dict(history_items=few["history_items"]), "HISTORY_ITEMS has 2"),
        (dict(log_probs=few["log_probs"]), r"disagree on the number of candidates W: .*CANDIDATE_LOG_PROBS has 3"),
        (dict(codes=more["codes"]), "CANDIDATE_CODES has 5"),
        ({k: v[:, :, :0] if k in ("keys", "values") else v[:, :0] for k, v in good.items() if k in
          ("states", "keys", "values", "timestamps", "history_items")}, "HISTORY_KEYS has no rows"),
        (dict(max_history=2), "HISTORY_KEYS has 3 history rows, more than the model's max history 2"),
        (dict(candidates=good["candidates"][:, :0], log_probs=good["log_probs"][:, :0], codes=good["codes"][:, :0]),
         "CANDIDATE_ITEMS is empty"),
        (dict(max_candidates=3), "CANDIDATE_ITEMS has too many candidates: 4 > 3"),
        # item indices: negative, past the catalogue, INT64_MAX
        (dict(history_items=_with("history_items", (0, 1), -1)),
         r"HISTORY_ITEMS holds item indices out of range at positions 1 \(values -1\)"),
        (dict(history_items=_with("history_items", (0, 0), int64_max)), "HISTORY_ITEMS holds item indices out of range"),
        (dict(candidates=_with("candidates", (0, 0), -100000)),
         r"CANDIDATE_ITEMS .* \(values -100000\): item indices are 0..51"),
        (dict(candidates=_with("candidates", (0, 1), CFG.num_items + 2)),
         "CANDIDATE_ITEMS holds item indices out of range at positions 1"),
        (dict(candidates=_with("candidates", (0, 2), int64_max)), f"CANDIDATE_ITEMS .*{int64_max}"),
        # timestamps
        (dict(timestamps=_with("timestamps", (0, 2), -(2**63))), "HISTORY_TIMESTAMPS out of range at positions 2"),
        (dict(timestamps=_with("timestamps", (0, 1), int64_max)), "HISTORY_TIMESTAMPS out of range at positions 1"),
        (dict(timestamps=_with("timestamps", (0, 2), 0)), "HISTORY_TIMESTAMPS out of order: row 2 at 0"),
        # candidate log-probs and codes
        (dict(log_probs=_with("log_probs", (0, 1), np.nan)), r"CANDIDATE_LOG_PROBS holds .*NaN or \+inf at positions 1"),
        (dict(log_probs=_with("log_probs", (0, 0), np.inf)), r"CANDIDATE_LOG_PROBS holds .*NaN or \+inf at positions 0"),
        (dict(log_probs=_with("log_probs", (0, 2), 3.4e38)), r"CANDIDATE_LOG_PROBS holds values above 0.* at positions 2"),
        (dict(log_probs=_with("log_probs", (0, 1), 0.01)), r"CANDIDATE_LOG_PROBS holds values above 0.* at positions 1"),
        (dict(codes=_with("codes", (0, 1, 3), 3)),
         r"CANDIDATE_CODES out of range .* candidate 1, level 3: 3; level sizes are \[4, 4, 4, 3\]"),
        # -1 names no code, and candidate 0 is not an empty beam
        (dict(codes=_with("codes", (0, 0, 0), -1)), "CANDIDATE_CODES out of range .* candidate 0, level 0: -1"),
        (dict(codes=_with("codes", (0, 3, 0), -2)), "candidate 3, level 0: -2"),
        # history states and K/V
        (dict(states=_with("states", (0, 2, 1), np.inf)), r"HISTORY_STATES holds 1 non-finite value"),
        (dict(keys=_with("keys", (0, 1, 2, 0, 5), np.nan)),
         r"HISTORY_KEYS holds 1 non-finite value\(s\).* \[0, 1, 2, 0, 5\]"),
        (dict(values=_with("values", (0, 0, 0, 1, 0), -np.inf)), "HISTORY_VALUES holds 1 non-finite value"),
    ]
    for kwargs, message in cases:
        with pytest.raises(RequestError, match=message):
            _rank_check(**kwargs)
    # an empty beam anywhere (item 0, -inf, codes -1) is fine, so is a real code on it
    _rank_check(log_probs=_with("log_probs", (0, 0), -np.inf), candidates=_with("candidates", (0, 0), 0),
                codes=_with("codes", (0, 0), -1))
    _rank_check(codes=_with("codes", (0, 3), 0))
    _rank_check(log_probs=_with("log_probs", (0, 1), 0.0))  # log 1, and float rounding just above it
    _rank_check(log_probs=_with("log_probs", (0, 1), 1e-6))


def test_error_codes():
    class Codes:  # stands in for TritonError's code constants
        NOT_FOUND, UNAVAILABLE, INVALID_ARG = "not-found", "unavailable", "invalid"

    assert error_code(P.NOT_FOUND, Codes) == "not-found"
    assert error_code(P.RESOURCE_EXHAUSTED, Codes) == "unavailable"
    assert error_code("UNAVAILABLE", Codes) == "unavailable"
    for status in (P.INVALID_ARGUMENT, P.FAILED_PRECONDITION, "anything else"):
        assert error_code(status, Codes) == "invalid"


# ------------------------------------------------------------------------------ session ids
def test_an_integer_id_is_its_signed_int64_in_every_form():
    # Triton hands the model a negative id as uint64; the client sends an id >= 2**63 as the int64 it wraps to
    assert P.session_key(-5) == P.session_key((1 << 64) - 5) == P.session_key(np.uint64((1 << 64) - 5)) == "i:-5"
    assert P.session_key(42) == "i:42" and P.session_key("42") == "s:42"  # integer and string ids never collide
    assert P.session_key("nulrX\0x") != P.session_key("nulrX")  # a string is kept whole
    assert P.parse_session_id("-5") == -5 and P.parse_session_id("42", string=True) == "42"
    assert [P.parse_session_id(t) for t in ("u-1", "--5", "5-", "\u0663")] == ["u-1", "--5", "5-", "\u0663"]


def test_the_balancer_header_is_ascii_and_tells_every_id_apart():
    ids = ["ü-1", "u-1", "a%b", "a%25b", "a b", "42", 42, -5, "i:-5", "s:x", "x" * 128, "\u4e2d\u6587"]
    values = [P.session_header(i) for i in ids]
    assert len(set(values)) == len(ids)  # unambiguous
    assert all(v.isascii() and v.isprintable() for v in values)  # what gRPC metadata carries
    assert P.session_header("ü-1") == "s:%C3%BC-1" and P.session_header((1 << 64) - 5) == "i:-5"


def test_a_session_id_that_cannot_travel_whole_is_refused_by_the_client():
    from clients.client import wire_session_id

    # Triton's Python backend hands the model a string id up to its first NUL: "nulrX\0x" would be "nulrX"'s session
    with pytest.raises(ValueError, match="NUL"):
        wire_session_id("nulrX\0x")
    # Triton's limit is 128 bytes of UTF-8: 65 characters of "ü" are 130
    with pytest.raises(ValueError, match="at most 128 bytes in UTF-8.*got 130 bytes"):
        wire_session_id("ü" * 65)
    with pytest.raises(ValueError, match="at most 128 bytes"):
        wire_session_id("x" * 129)
    assert wire_session_id("ü" * 64) == "ü" * 64 and wire_session_id((1 << 64) - 5) == -5
    with pytest.raises(ValueError) as e:  # the message shows a prefix of the id, not all of it
        wire_session_id("y" * 1_000_000)
    assert len(str(e.value)) < 300 and "1000000 characters" in str(e.value)


def test_the_client_sends_the_encoded_header_and_does_not_resend_what_grpc_found_too_large():
    from tritonclient.utils import InferenceServerException

    from clients.client import RecommenderClient, RecommenderError

    sent = []

    def infer(model, inputs, **kw):  # gRPC's answer to a response whose metadata is over its limit
        sent.append(kw["headers"][P.SESSION_HEADER])
        raise InferenceServerException("Stream removed (received metadata size exceeds hard limit (value length "
                                       "1048631 vs. 16384))", status="StatusCode.RESOURCE_EXHAUSTED")

    with RecommenderClient("127.0.0.1:1") as c:
        c._client.infer = infer
        with pytest.raises(RecommenderError, match="RESOURCE_EXHAUSTED"):
            c.recommend("ü-1")
        assert sent == ["s:%C3%BC-1"] and c.retried == 0


def test_a_tagged_status_is_read_back_only_where_triton_puts_it():
    message = P.tagged_message(P.FAILED_PRECONDITION, "session 'a': EVENTS_BEFORE is 5 but the server holds 2 events")
    assert P.status_of(P.INVALID_ARGUMENT, "in ensemble 'recommend', " + message) == P.FAILED_PRECONDITION
    assert P.tagged_message(P.INVALID_ARGUMENT, "bad") == "bad" and P.status_of(P.INVALID_ARGUMENT, "bad") == P.INVALID_ARGUMENT


# ------------------------------------------------------------------------------ request values in messages
def test_a_huge_request_value_gives_a_short_message():
    from backend_src.serving.validation import decode_strings, preview

    huge = "m" * (1 << 20)
    with pytest.raises(RequestError) as e:
        parse_options({"DECODE_MODE": np.array([[huge.encode()]], dtype=object)}, DecodeOptions(), 10, LIMITS)
    assert len(e.value.message) < 300 and f"({1 << 20} characters)" in e.value.message
    with pytest.raises(RequestError) as e:
        decode_strings(np.array([[b"\xff" * (1 << 20)]], dtype=object), "ITEM_IDS")
    assert len(e.value.message) < 300 and f"({1 << 20} bytes)" in e.value.message
    assert preview("short") == "'short'" and len(preview(list(range(10**5)))) < 100


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
    texts = render(CFG, ServingOptions(visit_idle_s=30, encoder_instances=2))
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
    assert "code_root" not in enc.parameters  # a version runs its own code: no path in any config
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
    from backend_src.model.recommender import GenerativeRecommender

    path = tmp_path / "ckpt.pt"
    GenerativeRecommender.untrained([None] + [f"sku-{i}" for i in range(1, 51)], 20, seed=0).save(path)
    return path


def test_publish_rollback_and_version_numbers(tmp_path, fake_checkpoint):
    repo = tmp_path / "repo"
    assert pub.publish(fake_checkpoint, repo, export_ranker=False) == {m: 1 for m in P.PYTHON_MODELS}
    onnx = tmp_path / "r.onnx"
    onnx.write_bytes(b"onnx")
    assert pub.publish(fake_checkpoint, repo, ranker_onnx=onnx) == {m: 2 for m in P.PYTHON_MODELS}
    for m in P.PYTHON_MODELS:
        v = repo / m / "2"
        assert (v / "model.py").read_bytes() == (pub.PROJECT_ROOT / "model_repository" / m / "model.py").read_bytes()
        assert (v / "backend_src" / "model" / "recommender.py").is_file() and not list(v.rglob("__pycache__"))
        assert (v / f"{pub.STAGES[m]}.pt").is_file() and not (v / "model.pt").exists()
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


def test_rollout_targets_the_running_cluster(tmp_path):
    """export.rollout takes the repository, every replica and the admin key from the state the
    cluster's start left; without one it says so and changes nothing."""
    import json

    from export import rollout

    assert rollout.main(["rollback", "--dir", str(tmp_path)]) == 3
    key = "k" * 24
    (tmp_path / "admin.key").write_text(key + "\n")
    replicas = [{"grpc": "127.0.0.1:1"}, {"grpc": "127.0.0.1:2"}]
    state = {"repository": str(tmp_path / "repo"), "admin_key_file": str(tmp_path / "admin.key"), "replicas": replicas}
    (tmp_path / "cluster.json").write_text(json.dumps(state))
    assert rollout.cluster_target(tmp_path) == (str(tmp_path / "repo"), ["127.0.0.1:1", "127.0.0.1:2"], key)


# ------------------------------------------------------------------------------ the watchdog's keeper
def _answers(url: str) -> bool:
    try:
        urllib.request.urlopen(url, timeout=2).close()
    except urllib.error.HTTPError:
        return True  # 503: there is no server, but the watchdog answers
    except OSError:
        return False
    return True


def _wait(condition, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


def test_keeper_starts_the_watchdog_again_until_stopped(tmp_path):
    """A watchdog that fails (its port is taken) or is killed is started again, after a growing
    wait; SIGTERM to the keeper ends both at once."""
    server = subprocess.Popen(["sleep", "120"])  # stands in for tritonserver: only its pid is watched
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port, log_file = taken.getsockname()[1], tmp_path / "watchdog.log"
    keeper = subprocess.Popen(
        [sys.executable, "-m", "backend_src.serving.watchdog", "--keep", f"--server-pid={server.pid}",
         "--grpc-url=127.0.0.1:9", "--http-url=127.0.0.1:9", f"--ready-port={port}", f"--log-file={log_file}",
         "--probe-interval=0"],
        cwd=Path(__file__).resolve().parents[1], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        _wait(lambda: log_file.exists() and log_file.read_text().count("died (exit status 1)") >= 2, 30,
              "a watchdog that cannot bind its port is not started again")
        assert "starting it again in 1 s" in log_file.read_text() and "starting it again in 2 s" in log_file.read_text()
        taken.close()
        _wait(lambda: _answers(f"http://127.0.0.1:{port}/live"), 30, "no watchdog after the port was freed")
        (first,) = watchdogs(keeper.pid)
        os.kill(first, signal.SIGKILL)
        _wait(lambda: watchdogs(keeper.pid) not in ([], [first]), 30, "a killed watchdog is not started again")
        (second,) = watchdogs(keeper.pid)
        _wait(lambda: _answers(f"http://127.0.0.1:{port}/live"), 30, "the new watchdog does not answer")
        keeper.send_signal(signal.SIGTERM)
        assert keeper.wait(10) == 0  # it returns once it has reaped its watchdog
        assert not running(second)
    finally:
        taken.close()
        if keeper.poll() is None:
            keeper.kill()
        server.kill()
        server.wait()
