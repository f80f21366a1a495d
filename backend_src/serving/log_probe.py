"""Whether the event log takes writes: the watchdog's probe, behind ``GET /ready``.

Every ``interval_s`` (2 s) a thread of the watchdog writes one event to a reserved key of the log
the server writes (``replace``: the key holds that one event) and reads it back. The key
(``event_log.PROBE_KEY``) is no session's (session keys are ``i:...`` or ``s:...``), so it is never
served, and the log's count of users leaves it out. A probe that fails (a full disk, a read-only or damaged file, Redis out of reach) makes
/ready answer 503 with the error; the next one that succeeds makes it 200 again. A probe that has
not finished within ``stale_s`` (a log that hangs) counts as failed.

The probe runs beside the served path, never on it: it takes the log's write lock for one small
transaction each interval, as one more writer would. A SQLite log is opened afresh for each
probe, so what it reads comes from the file, not from pages a long-lived connection kept.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from typing import Callable, Optional

from backend_src.serving.event_log import EVENT_LOG_ENV, SQLiteEventLog, open_event_log, served_log_url
from backend_src.serving.event_log.base import PROBE_KEY
from backend_src.serving.event_log.redis_log import redact_url

log = logging.getLogger("genrec.watchdog")


def served_event_log(grpc_url: str, repository) -> Optional[str]:
    """The URL of the log the server at `grpc_url` writes (event_log.served_log_url), the parameters
    read from its encoder's config; None while the server does not answer."""
    if os.environ.get(EVENT_LOG_ENV):
        return os.environ[EVENT_LOG_ENV]
    import tritonclient.grpc as grpcclient

    from genrec_contract import protocol as P

    client = grpcclient.InferenceServerClient(grpc_url)
    try:
        config = client.get_model_config(P.ENCODER, as_json=True, client_timeout=5)["config"]
    except Exception:  # noqa: BLE001 - not up (yet)
        return None
    finally:
        client.close()
    params = {k: v.get("string_value", "") for k, v in (config.get("parameters") or {}).items()}
    return served_log_url(params, repository)


class LogProbe:
    """`url`: returns the log's URL, or None while it cannot be told yet (it is asked again)."""

    def __init__(self, url: Callable[[], Optional[str]], interval_s: float = 2.0, stale_s: float = 15.0):
        self._url, self.interval_s, self.stale_s = url, float(interval_s), float(stale_s)
        self._lock = threading.Lock()
        self.where: Optional[str] = None
        self.ok: Optional[bool] = None  # None: no probe has finished yet
        self.error: Optional[str] = None
        self.finished_at = self.started_at = time.monotonic()
        self._first = threading.Event()
        self._stop = threading.Event()
        self._kept = None  # a Redis log stays open between probes (it reconnects by itself)

    # ---- one probe ------------------------------------------------------------------------------
    def _open(self, url: str):
        if self._kept is not None and self._kept[0] == url:
            return self._kept[1]
        event_log = open_event_log(url, verify=False)
        if not isinstance(event_log, SQLiteEventLog):
            self._kept = (url, event_log)
        return event_log

    def probe_once(self) -> None:
        self.started_at = time.monotonic()
        try:
            url = self._url()
            if url is None:
                raise RuntimeError("the event log's URL is not known yet (the server has not answered)")
            self.where = redact_url(url)
            event_log = self._open(url)
            try:
                nonce = f"{time.time_ns()}"
                event_log.replace(PROBE_KEY, [nonce], [0], [int(time.time())])
                back = event_log.tail(PROBE_KEY, 1)  # one write a probe: it takes the write lock once
                if back.items != [nonce]:
                    raise RuntimeError(f"wrote event {nonce!r} and read back {back.items!r}")
            finally:
                if isinstance(event_log, SQLiteEventLog):
                    event_log.close(checkpoint=False)  # checkpoints are the server's, not every probe's
            ok, error = True, None
        except Exception as e:  # noqa: BLE001 - any failure is the answer
            ok, error = False, f"{type(e).__name__}: {e}"
            if self._kept is not None:
                self._kept = None  # open it afresh next time
        with self._lock:
            if ok != self.ok:
                (log.warning if ok else log.error)("event log %s: %s", self.where or "?", "takes writes" if ok else error)
            self.ok, self.error, self.finished_at = ok, error, time.monotonic()
        self._first.set()

    # ---- the thread -----------------------------------------------------------------------------
    def run(self) -> None:
        while not self._stop.is_set():
            self.probe_once()
            self._stop.wait(self.interval_s)

    def start(self) -> "LogProbe":
        threading.Thread(target=self.run, daemon=True, name="event-log-probe").start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def state(self, wait_s: float = 5.0) -> tuple:
        """(ok, body for /ready). Waits up to `wait_s` for the first probe."""
        self._first.wait(wait_s)
        with self._lock:
            ok, error, finished_at = self.ok, self.error, self.finished_at
        busy_s = time.monotonic() - max(self.started_at, finished_at)
        if ok is None:
            ok, error = False, "the event log has not been probed yet"
        elif self.started_at > finished_at and busy_s > self.stale_s:
            ok, error = False, f"a probe of the event log has not finished in {busy_s:.0f} s"
        return ok, {"ok": ok, "where": self.where, "error": error,
                    "checked_s_ago": round(time.monotonic() - finished_at, 1)}
