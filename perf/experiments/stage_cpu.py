"""Where the CPU goes under load: at one perf_analyzer concurrency (the served benchmark's sessions: an open
with 50 real events, then one-event appends), the CPU seconds per request of every process of the server
(tritonserver and each stage's Python stub, read from /proc around the measurement) and of perf_analyzer, and
each stage's batching (requests per execution) and compute per execution from Triton's statistics; the same
for the floor (perf/floor: the real configs with no-op stages), what Triton and the Python stubs cost. With
`--baseline-ref`, an earlier commit's code serves the same checkpoint beside this one (its own publish, as
`make bench-served` does) and the two are measured in turn, `--rounds` times, so the host's drift hits both.
With `--one-at-a-time N`, instead: N cached recommends sent one at a time from this process (no perf_analyzer,
no statistics read in the window), and the CPU of this client process (its gRPC threads included) beside the
server's: does Triton's own path cost the same when its stages do real work between its steps as the floor's?
Run from the repository root (needs the benchmark model, `make bench-served` trains it):
    python -m perf.experiments.stage_cpu --baseline-ref OLD_COMMIT     # -> perf/results/stage_cpu.json
    python -m perf.experiments.stage_cpu --one-at-a-time 500 --rounds 3 # -> perf/results/stage_cpu_one_at_a_time.json
    python -m perf.experiments.stage_cpu --quick --out -
"""
import json
import os
import resource
import shutil
import statistics
import tempfile
from contextlib import ExitStack
from pathlib import Path

from genrec_contract import protocol as P
from perf.common import host_load, log, save_result
from perf.experiments import bench_model_parser, served_settings

STAGES = (P.ENCODER, P.DECODER, P.RANKER)


def process_cpu_s(root_pid: int) -> dict:
    """CPU seconds (user + system) of `root_pid` and its descendants, by role: 'tritonserver' or the
    model name a Python stub serves (read off its model.py path)."""
    tick = os.sysconf("SC_CLK_TCK")
    procs = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text().rsplit(")", 1)[1].split()
            cmd = (d / "cmdline").read_bytes().split(b"\0")
        except OSError:  # gone meanwhile
            continue
        procs[int(d.name)] = (int(stat[1]), (int(stat[11]) + int(stat[12])) / tick, cmd)
    out = {}
    for pid, (ppid, cpu, cmd) in procs.items():
        p = pid
        while p in procs and p != root_pid:
            p = procs[p][0]
        if p != root_pid:
            continue
        if pid == root_pid:
            role = "tritonserver"
        elif len(cmd) > 1 and cmd[1].endswith(b"model.py"):
            role = Path(cmd[1].decode()).parts[-3]  # <repository>/<model>/<version>/model.py
        else:
            role = "other"
        out[role] = out.get(role, 0.0) + cpu
    return out


def measure(server, tag: str, input_json: Path, concurrency: int, steps: int, env: dict, work: Path, interval_ms: int,
            id_start: int) -> dict:
    import tritonclient.grpc as grpcclient

    from perf.served import run_perf_analyzer, server_statistics

    client = grpcclient.InferenceServerClient(server.grpc_url)
    run_perf_analyzer(server.grpc_url, input_json, concurrency, steps, env, work / f"warm_{tag}.csv",
                      id_start=id_start, request_count=300)  # warm-up: one window, no stability asked
    cpu0, stats0, kids0 = process_cpu_s(server.pid), server_statistics(client), resource.getrusage(resource.RUSAGE_CHILDREN)
    row = run_perf_analyzer(server.grpc_url, input_json, concurrency, steps, env, work / f"{tag}.csv", interval_ms,
                            id_start=id_start + 500_000)
    cpu1, stats1, kids1 = process_cpu_s(server.pid), server_statistics(client), resource.getrusage(resource.RUSAGE_CHILDREN)
    requests = stats1[P.ENSEMBLE]["requests"] - stats0[P.ENSEMBLE]["requests"]
    per_request = {role: (cpu1[role] - cpu0.get(role, 0.0)) * 1e3 / requests for role in cpu1}
    per_request["perf_analyzer"] = (kids1.ru_utime + kids1.ru_stime - kids0.ru_utime - kids0.ru_stime) * 1e3 / requests
    stages = {}
    for s in STAGES:
        n = {k: stats1[s][k] - stats0[s][k] for k in ("requests", "executions", "compute_infer")}
        stages[s] = dict(batch=n["requests"] / max(n["executions"], 1),
                         compute_per_execution_ms=n["compute_infer"] / 1e6 / max(n["executions"], 1))
    return dict(throughput_per_s=row["throughput_per_s"], p50_ms=row["p50_ms"], p99_ms=row["p99_ms"],
                requests_counted=requests, cpu_ms_per_request=per_request,
                server_cpu_ms_per_request=sum(v for k, v in per_request.items() if k != "perf_analyzer"), stages=stages)


