"""Sessions at real scale, against a real Triton Inference Server: a session is keyed by its id
and outlives visits (sequences), cache evictions, version swaps and server restarts, rebuilt
from the durable event log; every event is applied exactly once, retries included.

The served model is a tiny, untrained recommender: these tests check state, not quality.
"""
import threading
import time

import numpy as np
import pytest
import torch

from backend_src.config import DecodeOptions
from genrec_contract import protocol as P
from backend_src.serving.processes import free_port
from backend_src.serving.server import TritonServer
from export import publish as pub
from export.triton_configs import ServingOptions

pytestmark = pytest.mark.server
grpcclient = pytest.importorskip("tritonclient.grpc")
from tritonclient.utils import InferenceServerException  # noqa: E402

from clients.client import RecommenderClient, RecommenderError  # noqa: E402
from serving_helpers import build_tiny_checkpoint, require_tritonserver  # noqa: E402

NUM_ITEMS = 60
MAX_HISTORY = 20
DECODE = DecodeOptions(mode="pfa", beam_width=8, k=8, r=0.5, selection_step=1)
TOP_K = 5
OPTS = dict(top_k=TOP_K)


def item_id(i: int) -> str:
    return f"sku-{i}"


def events(u: int, n: int, start: int = 0):
    """Deterministic events of user u: (items, actions, timestamps) of events start..start+n-1."""
    rng = np.random.default_rng(u)
    items = [item_id(int(i)) for i in rng.integers(1, NUM_ITEMS + 1, 200)]
    sl = slice(start, start + n)
    return items[sl], [1 + (i % 5) for i in range(200)][sl], [10_000 + 60 * i for i in range(200)][sl]


def two_versions(tmp):
    """Checkpoints of two versions (different weights) over the same catalog."""
    item_ids = [None] + [item_id(i) for i in range(1, NUM_ITEMS + 1)]
    ckpts = tmp / "v1.pt", tmp / "v2.pt"
    for seed, c in enumerate(ckpts, start=1):
        build_tiny_checkpoint(c, item_ids, MAX_HISTORY, seed=seed)
    return ckpts


def offline_ids(ckpt, items, actions, timestamps):
    """The top-K of the offline model on the last MAX_HISTORY events of a history."""
    from backend_src.model.recommender import GenerativeRecommender

    model = GenerativeRecommender.load(ckpt)
    items, actions, timestamps = items[-MAX_HISTORY:], actions[-MAX_HISTORY:], timestamps[-MAX_HISTORY:]
    idx = torch.as_tensor(model.item_indices(items))[None]
    with torch.no_grad():
        cache = model.encode(idx, torch.tensor([actions]), torch.tensor([timestamps]), torch.tensor([len(items)]))
        rec = model.recommend(cache, DECODE, top_k=TOP_K)
    return [model.item_ids[i] or "" for i in rec.items[0].tolist() if i]


def logged(repo, session_id: str):
    """What the server's default event log holds for a string session id."""
    from backend_src.serving.event_log import open_event_log

    log = open_event_log(str(repo.parent / f"{repo.name}-events" / "events.sqlite3"))
    try:
        return log.tail(f"s:{session_id}", 10_000)
    finally:
        log.close()


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    require_tritonserver()
    tmp = tmp_path_factory.mktemp("sessions")
    ckpts = two_versions(tmp)
    repo = tmp / "model_repository"
    # a session cache of 48 KiB holds a handful of these sessions: the rest are evicted
    options = ServingOptions(decode=DECODE, top_k=TOP_K, visit_idle_s=5, max_queue_delay_us=500,
                             session_max_bytes=48 << 10, ranker_backend="torch")
    pub.publish(ckpts[0], repo, options, export_ranker=False)
    server = TritonServer(repo, free_port(), free_port(), free_port(), log_file=tmp / "tritonserver.log", exit_timeout_s=5)
    server.start(timeout_s=120)
    yield {"server": server, "repo": repo, "ckpts": ckpts, "options": options, "tmp": tmp}
    server.stop(grace_s=10)


