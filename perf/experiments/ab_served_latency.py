"""Is the working tree's served path faster than an earlier commit's, request by request and stage by stage? Two
servers of the benchmark model, one published by an earlier commit's code and one by this tree's, run side by side;
one client sends each request kind (a cached `recommend`, a one-event `append`, an `open`) at concurrency 1 to
the two in turn, alternating which goes first, so drift of the host cancels in the differences. Per kind and
history length: each server's client p50 and the per-request Triton compute (compute input + infer + output) of
each stage, and the p50 of the paired differences (this tree minus the earlier code). Run from the repository
root (needs the benchmark model, `make bench-served` trains it):
    python -m perf.experiments.ab_served_latency OLD_COMMIT          # -> perf/results/ab_served_latency.json
    python -m perf.experiments.ab_served_latency OLD_COMMIT --quick --out -
"""
import statistics
import tempfile
from pathlib import Path

from perf.common import host_load, log, save_result
from perf.experiments import bench_model_parser, served_settings

KINDS = ("recommend", "append", "open")
STAGE_PARTS = ("compute_input", "compute_infer", "compute_output")


def in_turn(clients: dict, kind: str, reps: int, warmup: int) -> tuple:
    """`kind` sent through each of `clients` (name -> perf.served.ServedKinds) in turn, alternating which goes first:
    after `warmup` rounds, name -> the latencies (ms), and name -> {model: Triton compute per request (ms)}."""
    from perf.served import _per_request_ms

    names = list(clients)
    latency = {name: [] for name in names}
    for i in range(warmup + reps):
        if i == warmup:  # Triton's statistics from here on
            for c in clients.values():
                c.stats.pop(kind, None)
        for name in (names if i % 2 == 0 else names[::-1]):
            ms = clients[name](kind)
            if i >= warmup:
                latency[name].append(ms)
    stages = {name: {m: sum(v[p] for p in STAGE_PARTS) for m, v in _per_request_ms(clients[name].stats[kind]).items()}
              for name in names}
    return latency, stages


def main(argv=None):
    ap = bench_model_parser(__doc__, "ab_served_latency.json")
    ap.add_argument("ref", help="the earlier commit")
    ap.add_argument("--histories", type=int, nargs="+", default=[50, 512])
    ap.add_argument("--requests", type=int, default=200)
    args = ap.parse_args(argv)

    from perf.served import ServedKinds, baseline_server, long_history, same_runtime_as_the_server, scratch_parent

    same_runtime_as_the_server(argv, module="perf.experiments.ab_served_latency")
    from backend_src.data import load_dataset
    from perf.served_eval import local_server

    reps, warmup = (10, 3) if args.quick else (args.requests, 20)
    load_start = host_load()
    data = load_dataset(args.data, max_users=args.max_users)
    options, serving = served_settings()
    names = (args.ref, "this")
    rows = []
    with tempfile.TemporaryDirectory(prefix="genrec-ab-", dir=scratch_parent()) as tmp, \
            baseline_server(args.ref, args.checkpoint, Path(tmp), serving.visit_idle_s) as old, \
            local_server(args.checkpoint, serving) as new:
        urls = dict(zip(names, (old.grpc_url, new.grpc_url)))
        for n in args.histories:
            events = long_history(data, n)
            clients = {name: ServedKinds(url, events, options, tag=f"ab-{name}-{n}") for name, url in urls.items()}
            for kind in KINDS:
                latency, stages = in_turn(clients, kind, reps, warmup)
                diff = statistics.median(b - a for a, b in zip(*(latency[name] for name in names)))
                row = dict(kind=kind, history=n, requests=reps, paired_diff_p50_ms=diff,
                           **{f"{name}_p50_ms": statistics.median(latency[name]) for name in names},
                           stages_ms={name: stages[name] for name in names})
                rows.append(row)
                per_stage = ", ".join(f"{m} {stages[names[0]][m]:.2f} -> {stages['this'][m]:.2f}" for m in sorted(stages["this"]))
                log(f"{kind:9s} history {n:4d}: p50 {row[f'{names[0]}_p50_ms']:.2f} -> {row['this_p50_ms']:.2f} ms "
                    f"(paired {diff:+.2f} ms); per stage {per_stage}")
            for c in clients.values():
                c.close()
    if args.out != "-":
        save_result(Path(args.out), rows, "perf.experiments.ab_served_latency", argv, load_start, checkpoint=str(args.checkpoint),
                    data=args.data, options=options, ref=args.ref)


if __name__ == "__main__":
    main()
