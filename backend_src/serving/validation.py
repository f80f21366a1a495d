"""Request validation for the served models: every check turns a bad request into a
``RequestError`` with a message that names the problem, before the request can touch a
session or the model.

Shapes are checked from the request's declared shape *before* numpy sees the payload: a
shape whose element count overflows (e.g. ``[2**62]`` with an empty payload) passes the
server's byte-size check and would otherwise kill the model process.

History length policy: a session keeps at most ``max_history`` events. A request whose events
would make the history longer drops the OLDEST events (of the session and, if needed, of the
request) and re-encodes the most recent ``max_history``; the number dropped by that request is
returned in TRUNCATED. A single request may carry at most ``max_request_events`` events.

Timestamps are seconds in ``[0, MAX_TIMESTAMP]``: the model takes differences of timestamps,
and within that range no difference overflows int64 and float64 holds every value exactly.

The decoder and the ranker are reachable directly on the server's port, not only through the
ensemble, so each checks its own inputs (``check_decoder_inputs``, ``check_ranker_inputs``)
before any model work.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Mapping, Sequence

import numpy as np

from backend_src.config import ATTENTION_MODES, DecodeOptions
from genrec_contract import protocol as P

_SHOW = 5  # offending values named in a message
LOG_PROB_TOLERANCE = 1e-4  # a beam log-probability above 0 by more than float rounding is refused
preview = P.preview  # a request value in a message: its first characters and its length
MAX_TIMESTAMP = 2**53 - 1  # largest accepted timestamp (seconds); see the module doc


class RequestError(ValueError):
    """A request the model refuses; ``status`` is a gRPC status name from protocol."""

    def __init__(self, message: str, status: str = P.INVALID_ARGUMENT):
        super().__init__(message)
        self.message = message
        self.status = status


@dataclass(frozen=True)
class Limits:
    max_history: int  # events a session keeps (<= the model's max_seq_len)
    num_actions: int  # action ids are 0..num_actions-1
    num_codes: int  # semantic-ID levels (SELECTION_STEP < num_codes)
    reserved_actions: tuple = (7,)  # the ranking-target action is not a history event
    max_request_events: int = 100_000
    max_top_k: int = 256
    max_beam_width: int = 1024
    max_pfa_k: int = 1 << 20
    max_tensor_elements: int = 1 << 24  # any one intermediate tensor of a request


def _fmt(values: Sequence, total: int | None = None) -> str:
    shown = ", ".join(preview(v) for v in list(values)[:_SHOW])
    total = len(values) if total is None else total
    return shown + (f" and {total - _SHOW} more" if total > _SHOW else "")


# ------------------------------------------------------------------------------------------
# Shapes and dtypes (before the payload is read)
# ------------------------------------------------------------------------------------------
def check_shape(spec: P.TensorSpec, shape: Sequence[int], sizes: dict, max_elements: int) -> tuple:
    """Check a request tensor's full shape ([1] + dims) against its spec. Returns the shape."""
    shape = tuple(int(s) for s in shape)
    dims = spec.resolve(sizes)
    if len(shape) != len(dims) + 1:
        raise RequestError(
            f"input '{spec.name}' must have shape [1, {', '.join('n' if d < 0 else str(d) for d in dims)}] "
            f"(one session per request), got {list(shape)}"
        )
    if shape[0] != 1:
        raise RequestError(f"input '{spec.name}': batch dimension must be 1 (one session per request), got {shape[0]}")
    for got, want in zip(shape[1:], dims):
        if got < 0:
            raise RequestError(f"input '{spec.name}' has a negative dimension: {list(shape)}")
        if want >= 0 and got != want:
            raise RequestError(f"input '{spec.name}' must have shape {[1] + [d if d >= 0 else 'n' for d in dims]}, got {list(shape)}")
    # the element count in exact integer arithmetic: no wrap-around
    if math.prod(shape) > max_elements:
        raise RequestError(f"input '{spec.name}' is too large: shape {list(shape)} exceeds {max_elements} elements")
    return shape


def check_dtype(spec: P.TensorSpec, dtype_name: str) -> None:
    """`dtype_name` is the wire type name (INT64, FP32, BYTES, ...)."""
    if dtype_name.replace("TYPE_", "").replace("STRING", "BYTES") != spec.dtype:
        raise RequestError(f"input '{spec.name}' must be {spec.dtype}, got {dtype_name}")


