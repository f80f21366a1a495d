"""Backend choice for each op call, made here and only here (``kernels_for``): the Triton kernels
for GPU tensors they support, the torch reference otherwise; the numba CPU kernels where they apply
(``fused_cpu_kernels``: the encoder's one-event append, a beam-search step, the co-visitation lookup)."""
from __future__ import annotations

import functools
import os

import torch

from backend_src.ops import reference

_ENV = "GENREC_OPS_BACKEND"  # "auto" (default), "torch" or "triton"


@functools.lru_cache(maxsize=None)
def _triton_module():
    try:
        from backend_src.ops import triton_kernels
    except Exception:  # triton missing or too old: the reference serves
        return None
    return triton_kernels


@functools.lru_cache(maxsize=None)
def _cpu_module():
    from backend_src.ops import cpu_kernels  # imports numba (slow): only on first use

    return cpu_kernels if cpu_kernels.available() else None


def fused_cpu_kernels(*tensors: torch.Tensor):
    """The fused CPU kernels module (``cpu_kernels``, numba) when it takes a call on `tensors`:
    all float32 on the CPU, numba importable, GENREC_OPS_BACKEND not forcing a backend
    ("torch" runs the reference composition); else None."""
    if os.environ.get(_ENV, "auto") != "auto" or not all(t.is_cpu and t.dtype == torch.float32 for t in tensors):
        return None
    return _cpu_module()


def backend_for(*tensors: torch.Tensor) -> str:
    """'triton' when forced by the environment, or when every tensor is on a GPU and Triton
    imports; 'torch' otherwise. Never launches a kernel without a driver to run it on."""
    choice = os.environ.get(_ENV, "auto")
    if choice == "torch":
        return "torch"
    mod = _triton_module()
    if choice == "triton":
        if mod is None:
            raise RuntimeError(f"{_ENV}=triton but the Triton kernels cannot be imported")
        return "triton"
    if mod is not None and tensors and all(t.is_cuda for t in tensors) and torch.cuda.is_available():
        return "triton"
    return "torch"


def kernels_for(op: str, args: tuple, kwargs: dict):
    """The one backend decision of an op call: the Triton kernels module when it takes the call,
    None for the reference. The kernels are forward-only, so a call needing gradients (training,
    through autograd) takes the reference; so do tensors off the GPU (unless GENREC_OPS_BACKEND
    forces Triton) and calls the kernels do not support (other dtypes, empty inputs)."""
    # (the tensors of a tuple argument count too: the rows pfa_select_rows gathers)
    tensors = [t for a in (*args, *kwargs.values()) for t in (a if isinstance(a, (tuple, list)) else (a,))
               if isinstance(t, torch.Tensor)]
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return None
    if backend_for(*tensors) != "triton":
        return None
    kernels = _triton_module()
    return kernels if kernels.supports(op, args, kwargs) else None


def _dispatch(name: str):
    ref = getattr(reference, name)

    @functools.wraps(ref)
    def op(*args, **kwargs):
        kernels = kernels_for(name, args, kwargs)
        return ref(*args, **kwargs) if kernels is None else getattr(kernels, name)(*args, **kwargs)

    return op


hstu_attention = _dispatch("hstu_attention")
attention_probs = _dispatch("attention_probs")
decode_attention = _dispatch("decode_attention")
pfa_select = _dispatch("pfa_select")
pfa_select_rows = _dispatch("pfa_select_rows")
dynamic_topk_attention = _dispatch("dynamic_topk_attention")
gather_rows = _dispatch("gather_rows")
