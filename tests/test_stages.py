"""The served stages' request handling in one process, without Triton (backend_src.serving.stages): the
encoder's sessions (open, append, recommend; exactly once across retries; gaps; a refused request changes
nothing; a session rebuilt from the log), the decoder's batches by decode options, the ranker's top-K and
EXCLUDE_SEEN, the three chained equal to the offline model, and the adapter between Triton and a stage.
Each stage loads a tiny, untrained model published as the server would load it."""
import dataclasses
import importlib
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

from backend_src.config import DecodeOptions
from backend_src.model.recommender import GenerativeRecommender
from backend_src.serving.stages import startup, stub
from backend_src.serving.stages.decoder import DecoderStage
from backend_src.serving.stages.encoder import EncoderStage
from backend_src.serving.stages.messages import END, INTERNAL, START, StageRequest, StageResponse
from backend_src.serving.stages.ranker import RankerStage
from backend_src.serving.validation import RequestError
from export import publish as pub
from export.triton_configs import ServingOptions
from genrec_contract import protocol as P
from serving_helpers import build_tiny_checkpoint

NUM_ITEMS = 60
MAX_HISTORY = 20
DECODE = DecodeOptions(mode="pfa", beam_width=8, k=8, r=0.5, selection_step=1)
TOP_K = 5
STAND_IN = Path(__file__).parent / "triton_stand_in"


def item_id(i: int) -> str:
    return f"sku-{i}"


@pytest.fixture(scope="module")
def published(tmp_path_factory):
    """A repository with one published version of each stage; the whole model for offline answers."""
    tmp = tmp_path_factory.mktemp("stages")
    ckpt = tmp / "model.pt"
    build_tiny_checkpoint(ckpt, [None] + [item_id(i) for i in range(1, NUM_ITEMS + 1)], MAX_HISTORY, seed=3)
    repo = tmp / "model_repository"
    pub.publish(ckpt, repo, ServingOptions(decode=DECODE, top_k=TOP_K, ranker_backend="torch"), export_ranker=False)
    return repo, GenerativeRecommender.load(ckpt)


def params(repo: Path, model: str, **override) -> dict:
    cfg = text_format.Parse((repo / model / "config.pbtxt").read_text(), model_config_pb2.ModelConfig())
    return {k: v.string_value for k, v in cfg.parameters.items()} | {k: str(v) for k, v in override.items()}


@pytest.fixture()
def encoder(published, tmp_path, monkeypatch):
    monkeypatch.delenv("GENREC_EVENT_LOG", raising=False)
    repo, _ = published
    stage = EncoderStage(repo / P.ENCODER / "1", params(repo, P.ENCODER, event_log=tmp_path / "events.sqlite3"))
    yield stage
    stage.close()


@pytest.fixture(scope="module")
def decoder(published):
    repo, _ = published
    return DecoderStage(repo / P.DECODER / "1", params(repo, P.DECODER))


@pytest.fixture(scope="module")
def ranker(published):
    repo, _ = published
    return RankerStage(repo / P.RANKER / "1", params(repo, P.RANKER))


def events_request(sid, first: int, n: int, before=None, flags=0, t0: int = 1000, **options) -> StageRequest:
    """n events of items first, first+1, ... at t0 + 60 i (before: EVENTS_BEFORE; options: name -> value)."""
    inputs = {
        P.ITEM_IDS.name: np.array([[item_id(1 + (first + i - 1) % NUM_ITEMS).encode() for i in range(n)]], dtype=object).reshape(1, n),
        P.ACTIONS.name: np.ones((1, n), np.int64),
        P.TIMESTAMPS.name: (t0 + 60 * np.arange(n, dtype=np.int64))[None],
    }
    if before is not None:
        inputs[P.EVENTS_BEFORE.name] = np.array([[before]], np.int64)
    for name, value in options.items():
        spec = next(s for s in P.OPTION_INPUTS if s.name == name)
        inputs[name] = np.array([[value.encode() if isinstance(value, str) else value]], dtype=spec.numpy_dtype)
    return StageRequest(inputs, sid, flags)


def one(stage, request) -> StageResponse:
    (response,) = stage.handle([request])
    return response


def scalars(response: StageResponse) -> dict:
    assert response.error is None, response.error
    o = response.outputs
    return {"count": int(o[P.EVENT_COUNT.name][0, 0]), "length": int(o[P.HISTORY_LENGTH.name][0, 0]),
            "truncated": int(o[P.TRUNCATED.name][0, 0]), "restored": bool(o[P.RESTORED.name][0, 0])}


def state(stage: EncoderStage, sid) -> dict:
    key = P.session_key(sid)
    session = stage.store.get(key)
    return {"logged": stage.log.count(key), "cached": None if session is None else session.count}


def offline_states(model, items, timestamps):
    idx = torch.as_tensor(model.item_indices(items))[None]
    with torch.no_grad():
        return model.encode(idx, torch.ones_like(idx), torch.as_tensor(timestamps)[None], torch.tensor([len(items)]))


