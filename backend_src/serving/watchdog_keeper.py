"""The watchdog's keeper: the process ``server start`` leaves behind, which runs the stub watchdog
as its child and starts it again when it dies of anything but a stop (a kill from outside, the
OOM killer, a fault of its own), waiting 1, 2, ... up to 30 s between quick deaths.

It is a loop with no threads, no network and no server client, so little can kill it; SIGTERM
passes to the watchdog, and a watchdog whose keeper is killed gets SIGTERM from the kernel
(``PR_SET_PDEATHSIG``). It runs as ``python -m backend_src.serving.watchdog --keep ...``.
"""
from __future__ import annotations

import ctypes
import logging
import os
import signal
import subprocess
import sys
import time

PR_SET_PDEATHSIG = 1

log = logging.getLogger("genrec.watchdog")


def keep(argv: list) -> int:
    """Run the watchdog (`argv`, without --keep) as a child and start it again whenever it
    exits other than by a stop: status 0 means it stopped by itself (no server to watch), and
    after SIGTERM or SIGINT to the keeper the child's own exit ends the keeper too."""
    cmd = [sys.executable, "-m", "backend_src.serving.watchdog", *argv]
    libc, keeper = ctypes.CDLL(None, use_errno=True), os.getpid()

    def die_with_keeper():  # in the child, between fork and exec (the keeper has no threads)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != keeper:  # the keeper was gone before the line above
            os._exit(1)

    stopping, child = [], None

    def stop(signum, _frame):
        stopping.append(signum)
        if child is not None and child.poll() is None:
            child.send_signal(signum)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    quick_deaths = 0
    while not stopping:
        started = time.monotonic()
        child = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, preexec_fn=die_with_keeper)
        if stopping:  # a stop that came while it was being spawned
            child.send_signal(signal.SIGTERM)
        code = child.wait()
        if stopping or code == 0:
            return code
        quick_deaths = quick_deaths + 1 if time.monotonic() - started < 60.0 else 1
        delay = min(30.0, 2.0 ** (quick_deaths - 1))
        why = f"signal {-code}" if code < 0 else f"exit status {code}"
        log.error("the watchdog (pid %d) died (%s); starting it again in %.0f s", child.pid, why, delay)
        deadline = time.monotonic() + delay
        while not stopping and time.monotonic() < deadline:
            time.sleep(0.1)
    return 0
