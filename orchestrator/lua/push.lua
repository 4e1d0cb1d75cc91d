-- Append a batch to a prefetch queue unless it is at its bound.
-- KEYS[1] queue; ARGV[1] depth, ARGV[2] item. Returns the new length, or 0 when full.
if redis.call('LLEN', KEYS[1]) < tonumber(ARGV[1]) then
  return redis.call('RPUSH', KEYS[1], ARGV[2])
end
return 0
