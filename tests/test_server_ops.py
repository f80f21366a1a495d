"""Operating the server: self-healing after a stub dies and after the server itself crashes, only
inference open without the admin key, loopback-only by default, a fast clean stop with sessions
open.

The server is started the way an operator starts it (`python -m backend_src.serving.server
start`, a command that returns while the server and its watchdog keep running), with a tiny
untrained model as in tests/test_server.py.
"""
import ipaddress
import json
import os
import resource
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from multiprocessing import shared_memory
from pathlib import Path

import numpy as np
import pytest

from backend_src.config import DecodeOptions
from genrec_contract import protocol as P
from backend_src.serving.access import ADMIN_HEADER, ADMIN_KEY_ENV, GRPC_ADMIN_HEADER
from backend_src.serving.processes import free_port
from backend_src.serving.server import TritonServer
from export import publish as pub
from export.triton_configs import ServingOptions

pytestmark = pytest.mark.server
grpcclient = pytest.importorskip("tritonclient.grpc")
httpclient = pytest.importorskip("tritonclient.http")
from tritonclient.utils import InferenceServerException  # noqa: E402
from serving_helpers import build_tiny_checkpoint, children, require_tritonserver, running, watchdogs  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
NUM_ITEMS = 60
RECOVERY_BOUND_S = 15.0  # kill -> `recommend` answers again, with no call from the test
RESTART_BOUND_S = 90.0  # server crash -> a new server ready (a full start: models load again)
STOP_BOUND_S = 8.0


# ---- helpers ------------------------------------------------------------------------------
def _input(name, array, dtype):
    t = grpcclient.InferInput(name, list(array.shape), dtype)
    t.set_data_from_numpy(array)
    return t


def recommend(client, sid, start=True, end=True):
    items = np.array([[b"sku-3", b"sku-7"]], dtype=object)
    inputs = [
        _input(P.ITEM_IDS.name, items, "BYTES"),
        _input(P.ACTIONS.name, np.ones((1, 2), np.int64), "INT64"),
        _input(P.TIMESTAMPS.name, np.array([[1000, 1060]], np.int64), "INT64"),
    ]
    return client.infer(P.ENSEMBLE, inputs, sequence_id=sid, sequence_start=start, sequence_end=end, client_timeout=30)


def overflowing_request(client, sid):
    """INT64 [1, 2**62] with an empty payload: the byte count wraps, the stub dies unpacking it."""
    huge = grpcclient.InferInput(P.ACTIONS.name, [1, 2**62], "INT64")
    huge._raw_content = b""
    inputs = [
        _input(P.ITEM_IDS.name, np.array([[b"sku-1", b"sku-2"]], dtype=object), "BYTES"),
        huge,
        _input(P.TIMESTAMPS.name, np.array([[1, 2]], np.int64), "INT64"),
    ]
    return client.infer(P.ENSEMBLE, inputs, sequence_id=sid, sequence_start=True, sequence_end=True, client_timeout=30)


def crash(pid: int) -> None:
    """SIGSEGV, as a crash ends a process (with no core file written)."""
    resource.prlimit(pid, resource.RLIMIT_CORE, (0, 0))
    os.kill(pid, signal.SIGSEGV)


def stubs(server_pid: int) -> dict:
    """{pid: (state, model)} of the server's Python-backend stubs (model None for a zombie)."""
    out = {}
    for pid, (state, cmd) in children(server_pid).items():
        comm = Path(f"/proc/{pid}/comm").read_text().strip() if Path(f"/proc/{pid}/comm").exists() else ""
        if "triton_python_backend_stub" in cmd or comm.startswith("triton_python_b"):
            model = next((m for m in P.PYTHON_MODELS if f"/{m}/" in cmd), None)
            out[pid] = (state, model)
    return out


def steady_stubs(server_pid: int, timeout_s: float = 30.0) -> dict:
    """stubs() once every Python model has exactly one (after a reload the old instances take a
    few seconds to finish)."""
    deadline = time.monotonic() + timeout_s
    while True:
        found = stubs(server_pid)
        if sorted(str(model) for _, model in found.values()) == sorted(P.PYTHON_MODELS):
            return found
        assert time.monotonic() < deadline, found
        time.sleep(0.2)


