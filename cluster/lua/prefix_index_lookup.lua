#!lua flags=no-writes
-- Prefix index lookup (cluster/prefix_index.py): how many LEADING blocks of a hash chain each worker holds.
-- Read-only (flags=no-writes): it also runs while Redis is at maxmemory, and on replicas via EVALSHA_RO.
--
-- KEYS[1]          <prefix>iworkers            HASH worker -> its current generation
-- ARGV[1]          <prefix>                    "duet:{<model_id>}:"
-- ARGV[2]          speculative_ttl_ms          the width of a speculative window
-- ARGV[3]          n                           how many worker ids follow (0: every worker)
-- ARGV[4 .. 3+n]   worker ids
-- ARGV[4+n]        the chain: block hashes as 16 hex chars each, concatenated, in chain order
-- Returns {worker, count, worker, count, ...} for the workers with count >= 1.
--
-- Candidates: the workers (of those given, if any) whose entry in blk:<block 1> carries their current
-- generation, "<gen>" (confirmed) or "<gen>:<expiry_ms>" (speculative, until expiry_ms on Redis's clock). Each candidate is then scanned from block 2 on, chunk by chunk (doubling
-- sizes): one SMISMEMBER on its confirmed set wblk:<w>, and where that misses, one HMGET of its two live
-- speculative windows wwin:<w>:<gen>:<j>, <j-1> (block -> expiry_ms), up to its first block held neither
-- way. Calls per worker grow with log(answer), work with the answer: the whole lookup grows with the sum of
-- the answers, never with chain length x workers. (Walking block by block with one HMGET of blk:<h> over
-- the workers still on a run was 1.5-3x slower in every case measured: a field read costs more than a
-- set membership test, and long single-worker tails cost one call per block.)

local prefix = ARGV[1]
local blk = prefix .. 'blk:'
local spec_ttl_ms = tonumber(ARGV[2])
local num_filter = tonumber(ARGV[3])
local chain = ARGV[4 + num_filter]
local num_blocks = chain and math.floor(#chain / 16) or 0
if num_blocks == 0 then return {} end
local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local window = math.floor(now_ms / spec_ttl_ms)

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
-- HGETALL, then the filter in Lua: an HMGET of many fields from a small (listpack-encoded) hash scans it
-- once per field.
local wanted = nil
if num_filter > 0 then
  wanted = {}
  for i = 4, 3 + num_filter do wanted[ARGV[i]] = true end
end
local flat = redis.call('HGETALL', blk .. hash_at(1))
for i = 1, #flat, 2 do
  if not wanted or wanted[flat[i]] then
    candidates[#candidates + 1] = flat[i]
    values[#values + 1] = flat[i + 1]
  end
end
if #candidates == 0 then return {} end
local candidate_gens = hmget(KEYS[1], candidates)  -- "<gen>" or "<gen>/<last speculative window>"
local active, gens, speculating = {}, {}, {}
for i, w in ipairs(candidates) do
  local gen, last_window = nil, nil
  if candidate_gens[i] then gen, last_window = string.match(candidate_gens[i], '^([^/]*)/?(%d*)$') end
  if held(values[i], gen) then
    active[#active + 1] = w
    gens[#gens + 1] = gen
    speculating[#speculating + 1] = last_window ~= '' and tonumber(last_window) >= window - 1
  end
end

-- Each candidate, chunk by chunk. Chunk boundaries are the same for every worker: build each once.
local chunks = {}  -- {first, last, hashes}
local function chunk_at(c)
  local chunk = chunks[c]
  if not chunk then
    local first = c == 1 and 2 or chunks[c - 1][2] + 1
    local last = math.min(first + math.min(16 * 2 ^ c, 1024) - 1, num_blocks)
    local hashes_in = {}
    for i = first, last do hashes_in[#hashes_in + 1] = hash_at(i) end
    chunk = {first, last, hashes_in}
    chunks[c] = chunk
  end
  return chunk
end

-- The worker's run from block 2 on. Fast path: no live speculative window, so the first block missing
-- from its confirmed set ends the run.
local function leading_run(w, gen, speculating)
  local wblk = prefix .. 'wblk:' .. w
  local windows = nil  -- its live speculative windows, if any, looked up at its first miss
  local c = 1
  while true do
    local chunk = chunk_at(c)
    if chunk[1] > num_blocks then return num_blocks end
    local member = redis.call('SMISMEMBER', wblk, unpack(chunk[3]))
    if not speculating then
      for k = 1, #member do
        if member[k] == 0 then return chunk[1] + k - 2 end
      end
    else
      local misses = {}  -- positions in the chunk
      for k = 1, #member do
        if member[k] == 0 then misses[#misses + 1] = k end
      end
      if #misses > 0 then
        if windows == nil then
          local base = prefix .. 'wwin:' .. w .. ':' .. gen .. ':'
          windows = {base .. string.format('%d', window), base .. string.format('%d', window - 1)}
        end
        local missed = {}
        for i, k in ipairs(misses) do missed[i] = chunk[3][k] end
        local live = {}
        for _, key in ipairs(windows) do
          local expiries = redis.call('HMGET', key, unpack(missed))
          for i = 1, #missed do
            if expiries[i] and tonumber(expiries[i]) > now_ms then live[i] = true end
          end
        end
        for i, k in ipairs(misses) do
          if not live[i] then return chunk[1] + k - 2 end
        end
      end
    end
    c = c + 1
  end
end

local result = {}
for i, w in ipairs(active) do
  result[#result + 1] = w
  result[#result + 1] = leading_run(w, gens[i], speculating[i])
end
return result
