"""Where does each stage's time go inside its Triton stub on a cached `recommend`? The benchmark model is published
into a temporary repository whose copies of the three stages' model.py get timers (encoder_phases' TIMERS) around
their `execute`, the steps of the stage behind it and the calls those make into the package (reading and checking
the inputs, the model's work, the served order); one client sends cached recommends one at a time and reads
Triton's compute_infer of each stage around each. What a stage spends outside the timed steps is building the response.
Run from the repository root (needs the benchmark model, `make bench-served` trains it):
    python -m perf.experiments.stage_phases            # -> perf/results/stage_phases.json
    python -m perf.experiments.stage_phases --quick --out -
"""
import json
import statistics
import tempfile
from pathlib import Path

from genrec_contract import protocol as P
from perf.common import host_load, log, save_result
from perf.experiments import bench_model_parser, served_settings
from perf.experiments.encoder_phases import TIMERS

# per stage, (label, owner, attribute) timed once the stage has loaded: the model's execute, its stage's own steps
# (backend_src.serving.stages), then calls into the package (V: the version's validation module)
PHASES = {
    P.ENCODER: (("execute", "self", "execute"), ("_parse", "self.stage", "_parse"), ("_round", "self.stage", "_round"),
                ("_set_base", "self.stage", "_set_base"), ("_response", "self.stage", "_response"),
                ("_publish_metrics", "self.stage.metrics", "publish"),
                ("read_input", "V", "read_input"), ("parse_options", "V", "parse_options"), ("counts", "self.stage.log", "counts")),
    P.DECODER: (("execute", "self", "execute"), ("_read", "self.stage", "_read"), ("_decode", "self.stage", "_decode"),
                ("read_input", "V", "read_input"), ("parse_options", "V", "parse_options"),
                ("check_decoder_inputs", "V", "check_decoder_inputs"), ("retrieve", "self.stage.graphs", "retrieve")),
    P.RANKER: (("execute", "self", "execute"), ("_read", "self.stage", "_read"), ("_order", "self.stage", "_order"),
               ("_scores", "self.stage", "_scores"), ("read_input", "V", "read_input"),
               ("check_ranker_inputs", "V", "check_ranker_inputs"), ("score", "self.stage.runtime", "score"),
               ("served_order", "self.stage", "served_order")),
}


def main(argv=None):
    ap = bench_model_parser(__doc__, "stage_phases.json")
    ap.add_argument("--histories", type=int, nargs="+", default=[50, 512])
    ap.add_argument("--reps", type=int, default=300)
    args = ap.parse_args(argv)

    from perf.served import compute_infer_ns, long_history, same_runtime_as_the_server, scratch_parent

    same_runtime_as_the_server(argv, module="perf.experiments.stage_phases")
    import tritonclient.grpc as grpcclient

    from backend_src.data import load_dataset
    from clients.client import RecommenderClient
    from export.publish import publish
    from perf.served_eval import serve_repository

    reps, warmup = (10, 3) if args.quick else (args.reps, 30)
    load_start = host_load()
    data = load_dataset(args.data, max_users=args.max_users)
    options, serving = served_settings()
    rows = []
    for n in args.histories:
        with tempfile.TemporaryDirectory(prefix="genrec-stage-phases-", dir=scratch_parent()) as tmp:
            repo = Path(tmp) / "model_repository"
            publish(args.checkpoint, repo, serving)
            for stage, phases in PHASES.items():
                model_py = repo / stage / "1" / "model.py"
                model_py.write_text(model_py.read_text() + TIMERS % (phases, str(Path(tmp) / f"{stage}.json")))
            with serve_repository(repo) as server:
                client, stats = RecommenderClient(server.grpc_url), grpcclient.InferenceServerClient(server.grpc_url)
                client.open_session("phases", *long_history(data, n), **options)
                compute = {stage: [] for stage in PHASES}
                for i in range(warmup + reps):
                    before = {stage: compute_infer_ns(stats, stage) for stage in PHASES}
                    client.recommend("phases", **options)
                    if i >= warmup:
                        for stage in PHASES:
                            compute[stage].append((compute_infer_ns(stats, stage) - before[stage]) / 1e6)
                client.close_session("phases")
                client.close()
                stats.close()
            for stage in PHASES:  # the stage's executes: the open, the warm-up and timed recommends, the close
                executes = json.loads((Path(tmp) / f"{stage}.json").read_text())
                executes = executes[-reps - 1:-1] if stage == P.ENCODER else executes[-reps:]
                names = sorted({k for e in executes for k in e})
                phases = {k: statistics.median(e.get(k, 0.0) for e in executes) * 1e3 for k in names}
                row = dict(history=n, stage=stage, reps=reps, compute_infer_p50_ms=statistics.median(compute[stage]), phases_p50_ms=phases)
                rows.append(row)
                log(f"history {n:4d} {stage:16s} compute_infer {row['compute_infer_p50_ms']:.2f} ms; "
                    + ", ".join(f"{k.strip('_')} {v:.3f}" for k, v in phases.items()))
    if args.out != "-":
        save_result(Path(args.out), rows, "perf.experiments.stage_phases", argv, load_start, checkpoint=str(args.checkpoint),
                    data=args.data, options=options)


if __name__ == "__main__":
    main()
