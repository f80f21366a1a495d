"""The op layer: one function per op, dispatched to the fastest backend for the tensors given.

``reference`` (torch) always exists and defines the semantics. The ``triton_kernels`` package holds
the Triton-lang kernels, one module per op family, used for CUDA tensors when Triton is importable
(or everywhere when ``GENREC_OPS_BACKEND=triton`` with ``TRITON_INTERPRET=1``, which is how the CPU
tests run them); ``dispatch`` makes the choice.
``cpu_kernels`` (numba) fuses, on the CPU, the encoder's one-event append, a beam-search step after the
decoder head's layers, and the co-visitation lookup, each into one call.
"""
from backend_src.ops.dispatch import (  # noqa: F401
    attention_probs,
    backend_for,
    decode_attention,
    dynamic_topk_attention,
    fused_cpu_kernels,
    gather_rows,
    hstu_attention,
    pfa_select,
    pfa_select_rows,
)
from backend_src.ops.reference import time_bucket, time_bucket_thresholds  # noqa: F401
