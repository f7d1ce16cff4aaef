-- snapshot.lua: read what a phase needs in one call (a consistent view: scripts run atomically).
--
-- KEYS: [1] run HASH  [2] tasks HASH  [3] data HASH
-- ARGV: data fields to read (the previous round's check, the candidate, ...)
-- Returns {run HGETALL, tasks HGETALL, data HMGET} as three flat arrays (the third may be empty).

local run = redis.call('HGETALL', KEYS[1])
if #run == 0 then return {run, {}, {}} end
local tasks = redis.call('HGETALL', KEYS[2])
local data = {}
if #ARGV > 0 then data = redis.call('HMGET', KEYS[3], unpack(ARGV)) end
return {run, tasks, data}
