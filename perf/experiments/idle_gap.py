"""Does a process that has just slept run the same work slower on this host? At concurrency 1 every stage of a
served request sleeps while the others (and the client, and Triton) run, and the served benchmark's in-process work
runs in turn with the served and floor requests; the same work back to back in one process is much faster. Here one
process, nothing else started, times the in-process work of a cached `recommend` (the decode and the ranking of the
served benchmark: beam 100, PFA k 256, top 10), and the encoder's durable log write of an append (one event, SQLite
with fsync), right after:
  - nothing (back to back);
  - a sleep of 1, 5 or 20 ms (the vCPU idles);
  - 20 ms of spinning on the clock (the same time passes, the vCPU stays busy);
  - 20 ms of reading the model's weights over and over (the same time passes, the weights stay in the caches).
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
              ("sleep 20 ms", "sleep", 0.020), ("spin 20 ms", "spin", 0.020), ("read weights 20 ms", "read weights", 0.020))


def pause(how, seconds: float, weights=()) -> None:
    if how == "sleep":
        time.sleep(seconds)
    elif how in ("spin", "read weights"):
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            for w in weights if how == "read weights" else ():
                w.sum()


def main(argv=None):
    ap = bench_model_parser(__doc__, "idle_gap.json")
    ap.add_argument("--histories", type=int, nargs="+", default=[50, 512])
    ap.add_argument("--reps", type=int, default=200)
    args = ap.parse_args(argv)

    from perf.served import InProcess, long_history, same_runtime_as_the_server, scratch_parent

    same_runtime_as_the_server(argv, module="perf.experiments.idle_gap")
    from backend_src.config import DecodeOptions
    from backend_src.data import load_dataset
    from backend_src.model.recommender import GenerativeRecommender
    from backend_src.serving.event_log import open_event_log

    reps = 5 if args.quick else args.reps
    load_start = host_load()
    model = GenerativeRecommender.load(args.checkpoint).eval()
    data = load_dataset(args.data, max_users=args.max_users)
    options = DecodeOptions(mode="pfa", beam_width=100, k=256, r=0.5, selection_step=1)
    rows = []
    log_dir = Path(tempfile.mkdtemp(prefix="genrec-idle-gap-", dir=scratch_parent()))

    # every parameter and buffer of the model, as the recommend reads them (item table, codebooks, heads)
    weights = [t.detach() for t in (*model.parameters(), *model.buffers()) if t.is_floating_point()]

    def timed(name, run, **fields):
        """`run` (-> ms) under every condition, alternating; one row per condition."""
        for _ in range(10):  # warm-up
            run()
        times = {condition: [] for condition, _, _ in CONDITIONS}
        for _ in range(reps):
            for condition, how, seconds in CONDITIONS:
                run()  # every condition follows the same work
                pause(how, seconds, weights)
                times[condition].append(run())
        base = statistics.median(times["back to back"])
        for condition, how, seconds in CONDITIONS:
            p50 = statistics.median(times[condition])
            rows.append(dict(work=name, **fields, condition=condition, pause=how or "none", pause_ms=seconds * 1e3,
                             reps=reps, p50_ms=p50, ratio_to_back_to_back=p50 / base))
            log(f"{name} {fields}, {condition:18s}: {p50:.3f} ms p50 ({p50 / base:.2f}x back to back)")

    for n in args.histories:
        work = InProcess(model, long_history(data, min(n, model.cfg.max_seq_len)), options, top_k=10, threads=1,
                         log_path=log_dir / f"events-{n}.sqlite3", durability="full")
        timed("recommend", lambda: work("recommend", parts=False)["total"], history=n)
        work.close()
    # the encoder's durable write of an append: one event to a 50-event session's log (SQLite, fsync)
    event_log = open_event_log(str(log_dir / "events.sqlite3"), retain_events=4096, durability="full")
    count = event_log.replace("s:idle-gap", [str(i) for i in range(50)], [0] * 50, list(range(50)))

    def append_one():
        nonlocal count
        t0 = time.perf_counter()
        count = event_log.append_many([("s:idle-gap", count, [str(count)], [0], [count])])[0]
        return (time.perf_counter() - t0) * 1e3

    timed("log append", append_one)
    event_log.close()
    shutil.rmtree(log_dir, ignore_errors=True)
    if args.out != "-":
        save_result(Path(args.out), rows, "perf.experiments.idle_gap", argv, load_start, checkpoint=str(args.checkpoint),
                    data=args.data, beam_width=100, pfa_k=256, torch_threads=1)


if __name__ == "__main__":
    main()
