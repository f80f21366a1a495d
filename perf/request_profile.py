"""Where one served request's time goes, stage by stage and phase by phase.

The three stages run in this process exactly as the server's stubs run them (the version published
into a temporary repository, each stage's ``handle`` on the requests the ensemble would hand it:
the encoder's answer feeds the decoder, both feed the ranker), one request at a time, with the
functions of each phase wrapped in timers:

  history_encoder  read the log's counts; the model's encode or append; the log write; the answer
  pfa_decoder      read and check the inputs; per decoding step the beams' query, their attention
                   over the history (PFA's selection included), the head's layers, the code scores
                   (node output included), top-k and the new beams; the search's set-up and results
  mfalcon_ranker   read and check the inputs; M-FALCON scores; the dense head; the co-visitation
                   lookup; the served order; the answer

"Python between" is what the stage's ``handle`` took beyond its phases. Medians over the requests.

    python -m perf.request_profile --checkpoint runs/beauty/model.pt --data amazon-beauty --exclude-seen
"""
from __future__ import annotations

import argparse
import contextlib
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

from backend_src.results import markdown_table
from genrec_contract import protocol as P


class Timers:
    """Wraps callables in timers for the length of a `with`; `take()` returns and clears the
    seconds each label took since the last take."""

    def __init__(self):
        self.spent = defaultdict(float)
        self._restore = []

    def wrap(self, owner, name: str, label):
        """owner.name (an instance's, a class's or a module's attribute) timed under label, a string
        or a function of the call's arguments giving one."""
        original = getattr(owner, name)

        def timed(*args, **kwargs):
            key = label if isinstance(label, str) else label(*args, **kwargs)
            t0 = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.spent[key] += time.perf_counter() - t0

        self._restore.append((owner, name, vars(owner).get(name), name in vars(owner)))
        setattr(owner, name, timed)

    def take(self) -> dict:
        out, self.spent = dict(self.spent), defaultdict(float)
        return out

    def close(self) -> None:
        for owner, name, value, had in reversed(self._restore):
            if had:
                setattr(owner, name, value)
            else:
                delattr(owner, name)
        self._restore.clear()


@contextlib.contextmanager
def instrumented(encoder, decoder, ranker):
    """Timers on the three stages' phases (see the module docstring)."""
    from backend_src.decoding import attention_policies, beam_search

    t = Timers()
    enc, log = encoder, encoder.log
    t.wrap(enc, "handle", "history_encoder")
    t.wrap(log, "counts", "history_encoder: read the log's counts")
    t.wrap(enc, "_run", "history_encoder: encode or append (model)")
    t.wrap(enc, "_write_log", "history_encoder: write the log")
    t.wrap(enc, "_response", "history_encoder: answer")

    dec, model = decoder, decoder.model.decoder
    t.wrap(dec, "handle", "pfa_decoder")
    t.wrap(dec, "_read", "pfa_decoder: read and check inputs")
    t.wrap(sys.modules[type(decoder.graphs).__module__], "generate", "pfa_decoder: beam search")  # what the stage calls
    t.wrap(model, "query", lambda u, p, step: f"pfa_decoder: step {step} query")
    for cls in {attention_policies.AttentionPolicy, *attention_policies.POLICIES.values()}:
        if "attend" in vars(cls):  # each class's own (none calls another's)
            t.wrap(cls, "attend", lambda self, step, q, lp: f"pfa_decoder: step {step} attention")
    t.wrap(model, "head_state", lambda x, attn, step: f"pfa_decoder: step {step} head")
    t.wrap(beam_search, "expand_beams", lambda dec, cb, step, *a: f"pfa_decoder: step {step} code scores (node output too), top-k, beams")

    rk = ranker
    t.wrap(rk, "handle", "mfalcon_ranker")
    t.wrap(rk, "_read", "mfalcon_ranker: read and check inputs")
    t.wrap(rk.runtime, "score", "mfalcon_ranker: M-FALCON scores")
    t.wrap(rk.model, "dense_log_probs", "mfalcon_ranker: dense head")
    t.wrap(rk.model, "covisit_scores", "mfalcon_ranker: co-visitation lookup")
    t.wrap(rk, "served_order", "mfalcon_ranker: served order")
    t.wrap(rk, "_answer", "mfalcon_ranker: answer")
    try:
        yield t
    finally:
        t.close()


