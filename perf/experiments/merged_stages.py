"""What does the hop between the decoder and the ranker cost a served request? The benchmark model is published into
a temporary repository that also holds a two-stage ensemble: the history encoder, then one stage whose stub runs the
decoder's and the ranker's own model.py one after the other in one process (the decoder's answer handed to the ranker
as a request made in that process, no trip through the server). One server serves both ensembles; one client sends
each request kind at concurrency 1 to the two in turn, alternating which goes first. Per kind and history length:
each ensemble's client p50, the p50 of the paired differences (two stages minus three) and each stage's Triton
compute. The two-stage ensemble is a measurement only: the served ensemble keeps its three separately versioned
stages. Run from the repository root (needs the benchmark model, `make bench-served` trains it):
    python -m perf.experiments.merged_stages            # -> perf/results/merged_stages.json
    python -m perf.experiments.merged_stages --quick --out -
"""
import shutil
import statistics
import tempfile
from pathlib import Path

from genrec_contract import protocol as P
from perf.common import host_load, log, save_result
from perf.experiments import bench_model_parser, served_settings
from perf.experiments.ab_served_latency import KINDS, in_turn

MERGED = "decode_and_rank"
MERGED_ENSEMBLE = "recommend_two_stages"
CANDIDATES = {t.name for t in P.DECODER_CONTRACT.outputs}
MERGED_CONTRACT = P.ModelContract(
    MERGED,
    inputs=tuple(t for t in P.RANKER_CONTRACT.inputs if t.name not in CANDIDATES) + P.DECODE_OPTION_INPUTS,
    outputs=P.RANKER_CONTRACT.outputs,
    ragged=tuple(n for n in P.RANKER_CONTRACT.ragged if n not in CANDIDATES),
)

# the stage's stub: the published decoder's and ranker's model.py, loaded as modules beside it
MERGED_MODEL_PY = f'''
import importlib.util
from pathlib import Path

import triton_python_backend_utils as pb_utils

HERE = Path(__file__).parent
RANKER_INPUTS = {[t.name for t in P.RANKER_CONTRACT.inputs]!r}
RANKER_OUTPUTS = {[t.name for t in P.RANKER_CONTRACT.outputs]!r}


def _stage(file):
    spec = importlib.util.spec_from_file_location(file[:-3], HERE / file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.TritonPythonModel()


class TritonPythonModel:
    def initialize(self, args):
        self.decoder, self.ranker = _stage("decoder_model.py"), _stage("ranker_model.py")
        self.decoder.initialize(args)
        self.ranker.initialize(args)

    def execute(self, requests):
        responses = self.decoder.execute(requests)
        ranked, to_rank = [], []
        for i, (request, decoded) in enumerate(zip(requests, responses)):
            if not decoded.has_error():
                inputs = [t for t in request.inputs() if t.name() in RANKER_INPUTS] + decoded.output_tensors()
                to_rank.append(pb_utils.InferenceRequest(model_name="{P.RANKER}", inputs=inputs, requested_output_names=RANKER_OUTPUTS))
                ranked.append(i)
        for i, response in zip(ranked, self.ranker.execute(to_rank) if to_rank else []):
            responses[i] = response
        return responses
'''


def add_two_stage_ensemble(repo: Path, cfg, serving) -> None:
    """`repo` (published) gains the merged stage (the ranker's version directory with the decoder's weights and both
    stubs) and the two-stage ensemble over it."""
    from export import triton_configs as T

    version = repo / MERGED / "1"
    shutil.copytree(repo / P.RANKER / "1", version)
    shutil.copy(repo / P.DECODER / "1" / "decoder.pt", version)
    shutil.copy(repo / P.DECODER / "1" / "model.py", version / "decoder_model.py")
    (version / "model.py").rename(version / "ranker_model.py")
    (version / "model.py").write_text(MERGED_MODEL_PY)
    T.atomic_write(repo / MERGED / "config.pbtxt", T.ranker_config(cfg, serving, contract=MERGED_CONTRACT))
    (repo / MERGED_ENSEMBLE / "1").mkdir(parents=True)
    T.atomic_write(repo / MERGED_ENSEMBLE / "config.pbtxt", T.ensemble_config(
        cfg, serving, name=MERGED_ENSEMBLE, wiring=P.ensemble_steps(P.ENCODER_CONTRACT, MERGED_CONTRACT)))


def main(argv=None):
    ap = bench_model_parser(__doc__, "merged_stages.json")
    ap.add_argument("--histories", type=int, nargs="+", default=[50, 512])
    ap.add_argument("--requests", type=int, default=200)
    args = ap.parse_args(argv)

    from perf.served import ServedKinds, long_history, same_runtime_as_the_server, scratch_parent

    same_runtime_as_the_server(argv, module="perf.experiments.merged_stages")
    from backend_src.data import load_dataset
    from export.publish import publish
    from export.triton_configs import config_from_checkpoint
    from perf.served_eval import serve_repository

    reps, warmup = (10, 3) if args.quick else (args.requests, 20)
    load_start = host_load()
    data = load_dataset(args.data, max_users=args.max_users)
    options, serving = served_settings()
    ensembles = {"three_stages": P.ENSEMBLE, "two_stages": MERGED_ENSEMBLE}
    rows = []
    with tempfile.TemporaryDirectory(prefix="genrec-merged-", dir=scratch_parent()) as tmp:
        repo = Path(tmp) / "model_repository"
        publish(args.checkpoint, repo, serving)
        add_two_stage_ensemble(repo, config_from_checkpoint(args.checkpoint), serving)
        with serve_repository(repo) as server:
            for n in args.histories:
                events = long_history(data, n)
                clients = {name: ServedKinds(server.grpc_url, events, options, tag=f"merged-{name}-{n}", model=model)
                           for name, model in ensembles.items()}
                for kind in KINDS:
                    latency, stages = in_turn(clients, kind, reps, warmup)
                    stages = {name: {m: t for m, t in per_model.items() if m not in ensembles.values()} for name, per_model in stages.items()}
                    diff = statistics.median(b - a for a, b in zip(latency["three_stages"], latency["two_stages"]))
                    row = dict(kind=kind, history=n, requests=reps, paired_diff_p50_ms=diff,
                               **{f"{name}_p50_ms": statistics.median(v) for name, v in latency.items()}, stages_ms=stages)
                    rows.append(row)
                    log(f"{kind:9s} history {n:4d}: three stages {row['three_stages_p50_ms']:.2f} ms, two {row['two_stages_p50_ms']:.2f} "
                        f"(paired {diff:+.2f} ms); stages " + "; ".join(
                            f"{name}: " + ", ".join(f"{m} {v:.2f}" for m, v in sorted(s.items())) for name, s in stages.items()))
                for c in clients.values():
                    c.close()
    if args.out != "-":
        save_result(Path(args.out), rows, "perf.experiments.merged_stages", argv, load_start, checkpoint=str(args.checkpoint),
                    data=args.data, options=options)


if __name__ == "__main__":
    main()
