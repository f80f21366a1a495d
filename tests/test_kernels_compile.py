"""Compile every Triton kernel for an sm_90 GPU without one (fp32 and fp16 signatures).

The CPU interpreter runs kernels as numpy code and misses errors only the compiler sees
(a loop-carried value changing dtype, a tl.dot shape below 16, an unsupported op). Here each
@triton.jit kernel goes through the real pipeline down to a cubin with the bundled ptxas, and
ptxas' own register and spill counts of the HSTU kernel's tiles are checked: a tile that spills
to local memory runs several times slower (fp32 tiles on the FMA units hold every operand in
registers).
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import re
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
TARGET = GPUTarget("cuda", 90, 32)
# Triton fixes interpreter/compile mode for its language library at its first import; when an
# earlier test file imported it for the interpreter, the compiles run in a fresh process.
IN_PROCESS = isinstance(tl.zeros, triton.runtime.JITFunction)


def _load_compilable_kernels():
    """A private copy of the kernels package whose @triton.jit functions are compilable."""
    from backend_src.ops.kernel_copies import KERNELS_PACKAGE, load_copy

    saved = os.environ.pop("TRITON_INTERPRET", None)
    try:
        return load_copy(KERNELS_PACKAGE, "_genrec_triton_kernels_compiled")
    finally:
        if saved is not None:
            os.environ["TRITON_INTERPRET"] = saved


K = _load_compilable_kernels() if IN_PROCESS else None


def _kernels_by_name() -> dict:
    """Every @triton.jit kernel (a name ending in _kernel) of the package's modules, by name."""
    from backend_src.ops.kernel_copies import modules_of

    return {n: obj for mod in modules_of(K) for n, obj in vars(mod).items()
            if n.endswith("_kernel") and isinstance(obj, triton.runtime.JITFunction)}

# pointer arguments that hold integer indices / lengths / positions / timestamps
INT_PTRS = {"len_ptr", "idx_ptr", "qpos_ptr", "kpos_ptr", "qts_ptr", "kts_ptr", "nh_ptr", "qself_ptr", "cthr_ptr"}
FLOAT_SCALARS = {"qk_scale", "inv_heads", "scale", "inv_norm", "inv_log2_base"}
FP32_PTRS = {"_pfa_scores_kernel": {"out_ptr"}, "_beam_head_mean_kernel": {"stat_ptr", "out_ptr"},
             "_pfa_select_rows_kernel": {"s_ptr"},
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


# (kernel name, case id, constexprs as a function of the dtype[, compile options; default 4 warps])
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
    # the op's launches (warps: triton_kernels.selection._select_rows_warps): a user's 2048 scores, then its
    # kept states (F 64) and K (F 256); and the longest history one program sorts
    # (SELECT_ROWS_MAX_N), one tensor
    ("_pfa_select_rows_kernel", "n2048_two_tensors",
     lambda dt: dict(N_POW2=2048, KEEP_POW2=256, HAS_Y=True, BLOCK_J=16, BLOCK_FX=64, BLOCK_FY=256),
     {"num_warps": 8}),
    ("_pfa_select_rows_kernel", "n8192_one_tensor",
     lambda dt: dict(N_POW2=8192, KEEP_POW2=1024, HAS_Y=False, BLOCK_J=64, BLOCK_FX=64, BLOCK_FY=64),
     {"num_warps": 16}),
    ("_hstu_attention_kernel", "d32",
     lambda dt: dict(D=32, DV=32, BLOCK_M=64, BLOCK_N=64, BLOCK_D=32, BLOCK_DV=32, DOT_PRECISION=_precision(dt),
                     BIASES=2, TIME_STEPS=3)),
    ("_hstu_attention_kernel", "d16_dv48",
     lambda dt: dict(D=16, DV=48, BLOCK_M=16, BLOCK_N=16, BLOCK_D=16, BLOCK_DV=64, DOT_PRECISION=_precision(dt),
                     BIASES=2, TIME_STEPS=3)),
    ("_hstu_attention_kernel", "per_pair_time_d32",  # every pair's own time bucket
     lambda dt: dict(D=32, DV=32, BLOCK_M=32, BLOCK_N=32, BLOCK_D=32, BLOCK_DV=32, DOT_PRECISION=_precision(dt),
                     BIASES=2, TIME_STEPS=0)),
    ("_hstu_attention_kernel", "no_bias_d64",  # the efficiency profile's variant
     lambda dt: dict(D=64, DV=64, BLOCK_M=128, BLOCK_N=32, BLOCK_D=64, BLOCK_DV=64, DOT_PRECISION=_precision(dt),
                     BIASES=0, TIME_STEPS=3)),
]