def decode_strings(arr: np.ndarray, name: str) -> list:
    """BYTES tensor -> list of str (utf-8)."""
    try:  # the common case, all bytes and valid utf-8, in one pass of C (bytes.decode's default is utf-8)
        return list(map(bytes.decode, arr.reshape(-1).tolist()))
    except (TypeError, UnicodeDecodeError):
        pass
    out = []
    for v in arr.reshape(-1):
        if isinstance(v, bytes):
            try:
                v = v.decode("utf-8")
            except UnicodeDecodeError:
                raise RequestError(f"input '{name}' holds a value that is not UTF-8: {preview(v)}") from None
        out.append(str(v))
    return out


def check_item_ids(ids: list, name: str) -> None:
    """Item ids are 1..MAX_ITEM_ID_BYTES bytes of UTF-8: an unknown id is accepted (and logged), so
    its size is bounded here."""
    if not ids:
        return
    longest = max(map(len, ids))  # characters; bytes checked only where they could be over
    if longest * 4 > P.MAX_ITEM_ID_BYTES or min(map(len, ids)) == 0:
        for j, v in enumerate(ids):
            if not v or len(v.encode()) > P.MAX_ITEM_ID_BYTES:
                raise RequestError(f"{name}: item {j} is {preview(v)}; an item id is 1 to {P.MAX_ITEM_ID_BYTES} bytes of UTF-8")


def catalog_version(value) -> int:
    """MIN_CATALOG_VERSION (absent: 0, nothing asked)."""
    if value is None:
        return 0
    v = int(_one(value, P.MIN_CATALOG_VERSION.name))
    if v < 0:
        raise RequestError(f"{P.MIN_CATALOG_VERSION.name} must be >= 0, got {v}")
    return v


# ------------------------------------------------------------------------------------------
# Events
# ------------------------------------------------------------------------------------------
def check_events(
    num_items: int,
    actions: np.ndarray,
    timestamps: np.ndarray,
    limits: Limits,
    start: bool,
    session_last_timestamp: int | None,
) -> None:
    """Counts, action ids and time order of one request's events."""
    n = num_items
    if actions.shape[0] != n or timestamps.shape[0] != n:
        raise RequestError(
            f"ITEM_IDS, ACTIONS and TIMESTAMPS must have the same length, got {n}, {actions.shape[0]}, {timestamps.shape[0]}"
        )
    if start and n == 0:
        raise RequestError("empty history on sequence start: the first request of a session must carry at least one event")
    if n > limits.max_request_events:
        raise RequestError(f"too many events in one request: {n} > {limits.max_request_events}")
    if n == 0:
        return
    out = (actions < 0) | (actions >= limits.num_actions)
    for reserved in limits.reserved_actions:  # one or two ids: np.isin costs more than the comparisons
        out |= actions == reserved
    bad = np.flatnonzero(out)
    if bad.size:
        raise RequestError(
            f"ACTIONS out of range at positions {_fmt(bad.tolist())} (values {_fmt(actions[bad].tolist())}): "
            f"action ids are 0..{limits.num_actions - 1}, {list(limits.reserved_actions)} reserved"
        )
    check_timestamps(timestamps, "TIMESTAMPS", what="event")
    if not start:
        check_continues(timestamps, session_last_timestamp)


def check_continues(timestamps: np.ndarray, session_last_timestamp: int | None) -> None:
    """New events (already checked by check_events) must not start before the session's last one."""
    if session_last_timestamp is not None and len(timestamps) and int(timestamps[0]) < session_last_timestamp:
        raise RequestError(
            f"TIMESTAMPS out of order: the first new event at {int(timestamps[0])} is before the session's last event at "
            f"{session_last_timestamp}"
        )


