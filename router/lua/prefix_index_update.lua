-- Prefix index updates (router/prefix_index.py): every write to the index is one call of this script.
--
-- KEYS[1]  <prefix>iworkers    HASH worker -> its current generation
-- ARGV[1]  op: apply | speculate | stage | commit | purge | collect
-- ARGV[2]  <prefix>            "duet:{<model_id>}:"
-- ARGV[3]  worker id
-- ARGV[4..] op arguments (see each op below); a list of block hashes is one argument, 16 hex chars per
--           hash, concatenated (one argument instead of thousands is much cheaper for client and server)
--
-- A block entry is the field <worker> of <prefix>blk:<hash16>: "<gen>" (confirmed) or "<gen>:<expiry_ms>"
-- (speculative). Only entries of the worker's current generation count, so replacing a worker's whole
-- state (resync, clear, purge) is O(1) here: a new generation (or none) makes every old entry invisible at
-- once, and the old entries are collected afterwards in bounded steps (op collect).

local op, prefix, worker = ARGV[1], ARGV[2], ARGV[3]
local IWORKERS = KEYS[1]
local BLK = prefix .. 'blk:'
local WSEQ = prefix .. 'wseq:' .. worker
local WBLK = prefix .. 'wblk:' .. worker
local WSPEC = prefix .. 'wspec:' .. worker
local GCQ = prefix .. 'gcq:' .. worker
local MAX_ARGS = 4000  -- unpack() is limited to ~8000 values

local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

local function split_hashes(concatenated)
  local hashes = {}
  for i = 1, #concatenated, 16 do hashes[#hashes + 1] = string.sub(concatenated, i, i + 15) end
  return hashes
end

