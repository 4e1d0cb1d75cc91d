--! include log_lost
-- A sync's re-read in the round trip of its change-log page (store/changes.py, SyncReads):
-- whether the reader lost entries (log_since.lua's check, which this replaces in a sync's
-- round trip: one script call a shard fewer), then the slots that the entries after the
-- reader's position took or freed (events with seq and n: ins, evict), every column and
-- their alive bits, read with the log in one atomic step. Queued after the page's plain
-- XRANGE, it sees those entries and maybe newer ones.
-- KEYS[1] the shard's change log, KEYS[2] its alive bitmap
-- ARGV: 1 shard prefix, 2 slots per shard (cap), 3 the reader's last entry id ('0-0':
--       none), 4 entries the log had added up to and including it, 5 most entries, 6 most
--       slots, then per column (from 7): key base (e.g. 'm:reward', 'f:obs'), row bytes,
--       slots per chunk; row bytes 0: a run column ('mr:timestamp'), whose blocks' run
--       tables come as one list (missing: '')
-- Returns {lost} when entries were lost (1) or past those limits (0: the reader re-reads
-- the page's slots itself), else {0, entries seen, then per merged slot span [start,
-- stop): start, stop, each column's rows (zero-padded), the alive bytes (start // 8 ..
-- (stop - 1) // 8)}.
local prefix, cap, most = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[5])
local lost = log_lost(KEYS[1], ARGV[3], tonumber(ARGV[4]))
if lost == 1 then return {1} end
local entries = redis.call('XRANGE', KEYS[1], '(' .. ARGV[3], '+', 'COUNT', most + 1)
if #entries > most then return {0} end
local spans = {}
for _, entry in ipairs(entries) do
  local kv, seq, n = entry[2], nil, nil
  for i = 1, #kv, 2 do
    if kv[i] == 'seq' then
      seq = tonumber(kv[i + 1])
    elseif kv[i] == 'n' then
      n = tonumber(kv[i + 1])
    end
  end
  if seq and n and n > 0 then
    local start = (seq - 1) % cap
    n = math.min(n, cap)
    if start + n <= cap then
      spans[#spans + 1] = {start, start + n}
    else -- the ring wraps
      spans[#spans + 1] = {start, cap}
      spans[#spans + 1] = {0, start + n - cap}
    end
  end
end
table.sort(spans, function(a, b) return a[1] < b[1] end)
local merged, total = {}, 0
for _, span in ipairs(spans) do
  local last = merged[#merged]
  if last and span[1] <= last[2] then
    last[2] = math.max(last[2], span[2])
  else
    merged[#merged + 1] = {span[1], span[2]}
  end
end
for _, span in ipairs(merged) do total = total + span[2] - span[1] end
if total > tonumber(ARGV[6]) then return {0} end
local out = {0, #entries}
for _, span in ipairs(merged) do
  local start, stop = span[1], span[2]
  out[#out + 1] = start
  out[#out + 1] = stop
  for a = 7, #ARGV, 3 do
    local base, size, cs = prefix .. ARGV[a] .. ':', tonumber(ARGV[a + 1]), tonumber(ARGV[a + 2])
    local parts, slot = {}, start
    if size == 0 then -- a run column (key base 'mr:<col>'): each block's table, whole
      for block = math.floor(start / cs), math.floor((stop - 1) / cs) do
        parts[#parts + 1] = redis.call('GET', base .. block) or ''
      end
      out[#out + 1] = parts
      slot = stop
    end
    while slot < stop do -- one GETRANGE per chunk the span crosses
      local chunk, inchunk = math.floor(slot / cs), slot % cs
      local len = math.min(stop - slot, cs - inchunk)
      local piece = redis.call('GETRANGE', base .. chunk, inchunk * size, (inchunk + len) * size - 1)
      if #piece < len * size then piece = piece .. string.rep('\0', len * size - #piece) end
      parts[#parts + 1] = piece
      slot = slot + len
    end
    if size > 0 then -- one piece as it is: a concat copies it (~45 us a call for 16 columns)
      out[#out + 1] = #parts == 1 and parts[1] or table.concat(parts)
    end
  end
  out[#out + 1] = redis.call('GETRANGE', KEYS[2], math.floor(start / 8), math.floor((stop - 1) / 8))
end
return out