# ------------------------------------------------------------------------------ encoder
def test_encoder_open_append_recommend_match_the_offline_encoding(encoder, published):
    _, model = published
    opened = one(encoder, events_request(7, 1, 5, before=0, flags=START))
    assert scalars(opened) == {"count": 5, "length": 5, "truncated": 0, "restored": False}
    o = opened.outputs
    L, D = model.cfg.num_layers, model.cfg.d_model
    assert o[P.HISTORY_STATES.name].shape == (1, 5, D) and o[P.HISTORY_KEYS.name].shape[:3] == (1, L, 5)
    assert o[P.HISTORY_ITEMS.name].tolist() == [model.item_indices([item_id(i) for i in range(1, 6)]).tolist()]

    appended = one(encoder, events_request(7, 6, 2, before=5, t0=2000))
    assert scalars(appended) == {"count": 7, "length": 7, "truncated": 0, "restored": False}
    recommend = one(encoder, events_request(7, 1, 0, before=7))
    assert scalars(recommend)["count"] == 7
    # the appended cache is the whole history encoded at once
    items = [item_id(i) for i in range(1, 8)]
    cache = offline_states(model, items, [1000 + 60 * i for i in range(5)] + [2000, 2060])
    for out in (appended, recommend):
        np.testing.assert_allclose(out.outputs[P.HISTORY_STATES.name], cache.states.numpy(), rtol=1e-4, atol=1e-5)
    assert state(encoder, 7) == {"logged": 7, "cached": 7}


def test_encoder_applies_each_event_once_across_retries(encoder):
    one(encoder, events_request(8, 1, 5, before=0, flags=START))
    first = one(encoder, events_request(8, 6, 2, before=5, t0=2000))
    retry = one(encoder, events_request(8, 6, 2, before=5, t0=2000))  # the same request again: nothing applied twice
    assert scalars(first)["count"] == scalars(retry)["count"] == 7
    np.testing.assert_array_equal(first.outputs[P.HISTORY_STATES.name], retry.outputs[P.HISTORY_STATES.name])
    # a retry that overlaps: the event the server has is skipped, the new one applied
    overlap = one(encoder, events_request(8, 7, 2, before=6, t0=2060))
    assert scalars(overlap)["count"] == 8 and state(encoder, 8) == {"logged": 8, "cached": 8}
    encoder.handle([])  # metrics are published once per call
    assert encoder.metrics.totals["replayed"] == 2 + 1 and encoder.metrics.totals["logged"] == 5 + 2 + 1


def test_encoder_refuses_a_gap_and_an_unknown_session_changing_nothing(encoder):
    one(encoder, events_request(9, 1, 3, before=0, flags=START))
    gap = one(encoder, events_request(9, 4, 2, before=5, t0=2000))
    assert gap.status == P.FAILED_PRECONDITION and "server holds 3 events" in gap.error
    assert state(encoder, 9) == {"logged": 3, "cached": 3}
    unknown = one(encoder, events_request(10, 1, 0))
    assert unknown.status == P.NOT_FOUND and state(encoder, 10) == {"logged": 0, "cached": None}
    no_id = one(encoder, events_request(0, 1, 2, before=0, flags=START))
    assert no_id.status == P.INVALID_ARGUMENT and "needs a sequence id" in no_id.error


@pytest.mark.parametrize("bad, message", [
    (dict(TOP_K=0), "TOP_K must be in"),
    (dict(DECODE_MODE="beam"), "DECODE_MODE must be one of"),
    (dict(TOP_K=9), r"TOP_K \(9\) must not exceed BEAM_WIDTH \(8\)"),
    (dict(backwards=True), "TIMESTAMPS out of order: event 1 at 5000 is before event 0 at 5060"),
    (dict(empty_id=True), "ITEM_IDS: item 0 is ''; an item id is 1 to 256 bytes"),
])
def test_encoder_refused_request_changes_nothing(encoder, bad, message):
    """Bad options, events out of time order, an empty item id: refused with END set, the log and the cache as they were."""
    import re

    before = one(encoder, events_request(11, 1, 4, before=0, flags=START))
    kwargs = dict(first=5, t0=5000) | {k: v for k, v in bad.items() if k not in ("empty_id", "backwards")}
    request = events_request(11, kwargs.pop("first"), 2, before=4, flags=END, t0=kwargs.pop("t0"), **kwargs)
    if bad.get("backwards"):  # a request whose own events go back in time
        request.inputs[P.TIMESTAMPS.name] = np.array([[5060, 5000]], np.int64)
    if bad.get("empty_id"):
        request.inputs[P.ITEM_IDS.name] = np.array([[b"", b"sku-1"]], dtype=object)
    refused = one(encoder, request)
    assert refused.status == P.INVALID_ARGUMENT and re.search(message, refused.error), refused.error
    assert state(encoder, 11) == {"logged": 4, "cached": 4}
    after = one(encoder, events_request(11, 1, 0, before=4))
    np.testing.assert_array_equal(after.outputs[P.HISTORY_STATES.name], before.outputs[P.HISTORY_STATES.name])


