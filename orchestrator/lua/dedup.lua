-- Which of some steps' digests were seen before (orchestrator/delivery/quarantine.py):
-- the dedup pass of a namespace's cleaning, shared by all its sources and workers.
-- KEYS[1] sorted set: digest -> order first seen (higher: newer)
-- KEYS[2] string: the counter that order comes from
-- ARGV[1] window: digests kept (the oldest beyond it are dropped)
-- ARGV[2..] the digests, in step order
-- Returns a string of one byte per digest: "1" seen before (in an earlier call or earlier
-- in this one), "0" new (added now). Atomic: two workers never both take one digest as new.
local n = #ARGV - 1
local last = redis.call('INCRBY', KEYS[2], n)
local out = {}
for i = 1, n do
  if redis.call('ZADD', KEYS[1], 'NX', last - n + i, ARGV[i + 1]) == 1 then
    out[i] = '0'
  else
    out[i] = '1'
  end
end
local window = tonumber(ARGV[1])
if redis.call('ZCARD', KEYS[1]) > window then
  redis.call('ZREMRANGEBYRANK', KEYS[1], 0, -(window + 1))
end
return table.concat(out)
