"""Served performance of the recommender: a real Triton server on free ports, a temporary
model repository with the checkpoint published into it.

(a) throughput and p50/p95/p99 latency under load: perf_analyzer drives the ``recommend``
    ensemble with sequences built from real user histories (each sequence: open with the
    user's history, then one event per request), at several concurrencies, then at those between
    the grid's highest whose p99 stays under 50 ms and the next (bisected); the highest
    throughput whose p99 stays under 50 ms;
(b) latency per request kind (open, append, recommend) and history length (50, 512), beam 100
    ranked, top 10, one request at a time: the same work in-process (same torch threads as a
    served instance, the events written to a durable log as the server writes them), through
    the server, and through Triton's floor (perf/floor: the same configs with no-op stages),
    one request of each in turn so that all three see the same noise, with a 95% interval of
    served - in-process - floor; with a per-stage breakdown from Triton's statistics (queue, compute input / infer /
    output) of the server and of the floor;
(c) with --baseline-ref REF: the same checkpoint published and served by the code of commit REF,
    beside this code's server all along: every perf_analyzer concurrency of (a) on both in turn,
    and its requests in (b)'s turns;
(d) with --locust: locust (from its own environment) replays user sessions (open, appends,
    close) for a bounded time; its CSV statistics go into the result;
(e) the per-phase profile of the three stages run in this process (perf.request_profile), and with
    --check-users the served lists against the offline model's (perf.served_eval).

    python -m perf.served --checkpoint runs/demo/model.pt --data synthetic [--quick] [--locust]

Writes perf/results/served_<data>.json and prints Markdown tables.
"""
from __future__ import annotations

import argparse
import contextlib
import csv
import glob
import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import numpy as np

from backend_src.results import REPO_ROOT, markdown_table, write_result
from genrec_contract import protocol as P

RESULTS_DIR = REPO_ROOT / "perf" / "results"
DEFAULT_CHECKPOINT = REPO_ROOT / "runs" / "demo" / "model.pt"
LOCUST_VENV = REPO_ROOT / ".venv-locust"


def scratch_parent() -> Path | None:
    """Where the benchmarks make their temporary repositories and logs: runs/ when there is one
    (beside the models, on their disk), else the system's temporary directory."""
    runs = REPO_ROOT / "runs"
    return runs if runs.is_dir() else None


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def pct(samples_ms) -> dict:
    a = np.asarray(samples_ms, dtype=float)
    if a.size == 0:
        return {"n": 0}
    return {"n": int(a.size), "p50_ms": float(np.percentile(a, 50)), "p95_ms": float(np.percentile(a, 95)),
            "p99_ms": float(np.percentile(a, 99)), "mean_ms": float(a.mean())}


def overhead_ci95(served, in_process, floor, resamples: int = 2000, seed: int = 0) -> list:
    """95% bootstrap interval of p50(served) - p50(in-process) - p50(floor): the rounds (one request
    of each, measured in turn) resampled with replacement, so the three stay paired as measured."""
    x = np.asarray([served, in_process, floor], dtype=float)  # [3, rounds]
    rounds = np.random.default_rng(seed).integers(0, x.shape[1], (resamples, x.shape[1]))
    p50 = np.median(x[:, rounds], axis=2)  # [3, resamples]
    return np.percentile(p50[0] - p50[1] - p50[2], [2.5, 97.5]).tolist()


# --------------------------------------------------------------------------------------------
# perf_analyzer
# --------------------------------------------------------------------------------------------
def perf_analyzer_binary() -> Path | None:
    """The perf_analyzer that the tritonclient package installs next to this interpreter."""
    p = Path(sys.executable).parent / "perf_analyzer"
    return p if p.exists() else (Path(shutil.which("perf_analyzer")) if shutil.which("perf_analyzer") else None)


def perf_analyzer_env(lib_dir: Path) -> dict:
    """Environment in which the bundled perf_analyzer starts: it links libb64.so.0d and
    libcudart.so.12, which the nvidia-pytriton wheel ships under hashed names; link them under
    the plain names into `lib_dir` and put it on LD_LIBRARY_PATH."""
    from backend_src.serving.server import triton_home

    libs = triton_home().parents[1] / "nvidia_pytriton.libs"
    lib_dir.mkdir(parents=True, exist_ok=True)
    for plain, pattern in (("libb64.so.0d", "libb64-*.so.0d"), ("libcudart.so.12", "libcudart-*.so.12*")):
        hits = sorted(glob.glob(str(libs / pattern)))
        if not hits:
            raise RuntimeError(f"no {pattern} in {libs}: perf_analyzer cannot start")
        link = lib_dir / plain
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(hits[0])
    env = dict(os.environ)
    env["LD_LIBRARY_PATH"] = str(lib_dir) + (os.pathsep + env["LD_LIBRARY_PATH"] if env.get("LD_LIBRARY_PATH") else "")
    return env


def perf_analyzer_usable(env: dict) -> tuple[bool, str]:
    binary = perf_analyzer_binary()
    if binary is None:
        return False, "no perf_analyzer binary (it comes with tritonclient 2.51)"
    r = subprocess.run([str(binary), "--help"], env=env, capture_output=True, text=True, timeout=60)
    text = r.stdout + r.stderr
    if "error while loading shared libraries" in text:
        return False, text.strip().splitlines()[-1]
    return True, str(binary)


def _json_tensor(spec: P.TensorSpec, values: list) -> dict:
    return {"content": values, "shape": [len(values)] if spec.dims == (-1,) else list(spec.resolve({}))}


