"""Offline performance harness: decode, ranking and caching benchmarks, and their report."""
import os

# Idle OpenMP threads sleep instead of spinning: on a shared host a spinning thread takes the
# core its busy sibling needs, which slows multi-threaded runs by an order of magnitude. Set
# before torch loads its OpenMP runtime; an explicit setting in the environment wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
