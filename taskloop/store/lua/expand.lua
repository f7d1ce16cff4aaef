-- expand.lua: a compacted run becomes a live-shaped run again (taskloop/store/compacted.py), so that
-- it can be written: before a resume. One call.
--
-- KEYS: [1] run HASH  [2] events STREAM  [3] end LIST  [4] leases ZSET  [5] compact STRING (one slot)
-- ARGV: [1] the marker field  [2] the number of hash fields that follow  [3..] those fields, as name,
--       value pairs, then the stream entries, each as: entry id, number of field/value pairs, pairs
--
-- Only a run that is still compacted (its hash has the marker) is expanded: the hash gets every field
-- back and loses the marker, the stream gets its entries back under their own ids, the compact record
-- goes, and every key keeps the run's remaining retention. Every field and key name comes from the
-- caller. Returns 1 (expanded) or 0 (not compacted: nothing written).

local run, events, compact = KEYS[1], KEYS[2], KEYS[5]
if not redis.call('HGET', run, ARGV[1]) then return 0 end
local ttl = redis.call('PTTL', run)
redis.call('HDEL', run, ARGV[1])
local n = tonumber(ARGV[2])
local i = 3
if n > 0 then
  redis.call('HSET', run, unpack(ARGV, i, i + 2 * n - 1))
end
i = i + 2 * n
redis.call('DEL', events)
while i <= #ARGV do
  local id, pairs = ARGV[i], tonumber(ARGV[i + 1])
  redis.call('XADD', events, id, unpack(ARGV, i + 2, i + 1 + 2 * pairs))
  i = i + 2 + 2 * pairs
end
redis.call('DEL', compact)
if ttl > 0 then
  redis.call('PEXPIRE', run, ttl)
  if redis.call('EXISTS', events) == 1 then redis.call('PEXPIRE', events, ttl) end
end
return 1
