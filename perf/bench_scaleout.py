"""Beyond one server: a local cluster (2 tritonserver replicas, one Redis event log, nginx
hashing the session header) under session traffic: real users of a data set replayed as
sessions (each session: the user's first events, then one event a request, in order) on a model
trained on it (default: ML-1M and the one-minute benchmark model `make bench` trains).

replica_kill: four client threads keep sessions going through the balancer; one replica is
    SIGKILLed, then started again. Failed requests (after the client library's retries), events
    lost or applied twice (each session's log against what its client sent), the longest time
    without a successful request, and which sessions moved: 200 sessions opened before the kill
    are asked once after it and once after the return, and those rebuilt from the log (on the
    survivor, then back on the returning replica) are counted.
rollout: a new version published to the shared repository and loaded replica by replica
    under the same traffic.
balancer_overhead: p50/p99 of an append and of a recommend through the balancer and straight to
    one replica, alternating in one run.

    python -m perf.bench_scaleout [--seconds 20]      -> perf/results/scaleout.json
"""
from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from backend_src.results import markdown_table, write_result
from perf.bench_sessions import RESULTS_DIR, SessionLoad, log, pct, scrape


def _restored(replica) -> float:
    return scrape(replica.metrics_port).get("genrec_sessions_restored_total", 0.0)


def _row(scenario: str, load: SessionLoad, t_fault: float, log_url: str, **extra) -> dict:
    check = load.check(log_url)
    return {"scenario": scenario, "failed_requests": len(load.failed), "events_lost": check["events_lost"],
            "events_doubled": check["events_doubled"], "recovery_s": load.longest_gap_after(t_fault),
            "histories_exact": check["histories_exact"], "sessions": check["sessions"],
            "events_acknowledged": check["events_acknowledged"], "requests_ok": len(load.ok_times),
            "failure_examples": load.failed[:3], **extra}


def _touch(url: str, sids: list) -> int:
    """One recommend for each session; how many were rebuilt from the log (not cached there)."""
    from clients.client import RecommenderClient

    with RecommenderClient(url, timeout_s=10, retries=12) as c:
        return sum(int(c.resume(sid, end_visit=True).restored) for sid in sids)


def replica_kill(cluster, a, events) -> dict:
    from clients.client import RecommenderClient

    probe = [f"probe-{u}" for u in range(a.probe_sessions)]
    with RecommenderClient(cluster.url) as c:
        for i, sid in enumerate(probe):
            c.open_session(sid, *events(50_000 + i, 8), end_visit=True)
    with SessionLoad(cluster.url, a.threads, a.items, events=events) as load:
        time.sleep(a.warmup_s)
        t_kill = time.monotonic()
        cluster.kill_replica(0)
        log(f"replica 0 killed; traffic on for {a.seconds:g} s")
        time.sleep(a.seconds)
        moved_away = _touch(cluster.url, probe)
        t_back = time.monotonic()
        cluster.restart_replica(0)
        start_s = time.monotonic() - t_back
        time.sleep(a.seconds)  # nginx takes the replica back after fail_timeout
        moved_back = _touch(cluster.url, probe)
    return _row("replica_kill", load, t_kill, cluster.redis.url, replica_restart_s=start_s,
                probe_sessions=len(probe), moved_on_kill=moved_away / len(probe), moved_on_return=moved_back / len(probe))


def rollout(cluster, a, v2: Path, options, events) -> dict:
    from export import publish as pub

    with SessionLoad(cluster.url, a.threads, a.items, events=events) as load:
        time.sleep(a.warmup_s)
        t0 = time.monotonic()
        pub.publish(v2, cluster.repository, options, server=cluster.replica_urls, admin_key=cluster.admin_key)
        took = time.monotonic() - t0
        time.sleep(a.seconds)
    return _row("rollout", load, t0, cluster.redis.url, rollout_s=took)


