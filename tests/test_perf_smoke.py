"""Smoke test of the offline performance harness: every benchmark runs in its tiny --quick
configuration into a temporary directory; the result files carry provenance, named rows and
computed ratios, and the report renders. No timing assertions: the numbers mean nothing here."""
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("perf")
    env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE")
    subprocess.run(
        [sys.executable, "-m", "perf.bench", "--quick", "--threads", "1", "--out", str(out)],
        cwd=REPO_ROOT, env=env, check=True, capture_output=True, text=True, timeout=300,
    )
    return out


def _load(results: Path, name: str) -> dict:
    blob = json.loads((results / name).read_text())
    for key in ("command", "date", "machine", "commit", "rows"):
        assert key in blob, f"{name} lacks {key}"
    assert blob["command"].startswith("python -m perf.")
    assert blob["rows"]
    for row in blob["rows"]:
        assert row["dataset"] and row["mode"] and row["model"]
        assert row["latency_ms_p50"] > 0 and row["reps"] >= 1
    return blob


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def test_decode_rows(results):
    blob = _load(results, "decode_latency.json")
    rows = blob["rows"]
    modes = {r["mode"] for r in rows}
    assert {"full", "pfa", "pfa_per_beam", "pfa_no_shrink", "pfa_shared_kv", "pfa_sel0", "pfa_sel2",
            "pfa_k128", "pfa_k192", "dynamic_topk"} <= modes
    for r in rows:
        assert _finite(r["speedup_vs_full"]) and _finite(r["attn_mac_ratio_vs_full"])
        assert _finite(r["latency_ms_per_user_p50"]) and _finite(r["project_history_ms_p50"])
        if r["mode"] == "full":
            assert r["speedup_vs_full"] == 1.0 and r["attn_mac_ratio_vs_full"] == 1.0
        assert _finite(r["decode_mac_ratio_vs_full"])
    # full and PFA timed by phase at every history length; the phases add up to the decode
    phases = blob["phases_ms"]
    assert {(p["history"], p["mode"]) for p in phases} == {(r["history"], m) for r in rows for m in ("full", "pfa")}
    for p in phases:
        parts = [p[k] for k in ("history_attention", "kv_projection", "beam_layers", "beam_bookkeeping")]
        assert all(x > 0 for x in parts[:3]) and abs(sum(parts) - p["total"]) < 1e-6
        assert _finite(p["speedup_bound_at_full_mac_rate"])
    # the analytical count reproduces the paper's theoretical ratios at its setting
    ours = blob["paper"]["our_count_at_paper_setting"]
    assert abs(ours["full_vs_pfa"] - 2.65) < 0.02 and abs(ours["dynamic_vs_pfa"] - 1.99) < 0.02


def test_ranking_rows(results):
    rows = _load(results, "ranking_throughput.json")["rows"]
    naive = [r for r in rows if r["mode"] == "naive_full_forward"]
    mf = [r for r in rows if r["mode"].startswith("mfalcon_mb")]
    assert naive and mf
    assert any("extrapolated_from" in r for r in naive)  # the larger sets scale a measured subset
    for r in mf:
        assert _finite(r["candidates_per_s"]) and _finite(r["speedup_vs_naive"])
        assert _finite(r["speedup_vs_naive_incl_history_encode"])
        assert r["max_abs_diff_vs_naive"] < 1e-3  # the same scores both ways


def test_caching_rows(results):
    rows = _load(results, "caching.json")["rows"]
    appends = [r for r in rows if r["mode"].startswith("append_")]
    assert {r["new_events"] for r in appends} >= {1}
    assert {r["users"] for r in appends} >= {1}
    for r in appends:
        assert _finite(r["speedup_vs_forward"]) and r["max_abs_diff"] < 1e-4


def test_report(results):
    text = (results / "RESULTS.md").read_text()
    for heading in ("Decode latency", "Ranking throughput", "Incremental encoding"):
        assert heading in text
    for png in ("decode_latency.png", "ranking_throughput.png", "caching.png"):
        assert (results / png).stat().st_size > 1000


