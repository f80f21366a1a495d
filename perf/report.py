"""Turns the benchmark JSON files of a results directory into RESULTS.md (Markdown tables) and
PNG plots: decode latency vs history length per variant, ranking throughput vs candidates,
incremental-encoding bar chart.

    python -m perf.report                     # perf/results
    python -m perf.report --results DIR
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from backend_src.results import markdown_table  # noqa: E402
from perf.common import RESULTS_DIR  # noqa: E402

DECODE_COLUMNS = ["mode", "users", "latency_ms_p50", "latency_ms_per_user_p50", "speedup_vs_full",
                  "attn_mac_ratio_vs_full", "speedup_bound_from_attention", "decode_mac_ratio_vs_full",
                  "project_history_ms_p50", "paper_speedup_vs_full", "reps"]
PHASE_COLUMNS = ["history", "users", "mode", "history_attention", "kv_projection", "beam_layers",
                 "beam_bookkeeping", "total", "speedup_bound_at_full_mac_rate"]
RANKING_COLUMNS = ["mode", "effective_microbatch", "latency_ms_p50", "candidates_per_s", "speedup_vs_naive",
                   "speedup_vs_naive_incl_history_encode", "extrapolated_from", "reps"]
CACHING_COLUMNS = ["threads", "users", "new_events", "mode", "latency_ms_p50", "latency_ms_per_user_p50",
                   "speedup_vs_forward", "max_abs_diff", "reps"]


# the offline harness's own files (random models of the papers' sizes); a run on a trained checkpoint
# (e.g. decode_latency_<its folder>.json) is listed with the other files
SECTION_FILES = {"decode": "decode_latency.json", "ranking": "ranking_throughput.json", "caching": "caching.json"}


def load_results(directory: Path) -> dict:
    """benchmark name -> blob, for the harness's files (SECTION_FILES); others listed."""
    found, others = {}, []
    for path in sorted(directory.glob("*.json")):
        try:
            blob = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        blob["_file"] = path.name
        if isinstance(blob, dict) and SECTION_FILES.get(blob.get("benchmark")) == path.name:
            found[blob["benchmark"]] = blob
        elif isinstance(blob, dict):
            others.append(blob)
    found["_others"] = others
    return found


def _provenance(blob: dict) -> str:
    m = blob.get("machine", {})
    machine = f"{m.get('cpu_cores', '?')} cores, {m.get('torch_threads', '?')} torch threads, " \
              f"gpu {m.get('gpu') or 'none'}, torch {m.get('torch', '?')}"
    return (f"File `{blob['_file']}`; command `{blob.get('command')}`; date {blob.get('date')}; "
            f"commit {blob.get('commit')}; machine: {machine}.")


def _fmt_rows(rows, digits=2):
    """Round floats for display (keeps the table readable; the JSON has full precision)."""
    out = []
    for r in rows:
        out.append({k: (round(v, digits) if isinstance(v, float) and abs(v) >= 0.01 else v) for k, v in r.items()})
    return out


