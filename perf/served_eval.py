"""Recommendation quality through the served path, side by side with the offline model.

Each test user's history (exactly what the offline evaluation uses: the last max_len events
before the held-out item, max_len = the model's max_seq_len) goes to the server as one session
(one request that starts and ends it), and the returned top-K is scored over the full catalog
(Recall@5/10, NDCG@5/10). The same users go through ``GenerativeRecommender.recommend`` offline
with the same decode options; the report gives both and the share of users whose served list
equals the offline list (same items, same order). --exclude-seen asks both for lists without
the items already in each history.

    python -m perf.served_eval --checkpoint runs/demo/model.pt --data synthetic --users 200 --start-server
    python -m perf.served_eval --checkpoint ckpt.pt --data amazon-beauty --users 500 --url localhost:8001
"""
from __future__ import annotations

import argparse
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch

from backend_src.config import DecodeOptions
from backend_src.data import eval_batches, load_dataset
from backend_src.metrics import METRIC_NAMES, ranking_metrics
from backend_src.model.recommender import GenerativeRecommender
from backend_src.results import REPO_ROOT, markdown_table, write_result
from clients.client import RecommenderClient

KS = (5, 10)


@contextmanager
def local_server(checkpoint, options=None, workdir=None, start_timeout_s: float = 180.0, export_ranker: bool = True):
    """A tritonserver on free ports serving `checkpoint`, published into a temporary repository.
    Yields the server (its grpc_url)."""
    from export.publish import publish
    from export.triton_configs import ServingOptions

    with tempfile.TemporaryDirectory(prefix="genrec-served-", dir=workdir) as tmp:
        repo = Path(tmp) / "model_repository"
        publish(checkpoint, repo, options or ServingOptions(), export_ranker=export_ranker)
        with serve_repository(repo, start_timeout_s) as server:
            yield server


@contextmanager
def serve_repository(repo: Path, start_timeout_s: float = 180.0):
    """A tritonserver on free ports serving the repository `repo` (its log beside it)."""
    from backend_src.serving.processes import free_port
    from backend_src.serving.server import TritonServer

    server = TritonServer(repo, free_port(), free_port(), free_port(), log_file=repo.parent / "tritonserver.log", exit_timeout_s=5)
    try:
        server.start(timeout_s=start_timeout_s)
        yield server
    finally:
        server.stop(grace_s=15)


def eval_histories(model, data, users: int | None):
    """Offline evaluation's test histories: (items [B, N], actions, timestamps, lengths, targets)
    as one batch, for the first `users` evaluable users."""
    rows = None if users is None else np.arange(min(users, data.num_users))
    batches = list(eval_batches(data, "test", batch_size=1 << 30, max_len=model.cfg.max_seq_len, users=rows))
    b = batches[0]
    return b


def offline_topk(model, batch, options: DecodeOptions, top_k: int, batch_size: int = 64, rank_by: str = "fused",
                 exclude_seen: bool = False) -> torch.Tensor:
    """[B, top_k] item indices from GenerativeRecommender.recommend (0 = empty slot)."""
    out = []
    with torch.no_grad():
        for s in range(0, len(batch.lengths), batch_size):
            sl = slice(s, s + batch_size)
            n = int(batch.lengths[sl].max())
            cache = model.encode(batch.items[sl, :n], batch.actions[sl, :n], batch.timestamps[sl, :n], batch.lengths[sl])
            rec = model.recommend(cache, options, top_k=top_k, rank_by=rank_by, exclude_seen=exclude_seen,
                                  history_items=batch.items[sl, :n])
            out.append(rec.items)
    return torch.cat(out)


def served_topk(url: str, model, batch, options: DecodeOptions, top_k: int, concurrency: int = 4,
                exclude_seen: bool = False) -> tuple:
    """[B, top_k] item indices from the server (0 = empty slot), and the request latencies (ms)."""
    tag = uuid.uuid4().hex[:8]
    raw = model.item_ids
    opts = dict(top_k=top_k, beam_width=options.beam_width, mode=options.mode, pfa_k=options.k, pfa_r=options.r,
                selection_step=options.selection_step, exclude_seen=exclude_seen)
    B = len(batch.lengths)
    ranked = torch.zeros(B, top_k, dtype=torch.long)
    latencies = np.zeros(B)

    def one(b: int, client: RecommenderClient):
        n = int(batch.lengths[b])
        items = [str(x) for x in raw[batch.items[b, :n].numpy()]]
        rec = client.recommend_history(f"eval-{tag}-{b}", items, batch.actions[b, :n].tolist(), batch.timestamps[b, :n].tolist(), **opts)
        idx = model.item_indices(rec.item_ids) if rec.item_ids else np.zeros(0, np.int64)
        ranked[b, : len(idx)] = torch.from_numpy(idx)
        latencies[b] = rec.latency_ms

    clients = [RecommenderClient(url) for _ in range(max(1, concurrency))]
    try:
        with ThreadPoolExecutor(len(clients)) as pool:
            list(pool.map(lambda b: one(b, clients[b % len(clients)]), range(B)))
    finally:
        for c in clients:
            c.close()
    return ranked, latencies


