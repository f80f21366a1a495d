"""Export the M-FALCON ranker to ONNX: one microbatch of candidates scored against a user
batch's cached history K/V (see ``backend_src.serving.ranker_runtime`` for the contract).

Inputs history_keys [L, B, n, H, dqk], history_values [L, B, n, H, dv], history_timestamps
[B, n] int64, history_lengths [B] int64, candidate_vectors [B, m, D] float32 (the candidates'
item vectors, read from the model's live item table by the runtime); output scores [B, m]
float32 with B, n, m dynamic.

    python -m export.onnx_ranker --checkpoint model.pt --out ranker.onnx
"""
from __future__ import annotations

import argparse
import copy
import warnings
from pathlib import Path

import numpy as np
import torch

from backend_src.serving.ranker_runtime import (
    INPUT_AXES,
    INPUT_NAMES,
    OUTPUT_AXES,
    OUTPUT_NAME,
    RankerGraph,
    as_ranker,
    example_inputs,
)

# example shapes for tracing: distinct from each other and from 1, so that no dynamic axis
# is mistaken for a constant or for another axis
EXAMPLE_SHAPE = dict(B=2, n=5, m=3)


def _dynamic_axes() -> dict:
    axes = {name: {i: a for i, a in enumerate(dims) if a} for name, dims in INPUT_AXES.items()}
    axes[OUTPUT_NAME] = {i: a for i, a in enumerate(OUTPUT_AXES)}
    return axes


def export_ranker_onnx(model_or_ranker, path, opset: int = 17, check: bool = True) -> Path:
    """Write the ranker graph to `path` (ONNX, `opset`) and return the path.

    Uses the TorchScript-tracing exporter: the graph has no data-dependent control flow, and
    every shape it uses is read from the inputs, so the traced graph is valid for all B, n, m
    (n >= 1). With ``check`` the exported graph is run once in ONNX Runtime against torch at
    shapes different from the tracing example.
    """
    ranker = as_ranker(model_or_ranker)
    if next(ranker.parameters()).device.type != "cpu":
        ranker = copy.deepcopy(ranker).cpu()  # export (and check) on the CPU; the model stays put
    was_training = ranker.training
    graph = RankerGraph(ranker).eval()  # no dropout in the exported graph
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    inputs = example_inputs(ranker.cfg, **EXAMPLE_SHAPE)
    try:
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # tracer notes about shape arithmetic, all symbolic here
            torch.onnx.export(
                graph,
                inputs,
                str(path),
                input_names=list(INPUT_NAMES),
                output_names=[OUTPUT_NAME],
                dynamic_axes=_dynamic_axes(),
                opset_version=opset,
                do_constant_folding=True,
                dynamo=False,
            )
    finally:
        ranker.train(was_training)
    if check:
        err = max_abs_error(graph, path, ranker.cfg, B=3, n=7, m=4, seed=1)
        if not err <= 1e-4:
            raise RuntimeError(f"{path}: ONNX Runtime differs from torch by {err:g}")
    return path


def max_abs_error(graph_or_ranker, onnx_path, cfg, B: int, n: int, m: int, seed: int = 0) -> float:
    """Largest |ORT - torch| over the scores at one shape (a NaN or inf anywhere counts as an
    infinite error)."""
    import onnxruntime as ort

    graph = graph_or_ranker if isinstance(graph_or_ranker, RankerGraph) else RankerGraph(as_ranker(graph_or_ranker))
    inputs = example_inputs(cfg, B=B, n=n, m=m, seed=seed)
    with torch.no_grad():
        ref = graph.eval()(*inputs).numpy()
    sess = ort.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"])
    out = sess.run([OUTPUT_NAME], {k: t.numpy() for k, t in zip(INPUT_NAMES, inputs)})[0]
    if np.isnan(out).any() or not np.array_equal(np.isinf(out), np.isinf(ref)):
        return float("inf")
    fin = np.isfinite(ref)
    return float(np.abs(out[fin] - ref[fin]).max()) if fin.any() else 0.0


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description="Export the M-FALCON ranker of a checkpoint to ONNX")
    ap.add_argument("--checkpoint", required=True, help="GenerativeRecommender checkpoint (model.pt)")
    ap.add_argument("--out", required=True, help="output ONNX file (ranker.onnx)")
    ap.add_argument("--opset", type=int, default=17)
    a = ap.parse_args(argv)
    from backend_src.model.recommender import GenerativeRecommender

    model = GenerativeRecommender.load(a.checkpoint)
    out = export_ranker_onnx(model, a.out, opset=a.opset)
    print(f"wrote {out} ({out.stat().st_size / 1e6:.2f} MB)")


if __name__ == "__main__":
    main()