def test_a_session_outlives_its_visit_and_only_new_events_are_encoded(served):
    url, ckpt = served["server"].grpc_url, served["ckpts"][0]
    items, actions, ts = events(1, 8)
    with RecommenderClient(url) as c:
        rec = c.open_session("visit-1", items[:5], actions[:5], ts[:5], **OPTS)
        assert (rec.event_count, rec.history_length, rec.restored) == (5, 5, False)
        assert c.close_session("visit-1")  # the visit ends, the session stays
    with RecommenderClient(url) as c:  # a later visit, from another client
        rec = c.append("visit-1", items[5:8], actions[5:8], ts[5:8], **OPTS)
    assert (rec.event_count, rec.history_length, rec.restored) == (8, 8, False)  # appended to the cache
    assert rec.item_ids == offline_ids(ckpt, items, actions, ts)
    log = logged(served["repo"], "visit-1")
    assert (log.count, log.items, log.timestamps) == (8, items, ts)

    # a data deletion request: the log goes, and the server's cached copy is not served again
    from backend_src.serving.event_log.cli import main as event_log_cli
    from clients.client import SessionLost

    repo = served["repo"]
    assert event_log_cli(["delete", "--log", str(repo.parent / f"{repo.name}-events" / "events.sqlite3"), "--session", "visit-1"]) == 0
    with RecommenderClient(url) as c, pytest.raises(SessionLost):
        c.recommend("visit-1", **OPTS)


def _raw(client, sid, items, ts, before=None, start=False, end=False, actions=None):
    n = len(items)
    x = lambda spec, a: grpcclient.InferInput(spec.name, list(a.shape), spec.dtype)  # noqa: E731
    arrays = [(P.ITEM_IDS, np.array([[s.encode() for s in items]], dtype=object).reshape(1, n)),
              (P.ACTIONS, np.asarray([actions or [1] * n], np.int64).reshape(1, n)),
              (P.TIMESTAMPS, np.asarray([ts], np.int64).reshape(1, n)), (P.TOP_K, np.array([[TOP_K]], np.int32))]
    if before is not None:
        arrays.append((P.EVENTS_BEFORE, np.array([[before]], np.int64)))
    inputs = []
    for spec, a in arrays:
        t = x(spec, a)
        t.set_data_from_numpy(a)
        inputs.append(t)
    return client.infer(P.ENSEMBLE, inputs, sequence_id=sid, sequence_start=start, sequence_end=end, client_timeout=60)


def test_each_event_is_applied_once_and_a_gap_is_refused(served):
    client = grpcclient.InferenceServerClient(served["server"].grpc_url)
    items, _, ts = events(2, 6)
    count = lambda r: int(r.as_numpy("EVENT_COUNT")[0, 0])  # noqa: E731
    ids = lambda r: [x.decode() for x in r.as_numpy("RECOMMENDED_IDS")[0]]  # noqa: E731
    first = _raw(client, "once-1", items[:2], ts[:2], before=0, start=True)
    again = _raw(client, "once-1", items[:2], ts[:2], before=0)  # a retry: answered, not applied
    assert count(first) == count(again) == 2 and ids(first) == ids(again)
    r = _raw(client, "once-1", items[1:4], ts[1:4], before=1)  # overlaps: only items[2:4] are new
    assert count(r) == 4
    with pytest.raises(InferenceServerException) as e:  # a gap: events 4..6 were never sent
        _raw(client, "once-1", items[5:6], ts[5:6], before=5)
    assert e.value.status() == "StatusCode.INVALID_ARGUMENT" and "holds 4 events" in e.value.message()
    # Triton has no FAILED_PRECONDITION code: the stage's status travels tagged, and the client library reads it
    from clients.client import _status_name

    assert _status_name(e.value) == P.FAILED_PRECONDITION
    with pytest.raises(InferenceServerException):  # a refused END changes nothing
        _raw(client, "once-1", [""], [10**6], before=4, end=True)  # an empty item id
    r = _raw(client, "once-1", items[4:6], ts[4:6], before=4, start=True, end=True)
    assert count(r) == 6
    log = logged(served["repo"], "once-1")
    assert (log.count, log.items, log.timestamps) == (6, items, ts)
    client.close()


