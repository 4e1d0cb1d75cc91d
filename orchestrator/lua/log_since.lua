-- Change-log entries after the last one a reader applied, and whether any entry after it
-- is gone (trimmed or deleted): then the reader must rebuild from the columns.
-- KEYS[1] the shard's change log
-- ARGV: 1 last applied entry id ('0-0': none), 2 entries the log had added up to and
--       including it, 3 max entries to return
-- Returns {lost (0 | 1), entries as XRANGE returns them}.
local seen = tonumber(ARGV[2])
if redis.call('EXISTS', KEYS[1]) == 0 then
  return {seen > 0 and 1 or 0, {}}
end
local function after(a, b)
  local am, as = string.match(a, '^(%d+)-(%d+)$')
  local bm, bs = string.match(b, '^(%d+)-(%d+)$')
  am, as, bm, bs = tonumber(am), tonumber(as), tonumber(bm), tonumber(bs)
  return am > bm or (am == bm and as > bs)
end
local info = redis.call('XINFO', 'STREAM', KEYS[1])
local f = {}
for i = 1, #info, 2 do f[info[i]] = info[i + 1] end
local lost = 0
if f['entries-added'] then
  -- Trimming removes the oldest entries: the first one left is number added - length + 1.
  if f['entries-added'] - f['length'] > seen or after(f['max-deleted-entry-id'], ARGV[1]) then
    lost = 1
  end
elseif f['first-entry'] and after(f['first-entry'][1], ARGV[1]) then
  lost = 1 -- Redis < 7 does not count entries: any gap may be a loss
end
return {lost, redis.call('XRANGE', KEYS[1], '(' .. ARGV[1], '+', 'COUNT', ARGV[3])}
