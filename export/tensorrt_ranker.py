"""Build a TensorRT engine (``ranker.plan``) from the ranker's ONNX graph.

One optimization profile covers the dynamic axes B (users), n (history rows) and m
(candidates of one microbatch) with (min, opt, max) sizes; the fixed axes (layers, heads,
head dim) are read from the ONNX graph. With fp16 the layers that compute log time buckets
from raw second timestamps stay in fp32 (time differences overflow fp16's 65504).

    python -m export.tensorrt_ranker --onnx ranker.onnx --out ranker.plan \
        --batch 1 8 32 --history 1 200 200 --candidates 1 64 64
"""
from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

from backend_src.serving.ranker_runtime import INPUT_AXES

DEFAULT_PROFILES = {"B": (1, 8, 32), "n": (1, 200, 200), "m": (1, 64, 64)}
DEFAULT_WORKSPACE = 2 << 30  # bytes of scratch memory TensorRT may use per layer


def default_profiles(cfg) -> dict:
    """Optimization profile for a model: histories up to its max length, up to 8 users a
    batch (the encoder's sequence batch), microbatches up to 256 candidates."""
    n = int(cfg.max_seq_len)
    return {"B": (1, 1, 8), "n": (1, n, n), "m": (1, 64, 256)}


def tensorrt_available() -> tuple[bool, str]:
    """(True, version) when the TensorRT Python package imports, else (False, why not)."""
    if importlib.util.find_spec("tensorrt") is None:
        return False, "the 'tensorrt' Python package is not installed"
    try:
        import tensorrt as trt
    except Exception as e:  # noqa: BLE001 - a stub or broken install: report, never crash
        return False, f"the 'tensorrt' Python package does not import: {type(e).__name__}: {e}"
    if not hasattr(trt, "Builder"):
        return False, "the installed 'tensorrt' package is a stub without the TensorRT API"
    return True, f"TensorRT {getattr(trt, '__version__', '?')}"


def _check_profiles(profiles: dict) -> dict:
    out = {}
    for axis in ("B", "n", "m"):
        if axis not in profiles:
            raise ValueError(f"profiles needs (min, opt, max) for axis {axis!r}, got {sorted(profiles)}")
        lo, opt, hi = (int(v) for v in profiles[axis])
        if not 1 <= lo <= opt <= hi:
            raise ValueError(f"profile of {axis!r} must satisfy 1 <= min <= opt <= max, got {(lo, opt, hi)}")
        out[axis] = (lo, opt, hi)
    return out


def _keep_time_path_fp32(network, trt) -> int:
    """Pin the float layers between the timestamp input and the (integer) time bucket to fp32.

    Walks the network in its topological layer order from ``history_timestamps``: integer
    tensors derived from it (differences) and the float tensors computed from those (|dt|,
    log, divide, floor) belong to the path; the cast back to an integer bucket ends it.
    Returns the number of pinned layers."""
    ints = {trt.int32} | ({trt.int64} if hasattr(trt, "int64") else set())
    floats = {trt.float32, trt.float16}
    int_path = {"history_timestamps"}  # integer tensors of raw time
    float_path: set = set()  # float tensors of raw time
    pinned = 0
    for i in range(network.num_layers):
        layer = network.get_layer(i)
        if layer.type == trt.LayerType.SHAPE:  # sizes are not times
            continue
        names = {layer.get_input(j).name for j in range(layer.num_inputs) if layer.get_input(j) is not None}
        from_int, from_float = bool(names & int_path), bool(names & float_path)
        if not (from_int or from_float):
            continue
        for j in range(layer.num_outputs):
            out = layer.get_output(j)
            if out.dtype in ints:
                if not from_float:  # still raw integer time (a gathered or subtracted timestamp)
                    int_path.add(out.name)
            elif out.dtype in floats and layer.type != trt.LayerType.GATHER:  # not the bias lookup
                float_path.add(out.name)
                layer.precision = trt.float32
                layer.set_output_type(j, trt.float32)
                pinned += 1
    return pinned