def test_two_writers_of_one_session_both_land_once(served):
    """A opens a session with one event; B (a second device) resumes it; A appends an event, then B does
    with its stale count: B's event is not taken for a retry of A's. The server refuses it (ABORTED, as
    ALREADY_EXISTS on the wire) naming its count, B's client sends it again after A's, and both land once."""
    url = served["server"].grpc_url
    items, actions, ts = events(9, 3)
    with RecommenderClient(url) as a, RecommenderClient(url) as b:
        a.open_session("writers-1", items[:1], actions[:1], ts[:1], **OPTS)
        assert b.resume("writers-1", **OPTS).event_count == 1
        ra = a.append("writers-1", items[1:2], actions[1:2], ts[1:2], **OPTS)
        rb = b.append("writers-1", items[2:3], actions[2:3], ts[2:3], **OPTS)
        assert (ra.event_count, ra.resent, rb.event_count, rb.resent) == (2, 0, 3, 1)
        assert b.conflicts_resolved == 1
    log = logged(served["repo"], "writers-1")
    assert (log.count, log.items, log.timestamps) == (3, items, ts)

    client = grpcclient.InferenceServerClient(url)  # what any gRPC client sees
    with pytest.raises(InferenceServerException) as e:
        _raw(client, "writers-1", ["sku-7"], [ts[2]], before=2, actions=[1])
    assert e.value.status() == "StatusCode.ALREADY_EXISTS" and "[ABORTED]" in e.value.message()
    assert P.resend_of(e.value.message()) == (0, 3), e.value.message()
    r = _raw(client, "writers-1", items[2:3], ts[2:3], before=2, actions=actions[2:3])  # B's retry: answered, not applied
    assert int(r.as_numpy("EVENT_COUNT")[0, 0]) == 3 and logged(served["repo"], "writers-1").count == 3
    client.close()


def test_a_request_that_timed_out_is_safe_to_retry(served):
    """The client gives up before the server answers; the server still applies the request.
    Sending it again with the same EVENTS_BEFORE applies nothing twice."""
    client = grpcclient.InferenceServerClient(served["server"].grpc_url)
    items, _, ts = events(3, 12)
    _raw(client, "timeout-1", items[:2], ts[:2], before=0, start=True)
    timed_out = 0
    for a in range(2, 12, 2):
        try:
            # a deadline no request can meet
            x = lambda spec, arr: grpcclient.InferInput(spec.name, list(arr.shape), spec.dtype)  # noqa: E731
            parts = [(P.ITEM_IDS, np.array([[s.encode() for s in items[a:a + 2]]], dtype=object)),
                     (P.ACTIONS, np.ones((1, 2), np.int64)), (P.TIMESTAMPS, np.array([ts[a:a + 2]], np.int64)),
                     (P.EVENTS_BEFORE, np.array([[a]], np.int64))]
            inputs = []
            for spec, arr in parts:
                t = x(spec, arr)
                t.set_data_from_numpy(arr)
                inputs.append(t)
            client.infer(P.ENSEMBLE, inputs, sequence_id="timeout-1", client_timeout=0.0005)
        except InferenceServerException as e:
            assert e.status() == "StatusCode.DEADLINE_EXCEEDED", e
            timed_out += 1
        r = _raw(client, "timeout-1", items[a:a + 2], ts[a:a + 2], before=a)  # the retry
        assert int(r.as_numpy("EVENT_COUNT")[0, 0]) == a + 2
    assert timed_out >= 3
    log = logged(served["repo"], "timeout-1")
    assert (log.count, log.items, log.timestamps) == (12, items, ts)
    client.close()


def test_evicted_sessions_are_rebuilt_from_the_log(served):
    url, ckpt = served["server"].grpc_url, served["ckpts"][0]
    users = range(100, 124)
    with RecommenderClient(url) as c:
        for u in users:  # far more sessions than the 48 KiB cache holds
            items, actions, ts = events(u, 12)
            c.open_session(f"evict-{u}", items, actions, ts, **OPTS)
            c.close_session(f"evict-{u}")
        restored = 0
        for u in users:
            items, actions, ts = events(u, 14)
            rec = c.append(f"evict-{u}", items[12:], actions[12:], ts[12:], **OPTS)
            restored += rec.restored
            assert rec.event_count == 14 and rec.history_length == 14
            assert rec.item_ids == offline_ids(ckpt, items, actions, ts), u
    assert restored >= len(users) // 2  # most were evicted, none was lost
    metrics = __import__("urllib.request").request.urlopen(f"http://127.0.0.1:{served['server'].metrics_port}/metrics").read().decode()
    peak = max(float(line.split()[-1]) for line in metrics.splitlines() if line.startswith("genrec_session_cache_peak_bytes"))
    assert 0 < peak <= 48 << 10