def sequence_input_data(streams: list, options: dict) -> dict:
    """perf_analyzer input data: one stream per user session, one step per request; step 0
    opens the session with its history, every later step appends events. All option inputs
    are given (perf_analyzer would otherwise fill optional inputs with random data)."""
    from clients.client import OPTION_TENSORS

    missing = sorted(set(OPTION_TENSORS) - set(options))
    if missing:
        raise ValueError(f"perf_analyzer input data needs every option (it would send random values): {missing}")
    opt = {}
    for key, value in options.items():
        spec = OPTION_TENSORS[key]
        opt[spec.name] = {"content": [value], "shape": [1]}
    data = []
    for steps in streams:
        out = []
        for items, actions, timestamps in steps:
            out.append({
                P.ITEM_IDS.name: _json_tensor(P.ITEM_IDS, [str(x) for x in items]),
                P.ACTIONS.name: _json_tensor(P.ACTIONS, [int(x) for x in actions]),
                P.TIMESTAMPS.name: _json_tensor(P.TIMESTAMPS, [int(x) for x in timestamps]),
                **opt,
            })
        data.append(out)
    return {"data": data}


def run_perf_analyzer(url: str, input_json: Path, concurrency: int, steps: int, env: dict, csv_path: Path,
                      interval_ms: int = 3000, max_trials: int = 6, timeout_s: float = 300.0,
                      id_start: int = 1_000_000, request_count: int | None = None) -> dict:
    """One perf_analyzer run at one concurrency; returns the parsed CSV row. With
    `request_count`, one measurement of that many requests (no stability windows)."""
    cmd = [
        str(perf_analyzer_binary()), "-m", P.ENSEMBLE, "-u", url, "-i", "grpc", "-b", "1",
        "--input-data", str(input_json),
        "--sequence-length", str(steps), "--sequence-length-variation", "0",
        "--sequence-id-range", f"{id_start}:{id_start + 1_000_000}",
        "--concurrency-range", str(concurrency),
        "-f", str(csv_path),
    ]
    if request_count:
        cmd += ["--request-count", str(request_count)]
    else:
        cmd += ["--measurement-mode", "time_windows", "--measurement-interval", str(interval_ms),
                "--stability-percentage", "50", "--max-trials", str(max_trials), "--percentile", "95"]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
    if r.returncode != 0 or not csv_path.exists():
        tail = "\n".join((r.stdout + r.stderr).strip().splitlines()[-15:])
        raise RuntimeError(f"perf_analyzer failed (exit {r.returncode}):\n{tail}")
    return parse_perf_analyzer_csv(csv_path)[0] | {"command": " ".join(cmd[1:])}


def parse_perf_analyzer_csv(path: Path) -> list:
    """perf_analyzer's -f CSV (latencies in microseconds) -> rows in ms."""
    rows = []
    with open(path, newline="") as f:
        for r in csv.DictReader(f):
            us = lambda k: float(r[k]) / 1e3 if r.get(k) not in (None, "") else None  # noqa: E731
            rows.append({
                "concurrency": int(r["Concurrency"]),
                "throughput_per_s": float(r["Inferences/Second"]),
                "p50_ms": us("p50 latency"), "p90_ms": us("p90 latency"), "p95_ms": us("p95 latency"), "p99_ms": us("p99 latency"),
                "server_queue_ms": us("Server Queue"), "server_compute_ms": us("Server Compute Infer"),
                "client_send_ms": us("Client Send"), "network_server_ms": us("Network+Server Send/Recv"),
                "client_recv_ms": us("Client Recv"),
            })
    return rows


# --------------------------------------------------------------------------------------------
# User histories
# --------------------------------------------------------------------------------------------
def raw_events(data, u: int, last: int | None = None) -> tuple:
    it, ac, ts = data.user_events(u)
    if last:
        it, ac, ts = it[-last:], ac[-last:], ts[-last:]
    return [str(x) for x in data.item_ids[it]], ac.tolist(), ts.tolist()


def session_streams(data, num: int, history: int, appends: int, seed: int = 0) -> list:
    """Up to `num` real users with at least appends + 2 events: (open events, [append events])
    where the open carries up to `history` events and each append one event."""
    rows = np.flatnonzero(data.lengths >= appends + 2)
    rows = np.random.default_rng(seed).permutation(rows)[:num]
    streams = []
    for u in rows.tolist():
        items, actions, ts = raw_events(data, u, last=history + appends)
        k = len(items) - appends
        steps = [(items[:k], actions[:k], ts[:k])] + [([items[i]], [actions[i]], [ts[i]]) for i in range(k, len(items))]
        streams.append(steps)
    return streams


def long_history(data, n: int, seed: int = 0) -> tuple:
    """A history of exactly n events: the longest user's most recent n events, preceded by
    random catalog items (earlier timestamps) if that user has fewer."""
    u = int(np.argmax(data.lengths))
    items, actions, ts = raw_events(data, u, last=n)
    missing = n - len(items)
    if missing > 0:
        rng = np.random.default_rng(seed)
        extra = data.item_ids[rng.integers(1, data.num_items + 1, missing)]
        first = ts[0] if ts else 0
        items = [str(x) for x in extra] + items
        actions = [0] * missing + actions
        ts = [first - 60 * (missing - i) for i in range(missing)] + ts
    return items, actions, ts


# --------------------------------------------------------------------------------------------
# (b) latency per request kind: in-process, served and Triton's floor, side by side
# --------------------------------------------------------------------------------------------
KINDS = ("open", "append", "recommend")
STAGE_STATS = ("queue", "compute_input", "compute_infer", "compute_output")
IN_PROCESS_PART = {P.ENSEMBLE: "total", P.ENCODER: "encoder", P.DECODER: "decoder", P.RANKER: "ranker"}