def test_encoder_accepts_events_on_items_it_does_not_know(encoder, published):
    """An event naming an item the version was not trained on is accepted, logged with its raw id and
    encoded with the learned unknown-item vector (its position, action and time count); UNKNOWN_ITEMS
    says how many of the history's events are such; a rebuild from the log encodes the same."""
    _, model = published
    request = events_request(19, 1, 3, before=0, flags=START)
    request.inputs[P.ITEM_IDS.name][0, 1] = "new-sku-\u00e9".encode()
    opened = one(encoder, request)
    assert scalars(opened)["count"] == 3 and int(opened.outputs[P.UNKNOWN_ITEMS.name][0, 0]) == 1
    assert encoder.log.tail("i:19", 3).items == [item_id(1), "new-sku-\u00e9", item_id(3)]
    idx = torch.tensor([[1, model.unknown_index, 3]])
    with torch.no_grad():
        want = model.encode(idx, torch.ones_like(idx), torch.tensor([[1000, 1060, 1120]]), torch.tensor([3])).states
    np.testing.assert_allclose(opened.outputs[P.HISTORY_STATES.name], want.numpy(), atol=1e-5)
    unk = model.backbone.item_embedding.weight.detach()[model.unknown_index]
    assert float(unk.norm()) > 0 and not any(torch.equal(unk, row) for row in model.backbone.item_embedding.weight.detach()[:-1])
    appended = one(encoder, events_request(19, 5, 1, before=3, t0=2000))
    assert scalars(appended)["count"] == 4 and int(appended.outputs[P.UNKNOWN_ITEMS.name][0, 0]) == 1
    encoder.store.discard("i:19")  # rebuilt from the log: the unknown id read back, encoded the same
    rebuilt = one(encoder, events_request(19, 1, 0, before=4))
    assert scalars(rebuilt)["restored"] and int(rebuilt.outputs[P.UNKNOWN_ITEMS.name][0, 0]) == 1
    np.testing.assert_allclose(rebuilt.outputs[P.HISTORY_STATES.name], appended.outputs[P.HISTORY_STATES.name], atol=1e-5)


def test_encoder_handles_one_sessions_requests_in_order_and_others_together(encoder):
    responses = encoder.handle([
        events_request(12, 1, 3, before=0, flags=START),
        events_request(13, 10, 2, before=0, flags=START),
        events_request(12, 4, 1, before=3, t0=2000),  # the same session: a later round sees the first's events
        events_request(12, 4, 1, before=3, t0=2000),  # its retry in the same call
    ])
    assert [scalars(r)["count"] for r in responses] == [3, 2, 4, 4]


def test_encoder_rebuilds_a_session_from_the_log(encoder, published, tmp_path):
    repo, model = published
    one(encoder, events_request(14, 1, 6, before=0, flags=START))
    fresh = EncoderStage(repo / P.ENCODER / "1", params(repo, P.ENCODER, event_log=tmp_path / "events.sqlite3"))
    try:
        rebuilt = one(fresh, events_request(14, 7, 1, before=6, t0=3000))
        assert scalars(rebuilt) == {"count": 7, "length": 7, "truncated": 0, "restored": True}
        cache = offline_states(model, [item_id(i) for i in range(1, 8)], [1000 + 60 * i for i in range(6)] + [3000])
        np.testing.assert_allclose(rebuilt.outputs[P.HISTORY_STATES.name], cache.states.numpy(), rtol=1e-4, atol=1e-5)
        fresh.handle([])
        assert fresh.metrics.totals["restored"] == 1
    finally:
        fresh.close()


def test_encoder_keeps_the_most_recent_events(encoder):
    opened = one(encoder, events_request(15, 1, MAX_HISTORY + 4, before=0, flags=START))
    assert scalars(opened) == {"count": MAX_HISTORY + 4, "length": MAX_HISTORY, "truncated": 4, "restored": False}
    grown = one(encoder, events_request(15, 30, 2, before=MAX_HISTORY + 4, t0=10**6))
    assert scalars(grown) == {"count": MAX_HISTORY + 6, "length": MAX_HISTORY, "truncated": 2, "restored": False}


def test_encoder_answers_unavailable_when_the_log_is_and_changes_nothing(encoder, monkeypatch):
    one(encoder, events_request(16, 1, 3, before=0, flags=START))

    def down(*args, **kwargs):
        raise ConnectionError("log down")

    monkeypatch.setattr(encoder.log, "counts", down)
    refused = one(encoder, events_request(16, 4, 1, before=3, t0=2000))
    assert refused.status == P.UNAVAILABLE and "event log is unavailable" in refused.error
    monkeypatch.undo()
    assert state(encoder, 16) == {"logged": 3, "cached": 3}


