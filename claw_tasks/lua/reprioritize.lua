-- Write recomputed priorities of some steps in one metadata chunk of a shard, each only
-- if the step is still there and nobody changed its priority since the pass began: the
-- current value must equal both the pass's snapshot of the chunk (taken when the pass
-- started) and the value the new one was computed from. A trainer's update_priorities
-- after the pass started therefore wins over the pass. Batched: one GETRANGE per column
-- (alive bits, ids, priorities, snapshot) over the rows' span, one SETRANGE per run of
-- consecutive written slots.
-- KEYS: 1 alive bitmap, 2 the chunk's m:id, 3 its m:priority, 4 the pass's snapshot of
--       that m:priority chunk, 5 change log
-- ARGV: 1 first slot of the chunk, 2 slots (<i4 packed, ascending, in the shard), 3 ids
--       (<i8), 4 expected priority bytes (4 each, as stored), 5 new priority bytes,
--       6 log length, 7 the chunk's bytes (a chunk the commits left missing, every
--       priority unset, is created at its full size before the first write)
-- Returns the number of priorities written.
local base = tonumber(ARGV[1])
local slots, ids, expect, new = ARGV[2], ARGV[3], ARGV[4], ARGV[5]
local n = #slots / 4
if n == 0 then return 0 end
local offs = {}
for k = 1, n do offs[k] = struct.unpack('<i4', slots, k * 4 - 3) - base end
local first_byte = math.floor((base + offs[1]) / 8)
local alive = redis.call('GETRANGE', KEYS[1], first_byte, math.floor((base + offs[n]) / 8))
local function is_alive(slot)
  local b = string.byte(alive, math.floor(slot / 8) - first_byte + 1) or 0
  return math.floor(b / 2 ^ (7 - slot % 8)) % 2 == 1
end
local lo, hi = offs[1], offs[n]
local idr = redis.call('GETRANGE', KEYS[2], lo * 8, hi * 8 + 7)
-- A chunk the commits left missing (every priority unset) reads as zeros, as it is stored.
local function padded(s, len) return s .. string.rep('\0', len - #s) end
local cur = padded(redis.call('GETRANGE', KEYS[3], lo * 4, hi * 4 + 3), (hi - lo + 1) * 4)
local snap = padded(redis.call('GETRANGE', KEYS[4], lo * 4, hi * 4 + 3), (hi - lo + 1) * 4)
local applied_ids, applied, run, run_at = {}, {}, {}, nil
local function flush()
  if run_at and redis.call('EXISTS', KEYS[3]) == 0 then
    redis.call('SETRANGE', KEYS[3], tonumber(ARGV[7]) - 1, '\0')
  end
  if run_at then redis.call('SETRANGE', KEYS[3], run_at * 4, table.concat(run)) end
  run, run_at = {}, nil
end
for k = 1, n do
  local off = offs[k]
  local r = off - lo
  local id = string.sub(ids, k * 8 - 7, k * 8)
  local c = string.sub(cur, r * 4 + 1, r * 4 + 4)
  if is_alive(base + off) and string.sub(idr, r * 8 + 1, r * 8 + 8) == id and
     c == string.sub(expect, k * 4 - 3, k * 4) and c == string.sub(snap, r * 4 + 1, r * 4 + 4) then
    local v = string.sub(new, k * 4 - 3, k * 4)
    if run_at and run_at + #run ~= off then flush() end
    if not run_at then run_at = off end
    run[#run + 1] = v
    applied_ids[#applied_ids + 1] = id
    applied[#applied + 1] = v
  else
    flush()
  end
end
flush()
if #applied_ids > 0 then
  redis.call('XADD', KEYS[5], 'MAXLEN', '~', ARGV[6], '*', 'op', 'prio', 'col', 'priority',
    'ids', table.concat(applied_ids), 'values', table.concat(applied))
end
return #applied_ids