def test_mac_count_rules():
    from perf.bench_decode import attention_macs

    full = attention_macs("full", 512, 100, 2, 32, 256, 1.0, 1)
    pfa = attention_macs("pfa", 512, 100, 2, 32, 256, 0.5, 1)
    # step 0: 1 beam over 512 rows; steps 1..3: 100 beams; QK + AV, 2 heads x 32 dims
    assert full["attn_macs"] == 2 * 32 * 2 * (512 + 3 * 100 * 512)
    assert pfa["attn_macs"] == 2 * 32 * (2 * 512 + 100 * (512 + 256) + 100 * 2 * 128 + 100 * 2 * 64)
    # a history shorter than k reads every row: no savings after selection
    short = attention_macs("pfa", 128, 100, 2, 32, 256, 1.0, 1)
    assert short["attn_macs"] == attention_macs("full", 128, 100, 2, 32, 256, 1.0, 1)["attn_macs"]


def test_decode_mac_count():
    from backend_src.config import DecodeOptions
    from perf.bench_decode import decode_macs

    D, H, dh, n, W, sizes = 64, 2, 32, 512, 100, (256, 256, 256, 8)
    full = decode_macs(DecodeOptions(mode="full", beam_width=W), n, D, H, sizes)
    pfa = decode_macs(DecodeOptions(mode="pfa", beam_width=W, k=256, r=0.5, selection_step=1), n, D, H, sizes)
    # the beams' layers: 6 D^2 + D C_t per beam and step, one beam at step 0
    head = 6 * D * D * (1 + 3 * W) + D * (256 + W * (256 + 256 + 8))
    assert full["head_macs"] == pfa["head_macs"] == head
    # step 0 in state space; then K and V of every row and attention over every row, 3 steps
    step0 = H * (2 * dh * D + 2 * n * D)
    assert full["projection_macs"] == 3 * n * 2 * D * D
    assert full["attention_macs"] == step0 + 3 * 2 * W * H * n * dh
    # PFA: keys of every row, K and V of the 256 + 128 + 64 kept rows; the selection's logits and
    # pooling over every row, attention over the kept prefixes
    assert pfa["projection_macs"] == n * D * D + (256 + 128 + 64) * 2 * D * D
    assert pfa["attention_macs"] == step0 + W * H * n * (dh + 1) + 2 * W * H * dh * (256 + 128 + 64)
    assert full["decode_macs"] == sum(full[k] for k in ("projection_macs", "attention_macs", "head_macs"))
    # a shared projection: K and V of every row once, the kept rows gathered, not projected
    shared = decode_macs(DecodeOptions(mode="pfa", beam_width=W), n, D, H, sizes, shared_kv=True)
    assert shared["projection_macs"] == n * 2 * D * D


def test_phase_timer_restores_the_decoder():
    """Timing by phase wraps the decoder's methods and the attention ops for its runs only."""
    import torch

    from backend_src import ops
    from backend_src.config import DecodeOptions
    from backend_src.decoding.beam_search import generate
    from perf.bench_decode import build, phase_times_ms

    codebook, decoders = build(600, 16, 2, 32, seed=0)
    decoder = decoders[False]
    states, lengths = torch.randn(2, 32, 16), torch.tensor([32, 20])
    original = ops.decode_attention
    for mode in ("full", "pfa"):
        opts = DecodeOptions(mode=mode, beam_width=8, k=16)
        expected = generate(decoder, codebook, states, lengths, opts).item_ids
        times = phase_times_ms(lambda: generate(decoder, codebook, states, lengths, opts), decoder, runs=2)
        assert times["history_attention"] > 0 and times["beam_layers"] > 0 and times["total"] > 0
        assert ops.decode_attention is original and not {"head_state", "query", "project_step"} & set(vars(decoder))
        assert torch.equal(generate(decoder, codebook, states, lengths, opts).item_ids, expected)


def test_report_gpu_section(results, tmp_path):
    """perf/gpu_run.sh's layout (decode runs in subfolders, ranking and caching beside them) gives a
    GPU section with one row per run and history length."""
    import shutil

    from perf.report import write_report

    gpu = tmp_path / "gpu"
    for sub in ("graphs", "torch_ops"):
        (gpu / sub).mkdir(parents=True)
        shutil.copy(results / "decode_latency.json", gpu / sub)
    for name in ("decode_latency.json", "ranking_throughput.json", "caching.json"):
        for folder in (gpu, tmp_path):
            shutil.copy(results / name, folder / name)
    text = write_report(tmp_path).read_text()
    section = text[text.index("## On a GPU"):]
    histories = {r["history"] for r in json.loads((results / "decode_latency.json").read_text())["rows"]}
    assert sum(line.startswith(("| Triton kernels", "| torch reference")) for line in section.splitlines()) \
        == 3 * len(histories)
    assert "### Ranking on the GPU" in section and "### Caching on the GPU" in section


