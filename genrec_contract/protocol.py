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

from dataclasses import dataclass

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
PYTHON_MODELS = (ENCODER, DECODER, RANKER)
ALL_MODELS = PYTHON_MODELS + (ENSEMBLE,)

# sequence-batching control inputs of the encoder (no CORRID input: the model reads the
# sequence id with request.correlation_id())
CONTROL_START = "START"
CONTROL_END = "END"
CONTROL_READY = "READY"

# The request header that carries the session id, so a balancer in front of several servers can
# keep a session's requests on one of them (consistent hashing); the client library sets it.
SESSION_HEADER = "x-session-key"


def session_key(sequence_id) -> str:
    """The event log's and the session cache's key of a session: integer and string sequence ids
    never collide ("i:42" vs "s:42")."""
    return f"i:{sequence_id}" if isinstance(sequence_id, int) else f"s:{sequence_id}"


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

# ------------------------------------------------------------------------------------------
# Tensors between the stages
# ------------------------------------------------------------------------------------------
HISTORY_STATES = TensorSpec("HISTORY_STATES", "FP32", (-1, "D"), doc="final HSTU states of the n history rows")
HISTORY_KEYS = TensorSpec("HISTORY_KEYS", "FP32", ("L", -1, "H", "DH"), doc="per-layer keys of the history rows")
HISTORY_VALUES = TensorSpec("HISTORY_VALUES", "FP32", ("L", -1, "H", "DH"), doc="per-layer values of the history rows")
HISTORY_TIMESTAMPS = TensorSpec("HISTORY_TIMESTAMPS", "INT64", (-1,), doc="timestamps of the history rows")
HISTORY_ITEMS = TensorSpec("HISTORY_ITEMS", "INT64", (-1,), doc="item indices of the history rows")

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
             EVENT_COUNT, RESTORED),
    ragged=("ITEM_IDS", "ACTIONS", "TIMESTAMPS"),
)
DECODER_CONTRACT = ModelContract(
    DECODER,
    inputs=(HISTORY_STATES,) + DECODE_OPTION_INPUTS,
    outputs=(CANDIDATE_ITEMS, CANDIDATE_LOG_PROBS, CANDIDATE_CODES),
    ragged=("HISTORY_STATES",),
)
RANKER_CONTRACT = ModelContract(
    RANKER,
    # HISTORY_STATES: the last row is the user state the dense head scores the candidates against
    inputs=(HISTORY_STATES, HISTORY_KEYS, HISTORY_VALUES, HISTORY_TIMESTAMPS, HISTORY_ITEMS, CANDIDATE_ITEMS,
            CANDIDATE_LOG_PROBS, CANDIDATE_CODES, TOP_K, EXCLUDE_SEEN),
    outputs=(RECOMMENDED_IDS, RANK_SCORES, RETRIEVAL_LOG_PROBS, SEMANTIC_IDS),
    ragged=("HISTORY_STATES", "HISTORY_KEYS", "HISTORY_VALUES", "HISTORY_TIMESTAMPS", "HISTORY_ITEMS",
            "CANDIDATE_ITEMS", "CANDIDATE_LOG_PROBS", "CANDIDATE_CODES"),
)
ENSEMBLE_CONTRACT = ModelContract(
    ENSEMBLE,
    inputs=(ITEM_IDS, ACTIONS, TIMESTAMPS, EVENTS_BEFORE) + OPTION_INPUTS,
    outputs=(RECOMMENDED_IDS, RANK_SCORES, RETRIEVAL_LOG_PROBS, SEMANTIC_IDS, HISTORY_LENGTH, TRUNCATED, EVENT_COUNT, RESTORED),
)
CONTRACTS = {c.name: c for c in (ENCODER_CONTRACT, DECODER_CONTRACT, RANKER_CONTRACT, ENSEMBLE_CONTRACT)}

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
