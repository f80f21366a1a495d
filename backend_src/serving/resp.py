"""A minimal Redis client: RESP2 over a plain TCP socket, commands sent as one pipeline.

The event log needs only a handful of commands (EVALSHA, SCRIPT LOAD, GET, DEL, DBSIZE) and
must run inside Triton's Python-backend stub, whose embedded interpreter cannot import the
``ssl`` module that full Redis clients import at start. So this speaks the protocol itself:
a command is an array of bulk strings, a reply is one of ``+``, ``-``, ``:``, ``$``, ``*``.
"""
from __future__ import annotations

import socket
import threading


class RespError(Exception):
    """An error reply of the server (e.g. NOSCRIPT, WRONGTYPE); the connection stays usable."""


def _encode(args) -> bytes:
    out = [b"*%d\r\n" % len(args)]
    for a in args:
        b = a if isinstance(a, bytes) else str(a).encode()
        out += [b"$%d\r\n" % len(b), b, b"\r\n"]
    return b"".join(out)


class RespConnection:
    """One connection (re-opened after a failure); thread-safe, one pipeline at a time."""

    def __init__(self, host: str, port: int, db: int = 0, password: str | None = None, username: str | None = None,
                 timeout_s: float = 5.0):
        self.host, self.port, self.db = host, int(port), int(db)
        self.password, self.username, self.timeout_s = password, username, timeout_s
        self._sock = None
        self._buf = None
        self._lock = threading.Lock()

    def _connect(self) -> None:
        self._sock = socket.create_connection((self.host, self.port), timeout=self.timeout_s)
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._buf = self._sock.makefile("rb")
        hello = []
        if self.password is not None:
            hello.append(["AUTH", self.username, self.password] if self.username else ["AUTH", self.password])
        if self.db:
            hello.append(["SELECT", self.db])
        for reply in self._exchange(hello):
            if isinstance(reply, RespError):
                raise reply

    def _read(self):
        line = self._buf.readline()
        if not line.endswith(b"\r\n"):
            raise ConnectionError("the Redis server closed the connection")
        kind, rest = line[:1], line[1:-2]
        if kind == b"+":
            return rest
        if kind == b"-":
            return RespError(rest.decode(errors="replace"))
        if kind == b":":
            return int(rest)
        if kind == b"$":
            n = int(rest)
            if n < 0:
                return None
            data = self._buf.read(n + 2)
            if len(data) != n + 2:
                raise ConnectionError("the Redis server closed the connection")
            return data[:-2]
        if kind == b"*":
            n = int(rest)
            return None if n < 0 else [self._read() for _ in range(n)]
        raise ConnectionError(f"unexpected reply from the Redis server: {line[:40]!r}")

    def _exchange(self, commands) -> list:
        if commands:
            self._sock.sendall(b"".join(_encode(c) for c in commands))
        return [self._read() for _ in commands]

    def pipeline(self, commands) -> list:
        """Send every command, then read every reply (error replies come back as RespError).
        A broken connection is closed and raises (OSError / ConnectionError); the next call
        connects again."""
        with self._lock:
            try:
                if self._sock is None:
                    self._connect()
                return self._exchange(commands)
            except BaseException:
                self.close_locked()
                raise

    def execute(self, *args):
        reply = self.pipeline([args])[0]
        if isinstance(reply, RespError):
            raise reply
        return reply

    def close_locked(self) -> None:
        if self._sock is not None:
            try:
                self._sock.close()
            finally:
                self._sock, self._buf = None, None

    def close(self) -> None:
        with self._lock:
            self.close_locked()