def check_timestamps(timestamps: np.ndarray, name: str, what: str = "event") -> None:
    """Range and time order of a 1-D timestamp array (oldest first). Neighbours are compared,
    never subtracted: a difference of two int64 timestamps can overflow."""
    if timestamps.size and not (timestamps.min() >= 0 and timestamps.max() <= MAX_TIMESTAMP):
        bad = np.flatnonzero((timestamps < 0) | (timestamps > MAX_TIMESTAMP))
        raise RequestError(
            f"{name} out of range at positions {_fmt(bad.tolist())} (values {_fmt(timestamps[bad].tolist())}): "
            f"timestamps are seconds in [0, {MAX_TIMESTAMP}]"
        )
    back = np.flatnonzero(timestamps[1:] < timestamps[:-1])
    if back.size:
        i = int(back[0]) + 1
        raise RequestError(
            f"{name} out of order: {what} {i} at {int(timestamps[i])} is before {what} {i - 1} at {int(timestamps[i - 1])} "
            f"({back.size} decrease(s) in this request); {what}s must be oldest first"
        )


# ------------------------------------------------------------------------------------------
# Tensors between the stages (checked again by each stage: it can be called directly)
# ------------------------------------------------------------------------------------------
# Each function takes the request's arrays as read (batch dim 1 first), after read_input has
# checked every tensor's own rank and fixed dims; it checks that the inputs agree with each
# other and that their values are ones the model can take.
# The checks below are on every request's path: each tests the common, valid case with a reduction
# or two first and only finds the offending positions for the message once one is known to exist.
def _check_indices(values: np.ndarray, name: str, num_items: int, zero: str) -> None:
    if values.size == 0 or (values.min() >= 0 and values.max() <= num_items):
        return
    bad = np.flatnonzero((values < 0) | (values > num_items))
    raise RequestError(
        f"{name} holds item indices out of range at positions {_fmt(bad.tolist())} "
        f"(values {_fmt(values[bad].tolist())}): item indices are 0..{num_items} (0 = {zero})"
    )


def _check_finite(x: np.ndarray, name: str) -> None:
    if np.isfinite(x).all():  # one pass and one reduction in the common case
        return
    bad = ~np.isfinite(x)
    # the first offending index only: argwhere on a large, all-NaN tensor would be huge
    first = tuple(int(i) for i in np.unravel_index(int(bad.argmax()), x.shape))
    raise RequestError(
        f"{name} holds {int(np.count_nonzero(bad))} non-finite value(s) (NaN or Inf), the first at index "
        f"{list(first)}: {float(x[first])}"
    )


def check_decoder_inputs(states: np.ndarray, max_history: int) -> None:
    """pfa_decoder: HISTORY_STATES [1, n, D] with 1 <= n <= max_history, all finite."""
    n = states.shape[1]
    if n == 0:
        raise RequestError("HISTORY_STATES has no rows: empty history, nothing to decode from")
    if n > max_history:
        raise RequestError(f"HISTORY_STATES has {n} history rows, more than the model's max history {max_history}")
    _check_finite(states, "HISTORY_STATES")


def _one_size(problem: str, sizes: dict, layout: str) -> int:
    """The one size that every input in `sizes` (name -> size) must share."""
    if len(set(sizes.values())) > 1:
        raise RequestError(f"{problem}: " + ", ".join(f"{k} has {v}" for k, v in sizes.items()) + f" ({layout})")
    return next(iter(sizes.values()))


