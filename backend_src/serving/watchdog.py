"""Stub watchdog: reloads a Python model whose stub process died, and says whether the server
can really serve.

    python -m backend_src.serving.watchdog --server-pid PID --grpc-url 127.0.0.1:8001 \
        --http-url 127.0.0.1:8000 --ready-port 8003 [--address 127.0.0.1] [--log-file runs/watchdog.log]

`python -m backend_src.serving.server start` runs it as a detached process of its own. The admin
key for reloading comes from GENREC_ADMIN_KEY in its environment.

Why: the Python backend runs each model instance as a child process of tritonserver
(`triton_python_backend_stub <repository>/<model>/<version>/model.py ...`). When one dies (a
request whose shape overflows the server's byte count kills it before model code runs), the
server answers every later request of that model with "Stub process ... is not healthy" and
still says the model is ready; nothing brings it back but a reload.

How: every `--interval` seconds (0.5) it lists tritonserver's stub children in /proc. A model
that the server says is ready but that has fewer live stubs than its config's instances (one
vanished, or is a zombie) is dead: it is reloaded (which reloads the ensemble too) at once.
An inference probe of every stage every `--probe-interval` seconds (30) is the slower
backstop, for a stub that is there but does not answer.

The server itself (`--restart-from LAUNCH_FILE --pid-file PID_FILE`, which `server start`
sets): when tritonserver is gone while the watchdog runs, it was not stopped (`server stop`
stops the watchdog first), so it crashed. The watchdog starts it again with the command and
environment the launch file holds (same ports, same repository, so the versions the repository
serves now) and writes the new pid to the pid file. A server that dies within a minute of its
start waits 2, 4, ... up to 60 s before the next start, so a server that cannot start does not
spin. Sessions come back from the event log at their next request. Without a launch file the
watchdog exits when tritonserver is gone.

Its keeper (`--keep`, which `TritonServer` always sets; `serving/watchdog_keeper.py`): the
process `server start` leaves behind runs the watchdog as its child and starts it again when it
dies of anything but a stop. The new watchdog reads the server's pid from the pid file, which
follows a restart. Stub processes are read from /proc (`serving/stub_processes.py`).

Readiness (HTTP on --address:--ready-port): GET /ready answers 200 only when tritonserver is
ready (and not being started again), every model is ready, every Python stage has all its
stubs alive and is not being reloaded, and the event log takes writes (``serving/log_probe.py``:
a write and read of a reserved key every --log-probe-interval seconds, of the log the server
writes: GENREC_EVENT_LOG, else the encoder config's event_log, else the SQLite file beside
--model-repository), else 503 with a JSON body naming the dead stages and the log's error;
GET /live answers 200 while tritonserver answers its own liveness. It exits on SIGTERM.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from genrec_contract import protocol as P
from backend_src.serving.access import ADMIN_KEY_ENV
from backend_src.serving.event_log import EVENT_LOG_ENV
from backend_src.serving.health import reload_model, unhealthy_models
from backend_src.serving.log_probe import LogProbe, served_event_log
from backend_src.serving.processes import alive, http_ok, launch, read_pid_file, terminate, update_pid_file
from backend_src.serving.stub_processes import STUB_COMM, end_group, instance_count, process_stat, stub_processes
from backend_src.serving.watchdog_keeper import keep

log = logging.getLogger("genrec.watchdog")


# --------------------------------------------------------------------------------------------
# The watchdog
# --------------------------------------------------------------------------------------------
class Watchdog:
    def __init__(
        self,
        server_pid: int,
        grpc_url: str,
        http_url: str,
        admin_key: str | None = None,
        interval_s: float = 0.5,
        probe_interval_s: float = 30.0,
        models=P.PYTHON_MODELS,
        restart_from=None,
        pid_file=None,
    ):
        self.server_pid, self.grpc_url, self.http_url = server_pid, grpc_url, http_url
        self.restart_from, self.pid_file = restart_from, pid_file
        self.server_process = None  # the Popen of a server this watchdog started (it reaps it)
        self.server_started_at = time.monotonic()
        self.quick_deaths = 0  # consecutive deaths within a minute of a start
        self.restarting = False
        self.restarts = 0  # servers started in place of a dead one
        self._spawn_lock = threading.Lock()
        self.admin_key = admin_key
        self.interval_s, self.probe_interval_s = interval_s, probe_interval_s
        self.models = tuple(models)
        self.known: dict = {}  # stub pid -> model, remembered to name a zombie
        self.expected: dict = {}  # model -> instances, for the models the server says are ready
        self._last_live: frozenset = frozenset()
        self._lock = threading.Lock()
        self.dead: dict = {}  # model -> why, until its reload succeeded
        self.retry_at: dict = {}  # model -> monotonic time of the next reload attempt after a failure
        self.failures: dict = {}
        self.healed: list = []  # (model, seconds from detection to reloaded)
        self.stop_event = threading.Event()
        self._client = None
        self.log_probe: LogProbe | None = None  # whether the event log takes writes (main() starts it)

    # ---- what the server should have ---------------------------------------------------------
    def client(self):
        if self._client is None:
            import tritonclient.grpc as grpcclient

            self._client = grpcclient.InferenceServerClient(self.grpc_url)
        return self._client

    def refresh(self) -> None:
        """Instances expected of each model the server says is ready (a model being unloaded,
        or never loaded, is not expected to have stubs)."""
        expected = {}
        for model in self.models:
            if self.client().is_model_ready(model, client_timeout=5):
                config = self.client().get_model_config(model, as_json=True, client_timeout=5)["config"]
                expected[model] = instance_count(config)
        self.expected = expected

    def scan(self) -> dict:
        stubs = stub_processes(self.server_pid, self.known)
        # one assignment, as /ready reads it from another thread
        self.known = {pid: model for pid, (model, _) in stubs.items() if model is not None}
        return stubs

    def deficits(self, stubs: dict, expected: dict | None = None) -> dict:
        """{model: why} for ready models with fewer live stubs than instances. Any version
        counts: during a version swap the new stubs start before the old ones stop."""
        expected = self.expected if expected is None else expected
        live: dict = {}
        for model, running in stubs.values():
            if running:
                live[model] = live.get(model, 0) + 1
        out = {}
        for model, want in expected.items():
            have = live.get(model, 0)
            if have < want:
                zombies = sorted(pid for pid, (m, running) in stubs.items() if m == model and not running)
                out[model] = f"stub died: {have} of {want} stub processes alive" + (
                    f" (zombie pids {zombies})" if zombies else "")
        return out

    def find_dead(self) -> dict:
        stubs = self.scan()
        live = frozenset(pid for pid, (_, running) in stubs.items() if running)
        if live != self._last_live or not self.expected:
            self._last_live = live
            self.refresh()
            stubs = self.scan()
        dead = self.deficits(stubs)
        if dead:  # confirm against the server's current view (a reload may have just finished)
            self.refresh()
            dead = {m: why for m, why in self.deficits(self.scan()).items() if m in dead}
        return dead

    # ---- healing -------------------------------------------------------------------------------
    def heal(self, dead: dict, found_at: float) -> None:
        for model, why in dead.items():
            if time.monotonic() < self.retry_at.get(model, 0.0):
                continue
            log.warning("%s: %s; reloading", model, why)
            t0 = time.monotonic()
            try:
                reload_model(self.client(), model, self.admin_key)
            except Exception as e:  # noqa: BLE001 - keep watching; try again later
                n = self.failures[model] = self.failures.get(model, 0) + 1
                self.retry_at[model] = time.monotonic() + min(60.0, 2.0**n)
                log.error("%s: reload failed (%s); next try in %.0f s", model, e, min(60.0, 2.0**n))
                continue
            self.failures.pop(model, None)
            self.retry_at.pop(model, None)
            with self._lock:
                self.dead.pop(model, None)
            self.healed.append((model, time.monotonic() - found_at))
            self._last_live = frozenset()  # look again at once
            log.warning("%s: reloaded in %.1f s (%.1f s after the failure was seen); %s follows",
                        model, time.monotonic() - t0, time.monotonic() - found_at, P.ENSEMBLE)

    def tick(self) -> None:
        if not self.server_live():
            return  # starting or stopping: nothing to heal
        found_at = time.monotonic()
        dead = self.find_dead()
        for model in list(self.retry_at):
            if model not in dead:  # back without us (reloaded by someone, or unloaded)
                self.retry_at.pop(model, None)
                self.failures.pop(model, None)
        with self._lock:
            self.dead = dict(dead)
        if dead:
            self.heal(dead, found_at)

    def probe(self) -> None:
        """The slow backstop: an inference probe of every stage not already known dead."""
        models = [m for m in self.models if m not in self.dead]
        bad = unhealthy_models(self.grpc_url, models)
        if bad:
            dead = {m: "stub does not answer an inference probe" for m in bad}
            with self._lock:
                self.dead.update(dead)
            self.heal(dead, time.monotonic())

    def server_alive(self) -> bool:
        return alive(self.server_pid)

    def server_live(self) -> bool:
        return http_ok(f"http://{self.http_url}/v2/health/live")

    def run(self) -> None:
        next_probe = time.monotonic() + self.probe_interval_s
        while not self.stop_event.is_set():
            if not self.server_alive():
                if not self.restart_from:
                    log.warning("tritonserver (pid %d) is gone; the watchdog stops", self.server_pid)
                    self.stop_event.set()
                    break
                self.restart_server()
                continue
            try:
                self.tick()
                if self.probe_interval_s > 0 and time.monotonic() >= next_probe:
                    next_probe = time.monotonic() + self.probe_interval_s
                    self.probe()
            except Exception as e:  # noqa: BLE001 - a watchdog must not die of a failed check
                log.error("check failed: %s", e)
                self._client, self._last_live = None, frozenset()
            self.stop_event.wait(self.interval_s)

    # ---- the server itself -------------------------------------------------------------------
    def restart_server(self) -> None:
        """Start tritonserver again from the launch file and wait until it is ready (or dies,
        or does not get ready in its start timeout: then it is killed and the next tick tries
        again)."""
        seen_gone = time.monotonic()
        old = self.server_pid
        code = self.server_process.poll() if self.server_process is not None else None  # ours: reaped here
        self.restarting = True
        if time.monotonic() - self.server_started_at < 60.0:
            self.quick_deaths += 1
        else:
            self.quick_deaths = 0
        delay = min(60.0, 2.0 ** (self.quick_deaths - 1)) if self.quick_deaths > 1 else 0.0
        log.error("tritonserver (pid %d) is gone%s; starting it again%s", old,
                  f" (exit status {code})" if code is not None else "", f" in {delay:.0f} s" if delay else "")
        self.end_orphaned_stubs()
        ended = end_group(old)  # stubs not seen yet (a server killed soon after its start), by their group
        if ended:
            log.warning("ended %d more processes of the dead server's group: %s", len(ended), ended)
        if self.stop_event.wait(delay):
            return
        spec = json.loads(Path(self.restart_from).read_text())
        with self._spawn_lock:  # SIGTERM waits for this: the new pid is in the pid file before we exit
            if self.stop_event.is_set():
                return
            proc = launch(spec["argv"], spec["env"], spec["log_file"], spec.get("cwd"))
            update_pid_file(self.pid_file, pid=proc.pid)
            self.server_process, self.server_pid = proc, proc.pid
            self.server_started_at = time.monotonic()
            self.known, self.expected, self._last_live, self.dead = {}, {}, frozenset(), {}
            self._client = None
        start_timeout_s = float(spec.get("start_timeout_s", 300))
        deadline = time.monotonic() + start_timeout_s
        while not self.stop_event.is_set():
            if proc.poll() is not None:
                log.error("restarted tritonserver (pid %d) exited with status %s while starting", proc.pid, proc.returncode)
                return
            if http_ok(f"http://{self.http_url}/v2/health/ready"):
                self.restarts += 1
                update_pid_file(self.pid_file, server_restarts=self.restarts)  # for a watchdog started anew
                self.restarting = False  # after the count: /ready says 200 only with the count up to date
                log.warning("tritonserver restarted: pid %d ready %.1f s after pid %d was seen gone",
                            proc.pid, time.monotonic() - seen_gone, old)
                return
            if time.monotonic() > deadline:
                log.error("restarted tritonserver (pid %d) not ready in %.0f s; stopping it", proc.pid, start_timeout_s)
                terminate(proc.pid, 10.0, proc)
                return
            self.stop_event.wait(0.2)

    def end_orphaned_stubs(self, timeout_s: float = 5.0) -> None:
        """SIGKILL the stubs the dead server left. A stub exits by itself only once its parent
        is gone for good, and a crashed server that its starter has not reaped yet (a zombie)
        still counts as there: its stubs would hold their memory until then."""
        left = []
        for pid in self.known:
            st = process_stat(pid)
            if st is not None and st[0] == STUB_COMM and st[1] != "Z":
                try:
                    os.kill(pid, signal.SIGKILL)
                    left.append(pid)
                except ProcessLookupError:
                    pass
        if left:
            log.warning("ended %d stub processes of the dead server: %s", len(left), left)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and any(alive(pid) for pid in left):
            time.sleep(0.05)

    # ---- readiness -----------------------------------------------------------------------------
    def readiness(self) -> tuple:
        """(ready, body). Looks at /proc again, so a stub that died since the last tick counts."""
        server_ready = http_ok(f"http://{self.http_url}/v2/health/ready")
        with self._lock:
            dead = dict(self.dead)
        for model, why in self.deficits(stub_processes(self.server_pid, self.known), self.expected).items():
            dead.setdefault(model, why)
        not_ready = [m for m in P.ALL_MODELS if not http_ok(f"http://{self.http_url}/v2/models/{m}/ready")]
        log_ok, log_state = self.log_probe.state() if self.log_probe is not None else (True, None)
        ready = server_ready and not dead and not not_ready and not self.restarting and log_ok
        return ready, {
            "ready": ready,
            "server_ready": server_ready,
            "server_restarting": self.restarting,
            "server_restarts": self.restarts,
            "dead": sorted(dead),
            "why": dead,
            "models_not_ready": not_ready,
            "event_log": log_state,
        }

    def liveness(self) -> tuple:
        live = self.server_alive() and self.server_live()
        return live, {"live": live, "server_pid": self.server_pid}

    def serve(self, address: str, port: int) -> ThreadingHTTPServer:
        watchdog = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 - the http.server name
                path = self.path.split("?", 1)[0].rstrip("/")
                if path == "/ready":
                    ok, body = watchdog.readiness()
                elif path == "/live":
                    ok, body = watchdog.liveness()
                else:
                    self.send_error(404)
                    return
                data = json.dumps(body).encode()
                self.send_response(200 if ok else 503)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):  # no line per health check
                pass

        httpd = ThreadingHTTPServer((address, port), Handler)
        httpd.daemon_threads = True
        threading.Thread(target=httpd.serve_forever, daemon=True, name="readiness").start()
        return httpd


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m backend_src.serving.watchdog", description=__doc__.split("\n\n")[0])
    ap.add_argument("--server-pid", type=int, required=True)
    ap.add_argument("--grpc-url", required=True)
    ap.add_argument("--http-url", required=True)
    ap.add_argument("--address", default="127.0.0.1", help="address of the readiness endpoint")
    ap.add_argument("--ready-port", type=int, required=True)
    ap.add_argument("--interval", type=float, default=0.5, help="seconds between stub checks")
    ap.add_argument("--probe-interval", type=float, default=30.0, help="seconds between inference probes (0: none)")
    ap.add_argument("--log-file", default=None)
    ap.add_argument("--restart-from", default=None,
                    help="launch file (JSON: argv, env, cwd, log_file) to start tritonserver again when it is gone")
    ap.add_argument("--pid-file", default=None,
                    help="pid file whose pid a restart updates (needed with --restart-from); read for the server's pid")
    ap.add_argument("--keep", action="store_true", help="run the watchdog as a child and start it again when it dies")
    ap.add_argument("--model-repository", default=None,
                    help="the server's repository: its event log, when neither GENREC_EVENT_LOG nor the config names one")
    ap.add_argument("--log-probe-interval", type=float, default=2.0,
                    help="seconds between probes of the event log for /ready (0: none)")
    argv = sys.argv[1:] if argv is None else list(argv)
    a = ap.parse_args(argv)
    if a.restart_from and not a.pid_file:
        ap.error("--restart-from needs --pid-file")
    logging.basicConfig(
        filename=a.log_file, level=logging.INFO,
        format=f"%(asctime)s {'keeper' if a.keep else 'watchdog'}[%(process)d] %(levelname)s %(message)s",
    )
    if a.keep:
        return keep([arg for arg in argv if arg != "--keep"])
    # a watchdog started again by its keeper: the server may have been restarted since
    info = (read_pid_file(a.pid_file) or {}) if a.pid_file else {}
    server_pid = int(info.get("pid") or a.server_pid)
    key = os.environ.get(ADMIN_KEY_ENV) or None
    wd = Watchdog(server_pid, a.grpc_url, a.http_url, key, a.interval, a.probe_interval,
                  restart_from=a.restart_from, pid_file=a.pid_file)
    wd.restarts = int(info.get("server_restarts", 0))
    if wd.admin_key is None:
        log.info("no admin key: reloads work only on a server that leaves model loading open")
    signal.signal(signal.SIGTERM, lambda *_: wd.stop_event.set())
    signal.signal(signal.SIGINT, lambda *_: wd.stop_event.set())
    if a.log_probe_interval > 0 and (a.model_repository or os.environ.get(EVENT_LOG_ENV)):
        url: list = []  # resolved once, then kept

        def log_url():
            if not url:
                found = served_event_log(a.grpc_url, a.model_repository or ".")
                if found is not None:
                    url.append(found)
            return url[0] if url else None

        wd.log_probe = LogProbe(log_url, a.log_probe_interval).start()
    httpd = wd.serve(a.address, a.ready_port)
    log.info("watching tritonserver pid %d (gRPC %s); readiness on http://%s:%d/ready; %s",
             server_pid, a.grpc_url, a.address, a.ready_port,
             "restarts it when it crashes" if a.restart_from else "stops when it is gone")
    failed = []

    def run() -> None:
        try:
            wd.run()
        except BaseException:  # noqa: BLE001 - end the process, so that its keeper starts it anew
            log.exception("the watchdog failed")
            failed.append(True)
            wd.stop_event.set()

    # the checks run beside the main thread, so a signal ends the process even during a reload
    threading.Thread(target=run, daemon=True, name="stub-watchdog").start()
    while not wd.stop_event.wait(0.5):
        pass
    if wd._spawn_lock.acquire(timeout=10):  # a restart in progress has written its pid file
        wd._spawn_lock.release()
    httpd.server_close()  # the serving thread goes with the process
    log.info("stopped" if not failed else "exits after a failure")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
