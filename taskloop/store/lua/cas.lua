-- cas.lua: the one compare-and-set primitive of taskloop (a guarded batch write).
--
-- KEYS: every key the batch may touch; operations refer to them by 1-based index. For a run:
--   [1] run HASH  [2] tasks HASH  [3] data HASH  [4] events STREAM
--   [5] leases ZSET  [6] runs index ZSET  [7] stats HASH  [8] end LIST
-- ARGV[1]: the batch as JSON (one string, decoded here with cjson): {"g": [guards], "w": [writes]}.
-- Guards, all evaluated before any write; the first one that fails aborts the whole batch:
--   ["eq", k, field, value]      HGET KEYS[k] field must equal value
--   ["nx", k, field]             HGET KEYS[k] field must be absent
--   ["cap", k, field, limit, add]  (HGET KEYS[k] field or 0) + add must be <= limit
-- Writes:
--   ["hset", k, field, value] | ["hdel", k, field] | ["hincr", k, field, n]
--   ["xadd", k, f1, v1, ..., fn, vn]  (appends to the stream, auto id) | ["rpush", k, value]
--   ["zadd", k, score, member] | ["zrem", k, member] | ["expire", k, seconds] | ["persist", k] | ["del", k]
-- Returns {1} when every guard held and every write was applied,
--         {0, i, current} when guard number i failed (current = the field's value or false).
-- Values that must stay exact (records, JSON payloads) are JSON strings; numbers are only
-- scores, counters and TTLs.

local batch = cjson.decode(ARGV[1])

for g, guard in ipairs(batch.g) do
  local op, key = guard[1], KEYS[guard[2]]
  local current = redis.call('HGET', key, guard[3])
  if op == 'eq' then
    if current ~= guard[4] then return {0, g, current} end
  elseif op == 'nx' then
    if current then return {0, g, current} end
  elseif op == 'cap' then
    if (tonumber(current) or 0) + guard[5] > guard[4] then return {0, g, current} end
  else
    return redis.error_reply('cas.lua: unknown guard ' .. tostring(op))
  end
end

for _, write in ipairs(batch.w) do
  local op, key = write[1], KEYS[write[2]]
  if op == 'hset' then
    redis.call('HSET', key, write[3], write[4])
  elseif op == 'hdel' then
    redis.call('HDEL', key, write[3])
  elseif op == 'hincr' then
    redis.call('HINCRBY', key, write[3], write[4])
  elseif op == 'xadd' then
    redis.call('XADD', key, '*', unpack(write, 3))
  elseif op == 'rpush' then
    redis.call('RPUSH', key, write[3])
  elseif op == 'zadd' then
    redis.call('ZADD', key, write[3], write[4])
  elseif op == 'zrem' then
    redis.call('ZREM', key, write[3])
  elseif op == 'expire' then
    redis.call('EXPIRE', key, write[3])
  elseif op == 'persist' then
    redis.call('PERSIST', key)
  elseif op == 'del' then
    redis.call('DEL', key)
  else
    return redis.error_reply('cas.lua: unknown write ' .. tostring(op))
  end
end
return {1}
