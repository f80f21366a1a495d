"""The shared catalog store: keys ``<prefix>catalog:{catalog}:*`` in the event log's Redis database,
each commit one Lua script, atomic on the server. Spoken to over RESP (``serving/resp.py``)."""
from __future__ import annotations

import hashlib
import json
import struct
import time
from typing import Callable
from urllib.parse import urlsplit

from backend_src.serving.catalog_store.base import (
    LIVE, RETIRED, CatalogChange, CatalogConflict, CatalogEntry, CatalogStore, _embedding, _item,
)
from backend_src.serving.event_log import DEFAULT_REDIS_PREFIX, EventLogUnavailable
from backend_src.serving.event_log.redis_log import redact_url
from backend_src.serving.resp import RespConnection, RespError

# KEYS[1]: the key base. ARGV: time, replace (1/0), number of adds n, then per add: id, content
# hash, record; then per retire: id, record. Checks every rule before it writes anything.
# Returns {0, id} for a conflict, {1, version} when nothing changes, {2, new version}.
# Keys: version; items (hash id -> JSON {s: status, v: version, h: content hash, a, p: where its
# last add is}); change:<v> (hash t: time, r: retire records); adds:<v> (list of add records);
# all, live, retired (sorted sets id by version: equal versions order by id).
_COMMIT_LUA = """
local base = KEYS[1]
local items = base .. 'items'
local version = tonumber(redis.call('GET', base .. 'version') or '0')
local new = version + 1
local n = tonumber(ARGV[3])
local add_ids, add_hashes, add_records = {}, {}, {}
for i = 0, n - 1 do
  local id, h = ARGV[4 + 3 * i], ARGV[5 + 3 * i]
  local cur = redis.call('HGET', items, id)
  cur = cur and cjson.decode(cur)
  if not (cur and cur.s == 'live' and cur.h == h) then
    if cur and cur.s == 'live' and ARGV[2] ~= '1' then return {0, id} end
    add_ids[#add_ids + 1] = id
    add_hashes[#add_hashes + 1] = h
    add_records[#add_records + 1] = ARGV[6 + 3 * i]
  end
end
local ret_ids, ret_records, ret_old = {}, {}, {}
for j = 4 + 3 * n, #ARGV, 2 do
  local cur = redis.call('HGET', items, ARGV[j])
  cur = cur and cjson.decode(cur)
  if not (cur and cur.s == 'retired') then
    ret_ids[#ret_ids + 1] = ARGV[j]
    ret_records[#ret_records + 1] = ARGV[j + 1]
    ret_old[#ret_old + 1] = cur or {}
  end
end
if #add_ids == 0 and #ret_ids == 0 then return {1, version} end
redis.call('SET', base .. 'version', new)
redis.call('HSET', base .. 'change:' .. new, 't', ARGV[1], 'r', table.concat(ret_records))
for i = 1, #add_records, 1000 do
  redis.call('RPUSH', base .. 'adds:' .. new, unpack(add_records, i, math.min(i + 999, #add_records)))
end
for i, id in ipairs(add_ids) do
  redis.call('HSET', items, id, cjson.encode({s = 'live', v = new, h = add_hashes[i], a = new, p = i - 1}))
  redis.call('ZADD', base .. 'all', new, id)
  redis.call('ZADD', base .. 'live', new, id)
  redis.call('ZREM', base .. 'retired', id)
end
for i, id in ipairs(ret_ids) do
  local old = ret_old[i]
  redis.call('HSET', items, id, cjson.encode({s = 'retired', v = new, h = old.h, a = old.a, p = old.p}))
  redis.call('ZADD', base .. 'all', new, id)
  redis.call('ZADD', base .. 'retired', new, id)
  redis.call('ZREM', base .. 'live', id)
end
return {2, new}
"""
_VERSIONS_PER_READ = 64  # changes per pipeline of changes()


def _pack(*parts: bytes) -> bytes:
    """Length-prefixed parts: a record the script stores as given and ``_unpack`` splits."""
    return b"".join(struct.pack("<I", len(p)) + p for p in parts)


def _unpack(buf) -> list:
    view, out, pos = memoryview(buf), [], 0
    while pos < len(view):
        (size,) = struct.unpack_from("<I", view, pos)
        out.append(view[pos + 4:pos + 4 + size])
        pos += 4 + size
    return out


