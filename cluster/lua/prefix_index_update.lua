-- Prefix index updates (cluster/prefix_index.py): every write to the index is one call of this script.
--
-- KEYS[1]  <prefix>iworkers    HASH worker -> its current generation
-- ARGV[1]  op: apply | speculate | stage | commit | purge | collect
-- ARGV[2]  <prefix>            "duet:{<model_id>}:"
-- ARGV[3]  worker id
-- ARGV[4]  entry_ttl_ms        ARGV[5]  speculative_ttl_ms (also the width of a speculative window)
-- ARGV[6..] op arguments (see each op below); a list of block hashes is one argument, 16 hex chars per
--           hash, concatenated (one argument instead of thousands is much cheaper for client and server)
--
-- Only entries of a worker's current generation count, so replacing a worker's whole state (resync,
-- clear, purge) is O(1) here: a new generation (or none) makes every old entry invisible at once, and the
-- old entries are deleted afterwards in bounded steps (op collect).

local op, prefix, worker = ARGV[1], ARGV[2], ARGV[3]
local ttl_ms, spec_ttl_ms = ARGV[4], tonumber(ARGV[5])
local IWORKERS = KEYS[1]
local BLK = prefix .. 'blk:'
local WSEQ = prefix .. 'wseq:' .. worker
local WBLK = prefix .. 'wblk:' .. worker
local WSPEC = prefix .. 'wspec:' .. worker
local GCQ = prefix .. 'gcq:' .. worker
local MAX_ARGS = 4000  -- unpack() is limited to ~8000 values
-- Hashes with many fields must use the hashtable encoding: in a listpack (Redis's compact encoding, up to
-- hash-max-listpack-entries fields) each field read or write scans the list, so an HMGET of 512 workers
-- took 3.5 ms instead of 0.24, and filling a window with 256 blocks 1.5 ms instead of 0.6. A field ""
-- (never a worker id nor a block) with a value longer than hash-max-listpack-value (64 by default) makes
-- Redis convert at once.
local WIDE = string.rep('-', 100)

-- iworkers holds "<gen>" or "<gen>/<j>": j is the last speculative window written, so a lookup knows
-- without a call which workers may have live speculative blocks.
local function set_gen(gen, j)
  redis.call('HSET', IWORKERS, '', WIDE, worker, j and (gen .. '/' .. j) or gen)
end

local function get_gen()
  local value = redis.call('HGET', IWORKERS, worker)
  if not value then return nil end
  return string.match(value, '^[^/]*')
end

local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

