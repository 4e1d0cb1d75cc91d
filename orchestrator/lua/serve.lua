-- A fill's push serves trajectories: it takes them out of admission's rewarded, unserved
-- set (their slots were consumed by the batch, so they must never lapse), in the push's
-- transaction. Sent as EVAL (not EVALSHA) inside that MULTI: no NOSCRIPT can split it.
-- KEYS[1] the rewarded trajectories not served yet (`claw:{ns}:admission:done`, a sorted
--         set scored by each one's oldest turn's version; orchestrator/lua/admission.lua)
-- KEYS[2] (optional) the batch's claim record (`claw:{ns}:admission:claim:<token>`): a
--         `once` batch's removed trajectories with their scores (JSON), so that a batch
--         dropped unserved, whose groups go back to the pool, puts them back exactly once
-- ARGV[1] seconds the claim record lives; ARGV[2..] the batch's trajectory ids
-- Returns {id, score, id, score, ...}: the trajectories this call removed (idempotent: a
-- second call for the same ids removes nothing and records nothing).
local out = {}
for i = 2, #ARGV do
  local score = redis.call('ZSCORE', KEYS[1], ARGV[i])
  if score then
    redis.call('ZREM', KEYS[1], ARGV[i])
    out[#out + 1] = ARGV[i]
    out[#out + 1] = score
  end
end
if KEYS[2] and #out > 0 then
  redis.call('SET', KEYS[2], cjson.encode(out), 'EX', ARGV[1])
end
return out
