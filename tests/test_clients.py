"""The client side against a real Triton Inference Server: the client library (sessions,
visits, errors), the command line, the replay service, quality through the
served path (served == offline) and a perf_analyzer smoke run.

The served model is a TINY, UNTRAINED GenerativeRecommender over a small synthetic data set's
items (random weights, random unique semantic IDs): the tests check plumbing, not quality.
No timing assertions.
"""
import json
import subprocess
import sys

import numpy as np
import pytest

from backend_src.config import DecodeOptions
from backend_src.results import REPO_ROOT

pytestmark = pytest.mark.server
pytest.importorskip("tritonclient.grpc")

from clients.client import RecommenderClient, RecommenderError, SessionLost, wire_session_id  # noqa: E402
from serving_helpers import build_tiny_checkpoint, require_tritonserver  # noqa: E402

DATA_SPEC = "synthetic:users=80,items=60,clusters=4,seed=3"
MAX_HISTORY = 20
DECODE = DecodeOptions(mode="pfa", beam_width=8, k=8, r=0.5, selection_step=1)
TOP_K = 5
OPTIONS = dict(top_k=TOP_K, exclude_seen=False, beam_width=DECODE.beam_width, mode=DECODE.mode, pfa_k=DECODE.k,
               pfa_r=DECODE.r, selection_step=DECODE.selection_step)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from backend_src.data import load_dataset
    from backend_src.model.recommender import GenerativeRecommender
    from export.triton_configs import ServingOptions
    from perf.served_eval import local_server

    require_tritonserver()
    tmp = tmp_path_factory.mktemp("clients")
    data = load_dataset(DATA_SPEC)
    ckpt = tmp / "tiny.pt"
    build_tiny_checkpoint(ckpt, data.item_ids, MAX_HISTORY, seed=1)
    options = ServingOptions(decode=DECODE, top_k=TOP_K, visit_idle_s=60, max_queue_delay_us=500, ranker_backend="torch")
    with local_server(ckpt, options, workdir=tmp, export_ranker=False) as server:
        yield {"url": server.grpc_url, "data": data, "ckpt": ckpt, "model": GenerativeRecommender.load(ckpt), "tmp": tmp}


def user_history(data, u):
    it, ac, ts = data.user_events(u)
    return [str(x) for x in data.item_ids[it]], ac.tolist(), ts.tolist()


def test_session_round_trip(served):
    items, actions, ts = user_history(served["data"], 0)
    with RecommenderClient(served["url"]) as c:
        rec = c.open_session("u-0", items[:4], actions[:4], ts[:4], **OPTIONS)
        assert rec.history_length == 4 and rec.truncated == 0 and rec.latency_ms > 0
        assert len(rec.item_ids) == TOP_K and rec.semantic_ids.shape == (TOP_K, 4)
        assert set(rec.item_ids) <= {str(x) for x in served["data"].item_ids[1:]}
        assert np.all(np.diff(rec.rank_scores) <= 0)  # best first
        rec = c.append("u-0", items[4:6], actions[4:6], ts[4:6], **OPTIONS)
        assert rec.history_length == 6
        again = c.recommend("u-0", **OPTIONS)  # no new events: same history, same answer
        assert again.history_length == 6 and again.item_ids == rec.item_ids
        assert again.event_count == 6 and c.event_count("u-0") == 6
        import tritonclient.grpc as grpcclient

        stats = grpcclient.InferenceServerClient(served["url"])
        decodes = lambda: int(stats.get_inference_statistics("pfa_decoder", as_json=True)["model_stats"][0]["inference_count"])  # noqa: E731
        before = decodes()
        assert c.close_session("u-0") is True  # ends the visit; the session stays
        assert decodes() == before  # ending a visit decodes nothing
        stats.close()
        rec = c.append("u-0", items[6:7], actions[6:7], ts[6:7], **OPTIONS)  # a new visit continues it
        assert rec.history_length == 7 and rec.event_count == 7 and not rec.restored
        assert c.close_session("u-0") is True
        assert c.close_session("never-seen-0") is False  # the server holds nothing for it

        # an integer session id, and one >= 2**63 (sent as a negative int64)
        big = (1 << 64) - 5
        assert wire_session_id(big) == -5
        assert c.open_session(big, items[:2], actions[:2], ts[:2], top_k=2).history_length == 2
        assert c.close_session(big)


def test_errors_and_session_loss(served):
    items, actions, ts = user_history(served["data"], 1)
    with RecommenderClient(served["url"]) as c:
        # an item the model does not know: accepted (and logged), counted in the answer
        rec = c.open_session("new-item", [items[0], "no-such-item"], top_k=2)
        assert rec.event_count == 2 and rec.unknown_items == 1 and len(rec.item_ids) == 2
        with pytest.raises(RecommenderError) as e:
            c.open_session("bad", [items[0], ""], top_k=2)
        assert e.value.status == "INVALID_ARGUMENT" and "an item id is 1 to 256 bytes" in e.value.message
        assert not isinstance(e.value, SessionLost)

        with pytest.raises(SessionLost) as e:  # never opened
            c.recommend("never-opened")
        assert e.value.status == "NOT_FOUND" and "no events" in e.value.message and "never-opened" in str(e.value)

        with pytest.raises(ValueError, match="at most 128"):
            c.recommend("x" * 129)
        with pytest.raises(ValueError, match="non-zero"):
            c.recommend(0)

    # another client (e.g. after the client service restarted) continues the session: it learns
    # the server's count first, and re-opening with the whole history applies only what is new
    with RecommenderClient(served["url"]) as c:
        c.open_session("moved-1", items[:5], actions[:5], ts[:5], **OPTIONS)
    with RecommenderClient(served["url"]) as other:
        rec = other.append("moved-1", items[5:6], actions[5:6], ts[5:6], **OPTIONS)
        assert rec.event_count == 6 and rec.history_length == 6
        rec = other.open_session("moved-1", items[:7], actions[:7], ts[:7], **OPTIONS)
        assert rec.event_count == 7 and rec.history_length == 7


