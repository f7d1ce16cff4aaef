-- cas_limits.lua: a guarded batch write on one run and a fleet-limits operation in one call. On a
-- single Redis only: on a Cluster each limit lives in a slot of its own, and the store makes the
-- two calls (cas.lua, limits.lua) instead.
-- uses: lib_cas, lib_limits
--
-- KEYS: cas.lua's keys (ARGV[1] of them), then limits.lua's
-- ARGV: [1] how many of KEYS are cas.lua's  [2..4] cas.lua's ARGV  [5..11] limits.lua's ARGV
--
-- The batch's guards come first: when one fails nothing is written, the limits neither, and the
-- reply is cas.lua's {0, i, current}. Then, by the limits' op:
--   wake (the outcome of a phase that held slots): the batch is written, the phase's slots are
--     released and the oldest waiters there is room for picked:
--     {1, open, members to send, per limit: when to look again}.
--   acquire (a phase that begins on this write): room first; when a limit refuses, the batch is
--     not written and the phase has joined that limit's wait queue: {2, index, retry at, used,
--     allowed}; else the batch is written: {1, open, per limit: when its waiters may start}.

local ncas = tonumber(ARGV[1])
local cas_keys, limit_keys, cas_argv, limit_argv = {}, {}, {}, {}
for i = 1, #KEYS do
  if i <= ncas then table.insert(cas_keys, KEYS[i]) else table.insert(limit_keys, KEYS[i]) end
end
for i = 2, 4 do table.insert(cas_argv, ARGV[i]) end
for i = 5, #ARGV do table.insert(limit_argv, ARGV[i]) end

local batch = cjson.decode(cas_argv[1])
local refused = cas_guards(cas_keys[1], batch)
if refused then return refused end
if limit_argv[1] == 'acquire' then
  local room = limit_op(limit_keys, limit_argv)
  if room[1] ~= 1 then return {2, room[2], room[3], room[4], room[5]} end
  local written = cas_apply(cas_keys, cas_argv, batch)
  return {1, written[2], room[2]}
end
local written = cas_apply(cas_keys, cas_argv, batch)
local woken = limit_op(limit_keys, limit_argv)
return {1, written[2], woken[1], woken[2]}
