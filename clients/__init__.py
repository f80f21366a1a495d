"""Client of the served recommender: the gRPC client library and its command line.

Needs numpy and tritonclient only (no torch): besides this package it reads the tensor contract,
``genrec_contract.protocol``. Installable on its own as the distribution ``genrec-client``
(pyproject.toml at the repository root). The demo and the replay service are in ``examples/``,
the served-path evaluation in ``perf/served_eval.py``."""
from .client import Recommendation, RecommenderClient, RecommenderError, SessionLost

__all__ = ["Recommendation", "RecommenderClient", "RecommenderError", "SessionLost"]
