"""How close can any stub come to Triton's floor? The benchmark model is published twice: as served, and with every
stage's model.py replaced by a bare one that does only what the in-process request does, on the published stage's
own model and event log: the encoder reads the events as they come (no checks, no log count, no session store, no
metrics) and encodes, appends and logs them as the in-process request does; the decoder decodes the states with the
served defaults (no checks, no option parsing); the ranker ranks the candidates in the served order (no checks). Each bare
stage answers with the served stage's own response code. A bare stub is the least any stub can do and still answer
the request, so its overhead over the in-process request and the floor is what remains of the three-process
pipeline on this host whatever a stub's request handling costs. It is a measurement only: without its checks a bare
stub changes state on bad input.

One client sends each request kind at concurrency 1 through the served server, the bare server, the floor and the
in-process request in turn (every order of the four in rotation, as the served benchmark's rounds). Per kind and
history: the four p50s, served - in-process - floor and bare - in-process - floor (with 95% intervals from resampling
the rounds), and each stage's Triton compute.
Run from the repository root (needs the benchmark model, `make bench-served` trains it):
    python -m perf.experiments.bare_stages            # -> perf/results/bare_stages.json
    python -m perf.experiments.bare_stages --quick --out -
"""
import itertools
import statistics
import tempfile
from pathlib import Path

from genrec_contract import protocol as P
from perf.common import host_load, log, save_result
from perf.experiments import bench_model_parser, served_settings

# replaces each stage's model.py; the published one is kept beside it as served_model.py, and its stage
# (backend_src.serving.stages) does the work
BARE_MODEL_PY = '''
import importlib.util
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch
import triton_python_backend_utils as pb_utils

HERE = Path(__file__).parent


def _served_model():
    spec = importlib.util.spec_from_file_location("served_model", HERE / "served_model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.TritonPythonModel()


def _inputs(request):
    return {t.name(): t.as_numpy() for t in request.inputs()}


class TritonPythonModel:
    def initialize(self, args):
        self.served = _served_model()
        self.served.initialize(args)  # puts the version's own package first on the path
        from backend_src.serving.stages import stub
        from backend_src.serving.stages.ranker import Ranking
        from genrec_contract import protocol as P

        self.stage, self.stub, self.P, self.Ranking = self.served.stage, stub, P, Ranking
        self._execute = {"%(encoder)s": self._encoder, "%(decoder)s": self._decoder, "%(ranker)s": self._ranker}[args["model_name"]]
        self.sessions = {}  # the encoder's: session key -> (cache, items tensor, events logged)

    def execute(self, requests):
        return self._execute(requests)

    def _encoder(self, requests):
        s = self.stage
        responses = []
        for r in requests:
            x = _inputs(r)
            key = self.P.session_key(r.correlation_id())
            ids = list(map(bytes.decode, x["%(items)s"].reshape(-1).tolist()))
            actions = x["%(actions)s"].reshape(-1).astype(np.int64)
            ts = x["%(timestamps)s"].reshape(-1).astype(np.int64)
            n, known = len(ids), self.sessions.get(key)
            with torch.inference_mode():
                if n == 0:
                    cache, items, count = known
                elif known is None:  # an open: the log written beside the encode, as the stage does
                    written = s._log_writer.submit(s.log.replace, key, ids, actions, ts) if n >= s.write_aside_events else None
                    items = torch.from_numpy(s.model.item_indices(ids))
                    cache = s.model.encode(items[None], torch.from_numpy(actions)[None], torch.from_numpy(ts)[None], torch.tensor([n]))
                    count = written.result() if written is not None else s.log.replace(key, ids, actions, ts)
                else:  # an append: encoded into the cached session, then logged
                    old, old_items, logged = known
                    new = torch.from_numpy(s.model.item_indices(ids))
                    cache = s.model.append(old, new[None], torch.from_numpy(actions)[None], torch.from_numpy(ts)[None],
                                           torch.tensor([n]), in_place=True)
                    count = s.log.append_many([(key, logged, ids, actions, ts)])[0]
                    items = torch.cat([old_items, new])
            count = int(count)
            self.sessions[key] = (cache, items, count)
            responses.append(s._response(SimpleNamespace(cache=cache, history=(items,), truncated=0, count=count, restored=False)))
        return self.stub.triton_responses(responses, pb_utils)

    def _decoder(self, requests):
        s, P = self.stage, self.P
        responses = []
        for r in requests:
            items, log_probs, codes = s._decode([_inputs(r)[P.HISTORY_STATES.name][0]], s.defaults)
            responses.append(pb_utils.InferenceResponse(output_tensors=[
                pb_utils.Tensor(P.CANDIDATE_ITEMS.name, items), pb_utils.Tensor(P.CANDIDATE_LOG_PROBS.name, log_probs),
                pb_utils.Tensor(P.CANDIDATE_CODES.name, codes)]))
        return responses

    def _ranker(self, requests):
        s, P = self.stage, self.P
        responses = []
        for r in requests:
            x = _inputs(r)
            one = lambda spec: x[spec.name][0]  # noqa: E731
            ranking = self.Ranking(
                one(P.HISTORY_STATES)[-1], one(P.HISTORY_KEYS), one(P.HISTORY_VALUES), one(P.HISTORY_TIMESTAMPS),
                one(P.HISTORY_ITEMS), one(P.CANDIDATE_ITEMS), one(P.CANDIDATE_LOG_PROBS), one(P.CANDIDATE_CODES),
                s.default_top_k, False)
            items, scores, log_probs, codes = (t.numpy() for t in s._order([ranking]))
            k = min(ranking.top_k, ranking.candidates.shape[0])
            responses.append(pb_utils.InferenceResponse(output_tensors=[
                pb_utils.Tensor(P.RECOMMENDED_IDS.name, s.raw_ids[items[0, :k]][None]),
                pb_utils.Tensor(P.RANK_SCORES.name, scores[:, :k].astype(np.float32)),
                pb_utils.Tensor(P.RETRIEVAL_LOG_PROBS.name, log_probs[:, :k].astype(np.float32)),
                pb_utils.Tensor(P.SEMANTIC_IDS.name, codes[:, :k].astype(np.int32))]))
        return responses

    def finalize(self):
        if hasattr(self.served, "finalize"):
            self.served.finalize()
''' % {"encoder": P.ENCODER, "decoder": P.DECODER, "ranker": P.RANKER, "items": P.ITEM_IDS.name, "actions": P.ACTIONS.name,
       "timestamps": P.TIMESTAMPS.name}