def balancer_overhead(cluster, a, events) -> dict:
    from clients.client import RecommenderClient

    lat = {("balancer", "append"): [], ("balancer", "recommend"): [], ("direct", "append"): [], ("direct", "recommend"): []}
    with RecommenderClient(cluster.url) as via, RecommenderClient(cluster.replica_urls[0]) as direct:
        clients = {"balancer": via, "direct": direct}
        for path, c in clients.items():
            for u in range(10):
                items, actions, ts = events(u, 20)
                c.open_session(f"{path}-{u}", items, actions, ts)
        for r in range(a.rounds):
            u, k = r % 10, 20 + r // 10
            for path in (("balancer", "direct") if r % 2 else ("direct", "balancer")):
                items, actions, ts = events(u, 20 + a.rounds // 10 + 1)
                c = clients[path]
                lat[(path, "append")].append(c.append(f"{path}-{u}", items[k:k + 1], actions[k:k + 1], ts[k:k + 1]).latency_ms)
                lat[(path, "recommend")].append(c.recommend(f"{path}-{u}").latency_ms)
    out = {"scenario": "balancer_overhead", "failed_requests": 0, "events_lost": 0, "events_doubled": 0, "recovery_s": 0.0}
    for (path, kind), v in lat.items():
        p = pct(v)
        out[f"{kind}_{path}_p50_ms"], out[f"{kind}_{path}_p99_ms"] = p["p50_ms"], p["p99_ms"]
    for kind in ("append", "recommend"):
        out[f"{kind}_p50_added_ms"] = out[f"{kind}_balancer_p50_ms"] - out[f"{kind}_direct_p50_ms"]
    return out


def real_users(data):
    """events(u, n): the first n events of the data set's u-th user (of those with 50 or more)."""
    users = [u for u in range(data.num_users) if len(data.user_events(u)[0]) >= 50]

    def events(u: int, n: int):
        items, actions, ts = data.user_events(users[u % len(users)])
        return [str(x) for x in data.item_ids[items[:n]]], actions[:n].tolist(), ts[:n].tolist()

    return events


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m perf.bench_scaleout", description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", default="runs/bench/model.pt", help="a model trained on --data")
    ap.add_argument("--data", default="ml-1m")
    ap.add_argument("--max-users", type=int, default=600, help="the users the checkpoint's catalog was built from")
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--threads", type=int, default=4)
    ap.add_argument("--probe-sessions", type=int, default=200, help="replica_kill: sessions asked after the kill and the return")
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--warmup-s", type=float, default=3.0)
    ap.add_argument("--rounds", type=int, default=200, help="balancer_overhead: requests of each kind per path")
    ap.add_argument("--beam-width", type=int, default=100)
    ap.add_argument("--out", default=str(RESULTS_DIR / "scaleout.json"))
    a = ap.parse_args(argv)

    from backend_src.config import DecodeOptions
    from backend_src.data import load_dataset
    from backend_src.serving.cluster import LocalCluster
    from export.publish import publish
    from export.triton_configs import ServingOptions

    events = real_users(load_dataset(a.data, max_users=a.max_users))
    a.items = None  # SessionLoad replays real users
    rows = []
    with tempfile.TemporaryDirectory(prefix="genrec-scaleout-") as tmp:
        tmp = Path(tmp)
        options = ServingOptions(decode=DecodeOptions(mode="pfa", beam_width=a.beam_width, k=256, r=0.5, selection_step=1),
                                 top_k=10)
        repo = tmp / "model_repository"
        publish(a.checkpoint, repo, options)
        with LocalCluster(repo, a.replicas, workdir=tmp / "cluster") as cluster:
            log(f"cluster up: {cluster.replica_urls} behind {cluster.url}")
            rows.append(balancer_overhead(cluster, a, events))
            log(str(rows[-1]))
            rows.append(replica_kill(cluster, a, events))
            log(str(rows[-1]))
            rows.append(rollout(cluster, a, Path(a.checkpoint), options, events))  # the same weights as a new version
            log(str(rows[-1]))
    write_result(a.out, rows, setup={"checkpoint": a.checkpoint, "data": a.data, "replicas": a.replicas, "threads": a.threads,
                                     "seconds": a.seconds, "beam_width": a.beam_width,
                                     "balancer": "nginx (hash $http_x_session_key consistent)",
                                     "event_log": "redis (appendfsync always)",
                                     "client": "RecommenderClient(timeout_s=10, retries=12, backoff_s=0.1)"})
    print(markdown_table(rows, ["scenario", "failed_requests", "events_lost", "events_doubled", "recovery_s"], ".2f"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