def _phases(spent: dict) -> dict:
    """Seconds by label -> milliseconds by phase: the beam search's time outside its steps as its
    "set-up and results", and each stage's time beyond its phases as "Python between"."""
    ms = {k: v * 1e3 for k, v in spent.items()}
    search = ms.pop("pfa_decoder: beam search", None)
    if search is not None:
        steps = sum(v for k, v in ms.items() if k.startswith("pfa_decoder: step "))
        ms["pfa_decoder: beam search set-up and results"] = search - steps
    out = {}
    for stage in (P.ENCODER, P.DECODER, P.RANKER):
        parts = {k: v for k, v in ms.items() if k.startswith(stage + ": ")}
        out[stage] = ms.get(stage, 0.0)
        out.update(parts)
        out[f"{stage}: Python between"] = out[stage] - sum(parts.values())
    return out


def stage_requests(events: tuple, options: dict, history: int):
    """The encoder's inputs of an open with `events` (raw ids, actions, timestamps), of an append of
    its last event to the rest, and of a recommend on the whole history."""
    from clients.client import OPTION_TENSORS

    items, actions, ts = events
    opts = {}
    for key, value in options.items():
        spec = OPTION_TENSORS[key]
        opts[spec.name] = np.array([[value.encode() if isinstance(value, str) else value]], dtype=spec.numpy_dtype)

    def inputs(it, ac, tt, before):
        return {P.ITEM_IDS.name: np.array([[str(x).encode() for x in it]], dtype=object).reshape(1, len(it)),
                P.ACTIONS.name: np.asarray(ac, np.int64).reshape(1, -1),
                P.TIMESTAMPS.name: np.asarray(tt, np.int64).reshape(1, -1),
                P.EVENTS_BEFORE.name: np.array([[before]], np.int64), **opts}

    return {"open": inputs(items, actions, ts, 0), "base": inputs(items[:-1], actions[:-1], ts[:-1], 0),
            "append": inputs(items[-1:], actions[-1:], ts[-1:], len(items) - 1),
            "recommend": inputs([], [], [], len(items))}