def test_gpu_kernels_script_cpu_smoke(tmp_path):
    """The GPU benchmark script itself (checks, HSTU profile per tile, a baseline kernels file
    beside ours, the Markdown) on tiny shapes through Triton's CPU interpreter, so that a GPU run
    is not spent finding a script error. Here the baseline is our own package."""
    pytest.importorskip("triton")
    kernels = REPO_ROOT / "backend_src" / "ops" / "triton_kernels"
    subprocess.run(
        [sys.executable, "perf/gpu_kernels.py", "--cpu-smoke", "--out", str(tmp_path),
         "--baseline-kernels", str(kernels)],
        cwd=REPO_ROOT, check=True, capture_output=True, text=True, timeout=600,
    )
    report = json.loads((tmp_path / "gpu_kernels.json").read_text())
    assert report["all_ok"] and report["decode"] and report["hstu"]
    for r in report["hstu"]:
        profile = r["profile"]
        assert len(profile["tiles"]) >= 2 and all(t["checks"]["ok"] for t in profile["tiles"].values())
        # the kernel with and without its biases, the per-pair time path, the dispatched op
        assert set(profile["parts_at_best"]) == {"biases=1", "biases=0", "per_pair_time", "op_at_best"}
        assert r["baseline"]["checks"]["ok"]
    assert "## HSTU kernel profile" in (tmp_path / "gpu_kernels.md").read_text()


def test_in_process_request_writes_the_log_as_the_served_one_does(tmp_path):
    """The served benchmark's in-process row does the served request's work beyond the model too: an
    open logs its events, an append its one event after the session's others, a recommend nothing."""
    from backend_src.config import DecodeOptions
    from backend_src.model.covisitation import CoVisitation
    from backend_src.model.recommender import GenerativeRecommender
    from backend_src.serving.event_log import open_event_log
    from perf.served import InProcess

    ids = [None] + [f"i{k}" for k in range(40)]
    model = GenerativeRecommender.untrained(ids, 32, seed=0)
    # every expert of the served order on, the co-visitation one too: it reads the history's items
    model.covisitation = CoVisitation(model.cfg.num_items, 2)
    model.cfg.set_fusion_weights((1.0, 0.5, 0.5), (1.0, 0.5, 0.5))
    events = ([f"i{k}" for k in range(20)], [0] * 20, list(range(100, 120)))
    path = tmp_path / "events.sqlite3"
    work = InProcess(model, events, DecodeOptions(beam_width=8), top_k=3, threads=1, log_path=path, durability="full")
    took = {kind: work(kind) for kind in ("open", "append", "recommend")}
    work.close()
    for kind, t in took.items():
        assert 0 < t["model"] <= t["total"], kind
    log = open_event_log(str(path))
    assert log.counts(["s:in-process-open-1", "s:in-process-append-2"]) == [20, 20]
    assert log.tail("s:in-process-append-2", 1).items == ["i19"]
    assert log.stats()["users"] == 2  # the recommend wrote nothing
    log.close()


def test_overhead_interval_holds_the_p50_difference_and_narrows_with_less_noise():
    import numpy as np

    from perf.served import overhead_ci95

    rng = np.random.default_rng(0)
    noise = rng.normal(0, 1, (3, 200))
    served, in_process, floor = 10 + noise[0], 6 + noise[1], 2 + 0.1 * noise[2]
    point = np.median(served) - np.median(in_process) - np.median(floor)
    lo, hi = overhead_ci95(served, in_process, floor)
    assert lo < point < hi and 1.0 < lo and hi < 3.0
    lo_quiet, hi_quiet = overhead_ci95(10 + 0.1 * noise[0], 6 + 0.1 * noise[1], floor)
    assert hi_quiet - lo_quiet < (hi - lo) / 5


