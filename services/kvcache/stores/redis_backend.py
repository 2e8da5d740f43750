"""The index in Redis: survives kvcache restarts and is shared by replicas.

Layout, under a key prefix P:
  P b:<hash>    hash: "^" -> parent hash, "w:<worker>" -> 1 per holder
  P p:<hash>    set of workers holding the partial (last) block <hash>
  P wb:<worker> set of block hashes the worker holds (for clears and stats)
  P wp:<worker> set of partial hashes the worker holds
  P seq         hash: worker -> last applied seq (a field per known worker)
  P stats       hash: lookups, hits, lookup_tokens, hit_tokens, events,
                resyncs, nodes (the number of b: keys)

Chained hashes identify whole prefixes, so the tree needs no node objects
here: a lookup walks the query's hashes in order. Publish and Lookup are one
Lua script each, so each is one round trip and atomic: replicas applying
events for the same worker cannot interleave, and the seq check and the
writes it guards happen together. Hashes travel as decimal strings because
Lua numbers are doubles. Scripts build key names, so this needs a single
Redis instance (not Redis Cluster). Every call goes through a RedisGuard
(redis_guard.py): deadlines, and failing fast for a moment after a failure.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

import redis.asyncio as redis

from services.kvcache.kv_types import (
    AllCleared, BlockRemoved, BlockStored, IndexStats, LookupQuery, PublishBatch, PublishResult,
    RecordedLookup, WorkerMatch,
)
from services.kvcache.stores.redis_guard import RedisGuard, redis_client
from services.kvcache.rules import order_chains, sort_matches

log = logging.getLogger(__name__)

_COMMON_LUA = """
local P = ARGV[1]
local worker = ARGV[2]
local field = 'w:' .. worker
local stats_key = P .. 'stats'
local blocks_key = P .. 'wb:' .. worker
local partials_key = P .. 'wp:' .. worker

local function holds(h)
  return redis.call('HEXISTS', P .. 'b:' .. h, field) == 1
end

-- Stores a chain of ARGV[first .. first+count-1]; false (and nothing
-- written) when the worker does not hold the parent or a block is
-- indexed under another parent.
local function store(parent, partial, first, count)
  if parent ~= '0' and not holds(parent) then return false end
  local prev = parent
  for i = first, first + count - 1 do
    local known = redis.call('HGET', P .. 'b:' .. ARGV[i], '^')
    if known and known ~= prev then return false end
    prev = ARGV[i]
  end
  prev = parent
  for i = first, first + count - 1 do
    local h = ARGV[i]
    local key = P .. 'b:' .. h
    if redis.call('HSETNX', key, '^', prev) == 1 then
      redis.call('HINCRBY', stats_key, 'nodes', 1)
    end
    if redis.call('HSETNX', key, field, '1') == 1 then
      redis.call('SADD', blocks_key, h)
    end
    prev = h
  end
  if partial ~= '0' then
    redis.call('SADD', P .. 'p:' .. partial, worker)
    redis.call('SADD', partials_key, partial)
  end
  return true
end

local function remove(h)
  local key = P .. 'b:' .. h
  if redis.call('HDEL', key, field) == 1 then
    redis.call('SREM', blocks_key, h)
    if redis.call('HLEN', key) <= 1 then
      redis.call('DEL', key)
      redis.call('HINCRBY', stats_key, 'nodes', -1)
    end
  elseif redis.call('SREM', P .. 'p:' .. h, worker) == 1 then
    redis.call('SREM', partials_key, h)
  end
end

local function clear()
  for _, h in ipairs(redis.call('SMEMBERS', blocks_key)) do remove(h) end
  for _, h in ipairs(redis.call('SMEMBERS', partials_key)) do remove(h) end
end
"""

# ARGV: prefix, worker, snapshot_seq, then chains as parent, partial, count, hashes...
_RESYNC_LUA = _COMMON_LUA + """
clear()
local i = 4
local dropped = 0
while i <= #ARGV do
  local count = tonumber(ARGV[i + 2])
  if not store(ARGV[i], ARGV[i + 1], i + 3, count) then dropped = dropped + 1 end
  i = i + 3 + count
