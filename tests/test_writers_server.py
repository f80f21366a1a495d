"""Concurrent writers on shared sessions through a real server, with forced client timeouts and
retries while a stage's stub and then tritonserver itself are killed: every acknowledged event
is in the log exactly once, and each writer's events in its own order (the fast version of
`python -m perf.bench_writers`)."""
import pytest

from perf.bench_writers import K, GENEROUS_CLIENT, Scenario, SingleServer, publish_model, run_scenario
from serving_helpers import require_tritonserver

pytestmark = pytest.mark.server


def test_writers_on_shared_sessions_every_acknowledged_event_exactly_once(tmp_path):
    require_tritonserver()
    writers = 3
    repo = publish_model(tmp_path, items=writers * K, max_history=32, beam_width=4)
    sc = Scenario("writers_stub_and_server_kill", writers, client=GENEROUS_CLIENT, timeout_fraction=0.2,
                  faults=((3.0, "stub_kill_history_encoder"), (9.0, "server_kill")), seconds_after_faults=8.0)
    with SingleServer(repo, tmp_path / "server", redis=False) as target:
        row = run_scenario(sc, target, sessions=6)
    summary = {k: row[k] for k in ("acknowledged", "events_lost", "events_doubled", "order_violations",
                                   "events_unexpected", "failed_calls", "failures_by_status", "failure_examples")}
    assert row["acknowledged"] >= 50, summary
    assert row["forced_timeouts"] > 0, summary
    assert row["events_lost"] == 0, summary
    assert row["events_doubled"] == 0, summary
    assert row["order_violations"] == 0, summary
    assert row["events_unexpected"] == 0, summary