def profile(checkpoint, serving, events: tuple, options: dict, requests: int = 100, threads: int = 1) -> list:
    """Rows {kind, history, phase, p50_ms} of open, append and recommend on `events` through the
    three stages of `checkpoint` published with `serving` (export.triton_configs.ServingOptions)."""
    import torch
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    from backend_src.serving.stages.decoder import DecoderStage
    from backend_src.serving.stages.encoder import EncoderStage
    from backend_src.serving.stages.messages import END, START, StageRequest
    from backend_src.serving.stages.ranker import RankerStage
    from export.publish import publish

    torch.set_num_threads(threads)
    rows = []
    with tempfile.TemporaryDirectory(prefix="genrec-profile-") as tmp:
        repo = Path(tmp) / "model_repository"
        publish(checkpoint, repo, serving, export_ranker=serving.ranker_backend != "torch")

        def params(model: str, **override) -> dict:
            cfg = text_format.Parse((repo / model / "config.pbtxt").read_text(), model_config_pb2.ModelConfig())
            return {k: v.string_value for k, v in cfg.parameters.items()} | override

        encoder = EncoderStage(repo / P.ENCODER / "1", params(P.ENCODER, event_log=str(Path(tmp) / "events.sqlite3")))
        decoder = DecoderStage(repo / P.DECODER / "1", params(P.DECODER))
        ranker = RankerStage(repo / P.RANKER / "1", params(P.RANKER))
        req = stage_requests(events, options, len(events[0]))
        history = len(events[0])
        counter = iter(range(1, 10**9))

        def one(stage, request):
            (r,) = stage.handle([request])
            if r.error is not None:
                raise RuntimeError(f"{type(stage).__name__}: {r.error}")
            return r.outputs

        def request(kind: str) -> None:
            sid = next(counter)
            if kind == "append":
                one(encoder, StageRequest(req["base"], sid, START))
            elif kind == "recommend":
                one(encoder, StageRequest(req["open"], sid, START))
            timers.take()  # only the request itself counts
            flags = START if kind == "open" else 0
            e = one(encoder, StageRequest(req[kind], sid, flags))
            d = one(decoder, StageRequest({P.HISTORY_STATES.name: e[P.HISTORY_STATES.name],
                                          **{k: v for k, v in req[kind].items() if k in {s.name for s in P.DECODE_OPTION_INPUTS}}}))
            ranked = {k: e[k] for k in (P.HISTORY_STATES.name, P.HISTORY_KEYS.name, P.HISTORY_VALUES.name,
                                        P.HISTORY_TIMESTAMPS.name, P.HISTORY_ITEMS.name)}
            ranked.update(d)
            ranked.update({k: v for k, v in req[kind].items() if k in (P.TOP_K.name, P.EXCLUDE_SEEN.name)})
            one(ranker, StageRequest(ranked))
            samples.append(_phases(timers.take()))
            one(encoder, StageRequest(req["recommend"] | {P.EVENTS_BEFORE.name: np.array([[history]], np.int64)}, sid, END))

        try:
            with instrumented(encoder, decoder, ranker) as timers:
                for kind in ("open", "append", "recommend"):
                    samples = []
                    for _ in range(requests + 5):
                        request(kind)
                    samples = samples[5:]
                    for phase in samples[0]:
                        rows.append({"kind": kind, "history": history, "phase": phase,
                                     "p50_ms": float(np.median([s.get(phase, 0.0) for s in samples]))})
                    total = [sum(s[st] for st in (P.ENCODER, P.DECODER, P.RANKER)) for s in samples]
                    rows.append({"kind": kind, "history": history, "phase": "all stages", "p50_ms": float(np.median(total))})
        finally:
            encoder.close()
    return rows


def table(rows: list) -> str:
    """One column per request kind, a row per phase."""
    kinds = list(dict.fromkeys(r["kind"] for r in rows))
    phases = list(dict.fromkeys(r["phase"] for r in rows))
    by = {(r["kind"], r["phase"]): r["p50_ms"] for r in rows}
    out = [{"phase": p, **{k: by.get((k, p)) for k in kinds}} for p in phases]
    return markdown_table(out, ["phase", *kinds], floatfmt=".3f")


def main(argv=None) -> int:
    from backend_src.config import DecodeOptions
    from backend_src.data import load_dataset
    from export.triton_configs import ServingOptions
    from perf.served import long_history

    ap = argparse.ArgumentParser(prog="python -m perf.request_profile", description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--data", required=True, help="the data set the checkpoint was trained on (a real history)")
    ap.add_argument("--history", type=int, default=50)
    ap.add_argument("--requests", type=int, default=100)
    ap.add_argument("--beam-width", type=int, default=100)
    ap.add_argument("--pfa-k", type=int, default=256)
    ap.add_argument("--exclude-seen", action="store_true")
    ap.add_argument("--ranker-backend", default="auto", choices=["auto", "torch", "onnx"])
    a = ap.parse_args(argv)
    decode = DecodeOptions(mode="pfa", beam_width=a.beam_width, k=a.pfa_k, r=0.5, selection_step=1)
    serving = ServingOptions(decode=decode, top_k=10, ranker_backend=a.ranker_backend, torch_threads=1)
    options = dict(top_k=10, exclude_seen=a.exclude_seen, beam_width=a.beam_width, mode="pfa", pfa_k=a.pfa_k, pfa_r=0.5,
                   selection_step=1)
    events = long_history(load_dataset(a.data), a.history)
    print(table(profile(a.checkpoint, serving, events, options, a.requests)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
