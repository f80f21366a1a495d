"""Locust load test of the served recommender: each simulated user replays real user sessions
over gRPC (open with the history, a few appends of one event each, close), one after another.

Runs from its own environment (perf/locust_requirements.txt; no torch there). The sessions come
from a JSON file prepared in the main environment (``python -m perf.served --locust`` does it):

    {"sessions": [{"items": [...], "actions": [...], "timestamps": [...], "open": n}, ...]}

    GENREC_LOCUST_SESSIONS=sessions.json GENREC_LOCUST_OPTIONS='{"top_k": 10}' \\
        .venv-locust/bin/locust -f perf/locustfile.py --headless -u 4 -r 4 --run-time 30s --host 127.0.0.1:8001

Each request is reported under its kind (open / append / close) with its client-side latency.
"""
import json
import os
import random
import sys
import time
import uuid
from pathlib import Path

# gRPC must run on gevent before the Triton client is imported, or locust's users block each other
import grpc.experimental.gevent as grpc_gevent

grpc_gevent.init_gevent()

from locust import User, between, events, task  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: clients, backend_src
from clients.client import RecommenderClient, RecommenderError  # noqa: E402

SESSIONS: list = []
OPTIONS: dict = {}


@events.init.add_listener
def _load_sessions(environment, **_):
    path = os.environ.get("GENREC_LOCUST_SESSIONS")
    if not path:
        raise SystemExit("set GENREC_LOCUST_SESSIONS to a sessions JSON file (perf/served.py --locust writes one)")
    SESSIONS.extend(json.loads(Path(path).read_text())["sessions"])
    OPTIONS.update(json.loads(os.environ.get("GENREC_LOCUST_OPTIONS", "{}")))
    if not SESSIONS:
        raise SystemExit(f"no sessions in {path}")


class SessionUser(User):
    wait_time = between(0.0, 0.05)

    def on_start(self):
        self.client = RecommenderClient(self.host)
        self.rng = random.Random()

    def on_stop(self):
        # without this the gRPC channel keeps locust from exiting after "Shutting down"
        self.client.close()

    def _call(self, name: str, fn, *args, **kwargs):
        t0 = time.perf_counter()
        exc = None
        try:
            return fn(*args, **kwargs)
        except RecommenderError as e:
            exc = e
            return None
        finally:
            events.request.fire(request_type="grpc", name=name, response_time=(time.perf_counter() - t0) * 1e3,
                                response_length=0, exception=exc, context={})

    @task
    def replay_session(self):
        s = self.rng.choice(SESSIONS)
        sid = f"locust-{uuid.uuid4().hex}"
        k = s["open"]
        if self._call("open", self.client.open_session, sid, s["items"][:k], s["actions"][:k], s["timestamps"][:k], **OPTIONS) is None:
            return
        for i in range(k, len(s["items"])):
            if self._call("append", self.client.append, sid, s["items"][i:i + 1], s["actions"][i:i + 1],
                          s["timestamps"][i:i + 1], **OPTIONS) is None:
                break
        self._call("close", self.client.close_session, sid)
