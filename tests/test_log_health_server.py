"""Readiness that tells the truth about writes, a damaged log, a clean stop, and the client's default
retries, against a real tritonserver started by the command line with its watchdog:

- a SQLite log on a small filesystem of its own: /ready says 503 with the reason while the disk is
  full, while the file cannot be opened for writing, and once its pages are damaged, and 200 again
  once writes work; a damaged file refuses `server start` with a message saying how to recover;
  after `server stop` the main file alone holds every event (the WAL was checkpointed);
- a Redis log: the client's default retries outlast a SIGKILLed tritonserver (its watchdog starts
  it again) and 5 s without Redis, during which /ready says 503.
"""
import json
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from backend_src.config import DecodeOptions
from backend_src.serving.processes import free_port, http_json
from backend_src.serving.redis_server import RedisServer, redis_server_binary
from export import publish as pub
from export.triton_configs import ServingOptions

pytestmark = pytest.mark.server
pytest.importorskip("tritonclient.grpc")

from clients.client import RecommenderClient, RecommenderError  # noqa: E402
from serving_helpers import build_tiny_checkpoint, require_tritonserver, running  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
NUM_ITEMS = 40
READY_BOUND_S = 12.0  # a change of the log -> /ready says so (the probe runs every 2 s)
RESTART_BOUND_S = 90.0


# ---- helpers ------------------------------------------------------------------------------
def server_cli(*args, timeout=240) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("GENREC_ADMIN_KEY", "GENREC_EVENT_LOG")}
    return subprocess.run([sys.executable, "-m", "backend_src.serving.server", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def start(repo: Path, run: Path, event_log: str) -> tuple:
    ports = {k: free_port() for k in ("grpc", "http", "metrics", "ready")}
    pid_file = run / "tritonserver.pid"
    r = server_cli("start", "--model-repository", str(repo), "--grpc-port", str(ports["grpc"]),
                   "--http-port", str(ports["http"]), "--metrics-port", str(ports["metrics"]),
                   "--ready-port", str(ports["ready"]), "--log-file", str(run / "tritonserver.log"),
                   "--pid-file", str(pid_file), "--event-log", event_log)
    server = {"pid_file": pid_file, "grpc_url": f"127.0.0.1:{ports['grpc']}", "run": run,
              "ready_url": f"http://127.0.0.1:{ports['ready']}/ready"}
    return r, server


def stop(server: dict) -> subprocess.CompletedProcess:
    return server_cli("stop", "--pid-file", str(server["pid_file"]))


def wait_ready_status(server: dict, want: int, bound_s: float = READY_BOUND_S) -> dict:
    deadline = time.monotonic() + bound_s
    while True:
        status, body = http_json(server["ready_url"])
        if status == want:
            return body
        assert time.monotonic() < deadline, (status, body)
        time.sleep(0.25)


def events(n: int, first: int = 1, t0: int = 1000):
    return [f"sku-{1 + (first + i) % NUM_ITEMS}" for i in range(n)], [1] * n, [t0 + 60 * (first + i) for i in range(n)]


def corrupt_pages(path: Path) -> None:
    """The WAL moved into the main file, then every page after the first overwritten with garbage."""
    with sqlite3.connect(path) as db:
        db.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchall()
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.seek(4096)
        f.write(os.urandom(size - 4096))


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    require_tritonserver()
    tmp = tmp_path_factory.mktemp("loghealth")
    build_tiny_checkpoint(tmp / "v1.pt", [None] + [f"sku-{i}" for i in range(1, NUM_ITEMS + 1)], 20, seed=3)
    options = ServingOptions(decode=DecodeOptions(mode="pfa", beam_width=8, k=8, r=0.5, selection_step=1),
                             top_k=5, max_queue_delay_us=500, ranker_backend="torch")
    pub.publish(tmp / "v1.pt", tmp / "model_repository", options, export_ranker=False)
    return tmp / "model_repository"


# ---- a SQLite log on a filesystem of its own ----------------------------------------------
@pytest.fixture(scope="module")
def on_tmpfs(repo, tmp_path_factory):
    run = tmp_path_factory.mktemp("tmpfs-run")
    mnt = run / "log"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(mnt)], capture_output=True).returncode:
        pytest.skip("mounting a small filesystem needs root")
    r, server = start(repo, run, str(mnt / "events.sqlite3"))
    assert r.returncode == 0, r.stdout + r.stderr
    server.update(mnt=mnt, db=mnt / "events.sqlite3", repo=repo)
    try:
        yield server
    finally:
        if server["pid_file"].exists():
            stop(server)
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def test_ready_says_503_while_the_disk_is_full_and_200_after(on_tmpfs):
    with RecommenderClient(on_tmpfs["grpc_url"]) as client:
        assert client.open_session("full-1", *events(3)).event_count == 3
    assert wait_ready_status(on_tmpfs, 200)["event_log"]["ok"]
    filler = on_tmpfs["mnt"] / "filler"
    with open(filler, "wb") as f:
        try:
            while True:
                f.write(b"\0" * 65536)
                f.flush()
        except OSError:
            pass
    try:
        body = wait_ready_status(on_tmpfs, 503)
        assert not body["ready"] and "full" in body["event_log"]["error"], body
    finally:
        filler.unlink()
    assert wait_ready_status(on_tmpfs, 200)["event_log"]["error"] is None
    with RecommenderClient(on_tmpfs["grpc_url"]) as client:
        assert client.append("full-1", *events(1, first=3)).event_count == 4


