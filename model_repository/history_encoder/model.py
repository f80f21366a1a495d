"""history_encoder: the HSTU backbone over each user session's history (sequence batching).

The first request of a session (START) carries the user's history; later ones only the events
since. The session's HistoryCache (per-layer K/V and final states) stays in this instance,
keyed by the sequence id, and only appended events are encoded (causal HSTU, so appending
equals re-encoding). A history that would exceed max_history keeps its most recent
max_history events: they are re-encoded and the number dropped is returned in TRUNCATED.
Requests of different sessions in one call are encoded in one batched forward/append.
Every request gets the session's whole cached history as outputs for the decoder and ranker.
The session is freed at END, after max idle time, or when the memory bound needs room.
"""
import json
import sys
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils


def _params(args) -> dict:
    cfg = json.loads(args["model_config"])
    return {k: v["string_value"] for k, v in cfg.get("parameters", {}).items()}


def _import_path(params) -> None:
    root = params.get("code_root") or str(Path(__file__).resolve().parents[3])
    if root not in sys.path:
        sys.path.insert(0, root)


class _Plan:
    """What one valid request does."""

    def __init__(self, index, key, start, end, session, items, actions, timestamps, reencode, truncated):
        self.index, self.key, self.start, self.end, self.session = index, key, start, end, session
        self.items, self.actions, self.timestamps = items, actions, timestamps  # new (or re-encoded) events
        self.reencode, self.truncated = reencode, truncated
        self.cache = None
        self.history_items = None  # [n] items of the history rows once committed


