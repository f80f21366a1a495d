"""Decoding: batched constrained beam search over semantic IDs (full / PFA / baselines) and the
attention statistics of the PFA paper."""
from backend_src.decoding.attention_stats import attention_stats, plot_attention_stats  # noqa: F401
from backend_src.decoding.beam_search import BeamResult, generate  # noqa: F401