def test_ready_says_503_while_the_file_cannot_be_opened_for_writing_and_200_after(on_tmpfs):
    db = on_tmpfs["db"]
    if subprocess.run(["chattr", "+i", str(db)], capture_output=True).returncode:
        pytest.skip("chattr +i is not available here")
    try:
        body = wait_ready_status(on_tmpfs, 503)
        assert "readonly" in body["event_log"]["error"], body
    finally:
        subprocess.run(["chattr", "-i", str(db)], check=True)
    wait_ready_status(on_tmpfs, 200)


def test_stop_leaves_every_event_in_the_main_file(on_tmpfs, tmp_path):
    with RecommenderClient(on_tmpfs["grpc_url"]) as client:
        for n in range(3):  # visits left open: the server's models do not unload gracefully at stop
            client.open_session(f"wal-{n}", *events(4 + n))
    r = stop(on_tmpfs)
    assert r.returncode == 0, r.stdout + r.stderr
    shutil.copy(on_tmpfs["db"], tmp_path / "alone.sqlite3")  # the main file without its WAL
    with sqlite3.connect(tmp_path / "alone.sqlite3") as db:
        counts = dict(db.execute("SELECT user, count FROM users WHERE user LIKE 's:wal-%'").fetchall())
    assert counts == {"s:wal-0": 4, "s:wal-1": 5, "s:wal-2": 6}, counts
    wal = on_tmpfs["db"].with_name("events.sqlite3-wal")
    assert not wal.exists() or wal.stat().st_size == 0


def test_a_damaged_log_refuses_start_saying_how_to_recover(on_tmpfs):
    db = on_tmpfs["db"]
    assert not on_tmpfs["pid_file"].exists()  # stopped by the test before
    corrupt_pages(db)
    r, _ = start(on_tmpfs["repo"], on_tmpfs["run"], str(db))
    out = r.stdout + r.stderr
    assert r.returncode != 0, out
    assert f"event log {db} is damaged" in out and "restore a backup" in out and ".recover" in out, out[-3000:]
    for suffix in ("", "-wal", "-shm"):  # the recovery: the damaged file moved aside, a fresh one
        f = db.with_name(db.name + suffix)
        if f.exists():
            f.rename(f.with_name(f.name + ".damaged"))
    r, server = start(on_tmpfs["repo"], on_tmpfs["run"], str(db))
    assert r.returncode == 0, r.stdout + r.stderr
    on_tmpfs.update(server)
    wait_ready_status(on_tmpfs, 200)


