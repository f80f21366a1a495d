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
"""
from __future__ import annotations

import argparse
import json
import os
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


class TritonServer:
    """One tritonserver process. Use as a context manager, or call start()/stop()."""

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
        exit_timeout_s: int = 30,
    ):
        self.model_repository = Path(model_repository).resolve()
        self.grpc_port, self.http_port, self.metrics_port = int(grpc_port), int(http_port), int(metrics_port)
        self.log_file = Path(log_file) if log_file else self.model_repository.parent / "runs" / "tritonserver.log"
        self.load_models = load_models
        self.control_mode = control_mode
        self.extra_args = tuple(extra_args)
        self.log_verbose = log_verbose
        self.exit_timeout_s = exit_timeout_s
        self.process: subprocess.Popen | None = None
        self.pid: int | None = None

    # ---- command ------------------------------------------------------------------------
    def command(self) -> list:
        home = triton_home()
        cmd = [
            str(home / "bin" / "tritonserver"),
            f"--model-repository={self.model_repository}",
            f"--backend-directory={home / 'backends'}",
            f"--cache-directory={home / 'caches'}",
            f"--grpc-port={self.grpc_port}",
            f"--http-port={self.http_port}",
            f"--metrics-port={self.metrics_port}",
            "--allow-metrics=true",
            f"--log-verbose={self.log_verbose}",
            f"--model-control-mode={self.control_mode}",
            f"--exit-timeout-secs={self.exit_timeout_s}",
        ]
        if self.control_mode == "explicit" and self.load_models:
            cmd.append(f"--load-model={self.load_models}")
        return cmd + list(self.extra_args)

    def environment(self) -> dict:
        env = dict(os.environ)
        for key, value in CPU_RUNTIME_ENV.items():  # an explicit setting in the environment wins
            env.setdefault(key, value)
        venv_bin = str(Path(sys.executable).parent)
        env["PATH"] = venv_bin + os.pathsep + env.get("PATH", "")
        return env

    # ---- lifecycle ----------------------------------------------------------------------
    def start(self, timeout_s: float = 120.0) -> "TritonServer":
        install_python_stub(triton_home())
        self.log_file.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_file, "ab")
        try:
            self.process = subprocess.Popen(
                self.command(),
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.environment(),
                start_new_session=True,  # our signals, not the terminal's
            )
        finally:
            log.close()
        self.pid = self.process.pid
        self.wait_ready(timeout_s)
        return self

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
        return _http_ok(f"http://127.0.0.1:{self.http_port}/v2/health/ready")

    def live(self) -> bool:
        return _http_ok(f"http://127.0.0.1:{self.http_port}/v2/health/live")

    def stop(self, grace_s: float = 30.0) -> int | None:
        """SIGTERM, then SIGKILL after `grace_s`. Returns the exit code."""
        if self.process is not None:
            return _terminate(self.process.pid, grace_s, self.process)
        if self.pid is not None:
            return _terminate(self.pid, grace_s)
        return None

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_file.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    @property
    def grpc_url(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def http_url(self) -> str:
        return f"127.0.0.1:{self.http_port}"

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


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # a zombie child of ours counts as gone
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[-1][:1] != "Z"
    except OSError:
        return True


def _terminate(pid: int, grace_s: float, process: subprocess.Popen | None = None) -> int | None:
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return process.wait() if process is not None else None
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        if process is not None:
            if process.poll() is not None:
                return process.returncode
        elif not _alive(pid):
            return 0
        time.sleep(0.1)
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    return process.wait() if process is not None else -signal.SIGKILL


# --------------------------------------------------------------------------------------------
# Stub health: a Python model whose stub process died stays "ready" but fails every request
# ("Stub process ... is not healthy") until it is reloaded. The server of this release does not
# restart it. One way to kill it is a request whose shape's element count overflows
# (e.g. INT64 [1, 2**62] with an empty payload): the stub dies while unpacking the request,
# before model code can look at the shape, so only a reload brings the model back.
# --------------------------------------------------------------------------------------------
def _probe_inputs(model: str, client_module):
    """A request each model refuses by its own validation (INVALID_ARG): an answer proves the
    stub is alive, and nothing changes (no session is started)."""
    import numpy as np

    from backend_src.serving import protocol as P

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

    from backend_src.serving import protocol as P

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


def unhealthy_models(grpc_url: str) -> list:
    """The Python models whose stub no longer answers."""
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    from backend_src.serving import protocol as P

    bad = []
    client = grpcclient.InferenceServerClient(grpc_url)
    try:
        for model in P.PYTHON_MODELS:
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


def heal(grpc_url: str) -> list:
    """Reload every Python model whose stub died (and the ensemble). Returns their names.
    A reloaded history_encoder has lost its sessions: their next request gets a clear error."""
    import tritonclient.grpc as grpcclient

    from backend_src.serving import protocol as P

    bad = unhealthy_models(grpc_url)
    if bad:
        client = grpcclient.InferenceServerClient(grpc_url)
        try:
            for model in bad:
                # load_model of an unchanged model keeps the (dead) instance: its own config
                # plus a fresh parameter forces a new instance, which replaces the dead one
                config = client.get_model_config(model, as_json=True)["config"]
                config.setdefault("parameters", {})["reload_nonce"] = {"string_value": str(time.time_ns())}
                client.load_model(model, config=json.dumps(config))  # the ensemble reloads with it
        finally:
            client.close()
    return bad


class StubWatchdog:
    """Probes the Python models every `interval_s` and reloads the ones whose stub died."""

    def __init__(self, grpc_url: str, interval_s: float = 10.0, log=print):
        import threading

        self.grpc_url, self.interval_s, self.log = grpc_url, interval_s, log
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="stub-watchdog")
        self.healed: list = []

    def _run(self):
        while not self._stop.wait(self.interval_s):
            try:
                bad = heal(self.grpc_url)
            except Exception as e:  # noqa: BLE001 - a watchdog must not die of a failed probe
                self.log(f"stub watchdog: probe failed: {e}")
                continue
            if bad:
                self.healed.extend(bad)
                self.log(f"stub watchdog: reloaded {', '.join(bad)} (stub process had died)")

    def start(self) -> "StubWatchdog":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=self.interval_s + 35)


# --------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m backend_src.serving.server", description=__doc__.split("\n\n")[0])
    ap.add_argument("action", choices=["start", "stop", "status", "heal"])
    ap.add_argument("--model-repository", default="model_repository")
    ap.add_argument("--grpc-port", type=int, default=8001)
    ap.add_argument("--http-port", type=int, default=8000)
    ap.add_argument("--metrics-port", type=int, default=8002)
    ap.add_argument("--log-file", default=str(DEFAULT_LOG_FILE))
    ap.add_argument("--pid-file", default=str(DEFAULT_PID_FILE))
    ap.add_argument("--load-model", default="*", help="model to load at start ('*' = all, '' = none)")
    ap.add_argument("--timeout", type=float, default=180.0, help="seconds to wait for readiness")
    a = ap.parse_args(argv)
    pid_file = Path(a.pid_file)

    if a.action == "start":
        if pid_file.exists() and _alive(int(json.loads(pid_file.read_text())["pid"])):
            print(f"already running ({pid_file})", file=sys.stderr)
            return 1
        srv = TritonServer(
            a.model_repository, a.grpc_port, a.http_port, a.metrics_port, a.log_file, load_models=a.load_model or None
        )
        try:
            srv.start(a.timeout)
        except Exception as e:  # noqa: BLE001 - report and clean up whatever started
            srv.stop(grace_s=5)
            print(str(e), file=sys.stderr)
            return 1
        pid_file.parent.mkdir(parents=True, exist_ok=True)
        pid_file.write_text(
            json.dumps({"pid": srv.pid, "grpc": srv.grpc_port, "http": srv.http_port, "metrics": srv.metrics_port, "log": str(srv.log_file)})
        )
        srv.process = None  # leave it running after this command exits
        print(f"tritonserver ready: pid {srv.pid}, gRPC :{srv.grpc_port}, HTTP :{srv.http_port}, metrics :{srv.metrics_port}")
        return 0

    if a.action == "heal":  # reload Python models whose stub process died
        bad = heal(f"127.0.0.1:{a.grpc_port}")
        print("reloaded " + ", ".join(bad) if bad else "all Python model stubs answer")
        return 0
    if not pid_file.exists():
        print("not running (no pid file)")
        return 0 if a.action == "stop" else 3
    info = json.loads(pid_file.read_text())
    pid = int(info["pid"])
    if a.action == "status":
        alive = _alive(pid)
        ready = alive and _http_ok(f"http://127.0.0.1:{info['http']}/v2/health/ready")
        print(json.dumps({**info, "alive": alive, "ready": ready}))
        return 0 if ready else 3
    code = _terminate(pid, grace_s=30.0) if _alive(pid) else None
    pid_file.unlink(missing_ok=True)
    print(f"stopped pid {pid}" + (f" (exit {code})" if code is not None else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
