"""The durable per-user event log (backend_src/serving/event_log/), every test on both
backends: a SQLite file and a real redis-server started here (skipped without the binary)."""
import json
import os
import re
import signal
import sqlite3
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

from backend_src.serving.event_log import (
    EventLogUnavailable,
    EventRange,
    LogConflict,
    SQLiteEventLog,
    UserLog,
    open_event_log,
)
from backend_src.serving.redis_server import RedisServer, redis_server_binary
import store_helpers
from store_helpers import BACKENDS, NO_REDIS, backend_url, opener, redis_or_skip, redis_server_fixture

REPO_ROOT = Path(__file__).resolve().parents[1]

# user keys that trip naive key schemes: hash-tag braces, an escaped brace, unicode, long
ODD_USERS = ["i:123", "s:user-abc", "a}", "a%7D", "{x}", "ü" * 140, "with space\nand newline"]


redis_server = pytest.fixture(scope="module")(redis_server_fixture)


@pytest.fixture(params=BACKENDS)
def log_url(request, tmp_path):
    return backend_url(request, tmp_path, "logs")


def durable_only(log_url: str) -> None:
    store_helpers.durable_only(log_url, "log")


@pytest.fixture
def open_log(log_url):
    yield from opener(lambda **options: open_event_log(log_url, **options))


