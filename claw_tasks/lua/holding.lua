-- Which of some slots of one shard still hold the steps a reader expects there
-- (claw_tasks/store/shards.py, Shards.holding): a step is still there while its slot was not
-- allocated again (the shard's seq counter has not reached its seq + cap) and its alive
-- bit is set (evictions clear it; an allocation clears it before reusing the slot).
-- KEYS[1] the shard's alive bitmap, KEYS[2] its seq counter
-- ARGV[1] cap (slots per shard), ARGV[2] msgpack list of slots, ARGV[3] msgpack list of
--         the seqs of the steps the reader expects there (same order)
-- Returns a string of one byte per row, "1" live, "0" gone. Reads only.
local cur = tonumber(redis.call('GET', KEYS[2]) or '0')
local cap = tonumber(ARGV[1])
local slots, seqs = cmsgpack.unpack(ARGV[2]), cmsgpack.unpack(ARGV[3])
local out = {}
for i = 1, #slots do
  if cur - seqs[i] < cap and redis.call('GETBIT', KEYS[1], slots[i]) == 1 then
    out[i] = '1'
  else
    out[i] = '0'
  end
end
return table.concat(out)
