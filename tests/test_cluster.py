"""Beyond one server, with real processes: two tritonserver replicas over one model repository,
one Redis event log, nginx hashing the session header. Sessions stay on one replica, carry on
when a replica dies and when it comes back, and a new version rolls out replica by replica.
"""
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from backend_src.serving.cluster import LocalCluster, nginx_binary
from backend_src.serving.processes import free_port
from backend_src.serving.redis_server import redis_server_binary
from export import publish as pub
from export.triton_configs import ServingOptions

pytestmark = pytest.mark.server
pytest.importorskip("tritonclient.grpc")

from clients.client import RecommenderClient  # noqa: E402
from serving_helpers import require_tritonserver  # noqa: E402
from test_sessions_server import DECODE, events, offline_ids, two_versions  # noqa: E402

SESSIONS = 12  # opened first; more (up to MAX_SESSIONS) only if these all hash onto one replica
MAX_SESSIONS = 48


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    require_tritonserver()
    if redis_server_binary() is None or nginx_binary() is None:
        pytest.skip("a local cluster needs Debian's redis-server and nginx")
    tmp = tmp_path_factory.mktemp("cluster")
    ckpts = two_versions(tmp)
    repo = tmp / "model_repository"
    options = ServingOptions(decode=DECODE, top_k=5, visit_idle_s=5, max_queue_delay_us=500, ranker_backend="torch")
    pub.publish(ckpts[0], repo, options, export_ranker=False)
    with LocalCluster(repo, replicas=2, workdir=tmp / "run") as c:
        yield {"cluster": c, "ckpts": ckpts, "options": options, "tmp": tmp}


def _metric(replica, name: str) -> float:
    from perf.bench_sessions import scrape

    return scrape(replica.metrics_port).get(name, 0.0)


def _logged(cluster, sid):
    from backend_src.serving.event_log import open_event_log

    with open_event_log(cluster.redis.url) as log:
        return log.tail(f"s:{sid}", 1000)


def test_sessions_stay_on_one_replica_and_survive_a_replica(cluster):
    c, v1 = cluster["cluster"], cluster["ckpts"][0]
    sent = {}
    with RecommenderClient(c.url, timeout_s=10, retries=12) as client:
        # consistent hashing over the replicas' (random) ports: 12 fixed ids all land on one replica in
        # about 1 run of 1,700, so more sessions are opened until both replicas hold some
        cached = [0.0] * len(c.replicas)
        n = 0
        while n < SESSIONS or (min(cached) == 0 and n < MAX_SESSIONS):
            items, actions, ts = events(n, 6)
            client.open_session(f"c-{n}", items, actions, ts, top_k=5)
            sent[n] = 6
            n += 1
            if n >= SESSIONS:
                cached = [_metric(r, "genrec_session_cache_sessions") for r in c.replicas]
        assert sum(cached) == n and min(cached) > 0  # each session on exactly one replica, both used

        c.kill_replica(0)  # a crashed machine: its sessions move to the other replica, rebuilt from the log
        for u in range(n):
            items, actions, ts = events(u, 8)
            rec = client.append(f"c-{u}", items[6:8], actions[6:8], ts[6:8], top_k=5)
            assert rec.event_count == 8
            sent[u] = 8
        assert _metric(c.replicas[1], "genrec_session_cache_sessions") == n

        c.restart_replica(0)  # back: its share of the sessions returns (after nginx's fail_timeout)
        time.sleep(6)
        for u in range(n):
            items, actions, ts = events(u, 9)
            rec = client.append(f"c-{u}", items[8:9], actions[8:9], ts[8:9], top_k=5)
            assert rec.event_count == 9 and rec.item_ids == offline_ids(v1, items, actions, ts), u
    moved = _metric(c.replicas[0], "genrec_sessions_restored_total")
    assert 0 < moved < n  # only the returning replica's share moved back
    for u in range(n):
        items, _, ts = events(u, 9)
        got = _logged(c, f"c-{u}")
        assert (got.count, got.items, got.timestamps) == (9, items, ts)


def test_a_new_version_rolls_out_replica_by_replica(cluster):
    c = cluster["cluster"]
    assert pub.current_options(c.repository) == cluster["options"]  # what a new version keeps by default
    pub.publish(cluster["ckpts"][1], c.repository, cluster["options"], server=c.replica_urls, admin_key=c.admin_key,
                export_ranker=False)
    import tritonclient.grpc as grpcclient

    for url in c.replica_urls:
        meta = grpcclient.InferenceServerClient(url)
        assert meta.get_model_metadata("history_encoder").versions == ["2"], url
        meta.close()
    with RecommenderClient(c.url) as client:
        rec = client.recommend("c-0", top_k=5)
    assert rec.restored and rec.event_count == 9