def check_ranker_inputs(
    states: np.ndarray,  # HISTORY_STATES [1, n, D]
    keys: np.ndarray,  # HISTORY_KEYS [1, L, n, H, DH]
    values: np.ndarray,  # HISTORY_VALUES [1, L, n, H, DH]
    timestamps: np.ndarray,  # HISTORY_TIMESTAMPS [1, n]
    history_items: np.ndarray,  # HISTORY_ITEMS [1, n]
    candidates: np.ndarray,  # CANDIDATE_ITEMS [1, W]
    log_probs: np.ndarray,  # CANDIDATE_LOG_PROBS [1, W]
    codes: np.ndarray,  # CANDIDATE_CODES [1, W, C]
    *,
    item_rows: int,
    codebook_sizes: Sequence[int],
    max_history: int,
    max_candidates: int,
) -> None:
    """mfalcon_ranker: one n across the history inputs, one W across the candidate inputs, and
    values in range: item indices below item_rows, the rows of the model's item table (an empty
    beam is item 0 with log-prob -inf and codes -1)."""
    # shapes first: the value checks below index the inputs together
    n = _one_size(
        "history inputs disagree on the number of rows n",
        {"HISTORY_STATES": states.shape[1], "HISTORY_KEYS": keys.shape[2], "HISTORY_VALUES": values.shape[2],
         "HISTORY_TIMESTAMPS": timestamps.shape[1], "HISTORY_ITEMS": history_items.shape[1]},
        "HISTORY_STATES [1, n, D], HISTORY_KEYS / HISTORY_VALUES [1, L, n, H, DH], HISTORY_TIMESTAMPS / HISTORY_ITEMS "
        "[1, n]",
    )
    if n == 0:
        raise RequestError("HISTORY_KEYS has no rows: empty history, nothing to rank against")
    if n > max_history:
        raise RequestError(f"HISTORY_KEYS has {n} history rows, more than the model's max history {max_history}")
    W = _one_size(
        "candidate inputs disagree on the number of candidates W",
        {"CANDIDATE_ITEMS": candidates.shape[1], "CANDIDATE_LOG_PROBS": log_probs.shape[1], "CANDIDATE_CODES": codes.shape[1]},
        "CANDIDATE_ITEMS / CANDIDATE_LOG_PROBS [1, W], CANDIDATE_CODES [1, W, C]",
    )
    if W == 0:
        raise RequestError("CANDIDATE_ITEMS is empty: nothing to rank")
    if W > max_candidates:
        raise RequestError(f"CANDIDATE_ITEMS has too many candidates: {W} > {max_candidates}")

    # values: the small inputs first, the history K/V (the bulk of the bytes) last
    _check_indices(history_items[0], "HISTORY_ITEMS", item_rows - 1, "padding")
    check_timestamps(timestamps[0], "HISTORY_TIMESTAMPS", what="row")
    cands = candidates[0]
    _check_indices(cands, "CANDIDATE_ITEMS", item_rows - 1, "empty beam")
    lp = log_probs[0]
    if not lp.max() <= LOG_PROB_TOLERANCE:  # a NaN fails this test too
        bad = np.flatnonzero(~(lp <= LOG_PROB_TOLERANCE))
        raise RequestError(
            f"CANDIDATE_LOG_PROBS holds values above 0, NaN or +inf at positions {_fmt(bad.tolist())} "
            f"(values {_fmt(lp[bad].tolist())}): log-probabilities are <= 0, -inf for an empty beam"
        )
    c = codes[0]
    sizes = np.asarray(codebook_sizes, dtype=np.int64)
    # each level's code is below that level's codebook size; an empty beam's codes may be -1
    if not (c.min() >= 0 and (c < sizes).all()):  # out of range, or an empty beam's -1
        ok = ((c >= 0) & (c < sizes)) | ((c == -1) & (cands == 0)[:, None])
        if not ok.all():
            beam, level = (int(i) for i in np.unravel_index(int((~ok).argmax()), ok.shape))
            raise RequestError(
                f"CANDIDATE_CODES out of range at {int(np.count_nonzero(~ok))} place(s), the first at candidate {beam}, "
                f"level {level}: {int(c[beam, level])}; level sizes are {sizes.tolist()} (-1 only for an empty beam, item 0)"
            )
    _check_finite(states, "HISTORY_STATES")
    _check_finite(keys, "HISTORY_KEYS")
    _check_finite(values, "HISTORY_VALUES")


# ------------------------------------------------------------------------------------------
# Options
# ------------------------------------------------------------------------------------------
def _one(v, name: str):
    """The single value of an option tensor (None if the option is absent)."""
    if v is None:
        return None
    v = np.asarray(v).reshape(-1)
    if v.size != 1:
        raise RequestError(f"input '{name}' must hold one value, got {v.size}")
    return v[0]


def _scalar(values: Mapping, name: str):
    return _one(values.get(name), name)


def _int_in(values: Mapping, name: str, lo: int, hi: int):
    v = _scalar(values, name)
    if v is None:
        return None
    v = int(v)
    if not lo <= v <= hi:
        raise RequestError(f"{name} must be in [{lo}, {hi}], got {v}")
    return v


def flag(value, name: str) -> bool:
    """An optional BOOL option tensor (None, absent: False)."""
    v = _one(value, name)
    return False if v is None else bool(v)


def parse_top_k(values: Mapping, default_top_k: int, max_top_k: int) -> int:
    """TOP_K of one request's option tensors, or the default."""
    top_k = _int_in(values, "TOP_K", 1, max_top_k)
    return default_top_k if top_k is None else top_k


