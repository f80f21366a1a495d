"""gRPC client of the served recommender (the ``recommend`` ensemble).

One user session = one Triton sequence (sequence id = session id). The first request of a
session (``open_session``) carries the user's history and starts the sequence; ``append`` sends
only the events since; ``recommend`` asks again without new events; ``close_session`` ends the
sequence, which frees the session's cached history on the server. Every request answers with
the session's current top-K recommendations.

    client = RecommenderClient("localhost:8001")
    rec = client.open_session("u1", ["B0001", "B0002"], timestamps=[1700000000, 1700000060])
    rec = client.append("u1", ["B0003"], [5], [1700000120], top_k=5)
    client.close_session("u1")

Tensor names, dtypes and shapes come from ``backend_src.serving.protocol`` (the contract);
this module needs only numpy and tritonclient (no torch), so it also runs in a load-testing
environment.

Session loss: the server keeps a session's history in the history encoder's memory. A session
ends at ``close_session``, after the server's idle timeout, when session memory needs room, or
when a new version of the history encoder is loaded (sessions do not survive a hot swap). A
request for such a session raises ``SessionLost``. The client keeps each open session's events
(``keep_history=True``), so ``ensure_session`` can start it again with the full history, and
``auto_restart=True`` does that by itself and then retries the request once.
"""
from __future__ import annotations

import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Sequence

import numpy as np
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from backend_src.serving import protocol as P

MAX_STRING_ID = 128  # longer string sequence ids are refused by the server
_INT64_RANGE = 1 << 64

# decode option keyword -> tensor of the contract
OPTION_TENSORS = {
    "top_k": P.TOP_K,
    "exclude_seen": P.EXCLUDE_SEEN,
    "beam_width": P.BEAM_WIDTH,
    "mode": P.DECODE_MODE,
    "pfa_k": P.PFA_K,
    "pfa_r": P.PFA_R,
    "selection_step": P.SELECTION_STEP,
}

# The cheapest valid END request: no new events (nothing is encoded) and the smallest decode
# (one beam, one row attended, top 1). The ensemble still runs the decoder and ranker once.
CLOSE_OPTIONS = {"top_k": 1, "beam_width": 1, "mode": "pfa", "pfa_k": 1, "pfa_r": 1.0, "selection_step": 0}

# Phrases of the server's answers that mean "this session is gone: start it again".
# The sequence batcher refuses a non-START request of a sequence it does not know (never started,
# ended, timed out, or the model was reloaded); the history encoder names why it has no session.
_LOST_MARKERS = (
    "must specify the START flag",
    "start it again with sequence_start",
    "was never started",
)

_OUTPUTS = (P.RECOMMENDED_IDS, P.RANK_SCORES, P.RETRIEVAL_LOG_PROBS, P.SEMANTIC_IDS, P.HISTORY_LENGTH, P.TRUNCATED)


class RecommenderError(RuntimeError):
    """A request the server refused or could not serve.

    status: the gRPC status name (e.g. "INVALID_ARGUMENT", "UNAVAILABLE", "DEADLINE_EXCEEDED");
    message: the server's message, which names the problem."""

    def __init__(self, status: str, message: str, session_id=None):
        self.status = status
        self.message = message
        self.session_id = session_id
        where = f"session {session_id!r}: " if session_id is not None else ""
        super().__init__(f"{where}{status}: {message}")


class SessionLost(RecommenderError):
    """The server no longer has this session (ended, idle timeout, evicted, or a new model
    version was loaded): open it again with the full history (``ensure_session`` does)."""


@dataclass
class Recommendation:
    item_ids: list  # raw item ids of the data set, best first (empty slots left out)
    rank_scores: np.ndarray  # [K] M-FALCON ranking logits
    retrieval_log_probs: np.ndarray  # [K] beam log-probability of each item
    semantic_ids: np.ndarray  # [K, C] int32 semantic ID of each item
    history_length: int  # events in the session's history after this request
    truncated: int  # oldest events dropped by this request (history longer than the server keeps)
    latency_ms: float  # client-side round trip of the request

    def to_dict(self) -> dict:
        d = asdict(self)
        for k in ("rank_scores", "retrieval_log_probs", "semantic_ids"):
            d[k] = np.asarray(getattr(self, k)).tolist()
        return d


@dataclass
class _History:
    """Events of one session kept on the client, for restarting a lost session."""

    items: list = field(default_factory=list)
    actions: list = field(default_factory=list)
    timestamps: list = field(default_factory=list)

    def extend(self, items, actions, timestamps, limit: int) -> None:
        self.items += list(items)
        self.actions += [int(a) for a in actions]
        self.timestamps += [int(t) for t in timestamps]
        if len(self.items) > limit:  # the server keeps fewer anyway: keep the most recent
            del self.items[:-limit], self.actions[:-limit], self.timestamps[:-limit]


