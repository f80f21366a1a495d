"""The durable store of catalog changes (backend_src/serving/catalog_store), every test on each
backend: a SQLite file, the in-process memory store, and a real redis-server started here (skipped
without the binary)."""
import hashlib
import json
import multiprocessing
import os
import pickle
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from backend_src.serving.catalog_store import (
    MAX_CONTENT_BYTES, CatalogChange, CatalogConflict, CatalogEntry, open_catalog_store,
)
from backend_src.serving.event_log import EventLogDamaged, EventLogUnavailable, open_event_log
from backend_src.serving.redis_server import RedisServer, redis_server_binary
import store_helpers
from store_helpers import BACKENDS, NO_REDIS, backend_url, opener, redis_server_fixture

REPO_ROOT = Path(__file__).resolve().parents[1]


redis_server = pytest.fixture(scope="module")(redis_server_fixture)


@pytest.fixture(params=BACKENDS)
def store_url(request, tmp_path):
    return backend_url(request, tmp_path, "store")


def durable_only(url: str) -> None:
    store_helpers.durable_only(url, "store")


@pytest.fixture
def open_store(store_url):
    yield from opener(lambda **options: open_catalog_store(store_url, **options))


def entry(item_id, text=None, d=8, seed=0.0):
    return CatalogEntry(item_id, {"text": text or f"about {item_id}", "attributes": [3, len(item_id)]},
                        np.arange(d, dtype=np.float32) * 0.5 + seed)


