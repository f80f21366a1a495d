"""Start, watch and stop a Triton Inference Server process.

The server binary, its Python backend and local cache come inside the ``nvidia-pytriton``
wheel (``pytriton/tritonserver``); no container is needed. Before the first start the
Python-backend stub for this interpreter's version is copied next to the backend, and the
interpreter's ``bin`` directory goes first on PATH so the stub finds this environment's
packages (torch, numpy).

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
``stop`` stops the watchdog, then the server.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

DEFAULT_PID_FILE = Path("runs") / "tritonserver.pid"
DEFAULT_LOG_FILE = Path("runs") / "tritonserver.log"
DEFAULT_ADMIN_KEY_FILE = DEFAULT_PID_FILE.parent / "admin.key"
DEFAULT_ADDRESS = "127.0.0.1"
DEFAULT_READY_PORT = 8003
# Seconds tritonserver waits at shutdown, for in-flight work and then for its models to unload
# (one budget; unloading the three stages took ~2.5 s here). An open sequence (a user session)
# counts as in flight until it ends, so with sessions open the server always waits the whole
# timeout and the models do not unload gracefully; sessions do not depend on that.
DEFAULT_EXIT_TIMEOUT_S = 5

ADMIN_KEY_ENV = "GENREC_ADMIN_KEY"
EVENT_LOG_ENV = "GENREC_EVENT_LOG"
ADMIN_HEADER = "genrec-admin-key"
# Triton checks a restricted gRPC protocol's header under this prefix (an HTTP API's header as
# it is named); the server says so when it refuses a call.
GRPC_ADMIN_HEADER = "triton-grpc-protocol-" + ADMIN_HEADER
RESTRICTED_APIS = ("model-repository", "shared-memory", "trace", "logging")
_KEY_CHARS = re.compile(r"^[A-Za-z0-9._~-]{16,256}$")  # safe inside a flag and a header

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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --------------------------------------------------------------------------------------------
# Admin key
# --------------------------------------------------------------------------------------------
def _check_key(key: str, where: str) -> str:
    key = key.strip()
    if not _KEY_CHARS.match(key):
        raise ValueError(f"admin key from {where}: 16-256 characters of A-Z a-z 0-9 . _ ~ - expected")
    return key


def read_admin_key(path=None) -> str | None:
    """The admin key from the file `path` when one is named; else from GENREC_ADMIN_KEY, else
    from runs/admin.key. None when there is none."""
    if path is None and os.environ.get(ADMIN_KEY_ENV):
        return _check_key(os.environ[ADMIN_KEY_ENV], ADMIN_KEY_ENV)
    path = Path(path) if path else DEFAULT_ADMIN_KEY_FILE
    try:
        return _check_key(path.read_text(), str(path))
    except FileNotFoundError:
        return None


def ensure_admin_key(path) -> str:
    """The key in the file `path`, creating it (mode 0600) with a random key when it is absent."""
    key = read_admin_key(path)
    if key:
        return key
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    key = secrets.token_urlsafe(32)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:  # another start won the race: use its key
        return read_admin_key(path)
    with os.fdopen(fd, "w") as f:
        os.fchmod(f.fileno(), 0o600)
        f.write(key + "\n")
    return key


def admin_headers(key: str | None, protocol: str = "grpc") -> dict | None:
    """Request headers that carry the admin key, for tritonclient's `headers=`."""
    if not key:
        return None
    return {GRPC_ADMIN_HEADER if protocol == "grpc" else ADMIN_HEADER: key}


# --------------------------------------------------------------------------------------------
# The server
# --------------------------------------------------------------------------------------------
def launch(argv: list, env: dict, log_file, cwd=None) -> subprocess.Popen:
    """Start tritonserver in a session of its own (our signals, not the terminal's), its output
    appended to `log_file`. The one way the server is started, first and after a crash."""
    with open(log_file, "ab") as log:
        return subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env,
                                cwd=cwd, start_new_session=True)


def read_pid_file(pid_file) -> dict | None:
    try:
        return json.loads(Path(pid_file).read_text())
    except (OSError, ValueError):
        return None


