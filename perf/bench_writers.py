"""Writers, retries and faults: a Jepsen-style check of the promise that every acknowledged event
is logged exactly once, for every session, whoever writes it.

N writers (threads, each with its own `clients.RecommenderClient`) write to the same sessions at
once: a writer's first call to a session appends (the client library resumes it first) or, when
the server holds nothing yet, opens it with the writer's events; every later call appends 1-3
events. Some calls get a short client deadline (2-30 ms: the request may or may not be carried
out) and are sent again with the normal deadline, as an application would. Meanwhile faults are
injected: a stage's stub SIGKILLed, tritonserver SIGKILLed (its watchdog starts it again), a
Redis event log killed for 5 s, a cluster replica killed.

Every event is identifiable: writer w's k-th event in a session is the catalog's item
`1 + w * K + k` (K events per writer and session at most), stamped with the writer's clock
(seconds). Every call's outcome is recorded: acknowledged (its events must be in the log), or
failed (raised after the client library's retries: its events are indeterminate). At the end each
session's log is read and checked:
    events_lost       acknowledged events missing from the log
    events_doubled    extra copies of any event (acknowledged or not) in the log
    order_violations  events logged before an earlier event of the same writer
    events_unexpected logged events no writer sent

    python -m perf.bench_writers [--only two_writers ...] [--seconds 30]
        -> perf/results/writers.json
"""
from __future__ import annotations

import argparse
import random
import tempfile
import threading
import time
from collections import Counter
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

from perf.bench_sessions import ThreadedLoad, item_id, os_kill
from perf.common import RESULTS_DIR, host_load, log, save_result

K = 64  # events per writer and session at most: writer w's k-th event is item 1 + w * K + k
FAULTS = ("stub_kill_history_encoder", "stub_kill_pfa_decoder", "stub_kill_mfalcon_ranker", "server_kill",
          "redis_down_5s", "replica_kill")
REDIS_DOWN_S = 5.0
HEAL_BOUND_S = 90.0  # a killed replica serves again within this (a full start: its models load again)
GENEROUS_CLIENT = {"timeout_s": 10.0, "retries": 12, "backoff_s": 0.1}  # what the other fault benchmarks use


@dataclass(frozen=True)
class Scenario:
    name: str
    writers: int
    store: str = "sqlite"  # sqlite (one server) | redis (one server, Redis log) | cluster (replicas, nginx, Redis)
    faults: tuple = ()  # (seconds after the start, fault)
    client: dict = field(default_factory=dict)  # RecommenderClient arguments; {} = the library's defaults
    timeout_fraction: float = 0.1  # calls given a short deadline first, then sent again
    seconds_after_faults: float = 20.0


def scenarios(seconds: float) -> list:
    return [
        Scenario("two_writers", 2, seconds_after_faults=seconds),
        Scenario("four_writers", 4, seconds_after_faults=seconds),
        Scenario("eight_writers", 8, seconds_after_faults=seconds),
        Scenario("eight_writers_with_faults", 8, "redis", client=GENEROUS_CLIENT, seconds_after_faults=seconds,
                 faults=((5.0, "stub_kill_history_encoder"), (20.0, "server_kill"), (40.0, "redis_down_5s"),
                         (55.0, "stub_kill_pfa_decoder"))),
        Scenario("server_kill_default_retries", 4, "sqlite", faults=((5.0, "server_kill"),), timeout_fraction=0.0,
                 seconds_after_faults=seconds),
        Scenario("redis_down_5s_default_retries", 4, "redis", faults=((5.0, "redis_down_5s"),), timeout_fraction=0.0,
                 seconds_after_faults=seconds),
        Scenario("replica_kill", 4, "cluster", faults=((5.0, "replica_kill"),), seconds_after_faults=seconds),
    ]


