"""Runs the M-FALCON ranker for serving: in torch, in ONNX Runtime (``ranker.onnx``) or in
TensorRT (``ranker.plan``), behind one ``score`` call.

The exported graph scores ONE microbatch of candidates against the users' cached history
K/V (the history is an input, never recomputed); ``RankerRuntime.score`` keeps M-FALCON's
microbatching by looping over microbatches of b_m candidates and concatenating the scores.

Graph contract (all backends):
    history_keys        [L, B, n, H, dqk] float32   per-layer keys of the history rows
    history_values      [L, B, n, H, dv]  float32
    history_timestamps  [B, n]            int64     seconds; rows >= length are padding
    history_lengths     [B]               int64
    candidate_vectors   [B, m, D]         float32   the candidates' item vectors
 -> scores              [B, m]            float32   logits
B, n and m are dynamic; n >= 1 (an empty history is passed as one padding row, length 0).
The candidates come as vectors, read by `score` from the model's live item table, so an item the
catalog adds after export (model/catalog.py) is scored like any other; `score` gives padding
candidates (item 0) -inf.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import torch.nn as nn

from backend_src.config import RANKER_MICROBATCH, DecodeOptions
from backend_src.model.hstu import HistoryCache
from backend_src.model.ranker import MFalconRanker
from backend_src.ops.reference import row_mask

INPUT_NAMES = ("history_keys", "history_values", "history_timestamps", "history_lengths", "candidate_vectors")
OUTPUT_NAME = "scores"
# which input axis is which dynamic dimension (None: fixed by the model config)
INPUT_AXES = {
    "history_keys": (None, "B", "n", None, None),
    "history_values": (None, "B", "n", None, None),
    "history_timestamps": ("B", "n"),
    "history_lengths": ("B",),
    "candidate_vectors": ("B", "m", None),
}
OUTPUT_AXES = ("B", "m")
BACKENDS = ("torch", "onnxruntime", "tensorrt", "routed")
ONNX_FILE = "ranker.onnx"
PLAN_FILE = "ranker.plan"
TORCH_FILE = "ranker.pt"  # the ranker stage's artifact (GenerativeRecommender.save_stage)


def as_ranker(model_or_ranker: nn.Module) -> MFalconRanker:
    """The MFalconRanker of a GenerativeRecommender (``.ranker``), or the ranker itself."""
    if isinstance(model_or_ranker, MFalconRanker):
        return model_or_ranker
    ranker = getattr(model_or_ranker, "ranker", None)
    if isinstance(ranker, MFalconRanker):
        return ranker
    raise TypeError(f"expected an MFalconRanker or a model with .ranker, got {type(model_or_ranker).__name__}")


class RankerGraph(nn.Module):
    """The exported computation: one microbatch of candidates against the cached history.

    Same math as ``MFalconRanker.score`` with the whole microbatch at once (candidates never
    see each other, so scores do not depend on how candidates are split into microbatches).
    Written without data-dependent Python branches so that B, n and m stay symbolic.
    """

    def __init__(self, ranker: MFalconRanker):
        super().__init__()
        self.ranker = ranker

    def forward(self, history_keys, history_values, history_timestamps, history_lengths, candidate_vectors):
        B, n = history_timestamps.shape
        cache = HistoryCache(
            keys=history_keys,
            values=history_values,
            states=history_keys.new_zeros(B, n, 0),  # only its row count is read
            timestamps=history_timestamps,
            lengths=history_lengths,
        )
        # candidate time = last history timestamp (0 for an empty history), as in score()
        last = (history_lengths - 1).clamp(min=0)
        cand_ts = history_timestamps.gather(1, last[:, None]).squeeze(1) * (history_lengths > 0)
        states = self.ranker.candidate_states(cache, None, history_lengths, cand_ts, None, vectors=candidate_vectors)
        return self.ranker.head_logits(states, None, vectors=candidate_vectors)


def example_inputs(cfg, B: int = 2, n: int = 5, m: int = 3, seed: int = 0):
    """Random inputs of the graph contract (tracing example; tests)."""
    g = torch.Generator().manual_seed(seed)
    L, H = cfg.num_layers, cfg.num_heads
    d = cfg.d_model // H
    lengths = torch.randint(1, n + 1, (B,), generator=g)
    lengths[0] = n
    valid = row_mask(lengths, n)
    keys = torch.randn(L, B, n, H, d, generator=g) * valid[None, :, :, None, None]
    values = torch.randn(L, B, n, H, d, generator=g) * valid[None, :, :, None, None]
    ts = (1_600_000_000 + torch.randint(0, 10**5, (B, n), generator=g).cumsum(1)) * valid
    vectors = torch.randn(B, m, cfg.d_model, generator=g) * 0.1
    return keys, values, ts, lengths, vectors


# ------------------------------------------------------------------------------------------
# Runtime
# ------------------------------------------------------------------------------------------
class RankerRuntime:
    """Scores [B, M] candidates against cached histories with one of BACKENDS.

    Build with ``RankerRuntime.torch(ranker)``, ``.onnxruntime(path)``, ``.tensorrt(path)`` or
    ``.from_version_dir(dir, model)``. ``provider`` names what actually executes the graph.
    """

    def __init__(self, backend: str, runner, provider: str, device: str = "cpu", item_vectors=None):
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        self.backend = backend
        self.provider = provider
        self.device = device
        self._run = runner  # (keys, values, ts, lengths, candidate vectors) torch tensors -> [B, m] torch
        self.item_vectors = item_vectors  # item ids [B, M] -> [B, M, D]: the model's live item table

    # ---- constructors ---------------------------------------------------------------------
    @classmethod
    def torch(cls, model_or_ranker: nn.Module, device: str | torch.device | None = None) -> "RankerRuntime":
        """Serve the ranker module itself (switched to eval mode: no dropout)."""
        ranker = as_ranker(model_or_ranker)
        if device is not None:
            ranker.to(device)
        dev = str(next(ranker.parameters()).device)
        graph = RankerGraph(ranker).eval()

        def run(*inputs):
            with torch.inference_mode():
                return graph(*(t.to(dev) for t in inputs))

        return cls("torch", run, f"torch:{dev}", dev, ranker.backbone.item_vectors)

    @classmethod
    def onnxruntime(cls, onnx_path, item_vectors=None, num_threads: int | None = None) -> "RankerRuntime":
        import onnxruntime as ort

        opts = ort.SessionOptions()
        # one thread that sleeps when idle: ONNX Runtime's pool otherwise takes every core and
        # its threads spin between runs, taking the cores the other stages of a request need
        opts.intra_op_num_threads = int(num_threads or 1)
        opts.inter_op_num_threads = 1
        opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
        opts.add_session_config_entry("session.inter_op.allow_spinning", "0")
        sess = ort.InferenceSession(str(onnx_path), opts, providers=["CPUExecutionProvider"])
        names = tuple(i.name for i in sess.get_inputs())
        if set(names) != set(INPUT_NAMES):
            raise ValueError(f"{onnx_path}: graph inputs {names} are not {INPUT_NAMES}")

        def run(*inputs):
            feed = {name: t.detach().cpu().numpy() for name, t in zip(INPUT_NAMES, inputs)}
            return torch.from_numpy(sess.run([OUTPUT_NAME], feed)[0])

        runtime = cls("onnxruntime", run, sess.get_providers()[0], "cpu", item_vectors)
        runtime.session = sess
        return runtime

    @classmethod
    def tensorrt(cls, plan_path, item_vectors=None, device: str = "cuda") -> "RankerRuntime":
        return cls("tensorrt", _TensorRTRunner(plan_path, device), "TensorRT", device, item_vectors)

    @classmethod
    def fastest_by_history(cls, runtimes: list, cfg, max_history: int, candidates: int = 64,
                           reps: int = 5) -> "RankerRuntime":
        """One runtime that sends each call to the fastest of `runtimes` for its history length,
        timed here once (one user, `candidates` candidates, history lengths 16, 32, ... up to
        max_history): on a CPU ONNX Runtime wins on short histories and torch on long ones."""
        import bisect
        import time

        buckets = []
        n = 16
        while True:
            buckets.append(min(n, max_history))
            if n >= max_history:
                break
            n *= 2
        table = []
        for n in buckets:
            inputs = example_inputs(cfg, B=1, n=n, m=candidates)
            best = None
            for rt in runtimes:
                rt._run(*inputs)  # warm up
                times = []
                for _ in range(reps):
                    t0 = time.perf_counter()
                    rt._run(*inputs)
                    times.append(time.perf_counter() - t0)
                t = sorted(times)[len(times) // 2]
                if best is None or t < best[0]:
                    best = (t, rt)
            table.append((n, best[1]))
        bounds = [n for n, _ in table]

        def run(keys, values, ts, lengths, cands):
            i = min(bisect.bisect_left(bounds, ts.shape[1]), len(table) - 1)
            return table[i][1]._run(keys, values, ts, lengths, cands)

        chosen = ", ".join(f"n<={n}: {rt.backend}" for n, rt in table)
        return cls("routed", run, chosen, runtimes[0].device, runtimes[0].item_vectors)

    @classmethod
    def from_version_dir(cls, path, model: nn.Module | None = None, backend: str = "auto",
                         candidates: int = DecodeOptions.beam_width) -> "RankerRuntime":
        """The fastest backend a model version supports here: tensorrt (ranker.plan, a CUDA
        GPU and an importable tensorrt); else, with ranker.onnx, ONNX Runtime and torch routed by
        history length (fastest_by_history, timed on calls of `candidates` candidates: the
        candidates of one served call); else torch (``model``, else the version's ranker.pt)."""
        vdir = Path(path)
        plan, onnx_file = vdir / PLAN_FILE, vdir / ONNX_FILE
        auto = backend == "auto"
        if auto:
            if plan.exists() and torch.cuda.is_available() and _importable("tensorrt"):
                backend = "tensorrt"
            elif onnx_file.exists() and _importable("onnxruntime"):
                backend = "onnxruntime"
            else:
                backend = "torch"
        if backend not in BACKENDS[:3]:
            raise ValueError(f"backend must be 'auto' or one of {BACKENDS}, got {backend!r}")
        if model is None and (vdir / TORCH_FILE).exists():
            from backend_src.model.recommender import GenerativeRecommender

            model = GenerativeRecommender.load(vdir / TORCH_FILE)
        if model is None:  # every backend reads the candidates' vectors from the model's item table
            raise ValueError(f"{vdir}: no {TORCH_FILE} and no model given: the ranker's item table is in it")
        item_vectors = as_ranker(model).backbone.item_vectors
        if backend == "tensorrt":
            return cls.tensorrt(plan, item_vectors)
        if backend == "onnxruntime":
            onnx = cls.onnxruntime(onnx_file, item_vectors)
            if not auto:
                return onnx
            # neither is faster at every history length on a CPU: route by length
            return cls.fastest_by_history([onnx, cls.torch(model)], model.cfg, model.cfg.max_seq_len, candidates)
        return cls.torch(model)

    # ---- scoring --------------------------------------------------------------------------
    def score(self, keys, values, timestamps, lengths, candidates, microbatch_size: int = RANKER_MICROBATCH):
        """Scores [B, M] (same type as ``candidates``: numpy in -> numpy out, else torch).

        keys/values [L, B, n, H, d], timestamps [B, n], lengths [B], candidates [B, M] (0 =
        padding, scored -inf). The candidates' vectors go through the graph b_m at a time."""
        as_numpy = isinstance(candidates, np.ndarray)
        keys, values = _tensor(keys, torch.float32), _tensor(values, torch.float32)
        timestamps, lengths = _tensor(timestamps, torch.long), _tensor(lengths, torch.long)
        candidates = _tensor(candidates, torch.long)
        B, M = candidates.shape
        if timestamps.shape[1] == 0:  # the graph needs n >= 1: one padding row changes nothing
            L, _, _, H, d = keys.shape
            keys, values = keys.new_zeros(L, B, 1, H, d), values.new_zeros(L, B, 1, H, values.shape[-1])
            timestamps = timestamps.new_zeros(B, 1)
        bm = max(1, int(microbatch_size or M))
        with torch.inference_mode():
            vectors = self.item_vectors(candidates.to(self.device)).float()
        parts = [
            self._run(keys, values, timestamps, lengths, vectors[:, s : s + bm]).float()
            for s in range(0, M, bm)  # microbatches; each call is batched over users
        ]
        scores = torch.cat(parts, dim=1).cpu() if parts else torch.zeros(B, 0)
        scores = scores.masked_fill(candidates == 0, float("-inf"))
        return scores.numpy() if as_numpy else scores

    def score_cache(self, cache: HistoryCache, candidates, microbatch_size: int = RANKER_MICROBATCH):
        """``score`` on a HistoryCache."""
        return self.score(cache.keys, cache.values, cache.timestamps, cache.lengths, candidates, microbatch_size)

    def __repr__(self) -> str:
        return f"RankerRuntime(backend={self.backend!r}, provider={self.provider!r})"


def _tensor(x, dtype) -> torch.Tensor:
    t = torch.from_numpy(np.ascontiguousarray(x)) if isinstance(x, np.ndarray) else torch.as_tensor(x)
    return t.to(dtype)


def _importable(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


class _TensorRTRunner:
    """Executes a serialized TensorRT engine on torch CUDA tensors (the engine reads and
    writes the tensors' memory directly; one CUDA stream, synchronized per call)."""

    def __init__(self, plan_path, device: str = "cuda"):
        try:
            import tensorrt as trt
        except ImportError as e:
            raise RuntimeError("the TensorRT backend needs the 'tensorrt' Python package") from e
        if not torch.cuda.is_available():
            raise RuntimeError("the TensorRT backend needs a CUDA GPU")
        self.trt = trt
        self.device = torch.device(device)
        self.logger = trt.Logger(trt.Logger.WARNING)
        self.runtime = trt.Runtime(self.logger)
        self.engine = self.runtime.deserialize_cuda_engine(Path(plan_path).read_bytes())
        if self.engine is None:
            raise RuntimeError(f"{plan_path}: TensorRT could not deserialize the plan")
        self.context = self.engine.create_execution_context()
        self.v10 = hasattr(self.engine, "num_io_tensors")  # name-based I/O API (TensorRT >= 8.5)
        self.dtypes = {name: self._torch_dtype(self._engine_dtype(name)) for name in INPUT_NAMES + (OUTPUT_NAME,)}

    def _engine_dtype(self, name):
        if self.v10:
            return self.engine.get_tensor_dtype(name)
        return self.engine.get_binding_dtype(self.engine.get_binding_index(name))

    def _torch_dtype(self, trt_dtype):
        trt = self.trt
        table = {trt.float32: torch.float32, trt.float16: torch.float16, trt.int32: torch.int32, trt.bool: torch.bool}
        if hasattr(trt, "int64"):
            table[trt.int64] = torch.int64
        return table[trt_dtype]

    def __call__(self, *inputs):
        # int64 inputs become int32 where the engine declares them so (older parsers)
        ins = [t.to(self.device, self.dtypes[name]).contiguous() for name, t in zip(INPUT_NAMES, inputs)]
        B, m = inputs[4].shape
        out = torch.empty(B, m, dtype=self.dtypes[OUTPUT_NAME], device=self.device)
        stream = torch.cuda.current_stream(self.device)
        if self.v10:
            for name, t in zip(INPUT_NAMES, ins):
                self.context.set_input_shape(name, tuple(t.shape))
                self.context.set_tensor_address(name, t.data_ptr())
            self.context.set_tensor_address(OUTPUT_NAME, out.data_ptr())
            ok = self.context.execute_async_v3(stream.cuda_stream)
        else:
            bindings = [0] * self.engine.num_bindings
            for name, t in zip(INPUT_NAMES, ins):
                i = self.engine.get_binding_index(name)
                self.context.set_binding_shape(i, tuple(t.shape))
                bindings[i] = t.data_ptr()
            bindings[self.engine.get_binding_index(OUTPUT_NAME)] = out.data_ptr()
            ok = self.context.execute_async_v2(bindings, stream.cuda_stream)
        if not ok:
            raise RuntimeError("TensorRT execution failed")
        stream.synchronize()
        return out.float()
