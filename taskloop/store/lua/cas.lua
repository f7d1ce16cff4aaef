-- cas.lua: the one compare-and-set primitive of taskloop (a guarded batch write).
--
-- KEYS: every key the batch may touch; ARGV refers to them by 1-based index. For a run:
--   [1] run HASH  [2] tasks HASH  [3] data HASH  [4] events STREAM
--   [5] leases ZSET  [6] runs index ZSET  [7] stats HASH
-- ARGV: <number of guards>, then the guards, then the writes, each an opcode and its operands.
-- Guards, all evaluated before any write; the first one that fails aborts the whole batch:
--   "eq"  k field value        HGET KEYS[k] field must equal value
--   "nx"  k field              HGET KEYS[k] field must be absent
--   "cap" k field limit add    (HGET KEYS[k] field or 0) + add must be <= limit
-- Writes:
--   "hset" k field value | "hdel" k field | "hincr" k field n
--   "xadd" k n f1 v1 .. fn vn  (appends to the stream, auto id)
--   "zadd" k score member | "zrem" k member | "expire" k seconds | "persist" k | "del" k
-- Returns {1} when every guard held and every write was applied,
--         {0, i, current} when guard number i failed (current = the field's value or false).

local argv = ARGV
local n_guards = tonumber(argv[1])
local i = 2

for g = 1, n_guards do
  local op = argv[i]
  local key = KEYS[tonumber(argv[i + 1])]
  local current = redis.call('HGET', key, argv[i + 2])
  if op == 'eq' then
    if current ~= argv[i + 3] then return {0, g, current} end
    i = i + 4
  elseif op == 'nx' then
    if current then return {0, g, current} end
    i = i + 3
  elseif op == 'cap' then
    if (tonumber(current) or 0) + tonumber(argv[i + 4]) > tonumber(argv[i + 3]) then
      return {0, g, current}
    end
    i = i + 5
  else
    return redis.error_reply('cas.lua: unknown guard ' .. tostring(op))
  end
end

while i <= #argv do
  local op = argv[i]
  local key = KEYS[tonumber(argv[i + 1])]
  if op == 'hset' then
    redis.call('HSET', key, argv[i + 2], argv[i + 3]); i = i + 4
  elseif op == 'hdel' then
    redis.call('HDEL', key, argv[i + 2]); i = i + 3
  elseif op == 'hincr' then
    redis.call('HINCRBY', key, argv[i + 2], argv[i + 3]); i = i + 4
  elseif op == 'xadd' then
    local n = tonumber(argv[i + 2])
    local fields = {}
    for f = 1, 2 * n do fields[f] = argv[i + 2 + f] end
    redis.call('XADD', key, '*', unpack(fields)); i = i + 3 + 2 * n
  elseif op == 'zadd' then
    redis.call('ZADD', key, argv[i + 2], argv[i + 3]); i = i + 4
  elseif op == 'zrem' then
    redis.call('ZREM', key, argv[i + 2]); i = i + 3
  elseif op == 'expire' then
    redis.call('EXPIRE', key, argv[i + 2]); i = i + 3
  elseif op == 'persist' then
    redis.call('PERSIST', key); i = i + 2
  elseif op == 'del' then
    redis.call('DEL', key); i = i + 2
  else
    return redis.error_reply('cas.lua: unknown write ' .. tostring(op))
  end
end
return {1}
