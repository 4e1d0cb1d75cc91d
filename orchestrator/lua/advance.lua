-- Move a rollout recipe to its next version in one call (Registry.advance): only while
-- KEYS[2] (name -> version) still says ARGV[2] (no other client changed the recipe since
-- the caller read it), store the entry ARGV[4] in KEYS[1] as version ARGV[3], drop the
-- queued minibatches of KEYS[3] (returned: the caller reclaims their segments) and add the
-- recipe to the namespace's waiting rollouts KEYS[4], so the ingest commit that completes
-- its next rollout forms it. Returns the dropped items, or false when the version differs.
if redis.call('HGET', KEYS[2], ARGV[1]) ~= ARGV[2] then
  return false
end
redis.call('SET', KEYS[1], ARGV[4])
redis.call('HSET', KEYS[2], ARGV[1], ARGV[3])
local items = redis.call('LRANGE', KEYS[3], 0, -1)
redis.call('DEL', KEYS[3])
redis.call('SADD', KEYS[4], ARGV[1])
return items
