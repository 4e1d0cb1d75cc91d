-- Map strings to int codes, adding new ones. Codes start at 1 (0 = missing). A string
-- marked for pruning (no live step used it, see dictprune.lua) is revived with its code.
-- KEYS[1] string -> code hash, KEYS[2] code -> string hash (field "0" is the counter),
-- KEYS[3] strings marked for pruning (string -> "code:marked_at")
-- ARGV: the strings. Returns their codes in order.
local out = {}
for i, s in ipairs(ARGV) do
  local code = redis.call('HGET', KEYS[1], s)
  if not code then
    local marked = redis.call('HGET', KEYS[3], s)
    if marked then
      code = string.match(marked, '^(%d+)')
      redis.call('HDEL', KEYS[3], s)
    else
      code = redis.call('HINCRBY', KEYS[2], '0', 1)
      redis.call('HSET', KEYS[2], code, s)
    end
    redis.call('HSET', KEYS[1], s, code)
  end
  out[i] = tonumber(code)
end
return out