def canonical_hash(content) -> str:
    text = json.dumps(content, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def assert_read_back(got: CatalogEntry, given: CatalogEntry, version: int) -> None:
    assert (got.item_id, got.content, got.content_hash, got.version) == \
        (given.item_id, given.content, given.content_hash, version)
    assert got.embedding.dtype == np.float32 and np.array_equal(got.embedding, given.embedding)


def snapshot(store):
    return store.version(), store.list(limit=1000), store.changes(0), store.stats()


# ------------------------------------------------------------------------------ entries
def test_entry_derives_its_hash_and_keeps_its_own_copies():
    content = {"text": "Blade Runner", "attributes": [4, 17], "vector": [0.25, -1.5]}
    emb = np.array([1.0, 2.0, 3.5], dtype=np.float64)
    e = CatalogEntry("i:42", content, emb)
    assert e.content_hash == canonical_hash(content) and e.version == 0
    assert e.content_hash == CatalogEntry("i:42", dict(reversed(list(content.items()))), emb).content_hash
    assert e.embedding.dtype == np.float32 and not e.embedding.flags.writeable
    content["text"] = "changed"
    emb[0] = 9.0
    assert e.content["text"] == "Blade Runner" and e.embedding[0] == 1.0  # the caller's objects are not kept
    assert e == CatalogEntry("i:42", {"vector": [0.25, -1.5], "attributes": [4, 17], "text": "Blade Runner"},
                             [1.0, 2.0, 3.5])
    assert e != CatalogEntry("i:42", e.content, [1.0, 2.0, 3.0])
    assert CatalogEntry("é" * 128, {}, [0.0]).item_id == "é" * 128  # 256 bytes of UTF-8: the limit


@pytest.mark.parametrize("item_id, content, embedding, message", [
    ("", {}, [1.0], "non-empty str"),
    (7, {}, [1.0], "non-empty str"),
    ("é" * 129, {}, [1.0], "258 bytes"),
    ("\ud800", {}, [1.0], "UTF-8"),
    ("x", ["text"], [1.0], "must be a dict"),
    ("x", {"n": np.int64(3)}, [1.0], "not JSON-able"),
    ("x", {"vector": [float("nan")]}, [1.0], "not JSON-able"),
    ("x", {"text": "a" * MAX_CONTENT_BYTES}, [1.0], "over the limit"),
    ("x", {}, np.ones((2, 2), np.float32), "1-D"),
    ("x", {}, np.array([], np.float32), "1-D"),
    ("x", {}, np.array([1, 2]), "float array"),
    ("x", {}, [1.0, float("inf")], "not finite"),
    ("x", {}, np.array([1e39]), "not finite"),  # overflows float32
])
def test_bad_entries_are_refused(item_id, content, embedding, message):
    with pytest.raises(ValueError, match=message):
        CatalogEntry(item_id, content, embedding)


# ------------------------------------------------------------------------------ commits and replay
def test_versions_are_consecutive_and_changes_replay_exactly(open_store):
    ticks = iter(range(1_700_000_000, 1_700_001_000))
    store = open_store(clock=lambda: next(ticks) + 0.25)
    assert store.version() == 0 and store.changes(0) == [] and store.stats()["version"] == 0
    a, b = entry("a"), entry("b", d=3, seed=-2.0)
    odd = CatalogEntry("ü🎬{x}} " * 15, {"text": "naïve\n\"quoted\"", "attributes": [1, 2**40]},
                       np.linspace(-1, 1, 5, dtype=np.float32))
    assert store.commit([a, b], []) == 1
    assert store.commit([], ["trained-7"]) == 2  # a trained item the store never saw: recorded as given
    assert store.commit([odd], ["a"]) == 3
    assert store.version() == 3

    changes = store.changes(0)
    assert [(c.version, c.time) for c in changes] == [(1, 1_700_000_000.25), (2, 1_700_000_001.25),
                                                      (3, 1_700_000_002.25)]
    assert changes[1] == CatalogChange(2, (), ("trained-7",), 1_700_000_001.25)
    assert [c.retires for c in changes] == [(), ("trained-7",), ("a",)]
    assert [len(c.adds) for c in changes] == [2, 0, 1]
    for got, given in zip(changes[0].adds, (a, b)):
        assert_read_back(got, given, 1)
    assert_read_back(changes[2].adds[0], odd, 3)
    assert changes[2].adds[0].content_hash == canonical_hash(odd.content)

    assert store.changes(1) == changes[1:] and store.changes(2) == changes[2:]
    assert store.changes(0, limit=2) == changes[:2] and store.changes(1, limit=1) == changes[1:2]
    assert store.changes(2, limit=50) == changes[2:]
    assert store.changes(3) == [] and store.changes(99) == [] and store.changes(0, limit=0) == []
    for bad in (-1, 1.5, "0"):
        with pytest.raises(ValueError, match="since"):
            store.changes(bad)
    with pytest.raises(ValueError, match="limit"):
        store.changes(0, limit=-1)


def test_changes_that_change_nothing_make_no_version(open_store):
    store = open_store()
    a, b = entry("a"), entry("b")
    assert store.commit([a, b], ["t1"]) == 1
    # the same content with its keys in another order, and another embedding: same content_hash
    same_a = CatalogEntry("a", dict(reversed(list(a.content.items()))), a.embedding + 1)
    assert store.commit([same_a], []) == 1
    assert store.commit([], ["t1"]) == 1  # already retired
    assert store.commit([a, b], ["t1"]) == 1
    assert store.commit([], []) == 1
    assert store.version() == 1 and len(store.changes(0)) == 1
    assert store.get(["a"])["a"]["version"] == 1
    # only the parts that change something are recorded
    c = entry("c")
    assert store.commit([a, c], ["t1", "b", "t2"]) == 2
    change = store.changes(1)[0]
    assert [x.item_id for x in change.adds] == ["c"] and change.retires == ("b", "t2")
    assert store.commit([a, c], ["t1", "b", "t2"]) == 2  # sent again (a lost reply): a no-op


def test_conflicting_content_needs_replace(open_store):
    store = open_store()
    old, new = entry("x", "old"), entry("x", "new")
    assert store.commit([old], []) == 1
    with pytest.raises(CatalogConflict, match="'x'") as err:
        store.commit([entry("y"), new, entry("z")], ["w"])
    assert isinstance(err.value, ValueError) and err.value.item_id == "x"
    assert pickle.loads(pickle.dumps(err.value)).item_id == "x"
    # nothing of that change was written, before or after the conflicting add
    assert store.version() == 1 and store.get(["y", "z", "w"]) == {}
    assert store.get(["x"])["x"]["content"] == old.content

    assert store.commit([new, entry("y")], [], replace=True) == 2
    change = store.changes(1)[0]
    assert [a.item_id for a in change.adds] == ["x", "y"] and change.retires == ()
    assert_read_back(change.adds[0], new, 2)
    assert store.get(["x"]) == {"x": {"item_id": "x", "status": "live", "version": 2, "content": new.content,
                                      "content_hash": new.content_hash}}
    assert store.commit([new], [], replace=True) == 2  # the same content: nothing to replace
    assert store.stats()["live"] == 2


def test_retire_and_re_add(open_store):
    store = open_store()
    first, second = entry("r", "first"), entry("r", "second", d=4)
    assert store.commit([first], []) == 1
    assert store.commit([], ["r"]) == 2
    assert store.get(["r"])["r"] == {"item_id": "r", "status": "retired", "version": 2, "content": first.content,
                                     "content_hash": first.content_hash}  # a retired item keeps its last content
    assert store.commit([], ["r"]) == 2
    assert store.commit([second], []) == 3  # re-activated, with new content
    assert store.get(["r"])["r"] == {"item_id": "r", "status": "live", "version": 3, "content": second.content,
                                     "content_hash": second.content_hash}
    with pytest.raises(CatalogConflict):  # the old content, now that the id is live with other content
        store.commit([first], [])
    # a trained item, retired without ever being added, then added
    assert store.commit([], ["trained"]) == 4
    assert store.get(["trained"])["trained"] == {"item_id": "trained", "status": "retired", "version": 4,
                                                 "content": None, "content_hash": None}
    assert store.commit([entry("trained")], []) == 5 and store.get(["trained"])["trained"]["status"] == "live"
    changes = store.changes(0)
    assert [([a.item_id for a in c.adds], c.retires) for c in changes] == [
        (["r"], ()), ([], ("r",)), (["r"], ()), ([], ("trained",)), (["trained"], ())]
    assert_read_back(changes[2].adds[0], second, 3)


def test_list_get_and_stats(open_store):
    store = open_store()
    assert store.list() == [] and store.stats()["live"] == 0 and store.get(["nope"]) == {}
    # ids whose order differs between naive orderings: upper case, accented, long
    assert store.commit([entry("b"), entry("é"), entry("Z"), entry("a")], []) == 1
    assert store.commit([], ["b", "t"]) == 2
    assert store.commit([entry("d")], []) == 3
    ordered = [(i["item_id"], i["status"], i["version"]) for i in store.list()]
    assert ordered == [("Z", "live", 1), ("a", "live", 1), ("é", "live", 1), ("b", "retired", 2),
                       ("t", "retired", 2), ("d", "live", 3)]  # by version, then id (UTF-8 bytes)
    assert [i["item_id"] for i in store.list(status="live")] == ["Z", "a", "é", "d"]
    assert [i["item_id"] for i in store.list(status="retired")] == ["b", "t"]
    assert [i["item_id"] for i in store.list(offset=2, limit=3)] == ["é", "b", "t"]
    assert [i["item_id"] for i in store.list(offset=1, limit=1, status="retired")] == ["t"]
    assert store.list(offset=6) == [] and store.list(limit=0) == []
    assert store.list(limit=1)[0] == store.get(["Z"])["Z"]
    assert list(store.get(["d", "missing", "a", "d"])) == ["d", "a"]
    stats = store.stats()
    assert (stats["version"], stats["live"], stats["retired"]) == (3, 4, 2)
    with pytest.raises(ValueError, match="status"):
        store.list(status="gone")
    with pytest.raises(ValueError, match="offset"):
        store.list(offset=-1)
    with pytest.raises(ValueError, match="non-empty"):
        store.get([""])


def test_bad_commits_write_nothing(open_store):
    store = open_store()
    assert store.commit([entry("keep")], ["old"]) == 1
    before = snapshot(store)
    good = [entry("g1"), entry("g2")]
    for adds, retires, options, message in [
        (good + [entry("g1", "again")], [], {}, "added twice"),
        (good, ["t", "g2"], {}, "both added and retired"),
        (good, ["t", "t"], {}, "retired twice"),
        (good, ["t", ""], {}, "non-empty str"),
        (good, ["t", "é" * 129], {}, "258 bytes"),
        (good, ["t", 7], {}, "non-empty str"),
        (good + [{"item_id": "g3"}], [], {}, "CatalogEntry"),
        (good, ["t1", "t2"], {"max_items": 3}, "at most 3"),
        (good, ["t"], {"max_items": 0}, "max_items"),
        (entry("g1"), [], {}, "list"),
        (good, "t", {}, "list"),
        ([entry("keep", "other content")] + good, ["t"], {}, "'keep' is live with other content"),
    ]:
        with pytest.raises(ValueError, match=message):
            store.commit(adds, retires, **options)
        assert snapshot(store) == before, message
    assert store.commit(good, ["t"], max_items=3) == 2  # exactly the limit


def test_a_10000_item_change(open_store, capsys):
    store = open_store()
    n = 10_000
    t0 = time.perf_counter()
    adds = [CatalogEntry(f"item-{j:05d}", {"text": f"title {j}", "attributes": [j % 7, j]},
                         np.full(32, j / 7, dtype=np.float32)) for j in range(n)]
    t1 = time.perf_counter()
    assert store.commit(adds, []) == 1
    t2 = time.perf_counter()
    (change,) = store.changes(0)
    t3 = time.perf_counter()
    assert change.version == 1 and len(change.adds) == n and change.retires == ()
    assert [a.item_id for a in change.adds] == [a.item_id for a in adds]
    for j in (0, 1, 4097, n - 1):
        assert_read_back(change.adds[j], adds[j], 1)
    got = store.get([a.item_id for a in adds])
    assert len(got) == n and got["item-09999"]["content"] == {"text": "title 9999", "attributes": [3, 9999]}
    assert store.stats()["live"] == n
    with pytest.raises(ValueError, match="at most 10000"):
        store.commit([], [f"t{j}" for j in range(n + 1)])
    t4 = time.perf_counter()
    assert store.commit([], [a.item_id for a in adds]) == 2
    t5 = time.perf_counter()
    assert store.changes(1)[0].retires == tuple(a.item_id for a in adds)
    assert store.stats()["live"] == 0 and store.stats()["retired"] == n
    with capsys.disabled():
        print(f"\n  {store.stats()['backend']}: 10,000 entries made {t1 - t0:.2f} s, added {t2 - t1:.2f} s, "
              f"read back {t3 - t2:.2f} s, retired {t5 - t4:.2f} s")


# ------------------------------------------------------------------------------ durability, processes
def test_durable_across_close_and_reopen(open_store, store_url):
    durable_only(store_url)
    store = open_store()
    store.commit([entry("a"), entry("b", d=5)], ["t"])
    store.commit([entry("a", "new")], ["b"], replace=True)
    before = snapshot(store)
    store.close()
    again = open_store()
    assert snapshot(again) == before
    assert again.commit([entry("c")], []) == 3 and again.get(["c"])["c"]["version"] == 3


def _commit_worker(url, tag, n, barrier, results):
    store = open_catalog_store(url)
    barrier.wait(60)  # both commit together, so they really contend
    versions = []
    for k in range(n):
        versions.append(store.commit([entry(f"{tag}-{k}", seed=k)], [f"{tag}-gone-{k}"]))
        time.sleep(random.uniform(0, 0.01))  # a moment for the other process, so their commits interleave
    store.close()
    results.put((tag, versions))


def test_two_processes_commit_concurrently(open_store, store_url):
    durable_only(store_url)
    n = 25
    ctx = multiprocessing.get_context("spawn")
    barrier, results = ctx.Barrier(2), ctx.Queue()
    workers = [ctx.Process(target=_commit_worker, args=(store_url, tag, n, barrier, results)) for tag in "AB"]
    for w in workers:
        w.start()
    got = dict(results.get(timeout=120) for _ in workers)
    for w in workers:
        w.join(30)
    assert [w.exitcode for w in workers] == [0, 0]

    assert sorted(got["A"] + got["B"]) == list(range(1, 2 * n + 1))  # distinct, consecutive
    store = open_store()
    assert store.version() == 2 * n
    changes = {c.version: c for c in store.changes(0)}
    for tag, versions in got.items():
        assert versions == sorted(versions)
        for k, v in enumerate(versions):  # each change present exactly as its process committed it
            assert [a.item_id for a in changes[v].adds] == [f"{tag}-{k}"]
            assert changes[v].retires == (f"{tag}-gone-{k}",)
            assert_read_back(changes[v].adds[0], entry(f"{tag}-{k}", seed=k), v)
    stats = store.stats()
    assert (stats["live"], stats["retired"]) == (2 * n, 2 * n)


_KILLED_WRITER = """
import sys
import numpy as np
from backend_src.serving.catalog_store import CatalogEntry, open_catalog_store
store = open_catalog_store(sys.argv[1])
tag = sys.argv[2]
adds = [CatalogEntry(f"{tag}-{j}", {"text": f"item {j}"}, np.full(16, j, np.float32)) for j in range(10_000)]
ids = [a.item_id for a in adds]
print("ready", flush=True)
for k in range(1000):  # 10,000 adds, then the same 10,000 retired, again and again
    print(store.commit(adds, []) if k % 2 == 0 else store.commit([], ids), flush=True)
"""


def test_sqlite_killed_commit_leaves_nothing_or_the_whole_change(tmp_path):
    url = f"sqlite://{tmp_path}/killed.db"
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    rng = random.Random(7)
    acked = 0
    for round_ in range(4):
        writer = subprocess.Popen([sys.executable, "-c", _KILLED_WRITER, url, f"r{round_}"], cwd=REPO_ROOT, env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert writer.stdout.readline().strip() == "ready", writer.stderr.read()
        time.sleep(rng.uniform(0.05, 0.8))
        writer.send_signal(signal.SIGKILL)
        out, _ = writer.communicate(timeout=30)
        assert writer.returncode == -signal.SIGKILL
        acked = max([acked] + [int(x) for x in out.split() if x.isdigit()])

    with open_catalog_store(url) as store:
        version = store.version()
        assert version >= acked  # every acknowledged change survived
        changes = store.changes(0)
        assert [c.version for c in changes] == list(range(1, version + 1))
        live = {}
        for c in changes:  # every change whole: all 10,000 adds or all 10,000 retires of one writer
            tag = (c.adds[0].item_id if c.adds else c.retires[0]).split("-")[0]
            ids = [f"{tag}-{j}" for j in range(10_000)]
            assert ([a.item_id for a in c.adds], c.retires) in ((ids, ()), ([], tuple(ids)))
            assert all(a.embedding[0] == int(a.item_id.split("-")[1]) for a in c.adds[::997])
            live[tag] = bool(c.adds)
        stats = store.stats()
        assert stats["live"] == 10_000 * sum(live.values())
        assert stats["retired"] == 10_000 * (len(live) - sum(live.values()))
        for tag, is_live in live.items():
            assert store.get([f"{tag}-9999"])[f"{tag}-9999"]["status"] == ("live" if is_live else "retired")
        assert store.commit([entry("after")], []) == version + 1  # writable after the kills


def test_redis_changes_survive_a_killed_server_and_lost_scripts(tmp_path):
    if redis_server_binary() is None:
        pytest.skip(NO_REDIS)
    from backend_src.serving.resp import RespConnection

    server = RedisServer(tmp_path / "redis").start()
    try:
        store = open_catalog_store(server.url)
        assert store.commit([entry("a"), entry("b")], ["t"]) == 1
        assert store.commit([], ["a"]) == 2
        before = snapshot(store)
        RespConnection("127.0.0.1", server.port).execute("SCRIPT", "FLUSH")
        assert store.commit([entry("c")], []) == 3  # the script is sent again
        before = snapshot(store)
        server.kill()
        with pytest.raises(EventLogUnavailable, match=re.escape(server.url)):
            store.version()
        server.start()  # replays the append-only file
        with open_catalog_store(server.url) as fresh:
            assert snapshot(fresh) == before
        assert store.commit([entry("d")], []) == 4  # the old client reconnects
        store.close()
    finally:
        server.stop()


# ------------------------------------------------------------------------------ the event log's store
def test_shares_the_event_logs_store(store_url):
    durable_only(store_url)
    log = open_event_log(store_url)
    store = open_catalog_store(store_url)
    try:
        assert log.append("i:1", 0, ["a", "b"], [1, 2], [10, 20]) == 2
        assert store.commit([entry("a")], ["b"]) == 1
        assert log.append("i:1", 2, ["c"], [3], [30]) == 3
    finally:
        store.close()
        log.close()
    log = open_event_log(store_url)  # verifies the SQLite file at open
    store = open_catalog_store(store_url)
    try:
        assert log.tail("i:1", 10).items == ["a", "b", "c"]
        assert store.version() == 1 and store.get(["a"])["a"]["status"] == "live"
        if log.stats()["backend"] == "sqlite":
            assert log.stats()["users"] == 1
    finally:
        store.close()
        log.close()


# ------------------------------------------------------------------------------ urls and errors
def test_url_forms_and_bad_urls(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for url, path in [
        (f"sqlite://{tmp_path}/abs/a.db", tmp_path / "abs" / "a.db"),
        ("sqlite:rel/dir/b.db", tmp_path / "rel" / "dir" / "b.db"),
        (str(tmp_path / "bare" / "c.db"), tmp_path / "bare" / "c.db"),
    ]:
        with open_catalog_store(url) as store:
            assert store.stats()["backend"] == "sqlite" and path.exists(), url
    with open_catalog_store("memory:") as store:
        assert store.stats()["backend"] == "memory"
    for url, message in [
        ("", "empty"),
        ("mysql://db/x", "unsupported catalog store URL"),
        ("sqlite:", "no file path"),
        ("sqlite://host/x.db", "bad SQLite URL"),
        (":memory:", "not durable"),
        ("rediss://host:1/0", "TLS"),
        ("redis:localhost", "bad Redis URL"),
        ("redis://", "no host"),
        ("redis://localhost:notaport/0", "port is not a number"),
        ("redis://localhost:6379/0?prefix={bad}", "prefix"),
        ("redis://:secret@localhost:notaport/0", r"\*\*\*"),
    ]:
        with pytest.raises(ValueError, match=message) as err:
            open_catalog_store(url)
        assert "secret" not in str(err.value)
    with pytest.raises(ValueError, match="durability"):
        open_catalog_store(str(tmp_path / "x.db"), durability="sometimes")


def test_unreachable_redis_names_the_url():
    from backend_src.serving.processes import free_port

    url = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    store = open_catalog_store(url)
    for call in (store.version, lambda: store.commit([entry("a")], []), lambda: store.changes(0),
                 lambda: store.get(["a"]), store.list, store.stats):
        with pytest.raises(EventLogUnavailable, match=re.escape(f"Redis at {url}")):
            call()
    store.close()


def test_damaged_sqlite_file(tmp_path):
    garbage = tmp_path / "garbage.db"
    garbage.write_bytes(b"this is not a database" * 500)
    with pytest.raises(EventLogDamaged, match=re.escape(str(garbage))):
        open_catalog_store(str(garbage))

    path = tmp_path / "damaged.db"
    with open_catalog_store(str(path)) as store:
        store.commit([CatalogEntry(f"i{j}", {"text": "x" * 500}, np.ones(64, np.float32)) for j in range(2000)], [])
    data = bytearray(path.read_bytes())
    data[8192:] = b"\xff" * (len(data) - 8192)  # every page after the second
    path.write_bytes(bytes(data))
    with pytest.raises(EventLogDamaged, match="damaged"):
        with open_catalog_store(str(path)) as store:
            store.changes(0)
