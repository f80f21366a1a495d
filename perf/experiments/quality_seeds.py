"""Quality over three seeds, per data set: our model (beam order and served order) against SASRec fit the
same way, beside published anchors and the co-visitation counts alone (`export.baselines --model
covisitation`, deterministic: one run), from the result files in perf/results. Run from the repository root:
    python -m perf.experiments.quality_seeds
writes perf/results/<data>_seeds.md (a table per data set) and perf/results/quality_summary.json (one row per
data set, order and seen-item policy: the means over the seeds). `--data D --variant STEM` prints the same table
for a variant's three result files instead, and writes nothing.

- amazon-beauty: the recipe's final fits (`make train-beauty-refit`, `make baselines-beauty`; seeds 1 and 2 with `--seed`).
- amazon-scientific: the recipe's validation-run fits (semantic IDs from the text encoder), not refit (`make train-scientific`).
"""
import argparse
import json

from backend_src.results import write_result
from perf.common import RESULTS_DIR

METRICS = ("recall@5", "ndcg@5", "recall@10", "ndcg@10")
SEEDS = ("", "_seed1", "_seed2")
ORDERS = {  # summary order -> (row label, model name in the file)
    "retrieval": ("ours: generative retrieval (beam order)", "hstu-retrieval"),
    "served": ("ours: after ranking, fused (served order)", "hstu-fused"),
    "sasrec": ("SASRec, our pipeline, full softmax", "sasrec"),
}
COVISITATION_LABEL = "co-visitation counts alone, every item"
DATASETS = {  # data set -> (what was fit, our result file stem, SASRec's, anchors by seen_excluded)
    "amazon-beauty": (
        "final fit", "quality_beauty_refit_recipe", "baseline_sasrec_beauty_refit",
        {False: {"TIGER (published)": (0.0454, 0.0321, 0.0648, 0.0384)},
         True: {"HSTU public code, 70 epochs (anchor; R@10 / N@10 only)": (None, None, 0.098, 0.057)}},
    ),
    "amazon-scientific": ("validation-run fit", "quality_scientific_text_encoder", "baseline_sasrec_scientific",
                          {False: {}, True: {}}),
}


def values(stem: str, model: str, excluded: bool) -> list[tuple]:
    """One tuple of METRICS per seed."""
    out = []
    for seed in SEEDS:
        rows = json.loads((RESULTS_DIR / f"{stem}{seed}.json").read_text())["rows"]
        (row,) = [r for r in rows if r["model"] == model and r["seen_excluded"] == excluded]
        out.append(tuple(row[m] for m in METRICS))
    return out


def covisitation(data: str, excluded: bool) -> tuple:
    """The co-visitation baseline's METRICS (baseline_covisitation_<data>.json)."""
    rows = json.loads((RESULTS_DIR / f"baseline_covisitation_{data.split('-')[-1]}.json").read_text())["rows"]
    (row,) = [r for r in rows if r["seen_excluded"] == excluded]
    return tuple(row[m] for m in METRICS)


def cell(v):
    return "" if v is None else f"{v:.4f}"


def summarize(data: str, variant: str | None = None) -> tuple[str, list[dict]]:
    """The Markdown table of one data set and its summary rows (variant: our result files' stem
    in place of the recipe's)."""
    fit, ours, sasrec, anchors = DATASETS[data]
    ours = variant or ours
    lines = [f"| {fit}, mean of {len(SEEDS)} seeds (min-max) | seen items | " + " | ".join(METRICS) + " |",
             "|---|---|" + "---|" * len(METRICS)]
    means, rows = {}, []
    for excluded in (False, True):
        policy = "excluded" if excluded else "not excluded"
        means["covisitation", excluded] = covisitation(data, excluded)
        for label, vals in {**anchors[excluded], COVISITATION_LABEL: means["covisitation", excluded]}.items():
            lines.append(f"| {label} | {policy} | " + " | ".join(cell(v) for v in vals) + " |")
        for order, (label, model) in ORDERS.items():
            cols = list(zip(*values(sasrec if order == "sasrec" else ours, model, excluded)))
            means[order, excluded] = [sum(c) / len(c) for c in cols]
            lines.append(f"| {label} | {policy} | " + " | ".join(
                f"{sum(c) / len(c):.4f} ({min(c):.4f}-{max(c):.4f})" for c in cols) + " |")
            rows.append({"dataset": data, "order": order, "seen": "excluded" if excluded else "included",
                         **dict(zip(("recall5", "ndcg5", "recall10", "ndcg10"), means[order, excluded])),
                         "seeds": len(SEEDS), "fit": fit})
    lines.append("")
    for order, against, name in (("retrieval", "sasrec", "SASRec"), ("served", "sasrec", "SASRec"),
                                 ("served", "covisitation", "the co-visitation counts alone")):
        for excluded in (False, True):
            diff = [f"{round(100 * (a / b - 1), 1) + 0.0:+.1f}%"  # + 0.0: no "-0.0"
                    for a, b in zip(means[order, excluded], means[against, excluded])]
            lines.append(f"- {ORDERS[order][0]}, seen items {'excluded' if excluded else 'not excluded'}, "
                         f"against {name}: " + " / ".join(diff))
    return "\n".join(lines) + "\n", rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", nargs="+", default=list(DATASETS), choices=list(DATASETS),
                    help="the tables to print and write (the summary file always holds every data set)")
    ap.add_argument("--variant", metavar="STEM",
                    help="print the table of a variant's result files (STEM.json, STEM_seed1.json, STEM_seed2.json) "
                         "in place of the recipe's, for the one data set of --data; nothing is written")
    args = ap.parse_args()
    if args.variant:
        if len(args.data) != 1:
            ap.error("--variant takes one data set (--data)")
        print(summarize(args.data[0], args.variant)[0])
        return
    summary = []
    for data in DATASETS:
        table, rows = summarize(data)
        if data in args.data:
            print(f"## {data}\n\n{table}")
            (RESULTS_DIR / f"{data.split('-')[-1]}_seeds.md").write_text(table)
        summary += rows
    write_result(RESULTS_DIR / "quality_summary.json", summary)


if __name__ == "__main__":
    main()
