"""An example client service: replay real users of a data set as live sessions.

For each user, a session opens with the first part of the user's history, then the remaining
events arrive a few at a time (``--step``), each append asking for fresh recommendations, as a
site would send them while the user browses. Several sessions run at once (threads). At the end
it prints per-request latency percentiles (open / append / all) and the hit rate: how often the
user's next event was in the top-K recommended just before it.

    python -m examples.replay_service --url localhost:8001 --data synthetic --users 50 --concurrency 4 --seconds 30
"""
from __future__ import annotations

import argparse
import json
import queue
import threading
import time
import uuid
from dataclasses import dataclass, field

import numpy as np

from clients.client import RecommenderClient, RecommenderError


@dataclass
class UserSession:
    user_id: str
    items: list  # raw item ids, oldest first
    actions: list
    timestamps: list


def sessions_from_data(data, users: int, max_events: int | None = None, min_events: int = 3, seed: int = 0) -> list:
    """Up to `users` users with at least `min_events` events (their most recent `max_events`),
    drawn at random (seeded) from the data set."""
    lengths = data.lengths
    rows = np.flatnonzero(lengths >= min_events)
    rows = np.random.default_rng(seed).permutation(rows)[:users]
    out = []
    for u in rows.tolist():
        it, ac, ts = data.user_events(u)
        if max_events:
            it, ac, ts = it[-max_events:], ac[-max_events:], ts[-max_events:]
        out.append(UserSession(str(data.user_ids[u]), [str(x) for x in data.item_ids[it]], ac.tolist(), ts.tolist()))
    return out


@dataclass
class ReplayStats:
    open_ms: list = field(default_factory=list)
    append_ms: list = field(default_factory=list)
    hits: int = 0
    asked: int = 0  # appends whose next event could be checked
    errors: list = field(default_factory=list)
    sessions: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def summary(self, top_k: int, seconds: float) -> dict:
        def pct(xs):
            if not xs:
                return {"n": 0}
            a = np.asarray(xs)
            return {"n": len(xs), "p50_ms": float(np.percentile(a, 50)), "p95_ms": float(np.percentile(a, 95)),
                    "p99_ms": float(np.percentile(a, 99)), "mean_ms": float(a.mean())}

        n = len(self.open_ms) + len(self.append_ms)
        return {
            "sessions": self.sessions,
            "requests": n,
            "seconds": seconds,
            "requests_per_s": n / seconds if seconds > 0 else 0.0,
            "latency": {"open": pct(self.open_ms), "append": pct(self.append_ms), "all": pct(self.open_ms + self.append_ms)},
            f"hit@{top_k}": self.hits / self.asked if self.asked else None,
            "hits_checked": self.asked,
            "errors": len(self.errors),
            "error_examples": self.errors[:3],
        }


def replay(
    url: str,
    sessions: list,
    concurrency: int = 4,
    seconds: float = 30.0,
    max_requests: int | None = None,
    open_fraction: float = 0.5,
    step: int = 1,
    max_appends: int | None = 20,
    timeout_s: float = 60.0,
    **options,
) -> dict:
    """Replay `sessions` against the server; bounded by `seconds` and `max_requests`."""
    top_k = int(options.get("top_k") or 10)
    stats = ReplayStats()
    work: queue.Queue = queue.Queue()
    for s in sessions:
        work.put(s)
    deadline = time.monotonic() + seconds
    budget = {"left": max_requests if max_requests else float("inf")}
    run_tag = uuid.uuid4().hex[:8]  # session ids unique to this run

    def take_request() -> bool:
        with stats.lock:
            if budget["left"] <= 0 or time.monotonic() >= deadline:
                return False
            budget["left"] -= 1
            return True

    def worker():
        client = RecommenderClient(url, timeout_s=timeout_s)
        try:
            while True:
                try:
                    s = work.get_nowait()
                except queue.Empty:
                    return
                if not take_request():
                    return
                _play(client, s, f"replay-{run_tag}-{s.user_id}")
        finally:
            client.close()

    def _play(client, s: UserSession, sid: str):
        n = len(s.items)
        first = min(max(1, int(n * open_fraction)), n - 1) if n > 1 else 1
        try:
            rec = client.open_session(sid, s.items[:first], s.actions[:first], s.timestamps[:first], **options)
            with stats.lock:
                stats.open_ms.append(rec.latency_ms)
                stats.sessions += 1
            pos, appends = first, 0
            while pos < n and (max_appends is None or appends < max_appends):
                nxt = s.items[pos]
                hit = nxt in rec.item_ids[:top_k]
                if not take_request():
                    break
                end = min(pos + step, n)
                rec = client.append(sid, s.items[pos:end], s.actions[pos:end], s.timestamps[pos:end], **options)
                with stats.lock:
                    stats.append_ms.append(rec.latency_ms)
                    stats.hits += int(hit)
                    stats.asked += 1
                pos, appends = end, appends + 1
            client.close_session(sid)
        except RecommenderError as e:
            with stats.lock:
                stats.errors.append(str(e))

    t0 = time.monotonic()
    threads = [threading.Thread(target=worker, daemon=True) for _ in range(max(1, concurrency))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return stats.summary(top_k, time.monotonic() - t0)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m examples.replay_service", description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default="localhost:8001")
    ap.add_argument("--data", default="synthetic", help="data set name, path, or 'synthetic'")
    ap.add_argument("--users", type=int, default=50)
    ap.add_argument("--max-events", type=int, default=100, help="replay each user's most recent N events")
    ap.add_argument("--concurrency", type=int, default=4, help="sessions at once (threads)")
    ap.add_argument("--seconds", type=float, default=30.0, help="stop after this long")
    ap.add_argument("--max-requests", type=int, default=None)
    ap.add_argument("--open-fraction", type=float, default=0.5, help="share of the history sent when the session opens")
    ap.add_argument("--step", type=int, default=1, help="events per append")
    ap.add_argument("--max-appends", type=int, default=20, help="appends per session")
    ap.add_argument("--top-k", type=int, default=10)
    ap.add_argument("--beam-width", type=int, default=None)
    ap.add_argument("--mode", default=None)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)

    from backend_src.data import load_dataset

    data = load_dataset(a.data)
    sessions = sessions_from_data(data, a.users, a.max_events, seed=a.seed)
    options = {k: v for k, v in (("top_k", a.top_k), ("beam_width", a.beam_width), ("mode", a.mode)) if v is not None}
    out = replay(a.url, sessions, a.concurrency, a.seconds, a.max_requests, a.open_fraction, a.step, a.max_appends, **options)
    out = {"data": data.name, "users": len(sessions), "concurrency": a.concurrency, **out}
    lat = out["latency"]["all"]
    if lat.get("n"):
        print(f"{out['requests']} requests in {out['seconds']:.1f} s ({out['requests_per_s']:.1f}/s), {out['sessions']} sessions: "
              f"p50 {lat['p50_ms']:.1f} ms, p95 {lat['p95_ms']:.1f} ms, p99 {lat['p99_ms']:.1f} ms; "
              f"hit@{a.top_k} of the next event {out[f'hit@{a.top_k}'] if out[f'hit@{a.top_k}'] is not None else float('nan'):.3f} "
              f"over {out['hits_checked']} appends; errors {out['errors']}")
    print(json.dumps(out, indent=2))
    return 1 if out["errors"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
