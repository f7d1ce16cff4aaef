-- snapshot.lua: read a run in one call (a consistent view: scripts run atomically).
--
-- KEYS: [1] run HASH  [2] tasks HASH  [3] data HASH  ([4] leases ZSET, with "*lease")
-- ARGV: data fields to read; or "*values" for the value of every task ("v:<task key>", in the
--       order of the tasks array); or "*lease", member: the lease of one task, read with the
--       records so that the two agree (what the reconciler decides on)
-- Returns {run HGETALL, tasks HGETALL, data HMGET} as three flat arrays (the third may be
-- empty), plus the lease expiry (or false) with "*lease".

local run = redis.call('HGETALL', KEYS[1])
if #run == 0 then return {run, {}, {}} end
local tasks = redis.call('HGETALL', KEYS[2])
if ARGV[1] == '*lease' then return {run, tasks, {}, redis.call('ZSCORE', KEYS[4], ARGV[2])} end
local fields = ARGV
if ARGV[1] == '*values' then
  fields = {}
  for i = 1, #tasks, 2 do fields[#fields + 1] = 'v:' .. tasks[i] end
end
local data = {}
if #fields > 0 then data = redis.call('HMGET', KEYS[3], unpack(fields)) end
return {run, tasks, data}
