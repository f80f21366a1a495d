"""The shared event log: per-user keys in Redis (or Redis Cluster: a user's two keys share a hash
tag), each write one Lua script, atomic on the server. Spoken to over RESP (``serving/resp.py``)."""
from __future__ import annotations

import hashlib
import json
from typing import Optional
from urllib.parse import urlsplit, urlunsplit

from backend_src.serving.event_log.base import (
    DEFAULT_REDIS_PREFIX, DEFAULT_RETAIN_EVENTS, EventLog, EventLogUnavailable, EventRange, LogConflict, UserLog,
)

# KEYS: count key, events key. ARGV: expected count, events in the write (may be more than are
# stored: only the last retain_events are sent), retain_events, ttl in ms (0: none), events...
# Returns {1, new count} or {0, the count} when the expected count is not the log's.
_APPEND_LUA = """
local n = tonumber(redis.call('GET', KEYS[1]) or '0')
if n ~= tonumber(ARGV[1]) then return {0, n} end
local total = tonumber(ARGV[2])
for i = 5, #ARGV, 1000 do
  redis.call('RPUSH', KEYS[2], unpack(ARGV, i, math.min(i + 999, #ARGV)))
end
if total > 0 then
  n = redis.call('INCRBY', KEYS[1], total)
  redis.call('LTRIM', KEYS[2], -tonumber(ARGV[3]), -1)
end
local ttl = tonumber(ARGV[4])
if ttl > 0 and n > 0 then
  redis.call('PEXPIRE', KEYS[1], ttl)
  redis.call('PEXPIRE', KEYS[2], ttl)
end
return {1, n}
"""
# ARGV: count, ttl in ms, events... Returns the count.
_REPLACE_LUA = """
redis.call('DEL', KEYS[1], KEYS[2])
if tonumber(ARGV[1]) == 0 then return 0 end
for i = 3, #ARGV, 1000 do
  redis.call('RPUSH', KEYS[2], unpack(ARGV, i, math.min(i + 999, #ARGV)))
end
redis.call('SET', KEYS[1], ARGV[1])
local ttl = tonumber(ARGV[2])
if ttl > 0 then
  redis.call('PEXPIRE', KEYS[1], ttl)
  redis.call('PEXPIRE', KEYS[2], ttl)
end
return tonumber(ARGV[1])
"""
# ARGV: n. Returns {count, the last n events joined by ','} (each event is a JSON array).
_TAIL_LUA = """
local n = tonumber(redis.call('GET', KEYS[1]) or '0')
local want = tonumber(ARGV[1])
if n == 0 or want <= 0 then return {n, ''} end
return {n, table.concat(redis.call('LRANGE', KEYS[2], -want, -1), ',')}
"""

# ARGV: start, stop (positions in the user's whole log). The list holds positions [count - LLEN, count).
# Returns {count, position of the first event returned, those events joined by ','} ('' when none).
_RANGE_LUA = """
local n = tonumber(redis.call('GET', KEYS[1]) or '0')
local first = n - redis.call('LLEN', KEYS[2])
local lo = math.max(tonumber(ARGV[1]), first)
local hi = math.min(tonumber(ARGV[2]), n)
if lo >= hi then return {n, 0, ''} end
return {n, lo, table.concat(redis.call('LRANGE', KEYS[2], lo - first, hi - first - 1), ',')}
"""


