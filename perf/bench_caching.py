"""Incremental encoding: HSTUEncoder.append of new events onto a cached history vs re-encoding
the whole history with forward, for one user and for a batch of users.

append encodes only the new rows (they attend to the cached K/V), forward recomputes every row:
O(n) vs O(n^2) attention work for one new event. append_E writes the new rows into spare rows
of the cached buffers (in_place=True, the server's path for one session), append_copy_E builds
a new combined cache. All give the same states (checked, reported as max_abs_diff).
append_warm_E is append_E run WARM_RUNS times back to back (time per append): the same call on
caches it warmed itself, where append_E runs right after other variants, as a request does.
One event per user in place runs the fused CPU kernel (``ops.cpu_kernels``); append_torch_1 is
the same call with it off (GENREC_OPS_BACKEND=torch): the eager torch composition, side by side.

    python -m perf.bench_caching            # default configuration (about a minute on 2 cores)
    python -m perf.bench_caching --quick    # tiny smoke configuration
"""
from __future__ import annotations

import argparse
import os

import torch

from perf.common import (
    add_checkpoint_arg, add_common_args, device_sync, fill_defaults, host_load, interleaved, log, median_s, random_hstu,
    ratio, result_name, save_result, trained_model,
    setup_torch, summary_ms,
)

GOAL_SPEEDUP_ONE_EVENT = 20.0
WARM_RUNS = 20


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_args(p)
    add_checkpoint_arg(p, "caching_<its folder>.json")
    p.add_argument("--history", type=int, default=None, help="cached history length (default 512)")
    p.add_argument("--users", type=int, nargs="+", default=None, help="batch sizes (default 1 16)")
    p.add_argument("--new-events", type=int, nargs="+", default=None, help="events appended (default 1 8)")
    p.add_argument("--items", type=int, default=16384)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--thread-counts", type=int, nargs="+", default=[1, 2],
                   help="torch intra-op thread counts to measure (default 1 2; the served history_encoder "
                        "runs 1 thread per instance); overrides --threads")
    p.add_argument("--max-seconds", type=float, default=None,
                   help="time budget per batch size for the timed repetitions (default 40)")
    args = p.parse_args(argv)
    if args.quick:
        d = dict(history=32, users=[1, 2], new_events=[1, 4], reps=3, warmup=1, max_seconds=3.0)
    else:
        d = dict(history=512, users=[1, 16], new_events=[1, 8], reps=15, warmup=2, max_seconds=40.0)
    fill_defaults(args, d)
    return args


def torch_ops(fn):
    """fn run with GENREC_OPS_BACKEND=torch (the fused CPU kernel off); the variable is set and
    restored by hand, which costs microseconds inside the timed call."""
    def run():
        before = os.environ.get("GENREC_OPS_BACKEND")
        os.environ["GENREC_OPS_BACKEND"] = "torch"
        try:
            return fn()
        finally:
            if before is None:
                del os.environ["GENREC_OPS_BACKEND"]
            else:
                os.environ["GENREC_OPS_BACKEND"] = before
    return run


