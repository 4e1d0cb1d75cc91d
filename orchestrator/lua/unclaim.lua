-- Release the claims of a `once` batch dropped unserved (a recipe change drained it, a pop
-- found it stale, a fill took it back): its groups are drawn again in the same pass.
-- KEYS[1]: the recipe's claims hash (claim.lua). ARGV[1]: "<pass>:<batch token>", the
-- batch's mark; ARGV[2..]: its group ids. Only claims still holding that mark go: a pass
-- that moved on, or another batch's claim of the group since, stays. Returns the count.
local n = 0
for i = 2, #ARGV do
  if redis.call('HGET', KEYS[1], ARGV[i]) == ARGV[1] then
    redis.call('HDEL', KEYS[1], ARGV[i])
    n = n + 1
  end
end
return n