def served_eval(model, data, url: str, users: int | None, options: DecodeOptions, top_k: int = 10, concurrency: int = 4,
                rank_by: str = "fused", exclude_seen: bool = False) -> dict:
    """The server must serve `model` with the same rank_by (ServingOptions.rank_by)."""
    batch = eval_histories(model, data, users)
    t0 = time.perf_counter()
    served, lat = served_topk(url, model, batch, options, top_k, concurrency, exclude_seen)
    served_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    offline = offline_topk(model, batch, options, top_k, rank_by=rank_by, exclude_seen=exclude_seen)
    offline_s = time.perf_counter() - t0
    same = (served == offline).all(dim=1)
    ks = tuple(k for k in KS if k <= top_k) or (top_k,)
    return {
        "users": len(batch.lengths),
        "served": ranking_metrics(served, batch.target_items, ks),
        "offline": ranking_metrics(offline, batch.target_items, ks),
        "same_list_fraction": float(same.float().mean()),
        "different_users": batch.users[~same.numpy()].tolist()[:20],
        "served_seconds": served_s,
        "offline_seconds": offline_s,
        "served_latency_ms": {"p50": float(np.percentile(lat, 50)), "p99": float(np.percentile(lat, 99))},
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m perf.served_eval", description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--data", default="synthetic")
    ap.add_argument("--max-users", type=int, default=None, help="load only the first N users (as the checkpoint was trained)")
    ap.add_argument("--users", type=int, default=200, help="first N test users (default 200; 0 = all)")
    where = ap.add_mutually_exclusive_group()
    where.add_argument("--url", default=None, help="gRPC address of a server already serving this checkpoint")
    where.add_argument("--start-server", action="store_true", help="start a server on a temporary repository (default without --url)")
    ap.add_argument("--top-k", type=int, default=10)
    ap.add_argument("--beam-width", type=int, default=100)
    ap.add_argument("--mode", default="pfa")
    ap.add_argument("--pfa-k", type=int, default=256)
    ap.add_argument("--pfa-r", type=float, default=0.5)
    ap.add_argument("--selection-step", type=int, default=1)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--rank-by", default="fused", choices=["ranker", "fused"], help="order of the served top-K")
    ap.add_argument("--exclude-seen", action="store_true", help="lists without the items already in each history")
    ap.add_argument("--out", default=None, help="result JSON (default perf/results/served_eval_<data>.json)")
    a = ap.parse_args(argv)

    torch.set_num_threads(max(1, torch.get_num_threads()))
    model = GenerativeRecommender.load(a.checkpoint)
    data = load_dataset(a.data, max_users=a.max_users)
    options = DecodeOptions(mode=a.mode, beam_width=a.beam_width, k=a.pfa_k, r=a.pfa_r, selection_step=a.selection_step)
    users = a.users or None
    if a.url:
        res = served_eval(model, data, a.url, users, options, a.top_k, a.concurrency, a.rank_by, a.exclude_seen)
    else:
        from export.triton_configs import ServingOptions

        with local_server(a.checkpoint, ServingOptions(decode=options, top_k=a.top_k, rank_by=a.rank_by)) as server:
            res = served_eval(model, data, server.grpc_url, users, options, a.top_k, a.concurrency, a.rank_by,
                              a.exclude_seen)
    rows = [{"path": p, **res[p]} for p in ("served", "offline")]
    out = Path(a.out or REPO_ROOT / "perf" / "results" / f"served_eval_{Path(a.data.split(':')[0]).name}.json")
    write_result(out, rows, checkpoint=str(a.checkpoint), data=data.name, users=res["users"], decode=vars(options), top_k=a.top_k,
                 exclude_seen=a.exclude_seen,
                 same_list_fraction=res["same_list_fraction"], different_users=res["different_users"],
                 served_latency_ms=res["served_latency_ms"], served_seconds=res["served_seconds"], offline_seconds=res["offline_seconds"])
    print(markdown_table(rows, ["path", *METRIC_NAMES]))
    print(f"{res['users']} users; served list == offline list for {round(res['same_list_fraction'] * res['users'])} "
          f"({res['same_list_fraction']:.3%}); "
          f"served p50 {res['served_latency_ms']['p50']:.1f} ms; result: {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
