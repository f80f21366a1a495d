"""A tiny untrained recommender checkpoint for the tests that start a real server, and the
processes they look at in /proc."""
from __future__ import annotations

import os
from pathlib import Path

import pytest


def build_tiny_checkpoint(path, item_ids, max_history: int, seed: int) -> None:
    """Random-weight model with random unique semantic IDs over `item_ids` (index 0 = None):
    the serving tests check plumbing and served == offline, not quality. Its fused order takes
    every expert (ranker and dense weights above 0), so the served path computes each one."""
    from backend_src.model.recommender import GenerativeRecommender

    model = GenerativeRecommender.untrained(item_ids, max_history, seed)
    model.cfg.set_fusion_weights((1.0, 0.5, 0.0), (1.0, 0.5, 0.0))
    model.save(path)


def require_tritonserver() -> None:
    """Skip the calling test (or fixture) when the Triton server binaries are not installed."""
    from backend_src.serving.server import triton_home

    try:
        triton_home()
    except RuntimeError as e:
        pytest.skip(str(e))


def children(pid: int) -> dict:
    """{child pid: (state, command line)} of a process, read from /proc."""
    out = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            state, ppid = stat[stat.rindex(")") + 2 :].split()[:2]
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except (OSError, ValueError):
            continue
        if int(ppid) == pid:
            out[int(entry)] = (state, cmdline)
    return out


def watchdogs(keeper: int) -> list:
    """The live watchdog processes that `keeper` runs."""
    return [pid for pid, (state, cmd) in children(keeper).items() if state != "Z" and "serving.watchdog" in cmd]


def running(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"
