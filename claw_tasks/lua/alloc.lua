--! include ranges
-- Allocate a block of sequence numbers for a batch, idempotently. The slots it takes are
-- freed at once (their older steps are evicted: alive bits cleared, logged), and the
-- payload chunks they fall in are sized, so a client may write payloads in place before
-- the commit makes the steps visible.
-- KEYS: 1 batch marker, 2 shard seq counter, 3 change log, 4 alive bitmap,
--       5 evictions by reason (hash; live steps the ring overwrites count as 'ring')
-- ARGV: 1 n, 2 marker ttl, 3 shard prefix, 4 cap, 5 log length,
--       6.. triples (field key base, row bytes, chunk slots) of payloads written in place
-- Returns {seq0, state}: state "new", "alloc" (allocated before, not committed), "done"
-- or "expired". The marker reads "alloc:<seq0>:<n>" until the commit.
local marker = redis.call('GET', KEYS[1])
if marker then
  local state, seq0 = string.match(marker, '^(%a+):(%d+)')
  return {tonumber(seq0), state}
end
local n, ttl, prefix, cap = tonumber(ARGV[1]), tonumber(ARGV[2]), ARGV[3], tonumber(ARGV[4])
local seq0 = redis.call('INCRBY', KEYS[2], n) - n + 1
redis.call('SET', KEYS[1], 'alloc:' .. seq0 .. ':' .. n, 'EX', ttl)
if n == 0 then return {seq0, 'new'} end
local slot0 = (seq0 - 1) % cap

local function runs(cs, fn) slot_runs(slot0, n, cap, cs, fn) end

if seq0 + n - 1 > cap then
  -- The ring comes round: evict the older steps in these slots.
  local live = 0
  runs(cap, function(i, slot, chunk, inchunk, len)
    live = live + count_bits(KEYS[4], slot, slot + len)
    fill_bits(KEYS[4], slot, slot + len, 0)
  end)
  if live > 0 then redis.call('HINCRBY', KEYS[5], 'ring', live) end
  redis.call('XADD', KEYS[3], 'MAXLEN', '~', tonumber(ARGV[5]), '*',
    'op', 'evict', 'seq', seq0, 'n', n)
end

for j = 6, #ARGV, 3 do
  local base, size, cs = ARGV[j], tonumber(ARGV[j + 1]), tonumber(ARGV[j + 2])
  runs(cs, function(i, slot, chunk, inchunk, len)
    size_chunk(prefix .. base .. ':' .. chunk, chunk, cs, cap, size)
  end)
end
return {seq0, 'new'}
