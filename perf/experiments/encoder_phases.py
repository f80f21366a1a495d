"""Where the history encoder's time goes inside its Triton stub, phase by phase. The benchmark model is published
into a temporary repository whose copy of the encoder's model.py gets timers around its phases (parse and check
the request, plan, the base history, encode and write the log (side by side, each timed too), cache, build the
response, publish the metrics; the log's count read is the round minus those), written out when the server unloads
the model. One client sends, one at a time, requests with no events to a cached 50-event session, then one-event
appends to it, then opens of new sessions with 512 events (a visit of one request each); Triton's compute_infer of
the encoder is read around each, and the floor's no-op encoder (perf/floor) is timed the same way for what the stub
and Triton cost without the work. Run from the repository root (needs the benchmark model, `make bench-served`
trains it):
    python -m perf.experiments.encoder_phases            # -> perf/results/encoder_phases.json
    python -m perf.experiments.encoder_phases --quick --out -
"""
import json
import statistics
import tempfile
from pathlib import Path

from genrec_contract import protocol as P
from perf.common import host_load, log, save_result
from perf.experiments import bench_model_parser, served_settings

# (kind, history) in the order they are sent; each kind's requests are one execute each
ROWS = (("recommend", 50), ("append", 50), ("open", 512))

# (label, owner, attribute): the encoder stage's steps (backend_src.serving.stages.encoder) behind the model.py
# adapter, the round's steps first; _run and _write_log run side by side inside _encode_and_log
PHASES = (("_parse", "self.stage", "_parse"), ("_plan", "self.stage", "_plan"), ("_set_base", "self.stage", "_set_base"),
          ("_encode_and_log", "self.stage", "_encode_and_log"), ("_commit", "self.stage", "_commit"),
          ("_response", "self.stage", "_response"), ("_round", "self.stage", "_round"),
          ("_publish_metrics", "self.stage.metrics", "publish"), ("execute", "self", "execute"),
          ("_run", "self.stage", "_run"), ("_write_log", "self.stage", "_write_log"))
LABELS = tuple(label for label, _, _ in PHASES)

# appended to a published copy of a stage's model.py: once the model has loaded, each (label, owner, attribute) of
# the list it is given (owner evaluated with `self`, the model, and `V`, the version's validation module) is timed;
# per execute, each label's wall time (summed over its calls; one not run counts 0), written at unload
TIMERS = '''

_PHASE_TIMES = []


def _time(owner, label, name):
    import time
    inner = getattr(owner, name, None)
    if inner is None:  # a phase this version's stage does not have
        return

    def timed(*args, **kwargs):
        if label == "execute":
            _PHASE_TIMES.append({})
        t0 = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            if _PHASE_TIMES:
                phases = _PHASE_TIMES[-1]
                phases[label] = phases.get(label, 0.0) + time.perf_counter() - t0

    setattr(owner, name, timed)


_initialize_untimed = TritonPythonModel.initialize


def _initialize_timed(self, args):
    _initialize_untimed(self, args)
    from backend_src.serving import validation as V  # the version's own copy, the one its stage calls

    for label, owner, name in %r:
        _time(eval(owner, {"self": self, "V": V}), label, name)


TritonPythonModel.initialize = _initialize_timed
_finalize = getattr(TritonPythonModel, "finalize", lambda self: None)


def _finalize_and_write(self):
    import json
    Path(%r).write_text(json.dumps(_PHASE_TIMES))
    _finalize(self)


TritonPythonModel.finalize = _finalize_and_write
'''


