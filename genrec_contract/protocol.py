"""The tensor contract of every served model: names, dtypes and dims, in one place.

The config generator, the Triton models and the client library all read this module, so a
name or a shape changes here or nowhere.

Every model (and the ``recommend`` ensemble) has a batch dimension; ``dims`` below are the
dims of ONE request without it. A client sends one user session per request, so the full
shapes it sends are ``[1] + dims`` (e.g. ITEM_IDS ``[1, n]``), and it gets ``[1] + dims``
back (e.g. RECOMMENDED_IDS ``[1, K]``).

Symbolic dims are resolved against the model config: ``L`` layers, ``H`` heads, ``DH`` head
dim, ``D`` model dim, ``C`` semantic-ID codes per item; ``-1`` is variable (history rows
``n``, beams ``W``, recommendations ``K``).

Flow (one request of a user session, sequence id = session id):

    client -> recommend (ensemble)
      history_encoder  events -> the durable event log and the session's HistoryCache (kept
                       in the instance, keyed by session id, rebuilt from the log on a miss),
                       outputs the session's whole cached history
      pfa_decoder      HISTORY_STATES -> CANDIDATE_* (constrained semantic-ID beam search)
      mfalcon_ranker   HISTORY_KEYS/VALUES/TIMESTAMPS/ITEMS + CANDIDATE_* -> top-K (with
                       EXCLUDE_SEEN, the candidates already in the history left out)
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from urllib.parse import quote

import numpy as np

# ------------------------------------------------------------------------------------------
# Tensor description
# ------------------------------------------------------------------------------------------
_NUMPY = {
    "BOOL": np.bool_,
    "INT32": np.int32,
    "INT64": np.int64,
    "FP32": np.float32,
    "BYTES": np.object_,
}
_CONFIG_TYPE = {"BOOL": "TYPE_BOOL", "INT32": "TYPE_INT32", "INT64": "TYPE_INT64", "FP32": "TYPE_FP32", "BYTES": "TYPE_STRING"}


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str  # wire datatype as the client names it: INT32, INT64, FP32, BYTES, BOOL
    dims: tuple  # per request, without the batch dim; ints or symbols L/H/DH/D/C; -1 variable
    optional: bool = False
    doc: str = ""

    @property
    def numpy_dtype(self):
        return _NUMPY[self.dtype]

    @property
    def config_type(self) -> str:
        return _CONFIG_TYPE[self.dtype]

    def resolve(self, sizes: dict) -> tuple:
        """Dims with symbols replaced by the model's sizes."""
        return tuple(d if isinstance(d, int) else int(sizes[d]) for d in self.dims)


def model_sizes(cfg) -> dict:
    """Symbol -> size for a ModelConfig."""
    return {
        "L": cfg.num_layers,
        "H": cfg.num_heads,
        "DH": cfg.d_model // cfg.num_heads,
        "D": cfg.d_model,
        "C": cfg.num_codes,
    }


# ------------------------------------------------------------------------------------------
# Model names
# ------------------------------------------------------------------------------------------
ENSEMBLE = "recommend"
ENCODER = "history_encoder"
DECODER = "pfa_decoder"
RANKER = "mfalcon_ranker"
CATALOG = "catalog"  # adds, retires and lists items while the others serve (not in the ensemble)
PYTHON_MODELS = (ENCODER, DECODER, RANKER, CATALOG)
ALL_MODELS = PYTHON_MODELS + (ENSEMBLE,)

# sequence-batching control inputs of the encoder (no CORRID input: the model reads the
# sequence id with request.correlation_id())
CONTROL_START = "START"
CONTROL_END = "END"
CONTROL_READY = "READY"

# ------------------------------------------------------------------------------------------
# Session ids
# ------------------------------------------------------------------------------------------
# A session id is Triton's sequence id: a non-zero int64 or a non-empty string. Its identity is
# session_key(): the event log's and the session cache's key, also the deletion command's, and
# (encoded by session_header) the balancer's. An integer id is its signed int64 value whatever
# form it takes on the way (Triton hands the model uint64: -5 arrives as 2**64 - 5); a string
# id is kept whole, so it must travel whole: Triton refuses one over MAX_STRING_ID_BYTES and the
# Python backend hands the model a string id only up to its first NUL, so the client refuses both.
MAX_STRING_ID_BYTES = 128  # Triton's limit on a string sequence id, in UTF-8 bytes
MAX_ITEM_ID_BYTES = 256  # an item id, in UTF-8 bytes: events and the catalog take any id up to this long
_UINT64 = 1 << 64

