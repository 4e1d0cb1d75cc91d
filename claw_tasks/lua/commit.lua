--! include ranges
-- Commit one shard's part of a batch atomically over its allocated slot range.
-- KEYS: 1 batch marker, 2 seq counter, 3 change log, 4 episode links hash,
--       5 episode names hash, 6 alive bitmap, 7 episode -> newest seq hash,
--       8 pruning cursors, 9 episode index (code -> (step_index <i4, id <i8) entries)
-- ARGV: 1 shard prefix, 2 n, 3 cap, 4 marker ttl, 5 seq0, 6 shard, 7 n_shards,
--       8 meta chunk slots, 9 spec (msgpack), 10.. blobs (columns, then sparse rows)
-- spec = {cols = {{base, itemsize, chunk_slots, zero, blobs}...} (a column's rows come in
--         `blobs` blobs, cut where its chunks end from seq0's slot on, so that no write
--         copies a piece of one: Lua hashes every string it makes, ~2.5 us per KB here;
--         zero: every byte of the column is zero and it comes in no blob: a chunk that
--         does not exist stays missing, it reads as zeros),
--         sparse = {{base, chunk_slots, rows}...},
--         clear = {{base, chunk_slots}...}, eps = {{code, first_rel, first_idx, last_rel,
--         last_idx, ended, name, newest_rel[, {step_index, id, ...}]}...} (newest_rel: the
--         episode's highest row in the part), dead = {rel rows left not alive},
--         loglen = n,
--         runs = {{base, block_slots, {{first row, records}...}}...} (run-table
--         columns, layout.py RUN_COLUMNS: the part's rows cut where blocks end from seq0's
--         slot on, as a column's blobs; each piece's runs as the records a block's table
--         holds, packed by the client: <u2 slot in the block, 8 value bytes, the first at
--         the piece's first slot)}
-- Payload fields the client wrote in place (see alloc.lua) are not in cols.
-- Returns {seq0, state, skipped}: state "done" (committed now or before) or "expired";
-- the first `skipped` rows were not committed: newer seqs took their slots in between
-- (past capacity already; with payloads written in place, those bytes are the newer
-- steps' now).
local marker = redis.call('GET', KEYS[1])
local seq0 = tonumber(ARGV[5])
if marker and string.sub(marker, 1, 5) ~= 'alloc' then
  return {seq0, string.match(marker, '^(%a+)'), 0}
end
local prefix = ARGV[1]
local n, cap, ttl = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local shard, n_shards, mc = tonumber(ARGV[6]), tonumber(ARGV[7]), tonumber(ARGV[8])
local spec = cmsgpack.unpack(ARGV[9])

local slot0 = (seq0 - 1) % cap

-- Check every column before writing anything (a script is not rolled back): its blobs hold
-- its rows, whole, and are cut only where a chunk ends.
local at = 10
for _, c in ipairs(spec.cols) do
  local rows = 0
  for j = at, at + c[5] - 1 do
    rows = rows + #ARGV[j] / c[2]
    local cut = rows < n and (slot0 + rows) % cap % c[3] ~= 0
    if #ARGV[j] == 0 or #ARGV[j] % c[2] ~= 0 or cut then
      return redis.error_reply('column ' .. c[1] .. ': a blob of ' .. #ARGV[j] ..
        ' bytes is not whole rows of ' .. c[2] .. ' up to a chunk end')
    end
  end
  if rows ~= (c[4] and 0 or n) then
    return redis.error_reply('column ' .. c[1] .. ': ' .. rows .. ' rows sent for ' .. n)
  end
  at = at + c[5]
end

for _, rc in ipairs(spec.runs or {}) do
  local ok = #rc[3] > 0 and rc[3][1][1] == 0 and rc[3][#rc[3]][1] < n
  for k, piece in ipairs(rc[3]) do
    ok = ok and #piece[2] > 0 and #piece[2] % 10 == 0 and (k == 1 or piece[1] > rc[3][k - 1][1])
  end
  if not ok then
    return redis.error_reply('column ' .. rc[1] .. ': run pieces are not whole records from row 0')
  end
end

-- Rows whose slots newer seqs took since allocation are already past capacity.
local seq_now = tonumber(redis.call('GET', KEYS[2]) or '0')
local skip = math.max(0, seq_now - cap + 1 - seq0)
if skip >= n then
  redis.call('SET', KEYS[1], 'expired:' .. seq0, 'EX', ttl)
  return {seq0, 'expired', n}
end

-- Runs over the rows that are committed, [skip, n); fn gets the row index i.
local function runs(cs, fn)
  slot_runs((slot0 + skip) % cap, n - skip, cap, cs, function(i, slot, chunk, inchunk, len)
    fn(i + skip, slot, chunk, inchunk, len)
  end)
end

-- The ring overwrote older steps in these slots: drop their sparse entries.
if seq0 + n - 1 > cap then
  for _, c in ipairs(spec.clear) do
    local base, cs = c[1], c[2]
    runs(cs, function(i, slot, chunk, inchunk, len)
      local key = prefix .. base .. ':' .. chunk
      if redis.call('EXISTS', key) == 1 then
        local f = {}
        for s = slot, slot + len - 1 do f[#f + 1] = s end
        for j = 1, #f, 4000 do
          redis.call('HDEL', key, unpack(f, j, math.min(j + 3999, #f)))
        end
      end
    end)
  end
end

local argi = 10
for _, c in ipairs(spec.cols) do
  local base, size, cs, zero = c[1], c[2], c[3], c[4]
  local j, row = argi, 0  -- the blob that holds rows from `row` on
  argi = argi + c[5]

  runs(cs, function(i, slot, chunk, inchunk, len)
    local key = prefix .. base .. ':' .. chunk
    if zero and redis.call('EXISTS', key) == 0 then return end
    size_chunk(key, chunk, cs, cap, size)
    local piece
    if zero then
      piece = string.rep('\0', len * size)
    else
      while row + #ARGV[j] / size <= i do row, j = row + #ARGV[j] / size, j + 1 end
      piece = ARGV[j]  -- a run lies in one blob: both end where a chunk does
      if row ~= i or #piece ~= len * size then  -- a run of rows after skipped ones
        piece = string.sub(piece, (i - row) * size + 1, (i - row + len) * size)
      end
    end
    redis.call('SETRANGE', key, inchunk * size, piece)
  end)
end

-- Run-table columns: each piece of committed rows inside one block splices the block's
-- table of records (<u2 first slot in the block, 8 value bytes), sorted by slot, so that
-- every other slot keeps the value it had; equal neighbours merge.
local ZERO8 = string.rep('\0', 8)
local function rec_slot(t, k) return (struct.unpack('<H', t, k * 10 + 1)) end  -- k from 0
local function first_at(t, m, s)  -- the first record whose slot is >= s (0-based)
  local lo, hi = 0, m
  while lo < hi do
    local mid = math.floor((lo + hi) / 2)
    if rec_slot(t, mid) < s then lo = mid + 1 else hi = mid end
  end
  return lo
end
for _, rc in ipairs(spec.runs or {}) do
  local base, bs, pieces = rc[1], rc[2], rc[3]
  local p = 1  -- the piece that holds row i
  runs(bs, function(i, slot, block, inblock, len)
    while p < #pieces and pieces[p + 1][1] <= i do p = p + 1 end
    local new = pieces[p][2]
    if pieces[p][1] < i then  -- its first rows were skipped: its runs from row i on
      local k = first_at(new, #new / 10, inblock)
      if k == #new / 10 or rec_slot(new, k) ~= inblock then
        new = struct.pack('<H', inblock) .. string.sub(new, k * 10 - 7, k * 10) ..
          string.sub(new, k * 10 + 1)
      else
        new = string.sub(new, k * 10 + 1)
      end
    end
    local last = string.sub(new, -8)
    local key = prefix .. base .. ':' .. block
    local t = redis.call('GET', key) or ''
    local m, stop = #t / 10, inblock + len
    local a, e = first_at(t, m, inblock), first_at(t, m, stop)
    if string.sub(new, 3, 10) == (a > 0 and string.sub(t, a * 10 - 7, a * 10) or ZERO8) then
      new = string.sub(new, 11)  -- the run before goes on
    end
    local tail = e * 10 + 1  -- records from slot `stop` on stay
    if e < m and rec_slot(t, e) == stop then
      if string.sub(t, e * 10 + 3, e * 10 + 10) == last then tail = tail + 10 end
    elseif stop < math.min(bs, cap - block * bs) then  -- the old value goes on from `stop`
      local after = e > 0 and string.sub(t, e * 10 - 7, e * 10) or ZERO8
      if after ~= last then new = new .. struct.pack('<H', stop) .. after end
    end
    redis.call('SET', key, string.sub(t, 1, a * 10) .. new .. string.sub(t, tail))
  end)
end

for _, sp in ipairs(spec.sparse) do
  local base, cs, rows = sp[1], sp[2], sp[3]
  for _, rel in ipairs(rows) do
    if rel >= skip then
      local slot = (slot0 + rel) % cap
      redis.call('HSET', prefix .. base .. ':' .. math.floor(slot / cs), slot, ARGV[argi])
    end
    argi = argi + 1
  end
end

-- Alive bits over the range (byte-wide where aligned).
local alive = KEYS[6]
local nbytes = math.ceil(cap / 8)
if redis.call('STRLEN', alive) < nbytes then redis.call('SETRANGE', alive, nbytes - 1, '\0') end
runs(cap, function(i, slot, chunk, inchunk, len) fill_bits(alive, slot, slot + len, 1) end)
for _, rel in ipairs(spec.dead) do  -- rejected rows of a batch written in place
  if rel >= skip then redis.call('SETBIT', alive, (slot0 + rel) % cap, 0) end
end
if #spec.dead > 0 then  -- alive bits now matter beyond the ring (see update.lua)
  redis.call('INCRBY', prefix .. 'evicted', #spec.dead)
end

-- Episode links across batches: a run's first step finds its predecessor's tail, a run's
-- last step finds its successor's head (batches of one episode may commit out of order).
local linked = {}
local function link(from_seq, to_seq)
  local slot = (from_seq - 1) % cap
  local chunk, off = math.floor(slot / mc), slot % mc
  local id = redis.call('GETRANGE', prefix .. 'm:id:' .. chunk, off * 8, off * 8 + 7)
  if id ~= struct.pack('<i8', from_seq * n_shards + shard) then return end
  size_chunk(prefix .. 'm:next:' .. chunk, chunk, mc, cap, 4)  -- missing if all zero so far
  redis.call('SETRANGE', prefix .. 'm:next:' .. chunk, off * 4, struct.pack('<i4', to_seq - from_seq))
  linked[#linked + 1] = from_seq .. ':' .. (to_seq - from_seq)
end
local links = KEYS[4]
local newest_of, touched = {}, {}  -- episode code -> its newest seq committed now
for _, ep in ipairs(spec.eps) do
  local code, first_rel, first_idx, last_rel, last_idx, ended, name =
    ep[1], ep[2], ep[3], ep[4], ep[5], ep[6], ep[7]
  local first_seq, last_seq = seq0 + first_rel, seq0 + last_rel
  if first_idx > 0 and first_rel >= skip then
    local tkey = 't:' .. code .. ':' .. (first_idx - 1)
    local prev = redis.call('HGET', links, tkey)
    if prev then
      link(tonumber(prev), first_seq)
      redis.call('HDEL', links, tkey)
    else
      redis.call('HSET', links, 'h:' .. code .. ':' .. first_idx, first_seq)
    end
  end
  if not ended and last_rel >= skip then
    local hkey = 'h:' .. code .. ':' .. (last_idx + 1)
    local nxt = redis.call('HGET', links, hkey)
    if nxt then
      link(last_seq, tonumber(nxt))
      redis.call('HDEL', links, hkey)
    else
      redis.call('HSET', links, 't:' .. code .. ':' .. last_idx, last_seq)
    end
  end
  -- Name, newest seq and index only for an episode with a committed row (its newest row,
  -- ep[8], is past the skipped ones): entries of an episode without one would never be
  -- swept.
  if ep[8] >= skip then
    redis.call('HSETNX', KEYS[5], code, name)
    if ep[9] then  -- episode index: entries of skipped rows are dropped by readers (id check)
      local e, parts = ep[9], {}
      for j = 1, #e, 2 do parts[#parts + 1] = struct.pack('<i4i8', e[j], e[j + 1]) end
      -- Leading entries of steps the ring passed go (entries are in commit order, so an
      -- episode that never ends keeps about its live steps' worth, not every step it had).
      local old, from = redis.call('HGET', KEYS[9], code) or '', 1
      while from + 11 <= #old do
        local _, id = struct.unpack('<i4i8', old, from)
        if math.floor(id / n_shards) > seq_now - cap then break end
        from = from + 12
      end
      redis.call('HSET', KEYS[9], code, string.sub(old, from) .. table.concat(parts))
    end
    if not newest_of[code] then
      newest_of[code] = seq0 + ep[8]
      touched[#touched + 1] = code
    end
  end
end

-- An episode's newest seq is the highest of its committed steps, whatever their step order
-- or commit order: the sweep below drops its name and index once the ring passes it. When
-- an older part lands late, the number stays but its spelling changes ('N' <-> 'N.0', the
-- same number to tonumber), so that an eviction planned before this commit sees a change
-- and keeps the name (evict.lua).
for _, code in ipairs(touched) do
  local newest, had = newest_of[code], redis.call('HGET', KEYS[7], code)
  local value = string.format('%d', newest)
  if had and tonumber(had) >= newest then
    value = string.format('%d', tonumber(had))
    if had == value then value = value .. '.0' end
  end
  redis.call('HSET', KEYS[7], code, value)
end

-- Bounded memory: a few entries per commit, drop links and episode names whose steps the
-- ring has passed (crashed envs leave links; every episode leaves a name).
if seq_now > cap then
  local horizon = seq_now - cap
  local count = math.max(32, 2 * #spec.eps)
  local function sweep(hash, on_stale)
    local res = redis.call('HSCAN', hash, redis.call('HGET', KEYS[8], hash) or '0',
      'COUNT', count)
    redis.call('HSET', KEYS[8], hash, res[1])
    local kv = res[2]
    for i = 1, #kv, 2 do
      if tonumber(kv[i + 1]) <= horizon then on_stale(kv[i]) end
    end
  end
  sweep(KEYS[4], function(field) redis.call('HDEL', KEYS[4], field) end)
  sweep(KEYS[7], function(code)
    redis.call('HDEL', KEYS[7], code)
    redis.call('HDEL', KEYS[5], code)
    redis.call('HDEL', KEYS[9], code)
  end)
end

redis.call('XADD', KEYS[3], 'MAXLEN', '~', spec.loglen, '*',
  'op', 'ins', 'seq', seq0 + skip, 'n', n - skip, 'links', table.concat(linked, ','))
redis.call('SET', KEYS[1], 'done:' .. seq0, 'EX', ttl)
return {seq0, 'done', skip}
