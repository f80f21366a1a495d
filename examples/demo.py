"""The end-to-end demo: train a small model, publish it, serve it with Triton, use it over gRPC.

    python -m examples.demo                    # synthetic data, about 2-3 minutes on 2 CPU cores
    python -m examples.demo --data ml-100k     # a real data set (first --max-users users)

Steps: (a) train a small generative recommender (export.train, few epochs); (b) publish it into
a fresh model repository under runs/demo (the tracked model_repository is not touched);
(c) start tritonserver on free ports; (d) for a few users, open a session with their history and
print the recommendations (raw item ids, ranking scores, semantic IDs) with request latencies,
append the user's next real event and print again, close the session; (e) stop the server.
Everything runs offline: no downloads.
"""
from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path

import numpy as np

from backend_src.results import REPO_ROOT

DEMO_DIR = REPO_ROOT / "runs" / "demo"


def say(msg: str = "") -> None:
    print(msg, flush=True)


def show(title: str, rec, data, top: int) -> None:
    say(f"  {title}: history {rec.history_length} events, {rec.latency_ms:.1f} ms" + (f", {rec.truncated} oldest dropped" if rec.truncated else ""))
    for i, (item, score, lp, code) in enumerate(zip(rec.item_ids[:top], rec.rank_scores, rec.retrieval_log_probs, rec.semantic_ids)):
        text = ""
        if data.item_text:
            try:
                text = str(data.item_text.get(data.item_index(item), ""))[:48]
            except KeyError:
                pass
        say(f"    {i + 1:2d}. item {item:>12s}  score {score:7.3f}  log p {lp:7.2f}  semantic ID {tuple(int(c) for c in code)}  {text}")


def train(data_spec: str, out: Path, epochs: int, minutes: float, max_users: int | None) -> float:
    from export.train import main as train_main

    argv = ["--data", data_spec, "--out", str(out), "--epochs", str(epochs), "--minutes", str(minutes),
            "--valid-users", "300", "--test-users", "500", "--beam", "50"]
    if max_users:
        argv += ["--max-users", str(max_users)]
    t0 = time.monotonic()
    train_main(argv)
    return time.monotonic() - t0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m examples.demo", description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", default="synthetic")
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--minutes", type=float, default=1.5, help="training time budget")
    ap.add_argument("--max-users", type=int, default=None, help="load only the first N users (default: all for synthetic, 3000 otherwise)")
    ap.add_argument("--users", type=int, default=3, help="users shown")
    ap.add_argument("--top", type=int, default=5, help="recommendations shown per request")
    ap.add_argument("--beam-width", type=int, default=50)
    ap.add_argument("--dir", default=str(DEMO_DIR), help="where the checkpoint, repository and server log go")
    ap.add_argument("--skip-train", action="store_true", help="reuse <dir>/model.pt")
    a = ap.parse_args(argv)

    import torch

    from backend_src.config import DecodeOptions
    from backend_src.data import load_dataset
    from backend_src.serving.processes import free_port
    from backend_src.serving.server import TritonServer
    from clients.client import RecommenderClient
    from export.publish import publish
    from export.triton_configs import ServingOptions

    torch.set_num_threads(max(1, torch.get_num_threads()))
    work = Path(a.dir)
    work.mkdir(parents=True, exist_ok=True)
    ckpt = work / "model.pt"
    max_users = a.max_users if a.max_users is not None else (None if a.data.startswith("synthetic") else 3000)
    summary = {}

    # (a) train
    if a.skip_train and ckpt.exists():
        say(f"== (a) reusing {ckpt}")
    else:
        say(f"== (a) training a small model on {a.data} ({a.epochs} epochs, at most {a.minutes:g} min)")
        summary["train_s"] = train(a.data, ckpt, a.epochs, a.minutes, max_users)
    data = load_dataset(a.data, max_users=max_users)

    # (b) publish into a fresh repository
    repo = work / "model_repository"
    if repo.exists():
        shutil.rmtree(repo)
    t0 = time.monotonic()
    decode = DecodeOptions(mode="pfa", beam_width=a.beam_width, k=64, r=0.5, selection_step=1)
    versions = publish(ckpt, repo, ServingOptions(decode=decode, top_k=10, visit_idle_s=60))
    summary["publish_s"] = time.monotonic() - t0
    say(f"== (b) published {ckpt} into {repo}: " + ", ".join(f"{m} v{v}" for m, v in versions.items()))

    # (c) serve
    server = TritonServer(repo, free_port(), free_port(), free_port(), log_file=work / "tritonserver.log", exit_timeout_s=10)
    t0 = time.monotonic()
    say("== (c) starting tritonserver ...")
    server.start(timeout_s=180)
    summary["server_start_s"] = time.monotonic() - t0
    latencies = []
    try:
        client = RecommenderClient(server.grpc_url)
        h = client.health()
        say(f"   Triton {h['server']['version']} ready at gRPC {server.grpc_url}; models: "
            + ", ".join(f"{m} v{','.join(v['versions'])}" for m, v in h["models"].items()))

        # one untimed request first: each model's first call pays one-off setup costs
        first = np.flatnonzero(data.lengths >= 1)[0]
        client.recommend_history("demo-warmup", [str(data.item_ids[data.user_events(int(first))[0][0]])], [0], [0])

        # (d) sessions for a few users: open with all but the last event, then append it
        say(f"== (d) sessions over gRPC (top {a.top} shown of 10; beam {a.beam_width}, PFA decoding, M-FALCON ranking)")
        rows = np.flatnonzero(data.lengths >= 3)[: a.users]
        for u in rows.tolist():
            it, ac, ts = data.user_events(u)
            raw = [str(x) for x in data.item_ids[it]]
            sid = f"demo-user-{data.user_ids[u]}"
            say(f"-- user {data.user_ids[u]} ({len(raw)} events; session {sid!r})")
            rec = client.open_session(sid, raw[:-1], ac[:-1].tolist(), ts[:-1].tolist())
            latencies.append(rec.latency_ms)
            show("open", rec, data, a.top)
            nxt = raw[-1]
            rank = rec.item_ids.index(nxt) + 1 if nxt in rec.item_ids else None
            say(f"  the user's next item {nxt} was " + (f"recommended at rank {rank}" if rank else "not in the top 10"))
            rec = client.append(sid, [nxt], [int(ac[-1])], [int(ts[-1])])
            latencies.append(rec.latency_ms)
            show(f"after appending item {nxt}", rec, data, a.top)
            t0 = time.perf_counter()
            client.close_session(sid)
            latencies.append((time.perf_counter() - t0) * 1e3)
            say("  visit closed (the server keeps the session in its event log for the next visit)")
        client.close()
    finally:
        # (e) shut down
        code = server.stop(grace_s=20)
        say(f"== (e) tritonserver stopped (exit code {code})")

    lat = np.asarray(latencies)
    say("\n== summary")
    if "train_s" in summary:
        say(f"   trained in {summary['train_s']:.0f} s -> {ckpt} (test metrics: {ckpt.with_suffix('.results.json')})")
    say(f"   published in {summary['publish_s']:.1f} s, server ready in {summary['server_start_s']:.1f} s")
    say(f"   {len(lat)} requests: p50 {np.percentile(lat, 50):.1f} ms, max {lat.max():.1f} ms (open, append, close per user)")
    say(f"   server log: {server.log_file}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
