"""Triton-lang kernels for the ops in ``reference.py``: same names, signatures and results, one module
per op family, their shared set-up in ``common``:

- ``decode``: decode attention, attention probabilities, dynamic top-k attention;
- ``selection``: PFA's selection (alone and fused with the gather of its kept rows), gather_rows;
- ``hstu``: HSTU pointwise attention with its biases and the M-FALCON mask.

Every op takes the tensors as the reference does (any strides; fp32, fp16, bf16; fp32 accumulation;
output in the input dtype) and launches ``@triton.jit`` kernels for the heavy work; torch glue is
limited to allocation and the top-k over a score matrix (``torch.topk``; PFA's selection with the
gather of its kept rows ranks in a kernel instead). The ops are forward-only and do not choose a
backend: the dispatcher (``dispatch.py``) sends them the calls ``supports`` accepts, and everything
else (autograd, CPU tensors, other dtypes, empty inputs) to the reference.
"""
from __future__ import annotations

from .common import computable
from .decode import attention_probs, decode_attention, dynamic_topk_attention
from .hstu import hstu_attention
from .selection import gather_rows, pfa_select, pfa_select_rows

# Each op's arguments the kernels compute with, as (position, name): they must be computable
# (fp32, fp16 or bf16, not empty). The others (lengths, positions, timestamps, the rows copied by
# gather_rows and pfa_select_rows) are taken in any dtype.
COMPUTED_ARGUMENTS = {
    "decode_attention": ((0, "q"), (1, "k"), (2, "v")),
    "attention_probs": ((0, "q"), (1, "k")),
    "dynamic_topk_attention": ((0, "q"), (1, "k"), (2, "v")),
    "pfa_select": ((0, "q"), (1, "k"), (3, "beam_weights")),
    "pfa_select_rows": ((0, "q"), (1, "k"), (3, "beam_weights")),
    "gather_rows": (),
    "hstu_attention": ((0, "q"), (1, "k"), (2, "v"), (9, "pos_bias"), (10, "time_bias")),
}


def supports(op: str, args: tuple, kwargs: dict) -> bool:
    """Whether the kernels take this call of `op` (asked by the dispatcher, which has already ruled
    out autograd and tensors off the GPU): an op of this module with computable arguments."""
    computed = COMPUTED_ARGUMENTS.get(op)
    if computed is None:
        return False
    return all(computable(args[i] if i < len(args) else kwargs.get(name)) for i, name in computed)


__all__ = ["COMPUTED_ARGUMENTS", "attention_probs", "decode_attention", "dynamic_topk_attention", "gather_rows",
           "hstu_attention", "pfa_select", "pfa_select_rows", "supports"]
