"""The served beam-search decode in (batch, history) buckets, captured as CUDA graphs on a GPU.

A decode launches a few hundred small kernels (4 steps of projections, attention, the constrained
softmax, top-k, gathers); eager, the host's launch cost is several ms per batch and hides what
PFA saves on the GPU. `DecodeGraphs.retrieve` pads a batch to the smallest bucket that holds it
(users to a batch-size bucket, the history to a length bucket) and, on CUDA, replays that
bucket's graph, captured once (at warm-up, or on first use) for the request's DecodeOptions.
Padding is exact: padded history rows lie past each user's length, which every attention masks,
and padded users (one zero state) decode on their own rows, which are dropped. On the CPU the same
padded path runs eagerly (pad=True), or the batch is decoded unpadded (the default there: padding
only adds work without graphs).

Capture needs static shapes and no reads of device values by the host inside the decode; the
decode as written has none (`HostReadDetector` checks it, on the CPU too).
"""
from __future__ import annotations

import bisect
import sys
from pathlib import Path

import torch

from backend_src.config import DecodeOptions
from backend_src.decoding.beam_search import BeamResult, generate

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
HISTORY_BUCKETS = (64, 128, 256, 512, 1024, 2048)


class DecodeGraphs:
    """Bucketed decode of `model` (a GenerativeRecommender, or anything with .decoder and .codebook).

    use_graphs: capture CUDA graphs (default: the model is on a CUDA device); pad: pad inputs to
    their bucket without graphs too (default: only with graphs). Batches beyond the largest
    bucket decode eagerly, unpadded. max_graphs bounds the graphs kept (every one holds its
    static inputs and outputs; intermediates share one memory pool)."""

    def __init__(self, model, batch_buckets=BATCH_BUCKETS, history_buckets=HISTORY_BUCKETS, max_history=None,
                 use_graphs: bool | None = None, pad: bool | None = None, max_graphs: int = 256):
        self.decoder, self.codebook = model.decoder, model.codebook
        self.device = next(self.decoder.parameters()).device
        self.use_graphs = self.device.type == "cuda" if use_graphs is None else bool(use_graphs)
        if self.use_graphs and self.device.type != "cuda":
            raise ValueError("CUDA graphs need the model on a CUDA device")
        self.pad = self.use_graphs if pad is None else bool(pad)
        self.batch_buckets = tuple(sorted(set(int(b) for b in batch_buckets)))
        hist = sorted(set(int(n) for n in history_buckets))
        if max_history is not None:  # the longest served history is always a bucket
            hist = sorted({n for n in hist if n < max_history} | {int(max_history)})
        self.history_buckets = tuple(hist)
        self.max_graphs = max_graphs
        self._graphs: dict = {}  # (options, batch, history, dtype) -> _Graph
        self._pool = None
        self.stats = dict(replays=0, captures=0, eager=0)

    def reset(self) -> None:
        """Drop the captured graphs: they hold the tables they were captured with (the catalog
        replaces the codebook's when it changes), so each is captured again on first use."""
        self._graphs.clear()

    # ------------------------------------------------------------------ buckets
    def bucket(self, batch: int, history: int) -> tuple[int, int] | None:
        """The smallest (batch, history) bucket holding the batch, or None beyond the largest."""
        i = bisect.bisect_left(self.batch_buckets, batch)
        j = bisect.bisect_left(self.history_buckets, history)
        if i == len(self.batch_buckets) or j == len(self.history_buckets):
            return None
        return self.batch_buckets[i], self.history_buckets[j]

    def pad_inputs(self, states: torch.Tensor, lengths: torch.Tensor, batch: int, history: int, out=None):
        """states [B, n, D], lengths [B] -> [batch, history, D] and [batch]: zero rows past n, padded
        users of length 1 (a decode needs at least one row). Written into `out` when given."""
        B, n, D = states.shape
        if out is None:
            out = (torch.empty(batch, history, D, dtype=states.dtype, device=self.device),
                   torch.empty(batch, dtype=torch.long, device=self.device))
        s, ln = out
        s[:B, :n].copy_(states, non_blocking=True)
        s[:B, n:].zero_()
        s[B:].zero_()
        ln[:B].copy_(lengths, non_blocking=True)
        ln[B:].fill_(1)
        return s, ln

    # ------------------------------------------------------------------ decode
    def retrieve(self, states: torch.Tensor, lengths: torch.Tensor, options: DecodeOptions) -> BeamResult:
        """states [B, n, D] (any device; left-aligned), lengths [B] -> the beams of the B users,
        as `generate` on the unpadded batch returns them (tensors on the model's device)."""
        if options.collect_attention:
            raise ValueError("collect_attention records per-step tensors: decode with generate()")
        B, n, _ = states.shape
        lengths = lengths.to(torch.long)
        size = self.bucket(B, n) if self.pad else None
        if size is None:
            self.stats["eager"] += 1
            return generate(self.decoder, self.codebook, states.to(self.device), lengths.to(self.device), options)
        if not self.use_graphs:
            s, ln = self.pad_inputs(states, lengths, *size)
            self.stats["eager"] += 1
            return _rows(generate(self.decoder, self.codebook, s, ln, options), B)
        g = self._graph(options, *size, states.dtype)
        self.pad_inputs(states, lengths, *size, out=(g.states, g.lengths))
        g.graph.replay()
        self.stats["replays"] += 1
        return _rows(g.out, B, clone=True)  # the next replay overwrites the static outputs

    def warmup(self, options: DecodeOptions, batch_sizes=None, histories=None, dtype=None) -> int:
        """Capture the graphs of `options` for every bucket (or the given ones) now, so that no
        request pays a capture; returns how many were captured."""
        if not self.use_graphs:
            return 0
        dtype = dtype or next(self.decoder.parameters()).dtype
        before = self.stats["captures"]
        for b in batch_sizes or self.batch_buckets:
            for n in histories or self.history_buckets:
                self._graph(options, *self.bucket(b, n), dtype)
        return self.stats["captures"] - before

    def _graph(self, options, batch, history, dtype) -> "_Graph":
        key = (options, batch, history, dtype)  # DecodeOptions is frozen: its own key
        g = self._graphs.get(key)
        if g is None:
            if len(self._graphs) >= self.max_graphs:  # the oldest capture goes
                self._graphs.pop(next(iter(self._graphs)))
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            g = _Graph(self.decoder, self.codebook, options, batch, history, dtype, self.device, self._pool)
            self._graphs[key] = g
            self.stats["captures"] += 1
        return g


