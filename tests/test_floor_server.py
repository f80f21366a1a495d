"""Triton's floor (perf/floor): the real configs with no-op stages answer the real contract with
tensors of the real sizes, so the served benchmark can stand every number beside Triton's own cost;
and the benchmark's per-stage statistics come from the server's counters."""
import numpy as np
import pytest

from backend_src.config import ModelConfig
from genrec_contract import protocol as P
from export.triton_configs import ServingOptions

pytestmark = pytest.mark.server
grpcclient = pytest.importorskip("tritonclient.grpc")
from serving_helpers import require_tritonserver  # noqa: E402


def test_floor_answers_the_contract_with_the_real_sizes(tmp_path):
    require_tritonserver()
    from clients.client import RecommenderClient
    from perf.floor import floor_server
    from perf.served import ServedKinds, _per_request_ms

    cfg = ModelConfig(num_items=50, max_seq_len=16, d_model=32, num_heads=2, num_layers=2)
    with floor_server(cfg, ServingOptions(visit_idle_s=30), workdir=tmp_path) as server:
        with RecommenderClient(server.grpc_url) as c:
            items = [str(i) for i in range(10)]
            rec = c.open_session("a", items, [1] * 10, list(range(10)), top_k=3, beam_width=7)
            assert rec.history_length == 10 and rec.event_count == 10
            rec = c.append("a", ["x"] * 10, [1] * 10, list(range(10, 20)), top_k=4)  # past max history: the last 16
            assert rec.history_length == 16 and rec.event_count == 20
            assert c.close_session("a")
        stats = grpcclient.InferenceServerClient(server.grpc_url)
        # the decoder really receives states [1, n, D] and returns BEAM_WIDTH candidates
        states = np.zeros((1, 5, cfg.d_model), np.float32)
        inp = grpcclient.InferInput(P.HISTORY_STATES.name, list(states.shape), "FP32")
        inp.set_data_from_numpy(states)
        width = grpcclient.InferInput(P.BEAM_WIDTH.name, [1, 1], "INT32")
        width.set_data_from_numpy(np.array([[9]], np.int32))
        out = stats.infer(P.DECODER, [inp, width])
        assert out.as_numpy(P.CANDIDATE_ITEMS.name).shape == (1, 9)
        assert out.as_numpy(P.CANDIDATE_CODES.name).shape == (1, 9, cfg.num_codes)

        kinds = ServedKinds(server.grpc_url, ([str(i) for i in range(12)], [1] * 12, list(range(12))), {"top_k": 5}, "t")
        for kind in ("open", "append", "recommend"):
            kinds(kind)
        kinds.close()
        per = _per_request_ms(kinds.stats["recommend"])
        # a recommend is one request through the ensemble and each stage, nothing else counted
        assert per[P.ENSEMBLE]["requests"] == 1 and per[P.DECODER]["requests"] == 1 and per[P.RANKER]["requests"] == 1
        assert per[P.ENSEMBLE]["total_ms"] > 0