# The request header that carries the session id, so a balancer in front of several servers can
# keep a session's requests on one of them (consistent hashing); the client library sets it.
SESSION_HEADER = "x-session-key"


def session_id_problem(sequence_id) -> str | None:
    """Why `sequence_id` cannot travel whole as a session id, or None when it can: an int in
    [-2**63, 2**64) other than 0 (ids >= 2**63 stand for the int64 they wrap to), or a str that is
    non-empty, UTF-8, free of NUL and at most MAX_STRING_ID_BYTES bytes in UTF-8."""
    if isinstance(sequence_id, (bool, np.bool_)):
        return "a session id must be an int or a string, got a bool"
    if isinstance(sequence_id, (int, np.integer)):
        v = int(sequence_id)
        if v == 0:
            return "session id 0 means 'no sequence'; use a non-zero id"
        if not -(1 << 63) <= v < _UINT64:
            return f"an integer session id must fit in 64 bits, got {preview(v)}"
        return None
    if isinstance(sequence_id, str):
        if not sequence_id:
            return "a session id must not be empty"
        try:
            size = len(sequence_id.encode("utf-8"))
        except UnicodeEncodeError:
            return f"a string session id must be valid Unicode (no lone surrogates), got {preview(sequence_id)}"
        if size > MAX_STRING_ID_BYTES:
            return (f"a string session id must be at most {MAX_STRING_ID_BYTES} bytes in UTF-8 (Triton's limit), "
                    f"got {size} bytes: {preview(sequence_id)}")
        if "\0" in sequence_id:
            return (f"a string session id must not contain NUL: the server would see it cut at the NUL, as another "
                    f"session's id; got {preview(sequence_id)}")
        return None
    return f"a session id must be an int or a string, got {type(sequence_id).__name__}"


def canonical_session_id(sequence_id):
    """The id a session is known by: an int as its signed int64 value (what a client sends; Triton
    hands the model the uint64 form of a negative id), a str as it is."""
    if isinstance(sequence_id, (int, np.integer)) and not isinstance(sequence_id, (bool, np.bool_)):
        v = int(sequence_id)
        return v - _UINT64 if v >= 1 << 63 else v
    return str(sequence_id)


def session_key(sequence_id) -> str:
    """The event log's and the session cache's key of a session: "i:<signed int64>" or "s:<the
    string, whole>"; integer and string ids never collide ("i:42" vs "s:42")."""
    sid = canonical_session_id(sequence_id)
    return f"i:{sid}" if isinstance(sid, int) else f"s:{sid}"


def parse_session_id(text: str, string: bool = False):
    """A session id as the command lines spell it: an integer id when `text` is an integer (an
    optional minus and digits), else a string id; `string`: a string id whatever it looks like
    (the command lines' --session-string, for "42" as a string)."""
    t = text.strip()
    if not string and t.lstrip("-").isdigit() and t.count("-") <= 1 and t.isascii():
        return int(t)
    return text


def session_header(sequence_id) -> str:
    """SESSION_HEADER's value: the session's key with the string's UTF-8 bytes percent-encoded,
    so any id travels as printable ASCII (gRPC metadata) and two ids never share a value
    ("s:%C3%BC-1" for "ü-1", "i:-5" for -5). Every client of one balancer must use this function:
    the balancer hashes the encoded value."""
    sid = canonical_session_id(sequence_id)
    return f"i:{sid}" if isinstance(sid, int) else "s:" + quote(sid, safe="")


# ------------------------------------------------------------------------------------------
# Request values in messages
# ------------------------------------------------------------------------------------------
PREVIEW_CHARS = 40  # characters of a request value an error message shows


def preview(value, limit: int = PREVIEW_CHARS) -> str:
    """A request value as an error message shows it: its repr, cut to `limit` characters with
    its length said, so a message stays short whatever the request held."""
    if isinstance(value, (str, bytes)) and len(value) > limit:
        unit = "characters" if isinstance(value, str) else "bytes"
        return f"{value[:limit]!r}... ({len(value)} {unit})"
    text = repr(value)
    return text if len(text) <= limit + 2 else f"{text[:limit]}... ({len(text)} characters)"


