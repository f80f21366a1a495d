"""gRPC client of the served recommender (the ``recommend`` ensemble).

A user session is keyed by its session id. The server keeps every accepted event of a session
in a durable event log and the session's encoded history in a cache, so a session lives on
between visits, across model versions and restarts; nothing needs to be re-sent.

A *visit* is one Triton sequence: the first request the client sends for a session starts it,
``close_session`` ends it (the server keeps the session), and the server ends a visit that idles
for a few seconds. Every request carries the number of events this client sent before it
(EVENTS_BEFORE), so the server applies each event once: a request that timed out, or failed
while a model was being swapped or a stage restarted, is retried safely: by default for up to
``retry_budget_s`` (30 s, longer than a server restart or a short outage of the log takes), with
full-jitter exponential backoff capped at ``max_backoff_s`` (2 s). Another
writer of the same session (a second device) whose events took the positions this client's
events claimed is not a retry: the server refuses them (ABORTED) naming its count, and
``open_session`` and ``append`` send them again after it (``conflict_retries``).

    client = RecommenderClient("localhost:8001")
    rec = client.open_session("u1", ["B0001", "B0002"], timestamps=[1700000000, 1700000060])
    rec = client.append("u1", ["B0003"], [5], [1700000120], top_k=5)
    client.close_session("u1")        # ends the visit; the history stays on the server

The catalog changes while the server serves: ``catalog_add`` (items with their text, attributes or
vector), ``catalog_retire``, ``catalog_list`` and ``catalog_show``, with the server's admin key
(``admin_key=``); each answer names the catalog version, and so does every recommendation.

Tensor names, dtypes and shapes come from ``genrec_contract.protocol`` (the contract);
this module needs only numpy and tritonclient (no torch), so it also runs in a load-testing
environment.
"""
from __future__ import annotations

import json as _json
import random
import threading
import time
from dataclasses import asdict, dataclass
from typing import Sequence

import numpy as np
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from genrec_contract import protocol as P

MAX_STRING_ID = P.MAX_STRING_ID_BYTES  # longer string sequence ids (UTF-8 bytes) are refused by Triton

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

# Ending a visit needs no recommendations: its END goes straight to the history encoder (the
# stage that holds the visit's sequence), asking only for the event count, so nothing is decoded.

# The sequence batcher's answer to a request of a visit it does not know (never started here,
# idled out, or the encoder was reloaded): the client starts a new visit and sends it again.
_NO_VISIT = "must specify the START flag"
# Answers after which the same request, sent again, can succeed: the server was busy, a stage
# was restarting or being swapped, or the request timed out. Safe to resend: EVENTS_BEFORE
# makes the server apply each event once.
_RETRYABLE = {"UNAVAILABLE", "DEADLINE_EXCEEDED", "RESOURCE_EXHAUSTED", "CANCELLED"}
_STAGE_RESTARTING = ("not healthy", "Stub process", "is not ready", "unavailable", "failed to connect", "Socket closed")
# RESOURCE_EXHAUSTED from gRPC's own size limits ("Sent message larger than max", "received metadata size
# exceeds hard limit"): the same request, sent again, meets the same limit
_TOO_LARGE = ("larger than max", "size exceeds", "too large")

_OUTPUTS = (P.RECOMMENDED_IDS, P.RANK_SCORES, P.RETRIEVAL_LOG_PROBS, P.SEMANTIC_IDS, P.HISTORY_LENGTH, P.TRUNCATED,
            P.EVENT_COUNT, P.RESTORED, P.UNKNOWN_ITEMS, P.CATALOG_VERSION)
_CLOSE_OUTPUTS = (P.EVENT_COUNT,)


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
    """The server holds no events for this session (never opened, or its log was deleted or
    expired): open it with the user's history."""


@dataclass
class Recommendation:
    item_ids: list  # raw item ids of the data set, best first (empty slots left out)
    rank_scores: np.ndarray  # [K] ranking scores of the served order
    retrieval_log_probs: np.ndarray  # [K] beam log-probability of each item
    semantic_ids: np.ndarray  # [K, C] int32 semantic ID of each item
    history_length: int  # events in the session's encoded history after this request (<= max history)
    truncated: int  # oldest events dropped by this request (history longer than the server keeps)
    latency_ms: float  # client-side round trip of the request, retries included
    event_count: int = 0  # events the server holds for the session (all ever accepted)
    restored: bool = False  # the session was rebuilt from the server's event log on this request
    resent: int = 0  # times the events were sent again after another writer's that took their positions
    unknown_items: int = 0  # events of the session's history naming items the serving version does not know
    catalog_version: int = 0  # the catalog version the answer was made at (every item in it live at it)

    def to_dict(self) -> dict:
        d = asdict(self)
        for k in ("rank_scores", "retrieval_log_probs", "semantic_ids"):
            d[k] = np.asarray(getattr(self, k)).tolist()
        return d


