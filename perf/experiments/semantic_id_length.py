"""Semantic-ID length: 3 / 4 / 6 / 8 codes per item, at one code budget (2^24 prefixes before the
collision code: 4096^2, 256^3, 32^4 x 16, 16^3 x 8^4), beyond the PFA paper, which fixes the length.

Decode (timing): what one batch's beam search costs with full attention and with PFA (k 256, r 0.5,
selection step 1, beam 100), and the share of it spent on history attention and the history's K/V
projections, at Amazon Beauty's shape (12,101 items, histories of 50, d 96) and MovieLens-1M's
(3,615 items, histories of 512, d 64). Random decoders over random unique codes of those sizes (as
perf/bench_decode.py): the work per step does not depend on training.

Quality (--train DATA): the recipe trained once per length (`python -m export.train --data DATA
--codebook SIZES`), its test rows read back from each run's result file.

    python -m perf.experiments.semantic_id_length                       # timing -> semantic_id_length.json
    python -m perf.experiments.semantic_id_length --train amazon-scientific \
        --recipe-result perf/results/quality_scientific.json     # + quality (the recipe's run for L = 4)
    python -m perf.experiments.semantic_id_length --train amazon-beauty --no-decode \
        --recipe-result perf/results/train_beauty.json --train-lengths 4 6 8 --out perf/results/semantic_id_length_beauty.json
    python -m perf.experiments.semantic_id_length --quick --out -       # a check that it runs
"""
from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
from pathlib import Path

import torch

from backend_src.config import DecodeOptions, ModelConfig
from backend_src.decoding.beam_search import generate
from backend_src.model.decoder import SemanticIdDecoder
from backend_src.model.semantic_ids import SemanticIdCodebook
from backend_src.results import write_result
from perf.bench_decode import phase_times_ms, synthetic_codes
from perf.common import RESULTS_DIR, command, interleaved, log, median_s

# codes per item -> k-means level sizes (the collision code comes on top)
LENGTHS = {3: (4096, 4096), 4: (256, 256, 256), 6: (32, 32, 32, 32, 16), 8: (16, 16, 16, 8, 8, 8, 8)}
SHAPES = {
    "amazon-beauty": dict(items=12101, history=50, d_model=96, users=32),
    "ml-1m": dict(items=3615, history=512, d_model=64, users=8),
}
MODES = {"full": dict(mode="full"), "pfa": dict(mode="pfa", k=256, r=0.5, selection_step=1)}


def decode_rows(shape: str, items: int, history: int, d_model: int, users: int, beam: int, reps: int,
                phase_runs: int) -> list[dict]:
    rows = []
    for length, sizes in LENGTHS.items():
        codebook = SemanticIdCodebook.from_codes(synthetic_codes(items, sizes, seed=length))
        cfg = ModelConfig(num_items=items, d_model=d_model, decoder_heads=2, max_seq_len=history,
                          codebook_sizes=codebook.codebook_sizes)
        torch.manual_seed(0)
        decoder = SemanticIdDecoder(cfg).eval()
        gen = torch.Generator().manual_seed(length)
        states = torch.randn(users, history, d_model, generator=gen)
        lengths = torch.full((users,), history, dtype=torch.long)
        calls = {m: (lambda o=DecodeOptions(beam_width=beam, **f): generate(decoder, codebook, states, lengths, o))
                 for m, f in MODES.items()}
        times = interleaved(calls, reps, warmup=1)
        full_ms = median_s(times["full"]) * 1e3
        for mode in MODES:
            with torch.inference_mode():
                phases = phase_times_ms(calls[mode], decoder, phase_runs)
            history_ms = phases["history_attention"] + phases["kv_projection"]
            row = {"shape": shape, "codes_per_item": length, "kmeans_sizes": list(sizes),
                   "codebook_sizes": list(codebook.codebook_sizes), "mode": mode, "history": history,
                   "users": users, "beam": beam, "decode_ms_p50": median_s(times[mode]) * 1e3,
                   "history_share": history_ms / phases["total"],
                   "history_attention_share": phases["history_attention"] / phases["total"], "phases_ms": phases}
            row["speedup_vs_full"] = full_ms / row["decode_ms_p50"]
            rows.append(row)
            log(f"  {shape} L={length} {mode:4s} {row['decode_ms_p50']:8.1f} ms/batch  x{row['speedup_vs_full']:.2f}"
                f"  history {row['history_share']:.0%} (attention {row['history_attention_share']:.0%})")
    return rows