# ------------------------------------------------------------------------------------------
# Client-facing tensors
# ------------------------------------------------------------------------------------------
ITEM_IDS = TensorSpec("ITEM_IDS", "BYTES", (-1,), doc="the data set's raw item ids of the new events, oldest first")
ACTIONS = TensorSpec("ACTIONS", "INT64", (-1,), doc="action id of each event (ratings 1..5, 0 = none)")
TIMESTAMPS = TensorSpec("TIMESTAMPS", "INT64", (-1,), doc="event times in seconds, non-decreasing")
EVENTS_BEFORE = TensorSpec(
    "EVENTS_BEFORE", "INT64", (1,), optional=True,
    doc="events the client sent to this session before this request: the server applies only the events past the "
        "count it has (a retried request is applied once) and refuses a gap. Absent: the events go after whatever the "
        "server has, and a START request with events starts the history afresh",
)

TOP_K = TensorSpec("TOP_K", "INT32", (1,), optional=True, doc="recommendations returned")
BEAM_WIDTH = TensorSpec("BEAM_WIDTH", "INT32", (1,), optional=True, doc="beams = candidates ranked")
DECODE_MODE = TensorSpec("DECODE_MODE", "BYTES", (1,), optional=True, doc="full | pfa | pfa_per_beam | dynamic_topk")
PFA_K = TensorSpec("PFA_K", "INT32", (1,), optional=True, doc="history rows kept at the selection step")
PFA_R = TensorSpec("PFA_R", "FP32", (1,), optional=True, doc="budget ratio of later steps, (0, 1]")
SELECTION_STEP = TensorSpec("SELECTION_STEP", "INT32", (1,), optional=True, doc="decoding step that selects rows")
EXCLUDE_SEEN = TensorSpec("EXCLUDE_SEEN", "BOOL", (1,), optional=True,
                          doc="leave out items already in the session's history (default: keep them)")
DECODE_OPTION_INPUTS = (BEAM_WIDTH, DECODE_MODE, PFA_K, PFA_R, SELECTION_STEP)
OPTION_INPUTS = (TOP_K, EXCLUDE_SEEN) + DECODE_OPTION_INPUTS

RECOMMENDED_IDS = TensorSpec("RECOMMENDED_IDS", "BYTES", (-1,), doc="raw item ids, best first; empty string = no item")
RANK_SCORES = TensorSpec("RANK_SCORES", "FP32", (-1,), doc="the served order's scores (-inf = no item)")
RETRIEVAL_LOG_PROBS = TensorSpec("RETRIEVAL_LOG_PROBS", "FP32", (-1,), doc="beam log-probability of each item")
SEMANTIC_IDS = TensorSpec("SEMANTIC_IDS", "INT32", (-1, "C"), doc="the items' semantic IDs")
HISTORY_LENGTH = TensorSpec("HISTORY_LENGTH", "INT64", (1,), doc="events in the session's history after this request")
TRUNCATED = TensorSpec("TRUNCATED", "INT32", (1,), doc="oldest events dropped by this request to stay within max history")
EVENT_COUNT = TensorSpec("EVENT_COUNT", "INT64", (1,), doc="events the server holds for the session after this request (all ever accepted)")
RESTORED = TensorSpec("RESTORED", "BOOL", (1,), doc="true when the session was not cached and was rebuilt from the event log")
CATALOG_VERSION = TensorSpec("CATALOG_VERSION", "INT64", (1,),
                             doc="the catalog version the answer was made at: every item in it was live at that version")
UNKNOWN_ITEMS = TensorSpec("UNKNOWN_ITEMS", "INT64", (1,),
                           doc="events of the session's history naming items the serving version does not know (accepted, "
                               "logged and encoded with the learned unknown-item vector)")

