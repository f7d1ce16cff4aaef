-- request.lua: the one-field moves of an action asked of a worker by run id (store/requests.py).
-- Whoever sets the request's "taken" field first decides it: a worker that takes the request (its
-- claim), or its caller that gave up waiting (the abandoned mark: no worker may take it after that).
--
-- KEYS: [1] the request HASH
-- ARGV: [1] "take", "abandon" or "reopen"  [2] the worker's claim (take) or the abandoned mark
--       [3] the "taken" field  [4] the body field  [5] the verdict field
-- take:    nil if the request expired; else {1 if this claim won, who holds it, the body, the verdict}
-- abandon: nil if the request expired; else who holds it (the mark when the caller's won)
-- reopen:  1 when the caller's mark was taken away (a retried request may be taken again), else 0

if ARGV[1] == 'reopen' then
  if redis.call('HGET', KEYS[1], ARGV[3]) == ARGV[2] then
    redis.call('HDEL', KEYS[1], ARGV[3])
    return 1
  end
  return 0
end
if redis.call('EXISTS', KEYS[1]) == 0 then return false end
if ARGV[1] == 'abandon' then
  redis.call('HSETNX', KEYS[1], ARGV[3], ARGV[2])
  return redis.call('HGET', KEYS[1], ARGV[3])
end
local won = redis.call('HSETNX', KEYS[1], ARGV[3], ARGV[2])
return {won, redis.call('HGET', KEYS[1], ARGV[3]), redis.call('HGET', KEYS[1], ARGV[4]),
        redis.call('HGET', KEYS[1], ARGV[5])}
