"""Sessions at real scale, against a real Triton server (an untrained model: the benchmark
measures session state, not quality).

scale: N distinct users each open a session with a short history (one request: START, the
    history, END), then M of them, drawn at random, come back with one new event (many were
    evicted from the bounded cache in between and are rebuilt from the event log); hangs
    (client deadline reached), errors, p50/p99 of each, and the session cache's peak bytes
    against its bound (from the server's own metrics). Then L users are written straight into
    the event log and a sample of them resumed twice: a rebuild from the log, then a cache hit.
    -> perf/results/sessions_scale.json
log-cost: what the event log adds to a request. Three servers run side by side, identical but
    for their log: in memory (not durable: the baseline), SQLite (the default) and Redis; one
    event is appended to a cached session on each in turn, round after round.
    -> perf/results/sessions_log_cost.json

faults: four client threads keep sessions going (open, then one event a request) while one
    fault is injected: a publish of every model, a rollback, the SIGKILL of each stage's stub,
    client timeouts followed by retries, the request whose shape overflows, a crash of
    tritonserver itself (SIGSEGV; its watchdog starts it again, as `server start` sets it up), and
    the SIGKILL of the watchdog followed by the encoder's stub (its keeper starts a new watchdog,
    which heals the stub). Each row:
    failed requests (calls that raised after the client library's retries), sessions lost,
    events lost and applied twice (each session's log against what its client sent), and the
    longest time without a successful request after the fault (recovery_s).
    -> perf/results/sessions_faults.json

    python -m perf.bench_sessions scale [--users 100000 --resumed 10000 --log-users 1000000]
    python -m perf.bench_sessions log-cost [--rounds 300]
    python -m perf.bench_sessions faults [--seconds 20]
"""
from __future__ import annotations

import argparse
import os
import re
import resource
import signal
import threading
import time
import urllib.request
import uuid
from pathlib import Path

import numpy as np

from backend_src.results import markdown_table, write_result
from perf.served import RESULTS_DIR, log, pct


# --------------------------------------------------------------------------------------------
# The served model and the server
# --------------------------------------------------------------------------------------------
def item_id(i: int) -> str:
    return f"item-{i}"


def build_checkpoint(path: Path, num_items: int, max_history: int, seed: int = 0) -> None:
    from backend_src.model.recommender import GenerativeRecommender

    item_ids = [None] + [item_id(i) for i in range(1, num_items + 1)]
    GenerativeRecommender.untrained(item_ids, max_history, seed=seed, d_model=32, levels=3, codes_per_level=16).save(path)


def user_events(u: int, n: int, num_items: int, offset: int = 0):
    """User u's first n events (deterministic): raw item ids, actions, timestamps."""
    rng = np.random.default_rng(u)
    items = rng.integers(1, num_items + 1, offset + n)[offset:]
    return [item_id(int(i)) for i in items], [1] * n, [1_600_000_000 + 60 * (offset + i) for i in range(n)]


def scrape(metrics_port: int) -> dict:
    """The server's genrec_* metrics (summed over label sets)."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
    out: dict = {}
    for line in text.splitlines():
        m = re.match(r"(genrec_\w+)(\{[^}]*\})? ([0-9.eE+-]+)$", line)
        if m:
            out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(3))
    return out


# --------------------------------------------------------------------------------------------
# Load
# --------------------------------------------------------------------------------------------
class Tally:
    def __init__(self):
        self.lock = threading.Lock()
        self.latency_ms: list = []
        self.hangs = 0
        self.errors: list = []
        self.restored = 0

    def summary(self) -> dict:
        return {**pct(self.latency_ms), "hangs": self.hangs, "errors": len(self.errors),
                "error_examples": self.errors[:5], "restored": self.restored}


def drive(url: str, users: list, request, concurrency: int, timeout_s: float) -> Tally:
    """Call request(client, u) for every user from `concurrency` threads; a request that
    reaches the client deadline counts as a hang, any other failure as an error."""
    from clients.client import RecommenderClient, RecommenderError

    tally, it, it_lock = Tally(), iter(users), threading.Lock()

    def worker():
        with RecommenderClient(url, timeout_s=timeout_s, retries=0) as c:
            while True:
                with it_lock:
                    u = next(it, None)
                if u is None:
                    return
                try:
                    rec = request(c, u)
                    with tally.lock:
                        tally.latency_ms.append(rec.latency_ms)
                        tally.restored += int(rec.restored)
                except RecommenderError as e:
                    with tally.lock:
                        if e.status == "DEADLINE_EXCEEDED":
                            tally.hangs += 1
                        else:
                            tally.errors.append(str(e)[:300])

    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return tally


def fill_log(url: str, first_user: int, users: int, events: int, num_items: int, chunk: int = 5000) -> float:
    """Write `users` users' histories straight into the event log; returns seconds taken."""
    from backend_src.serving.event_log import open_event_log

    log_ = open_event_log(url, durability="normal")  # a bulk load, not acknowledged traffic
    t0 = time.perf_counter()
    try:
        for start in range(first_user, first_user + users, chunk):
            writes = [(f"s:u{u}", 0, *user_events(u, events, num_items)) for u in range(start, min(start + chunk, first_user + users))]
            log_.append_many(writes)
    finally:
        log_.close()
    return time.perf_counter() - t0