# ------------------------------------------------------------------------------------------
# Tensors between the stages
# ------------------------------------------------------------------------------------------
HISTORY_STATES = TensorSpec("HISTORY_STATES", "FP32", (-1, "D"), doc="final HSTU states of the n history rows")
HISTORY_KEYS = TensorSpec("HISTORY_KEYS", "FP32", ("L", -1, "H", "DH"), doc="per-layer keys of the history rows")
HISTORY_VALUES = TensorSpec("HISTORY_VALUES", "FP32", ("L", -1, "H", "DH"), doc="per-layer values of the history rows")
HISTORY_TIMESTAMPS = TensorSpec("HISTORY_TIMESTAMPS", "INT64", (-1,), doc="timestamps of the history rows")
HISTORY_ITEMS = TensorSpec("HISTORY_ITEMS", "INT64", (-1,), doc="item indices of the history rows")

MIN_CATALOG_VERSION = TensorSpec("MIN_CATALOG_VERSION", "INT64", (1,), optional=True,
                                 doc="the catalog version the encoder applied: the later stages apply at least this one")

CANDIDATE_ITEMS = TensorSpec("CANDIDATE_ITEMS", "INT64", (-1,), doc="beam item indices (0 = empty beam)")
CANDIDATE_LOG_PROBS = TensorSpec("CANDIDATE_LOG_PROBS", "FP32", (-1,), doc="beam log-probabilities")
CANDIDATE_CODES = TensorSpec("CANDIDATE_CODES", "INT32", (-1, "C"), doc="beam semantic IDs")


@dataclass(frozen=True)
class ModelContract:
    name: str
    inputs: tuple
    outputs: tuple
    ragged: tuple = ()  # inputs whose variable dims may differ between batched requests

    def input(self, name: str) -> TensorSpec:
        return next(t for t in self.inputs if t.name == name)

    def output(self, name: str) -> TensorSpec:
        return next(t for t in self.outputs if t.name == name)


ENCODER_CONTRACT = ModelContract(
    ENCODER,
    inputs=(ITEM_IDS, ACTIONS, TIMESTAMPS, EVENTS_BEFORE) + OPTION_INPUTS,  # options only validated here
    outputs=(HISTORY_STATES, HISTORY_KEYS, HISTORY_VALUES, HISTORY_TIMESTAMPS, HISTORY_ITEMS, HISTORY_LENGTH, TRUNCATED,
             EVENT_COUNT, RESTORED, UNKNOWN_ITEMS, MIN_CATALOG_VERSION),
    ragged=("ITEM_IDS", "ACTIONS", "TIMESTAMPS"),
)
DECODER_CONTRACT = ModelContract(
    DECODER,
    inputs=(HISTORY_STATES, MIN_CATALOG_VERSION) + DECODE_OPTION_INPUTS,
    outputs=(CANDIDATE_ITEMS, CANDIDATE_LOG_PROBS, CANDIDATE_CODES),
    ragged=("HISTORY_STATES",),
)
RANKER_CONTRACT = ModelContract(
    RANKER,
    # HISTORY_STATES: the last row is the user state the dense head scores the candidates against
    inputs=(HISTORY_STATES, HISTORY_KEYS, HISTORY_VALUES, HISTORY_TIMESTAMPS, HISTORY_ITEMS, CANDIDATE_ITEMS,
            CANDIDATE_LOG_PROBS, CANDIDATE_CODES, TOP_K, EXCLUDE_SEEN, MIN_CATALOG_VERSION),
    outputs=(RECOMMENDED_IDS, RANK_SCORES, RETRIEVAL_LOG_PROBS, SEMANTIC_IDS, CATALOG_VERSION),
    ragged=("HISTORY_STATES", "HISTORY_KEYS", "HISTORY_VALUES", "HISTORY_TIMESTAMPS", "HISTORY_ITEMS",
            "CANDIDATE_ITEMS", "CANDIDATE_LOG_PROBS", "CANDIDATE_CODES"),
)
ENSEMBLE_CONTRACT = ModelContract(
    ENSEMBLE,
    inputs=(ITEM_IDS, ACTIONS, TIMESTAMPS, EVENTS_BEFORE) + OPTION_INPUTS,
    outputs=(RECOMMENDED_IDS, RANK_SCORES, RETRIEVAL_LOG_PROBS, SEMANTIC_IDS, HISTORY_LENGTH, TRUNCATED, EVENT_COUNT, RESTORED,
             UNKNOWN_ITEMS, CATALOG_VERSION),
)
# the catalog's management model: one JSON request, one JSON answer (docs/catalog.md)
CATALOG_OPERATION = TensorSpec("CATALOG_OPERATION", "BYTES", (1,), doc="add | retire | list | show")
CATALOG_REQUEST = TensorSpec("CATALOG_REQUEST", "BYTES", (1,), doc="the operation's arguments as JSON")
ADMIN_KEY = TensorSpec("ADMIN_KEY", "BYTES", (1,), optional=True,
                       doc="the server's admin key: add and retire need it where the server has one")