def parse_options(values: Mapping, defaults: DecodeOptions, default_top_k: int, limits: Limits) -> tuple:
    """Option tensors of one request (name -> array; missing ones absent or None) ->
    (top_k, DecodeOptions), defaults filled in from the model's config. Each stage that reads decode
    options parses them once per request here; requests with equal DecodeOptions (frozen, so
    hashable: the options are their own key) are decoded in one batch."""
    top_k = parse_top_k(values, default_top_k, limits.max_top_k)
    beam = _int_in(values, "BEAM_WIDTH", 1, limits.max_beam_width)
    k = _int_in(values, "PFA_K", 1, limits.max_pfa_k)
    step = _int_in(values, "SELECTION_STEP", 0, limits.num_codes - 1)
    r = _scalar(values, "PFA_R")
    if r is not None:
        r = float(r)
        if not (0.0 < r <= 1.0):  # also refuses NaN
            raise RequestError(f"PFA_R must be in (0, 1], got {r}")
    mode = _scalar(values, "DECODE_MODE")
    if mode is not None:
        mode = mode.decode("utf-8", "replace") if isinstance(mode, bytes) else str(mode)
        if mode not in ATTENTION_MODES:
            raise RequestError(f"DECODE_MODE must be one of {', '.join(ATTENTION_MODES)}, got {preview(mode)}")
    opts = replace(
        defaults,
        mode=mode if mode is not None else defaults.mode,
        beam_width=beam if beam is not None else defaults.beam_width,
        k=k if k is not None else defaults.k,
        r=r if r is not None else defaults.r,
        selection_step=step if step is not None else defaults.selection_step,
        collect_attention=False,
    )
    if top_k > opts.beam_width:
        raise RequestError(f"TOP_K ({top_k}) must not exceed BEAM_WIDTH ({opts.beam_width}): the ranker reorders the beams")
    return top_k, opts


# ------------------------------------------------------------------------------------------
# Reading a request's inputs inside a served model
# ------------------------------------------------------------------------------------------
def read_input(inputs: Mapping, spec: P.TensorSpec, sizes: dict, max_elements: int) -> np.ndarray | None:
    """The input `spec` of a request as numpy (None if an optional input is absent), its shape
    checked first. `inputs`: the request's tensors by name, built once per request (the backend's
    get_input_tensor_by_name lists every input anew on each call): Triton's tensors, read only once
    their declared shape has passed, or numpy arrays."""
    t = inputs.get(spec.name)
    if t is None:
        if spec.optional:
            return None
        raise RequestError(f"missing input '{spec.name}'")
    if isinstance(t, np.ndarray):  # a stage driven with plain arrays (tests, benchmarks)
        check_shape(spec, t.shape, sizes, max_elements)
        return t
    check_shape(spec, t.shape(), sizes, max_elements)
    return t.as_numpy()


# gRPC status name -> TritonError code name; anything else is the client's mistake (INVALID_ARG).
# "UNAVAILABLE" and "INTERNAL" are spelled out: protocol has no constant for INTERNAL (a client is never told to send it).
_ERROR_CODES = {
    P.NOT_FOUND: "NOT_FOUND",
    "ALREADY_EXISTS": "ALREADY_EXISTS",
    P.RESOURCE_EXHAUSTED: "UNAVAILABLE",  # a full server: retrying later may succeed
    "UNAVAILABLE": "UNAVAILABLE",
    "INTERNAL": "INTERNAL",  # the stage failed, not the request
}


def error_code(status: str, codes) -> int:
    """gRPC status name -> the backend's TritonError code (`codes` = TritonError); a status Triton
    has no code for travels as the one protocol.TAGGED_STATUSES names (its message tagged)."""
    return getattr(codes, _ERROR_CODES.get(P.TAGGED_STATUSES.get(status, status), "INVALID_ARG"))


def decode_defaults(params: Mapping) -> DecodeOptions:
    """A model's default decode options from its config parameters (written by the config
    generator from ServingOptions.decode); DecodeOptions' own defaults where one is absent."""
    d = DecodeOptions()
    return DecodeOptions(
        mode=params.get("decode_mode", d.mode),
        beam_width=int(params.get("beam_width", d.beam_width)),
        k=int(params.get("pfa_k", d.k)),
        r=float(params.get("pfa_r", d.r)),
        selection_step=int(params.get("selection_step", d.selection_step)),
    )