def server_statistics(client, model: str = "") -> dict:
    """model -> {"success": count, "success_ns", "requests" (inferences), "executions" (calls of the model,
    each a batch), and per STAGE_STATS: total ns} (Triton's own counters); every model, or only `model`."""
    out = {}
    for m in client.get_inference_statistics(model_name=model, as_json=True).get("model_stats", []):
        st = m.get("inference_stats", {})
        row = {"success": int(st.get("success", {}).get("count", 0)), "success_ns": int(st.get("success", {}).get("ns", 0)),
               "requests": int(m.get("inference_count", 0)), "executions": int(m.get("execution_count", 0))}
        row |= {k: int(st.get(k, {}).get("ns", 0)) for k in STAGE_STATS}
        out[m["name"]] = row
    return out


def compute_infer_ns(client, model: str) -> int:
    """Triton's cumulative compute_infer of one model (ns)."""
    return server_statistics(client, model)[model]["compute_infer"]


def _add_delta(acc: dict, before: dict, after: dict) -> None:
    for model, b in after.items():
        a = before.get(model, {})
        d = acc.setdefault(model, {})
        for k, v in b.items():
            d[k] = d.get(k, 0) + v - a.get(k, 0)


def _per_request_ms(acc: dict) -> dict:
    """model -> {"requests", "total_ms" (server side, per request), STAGE_STATS in ms per request}."""
    out = {}
    for model, d in acc.items():
        n = d.get("success", 0)
        if n > 0:
            out[model] = {"requests": n, "total_ms": d["success_ns"] / n / 1e6} | {k: d[k] / n / 1e6 for k in STAGE_STATS}
    return out


class InProcess:
    """The work of one served request, done in this process with the same torch threads: open =
    map the raw item ids, write the events to a durable event log and encode the history, then
    recommend; append = map the new event's id, append it to the cached history, write it to the log,
    then recommend; recommend = recommend on the cached history. The log is the server's kind
    (SQLite, the same durability, a new session per open or append) and is written the way the
    encoder stage writes it: beside the encode when the write is long, after the model work when short.
    Each call returns the whole request's milliseconds and its parts: the model's share alone
    ("model": encode or append, and recommend), and with `parts` the stages' shares, the decoder's
    being the retrieval alone run once more after the request."""

    def __init__(self, model, events: tuple, options, top_k: int, threads: int, log_path: Path, durability: str,
                 exclude_seen: bool = False):
        from concurrent.futures import ThreadPoolExecutor

        import torch

        from backend_src.serving.event_log import WRITE_ASIDE_EVENTS, open_event_log

        torch.set_num_threads(threads)
        self.torch, self.model, self.options, self.top_k, self.exclude_seen = torch, model, options, top_k, exclude_seen
        self.raw, actions, ts = events
        self.actions, self.timestamps = np.asarray(actions, dtype=np.int64), np.asarray(ts, dtype=np.int64)
        self.act, self.tim = torch.from_numpy(self.actions)[None], torch.from_numpy(self.timestamps)[None]
        self.n = len(self.raw)
        self.log = open_event_log(str(log_path), retain_events=max(4096, model.cfg.max_seq_len), durability=durability)
        self.aside = self.n >= WRITE_ASIDE_EVENTS  # the open's write; an append's one event is written after
        self.writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="in-process-log")
        self.sessions = 0
        with torch.inference_mode():
            self.history = self._indices(self.raw)  # the ranker stage gets it from the encoder's answer
            self.cache = self._encode(self.history)
            self.base = self._encode(self._indices(self.raw[:-1]))

    def _indices(self, raw):
        return self.torch.from_numpy(self.model.item_indices(raw))[None]

    def _encode(self, idx):
        n = idx.shape[1]
        return self.model.encode(idx, self.act[:, :n], self.tim[:, :n], self.torch.tensor([n]))

    def _session(self, kind: str) -> str:
        self.sessions += 1
        key = f"s:in-process-{kind}-{self.sessions}"
        if kind == "append":  # the session the append goes to, as the served append's (not timed)
            self.log.replace(key, self.raw[:-1], self.actions[:-1], self.timestamps[:-1])
        return key

    def __call__(self, kind: str, parts: bool = True) -> dict:
        """Milliseconds of the whole request (and of its parts)."""
        m, torch, log = self.model, self.torch, self.log
        key = self._session(kind) if kind != "recommend" else None
        with torch.inference_mode():
            t0 = time.perf_counter()
            if kind == "open":
                written = self.writer.submit(log.replace, key, self.raw, self.actions, self.timestamps) if self.aside else None
                idx = self._indices(self.raw)
                tm = time.perf_counter()
                cache = self._encode(idx)
                model_ms = time.perf_counter() - tm
                if written is None:
                    log.replace(key, self.raw, self.actions, self.timestamps)
                else:
                    written.result()
            elif kind == "append":
                idx = self._indices(self.raw[-1:])
                tm = time.perf_counter()
                cache = m.append(self.base, idx, self.act[:, -1:], self.tim[:, -1:], torch.tensor([1]))
                model_ms = time.perf_counter() - tm
                log.append_many([(key, self.n - 1, self.raw[-1:], self.actions[-1:], self.timestamps[-1:])])
            else:
                cache, model_ms = self.cache, 0.0
            t1 = time.perf_counter()
            m.recommend(cache, self.options, top_k=self.top_k, history_items=self.history,
                        exclude_seen=self.exclude_seen)  # as the stages call it
            t2 = time.perf_counter()
            if parts:
                m.retrieve(cache, self.options)
            t3 = time.perf_counter()
        took = {"total": (t2 - t0) * 1e3, "model": (model_ms + t2 - t1) * 1e3}
        if not parts:
            return took
        return took | {"encoder": (t1 - t0) * 1e3, "decoder": (t3 - t2) * 1e3, "ranker": max(0.0, (t2 - t1) - (t3 - t2)) * 1e3}

    def close(self) -> None:
        self.writer.shutdown(wait=True)
        self.log.close()