def redact_url(url: str) -> str:
    """The URL without its password, for messages."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.rsplit("@", 1)[1]
    user = parts.username or ""
    return urlunsplit(parts._replace(netloc=f"{user}:***@{netloc}"))


class RedisEventLog(EventLog):
    """The shared log: per-user keys in Redis (or Redis Cluster: a user's keys share a hash tag)."""

    def __init__(self, url: str, *, prefix: str = DEFAULT_REDIS_PREFIX,
                 retain_events: int = DEFAULT_RETAIN_EVENTS, ttl_s: Optional[float] = None,
                 durability: str = "full", socket_timeout_s: float = 5.0):
        super().__init__(retain_events=retain_events, ttl_s=ttl_s, durability=durability)
        if "{" in prefix or "}" in prefix:
            raise ValueError(f"the Redis key prefix must not contain '{{' or '}}', got {prefix!r}")
        from backend_src.serving.resp import RespConnection

        self.url = url
        self.prefix = prefix
        self._where = redact_url(url)
        self._ttl_ms = 0 if self.ttl_s is None else max(1, int(round(self.ttl_s * 1000)))
        parts = urlsplit(url)
        self._client = RespConnection(parts.hostname, parts.port or 6379, int(parts.path.strip("/") or 0),
                                      password=parts.password, username=parts.username or None, timeout_s=socket_timeout_s)
        self._scripts = {name: (src, hashlib.sha1(src.encode()).hexdigest())
                         for name, src in (("append", _APPEND_LUA), ("replace", _REPLACE_LUA),
                                           ("tail", _TAIL_LUA), ("range", _RANGE_LUA))}
        self._loaded = False

    def _keys(self, user: str):
        # the user is the hash tag, so a user's two keys live in one cluster slot; braces are
        # escaped so the tag always ends where the user does
        tag = user.replace("%", "%25").replace("{", "%7B").replace("}", "%7D")
        base = f"{self.prefix}{{{tag}}}"
        return base + ":n", base + ":ev"

    def _unavailable(self, e) -> EventLogUnavailable:
        return EventLogUnavailable(f"event log Redis at {self._where} is unavailable: {e}")

    def _call(self, commands) -> list:
        """One pipeline; a lost or refused connection becomes EventLogUnavailable."""
        from backend_src.serving.resp import RespError

        try:
            return self._client.pipeline(commands)
        except (OSError, RespError) as e:  # ConnectionError and socket timeouts are OSErrors
            raise self._unavailable(e) from e

    def _load_scripts(self):
        from backend_src.serving.resp import RespError

        for reply in self._call([("SCRIPT", "LOAD", src) for src, _ in self._scripts.values()]):
            if isinstance(reply, RespError):
                raise self._unavailable(reply)
        self._loaded = True  # registered once; later calls send only the sha

    def _run(self, calls):
        """Send ``calls`` (name, keys, args) as one non-transactional pipeline of EVALSHAs.

        Each script is atomic on the server. If the server lost its scripts (restart), only the
        calls answered NOSCRIPT (which therefore did nothing) are sent again."""
        from backend_src.serving.resp import RespError

        if not self._loaded:
            self._load_scripts()
        results = [None] * len(calls)
        todo = list(range(len(calls)))
        for attempt in range(2):
            answers = self._call([("EVALSHA", self._scripts[calls[i][0]][1], len(calls[i][1]), *calls[i][1], *calls[i][2])
                                  for i in todo])
            retry = []
            for i, answer in zip(todo, answers):
                if isinstance(answer, RespError) and str(answer).startswith("NOSCRIPT") and attempt == 0:
                    retry.append(i)
                elif isinstance(answer, RespError):
                    raise RuntimeError(f"event log Redis at {self._where}: {answer}")
                else:
                    results[i] = answer
            if not retry:
                return results
            self._load_scripts()
            todo = retry
        return results

    @staticmethod
    def _encode(items, actions, timestamps):
        return [json.dumps([i, a, t], ensure_ascii=False, separators=(",", ":"))
                for i, a, t in zip(items, actions, timestamps)]

    def _counts(self, users):
        return [int(v) if v is not None else 0 for v in self._call([("GET", self._keys(u)[0]) for u in users])]

    def _tails(self, users, n):
        answers = self._run([("tail", self._keys(u), (n,)) for u in users])
        out = []
        for count, joined in answers:
            events = json.loads(b"[" + joined + b"]") if joined else []
            out.append(UserLog(int(count), [e[0] for e in events], [e[1] for e in events],
                               [e[2] for e in events]))
        return out

    def _event_ranges(self, reads):
        answers = self._run([("range", self._keys(user), (start, stop)) for user, start, stop in reads])
        out = []
        for (_, _, stop), (count, first, joined) in zip(reads, answers):
            events = json.loads(b"[" + joined + b"]") if joined else []
            out.append(EventRange(int(count), int(first) if events else stop, [e[0] for e in events],
                                  [e[1] for e in events], [e[2] for e in events]))
        return out

    def _append_many(self, writes):
        calls = [("append", self._keys(user),
                  (expected, total, self.retain_events, self._ttl_ms, *self._encode(items, actions, ts)))
                 for user, expected, total, items, actions, ts in writes]
        results = []
        for (user, expected, *_), (applied, count) in zip(writes, self._run(calls)):
            results.append(int(count) if applied else LogConflict(int(count), user, expected))
        return results

    def _replace(self, user, total, items, actions, timestamps):
        args = (total, self._ttl_ms, *self._encode(items, actions, timestamps))
        return int(self._run([("replace", self._keys(user), args)])[0])

    def _delete(self, user):
        return self._call([("DEL", *self._keys(user))])[0] > 0

    def sweep(self) -> int:
        return 0  # keys carry EXPIRE; the server drops them itself

    def stats(self) -> dict:
        keys = self._call([("DBSIZE",)])[0]
        # counting users would need a SCAN of the keyspace: not cheap, so not done
        return {"backend": "redis", "url": self._where, "prefix": self.prefix, "users": None,
                "db_keys": keys, "retain_events": self.retain_events, "ttl_s": self.ttl_s}

    def close(self) -> None:
        self._client.close()