-- cmd key member... in slices unpack() can take
local function list_call(cmd, key, list)
  for i = 1, #list, MAX_ARGS do
    redis.call(cmd, key, unpack(list, i, math.min(i + MAX_ARGS - 1, #list)))
  end
end

local function is_current(value, gen)
  if not gen then return false end
  return value == gen or string.sub(value, 1, #gen + 1) == gen .. ':'
end

-- Move the worker's block sets out of the way (O(1) renames) and queue them for collection.
local function retire(tag, ttl_ms)
  for _, pair in ipairs({{WBLK, 'blk'}, {WSPEC, 'spec'}}) do
    if redis.call('EXISTS', pair[1]) == 1 then
      local garbage = prefix .. 'gc:' .. worker .. ':' .. tag .. ':' .. pair[2]
      redis.call('RENAME', pair[1], garbage)
      redis.call('PEXPIRE', garbage, ttl_ms)
      redis.call('SADD', GCQ, garbage)
      redis.call('PEXPIRE', GCQ, ttl_ms)
    end
  end
end

-- apply: ttl_ms, k, k fresh generations (one per clear event), then events as
--        kind ("s" stored | "r" removed | "c" cleared), epoch, sequence, hashes
-- returns {applied, skipped, code ("ok" | "unknown" | "gap" | "epoch"), detail1, detail2, garbage queued}
if op == 'apply' then
  local ttl_ms = ARGV[4]
  local num_fresh = tonumber(ARGV[5])
  local fresh = 6
  local pos = 6 + num_fresh
  local state = redis.call('HMGET', WSEQ, 'epoch', 'sequence')
  local gen = redis.call('HGET', IWORKERS, worker)
  if not state[1] or not state[2] or not gen then return {0, 0, 'unknown', '', '', 0} end
  local epoch, last = state[1], tonumber(state[2])
  local last_text = state[2]
  local applied, skipped, garbage = 0, 0, 0
  local code, detail1, detail2 = 'ok', '', ''
  while pos <= #ARGV do
    local kind, ev_epoch, seq = ARGV[pos], ARGV[pos + 1], tonumber(ARGV[pos + 2])
    if ev_epoch ~= epoch then
      code, detail1, detail2 = 'epoch', ev_epoch, epoch
      break
    end
    if seq > last + 1 then
      code, detail1, detail2 = 'gap', string.format('%d', last + 1), ARGV[pos + 2]
      break
    end
    if seq <= last then
      skipped = skipped + 1
    else
      if kind == 's' then
        local hashes = split_hashes(ARGV[pos + 3])
        for _, h in ipairs(hashes) do
          local key = BLK .. h
          redis.call('HSET', key, worker, gen)
          redis.call('PEXPIRE', key, ttl_ms)
        end
        list_call('SADD', WBLK, hashes)
        list_call('ZREM', WSPEC, hashes)
      elseif kind == 'r' then
        local hashes = split_hashes(ARGV[pos + 3])
        for _, h in ipairs(hashes) do redis.call('HDEL', BLK .. h, worker) end
        list_call('SREM', WBLK, hashes)
        list_call('ZREM', WSPEC, hashes)
      else
        local new_gen = ARGV[fresh]
        fresh = fresh + 1
        if new_gen == gen then new_gen = new_gen .. '0' end
        retire(new_gen, ttl_ms)
        gen = new_gen
        redis.call('HSET', IWORKERS, worker, gen)
        garbage = 1
      end
      last, last_text = seq, ARGV[pos + 2]
      applied = applied + 1
    end
    pos = pos + 4
  end
  redis.call('HSET', WSEQ, 'sequence', last_text)
  for _, key in ipairs({WSEQ, WBLK, WSPEC, IWORKERS}) do redis.call('PEXPIRE', key, ttl_ms) end
  return {applied, skipped, code, detail1, detail2, garbage}
end

-- speculate: speculative_ttl_ms, entry_ttl_ms, fresh generation (used if the worker has none), hashes
-- Writes "<gen>:<expiry_ms>" where the worker has no confirmed entry; sweeps some expired ones.
if op == 'speculate' then
  local spec_ttl_ms, ttl_ms = ARGV[4], ARGV[5]
  local now = now_ms()
  local gen = redis.call('HGET', IWORKERS, worker)
  if not gen then
    gen = ARGV[6]
    retire(gen, ttl_ms)  -- sets left from a lost generation must not count under the new one
    redis.call('HSET', IWORKERS, worker, gen)
  end
  redis.call('PEXPIRE', IWORKERS, ttl_ms)
  local expiry = string.format('%d', now + tonumber(spec_ttl_ms))
  local value = gen .. ':' .. expiry
  local scored = {}
  for _, h in ipairs(split_hashes(ARGV[7])) do
    local key = BLK .. h
    if redis.call('HGET', key, worker) ~= gen then
      redis.call('HSET', key, worker, value)
      -- a key made here lives spec_ttl; an existing key's TTL only ever grows
      if redis.call('PEXPIRE', key, spec_ttl_ms, 'NX') == 0 then
        redis.call('PEXPIRE', key, spec_ttl_ms, 'GT')
      end
      scored[#scored + 1] = expiry
      scored[#scored + 1] = h
    end
  end
  list_call('ZADD', WSPEC, scored)
  -- lazy sweep of expired speculative entries, a bounded number per call
  local expired = redis.call('ZRANGEBYSCORE', WSPEC, '-inf', now, 'LIMIT', 0, #scored + 64)
  for _, h in ipairs(expired) do
    local key = BLK .. h
    local v = redis.call('HGET', key, worker)
    if v and v ~= gen then
      local n = #gen
      local speculative_now = string.sub(v, 1, n + 1) == gen .. ':' and tonumber(string.sub(v, n + 2)) > now
      if not speculative_now then redis.call('HDEL', key, worker) end
    end
  end
  list_call('ZREM', WSPEC, expired)
  if redis.call('EXISTS', WSPEC) == 1 then redis.call('PEXPIRE', WSPEC, ttl_ms) end
  return #scored / 2
end

-- stage: new generation, ttl_ms, hashes -- one chunk of a resync, written under a generation not yet
-- current (so invisible); the staging set is queued for collection at once, so a resync that dies before
-- its commit leaves nothing that is not collected later.
if op == 'stage' then
  local new_gen, ttl_ms = ARGV[4], ARGV[5]
  local stage = prefix .. 'stage:' .. worker .. ':' .. new_gen
  redis.call('SADD', GCQ, stage)
  redis.call('PEXPIRE', GCQ, ttl_ms)
  local hashes = split_hashes(ARGV[6])
  for _, h in ipairs(hashes) do
    local key = BLK .. h
    redis.call('HSET', key, worker, new_gen)
    redis.call('PEXPIRE', key, ttl_ms)
  end
  if #hashes > 0 then
    list_call('SADD', stage, hashes)
    redis.call('PEXPIRE', stage, ttl_ms)
  end
  return 0
end

-- commit: new generation, ttl_ms, epoch, sequence -- the staged set becomes the worker's state, atomically.
-- returns the number of garbage sets queued
if op == 'commit' then
  local new_gen, ttl_ms = ARGV[4], ARGV[5]
  local stage = prefix .. 'stage:' .. worker .. ':' .. new_gen
  retire(new_gen, ttl_ms)
  if redis.call('EXISTS', stage) == 1 then
    redis.call('RENAME', stage, WBLK)
    redis.call('PEXPIRE', WBLK, ttl_ms)
  end
  redis.call('HSET', IWORKERS, worker, new_gen)
  redis.call('PEXPIRE', IWORKERS, ttl_ms)
  redis.call('DEL', WSEQ)
  redis.call('HSET', WSEQ, 'epoch', ARGV[6], 'sequence', ARGV[7])
  redis.call('PEXPIRE', WSEQ, ttl_ms)
  return redis.call('SCARD', GCQ)
end

-- purge: tag, ttl_ms -- the worker has no generation any more (every entry invisible at once)
if op == 'purge' then
  redis.call('HDEL', IWORKERS, ARGV[3])
  retire(ARGV[4], ARGV[5])
  redis.call('DEL', WSEQ)
  return redis.call('SCARD', GCQ)
end

-- collect: budget -- delete up to ~budget stale entries named by the queued garbage sets
-- returns how many garbage sets are left
if op == 'collect' then
  local budget = tonumber(ARGV[4])
  local gen = redis.call('HGET', IWORKERS, worker)
  for _, garbage in ipairs(redis.call('SMEMBERS', GCQ)) do
    if budget <= 0 then break end
    local kind = redis.call('TYPE', garbage)['ok']
    local hashes = {}
    if kind == 'set' then
      hashes = redis.call('SPOP', garbage, budget)
    elseif kind == 'zset' then
      local popped = redis.call('ZPOPMIN', garbage, budget)
      for i = 1, #popped, 2 do hashes[#hashes + 1] = popped[i] end
    else
      redis.call('SREM', GCQ, garbage)  -- gone (expired), or not ours to pop
    end
    for _, h in ipairs(hashes) do
      local key = BLK .. h
      local v = redis.call('HGET', key, worker)
      if v and not is_current(v, gen) then redis.call('HDEL', key, worker) end
    end
    budget = budget - #hashes
    if (kind == 'set' or kind == 'zset') and redis.call('EXISTS', garbage) == 0 then
      redis.call('SREM', GCQ, garbage)
    end
  end
  return redis.call('SCARD', GCQ)
end

return redis.error_reply('unknown op ' .. tostring(op))
