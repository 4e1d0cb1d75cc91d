-- Prune a string dictionary in two phases, so that a string encoded while it is being
-- pruned never loses its code: 'mark' moves an unused entry out of the forward map into
-- the marked hash (the reverse map keeps it; an encode revives it, see dict.lua);
-- 'sweep', a grace period later and only if it is still unused, removes it for good;
-- 'revive' puts a marked entry that is in use again back.
-- KEYS: 1 string -> code, 2 code -> string, 3 marked (string -> "code:marked_at")
-- ARGV: 1 mode ('mark' | 'sweep' | 'revive'), 2 now, then pairs (string, code)
-- Returns the number of entries changed.
local mode, now, done = ARGV[1], ARGV[2], 0
for i = 3, #ARGV, 2 do
  local s, code = ARGV[i], ARGV[i + 1]
  if mode == 'mark' then
    if redis.call('HGET', KEYS[1], s) == code and redis.call('HGET', KEYS[2], code) == s then
      redis.call('HDEL', KEYS[1], s)
      redis.call('HSET', KEYS[3], s, code .. ':' .. now)
      done = done + 1
    end
  else
    local marked = redis.call('HGET', KEYS[3], s)
    if marked and string.match(marked, '^(%d+)') == code then
      redis.call('HDEL', KEYS[3], s)
      if mode == 'sweep' then
        redis.call('HDEL', KEYS[2], code)
      else
        redis.call('HSET', KEYS[1], s, code)
      end
      done = done + 1
    end
  end
end
return done
