"""OpenMP wait policy vs whole decode time, alone and with a second busy process beside it.

The same decode as perf.bench_decode (history 512, 32 users, beam 100, d 64, 2 heads, 2 threads;
full attention and PFA k 256, r 0.5, s 1) runs in child processes under the runtime's default
policy (an idle thread spins briefly, then sleeps) and under OMP_WAIT_POLICY=PASSIVE, first one
process alone, then two identical processes at once on the 2 cores. Each child prints the median
of 9 timed runs (after 2 untimed) of each mode, interleaved.

    python perf/results/omp_wait_policy.py > perf/results/omp_wait_policy.txt
"""
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from backend_src.serving.server import CPU_RUNTIME_ENV  # noqa: E402

# the glibc settings of the server and the Makefile; the wait policy is what this script varies
MALLOC_ENV = {key: value for key, value in CPU_RUNTIME_ENV.items() if key.startswith("MALLOC_")}
CHILD = """
import time, torch
from backend_src.config import DecodeOptions
from backend_src.decoding.beam_search import generate
from perf.bench_decode import build
torch.set_num_threads(2)
codebook, decoders = build(16384, 64, 2, 512, 0)
gen = torch.Generator().manual_seed(512)
states, lengths = torch.randn(32, 512, 64, generator=gen), torch.full((32,), 512)
calls = {m: (lambda o=DecodeOptions(beam_width=100, mode=m, k=256, r=0.5, selection_step=1):
             generate(decoders[False], codebook, states, lengths, o)) for m in ("full", "pfa")}
times = {m: [] for m in calls}
for rep in range(11):
    for m, fn in calls.items():
        t = time.perf_counter(); fn(); times[m].append(time.perf_counter() - t)
med = {m: sorted(v[2:])[4] * 1e3 for m, v in times.items()}
print(f"full {med['full']:.1f} ms, pfa {med['pfa']:.1f} ms, full/pfa {med['full'] / med['pfa']:.2f}")
"""


def run(policy: str | None, processes: int) -> list[str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    for key, value in MALLOC_ENV.items():
        env.setdefault(key, value)
    env.pop("OMP_WAIT_POLICY", None)
    if policy:
        env["OMP_WAIT_POLICY"] = policy
    procs = [subprocess.Popen([sys.executable, "-c", CHILD], cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True)
             for _ in range(processes)]
    return [p.communicate()[0].strip() for p in procs]


if __name__ == "__main__":
    print(__doc__.split("\n\n")[0])
    for processes in (1, 2):
        for policy in (None, "PASSIVE"):
            for i, line in enumerate(run(policy, processes)):
                label = f"{policy or 'default':8s} {processes} process{'es' if processes > 1 else ''}"
                print(f"{label} (#{i + 1}): {line}")
