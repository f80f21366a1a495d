"""The decoder and the ranker called DIRECTLY over gRPC (not through the ensemble), with bad
inputs: each is refused with INVALID_ARGUMENT and a message naming the input, a good request
in between still answers, a bad request batched with good ones fails alone, and both stages
are still up afterwards.

Only the two stages are loaded: the requests here are built by hand, not by the encoder.
"""
import time

import numpy as np
import pytest

from backend_src.config import DecodeOptions
from genrec_contract import protocol as P
from backend_src.serving.processes import free_port
from backend_src.serving.server import TritonServer
from export import publish as pub
from export.triton_configs import ServingOptions, config_from_checkpoint

pytestmark = pytest.mark.server
grpcclient = pytest.importorskip("tritonclient.grpc")
from tritonclient.utils import InferenceServerException  # noqa: E402
from serving_helpers import build_tiny_checkpoint, require_tritonserver  # noqa: E402

NUM_ITEMS = 30
MAX_HISTORY = 8
BEAMS = 6
INT64_MAX = np.iinfo(np.int64).max
INT64_MIN = np.iinfo(np.int64).min


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    require_tritonserver()
    tmp = tmp_path_factory.mktemp("stages")
    ckpt = tmp / "model.pt"
    build_tiny_checkpoint(ckpt, [None] + [f"sku-{i}" for i in range(1, NUM_ITEMS + 1)], MAX_HISTORY, seed=3)
    repo = tmp / "model_repository"
    # a long queue delay so that requests sent together are batched into one execute()
    options = ServingOptions(decode=DecodeOptions(mode="pfa", beam_width=BEAMS, k=4, r=0.5, selection_step=1),
                             top_k=3, max_queue_delay_us=100_000)
    pub.publish(ckpt, repo, options)
    server = TritonServer(repo, free_port(), free_port(), free_port(), log_file=tmp / "tritonserver.log",
                          load_models=P.DECODER, extra_args=(f"--load-model={P.RANKER}",), exit_timeout_s=5)
    server.start(timeout_s=120)
    client = grpcclient.InferenceServerClient(server.grpc_url)
    try:
        yield {"server": server, "client": client, "cfg": config_from_checkpoint(ckpt)}
    finally:
        client.close()
        server.stop(grace_s=10)


def _inputs(specs_and_arrays):
    out = []
    for spec, array in specs_and_arrays:
        t = grpcclient.InferInput(spec.name, list(array.shape), spec.dtype)
        t.set_data_from_numpy(np.ascontiguousarray(array, dtype=spec.numpy_dtype))
        out.append(t)
    return out


def _states(cfg, n=5, seed=0):
    return np.random.default_rng(seed).standard_normal((1, n, cfg.d_model)).astype(np.float32)


def decode(client, states, **kw):
    return client.infer(P.DECODER, _inputs([(P.HISTORY_STATES, states)]), client_timeout=30, **kw)


def ranker_request(client, decoded, cfg, n=5):
    """A valid ranker request: random history states and K/V, the decoder's real candidates."""
    rng = np.random.default_rng(1)
    L, H, DH = cfg.num_layers, cfg.num_heads, cfg.d_model // cfg.num_heads
    return {
        P.HISTORY_STATES: rng.standard_normal((1, n, cfg.d_model)).astype(np.float32),
        P.HISTORY_KEYS: rng.standard_normal((1, L, n, H, DH)).astype(np.float32),
        P.HISTORY_VALUES: rng.standard_normal((1, L, n, H, DH)).astype(np.float32),
        P.HISTORY_TIMESTAMPS: (1000 + 60 * np.arange(n, dtype=np.int64))[None],
        P.HISTORY_ITEMS: np.arange(1, n + 1, dtype=np.int64)[None],
        P.CANDIDATE_ITEMS: decoded.as_numpy(P.CANDIDATE_ITEMS.name),
        P.CANDIDATE_LOG_PROBS: decoded.as_numpy(P.CANDIDATE_LOG_PROBS.name),
        P.CANDIDATE_CODES: decoded.as_numpy(P.CANDIDATE_CODES.name),
    }