@dataclass
class _SessionState:
    count: int | None = None  # events the server holds, as last answered (None: not known yet)
    visit: bool = False  # a visit (Triton sequence) is open from this client


def wire_session_id(session_id):
    """A session id as the server's sequence id, checked so that it travels whole: a non-zero int
    (ids >= 2**63 travel as the negative int64 they wrap to) or a non-empty string of at most
    MAX_STRING_ID bytes in UTF-8, without NUL (see protocol.session_id_problem)."""
    if not isinstance(session_id, (int, np.integer, str, np.bool_)):
        raise TypeError(f"session id must be an int or a string, got {type(session_id).__name__}")
    problem = P.session_id_problem(session_id)
    if problem:
        raise ValueError(problem)
    return P.canonical_session_id(session_id)


def _status_name(exc: InferenceServerException) -> str:
    """The status the server answered with: gRPC's ("StatusCode.INVALID_ARGUMENT" -> "INVALID_ARGUMENT"), or the
    one a stage tagged its message with where Triton has no code for it (FAILED_PRECONDITION)."""
    s = (exc.status() or "UNKNOWN").split(".")[-1]
    return P.status_of(s, exc.message() or "")


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
        event_count=int(result.as_numpy(P.EVENT_COUNT.name).reshape(-1)[0]),
        restored=bool(result.as_numpy(P.RESTORED.name).reshape(-1)[0]),
        unknown_items=int(result.as_numpy(P.UNKNOWN_ITEMS.name).reshape(-1)[0]),
        catalog_version=int(result.as_numpy(P.CATALOG_VERSION.name).reshape(-1)[0]),
    )