def scale(a) -> dict:
    import tempfile

    from backend_src.config import DecodeOptions
    from backend_src.serving.processes import free_port
    from backend_src.serving.server import TritonServer
    from export.publish import publish
    from export.triton_configs import ServingOptions

    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory(prefix="genrec-sessions-") as tmp:
        tmp = Path(tmp)
        ckpt = tmp / "model.pt"
        build_checkpoint(ckpt, a.items, a.max_history)
        repo = tmp / "model_repository"
        options = ServingOptions(
            decode=DecodeOptions(mode="pfa", beam_width=a.beam_width, k=16, r=0.5, selection_step=1), top_k=10,
            session_max_bytes=a.cache_bytes, visit_idle_s=5,
        )
        publish(ckpt, repo, options)
        log_url = str(repo.parent / f"{repo.name}-events" / "events.sqlite3")
        server = TritonServer(repo, free_port(), free_port(), free_port(), log_file=tmp / "tritonserver.log", exit_timeout_s=5)
        server.start(timeout_s=180)
        try:
            url = server.grpc_url
            ev = a.history

            def open_(c, u):
                return c.open_session(f"u{u}", *user_events(u, ev, a.items), end_visit=True)

            def resume(c, u):  # the client sends the history it knows plus one event: only the new one is applied
                return c.open_session(f"u{u}", *user_events(u, ev + 1, a.items), end_visit=True)

            def reopen(c, u):  # a session this client has not seen: recommendations from what the server holds
                return c.resume(f"u{u}", end_visit=True)

            log(f"opening {a.users} sessions from {a.concurrency} threads")
            t0 = time.perf_counter()
            opened = drive(url, list(range(a.users)), open_, a.concurrency, a.timeout_s)
            open_s = time.perf_counter() - t0
            log(f"  {opened.summary()} in {open_s:.0f} s")
            back = rng.choice(a.users, size=min(a.resumed, a.users), replace=False).tolist()
            log(f"resuming {len(back)} of them with one new event")
            resumed = drive(url, back, resume, a.concurrency, a.timeout_s)
            log(f"  {resumed.summary()}")
            m = scrape(server.metrics_port)
            log_part = {}
            if a.log_users:
                log(f"writing {a.log_users} users straight into the event log")
                fill_s = fill_log(log_url, a.users, a.log_users, ev, a.items)
                sample = (a.users + rng.choice(a.log_users, size=min(a.log_sample, a.log_users), replace=False)).tolist()
                # one request at a time, each user twice in a row: a rebuild from the log, then a cache hit
                from clients.client import RecommenderClient, RecommenderError

                rebuilt, hit = Tally(), Tally()
                with RecommenderClient(url, timeout_s=a.timeout_s, retries=0) as c:
                    for u in sample:
                        for tally in (rebuilt, hit):
                            try:
                                rec = reopen(c, u)
                                tally.latency_ms.append(rec.latency_ms)
                                tally.restored += int(rec.restored)
                            except RecommenderError as e:
                                tally.errors.append(str(e)[:300])
                log(f"  rebuild {rebuilt.summary()}\n  cache hit {hit.summary()}")
                log_part = {"log_users": a.users + a.log_users, "log_fill_s": fill_s, "rebuild_from_log": rebuilt.summary(),
                            "cache_hit": hit.summary()}
                m = scrape(server.metrics_port)
        finally:
            server.stop(grace_s=15)
    rows = [
        {"phase": "open", "users": a.users, **opened.summary(), "requests_per_s": a.users / open_s},
        {"phase": "resume after the visit ended", "users": len(back), **resumed.summary()},
    ]
    if log_part:
        rows += [{"phase": f"resume from a {log_part['log_users']:,}-user log: rebuild", "users": len(sample), **log_part["rebuild_from_log"]},
                 {"phase": "the same users again: cache hit", "users": len(sample), **log_part["cache_hit"]}]
    return {
        "rows": rows,
        "users_opened": a.users,
        "users_resumed": len(back),
        "hangs": sum(r["hangs"] for r in rows),
        "errors": sum(r["errors"] for r in rows),
        "session_bytes_peak": int(m.get("genrec_session_cache_peak_bytes", 0)),
        "session_bytes_bound": int(m.get("genrec_session_cache_bound_bytes", 0)),
        "sessions_restored": int(m.get("genrec_sessions_restored_total", 0)),
        "events_logged": int(m.get("genrec_events_logged_total", 0)),
        "setup": {"items": a.items, "history_events": a.history, "max_history": a.max_history, "beam_width": a.beam_width,
                  "concurrency": a.concurrency, "cache_bytes": a.cache_bytes, "client_timeout_s": a.timeout_s,
                  "event_log": "sqlite (default, durability full)"},
        **({k: v for k, v in log_part.items() if k in ("log_users", "log_fill_s")}),
    }