class ServedKinds:
    """The same three request kinds through a server, one at a time, with Triton's statistics read
    around each timed request (so setup requests are not counted)."""

    def __init__(self, url: str, events: tuple, options: dict, tag: str, model: str = P.ENSEMBLE):
        import tritonclient.grpc as grpcclient

        from clients.client import RecommenderClient

        self.client = RecommenderClient(url, model=model)
        self.stats_client = grpcclient.InferenceServerClient(url)
        self.events, self.options, self.tag, self.i = events, options, tag, 0
        items, actions, ts = events
        self.cached = f"{tag}-cached"
        self.client.open_session(self.cached, items, actions, ts, **options)
        self.stats: dict = {}

    def __call__(self, kind: str) -> float:
        items, actions, ts = self.events
        c, o = self.client, self.options
        self.i += 1
        sid = f"{self.tag}-{kind}-{self.i}"
        if kind == "append":
            c.open_session(sid, items[:-1], actions[:-1], ts[:-1], **o)
        before = server_statistics(self.stats_client)
        if kind == "open":
            rec = c.open_session(sid, items, actions, ts, **o)
        elif kind == "append":
            rec = c.append(sid, items[-1:], actions[-1:], ts[-1:], **o)
        else:
            rec = c.recommend(self.cached, **o)
        _add_delta(self.stats.setdefault(kind, {}), before, server_statistics(self.stats_client))
        if kind != "recommend":
            c.close_session(sid)
        return rec.latency_ms

    def close(self) -> None:
        self.client.close_session(self.cached)
        self.client.close()
        self.stats_client.close()


# The three measurements of a round, in every order in turn: each follows each of the others
# equally often. What ran just before (the in-process work, or a request through the server's
# processes) sets how cold a measurement's caches are; one fixed order would always give one of
# them the heaviest predecessor.
def latency_rows(model, data, url: str, floor_url: str, histories, options: dict, decode_options, top_k: int,
                 requests: int, threads: int, log_dir: Path, durability: str, baseline_url: str | None = None) -> tuple:
    """One row per (kind, history): served, in-process and floor p50/p99 (and with `baseline_url`
    the same requests served by an earlier commit's code), measured in turn request by request
    (each sees the same noise, and follows each of the others equally often), the in-process work
    once more back to back (warm: the best it does alone), and a breakdown per stage from Triton's
    statistics. The in-process request writes its events to a durable log in `log_dir` as the
    server does; its model's share alone is kept beside it."""
    rows, breakdown = [], []
    tag = uuid.uuid4().hex[:8]
    for n in histories:
        events = long_history(data, n)
        local = InProcess(model, events, decode_options, top_k, threads, log_dir / f"in-process-{n}.sqlite3", durability,
                          exclude_seen=bool(options.get("exclude_seen")))
        served = ServedKinds(url, events, options, f"perf-{tag}-{n}")
        floor = ServedKinds(floor_url, events, options, f"floor-{tag}-{n}")
        measure = {"served": served, "floor": floor, "in_process": local}
        if baseline_url:
            measure["baseline"] = ServedKinds(baseline_url, events, options, f"base-{tag}-{n}")
        orders = tuple(itertools.permutations(measure))
        try:
            for kind in KINDS:
                samples = {"served": [], "floor": [], "in_process": [], "in_process_model": [], "baseline": []}
                parts = []
                for r in range(requests + 3):  # three warm-up rounds
                    took = {name: measure[name](kind) for name in orders[r % len(orders)]}
                    if r >= 3:
                        samples["served"].append(took["served"])
                        samples["floor"].append(took["floor"])
                        if baseline_url:
                            samples["baseline"].append(took["baseline"])
                        samples["in_process"].append(took["in_process"]["total"])
                        samples["in_process_model"].append(took["in_process"]["model"])
                        parts.append(took["in_process"])
                # the same work again back to back in this process: warm caches, no other process between
                samples["in_process_warm"] = [local(kind, parts=False)["total"] for _ in range(requests)]
                st = {k: pct(v) for k, v in samples.items() if v}
                row = {"kind": kind, "history": n, "requests": requests,
                       "served_p50_ms": st["served"]["p50_ms"], "served_p99_ms": st["served"]["p99_ms"],
                       "in_process_p50_ms": st["in_process"]["p50_ms"], "in_process_p99_ms": st["in_process"]["p99_ms"],
                       "floor_p50_ms": st["floor"]["p50_ms"], "floor_p99_ms": st["floor"]["p99_ms"]}
                row["in_process_warm_p50_ms"] = st["in_process_warm"]["p50_ms"]
                row["in_process_model_p50_ms"] = st["in_process_model"]["p50_ms"]
                row["overhead_p50_ms"] = row["served_p50_ms"] - row["in_process_p50_ms"] - row["floor_p50_ms"]
                row["overhead_vs_model_p50_ms"] = row["served_p50_ms"] - row["in_process_model_p50_ms"] - row["floor_p50_ms"]
                row["overhead_p50_ci95_ms"] = overhead_ci95(samples["served"], samples["in_process"], samples["floor"])
                row["overhead_vs_warm_p50_ms"] = row["served_p50_ms"] - row["in_process_warm_p50_ms"] - row["floor_p50_ms"]
                if baseline_url:
                    row["baseline_served_p50_ms"] = st["baseline"]["p50_ms"]
                    row["baseline_served_p99_ms"] = st["baseline"]["p99_ms"]
                    row["served_p50_vs_baseline"] = row["served_p50_ms"] / row["baseline_served_p50_ms"]
                rows.append(row)
                served_stats, floor_stats = _per_request_ms(served.stats[kind]), _per_request_ms(floor.stats[kind])
                for stage in (P.ENSEMBLE,) + P.PYTHON_MODELS:
                    sv, fl = served_stats.get(stage), floor_stats.get(stage)
                    if sv is None:
                        continue
                    b = {"kind": kind, "history": n, "stage": stage,
                         "in_process_ms": float(np.median([p[IN_PROCESS_PART[stage]] for p in parts]))}
                    for k in ("total_ms",) + STAGE_STATS:
                        b[f"served_{k}"] = sv[k]
                        b[f"floor_{k}"] = fl[k] if fl else None
                    breakdown.append(b)
                lo, hi = row["overhead_p50_ci95_ms"]
                base = f", baseline {row['baseline_served_p50_ms']:.2f}" if baseline_url else ""
                log(f"  {kind:9s} history {n:4d}: served {row['served_p50_ms']:.2f} ms p50 / {row['served_p99_ms']:.2f} p99{base}, "
                    f"in-process {row['in_process_p50_ms']:.2f}, floor {row['floor_p50_ms']:.2f}: "
                    f"overhead {row['overhead_p50_ms']:+.2f} ms (95% CI {lo:+.2f} to {hi:+.2f})")
        finally:
            for m in measure.values():
                m.close()
    return rows, breakdown


