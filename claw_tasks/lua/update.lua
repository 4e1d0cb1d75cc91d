--! include ranges
-- Set one metadata column for a list of step ids, skipping ids whose slot no longer holds
-- them: the ring came round to the slot (seq counter - seq >= cap; allocation evicts a
-- slot's old step at once) or the step was evicted otherwise (alive bit clear; checked
-- only once the shard has had such an eviction, counted in KEYS[4]). Idempotent.
-- KEYS[1] change log, KEYS[2] seq counter, KEYS[3] alive bitmap, KEYS[4] eviction count
-- ARGV: 1 shard prefix, 2 cap, 3 n_shards, 4 shard, 5 meta chunk slots, 6 column,
--       7 itemsize, 8 mode ('set' | 'bits_on' | 'bits_off'), 9 ids (<i8 packed),
--       10 values (itemsize each; for bits_* one mask byte), 11 log length, 12 log op
-- Returns the number of steps updated.
local prefix, cap = ARGV[1], tonumber(ARGV[2])
local n_shards, shard, mc = tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])
local col, size, mode = ARGV[6], tonumber(ARGV[7]), ARGV[8]
local ids, values = ARGV[9], ARGV[10]
local seq_now = tonumber(redis.call('GET', KEYS[2]) or '0')
local count = #ids / 8
local idv, slots, seqs = {}, {}, {}
for k = 1, count do
  local id = struct.unpack('<i8', ids, k * 8 - 7)
  local seq = math.floor(id / n_shards)
  idv[k], seqs[k], slots[k] = id, seq, (seq - 1) % cap
end
local alive = nil
if count > 0 and redis.call('EXISTS', KEYS[4]) == 1 then
  -- BITFIELD GETs in groups: unpack() takes a few thousand arguments at most
  alive = {}
  for first = 1, count, 1000 do
    local get = {}
    for k = first, math.min(count, first + 999) do
      get[#get + 1] = 'GET'
      get[#get + 1] = 'u1'
      get[#get + 1] = slots[k]
    end
    local got = redis.call('BITFIELD', KEYS[3], unpack(get))
    for j = 1, #got do alive[first + j - 1] = got[j] end
  end
end
local mask = 0
if mode ~= 'set' then mask = string.byte(values, 1) end
local applied_ids, applied_vals = {}, {}
for k = 1, count do
  local seq, slot = seqs[k], slots[k]
  if idv[k] % n_shards == shard and seq >= 1 and seq <= seq_now and seq_now - seq < cap and
     (alive == nil or alive[k] == 1) then
    local key = prefix .. 'm:' .. col .. ':' .. math.floor(slot / mc)
    local off = slot % mc
    local v
    if mode == 'set' then
      v = string.sub(values, k * size - size + 1, k * size)
    else
      local old = string.byte(redis.call('GETRANGE', key, off, off)) or 0
      if mode == 'bits_on' then v = string.char(bit.bor(old, mask))
      else v = string.char(bit.band(old, bit.bnot(mask)) % 256) end
    end
    size_chunk(key, math.floor(slot / mc), mc, cap, size)  -- a column left all zero so far
    redis.call('SETRANGE', key, off * size, v)
    applied_ids[#applied_ids + 1] = string.sub(ids, k * 8 - 7, k * 8)
    applied_vals[#applied_vals + 1] = v
  end
end
if #applied_ids > 0 then
  redis.call('XADD', KEYS[1], 'MAXLEN', '~', ARGV[11], '*', 'op', ARGV[12], 'col', col,
    'ids', table.concat(applied_ids), 'values', table.concat(applied_vals))
end
return #applied_ids
