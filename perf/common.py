"""Shared timing helpers for the offline benchmarks.

Every benchmark measures its variants side by side in one process: after warmup runs, each
repetition runs every variant once (round-robin, the starting variant rotating per repetition),
so machine noise on a shared host hits all variants alike. Numbers are medians of those
repetitions; ratios are computed from the medians.
"""
from __future__ import annotations

import argparse
import gc
import os
import shlex
import sys
import statistics
import time
from pathlib import Path
from typing import Callable

import torch

from backend_src.results import write_result

REPO_ROOT = Path(__file__).resolve().parents[1]
RESULTS_DIR = REPO_ROOT / "perf" / "results"


def add_common_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true", help="tiny smoke configuration (seconds; numbers mean little)")
    p.add_argument("--out", type=Path, default=RESULTS_DIR, help="directory for the result JSON")
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    p.add_argument("--reps", type=int, default=None, help="timed repetitions per variant (default per benchmark)")
    p.add_argument("--warmup", type=int, default=None, help="untimed runs per variant first")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu", help="torch device for models and inputs (cpu, cuda)")


def fill_defaults(args: argparse.Namespace, defaults: dict) -> None:
    """Options left unset (None) take this configuration's (quick or full) default."""
    for key, val in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, val)


def save_result(path: Path, rows: list[dict], module: str, argv, load_start, **extra) -> dict:
    """Write a benchmark's result file with the command that reproduces it and the host's load
    and CPU runtime settings around the run."""
    extra.update(host_load_start=load_start, host_load_end=host_load(),
                 omp_wait_policy=os.environ.get("OMP_WAIT_POLICY", "runtime default"))
    blob = write_result(path, rows, command=command(module, argv), **extra)
    log(f"wrote {path}")
    return blob


def setup_torch(threads: int, seed: int = 0, device: str = "cpu") -> None:
    torch.set_num_threads(threads)
    torch.manual_seed(seed)
    if torch.device(device).type == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit(f"--device {device}: no CUDA GPU is visible to torch")
        torch.backends.cuda.matmul.allow_tf32 = False  # fp32 numbers stay fp32 on every device


def device_sync(device: str) -> Callable[[], None] | None:
    """What to call around a timed region so that it covers the device's work too (kernels are
    launched asynchronously on a GPU); None on the CPU."""
    dev = torch.device(device)
    return (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else None


def random_hstu(args: argparse.Namespace, max_seq_len: int):
    """A randomly initialized HSTU encoder (eval mode) from the benchmark's --items/--d-model/--layers/
    --heads flags: latency does not depend on training. Returns (config, encoder)."""
    from backend_src.config import ModelConfig
    from backend_src.model.hstu import HSTUEncoder

    cfg = ModelConfig(num_items=args.items, d_model=args.d_model, num_layers=args.layers, num_heads=args.heads,
                      max_seq_len=max_seq_len)
    torch.manual_seed(args.seed)
    return cfg, HSTUEncoder(cfg).eval()


def add_checkpoint_arg(p: argparse.ArgumentParser, result: str) -> None:
    p.add_argument("--checkpoint", default=None, help=f"a trained model instead of a random one -> {result}")


def trained_model(args: argparse.Namespace, max_seq_len: int):
    """The checkpoint of --checkpoint (eval mode), its sizes copied into args' --items/--d-model/--layers/
    --heads; an error if its histories are shorter than max_seq_len."""
    from backend_src.model.recommender import GenerativeRecommender

    model = GenerativeRecommender.load(args.checkpoint)
    cfg = model.cfg
    if cfg.max_seq_len < max_seq_len:
        raise SystemExit(f"{args.checkpoint} keeps histories of {cfg.max_seq_len} events, the benchmark needs {max_seq_len}")
    args.items, args.d_model, args.layers, args.heads = cfg.num_items, cfg.d_model, cfg.num_layers, cfg.num_heads
    return model


def result_name(args: argparse.Namespace, stem: str) -> str:
    """stem.json, or stem_<the checkpoint's folder>.json for a trained model's run."""
    return f"{stem}_{Path(args.checkpoint).parent.name}.json" if getattr(args, "checkpoint", None) else f"{stem}.json"


def cuda_graphed(fn: Callable[[], object]) -> Callable[[], None]:
    """fn captured once into a CUDA graph; the returned callable replays it on the same input
    tensors. A replay launches all of fn's kernels at once, so its time is the GPU's work without
    the Python and per-op launch cost that an eager call pays (fn must not copy to the host)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.inference_mode(), torch.cuda.stream(side):
        for _ in range(2):  # compile kernels, settle the allocator before capture
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.inference_mode(), torch.cuda.graph(graph):
        fn()
    return graph.replay


def interleaved(
    variants: dict[str, Callable[[], object]],
    reps: int,
    warmup: int = 1,
    max_seconds: float | None = None,
    min_reps: int = 3,
    sync: Callable[[], None] | None = None,
) -> dict[str, list[float]]:
    """Time every variant `reps` times, round-robin, after `warmup` untimed rounds.

    Repetition i runs the variants starting at index i (rotated), so no variant always runs
    first or right after the same neighbour. With max_seconds, repetitions stop early (never
    below min_reps) once the next round would exceed that budget. Returns seconds per run.
    The garbage collector is off while timing (as in timeit): a collector pause does not land
    inside one variant, and no variant starts on the caches a full collection just swept.
    sync (see device_sync) waits for a device's queued work before and after each timed call.
    """
    sync = sync or (lambda: None)
    names = list(variants)
    with torch.inference_mode():
        for _ in range(warmup):
            for name in names:
                variants[name]()
        times: dict[str, list[float]] = {n: [] for n in names}
        gc.collect()
        gc.disable()
        try:
            start = time.perf_counter()
            for i in range(reps):
                if max_seconds is not None and i >= min_reps:
                    elapsed = time.perf_counter() - start
                    if elapsed / i * (i + 1) > max_seconds:
                        break
                order = names[i % len(names):] + names[: i % len(names)]
                for name in order:
                    sync()
                    t0 = time.perf_counter()
                    variants[name]()
                    sync()
                    times[name].append(time.perf_counter() - t0)
        finally:
            gc.enable()
    return times


def summary_ms(samples: list[float]) -> dict:
    """Seconds -> {latency_ms_p50 (median), latency_ms_min, latency_ms_max, reps}."""
    ms = [s * 1e3 for s in samples]
    return {
        "latency_ms_p50": statistics.median(ms),
        "latency_ms_min": min(ms),
        "latency_ms_max": max(ms),
        "reps": len(ms),
    }


def median_s(samples: list[float]) -> float:
    return statistics.median(samples)


def ratio(a: float, b: float) -> float | None:
    """a / b, None when b is 0 (never divide by a missing measurement silently)."""
    return a / b if b else None


def command(module: str, argv: list[str] | None) -> str:
    """The command line that reproduces a run, as `python -m <module> <args>`."""
    args = [str(a) for a in (sys.argv[1:] if argv is None else argv)]
    # paths inside the repository are written relative to its root (where the command runs)
    args = [str(Path(a).relative_to(REPO_ROOT)) if a.startswith(str(REPO_ROOT) + os.sep) else a for a in args]
    return " ".join(["python", "-m", module, *map(shlex.quote, args)])


def host_load() -> list[float] | None:
    """1, 5 and 15 minute load averages: how busy the shared host was around the run."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def log(msg: str) -> None:
    print(msg, flush=True)
