-- Set one metadata column for a list of step ids, skipping ids whose slot now holds
-- another step (evicted or overwritten). Idempotent.
-- KEYS[1] change log
-- ARGV: 1 shard prefix, 2 cap, 3 n_shards, 4 shard, 5 meta chunk slots, 6 column,
--       7 itemsize, 8 mode ('set' | 'bits_on' | 'bits_off'), 9 ids (<i8 packed),
--       10 values (itemsize each; for bits_* one mask byte), 11 log length, 12 log op
-- Returns the number of steps updated.
local prefix, cap = ARGV[1], tonumber(ARGV[2])
local n_shards, shard, mc = tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])
local col, size, mode = ARGV[6], tonumber(ARGV[7]), ARGV[8]
local ids, values = ARGV[9], ARGV[10]
local applied_ids, applied_vals = {}, {}
local mask = 0
if mode ~= 'set' then mask = string.byte(values, 1) end
for k = 0, #ids / 8 - 1 do
  local packed = string.sub(ids, k * 8 + 1, k * 8 + 8)
  local id = struct.unpack('<i8', packed)
  local seq = math.floor(id / n_shards)
  local slot = (seq - 1) % cap
  local chunk, off = math.floor(slot / mc), slot % mc
  local suffix = ':' .. chunk
  if id % n_shards == shard and seq >= 1 and
     redis.call('GETRANGE', prefix .. 'm:id' .. suffix, off * 8, off * 8 + 7) == packed and
     redis.call('GETBIT', prefix .. 'alive', slot) == 1 then
    local key = prefix .. 'm:' .. col .. suffix
    local v
    if mode == 'set' then
      v = string.sub(values, k * size + 1, k * size + size)
    else
      local old = string.byte(redis.call('GETRANGE', key, off, off)) or 0
      if mode == 'bits_on' then v = string.char(bit.bor(old, mask))
      else v = string.char(bit.band(old, bit.bnot(mask)) % 256) end
    end
    redis.call('SETRANGE', key, off * size, v)
    applied_ids[#applied_ids + 1] = packed
    applied_vals[#applied_vals + 1] = v
  end
end
if #applied_ids > 0 then
  redis.call('XADD', KEYS[1], 'MAXLEN', '~', ARGV[11], '*', 'op', ARGV[12], 'col', col,
    'ids', table.concat(applied_ids), 'values', table.concat(applied_vals))
end
return #applied_ids
