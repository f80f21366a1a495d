"""One-off experiments kept runnable on the current code: each answers one question the docs cite
and writes its result into perf/results. What each measures and how to run it: README.md here."""
import argparse
from pathlib import Path

from perf.common import RESULTS_DIR


def bench_model_parser(doc: str, result_file: str) -> argparse.ArgumentParser:
    """The arguments every experiment on the served benchmark's model takes (`make bench-served` trains
    it): the checkpoint, the data it was trained on, --quick and --out; the experiment adds its own."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--checkpoint", type=Path, default=Path("runs/bench/model.pt"))
    ap.add_argument("--data", default="ml-1m")
    ap.add_argument("--max-users", type=int, default=600)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=str(RESULTS_DIR / result_file), help="'-': print only")
    return ap


def served_settings() -> tuple:
    """What the served benchmark asks and serves (beam 100, PFA k 256, top 10, one torch thread a
    stage): (the client's request options, the ServingOptions to publish with)."""
    from backend_src.config import DecodeOptions
    from export.triton_configs import ServingOptions

    options = dict(top_k=10, exclude_seen=False, beam_width=100, mode="pfa", pfa_k=256, pfa_r=0.5, selection_step=1)
    decode = DecodeOptions(mode="pfa", beam_width=100, k=256, r=0.5, selection_step=1)
    return options, ServingOptions(decode=decode, top_k=10, torch_threads=1, visit_idle_s=120)
