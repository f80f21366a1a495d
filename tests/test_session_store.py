"""The history encoder's session cache: LRU memory bound, idle timeout, discard."""
import pytest
import torch

from backend_src.serving.session_store import Session, SessionStore, SessionTooLarge


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def _session(n_bytes_rows: int, count: int = 4) -> Session:
    ev = torch.arange(4)
    return Session(cache=torch.zeros(n_bytes_rows, dtype=torch.uint8), items=ev, actions=ev, timestamps=ev, count=count)


def test_lru_bound_evicts_least_recent_and_is_never_exceeded():
    per = _session(1000).nbytes
    store = SessionStore(max_bytes=3 * per, idle_timeout_s=100)
    for k in ("a", "b", "c"):
        store.put(k, _session(1000))
    store.get("a")  # a becomes most recent: b is now the oldest
    evicted = store.put("d", _session(1000))
    assert evicted == ["b"]
    assert set(store._sessions) == {"a", "c", "d"} and store.total_bytes == 3 * per
    assert store.stats()["evicted_memory"] == 1 and store.peak_bytes == 3 * per  # room made before inserting


def test_replace_keeps_byte_count_refuses_oversized_and_discards():
    store = SessionStore(max_bytes=10_000)
    store.put(1, _session(100))
    store.put(1, _session(200, count=9))
    assert len(store) == 1 and store.total_bytes == _session(200).nbytes and store.get(1).count == 9
    with pytest.raises(SessionTooLarge):
        store.put(2, _session(20_000))
    assert 2 not in store and len(store) == 1
    assert store.discard(1) and not store.discard(1) and store.total_bytes == 0


def test_idle_timeout():
    clock = Clock()
    store = SessionStore(max_bytes=1 << 20, idle_timeout_s=10, clock=clock)
    store.put("old", _session(10))
    clock.t = 8
    store.put("new", _session(10))
    clock.t = 15
    assert store.sweep() == ["old"] and "new" in store and store.stats()["evicted_idle"] == 1


_FAULTS_AFTER_PREFAULT = """
import resource, torch
from backend_src.serving.session_store import prefault_heap
touched = prefault_heap({prefault})
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
sessions = [torch.zeros(1 << 20, dtype=torch.uint8) for _ in range(48)]  # 48 MB kept, as a growing store keeps them
print(touched, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


@pytest.mark.parametrize("allocator_keeps_memory", [True, False])
def test_prefault_heap_maps_the_pages_new_sessions_take(allocator_keeps_memory):
    import os
    import subprocess
    import sys

    from backend_src.serving.server import CPU_RUNTIME_ENV

    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    if allocator_keeps_memory:
        env |= CPU_RUNTIME_ENV
    faults = {}
    for prefault in (0, 64 << 20):
        out = subprocess.run([sys.executable, "-c", _FAULTS_AFTER_PREFAULT.format(prefault=prefault)], env=env,
                             capture_output=True, text=True, check=True).stdout.split()
        touched, faults[prefault] = int(out[0]), int(out[1])
        assert touched == (prefault if allocator_keeps_memory else 0)
    pages = (48 << 20) // 4096
    assert faults[0] > pages // 2  # without it, the kept tensors fault their pages in
    if allocator_keeps_memory:
        assert faults[64 << 20] < pages // 10