def stub_processes_of(repo) -> list:
    """Running stub processes (of any parent) serving a model of `repo`."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and running(int(entry)):
            try:
                cmd = Path(f"/proc/{entry}/cmdline").read_bytes()
            except OSError:
                continue
            if b"triton_python_backend_stub" in cmd and str(repo).encode() in cmd:
                out.append(int(entry))
    return out


def get(url: str) -> tuple:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def server_cli(*args, env=None, timeout=240) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "backend_src.serving.server", *args],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout,
    )


def clean_env() -> dict:
    env = dict(os.environ)
    env.pop(ADMIN_KEY_ENV, None)
    return env


# ---- fixtures -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    require_tritonserver()
    tmp = tmp_path_factory.mktemp("ops")
    item_ids = [None] + [f"sku-{i}" for i in range(1, NUM_ITEMS + 1)]
    build_tiny_checkpoint(tmp / "v1.pt", item_ids, 20, seed=1)
    options = ServingOptions(
        decode=DecodeOptions(mode="pfa", beam_width=8, k=8, r=0.5, selection_step=1),
        top_k=5, max_queue_delay_us=500,
    )
    pub.publish(tmp / "v1.pt", tmp / "model_repository", options)
    return tmp / "model_repository"


@pytest.fixture(scope="module")
def cli_server(repo, tmp_path_factory):
    """A server started by the CLI with its defaults (watchdog on, admin key, loopback)."""
    run = tmp_path_factory.mktemp("run")
    ports = {"grpc": free_port(), "http": free_port(), "metrics": free_port(), "ready": free_port()}
    pid_file = run / "tritonserver.pid"
    common = ["--pid-file", str(pid_file)]
    r = server_cli(
        "start", "--model-repository", str(repo), "--grpc-port", str(ports["grpc"]), "--http-port", str(ports["http"]),
        "--metrics-port", str(ports["metrics"]), "--ready-port", str(ports["ready"]),
        "--log-file", str(run / "tritonserver.log"), *common, env=clean_env(),
    )
    assert r.returncode == 0, r.stdout + r.stderr
    info = json.loads(pid_file.read_text())
    yield {
        "run": run, "ports": ports, "pid_file": pid_file, "info": info, "common": common,
        "key": (run / "admin.key").read_text().strip(), "grpc_url": f"127.0.0.1:{ports['grpc']}",
        "http_url": f"127.0.0.1:{ports['http']}", "ready_url": f"http://127.0.0.1:{ports['ready']}",
    }
    current = json.loads(pid_file.read_text()) if pid_file.exists() else info
    if pid_file.exists():
        server_cli("stop", *common, env=clean_env())
    # whatever a failed test left behind (checked by command line: a pid may be reused)
    for pid, marker in ((info["watchdog_pid"], b"serving.watchdog"), (current["watchdog_pid"], b"serving.watchdog"),
                        (current["pid"], b"tritonserver")):
        try:
            ours = running(pid) and marker in Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            ours = False
        if ours:
            os.kill(pid, signal.SIGKILL)


# ---- tests --------------------------------------------------------------------------------
def test_cli_start_leaves_server_and_watchdog_running(cli_server):
    info, run = cli_server["info"], cli_server["run"]
    # `start` has returned; both processes outlive it, each on its own
    assert running(info["pid"]) and running(info["watchdog_pid"]) and info["pid"] != info["watchdog_pid"]
    assert b"backend_src.serving.watchdog" in Path(f"/proc/{info['watchdog_pid']}/cmdline").read_bytes()
    assert len(watchdogs(info["watchdog_pid"])) == 1  # the keeper's one child
    assert (run / "admin.key").stat().st_mode & 0o777 == 0o600
    assert len(cli_server["key"]) >= 32
    assert get(cli_server["ready_url"] + "/ready")[0] == 200 and get(cli_server["ready_url"] + "/live")[0] == 200
    r = server_cli("status", *cli_server["common"], env=clean_env())
    status = json.loads(r.stdout)
    assert r.returncode == 0 and status["ready"] and status["watchdog"]["ready_status"] == 200, r.stdout
    assert (run / "watchdog.log").exists()


def _listening(port: int) -> set:
    """Local addresses of the sockets listening on `port`, from /proc/net/tcp and tcp6 (an IPv6
    socket bound to an IPv4 address shows the v4-mapped form: given as the IPv4 address)."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            local, state = line.split()[1], line.split()[3]
            hexaddr, hexport = local.split(":")
            if state != "0A" or int(hexport, 16) != port:
                continue
            # 32-bit words in host (little-endian) order
            raw = b"".join(bytes.fromhex(hexaddr[i : i + 8])[::-1] for i in range(0, len(hexaddr), 8))
            addr = ipaddress.ip_address(raw)
            found.add(str(getattr(addr, "ipv4_mapped", None) or addr))
    return found


