-- Finish one ingest message: count its outcome, record its done key once, and add its dead
-- letter (if any) under a byte cap, trimming the oldest letters first.
-- KEYS: 1 outcome counters (hash), 2 dead-letter stream,
--       3 done key (optional: a message without a usable batch id is counted every time)
-- ARGV: 1 outcome (the counter to add 1 to), 2 done value, 3 done ttl, 4 byte cap,
--       5 cost (bytes charged for the letter), 6 code, 7.. letter fields (none: no letter)
-- Counters: <outcome>, dead, dead:<code>, dead_bytes (held now), dead_trimmed.
-- Every call counts one outcome: when the done key was already there (another delivery of
-- the batch finished first, e.g. a redelivery racing the original), this one is counted
-- `duplicate` and writes nothing else (no done record, no letter); returns 0, else 1.
if KEYS[3] and not redis.call('SET', KEYS[3], ARGV[2], 'NX', 'EX', tonumber(ARGV[3])) then
  redis.call('HINCRBY', KEYS[1], 'duplicate', 1)
  return 0
end
redis.call('HINCRBY', KEYS[1], ARGV[1], 1)
if #ARGV < 7 then return 1 end
local cap, cost, code = tonumber(ARGV[4]), tonumber(ARGV[5]), ARGV[6]
local fields = {'code', code, 'cost', ARGV[5]}
for i = 7, #ARGV do fields[#fields + 1] = ARGV[i] end
redis.call('XADD', KEYS[2], '*', unpack(fields))
redis.call('HINCRBY', KEYS[1], 'dead', 1)
redis.call('HINCRBY', KEYS[1], 'dead:' .. code, 1)
local held = redis.call('HINCRBY', KEYS[1], 'dead_bytes', cost)
while held > cap do
  local oldest = redis.call('XRANGE', KEYS[2], '-', '+', 'COUNT', 1)
  if #oldest == 0 then
    redis.call('HSET', KEYS[1], 'dead_bytes', 0)
    break
  end
  local f, c = oldest[1][2], nil
  for i = 1, #f - 1, 2 do
    if f[i] == 'cost' then c = tonumber(f[i + 1]) end
  end
  if c == nil then  -- a letter written before costs were kept: its field bytes
    c = 0
    for i = 1, #f do c = c + #f[i] end
  end
  redis.call('XDEL', KEYS[2], oldest[1][1])
  redis.call('HINCRBY', KEYS[1], 'dead_trimmed', 1)
  held = redis.call('HINCRBY', KEYS[1], 'dead_bytes', -c)
end
return 1
