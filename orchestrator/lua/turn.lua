-- The capture gateway's per-trajectory state, shared by every gateway process: one hash
-- per trajectory (`claw:{ns}:gw:<trajectory>`) with a TTL refreshed on each turn. Fields:
--   turns       turn indices handed out so far
--   done        the reward was posted: its digest (a retry of the same reward is told
--               apart from another reward)
--   rwd         1 once the reward is attached to the stored turns
--   vmin, vmax  the lowest and highest policy version of its turns (where one is known)
--   c:<call>    the turn index the call with that interaction id produced
--   key, grp, rw, ttl   a session's (POST /sessions): the sha256 of its key, its group,
--               1 if the key may post the reward, its TTL in seconds
--   adm, res, rel, fin  admission's (orchestrator/lua/admission.lua); a session's `ch`:
--               how many choices (`~0`..) its n > 1 calls made the key's
-- KEYS[1]: the trajectory's hash; KEYS[2]: the namespace's admission hash (turn only: the
-- declared policy version stands in for a turn whose version is not known); KEYS[3] (turn,
-- optional): the open trajectories of admission.lua, whose expiry a turn moves.
-- ARGV[1] op, ARGV[2] TTL (s); then per op:
--   turn    ARGV[3] the turn's policy version ('' unknown), ARGV[4] the call id ('' none),
--           with KEYS[3]: ARGV[5] the admission expiry (s), ARGV[6] the trajectory id (an
--           open trajectory expires that long after its last turn); ARGV[7] the call's
--           group ('' none), kept as `grp` if the trajectory has none yet (a call the
--           gate let through without the admission script, no budget being declared).
--           Returns {index, version} (version -1: none known); {-1, -1} when finished.
--           Idempotent per call id: a call numbered already (`c:<call>` is set: a call
--           the gateway spooled, numbered, and re-records after a restart) gets its index
--           back, finished or not, and nothing is written.
--   finish  ARGV[3] the reward's digest. Marks the trajectory done with it. Returns
--           {status, turns, vmin, vmax, grp} (vmin/vmax -1 when no version is known, grp ''
--           without a group): status 1 done now; 0 done earlier by this same reward and not
--           attached (its poster died midway, or is still at it: attaching it again writes
--           the same values); 2 this same reward is attached already; -1 done by another
--           reward (then only {-1}).
--   attached  ARGV[3] the reward's digest. Marks it attached (`rwd`), putting its `done`
--           back if a failed post of the same reward cleared it meanwhile; returns 1, or -1
--           (nothing written) when `done` holds another reward.
--   reopen  ARGV[3] the reward's digest. Clears done (a reward that failed may be posted
--           again) unless it holds another reward or the reward is attached (a retry of
--           the same reward, on another gateway process, got there); returns 0.
--   session ARGV[3] key sha256, ARGV[4] group ('' none), ARGV[5] 1 if the key may reward.
--           Creates the trajectory with its session; 0 when the trajectory exists already.
local op, ttl = ARGV[1], tonumber(ARGV[2])
local key = KEYS[1]
local own = tonumber(redis.call('HGET', key, 'ttl') or '0')
if own > 0 and own < ttl then ttl = own end
if op == 'reopen' then
  if redis.call('HGET', key, 'done') == ARGV[3] and redis.call('HEXISTS', key, 'rwd') == 0 then
    redis.call('HDEL', key, 'done')
  end
  return 0
end
if op == 'attached' then
  local done = redis.call('HGET', key, 'done')
  if done and done ~= ARGV[3] then return -1 end
  redis.call('HSET', key, 'done', ARGV[3], 'rwd', 1)
  redis.call('EXPIRE', key, ttl)
  return 1
end
if op == 'session' then
  if redis.call('EXISTS', key) == 1 then return 0 end
  redis.call('HSET', key, 'key', ARGV[3], 'grp', ARGV[4], 'rw', ARGV[5], 'ttl', ttl, 'turns', 0)
  redis.call('EXPIRE', key, ttl)
  return 1
end
if op == 'turn' and ARGV[4] ~= '' then
  local had = redis.call('HGET', key, 'c:' .. ARGV[4])
  if had then
    local v = tonumber(ARGV[3])
    if v == nil then v = tonumber(redis.call('HGET', KEYS[2], 'version') or '') end
    return {tonumber(had), v or -1}
  end
end
local done = redis.call('HGET', key, 'done')
local status = 1
if done then
  if op == 'turn' then return {-1, -1} end
  if done ~= ARGV[3] then return {-1} end
  status = 0
  if redis.call('HEXISTS', key, 'rwd') == 1 then status = 2 end
end
if op == 'turn' then
  local n = redis.call('HINCRBY', key, 'turns', 1) - 1
  local v = tonumber(ARGV[3])
  if v == nil then v = tonumber(redis.call('HGET', KEYS[2], 'version') or '') end
  if v ~= nil then
    local lo = tonumber(redis.call('HGET', key, 'vmin') or '')
    local hi = tonumber(redis.call('HGET', key, 'vmax') or '')
    if lo == nil or v < lo then redis.call('HSET', key, 'vmin', v) end
    if hi == nil or v > hi then redis.call('HSET', key, 'vmax', v) end
  end
  if ARGV[4] ~= '' then redis.call('HSET', key, 'c:' .. ARGV[4], n) end
  if ARGV[7] and ARGV[7] ~= '' then redis.call('HSETNX', key, 'grp', ARGV[7]) end
  redis.call('EXPIRE', key, ttl)
  if KEYS[3] and tonumber(ARGV[5]) > 0 then
    local now = redis.call('TIME')
    local due = tonumber(now[1]) + tonumber(now[2]) / 1e6 + tonumber(ARGV[5])
    redis.call('ZADD', KEYS[3], 'XX', due, ARGV[6])
  end
  return {n, v or -1}
end
redis.call('HSET', key, 'done', ARGV[3])
local f = redis.call('HMGET', key, 'turns', 'vmin', 'vmax', 'grp')
redis.call('EXPIRE', key, ttl)
return {status, tonumber(f[1] or '0'), tonumber(f[2] or '-1'), tonumber(f[3] or '-1'), f[4] or ''}