def quality_rows(data: str, runs_dir: Path, results_dir: Path, extra: list[str], recipe_result: str | None,
                 lengths) -> list[dict]:
    """Train each length (unless its result file exists) and read its test rows; the recipe's own
    length (4 codes, 256^3) can come from an existing run of the recipe (recipe_result)."""
    rows = []
    for length in lengths:
        sizes = LENGTHS[length]
        result = results_dir / f"semantic_id_length_{data}_L{length}.json"
        if length == 4 and recipe_result:
            result = Path(recipe_result)
        if not result.exists():
            cmd = [sys.executable, "-m", "export.train", "--data", data, "--codebook", *map(str, sizes),
                   "--out", str(runs_dir / f"{data}-L{length}" / "model.pt"), "--results", str(result), *extra]
            log("  " + " ".join(cmd[1:]))
            subprocess.run(cmd, check=True)
        blob = json.loads(result.read_text())
        for r in blob["rows"]:
            if r["model"] in ("hstu-retrieval", "hstu-fused"):
                rows.append({"dataset": data, "codes_per_item": length, "kmeans_sizes": list(sizes),
                             "codebook_sizes": blob["config"]["codebook_sizes"], "order": r["model"],
                             "seen_excluded": r["seen_excluded"], "best_valid": blob["best_valid"],
                             "epochs_run": blob["epochs_run"], "train_seconds": blob["train_seconds"],
                             **{k: r[k] for k in ("recall@5", "ndcg@5", "recall@10", "ndcg@10")}})
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--train", metavar="DATA", help="also train the recipe once per length on DATA and read its test rows")
    ap.add_argument("--train-args", default="", help="extra export.train flags for --train (e.g. '--epochs 10')")
    ap.add_argument("--recipe-result", help="the result file of a run of the recipe on DATA (export.train --results) "
                                            "to read the 4-code rows from instead of training it again")
    ap.add_argument("--no-decode", action="store_true", help="quality only: skip the decode timing")
    ap.add_argument("--quick", action="store_true", help="tiny shapes, few repetitions (a check that it runs)")
    ap.add_argument("--out", default=None, help="result file ('-': print only; default perf/results/semantic_id_length.json)")
    ap.add_argument("--runs", default="runs/semantic-id-length", help="where --train puts its checkpoints")
    ap.add_argument("--train-lengths", type=int, nargs="+", choices=list(LENGTHS), default=list(LENGTHS),
                    help="the lengths --train trains (default all)")
    args = ap.parse_args(argv)
    torch.set_num_threads(2)
    shapes = {k: dict(v) for k, v in SHAPES.items()}
    beam, reps, phase_runs = 100, 7, 5
    if args.quick:
        shapes = {k: dict(v, items=min(v["items"], 600), history=min(v["history"], 64), users=2) for k, v in shapes.items()}
        beam, reps, phase_runs = 16, 2, 1
    rows = []
    for shape, s in ({} if args.no_decode else shapes).items():
        rows += decode_rows(shape, beam=beam, reps=reps, phase_runs=phase_runs, **s)
    extra = {}
    if args.train:
        extra["quality"] = quality_rows(args.train, Path(args.runs), RESULTS_DIR, args.train_args.split(),
                                        args.recipe_result, args.train_lengths)
        for r in extra["quality"]:
            log(f"  {r['dataset']} L={r['codes_per_item']} {r['order']:14s} seen_excluded={r['seen_excluded']!s:5} "
                f"R@10 {r['recall@10']:.4f} N@10 {r['ndcg@10']:.4f} (valid {r['best_valid']:.4f}, {r['epochs_run']} epochs)")
    if args.out != "-":
        out = Path(args.out) if args.out else RESULTS_DIR / "semantic_id_length.json"
        write_result(out, rows, command=command("perf.experiments.semantic_id_length", argv),
                     code_budget=f"2^{int(math.log2(math.prod(LENGTHS[4])))} prefixes before the collision code",
                     **extra)
        log(f"wrote {out}")


if __name__ == "__main__":
    main()
