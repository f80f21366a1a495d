"""Clients of the served recommender: a gRPC client library, a command line, an example
service that replays real user sessions, quality through the served path and the demo."""
from .client import Recommendation, RecommenderClient, RecommenderError, SessionLost

__all__ = ["Recommendation", "RecommenderClient", "RecommenderError", "SessionLost"]
