"""What does encoding a long history in query blocks save? The encoder's full pass (an open, a session rebuilt
from the log, a history past its bound re-encoded) is causal self-attention over the history; `ops.hstu_attention`
with shared["self_causal"] computes it CAUSAL_BLOCK queries at a time against the keys up to each block's last
query, instead of the whole [N, N] matrix under the mask. Both timed side by side (interleaved, block sizes
included) on the torch path with the served benchmark's model (one user, one thread, as the served stage runs),
whole passes of the encoder at several history lengths; the caches are checked equal first. Run from the
repository root (needs the benchmark model: `make bench-served` trains it):
    python -m perf.experiments.causal_blocks      # -> perf/results/causal_blocks.json
    python -m perf.experiments.causal_blocks --quick --out -
"""
import torch

from backend_src.model.recommender import GenerativeRecommender
from backend_src.ops import reference
from perf.common import host_load, interleaved, log, save_result, summary_ms
from perf.experiments import bench_model_parser

WHOLE = 1 << 30  # a block larger than any history: the whole matrix


def encode(model, events, block: int):
    reference.CAUSAL_BLOCK = block
    with torch.inference_mode():
        return model.encode(*events)


def main():
    ap = bench_model_parser(__doc__, "causal_blocks.json")
    ap.add_argument("--histories", type=int, nargs="+", default=[50, 128, 256, 512])
    ap.add_argument("--blocks", type=int, nargs="+", default=[64, 128, 256])
    ap.add_argument("--reps", type=int, default=100)
    args = ap.parse_args()
    torch.set_num_threads(1)
    load_start = host_load()
    model = GenerativeRecommender.load(args.checkpoint).eval()
    default = reference.CAUSAL_BLOCK
    g = torch.Generator().manual_seed(0)
    rows = []
    for n in args.histories:
        n = min(n, model.cfg.max_seq_len)
        events = (torch.randint(1, model.cfg.num_items + 1, (1, n), generator=g), torch.randint(0, 2, (1, n), generator=g),
                  1_000_000_000 + torch.cumsum(torch.randint(0, 86_400, (1, n), generator=g), 1), torch.tensor([n]))
        whole = encode(model, events, WHOLE)
        gap = max(float((getattr(encode(model, events, b), f) - getattr(whole, f)).abs().max())
                  for b in args.blocks for f in ("states", "keys", "values"))
        runs = {"whole": lambda: encode(model, events, WHOLE)}
        runs |= {f"block {b}": (lambda b=b: encode(model, events, b)) for b in args.blocks}
        t = interleaved(runs, reps=5 if args.quick else args.reps, warmup=3)
        stats = {k: summary_ms(v) for k, v in t.items()}
        p50 = {k: s["latency_ms_p50"] for k, s in stats.items()}
        rows.append(dict(history=n, max_abs_diff=gap, p50_ms=p50, served_block=default,
                         speedup=p50["whole"] / p50[f"block {default}"] if f"block {default}" in p50 else None,
                         stats=stats))
        log(f"history {n}: " + ", ".join(f"{k} {v:.2f} ms" for k, v in p50.items()) + f" (caches differ by {gap:.1e})")
    reference.CAUSAL_BLOCK = default
    if args.out != "-":
        save_result(args.out, rows, "perf.experiments.causal_blocks", None, load_start)


if __name__ == "__main__":
    main()
