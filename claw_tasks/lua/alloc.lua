-- Allocate a block of sequence numbers for a batch, idempotently. The slots it takes are
-- freed at once (their older steps are evicted: alive bits cleared, logged), and the
-- payload chunks they fall in are sized, so a client may write payloads in place before
-- the commit makes the steps visible.
-- KEYS: 1 batch marker, 2 shard seq counter, 3 change log, 4 alive bitmap
-- ARGV: 1 n, 2 marker ttl, 3 shard prefix, 4 cap, 5 log length,
--       6.. triples (field key base, row bytes, chunk slots) of payloads written in place
-- Returns {seq0, state}: state "new", "alloc" (allocated before, not committed), "done"
-- or "expired".
local marker = redis.call('GET', KEYS[1])
if marker then
  local state, seq0 = string.match(marker, '^(%a+):(%d+)')
  return {tonumber(seq0), state}
end
local n, ttl, prefix, cap = tonumber(ARGV[1]), tonumber(ARGV[2]), ARGV[3], tonumber(ARGV[4])
local seq0 = redis.call('INCRBY', KEYS[2], n) - n + 1
redis.call('SET', KEYS[1], 'alloc:' .. seq0, 'EX', ttl)
if n == 0 then return {seq0, 'new'} end
local slot0 = (seq0 - 1) % cap

-- Runs of slots [slot, slot + len) inside one chunk of cs slots, without ring wrap.
local function runs(cs, fn)
  local i = 0
  while i < n do
    local slot = (slot0 + i) % cap
    local inchunk = slot % cs
    local len = math.min(n - i, cs - inchunk, cap - slot)
    fn(i, slot, math.floor(slot / cs), inchunk, len)
    i = i + len
  end
end

if seq0 + n - 1 > cap then
  -- The ring comes round: evict the older steps in these slots.
  local alive = KEYS[4]
  runs(cap, function(i, s, chunk, inchunk, len)
    local e = s + len
    while s < e and s % 8 ~= 0 do redis.call('SETBIT', alive, s, 0); s = s + 1 end
    local full = math.floor((e - s) / 8)
    if full > 0 then
      redis.call('SETRANGE', alive, s / 8, string.rep('\0', full))
      s = s + full * 8
    end
    while s < e do redis.call('SETBIT', alive, s, 0); s = s + 1 end
  end)
  redis.call('XADD', KEYS[3], 'MAXLEN', '~', tonumber(ARGV[5]), '*',
    'op', 'evict', 'seq', seq0, 'n', n)
end

for j = 6, #ARGV, 3 do
  local base, size, cs = ARGV[j], tonumber(ARGV[j + 1]), tonumber(ARGV[j + 2])
  runs(cs, function(i, slot, chunk, inchunk, len)
    local key = prefix .. base .. ':' .. chunk
    if redis.call('EXISTS', key) == 0 then
      local slots = math.min(cs, cap - chunk * cs)
      redis.call('SETRANGE', key, slots * size - 1, '\0')
    end
  end)
end
return {seq0, 'new'}