def test_cli_health_and_session(served):
    run = lambda *args: subprocess.run([sys.executable, "-m", "clients.cli", "--url", served["url"], *args],  # noqa: E731
                                       cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    r = run("health")
    assert r.returncode == 0, r.stderr
    h = json.loads(r.stdout)
    assert h["ready"] and h["server"]["version"]
    assert all(m["ready"] and m["versions"] for m in h["models"].values())

    from clients.cli import main

    items, _, _ = user_history(served["data"], 2)
    assert main(["--url", served["url"], "open", "--session", "cli-1", "--items", *items[:3], "--timestamps", "1", "2", "3", "--top-k", "3"]) == 0
    assert main(["--url", served["url"], "close", "--session", "cli-1"]) == 0
    assert main(["--url", served["url"], "append", "--session", "cli-1", "--items", items[3], "--timestamps", "4"]) == 0
    assert main(["--url", served["url"], "recommend", "--session", "cli-never-opened"]) == 2  # no events held


def test_replay_service(served):
    from examples.replay_service import replay, sessions_from_data

    sessions = sessions_from_data(served["data"], users=4, max_events=12)
    out = replay(served["url"], sessions, concurrency=2, seconds=5, max_appends=3, **OPTIONS)
    assert out["errors"] == 0, out["error_examples"]
    assert out["sessions"] > 0 and out["latency"]["all"]["n"] > 0 and out["hits_checked"] > 0
    assert 0.0 <= out[f"hit@{TOP_K}"] <= 1.0


def test_served_eval_equals_offline(served):
    from perf.served_eval import served_eval

    res = served_eval(served["model"], served["data"], served["url"], 20, DECODE, top_k=TOP_K, concurrency=2)
    assert res["users"] == 20
    assert res["same_list_fraction"] == 1.0, res["different_users"]
    assert res["served"] == res["offline"]


def test_perf_analyzer_smoke(served):
    from perf.served import perf_analyzer_env, perf_analyzer_usable, run_perf_analyzer, sequence_input_data, session_streams

    env = perf_analyzer_env(served["tmp"] / "pa_lib")
    ok, why = perf_analyzer_usable(env)
    if not ok:
        pytest.skip(f"perf_analyzer cannot run here: {why}")
    streams = session_streams(served["data"], 8, history=10, appends=3)
    path = served["tmp"] / "pa_input.json"
    path.write_text(json.dumps(sequence_input_data(streams, OPTIONS)))
    row = run_perf_analyzer(served["url"], path, 1, 4, env, served["tmp"] / "pa.csv", request_count=40, timeout_s=120)
    assert row["concurrency"] == 1 and row["throughput_per_s"] > 0 and row["p50_ms"] > 0


def test_the_catalog_changes_while_the_server_serves(served, tmp_path):
    """Items added through the client are known to the encoder, generated by the decoder and returned by the
    ranker within a poll of the stages (catalog_poll_s); retired ones never again; the CLI drives the same.
    Last in this module: it leaves the catalog as the trained model's (the added items retired, the
    retired trained item listed again)."""
    import time

    from backend_src.model.recommender import content_vectors
    from clients.cli import main

    data = served["data"]
    content = content_vectors(data.num_items)
    items, _, ts = user_history(data, 2)
    every = dict(top_k=data.num_items + 1, beam_width=64, mode="full", exclude_seen=False)
    with RecommenderClient(served["url"]) as c:
        added = c.catalog_add([{"id": "brand-new", "vector": (content[4] + 0.01).tolist()}])
        assert added["items"][0]["id"] == "brand-new" and len(added["items"][0]["semantic_id"]) == 4
        time.sleep(1.0)  # the stages look at the store every 0.5 s between requests
        rec = c.open_session("cat-1", items[:3] + ["brand-new", "still-unknown"], timestamps=ts[:3] + [ts[2] + 1, ts[2] + 2],
                             **every)
        assert rec.unknown_items == 1 and rec.catalog_version == added["version"]
        assert "brand-new" in rec.item_ids and len(rec.item_ids) == data.num_items + 1
        trained = next(i for i in rec.item_ids if i != "brand-new")
        retired = c.catalog_retire(["brand-new", trained])
        time.sleep(1.0)
        again = c.recommend("cat-1", **every)
        assert again.catalog_version == retired["version"] and not {"brand-new", trained} & set(again.item_ids)
        with pytest.raises(RecommenderError) as e:
            c.catalog_retire(["no-such-item"])
        assert e.value.status == "NOT_FOUND"
        shown = c.catalog_show(["brand-new"])["items"][0]
        assert shown["status"] == "retired" and shown["live"] is False
    lines = tmp_path / "items.jsonl"
    lines.write_text("\n".join(json.dumps({"id": f"cli-{j}", "vector": content[j].tolist()}) for j in range(3)) + "\n")
    assert main(["--url", served["url"], "catalog", "add", "--file", str(lines)]) == 0
    assert main(["--url", served["url"], "catalog", "add", "--id", "cli-9", "--text", "text, but this version reads vectors"]) == 1
    assert main(["--url", served["url"], "catalog", "list", "--status", "live"]) == 0
    with RecommenderClient(served["url"]) as c:
        c.catalog_retire([f"cli-{j}" for j in range(3)])
        assert c.catalog_add([{"id": trained, "text": "back on sale"}])["version"] > retired["version"]
