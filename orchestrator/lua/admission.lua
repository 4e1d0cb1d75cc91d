-- Staleness-bounded admission of new trajectories (AReaL's rule), one budget per namespace
-- shared by every gateway process and declared by the trainer (docs/llm.md, "Admission").
-- KEYS[1] the namespace's admission hash (`claw:{ns}:admission`):
--           recipe, rv     the recipe that declared it and that recipe's version
--           version        v, the trainer's current policy version
--           batch          B, trajectories per training batch
--           staleness      s, max_staleness
--           group          trajectories per group (1: none)
--           admitted       trajectories admitted and not released (running + accepted)
--           total, waited, refused, released, expired, lapsed   counters (calls that
--                          waited, calls that got 429, slots given back, trajectories
--                          expired, rewarded trajectories released unserved)
--           rewarded:<b>, stale:<b>   trajectories rewarded, and rewarded ones released
--                          unserved (too old at their reward, or lapsed later), by turns
--                          (b: the power of two at or above the turn count, 1..64; 65+)
-- KEYS[2] the admission log (a stream capped near ARGV's maxlog entries)
-- Channel KEYS[1] .. ':wake': published when the budget grows (declare, give, finish), so
-- gateways holding calls over the budget look again at once.
-- KEYS[3] the group's reservation hash (`claw:{ns}:gwres:<group>`; unused without a group):
--           round, left    the current reservation's number and slots left in it
--           size:<r>, rel:<r>   the slots reservation r took, and 1 once they were released
-- KEYS[4] the session's trajectory hash (orchestrator/lua/turn.lua; its `key` checked);
--         (finish, expire) the trajectory's
-- KEYS[5] the open trajectories (`claw:{ns}:admission:open`), a sorted set: trajectories
--         admitted against a declared budget and not rewarded yet, scored by when they
--         expire (server time; each recorded turn moves it, orchestrator/lua/turn.lua)
-- KEYS[6] (declare, finish, lapse) the rewarded trajectories not served yet
--         (`claw:{ns}:admission:done`), a sorted set scored by each one's oldest turn's
--         version: a fill that serves one removes it (orchestrator/delivery/prefetch.py),
--         so a member is rewarded, unserved and holds its slot.
-- KEYS[6..] (enter) the hashes of the trajectories the call starts or continues
--
-- The rule: with budget = (s + v + 1) * B, a trajectory may start only while
-- admitted + the slots it takes <= budget. A trajectory of a group takes a slot of the
-- group's current reservation when one is left; else it reserves a whole group (`group`
-- slots), so a group once started can always be completed (a trainer waiting for whole
-- groups never waits for a trajectory the budget keeps out). Everything is one script:
-- gateways racing for the last slots never admit past the budget.
--
-- ARGV[1] op:
--   declare  ARGV: recipe, rv, version, batch, staleness, group, fresh (1: a new
--            registration). A declaration of an older rv than the stored one is ignored;
--            one by another recipe is refused. A fresh registration, or a version lower
--            than the stored one (a trainer restarted from an earlier version), sets
--            admitted to version * B: nothing is counted in flight (nor open, nor
--            rewarded unserved). Returns 1 applied,
--            0 ignored, -1 owned by another recipe.
--   enter    ARGV: key sha256 ('' no session), group ('' none), first (1: the call's first
--            try), last (1: its last: a refusal counts as refused), who, maxlog, ttl,
--            expiry (seconds an admitted trajectory may go without a turn or its reward
--            before its slots come back; 0 never), split (n of a session's n > 1 call of
--            its own trajectory: choices 0..n-1 become the key's, field `ch` of KEYS[4];
--            else 0), need (the choices the call names: its highest choice index + 1, 0
--            none), then the trajectory ids of KEYS[6..]. Returns {status, budget,
--            admitted, session group, session may-reward, trajectories newly admitted,
--            session choices}: status 1 admitted (or already), 0 over budget, -2 the
--            session key does not match, -3 the call names another group than the
--            session's (a session's calls default to its group), -4 the session's
--            trajectory has its reward (the key opens nothing more), -5 the call names a
--            choice no n > 1 call of the session made; budget -1 when none is declared.
--            Without trajectory ids, only the key is checked (and a split recorded).
--   give     ARGV: slots, who, maxlog, why. Gives back slots of trajectories accepted and
--            then never served (batches dropped when the recipe changed). Returns them.
--   finish   ARGV: vmin ('' none known), who, maxlog, trajectory id. The trajectory is no
--            longer open; one whose oldest turn is older than v - s will never be served:
--            its reservation (its group's, once) is released; else it joins KEYS[6].
--            Once per trajectory (field `fin`): a reward posted again (the first failed
--            after this ran) neither counts it again nor puts it back in KEYS[6] after a
--            fill served it. Returns the slots released.
--   lapse    ARGV: who, maxlog, trajectory id. If the trajectory is in KEYS[6] and its
--            oldest turn is now older than v - s (the version moved past it before a fill
--            served it), it leaves KEYS[6] and its reservation is released as by finish.
--            Exactly once: only the call that removes it from KEYS[6] releases. Returns
--            {1 lapsed / 0 not (served, fresh, or lapsed already), slots released}.
--   expire   ARGV: who, maxlog, trajectory id. If the trajectory is open past its expiry
--            (server time), it is no longer open, counted expired, and its reservation
--            released as by finish (a group's: an incomplete group is never served).
--            Returns {1 expired / 0 not (finished, or moved by a turn), slots released}.
local A, LOG, RES, OPEN, DONE = KEYS[1], KEYS[2], KEYS[3], KEYS[5], KEYS[6]
local op = ARGV[1]
local WAKE = A .. ':wake' -- a channel, not a key: waiting gateways look again when told

local function num(key, field)
  return tonumber(redis.call('HGET', key, field) or '')
end

if op == 'declare' then
  local recipe, rv = ARGV[2], tonumber(ARGV[3])
  local version, batch = tonumber(ARGV[4]), tonumber(ARGV[5])
  local cur = redis.call('HGET', A, 'recipe')
  if cur and cur ~= recipe then return -1 end
  local rv0, v0 = num(A, 'rv'), num(A, 'version')
  if rv0 and rv < rv0 then return 0 end
  redis.call('HSET', A, 'recipe', recipe, 'rv', rv, 'version', version, 'batch', batch,
    'staleness', ARGV[6], 'group', ARGV[7])
  if ARGV[8] == '1' or v0 == nil or version < v0 then
    redis.call('HSET', A, 'admitted', version * batch)
    redis.call('DEL', OPEN, DONE)
  end
  redis.call('PUBLISH', WAKE, version)
  return 1
end

local budget, admitted = -1, num(A, 'admitted') or 0
local batch = num(A, 'batch')
local version, s = num(A, 'version'), num(A, 'staleness')
if batch then budget = (s + version + 1) * batch end

if op == 'give' then
  local slots = math.min(tonumber(ARGV[2]), admitted)
  if batch == nil or slots <= 0 then return 0 end
  redis.call('HSET', A, 'admitted', admitted - slots)
  redis.call('HINCRBY', A, 'released', slots)
  redis.call('XADD', LOG, 'MAXLEN', '~', ARGV[4], '*', 'op', 'release', 't', ARGV[5],
    'slots', slots, 'admitted', admitted - slots, 'budget', budget, 'v', version, 'w', ARGV[3])
  redis.call('PUBLISH', WAKE, version)
  return slots
end

-- The length bucket of trajectory T: the power of two at or above its turns (65+ past 64).
local function bucket(T)
  local n, b = tonumber(redis.call('HGET', T, 'turns') or '0'), 1
  while b < n and b < 128 do b = b * 2 end
  if b > 64 then return '65+' end
  return tostring(b)
end

-- Release trajectory T's reservation (its group's, once); returns the slots released.
local function release(T, opname, who, maxlog, uid, vmin)
  local res, slots = redis.call('HGET', T, 'res'), 0
  if res and res ~= '' then
    if redis.call('HSETNX', RES, 'rel:' .. res, 1) == 1 then
      slots = tonumber(redis.call('HGET', RES, 'size:' .. res) or '0')
      if redis.call('HGET', RES, 'round') == res then
        redis.call('HSET', RES, 'left', 0) -- its unused slots went back with it
      end
    end
  elseif redis.call('HSETNX', T, 'rel', 1) == 1 then
    slots = 1
  end
  if slots > 0 then
    local left = math.max(0, admitted - slots)
    redis.call('HSET', A, 'admitted', left)
    if opname == 'release' then redis.call('HINCRBY', A, 'released', slots) end
    redis.call('XADD', LOG, 'MAXLEN', '~', maxlog, '*', 'op', opname, 't', uid,
      'slots', slots, 'admitted', left, 'budget', budget, 'v', version, 'vmin', vmin, 'w', who)
    redis.call('PUBLISH', WAKE, version)
  end
  return slots
end

if op == 'finish' then
  local T = KEYS[4]
  redis.call('ZREM', OPEN, ARGV[5])
  local adm = redis.call('HGET', T, 'adm')
  if batch == nil or adm == false or adm == '-' then return 0 end
  if redis.call('HSETNX', T, 'fin', 1) == 0 then return 0 end
  local vmin = tonumber(ARGV[2]) or tonumber(adm)
  local b = bucket(T)
  redis.call('HINCRBY', A, 'rewarded:' .. b, 1)
  if vmin >= version - s then
    redis.call('ZADD', DONE, vmin, ARGV[5])
    return 0
  end
  redis.call('ZREM', DONE, ARGV[5])
  redis.call('HINCRBY', A, 'stale:' .. b, 1)
  return release(T, 'release', ARGV[3], ARGV[4], ARGV[5], vmin)
end

if op == 'lapse' then
  local T, uid = KEYS[4], ARGV[4]
  local vmin = tonumber(redis.call('ZSCORE', DONE, uid) or '')
  if batch == nil or vmin == nil or vmin >= version - s then return {0, 0} end
  redis.call('ZREM', DONE, uid)
  redis.call('HINCRBY', A, 'lapsed', 1)
  redis.call('HINCRBY', A, 'stale:' .. bucket(T), 1)
  return {1, release(T, 'release', ARGV[2], ARGV[3], uid, vmin)}
end

if op == 'expire' then
  local uid = ARGV[4]
  local due = tonumber(redis.call('ZSCORE', OPEN, uid) or '')
  local now = redis.call('TIME')
  if due == nil or due > tonumber(now[1]) + tonumber(now[2]) / 1e6 then return {0, 0} end
  redis.call('ZREM', OPEN, uid)
  redis.call('HINCRBY', A, 'expired', 1)
  local adm = redis.call('HGET', KEYS[4], 'adm')
  if batch == nil or adm == false or adm == '-' then return {1, 0} end
  return {1, release(KEYS[4], 'expire', ARGV[2], ARGV[3], uid, tonumber(adm))}
end

-- enter
local keyhash, group, first, last = ARGV[2], ARGV[3], ARGV[4], ARGV[5]
local who, maxlog, ttl, expiry = ARGV[6], ARGV[7], tonumber(ARGV[8]), tonumber(ARGV[9])
local split, wanted = tonumber(ARGV[10]), tonumber(ARGV[11])
local sgroup, srw, ch = '', 0, 0
if keyhash ~= '' then
  local f = redis.call('HMGET', KEYS[4], 'key', 'grp', 'rw', 'done', 'ch')
  if f[1] ~= keyhash then return {-2, budget, admitted, '', 0, 0, 0} end
  sgroup, srw, ch = f[2] or '', tonumber(f[3] or '0'), tonumber(f[5] or '0')
  if f[4] then return {-4, budget, admitted, sgroup, srw, 0, ch} end
  if group == '' then
    group = sgroup
  elseif group ~= sgroup then
    return {-3, budget, admitted, sgroup, srw, 0, ch}
  end
  if split == 0 and wanted > ch then return {-5, budget, admitted, sgroup, srw, 0, ch} end
end
-- The call passes: a session's split makes its choices the key's.
local function granted()
  if keyhash ~= '' and split > ch then
    redis.call('HSET', KEYS[4], 'ch', split)
    ch = split
  end
end
if ARGV[12] == nil then -- a key check only
  granted()
  return {1, budget, admitted, sgroup, srw, 0, ch}
end
local need = {}
for i = 6, #KEYS do
  if redis.call('HEXISTS', KEYS[i], 'adm') == 0 then need[#need + 1] = i end
end
if #need == 0 then
  granted()
  return {1, budget, admitted, sgroup, srw, 0, ch}
end
if batch == nil then -- no trainer declared a budget: admitted, not counted
  for _, i in ipairs(need) do
    redis.call('HSET', KEYS[i], 'adm', '-', 'grp', group)
    if redis.call('TTL', KEYS[i]) < 0 then redis.call('EXPIRE', KEYS[i], ttl) end
  end
  granted()
  return {1, budget, admitted, sgroup, srw, #need, ch}
end
local size = num(A, 'group') or 1
local grouped = group ~= '' and size > 1
local slots, left, round = #need, 0, 0
if grouped then
  left, round = num(RES, 'left') or 0, num(RES, 'round') or 0
  local rest = #need - math.min(left, #need)
  slots = math.ceil(rest / size) * size
end
if admitted + slots > budget then
  if first == '1' then redis.call('HINCRBY', A, 'waited', 1) end
  if last == '1' then redis.call('HINCRBY', A, 'refused', 1) end
  return {0, budget, admitted, sgroup, srw, 0, ch}
end
for _, i in ipairs(need) do
  local res = ''
  if grouped then
    if left == 0 then
      round, left = round + 1, size
      redis.call('HSET', RES, 'size:' .. round, size)
    end
    left = left - 1
    res = round
  end
  redis.call('HSET', KEYS[i], 'adm', version, 'res', res, 'grp', group)
  if redis.call('TTL', KEYS[i]) < 0 then redis.call('EXPIRE', KEYS[i], ttl) end
end
local ids = {}
for _, i in ipairs(need) do ids[#ids + 1] = ARGV[i + 6] end
if expiry > 0 then
  local now = redis.call('TIME')
  local due = tonumber(now[1]) + tonumber(now[2]) / 1e6 + expiry
  for _, id in ipairs(ids) do redis.call('ZADD', OPEN, due, id) end
end
if grouped then
  redis.call('HSET', RES, 'round', round, 'left', left)
  redis.call('EXPIRE', RES, ttl)
end
admitted = admitted + slots
redis.call('HSET', A, 'admitted', admitted)
redis.call('HINCRBY', A, 'total', #need)
redis.call('XADD', LOG, 'MAXLEN', '~', maxlog, '*', 'op', 'admit', 't', table.concat(ids, ' '),
  'g', group, 'slots', slots, 'admitted', admitted, 'budget', budget, 'v', version, 'w', who)
granted()
return {1, budget, admitted, sgroup, srw, #need, ch}