def test_the_p99_limit_is_bisected_between_the_grid_points():
    from perf.served import bisect_p99_limit, throughput_at_p99

    measured = []

    def measure(c):  # p99 10 ms a concurrency; c = 7 fails to run
        measured.append(c)
        return None if c == 7 else {"concurrency": c, "p99_ms": 10.0 * c, "throughput_per_s": 100.0 * c}

    grid = [measure(c) for c in (1, 2, 4, 8, 16)]
    measured.clear()
    new = bisect_p99_limit(measure, grid, limit_ms=50.0)
    assert measured == [6, 5] and [r["concurrency"] for r in new] == [6, 5]
    assert throughput_at_p99(grid) == 400.0 and throughput_at_p99(grid + new) == 500.0
    assert bisect_p99_limit(measure, grid + new, limit_ms=50.0) == []  # neighbours: nothing left to measure
    measured.clear()
    new = bisect_p99_limit(measure, grid, limit_ms=75.0)  # 6 passes, 7 fails to run: it stops there
    assert measured == [6, 7] and [r["concurrency"] for r in new] == [6]


def test_benchmarks_on_a_trained_checkpoint(results, tmp_path):
    """--checkpoint runs decode, ranking and caching on a saved model's parts into files of their own,
    which the report lists without taking the random models' sections."""
    import shutil

    from perf.report import write_report
    from serving_helpers import build_tiny_checkpoint

    ckpt = tmp_path / "tiny" / "model.pt"
    build_tiny_checkpoint(ckpt, [None] + [f"item-{i}" for i in range(1, 300)], 64, seed=0)
    out = tmp_path / "out"
    env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE")
    for module in ("perf.bench_decode", "perf.bench_ranking", "perf.bench_caching"):
        subprocess.run([sys.executable, "-m", module, "--quick", "--threads", "1", "--checkpoint", str(ckpt), "--out", str(out)],
                       cwd=REPO_ROOT, env=env, check=True, capture_output=True, text=True, timeout=300)
    for name in ("decode_latency_tiny.json", "ranking_throughput_tiny.json", "caching_tiny.json"):
        blob = _load(out, name)
        assert "--checkpoint" in blob["command"] and all("trained" in r["model"] for r in blob["rows"])
    for name in ("decode_latency.json", "ranking_throughput.json", "caching.json"):
        shutil.copy(results / name, out / name)
    text = write_report(out).read_text()
    assert "File `decode_latency.json`" in text and "File `caching.json`" in text
    assert "- `decode_latency_tiny.json`: python -m perf.bench_decode" in text


def test_request_profile_times_every_phase_and_restores_the_stages(tmp_path):
    """The per-phase profile of the three stages: a row per (kind, phase), each stage's phases within its
    total, the decode's steps all there, and no timer left on the code afterwards."""
    from backend_src.config import DecodeOptions
    from backend_src.decoding import attention_policies, beam_search
    from export.triton_configs import ServingOptions
    from perf.request_profile import profile
    from serving_helpers import build_tiny_checkpoint

    ckpt = tmp_path / "model.pt"
    ids = [None] + [f"item-{i}" for i in range(1, 80)]
    build_tiny_checkpoint(ckpt, ids, 16, seed=0)
    decode = DecodeOptions(mode="pfa", beam_width=8, k=8)
    serving = ServingOptions(decode=decode, top_k=5, ranker_backend="torch")
    options = dict(top_k=5, exclude_seen=True, beam_width=8, mode="pfa", pfa_k=8, pfa_r=0.5, selection_step=1)
    events = (ids[1:13], [1] * 12, [1000 + 60 * i for i in range(12)])
    rows = profile(ckpt, serving, events, options, requests=3)
    by = {(r["kind"], r["phase"]): r["p50_ms"] for r in rows}
    for kind in ("open", "append", "recommend"):
        for stage in ("history_encoder", "pfa_decoder", "mfalcon_ranker"):
            assert by[kind, stage] > 0
        assert all((kind, f"pfa_decoder: step {t} head") in by for t in range(4))
        assert by[kind, "mfalcon_ranker: M-FALCON scores"] < by[kind, "mfalcon_ranker"]
    assert ("open", "history_encoder: write the log") in by and ("recommend", "history_encoder: write the log") not in by
    for wrapped in (attention_policies.AttentionPolicy.attend, attention_policies.FullAttention.attend,
                    beam_search.expand_beams):
        assert wrapped.__module__.startswith("backend_src.decoding.")
