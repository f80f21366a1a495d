"""The client library's default retries, on a clock of its own: they outlast an outage of a server
restart's length, stop at their time budget, back off with jitter under a cap, and the attempt
count can still be capped. (tests/test_log_health_server.py checks the same against a real server.)"""
import numpy as np
import pytest

pytest.importorskip("tritonclient.grpc")

import clients.client as client_module  # noqa: E402
from clients.client import RecommenderClient, RecommenderError  # noqa: E402
from tritonclient.utils import InferenceServerException  # noqa: E402


class FakeClock:
    def __init__(self):
        self.now = 1000.0
        self.sleeps = []

    def monotonic(self):
        return self.now

    def perf_counter(self):
        return self.now

    def time(self):
        return self.now

    def sleep(self, s):
        self.sleeps.append(s)
        self.now += s


class Result:
    def as_numpy(self, name):
        return np.array([[3]], np.int64)


def server_down_until(clock, up_at: float, calls: list):
    def infer(model, inputs, **kw):
        calls.append((clock.now, kw["client_timeout"]))
        clock.now += 0.01
        if clock.now < up_at:
            raise InferenceServerException("failed to connect to all addresses", status="StatusCode.UNAVAILABLE")
        return Result()

    return infer


@pytest.fixture
def clock(monkeypatch):
    c = FakeClock()
    monkeypatch.setattr(client_module, "time", c)
    return c


def test_default_retries_outlast_a_server_restart(clock):
    calls = []
    with RecommenderClient("127.0.0.1:1") as c:
        c._client.infer = server_down_until(clock, clock.now + 6.0, calls)  # a restart takes about 5 s
        c.close_session("u1")  # answered once the server is back
    assert len(calls) > 2 and calls[-1][0] >= 1006.0
    assert max(clock.sleeps) <= 2.0 and len(set(clock.sleeps)) == len(clock.sleeps)  # capped, jittered


def test_default_retries_stop_at_their_budget_and_never_run_past_it(clock):
    calls = []
    with RecommenderClient("127.0.0.1:1", timeout_s=10) as c:
        c._client.infer = server_down_until(clock, float("inf"), calls)
        t0 = clock.now
        with pytest.raises(RecommenderError, match="UNAVAILABLE"):
            c.close_session("u1")
    assert 25.0 <= clock.now - t0 <= 30.0 + 0.05
    assert all(start + timeout <= t0 + 30.0 + 1e-6 for start, timeout in calls[1:])  # retries end by the deadline
    assert calls[0][1] == 10  # the first attempt has the whole timeout


def test_the_attempt_count_can_still_be_capped(clock):
    calls = []
    with RecommenderClient("127.0.0.1:1", retries=2) as c:
        c._client.infer = server_down_until(clock, float("inf"), calls)
        with pytest.raises(RecommenderError):
            c.close_session("u1")
    assert len(calls) == 3


def test_a_request_that_is_not_safe_to_send_again_is_not_retried(clock):
    calls = []
    with RecommenderClient("127.0.0.1:1") as c:
        c._client.infer = server_down_until(clock, float("inf"), calls)
        with pytest.raises(RecommenderError):  # a whole history that replaces the session's: not idempotent
            c.recommend_history("u1", ["a"], timestamps=[1])
    assert len(calls) == 1