def own_cpu_s() -> float:
    """CPU seconds (user + system) of this process, all its threads."""
    t = os.times()
    return t.user + t.system


def measure_one_at_a_time(server, tag: str, events: tuple, options: dict, requests: int) -> dict:
    """CPU per request of the server's processes and of this client process over `requests` cached
    recommends of one session sent one at a time, and their client-side p50."""
    from clients.client import RecommenderClient

    client = RecommenderClient(server.grpc_url)
    session = f"stage-cpu-{tag}"
    try:
        client.open_session(session, *events, **options)
        for _ in range(20):  # warm-up
            client.recommend(session, **options)
        cpu0, own0 = process_cpu_s(server.pid), own_cpu_s()
        latency = [client.recommend(session, **options).latency_ms for _ in range(requests)]
        cpu1, own1 = process_cpu_s(server.pid), own_cpu_s()
        client.close_session(session)
    finally:
        client.close()
    per_request = {role: (cpu1[role] - cpu0.get(role, 0.0)) * 1e3 / requests for role in cpu1}
    per_request["client"] = (own1 - own0) * 1e3 / requests
    return dict(requests_counted=requests, p50_ms=statistics.median(latency), cpu_ms_per_request=per_request,
                server_cpu_ms_per_request=sum(v for k, v in per_request.items() if k != "client"))


def measure_in_process(model, events: tuple, serving, requests: int, log_path: Path) -> dict:
    """The same cached recommend's work done in this process (the served benchmark's in-process
    request): its CPU and p50."""
    from perf.served import InProcess

    local = InProcess(model, events, serving.decode, serving.top_k, serving.torch_threads, log_path, serving.log_durability)
    try:
        for _ in range(20):
            local("recommend", parts=False)
        own0 = own_cpu_s()
        latency = [local("recommend", parts=False)["total"] for _ in range(requests)]
        own1 = own_cpu_s()
    finally:
        local.close()
    return dict(requests_counted=requests, p50_ms=statistics.median(latency),
                cpu_ms_per_request={"client": (own1 - own0) * 1e3 / requests},
                server_cpu_ms_per_request=0.0)