# --------------------------------------------------------------------------------------------
# (d) locust
# --------------------------------------------------------------------------------------------
def locust_binary(explicit: str | None = None) -> Path | None:
    for cand in (explicit, os.environ.get("GENREC_LOCUST"), LOCUST_VENV / "bin" / "locust"):
        if cand and Path(cand).exists():
            return Path(cand)
    return None


def write_locust_sessions(path: Path, streams: list) -> None:
    """Sessions for the locustfile (its environment has no torch: plain JSON)."""
    sessions = []
    for steps in streams:
        items = [x for s in steps for x in s[0]]
        actions = [a for s in steps for a in s[1]]
        ts = [t for s in steps for t in s[2]]
        sessions.append({"items": items, "actions": actions, "timestamps": ts, "open": len(steps[0][0])})
    path.write_text(json.dumps({"sessions": sessions}))


def run_locust(binary: Path, url: str, sessions_json: Path, options: dict, users: int, run_time_s: int, workdir: Path) -> dict:
    prefix = workdir / "locust"
    env = dict(os.environ)
    env["GENREC_LOCUST_SESSIONS"] = str(sessions_json)
    env["GENREC_LOCUST_OPTIONS"] = json.dumps(options)
    env.pop("PYTHONPATH", None)
    cmd = [str(binary), "-f", str(REPO_ROOT / "perf" / "locustfile.py"), "--headless", "-u", str(users), "-r", str(users),
           "--run-time", f"{run_time_s}s", "--stop-timeout", "10", "--host", url, "--csv", str(prefix), "--only-summary",
           "--loglevel", "WARNING"]
    proc = subprocess.Popen(cmd, env=env, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=run_time_s + 90)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        raise RuntimeError("locust did not stop in time; killed. Output tail:\n" + "\n".join(output.splitlines()[-15:]))
    stats = prefix.with_name("locust_stats.csv")
    if not stats.exists():
        raise RuntimeError(f"locust wrote no statistics (exit {proc.returncode}):\n" + "\n".join(output.splitlines()[-15:]))
    return {"exit_code": proc.returncode, "rows": parse_locust_csv(stats), "command": " ".join(cmd[1:])}


def parse_locust_csv(path: Path) -> list:
    rows = []
    with open(path, newline="") as f:
        for r in csv.DictReader(f):
            num = lambda k: float(r[k]) if r.get(k) not in (None, "", "N/A") else None  # noqa: E731
            rows.append({
                "name": r["Name"], "requests": int(r["Request Count"]), "failures": int(r["Failure Count"]),
                "requests_per_s": num("Requests/s"), "p50_ms": num("50%"), "p95_ms": num("95%"), "p99_ms": num("99%"),
                "avg_ms": num("Average Response Time"),
            })
    return rows


# --------------------------------------------------------------------------------------------
# main
# --------------------------------------------------------------------------------------------
# --------------------------------------------------------------------------------------------
# (c) throughput against an earlier commit of this project, in the same run
# --------------------------------------------------------------------------------------------
def checkpoint_for_earlier_code(checkpoint, tree: Path, env: dict, out: Path) -> Path:
    """`checkpoint` as the code in `tree` can load it. Model settings that code does not have are
    left out when they change nothing it would serve (features it lacks, switched off: at their
    defaults, or fusion weights equal to the defaults' in effect); any other is an error naming it."""
    import dataclasses

    import torch

    from backend_src.config import ModelConfig

    known = json.loads(subprocess.run(
        [sys.executable, "-c", "import dataclasses, json; from backend_src.config import ModelConfig; "
                               "print(json.dumps([f.name for f in dataclasses.fields(ModelConfig)]))"],
        cwd=tree, env=env, capture_output=True, text=True, check=True).stdout)
    ckpt = torch.load(checkpoint, map_location="cpu", weights_only=False)
    config = ckpt["config"]
    unknown = [k for k in config if k not in known]
    if not unknown:
        return Path(checkpoint)
    defaults = {f.name: f.default for f in dataclasses.fields(ModelConfig)}
    now, earlier = (ModelConfig.from_dict(c) for c in (config, {**config, **{k: defaults[k] for k in unknown}}))
    changed = [k for k in unknown if getattr(now, k) != defaults[k]]  # as loaded: a saved [] is the default ()
    same_order = all(now.fusion_weights(x) == earlier.fusion_weights(x) for x in (False, True))
    if not same_order or any("fusion_weight" not in k for k in changed):
        raise RuntimeError(f"the checkpoint sets {changed}, which the earlier code does not have")
    ckpt["config"] = {k: v for k, v in config.items() if k in known}
    torch.save(ckpt, out)
    return out