# --------------------------------------------------------------------------------------------
# What runs: one server (SQLite or Redis log) or a cluster, and the faults it can suffer
# --------------------------------------------------------------------------------------------
class SingleServer:
    """One tritonserver with its watchdog (which restarts a crashed server), over a SQLite log
    or a Redis one."""

    def __init__(self, repo: Path, workdir: Path, redis: bool):
        self.repo, self.workdir, self.use_redis = repo, workdir, redis
        self.redis = self.server = None

    def __enter__(self):
        import secrets

        from backend_src.serving.processes import free_port
        from backend_src.serving.redis_server import RedisServer
        from backend_src.serving.server import TritonServer

        if self.use_redis:
            self.redis = RedisServer(self.workdir / "redis").start()
        self.server = TritonServer(self.repo, free_port(), free_port(), free_port(), log_file=self.workdir / "tritonserver.log",
                                   exit_timeout_s=5, watchdog=True, admin_key=secrets.token_urlsafe(32),
                                   pid_file=self.workdir / "server.pid", restart=True,
                                   event_log=self.redis.url if self.redis else None)
        try:
            self.server.start(timeout_s=180)
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc):
        if self.server is not None:
            self.server.stop(grace_s=15)
        if self.redis is not None:
            self.redis.stop()

    @property
    def url(self) -> str:
        return self.server.grpc_url

    @property
    def log_url(self) -> str:
        from backend_src.serving.event_log import served_log_url

        return self.redis.url if self.redis else served_log_url({}, self.repo)  # the encoder's default beside the repository

    def server_pid(self) -> int:
        """The running tritonserver's pid (the watchdog writes a restarted one's to the pid file)."""
        from backend_src.serving.processes import read_pid_file

        return int((read_pid_file(self.server.pid_file) or {}).get("pid") or self.server.pid)

    def inject(self, fault: str) -> str:
        if fault.startswith("stub_kill_"):
            from perf.bench_sessions import stub_pid

            pid = stub_pid(fault[len("stub_kill_"):], self.server_pid())
            os_kill(pid)
            return f"SIGKILL stub pid {pid}"
        if fault == "server_kill":
            pid = self.server_pid()
            os_kill(pid)
            return f"SIGKILL tritonserver pid {pid}"
        if fault == "redis_down_5s":
            self.redis.kill()
            time.sleep(REDIS_DOWN_S)
            self.redis.start()
            return f"SIGKILL redis-server, started again {REDIS_DOWN_S:g} s later"
        raise ValueError(f"{fault} needs a cluster")


class Cluster:
    """Two replicas behind nginx over one Redis log (backend_src/serving/cluster.py)."""

    def __init__(self, repo: Path, workdir: Path, replicas: int = 2):
        from backend_src.serving.cluster import LocalCluster

        self.cluster = LocalCluster(repo, replicas, workdir=workdir / "cluster")

    def __enter__(self):
        self.cluster.start()
        return self

    def __exit__(self, *exc):
        self.cluster.stop()

    @property
    def url(self) -> str:
        return self.cluster.url

    @property
    def log_url(self) -> str:
        return self.cluster.redis.url

    def inject(self, fault: str) -> str:
        """replica_kill: SIGKILL replica 0's tritonserver; its watchdog is to start it again. If it
        does not serve again within HEAL_BOUND_S, the replica is restarted here (and the row says so)."""
        if fault != "replica_kill":
            raise ValueError(f"{fault} is not a cluster fault")
        from backend_src.serving.processes import http_ok, read_pid_file

        replica = self.cluster.replicas[0]
        pid = int((read_pid_file(replica.pid_file) or {}).get("pid") or replica.pid) if replica.pid_file else replica.pid
        os_kill(pid)
        t0 = time.monotonic()
        time.sleep(1.0)
        while time.monotonic() - t0 < HEAL_BOUND_S and not http_ok(f"http://{replica.http_url}/v2/health/ready"):
            time.sleep(0.5)
        if http_ok(f"http://{replica.http_url}/v2/health/ready"):
            return f"SIGKILL replica 0's tritonserver pid {pid}; its watchdog had it serving again {time.monotonic() - t0:.1f} s later"
        self.cluster.restart_replica(0)
        return (f"SIGKILL replica 0's tritonserver pid {pid}; not serving again after {HEAL_BOUND_S:g} s, restarted by hand "
                f"({time.monotonic() - t0:.1f} s after the kill)")


