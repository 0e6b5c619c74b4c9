#!lua flags=no-writes
-- Prefix index lookup (router/prefix_index.py): how many LEADING blocks of a hash chain each worker holds.
-- Read-only (flags=no-writes): it also runs while Redis is at maxmemory, and on replicas via EVALSHA_RO.
--
-- KEYS[1]          <prefix>iworkers            HASH worker -> its current generation
-- ARGV[1]          <prefix>                    "duet:{<model_id>}:"
-- ARGV[2]          n                           how many worker ids follow (0: every worker)
-- ARGV[3 .. 2+n]   worker ids
-- ARGV[3+n ..]     block hashes, 16 hex chars each, in chain order
-- Returns {worker, count, worker, count, ...} for the workers with count >= 1.
--
-- Cost: one HMGET per block until no worker is left on an unbroken run, over the workers still on it, so
-- it grows with the sum of the answers (plus one block), not with chain length x workers.

local blk = ARGV[1] .. 'blk:'
local num_filter = tonumber(ARGV[2])
local first_hash = 3 + num_filter
if first_hash > #ARGV then return {} end
local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)

-- An entry counts only if it carries the worker's current generation: "<gen>" (confirmed) or
-- "<gen>:<expiry_ms>" (speculative, until expiry_ms on Redis's clock). Entries of an older generation
-- (left by a resync, a clear or a purge and not yet collected) never count.
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
local key1 = blk .. ARGV[first_hash]
if num_filter == 0 then
  local flat = redis.call('HGETALL', key1)
  for i = 1, #flat, 2 do
    candidates[#candidates + 1] = flat[i]
    values[#values + 1] = flat[i + 1]
  end
else
  for i = 3, 2 + num_filter do candidates[#candidates + 1] = ARGV[i] end
  values = hmget(key1, candidates)
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

-- Blocks 2..: keep the workers still on an unbroken run; a worker leaves with the depth it reached.
local result = {}
local depth = 1
for h = first_hash + 1, #ARGV do
  if #active == 0 then break end
  values = hmget(blk .. ARGV[h], active)
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
for _, w in ipairs(active) do
  result[#result + 1] = w
  result[#result + 1] = depth
end
return result
