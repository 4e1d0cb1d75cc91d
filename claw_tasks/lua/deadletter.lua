-- Add a dead letter once per (batch, attempt key).
-- KEYS[1] dead-letter stream, KEYS[2] once-marker; ARGV[1] ttl, ARGV[2] maxlen, ARGV[3..] fields
if redis.call('SET', KEYS[2], 1, 'NX', 'EX', tonumber(ARGV[1])) then
  local fields = {}
  for i = 3, #ARGV do fields[#fields + 1] = ARGV[i] end
  return redis.call('XADD', KEYS[1], 'MAXLEN', '~', tonumber(ARGV[2]), '*', unpack(fields))
end
return false
