-- begin.lua: begin a prepared phase, or read what the caller needs to decide itself: one call.
-- uses: lib_limits
--
-- When the scheduler queued a phase it also stored, in a hash field of the run (ARGV[1]), what
-- beginning it writes for the record with that token: the running record's JSON, computed by the
-- pure state machine (taskloop/core/begin.py), the budget caps to admit it against and the lease
-- terms. This script checks that the message and the record still match, writes that JSON as it
-- is, and writes the execution (who runs it, since when, until when) as plain values in their
-- own fields: it assembles no JSON. It counts the attempt and takes the lease.
--
-- A phase under fleet limits that need no key from the worker: the prepared begin names them
-- (pre.lim, taskloop/core/limits.py limits_tag), and a worker that presents the same (ARGV[13],
-- with their keys) has the room taken here, before anything is written (lib_limits.lua acquire,
-- the slots expiring with the lease this call takes). A worker that presents other limits, or
-- none (a Cluster, where the limits live in other slots), is given the full path.
--
-- KEYS: [1] run HASH  [2] leases ZSET  [3..] the limits' keys (limits.lua's KEYS), with ARGV[13]
-- ARGV: [1] prepared-begin field  [2] record field  [3] worker field  [4] began field
--       [5] deadline field  [6] attempts usage field  [7] the task key (its lease member)
--       [8] message token  [9] message round  [10] message phase  [11] worker name
--       [12] now (epoch seconds, as text)
--       [13] the limits the worker presents ('' for none)  [14] the phase's wait member
--       [15] its slot holder  [16] its throttle field (deleted when it begins)
--       [17..] run hash fields to return: the caller puts ARGV[2..5] first and the control flag
--       field fifth
-- Returns {began, values, more names, more values[, refusal]}: values are the fields of ARGV[17..]
-- in order (false when absent); when began is 1 the first four are what this call wrote, and
-- "more" holds the fields the prepared begin says the phase's outcome will need (the dependents'
-- records), read in the same call. began is 0 when there is no prepared begin, the message or the
-- record moved on, the run has a control flag, a budget cap refuses, or the limits presented are
-- not the prepared begin's: the caller then decides on what it read. began is 2 when a fleet limit
-- refused the phase: it joined that limit's wait queue, nothing else was written, and refusal is
-- {index of the limit, retry at, used, allowed} (limits.lua's acquire).

local values = redis.call('HMGET', KEYS[1], ARGV[1], unpack(ARGV, 17))
local prepared = table.remove(values, 1)
if not prepared then return {0, values, {}, {}} end
local pre = cjson.decode(prepared)
-- the message, the prepared begin and the record must all name the same token (every transition
-- of the record changes its token), and the run must have no control flag
if pre.tok ~= tonumber(ARGV[8]) or pre.rnd ~= tonumber(ARGV[9]) or pre.ph ~= ARGV[10] or values[5]
    or not values[1] or cjson.decode(values[1]).token ~= pre.tok then
  return {0, values, {}, {}}
end
for _, cap in ipairs(pre.caps) do
  if (tonumber(redis.call('HGET', KEYS[1], cap[1])) or 0) + cap[3] > cap[2] then return {0, values, {}, {}} end
end

local now = tonumber(ARGV[12])
-- round_deadline (taskloop/core/leases.py): a new round ends tmo seconds after it began; a check
-- keeps its round's deadline (pre.dl)
local deadline = pre.dl
if deadline == cjson.null then deadline = nil end
if deadline == nil and pre.tmo ~= cjson.null then deadline = now + pre.tmo end
-- lease_until (taskloop/core/leases.py): max(now + running lease, deadline + grace + 1)
local lease = now + pre.lease
if deadline then lease = math.max(lease, deadline + pre.grace + 1) end

local limits = pre.lim or ''
if limits ~= ARGV[13] then return {0, values, {}, {}} end
if limits ~= '' then
  local limit_keys = {}
  for i = 3, #KEYS do limit_keys[i - 2] = KEYS[i] end
  local specs = cjson.encode(cjson.decode(limits).s)
  local room = limit_op(limit_keys, {'acquire', ARGV[12], ARGV[14], ARGV[15], string.format('%.6f', lease), specs, 0})
  if room[1] ~= 1 then return {2, values, {}, {}, {room[2], room[3], room[4], room[5]}} end
  redis.call('HDEL', KEYS[1], ARGV[16])
end

redis.call('HSET', KEYS[1], ARGV[2], pre.rec, ARGV[3], ARGV[11], ARGV[4], ARGV[12])
local deadline_text = false
if deadline then
  deadline_text = string.format('%.6f', deadline)
  redis.call('HSET', KEYS[1], ARGV[5], deadline_text)
end
if pre.cons > 0 then redis.call('HINCRBY', KEYS[1], ARGV[6], pre.cons) end
redis.call('ZADD', KEYS[2], lease, ARGV[7])
values[1], values[2], values[3], values[4] = pre.rec, ARGV[11], ARGV[12], deadline_text
local more = {}
if #pre.rd > 0 then more = redis.call('HMGET', KEYS[1], unpack(pre.rd)) end
return {1, values, pre.rd, more}
