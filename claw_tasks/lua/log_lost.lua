-- log_lost(key, last, seen): whether a change-log reader lost entries after the last one
-- it applied (trimmed or deleted), ``last`` being that entry's id ('0-0': none) and
-- ``seen`` the entries the log had added up to and including it. Included by
-- log_since.lua and reread.lua (a sync's round trip: one script call a shard fewer).
local function log_lost(key, last, seen)
  if redis.call('EXISTS', key) == 0 then
    return seen > 0 and 1 or 0
  end
  local function after(a, b)
    local am, as = string.match(a, '^(%d+)-(%d+)$')
    local bm, bs = string.match(b, '^(%d+)-(%d+)$')
    am, as, bm, bs = tonumber(am), tonumber(as), tonumber(bm), tonumber(bs)
    return am > bm or (am == bm and as > bs)
  end
  local info = redis.call('XINFO', 'STREAM', key)
  local f = {}
  for i = 1, #info, 2 do f[info[i]] = info[i + 1] end
  if f['entries-added'] then
    -- Trimming removes the oldest entries: the first one left is number added - length + 1.
    if f['entries-added'] - f['length'] > seen or after(f['max-deleted-entry-id'], last) then
      return 1
    end
  elseif f['first-entry'] and after(f['first-entry'][1], last) then
    return 1 -- Redis < 7 does not count entries: any gap may be a loss
  end
  return 0
end
