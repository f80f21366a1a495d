"""Does a process that has just slept run the same work slower on this host? At concurrency 1 every stage of a
served request sleeps while the others (and the client, and Triton) run, and the served benchmark's in-process work
runs in turn with the served and floor requests; the same work back to back in one process is much faster. Here one
process, nothing else started, times the in-process work of a cached `recommend` (the decode and the ranking of the
served benchmark: beam 100, PFA k 256, top 10) right after:
  - nothing (back to back);
  - a sleep of 1, 5 or 20 ms (the vCPU idles);
  - 20 ms of spinning on the clock (the same time passes, the vCPU stays busy).
Conditions alternate request by request, so drift of the host cancels in the ratios. Run from the repository root
(needs the benchmark model, `make bench-served` trains it):
    python -m perf.experiments.idle_gap            # -> perf/results/idle_gap.json
    python -m perf.experiments.idle_gap --quick --out -
"""
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from perf.common import host_load, log, save_result
from perf.experiments import bench_model_parser

CONDITIONS = (("back to back", None, 0.0), ("sleep 1 ms", "sleep", 0.001), ("sleep 5 ms", "sleep", 0.005),
              ("sleep 20 ms", "sleep", 0.020), ("spin 20 ms", "spin", 0.020))


def pause(how, seconds: float) -> None:
    if how == "sleep":
        time.sleep(seconds)
    elif how == "spin":
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            pass


def main(argv=None):
    ap = bench_model_parser(__doc__, "idle_gap.json")
    ap.add_argument("--histories", type=int, nargs="+", default=[50, 512])
    ap.add_argument("--reps", type=int, default=200)
    args = ap.parse_args(argv)

    from perf.served import InProcess, long_history, same_runtime_as_the_server

    same_runtime_as_the_server(argv, module="perf.experiments.idle_gap")
    from backend_src.config import DecodeOptions
    from backend_src.data import load_dataset
    from backend_src.model.recommender import GenerativeRecommender

    reps = 5 if args.quick else args.reps
    load_start = host_load()
    model = GenerativeRecommender.load(args.checkpoint).eval()
    data = load_dataset(args.data, max_users=args.max_users)
    options = DecodeOptions(mode="pfa", beam_width=100, k=256, r=0.5, selection_step=1)
    rows = []
    log_dir = Path(tempfile.mkdtemp(prefix="idle-gap-"))  # the in-process log; only recommends run, which write none
    for n in args.histories:
        work = InProcess(model, long_history(data, min(n, model.cfg.max_seq_len)), options, top_k=10, threads=1,
                         log_path=log_dir / f"events-{n}.sqlite3", durability="full")
        for _ in range(10):  # warm-up
            work("recommend", parts=False)
        times = {name: [] for name, _, _ in CONDITIONS}
        for _ in range(reps):
            for name, how, seconds in CONDITIONS:
                work("recommend", parts=False)  # every condition follows the same work
                pause(how, seconds)
                times[name].append(work("recommend", parts=False)["total"])
        work.close()
        base = statistics.median(times["back to back"])
        for name, how, seconds in CONDITIONS:
            p50 = statistics.median(times[name])
            rows.append(dict(history=n, condition=name, pause=how or "none", pause_ms=seconds * 1e3, reps=reps,
                             recommend_p50_ms=p50, ratio_to_back_to_back=p50 / base))
            log(f"history {n:4d}, {name:12s}: recommend {p50:.2f} ms p50 ({p50 / base:.2f}x back to back)")
    shutil.rmtree(log_dir, ignore_errors=True)
    if args.out != "-":
        save_result(Path(args.out), rows, "perf.experiments.idle_gap", argv, load_start, checkpoint=str(args.checkpoint),
                    data=args.data, beam_width=100, pfa_k=256, torch_threads=1)


if __name__ == "__main__":
    main()