def update_pid_file(pid_file, **fields) -> None:
    """Set fields of the pid file's JSON, atomically (readers see the old or the new file)."""
    pid_file = Path(pid_file)
    info = {**(read_pid_file(pid_file) or {}), **fields}
    tmp = pid_file.with_name(f".{pid_file.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(info))
    os.replace(tmp, pid_file)


def launch_file(pid_file) -> Path:
    """Where the command and environment that started the server are kept, for a restart."""
    return Path(pid_file).with_suffix(".launch.json")


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
        self.admin_key = _check_key(admin_key, "admin_key") if admin_key else None
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
            # Triton takes the key only on its command line (so local users can read it in the
            # process list); the threat kept out is anyone who can reach the ports.
            apis = ",".join(RESTRICTED_APIS)
            cmd += [
                f"--grpc-restricted-protocol={apis}:{ADMIN_HEADER}={self.admin_key}",
                f"--http-restricted-api={apis}:{ADMIN_HEADER}={self.admin_key}",
            ]
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
        env.pop(ADMIN_KEY_ENV, None)  # the models have no use for it
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
            "log": str(self.log_file), "restart": self.restart,
        }

    def start(self, timeout_s: float = 120.0) -> "TritonServer":
        install_python_stub(triton_home())
        self.log_file.parent.mkdir(parents=True, exist_ok=True)
        argv, env = self.command(), self.environment()
        self.process = launch(argv, env, self.log_file)
        self.pid = self.process.pid  # the exec keeps the pid: this is tritonserver's
        self.wait_ready(timeout_s)
        if self.pid_file:
            self.pid_file.parent.mkdir(parents=True, exist_ok=True)
            update_pid_file(self.pid_file, **self.info())
        if self.restart:
            # the command line holds the admin key (as the process list does): owner-only
            spec = {"argv": argv, "env": env, "cwd": os.getcwd(), "log_file": str(self.log_file),
                    "start_timeout_s": timeout_s}
            fd = os.open(launch_file(self.pid_file), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                os.fchmod(f.fileno(), 0o600)
                json.dump(spec, f)
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
        while not _http_ok(f"{self.ready_url}/live"):
            if self.watchdog_process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the stub watchdog did not start; see {self.watchdog_log_file}")
            time.sleep(0.1)

    def wait_ready(self, timeout_s: float = 120.0) -> None:
        """Wait until the server (and every model it loads at start) is ready."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process is not None and self.process.poll() is not None:
                raise RuntimeError(
                    f"tritonserver exited with code {self.process.returncode} while starting; log tail:\n{self.log_tail()}"
                )
            if self.ready():
                return
            time.sleep(0.2)
        raise TimeoutError(f"tritonserver not ready after {timeout_s:g} s; log tail:\n{self.log_tail()}")

    def ready(self) -> bool:
        return _http_ok(f"http://{self.http_url}/v2/health/ready")

    def live(self) -> bool:
        return _http_ok(f"http://{self.http_url}/v2/health/live")

    def stop(self, grace_s: float | None = None) -> int | None:
        """Stop the watchdog first (so it does not heal a stopping server), then SIGTERM the
        server and SIGKILL it only if it is still there `grace_s` later (default: its exit
        timeout + 10 s). Returns the server's exit code (-9 when it had to be killed)."""
        self.stop_watchdog()
        grace_s = self.exit_timeout_s + 10.0 if grace_s is None else grace_s
        code = None
        if self.process is not None:
            code = _terminate(self.process.pid, grace_s, self.process)[0]
        elif self.pid is not None:
            code = _terminate(self.pid, grace_s)[0]
        if self.pid_file:
            current = (read_pid_file(self.pid_file) or {}).get("pid")
            if current and current != self.pid and _is_process(int(current), "tritonserver"):
                code = _terminate(int(current), grace_s)[0]  # the watchdog restarted it
            self.pid_file.unlink(missing_ok=True)
            launch_file(self.pid_file).unlink(missing_ok=True)
        return code

    def stop_watchdog(self) -> None:
        if self.watchdog_process is not None:
            _terminate(self.watchdog_process.pid, 5.0, self.watchdog_process)
        elif self.watchdog_pid is not None and _is_process(self.watchdog_pid, "serving.watchdog"):
            _terminate(self.watchdog_pid, 5.0)

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


def _http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status == 200
    except (urllib.error.URLError, ConnectionError, OSError):
        return False


def _http_json(url: str, timeout: float = 3.0) -> tuple:
    """(status, parsed JSON body) of a GET; (None, error text) when nothing answered."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, json.loads(r.read() or b"null")
    except urllib.error.HTTPError as e:
        try:
            return e.code, json.loads(e.read() or b"null")
        except ValueError:
            return e.code, None
    except (urllib.error.URLError, ConnectionError, OSError, ValueError) as e:
        return None, str(e)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # a zombie (exited, not yet reaped by its parent) counts as gone
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(") ", 1)[-1][:1] != "Z"
    except OSError:
        return True


def _is_process(pid: int, marker: str) -> bool:
    """Whether pid is alive and its command line contains `marker` (a pid read from a file
    may since belong to another process)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return _alive(pid) and marker.encode() in f.read()
    except OSError:
        return False


def _terminate(pid: int, grace_s: float, process: subprocess.Popen | None = None) -> tuple:
    """SIGTERM, then SIGKILL after `grace_s`. Returns (exit code, killed): the code is known only
    for a child of ours (else 0 after SIGTERM, -9 after SIGKILL)."""
    if process is not None and process.poll() is not None:  # already reaped: its pid may be reused
        return process.returncode, False
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return (process.wait() if process is not None else None), False
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        if process is not None:
            if process.poll() is not None:
                return process.returncode, False
        elif not _alive(pid):
            return 0, False
        time.sleep(0.05)
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    if process is not None:
        return process.wait(), True
    while _alive(pid) and time.monotonic() < deadline + 5:
        time.sleep(0.05)
    return -signal.SIGKILL, True


# --------------------------------------------------------------------------------------------
# Stub health: a Python model whose stub process died stays "ready" but fails every request
# ("Stub process ... is not healthy") until it is reloaded. The server of this release does not
# restart it. One way to kill it is a request whose shape's element count overflows
# (e.g. INT64 [1, 2**62] with an empty payload): the stub dies while unpacking the request,
# before model code can look at the shape, so only a reload brings the model back.
# The watchdog (serving/watchdog.py) sees the stub process go and calls reload_model; the
# inference probe below is the slower way, for a stub that is there but does not answer.
# --------------------------------------------------------------------------------------------
def _probe_inputs(model: str, client_module):
    """A request each model refuses by its own validation (INVALID_ARG): an answer proves the
    stub is alive, and nothing changes (no session is started)."""
    import numpy as np

    from genrec_contract import protocol as P

    def tensor(spec, arr):
        t = client_module.InferInput(spec.name, list(arr.shape), spec.dtype)
        t.set_data_from_numpy(arr)
        return t

    if model == P.ENCODER:  # START with an empty history
        return [
            tensor(P.ITEM_IDS, np.zeros((1, 0), dtype=object)),
            tensor(P.ACTIONS, np.zeros((1, 0), np.int64)),
            tensor(P.TIMESTAMPS, np.zeros((1, 0), np.int64)),
        ], {"sequence_id": "stub-health-probe", "sequence_start": True, "sequence_end": True}
    if model in (P.DECODER, P.RANKER):
        return None, None  # needs the model's dims: built by the caller from its metadata
    raise KeyError(model)


def _metadata_probe(client, model: str, client_module):
    """Probe inputs for a stateless stage from its metadata: empty history / no candidates,
    TOP_K = 0 where the model has it (refused by the model itself)."""
    import numpy as np

    from genrec_contract import protocol as P

    meta = client.get_model_metadata(model)
    inputs = []
    for t in meta.inputs:
        spec = P.CONTRACTS[model].input(t.name)
        if spec.optional and t.name != P.TOP_K.name:
            continue
        shape = [1] + [0 if d < 0 else d for d in list(t.shape)[1:]]
        arr = np.zeros(shape, dtype=spec.numpy_dtype)
        if t.name == P.TOP_K.name:
            arr = np.zeros((1, 1), np.int32)
        x = client_module.InferInput(t.name, shape, t.datatype)
        x.set_data_from_numpy(arr)
        inputs.append(x)
    return inputs


def unhealthy_models(grpc_url: str, models=None) -> list:
    """The Python models whose stub no longer answers (by an inference probe).

    A probe that reaches a dead stub leaves that instance stuck in the server (measured with
    2.51: the old instance is never released after the reload, so its zombie stays and the
    server's shutdown waits its whole exit timeout); the watchdog's process check comes first."""
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    from genrec_contract import protocol as P

    bad = []
    client = grpcclient.InferenceServerClient(grpc_url)
    try:
        for model in P.PYTHON_MODELS if models is None else models:
            if not client.is_model_ready(model):
                continue
            inputs, kwargs = _probe_inputs(model, grpcclient)
            if inputs is None:
                inputs, kwargs = _metadata_probe(client, model, grpcclient), {}
            try:
                client.infer(model, inputs, client_timeout=30, **kwargs)
            except InferenceServerException as e:
                if "not healthy" in (e.message() or ""):
                    bad.append(model)
    finally:
        client.close()
    return bad


def reload_model(client, model: str, admin_key: str | None = None, timeout_s: float = 300.0) -> None:
    """Replace every instance of `model` with a fresh one (same version, same config); the
    ensemble that uses it is reloaded with it. A reloaded history_encoder has lost its
    sessions: their next request gets a clear error."""
    # load_model of an unchanged model keeps the (dead) instance: its own config plus a fresh
    # parameter forces a new instance, which replaces the dead one
    config = client.get_model_config(model, as_json=True)["config"]
    config.setdefault("parameters", {})["reload_nonce"] = {"string_value": str(time.time_ns())}
    client.load_model(model, config=json.dumps(config), headers=admin_headers(admin_key), client_timeout=timeout_s)


def heal(grpc_url: str, admin_key: str | None = None, models=None) -> list:
    """Reload the given Python models, or every one whose stub no longer answers a probe (and
    the ensemble). Returns their names."""
    import tritonclient.grpc as grpcclient

    bad = unhealthy_models(grpc_url) if models is None else list(models)
    if bad:
        client = grpcclient.InferenceServerClient(grpc_url)
        try:
            for model in bad:
                reload_model(client, model, admin_key)
        finally:
            client.close()
    return bad


# --------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------
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
        if info and _is_process(int(info["pid"]), "tritonserver"):
            wd_pid = info.get("watchdog_pid")
            if not info.get("ready_port") or (wd_pid and _is_process(int(wd_pid), "serving.watchdog")):
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
        alive = _is_process(pid, "tritonserver")
        ready = alive and _http_ok(f"http://{host}:{info['http']}/v2/health/ready")
        out = {**info, "alive": alive, "ready": ready}
        if wd_pid:
            status, body = _http_json(f"http://{host}:{info['ready_port']}/ready")
            wd_alive = _is_process(int(wd_pid), "serving.watchdog")
            out["watchdog"] = {"alive": wd_alive, "ready_status": status, "ready": body}
            ready = ready and status == 200
        print(json.dumps(out))
        return 0 if ready else 3
    # stop: the watchdog first, so it neither reloads models of a stopping server nor restarts it
    if wd_pid and _is_process(int(wd_pid), "serving.watchdog"):
        _terminate(int(wd_pid), grace_s=5.0)
    pid = int((read_pid_file(pid_file) or info)["pid"])  # a restart may have changed it meanwhile
    t0 = time.monotonic()
    if _is_process(pid, "tritonserver"):
        code, killed = _terminate(pid, grace_s=a.exit_timeout + 10.0)
        how = "SIGKILL (did not exit after SIGTERM)" if killed else "SIGTERM"
        print(f"stopped pid {pid} by {how} in {time.monotonic() - t0:.1f} s")
    else:
        print(f"pid {pid} was not running")
    pid_file.unlink(missing_ok=True)
    launch_file(pid_file).unlink(missing_ok=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