def _compile(kernel: str, case: str, dtype: str, options=None, constexprs=None):
    if constexprs is None:
        entry = next(c for c in CASES if c[0] == kernel and c[1] == case)
        constexprs = entry[2](dtype)
        options = options or (entry[3] if len(entry) > 3 else None)
    fn = _kernels_by_name()[kernel]
    assert isinstance(fn, triton.runtime.JITFunction)
    src = ASTSource(fn, signature=_signature(fn, dtype), constexprs=constexprs)
    compiled = triton.compile(src, target=TARGET, options=options or {"num_warps": 4})
    assert compiled.asm.get("cubin"), "no cubin produced"
    assert ".target sm_90" in compiled.asm["ptx"]
    return compiled


# HSTU tiles whose ptxas counts are checked: the op's tile of each dtype at head dims 32 and 64
def _hstu_usage_cases() -> list:
    return [("fp32", 16), ("fp32", 32), ("fp32", 64), ("fp32", 128), ("fp16", 32), ("fp16", 64)]


def _ptxas_usage(kernel: str, case: str, dtype: str, options=None, constexprs=None) -> dict:
    """ptxas' counts for one compile of `kernel` (registers, spill bytes), from the log of the
    compile Triton itself runs (its own ptxas flags); {} where this Triton cannot print that log."""
    knobs = getattr(triton, "knobs", None)
    if knobs is None or not hasattr(knobs.nvidia, "dump_ptxas_log") or not hasattr(knobs.compilation,
                                                                                    "always_compile"):
        return {}
    log = io.StringIO()
    saved = knobs.nvidia.dump_ptxas_log, knobs.compilation.always_compile
    knobs.nvidia.dump_ptxas_log, knobs.compilation.always_compile = True, True  # a cached cubin prints nothing
    try:
        with contextlib.redirect_stdout(log):
            _compile(kernel, case, dtype, options, constexprs)
    finally:
        knobs.nvidia.dump_ptxas_log, knobs.compilation.always_compile = saved
    text = log.getvalue()
    regs = re.search(r"Used (\d+) registers", text)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", text)
    if not regs or not spills:
        return {}
    return dict(registers=int(regs.group(1)), spill_stores=int(spills.group(1)), spill_loads=int(spills.group(2)))


def _hstu_usage(dtype: str, d: int) -> dict:
    """ptxas' counts for the op's HSTU tile of `dtype` at head dim d ({} where they cannot be read)."""
    import torch

    bm, bn, warps, stages = K.hstu.hstu_tile(torch.float32 if dtype == "fp32" else torch.float16, d)
    constexprs = dict(D=d, DV=d, BLOCK_M=bm, BLOCK_N=bn, BLOCK_D=d, BLOCK_DV=d, DOT_PRECISION=_precision(dtype),
                      BIASES=2, TIME_STEPS=3)
    usage = _ptxas_usage("_hstu_attention_kernel", "", dtype, {"num_warps": warps, "num_stages": stages}, constexprs)
    return dict(tile=[bm, bn, warps, stages], **usage) if usage else {}


