"""Container entrypoint of a Triton replica: tritonserver in the foreground, logs on stdout.

`python -m backend_src.serving.server start` detaches the server and returns, which suits a
host but not a container (its main process must be the server's lifetime). This runs the same
command line (`TritonServer.command()`: ports, admin-key protected model control, children
reaped) and the same environment, but as a child that this process waits on:

- gRPC 8001, HTTP 8000 and metrics 8002 listen on every interface of the pod;
- the admin key comes from GENREC_ADMIN_KEY (a Secret); it is required;
- the event log comes from GENREC_EVENT_LOG (required: the model repository is mounted
  read-only, so the SQLite default beside it cannot work, and replicas must share one log);
- the stub watchdog (`backend_src/serving/watchdog.py`) runs beside the server once it is
  ready, reloading a model whose Python stub died, under a keeper process that starts it again
  if it dies; it answers the Deployment's readiness and liveness probes on 8003 (GENREC_WATCHDOG=0
  turns both off, for a pod probed on Triton's own endpoints);
- SIGTERM (the kubelet, after the preStop hook) stops the watchdog, then passes SIGTERM to
  tritonserver, which finishes in-flight requests for up to GENREC_EXIT_TIMEOUT_S seconds;
- the container exits with tritonserver's exit code, so a crash restarts the container.

Settings (environment): GENREC_MODEL_REPOSITORY (default /srv/genrec/model_repository),
GENREC_ADMIN_KEY, GENREC_EVENT_LOG, GENREC_EXIT_TIMEOUT_S (30), GENREC_WATCHDOG (1),
GENREC_START_TIMEOUT_S (600), GENREC_RUN_DIR (genrec/ in the temporary directory: the watchdog's log).
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

# The image puts the project root on PYTHONPATH; running this file from a checkout works too.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from backend_src.serving.access import ADMIN_KEY_ENV  # noqa: E402
from backend_src.serving.server import EVENT_LOG_ENV, TritonServer  # noqa: E402

DEFAULT_REPOSITORY = "/srv/genrec/model_repository"
PORTS = {"http": 8000, "grpc": 8001, "metrics": 8002, "watchdog": 8003}


class ConfigError(Exception):
    pass


def server_from_env(env=None) -> TritonServer:
    """The TritonServer this container runs, from its environment (nothing is started)."""
    env = os.environ if env is None else env
    key = (env.get(ADMIN_KEY_ENV) or "").strip()
    if not key:
        raise ConfigError(f"{ADMIN_KEY_ENV} is not set: mount it from a Secret")
    event_log = (env.get(EVENT_LOG_ENV) or "").strip()
    if not event_log:
        raise ConfigError(f"{EVENT_LOG_ENV} is not set: point it at the shared Redis (redis://host:6379/0)")
    run_dir = Path(env.get("GENREC_RUN_DIR") or Path(tempfile.gettempdir()) / "genrec")
    watchdog = env.get("GENREC_WATCHDOG", "1") not in ("0", "false", "no", "")
    return TritonServer(
        env.get("GENREC_MODEL_REPOSITORY", DEFAULT_REPOSITORY),
        grpc_port=PORTS["grpc"],
        http_port=PORTS["http"],
        metrics_port=PORTS["metrics"],
        log_file=run_dir / "tritonserver.log",  # only the watchdog's log goes beside it
        exit_timeout_s=int(env.get("GENREC_EXIT_TIMEOUT_S", "30")),
        address="0.0.0.0",
        admin_key=key,  # checked: 16-256 characters of A-Z a-z 0-9 . _ ~ -
        watchdog=watchdog,
        ready_port=PORTS["watchdog"] if watchdog else None,
        event_log=event_log,
    )


def main() -> int:
    try:
        srv = server_from_env()
    except (ConfigError, ValueError) as e:
        print(f"genrec entrypoint: {e}", file=sys.stderr, flush=True)
        return 2
    srv.log_file.parent.mkdir(parents=True, exist_ok=True)
    stopping = False

    def on_signal(signum, _frame):
        nonlocal stopping
        stopping = True
        if srv.watchdog_process is not None and srv.watchdog_process.poll() is None:
            srv.watchdog_process.terminate()  # first, so it does not reload models of a stopping server
        if srv.process is not None and srv.process.poll() is None:
            srv.process.send_signal(signal.SIGTERM)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)

    # stdout and stderr are inherited: the server's log is the container's log
    srv.process = subprocess.Popen(srv.command(), stdin=subprocess.DEVNULL, env=srv.environment())
    srv.pid = srv.process.pid
    if srv.watchdog:
        try:
            srv.wait_ready(float(os.environ.get("GENREC_START_TIMEOUT_S", "600")))
            if not stopping:
                srv.start_watchdog()
        except Exception as e:  # noqa: BLE001 - the server serves on; without a watchdog its liveness probe fails
            if not stopping:
                print(f"genrec entrypoint: watchdog not started: {e}", file=sys.stderr, flush=True)
    code = srv.process.wait()
    if srv.watchdog_process is not None and srv.watchdog_process.poll() is None:
        srv.watchdog_process.terminate()
        try:
            srv.watchdog_process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            srv.watchdog_process.kill()
    return code if code >= 0 else 128 - code  # killed by signal N -> 128+N, as a shell reports it


if __name__ == "__main__":
    sys.exit(main())