end
redis.call('HSET', P .. 'seq', worker, ARGV[3])
redis.call('HINCRBY', stats_key, 'resyncs', 1)
return dropped
"""

# ARGV: prefix, worker, then events as: seq, 's', parent, partial, count, hashes...
#                                     | seq, 'r', count, hashes... | seq, 'c'
# Returns {resync_needed, last applied seq}.
_EVENTS_LUA = _COMMON_LUA + """
local last = redis.call('HGET', P .. 'seq', worker)
if not last then return {1, 0} end
last = tonumber(last)
local applied = 0
local status = 0
local i = 3
while i <= #ARGV do
  local seq = tonumber(ARGV[i])
  local kind = ARGV[i + 1]
  local size = 2
  if kind == 's' then size = 5 + tonumber(ARGV[i + 4])
  elseif kind == 'r' then size = 3 + tonumber(ARGV[i + 2]) end
  if seq > last then
    if seq ~= last + 1 then status = 1; break end
    if kind == 's' then
      if not store(ARGV[i + 2], ARGV[i + 3], i + 5, tonumber(ARGV[i + 4])) then
        status = 1; break
      end
    elseif kind == 'r' then
      for j = i + 3, i + size - 1 do remove(ARGV[j]) end
    else
      clear()
    end
    last = seq
    applied = applied + 1
  end
  i = i + size
end
redis.call('HSET', P .. 'seq', worker, string.format('%d', last))
redis.call('HINCRBY', stats_key, 'events', applied)
return {status, last}
"""

# ARGV: prefix, block_size, partial hash, partial tokens, then the block hashes.
# Returns a flat list: worker, matched blocks, exact (0/1), ...
_LOOKUP_LUA = """
local P = ARGV[1]
local block_size = tonumber(ARGV[2])
local partial = ARGV[3]
local partial_tokens = tonumber(ARGV[4])
local n = #ARGV - 4
local depth = {}
local active = nil
local matched = 0
for i = 1, n do
  local here = {}
  for _, f in ipairs(redis.call('HKEYS', P .. 'b:' .. ARGV[4 + i])) do
    if f ~= '^' then here[string.sub(f, 3)] = true end
  end
  if active == nil then
    active = here
  else
    for w in pairs(active) do
      if not here[w] then active[w] = nil; depth[w] = matched end
    end
  end
  if next(active) == nil then break end
  matched = matched + 1
end
if active then for w in pairs(active) do depth[w] = matched end end

local holders = {}
if partial ~= '0' then
  for _, w in ipairs(redis.call('SMEMBERS', P .. 'p:' .. partial)) do holders[w] = true end
end
local result = {}
local best = 0
local function add(w, blocks, exact)
  local tokens = blocks * block_size
  if exact and partial ~= '0' then tokens = tokens + partial_tokens end
  if tokens > best then best = tokens end
  table.insert(result, w)
  table.insert(result, blocks)
  table.insert(result, exact and 1 or 0)
end
for w, blocks in pairs(depth) do
  if blocks > 0 then
    local exact = blocks == n and (partial == '0' or holders[w] == true)
    add(w, blocks, exact)
  end
end
if n == 0 and partial ~= '0' then
  for w in pairs(holders) do add(w, 0, true) end
end
local stats_key = P .. 'stats'
redis.call('HINCRBY', stats_key, 'lookups', 1)
redis.call('HINCRBY', stats_key, 'lookup_tokens', n * block_size + partial_tokens)
if best > 0 then
  redis.call('HINCRBY', stats_key, 'hits', 1)
  redis.call('HINCRBY', stats_key, 'hit_tokens', best)