def drive(url: str, events: tuple, long_events: tuple, options: dict, warmup: int, reps: int) -> dict:
    """Per kind: the client's latencies and the encoder's compute_infer (ms), `reps` requests after `warmup`; an
    open is a new session's visit of one request with `long_events` (logged and encoded whole)."""
    import tritonclient.grpc as grpcclient

    from clients.client import RecommenderClient
    from perf.served import compute_infer_ns

    client, stats = RecommenderClient(url), grpcclient.InferenceServerClient(url)
    items, actions, ts = events
    client.open_session("phases", items, actions, ts, **options)
    out, step = {}, [0]

    def append():
        step[0] += 1
        return client.append("phases", [items[step[0] % len(items)]], [actions[-1]], [ts[-1] + step[0]], **options)

    def open_new():
        step[0] += 1
        return client.open_session(f"phases-open-{step[0]}", *long_events, end_visit=True, **options)

    calls = {"recommend": lambda: client.recommend("phases", **options), "append": append, "open": open_new}
    for kind, _ in ROWS:
        call, latency, compute = calls[kind], [], []
        for i in range(warmup + reps):
            before = compute_infer_ns(stats, P.ENCODER)
            ms = call().latency_ms
            if i >= warmup:
                latency.append(ms)
                compute.append((compute_infer_ns(stats, P.ENCODER) - before) / 1e6)
        out[kind] = dict(client_p50_ms=statistics.median(latency), encoder_compute_p50_ms=statistics.median(compute))
    client.close_session("phases")
    client.close()
    stats.close()
    return out


def main(argv=None):
    ap = bench_model_parser(__doc__, "encoder_phases.json")
    ap.add_argument("--reps", type=int, default=300)
    args = ap.parse_args(argv)

    from backend_src.data import load_dataset
    from backend_src.model.recommender import GenerativeRecommender
    from export.publish import publish
    from perf.floor import floor_server
    from perf.served import long_history, same_runtime_as_the_server, scratch_parent
    from perf.served_eval import serve_repository

    same_runtime_as_the_server(None, module="perf.experiments.encoder_phases")
    reps, warmup = (10, 3) if args.quick else (args.reps, 20)
    load_start = host_load()
    data = load_dataset(args.data, max_users=args.max_users)
    events, long_events = long_history(data, 50), long_history(data, 512)
    options, serving = served_settings()
    with tempfile.TemporaryDirectory(prefix="genrec-phases-", dir=scratch_parent()) as tmp:
        repo, times_file = Path(tmp) / "model_repository", Path(tmp) / "phases.json"
        publish(args.checkpoint, repo, serving)
        model_py = repo / P.ENCODER / "1" / "model.py"
        model_py.write_text(model_py.read_text() + TIMERS % (PHASES, str(times_file)))
        with serve_repository(repo) as server:
            served = drive(server.grpc_url, events, long_events, options, warmup, reps)
        with floor_server(GenerativeRecommender.load(args.checkpoint).cfg, serving) as floor:
            no_op = drive(floor.grpc_url, events, long_events, options, warmup, reps)
        times = json.loads(times_file.read_text())
    # the stage's executes in order: the open, then each kind's warm-up and timed requests, then the close
    rows = []
    for k, (kind, history) in enumerate(ROWS):
        first = 1 + k * (warmup + reps) + warmup
        executes = times[first:first + reps]
        phases = {name: statistics.median(e.get(name, 0.0) for e in executes) * 1e3 for name in LABELS}
        phases["log_count_read_and_rest"] = statistics.median(
            e["_round"] - sum(e.get(n, 0.0) for n in LABELS[:6]) for e in executes) * 1e3
        rows.append(dict(kind=kind, history=history, reps=reps, **served[kind], floor_encoder_compute_p50_ms=no_op[kind]["encoder_compute_p50_ms"],
                         phases_p50_ms=phases))
        log(f"{kind}: encoder compute {served[kind]['encoder_compute_p50_ms']:.2f} ms (floor "
            f"{no_op[kind]['encoder_compute_p50_ms']:.2f}); execute {phases['execute']:.2f} ms: "
            + ", ".join(f"{n.strip('_')} {v:.3f}" for n, v in phases.items() if n not in ("execute", "_round")))
    if args.out != "-":
        save_result(Path(args.out), rows, "perf.experiments.encoder_phases", argv, load_start, checkpoint=str(args.checkpoint),
                    data=args.data, options=options)


if __name__ == "__main__":
    main()
