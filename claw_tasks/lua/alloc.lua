-- Allocate a block of sequence numbers for a batch, idempotently.
-- KEYS[1] batch marker, KEYS[2] shard seq counter
-- ARGV[1] n, ARGV[2] marker ttl (s)
-- Returns {seq0, state}: state "new", "alloc" (allocated before, not committed) or "done".
local marker = redis.call('GET', KEYS[1])
if marker then
  local state, seq0 = string.match(marker, '^(%a+):(%d+)')
  return {tonumber(seq0), state}
end
local n = tonumber(ARGV[1])
local seq0 = redis.call('INCRBY', KEYS[2], n) - n + 1
redis.call('SET', KEYS[1], 'alloc:' .. seq0, 'EX', tonumber(ARGV[2]))
return {seq0, 'new'}