# --------------------------------------------------------------------------------------------
# Sections
# --------------------------------------------------------------------------------------------
def decode_section(blob: dict, out_dir: Path) -> list[str]:
    rows = blob["rows"]
    paper = blob.get("paper", {})
    lines = ["## Decode latency (semantic-ID beam search)", "", _provenance(blob), "", blob.get("note", ""), ""]
    cfg = blob.get("config", {})
    lines.append(f"Beam {cfg.get('beam')}, codebook sizes {cfg.get('codebook_sizes')}, {cfg.get('items')} items, "
                 f"d_model {cfg.get('d_model')}, {cfg.get('heads')} heads. Latency in ms per batch of users "
                 f"(median of interleaved repetitions) and per user; speedups are ratios of medians measured in "
                 f"one process. MAC ratios are analytical (attention QK + AV rows actually read). "
                 f"speedup_bound_from_attention is Amdahl's bound 1 / (1 - f + f / mac_ratio), with f the "
                 f"measured share of the full decode spent in its history attention (the rest -- beam "
                 f"bookkeeping, query/output layers, constrained softmax, top-k -- is the same in every mode). "
                 f"decode_mac_ratio_vs_full counts every multiply-accumulate of the decode as it runs (K/V "
                 f"projections, attention, the beams' layers): the speedup if every multiply ran at one rate.")
    lines.append("")
    for n in sorted({r["history"] for r in rows}):
        sub = [r for r in rows if r["history"] == n]
        share = sub[0].get("full_attention_share")
        lines += [f"### History {n}", ""]
        if share is not None:
            lines += [f"History attention is {share:.0%} of the full-attention decode at this length.", ""]
        lines += [markdown_table(_fmt_rows(sub), DECODE_COLUMNS, ".3g"), ""]
    if paper:
        ours = paper.get("our_count_at_paper_setting", {})
        lines += [
            "PFA paper (history 512, L20 GPU, 512 users a batch): PFA "
            f"{paper.get('measured_speedup_pfa_vs_full')}x faster than full attention measured, "
            f"{paper.get('theoretical_mac_ratio_pfa_vs_full')}x fewer attention MACs in theory, "
            f"{paper.get('theoretical_mac_ratio_dynamic_vs_pfa')}x fewer than dynamic top-k. The same counting "
            f"rule here gives {ours.get('full_vs_pfa', float('nan')):.2f}x and "
            f"{ours.get('dynamic_vs_pfa', float('nan')):.2f}x at that setting.", ""]
    png = out_dir / "decode_latency.png"
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for mode in dict.fromkeys(r["mode"] for r in rows):
        pts = sorted((r["history"], r["latency_ms_per_user_p50"]) for r in rows if r["mode"] == mode)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=mode,
                linewidth=2.5 if mode in ("full", "pfa") else 1.2)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("history length")
    ax.set_ylabel("ms per user (median)")
    ax.set_title("Beam-search decode latency per user")
    ax.legend(fontsize=7, ncol=2)
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
    lines += [f"![decode latency]({png.name})", ""]
    if blob.get("phases_ms"):
        lines += ["Where the time goes (ms per batch, medians of decodes timed by phase: history attention "
                  "ops, K/V projections, the beams' query and output layers, and the rest, the beam "
                  "bookkeeping: constrained log-softmax, top-k, codebook tables, reordering). "
                  "speedup_bound_at_full_mac_rate: PFA's speedup if its history side (attention and K/V "
                  "projections) took full attention's time per multiply-accumulate and the rest the time "
                  "measured:", "",
                  markdown_table(blob["phases_ms"], PHASE_COLUMNS, ".3g"), ""]
    return lines


def ranking_section(blob: dict, out_dir: Path) -> list[str]:
    rows = blob["rows"]
    lines = ["## Ranking throughput (M-FALCON vs one forward per candidate)", "", _provenance(blob), "",
             blob.get("note", ""), ""]
    goal = blob.get("goal", {}).get("speedup_at_1024_candidates")
    for m in sorted({r["candidates"] for r in rows}):
        sub = [r for r in rows if r["candidates"] == m]
        lines += [f"### {m} candidates, history {sub[0]['history']}", "",
                  markdown_table(_fmt_rows(sub), RANKING_COLUMNS, ".3g"), ""]
    best = [r for r in rows
            if r["candidates"] == 1024 and r.get("speedup_vs_naive") and r["mode"] != "naive_full_forward"]
    if best and goal:
        b = max(best, key=lambda r: r["speedup_vs_naive"])
        lines += [f"At 1024 candidates the best microbatch ({b['microbatch']}) is {b['speedup_vs_naive']:.0f}x the "
                  f"naive throughput ({b['speedup_vs_naive_incl_history_encode']:.0f}x counting one history "
                  f"encode); goal {goal:.0f}x.", ""]
    png = out_dir / "ranking_throughput.png"
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for mode in dict.fromkeys(r["mode"] for r in rows if "candidates_per_s" in r):
        pts = sorted((r["candidates"], r["candidates_per_s"]) for r in rows if r["mode"] == mode)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=mode)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("candidates per request")
    ax.set_ylabel("candidates / s (median)")
    ax.set_title("Ranking throughput")
    ax.legend(fontsize=8)
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
    lines += [f"![ranking throughput]({png.name})", ""]
    return lines