def test_catalog_changes_reach_every_replica_also_one_down_during_the_add(cluster):
    """An add through one replica reaches the other within a few polls (both answer at its catalog version);
    a replica killed before an add and started after it serves that version at once (it replays the store
    at load)."""
    c = cluster["cluster"]
    urls = c.replica_urls
    items, actions, ts = events(0, 3)

    def version_of(url):
        with RecommenderClient(url) as client:
            return client.recommend_history(f"cat-{time.monotonic_ns()}", items, actions, ts, top_k=5).catalog_version

    with RecommenderClient(urls[0], admin_key=c.admin_key) as admin:
        v1 = admin.catalog_add([{"id": "cluster-new-1", "vector": [1.0] + [0.0] * 7}])["version"]
    deadline = time.monotonic() + 10
    while min(version_of(u) for u in urls) < v1 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert [version_of(u) for u in urls] == [v1, v1]
    c.kill_replica(1)
    with RecommenderClient(urls[0], admin_key=c.admin_key) as admin:
        v2 = admin.catalog_add([{"id": "cluster-new-2", "vector": [0.0, 1.0] + [0.0] * 6}])["version"]
    c.restart_replica(1)
    assert v2 == v1 + 1 and version_of(urls[1]) == v2
    with RecommenderClient(urls[1], admin_key=c.admin_key) as admin:
        assert admin.catalog_show(["cluster-new-2"])["items"][0]["live"] is True


def test_cluster_command_starts_and_stops(cluster):
    from backend_src.serving.processes import alive

    tmp = cluster["tmp"]
    run = lambda *a: subprocess.run([sys.executable, "-m", "backend_src.serving.cluster", *a, "--dir", str(tmp / "cli")],  # noqa: E731
                                    capture_output=True, text=True, timeout=300)
    port = free_port()
    r = run("start", "--model-repository", str(cluster["cluster"].repository), "--replicas", "1", "--port", str(port))
    assert r.returncode == 0, r.stderr
    try:
        state = json.loads((tmp / "cli" / "cluster.json").read_text())
        with RecommenderClient(f"127.0.0.1:{port}") as client:
            items, actions, ts = events(99, 3)
            assert client.open_session("cli-0", items, actions, ts, top_k=5).event_count == 3
        assert run("status").returncode == 0
        # a new version through the roll-out command: into the shared repository, loaded on every replica
        repo = cluster["cluster"].repository
        r = subprocess.run([sys.executable, "-m", "export.rollout", "publish", "--checkpoint", str(cluster["ckpts"][1]),
                            "--dir", str(tmp / "cli"), "--no-ranker-export"], capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr
        newest = pub.versions(repo / "history_encoder")[-1]
        assert f"history_encoder v{newest}" in r.stdout and "on 1 replicas" in r.stdout
        import tritonclient.grpc as grpcclient

        meta = grpcclient.InferenceServerClient(state["replicas"][0]["grpc"])
        assert meta.get_model_metadata("history_encoder").versions == [str(newest)]
        meta.close()
        killed = _kill_replica_server_and_wait_healed(state, port, run)
    finally:
        groups = _process_groups(state, tmp / "cli")
        t0 = time.monotonic()
        r = run("stop")
    assert r.returncode == 0 and time.monotonic() - t0 < 30
    pids = [state["balancer"]["pid"], state["redis"]["pid"]] + [x["pid"] for x in state["replicas"]] + killed
    assert not any(alive(p) for p in pids)
    left = _members(groups | _process_groups(state, tmp / "cli"))
    assert not left, f"processes of the cluster outlived `cluster stop`: {left}"


HEAL_BOUND_S = 90.0  # a replica's server killed -> it serves again (a full start: models load again)


def _members(groups: set) -> dict:
    """{pid: command name} of the live processes in any of these process groups."""
    from backend_src.serving.stub_processes import process_stat

    out = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            st = process_stat(int(entry.name))
            if st is not None and st[3] in groups and st[1] != "Z":
                out[int(entry.name)] = st[0]
    return out


def _process_groups(state: dict, run_dir: Path) -> set:
    """The process groups of everything the cluster runs: nginx (and its workers), Redis, and per
    replica its watchdog's keeper (and the watchdog) and each of its servers (and their stubs)."""
    groups = {state["balancer"]["pid"], state["redis"]["pid"]}
    for i, r in enumerate(state["replicas"]):
        groups |= {r["pid"], r["watchdog_pid"]}
        pid_file = run_dir / f"replica{i}.pid"
        if pid_file.exists():
            now = json.loads(pid_file.read_text())
            groups |= {now["pid"], now["watchdog_pid"]}
    return {g for g in groups if g}


def _kill_replica_server_and_wait_healed(state: dict, port: int, run) -> list:
    """SIGKILL replica 0's tritonserver alone (its stubs live on): its watchdog starts it again,
    `cluster status` says every replica is alive, and a session is served through the balancer."""
    import os
    import signal

    from backend_src.serving.processes import http_json
    from backend_src.serving.stub_processes import group_members

    old = state["replicas"][0]["pid"]
    os.kill(old, signal.SIGKILL)
    killed_at = time.monotonic()
    while True:
        elapsed = time.monotonic() - killed_at
        r = run("status")
        now = json.loads(r.stdout)["replicas"][0]["pid"] if r.stdout.strip().startswith("{") else old
        if r.returncode == 0 and now != old and http_json(state["replicas"][0]["ready_url"] + "/ready")[0] == 200:
            break
        assert elapsed < HEAL_BOUND_S, r.stdout[-2000:]
        time.sleep(1.0)
    with RecommenderClient(f"127.0.0.1:{port}") as client:
        items, actions, ts = events(98, 3)
        assert client.open_session("cli-healed", items, actions, ts, top_k=5).event_count == 3
    print(f"replica's server killed: serving again {time.monotonic() - killed_at:.1f} s later")
    assert not group_members(old), "the killed server's stubs run on"
    return [old]
