-- compact.lua: a finished run becomes one compact record (taskloop/store/compacted.py), in one call.
--
-- KEYS: [1] run HASH  [2] events STREAM  [3] end LIST  [4] leases ZSET  [5] compact STRING (one slot)
-- ARGV: [1] the status field  [2] the status the caller read (terminal)  [3] the number of fields the
--       caller read (HLEN)  [4] the number of stream entries it read (XLEN)  [5] the compact record
--       [6] the marker field (set to "1" in the hash)  [7..] the fields the hash keeps, as name, value
--       pairs (the run's meta fields: what the run lists, wait() and a repeated start read)
--
-- The run must still be exactly as the caller read it: the same terminal status, as many hash
-- fields and stream entries; otherwise nothing is written. Then, atomically: the
-- hash is rewritten with only the fields kept and the marker, the compact record is stored, the
-- stream, the end marker and the lease set are deleted, and both keys keep the run's remaining
-- retention. (A waiter that blocked on the end marker woke when it was pushed; one that comes later
-- reads the run's status first.) Every field and key name comes from the caller.
-- Returns 1 (compacted) or 0 (the run changed, or is not as read: nothing written).

local run, events, endlist, leases, compact = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
if redis.call('HGET', run, ARGV[1]) ~= ARGV[2] then return 0 end
if redis.call('HLEN', run) ~= tonumber(ARGV[3]) then return 0 end
if redis.call('XLEN', events) ~= tonumber(ARGV[4]) then return 0 end
-- A finished run's lease set is gone, or holds the leases of phases still queued when it was
-- aborted (their messages find the run over): deleted with the rest, not read first.
local ttl = redis.call('PTTL', run)
redis.call('DEL', run, events, endlist, leases)
redis.call('HSET', run, ARGV[6], '1', unpack(ARGV, 7))
if ttl > 0 then
  redis.call('SET', compact, ARGV[5], 'PX', ttl)
  redis.call('PEXPIRE', run, ttl)
else
  redis.call('SET', compact, ARGV[5])
end
return 1
