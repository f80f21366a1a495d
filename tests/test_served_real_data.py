"""Parity on real users: the items and scores served over gRPC equal the offline package's.

A small untrained model over the real MovieLens-100K catalog (semantic IDs built from the
data, raw MovieLens item ids in and out), published the way production publishes (ranker
exported to ONNX and served with ONNX Runtime), queried with real users' histories.
"""
import pytest
import torch

from backend_src.config import DecodeOptions, ModelConfig
from serving_helpers import require_tritonserver

pytestmark = pytest.mark.server

DECODE = DecodeOptions(mode="pfa", beam_width=20, k=16, r=0.5, selection_step=1)


@pytest.fixture(scope="module")
def real(tmp_path_factory, data_dir):
    from backend_src.data import load_dataset
    from backend_src.training import build_model
    from export.triton_configs import ServingOptions
    from perf.served_eval import local_server

    require_tritonserver()
    data = load_dataset(str(data_dir / "ml-100k"), max_users=60)
    cfg = ModelConfig(num_items=data.num_items, d_model=16, num_layers=2, num_heads=2, max_seq_len=40,
                      codebook_sizes=(8, 8, 8, 1), dropout=0.0, covisit_window=3)
    model = build_model(data, cfg, embedding_dim=16).eval()
    # the served fused order must take the checkpoint's weights of each seen-item policy: the
    # ranker's, the dense head's (off with seen items kept, on with them excluded) and the
    # co-visitation expert's (the table built from the training events, published with the ranker)
    model.cfg.set_fusion_weights((0.37, 0.0, 1.5), (1.9, 0.6, 2.5))
    tmp = tmp_path_factory.mktemp("real")
    ckpt = tmp / "ml100k.pt"
    model.save(ckpt)
    options = ServingOptions(decode=DECODE, top_k=10, visit_idle_s=60, max_queue_delay_us=500)
    with local_server(ckpt, options, workdir=tmp) as server:  # exports ranker.onnx
        yield {"url": server.grpc_url, "data": data, "model": model, "repo": tmp}


def test_ranker_is_served_from_onnx(real):
    assert list(real["repo"].rglob("mfalcon_ranker/1/ranker.onnx")), "publish did not export the ranker"


def test_served_equals_offline_on_real_users(real):
    from perf.served_eval import eval_histories, offline_topk, served_eval

    torch.manual_seed(0)
    res = served_eval(real["model"], real["data"], real["url"], 25, DECODE, top_k=10, concurrency=2)
    assert res["users"] == 25
    assert res["same_list_fraction"] == 1.0, res["different_users"]
    assert res["served"] == res["offline"]
    model, batch = real["model"], eval_histories(real["model"], real["data"], 25)
    offline = offline_topk(model, batch, DECODE, 10)
    model.cfg.covisit_fusion_weight = 0.0
    try:  # the co-visitation term moves these lists: the equality above saw it served
        assert not torch.equal(offline, offline_topk(model, batch, DECODE, 10))
    finally:
        model.cfg.covisit_fusion_weight = 1.5


def test_served_lists_without_seen_items_equal_offline(real):
    """EXCLUDE_SEEN: the ranker leaves out the candidates already in the session's history and
    orders the rest with the checkpoint's second weights (the ranker's and the dense head's), as
    GenerativeRecommender.recommend does."""
    from perf.served_eval import eval_histories, offline_topk, served_topk

    model = real["model"]
    batch = eval_histories(model, real["data"], 25)
    kept, _ = served_topk(real["url"], model, batch, DECODE, 10, concurrency=2)
    served, _ = served_topk(real["url"], model, batch, DECODE, 10, concurrency=2, exclude_seen=True)
    offline = offline_topk(model, batch, DECODE, 10, exclude_seen=True)
    assert torch.equal(served, offline)
    model.cfg.dense_fusion_weight_seen_excluded = 0.0
    try:  # the dense head's term moves these lists: the equality above saw it served
        assert not torch.equal(offline, offline_topk(model, batch, DECODE, 10, exclude_seen=True))
    finally:
        model.cfg.dense_fusion_weight_seen_excluded = 0.6
    seen = (served[:, :, None] == batch.items[:, None, :]).any(-1) & (served > 0)
    assert not seen.any()
    assert ((kept[:, :, None] == batch.items[:, None, :]).any(-1) & (kept > 0)).any()  # there was something to leave out