def wire_session_id(session_id):
    """A session id as the server's sequence id: a non-zero int (ids >= 2**63 travel as negative
    int64) or a non-empty string of at most 128 characters."""
    if isinstance(session_id, (bool, np.bool_)):
        raise ValueError("session id must be an int or a string, got a bool")
    if isinstance(session_id, (int, np.integer)):
        sid = int(session_id)
        if sid == 0:
            raise ValueError("session id 0 means 'no sequence'; use a non-zero id")
        if not -(1 << 63) <= sid < _INT64_RANGE:
            raise ValueError(f"integer session id must fit in 64 bits, got {sid}")
        return sid - _INT64_RANGE if sid >= 1 << 63 else sid
    if isinstance(session_id, str):
        if not session_id:
            raise ValueError("session id must not be empty")
        if len(session_id) > MAX_STRING_ID:
            raise ValueError(f"string session id must have at most {MAX_STRING_ID} characters, got {len(session_id)}")
        return session_id
    raise TypeError(f"session id must be an int or a string, got {type(session_id).__name__}")


def _status_name(exc: InferenceServerException) -> str:
    s = exc.status() or "UNKNOWN"
    return s.split(".")[-1]  # "StatusCode.INVALID_ARGUMENT" -> "INVALID_ARGUMENT"


def _input(spec: P.TensorSpec, array: np.ndarray):
    t = grpcclient.InferInput(spec.name, list(array.shape), spec.dtype)
    t.set_data_from_numpy(array)
    return t


def option_inputs(options: dict) -> list:
    """Options (top_k, exclude_seen, beam_width, mode, pfa_k, pfa_r, selection_step) -> input
    tensors; options left out (or None) take the server's defaults."""
    out = []
    for key, value in options.items():
        if value is None:
            continue
        spec = OPTION_TENSORS.get(key)
        if spec is None:
            raise TypeError(f"unknown option {key!r}; options are {', '.join(OPTION_TENSORS)}")
        v = value.encode() if isinstance(value, str) else value
        out.append(_input(spec, np.array([[v]], dtype=spec.numpy_dtype)))
    return out


def event_inputs(item_ids: Sequence, actions: Sequence | None, timestamps: Sequence | None) -> tuple:
    """New events -> (ITEM_IDS, ACTIONS, TIMESTAMPS inputs, actions list, timestamps list).
    Missing actions are 0 (none); missing timestamps are the current time."""
    n = len(item_ids)
    actions = [0] * n if actions is None else [int(a) for a in actions]
    if timestamps is None:
        timestamps = [int(time.time())] * n
    timestamps = [int(t) for t in timestamps]
    if len(actions) != n or len(timestamps) != n:
        raise ValueError(f"item_ids, actions and timestamps must have the same length, got {n}, {len(actions)}, {len(timestamps)}")
    ids = np.array([str(x).encode() for x in item_ids], dtype=object).reshape(1, n)
    inputs = [
        _input(P.ITEM_IDS, ids),
        _input(P.ACTIONS, np.asarray(actions, np.int64).reshape(1, n)),
        _input(P.TIMESTAMPS, np.asarray(timestamps, np.int64).reshape(1, n)),
    ]
    return inputs, actions, timestamps


def parse_response(result, latency_ms: float) -> Recommendation:
    ids = [x.decode() if isinstance(x, bytes) else str(x) for x in result.as_numpy(P.RECOMMENDED_IDS.name)[0]]
    scores = result.as_numpy(P.RANK_SCORES.name)[0]
    log_probs = result.as_numpy(P.RETRIEVAL_LOG_PROBS.name)[0]
    codes = result.as_numpy(P.SEMANTIC_IDS.name)[0]
    keep = np.array([x != "" for x in ids], dtype=bool)  # "" = empty slot (fewer items than TOP_K)
    return Recommendation(
        item_ids=[x for x in ids if x != ""],
        rank_scores=scores[keep],
        retrieval_log_probs=log_probs[keep],
        semantic_ids=codes[keep],
        history_length=int(result.as_numpy(P.HISTORY_LENGTH.name).reshape(-1)[0]),
        truncated=int(result.as_numpy(P.TRUNCATED.name).reshape(-1)[0]),
        latency_ms=latency_ms,
    )


