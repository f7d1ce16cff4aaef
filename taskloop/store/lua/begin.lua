-- begin.lua: read a run and, when the phase is ready for it, begin it — in one call.
--
-- The scheduler prepares each dispatch: next to the queued record it stores, in data field
-- "b:<key>", what beginning that phase writes (the running record, computed by the pure
-- state machine in Python, with "@@worker@@" where the executing worker's name goes), the
-- budget caps to admit against, and the exec event. This script only checks and moves it.
--
-- KEYS: [1] run HASH  [2] tasks HASH  [3] data HASH  [4] events STREAM  [5] leases ZSET
-- ARGV: [1] task key  [2] message token  [3] message round  [4] message phase  [5] worker
--       [6] now (epoch seconds)  [7] running lease (seconds)  [8..] data fields to read
-- Returns {began, run HGETALL, tasks HGETALL, data HMGET}; began is 1 when the phase began here,
-- 0 when the caller must decide itself (no prepared begin, another token, a run control, a cap).

local key = ARGV[1]
local function snapshot(began)
  local data = {}
  if #ARGV > 7 then data = redis.call('HMGET', KEYS[3], unpack(ARGV, 8)) end
  return {began, redis.call('HGETALL', KEYS[1]), redis.call('HGETALL', KEYS[2]), data}
end

local prepared = redis.call('HGET', KEYS[3], 'b:' .. key)
if not prepared then return snapshot(0) end
local pre = cjson.decode(prepared)
if pre.token ~= tonumber(ARGV[2]) or pre.round ~= tonumber(ARGV[3]) or pre.phase ~= ARGV[4]
    or redis.call('HGET', KEYS[2], key) ~= pre.expect or redis.call('HEXISTS', KEYS[1], 'ctl') == 1 then
  return snapshot(0)
end
for _, cap in ipairs(pre.caps) do
  if (tonumber(redis.call('HGET', KEYS[1], cap[1])) or 0) + cap[3] > cap[2] then return snapshot(0) end
end

local function fill(text)
  local s, e = string.find(text, '@@worker@@', 1, true)
  if s then text = string.sub(text, 1, s - 1) .. ARGV[5] .. string.sub(text, e + 1) end
  s, e = string.find(text, '@@now@@', 1, true)
  if s then text = string.sub(text, 1, s - 1) .. ARGV[6] .. string.sub(text, e + 1) end
  return text
end

local now = tonumber(ARGV[6])
local record = fill(pre.record)
local lease = now + tonumber(ARGV[7])
local deadline = pre.deadline
if pre.timeout_ms ~= cjson.null and deadline == cjson.null then
  deadline = now + pre.timeout_ms / 1000
  record = string.sub(record, 1, -2) .. ',"deadline":' .. string.format('%.6f', deadline) .. '}'
end
if deadline ~= cjson.null then lease = math.max(lease, deadline + pre.grace + 1) end

redis.call('HSET', KEYS[2], key, record)
redis.call('HDEL', KEYS[3], 'b:' .. key)
if pre.consume > 0 then redis.call('HINCRBY', KEYS[1], 'u:attempts', pre.consume) end
local fields = {}
for i, value in ipairs(pre.event) do fields[i] = fill(value) end
redis.call('XADD', KEYS[4], '*', unpack(fields))
redis.call('ZADD', KEYS[5], lease, pre.member)
return snapshot(1)