def logged_events(stage: EncoderStage, sid) -> list:
    tail = stage.log.tail(P.session_key(sid), 1000)
    return list(zip(tail.items, tail.actions, tail.timestamps))


def test_encoder_tells_a_retry_from_a_second_writer(encoder):
    """Writer A and writer B (a second device after resume) both append after event 0: A's lands, B's is refused
    with ABORTED naming what to re-send and after how many events; A's retry is still applied once."""
    one(encoder, events_request(17, 1, 1, before=0, flags=START))
    a = one(encoder, events_request(17, 2, 1, before=1, t0=2000))
    b = one(encoder, events_request(17, 3, 1, before=1, t0=2000))  # B's view of the count is stale
    assert scalars(a)["count"] == 2 and b.status == P.ABORTED, b.error
    assert "events 1..1 are held and differ" in b.error and P.resend_of(b.error) == (0, 2)
    assert state(encoder, 17) == {"logged": 2, "cached": 2}  # the refusal changed nothing
    b = one(encoder, events_request(17, 3, 1, before=2, t0=2000))  # re-sent after the events held
    retry_a = one(encoder, events_request(17, 2, 1, before=1, t0=2000))  # A's answer was lost: its retry
    assert scalars(b)["count"] == scalars(retry_a)["count"] == 3
    assert logged_events(encoder, 17) == [(item_id(1), 1, 1000), (item_id(2), 1, 2000), (item_id(3), 1, 2000)]
    # a history re-sent whole (open_session) that matches the log up to an event: only the rest is refused
    history = events_request(17, 1, 3, before=0)
    history.inputs[P.TIMESTAMPS.name] = np.array([[1000, 2000, 2000]], np.int64)
    assert scalars(one(encoder, history))["count"] == 3  # the same three events: a retry
    history.inputs[P.ITEM_IDS.name] = np.array([[item_id(1).encode(), item_id(2).encode(), b"sku-9"]], dtype=object)
    refused = one(encoder, history)
    assert refused.status == P.ABORTED and P.resend_of(refused.error) == (2, 3)
    encoder.handle([])
    assert encoder.metrics.totals["replayed"] == 1 + 3 and encoder.metrics.totals["logged"] == 3


def test_encoder_write_race_loser_retries_into_a_conflict(encoder, published, tmp_path, monkeypatch):
    """Two encoders (instances or replicas) on one log append to a session at the same moment: the log's
    compare-and-append takes one; the other is answered UNAVAILABLE, and its retry is a conflict it resolves."""
    repo, _ = published
    one(encoder, events_request(18, 1, 2, before=0, flags=START))
    other = EncoderStage(repo / P.ENCODER / "1", params(repo, P.ENCODER, event_log=tmp_path / "events.sqlite3"))
    try:
        assert scalars(one(other, events_request(18, 1, 0, before=2)))["restored"]  # both hold the session at count 2
        write = other.log.append_many

        def write_after_the_first_writer(writes):  # the first writer's append lands between plan and write
            assert scalars(one(encoder, events_request(18, 10, 1, before=2, t0=3000)))["count"] == 3
            monkeypatch.setattr(other.log, "append_many", write)
            return write(writes)

        monkeypatch.setattr(other.log, "append_many", write_after_the_first_writer)
        lost = one(other, events_request(18, 20, 1, before=2, t0=3000))
        assert lost.status == P.UNAVAILABLE and "at the same time" in lost.error
        retried = one(other, events_request(18, 20, 1, before=2, t0=3000))
        assert retried.status == P.ABORTED and P.resend_of(retried.error) == (0, 3)
        assert scalars(one(other, events_request(18, 20, 1, before=3, t0=3000)))["count"] == 4
        assert [e[0] for e in logged_events(other, 18)] == [item_id(1), item_id(2), item_id(10), item_id(20)]
    finally:
        other.close()


def test_encoder_logs_a_second_writers_late_event_as_given(encoder, published, tmp_path):
    """An event older than the session's last (another device's clock) lands: logged with its own timestamp,
    encoded at the session's last time, and a session rebuilt from the log encodes it the same way."""
    repo, model = published
    one(encoder, events_request(19, 1, 3, before=0, flags=START))  # at 1000, 1060, 1120
    late = one(encoder, events_request(19, 4, 2, before=3, t0=500))  # at 500, 560
    assert scalars(late)["count"] == 5
    assert [e[2] for e in logged_events(encoder, 19)] == [1000, 1060, 1120, 500, 560]
    assert late.outputs[P.HISTORY_TIMESTAMPS.name].tolist() == [[1000, 1060, 1120, 1120, 1120]]
    cache = offline_states(model, [item_id(i) for i in range(1, 6)], [1000, 1060, 1120, 1120, 1120])
    np.testing.assert_allclose(late.outputs[P.HISTORY_STATES.name], cache.states.numpy(), rtol=1e-4, atol=1e-5)
    assert scalars(one(encoder, events_request(19, 4, 2, before=3, t0=500)))["count"] == 5  # its retry: applied once
    fresh = EncoderStage(repo / P.ENCODER / "1", params(repo, P.ENCODER, event_log=tmp_path / "events.sqlite3"))
    try:
        rebuilt = one(fresh, events_request(19, 1, 0, before=5))
        assert scalars(rebuilt)["restored"]
        np.testing.assert_array_equal(rebuilt.outputs[P.HISTORY_TIMESTAMPS.name], late.outputs[P.HISTORY_TIMESTAMPS.name])
        np.testing.assert_allclose(rebuilt.outputs[P.HISTORY_STATES.name], late.outputs[P.HISTORY_STATES.name], rtol=1e-4, atol=1e-5)
    finally:
        fresh.close()


