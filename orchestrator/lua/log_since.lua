-- Whether a change-log reader lost entries after the last one it applied (trimmed or
-- deleted): then it must rebuild from the columns. The entries themselves are read by a
-- plain XRANGE queued just before this check (orchestrator.sampling.changelog): returned
-- through Lua, a page of 1,000 cost Redis ~3.8 ms, natively ~0.65 ms. The check needs no
-- atomicity with that read: the counts it compares only grow, so a loss before the read
-- still shows here, and one after it only makes the reader rebuild when it need not.
-- KEYS[1] the shard's change log
-- ARGV: 1 last applied entry id ('0-0': none), 2 entries the log had added up to and
--       including it
-- Returns 1 when entries were lost, else 0.
local seen = tonumber(ARGV[2])
if redis.call('EXISTS', KEYS[1]) == 0 then
  return seen > 0 and 1 or 0
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
if f['entries-added'] then
  -- Trimming removes the oldest entries: the first one left is number added - length + 1.
  if f['entries-added'] - f['length'] > seen or after(f['max-deleted-entry-id'], ARGV[1]) then
    return 1
  end
elseif f['first-entry'] and after(f['first-entry'][1], ARGV[1]) then
  return 1 -- Redis < 7 does not count entries: any gap may be a loss
end
return 0
