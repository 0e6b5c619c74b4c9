#!lua flags=no-writes
-- Prefix index lookup (router/prefix_index.py): how many LEADING blocks of a hash chain each worker holds.
-- Read-only (flags=no-writes): it also runs while Redis is at maxmemory, and on replicas via EVALSHA_RO.
--
-- KEYS[1]          <prefix>iworkers            HASH worker -> its current generation
-- ARGV[1]          <prefix>                    "duet:{<model_id>}:"
-- ARGV[2]          n                           how many worker ids follow (0: every worker)
-- ARGV[3 .. 2+n]   worker ids
-- ARGV[3+n]        the chain: block hashes as 16 hex chars each, concatenated, in chain order
-- Returns {worker, count, worker, count, ...} for the workers with count >= 1.
--
-- A block counts for worker w if w's current confirmed set (wblk:<w>) has it, or its field in blk:<h>
-- carries w's current generation (confirmed, or speculative and not expired on Redis's clock). The two
-- agree except when a key was expired or evicted on its own: then either one still counts the block.
--
-- Two phases, both stopping at each worker's first miss, so the work grows with the sum of the answers
-- (plus one block), never with chain length x workers:
--   1. block by block, one HMGET over the workers still on an unbroken run: cheap per worker while many
--      share a prefix (a system prompt);
--   2. once at most FEW are left, worker by worker: SMISMEMBER on its confirmed set over chunks of
--      doubling size (one call per chunk, not per block), falling back to the block's field on a miss.

local FEW = 16
local blk = ARGV[1] .. 'blk:'
local num_filter = tonumber(ARGV[2])
local chain = ARGV[3 + num_filter]
local num_blocks = chain and math.floor(#chain / 16) or 0
if num_blocks == 0 then return {} end
local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)

local hashes = {}  -- split lazily: only the blocks walked
local function hash_at(i)
  local h = hashes[i]
  if not h then
    h = string.sub(chain, 16 * i - 15, 16 * i)
    hashes[i] = h
  end
  return h
end

-- "<gen>" (confirmed) or "<gen>:<expiry_ms>" (speculative until expiry_ms) of the worker's current gen
local function held(value, gen)
  if not value or not gen then return false end
  if value == gen then return true end
  local n = #gen
  if string.byte(value, n + 1) ~= 58 or string.sub(value, 1, n) ~= gen then return false end
  return tonumber(string.sub(value, n + 2)) > now_ms
end

local MAX_ARGS = 4000  -- unpack() is limited to ~8000 values
local function hmget(key, fields)
  if #fields <= MAX_ARGS then return redis.call('HMGET', key, unpack(fields)) end
  local out = {}
  for i = 1, #fields, MAX_ARGS do
    local part = redis.call('HMGET', key, unpack(fields, i, math.min(i + MAX_ARGS - 1, #fields)))
    for j = 1, #part do out[#out + 1] = part[j] end
  end
  return out
end

-- Block 1: its holders (or the given workers), then their generations.
local candidates, values = {}, {}
if num_filter == 0 then
  local flat = redis.call('HGETALL', blk .. hash_at(1))
  for i = 1, #flat, 2 do
    candidates[#candidates + 1] = flat[i]
    values[#values + 1] = flat[i + 1]
  end
else
  for i = 3, 2 + num_filter do candidates[#candidates + 1] = ARGV[i] end
  values = hmget(blk .. hash_at(1), candidates)
end
if #candidates == 0 then return {} end
local candidate_gens = hmget(KEYS[1], candidates)
local active, gens = {}, {}
for i, w in ipairs(candidates) do
  if held(values[i], candidate_gens[i]) then
    active[#active + 1] = w
    gens[#gens + 1] = candidate_gens[i]
  end
end

-- Phase 1: block by block while many workers are on a run; a worker leaves with the depth it reached.
local result = {}
local depth = 1  -- every active worker holds blocks 1..depth
while #active > FEW and depth < num_blocks do
  values = hmget(blk .. hash_at(depth + 1), active)
  local still, still_gens = {}, {}
  for i, w in ipairs(active) do
    if held(values[i], gens[i]) then
      still[#still + 1] = w
      still_gens[#still_gens + 1] = gens[i]
    else
      result[#result + 1] = w
      result[#result + 1] = depth
    end
  end
  active, gens = still, still_gens
  depth = depth + 1
end

-- Phase 2: worker by worker from depth + 1 on.
local function scan(w, gen)
  local wblk = ARGV[1] .. 'wblk:' .. w
  local pos, chunk = depth + 1, 32
  while pos <= num_blocks do
    local upto = math.min(pos + chunk - 1, num_blocks)
    local args = {}
    for i = pos, upto do args[#args + 1] = hash_at(i) end
    local member = redis.call('SMISMEMBER', wblk, unpack(args))
    for k = 1, #member do
      if member[k] == 0 and not held(redis.call('HGET', blk .. args[k], w), gen) then
        return pos + k - 2
      end
    end
    pos = upto + 1
    chunk = math.min(chunk * 2, 1024)
  end
  return num_blocks
end
for i, w in ipairs(active) do
  result[#result + 1] = w
  result[#result + 1] = scan(w, gens[i])
end
return result