def measure(encoder, args, n: int, model_name: str, threads: int) -> list[dict]:
    """Append vs re-encode for every batch size and new-event count at one thread count."""
    rows = []
    gen = torch.Generator().manual_seed(args.seed)
    dev = args.device
    for users in args.users:
        total = n + max(args.new_events)
        items = torch.randint(1, args.items + 1, (users, total), generator=gen).to(dev)
        actions = torch.randint(1, 6, (users, total), generator=gen).to(dev)
        ts = torch.sort(torch.randint(0, 90 * 86400, (users, total), generator=gen), dim=1).values.to(dev)
        lengths = torch.full((users,), n, device=dev)
        with torch.inference_mode():
            cache = encoder(items[:, :n], actions[:, :n], ts[:, :n], lengths)
            # a served session's cache, grown geometrically, has spare rows for the next events
            roomy = cache.reserve(2 * n)
        calls, diffs = {}, {}
        for e in args.new_events:
            new = (items[:, n : n + e], actions[:, n : n + e], ts[:, n : n + e], torch.full((users,), e, device=dev))
            whole = (items[:, : n + e], actions[:, : n + e], ts[:, : n + e], torch.full((users,), n + e, device=dev))
            calls[f"append_{e}"] = lambda new=new: encoder.append(roomy, *new, in_place=True)
            calls[f"append_copy_{e}"] = lambda new=new: encoder.append(cache, *new)
            calls[f"append_warm_{e}"] = lambda new=new: [encoder.append(roomy, *new, in_place=True) for _ in range(WARM_RUNS)]
            if e == 1:
                calls["append_torch_1"] = torch_ops(calls["append_1"])
            calls[f"forward_{n + e}"] = lambda whole=whole: encoder(*whole)
            with torch.inference_mode():
                ref = encoder(*whole).states
                diffs[e] = max(float((append().states - ref).abs().max()) for append in (
                    calls[f"append_{e}"], calls[f"append_copy_{e}"], torch_ops(calls[f"append_{e}"])))
        times = interleaved(calls, args.reps, args.warmup, max_seconds=args.max_seconds, sync=device_sync(dev))
        for e in args.new_events:
            t_fwd = median_s(times[f"forward_{n + e}"])
            base = {"dataset": f"synthetic-history-{n}", "model": model_name, "history": n, "users": users,
                    "new_events": e, "threads": threads}
            rows.append({**base, "mode": f"forward_{n + e}", **summary_ms(times[f"forward_{n + e}"]),
                         "latency_ms_per_user_p50": t_fwd * 1e3 / users, "speedup_vs_forward": 1.0})
            times[f"append_warm_{e}"] = [t / WARM_RUNS for t in times[f"append_warm_{e}"]]
            modes = [f"append_{e}", f"append_copy_{e}", f"append_warm_{e}"] + (["append_torch_1"] if e == 1 else [])
            for mode in modes:
                t_app = median_s(times[mode])
                row = {**base, "mode": mode, **summary_ms(times[mode]), "latency_ms_per_user_p50": t_app * 1e3 / users,
                       "speedup_vs_forward": ratio(t_fwd, t_app), "max_abs_diff": diffs[e]}
                if e == 1 and mode == "append_1":
                    row["goal_speedup"] = GOAL_SPEEDUP_ONE_EVENT
                rows.append(row)
                log(f"  {threads} thread(s), {users} users, +{e} events: {mode} {t_app * 1e3:.2f} ms, "
                    f"forward {t_fwd * 1e3:.2f} ms, x{row['speedup_vs_forward']:.1f} (reps {row['reps']}, "
                    f"max |diff| {diffs[e]:.1e})")
    return rows


def main(argv=None) -> dict:
    args = parse_args(argv)
    load_start = host_load()
    setup_torch(args.threads, args.seed, args.device)
    n = args.history
    if args.checkpoint:  # the recipe's trained backbone
        encoder = trained_model(args, max_seq_len=n + max(args.new_events)).backbone
    else:
        _, encoder = random_hstu(args, max_seq_len=n + max(args.new_events))
    encoder.to(args.device)
    log(f"caching: history {n}, d{args.d_model}, {args.layers} layers, {args.heads} heads, "
        f"threads {args.thread_counts}, device {args.device}")
    model_name = (f"HSTU({'trained: ' + args.checkpoint if args.checkpoint else 'random init'}, d{args.d_model}, "
                  f"{args.layers} layers, {args.heads} heads)")
    rows = []
    for threads in args.thread_counts:
        torch.set_num_threads(threads)
        rows += measure(encoder, args, n, model_name, threads)
    extra = dict(
        benchmark="caching",
        note="randomly initialized HSTU: latency does not depend on training; append_E writes the new rows "
             "into the spare rows of the cached buffers (in_place=True, as the server does for one session), "
             "with one event by the fused CPU kernel; append_torch_1 is append_1 with that kernel off (eager "
             "torch ops); append_copy_E copies the cached K/V into a new combined cache (the batched path); "
             f"append_warm_E is append_E run {WARM_RUNS} times back to back, time per append (warm caches)",
        config=dict(history=n, users=args.users, new_events=args.new_events, d_model=args.d_model,
                    layers=args.layers, heads=args.heads, threads=args.thread_counts, device=args.device,
                    warmup=args.warmup, reps_requested=args.reps, quick=args.quick),
        goal=dict(speedup_one_event=GOAL_SPEEDUP_ONE_EVENT),
    )
    path = args.out / result_name(args, "caching")
    return save_result(path, rows, "perf.bench_caching", argv, load_start, **extra)


if __name__ == "__main__":
    main()