def _run_python(code: str, *args) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    return subprocess.Popen([sys.executable, "-c", code, *map(str, args)], cwd=REPO_ROOT, env=env,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


# ------------------------------------------------------------------------------ basics
def test_round_trip_unicode_long_ids_big_timestamps(open_log):
    log = open_log()
    items = ["🎬" * 300, "é\x00ü", "B00" + "x" * 2000, "42"]
    actions = [0, -1, 7, 2**31]
    timestamps = [0, 2**53, 2**53 + 1, 1_700_000_000]
    assert log.append(ODD_USERS[0], 0, items[:2], actions[:2], timestamps[:2]) == 2
    assert log.append(ODD_USERS[0], 2, items[2:], actions[2:], timestamps[2:]) == 4
    for i, user in enumerate(ODD_USERS[1:], start=1):
        assert log.append(user, 0, [f"item-{i}"] * i, list(range(i)), [10 * i] * i) == i

    full = log.tail(ODD_USERS[0], 100)
    assert full == UserLog(4, items, actions, timestamps)
    assert all(type(t) is int for t in full.timestamps)
    assert log.tail(ODD_USERS[0], 2) == UserLog(4, items[2:], actions[2:], timestamps[2:])
    assert log.tail(ODD_USERS[0], 0) == UserLog(4, [], [], [])
    # users differing only in an escaped character stay apart
    assert log.counts(ODD_USERS) == [4] + list(range(1, len(ODD_USERS)))
    assert log.count("a}") == 2 and log.count("a%7D") == 3
    tails = log.tails(ODD_USERS[1:], 3)
    for i, tail in enumerate(tails, start=1):
        k = min(i, 3)
        assert tail == UserLog(i, [f"item-{i}"] * k, list(range(i))[-k:], [10 * i] * k)


def test_writes_of_every_size_keep_their_order(open_log):
    """A write's events go in as several statements on SQLite (a power of two rows each, at most
    1024): sizes on and off those boundaries read back whole and in order."""
    log = open_log(retain_events=5000)
    count = 0
    for n in (1, 2, 3, 7, 512, 1023, 1024, 1025, 2500):
        items = [f"{n}-{j}" for j in range(n)]
        assert log.append("u", count, items, [j % 5 for j in range(n)], list(range(count, count + n))) == count + n
        tail = log.tail("u", n)
        assert tail == UserLog(count + n, items, [j % 5 for j in range(n)], list(range(count, count + n)))
        count += n
    assert log.tail("u", 5000).timestamps == list(range(count))[-5000:]
    assert log.replace("r", [f"x{j}" for j in range(1500)], [0] * 1500, list(range(1500))) == 1500
    assert log.tail("r", 2000).items == [f"x{j}" for j in range(1500)]


def test_sqlite_writes_within_a_low_parameter_limit(tmp_path):
    """An SQLite built with the limit of before 3.32 (999 parameters a statement) takes 128 rows an
    INSERT: a write of 1,500 events still goes in whole."""
    log = SQLiteEventLog(tmp_path / "events.db", retain_events=5000)
    log._db().setlimit(sqlite3.SQLITE_LIMIT_VARIABLE_NUMBER, 999)
    items = [f"i{j}" for j in range(1500)]
    assert log.append("u", 0, items, [1] * 1500, list(range(1500))) == 1500
    assert log.tail("u", 1500) == UserLog(1500, items, [1] * 1500, list(range(1500)))
    log.close()


def test_unknown_users_and_empty_appends(open_log):
    log = open_log()
    assert log.counts(["nobody", "nobody-else"]) == [0, 0]
    assert log.tails(["nobody", "nobody-else"], 512) == [UserLog(0, [], [], [])] * 2
    assert log.counts([]) == [] and log.tails([], 5) == [] and log.append_many([]) == []
    assert log.append("u", 0, [], [], []) == 0  # an empty append to an empty log is fine
    assert log.count("u") == 0
    log.append("u", 0, ["a"], [1], [5])
    assert log.append("u", 1, [], [], []) == 1
    with pytest.raises(LogConflict) as err:
        log.append("u", 0, [], [], [])  # an empty append is still compared
    assert err.value.count == 1
    assert log.tail("u", 10) == UserLog(1, ["a"], [1], [5])


def test_counts_of_more_users_than_one_query_takes(open_log):
    """Counts read in one statement, or in several queries in one transaction: each user's own,
    in the order asked, duplicates included."""
    log = open_log()
    users = [f"many-{i}" for i in range(1200)]
    log.append_many([(u, 0, ["x"] * (i % 3), [1] * (i % 3), [7] * (i % 3)) for i, u in enumerate(users) if i % 3])
    want = [i % 3 for i in range(1200)]
    assert log.counts(users) == want
    assert log.counts(users[:5] + users[:5]) == want[:5] * 2
    assert log.counts(users[::-1] + ["nobody"]) == want[::-1] + [0]


def test_bad_writes_are_rejected_before_anything_is_applied(open_log):
    log = open_log()
    good = ("u", 0, ["a"], [1], [1])
    with pytest.raises(ValueError, match="same length"):
        log.append_many([good, ("v", 0, ["a", "b"], [1], [1, 2])])
    with pytest.raises(ValueError, match="64 bits"):
        log.append_many([good, ("v", 0, ["a"], [1], [2**64])])
    with pytest.raises(ValueError, match="non-empty str"):
        log.append_many([good, ("", 0, ["a"], [1], [1])])
    with pytest.raises(ValueError, match="n must be"):
        log.tails(["u"], -1)
    assert log.counts(["u", "v"]) == [0, 0]


# ------------------------------------------------------------------------------ compare-and-append
def test_stale_expected_count_is_not_applied_and_reports_the_real_count(open_log):
    log = open_log()
    assert log.append("u", 0, ["a", "b", "c"], [1, 1, 1], [1, 2, 3]) == 3
    for stale in (0, 2, 4):
        with pytest.raises(LogConflict) as err:
            log.append("u", stale, ["x"], [9], [9])
        assert err.value.count == 3 and err.value.expected == stale and "'u'" in str(err.value)
    assert log.tail("u", 10) == UserLog(3, ["a", "b", "c"], [1, 1, 1], [1, 2, 3])


def test_append_many_conflict_does_not_stop_the_others(open_log):
    log = open_log()
    log.append("b", 0, ["b0", "b1"], [0, 0], [0, 0])
    results = log.append_many([
        ("a", 0, ["a0"], [1], [10]),
        ("b", 5, ["lost"], [1], [10]),          # stale: b has 2
        ("c", 0, ["c0", "c1"], [1, 2], [10, 11]),
        ("a", 1, ["a1"], [2], [11]),            # chains on the first write in this batch
        ("a", 1, ["lost"], [3], [12]),          # a is at 2 by now
    ])
    assert results[0] == 1 and results[2] == 2 and results[3] == 2
    assert isinstance(results[1], LogConflict) and results[1].count == 2
    assert isinstance(results[4], LogConflict) and results[4].count == 2
    tails = log.tails(["a", "b", "c"], 10)
    assert [t.items for t in tails] == [["a0", "a1"], ["b0", "b1"], ["c0", "c1"]]
    assert [t.count for t in tails] == [2, 2, 2]


def test_threads_sharing_one_log(open_log):
    log = open_log()
    per_thread, threads = 20, 4

    def worker(tag):
        for i in range(per_thread):
            expected = log.count("shared")
            while True:
                try:
                    expected = log.append("shared", expected, [f"{tag}-{i}"], [tag], [i])
                    break
                except LogConflict as e:
                    expected = e.count

    pool = [threading.Thread(target=worker, args=(t,)) for t in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    tail = log.tail("shared", 1000)
    assert tail.count == per_thread * threads == len(tail.items) == len(set(tail.items))
    for tag in range(threads):
        assert [i for a, i in zip(tail.actions, tail.timestamps) if a == tag] == list(range(per_thread))


# ------------------------------------------------------------------------------ retention
def test_retention_trims_old_events_but_count_keeps_counting(open_log, log_url):
    durable_only(log_url)
    log = open_log(retain_events=5)
    log.append("u", 0, ["e0", "e1", "e2"], [0, 1, 2], [0, 1, 2])
    log.append("u", 3, ["e3", "e4", "e5", "e6"], [3, 4, 5, 6], [3, 4, 5, 6])
    assert log.tail("u", 100) == UserLog(7, ["e2", "e3", "e4", "e5", "e6"],
                                         [2, 3, 4, 5, 6], [2, 3, 4, 5, 6])
    # one append longer than the retention keeps only its own last events
    assert log.append("u", 7, [f"e{i}" for i in range(7, 19)], list(range(7, 19)), list(range(7, 19))) == 19
    assert log.append("u", 19, ["e19"], [19], [19]) == 20
    assert log.tail("u", 100) == UserLog(20, [f"e{i}" for i in range(15, 20)], list(range(15, 20)),
                                         list(range(15, 20)))
    # the trimmed events are gone from storage, not just hidden: a log opened with a larger
    # retention still sees only 5
    wide = open_log(retain_events=100)
    assert wide.tail("u", 100).items == [f"e{i}" for i in range(15, 20)]


def test_events_at_positions_read_back_what_was_accepted_there(open_log):
    """The read a server compares a request's events with: positions in the user's whole log, only those
    retention keeps, several users in one call."""
    log = open_log(retain_events=5)
    log.append("u", 0, ["e0", "e1", "e2"], [0, 1, 2], [10, 11, 12])
    assert log.events("u", 1, 3) == EventRange(3, 1, ["e1", "e2"], [1, 2], [11, 12])
    assert log.events("u", 2, 9) == EventRange(3, 2, ["e2"], [2], [12])  # cut at the count
    assert log.events("u", 3, 4) == EventRange(3, 4, [], [], [])  # past the count: none held
    assert log.events("u", 1, 1) == EventRange(3, 1, [], [], [])
    assert log.events("nobody", 0, 2) == EventRange(0, 2, [], [], [])
    log.append("u", 3, [f"e{i}" for i in range(3, 9)], list(range(3, 9)), list(range(13, 19)))
    # retention keeps positions 4..8: older ones are left out
    assert log.events("u", 2, 6) == EventRange(9, 4, ["e4", "e5"], [4, 5], [14, 15])
    assert log.events("u", 0, 3) == EventRange(9, 3, [], [], [])
    log.append("v", 0, ["é\x00ü"], [1], [2**53 + 1])
    assert log.event_ranges([("v", 0, 1), ("u", 8, 9), ("v", 0, 0)]) == [
        EventRange(1, 0, ["é\x00ü"], [1], [2**53 + 1]), EventRange(9, 8, ["e8"], [8], [18]), EventRange(1, 0, [], [], [])]
    with pytest.raises(ValueError, match="0 <= start <= stop"):
        log.events("u", 3, 2)
    assert log.event_ranges([]) == []


def test_sqlite_ttl_sweep_with_injected_clock(tmp_path):
    now = [1000.0]
    log = SQLiteEventLog(tmp_path / "ttl.db", ttl_s=10, clock=lambda: now[0])
    try:
        log.append("old", 0, ["a"], [1], [1])
        log.append("kept", 0, ["a"], [1], [1])
        log.append("touched", 0, ["a"], [1], [1])
        now[0] += 6
        log.append("kept", 1, ["b"], [1], [2])
        log.append("touched", 1, [], [], [])  # an empty append renews the user too
        assert log.sweep() == 0
        now[0] += 5  # "old" idle 11 s, the others 5 s
        assert log.stats()["users"] == 3
        assert log.sweep() == 1
        assert log.counts(["old", "kept", "touched"]) == [0, 2, 1]
        assert log.tail("old", 10) == UserLog(0, [], [], [])
        assert log.stats()["users"] == 2
        now[0] += 100
        assert log.sweep() == 2 and log.stats()["users"] == 0
    finally:
        log.close()
    # without a ttl nothing is ever swept
    forever = SQLiteEventLog(tmp_path / "forever.db", clock=lambda: now[0])
    forever.append("u", 0, ["a"], [1], [1])
    now[0] += 10**9
    assert forever.sweep() == 0 and forever.count("u") == 1
    forever.close()


def test_sqlite_ttl_sweep_with_real_clock(tmp_path):
    log = open_event_log(str(tmp_path / "ttl.db"), ttl_s=0.2)
    log.append("u", 0, ["a"], [1], [1])
    assert log.sweep() == 0
    time.sleep(0.3)
    assert log.sweep() == 1 and log.count("u") == 0
    log.close()


def test_redis_keys_carry_ttl_and_expire(request):
    from urllib.parse import urlsplit

    from backend_src.serving.resp import RespConnection

    server = redis_or_skip(request)
    prefix = f"ttl-{uuid.uuid4().hex[:8]}:"
    log = open_event_log(f"{server.url}?prefix={prefix}", ttl_s=0.5)
    client = RespConnection("127.0.0.1", urlsplit(server.url).port)
    keys_now = lambda: sorted(client.execute("KEYS", prefix + "*"))  # noqa: E731
    try:
        log.append("u{1}", 0, ["a", "b"], [1, 2], [1, 2])
        keys = keys_now()
        assert len(keys) == 2  # the count and the events
        assert all(0 < client.execute("PTTL", k) <= 500 for k in keys)
        assert log.sweep() == 0
        time.sleep(0.7)
        assert log.count("u{1}") == 0 and keys_now() == []
        # without a ttl the keys are kept
        forever = open_event_log(f"{server.url}?prefix={prefix}")
        forever.append("v", 0, ["a"], [1], [1])
        assert [client.execute("PTTL", k) for k in keys_now()] == [-1, -1]
        forever.close()
    finally:
        log.close()
        client.close()


# ------------------------------------------------------------------------------ replace, delete
def test_replace_and_delete(open_log):
    log = open_log(retain_events=4)
    log.append("u", 0, ["a", "b", "c"], [1, 2, 3], [1, 2, 3])
    log.append("other", 0, ["o"], [1], [1])
    assert log.replace("u", ["x", "y"], [7, 8], [70, 80]) == 2
    assert log.tail("u", 10) == UserLog(2, ["x", "y"], [7, 8], [70, 80])
    assert log.append("u", 2, ["z"], [9], [90]) == 3
    # replace beyond the retention: count is everything, only the last 4 are kept
    assert log.replace("u", [f"r{i}" for i in range(10)], list(range(10)), list(range(10))) == 10
    assert log.tail("u", 100) == UserLog(10, ["r6", "r7", "r8", "r9"], [6, 7, 8, 9], [6, 7, 8, 9])
    assert log.append("u", 10, ["r10"], [10], [10]) == 11
    assert log.tail("u", 2).items == ["r9", "r10"]
    # replace with nothing empties the log
    assert log.replace("other", [], [], []) == 0 and log.tail("other", 5) == UserLog(0, [], [], [])

    assert log.delete("u") is True
    assert log.tail("u", 100) == UserLog(0, [], [], [])
    assert log.delete("u") is False and log.delete("never-seen") is False
    assert log.append("u", 0, ["fresh"], [1], [1]) == 1  # starts over from 0


def test_sqlite_delete_erases_rows(tmp_path):
    import sqlite3

    path = tmp_path / "del.db"
    log = open_event_log(str(path))
    log.append("gone", 0, ["a", "b"], [1, 2], [1, 2])
    log.append("stays", 0, ["c"], [1], [1])
    log.delete("gone")
    log.close()
    db = sqlite3.connect(path)
    assert db.execute("SELECT COUNT(*) FROM events WHERE user = 'gone'").fetchone()[0] == 0
    assert db.execute("SELECT COUNT(*) FROM users WHERE user = 'gone'").fetchone()[0] == 0
    assert db.execute("SELECT COUNT(*) FROM events").fetchone()[0] == 1
    db.close()


# ------------------------------------------------------------------------------ processes
_CONCURRENT_WORKER = """
import json, sys
from backend_src.serving.event_log import open_event_log, LogConflict
url, tag, users, n, mode = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
log = open_event_log(url)
print("ready", flush=True)
sys.stdin.readline()  # both writers start together, so they really contend
expected = dict(zip(users, log.counts(users)))
done = {u: 0 for u in users}
conflicts = 0
while any(done[u] < n for u in users):
    todo = [u for u in users if done[u] < n]
    if mode == "many":
        results = log.append_many([(u, expected[u], [f"{tag}-{done[u]}"], [done[u]], [done[u]]) for u in todo])
    else:
        results = []
        for u in todo:
            try:
                results.append(log.append(u, expected[u], [f"{tag}-{done[u]}"], [done[u]], [done[u]]))
            except LogConflict as e:
                results.append(e)
    for u, r in zip(todo, results):
        if isinstance(r, LogConflict):
            expected[u] = r.count
            conflicts += 1
        else:
            expected[u] = r
            done[u] += 1
print(conflicts)
"""


def test_two_processes_appending_to_the_same_users(open_log, log_url):
    durable_only(log_url)
    users, n = ["p:1", "p:{2}", "p:ü"], 60
    workers = [_run_python(_CONCURRENT_WORKER, log_url, tag, json.dumps(users), n, mode)
               for tag, mode in (("A", "many"), ("B", "one"))]
    for w in workers:
        assert w.stdout.readline().strip() == "ready", w.stderr.read()
    for w in workers:
        w.stdin.write("go\n")
        w.stdin.flush()
    for w in workers:
        out, err = w.communicate(timeout=60)
        assert w.returncode == 0, err
    log = open_log()
    for tail in log.tails(users, 1000):
        assert tail.count == 2 * n == len(tail.items)
        assert sorted(tail.items) == sorted(f"{t}-{i}" for t in "AB" for i in range(n))  # each exactly once
        for tag in "AB":  # and each writer's events in the order it wrote them
            assert [int(x.split("-")[1]) for x in tail.items if x.startswith(tag)] == list(range(n))


_DURABILITY_WORKER = """
import sys
from backend_src.serving.event_log import open_event_log
log = open_event_log(sys.argv[1])
user = sys.argv[2]
count = log.count(user)
while True:
    count = log.append(user, count, [f"e{count}"], [count % 7], [1_700_000_000 + count])
    print(count, flush=True)  # printed only once acknowledged
"""


def test_acknowledged_events_survive_a_killed_writer(open_log, log_url):
    durable_only(log_url)
    user = "s:durable"
    writer = _run_python(_DURABILITY_WORKER, log_url, user)
    acked = 0
    for line in writer.stdout:
        acked = int(line)
        if acked >= 30:
            break
    assert acked >= 30, writer.stderr.read()
    writer.send_signal(signal.SIGKILL)
    rest, _ = writer.communicate(timeout=30)
    acked = max([acked] + [int(x) for x in rest.split() if x.isdigit()])
    assert writer.returncode == -signal.SIGKILL

    tail = open_log().tail(user, 10**6)
    assert tail.count >= acked
    assert tail.items == [f"e{i}" for i in range(tail.count)]  # nothing lost, nothing twice
    assert tail.timestamps == [1_700_000_000 + i for i in range(tail.count)]


def test_redis_acknowledged_events_survive_a_killed_server(tmp_path):
    if redis_server_binary() is None:
        pytest.skip(NO_REDIS)
    server = RedisServer(tmp_path / "redis").start()
    try:
        log = open_event_log(server.url, retain_events=50)
        users = [f"k:{i}" for i in range(5)]
        expected = {u: 0 for u in users}
        for step in range(20):
            results = log.append_many([(u, expected[u], [f"{u}/{step}"], [step], [2**53 - step]) for u in users])
            assert not any(isinstance(r, LogConflict) for r in results)
            expected = dict(zip(users, results))
        server.kill()
        with pytest.raises(EventLogUnavailable, match=re.escape(server.url)):
            log.counts(users)
        server.start()  # replays the append-only file
        fresh = open_event_log(server.url)
        for u, tail in zip(users, fresh.tails(users, 100)):
            assert tail.count == 20 and tail.items == [f"{u}/{s}" for s in range(20)]
            assert tail.timestamps == [2**53 - s for s in range(20)]
        fresh.close()
        # the old client reconnects; the restarted server lost the scripts and they are reloaded
        assert log.append(users[0], 20, ["after"], [0], [0]) == 21
        assert log.tail(users[0], 1).items == ["after"]
        log.close()
    finally:
        server.stop()
    assert not server.running


# ------------------------------------------------------------------------------ urls
def test_url_forms_and_bad_urls(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for url, path in [
        (f"sqlite://{tmp_path}/abs/a.db", tmp_path / "abs" / "a.db"),
        ("sqlite:rel/dir/b.db", tmp_path / "rel" / "dir" / "b.db"),
        (str(tmp_path / "bare" / "c.db"), tmp_path / "bare" / "c.db"),
        ("plain.db", tmp_path / "plain.db"),
    ]:
        log = open_event_log(url)
        assert log.stats()["backend"] == "sqlite" and path.exists(), url
        log.close()

    for url, message in [
        ("", "empty"),
        ("mysql://db/x", "unsupported event log URL"),
        ("sqlite:", "no file path"),
        ("sqlite://host/x.db", "bad SQLite URL"),
        (":memory:", "not durable"),
        ("redis:localhost", "bad Redis URL"),
        ("redis://", "no host"),
        ("redis://localhost:notaport/0", "port is not a number"),
        ("redis://localhost:6379/zero", "database 'zero' is not a number"),
        ("redis://localhost:6379/0?prefix={bad}", "prefix"),
        ("redis://:secret@localhost:notaport/0", r"\*\*\*"),
    ]:
        with pytest.raises(ValueError, match=message) as err:
            open_event_log(url)
        assert "secret" not in str(err.value)
    with pytest.raises(ValueError, match="retain_events"):
        open_event_log(str(tmp_path / "x.db"), retain_events=0)
    with pytest.raises(ValueError, match="durability"):
        open_event_log(str(tmp_path / "x.db"), durability="sometimes")
    with pytest.raises(ValueError, match="ttl_s"):
        open_event_log(str(tmp_path / "x.db"), ttl_s=0)


def test_unreachable_redis_names_the_url():
    from backend_src.serving.processes import free_port

    url = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    log = open_event_log(url)
    for call in (lambda: log.counts(["u"]), lambda: log.append("u", 0, ["a"], [1], [1]),
                 lambda: log.tails(["u"], 5), lambda: log.delete("u")):
        with pytest.raises(EventLogUnavailable, match=re.escape(f"Redis at {url}")):
            call()
    log.close()


def test_stats(open_log):
    log = open_log(retain_events=8)
    log.append("u", 0, ["a"], [1], [1])
    stats = log.stats()
    assert stats["backend"] in ("sqlite", "redis", "memory") and stats["retain_events"] == 8
    if stats["backend"] == "sqlite":
        assert stats["users"] == 1 and stats["durability"] == "full"