class RecommenderClient:
    """Sessions of the ``recommend`` ensemble over gRPC. One client may be shared by threads;
    a session's requests must not overlap (the server applies them in arrival order).

    Retries: a failure the same request can outlive (UNAVAILABLE, a timeout, a stage or server
    restarting) of a request that is safe to send again is retried until `retry_budget_s` seconds
    (30) have passed since the call began: each retry waits a random time in [0, min(max_backoff_s,
    backoff_s * 2**attempt)] (full jitter: 0.1 s doubling up to 2 s), is sent only while time is left
    and gets at most what is left as its timeout. So the defaults outlast a server restart (about 5 s)
    and a few seconds without the event log, and every call ends within max(timeout_s, retry_budget_s).
    `retries` caps the number of retries too (None: only the budget); timeout_s bounds each attempt."""

    def __init__(
        self,
        url: str = "localhost:8001",
        model: str = P.ENSEMBLE,
        timeout_s: float = 30.0,
        retries: int | None = None,
        backoff_s: float = 0.1,
        retry_budget_s: float = 30.0,
        max_backoff_s: float = 2.0,
        headers: dict | None = None,
        verbose: bool = False,
        conflict_retries: int = 8,
        admin_key: str | None = None,
    ):
        self.url, self.model, self.timeout_s = url, model, timeout_s
        self.retries = None if retries is None else int(retries)
        self.backoff_s, self.max_backoff_s, self.retry_budget_s = float(backoff_s), float(max_backoff_s), float(retry_budget_s)
        self._jitter = random.Random()
        self.headers = dict(headers or {})  # sent with every request
        self._client = grpcclient.InferenceServerClient(url, verbose=verbose)
        self._sessions: dict = {}
        self._lock = threading.Lock()
        self.retried = 0  # attempts sent again after a retryable failure
        self.visits_restarted = 0  # requests sent again with START because the server no longer had the visit
        self.conflict_retries = int(conflict_retries)  # re-sends after other writers' events, per call
        self.conflicts_resolved = 0  # events sent again after another writer's (ABORTED)
        self.admin_key = admin_key  # the server's, for the catalog's requests

    # ---- sessions ---------------------------------------------------------------------------
    def open_session(self, session_id, item_ids: Sequence, actions=None, timestamps=None, end_visit: bool = False,
                     **options) -> Recommendation:
        """The user's history as this client service knows it (oldest first). The server applies
        only the events it does not hold yet, so opening a known session again is safe.
        end_visit: this request also ends the visit (a visit of one request)."""
        return self._send_events(session_id, item_ids, actions, timestamps, options, events_before=0, end=end_visit)

    def append(self, session_id, item_ids: Sequence, actions=None, timestamps=None, end_visit: bool = False,
               **options) -> Recommendation:
        """Add the events since the last request (may be none) and get fresh recommendations.
        Applied exactly once, retries included; after another writer's events, if theirs came first."""
        event_inputs(item_ids, actions, timestamps)  # bad events fail here, before any request
        state = self._state(session_id)
        if state.count is None and len(item_ids):
            self.resume(session_id, **options)  # learn how many events the server holds
        return self._send_events(session_id, item_ids, actions, timestamps, options, events_before=state.count, end=end_visit)

    def recommend(self, session_id, end_visit: bool = False, **options) -> Recommendation:
        """Recommendations for the session's current history (no new events)."""
        return self._send(session_id, event_inputs([], [], [])[0], 0, options, events_before=self._state(session_id).count,
                          end=end_visit)

    def resume(self, session_id, end_visit: bool = False, **options) -> Recommendation:
        """Recommendations for a session this client has not talked to yet (e.g. after the client
        service restarted); afterwards ``append`` knows how many events the server holds."""
        return self._send(session_id, event_inputs([], [], [])[0], 0, options, events_before=None, end=end_visit)

    def close_session(self, session_id) -> bool:
        """End the visit: the server frees its sequence slot and keeps the session (its cache and
        log) for the next visit. False if the server holds no events for this session."""
        state = self._state(session_id)
        inputs = event_inputs([], [], [])[0]
        try:
            self._send(session_id, inputs, 0, {}, events_before=state.count, end=True, outputs=_CLOSE_OUTPUTS, model=P.ENCODER)
        except SessionLost:
            return False
        finally:
            state.visit = False
        return True

    def recommend_history(self, session_id, item_ids: Sequence, actions=None, timestamps=None, **options) -> Recommendation:
        """One-shot: a whole history in one request that starts and ends its visit; the session's
        history on the server becomes exactly these events (not idempotent: use open_session
        for a session that lives on)."""
        inputs, _, _ = event_inputs(item_ids, actions, timestamps)
        return self._send(session_id, inputs, len(item_ids), options, events_before=None, start=True, end=True)

    def event_count(self, session_id) -> int | None:
        """Events the server holds for the session, as last answered to this client."""
        s = self._sessions.get(session_id)
        return None if s is None else s.count

    # ---- the living catalog (the server's admin key) ----------------------------------------------
    def catalog_add(self, items: Sequence[dict], replace: bool = False) -> dict:
        """Add up to 10,000 items, one change whole or not at all: each {"id": ..., and "text",
        "attributes" and/or "vector": its content}. An id already added with the same content changes
        nothing (a retry is safe); with other content it is refused (ALREADY_EXISTS) unless `replace`.
        Returns {"version": the catalog version made, "items": [{"id", "semantic_id"}, ...]}."""
        return self._catalog("add", {"items": list(items), "replace": bool(replace)})

    def catalog_retire(self, item_ids: Sequence[str]) -> dict:
        """Retire items (added or trained): never recommended again; histories holding them still count them."""
        return self._catalog("retire", {"ids": list(item_ids)})

    def catalog_list(self, offset: int = 0, limit: int = 100, status: str | None = None) -> dict:
        """The items added or retired, oldest change first ("live" / "retired" only with `status`), and the counts."""
        return self._catalog("list", {"offset": offset, "limit": limit, "status": status})

    def catalog_show(self, item_ids: Sequence[str]) -> dict:
        """Each item's status (live, retired, trained, unknown), content and semantic ID."""
        return self._catalog("show", {"ids": list(item_ids)})

    def _catalog(self, op: str, body: dict) -> dict:
        """One catalog request; sent again while the server is unavailable (every operation is safe to repeat)."""
        inputs = [_input(P.CATALOG_OPERATION, np.array([[op.encode()]], dtype=object)),
                  _input(P.CATALOG_REQUEST, np.array([[_json.dumps(body).encode()]], dtype=object))]
        if self.admin_key:
            inputs.append(_input(P.ADMIN_KEY, np.array([[self.admin_key.encode()]], dtype=object)))
        deadline, attempt = time.monotonic() + self.retry_budget_s, 0
        while True:
            try:
                result = self._client.infer(P.CATALOG, inputs, client_timeout=self.timeout_s, headers=self.headers)
                return _json.loads(result.as_numpy(P.CATALOG_RESULT.name).reshape(-1)[0])
            except InferenceServerException as e:
                status, message = _status_name(e), e.message() or str(e)
                pause = self._jitter.uniform(0.0, min(self.max_backoff_s, self.backoff_s * 2**attempt))
                if status != "UNAVAILABLE" or time.monotonic() + pause >= deadline:
                    raise RecommenderError(status, message) from None
                self.retried += 1
                attempt += 1
                time.sleep(pause)

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
    def _send_events(self, session_id, item_ids, actions, timestamps, options: dict, events_before, end: bool):
        """Events sent after `events_before`. When another writer's events hold positions they claimed
        (ABORTED), they are sent again after the count the server names, leaving out those of them that are
        the very events held there, at most conflict_retries times; the answer's event_count is the session's
        count once they landed and `resent` says how often they were sent again."""
        items = list(item_ids)
        inputs, actions, timestamps = event_inputs(items, actions, timestamps)  # timestamps fixed once, for every re-send
        for resent in range(self.conflict_retries + 1):
            try:
                rec = self._send(session_id, inputs, len(items), options, events_before=events_before, end=end)
            except RecommenderError as e:
                resend = P.resend_of(e.message) if e.status == P.ABORTED else None
                if resend is None or resent == self.conflict_retries:
                    raise
                skip, events_before = resend
                # the count as the server named it: a call sent again after this one failed claims the positions
                # its events were re-sent to, where they may have landed, and is then answered as their retry
                self._state(session_id).count = events_before
                self.conflicts_resolved += 1
                items, actions, timestamps = items[skip:], actions[skip:], timestamps[skip:]
                inputs, _, _ = event_inputs(items, actions, timestamps)
                continue
            rec.resent = resent
            return rec

    def _state(self, session_id) -> _SessionState:
        with self._lock:
            return self._sessions.setdefault(session_id, _SessionState())

    def _send(self, session_id, inputs, n_events: int, options: dict, events_before, start: bool = False,
              end: bool = False, outputs=_OUTPUTS, model: str | None = None) -> Recommendation | None:
        """One request, sent again on retryable failures. With events_before set (or no events)
        every attempt is idempotent; without it only failures that the server did not act on
        are retried."""
        sid = wire_session_id(session_id)
        state = self._state(session_id)
        inputs = inputs + option_inputs(options)
        if events_before is not None:
            inputs.append(_input(P.EVENTS_BEFORE, np.array([[events_before]], np.int64)))
        idempotent = events_before is not None or n_events == 0
        start = start or not state.visit
        requested = [grpcclient.InferRequestedOutput(o.name) for o in outputs]
        headers = {**self.headers, P.SESSION_HEADER: P.session_header(sid)}  # a balancer keeps the session on one server
        t0 = time.perf_counter()
        deadline = time.monotonic() + self.retry_budget_s  # no retry starts, nor runs, past it
        attempt, timeout_s = 0, self.timeout_s
        while True:
            try:
                result = self._client.infer(
                    model or self.model, inputs, outputs=requested, sequence_id=sid, sequence_start=start, sequence_end=end,
                    client_timeout=timeout_s, headers=headers,
                )
                break
            except InferenceServerException as e:
                status, message = _status_name(e), e.message() or str(e)
                no_visit = _NO_VISIT in message and not start  # the server no longer has this visit
                too_large = status == "RESOURCE_EXHAUSTED" and any(m in message for m in _TOO_LARGE)
                retryable = no_visit or (not too_large and (status in _RETRYABLE or any(m in message for m in _STAGE_RESTARTING)))
                pause = 0.0 if no_visit else self._jitter.uniform(0.0, min(self.max_backoff_s, self.backoff_s * 2**attempt))
                left = deadline - time.monotonic() - pause
                if not (retryable and (idempotent or no_visit)) or left <= 0 or (self.retries is not None and attempt >= self.retries):
                    state.visit = False
                    if no_visit:
                        raise RecommenderError("UNAVAILABLE", "the server kept refusing to start a visit", session_id)
                    if status == "NOT_FOUND":
                        raise SessionLost(status, message, session_id) from None
                    raise RecommenderError(status, message, session_id) from None
                if no_visit:
                    self.visits_restarted += 1
                else:
                    self.retried += 1
                    time.sleep(pause)
                start = True  # a new visit: the old one may have ended with the failure
                attempt, timeout_s = attempt + 1, min(self.timeout_s, left)
        latency_ms = (time.perf_counter() - t0) * 1e3
        state.visit = not end
        state.count = int(result.as_numpy(P.EVENT_COUNT.name).reshape(-1)[0])
        if outputs is not _OUTPUTS:
            return None
        return parse_response(result, latency_ms)
