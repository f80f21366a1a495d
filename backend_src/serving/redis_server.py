"""Start and stop a local ``redis-server`` for tests and local clusters.

The server listens on 127.0.0.1 only, keeps its data in a given folder and logs every write
to its append-only file, fsynced before it answers (``--appendonly yes --appendfsync always``,
no RDB snapshots), so an acknowledged write survives the server being killed; starting it
again on the same folder replays that file.

    with RedisServer("runs/redis") as server:
        log = open_event_log(server.url)
"""
from __future__ import annotations

import atexit
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Optional

from backend_src.serving.processes import free_port

HOST = "127.0.0.1"
LOG_FILE = "redis-server.log"


def redis_server_binary() -> Optional[str]:
    """Path of the ``redis-server`` binary on PATH (Debian's package installs it there), or None."""
    return shutil.which("redis-server")


def _ping(port: int) -> Optional[bytes]:
    """The server's first reply line to PING, or None when it does not answer yet."""
    try:
        with socket.create_connection((HOST, port), timeout=0.5) as s:
            s.sendall(b"PING\r\n")
            return s.recv(64)
    except OSError:
        return None


class RedisServer:
    """One ``redis-server`` process on 127.0.0.1; a context manager (start on enter, stop on exit)."""

    def __init__(self, data_dir, port: Optional[int] = None, *, binary: Optional[str] = None,
                 startup_timeout_s: float = 20.0, stop_grace_s: float = 10.0):
        self.data_dir = Path(data_dir).resolve()
        self.port = port  # a free one is picked at the first start and kept for restarts
        self.binary = binary or redis_server_binary()
        self.startup_timeout_s = startup_timeout_s
        self.stop_grace_s = stop_grace_s
        self._proc: Optional[subprocess.Popen] = None

    @property
    def url(self) -> str:
        if self.port is None:
            raise RuntimeError("the Redis server has not been started yet")
        return f"redis://{HOST}:{self.port}/0"

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    @property
    def pid(self) -> Optional[int]:
        return self._proc.pid if self.running else None

    def start(self) -> "RedisServer":
        if self.running:
            return self
        if not self.binary:
            raise FileNotFoundError("redis-server not found on PATH (Debian: apt-get install redis-server)")
        self.data_dir.mkdir(parents=True, exist_ok=True)
        if self.port is None:
            self.port = free_port(HOST)
        args = [
            self.binary,
            "--bind", HOST,
            "--port", str(self.port),
            "--dir", str(self.data_dir),
            "--appendonly", "yes",
            "--appendfsync", "always",
            "--save", "",
            "--daemonize", "no",
            "--protected-mode", "yes",
        ]
        with open(self.data_dir / LOG_FILE, "ab") as log:
            self._proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                          start_new_session=True)  # a terminal's Ctrl-C is ours to handle
        atexit.register(self._kill_at_exit)
        deadline = time.monotonic() + self.startup_timeout_s
        while True:
            if self._proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self._proc.returncode} at start:\n{self._log_tail()}")
            reply = _ping(self.port)
            if reply is not None and reply.startswith(b"+PONG"):
                return self
            # no answer yet, or -LOADING while it replays its append-only file
            if time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"redis-server did not answer PING on port {self.port} within "
                                   f"{self.startup_timeout_s} s:\n{self._log_tail()}")
            time.sleep(0.02)

    def stop(self) -> None:
        """SIGTERM (the server flushes and exits), SIGKILL if it has not exited after the grace."""
        if not self.running:
            return
        self._proc.send_signal(signal.SIGTERM)
        try:
            self._proc.wait(self.stop_grace_s)
        except subprocess.TimeoutExpired:
            self.kill()
        self._forget()

    def kill(self) -> None:
        """SIGKILL, as a crash would: only what reached the append-only file survives."""
        if self._proc is None:
            return
        if self._proc.poll() is None:
            self._proc.kill()
        self._proc.wait()
        self._forget()

    def detach(self) -> int:
        """Leave the server running after this process exits (a command that starts a cluster);
        returns its pid."""
        pid = self.pid
        self._forget()
        return pid

    def _forget(self):
        atexit.unregister(self._kill_at_exit)

    def _kill_at_exit(self):
        if self.running:
            self._proc.kill()

    def _log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join((self.data_dir / LOG_FILE).read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def __enter__(self) -> "RedisServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