end
return result
"""


class RedisBackend:
    name = "redis"

    def __init__(self, client: redis.Redis, block_size: int, prefix: str = "fairserve:kv:",
                 guard: RedisGuard | None = None) -> None:
        self.block_size = block_size
        self._client = client
        self._prefix = prefix
        self._guard = guard if guard is not None else RedisGuard()
        self._resync = client.register_script(_RESYNC_LUA)
        self._events = client.register_script(_EVENTS_LUA)
        self._lookup = client.register_script(_LOOKUP_LUA)

    @classmethod
    def from_url(cls, url: str, block_size: int, prefix: str = "fairserve:kv:",
                 socket_timeout_s: float = 0.5, password: str = "") -> "RedisBackend":
        return cls(redis_client(url, socket_timeout_s, password), block_size, prefix)

    async def wait_ready(self, timeout_s: float, interval_s: float = 0.5) -> None:
        """Pings until Redis answers; raises ConnectionError after timeout_s."""
        deadline = asyncio.get_running_loop().time() + timeout_s
        while True:
            try:
                await self._client.ping()
                return
            except (redis.ConnectionError, redis.TimeoutError) as error:
                if asyncio.get_running_loop().time() >= deadline:
                    raise ConnectionError(f"Redis unreachable: {error}") from error
                log.info("waiting for Redis", extra={"error": str(error)})
                await asyncio.sleep(interval_s)

    async def publish(self, batch: PublishBatch) -> PublishResult:
        if batch.full_resync:
            args = [self._prefix, batch.worker_id, batch.snapshot_seq]
            ordered, dropped = order_chains(batch.snapshot)
            for chain in ordered:
                args += _chain_args(chain)
            dropped += int(await self._guard.call(lambda: self._resync(args=args)))
            if dropped:
                log.warning("resync dropped unreachable chains",
                            extra={"worker_id": batch.worker_id, "dropped": dropped})
            return PublishResult(False, batch.snapshot_seq + 1)
        args = [self._prefix, batch.worker_id]
        for event in batch.events:
            args += _event_args(event.seq, event.body)
        resync_needed, last = await self._guard.call(lambda: self._events(args=args))
        return PublishResult(bool(resync_needed), int(last) + 1)

    async def lookup(self, query: LookupQuery) -> list[WorkerMatch]:
        args = [self._prefix, self.block_size, query.partial_hash, query.partial_tokens,
                *query.block_hashes]
        flat = await self._guard.call(lambda: self._lookup(args=args))
        matches = []
        for index in range(0, len(flat), 3):
            worker, blocks, exact = flat[index], int(flat[index + 1]), bool(int(flat[index + 2]))
            with_partial = exact and query.partial_hash != 0
            tokens = blocks * self.block_size + (query.partial_tokens if with_partial else 0)
            matches.append(WorkerMatch(worker, blocks, tokens, exact))
        return sort_matches(matches)

    async def record_lookups(self, lookups: Sequence[RecordedLookup]) -> None:
        """The lookups' counts added to the shared stats, as `lookup` adds its own."""
        if not lookups:
            return
        hits = [lookup for lookup in lookups if lookup.cached_tokens > 0]
        counts = {"lookups": len(lookups), "lookup_tokens": sum(lookup.prompt_tokens for lookup in lookups),
                  "hits": len(hits), "hit_tokens": sum(lookup.cached_tokens for lookup in hits)}

        async def add() -> None:
            async with self._client.pipeline(transaction=True) as pipe:
                for name, count in counts.items():
                    pipe.hincrby(self._prefix + "stats", name, count)
                await pipe.execute()
        await self._guard.call(add)

    async def stats(self) -> IndexStats:
        counters, workers, sizes = await self._guard.call(self._read_stats)

        def counter(name: str) -> int:
            return int(counters.get(name, 0))

        return IndexStats(
            lookups=counter("lookups"), hits=counter("hits"),
            lookup_tokens=counter("lookup_tokens"), hit_tokens=counter("hit_tokens"),
            nodes=counter("nodes"), events=counter("events"), resyncs=counter("resyncs"),
            blocks_by_worker={w: int(n) for w, n in zip(workers, sizes)}, backend=self.name,
        )

    async def _read_stats(self) -> tuple[dict[str, str], list[str], list[int]]:
        async with self._client.pipeline(transaction=False) as pipe:
            pipe.hgetall(self._prefix + "stats")
            pipe.hkeys(self._prefix + "seq")
            counters, workers = await pipe.execute()
        async with self._client.pipeline(transaction=False) as pipe:
            for worker in workers:
                pipe.scard(self._prefix + "wb:" + worker)
            sizes = await pipe.execute()
        return counters, workers, sizes

    async def close(self) -> None:
        await self._client.aclose()


def _chain_args(chain: BlockStored) -> list[int | str]:
    return [chain.parent_hash, chain.partial_hash, len(chain.block_hashes), *chain.block_hashes]


def _event_args(seq: int, body: object) -> list[int | str]:
    if isinstance(body, BlockStored):
        return [seq, "s", *_chain_args(body)]
    if isinstance(body, BlockRemoved):
        return [seq, "r", len(body.block_hashes), *body.block_hashes]
    if isinstance(body, AllCleared):
        return [seq, "c"]
    raise TypeError(f"unknown event {body!r}")
