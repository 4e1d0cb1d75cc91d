-- Write recomputed priorities of one metadata chunk of a shard, each only if the step
-- is still there and nobody changed its priority since the pass began: the current value
-- must equal both the pass's snapshot of the chunk (taken when the pass started) and the
-- value the new one was computed from. A trainer's update_priorities after the pass
-- started therefore wins over the pass.
-- KEYS: 1 alive bitmap, 2 the chunk's m:id, 3 its m:priority, 4 the pass's snapshot of
--       that m:priority chunk, 5 change log
-- ARGV: 1 first slot of the chunk, 2 slots (<i4 packed, in the shard), 3 ids (<i8),
--       4 expected priority bytes (4 each, as stored), 5 new priority bytes, 6 log length
-- Returns the number of priorities written.
local base = tonumber(ARGV[1])
local slots, ids, expect, new = ARGV[2], ARGV[3], ARGV[4], ARGV[5]
local applied_ids, applied = {}, {}
for k = 1, #slots / 4 do
  local slot = struct.unpack('<i4', slots, k * 4 - 3)
  local off = slot - base
  local id = string.sub(ids, k * 8 - 7, k * 8)
  local want = string.sub(expect, k * 4 - 3, k * 4)
  if redis.call('GETBIT', KEYS[1], slot) == 1 and
     redis.call('GETRANGE', KEYS[2], off * 8, off * 8 + 7) == id then
    local cur = redis.call('GETRANGE', KEYS[3], off * 4, off * 4 + 3)
    if cur == want and redis.call('GETRANGE', KEYS[4], off * 4, off * 4 + 3) == cur then
      local v = string.sub(new, k * 4 - 3, k * 4)
      redis.call('SETRANGE', KEYS[3], off * 4, v)
      applied_ids[#applied_ids + 1] = id
      applied[#applied + 1] = v
    end
  end
end
if #applied_ids > 0 then
  redis.call('XADD', KEYS[5], 'MAXLEN', '~', ARGV[6], '*', 'op', 'prio', 'col', 'priority',
    'ids', table.concat(applied_ids), 'values', table.concat(applied))
end
return #applied_ids
