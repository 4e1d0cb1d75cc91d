-- Push minibatches of a formed rollout in one call (Registry.push_rollout): one round trip
-- on the learner's path where a WATCH/HMGET/MULTI transaction takes three.
-- KEYS[1] the rollout's state hash (fields no, cursor), KEYS[2] the recipe's queue,
-- KEYS[3] its counters hash, KEYS[4] the namespace's versions hash (name -> version),
-- KEYS[5] the recipe's entry key. ARGV[1] the recipe's name, ARGV[2] the plan's number,
-- ARGV[3] the cursor the items start at, ARGV[4] rows per minibatch, ARGV[5] and ARGV[6]
-- the counters' produced and sampled fields, ARGV[7..] the items (pushed 4,000 at a time:
-- below Lua's unpack limit).
-- Only while the state still holds plan ARGV[2] at cursor ARGV[3] (no other fill pushed
-- them, the rollout did not move on): the items are appended to the queue, the cursor and
-- the produced/sampled counters advanced, all at once. Returns false when the state
-- differs (nothing written), else {queue length, the recipe's stored version ('' when
-- none: a nil would end the reply), whether its entry exists} (the caller takes the
-- items back when the recipe changed). All keys are the namespace's own (one hash slot).
local no = redis.call('HGET', KEYS[1], 'no')
local cursor = redis.call('HGET', KEYS[1], 'cursor')
if (tonumber(no) or 0) ~= tonumber(ARGV[2]) or (tonumber(cursor) or 0) ~= tonumber(ARGV[3]) then
  return false
end
local m = #ARGV - 6
local length = 0
for j = 7, #ARGV, 4000 do
  length = redis.call('RPUSH', KEYS[2], unpack(ARGV, j, math.min(j + 3999, #ARGV)))
end
redis.call('HINCRBY', KEYS[1], 'cursor', m)
redis.call('HINCRBY', KEYS[3], ARGV[5], m)
redis.call('HINCRBY', KEYS[3], ARGV[6], m * tonumber(ARGV[4]))
local version = redis.call('HGET', KEYS[4], ARGV[1])
return {length, version or '', redis.call('EXISTS', KEYS[5])}