def test_a_log_damaged_while_serving_is_not_ready_and_not_retried(on_tmpfs):
    with RecommenderClient(on_tmpfs["grpc_url"]) as client:
        for n in range(20):
            client.open_session(f"dmg-{n}", *events(30, first=n))
    corrupt_pages(on_tmpfs["db"])
    body = wait_ready_status(on_tmpfs, 503)
    assert "damaged" in body["event_log"]["error"], body
    t0 = time.monotonic()
    with RecommenderClient(on_tmpfs["grpc_url"]) as client, pytest.raises(RecommenderError) as refused:
        client.open_session("dmg-new", *events(2))
    assert refused.value.status == "INTERNAL" and "damaged" in refused.value.message, refused.value
    assert "retry" not in refused.value.message.lower() and time.monotonic() - t0 < 5.0  # answered, not retried


# ---- a Redis log: the client's default retries ----------------------------------------------
@pytest.fixture(scope="module")
def on_redis(repo, tmp_path_factory):
    if redis_server_binary() is None:
        pytest.skip("needs Debian's redis-server")
    run = tmp_path_factory.mktemp("redis-run")
    redis = RedisServer(run / "redis").start()
    r, server = start(repo, run, redis.url)
    try:
        assert r.returncode == 0, r.stdout + r.stderr
        server["redis"] = redis
        yield server
    finally:
        stop(server)
        redis.stop()


class Writers:
    """`n` threads, each appending one event at a time to its own session with a default client,
    until stopped; failed calls and acknowledged counts are kept."""

    def __init__(self, url: str, n: int, tag: str):
        self.url, self.tag, self.failed, self.acked = url, tag, [], {}
        self.stopping = threading.Event()
        self.threads = [threading.Thread(target=self.write, args=(i,)) for i in range(n)]
        for t in self.threads:
            t.start()

    def write(self, i: int) -> None:
        sid = f"{self.tag}-{i}"
        with RecommenderClient(self.url) as client:  # the defaults
            client.open_session(sid, *events(2, first=i))
            n = 2
            while not self.stopping.is_set():
                try:
                    n = client.append(sid, *events(1, first=i + n, t0=1000 + 60 * n)).event_count
                except RecommenderError as e:
                    self.failed.append(str(e)[:200])
                time.sleep(0.05)
            self.acked[sid] = n

    def stop(self) -> None:
        self.stopping.set()
        for t in self.threads:
            t.join(120)


def test_default_retries_outlast_a_killed_server(on_redis):
    writers = Writers(on_redis["grpc_url"], 3, "kill")
    try:
        time.sleep(1.0)
        old = json.loads(on_redis["pid_file"].read_text())["pid"]
        os.kill(old, signal.SIGKILL)
        killed_at = time.monotonic()
        while json.loads(on_redis["pid_file"].read_text())["pid"] == old or http_json(on_redis["ready_url"])[0] != 200:
            assert time.monotonic() - killed_at < RESTART_BOUND_S
            time.sleep(0.25)
        print(f"server SIGKILLed: ready again {time.monotonic() - killed_at:.1f} s later")
        time.sleep(2.0)
    finally:
        writers.stop()
    assert writers.failed == [], writers.failed
    assert not running(old)
    from backend_src.serving.event_log import open_event_log

    with open_event_log(on_redis["redis"].url) as log:
        assert {sid: log.count(f"s:{sid}") for sid in writers.acked} == writers.acked


def test_default_retries_outlast_redis_down_for_5_s_and_ready_says_so(on_redis):
    redis = on_redis["redis"]
    wait_ready_status(on_redis, 200, RESTART_BOUND_S)
    writers = Writers(on_redis["grpc_url"], 3, "redis")
    try:
        time.sleep(1.0)
        redis.stop()
        down_at = time.monotonic()
        body = wait_ready_status(on_redis, 503)
        assert "unavailable" in body["event_log"]["error"], body
        time.sleep(max(0.0, 5.0 - (time.monotonic() - down_at)))
        redis.start()
        wait_ready_status(on_redis, 200)
        time.sleep(2.0)
    finally:
        writers.stop()
        redis.start()
    assert writers.failed == [], writers.failed
    from backend_src.serving.event_log import open_event_log

    with open_event_log(redis.url) as log:
        assert {sid: log.count(f"s:{sid}") for sid in writers.acked} == writers.acked
