-- begin.lua: begin a prepared phase, or read what the caller needs to decide itself — one call.
--
-- When the scheduler queued a phase it also stored, in hash field "b:<key>", what beginning it
-- writes (for the record with that token): the running record computed by the pure state machine (without its worker, begin time
-- and deadline, which only the executing worker knows), the budget caps to admit it against and
-- the lease terms. This script checks that the message and the record still match, fills in
-- those three fields, writes the record, counts the attempt and takes the lease.
--
-- KEYS: [1] run HASH  [2] leases ZSET
-- ARGV: [1] task key  [2] message token  [3] message round  [4] message phase
--       [5] worker name as a JSON string  [6] now (epoch seconds, as text)
--       [7..] run hash fields to return; the caller puts "t:<key>" first and "ctl" second
-- Returns {began, values, more names, more values}: values are the fields of ARGV[7..] in order
-- (false when absent); when began is 1 the first of them is the running record just written, and
-- "more" holds the fields the prepared begin says the phase's outcome will need (the dependents'
-- records, the run's outcome fields), read in the same call. began is 0 when there is no
-- prepared begin, the message or the record moved on, the run has a control flag, or a budget
-- cap refuses: the caller then decides on what it read.

local key = ARGV[1]
local values = redis.call('HMGET', KEYS[1], 'b:' .. key, unpack(ARGV, 7))
local prepared = table.remove(values, 1)
if not prepared then return {0, values, {}, {}} end
local pre = cjson.decode(prepared)
-- the message, the prepared begin and the record must all name the same token (every transition
-- of the record changes its token), and the run must have no control flag
if pre.tok ~= tonumber(ARGV[2]) or pre.rnd ~= tonumber(ARGV[3]) or pre.ph ~= ARGV[4] or values[2]
    or not values[1] or cjson.decode(values[1]).token ~= pre.tok then
  return {0, values, {}, {}}
end
for _, cap in ipairs(pre.caps) do
  if (tonumber(redis.call('HGET', KEYS[1], cap[1])) or 0) + cap[3] > cap[2] then return {0, values, {}, {}} end
end

local now = tonumber(ARGV[6])
-- round_deadline (taskloop/phases.py): a new round ends tmo seconds after it began; a check
-- keeps its round's deadline (pre.dl)
local deadline = pre.dl
if deadline == cjson.null then deadline = nil end
if deadline == nil and pre.tmo ~= cjson.null then deadline = now + pre.tmo end
local record = pre.rec .. ',"worker":' .. ARGV[5] .. ',"began_at":' .. ARGV[6]
if deadline then record = record .. ',"deadline":' .. string.format('%.6f', deadline) end
record = record .. '}'
-- lease_until (taskloop/phases.py): max(now + running lease, deadline + grace + 1)
local lease = now + pre.lease
if deadline then lease = math.max(lease, deadline + pre.grace + 1) end

redis.call('HSET', KEYS[1], 't:' .. key, record)
if pre.cons > 0 then redis.call('HINCRBY', KEYS[1], 'u:attempts', pre.cons) end
redis.call('ZADD', KEYS[2], lease, key)
values[1] = record
local more = {}
if #pre.rd > 0 then more = redis.call('HMGET', KEYS[1], unpack(pre.rd)) end
return {1, values, pre.rd, more}
