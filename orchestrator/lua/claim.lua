-- Claim a batch's groups for one pass of a `once` group recipe: all or nothing, so prefetch
-- workers that race never deliver a group twice in one pass.
-- KEYS[1]: the recipe's claims hash: field "~pass" = the current pass, field <group id> =
--          the pass the group was delivered in.
-- ARGV[1]: the pass the caller drew for: the current one, or the current + 1 to start the
--          next pass (which clears the claims of the last).
-- ARGV[2..]: the group ids.
-- Returns 1 when every group was claimed, 0 when the pass moved or a group was taken.
local cur = tonumber(redis.call('HGET', KEYS[1], '~pass') or '0')
local want = tonumber(ARGV[1])
if want == cur + 1 then
  redis.call('DEL', KEYS[1])
  redis.call('HSET', KEYS[1], '~pass', want)
elseif want ~= cur then
  return 0
else
  for i = 2, #ARGV do
    if redis.call('HGET', KEYS[1], ARGV[i]) == ARGV[1] then
      return 0
    end
  end
end
for i = 2, #ARGV do
  redis.call('HSET', KEYS[1], ARGV[i], want)
end
return 1