def rank(client, request, **kw):
    return client.infer(P.RANKER, _inputs(request.items()), client_timeout=30, **kw)


def changed(array, index, value):
    array = array.copy()
    array[index] = value
    return array


def assert_refused(call, *names):
    with pytest.raises(InferenceServerException) as e:
        call()
    assert e.value.status() == "StatusCode.INVALID_ARGUMENT", e.value
    for name in names:
        assert name in e.value.message(), (name, e.value.message())


def test_decoder_refuses_bad_states(served):
    client, cfg = served["client"], served["cfg"]
    good = _states(cfg)
    cases = [
        (changed(good, (0, 1, 2), np.nan), "non-finite"),
        (changed(good, (0, 0, 0), np.inf), "non-finite"),
        (changed(good, (0, 4, 3), -np.inf), "non-finite"),
        (_states(cfg, n=MAX_HISTORY + 1), f"max history {MAX_HISTORY}"),
        (good[:, :0], "no rows"),
    ]
    for states, problem in cases:
        assert_refused(lambda: decode(client, states), P.HISTORY_STATES.name, problem)
        r = decode(client, good)  # the stage still answers
        assert r.as_numpy(P.CANDIDATE_ITEMS.name).shape == (1, BEAMS)


def test_ranker_refuses_bad_inputs(served):
    client, cfg = served["client"], served["cfg"]
    good = ranker_request(client, decode(client, _states(cfg)), cfg)
    top = rank(client, good)
    assert top.as_numpy(P.RECOMMENDED_IDS.name).shape == (1, 3)

    S, K, V, TS, HI = P.HISTORY_STATES, P.HISTORY_KEYS, P.HISTORY_VALUES, P.HISTORY_TIMESTAMPS, P.HISTORY_ITEMS
    CI, LP, CC = P.CANDIDATE_ITEMS, P.CANDIDATE_LOG_PROBS, P.CANDIDATE_CODES
    longer = ranker_request(client, decode(client, _states(cfg)), cfg, n=MAX_HISTORY + 1)
    cases = [
        # item indices: negative, past the item table (the trained items, the unknown item, the rows reserved for
        # the catalog: a row that is no item is an empty slot), INT64_MAX (was an ONNX Runtime INTERNAL error)
        ({CI: changed(good[CI], (0, 0), -1)}, CI, "out of range"),
        ({CI: changed(good[CI], (0, 1), -100000)}, CI, "out of range"),
        ({CI: changed(good[CI], (0, 2), NUM_ITEMS + 2 + ServingOptions().catalog_capacity)}, CI, "out of range"),
        ({CI: changed(good[CI], (0, 0), INT64_MAX)}, CI, "out of range"),
        ({HI: changed(good[HI], (0, 0), -1)}, HI, "out of range"),
        ({HI: changed(good[HI], (0, 3), INT64_MAX)}, HI, "out of range"),
        # history states and K/V
        ({S: changed(good[S], (0, 4, 1), np.inf)}, S, "non-finite"),
        ({K: changed(good[K], (0, 1, 2, 0, 3), np.nan)}, K, "non-finite"),
        ({V: changed(good[V], (0, 0, 4, 1, 0), np.inf)}, V, "non-finite"),
        # candidate log-probs and codes
        ({LP: changed(good[LP], (0, 1), np.nan)}, LP, "NaN or +inf"),
        ({LP: changed(good[LP], (0, 0), np.inf)}, LP, "NaN or +inf"),
        ({LP: changed(good[LP], (0, 2), 3.4e38)}, LP, "above 0"),  # log-probabilities are <= 0
        ({CC: changed(good[CC], (0, 0, 0), 99)}, CC, "out of range"),
        ({CC: changed(good[CC], (0, 0, 1), -5)}, CC, "out of range"),
        # timestamps: int64 extremes (their differences overflow), out of order
        ({TS: changed(good[TS], (0, 4), INT64_MIN)}, TS, "out of range"),
        ({TS: changed(changed(good[TS], (0, 0), -10), (0, 4), INT64_MAX)}, TS, "out of range"),
        ({TS: changed(good[TS], (0, 2), 0)}, TS, "out of order"),
        # shapes that disagree between inputs, or too long a history
        ({V: good[V][:, :, :4]}, V, "disagree on the number of rows n"),
        ({HI: good[HI][:, :3]}, HI, "disagree on the number of rows n"),
        ({S: good[S][:, 1:]}, S, "disagree on the number of rows n"),
        ({CC: good[CC][:, :-1]}, CC, "disagree on the number of candidates W"),
        ({LP: good[LP][:, :-2]}, LP, "disagree on the number of candidates W"),
        ({k: longer[k] for k in (S, K, V, TS, HI)}, K.name, f"max history {MAX_HISTORY}"),
    ]
    for replace, spec, problem in cases:
        name = spec if isinstance(spec, str) else spec.name
        assert_refused(lambda: rank(client, {**good, **replace}), name, problem)
        r = rank(client, good)  # the stage still answers, with the same answer
        np.testing.assert_array_equal(r.as_numpy(P.RECOMMENDED_IDS.name), top.as_numpy(P.RECOMMENDED_IDS.name))

    # an empty beam (item 0, log-prob -inf, codes -1) is a valid candidate: it comes last
    empty = {CI: changed(good[CI], (0, 0), 0), LP: changed(good[LP], (0, 0), -np.inf), CC: changed(good[CC], (0, 0), -1)}
    r = rank(client, {**good, **empty})
    assert np.isfinite(r.as_numpy(P.RANK_SCORES.name)).all()