# PFA's fused selection: its cases' ptxas counts (fp16 rows; the sort is of 64-bit keys either way)
SELECT_ROWS_CASES = [c[1] for c in CASES if c[0] == "_pfa_select_rows_kernel"]


def _jitted_kernels() -> list:
    return sorted(_kernels_by_name())


def _compile_all() -> dict:
    """{'kernel/case/dtype': '' or the error} for every case, and the kernels found."""
    results = {"kernels": _jitted_kernels()}
    for kernel, case, *_ in CASES:
        for dtype in ("fp32", "fp16"):
            try:
                _compile(kernel, case, dtype)
                results[f"{kernel}/{case}/{dtype}"] = ""
            except Exception as exc:  # reported per case by the tests
                results[f"{kernel}/{case}/{dtype}"] = f"{type(exc).__name__}: {exc}"
    for dtype, d in _hstu_usage_cases():
        try:
            results[f"usage/{dtype}/{d}"] = _hstu_usage(dtype, d)
        except Exception as exc:
            results[f"usage/{dtype}/{d}"] = f"{type(exc).__name__}: {exc}"
    for case in SELECT_ROWS_CASES:
        try:
            results[f"usage/select_rows/{case}"] = _ptxas_usage("_pfa_select_rows_kernel", case, "fp16")
        except Exception as exc:
            results[f"usage/select_rows/{case}"] = f"{type(exc).__name__}: {exc}"
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


def _usage_or_skip(request, key: str, compute) -> dict:
    """ptxas' register and spill counts: computed here, or read from the fresh-process run."""
    if IN_PROCESS:
        usage = compute()
    else:
        usage = request.getfixturevalue("fresh_process_results")[key]
        assert not isinstance(usage, str), usage
    if not usage:
        pytest.skip("this Triton cannot print ptxas' log (triton.knobs.nvidia.dump_ptxas_log)")
    return usage


@pytest.mark.parametrize("dtype,d", _hstu_usage_cases())
def test_hstu_tile_registers(dtype, d, request):
    """ptxas counts of the op's HSTU tile: fp32 must not spill (its products run on the FMA units
    with q, k, v, the logits and the accumulator all in registers); fp16 may spill a little (its
    tensor-core tiles sit at the 255-register limit: 696-1228 / 752-1352 bytes with the per-row time
    path at one pipeline stage), bounded here so that a change which makes it spill much more fails."""
    usage = _usage_or_skip(request, f"usage/{dtype}/{d}", lambda: _hstu_usage(dtype, d))
    print(f"HSTU {dtype} d{d} tile {usage['tile']}: {usage['registers']} registers, "
          f"{usage['spill_stores']} / {usage['spill_loads']} bytes spill stores / loads")
    assert 0 < usage["registers"] <= 255
    if dtype == "fp32":
        assert usage["spill_stores"] == 0 and usage["spill_loads"] == 0, usage
    else:
        assert usage["spill_stores"] <= 1536, usage


@pytest.mark.parametrize("case", SELECT_ROWS_CASES)
def test_select_rows_registers(case, request):
    """ptxas counts of PFA's fused selection: a user's keys are sorted in registers, so the warps
    per history length (triton_kernels.selection._select_rows_warps) must keep them there: no spills."""
    usage = _usage_or_skip(request, f"usage/select_rows/{case}",
                           lambda: _ptxas_usage("_pfa_select_rows_kernel", case, "fp16"))
    print(f"select rows {case}: {usage['registers']} registers, "
          f"{usage['spill_stores']} / {usage['spill_loads']} bytes spill stores / loads")
    assert 0 < usage["registers"] <= 255
    assert usage["spill_stores"] == 0 and usage["spill_loads"] == 0, usage


if __name__ == "__main__":  # the fresh-process run: one JSON line of results
    if not IN_PROCESS:
        sys.exit("Triton imported in interpreter mode; unset TRITON_INTERPRET")
    print(json.dumps(_compile_all()))
