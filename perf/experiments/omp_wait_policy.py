"""OpenMP wait policy vs whole decode time, alone and with a second busy process beside it.

The same decode as perf.bench_decode (history 512, 32 users, beam 100, d 64, 2 heads, 2 threads;
full attention and PFA k 256, r 0.5, s 1) runs in child processes under the runtime's default
policy (an idle thread spins briefly, then sleeps) and under OMP_WAIT_POLICY=PASSIVE, first one
process alone, then two identical processes at once on the 2 cores. Each child prints the median
of 9 timed runs (after 2 untimed) of each mode, interleaved. Run from the repository root, alone on
the machine:

    python -m perf.experiments.omp_wait_policy           # writes perf/results/omp_wait_policy.txt
    python -m perf.experiments.omp_wait_policy --quick --out -   # 3 timed runs, 1 untimed
"""
import argparse
import os
import subprocess
import sys
from pathlib import Path

from backend_src.serving.server import CPU_RUNTIME_ENV
from perf.common import REPO_ROOT as ROOT, RESULTS_DIR

# the glibc settings of the server and the Makefile; the wait policy is what this script varies
MALLOC_ENV = {key: value for key, value in CPU_RUNTIME_ENV.items() if key.startswith("MALLOC_")}
CHILD = """
import sys, time, torch
from backend_src.config import DecodeOptions
from backend_src.decoding.beam_search import generate
from perf.bench_decode import build
torch.set_num_threads(2)
codebook, decoders = build(16384, 64, 2, 512, 0)
gen = torch.Generator().manual_seed(512)
states, lengths = torch.randn(32, 512, 64, generator=gen), torch.full((32,), 512)
calls = {m: (lambda o=DecodeOptions(beam_width=100, mode=m, k=256, r=0.5, selection_step=1):
             generate(decoders[False], codebook, states, lengths, o)) for m in ("full", "pfa")}
untimed, timed = int(sys.argv[1]), int(sys.argv[2])
times = {m: [] for m in calls}
for rep in range(untimed + timed):
    for m, fn in calls.items():
        t = time.perf_counter(); fn(); times[m].append(time.perf_counter() - t)
med = {m: sorted(v[untimed:])[timed // 2] * 1e3 for m, v in times.items()}
print(f"full {med['full']:.1f} ms, pfa {med['pfa']:.1f} ms, full/pfa {med['full'] / med['pfa']:.2f}")
"""


def run(policy: str | None, processes: int, untimed: int = 2, timed: int = 9) -> list[str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    for key, value in MALLOC_ENV.items():
        env.setdefault(key, value)
    env.pop("OMP_WAIT_POLICY", None)
    if policy:
        env["OMP_WAIT_POLICY"] = policy
    procs = [subprocess.Popen([sys.executable, "-c", CHILD, str(untimed), str(timed)], cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True)
             for _ in range(processes)]
    return [p.communicate()[0].strip() for p in procs]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="3 timed runs after 1 untimed (a check that it runs)")
    ap.add_argument("--out", default=str(RESULTS_DIR / "omp_wait_policy.txt"), help="text file ('-': stdout only)")
    args = ap.parse_args()
    lines = [__doc__.split("\n\n")[0]]
    print(lines[0], flush=True)
    for processes in (1, 2):
        for policy in (None, "PASSIVE"):
            for i, line in enumerate(run(policy, processes, *((1, 3) if args.quick else (2, 9)))):
                label = f"{policy or 'default':8s} {processes} process{'es' if processes > 1 else ''}"
                lines.append(f"{label} (#{i + 1}): {line}")
                print(lines[-1], flush=True)
    if args.out != "-":
        Path(args.out).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