def test_bad_request_in_a_batch_fails_alone(served):
    """Requests sent together (batched by the queue delay): the bad ones are refused, the good
    ones answered, for both stages."""
    client, cfg = served["client"], served["cfg"]
    good_states = _states(cfg)
    good = ranker_request(client, decode(client, good_states), cfg)
    bad_states = changed(good_states, (0, 0, 0), np.nan)
    bad = {**good, P.CANDIDATE_ITEMS: changed(good[P.CANDIDATE_ITEMS], (0, 0), -1)}

    def burst(send, requests):
        results = [None] * len(requests)

        def done(i):
            return lambda result, error: results.__setitem__(i, (result, error))

        for i, req in enumerate(requests):
            send(req, done(i))
        for _ in range(600):
            if all(r is not None for r in results):
                return results
            time.sleep(0.05)
        raise AssertionError("no answer within 30 s")

    before = {m: _executions(client, m) for m in (P.DECODER, P.RANKER)}
    for model, send, requests, bad_name in (
        (P.DECODER, lambda s, cb: client.async_infer(P.DECODER, _inputs([(P.HISTORY_STATES, s)]), cb),
         [good_states, bad_states, good_states, bad_states], P.HISTORY_STATES.name),
        (P.RANKER, lambda r, cb: client.async_infer(P.RANKER, _inputs(r.items()), cb),
         [good, bad, good, bad], P.CANDIDATE_ITEMS.name),
    ):
        results = burst(send, requests)
        for i, (result, error) in enumerate(results):
            if i % 2 == 0:
                assert error is None and result is not None, (model, error)
            else:
                assert error is not None and error.status() == "StatusCode.INVALID_ARGUMENT", (model, error)
                assert bad_name in error.message(), error.message()
        requests_, executions = _executions(client, model)
        # fewer executions than requests: at least two of the four shared one execute()
        assert executions - before[model][1] < requests_ - before[model][0], model

    # both stages still answer
    assert decode(client, good_states).as_numpy(P.CANDIDATE_ITEMS.name).shape == (1, BEAMS)
    assert rank(client, good).as_numpy(P.RECOMMENDED_IDS.name).shape == (1, 3)
    for m in (P.DECODER, P.RANKER):
        assert client.is_model_ready(m), m


def _executions(client, model):
    """(requests, model executions) the server counted for `model`, refused ones included."""
    stats = client.get_inference_statistics(model, as_json=True)["model_stats"][0]
    requests = int(stats.get("inference_stats", {}).get("success", {}).get("count", 0)) + int(
        stats.get("inference_stats", {}).get("fail", {}).get("count", 0)
    )
    return requests, int(stats.get("execution_count", 0))