@contextlib.contextmanager
def baseline_server(ref: str, checkpoint, workdir: Path, visit_idle_s: float):
    """A tritonserver serving `checkpoint` published by the code of commit `ref` (its own
    publish command and defaults, its own model code). Yields the server."""
    from perf.served_eval import serve_repository

    tree = workdir / "baseline"
    tree.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(REPO_ROOT), "archive", ref], capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
    repo = tree / "model_repository_served"
    env = dict(os.environ, PYTHONPATH=str(tree))
    checkpoint = checkpoint_for_earlier_code(checkpoint, tree, env, workdir / "baseline_checkpoint.pt")
    done = subprocess.run([sys.executable, "-m", "export.publish", "publish", "--checkpoint", str(Path(checkpoint).resolve()),
                           "--repository", str(repo), "--visit-idle-s", str(visit_idle_s)], cwd=tree, env=env,
                          capture_output=True, text=True)
    if done.returncode:  # e.g. a checkpoint with parts the earlier code does not know
        raise RuntimeError(f"{ref}'s code could not publish the checkpoint: {done.stderr.strip().splitlines()[-1:]}")
    with serve_repository(repo) as server:
        yield server


def throughput_at_p99(rows: list, limit_ms: float = 50.0) -> float | None:
    """The highest perf_analyzer throughput whose p99 stays under `limit_ms`."""
    ok = [r["throughput_per_s"] for r in rows if r.get("p99_ms") is not None and r["p99_ms"] <= limit_ms]
    return max(ok) if ok else None


def bisect_p99_limit(measure, rows: list, limit_ms: float = 50.0) -> list:
    """Concurrencies between the highest measured one whose p99 stayed under `limit_ms` and the lowest
    above it whose p99 did not, measured by halving that gap (`measure(c)` -> a perf_analyzer row, or
    None when the run failed) until they are neighbours; p99 is taken to grow with concurrency.
    Returns the new rows."""
    new: list = []
    while True:
        done = [r for r in rows + new if r.get("p99_ms") is not None]
        under = max((r["concurrency"] for r in done if r["p99_ms"] <= limit_ms), default=0)
        over = min((r["concurrency"] for r in done if r["concurrency"] > under and r["p99_ms"] > limit_ms), default=None)
        if over is None or over - under < 2:
            return new
        row = measure((under + over) // 2)
        if row is None:
            return new
        new.append(row)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="python -m perf.served", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", default=str(DEFAULT_CHECKPOINT), help="model checkpoint (default: the demo's)")
    ap.add_argument("--data", default="synthetic", help="data set the checkpoint was trained on (real user histories)")
    ap.add_argument("--max-users", type=int, default=None, help="load only the first N users (as the checkpoint was trained)")
    ap.add_argument("--histories", type=int, nargs="+", default=[50, 512], help="history lengths of (b), capped at the model's max")
    ap.add_argument("--open-history", type=int, default=50, help="events in the first request of a perf_analyzer sequence")
    ap.add_argument("--steps", type=int, default=10, help="requests per perf_analyzer sequence (1 open + appends)")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8, 12, 16])
    ap.add_argument("--beam-width", type=int, default=100, help="beams = candidates ranked")
    ap.add_argument("--mode", default="pfa")
    ap.add_argument("--pfa-k", type=int, default=256)
    ap.add_argument("--top-k", type=int, default=10)
    ap.add_argument("--exclude-seen", action="store_true",
                    help="lists without the history's items (the fused order's weights for that policy: every expert on)")
    ap.add_argument("--profile-requests", type=int, default=100,
                    help="requests of each kind in the per-phase profile of the stages (perf.request_profile; 0: none)")
    ap.add_argument("--check-users", type=int, default=None,
                    help="also serve the test split's first N users (0: all) and count the lists equal to the offline model's")
    ap.add_argument("--requests", type=int, default=200, help="requests per kind and history in (b)")
    ap.add_argument("--ranker-backend", default="auto", choices=["auto", "torch", "onnx"],
                    help="served ranker runtime (torch = the same computation as in-process)")
    ap.add_argument("--torch-threads", type=int, default=1, help="per served instance, and in-process")
    ap.add_argument("--max-queue-delay-us", type=int, default=None, help="every stage's batching delay (default: the serving default)")
    ap.add_argument("--instances", type=int, nargs=3, default=None, metavar=("ENCODER", "DECODER", "RANKER"),
                    help="instances of each stage (default: the serving default, one each)")
    ap.add_argument("--event-log", default=None, help="the encoder's event log (default: SQLite beside the repository; memory: to measure it)")
    ap.add_argument("--locust", action="store_true", help="also run locust headless (needs .venv-locust)")
    ap.add_argument("--locust-bin", default=None)
    ap.add_argument("--locust-users", type=int, default=4)
    ap.add_argument("--locust-seconds", type=int, default=30)
    ap.add_argument("--baseline-ref", default=None,
                    help="also serve the checkpoint with the code of this git commit and compare throughput at "
                         "--baseline-concurrency, the two servers measured in turn")
    ap.add_argument("--quick", action="store_true", help="short runs (concurrency 1,2,4; few requests)")
    ap.add_argument("--out", default=None)
    return ap.parse_args(argv)