MEASURES = ("served", "bare", "floor", "in_process")
# every order of the four in rotation: each measurement follows each of the others equally often
TURN_ORDERS = tuple(itertools.permutations(MEASURES))


def make_bare(repo: Path) -> None:
    """Every Python stage of the published repository `repo` gets the bare model.py."""
    for stage in P.PYTHON_MODELS:
        version = repo / stage / "1"
        (version / "model.py").rename(version / "served_model.py")
        (version / "model.py").write_text(BARE_MODEL_PY)


def main(argv=None):
    ap = bench_model_parser(__doc__, "bare_stages.json")
    ap.add_argument("--histories", type=int, nargs="+", default=[50, 512])
    ap.add_argument("--requests", type=int, default=200)
    args = ap.parse_args(argv)

    from perf.served import (KINDS, InProcess, ServedKinds, _per_request_ms, long_history, overhead_ci95, pct,
                             same_runtime_as_the_server, scratch_parent)

    same_runtime_as_the_server(argv, module="perf.experiments.bare_stages")
    from backend_src.data import load_dataset
    from backend_src.model.recommender import GenerativeRecommender
    from export.publish import publish
    from perf.floor import floor_server
    from perf.served_eval import serve_repository

    reps, warmup = 8 if args.quick else args.requests, 3
    load_start = host_load()
    data = load_dataset(args.data, max_users=args.max_users)
    model = GenerativeRecommender.load(args.checkpoint)
    options, serving = served_settings()
    rows = []
    with tempfile.TemporaryDirectory(prefix="genrec-bare-", dir=scratch_parent()) as tmp:
        repos = {name: Path(tmp) / name / "model_repository" for name in ("served", "bare")}
        for repo in repos.values():
            publish(args.checkpoint, repo, serving)
        make_bare(repos["bare"])
        with serve_repository(repos["served"]) as served_server, serve_repository(repos["bare"]) as bare_server, \
                floor_server(model.cfg, serving) as floor_server_:
            urls = {"served": served_server.grpc_url, "bare": bare_server.grpc_url, "floor": floor_server_.grpc_url}
            for n in args.histories:
                events = long_history(data, n)
                measure = {name: ServedKinds(url, events, options, f"bare-{name}-{n}") for name, url in urls.items()}
                measure["in_process"] = InProcess(model, events, serving.decode, options["top_k"], serving.torch_threads,
                                                  Path(tmp) / f"in-process-{n}.sqlite3", serving.log_durability)
                for kind in KINDS:
                    samples = {name: [] for name in MEASURES}
                    for r in range(warmup + reps):
                        if r == warmup:  # Triton's statistics from here on
                            for name in urls:
                                measure[name].stats.pop(kind, None)
                        for name in TURN_ORDERS[r % len(TURN_ORDERS)]:
                            took = measure[name](kind) if name != "in_process" else measure[name](kind, parts=False)["total"]
                            if r >= warmup:
                                samples[name].append(took)
                    p50 = {name: statistics.median(v) for name, v in samples.items()}
                    row = dict(kind=kind, history=n, requests=reps, **{f"{name}_p50_ms": v for name, v in p50.items()},
                               served_p99_ms=pct(samples["served"])["p99_ms"], bare_p99_ms=pct(samples["bare"])["p99_ms"])
                    for name in ("served", "bare"):
                        row[f"{name}_overhead_p50_ms"] = p50[name] - p50["in_process"] - p50["floor"]
                        row[f"{name}_overhead_p50_ci95_ms"] = overhead_ci95(samples[name], samples["in_process"], samples["floor"])
                    row["stages_ms"] = {name: {m: v["compute_infer"] for m, v in _per_request_ms(measure[name].stats[kind]).items()}
                                        for name in urls}
                    rows.append(row)
                    log(f"{kind:9s} history {n:4d}: served {p50['served']:.2f}, bare {p50['bare']:.2f}, floor {p50['floor']:.2f}, "
                        f"in-process {p50['in_process']:.2f} ms; over in-process + floor: served {row['served_overhead_p50_ms']:+.2f}, "
                        f"bare {row['bare_overhead_p50_ms']:+.2f} ms")
                for m in measure.values():
                    m.close()
    if args.out != "-":
        save_result(Path(args.out), rows, "perf.experiments.bare_stages", argv, load_start, checkpoint=str(args.checkpoint),
                    data=args.data, options=options)


if __name__ == "__main__":
    main()
