"""Where PFA's selection step spends its time on this CPU, beside one full-attention step.

A full-attention step (t >= 1, all beams): project K and V of every history row, then one fused
SDPA call. PFA's selection step (ops.pfa_select, torch reference, then the decoder's own work):
project K of every row; per head the logits of every beam over every row (a batched matmul), their
softmax and the probability-weighted pooling; one top-k; the kept rows' states gathered and their K
and V projected; attention over the kept rows (the step's own weights renormalized over them).
Randomly initialized decoder of perf.bench_decode's setting (d 64, beam 100, 2 heads of 32, keep
256); medians of 21 rounds, all variants side by side per round. Run from the repository root, alone
on the machine, with OpenMP's default wait policy and the glibc settings of `make bench-offline`:

    python -m perf.experiments.pfa_select_parts          # writes perf/results/pfa_select_parts.txt
    python -m perf.experiments.pfa_select_parts --quick --out -   # 3 rounds, 2 threads only
"""
import argparse
import time
from pathlib import Path

import torch

from backend_src.ops import reference as R
from perf.bench_decode import build
from perf.common import RESULTS_DIR

W, H, D, KEEP, STEP = 100, 2, 32, 256, 1


@torch.no_grad()
def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="3 rounds at 2 threads (a check that it runs)")
    ap.add_argument("--out", default=str(RESULTS_DIR / "pfa_select_parts.txt"), help="text file ('-': stdout only)")
    args = ap.parse_args()
    rounds, thread_counts = (3, (2,)) if args.quick else (21, (1, 2))
    lines = []

    def say(text):
        lines.append(text)
        print(text, flush=True)

    say(f"torch {torch.__version__}, beam {W}, {H} heads x {D}, keep {KEEP}; ms, median of {rounds}")
    _, decoders = build(16384, H * D, H, 2048, 0)
    dec = decoders[False]
    for threads in thread_counts:
        torch.set_num_threads(threads)
        for B, N in ((32, 512), (8, 2048)):
            g = torch.Generator().manual_seed(0)
            states = torch.randn(B, N, H * D, generator=g)
            q = torch.randn(B, W, H, D, generator=g)
            lengths = torch.full((B,), N)
            bw = torch.softmax(torch.randn(B, W, generator=g), 1)
            k, v = dec.project_step(states, STEP)
            qs = q * D**-0.5
            e = torch.bmm(qs[:, :, 0], k[:, :, 0].transpose(1, 2))
            order, kept_len = R.pfa_select(q, k, lengths, bw, KEEP)
            kept_states = R.gather_rows(states, order)
            kk, vk = dec.project_step(kept_states, STEP)

            def selection_step():
                keys = dec.project_step(states, STEP, "k")
                rows, n_kept = R.pfa_select(q, keys, lengths, bw, KEEP)
                kept_k, kept_v = dec.project_step(R.gather_rows(states, rows), STEP)
                return R.decode_attention(q, kept_k, kept_v, n_kept)

            def full_step():
                return R.decode_attention(q, *dec.project_step(states, STEP), lengths)

            calls = {
                "full-attention step (K/V of all rows, SDPA)": full_step,
                "  K/V projection of all rows": lambda: dec.project_step(states, STEP),
                "  SDPA over all rows": lambda: R.decode_attention(q, k, v, lengths),
                "PFA selection step (whole)": selection_step,
                "  K projection of all rows": lambda: dec.project_step(states, STEP, "k"),
                "  logits, one head (bmm)": lambda: torch.bmm(qs[:, :, 0], k[:, :, 0].transpose(1, 2)),
                "  softmax, one head": lambda: torch.softmax(e, -1),
                "  pooling, one head (bmm)": lambda: torch.bmm(bw[:, None, :], e),
                "  top-k": lambda: torch.topk(e[:, 0], KEEP, 1, sorted=True),
                "  gather kept states, project K/V": lambda: dec.project_step(R.gather_rows(states, order), STEP),
                "  attention over the kept rows": lambda: R.decode_attention(q, kk, vk, kept_len),
            }
            times = {name: [] for name in calls}
            for _ in range(rounds):
                for name, fn in calls.items():
                    t = time.perf_counter()
                    fn()
                    times[name].append(time.perf_counter() - t)
            say(f"\n{threads} thread(s), {B} users x history {N}")
            for name, ts in times.items():
                say(f"  {name:45s} {sorted(ts)[rounds // 2] * 1e3:7.2f}")
    if args.out != "-":
        Path(args.out).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