class TritonPythonModel:
    def initialize(self, args):
        params = _params(args)
        _import_path(params)
        import torch

        from backend_src.model.hstu import HistoryCache
        from backend_src.model.recommender import GenerativeRecommender
        from backend_src.serving import protocol as P
        from backend_src.serving import validation as V
        from backend_src.serving.session_store import Session, SessionStore

        self.torch, self.P, self.V, self.Session, self.HistoryCache = torch, P, V, Session, HistoryCache
        torch.set_num_threads(int(params.get("torch_threads", 1)))
        vdir = Path(args["model_repository"]) / args["model_version"]
        self.model = GenerativeRecommender.load(vdir / "model.pt")
        self.device = "cuda" if torch.cuda.is_available() else "cpu"  # sessions live where the model runs
        self.model.to(self.device)
        self.model.backbone.warm_up()
        cfg = self.model.cfg
        self.sizes = P.model_sizes(cfg)
        self.max_history = min(int(params.get("max_history", cfg.max_seq_len)), cfg.max_seq_len)
        self.limits = V.Limits(
            max_history=self.max_history,
            num_actions=cfg.num_actions,
            num_codes=cfg.num_codes,
            max_request_events=int(params.get("max_request_events", 100_000)),
            max_top_k=int(params.get("max_top_k", 256)),
            max_beam_width=int(params.get("max_beam_width", 1024)),
        )
        self.defaults = V.decode_defaults(params)
        self.default_top_k = int(params.get("top_k", 10))
        self.store = SessionStore(
            max_bytes=int(params.get("session_max_bytes", 2 << 30)),
            idle_timeout_s=float(params.get("idle_timeout_s", 600)),
        )
        self.max_elements = max(self.limits.max_request_events, 1)

    # ---- one request -> plan (all checks, nothing changes yet) ------------------------------
    def _flag(self, request, name, bit):
        t = pb_utils.get_input_tensor_by_name(request, name)
        if t is not None:
            return bool(np.asarray(t.as_numpy()).reshape(-1)[0])
        return bool(request.flags() & bit)

    def _plan(self, index, request) -> _Plan:
        P, V, torch = self.P, self.V, self.torch
        key = request.correlation_id()
        if key == 0 or key == "":
            raise V.RequestError("history_encoder needs a sequence id (one per user session)")
        start = self._flag(request, P.CONTROL_START, 1)
        end = self._flag(request, P.CONTROL_END, 2)
        read = lambda spec: V.read_input(request, spec, self.sizes, self.max_elements, pb_utils.get_input_tensor_by_name)
        raw = read(P.ITEM_IDS)
        actions = read(P.ACTIONS).reshape(-1).astype(np.int64)
        timestamps = read(P.TIMESTAMPS).reshape(-1).astype(np.int64)
        options = {spec.name: read(spec) for spec in P.OPTION_INPUTS}
        V.parse_options(options, self.defaults, self.default_top_k, self.limits)  # refuse bad options before any change

        session = None if start else self.store.get(key)
        if not start and session is None:
            raise V.RequestError(f"session {key!r} {self.store.why_missing(key)}")
        ids = V.decode_strings(raw, P.ITEM_IDS.name)
        V.check_events(len(ids), actions, timestamps, self.limits, start, None if session is None else session.last_timestamp)
        try:
            items = self.model.item_indices(ids)
        except KeyError as e:
            raise V.unknown_items_error(e) from None

        items, actions, timestamps = (torch.from_numpy(x) for x in (items, actions, timestamps))
        old = 0 if session is None else session.length
        total = old + items.shape[0]
        if session is not None and total <= self.max_history:
            return _Plan(index, key, start, end, session, items, actions, timestamps, reencode=False, truncated=0)
        # START, or the history would grow too long: encode the most recent max_history events
        if session is not None:
            items = torch.cat([session.items, items])
            actions = torch.cat([session.actions, actions])
            timestamps = torch.cat([session.timestamps, timestamps])
        drop = max(0, total - self.max_history)
        return _Plan(index, key, start, end, session, items[drop:], actions[drop:], timestamps[drop:], reencode=True, truncated=drop)

    # ---- batched encoding -------------------------------------------------------------------
    def _pad(self, plans):
        """New events of the plans -> left-aligned [B, n] tensors + lengths [B]."""
        pad = self.torch.nn.utils.rnn.pad_sequence
        lengths = self.torch.tensor([p.items.shape[0] for p in plans], dtype=self.torch.long)
        out = [pad([getattr(p, f) for p in plans], batch_first=True).to(self.device) for f in ("items", "actions", "timestamps")]
        return (*out, lengths.to(self.device))

    def _run(self, plans) -> None:
        encode = [p for p in plans if p.reencode]
        append = [p for p in plans if not p.reencode]
        with self.torch.inference_mode():
            if encode:
                items, actions, ts, lengths = self._pad(encode)
                for p, c in zip(encode, self.model.encode(items, actions, ts, lengths).split()):
                    p.cache = c
            grow = [p for p in append if p.items.shape[0] > 0]
            for p in append:
                if p.items.shape[0] == 0:
                    p.cache = p.session.cache  # nothing new: recommend on the cached history
            if len(grow) == 1:  # one session: its new rows go into its cache's spare rows
                p = grow[0]
                p.cache = self.model.append(p.session.cache, *self._pad(grow), in_place=True)
            elif grow:
                cache = self.HistoryCache.cat([p.session.cache for p in grow])
                items, actions, ts, lengths = self._pad(grow)
                for p, c in zip(grow, self.model.append(cache, items, actions, ts, lengths).split()):
                    p.cache = c

    def _commit(self, p) -> None:
        torch = self.torch
        if p.reencode:
            items, actions, ts = p.items, p.actions, p.timestamps
        else:
            s = p.session
            items, actions, ts = (torch.cat([a, b]) for a, b in ((s.items, p.items), (s.actions, p.actions), (s.timestamps, p.timestamps)))
        p.history_items = items  # the history rows' items, for the ranker's EXCLUDE_SEEN
        if p.end:
            self.store.end(p.key)
        else:
            self.store.put(p.key, self.Session(cache=p.cache, items=items, actions=actions, timestamps=ts))

    def _response(self, p):
        P, c = self.P, p.cache
        n = int(c.lengths[0])
        outs = {
            P.HISTORY_STATES.name: c.states[:, :n],  # [1, n, D]
            P.HISTORY_KEYS.name: c.keys[:, :, :n].transpose(0, 1),  # [1, L, n, H, dh]
            P.HISTORY_VALUES.name: c.values[:, :, :n].transpose(0, 1),
            P.HISTORY_TIMESTAMPS.name: c.timestamps[:, :n],  # [1, n]
            P.HISTORY_ITEMS.name: p.history_items[None],  # [1, n]
        }
        tensors = [pb_utils.Tensor(k, np.ascontiguousarray(v.cpu().numpy())) for k, v in outs.items()]
        tensors.append(pb_utils.Tensor(P.HISTORY_LENGTH.name, np.array([[n]], dtype=np.int64)))
        tensors.append(pb_utils.Tensor(P.TRUNCATED.name, np.array([[p.truncated]], dtype=np.int32)))
        return pb_utils.InferenceResponse(output_tensors=tensors)

    def _error(self, exc):
        if isinstance(exc, self.V.RequestError):
            return pb_utils.InferenceResponse(error=pb_utils.TritonError(exc.message, self.V.error_code(exc.status, pb_utils.TritonError)))
        return pb_utils.InferenceResponse(error=pb_utils.TritonError(f"history_encoder: {type(exc).__name__}: {exc}", pb_utils.TritonError.INTERNAL))

    # ---- Triton entry points ------------------------------------------------------------------
    def execute(self, requests):
        self.store.sweep()
        responses = [None] * len(requests)
        pending = list(enumerate(requests))
        while pending:  # rounds: a session appears at most once a round, in arrival order
            seen, now, later = set(), [], []
            for i, r in pending:
                key = r.correlation_id()
                (later if key in seen else now).append((i, r))
                seen.add(key)
            plans = []
            for i, r in now:
                try:
                    plans.append(self._plan(i, r))
                except Exception as e:  # noqa: BLE001 - a bad request fails alone
                    responses[i] = self._error(e)
            try:
                self._run(plans)
            except Exception as e:  # noqa: BLE001 - the batch fails, the sessions stay as they were
                for p in plans:
                    responses[p.index] = self._error(e)
                plans = []
            for p in plans:
                try:
                    self._commit(p)
                    responses[p.index] = self._response(p)
                except Exception as e:  # noqa: BLE001
                    if type(e).__name__ == "SessionTooLarge":
                        e = self.V.RequestError(str(e), self.P.RESOURCE_EXHAUSTED)
                    responses[p.index] = self._error(e)
            pending = later
        return responses

    def finalize(self):
        self.store.clear()
