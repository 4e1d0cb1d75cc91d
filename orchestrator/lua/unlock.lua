-- Release a lock only if it is still the caller's: delete KEYS[1] when it holds ARGV[1]
-- (the token its taker set). Returns 1 if deleted, 0 if the lock expired or is another's.
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