def caching_section(blob: dict, out_dir: Path) -> list[str]:
    rows = blob["rows"]
    lines = ["## Incremental encoding (append to a cached history vs re-encode)", "", _provenance(blob), "",
             blob.get("note", ""), "", markdown_table(_fmt_rows(rows, 3), CACHING_COLUMNS, ".3g"), ""]
    png = out_dir / "caching.png"
    key = lambda r: (r.get("threads", 0), r["users"], r["new_events"])  # noqa: E731
    groups = sorted({key(r) for r in rows})
    fig, ax = plt.subplots(figsize=(8, 4.5))
    width = 0.38
    for j, kind in enumerate(("append", "forward")):
        vals = [next((r["latency_ms_p50"] for r in rows if key(r) == g and r["mode"].startswith(kind)), 0.0)
                for g in groups]
        bars = ax.bar([i + (j - 0.5) * width for i in range(len(groups))], vals, width, label=kind)
        ax.bar_label(bars, fmt="%.1f", fontsize=7)
    ax.set_xticks(range(len(groups)), [f"{t}t, {u}u, +{e}" for t, u, e in groups], fontsize=8)
    ax.set_yscale("log")
    ax.set_ylabel("ms per batch (median)")
    ax.set_title(f"Append vs re-encode, history {rows[0]['history']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
    lines += [f"![caching]({png.name})", ""]
    return lines


# the whole-decode runs of perf/gpu_run.sh: (subdirectory, ops backend, timing)
GPU_DECODE_RUNS = [
    ("graphs", "Triton kernels", "CUDA-graph replay"), (".", "Triton kernels", "eager"),
    ("torch_ops_graphs", "torch reference", "CUDA-graph replay"), ("torch_ops", "torch reference", "eager"),
]


def gpu_section(gpu_dir: Path) -> list[str]:
    """Whole-decode latency on a GPU in the four setups of perf/gpu_run.sh, side by side, plus
    ranking and caching there; the kernel tables are in gpu/gpu_kernels.md."""
    runs = [(sub, ops, timing, json.loads((gpu_dir / sub / "decode_latency.json").read_text()))
            for sub, ops, timing in GPU_DECODE_RUNS if (gpu_dir / sub / "decode_latency.json").exists()]
    if not runs:
        return []
    first = runs[0][3]
    lines = ["## On a GPU (`bash perf/gpu_run.sh`)", "",
             f"{first['machine'].get('gpu')}, torch {first['machine'].get('torch')}, date {first.get('date')}; "
             f"commit {first.get('commit')}. Whole semantic-ID decode, beam {first['config']['beam']}, "
             f"{first['config']['items']} items, d_model {first['config']['d_model']}, "
             f"{first['config']['heads']} heads; ms per batch (median). Eager: Python launches every op (as "
             "served); CUDA-graph replay: the GPU's own work without per-op launch cost. Kernel-level tables: "
             "`gpu/gpu_kernels.md`.", ""]
    rows = []
    for _, ops, timing, blob in runs:
        for n in sorted({r["history"] for r in blob["rows"]}):
            by = {r["mode"]: r for r in blob["rows"] if r["history"] == n}
            full, pfa, dyn, sel0 = (by.get(m, {}) for m in ("full", "pfa", "dynamic_topk", "pfa_sel0"))
            rows.append({
                "ops": ops, "timing": timing, "history": n, "users": full.get("users"),
                "full_ms": full.get("latency_ms_p50"), "pfa_ms": pfa.get("latency_ms_p50"),
                "pfa_speedup": pfa.get("speedup_vs_full"), "pfa_sel0_speedup": sel0.get("speedup_vs_full"),
                "dynamic_topk_ms": dyn.get("latency_ms_p50"),
                "dynamic_topk_over_pfa": dyn["latency_ms_p50"] / pfa["latency_ms_p50"] if dyn and pfa else None,
                "pfa_amdahl_bound": pfa.get("speedup_bound_from_attention"),
            })
    lines.append(markdown_table(rows, list(rows[0]), ".3g"))
    lines.append("")
    for name, title in (("ranking_throughput.json", "Ranking on the GPU"), ("caching.json", "Caching on the GPU")):
        path = gpu_dir / name
        if path.exists():
            blob = json.loads(path.read_text())
            blob["_file"] = f"gpu/{name}"
            cols = RANKING_COLUMNS if name.startswith("ranking") else CACHING_COLUMNS
            table = markdown_table(_fmt_rows(blob["rows"], 3), cols, ".3g")
            lines += [f"### {title}", "", _provenance(blob), "", table, ""]
    return lines


def write_report(directory: Path = RESULTS_DIR) -> Path:
    directory = Path(directory)
    results = load_results(directory)
    lines = ["# Offline performance results", "",
             "Generated from the JSON files in this directory. Medians of repetitions in which every variant "
             "runs once per round (interleaved), after warmup; ratios come from medians measured in the same "
             "process. Absolute CPU times depend on the host and its load; the ratios are the numbers to read.", ""]
    for name, section in (("decode", decode_section), ("ranking", ranking_section), ("caching", caching_section)):
        if name in results:
            lines += section(results[name], directory)
        else:
            lines += [f"## {name}", "", "(no result file yet)", ""]
    if (directory / "gpu").is_dir():
        lines += gpu_section(directory / "gpu")
    others = results["_others"]
    if others:
        lines += ["## Other result files", ""]
        lines += [f"- `{b['_file']}`: {b.get('command', '')} ({b.get('date', '')})" for b in others]
        lines.append("")
    path = directory / "RESULTS.md"
    path.write_text("\n".join(lines))
    return path


def main(argv=None) -> Path:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--results", type=Path, default=RESULTS_DIR, help="directory with the JSON files")
    args = p.parse_args(argv)
    path = write_report(args.results)
    print(f"wrote {path}", flush=True)
    return path


if __name__ == "__main__":
    main()
