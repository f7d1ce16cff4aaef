-- renew.lua: renew the leases of many running phases in one call (a worker process's watcher,
-- taskloop/worker/liveness/watcher.py), each guarded by its record's fencing token: a phase whose
-- record moved on (taken over, or ended: every transition changes the token) keeps no lease from
-- here. The runs may be any number of different runs of one Redis (never a Cluster: there each run
-- is renewed in a call of its own, on its slot).
--
-- KEYS: for each phase i: [2i-1] its run HASH  [2i] the run's leases ZSET
-- ARGV: [1] the control flag field  then for each phase i, four values from 1 + 4(i-1) + 1:
--       the record field, the token of the record its execution began, the lease member (the
--       task key), the new lease expiry (epoch seconds, as text)
-- Returns, for each phase in order, {renewed (1) or moved (0), the run's control flag or false}:
-- the flag tells the watcher of a cancel or stop it may not have heard of yet.

local out = {}
local n = #KEYS / 2
for i = 1, n do
  local at = 1 + 4 * (i - 1)
  local run, leases = KEYS[2 * i - 1], KEYS[2 * i]
  local ok = 0
  local record = redis.call('HGET', run, ARGV[at + 1])
  if record and tostring(cjson.decode(record).token) == ARGV[at + 2] then
    redis.call('ZADD', leases, ARGV[at + 4], ARGV[at + 3])
    ok = 1
  end
  out[i] = {ok, redis.call('HGET', run, ARGV[1])}
end
return out