def test_encoder_refuses_claims_older_than_the_log_keeps(published, tmp_path, monkeypatch):
    """Positions the log no longer keeps cannot be compared: a request whose claimed events all lie there is
    refused (FAILED_PRECONDITION), neither dropped as a retry nor doubled; a history re-sent whole is compared
    on the part the log keeps."""
    monkeypatch.delenv("GENREC_EVENT_LOG", raising=False)
    repo, _ = published
    stage = EncoderStage(repo / P.ENCODER / "1", params(repo, P.ENCODER, event_log=tmp_path / "e.sqlite3", log_retain_events=1))
    try:
        n = MAX_HISTORY + 5  # the log keeps the last MAX_HISTORY (retention is at least the history kept)
        assert scalars(one(stage, events_request(20, 1, n, before=0, flags=START)))["count"] == n
        old = one(stage, events_request(20, 40, 1, before=2, t0=10**6))
        assert old.status == P.FAILED_PRECONDITION and "events 2..2 are older than" in old.error and f"holds {n} events" in old.error
        assert scalars(one(stage, events_request(20, 1, n, before=0)))["count"] == n  # the whole history again: a retry
        assert stage.log.count(P.session_key(20)) == n
    finally:
        stage.close()


def test_encoder_keys_a_negative_id_as_sent_and_the_deletion_command_erases_it(encoder, tmp_path, capsys):
    """Triton hands the model the id -5 as 2**64 - 5: the session is "i:-5", the one `delete --session -5`
    erases, together with what was logged under the unsigned key before."""
    from backend_src.serving.event_log.cli import main as event_log_cli

    opened = one(encoder, events_request((1 << 64) - 5, 1, 2, before=0, flags=START))
    assert scalars(opened)["count"] == 2 and state(encoder, -5)["logged"] == 2
    encoder.log.append(f"i:{(1 << 64) - 5}", 0, ["sku-1"], [1], [1000])  # a log of the unsigned key
    assert event_log_cli(["delete", "--log", str(tmp_path / "events.sqlite3"), "--session", "-5"]) == 0
    assert '"deleted": true' in capsys.readouterr().out
    assert encoder.log.counts(["i:-5", f"i:{(1 << 64) - 5}"]) == [0, 0]
    assert one(encoder, events_request((1 << 64) - 5, 1, 0)).status == P.NOT_FOUND  # served no more
    # both forms of the id in one call are one session: its requests in order, not side by side
    answers = encoder.handle([events_request(-5, 1, 2, before=0, flags=START),
                              events_request((1 << 64) - 5, 3, 1, before=2, t0=2000)])
    assert [scalars(a)["count"] for a in answers] == [2, 3]


def test_encoder_refuses_huge_values_with_a_short_message(encoder):
    """A 1 MB item id or option value is named by its first characters and its length."""
    request = events_request(17, 1, 2, before=0, flags=START)
    request.inputs[P.ITEM_IDS.name] = np.array([[b"x" * (1 << 20), b"sku-1"]], dtype=object)
    refused = one(encoder, request)
    assert refused.status == P.INVALID_ARGUMENT and "ITEM_IDS: item 0 is 'xxx" in refused.error
    assert len(refused.error) < 300 and f"({1 << 20} characters)" in refused.error
    assert state(encoder, 17) == {"logged": 0, "cached": None}
    refused = one(encoder, events_request(17, 1, 2, before=0, flags=START, DECODE_MODE="m" * (1 << 20)))
    assert refused.status == P.INVALID_ARGUMENT and "DECODE_MODE" in refused.error and len(refused.error) < 300


# ------------------------------------------------------------------------------ decoder
def states_request(states: np.ndarray, **options) -> StageRequest:
    inputs = {P.HISTORY_STATES.name: states[None].astype(np.float32)}
    for name, value in options.items():
        spec = next(s for s in P.DECODE_OPTION_INPUTS if s.name == name)
        inputs[name] = np.array([[value.encode() if isinstance(value, str) else value]], dtype=spec.numpy_dtype)
    return StageRequest(inputs)