def _non_loopback_address() -> str | None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))  # no packet is sent: this only picks the source address
            addr = s.getsockname()[0]
        except OSError:
            return None
    return None if addr.startswith("127.") else addr


def test_listens_on_loopback_only(cli_server):
    for name, port in cli_server["ports"].items():
        assert _listening(port) == {"127.0.0.1"}, (name, _listening(port))  # no wildcard, no other address
    addr = _non_loopback_address()
    if addr:
        for port in cli_server["ports"].values():
            with pytest.raises(OSError):
                socket.create_connection((addr, port), timeout=2).close()


def test_only_inference_is_open_without_the_admin_key(cli_server, repo):
    key = cli_server["key"]
    g = grpcclient.InferenceServerClient(cli_server["grpc_url"])
    h = httpclient.InferenceServerClient(cli_server["http_url"])
    shm = shared_memory.SharedMemory(create=True, size=64)
    try:
        admin_calls = {
            "unload_model": lambda c, hd: c.unload_model(P.ENSEMBLE, headers=hd),
            "load_model": lambda c, hd: c.load_model(P.ENSEMBLE, headers=hd),
            "register_system_shared_memory":
                lambda c, hd: c.register_system_shared_memory("ops", "/" + shm.name, 64, headers=hd),
            "unregister_system_shared_memory": lambda c, hd: c.unregister_system_shared_memory("ops", headers=hd),
            "update_log_settings": lambda c, hd: c.update_log_settings({"log_info": True}, headers=hd),
            "get_model_repository_index": lambda c, hd: c.get_model_repository_index(headers=hd),
        }
        for client, header, refusal in ((g, GRPC_ADMIN_HEADER, "StatusCode.UNAVAILABLE"), (h, ADMIN_HEADER, "403")):
            for name, call in admin_calls.items():
                for headers in (None, {header: "not-the-key-0123456789"}):
                    with pytest.raises(InferenceServerException) as e:
                        call(client, headers)
                    assert e.value.status() == refusal and "restricted" in e.value.message(), (name, e.value)
            assert client.is_model_ready(P.ENSEMBLE)  # the refused unload did nothing

            # with the key every one of them works
            ok = {header: key}
            index = admin_calls["get_model_repository_index"](client, ok)
            names = {m["name"] for m in index} if isinstance(index, list) else {m.name for m in index.models}
            assert names >= set(P.ALL_MODELS)
            admin_calls["update_log_settings"](client, ok)
            admin_calls["register_system_shared_memory"](client, ok)
            admin_calls["unregister_system_shared_memory"](client, ok)
            admin_calls["unload_model"](client, ok)
            deadline = time.monotonic() + 30
            while client.is_model_ready(P.ENSEMBLE) and time.monotonic() < deadline:
                time.sleep(0.1)
            assert not client.is_model_ready(P.ENSEMBLE)
            admin_calls["load_model"](client, ok)
            assert client.is_model_ready(P.ENSEMBLE)

            # open to anyone: health, metadata, model config, statistics
            assert client.is_server_live() and client.is_server_ready()
            assert client.get_server_metadata() and client.get_model_metadata(P.ENCODER)
            assert client.get_model_config(P.ENCODER) and client.get_inference_statistics(P.ENSEMBLE)
        # and inference
        r = recommend(g, 900)
        assert r.as_numpy("RECOMMENDED_IDS").shape == (1, 5)

        # publish sends the key; with a wrong one it stops before the repository changes
        with pytest.raises(InferenceServerException, match="restricted"):
            pub.reload_models(cli_server["grpc_url"], admin_key="not-the-key-0123456789")
        before = pub.describe(repo)
        with pytest.raises(InferenceServerException, match="restricted"):
            pub.publish(repo.parent / "v1.pt", repo, server=cli_server["grpc_url"], admin_key="not-the-key-0123456789")
        assert pub.describe(repo) == before
        pub.reload_models(cli_server["grpc_url"], admin_key=key)
        # none of these reloads looked like a dead stub to the watchdog
        steady_stubs(cli_server["info"]["pid"])
        assert "reloading" not in (cli_server["run"] / "watchdog.log").read_text()
    finally:
        g.close()
        h.close()
        shm.close()
        shm.unlink()