def test_sessions_survive_a_version_swap_a_rollback_and_a_restart_under_traffic(served):
    """Four client threads keep sessions going while every model is swapped to v2, rolled back
    to v1, and the server is restarted: every history ends exactly as its client sent it."""
    server, repo, (v1, v2) = served["server"], served["repo"], served["ckpts"]
    url = server.grpc_url
    stop, failures, sent = threading.Event(), [], {}

    def traffic(w: int):
        with RecommenderClient(url, timeout_s=20, retries=8) as c:
            for s in range(3):
                u = 1000 + 10 * w + s
                items, actions, ts = events(u, 60)
                c.open_session(f"swap-{u}", items[:4], actions[:4], ts[:4], **OPTS)
                sent[u] = 4
                for a in range(4, 60, 2):
                    if stop.is_set():
                        break
                    try:
                        c.append(f"swap-{u}", items[a:a + 2], actions[a:a + 2], ts[a:a + 2], **OPTS)
                        sent[u] = a + 2
                    except Exception as e:  # noqa: BLE001 - counted below
                        failures.append(repr(e))
                        return
                    time.sleep(0.01)

    threads = [threading.Thread(target=traffic, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    try:
        time.sleep(1.0)
        pub.publish(v2, repo, served["options"], server=url, export_ranker=False)
        time.sleep(1.0)
        pub.rollback(repo, server=url)
        time.sleep(1.0)
    finally:
        for t in threads:
            t.join()
    assert not failures, failures[:3]
    for u, n in sent.items():
        items, actions, ts = events(u, n)
        log = logged(repo, f"swap-{u}")
        assert (log.count, log.items, log.timestamps) == (n, items, ts), u

    # a restarted server has an empty cache: the next request rebuilds from the log
    server.stop(grace_s=10)
    server.start(timeout_s=120)
    u = next(iter(sent))
    items, actions, ts = events(u, sent[u])
    with RecommenderClient(url) as c:
        rec = c.recommend(f"swap-{u}", **OPTS)
    assert rec.restored and rec.event_count == sent[u] and rec.history_length == min(sent[u], MAX_HISTORY)
    assert rec.item_ids == offline_ids(v1, items, actions, ts)


def test_a_redis_event_log_shared_by_two_servers(served, monkeypatch):
    """Two servers over one Redis log (what replicas do): a session opened on one continues on
    the other, rebuilt from the log there, and goes back with every event exactly once."""
    from backend_src.serving.event_log import open_event_log
    from backend_src.serving.redis_server import RedisServer, redis_server_binary

    if redis_server_binary() is None:
        pytest.skip("redis-server is not installed (Debian package redis-server)")
    tmp, ckpt = served["tmp"], served["ckpts"][0]
    with RedisServer(tmp / "redis") as redis:
        monkeypatch.setenv("GENREC_EVENT_LOG", redis.url)
        servers = [TritonServer(served["repo"], free_port(), free_port(), free_port(), log_file=tmp / f"replica{i}.log",
                                exit_timeout_s=5).start(timeout_s=120) for i in range(2)]
        try:
            items, actions, ts = events(7, 9)
            with RecommenderClient(servers[0].grpc_url) as a, RecommenderClient(servers[1].grpc_url) as b:
                assert a.open_session("shared-1", items[:4], actions[:4], ts[:4], **OPTS).event_count == 4
                rec = b.open_session("shared-1", items[:6], actions[:6], ts[:6], **OPTS)  # only 2 are new
                assert rec.restored and rec.event_count == 6
                rec = a.open_session("shared-1", items, actions, ts, **OPTS)  # 3 new; a's cache is stale: rebuilt
                assert rec.restored and rec.event_count == 9 and rec.item_ids == offline_ids(ckpt, items, actions, ts)
            with open_event_log(redis.url) as log:
                got = log.tail("s:shared-1", 100)
            assert (got.count, got.items, got.timestamps) == (9, items, ts)
        finally:
            for s in servers:
                s.stop(grace_s=10)


def test_session_ids_are_kept_whole_and_erased_as_sent(served):
    """Ids are opaque and kept whole: a non-ASCII id goes through the client library (its balancer header
    encoded), "42" and 42 are two sessions, an id the transport would cut or Triton refuse is refused by the
    client naming why, and the deletion command erases a negative id's session."""
    from backend_src.serving.event_log.cli import main as event_log_cli
    from clients.client import SessionLost

    url, repo = served["server"].grpc_url, served["repo"]
    items, actions, ts = events(40, 4)
    with RecommenderClient(url) as c:
        assert c.open_session("ü-1", items[:2], actions[:2], ts[:2], **OPTS).event_count == 2
        assert c.append("ü-1", items[2:3], actions[2:3], ts[2:3], **OPTS).event_count == 3
        assert logged(repo, "ü-1").count == 3
        assert c.open_session("42", items[:1], actions[:1], ts[:1], **OPTS).event_count == 1
        assert c.open_session(42, items[:2], actions[:2], ts[:2], **OPTS).event_count == 2
        assert logged(repo, "42").count == 1
        # Triton's Python backend would hand the model "nulrX\0x" as "nulrX": two users, one session
        assert c.open_session("nulrX", items[:2], actions[:2], ts[:2], **OPTS).event_count == 2
        with pytest.raises(ValueError, match="NUL"):
            c.open_session("nulrX\0x", items[:3], actions[:3], ts[:3], **OPTS)
        assert logged(repo, "nulrX").count == 2
        with pytest.raises(ValueError, match="at most 128 bytes in UTF-8"):  # Triton: UNIMPLEMENTED
            c.open_session("ü" * 65, items[:1], actions[:1], ts[:1], **OPTS)
        assert c.open_session(-5, items[:2], actions[:2], ts[:2], **OPTS).event_count == 2
        assert c.close_session(-5)
    log = str(repo.parent / f"{repo.name}-events" / "events.sqlite3")
    assert event_log_cli(["delete", "--log", log, "--session", "-5"]) == 0
    assert event_log_cli(["delete", "--log", log, "--session-string", "42"]) == 0
    with RecommenderClient(url) as c:
        with pytest.raises(SessionLost):
            c.resume(-5, **OPTS)
        with pytest.raises(SessionLost):
            c.resume("42", **OPTS)
        assert c.resume(42, **OPTS).event_count == 2  # the integer id's session stays


def test_a_huge_request_value_is_refused_with_a_short_message(served):
    """A 1 MB item id or option value: INVALID_ARGUMENT naming a prefix and the length, not the value echoed
    past gRPC's metadata limit (RESOURCE_EXHAUSTED, retried)."""
    items, actions, ts = events(41, 2)
    with RecommenderClient(served["server"].grpc_url) as c:
        with pytest.raises(RecommenderError) as e:
            c.open_session("huge-1", ["x" * (1 << 20)], [1], [ts[0]], **OPTS)
        assert e.value.status == "INVALID_ARGUMENT" and "an item id is 1 to 256 bytes" in e.value.message
        assert len(e.value.message.encode()) < 300 and f"({1 << 20} characters)" in e.value.message
        with pytest.raises(RecommenderError) as e:
            c.open_session("huge-1", items, actions, ts, mode="m" * (1 << 20), **OPTS)
        assert e.value.status == "INVALID_ARGUMENT" and len(e.value.message.encode()) < 300
        assert c.retried == 0


def test_more_open_visits_than_slots_wait_at_most_the_visit_idle_time(served, tmp_path):
    """Sequence slots are not the limit on how many users a server knows: with 2 slots, a third
    visit opened while two others stay open is served once the idle ones end (visit_idle_s),
    never left hanging; and sessions whose visits ended are resumed without any wait."""
    options = ServingOptions(decode=DECODE, top_k=TOP_K, visit_idle_s=1, max_candidate_sequences=2,
                             max_queue_delay_us=500, ranker_backend="torch")
    repo = tmp_path / "model_repository"
    pub.publish(served["ckpts"][0], repo, options, export_ranker=False)
    with TritonServer(repo, free_port(), free_port(), free_port(), log_file=tmp_path / "slots.log", exit_timeout_s=2) as server:
        with RecommenderClient(server.grpc_url, timeout_s=20, retries=0) as c:
            for u in range(2):  # two visits left open
                c.open_session(f"slot-{u}", *events(u, 3), **OPTS)
            t0 = time.monotonic()
            rec = c.open_session("slot-2", *events(2, 3), **OPTS)
            waited = time.monotonic() - t0
            assert rec.event_count == 3 and waited < 1 + 5  # the idle timeout, plus scheduling slack
            for u in range(20):  # visits of one request each never hold a slot
                assert c.open_session(f"short-{u}", *events(u, 3), end_visit=True, **OPTS).event_count == 3