class RedisCatalogStore(CatalogStore):
    """Keys ``<prefix>catalog:{catalog}:*`` in the event log's Redis database; each commit one Lua
    script. The change's time is this process's clock."""

    def __init__(self, url: str, *, prefix: str = DEFAULT_REDIS_PREFIX, socket_timeout_s: float = 5.0,
                 clock: Callable[[], float] = time.time):
        if "{" in prefix or "}" in prefix:
            raise ValueError(f"the Redis key prefix must not contain '{{' or '}}', got {prefix!r}")
        self.url, self.prefix = url, prefix
        self._where = redact_url(url)
        self._base = f"{prefix}catalog:{{catalog}}:"
        self._clock = clock
        self._sha = hashlib.sha1(_COMMIT_LUA.encode()).hexdigest()
        parts = urlsplit(url)
        self._client = RespConnection(parts.hostname, parts.port or 6379, int(parts.path.strip("/") or 0),
                                      password=parts.password, username=parts.username or None,
                                      timeout_s=socket_timeout_s)

    def _call(self, commands) -> list:
        """One pipeline; a lost or refused connection becomes EventLogUnavailable, an error reply RuntimeError."""
        try:
            replies = self._client.pipeline(commands)
        except (OSError, RespError) as e:  # ConnectionError and socket timeouts are OSErrors
            raise EventLogUnavailable(f"catalog store Redis at {self._where} is unavailable: {e}") from e
        for reply in replies:
            if isinstance(reply, RespError) and not str(reply).startswith("NOSCRIPT"):
                raise RuntimeError(f"catalog store Redis at {self._where}: {reply}")
        return replies

    def version(self) -> int:
        return int(self._call([("GET", self._base + "version")])[0] or 0)

    def _commit(self, adds, retires, replace):
        args = [repr(float(self._clock())), int(replace), len(adds)]
        for a in adds:
            args += [a.item_id, a.content_hash, _pack(a.item_id.encode(), a._json.encode(), a.content_hash.encode(),
                                                      a.embedding.astype("<f4").tobytes())]
        for r in retires:
            args += [r, _pack(r.encode())]
        reply = self._call([("EVALSHA", self._sha, 1, self._base, *args)])[0]
        if isinstance(reply, RespError):  # NOSCRIPT: not run; EVAL runs and caches it
            reply = self._call([("EVAL", _COMMIT_LUA, 1, self._base, *args)])[0]
        code, value = reply
        if code == 0:
            raise CatalogConflict(value.decode())
        return int(value)

    def _changes(self, since, limit):
        top = self.version()
        last = top if limit is None else min(top, since + limit)
        out = []
        for lo in range(since + 1, last + 1, _VERSIONS_PER_READ):
            versions = range(lo, min(last, lo + _VERSIONS_PER_READ - 1) + 1)
            replies = self._call([c for v in versions for c in (("HMGET", f"{self._base}change:{v}", "t", "r"),
                                                                ("LRANGE", f"{self._base}adds:{v}", 0, -1))])
            for v, (t, r), records in zip(versions, replies[::2], replies[1::2]):
                adds = []
                for record in records:
                    item_id, content, content_hash, embedding = _unpack(record)
                    adds.append(CatalogEntry._stored(str(item_id, "utf-8"), str(content, "utf-8"),
                                                     str(content_hash, "ascii"), _embedding(embedding), v))
                out.append(CatalogChange(v, tuple(adds), tuple(str(i, "utf-8") for i in _unpack(r)), float(t)))
        return out

    def _get(self, ids):
        states = self._call([("HMGET", self._base + "items", *ids)])[0]
        known = [(i, json.loads(s)) for i, s in zip(ids, states) if s is not None]
        with_content = [(i, s) for i, s in known if "a" in s]
        records = self._call([("LINDEX", f"{self._base}adds:{int(s['a'])}", int(s["p"])) for _, s in with_content])
        contents = {i: str(_unpack(rec)[1], "utf-8") for (i, _), rec in zip(with_content, records)}
        return {i: _item(i, s["s"], s["v"], contents.get(i), s.get("h")) for i, s in known}

    def _list(self, offset, limit, status):
        ids = [str(i, "utf-8") for i in self._call([("ZRANGE", self._base + (status or "all"),
                                                      offset, offset + limit - 1)])[0]]
        found = self._get(ids) if ids else {}
        return [found[i] for i in ids if i in found]

    def stats(self) -> dict:
        version, live, retired = self._call([("GET", self._base + "version"), ("ZCARD", self._base + LIVE),
                                             ("ZCARD", self._base + RETIRED)])
        return {"backend": "redis", "url": self._where, "prefix": self.prefix, "version": int(version or 0),
                "live": live, "retired": retired}

    def close(self) -> None:
        self._client.close()