# --------------------------------------------------------------------------------------------
# The writers and the check
# --------------------------------------------------------------------------------------------
def event_item(writer: int, k: int) -> str:
    return item_id(1 + writer * K + k)


def item_event(item: str):
    """(writer, k) of a logged item id, None if no writer sends it."""
    try:
        i = int(item.rsplit("-", 1)[1]) - 1
    except (IndexError, ValueError):
        return None
    return (i // K, i % K) if i >= 0 else None


class Writers(ThreadedLoad):
    """`writers` threads writing to the same `sessions` sessions; what each call's answer (or
    failure) says of its events."""

    def __init__(self, url: str, writers: int, sessions: int, client: dict, timeout_fraction: float, seed: int = 0):
        import uuid

        self.url, self.n, self.client_args, self.timeout_fraction = url, writers, dict(client), timeout_fraction
        self.tag = uuid.uuid4().hex[:6]
        self.sids = [f"jw-{self.tag}-{s}" for s in range(sessions)]
        self.seed = seed
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.acked: set = set()  # (session, writer, k)
        self.indeterminate: set = set()
        self.calls = self.failed_calls = self.forced_timeouts = 0
        self.failures: Counter = Counter()  # status -> failed calls
        self.failure_examples: list = []
        self.retried = self.visits_restarted = self.conflicts_resolved = 0
        self.trace: list = []  # (session, writer, ks, timed out first, conflicts resolved) of every call
        self.ack_times: list = []
        self._threads = [threading.Thread(target=self._run, args=(w,), daemon=True) for w in range(writers)]

    def _run(self, w: int) -> None:
        from clients.client import RecommenderClient, SessionLost

        rng = random.Random(self.seed * 1000 + w)
        order = list(range(len(self.sids)))
        rng.shuffle(order)
        next_k = [0] * len(self.sids)
        c = RecommenderClient(self.url, **self.client_args)
        timeout_s, retries = c.timeout_s, c.retries

        opening: set = set()  # sessions this writer opens: the server held nothing when it first wrote

        def call(s: int, ks: list, stamps: list):
            """The writer's events: appended, or the session opened with them when the server holds
            nothing yet; a retry repeats the same call (an open stays an open)."""
            sid, items = self.sids[s], [event_item(w, k) for k in ks]
            if s not in opening:
                try:
                    return c.append(sid, items, [1] * len(ks), stamps)
                except SessionLost:
                    opening.add(s)
            rec = c.open_session(sid, items, [1] * len(ks), stamps)
            opening.discard(s)
            return rec

        try:
            i = 0
            while not self.stop.is_set():
                s = order[i % len(order)]
                i += 1
                if next_k[s] >= K:
                    if min(next_k) >= K:
                        break
                    continue
                ks = list(range(next_k[s], min(K, next_k[s] + rng.randint(1, 3))))
                next_k[s] = ks[-1] + 1
                events = {(s, w, k) for k in ks}
                stamps = [int(time.time())] * len(ks)  # the writer's clock; a retry sends the same events
                forced = rng.random() < self.timeout_fraction
                resolved_before, timed_out = getattr(c, "conflicts_resolved", 0), False
                if forced:  # a client that gives up early, then sends the same call again
                    c.timeout_s, c.retries = rng.uniform(0.002, 0.03), 0
                try:
                    try:
                        call(s, ks, stamps)
                    except Exception:  # noqa: BLE001
                        if not forced:
                            raise
                        with self.lock:
                            self.forced_timeouts += 1
                        timed_out = True
                        c.timeout_s, c.retries = timeout_s, retries
                        call(s, ks, stamps)
                    with self.lock:
                        self.calls += 1
                        self.acked |= events
                        self.ack_times.append(time.monotonic())
                except Exception as e:  # noqa: BLE001 - a failed call, whatever raised
                    with self.lock:
                        self.calls += 1
                        self.failed_calls += 1
                        self.indeterminate |= events
                        self.failures[getattr(e, "status", type(e).__name__)] += 1
                        if len(self.failure_examples) < 5:
                            self.failure_examples.append(str(e)[:240])
                finally:
                    c.timeout_s, c.retries = timeout_s, retries
                    self.trace.append((s, w, tuple(ks), timed_out, getattr(c, "conflicts_resolved", 0) - resolved_before))
        finally:
            with self.lock:
                self.retried += c.retried
                self.visits_restarted += c.visits_restarted
                self.conflicts_resolved += getattr(c, "conflicts_resolved", 0)
            c.close()

    def longest_gap_after(self, t: float) -> float | None:
        """The longest time without an acknowledged call after t (until the end)."""
        times = sorted(x for x in self.ack_times if x >= t)
        if not times:
            return None
        return max(b - a for a, b in zip([t] + times, times + [self.t0 + self.seconds]))

    def check(self, log_url: str) -> dict:
        """Every session's log against the calls' outcomes."""
        from backend_src.serving.event_log import open_event_log
        from genrec_contract.protocol import session_key

        lost = doubled = unexpected = order = applied_indeterminate = logged_total = 0
        with open_event_log(log_url) as event_log:
            keys = [session_key(sid) for sid in self.sids]
            tails = event_log.tails(keys, max(event_log.counts(keys)))
        for s, got in enumerate(tails):
            if got.count != len(got.items):
                raise RuntimeError(f"session {self.sids[s]}: the log retains {len(got.items)} of {got.count} events")
            logged_total += got.count
            seen: Counter = Counter()
            last_k: dict = {}
            for item in got.items:
                e = item_event(item)
                if e is None or e[0] >= self.n or ((s, *e) not in self.acked and (s, *e) not in self.indeterminate):
                    unexpected += 1
                    continue
                seen[e] += 1
                if seen[e] > 1:  # a copy: counted as doubled, its first copy's place is the one ordered
                    continue
                w, k = e
                if k < last_k.get(w, -1):
                    order += 1
                last_k[w] = max(k, last_k.get(w, -1))
            doubled += sum(n - 1 for n in seen.values() if n > 1)
            lost += sum(1 for (s2, w, k) in self.acked if s2 == s and seen[(w, k)] == 0)
            applied_indeterminate += sum(1 for (s2, w, k) in self.indeterminate if s2 == s and seen[(w, k)] > 0)
        return {"events_lost": lost, "events_doubled": doubled, "order_violations": order, "events_unexpected": unexpected,
                "events_logged": logged_total, "indeterminate_applied": applied_indeterminate}


def run_scenario(sc: Scenario, target, sessions: int) -> dict:
    """Writers on `target` while the scenario's faults happen; the row of writers.json."""
    notes = []
    t_first = None
    with Writers(target.url, sc.writers, sessions, sc.client, sc.timeout_fraction) as load:
        for at, fault in sc.faults:
            time.sleep(max(0.0, load.t0 + at - time.monotonic()))
            t_first, t_fault = t_first or time.monotonic(), time.monotonic()
            note = target.inject(fault)
            log(f"  {t_fault - load.t0:5.1f} s  {fault}: {note}")
            notes.append(f"{at:g} s: {note}")
        time.sleep(sc.seconds_after_faults)
    check = load.check(target.log_url)
    return {
        "scenario": sc.name, "writers": sc.writers, "sessions": sessions, "acknowledged": len(load.acked),
        "events_lost": check["events_lost"], "events_doubled": check["events_doubled"], "failed_calls": load.failed_calls,
        "order_violations": check["order_violations"], "events_unexpected": check["events_unexpected"],
        "calls": load.calls, "indeterminate": len(load.indeterminate), "indeterminate_applied": check["indeterminate_applied"],
        "events_logged": check["events_logged"], "forced_timeouts": load.forced_timeouts,
"client_retries": load.retried, "visits_restarted": load.visits_restarted,
        "conflicts_resolved": load.conflicts_resolved,
        "failures_by_status": dict(load.failures), "failure_examples": load.failure_examples,
        "faults": notes, "recovery_s": load.longest_gap_after(t_first) if t_first else None,
        "duration_s": load.seconds, "event_log": {"sqlite": "sqlite", "redis": "redis", "cluster": "redis"}[sc.store],
        "client": sc.client or "defaults",
    }


def publish_model(workdir: Path, items: int, max_history: int = 64, beam_width: int = 10) -> Path:
    """An untrained model over `items` items ("item-1" ...), published; returns the repository.
    The check needs no quality, only a catalog that holds every writer's events."""
    from backend_src.config import DecodeOptions
    from export.publish import publish
    from export.triton_configs import ServingOptions
    from perf.bench_sessions import build_checkpoint

    ckpt = workdir / "model.pt"
    if not ckpt.exists():
        build_checkpoint(ckpt, items, max_history)
    repo = workdir / f"repo-{len(list(workdir.glob('repo-*')))}"
    publish(ckpt, repo, ServingOptions(decode=DecodeOptions(mode="pfa", beam_width=beam_width, k=16, r=0.5, selection_step=1),
                                       top_k=min(10, beam_width), visit_idle_s=5))
    return repo


def run(chosen: list, sessions: int, workdir: Path, items: int) -> list:
    """The scenarios in order: those without faults on one store share a server, every other
    one gets its own."""
    if max(sc.writers for sc in chosen) * K > items:
        raise SystemExit(f"--items must be at least writers * {K}")
    rows = []
    with ExitStack() as shared_servers:
        shared: dict = {}
        for sc in chosen:
            log(f"{sc.name}: {sc.writers} writers, {sessions} sessions, faults {[f for _, f in sc.faults] or 'none'}")
            if sc.store == "cluster":
                with Cluster(publish_model(workdir, items), workdir / sc.name) as target:
                    rows.append(run_scenario(sc, target, sessions))
            elif sc.faults:
                with SingleServer(publish_model(workdir, items), workdir / sc.name, sc.store == "redis") as target:
                    rows.append(run_scenario(sc, target, sessions))
            else:
                if sc.store not in shared:
                    shared[sc.store] = shared_servers.enter_context(
                        SingleServer(publish_model(workdir, items), workdir / sc.name, sc.store == "redis"))
                rows.append(run_scenario(sc, shared[sc.store], sessions))
            r = rows[-1]
            log(f"  acknowledged {r['acknowledged']}, lost {r['events_lost']}, doubled {r['events_doubled']}, "
                f"failed calls {r['failed_calls']} {r['failures_by_status']}, order violations {r['order_violations']}")
    return rows


def main(argv=None) -> int:
    from backend_src.results import markdown_table

    ap = argparse.ArgumentParser(prog="python -m perf.bench_writers", description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", nargs="*", help="these scenarios only (default: all)")
    ap.add_argument("--sessions", type=int, default=100)
    ap.add_argument("--seconds", type=float, default=30.0, help="traffic after the last fault (without faults: in all)")
    ap.add_argument("--items", type=int, default=1000, help="the catalog of the untrained model served")
    ap.add_argument("--out", default=str(RESULTS_DIR / "writers.json"))
    a = ap.parse_args(argv)
    known = {sc.name: sc for sc in scenarios(a.seconds)}
    unknown = set(a.only or ()) - set(known)
    if unknown:
        ap.error(f"unknown scenarios {sorted(unknown)}; known: {', '.join(known)}")
    chosen = [sc for name, sc in known.items() if not a.only or name in a.only]
    load_start = host_load()
    with tempfile.TemporaryDirectory(prefix="genrec-writers-") as tmp:
        rows = run(chosen, a.sessions, Path(tmp), a.items)
    save_result(Path(a.out), rows, "perf.bench_writers", argv, load_start,
                setup={"sessions": a.sessions, "events_per_writer_and_session_max": K, "items": a.items,
                       "model": "untrained, d 32, histories up to 64, beam 10",
                       "forced_timeouts": "a short deadline (2-30 ms), then the same call again",
                       "redis_down_s": REDIS_DOWN_S})
    print(markdown_table(rows, ["scenario", "writers", "acknowledged", "events_lost", "events_doubled", "failed_calls",
                                "order_violations", "indeterminate", "forced_timeouts", "client_retries", "recovery_s"], ".2f"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
