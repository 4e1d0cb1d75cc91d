-- Map strings to int codes, adding new ones. Codes start at 1 (0 = missing).
-- KEYS[1] string -> code hash, KEYS[2] code -> string hash (field "0" is the counter)
-- ARGV: the strings. Returns their codes in order.
local out = {}
for i, s in ipairs(ARGV) do
  local code = redis.call('HGET', KEYS[1], s)
  if not code then
    code = redis.call('HINCRBY', KEYS[2], '0', 1)
    redis.call('HSET', KEYS[1], s, code)
    redis.call('HSET', KEYS[2], code, s)
  end
  out[i] = tonumber(code)
end
return out
