"""Compile every Triton kernel for an sm_90 GPU without one (fp32 and fp16 signatures).

The CPU interpreter runs kernels as numpy code and misses errors only the compiler sees
(a loop-carried value changing dtype, a tl.dot shape below 16, an unsupported op). Here each
@triton.jit kernel goes through the real pipeline down to a cubin with the bundled ptxas.
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

try:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
except ImportError as exc:  # pragma: no cover - depends on the installed Triton
    pytest.skip(f"this Triton has no ASTSource/GPUTarget ahead-of-time compile API: {exc}",
                allow_module_level=True)

REPO = Path(__file__).resolve().parents[1]
KERNELS_FILE = REPO / "backend_src" / "ops" / "triton_kernels.py"
TARGET = GPUTarget("cuda", 90, 32)
# Triton fixes interpreter/compile mode for its language library at its first import; when an
# earlier test file imported it for the interpreter, the compiles run in a fresh process.
IN_PROCESS = isinstance(tl.zeros, triton.runtime.JITFunction)


def _load_compilable_kernels():
    """A private copy of the kernels module whose @triton.jit functions are compilable."""
    saved = os.environ.pop("TRITON_INTERPRET", None)
    try:
        spec = importlib.util.spec_from_file_location("_genrec_triton_kernels_compiled", KERNELS_FILE)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    finally:
        if saved is not None:
            os.environ["TRITON_INTERPRET"] = saved
    return mod


K = _load_compilable_kernels() if IN_PROCESS else None

# pointer arguments that hold integer indices / lengths / positions / timestamps
INT_PTRS = {"len_ptr", "idx_ptr", "qpos_ptr", "kpos_ptr", "qts_ptr", "kts_ptr", "nh_ptr", "qself_ptr"}
FLOAT_SCALARS = {"qk_scale", "inv_heads", "scale", "inv_norm", "inv_log2_base"}
FP32_PTRS = {"_pfa_scores_kernel": {"out_ptr"}, "_beam_head_mean_kernel": {"stat_ptr", "out_ptr"},
             "_hstu_attention_kernel": {"pb_ptr", "tb_ptr", "thr_ptr"},
             "_decode_attention_kernel": {"sel_ptr", "tau_ptr"}}


def _signature(fn, dtype: str) -> dict:
    sig = {}
    for p in fn.params:
        name = p.name
        if p.is_constexpr:
            sig[name] = "constexpr"
        elif name.endswith("_ptr"):
            if name in INT_PTRS:
                sig[name] = "*i64"
            elif name in FP32_PTRS.get(fn.__name__, ()):
                sig[name] = "*fp32"
            else:
                sig[name] = f"*{dtype}"
        elif name in FLOAT_SCALARS:
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
    return sig


def _precision(dtype: str) -> str:
    return "ieee" if dtype == "fp32" else "tf32"


# (kernel name, case id, constexprs as a function of the dtype)
CASES = [
    ("_decode_attention_kernel", "prefix_d64",
     lambda dt: dict(HAS_THRESH=False, BLOCK_W=64, BLOCK_N=64, BLOCK_D=64, BLOCK_DV=64,
                     DOT_PRECISION=_precision(dt))),
    ("_decode_attention_kernel", "prefix_d16",
     lambda dt: dict(HAS_THRESH=False, BLOCK_W=16, BLOCK_N=16, BLOCK_D=16, BLOCK_DV=32,
                     DOT_PRECISION=_precision(dt))),
    ("_decode_attention_kernel", "per_beam_rows_d64",
     lambda dt: dict(HAS_THRESH=True, BLOCK_W=64, BLOCK_N=64, BLOCK_D=64, BLOCK_DV=64,
                     DOT_PRECISION=_precision(dt))),
    ("_attention_probs_kernel", "d32",
     lambda dt: dict(BLOCK_W=64, BLOCK_N=64, BLOCK_D=32, DOT_PRECISION=_precision(dt))),
    ("_pfa_scores_kernel", "d64",
     lambda dt: dict(BLOCK_W=64, BLOCK_N=64, BLOCK_D=64, DOT_PRECISION=_precision(dt))),
    ("_beam_head_mean_kernel", "d16",
     lambda dt: dict(BLOCK_W=16, BLOCK_N=32, BLOCK_D=16, DOT_PRECISION=_precision(dt))),
    ("_beam_head_mean_kernel", "d64",
     lambda dt: dict(BLOCK_W=64, BLOCK_N=64, BLOCK_D=64, DOT_PRECISION=_precision(dt))),
    ("_gather_rows_kernel", "rows", lambda dt: dict(BLOCK_J=8, BLOCK_F=512)),
    ("_hstu_attention_kernel", "d32",
     lambda dt: dict(D=32, DV=32, BLOCK_M=64, BLOCK_N=64, BLOCK_D=32, BLOCK_DV=32, DOT_PRECISION=_precision(dt),
                     BIASES=2)),
    ("_hstu_attention_kernel", "d16_dv48",
     lambda dt: dict(D=16, DV=48, BLOCK_M=16, BLOCK_N=16, BLOCK_D=16, BLOCK_DV=64, DOT_PRECISION=_precision(dt),
                     BIASES=2)),
    ("_hstu_attention_kernel", "no_bias_d64",  # the efficiency profile's variant
     lambda dt: dict(D=64, DV=64, BLOCK_M=128, BLOCK_N=32, BLOCK_D=64, BLOCK_DV=64, DOT_PRECISION=_precision(dt),
                     BIASES=0)),
]


def _compile(kernel: str, case: str, dtype: str) -> None:
    constexprs = next(c[2] for c in CASES if c[0] == kernel and c[1] == case)
    fn = getattr(K, kernel)
    assert isinstance(fn, triton.runtime.JITFunction)
    src = ASTSource(fn, signature=_signature(fn, dtype), constexprs=constexprs(dtype))
    compiled = triton.compile(src, target=TARGET, options={"num_warps": 4})
    assert compiled.asm.get("cubin"), "no cubin produced"
    assert ".target sm_90" in compiled.asm["ptx"]


def _jitted_kernels() -> list:
    return sorted(n for n, obj in vars(K).items()
                  if n.endswith("_kernel") and isinstance(obj, triton.runtime.JITFunction))


def _compile_all() -> dict:
    """{'kernel/case/dtype': '' or the error} for every case, and the kernels found."""
    results = {"kernels": _jitted_kernels()}
    for kernel, case, _ in CASES:
        for dtype in ("fp32", "fp16"):
            try:
                _compile(kernel, case, dtype)
                results[f"{kernel}/{case}/{dtype}"] = ""
            except Exception as exc:  # reported per case by the tests
                results[f"{kernel}/{case}/{dtype}"] = f"{type(exc).__name__}: {exc}"
    return results


@pytest.fixture(scope="module")
def fresh_process_results():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    res = subprocess.run([sys.executable, str(Path(__file__))], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stderr[-4000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def test_every_kernel_is_covered(request):
    jitted = _jitted_kernels() if IN_PROCESS else request.getfixturevalue("fresh_process_results")["kernels"]
    assert set(jitted) == {c[0] for c in CASES}


@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
@pytest.mark.parametrize("kernel,case", [c[:2] for c in CASES], ids=[f"{c[0]}-{c[1]}" for c in CASES])
def test_compiles_for_sm90(kernel, case, dtype, request):
    if IN_PROCESS:
        _compile(kernel, case, dtype)
    else:
        error = request.getfixturevalue("fresh_process_results")[f"{kernel}/{case}/{dtype}"]
        assert not error, error


if __name__ == "__main__":  # the fresh-process run: one JSON line of results
    if not IN_PROCESS:
        sys.exit("Triton imported in interpreter mode; unset TRITON_INTERPRET")
    print(json.dumps(_compile_all()))