class RecommenderClient:
    """Sessions of the ``recommend`` ensemble over gRPC. One client may be shared by threads;
    a session's requests must not overlap (the server applies them in arrival order)."""

    def __init__(
        self,
        url: str = "localhost:8001",
        model: str = P.ENSEMBLE,
        timeout_s: float = 60.0,
        keep_history: bool = True,
        auto_restart: bool = False,
        history_limit: int = 100_000,
        verbose: bool = False,
    ):
        self.url, self.model, self.timeout_s = url, model, timeout_s
        self.keep_history = keep_history or auto_restart
        self.auto_restart = auto_restart
        self.history_limit = history_limit
        self._client = grpcclient.InferenceServerClient(url, verbose=verbose)
        self._histories: dict = {}
        self._lock = threading.Lock()
        self.restarts = 0  # sessions started again after SessionLost

    # ---- sessions ---------------------------------------------------------------------------
    def open_session(self, session_id, item_ids: Sequence, actions=None, timestamps=None, **options) -> Recommendation:
        """Start a session with the user's history (at least one event; oldest first)."""
        inputs, actions, timestamps = event_inputs(item_ids, actions, timestamps)
        rec = self._infer(session_id, inputs + option_inputs(options), start=True)
        if self.keep_history:
            h = _History()
            h.extend(item_ids, actions, timestamps, self.history_limit)
            with self._lock:
                self._histories[session_id] = h
        return rec

    def append(self, session_id, item_ids: Sequence, actions=None, timestamps=None, **options) -> Recommendation:
        """Add the events since the last request (may be none) and get fresh recommendations."""
        inputs, actions, timestamps = event_inputs(item_ids, actions, timestamps)
        try:
            rec = self._infer(session_id, inputs + option_inputs(options))
        except SessionLost:
            if not (self.auto_restart and self.has_history(session_id)):
                raise
            # start again with the kept history plus these events, in one request
            h = self._histories[session_id]
            self.restarts += 1
            return self.open_session(session_id, h.items + list(item_ids), h.actions + actions, h.timestamps + timestamps, **options)
        if self.keep_history and item_ids:
            with self._lock:
                self._histories.setdefault(session_id, _History()).extend(item_ids, actions, timestamps, self.history_limit)
        return rec

    def recommend(self, session_id, **options) -> Recommendation:
        """Recommendations for the session's current history (an append with no events)."""
        return self.append(session_id, [], [], [], **options)

    def close_session(self, session_id) -> bool:
        """End the session (the server frees its history). False if the server no longer had it."""
        with self._lock:
            self._histories.pop(session_id, None)
        inputs, _, _ = event_inputs([], [], [])
        try:
            self._infer(session_id, inputs + option_inputs(CLOSE_OPTIONS), end=True, outputs=(P.HISTORY_LENGTH,))
        except SessionLost:
            return False
        return True

    def recommend_history(self, session_id, item_ids: Sequence, actions=None, timestamps=None, **options) -> Recommendation:
        """One-shot: a whole history in one request that starts and ends its session."""
        inputs, _, _ = event_inputs(item_ids, actions, timestamps)
        return self._infer(session_id, inputs + option_inputs(options), start=True, end=True)

    def ensure_session(self, session_id, **options) -> Recommendation:
        """Recommendations for the session; if the server lost it, start it again with the
        history this client kept (needs keep_history)."""
        try:
            return self._infer(session_id, event_inputs([], [], [])[0] + option_inputs(options))
        except SessionLost:
            h = self._histories.get(session_id)
            if h is None or not h.items:
                raise
            self.restarts += 1
            return self.open_session(session_id, list(h.items), list(h.actions), list(h.timestamps), **options)

    def has_history(self, session_id) -> bool:
        h = self._histories.get(session_id)
        return h is not None and bool(h.items)

    def history(self, session_id) -> tuple:
        """(item_ids, actions, timestamps) this client kept for the session."""
        h = self._histories.get(session_id, _History())
        return list(h.items), list(h.actions), list(h.timestamps)

    # ---- server -------------------------------------------------------------------------------
    def health(self) -> dict:
        """Server liveness/readiness and version, and each served model's readiness and versions."""
        out = {"url": self.url}
        try:
            out["live"] = self._client.is_server_live(client_timeout=self.timeout_s)
            out["ready"] = self._client.is_server_ready(client_timeout=self.timeout_s)
            meta = self._client.get_server_metadata(client_timeout=self.timeout_s)
            out["server"] = {"name": meta.name, "version": meta.version}
        except InferenceServerException as e:
            return {**out, "live": False, "ready": False, "error": f"{_status_name(e)}: {e.message()}"}
        models = {}
        for name in P.ALL_MODELS:
            try:
                ready = self._client.is_model_ready(name, client_timeout=self.timeout_s)
                versions = list(self._client.get_model_metadata(name, client_timeout=self.timeout_s).versions) if ready else []
            except InferenceServerException as e:
                ready, versions = False, []
                models[name] = {"ready": False, "error": e.message()}
                continue
            models[name] = {"ready": ready, "versions": versions}
        out["models"] = models
        out["ready"] = bool(out["ready"] and all(m["ready"] for m in models.values()))
        return out

    def close(self) -> None:
        self._client.close()

    def __enter__(self) -> "RecommenderClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- one request --------------------------------------------------------------------------
    def _infer(self, session_id, inputs, start: bool = False, end: bool = False, outputs=_OUTPUTS) -> Recommendation | None:
        sid = wire_session_id(session_id)
        requested = [grpcclient.InferRequestedOutput(o.name) for o in outputs]
        t0 = time.perf_counter()
        try:
            result = self._client.infer(
                self.model, inputs, outputs=requested, sequence_id=sid, sequence_start=start, sequence_end=end,
                client_timeout=self.timeout_s,
            )
        except InferenceServerException as e:
            status, message = _status_name(e), e.message() or str(e)
            if not start and any(m in message for m in _LOST_MARKERS):
                raise SessionLost(status, message, session_id) from None
            raise RecommenderError(status, message, session_id) from None
        latency_ms = (time.perf_counter() - t0) * 1e3
        if len(outputs) < len(_OUTPUTS):
            return None
        return parse_response(result, latency_ms)
