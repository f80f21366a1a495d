"""The processes the serving tools start and watch: launching tritonserver, its pid file and
launch file, whether a pid is alive (and still the process we think), ending one, a free port,
and the local HTTP checks that say whether something answers.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path


def launch(argv: list, env: dict, log_file, cwd=None) -> subprocess.Popen:
    """Start tritonserver in a session of its own (our signals, not the terminal's), its output
    appended to `log_file`. The one way the server is started, first and after a crash."""
    with open(log_file, "ab") as log:
        return subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env,
                                cwd=cwd, start_new_session=True)


# --------------------------------------------------------------------------------------------
# Pid file (JSON: the server's pid, ports, watchdog pid) and launch file (how to start it again)
# --------------------------------------------------------------------------------------------
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


def write_launch_file(pid_file, spec: dict) -> None:
    """Keep `spec` (argv, env, cwd, log_file, start_timeout_s) owner-only: the command line holds
    the admin key (as the process list does)."""
    fd = os.open(launch_file(pid_file), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        os.fchmod(f.fileno(), 0o600)
        json.dump(spec, f)


# --------------------------------------------------------------------------------------------
# Processes by pid
# --------------------------------------------------------------------------------------------
def alive(pid: int) -> bool:
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


def is_process(pid: int, marker: str) -> bool:
    """Whether pid is alive and its command line contains `marker` (a pid read from a file
    may since belong to another process)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return alive(pid) and marker.encode() in f.read()
    except OSError:
        return False


def terminate(pid: int, grace_s: float, process: subprocess.Popen | None = None) -> tuple:
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
        elif not alive(pid):
            return 0, False
        time.sleep(0.05)
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    if process is not None:
        return process.wait(), True
    while alive(pid) and time.monotonic() < deadline + 5:
        time.sleep(0.05)
    return -signal.SIGKILL, True


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on now (the caller binds it soon after)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


# --------------------------------------------------------------------------------------------
# Does it answer
# --------------------------------------------------------------------------------------------
def http_ok(url: str) -> bool:
    """Whether a GET of `url` answers 200 within 2 s."""
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status == 200
    except (urllib.error.URLError, ConnectionError, OSError):
        return False


def http_json(url: str, timeout: float = 3.0) -> tuple:
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