def test_decoder_batches_requests_by_their_decode_options(decoder, monkeypatch):
    rng = np.random.default_rng(0)
    histories = [rng.standard_normal((n, decoder.model.cfg.d_model)).astype(np.float32) for n in (3, 7, 5, 4)]
    requests = [
        states_request(histories[0]),
        states_request(histories[1], DECODE_MODE="full"),
        states_request(histories[2], BEAM_WIDTH=DECODE.beam_width),  # the default, given: the same options
        states_request(histories[3], PFA_K=0),  # refused alone
    ]
    alone = [one(decoder, r) for r in requests[:3]]
    calls = []
    real = decoder._decode
    monkeypatch.setattr(decoder, "_decode", lambda states, opts: calls.append((len(states), opts)) or real(states, opts))
    together = decoder.handle(requests)
    assert sorted(len_ for len_, _ in calls) == [1, 2]
    assert {opts for _, opts in calls} == {DECODE, dataclasses.replace(DECODE, mode="full")}
    for a, b in zip(alone, together):
        assert a.error is None and b.error is None
        np.testing.assert_array_equal(a.outputs[P.CANDIDATE_ITEMS.name], b.outputs[P.CANDIDATE_ITEMS.name])
        np.testing.assert_allclose(a.outputs[P.CANDIDATE_LOG_PROBS.name], b.outputs[P.CANDIDATE_LOG_PROBS.name], rtol=1e-5, atol=1e-5)
    assert together[0].outputs[P.CANDIDATE_ITEMS.name].shape == (1, DECODE.beam_width)
    assert together[3].status == P.INVALID_ARGUMENT and "PFA_K must be in" in together[3].error


def test_decoder_checks_its_inputs(decoder):
    bad = np.zeros((3, decoder.model.cfg.d_model), np.float32)
    bad[1, 2] = np.nan
    refused = one(decoder, states_request(bad))
    assert refused.status == P.INVALID_ARGUMENT and "non-finite" in refused.error
    wrong = one(decoder, StageRequest({P.HISTORY_STATES.name: np.zeros((1, 3, 5), np.float32)}))
    assert wrong.status == P.INVALID_ARGUMENT and "HISTORY_STATES" in wrong.error


def test_decode_options_are_their_own_key():
    a, b = DecodeOptions(beam_width=8), DecodeOptions(beam_width=8)
    assert a == b and hash(a) == hash(b) and len({a, b, DecodeOptions(beam_width=9)}) == 2
    with pytest.raises(AttributeError):
        a.beam_width = 9  # frozen: an options object used as a key never changes


# ------------------------------------------------------------------------------ ranker (and the three chained)
def ranker_request(encoded: StageResponse, decoded: StageResponse, **options) -> StageRequest:
    names = [t.name for t in P.RANKER_CONTRACT.inputs if t.name in encoded.outputs or t.name in decoded.outputs]
    inputs = {n: encoded.outputs.get(n, decoded.outputs.get(n)) for n in names}
    if "TOP_K" in options:
        inputs[P.TOP_K.name] = np.array([[options["TOP_K"]]], np.int32)
    if "EXCLUDE_SEEN" in options:
        inputs[P.EXCLUDE_SEEN.name] = np.array([[options["EXCLUDE_SEEN"]]], np.bool_)
    return StageRequest(inputs)


def chain(encoder, decoder, sid, n):
    encoded = one(encoder, events_request(sid, 1, n, before=0, flags=START))
    decoded = one(decoder, StageRequest({P.HISTORY_STATES.name: encoded.outputs[P.HISTORY_STATES.name]}))
    return encoded, decoded


def test_three_stages_chained_equal_the_offline_model(encoder, decoder, ranker, published):
    _, model = published
    encoded, decoded = chain(encoder, decoder, 20, 6)
    ranked = one(ranker, ranker_request(encoded, decoded))
    assert ranked.error is None
    cache = offline_states(model, [item_id(i) for i in range(1, 7)], [1000 + 60 * i for i in range(6)])
    rec = model.recommend(cache, DECODE, top_k=TOP_K)
    assert [x.decode() for x in ranked.outputs[P.RECOMMENDED_IDS.name][0]] == [model.item_ids[i] or "" for i in rec.items[0].tolist()]
    np.testing.assert_allclose(ranked.outputs[P.RANK_SCORES.name][0], rec.rank_scores[0].numpy(), rtol=1e-4, atol=1e-4)
    assert ranked.outputs[P.SEMANTIC_IDS.name].shape == (1, TOP_K, model.cfg.num_codes)


