-- Read sampled rows of one shard, atomically, after checking that their slots still hold
-- the steps the reader's index expects. A slot is reused only once the shard's seq has
-- gone a whole ring past its step, and an evicted step's alive bit is clear.
-- KEYS[1] the shard's alive bitmap, KEYS[2] its seq counter
-- ARGV: 1 shard prefix, 2 slots per shard (cap), 3 smallest seq of the checked steps,
--       4 their slots (msgpack array), then 5 per read: kind ('f': fixed-size rows of a
--       chunked string, 'h': one hash value per row), key base, row bytes, slots per
--       chunk, slots (msgpack array)
-- Returns {1} when a step is gone, else {0, read, ...}: a fixed read is its rows' bytes
-- concatenated (zero-padded), a hash read a list of values.
local prefix, cap, oldest = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
if oldest + cap <= tonumber(redis.call('GET', KEYS[2]) or '0') then return {1} end
local check = cmsgpack.unpack(ARGV[4])
for first = 1, #check, 2000 do -- BITFIELD reads many bits in one call
  local ops = {}
  for i = first, math.min(first + 1999, #check) do
    ops[#ops + 1] = 'GET'
    ops[#ops + 1] = 'u1'
    ops[#ops + 1] = check[i]
  end
  for _, bit in ipairs(redis.call('BITFIELD', KEYS[1], unpack(ops))) do
    if bit == 0 then return {1} end
  end
end

local out = {0}
for a = 5, #ARGV, 5 do
  local kind, base, slots = ARGV[a], prefix .. ARGV[a + 1] .. ':', cmsgpack.unpack(ARGV[a + 4])
  local size, cs = tonumber(ARGV[a + 2]), tonumber(ARGV[a + 3])
  local keys, parts, n, i = {}, {}, #slots, 1
  while i <= n do
    local slot = slots[i]
    local chunk, inchunk = math.floor(slot / cs), slot % cs
    local key = keys[chunk]
    if not key then
      key = base .. chunk
      keys[chunk] = key
    end
    if kind == 'f' then
      -- One GETRANGE for a run of consecutive slots in the same chunk.
      local len = 1
      while i + len <= n and inchunk + len < cs and slots[i + len] == slot + len do
        len = len + 1
      end
      local piece = redis.call('GETRANGE', key, inchunk * size, (inchunk + len) * size - 1)
      if #piece < len * size then piece = piece .. string.rep('\0', len * size - #piece) end
      parts[#parts + 1] = piece
      i = i + len
    else
      parts[#parts + 1] = redis.call('HGET', key, slot)
      i = i + 1
    end
  end
  if kind == 'f' then out[#out + 1] = table.concat(parts) else out[#out + 1] = parts end
end
return out
