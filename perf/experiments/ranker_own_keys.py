"""What does the ranker's own-keys layout save? M-FALCON candidates attend to the history and to their own key
only; `ops.hstu_attention` with shared["own_keys"] computes the history block as a matrix product and the own
keys as a row-wise dot, instead of the whole [m, history + m] block under the mask. Both layouts timed side by
side (interleaved) on the torch path at the served shape (one user, 100 candidates, 2 heads of 32, one pass of
2 layers sharing the layout), at histories 50 and 512; the outputs are checked equal first. Run from the
repository root:
    python -m perf.experiments.ranker_own_keys      # -> perf/results/ranker_own_keys.json
    python -m perf.experiments.ranker_own_keys --quick --out -
"""
import argparse
from pathlib import Path

import torch

from backend_src.ops import reference
from perf.common import RESULTS_DIR, host_load, interleaved, log, save_result, summary_ms


def case(n: int, m: int, heads: int = 2, d: int = 32, seed: int = 0):
    """hstu_attention's arguments for m candidates after a history of n rows (the ranker's call)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, m, heads, d, generator=g)
    k, v = torch.randn(1, n + m, heads, d, generator=g), torch.randn(1, n + m, heads, d, generator=g)
    nh = torch.tensor([n])
    ts = torch.cumsum(torch.randint(0, 86400, (1, n), generator=g), 1)
    k_pos = torch.cat([torch.arange(n)[None], nh[:, None].expand(1, m)], 1)
    k_ts = torch.cat([ts, ts[:, -1:].expand(1, m)], 1)
    q_self = (n + torch.arange(m))[None]
    bias = torch.randn(heads, 64, generator=g), torch.randn(heads, 64, generator=g)
    return (q, k, v, nh[:, None].expand(1, m), k_pos, ts[:, -1:].expand(1, m), k_ts, nh, q_self, *bias,
            1.6, d ** -0.5, 512.0)


def one_pass(args, layers: int, own: bool):
    shared = {"own_keys": args[0].shape[1]} if own else {}
    for _ in range(layers):
        out = reference.hstu_attention(*args, shared=shared)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--histories", type=int, nargs="+", default=[50, 512])
    ap.add_argument("--candidates", type=int, default=100)
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", type=Path, default=RESULTS_DIR / "ranker_own_keys.json", help="'-': print only")
    args = ap.parse_args()
    torch.set_num_threads(1)  # as a served stage runs
    load_start = host_load()
    rows = []
    for n in args.histories:
        a = case(n, args.candidates)
        gap = (one_pass(a, 2, True) - one_pass(a, 2, False)).abs().max().item()
        t = interleaved({"general": lambda: one_pass(a, 2, False), "own_keys": lambda: one_pass(a, 2, True)},
                        reps=5 if args.quick else args.reps, warmup=3)
        general, own = summary_ms(t["general"]), summary_ms(t["own_keys"])
        rows.append(dict(history=n, candidates=args.candidates, max_abs_diff=gap, general=general, own_keys=own,
                         speedup=general["latency_ms_p50"] / own["latency_ms_p50"]))
        log(f"history {n}: general mask {general['latency_ms_p50']:.3f} ms, own keys {own['latency_ms_p50']:.3f} ms, "
            f"{rows[-1]['speedup']:.2f}x (outputs differ by {gap:.1e})")
    if str(args.out) != "-":
        save_result(args.out, rows, "perf.experiments.ranker_own_keys", None, load_start)


if __name__ == "__main__":
    main()