def test_ranker_top_k_exclude_seen_and_batches(encoder, decoder, ranker):
    encoded, decoded = chain(encoder, decoder, 21, 8)
    # the candidates include the history's items: EXCLUDE_SEEN leaves them out
    history = encoded.outputs[P.HISTORY_ITEMS.name][0]
    cands = decoded.outputs[P.CANDIDATE_ITEMS.name].copy()
    cands[0, :3] = history[:3]
    decoded = StageResponse({**decoded.outputs, P.CANDIDATE_ITEMS.name: cands})
    requests = [ranker_request(encoded, decoded, TOP_K=3), ranker_request(encoded, decoded, TOP_K=8, EXCLUDE_SEEN=True),
                ranker_request(encoded, decoded, TOP_K=300)]
    alone = [one(ranker, r) for r in requests]
    together = ranker.handle(requests)
    seen = {ranker.raw_ids[i] for i in history}
    kept, excluded = together[0].outputs, together[1].outputs
    assert kept[P.RECOMMENDED_IDS.name].shape == (1, 3) and excluded[P.RECOMMENDED_IDS.name].shape == (1, 8)
    scores = kept[P.RANK_SCORES.name][0]
    assert (np.diff(scores) <= 0).all()  # best first
    assert not seen & set(excluded[P.RECOMMENDED_IDS.name][0].tolist()) - {b""}
    assert seen & set(ranker.handle([ranker_request(encoded, decoded, TOP_K=8)])[0].outputs[P.RECOMMENDED_IDS.name][0].tolist())
    for a, b in zip(alone[:2], together[:2]):  # ranked in one batch as alone
        np.testing.assert_array_equal(a.outputs[P.RECOMMENDED_IDS.name], b.outputs[P.RECOMMENDED_IDS.name])
        np.testing.assert_allclose(a.outputs[P.RANK_SCORES.name], b.outputs[P.RANK_SCORES.name], rtol=1e-5, atol=1e-5)
    assert together[2].status == P.INVALID_ARGUMENT and "TOP_K must be in [1, 256], got 300" in together[2].error


# ------------------------------------------------------------------------------ start-up and Triton's side
def test_stub_keeps_each_status_as_tritons_error_code(monkeypatch):
    monkeypatch.syspath_prepend(str(STAND_IN))
    pb = importlib.import_module("triton_python_backend_utils")
    E = pb.TritonError
    responses = [
        StageResponse({"X": np.zeros((1, 2), np.float32)}),
        StageResponse.failed(RequestError("bad"), "stage"),
        StageResponse.failed(RequestError("gone", P.NOT_FOUND), "stage"),
        StageResponse.failed(RequestError("gap", P.FAILED_PRECONDITION), "stage"),
        StageResponse.failed(RequestError("busy", P.UNAVAILABLE), "stage"),
        StageResponse.failed(RequestError("full", P.RESOURCE_EXHAUSTED), "stage"),
        StageResponse.failed(RuntimeError("boom"), "stage"),
        StageResponse.internal(RequestError("late"), "stage"),
    ]
    out = stub.triton_responses(responses, pb)
    assert [t.name() for t in out[0].output_tensors()] == ["X"] and not out[0].has_error()
    assert [r.error().code() for r in out[1:]] == [E.INVALID_ARG, E.NOT_FOUND, E.INVALID_ARG, E.UNAVAILABLE, E.UNAVAILABLE,
                                                   E.INTERNAL, E.INTERNAL]
    assert out[6].error().message() == "stage: RuntimeError: boom" and responses[7].status == INTERNAL
    # Triton has no FAILED_PRECONDITION: it travels as INVALID_ARGUMENT, tagged, and the client reads it back
    assert out[3].error().message() == "[FAILED_PRECONDITION] gap" and out[1].error().message() == "bad"
    assert P.status_of(P.INVALID_ARGUMENT, "in ensemble 'recommend', " + out[3].error().message()) == P.FAILED_PRECONDITION
    assert P.status_of(P.INVALID_ARGUMENT, out[1].error().message()) == P.INVALID_ARGUMENT
    assert P.status_of(P.NOT_FOUND, "[FAILED_PRECONDITION] not from a stage's tag") == P.NOT_FOUND
    # nor ABORTED (another writer's events at the claimed positions): it travels as ALREADY_EXISTS, tagged
    (conflict,) = stub.triton_responses([StageResponse.failed(RequestError("taken; " + P.resend_after(0, 2), P.ABORTED), "s")], pb)
    assert conflict.error().code() == E.ALREADY_EXISTS
    message = "in ensemble 'recommend', " + conflict.error().message()
    assert P.status_of("ALREADY_EXISTS", message) == P.ABORTED and P.resend_of(message) == (0, 2)
    requests = stub.plain_requests([pb.InferenceRequest([pb.Tensor("A", np.ones((1, 1)))], "user-1", START | END)])
    assert requests[0].correlation_id == "user-1" and requests[0].flags == START | END
    assert requests[0].inputs["A"].as_numpy().tolist() == [[1.0]]  # Triton's tensor, read once its shape is checked


