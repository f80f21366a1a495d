"""Runs every offline benchmark in one go -- decode latency, ranking throughput, incremental
encoding -- then writes RESULTS.md and the plots.

    python -m perf.bench            # default configurations (about a minute on 2 cores)
    python -m perf.bench --quick    # tiny smoke configurations (seconds)
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

from perf import bench_caching, bench_decode, bench_ranking, report
from perf.common import RESULTS_DIR, log


def main(argv=None) -> Path:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny smoke configurations")
    p.add_argument("--out", type=Path, default=RESULTS_DIR, help="directory for the JSON files, RESULTS.md, plots")
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    p.add_argument("--only", nargs="+", choices=["decode", "ranking", "caching"], default=None,
                   help="run a subset (the report covers whatever result files exist)")
    args = p.parse_args(argv)
    common = ["--out", str(args.out), "--threads", str(args.threads)] + (["--quick"] if args.quick else [])
    benches = {"decode": bench_decode, "ranking": bench_ranking, "caching": bench_caching}
    for name in args.only or list(benches):
        t0 = time.perf_counter()
        benches[name].main(common)
        log(f"[{name}: {time.perf_counter() - t0:.0f} s]")
    return report.main(["--results", str(args.out)])


if __name__ == "__main__":
    main()
