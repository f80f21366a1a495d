"""Amazon Beauty final fits over three seeds: our model (beam order and served order) against SASRec fit the
same way, TIGER's published numbers and the HSTU public code's, from the result files in perf/results
(`make train-beauty-refit` and `make baselines-beauty`, seeds 1 and 2 with `--seed`). Run from the
repository root:
    python -m perf.experiments.beauty_seeds       # writes perf/results/beauty_seeds.md
"""
import argparse
import contextlib
import io
import json
import sys
from pathlib import Path

from perf.common import RESULTS_DIR

METRICS = ("recall@5", "ndcg@5", "recall@10", "ndcg@10")
SEEDS = ("", "_seed1", "_seed2")
RUNS = {  # row label -> (result file stem, model name in the file)
    "ours: generative retrieval (beam order)": ("quality_beauty_refit", "hstu-retrieval"),
    "ours: after ranking, fused (served order)": ("quality_beauty_refit", "hstu-fused"),
    "SASRec, our pipeline, full softmax": ("baseline_sasrec_beauty_refit", "sasrec"),
}
ANCHORS = {  # reference numbers not measured by this project: seen items not excluded / excluded
    False: {"TIGER (published)": (0.0454, 0.0321, 0.0648, 0.0384)},
    True: {"HSTU public code, 70 epochs (anchor; R@10 / N@10 only)": (None, None, 0.098, 0.057)},
}


def values(stem: str, model: str, excluded: bool) -> list[tuple]:
    out = []
    for seed in SEEDS:
        rows = json.loads((RESULTS_DIR / f"{stem}{seed}.json").read_text())["rows"]
        (row,) = [r for r in rows if r["model"] == model and r["seen_excluded"] == excluded]
        out.append(tuple(row[m] for m in METRICS))
    return out


def cell(v):
    return "" if v is None else f"{v:.4f}"


def main():
    print("| final fit, mean of 3 seeds (min-max) | seen items | " + " | ".join(METRICS) + " |")
    print("|---|---|" + "---|" * len(METRICS))
    means = {}
    for excluded in (False, True):
        policy = "excluded" if excluded else "not excluded"
        for label, vals in ANCHORS[excluded].items():
            print(f"| {label} | {policy} | " + " | ".join(cell(v) for v in vals) + " |")
        for label, (stem, model) in RUNS.items():
            seeds = values(stem, model, excluded)
            cols = list(zip(*seeds))
            means[label, excluded] = [sum(c) / len(c) for c in cols]
            print(f"| {label} | {policy} | " + " | ".join(
                f"{sum(c) / len(c):.4f} ({min(c):.4f}-{max(c):.4f})" for c in cols) + " |")
    print()
    sasrec = "SASRec, our pipeline, full softmax"
    for label in list(RUNS)[:2]:
        for excluded in (False, True):
            ours, base = means[label, excluded], means[sasrec, excluded]
            diff = [f"{round(100 * (a / b - 1), 1) + 0.0:+.1f}%" for a, b in zip(ours, base)]  # + 0.0: no "-0.0"
            print(f"- {label}, seen items {'excluded' if excluded else 'not excluded'}, against SASRec: "
                  + " / ".join(diff))


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(RESULTS_DIR / "beauty_seeds.md"), help="Markdown file ('-': stdout)")
    out = ap.parse_args().out
    text = io.StringIO()
    with contextlib.redirect_stdout(text):
        main()
    sys.stdout.write(text.getvalue())
    if out != "-":
        Path(out).write_text(text.getvalue())
