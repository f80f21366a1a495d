"""Is the working tree's served decode (one request's beam search, as the pfa_decoder stage runs it) faster than an
earlier commit's? Both versions of the package are loaded into this one process (the earlier one exported with
`git archive`), each loads the same checkpoint, and their decodes alternate call by call on the same states, so the
drift of a shared machine's speed cancels; their beams are checked identical first. Run from the repository root
(needs the benchmark model, `make bench-served` trains it):
    python -m perf.experiments.ab_served_decode OLD_COMMIT      # -> perf/results/ab_served_decode.json
    python -m perf.experiments.ab_served_decode OLD_COMMIT --quick --out -
"""
import argparse
import importlib
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from perf.common import RESULTS_DIR, host_load, interleaved, log, save_result, summary_ms

PACKAGE = "backend_src"


DECODE_MODULES = ("config", "model.recommender", "decoding.beam_search", "decoding.cuda_graphs")


def load_package(root: Path, modules=DECODE_MODULES) -> dict:
    """Import the package's `modules` found under `root` and return them, then take them out of
    sys.modules so that another copy can be imported (the functions keep their own modules' globals)."""
    sys.path.insert(0, str(root))
    try:
        for name in [n for n in sys.modules if n == PACKAGE or n.startswith(PACKAGE + ".")]:
            del sys.modules[name]
        for name in modules:
            importlib.import_module(f"{PACKAGE}.{name}")
        return {n: sys.modules.pop(n) for n in list(sys.modules) if n == PACKAGE or n.startswith(PACKAGE + ".")}
    finally:
        sys.path.remove(str(root))


def old_and_new(old: str, modules=DECODE_MODULES) -> dict:
    """{"old": the package at commit `old` (exported with `git archive`), "new": the working tree's}."""
    with tempfile.TemporaryDirectory() as tmp:
        archive = subprocess.run(["git", "archive", old, PACKAGE], capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", tmp], input=archive, check=True)
        return {"old": load_package(Path(tmp), modules), "new": load_package(Path.cwd(), modules)}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("old", help="the earlier commit")
    ap.add_argument("--checkpoint", type=Path, default=Path("runs/bench/model.pt"))
    ap.add_argument("--histories", type=int, nargs="+", default=[50, 512])
    ap.add_argument("--users", type=int, nargs="+", default=[1, 4], help="requests decoded together (dynamic batching)")
    ap.add_argument("--reps", type=int, default=300)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=str(RESULTS_DIR / "ab_served_decode.json"), help="'-': print only")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)  # as the served stage runs
    load_start = host_load()
    old_rev = subprocess.run(["git", "rev-parse", "--short", args.old], capture_output=True, text=True, check=True).stdout.strip()
    versions = old_and_new(args.old)
    models, decoders = {}, {}
    for name, mods in versions.items():
        models[name] = mods[f"{PACKAGE}.model.recommender"].GenerativeRecommender.load(args.checkpoint)
        options = mods[f"{PACKAGE}.config"].DecodeOptions(mode="pfa", beam_width=100, k=256, r=0.5, selection_step=1)
        graphs = mods[f"{PACKAGE}.decoding.cuda_graphs"].DecodeGraphs(models[name], max_history=models[name].cfg.max_seq_len)
        decoders[name] = (graphs, options)
    if type(models["old"]) is type(models["new"]):
        raise SystemExit("the two versions share one package: the earlier one was not loaded")
    cfg = models["new"].cfg
    rows = []
    for n in sorted({min(h, cfg.max_seq_len) for h in args.histories}):
        for b in args.users:
            g = torch.Generator().manual_seed(n * 100 + b)
            idx = torch.randint(1, cfg.num_items + 1, (b, n), generator=g)
            with torch.inference_mode():
                cache = models["new"].encode(idx, torch.zeros(b, n, dtype=torch.long), torch.arange(n).expand(b, n) * 60,
                                             torch.full((b,), n))
            states, lengths = cache.states, cache.lengths

            def run(name):
                graphs, options = decoders[name]
                return graphs.retrieve(states, lengths, options)

            with torch.inference_mode():
                a, c = run("old"), run("new")
            if not (torch.equal(a.item_ids, c.item_ids) and torch.equal(a.codes, c.codes) and torch.equal(a.log_probs, c.log_probs)):
                raise SystemExit(f"history {n}, {b} users: the two versions' beams differ")
            t = interleaved({"old": lambda: run("old"), "new": lambda: run("new")}, reps=10 if args.quick else args.reps, warmup=3)
            old, new = summary_ms(t["old"]), summary_ms(t["new"])
            rows.append(dict(history=n, users=b, identical=True, old=old, new=new, speedup=old["latency_ms_p50"] / new["latency_ms_p50"]))
            log(f"history {n}, {b} users: {old_rev} {old['latency_ms_p50']:.3f} ms, working tree {new['latency_ms_p50']:.3f} ms "
                f"({rows[-1]['speedup']:.3f}x), beams identical")
    if args.out != "-":  # the command names the commit itself, not a ref that moves (HEAD)
        argv = [old_rev if a == args.old else a for a in (sys.argv[1:] if argv is None else argv)]
        save_result(Path(args.out), rows, "perf.experiments.ab_served_decode", argv, load_start, old=old_rev,
                    checkpoint=str(args.checkpoint), options=dict(mode="pfa", beam_width=100, k=256))


if __name__ == "__main__":
    main()
