-- Size the chunk keys of slot arrays once (claw_tasks/store/arrays.py), so the
-- writer's later SETRANGEs into them never reallocate (a string grown piece by piece
-- ends in a larger allocation than one sized once).
-- KEYS: chunk keys of one shard (one hash tag: one cluster slot)
-- ARGV: the full size in bytes of each key, in KEYS order
-- A key shorter than its size gets a zero byte at its last offset (Redis pads the gap
-- with zeros); a key that long already is left alone, so no stored byte changes.
-- Returns the number of keys sized now.
local sized = 0
for i, key in ipairs(KEYS) do
  local size = tonumber(ARGV[i])
  if redis.call('STRLEN', key) < size then
    redis.call('SETRANGE', key, size - 1, '\0')
    sized = sized + 1
  end
end
return sized