def same_runtime_as_the_server(argv, module: str = "perf.served") -> None:
    """Run this process under the allocator and OpenMP settings the server gives its stages (the
    in-process rows must do the same work the same way): re-exec with them when any is missing."""
    from backend_src.serving.server import CPU_RUNTIME_ENV

    if all(os.environ.get(k) == v for k, v in CPU_RUNTIME_ENV.items()):
        return
    env = dict(os.environ, **CPU_RUNTIME_ENV)
    args = sys.argv[1:] if argv is None else list(argv)
    os.execve(sys.executable, [sys.executable, "-m", module, *args], env)


def main(argv=None) -> int:
    same_runtime_as_the_server(argv)
    a = parse_args(argv)
    from backend_src.config import DecodeOptions
    from backend_src.data import load_dataset
    from backend_src.model.recommender import GenerativeRecommender
    from export.triton_configs import ServingOptions
    from perf.floor import floor_server
    from perf.served_eval import local_server, served_eval

    if not Path(a.checkpoint).exists():
        log(f"no checkpoint at {a.checkpoint}: run `make demo` (or export.train) first, or pass --checkpoint")
        return 2
    if a.quick:
        a.concurrency = [c for c in a.concurrency if c <= 4]
        a.requests = min(a.requests, 20)
        a.locust_seconds = min(a.locust_seconds, 15)
    interval_ms = 2000 if a.quick else 5000
    model = GenerativeRecommender.load(a.checkpoint)
    data = load_dataset(a.data, max_users=a.max_users)
    max_len = model.cfg.max_seq_len
    open_hist = min(a.open_history, max_len - 1)
    histories = sorted({min(max(2, h), max_len) for h in a.histories})
    options = dict(top_k=a.top_k, exclude_seen=False, beam_width=a.beam_width, mode=a.mode, pfa_k=a.pfa_k, pfa_r=0.5,
                   selection_step=1)
    decode = DecodeOptions(mode=a.mode, beam_width=a.beam_width, k=a.pfa_k, r=0.5, selection_step=1)
    serving = ServingOptions(decode=decode, top_k=a.top_k, ranker_backend=a.ranker_backend, torch_threads=a.torch_threads,
                             visit_idle_s=120)
    if a.max_queue_delay_us is not None:
        serving.max_queue_delay_us = a.max_queue_delay_us
    if a.event_log is not None:
        serving.event_log = a.event_log
    if a.instances:
        serving.encoder_instances, serving.decoder_instances, serving.ranker_instances = a.instances
    result: dict = {"checkpoint": str(a.checkpoint), "data": data.name, "model": {"max_seq_len": max_len, "d_model": model.cfg.d_model,
                    "layers": model.cfg.num_layers, "items": model.cfg.num_items}, "options": options,
                    "serving": {"ranker_backend": a.ranker_backend, "torch_threads": a.torch_threads,
                                "instances": [serving.encoder_instances, serving.decoder_instances, serving.ranker_instances],
                                "max_queue_delay_us": serving.max_queue_delay_us}}
    if a.exclude_seen:
        options["exclude_seen"] = True
    rows = []
    work = Path(tempfile.mkdtemp(prefix="genrec-perf-", dir=scratch_parent()))
    try:
        streams = session_streams(data, 64, open_hist, a.steps - 1)
        if not streams:
            raise SystemExit(f"no user of {data.name} has {a.steps + 1} events: lower --steps")
        log(f"starting tritonserver ({a.checkpoint}) and the floor (no-op stages) ...")
        t0 = time.monotonic()
        with contextlib.ExitStack() as stack:
            server = stack.enter_context(local_server(a.checkpoint, serving, export_ranker=a.ranker_backend != "torch"))
            floor = stack.enter_context(floor_server(model.cfg, serving))
            servers = {"this": server.grpc_url}
            if a.baseline_ref:  # (c) the same checkpoint served by the code of an earlier commit, side by side
                log(f"publishing with the code of {a.baseline_ref} ...")
                base = stack.enter_context(baseline_server(a.baseline_ref, a.checkpoint, work, serving.visit_idle_s))
                servers[a.baseline_ref] = base.grpc_url
            log(f"servers ready in {time.monotonic() - t0:.1f} s: {servers}, floor {floor.grpc_url}")
            url = server.grpc_url

            # (a) perf_analyzer over sequences of real sessions, each concurrency on every server in turn
            input_json = work / "perf_input.json"
            input_json.write_text(json.dumps(sequence_input_data(streams, options)))
            env = perf_analyzer_env(work / "lib")
            ok, why = perf_analyzer_usable(env)
            pa_rows = {name: [] for name in servers}
            if not ok:
                log(f"perf_analyzer skipped: {why}")
                result["perf_analyzer"] = {"skipped": why}
            else:
                def at(name: str, c: int) -> dict | None:
                    log(f"perf_analyzer concurrency {c} ({name}) ...")
                    done = pa_rows[name]
                    try:
                        row = run_perf_analyzer(servers[name], input_json, c, a.steps, env, work / f"pa_{len(done)}_{c}.csv",
                                                interval_ms, id_start=1_000_000 * (sum(map(len, pa_rows.values())) + 1))
                    except (RuntimeError, subprocess.TimeoutExpired) as e:
                        log(str(e))
                        done.append({"concurrency": c, "error": str(e)[-500:]})
                        return None
                    done.append(row)
                    rows.append({"part": "a" if name == "this" else "c", "what": f"perf_analyzer sequences, {name}, concurrency {c}",
                                 **{k: row[k] for k in ("concurrency", "throughput_per_s", "p50_ms", "p95_ms", "p99_ms")}})
                    return row

                for i, c in enumerate(a.concurrency):
                    for name in (list(servers) if i % 2 == 0 else list(servers)[::-1]):
                        at(name, c)
                for name in servers:  # the concurrency at the 50 ms p99 limit, on each server
                    bisect_p99_limit(lambda c, name=name: at(name, c), [r for r in pa_rows[name] if "error" not in r])
                    pa_rows[name].sort(key=lambda r: r["concurrency"])
                rows.sort(key=lambda r: (r["part"], r["what"].split(",")[1], r.get("concurrency", 0)))
                result["perf_analyzer"] = {"rows": pa_rows["this"], "sequence": {"steps": a.steps, "open_events": f"<= {open_hist}",
                                           "append_events": 1, "sessions": len(streams)}, "interval_ms": interval_ms}
                result["throughput_at_p99_50ms"] = throughput_at_p99([r for r in pa_rows["this"] if "error" not in r])
                if a.baseline_ref:
                    done = [r for r in pa_rows[a.baseline_ref] if "error" not in r]
                    result["baseline"] = {"ref": a.baseline_ref, "perf_analyzer": pa_rows[a.baseline_ref]}
                    result["baseline_throughput_at_p99_50ms"] = throughput_at_p99(done)

            # (b) every request kind in-process, served (and by the baseline) and on the floor, one request of each in turn
            log(f"latency per request kind, histories {histories}, {a.requests} requests each ...")
            latency, breakdown = latency_rows(model, data, url, floor.grpc_url, histories, options, decode, a.top_k,
                                              a.requests, a.torch_threads, work, serving.log_durability,
                                              baseline_url=servers.get(a.baseline_ref))
            result["latency_rows"] = latency
            result["breakdown"] = breakdown
            for r in latency:
                rows.append({"part": "b", "what": f"{r['kind']}, history {r['history']}", "concurrency": 1,
                             "p50_ms": r["served_p50_ms"], "p99_ms": r["served_p99_ms"], "in_process_p50_ms": r["in_process_p50_ms"],
                             "floor_p50_ms": r["floor_p50_ms"], "overhead_p50_ms": r["overhead_p50_ms"],
                             "baseline_p50_ms": r.get("baseline_served_p50_ms")})

            # the served lists against the offline model's
            if a.check_users is not None:
                log(f"served against offline lists, {a.check_users or 'all'} test users ...")
                check = served_eval(model, data, url, a.check_users or None, decode, a.top_k, exclude_seen=a.exclude_seen)
                result["served_equals_offline"] = check
                result["served_equals_offline_users"] = round(check["same_list_fraction"] * check["users"])
                result["checked_users"] = check["users"]

            # (d) locust
            if a.locust:
                binary = locust_binary(a.locust_bin)
                if binary is None:
                    why = f"no locust: create {LOCUST_VENV.name} (python3 -m venv {LOCUST_VENV.name} && {LOCUST_VENV.name}/bin/pip install -r perf/locust_requirements.txt)"
                    log(why)
                    result["locust"] = {"skipped": why}
                else:
                    sessions_json = work / "locust_sessions.json"
                    write_locust_sessions(sessions_json, streams)
                    log(f"locust: {a.locust_users} users for {a.locust_seconds} s ...")
                    try:
                        loc = run_locust(binary, url, sessions_json, options, a.locust_users, a.locust_seconds, work)
                        result["locust"] = {"users": a.locust_users, "seconds": a.locust_seconds, **loc}
                        for r in loc["rows"]:
                            rows.append({"part": "d", "what": f"locust {r['name']} ({a.locust_users} users)", "concurrency": a.locust_users,
                                         "throughput_per_s": r["requests_per_s"], "p50_ms": r["p50_ms"], "p95_ms": r["p95_ms"],
                                         "p99_ms": r["p99_ms"], "failures": r["failures"]})
                    except RuntimeError as e:
                        log(str(e))
                        result["locust"] = {"error": str(e)[-800:]}
            result["host_load"] = list(os.getloadavg())
        if a.profile_requests:  # (e) the stages in this process, phase by phase (no server running)
            from perf.request_profile import profile, table
            log(f"per-phase profile of the stages, {a.profile_requests} requests of each kind ...")
            result["profile"] = []
            for n in histories:
                result["profile"] += profile(a.checkpoint, serving, long_history(data, n), options, a.profile_requests,
                                             a.torch_threads)
            print(table(result["profile"]))
    finally:
        shutil.rmtree(work, ignore_errors=True)

    out = Path(a.out or RESULTS_DIR / f"served_{Path(a.data.split(':')[0]).name}{'_quick' if a.quick else ''}.json")
    write_result(out, rows, quick=a.quick, **result)
    cols = ["part", "what", "concurrency", "throughput_per_s", "p50_ms", "p99_ms", "baseline_p50_ms", "in_process_p50_ms",
            "floor_p50_ms", "overhead_p50_ms"]
    print(markdown_table(rows, cols, floatfmt=".2f"))
    print(f"\nthroughput at p99 <= 50 ms: {result.get('throughput_at_p99_50ms')} requests/s"
          + (f" (baseline {result.get('baseline_throughput_at_p99_50ms')})" if a.baseline_ref else ""))
    print(f"result: {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
