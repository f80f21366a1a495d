"""The Python backend's stub processes of a tritonserver, read from /proc.

The Python backend runs each model instance as a child process of tritonserver
(``triton_python_backend_stub <repository>/<model>/<version>/model.py ...``); the watchdog
counts them per model against the instances the model's config asks for.

They stay in the server's process group (the server leads a group of its own) after the server is
gone: a stub whose server was killed runs on until something ends it, so whoever stops or restarts
a server ends what is left of its group (``end_group``).
"""
from __future__ import annotations

import os
import signal
import time
from pathlib import Path

STUB_COMM = "triton_python_b"  # the kernel keeps 15 characters of triton_python_backend_stub
STUB_NAME = "triton_python_backend_stub"


def process_stat(pid: int) -> tuple | None:
    """(comm, state, ppid, pgrp) of a process, or None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except OSError:
        return None
    comm = text[text.index("(") + 1 : text.rindex(")")]
    state, ppid, pgrp = text[text.rindex(")") + 2 :].split()[:3]
    return comm, state, int(ppid), int(pgrp)


def child_pids(pid: int) -> list:
    """Children of `pid` (zombies included): from each thread's children list where the kernel
    has one, else by reading every process's parent."""
    tasks = Path(f"/proc/{pid}/task")
    found, have_lists = set(), False
    try:
        for task in tasks.iterdir():
            try:
                found.update(int(x) for x in (task / "children").read_text().split())
                have_lists = True
            except OSError:
                continue
    except OSError:
        return []
    if have_lists:
        return sorted(found)
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            st = process_stat(int(entry))
            if st and st[2] == pid:
                out.append(int(entry))
    return out


def stub_processes(server_pid: int, known: dict | None = None) -> dict:
    """{pid: (model, alive)} for every Python-backend stub child of the server. A zombie's
    command line is gone: its model comes from `known` (pid -> model seen while alive), or None."""
    out = {}
    for pid in child_pids(server_pid):
        st = process_stat(pid)
        if st is None or st[0] != STUB_COMM:
            continue
        if st[1] == "Z":
            out[pid] = ((known or {}).get(pid), False)
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue  # gone since
        if not argv[0].endswith(STUB_NAME.encode()) or len(argv) < 2:
            continue  # still the shell that launches it
        model_py = Path(argv[1].decode(errors="replace"))  # <repository>/<model>/<version>/model.py
        out[pid] = (model_py.parent.parent.name, True)
    return out


def instance_count(config: dict) -> int:
    """Instances the server runs of a model, from its (server-completed) config."""
    n = 0
    for group in config.get("instance_group") or [{"count": 1}]:
        count = int(group.get("count", 1))
        gpus = group.get("gpus") or []
        n += count * (len(gpus) if group.get("kind") == "KIND_GPU" and gpus else 1)
    return max(n, 1)


def group_members(pgid: int, comms=(STUB_COMM, "tritonserver")) -> list:
    """Live processes of process group `pgid` whose command name is one of `comms` (a group id
    outlives its leader while members are left)."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            st = process_stat(int(entry))
            if st is not None and st[3] == pgid and st[1] != "Z" and st[0] in comms:
                out.append(int(entry))
    return out


def end_group(pgid: int, comms=(STUB_COMM, "tritonserver"), timeout_s: float = 5.0) -> list:
    """SIGKILL what is left of process group `pgid` (processes named in `comms`: a stopped or
    killed server's stubs) and wait until they are gone; returns their pids."""
    left = group_members(pgid, comms)
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + timeout_s
    while left and time.monotonic() < deadline:
        st = [process_stat(pid) for pid in left]
        if all(x is None or x[1] == "Z" for x in st):
            break
        time.sleep(0.05)
    return left