def log_cost(a) -> list:
    """Append latency with each event log, measured round-robin over three live servers."""
    import os
    import tempfile

    from backend_src.config import DecodeOptions
    from backend_src.serving.redis_server import RedisServer, redis_server_binary
    from backend_src.serving.processes import free_port
    from backend_src.serving.server import TritonServer
    from clients.client import RecommenderClient
    from export.publish import publish
    from export.triton_configs import ServingOptions

    if redis_server_binary() is None:
        raise SystemExit("log-cost needs Debian's redis-server")
    with tempfile.TemporaryDirectory(prefix="genrec-logcost-") as tmp, RedisServer(Path(tmp) / "redis") as redis:
        tmp = Path(tmp)
        ckpt = tmp / "model.pt"
        build_checkpoint(ckpt, a.items, a.max_history)
        options = ServingOptions(decode=DecodeOptions(mode="pfa", beam_width=a.beam_width, k=16, r=0.5, selection_step=1),
                                 top_k=10)
        logs = {"memory (not durable)": "memory:", "sqlite (default)": "", "redis": redis.url}
        servers, clients = {}, {}
        try:
            for name, url in logs.items():
                repo = tmp / f"repo-{len(servers)}"
                publish(ckpt, repo, options)
                os.environ["GENREC_EVENT_LOG"] = url  # read by the encoder when it loads
                try:
                    servers[name] = TritonServer(repo, free_port(), free_port(), free_port(),
                                                 log_file=tmp / f"{len(servers)}.log", exit_timeout_s=5).start(timeout_s=180)
                finally:
                    os.environ.pop("GENREC_EVENT_LOG", None)
                clients[name] = RecommenderClient(servers[name].grpc_url)
            sessions = 20
            history = {u: user_events(u, a.history + a.rounds // sessions + 2, a.items) for u in range(sessions)}
            for name, c in clients.items():
                for u, (items, actions, ts) in history.items():
                    c.open_session(f"u{u}", items[:a.history], actions[:a.history], ts[:a.history])
            lat = {name: [] for name in logs}
            names = list(logs)
            for r in range(a.rounds):
                u, k = r % sessions, a.history + r // sessions
                items, actions, ts = history[u]
                for name in names[r % 3:] + names[: r % 3]:  # rotate who goes first
                    lat[name].append(clients[name].append(f"u{u}", items[k:k + 1], actions[k:k + 1], ts[k:k + 1]).latency_ms)
        finally:
            for c in clients.values():
                c.close()
            for srv in servers.values():
                srv.stop(grace_s=15)
    base = float(np.median(lat["memory (not durable)"]))
    return [{"event_log": name, **pct(v), "p50_over_memory_ms": float(np.median(v)) - base} for name, v in lat.items()]


FAULTS = ("publish", "rollback", "stub_kill_history_encoder", "stub_kill_pfa_decoder", "stub_kill_mfalcon_ranker",
          "retry_after_timeout", "oversized_shape", "server_crash", "watchdog_and_stub_kill")


def stub_pid(model: str, server_pid: int) -> int | None:
    """The pid of the server's Python-backend stub of `model`."""
    from backend_src.serving.stub_processes import stub_processes

    return next((pid for pid, (name, alive) in stub_processes(server_pid).items() if name == model and alive), None)


def watchdog_pid(keeper_pid: int) -> int | None:
    """The pid of the watchdog that its keeper runs."""
    from backend_src.serving.stub_processes import child_pids

    return next((pid for pid in child_pids(keeper_pid)
                 if b"serving.watchdog" in Path(f"/proc/{pid}/cmdline").read_bytes()), None)


def overflow_request(url: str) -> str:
    """The request whose declared shape overflows (INT64 [1, 2**62], empty payload): it kills
    the encoder's stub before model code runs. Returns the server's answer."""
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    from genrec_contract import protocol as P

    c = grpcclient.InferenceServerClient(url)
    ids = grpcclient.InferInput(P.ITEM_IDS.name, [1, 1], "BYTES")
    ids.set_data_from_numpy(np.array([[b"item-1"]], dtype=object))
    ts = grpcclient.InferInput(P.TIMESTAMPS.name, [1, 1], "INT64")
    ts.set_data_from_numpy(np.array([[1]], np.int64))
    huge = grpcclient.InferInput(P.ACTIONS.name, [1, 2**62], "INT64")
    huge._raw_content = b""
    try:
        c.infer(P.ENSEMBLE, [ids, huge, ts], sequence_id="overflow", sequence_start=True, sequence_end=True, client_timeout=30)
        return "answered"
    except InferenceServerException as e:
        return f"{e.status()}: {e.message()[:120]}"
    finally:
        c.close()


class ThreadedLoad:
    """Client threads (`_threads`, each running `_run`) for the length of a `with`: started on entry,
    told to stop (`stop`) and joined on exit; `t0` and `seconds` time the run."""

    def __enter__(self):
        self.t0 = time.monotonic()
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        for t in self._threads:
            t.join()
        self.seconds = time.monotonic() - self.t0


class SessionLoad(ThreadedLoad):
    """`threads` client threads, each with its own sessions: open with `history` events, then one
    event a request. Keeps, per session, the events acknowledged and the time of every success."""

    def __init__(self, url: str, threads: int, items: int, history: int = 4, timeouts: bool = False, length: int = 400,
                 events=None):
        self.url, self.threads, self.items, self.history, self.timeouts = url, threads, items, history, timeouts
        self.length = length  # events a session reaches (at most) before its client moves on to a new one
        self.tag = uuid.uuid4().hex[:6]  # session ids unique to this load
        # events(u, n) -> the first n events of user u (items, actions, timestamps); synthetic by default
        self.events = events or (lambda u, n: user_events(u, n, items))
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.acked: dict = {}  # session -> events acknowledged
        self.first_ok: dict = {}  # session -> time of its first success
        self.last_ok: dict = {}  # session -> time of its last success
        self.sent: dict = {}  # session -> events sent (acknowledged or not)
        self.failed: list = []
        self.lost: set = set()
        self.ok_times: list = []
        self.timed_out = 0
        self._threads = [threading.Thread(target=self._run, args=(w,)) for w in range(threads)]

    def _run(self, w: int):
        import tritonclient.grpc as grpcclient
        from tritonclient.utils import InferenceServerException

        from genrec_contract import protocol as P
        from clients.client import RecommenderClient, RecommenderError, SessionLost, event_inputs

        raw = grpcclient.InferenceServerClient(self.url)
        with RecommenderClient(self.url, timeout_s=10, retries=12, backoff_s=0.1) as c:
            s = 0
            while not self.stop.is_set():
                sid = f"{self.tag}-w{w}-s{s}"
                u = 1000 * (w + 1) + s
                items, actions, ts = self.events(u, self.length)
                n = min(self.history, len(items))
                try:
                    c.open_session(sid, items[:n], actions[:n], ts[:n])
                    self._ok(sid, n, n)
                    while n < len(items) and not self.stop.is_set():
                        if self.timeouts and n % 3 == 0:  # a client that gives up too early, then retries
                            inputs = event_inputs(items[n:n + 1], actions[n:n + 1], ts[n:n + 1])[0]
                            before = grpcclient.InferInput(P.EVENTS_BEFORE.name, [1, 1], "INT64")
                            before.set_data_from_numpy(np.array([[n]], np.int64))
                            try:
                                raw.infer(P.ENSEMBLE, inputs + [before], sequence_id=sid, sequence_start=True,
                                          client_timeout=0.001)
                            except InferenceServerException:
                                with self.lock:
                                    self.timed_out += 1
                        with self.lock:
                            self.sent[sid] = n + 1
                        c.append(sid, items[n:n + 1], actions[n:n + 1], ts[n:n + 1])
                        n += 1
                        self._ok(sid, n, n)
                        time.sleep(0.01)
                    c.close_session(sid)
                except SessionLost as e:
                    with self.lock:
                        self.lost.add(sid)
                        self.failed.append(str(e)[:200])
                except RecommenderError as e:
                    with self.lock:
                        self.failed.append(str(e)[:200])
                s += 1
        raw.close()

    def _ok(self, sid, acked, sent):
        with self.lock:
            self.last_ok[sid] = time.monotonic()
            self.first_ok.setdefault(sid, self.last_ok[sid])
            self.acked[sid] = acked
            self.sent[sid] = max(self.sent.get(sid, 0), sent)
            self.ok_times.append(time.monotonic())

    def check(self, log_url: str) -> dict:
        """Each session's log against what its client sent and had acknowledged."""
        from backend_src.serving.event_log import open_event_log

        lost = doubled = 0
        exact = True
        with open_event_log(log_url) as log:
            sessions = sorted(self.acked)
            for sid, got in zip(sessions, log.tails([f"s:{sid}" for sid in sessions], self.length)):
                w, s = (int(x[1:]) for x in sid.split("-")[1:])
                items, _, ts = self.events(1000 * (w + 1) + s, got.count)
                exact &= got.items == items and got.timestamps == ts
                lost += max(0, self.acked[sid] - got.count)  # acknowledged, not in the log
                doubled += max(0, got.count - self.sent[sid])  # in the log more often than sent
        return {"sessions": len(self.acked), "events_acknowledged": sum(self.acked.values()), "events_lost": lost,
                "events_doubled": doubled, "histories_exact": bool(exact)}

    def longest_gap_after(self, t: float) -> float:
        times = sorted(x for x in self.ok_times if x >= t)
        if not times:
            return float("inf")
        return float(max(np.diff([t] + times)))


def faults(a) -> list:
    import secrets
    import tempfile

    from backend_src.config import DecodeOptions
    from backend_src.serving.processes import free_port
    from backend_src.serving.server import TritonServer
    from export import publish as pub
    from export.triton_configs import ServingOptions

    rows = []
    with tempfile.TemporaryDirectory(prefix="genrec-faults-") as tmp:
        tmp = Path(tmp)
        v1, v2 = tmp / "v1.pt", tmp / "v2.pt"
        build_checkpoint(v1, a.items, a.max_history)
        build_checkpoint(v2, a.items, a.max_history, seed=1)
        options = ServingOptions(decode=DecodeOptions(mode="pfa", beam_width=a.beam_width, k=16, r=0.5, selection_step=1),
                                 top_k=10, visit_idle_s=5)
        for fault in a.only or FAULTS:
            repo = tmp / f"repo-{fault}"
            pub.publish(v1, repo, options)
            if fault == "rollback":
                pub.publish(v2, repo, options)  # v2 serves; the rollback goes back to v1
            log_url = str(repo.parent / f"{repo.name}-events" / "events.sqlite3")
            server = TritonServer(repo, free_port(), free_port(), free_port(), log_file=tmp / f"{fault}.log",
                                  exit_timeout_s=5, watchdog=True, admin_key=secrets.token_urlsafe(32),
                                  pid_file=tmp / f"{fault}.pid", restart=True)
            server.start(timeout_s=180)
            note = ""
            try:
                with SessionLoad(server.grpc_url, a.threads, a.items, timeouts=fault == "retry_after_timeout") as load:
                    time.sleep(a.warmup_s)
                    t_fault = time.monotonic()
                    if fault == "publish":
                        pub.publish(v2, repo, options, server=server.grpc_url, admin_key=server.admin_key)
                    elif fault == "rollback":
                        pub.rollback(repo, server=server.grpc_url, admin_key=server.admin_key)
                    elif fault.startswith("stub_kill_"):
                        model = fault[len("stub_kill_"):]
                        pid = stub_pid(model, server.pid)
                        os_kill(pid)
                        note = f"SIGKILL stub pid {pid}"
                    elif fault == "oversized_shape":
                        note = overflow_request(server.grpc_url)
                    elif fault == "watchdog_and_stub_kill":  # the stub dies while no watchdog runs
                        watchdog = watchdog_pid(server.watchdog_pid)
                        os_kill(watchdog)
                        pid = stub_pid("history_encoder", server.pid)
                        os_kill(pid)
                        note = f"SIGKILL watchdog pid {watchdog}, then stub pid {pid}"
                    elif fault == "server_crash":
                        resource.prlimit(server.pid, resource.RLIMIT_CORE, (0, 0))  # no core file
                        os.kill(server.pid, signal.SIGSEGV)
                        note = f"SIGSEGV tritonserver pid {server.pid}"
                    time.sleep(a.seconds)
                rec = load.longest_gap_after(t_fault)
                check = load.check(log_url)
            finally:
                server.stop(grace_s=15)
            row = {"fault": fault, "failed_requests": len(load.failed), "sessions_lost": len(load.lost),
                   "events_lost": check["events_lost"], "events_doubled": check["events_doubled"],
                   "recovery_s": rec, "histories_exact": check["histories_exact"], "sessions": check["sessions"],
                   "events_acknowledged": check["events_acknowledged"], "requests_ok": len(load.ok_times),
                   "client_timeouts_forced": load.timed_out, "failure_examples": load.failed[:3], "note": note}
            log(f"{fault}: {row}")
            rows.append(row)
    return rows


def os_kill(pid: int | None) -> None:
    if pid is None:
        raise RuntimeError("no such process found")
    os.kill(pid, signal.SIGKILL)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m perf.bench_sessions", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="what", required=True)
    s = sub.add_parser("scale")
    s.add_argument("--users", type=int, default=100_000)
    s.add_argument("--resumed", type=int, default=10_000)
    s.add_argument("--log-users", type=int, default=1_000_000, help="users written straight into the log (0: skip)")
    s.add_argument("--log-sample", type=int, default=500, help="of those, resumed one at a time (rebuild, then cache hit)")
    s.add_argument("--history", type=int, default=5, help="events per user at open")
    s.add_argument("--items", type=int, default=5000)
    s.add_argument("--max-history", type=int, default=64)
    s.add_argument("--beam-width", type=int, default=10)
    s.add_argument("--concurrency", type=int, default=8)
    s.add_argument("--cache-bytes", type=int, default=64 << 20, help="the session cache's bound")
    s.add_argument("--timeout-s", type=float, default=30.0, help="client deadline per request (reached = a hang)")
    s.add_argument("--out", default=str(RESULTS_DIR / "sessions_scale.json"))
    c = sub.add_parser("log-cost")
    c.add_argument("--rounds", type=int, default=300)
    c.add_argument("--history", type=int, default=20)
    c.add_argument("--items", type=int, default=5000)
    c.add_argument("--max-history", type=int, default=64)
    c.add_argument("--beam-width", type=int, default=10)
    c.add_argument("--out", default=str(RESULTS_DIR / "sessions_log_cost.json"))
    f = sub.add_parser("faults")
    f.add_argument("--only", nargs="*", choices=FAULTS, help="these faults only (default: all)")
    f.add_argument("--threads", type=int, default=4)
    f.add_argument("--seconds", type=float, default=20.0, help="traffic after the fault")
    f.add_argument("--warmup-s", type=float, default=3.0, help="traffic before the fault")
    f.add_argument("--items", type=int, default=5000)
    f.add_argument("--max-history", type=int, default=64)
    f.add_argument("--beam-width", type=int, default=10)
    f.add_argument("--out", default=str(RESULTS_DIR / "sessions_faults.json"))
    a = ap.parse_args(argv)
    if a.what == "faults":
        rows = faults(a)
        write_result(a.out, rows, setup={"threads": a.threads, "seconds_after_fault": a.seconds, "items": a.items,
                                         "max_history": a.max_history, "beam_width": a.beam_width,
                                         "client": "RecommenderClient(timeout_s=10, retries=12, backoff_s=0.1)"})
        print(markdown_table(rows, ["fault", "failed_requests", "sessions_lost", "events_lost", "events_doubled",
                                    "recovery_s", "histories_exact", "events_acknowledged"], ".2f"))
        return 0
    if a.what == "log-cost":
        rows = log_cost(a)
        write_result(a.out, rows, setup={"items": a.items, "max_history": a.max_history, "beam_width": a.beam_width,
                                         "history_events": a.history, "rounds": a.rounds})
        print(markdown_table(rows, ["event_log", "n", "p50_ms", "p99_ms", "p50_over_memory_ms"], ".2f"))
        return 0
    result = scale(a)
    rows = result.pop("rows")
    write_result(a.out, rows, **result)
    print(markdown_table(rows, ["phase", "users", "n", "p50_ms", "p95_ms", "p99_ms", "hangs", "errors", "restored"], ".1f"))
    print({k: result[k] for k in ("users_opened", "users_resumed", "hangs", "errors", "session_bytes_peak", "session_bytes_bound")})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