def main(argv=None):
    ap = bench_model_parser(__doc__, "stage_cpu.json")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--steps", type=int, default=10, help="requests per session: an open, then appends")
    ap.add_argument("--baseline-ref", default=None, help="an earlier commit measured in turn with this code")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--no-floor", dest="floor", action="store_false", help="skip the no-op ensemble")
    ap.add_argument("--one-at-a-time", type=int, default=0, metavar="N",
                    help="N cached recommends one at a time per round and history instead of perf_analyzer")
    ap.add_argument("--histories", type=int, nargs="+", default=[50, 512], help="with --one-at-a-time")
    args = ap.parse_args(argv)
    if args.one_at_a_time and args.out == ap.get_default("out"):
        args.out = str(Path(args.out).with_name("stage_cpu_one_at_a_time.json"))

    from backend_src.data import load_dataset
    from backend_src.model.recommender import GenerativeRecommender
    from perf.served import (baseline_server, long_history, perf_analyzer_env, perf_analyzer_usable,
                             same_runtime_as_the_server, scratch_parent, sequence_input_data, session_streams)
    from perf.floor import floor_server
    from perf.served_eval import local_server

    same_runtime_as_the_server(None, module="perf.experiments.stage_cpu")
    rounds, interval_ms = (1, 1000) if args.quick else (args.rounds, 5000)
    load_start = host_load()
    data = load_dataset(args.data, max_users=args.max_users)
    model = GenerativeRecommender.load(args.checkpoint)
    cfg = model.cfg
    options, serving = served_settings()
    work = Path(tempfile.mkdtemp(prefix="genrec-stage-cpu-", dir=scratch_parent()))
    rows = []
    try:
        input_json = work / "perf_input.json"
        input_json.write_text(json.dumps(sequence_input_data(session_streams(data, 64, 50, args.steps - 1), options)))
        env = perf_analyzer_env(work / "lib")
        ok, why = perf_analyzer_usable(env)
        if not ok and not args.one_at_a_time:
            raise SystemExit(f"perf_analyzer is not usable here: {why}")
        with ExitStack() as stack:
            servers = {}
            if args.baseline_ref:
                servers[args.baseline_ref] = stack.enter_context(baseline_server(args.baseline_ref, args.checkpoint, work,
                                                                                 serving.visit_idle_s))
            servers["this"] = stack.enter_context(local_server(args.checkpoint, serving))
            if args.floor:
                servers["floor"] = stack.enter_context(floor_server(cfg, serving))
            for r in range(rounds):
                if args.one_at_a_time:  # the servers one at a time, then the same work in this process
                    requests = 20 if args.quick else args.one_at_a_time
                    for n in args.histories:
                        events = long_history(data, n)
                        for name, server in [*servers.items(), ("in_process", None)]:
                            row = (measure_in_process(model, events, serving, requests, work / f"in-process-{r}-{n}.sqlite3")
                                   if server is None else measure_one_at_a_time(server, f"{name}-{r}-{n}", events, options, requests))
                            rows.append(dict(server=name, round=r, history=n, concurrency=1, **row))
                            cpu = ", ".join(f"{k} {v:.2f}" for k, v in sorted(row["cpu_ms_per_request"].items()))
                            log(f"{name} round {r + 1}, history {n}: p50 {row['p50_ms']:.2f} ms; CPU ms a request: {cpu}")
                    continue
                for i, (name, server) in enumerate(servers.items()):
                    row = measure(server, f"{name}_{r}", input_json, args.concurrency, args.steps, env, work, interval_ms,
                                  id_start=10_000_000 * (1 + r * len(servers) + i))
                    rows.append(dict(server=name, round=r, concurrency=args.concurrency, **row))
                    cpu = ", ".join(f"{k} {v:.2f}" for k, v in sorted(row["cpu_ms_per_request"].items()))
                    log(f"{name} round {r + 1}: {row['throughput_per_s']:.1f} requests/s; CPU ms a request: {cpu}; batch "
                        + ", ".join(f"{s} {v['batch']:.2f}" for s, v in row["stages"].items()))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    summary = {}
    for name, history in dict.fromkeys((r["server"], r.get("history")) for r in rows):
        mine = [r for r in rows if r["server"] == name and r.get("history") == history]
        cpu = {k: statistics.median(r["cpu_ms_per_request"].get(k, 0.0) for r in mine) for k in mine[0]["cpu_ms_per_request"]}
        if history is not None:  # one at a time: latency and CPU per history
            summary[f"{name}, history {history}"] = dict(p50_ms=statistics.median(r["p50_ms"] for r in mine), cpu_ms_per_request=cpu)
            continue
        summary[name] = dict(throughput_per_s=statistics.median(r["throughput_per_s"] for r in mine), cpu_ms_per_request=cpu,
                             batch={s: statistics.median(r["stages"][s]["batch"] for r in mine) for s in STAGES})
    if args.baseline_ref and not args.one_at_a_time:
        summary["throughput_ratio"] = summary["this"]["throughput_per_s"] / summary[args.baseline_ref]["throughput_per_s"]
        log(f"this / {args.baseline_ref}: {summary['throughput_ratio']:.3f}x")
    if args.out != "-":
        save_result(Path(args.out), rows, "perf.experiments.stage_cpu", argv, load_start, checkpoint=str(args.checkpoint),
                    data=args.data, options=options, summary=summary)
    else:
        print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
