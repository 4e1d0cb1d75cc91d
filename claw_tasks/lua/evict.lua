--! include ranges
-- Evict steps of one shard (retention, manual): a planned chunk of victims, each checked
-- first (its slot still holds its id and is alive; else skipped). For each: the alive bit
-- is cleared, its sparse payload entries (ragged fields, explicit next_obs, info) and its
-- episode-link entries removed. A live predecessor whose next_obs is this step's obs gets
-- a copy of it as its explicit next_obs first (a transition stays whole). Fixed-size
-- payload and metadata bytes stay in their preallocated chunks (the ring reuses them), so
-- a predecessor checked by `claw doctor` still points at the id it linked to.
-- Episodes left without live steps lose their name, newest-seq and index entries, unless a
-- commit of theirs landed since the plan was made (every commit changes the `eplast` value:
-- a newer seq, or an older part's late commit respells the same one, see commit.lua).
-- Commands are batched (one GETRANGE for the alive bits and one per id chunk, one HDEL
-- per hash, alive bits cleared by runs), so a call costs a few commands plus Lua work.
-- KEYS: 1 alive bitmap, 2 evicted counter (update.lua checks alive bits once it exists),
--       3 evictions by reason (hash), 4 change log, 5 episode links, 6 episode names,
--       7 episode -> newest seq, 8 episode index, 9.. chunk keys the plan refers to by
--       KEYS index
-- ARGV: 1 reason, 2 log length, 3 plan (msgpack):
--   {victims = {{slot, id (<i8 bytes), id key, id offset (bytes), seq, episode code
--                (string), step_index, {sparse keys}, pred}...},
--    episodes = {{episode code, newest seq as planned ('' = none)}...}}
--   pred = {} or {slot, id (<i8 bytes), id key, id offset, flags key, flags offset,
--           next key, next offset, delta, source kind ('f' | 'h'), source key,
--           source offset (bytes, 'f') , row bytes ('f'), nx key, flags chunk bytes}
-- Returns {evicted, relinked}.
local reason, loglen = ARGV[1], tonumber(ARGV[2])
local plan = cmsgpack.unpack(ARGV[3])
local alive = KEYS[1]
local victims = plan.victims or {}

-- Alive bits of all victims: one GETRANGE of the bitmap's bytes over their span.
local bits = {}
if #victims > 0 then
  local lo, hi = victims[1][1], victims[1][1]
  for _, v in ipairs(victims) do lo = math.min(lo, v[1]); hi = math.max(hi, v[1]) end
  lo, hi = math.floor(lo / 8), math.floor(hi / 8)
  if hi - lo < 65536 then
    local bytes = redis.call('GETRANGE', alive, lo, hi)
    for i, v in ipairs(victims) do
      local b = string.byte(bytes, math.floor(v[1] / 8) - lo + 1) or 0
      bits[i] = math.floor(b / 2 ^ (7 - v[1] % 8)) % 2
    end
  else
    for i, v in ipairs(victims) do bits[i] = redis.call('GETBIT', alive, v[1]) end
  end
end

-- Ids: one GETRANGE per id chunk over the span the victims need.
local span = {}
for _, v in ipairs(victims) do
  local s = span[v[3]]
  if not s then span[v[3]] = {v[4], v[4]} else
    s[1] = math.min(s[1], v[4]); s[2] = math.max(s[2], v[4])
  end
end
local idbytes = {}
for k, s in pairs(span) do
  idbytes[k] = {s[1], redis.call('GETRANGE', KEYS[k], s[1], s[2] + 7)}
end
local function holds(k, off, id)
  local got = idbytes[k]
  if got and off >= got[1] and off + 8 <= got[1] + #got[2] then
    return string.sub(got[2], off - got[1] + 1, off - got[1] + 8) == id
  end
  return redis.call('GETRANGE', KEYS[k], off, off + 7) == id
end

local ids, pred_ids, pred_flags, clear, sparse, fields, seqs = {}, {}, {}, {}, {}, {}, {}
for i, v in ipairs(victims) do
  local slot, id, idk, idoff, seq, code, idx, keys, pred =
    v[1], v[2], v[3], v[4], v[5], v[6], v[7], v[8], v[9]
  if bits[i] == 1 and holds(idk, idoff, id) then
    if pred and #pred > 0 then
      local pslot, pid, pidk, pidoff, pfk, pfoff, pnk, pnoff, delta, kind, srck, srcoff, size, nxk,
        flen = unpack(pred)
      local flags = string.byte(redis.call('GETRANGE', KEYS[pfk], pfoff, pfoff)) or 0
      if redis.call('GETBIT', alive, pslot) == 1 and holds(pidk, pidoff, pid) and
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
        if redis.call('EXISTS', KEYS[pfk]) == 0 then  -- all flags zero so far: sized now
          redis.call('SETRANGE', KEYS[pfk], flen - 1, '\0')
        end
        redis.call('SETRANGE', KEYS[pfk], pfoff, flags)
        redis.call('SETRANGE', KEYS[pnk], pnoff, struct.pack('<i4', 0))
        pred_ids[#pred_ids + 1] = pid
        pred_flags[#pred_flags + 1] = flags
      end
    end
    clear[#clear + 1] = slot
    for _, k in ipairs(keys) do
      sparse[k] = sparse[k] or {}
      table.insert(sparse[k], slot)
    end
    fields[#fields + 1] = 't:' .. code .. ':' .. idx
    fields[#fields + 1] = 'h:' .. code .. ':' .. idx
    seqs[#seqs + 1] = seq
    ids[#ids + 1] = id
  end
end

local function each_batch(list, fn)  -- unpack() has a limit: at most 4000 at a time
  for j = 1, #list, 4000 do fn(unpack(list, j, math.min(j + 3999, #list))) end
end
-- Clear the alive bits by runs of consecutive slots (byte-wide where aligned).
table.sort(clear)
local j = 1
while j <= #clear do
  local k = j
  while k < #clear and clear[k + 1] == clear[k] + 1 do k = k + 1 end
  fill_bits(alive, clear[j], clear[k] + 1, 0)
  j = k + 1
end
for k, slots in pairs(sparse) do
  each_batch(slots, function(...) redis.call('HDEL', KEYS[k], ...) end)
end
if #fields > 0 then
  local got, stale = redis.call('HMGET', KEYS[5], unpack(fields)), {}
  for j = 1, #fields do
    if got[j] and tonumber(got[j]) == seqs[math.floor((j + 1) / 2)] then
      stale[#stale + 1] = fields[j]
    end
  end
  if #stale > 0 then redis.call('HDEL', KEYS[5], unpack(stale)) end
end

for _, e in ipairs(plan.episodes or {}) do
  local code, planned = e[1], e[2]
  if (redis.call('HGET', KEYS[7], code) or '') == planned then
    redis.call('HDEL', KEYS[7], code)
    redis.call('HDEL', KEYS[6], code)
    redis.call('HDEL', KEYS[8], code)
  end
end

if #ids > 0 then
  redis.call('INCRBY', KEYS[2], #ids)
  redis.call('HINCRBY', KEYS[3], reason, #ids)
  -- Runs of consecutive seqs are logged as ranges (readers re-read them), the rest by id:
  -- small events, however many steps go.
  local id_of, order = {}, {}
  for j, seq in ipairs(seqs) do id_of[seq] = ids[j]; order[j] = seq end
  table.sort(order)
  local single, j = {}, 1
  while j <= #order do
    local k = j
    while k < #order and order[k + 1] == order[k] + 1 do k = k + 1 end
    if k > j then
      redis.call('XADD', KEYS[4], 'MAXLEN', '~', loglen, '*', 'op', 'evict', 'reason', reason,
        'seq', order[j], 'n', k - j + 1)
    else
      single[#single + 1] = id_of[order[j]]
    end
    j = k + 1
  end
  if #single > 0 then
    redis.call('XADD', KEYS[4], 'MAXLEN', '~', loglen, '*', 'op', 'evict', 'reason', reason,
      'ids', table.concat(single))
  end
end
if #pred_ids > 0 then
  local zeros = string.rep('\0', 4 * #pred_ids)
  redis.call('XADD', KEYS[4], 'MAXLEN', '~', loglen, '*', 'op', 'cur', 'col', 'flags',
    'ids', table.concat(pred_ids), 'values', table.concat(pred_flags))
  redis.call('XADD', KEYS[4], 'MAXLEN', '~', loglen, '*', 'op', 'cur', 'col', 'next',
    'ids', table.concat(pred_ids), 'values', zeros)
end
return {#ids, #pred_ids}
