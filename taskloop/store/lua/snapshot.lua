-- snapshot.lua: read a run in one call (a consistent view: scripts run atomically).
--
-- KEYS: [1] run HASH  [2] tasks HASH  [3] data HASH
-- ARGV: data fields to read; or the single argument "*values" for the value of every task
--       ("v:<task key>", in the order of the tasks array)
-- Returns {run HGETALL, tasks HGETALL, data HMGET} as three flat arrays (the third may be empty).

local run = redis.call('HGETALL', KEYS[1])
if #run == 0 then return {run, {}, {}} end
local tasks = redis.call('HGETALL', KEYS[2])
local fields = ARGV
if ARGV[1] == '*values' then
  fields = {}
  for i = 1, #tasks, 2 do fields[#fields + 1] = 'v:' .. tasks[i] end
end
local data = {}
if #fields > 0 then data = redis.call('HMGET', KEYS[3], unpack(fields)) end
return {run, tasks, data}
