"""What the tests of the event log and of the catalog store beside it share: a module's real redis-server
(skipped without the binary), one URL per backend with a fresh key space, and an opener that closes what
it opened."""
import uuid

import pytest

from backend_src.serving.redis_server import RedisServer, redis_server_binary

NO_REDIS = "redis-server binary not found on PATH (apt-get install redis-server)"
BACKENDS = ["sqlite", "redis", "memory"]


def redis_or_skip(request) -> RedisServer:
    """The module's `redis_server` fixture, or a skip when redis-server is not installed."""
    if redis_server_binary() is None:
        pytest.skip(NO_REDIS)
    return request.getfixturevalue("redis_server")


def redis_server_fixture(tmp_path_factory):
    """Body of a module-scoped `redis_server` fixture: one real server for the module."""
    if redis_server_binary() is None:
        pytest.skip(NO_REDIS)
    with RedisServer(tmp_path_factory.mktemp("redis")) as server:
        yield server


def backend_url(request, tmp_path, folder: str) -> str:
    """The URL of request.param's backend: a SQLite file under tmp_path/folder, the memory backend, or the
    module's Redis under a fresh key prefix."""
    if request.param == "sqlite":
        return f"sqlite://{tmp_path}/{folder}/events.db"
    if request.param == "memory":
        return "memory:"
    return f"{redis_or_skip(request).url}?prefix=test-{uuid.uuid4().hex[:8]}:"  # a fresh key space per test


def durable_only(url: str, what: str) -> None:
    if url == "memory:":
        pytest.skip(f"the memory {what} lives in one object: not shared between processes or openings")


def opener(open_fn):
    """Body of a fixture giving `open_fn` (keyword options -> a store), everything it opened closed after."""
    opened = []

    def _open(**options):
        opened.append(open_fn(**options))
        return opened[-1]

    yield _open
    for store in opened:
        store.close()
