-- Which of some steps' digests were seen before (orchestrator/delivery/quarantine.py):
-- the dedup pass of a namespace's cleaning, shared by all its sources and workers.
-- KEYS[1], KEYS[2] two sets of digests (generations: one current, one previous)
-- KEYS[3] string: which of the two is current ("1" or "2"; absent: "1")
-- ARGV[1] window: digests a generation takes before the next one starts (the older
--         generation is then dropped: the newest window to 2 * window digests are kept)
-- ARGV[2..] the digests, in step order
-- Returns a string of one byte per digest: "1" seen before (in an earlier call or earlier
-- in this one), "0" new (added now). Atomic: two workers never both take one digest as new.
local cur = tonumber(redis.call('GET', KEYS[3]) or '1')
local now, old = KEYS[cur], KEYS[3 - cur]
local window = tonumber(ARGV[1])
local out = {}
for i = 2, #ARGV do
  local d = ARGV[i]
  if redis.call('SISMEMBER', old, d) == 1 or redis.call('SADD', now, d) == 0 then
    out[i - 1] = '1'
  else
    out[i - 1] = '0'
    if redis.call('SCARD', now) >= window then  -- a new generation; the oldest goes
      redis.call('UNLINK', old)
      cur = 3 - cur
      redis.call('SET', KEYS[3], tostring(cur))
      now, old = KEYS[cur], KEYS[3 - cur]
    end
  end
end
return table.concat(out)
