-- unnote.lua: take back a start note that a worker wrote with its read (worker/deferred.py) when
-- the read showed the note does not belong: the message was stale, a duplicate, or of a run that
-- does not exist. Only the worker's own note is touched: a note written since by another worker
-- (the execution of the live message) stays. A note that a run which does not exist was given is
-- deleted, never put back (the run's hash then goes with its last field).
--
-- KEYS: [1] run HASH
-- ARGV: [1] the note's field  [2] this worker's note  [3] the field's value before it ('' for none)
--       [4] the run's workflow field (absent: the run does not exist)
-- Returns 1 when the field was put back or deleted, 0 when it held another note.

if redis.call('HGET', KEYS[1], ARGV[1]) ~= ARGV[2] then return 0 end
if ARGV[3] == '' or not redis.call('HGET', KEYS[1], ARGV[4]) then
  redis.call('HDEL', KEYS[1], ARGV[1])
else
  redis.call('HSET', KEYS[1], ARGV[1], ARGV[3])
end
return 1