def _wait_healed(cli_server, client, killed_at: float, seen_503: list) -> float:
    """Poll /ready (recording 503s) and `recommend` until it answers; seconds since killed_at."""
    sid = 5000
    while True:
        elapsed = time.monotonic() - killed_at
        assert elapsed < RECOVERY_BOUND_S, f"not healed after {elapsed:.1f} s; /ready says {seen_503[-1:]}"
        status, body = get(cli_server["ready_url"] + "/ready")
        if status == 503:
            seen_503.append(body)
        sid += 1
        try:
            recommend(client, sid)
            return time.monotonic() - killed_at
        except InferenceServerException:
            time.sleep(0.2)


def _encoder_reloads(cli_server) -> int:
    return (cli_server["run"] / "watchdog.log").read_text().count(f"{P.ENCODER}: reloaded")


def _check_healed(cli_server, seen_503: list, reloads_before: int) -> None:
    """The encoder was seen dead, is back with one live stub a model, and was reloaded once more."""
    assert any(P.ENCODER in body["dead"] for body in seen_503), seen_503[:3]
    deadline = time.monotonic() + 10
    while get(cli_server["ready_url"] + "/ready")[0] != 200:
        assert time.monotonic() < deadline, get(cli_server["ready_url"] + "/ready")
        time.sleep(0.2)
    found = steady_stubs(cli_server["info"]["pid"])  # one live stub per model, and no zombie stub left
    assert not [pid for pid, (state, _) in found.items() if state == "Z"], found
    assert _encoder_reloads(cli_server) == reloads_before + 1


def _kill_encoder_stub_and_check_healed(cli_server) -> float:
    client = grpcclient.InferenceServerClient(cli_server["grpc_url"])
    reloads = _encoder_reloads(cli_server)
    try:
        recommend(client, 1001 + reloads)
        (encoder,) = [pid for pid, (_, model) in steady_stubs(cli_server["info"]["pid"]).items() if model == P.ENCODER]
        os.kill(encoder, signal.SIGKILL)
        killed_at = time.monotonic()
        seen_503 = []
        while not seen_503 and time.monotonic() - killed_at < 3:  # right after the kill
            status, body = get(cli_server["ready_url"] + "/ready")
            if status == 503:
                seen_503.append(body)
        recovered_s = _wait_healed(cli_server, client, killed_at, seen_503)
        _check_healed(cli_server, seen_503, reloads)
        return recovered_s
    finally:
        client.close()


def test_watchdog_heals_a_killed_stub(cli_server):
    recovered_s = _kill_encoder_stub_and_check_healed(cli_server)
    print(f"killed stub: recommend answers again {recovered_s:.1f} s after the kill")


def test_watchdog_heals_after_an_overflowing_request(cli_server):
    client = grpcclient.InferenceServerClient(cli_server["grpc_url"])
    reloads = _encoder_reloads(cli_server)
    try:
        sent_at = time.monotonic()
        with pytest.raises(InferenceServerException, match="not healthy"):
            overflowing_request(client, 1002)
        seen_503 = []
        recovered_s = _wait_healed(cli_server, client, sent_at, seen_503)
        print(f"overflowing request: recommend answers again {recovered_s:.1f} s after it was sent")
        _check_healed(cli_server, seen_503, reloads)
    finally:
        client.close()