CATALOG_RESULT = TensorSpec("CATALOG_RESULT", "BYTES", (1,), doc="the answer as JSON")
CATALOG_CONTRACT = ModelContract(CATALOG, inputs=(CATALOG_OPERATION, CATALOG_REQUEST, ADMIN_KEY),
                                 outputs=(CATALOG_RESULT, CATALOG_VERSION))
CATALOG_OPERATIONS = ("add", "retire", "list", "show")
CONTRACTS = {c.name: c for c in (ENCODER_CONTRACT, DECODER_CONTRACT, RANKER_CONTRACT, ENSEMBLE_CONTRACT, CATALOG_CONTRACT)}

def ensemble_steps(*contracts: ModelContract) -> tuple:
    """An ensemble's wiring: (model, its input names, its output names) per step, in order. Ensemble tensors are
    named like the model tensors, so each step's maps are the identity on names."""
    return tuple((c.name, [t.name for t in c.inputs], [t.name for t in c.outputs]) for c in contracts)


ENSEMBLE_STEPS = ensemble_steps(ENCODER_CONTRACT, DECODER_CONTRACT, RANKER_CONTRACT)

# Request status codes carried by validation errors (gRPC names)
INVALID_ARGUMENT = "INVALID_ARGUMENT"
NOT_FOUND = "NOT_FOUND"
RESOURCE_EXHAUSTED = "RESOURCE_EXHAUSTED"
FAILED_PRECONDITION = "FAILED_PRECONDITION"
UNAVAILABLE = "UNAVAILABLE"  # retry: the event log or a concurrent writer got in the way
ABORTED = "ABORTED"  # another writer's events hold positions the request claims: re-send after them (resend_after)
ALREADY_EXISTS = "ALREADY_EXISTS"  # a catalog add of an id that holds other content (replace it explicitly)
PERMISSION_DENIED = "PERMISSION_DENIED"  # a catalog change without the server's admin key

# Statuses that Triton's Python backend has no error code for (its codes give INVALID_ARGUMENT,
# NOT_FOUND, UNAVAILABLE, INTERNAL, UNIMPLEMENTED, ALREADY_EXISTS, CANCELLED, UNKNOWN) travel as the
# gRPC status named here, their message starting with the status in brackets; status_of() reads it.
TAGGED_STATUSES = {FAILED_PRECONDITION: INVALID_ARGUMENT, ABORTED: ALREADY_EXISTS, RESOURCE_EXHAUSTED: UNAVAILABLE,
                   PERMISSION_DENIED: INVALID_ARGUMENT}
_TAG = re.compile(r"\[([A-Z_]+)\] ")


def tagged_message(status: str, message: str) -> str:
    """A stage's message as it travels: tagged with `status` when Triton has no code for it."""
    return f"[{status}] {message}" if status in TAGGED_STATUSES else message


# An ABORTED message ends with what to re-send and where: the request's events from its event `skip` on
# (the earlier ones are the very events held at their positions) after the `count` events the session holds.
_RESEND = "re-send this request's events from its event {skip} on with EVENTS_BEFORE={count}"
_RESEND_PATTERN = re.compile(re.escape(_RESEND).replace(r"\{skip\}", r"(\d+)").replace(r"\{count\}", r"(\d+)") + r"\s*$")


def resend_after(skip: int, count: int) -> str:
    return _RESEND.format(skip=skip, count=count)


def resend_of(message: str) -> tuple | None:
    """(skip, count) from an ABORTED message's end (resend_after), or None."""
    m = _RESEND_PATTERN.search(message or "")
    return (int(m.group(1)), int(m.group(2))) if m else None


def status_of(grpc_status: str, message: str) -> str:
    """The status a stage answered with, from the gRPC status and message a client receives (Triton
    may put words before the stage's message: the first tag counts)."""
    m = _TAG.search(message or "")
    if m and TAGGED_STATUSES.get(m.group(1)) == grpc_status:
        return m.group(1)
    return grpc_status