class _Graph:
    """One captured decode: static inputs (states, lengths), the graph, its static outputs."""

    def __init__(self, decoder, codebook, options, batch, history, dtype, device, pool):
        D = decoder.d_model
        self.states = torch.zeros(batch, history, D, dtype=dtype, device=device)
        self.lengths = torch.ones(batch, dtype=torch.long, device=device)
        run = lambda: generate(decoder, codebook, self.states, self.lengths, options)  # noqa: E731
        # compile the Triton kernels and settle the allocator off the capture
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.inference_mode(), torch.cuda.stream(side):
            for _ in range(2):
                run()
        torch.cuda.current_stream(device).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.inference_mode(), torch.cuda.graph(self.graph, pool=pool):
            self.out = run()


def _rows(res: BeamResult, B: int, clone: bool = False) -> BeamResult:
    take = (lambda t: t[:B].clone()) if clone else (lambda t: t[:B])
    return BeamResult(item_ids=take(res.item_ids), codes=take(res.codes), log_probs=take(res.log_probs))


# ------------------------------------------------------------------------------------------
# host reads: what a CUDA graph cannot capture
# ------------------------------------------------------------------------------------------
_HOST_READS = {
    torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.numpy, torch.Tensor.cpu, torch.Tensor.__bool__,
    torch.Tensor.__int__, torch.Tensor.__float__, torch.Tensor.__index__, torch.Tensor.nonzero, torch.nonzero,
    torch.Tensor.masked_select, torch.masked_select, torch.unique, torch.Tensor.unique, torch.argwhere,
    torch.Tensor.argwhere,
}
_INDEXING = {torch.Tensor.__getitem__, torch.Tensor.__setitem__}
_IGNORED = (str(Path(torch.__file__).parent),)


class HostReadDetector(torch.overrides.TorchFunctionMode):
    """Records every call, made from outside torch (and outside `ignore`d packages, e.g. Triton's
    interpreter), that reads a tensor's values on the host or sizes a result by them: .item(),
    bool()/int() of a tensor, .cpu(), .nonzero(), boolean-mask indexing... On a GPU each is a
    synchronization that a CUDA graph cannot capture; on the CPU this finds them without one."""

    def __init__(self, ignore: tuple = ()):
        super().__init__()
        self.calls: list[str] = []
        self._ignore = _IGNORED + tuple(ignore)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        hit = func in _HOST_READS or (func in _INDEXING and _bool_index(args[1] if len(args) > 1 else None))
        if hit:
            where = self._caller()
            if where is not None:
                self.calls.append(f"{getattr(func, '__name__', func)} at {where}")
        return func(*args, **kwargs)

    def _caller(self):
        f = sys._getframe(2)
        while f is not None:
            fn = f.f_code.co_filename
            if fn == __file__:
                f = f.f_back
                continue
            if fn.startswith(self._ignore):
                return None
            return f"{Path(fn).name}:{f.f_lineno}"
        return None


def _bool_index(idx) -> bool:
    items = idx if isinstance(idx, tuple) else (idx,)
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in items)