def test_a_killed_watchdog_is_started_again(cli_server):
    """The watchdog itself is killed (SIGKILL, as the OOM killer ends a process): its keeper
    starts a new one, which answers /ready on the same port and heals a killed stub as the first
    one did."""
    keeper, log_file = cli_server["info"]["watchdog_pid"], cli_server["run"] / "watchdog.log"
    (old,) = watchdogs(keeper)
    os.kill(old, signal.SIGKILL)
    killed_at = time.monotonic()
    while True:
        elapsed = time.monotonic() - killed_at
        assert elapsed < RECOVERY_BOUND_S, log_file.read_text()[-2000:]
        new = watchdogs(keeper)
        try:
            ready = new and new != [old] and get(cli_server["ready_url"] + "/ready")[0] == 200
        except OSError:  # not listening yet
            ready = False
        if ready:
            break
        time.sleep(0.2)
    print(f"killed watchdog: a new one ready {elapsed:.1f} s after the kill")
    assert running(keeper) and not running(old)
    assert f"the watchdog (pid {old}) died (signal 9)" in log_file.read_text()
    _kill_encoder_stub_and_check_healed(cli_server)


def test_cli_start_gives_a_running_server_its_watchdog_again(cli_server):
    """The keeper itself is killed, and the watchdog with it: `start` on the running server starts
    only a new keeper and watchdog for it, and a second `start` finds everything running."""
    info, pid_file = cli_server["info"], cli_server["pid_file"]
    keeper, (watchdog,) = info["watchdog_pid"], watchdogs(info["watchdog_pid"])
    os.kill(keeper, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while running(watchdog):  # it gets SIGTERM from the kernel when its keeper dies
        assert time.monotonic() < deadline, "the watchdog outlived its keeper"
        time.sleep(0.1)
    r = server_cli("status", *cli_server["common"], env=clean_env())
    assert r.returncode == 3 and not json.loads(r.stdout)["watchdog"]["alive"], r.stdout
    # what a liveness probe on the watchdog sees (deploy/: the kubelet then restarts the container)
    with pytest.raises(urllib.error.URLError):
        get(cli_server["ready_url"] + "/live")
    r = server_cli("start", *cli_server["common"], env=clean_env())
    assert r.returncode == 0 and "its watchdog was gone" in r.stdout, r.stdout + r.stderr
    new = json.loads(pid_file.read_text())
    assert new["pid"] == info["pid"] and new["watchdog_pid"] != keeper and len(watchdogs(new["watchdog_pid"])) == 1
    assert get(cli_server["ready_url"] + "/ready")[0] == 200 and get(cli_server["ready_url"] + "/live")[0] == 200
    r = server_cli("start", *cli_server["common"], env=clean_env())
    assert r.returncode == 1 and "already running" in r.stderr, r.stdout + r.stderr
    cli_server["info"] = new


def test_watchdog_restarts_a_crashed_server(cli_server):
    """tritonserver itself dies as a crash kills it (SIGSEGV): the watchdog starts it again on
    the same ports, the pid file follows, and a session carries on from the log with every
    acknowledged event exactly once."""
    from clients.client import RecommenderClient

    pid_file = cli_server["pid_file"]
    old = json.loads(pid_file.read_text())["pid"]
    with RecommenderClient(cli_server["grpc_url"], timeout_s=10, retries=2) as client:
        client.open_session("crashed", ["sku-1", "sku-2", "sku-3"], timestamps=[10, 20, 30])
        client.append("crashed", ["sku-4"], timestamps=[40])
        assert client.event_count("crashed") == 4
        crash(old)
        crashed_at = time.monotonic()
        while True:  # a new server, ready
            elapsed = time.monotonic() - crashed_at
            assert elapsed < RESTART_BOUND_S, (elapsed, (cli_server["run"] / "watchdog.log").read_text()[-2000:])
            new = json.loads(pid_file.read_text())["pid"]
            status, body = get(cli_server["ready_url"] + "/ready")
            if new != old and status == 200:
                break
            time.sleep(0.5)
        print(f"crashed server: a new one ready {elapsed:.1f} s after the crash")
        assert not running(old) and running(new) and b"tritonserver" in Path(f"/proc/{new}/cmdline").read_bytes()
        assert body["server_restarts"] == 1 and not body["server_restarting"], body
        # same ports, same admin key, loopback only
        for name, port in cli_server["ports"].items():
            assert _listening(port) == {"127.0.0.1"}, (name, port)
        with pytest.raises(InferenceServerException, match="restricted"):
            grpcclient.InferenceServerClient(cli_server["grpc_url"]).unload_model(P.ENSEMBLE)
        # the session resumes from the log: nothing lost, nothing applied twice
        client.append("crashed", ["sku-5"], timestamps=[50])
        assert client.event_count("crashed") == 5
    with RecommenderClient(cli_server["grpc_url"], timeout_s=10) as fresh:
        fresh.resume("crashed")
        assert fresh.event_count("crashed") == 5
    r = server_cli("status", *cli_server["common"], env=clean_env())
    assert r.returncode == 0 and json.loads(r.stdout)["pid"] == new, r.stdout
    assert "tritonserver restarted" in (cli_server["run"] / "watchdog.log").read_text()
    cli_server["info"] = json.loads(pid_file.read_text())


def test_cli_stop_with_open_sessions_is_fast(cli_server, repo):
    info = cli_server["info"]
    client = grpcclient.InferenceServerClient(cli_server["grpc_url"])
    for sid in (71, 72, 73):  # three sessions left open
        recommend(client, sid, start=True, end=False)
    client.close()
    t0 = time.monotonic()
    r = server_cli("stop", *cli_server["common"], env=clean_env())
    took = time.monotonic() - t0
    print(f"CLI stop with 3 open sessions: {took:.1f} s ({r.stdout.strip()})")
    assert r.returncode == 0 and "by SIGTERM" in r.stdout, r.stdout + r.stderr
    assert took < STOP_BOUND_S, took
    assert not running(info["pid"]) and not running(info["watchdog_pid"])
    assert not cli_server["pid_file"].exists()
    # the stubs follow their server out
    deadline = time.monotonic() + 10
    while stub_processes_of(repo):
        assert time.monotonic() < deadline, f"stub processes outlived the server: {stub_processes_of(repo)}"
        time.sleep(0.2)


def test_class_with_watchdog_stops_by_sigterm_with_open_sessions(repo, tmp_path):
    server = TritonServer(
        repo, free_port(), free_port(), free_port(), log_file=tmp_path / "tritonserver.log",
        admin_key="k" * 32, watchdog=True, ready_port=free_port(),
    )
    server.start(timeout_s=120)
    try:
        assert running(server.watchdog_pid) and get(server.ready_url + "/ready")[0] == 200
        client = grpcclient.InferenceServerClient(server.grpc_url)
        for sid in (81, 82, 83):
            recommend(client, sid, start=True, end=False)
        client.close()
    finally:
        t0 = time.monotonic()
        code = server.stop()
        took = time.monotonic() - t0
        print(f"TritonServer.stop with 3 open sessions: {took:.1f} s, exit code {code}")
    assert server.watchdog_process.returncode is not None  # stopped first, by us
    assert code is not None and code != -signal.SIGKILL, code  # the server's own exit after SIGTERM
    assert took < STOP_BOUND_S, took


def test_class_stop_after_a_restart_stops_the_new_server(repo, tmp_path):
    """With restart on, stop() ends the server the watchdog started in place of a crashed one
    (not only the one it started itself), and leaves no pid or launch file. The crashed server
    stays a zombie here (this process started it and has not reaped it), which its stubs take for
    a live parent: the watchdog ends them."""
    pid_file = tmp_path / "tritonserver.pid"
    server = TritonServer(
        repo, free_port(), free_port(), free_port(), log_file=tmp_path / "tritonserver.log",
        admin_key="k" * 32, watchdog=True, ready_port=free_port(), pid_file=pid_file, restart=True,
    )
    server.start(timeout_s=120)
    try:
        launch = pid_file.with_suffix(".launch.json")
        assert launch.stat().st_mode & 0o777 == 0o600
        old_stubs = steady_stubs(server.pid)
        crash(server.pid)
        deadline = time.monotonic() + RESTART_BOUND_S
        while json.loads(pid_file.read_text())["pid"] == server.pid or get(server.ready_url + "/ready")[0] != 200:
            assert time.monotonic() < deadline, (tmp_path / "watchdog.log").read_text()[-2000:]
            time.sleep(0.5)
        new = json.loads(pid_file.read_text())["pid"]
        assert not [pid for pid in old_stubs if running(pid)], old_stubs
        assert server.process.wait(5) == -signal.SIGSEGV and running(new)
    finally:
        server.stop()
    assert not running(new) and not pid_file.exists() and not launch.exists()
