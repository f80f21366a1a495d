"""The watchdog's probe of the event log (serving/log_probe.py), without a server: a write and a
read of a reserved key tell whether the log takes writes; the key is never a session's nor counted."""
import os

import pytest

from backend_src.serving.event_log import PROBE_KEY, open_event_log
from backend_src.serving.event_log import sqlite_path
from backend_src.serving.log_probe import LogProbe
from backend_src.serving.redis_server import RedisServer, redis_server_binary
from genrec_contract import protocol as P


def probed(url) -> dict:
    probe = LogProbe(lambda: url)
    probe.probe_once()
    return probe.state(0)[1]


def test_probe_of_a_sqlite_log_says_when_it_is_damaged_and_is_not_counted(tmp_path):
    path = tmp_path / "events.sqlite3"
    with open_event_log(path) as log:
        log.append("s:a", 0, ["1", "2"], [0, 0], [1, 2])
    assert probed(str(path)) == {"ok": True, "where": str(path), "error": None, "checked_s_ago": 0.0}
    with open_event_log(path) as log:
        assert log.stats()["users"] == 1 and log.count(PROBE_KEY) == 1
    assert PROBE_KEY not in {P.session_key("~probe:readiness"), P.session_key(1)}
    data = bytearray(path.read_bytes())
    data[4096:] = os.urandom(len(data) - 4096)
    path.write_bytes(bytes(data))
    state = probed(str(path))
    assert not state["ok"] and "damaged" in state["error"], state


def test_probe_of_a_redis_log_follows_the_server(tmp_path):
    if redis_server_binary() is None:
        pytest.skip("needs Debian's redis-server")
    redis = RedisServer(tmp_path / "redis").start()
    try:
        probe = LogProbe(lambda: redis.url)
        probe.probe_once()
        assert probe.state(0)[0]
        redis.stop()
        probe.probe_once()
        ok, body = probe.state(0)
        assert not ok and "unavailable" in body["error"], body
        redis.start()
        probe.probe_once()
        assert probe.state(0)[0]
    finally:
        redis.stop()


def test_sqlite_path_of_each_url_form():
    assert sqlite_path("sqlite:///abs/e.db") == "/abs/e.db" and sqlite_path("sqlite:rel/e.db") == "rel/e.db"
    assert sqlite_path("/abs/e.db") == "/abs/e.db" and sqlite_path("redis://h:1/0") is None and sqlite_path(None) is None
    assert sqlite_path("/data/a:b.db") == "/data/a:b.db" and sqlite_path("memory:") is None  # as open_event_log reads them
