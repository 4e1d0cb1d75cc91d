-- Evict steps of one shard (retention, manual): a planned chunk of victims, each checked
-- first (its slot still holds its id and is alive; else skipped). For each: the alive bit
-- is cleared, its sparse payload entries (ragged fields, explicit next_obs, info) and its
-- episode-link entries removed. A live predecessor whose next_obs is this step's obs gets
-- a copy of it as its explicit next_obs first (a transition stays whole). Fixed-size
-- payload and metadata bytes stay in their preallocated chunks (the ring reuses them), so
-- a predecessor checked by `claw doctor` still points at the id it linked to.
-- Episodes left without live steps lose their name and newest-seq entries, unless a newer
-- commit of theirs changed the newest seq since the plan was made.
-- KEYS: 1 alive bitmap, 2 evicted counter (update.lua checks alive bits once it exists),
--       3 evictions by reason (hash), 4 change log, 5 episode links, 6 episode names,
--       7 episode -> newest seq, 8.. chunk keys the plan refers to by KEYS index
-- ARGV: 1 reason, 2 log length, 3 plan (msgpack):
--   {victims = {{slot, id (<i8 bytes), id key, id offset (bytes), seq, episode code
--                (string), step_index, {sparse keys}, pred}...},
--    episodes = {{episode code, newest seq as planned ('' = none)}...}}
--   pred = {} or {slot, id (<i8 bytes), id key, id offset, flags key, flags offset,
--           next key, next offset, delta, source kind ('f' | 'h'), source key,
--           source offset (bytes, 'f') , row bytes ('f'), nx key}
-- Returns {evicted, relinked}.
local reason, loglen = ARGV[1], tonumber(ARGV[2])
local plan = cmsgpack.unpack(ARGV[3])
local alive = KEYS[1]
local ids, pred_ids, pred_flags = {}, {}, {}

local function holds(key, off, id)
  return redis.call('GETRANGE', key, off, off + 7) == id
end

for _, v in ipairs(plan.victims or {}) do
  local slot, id, idk, idoff, seq, code, idx, sparse, pred =
    v[1], v[2], v[3], v[4], v[5], v[6], v[7], v[8], v[9]
  if redis.call('GETBIT', alive, slot) == 1 and holds(KEYS[idk], idoff, id) then
    if pred and #pred > 0 then
      local pslot, pid, pidk, pidoff, pfk, pfoff, pnk, pnoff, delta, kind, srck, srcoff, size, nxk =
        unpack(pred)
      local flags = string.byte(redis.call('GETRANGE', KEYS[pfk], pfoff, pfoff)) or 0
      if redis.call('GETBIT', alive, pslot) == 1 and holds(KEYS[pidk], pidoff, pid) and
         bit.band(flags, 7) == 0 and
         redis.call('GETRANGE', KEYS[pnk], pnoff, pnoff + 3) == struct.pack('<i4', delta) then
        local obs
        if kind == 'f' then
          obs = redis.call('GETRANGE', KEYS[srck], srcoff, srcoff + size - 1)
        else
          obs = redis.call('HGET', KEYS[srck], slot) or ''
        end
        redis.call('HSET', KEYS[nxk], pslot, obs)
        flags = string.char(bit.bor(flags, 4))
        redis.call('SETRANGE', KEYS[pfk], pfoff, flags)
        redis.call('SETRANGE', KEYS[pnk], pnoff, struct.pack('<i4', 0))
        pred_ids[#pred_ids + 1] = pid
        pred_flags[#pred_flags + 1] = flags
      end
    end
    redis.call('SETBIT', alive, slot, 0)
    for _, k in ipairs(sparse) do redis.call('HDEL', KEYS[k], slot) end
    for _, end_ in ipairs({'t:', 'h:'}) do
      local field = end_ .. code .. ':' .. idx
      if tonumber(redis.call('HGET', KEYS[5], field) or '-1') == seq then
        redis.call('HDEL', KEYS[5], field)
      end
    end
    ids[#ids + 1] = id
  end
end

for _, e in ipairs(plan.episodes or {}) do
  local code, planned = e[1], e[2]
  if (redis.call('HGET', KEYS[7], code) or '') == planned then
    redis.call('HDEL', KEYS[7], code)
    redis.call('HDEL', KEYS[6], code)
  end
end

if #ids > 0 then
  redis.call('INCRBY', KEYS[2], #ids)
  redis.call('HINCRBY', KEYS[3], reason, #ids)
  redis.call('XADD', KEYS[4], 'MAXLEN', '~', loglen, '*', 'op', 'evict', 'reason', reason,
    'ids', table.concat(ids))
end
if #pred_ids > 0 then
  local zeros = string.rep('\0', 4 * #pred_ids)
  redis.call('XADD', KEYS[4], 'MAXLEN', '~', loglen, '*', 'op', 'cur', 'col', 'flags',
    'ids', table.concat(pred_ids), 'values', table.concat(pred_flags))
  redis.call('XADD', KEYS[4], 'MAXLEN', '~', loglen, '*', 'op', 'cur', 'col', 'next',
    'ids', table.concat(pred_ids), 'values', zeros)
end
return {#ids, #pred_ids}
