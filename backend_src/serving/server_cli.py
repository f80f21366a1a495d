"""Start, watch and stop a Triton Inference Server process.

    python -m backend_src.serving.server start --model-repository model_repository
    python -m backend_src.serving.server status
    python -m backend_src.serving.server stop
    python -m backend_src.serving.server heal     # reload models whose stub process died

``start`` binds gRPC, HTTP and metrics to 127.0.0.1 (``--address`` to change), leaves
inference, health, metadata, model config and statistics open, and asks for the admin key
on model loading/unloading, shared memory, trace and logging. The key comes from
GENREC_ADMIN_KEY or a key file (default ``admin.key`` beside the pid file, created with mode
0600 at the first start). ``start`` also runs the stub watchdog (``serving/watchdog.py``) as a
process of its own: it reloads a model whose Python stub died and serves ``GET /ready`` and
``GET /live`` on ``--ready-port``, and starts tritonserver again, the same way, when it exits
by any other way than ``stop`` (a crash); a keeper process starts the watchdog itself again
when it dies. ``start`` on a running server whose watchdog is gone starts only the watchdog.
``stop`` stops the watchdog, then the server, ends what is left of the server's process group (its
stubs), and checkpoints a SQLite event log's WAL into its main file.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from backend_src.serving.access import ADMIN_KEY_ENV, ensure_admin_key, read_admin_key
from backend_src.serving.health import heal
from backend_src.serving.processes import http_json, http_ok, is_process, read_pid_file, terminate, update_pid_file
from backend_src.serving.server import (
    DEFAULT_ADDRESS, DEFAULT_EXIT_TIMEOUT_S, DEFAULT_LOG_FILE, DEFAULT_PID_FILE, DEFAULT_READY_PORT, SERVER_MARKER,
    WATCHDOG_MARKER, TritonServer, clean_up_after_stop,
)


def start_missing_watchdog(info: dict, pid_file: Path, model_repository, key_from_env: bool) -> int:
    """`start` on a running server whose watchdog is gone (its keeper was killed): start the
    watchdog again for that server, as the first `start` did."""
    if not key_from_env and not info.get("admin_key_file"):
        print(f"the server was started with its admin key in {ADMIN_KEY_ENV}: set it", file=sys.stderr)
        return 1
    try:
        key = read_admin_key() if key_from_env else read_admin_key(info["admin_key_file"])
    except (OSError, ValueError) as e:
        print(f"admin key: {e}", file=sys.stderr)
        return 1
    srv = TritonServer(
        model_repository, info["grpc"], info["http"], info["metrics"], info["log"], address=info["address"],
        admin_key=key, watchdog=True, ready_port=info["ready_port"], pid_file=pid_file,
        restart=bool(info.get("restart")),
    )
    srv.pid = int(info["pid"])
    try:
        srv.start_watchdog()
    except RuntimeError as e:
        print(str(e), file=sys.stderr)
        return 1
    update_pid_file(pid_file, watchdog_pid=srv.watchdog_pid)
    print(f"tritonserver already running (pid {srv.pid}); its watchdog was gone and runs again: pid {srv.watchdog_pid}")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m backend_src.serving.server",
        description=__doc__.split("\n\n")[0],
        epilog="Self-healing, loopback-only and key-protected by default; see the module docstring.",
    )
    ap.add_argument("action", choices=["start", "stop", "status", "heal"])
    ap.add_argument("--model-repository", default="model_repository")
    ap.add_argument("--grpc-port", type=int, default=8001)
    ap.add_argument("--http-port", type=int, default=8000)
    ap.add_argument("--metrics-port", type=int, default=8002)
    ap.add_argument("--ready-port", type=int, default=DEFAULT_READY_PORT,
                    help="port of the watchdog's GET /ready and /live")
    ap.add_argument("--address", "--bind", dest="address", default=DEFAULT_ADDRESS,
                    help="address gRPC, HTTP, metrics and /ready listen on (0.0.0.0: every interface)")
    ap.add_argument("--admin-key-file", default=None,
                    help="file with the admin key (default: admin.key beside the pid file; GENREC_ADMIN_KEY wins)")
    ap.add_argument("--no-watchdog", dest="watchdog", action="store_false",
                    help="do not run the stub watchdog (no self-healing, no /ready)")
    ap.add_argument("--no-restart", dest="restart", action="store_false",
                    help="the watchdog does not start the server again when it crashes")
    ap.add_argument("--event-log", default=None, help="put in the server's environment as GENREC_EVENT_LOG")
    ap.add_argument("--exit-timeout", type=int, default=DEFAULT_EXIT_TIMEOUT_S,
                    help="seconds the server waits for in-flight work when stopped")
    ap.add_argument("--log-file", default=str(DEFAULT_LOG_FILE))
    ap.add_argument("--pid-file", default=str(DEFAULT_PID_FILE))
    ap.add_argument("--load-model", default="*", help="model to load at start ('*' = all, '' = none)")
    ap.add_argument("--timeout", type=float, default=180.0, help="seconds to wait for readiness")
    a = ap.parse_args(argv)
    pid_file = Path(a.pid_file)
    # an explicit key file, else GENREC_ADMIN_KEY, else admin.key beside the pid file
    key_file = Path(a.admin_key_file) if a.admin_key_file else pid_file.parent / "admin.key"
    key_from_env = not a.admin_key_file and bool(os.environ.get(ADMIN_KEY_ENV))
    info = read_pid_file(pid_file)

    if a.action == "start":
        if info and is_process(int(info["pid"]), SERVER_MARKER):
            wd_pid = info.get("watchdog_pid")
            if not info.get("ready_port") or (wd_pid and is_process(int(wd_pid), WATCHDOG_MARKER)):
                print(f"already running ({pid_file})", file=sys.stderr)
                return 1
            return start_missing_watchdog(info, pid_file, a.model_repository, key_from_env)
        try:
            key = read_admin_key() if key_from_env else ensure_admin_key(key_file)
        except (OSError, ValueError) as e:
            print(f"admin key: {e}", file=sys.stderr)
            return 1
        srv = TritonServer(
            a.model_repository, a.grpc_port, a.http_port, a.metrics_port, a.log_file, load_models=a.load_model or None,
            exit_timeout_s=a.exit_timeout, address=a.address, admin_key=key, watchdog=a.watchdog,
            ready_port=a.ready_port if a.watchdog else None, event_log=a.event_log,
            pid_file=pid_file, restart=a.watchdog and a.restart,
        )
        try:
            srv.start(a.timeout)
        except Exception as e:  # noqa: BLE001 - report and clean up whatever started
            srv.stop(grace_s=5)
            print(str(e), file=sys.stderr)
            return 1
        update_pid_file(pid_file, admin_key_file=None if key_from_env else str(key_file))
        srv.process = srv.watchdog_process = None  # leave both running after this command exits
        print(
            f"tritonserver ready: pid {srv.pid}, gRPC {srv.address}:{srv.grpc_port}, HTTP :{srv.http_port}, "
            f"metrics :{srv.metrics_port}"
            + (f"; watchdog pid {srv.watchdog_pid}, {srv.ready_url}/ready" if srv.watchdog else "; no watchdog")
        )
        return 0

    host = "127.0.0.1"
    if info and info.get("address") not in (None, "0.0.0.0", "127.0.0.1", ""):
        host = info["address"]
    if a.action == "heal":  # reload Python models whose stub process died
        grpc_port = info["grpc"] if info else a.grpc_port
        bad = heal(f"{host}:{grpc_port}", read_admin_key() if key_from_env else read_admin_key(key_file))
        print("reloaded " + ", ".join(bad) if bad else "all Python model stubs answer")
        return 0
    if not info:
        print("not running (no pid file)")
        return 0 if a.action == "stop" else 3
    pid, wd_pid = int(info["pid"]), info.get("watchdog_pid")
    if a.action == "status":
        alive = is_process(pid, SERVER_MARKER)
        ready = alive and http_ok(f"http://{host}:{info['http']}/v2/health/ready")
        out = {**info, "alive": alive, "ready": ready}
        if wd_pid:
            status, body = http_json(f"http://{host}:{info['ready_port']}/ready")
            wd_alive = is_process(int(wd_pid), WATCHDOG_MARKER)
            out["watchdog"] = {"alive": wd_alive, "ready_status": status, "ready": body}
            ready = ready and status == 200
        print(json.dumps(out))
        return 0 if ready else 3
    # stop: the watchdog first, so it neither reloads models of a stopping server nor restarts it
    if wd_pid and is_process(int(wd_pid), WATCHDOG_MARKER):
        terminate(int(wd_pid), grace_s=5.0)
    pid = int((read_pid_file(pid_file) or info)["pid"])  # a restart may have changed it meanwhile
    t0 = time.monotonic()
    if is_process(pid, SERVER_MARKER):
        code, killed = terminate(pid, grace_s=a.exit_timeout + 10.0)
        how = "SIGKILL (did not exit after SIGTERM)" if killed else "SIGTERM"
        print(f"stopped pid {pid} by {how} in {time.monotonic() - t0:.1f} s")
    else:
        print(f"pid {pid} was not running")
    clean_up_after_stop([pid], pid_file, info.get("event_log_file"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
