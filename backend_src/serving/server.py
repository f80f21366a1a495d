"""Start, watch and stop a Triton Inference Server process.

The server binary, its Python backend and local cache come inside the ``nvidia-pytriton``
wheel (``pytriton/tritonserver``); no container is needed. Before the first start the
Python-backend stub for this interpreter's version is copied next to the backend, and the
interpreter's ``bin`` directory goes first on PATH so the stub finds this environment's
packages (torch, numpy).

``TritonServer`` is one server process and, optionally, its stub watchdog
(``serving/watchdog.py``) under a keeper process. The command line that operators use
(``python -m backend_src.serving.server start|stop|status|heal``) is in ``server_cli.py``; the
admin key in ``access.py``; pid files and process control in ``processes.py``; stub health and
reloading in ``health.py``.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from backend_src.serving.access import (
    ADMIN_KEY_DIGEST_ENV, ADMIN_KEY_ENV, check_admin_key, key_digest, restricted_api_flags,
)
from backend_src.serving.event_log import EVENT_LOG_ENV, checkpoint, sqlite_path
from backend_src.serving.log_probe import served_event_log
from backend_src.serving.processes import (
    free_port, http_ok, is_process, launch, launch_file, read_pid_file, terminate, update_pid_file, write_launch_file,
)
from backend_src.serving.stub_processes import end_group

DEFAULT_PID_FILE = Path("runs") / "tritonserver.pid"
DEFAULT_LOG_FILE = Path("runs") / "tritonserver.log"
DEFAULT_ADDRESS = "127.0.0.1"
DEFAULT_READY_PORT = 8003
# Seconds tritonserver waits at shutdown, for in-flight work and then for its models to unload
# (one budget; unloading the three stages took ~2.5 s here). An open sequence (a user session)
# counts as in flight until it ends, so with sessions open the server always waits the whole
# timeout and the models do not unload gracefully; sessions do not depend on that.
DEFAULT_EXIT_TIMEOUT_S = 5

# What a process's command line holds, to tell ours from a process that took a pid since
SERVER_MARKER = "tritonserver"
WATCHDOG_MARKER = "serving.watchdog"

# Process settings for CPU inference, read by the Python stubs at start: idle OpenMP threads
# sleep instead of spinning (on a shared host a spinning thread takes its busy sibling's core),
# and glibc keeps freed memory for reuse instead of unmapping it, so the large per-request
# tensors do not pay first-touch page faults on every call (~10-20% of decode time here).
CPU_RUNTIME_ENV = {
    "OMP_WAIT_POLICY": "PASSIVE",
    "MALLOC_MMAP_THRESHOLD_": str(32 << 20),
    "MALLOC_TRIM_THRESHOLD_": str(4 << 30),
    "MALLOC_TOP_PAD_": str(256 << 20),
}

# Runs tritonserver with SIGCHLD ignored (an ignored signal stays ignored across exec), so the
# kernel reaps its children itself. Without it a stub that dies while a request is in it stays a
# zombie until the server stops: the server keeps the dead instance around and never waits for
# it, even after the model is reloaded. Side effect: the stubs inherit it too, so model code
# that starts subprocesses gets exit status 0 from them.
_EXEC_REAPING_CHILDREN = (
    "import os, signal, sys; signal.signal(signal.SIGCHLD, signal.SIG_IGN); os.execv(sys.argv[1], sys.argv[1:])"
)


def triton_home() -> Path:
    """The `tritonserver` folder of the installed pytriton wheel."""
    import importlib.util

    spec = importlib.util.find_spec("pytriton")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the nvidia-pytriton package is not installed in this environment")
    home = Path(list(spec.submodule_search_locations)[0]) / "tritonserver"
    if not (home / "bin" / "tritonserver").exists():
        raise RuntimeError(f"no tritonserver binary in {home}")
    return home


def install_python_stub(home: Path) -> Path:
    """Copy the Python-backend stub of this interpreter's version into backends/python
    (once; the backend looks for it there)."""
    import shutil

    ver = f"{sys.version_info.major}.{sys.version_info.minor}"
    src = home / "python_backend_stubs" / ver / "triton_python_backend_stub"
    dst = home / "backends" / "python" / "triton_python_backend_stub"
    if not src.exists():
        raise RuntimeError(f"the wheel has no Python-backend stub for Python {ver} ({src})")
    if not dst.exists() or dst.stat().st_size != src.stat().st_size:
        tmp = dst.with_suffix(".tmp")
        shutil.copy2(src, tmp)
        os.chmod(tmp, 0o755)
        os.replace(tmp, dst)
    return dst


def clean_up_after_stop(servers: list, pid_file, event_log_file) -> None:
    """What stopped servers leave: the stubs a server killed after its grace left behind (its process
    group), its pid and launch files, and a SQLite log's WAL (checkpointed: the main file then holds
    every event)."""
    for pid in servers:
        end_group(pid)
    if pid_file:
        Path(pid_file).unlink(missing_ok=True)
        launch_file(pid_file).unlink(missing_ok=True)
    checkpoint(event_log_file)


class TritonServer:
    """One tritonserver process (and, with `watchdog=True`, its stub watchdog, under a keeper process
    that starts the watchdog again when it dies).
    Use as a context manager, or call start()/stop().

    `admin_key`: None leaves every API open (for tests and tools that own the server); with a
    key, model repository, shared memory, trace and logging calls need it (the CLI always sets
    one). `address`: where gRPC, HTTP and metrics listen. `reap_children`: run the server so
    that dead stub processes do not stay zombies. `pid_file`: JSON with the server's pid and
    ports, written once it is ready and kept current. `restart` (needs the watchdog and a
    pid file): the watchdog starts the server again, with the same command and environment,
    when it exits while the watchdog runs (a crash); it writes the new pid to the pid file."""

    def __init__(
        self,
        model_repository,
        grpc_port: int = 8001,
        http_port: int = 8000,
        metrics_port: int = 8002,
        log_file=None,
        load_models: str | None = "*",  # --load-model; None loads nothing at start
        control_mode: str = "explicit",
        extra_args: tuple = (),
        log_verbose: int = 0,
        exit_timeout_s: int = DEFAULT_EXIT_TIMEOUT_S,
        address: str = DEFAULT_ADDRESS,
        admin_key: str | None = None,
        watchdog: bool = False,
        ready_port: int | None = None,
        event_log: str | None = None,
        reap_children: bool = True,
        watchdog_interval_s: float = 0.5,
        watchdog_probe_interval_s: float = 30.0,
        pid_file=None,
        restart: bool = False,
    ):
        if restart and not (watchdog and pid_file):
            raise ValueError("restart needs the watchdog and a pid file")
        self.model_repository = Path(model_repository).resolve()
        self.grpc_port, self.http_port, self.metrics_port = int(grpc_port), int(http_port), int(metrics_port)
        self.log_file = Path(log_file) if log_file else self.model_repository.parent / "runs" / "tritonserver.log"
        self.load_models = load_models
        self.control_mode = control_mode
        self.extra_args = tuple(extra_args)
        self.log_verbose = log_verbose
        self.exit_timeout_s = int(exit_timeout_s)
        self.address = address
        self.admin_key = check_admin_key(admin_key, "admin_key") if admin_key else None
        self.watchdog = watchdog
        self.ready_port = int(ready_port) if ready_port else (free_port() if watchdog else None)
        self.event_log = event_log
        self.reap_children = reap_children
        self.watchdog_interval_s = watchdog_interval_s
        self.watchdog_probe_interval_s = watchdog_probe_interval_s
        self.pid_file = Path(pid_file) if pid_file else None
        self.restart = restart
        self.process: subprocess.Popen | None = None
        self.pid: int | None = None
        self.watchdog_process: subprocess.Popen | None = None
        self.watchdog_pid: int | None = None
        self.event_log_file: str | None = None  # a SQLite log's file, checkpointed once the server has stopped
        self._log_start = 0  # where this start's lines begin in the log file

    # ---- command ------------------------------------------------------------------------
    def command(self) -> list:
        home = triton_home()
        cmd = [
            str(home / "bin" / "tritonserver"),
            f"--model-repository={self.model_repository}",
            f"--backend-directory={home / 'backends'}",
            f"--cache-directory={home / 'caches'}",
            f"--grpc-address={self.address}",
            f"--http-address={self.address}",
            f"--metrics-address={self.address}",
            f"--grpc-port={self.grpc_port}",
            f"--http-port={self.http_port}",
            f"--metrics-port={self.metrics_port}",
            "--allow-metrics=true",
            f"--log-verbose={self.log_verbose}",
            f"--model-control-mode={self.control_mode}",
            f"--exit-timeout-secs={self.exit_timeout_s}",
        ]
        if self.admin_key:
            cmd += restricted_api_flags(self.admin_key)
        if self.control_mode == "explicit" and self.load_models:
            cmd.append(f"--load-model={self.load_models}")
        cmd += list(self.extra_args)
        if self.reap_children:
            cmd = [sys.executable, "-S", "-c", _EXEC_REAPING_CHILDREN] + cmd
        return cmd

    def environment(self) -> dict:
        env = dict(os.environ)
        for key, value in CPU_RUNTIME_ENV.items():  # an explicit setting in the environment wins
            env.setdefault(key, value)
        venv_bin = str(Path(sys.executable).parent)
        env["PATH"] = venv_bin + os.pathsep + env.get("PATH", "")
        env.pop(ADMIN_KEY_ENV, None)  # the models have no use for it: the catalog checks a change's key by its digest
        env.pop(ADMIN_KEY_DIGEST_ENV, None)
        if self.admin_key:
            env[ADMIN_KEY_DIGEST_ENV] = key_digest(self.admin_key)
        if self.event_log:
            env[EVENT_LOG_ENV] = self.event_log
        return env

    def watchdog_command(self) -> list:
        return [
            sys.executable, "-m", "backend_src.serving.watchdog",
            f"--server-pid={self.pid}",
            f"--grpc-url={self.grpc_url}",
            f"--http-url={self.http_url}",
            f"--address={self.address}",
            f"--ready-port={self.ready_port}",
            f"--log-file={self.watchdog_log_file}",
            f"--interval={self.watchdog_interval_s}",
            f"--probe-interval={self.watchdog_probe_interval_s}",
            f"--model-repository={self.model_repository}",
            "--keep",
        ] + ([f"--restart-from={launch_file(self.pid_file)}", f"--pid-file={self.pid_file}"] if self.restart else [])

    @property
    def watchdog_log_file(self) -> Path:
        return self.log_file.parent / "watchdog.log"

    # ---- lifecycle ----------------------------------------------------------------------
    def info(self) -> dict:
        """What the pid file says of the server."""
        return {
            "pid": self.pid, "watchdog_pid": self.watchdog_pid, "address": self.address, "grpc": self.grpc_port,
            "http": self.http_port, "metrics": self.metrics_port, "ready_port": self.ready_port,
            "log": str(self.log_file), "restart": self.restart, "event_log_file": self.event_log_file,
        }

    def start(self, timeout_s: float = 120.0) -> "TritonServer":
        install_python_stub(triton_home())
        self.log_file.parent.mkdir(parents=True, exist_ok=True)
        argv, env = self.command(), self.environment()
        self._log_start = self.log_file.stat().st_size if self.log_file.exists() else 0
        self.process = launch(argv, env, self.log_file)
        self.pid = self.process.pid  # the exec keeps the pid: this is tritonserver's
        self.wait_ready(timeout_s)
        url = self.event_log or served_event_log(self.grpc_url, self.model_repository)
        path = sqlite_path(url)
        self.event_log_file = str(Path(path).resolve()) if path else None
        if self.pid_file:
            self.pid_file.parent.mkdir(parents=True, exist_ok=True)
            update_pid_file(self.pid_file, **self.info())
        if self.restart:
            write_launch_file(self.pid_file, {"argv": argv, "env": env, "cwd": os.getcwd(),
                                              "log_file": str(self.log_file), "start_timeout_s": timeout_s})
        if self.watchdog:
            self.start_watchdog()
            if self.pid_file:
                update_pid_file(self.pid_file, watchdog_pid=self.watchdog_pid)
        return self

    def start_watchdog(self, timeout_s: float = 30.0) -> None:
        """The watchdog runs detached, so it outlives the command that started it."""
        env = dict(os.environ)
        root = str(Path(__file__).resolve().parents[2])
        env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        env.pop(ADMIN_KEY_ENV, None)
        if self.event_log_file or self.event_log:  # the log its probe checks: the server's (a file's path made absolute)
            env[EVENT_LOG_ENV] = self.event_log_file or self.event_log
        if self.admin_key:  # in its environment, not on its command line
            env[ADMIN_KEY_ENV] = self.admin_key
        log = open(self.watchdog_log_file, "ab")
        try:
            self.watchdog_process = subprocess.Popen(
                self.watchdog_command(), stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                env=env, cwd=root, start_new_session=True,
            )
        finally:
            log.close()
        self.watchdog_pid = self.watchdog_process.pid
        deadline = time.monotonic() + timeout_s
        while not http_ok(f"{self.ready_url}/live"):
            if self.watchdog_process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the stub watchdog did not start; see {self.watchdog_log_file}")
            time.sleep(0.1)

    def wait_ready(self, timeout_s: float = 120.0) -> None:
        """Wait until the server (and every model it loads at start) is ready."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process is not None and self.process.poll() is not None:
                raise RuntimeError(
                    f"tritonserver exited with code {self.process.returncode} while starting{self.load_failures()}; "
                    f"log tail:\n{self.log_tail()}"
                )
            if self.ready():
                return
            time.sleep(0.2)
        raise TimeoutError(f"tritonserver not ready after {timeout_s:g} s; log tail:\n{self.log_tail()}")

    def load_failures(self) -> str:
        """The models that failed to load in this start, each with its reason (a stage's own message,
        e.g. a damaged event log and how to recover), as lines to put before the log's tail."""
        try:
            with open(self.log_file, "rb") as f:
                f.seek(self._log_start)
                text = f.read().decode(errors="replace")
        except OSError:
            return ""
        found = [line[line.index("failed to load '"):].rstrip('"') for line in text.splitlines()
                 if "model_lifecycle" in line and "failed to load '" in line]
        return "".join(f"\n  {x}" for x in dict.fromkeys(found))

    def ready(self) -> bool:
        return http_ok(f"http://{self.http_url}/v2/health/ready")

    def live(self) -> bool:
        return http_ok(f"http://{self.http_url}/v2/health/live")

    def stop(self, grace_s: float | None = None) -> int | None:
        """Stop the watchdog first (so it does not heal a stopping server), then SIGTERM the
        server and SIGKILL it only if it is still there `grace_s` later (default: its exit
        timeout + 10 s). Returns the server's exit code (-9 when it had to be killed)."""
        self.stop_watchdog()
        grace_s = self.exit_timeout_s + 10.0 if grace_s is None else grace_s
        code = None
        if self.process is not None:
            code = terminate(self.process.pid, grace_s, self.process)[0]
        elif self.pid is not None:
            code = terminate(self.pid, grace_s)[0]
        servers = [self.pid] if self.pid is not None else []
        if self.pid_file:
            current = (read_pid_file(self.pid_file) or {}).get("pid")
            if current and current != self.pid and is_process(int(current), SERVER_MARKER):
                code = terminate(int(current), grace_s)[0]  # the watchdog restarted it
            servers += [int(current)] if current else []
        clean_up_after_stop(servers, self.pid_file, self.event_log_file)
        return code

    def stop_watchdog(self) -> None:
        if self.watchdog_process is not None:
            terminate(self.watchdog_process.pid, 5.0, self.watchdog_process)
        elif self.watchdog_pid is not None and is_process(self.watchdog_pid, WATCHDOG_MARKER):
            terminate(self.watchdog_pid, 5.0)

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_file.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    @property
    def local_host(self) -> str:
        """Where a client on this machine reaches the server."""
        return "127.0.0.1" if self.address in ("0.0.0.0", "127.0.0.1", "") else self.address

    @property
    def grpc_url(self) -> str:
        return f"{self.local_host}:{self.grpc_port}"

    @property
    def http_url(self) -> str:
        return f"{self.local_host}:{self.http_port}"

    @property
    def ready_url(self) -> str | None:
        return f"http://{self.local_host}:{self.ready_port}" if self.ready_port else None

    def __enter__(self) -> "TritonServer":
        return self.start() if self.process is None else self

    def __exit__(self, *exc) -> None:
        self.stop()


if __name__ == "__main__":  # the operators' command: python -m backend_src.serving.server start|stop|status|heal
    from backend_src.serving.server_cli import main

    sys.exit(main())