def test_startup_reads_parameters_and_checks_the_packages_came_from_the_version(tmp_path):
    import json

    assert startup.config_params(json.dumps({"parameters": {"top_k": {"string_value": "7"}}})) == {"top_k": "7"}
    with pytest.raises(RuntimeError, match="not from the version directory"):
        startup.check_own_copies(tmp_path)
    root = Path(sys.modules["backend_src"].__file__).resolve().parents[1]  # this checkout holds both packages
    args = {"model_repository": str(root.parent), "model_version": root.name, "model_name": "m",
            "model_config": json.dumps({"parameters": {"torch_threads": {"string_value": str(torch.get_num_threads())}}})}
    logged = []
    start = startup.start(args, logged.append)
    assert start.version_dir == root and start.params["torch_threads"] == str(torch.get_num_threads())
    assert logged == [f"m v{root.name}: backend_src {sys.modules['backend_src'].__version__}"]


def test_session_metrics_send_only_what_changed():
    from backend_src.serving.stages.session_metrics import SessionMetrics

    sent = []

    class Metric:
        def __init__(self, name):
            self.name = name

        def increment(self, n):
            sent.append((self.name, "+", n))

        def set(self, value):
            sent.append((self.name, "=", value))

    metrics = SessionMetrics(lambda name, kind, doc: Metric(name), bound_bytes=1 << 20)
    assert sent == [("genrec_session_cache_bound_bytes", "=", 1 << 20)]
    sent.clear()
    metrics.count("logged", 3)
    metrics.publish({"bytes": 2560, "peak_bytes": 2560, "sessions": 1})
    assert sorted(sent) == [("genrec_events_logged_total", "+", 3), ("genrec_session_cache_bytes", "=", 2560),
                            ("genrec_session_cache_peak_bytes", "=", 2560), ("genrec_session_cache_sessions", "=", 1)]
    sent.clear()
    metrics.publish({"bytes": 2560 + 10, "peak_bytes": 2560 + 10, "sessions": 1})  # under 1/256 of what is shown
    assert sent == []
    metrics.publish({"bytes": 2560 + 11, "peak_bytes": 2560 + 10, "sessions": 1})  # over it
    assert sent == [("genrec_session_cache_bytes", "=", 2571)]
    sent.clear()
    metrics.publish({"bytes": 2572, "peak_bytes": 2572, "sessions": 2})  # a new session: every changed gauge is sent
    assert sorted(sent) == [("genrec_session_cache_bytes", "=", 2572), ("genrec_session_cache_peak_bytes", "=", 2572),
                            ("genrec_session_cache_sessions", "=", 2)]
    assert metrics.totals == {"restored": 0, "logged": 3, "replayed": 0}


def corrupt_pages(path: Path) -> None:
    """Every page after the first (the header and schema) overwritten with garbage, after the WAL's
    pages went into the main file: what a failing disk or a stray write leaves."""
    import sqlite3

    with sqlite3.connect(path) as db:
        db.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchall()
    data = bytearray(path.read_bytes())
    data[4096:] = np.random.default_rng(0).integers(0, 256, len(data) - 4096, dtype=np.uint8).tobytes()
    path.write_bytes(bytes(data))


def test_encoder_answers_a_damaged_log_as_internal_without_retry_and_refuses_to_load_on_one(published, tmp_path, monkeypatch):
    repo, _ = published
    monkeypatch.delenv("GENREC_EVENT_LOG", raising=False)
    path = tmp_path / "damaged.sqlite3"
    stage = EncoderStage(repo / P.ENCODER / "1", params(repo, P.ENCODER, event_log=path))
    try:
        for sid in range(30, 60):
            one(stage, events_request(sid, 1, 40, before=0, flags=START))
        corrupt_pages(path)
        refused = one(stage, events_request(61, 1, 3, before=0, flags=START))
    finally:
        stage.close()
    assert refused.status == INTERNAL and "damaged" in refused.error and str(path) in refused.error, refused.error
    assert "retry" not in refused.error.lower() and "unavailable" not in refused.error.lower()
    assert ".recover" in refused.error
    with pytest.raises(Exception, match="is damaged") as failed:  # a server on it does not start
        EncoderStage(repo / P.ENCODER / "1", params(repo, P.ENCODER, event_log=path))
    assert str(path) in str(failed.value) and "restore a backup" in str(failed.value)


def test_encoder_close_leaves_every_event_in_the_main_file(published, tmp_path, monkeypatch):
    import shutil
    import sqlite3

    repo, _ = published
    monkeypatch.delenv("GENREC_EVENT_LOG", raising=False)
    path = tmp_path / "log" / "events.sqlite3"
    stage = EncoderStage(repo / P.ENCODER / "1", params(repo, P.ENCODER, event_log=path))
    for sid in (71, 72):
        one(stage, events_request(sid, 1, 5, before=0, flags=START))
    stage.close()
    shutil.copy(path, tmp_path / "alone.sqlite3")  # the main file without its WAL
    with sqlite3.connect(tmp_path / "alone.sqlite3") as db:
        assert db.execute("SELECT user, count FROM users ORDER BY user").fetchall() == [("i:71", 5), ("i:72", 5)]
    assert not path.with_name(path.name + "-wal").exists() or path.with_name(path.name + "-wal").stat().st_size == 0
