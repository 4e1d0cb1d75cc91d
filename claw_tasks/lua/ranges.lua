-- Shared by the scripts that start with `--! include ranges` (prepended when loaded).

-- Calls fn(i, slot, chunk, inchunk, len) for each run of the n slots from slot0 of a ring
-- of cap slots that stays inside one chunk of cs slots: [slot, slot + len).
local function slot_runs(slot0, n, cap, cs, fn)
  local i = 0
  while i < n do
    local slot = (slot0 + i) % cap
    local inchunk = slot % cs
    local len = math.min(n - i, cs - inchunk, cap - slot)
    fn(i, slot, math.floor(slot / cs), inchunk, len)
    i = i + len
  end
end

-- Sets bits [s, e) of a bitmap to 1 or 0, whole bytes at once where aligned.
local function fill_bits(key, s, e, bit)
  while s < e and s % 8 ~= 0 do redis.call('SETBIT', key, s, bit); s = s + 1 end
  local full = math.floor((e - s) / 8)
  if full > 0 then
    redis.call('SETRANGE', key, s / 8, string.rep(bit == 1 and '\255' or '\0', full))
    s = s + full * 8
  end
  while s < e do redis.call('SETBIT', key, s, bit); s = s + 1 end
end

-- Number of set bits in [s, e) of a bitmap (BITCOUNT counts whole bytes).
local function count_bits(key, s, e)
  local n = 0
  while s < e and s % 8 ~= 0 do n = n + redis.call('GETBIT', key, s); s = s + 1 end
  while e > s and e % 8 ~= 0 do e = e - 1; n = n + redis.call('GETBIT', key, e) end
  if e > s then n = n + redis.call('BITCOUNT', key, s / 8, e / 8 - 1) end
  return n
end

-- Sizes a payload chunk once, so later SETRANGEs never reallocate (no greedy slack).
local function size_chunk(key, chunk, cs, cap, size)
  if redis.call('EXISTS', key) == 0 then
    redis.call('SETRANGE', key, math.min(cs, cap - chunk * cs) * size - 1, '\0')
  end
end
