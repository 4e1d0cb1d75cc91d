-- Claim a batch's groups for one pass of a `once` group recipe: all or nothing, so prefetch
-- workers that race never deliver a group twice in one pass.
-- KEYS[1]: the recipe's claims hash: field "~pass" = the current pass, field <group id> =
--          "<pass>:<batch token>", the pass the group was delivered in and by which batch
--          (a batch dropped unserved releases exactly its own claims: unclaim.lua).
-- ARGV[1]: the pass the caller drew for: the current one, or the current + 1 to start the
--          next pass (which clears the claims of the last).
-- ARGV[2]: the batch's token. ARGV[3..]: the group ids.
-- Returns 1 when every group was claimed, 0 when the pass moved or a group was taken.
local cur = tonumber(redis.call('HGET', KEYS[1], '~pass') or '0')
local want = tonumber(ARGV[1])
if want == cur + 1 then
  redis.call('DEL', KEYS[1])
  redis.call('HSET', KEYS[1], '~pass', want)
elseif want ~= cur then
  return 0
else
  for i = 3, #ARGV do
    local v = redis.call('HGET', KEYS[1], ARGV[i])
    if v and tonumber(string.match(v, '^%d+')) == want then
      return 0
    end
  end
end
local mark = want .. ':' .. ARGV[2]
for i = 3, #ARGV do
  redis.call('HSET', KEYS[1], ARGV[i], mark)
end
return 1