-- The speculative window hashes of a generation that may still hold live entries: an entry written in
-- window k expires by (k + 2) * spec_ttl_ms, so at time now only windows j and j - 1 can (j = now's).
local function window_keys(gen, now)
  local j = math.floor(now / spec_ttl_ms)
  local base = prefix .. 'wwin:' .. worker .. ':' .. gen .. ':'
  return {base .. string.format('%d', j), base .. string.format('%d', j - 1)}
end

local function split_hashes(concatenated)
  local hashes = {}
  for i = 1, #concatenated, 16 do hashes[#hashes + 1] = string.sub(concatenated, i, i + 15) end
  return hashes
end

-- cmd key item... in slices unpack() can take (MAX_ARGS is even: field/value pairs stay together)
local function list_call(cmd, key, list)
  for i = 1, #list, MAX_ARGS do
    redis.call(cmd, key, unpack(list, i, math.min(i + MAX_ARGS - 1, #list)))
  end
end

local function is_current(value, gen)
  if not gen then return false end
  return value == gen or string.sub(value, 1, #gen + 1) == gen .. ':'
end

-- The worker's state moves out of the way: its sets are renamed (O(1)) and queued for collection, the
-- windows of its old generation dropped (their block entries are in the renamed wspec).
local function retire(old_gen, tag)
  for _, pair in ipairs({{WBLK, 'blk'}, {WSPEC, 'spec'}}) do
    if redis.call('EXISTS', pair[1]) == 1 then
      local garbage = prefix .. 'gc:' .. worker .. ':' .. tag .. ':' .. pair[2]
      redis.call('RENAME', pair[1], garbage)
      redis.call('PEXPIRE', garbage, ttl_ms)
      redis.call('SADD', GCQ, garbage)
      redis.call('PEXPIRE', GCQ, ttl_ms)
    end
  end
  if old_gen then redis.call('DEL', unpack(window_keys(old_gen, now_ms()))) end
end

-- apply: k, k fresh generations (one per clear event), then events as
--        kind ("s" stored | "r" removed | "c" cleared), epoch, sequence, hashes, parent hash ("" unless "s")
-- A stored run gets an entry in blk:<h> (the inverted index a lookup reads for its first block only) just
-- for its first block, and only if the worker does not hold that block's parent: a block whose parent is
-- held is never the first block of a prompt. That always covers the children of a root.
-- returns {applied, skipped, code ("ok" | "unknown" | "gap" | "epoch"), detail1, detail2, garbage queued}
if op == 'apply' then
  local num_fresh = tonumber(ARGV[6])
  local fresh = 7
  local pos = 7 + num_fresh
  local state = redis.call('HMGET', WSEQ, 'epoch', 'sequence')
  local gen = get_gen()
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
        if #hashes > 0 and redis.call('SISMEMBER', WBLK, ARGV[pos + 4]) == 0 then
          local key = BLK .. hashes[1]
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
        for _, window in ipairs(window_keys(gen, now_ms())) do list_call('HDEL', window, hashes) end
      else
        local new_gen = ARGV[fresh]
        fresh = fresh + 1
        if new_gen == gen then new_gen = new_gen .. '0' end
        retire(gen, new_gen)
        gen = new_gen
        set_gen(gen)
        garbage = 1
      end
      last, last_text = seq, ARGV[pos + 2]
      applied = applied + 1
    end
    pos = pos + 5
  end
  redis.call('HSET', WSEQ, 'sequence', last_text)
  for _, key in ipairs({WSEQ, WBLK, WSPEC, IWORKERS}) do redis.call('PEXPIRE', key, ttl_ms) end
  return {applied, skipped, code, detail1, detail2, garbage}
end

-- speculate: fresh generation (used if the worker has none), hashes (a chain from its first block)
-- Every block goes into the current window hash (block -> expiry_ms), which the lookup reads per chunk
-- and which expires on its own. The first block also gets an entry in its blk hash, unless confirmed
-- there, so the lookup finds the worker as a candidate; those entries are tracked in wspec (first block ->
-- expiry) and swept once expired, a bounded number per call. Being routed to keeps the worker's state and
-- its confirmed first block alive (TTLs refreshed), as events do.
if op == 'speculate' then
  local now = now_ms()
  local gen = get_gen()
  if not gen then
    gen = ARGV[6]
    retire(nil, gen)  -- sets left from a lost generation must not count under the new one
    set_gen(gen)
  end
  redis.call('PEXPIRE', IWORKERS, ttl_ms)
  local hashes = split_hashes(ARGV[7])
  local expiry = string.format('%d', now + spec_ttl_ms)
  local first_key = BLK .. hashes[1]
  for _, key in ipairs({WSEQ, WBLK}) do redis.call('PEXPIRE', key, ttl_ms) end
  if redis.call('HGET', first_key, worker) == gen then
    redis.call('PEXPIRE', first_key, ttl_ms, 'GT')
  else
    redis.call('HSET', first_key, worker, gen .. ':' .. expiry)
    -- a key made here lives spec_ttl; an existing key's TTL only ever grows
    if redis.call('PEXPIRE', first_key, spec_ttl_ms, 'NX') == 0 then
      redis.call('PEXPIRE', first_key, spec_ttl_ms, 'GT')
    end
    redis.call('ZADD', WSPEC, expiry, hashes[1])
  end
  local window = window_keys(gen, now)[1]
  set_gen(gen, string.format('%d', math.floor(now / spec_ttl_ms)))
  local pairs_list = {}
  for _, h in ipairs(hashes) do
    pairs_list[#pairs_list + 1] = h
    pairs_list[#pairs_list + 1] = expiry
  end
  redis.call('HSET', window, '', WIDE)
  list_call('HSET', window, pairs_list)
  redis.call('PEXPIREAT', window, (math.floor(now / spec_ttl_ms) + 2) * spec_ttl_ms)
  local expired = redis.call('ZRANGEBYSCORE', WSPEC, '-inf', now, 'LIMIT', 0, 16)
  for _, h in ipairs(expired) do
    local key = BLK .. h
    local v = redis.call('HGET', key, worker)
    if v and v ~= gen then
      local n = #gen
      if not (string.sub(v, 1, n + 1) == gen .. ':' and tonumber(string.sub(v, n + 2)) > now) then
        redis.call('HDEL', key, worker)
      end
    end
  end
  list_call('ZREM', WSPEC, expired)
  if redis.call('EXISTS', WSPEC) == 1 then redis.call('PEXPIRE', WSPEC, ttl_ms) end
  return #hashes
end

-- stage: new generation, hashes -- one chunk of a resync, written under a generation not yet current (so
-- invisible); the staging set is queued for collection at once, so a resync that dies before its commit
-- leaves nothing that is not collected later.
if op == 'stage' then
  local new_gen = ARGV[6]
  local stage = prefix .. 'stage:' .. worker .. ':' .. new_gen
  redis.call('SADD', GCQ, stage)
  redis.call('PEXPIRE', GCQ, ttl_ms)
  local hashes = split_hashes(ARGV[7])
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

-- commit: new generation, epoch, sequence -- the staged set becomes the worker's state, atomically.
-- returns the number of garbage sets queued
if op == 'commit' then
  local new_gen = ARGV[6]
  local stage = prefix .. 'stage:' .. worker .. ':' .. new_gen
  retire(get_gen(), new_gen)
  if redis.call('EXISTS', stage) == 1 then
    redis.call('RENAME', stage, WBLK)
    redis.call('PEXPIRE', WBLK, ttl_ms)
  end
  set_gen(new_gen)
  redis.call('PEXPIRE', IWORKERS, ttl_ms)
  redis.call('DEL', WSEQ)
  redis.call('HSET', WSEQ, 'epoch', ARGV[7], 'sequence', ARGV[8])
  redis.call('PEXPIRE', WSEQ, ttl_ms)
  return redis.call('SCARD', GCQ)
end

-- purge: tag -- the worker has no generation any more (every entry invisible at once)
if op == 'purge' then
  local old_gen = get_gen()
  redis.call('HDEL', IWORKERS, worker)
  retire(old_gen, ARGV[6])
  redis.call('DEL', WSEQ)
  return redis.call('SCARD', GCQ)
end

-- collect: budget -- delete up to ~budget stale entries named by the queued garbage sets
-- returns how many garbage sets are left
if op == 'collect' then
  local budget = tonumber(ARGV[6])
  local gen = get_gen()
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