def build_tensorrt_plan(onnx_path, plan_path, profiles: dict | None = None, fp16: bool = True,
                        workspace_bytes: int = DEFAULT_WORKSPACE) -> Path:
    """Parse `onnx_path`, build an engine for the (min, opt, max) `profiles` of B, n, m
    (e.g. ``{"B": (1, 8, 32), "n": (1, 200, 200), "m": (1, 64, 64)}``) and write it to
    `plan_path`. Raises RuntimeError when TensorRT is missing or the build fails."""
    try:
        import tensorrt as trt
    except ImportError as e:
        raise RuntimeError("building a TensorRT plan needs the 'tensorrt' Python package (NVIDIA TensorRT)") from e
    ok, why = tensorrt_available()
    if not ok:
        raise RuntimeError(f"building a TensorRT plan needs the 'tensorrt' Python package: {why}")
    prof = _check_profiles(profiles or DEFAULT_PROFILES)

    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    major = int(trt.__version__.split(".")[0])
    flags = 0
    if major < 10:  # TensorRT 10 networks are always explicit-batch (the flag is deprecated)
        flags = 1 << int(trt.NetworkDefinitionCreationFlag.EXPLICIT_BATCH)
    network = builder.create_network(flags)
    parser = trt.OnnxParser(network, logger)
    if not parser.parse(Path(onnx_path).read_bytes()):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise RuntimeError(f"TensorRT could not parse {onnx_path}: {errors}")

    config = builder.create_builder_config()
    if hasattr(config, "set_memory_pool_limit"):
        config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, int(workspace_bytes))
    else:  # TensorRT < 8.4
        config.max_workspace_size = int(workspace_bytes)
    if fp16:
        if not builder.platform_has_fast_fp16:
            raise RuntimeError("fp16 requested but this GPU has no fast fp16")
        config.set_flag(trt.BuilderFlag.FP16)
        if hasattr(trt.BuilderFlag, "OBEY_PRECISION_CONSTRAINTS"):
            config.set_flag(trt.BuilderFlag.OBEY_PRECISION_CONSTRAINTS)
        else:
            config.set_flag(trt.BuilderFlag.STRICT_TYPES)
        _keep_time_path_fp32(network, trt)

    profile = builder.create_optimization_profile()
    for i in range(network.num_inputs):
        tensor = network.get_input(i)
        axes = INPUT_AXES.get(tensor.name)
        if axes is None:
            raise RuntimeError(f"{onnx_path}: unexpected graph input {tensor.name!r}")
        fixed = tuple(tensor.shape)
        shapes = [
            tuple(prof[a][k] if a else int(fixed[d]) for d, a in enumerate(axes)) for k in range(3)
        ]  # min, opt, max
        profile.set_shape(tensor.name, *shapes)
    config.add_optimization_profile(profile)

    serialized = builder.build_serialized_network(network, config)
    if serialized is None:
        raise RuntimeError(f"TensorRT failed to build an engine from {onnx_path}")
    plan_path = Path(plan_path)
    plan_path.parent.mkdir(parents=True, exist_ok=True)
    plan_path.write_bytes(bytes(serialized))
    return plan_path


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description="Build a TensorRT plan of the M-FALCON ranker from its ONNX graph")
    ap.add_argument("--onnx", required=True, help="ranker.onnx from export.onnx_ranker")
    ap.add_argument("--out", required=True, help="output plan (ranker.plan)")
    for flag, axis, what in (("--batch", "B", "users"), ("--history", "n", "history rows"), ("--candidates", "m", "candidates per microbatch")):
        ap.add_argument(flag, type=int, nargs=3, metavar=("MIN", "OPT", "MAX"), default=DEFAULT_PROFILES[axis],
                        help=f"profile of {what} (default {DEFAULT_PROFILES[axis]})")
    ap.add_argument("--fp32", action="store_true", help="build without fp16")
    ap.add_argument("--workspace-mb", type=int, default=DEFAULT_WORKSPACE >> 20)
    a = ap.parse_args(argv)
    profiles = {"B": a.batch, "n": a.history, "m": a.candidates}
    out = build_tensorrt_plan(a.onnx, a.out, profiles, fp16=not a.fp32, workspace_bytes=a.workspace_mb << 20)
    print(f"wrote {out} ({out.stat().st_size / 1e6:.2f} MB)")


if __name__ == "__main__":
    main()
