-- The capture gateway's per-trajectory state, shared by every gateway process: a hash with
-- `turns` (turn indices handed out so far) and `done` (the reward was posted).
-- KEYS[1]: the trajectory's hash. ARGV[1]: op ('turn' | 'finish' | 'reopen'), ARGV[2]: TTL s.
-- turn: the next turn index (0, 1, ...), or -1 when the trajectory is finished.
-- finish: the number of turns handed out, marking the trajectory done; -1 if it already was.
-- reopen: clears done (a reward that failed may be posted again); returns 0.
local op, ttl = ARGV[1], tonumber(ARGV[2])
if op == 'reopen' then
  redis.call('HDEL', KEYS[1], 'done')
  return 0
end
if redis.call('HEXISTS', KEYS[1], 'done') == 1 then return -1 end
local n
if op == 'turn' then
  n = redis.call('HINCRBY', KEYS[1], 'turns', 1) - 1
else
  redis.call('HSET', KEYS[1], 'done', 1)
  n = tonumber(redis.call('HGET', KEYS[1], 'turns') or '0')
end
redis.call('EXPIRE', KEYS[1], ttl)
return n
