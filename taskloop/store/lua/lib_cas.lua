-- lib_cas.lua: the one compare-and-set primitive of taskloop (a guarded batch write on one run).
--
-- KEYS: [1] run HASH  [2] events STREAM  [3] end LIST  [4] leases ZSET   (all of one run: one slot)
--       [5..] broker queue LISTs of the messages in "q" (only when the broker is this same Redis),
--       then the run lists of "k" (only on a single Redis: on a Cluster they live in other slots
--       and the store writes them after this script); a push or a list entry names its key by
--       position n among them: KEYS[4 + n]
-- ARGV: [1] the batch as JSON (decoded here with cjson)  [2] MAXLEN of the events stream (approximate)
--       [3] the run id (the member of the run lists)
--
-- The batch: {"g": guards, "w": writes, "q": pushes, "z": {"n": delta, "w": writes}}
-- Guards (fields of the run hash, read with one HMGET; the first that fails aborts everything):
--   ["eq", field, value]  equal   | ["nx", field]  absent   | ["ex", field]  present
--   ["in", field, [v...]] one of   | ["cap", field, limit, add]  (value or 0) + add <= limit
-- Writes (each part optional):
--   "h": [f1, v1, f2, v2, ...] HSET   "d": [f...] HDEL   "i": [[f, n]...] HINCRBY
--   "x": [[name, json list]] events: every part's list (z's too, under its own name) goes into
--        one XADD entry
--   "l": [score, member, ...] ZADD leases
--   "r": [member...] ZREM leases   "e": value RPUSH end
--   "t": seconds EXPIRE the run, its events and its end marker (and its leases with "tl": true:
--        a run that ends with phases in flight); a finished run's lease set is empty, hence gone
--   "p": true PERSIST the run's keys and DEL end (a resumed run is live again)
--   "k": [[n, score]...] ZADD the run (KEYS[1]'s run id, ARGV[3]) to run list KEYS[4 + n] at
--        score, or ZREM it when score is false
-- "q" (optional): [["lpush", k, payload, fields?] | ["pexpire", k, ms]] the Celery messages the
--   write dispatches, exactly as kombu would publish them (taskloop/runtime/outbox.py): sent if and
--   only if the write is applied, after its writes; a push that names fields carries their values
--   in its payload (see carried below).
-- "z" (optional): HINCRBY the run's open-task counter (field z.f) by z.n, then apply z.w if it
-- reached 0: the writes that finish the run, prepared by the scheduler, applied by whichever
-- write ends the last task.
-- Every field name comes from the batch (taskloop/core/fields.py names them); the script names none.
-- Returns {1, open} (open: the new counter, or false without "z"), or {0, i, current} when guard i
-- failed (current: the field's value, or false).

--
-- A library: cas_guards(run, batch) checks the guards (nil, or the refusal to return) and
-- cas_apply(KEYS, ARGV, batch) applies the writes and returns {1, open}. cas.lua calls them in
-- that order; cas_limits.lua puts a fleet-limits operation between or after them.

local CHUNK = 500  -- unpack() has a limit: large writes go in slices

local function chunked(cmd, key, list, step)
  for i = 1, #list, step do
    redis.call(cmd, key, unpack(list, i, math.min(i + step - 1, #list)))
  end
end

-- A message that carries fields (taskloop/core/reads.py): its payload holds the header
-- "tl_carry":null, which becomes the fields' values (HMGET, read after the write's writes: null for
-- an absent field), unless they add up to more than CARRY_MAX bytes (then it stays null and the
-- worker reads them itself).
local CARRY_MAX = 65536
local CARRY_MARK = '"tl_carry":null'

local function carried(run, payload, names)
  if type(names) ~= 'table' or #names == 0 or #names > CHUNK then return payload end
  local at = string.find(payload, CARRY_MARK, 1, true)
  if not at then return payload end
  local values = redis.call('HMGET', run, unpack(names))
  local size = 0
  for i = 1, #names do
    if values[i] then size = size + #values[i] else values[i] = cjson.null end
  end
  if size > CARRY_MAX then return payload end
  return string.sub(payload, 1, at - 1) .. '"tl_carry":' .. cjson.encode(values) .. string.sub(payload, at + #CARRY_MARK)
end

local function cas_guards(run, batch)
  local guards = batch.g or {}
  if #guards == 0 then return nil end
  local fields = {}
  for i, guard in ipairs(guards) do fields[i] = guard[2] end
  local current = {}
  for i = 1, #fields, CHUNK do
    local part = redis.call('HMGET', run, unpack(fields, i, math.min(i + CHUNK - 1, #fields)))
    for j, value in ipairs(part) do current[i + j - 1] = value end
  end
  for i, guard in ipairs(guards) do
    local op, value = guard[1], current[i]
    local ok
    if op == 'eq' then ok = value == guard[3]
    elseif op == 'nx' then ok = not value
    elseif op == 'ex' then ok = value ~= false and value ~= nil
    elseif op == 'in' then
      ok = false
      for _, allowed in ipairs(guard[3]) do if value == allowed then ok = true end end
    elseif op == 'cap' then ok = (tonumber(value) or 0) + guard[4] <= guard[3]
    else return redis.error_reply('cas.lua: unknown guard ' .. tostring(op)) end
    if not ok then return {0, i, value} end
  end
  return nil
end

local function cas_apply(KEYS, ARGV, batch)
  local run, events, endlist, leases = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
  local maxlen = ARGV[2]
  -- The events of this write: each part's entry is {name, <JSON list>}; they are added at the end
  -- as one stream entry (the run-finishing events of "z" join the step's own under their own name).
  local entry = {}
  local expire, expire_leases = false, false
  -- The run hash's HSETs (the write's and, when it ends the run, z's) go in one call, made after
  -- the rest: pending holds the pairs, at[field] the index of a field's value. An HDEL or HINCRBY
  -- of a pending field makes the call first, so the effect is that of the writes in their order.
  local pending, at = {}, {}
  local function flush()
    if #pending > 0 then chunked('HSET', run, pending, 2 * CHUNK) end
    pending, at = {}, {}
  end
  local function touches(fields)
    for _, f in ipairs(fields) do if at[f] then return true end end
    return false
  end

  local function apply(w)
    for i = 1, #(w.h or {}), 2 do
      local f = w.h[i]
      if at[f] then pending[at[f]] = w.h[i + 1]
      else
        table.insert(pending, f); table.insert(pending, w.h[i + 1]); at[f] = #pending
      end
    end
    if w.d and #w.d > 0 then
      if touches(w.d) then flush() end
      chunked('HDEL', run, w.d, CHUNK)
    end
    for _, inc in ipairs(w.i or {}) do
      if at[inc[1]] then flush() end
      redis.call('HINCRBY', run, inc[1], inc[2])
    end
    for _, part in ipairs(w.x or {}) do table.insert(entry, part[1]); table.insert(entry, part[2]) end
    if w.l and #w.l > 0 then chunked('ZADD', leases, w.l, 2 * CHUNK) end
    if w.r and #w.r > 0 then chunked('ZREM', leases, w.r, CHUNK) end
    if w.e then redis.call('RPUSH', endlist, w.e) end
    if w.p then
      redis.call('DEL', endlist)
      for _, key in ipairs({run, events, leases}) do redis.call('PERSIST', key) end
    end
    for _, listed in ipairs(w.k or {}) do
      if listed[2] then redis.call('ZADD', KEYS[4 + listed[1]], listed[2], ARGV[3])
      else redis.call('ZREM', KEYS[4 + listed[1]], ARGV[3]) end
    end
    if w.t then expire, expire_leases = w.t, w.tl end  -- applied last: the events' stream may not exist yet
  end

  apply(batch.w or {})
  local open = false
  if batch.z then
    if at[batch.z.f] then flush() end
    open = redis.call('HINCRBY', run, batch.z.f, batch.z.n)
    if open == 0 then apply(batch.z.w) end
  end
  flush()
  -- the messages go out after every write, so that one that carries fields carries them as written
  for _, push in ipairs(batch.q or {}) do
    if push[1] == 'lpush' then redis.call('LPUSH', KEYS[4 + push[2]], carried(run, push[3], push[4]))
    elseif push[1] == 'pexpire' then redis.call('PEXPIRE', KEYS[4 + push[2]], push[3])
    else return redis.error_reply('cas.lua: unknown push ' .. tostring(push[1])) end
  end
  if #entry > 0 then redis.call('XADD', events, 'MAXLEN', '~', maxlen, '*', unpack(entry)) end
  if expire then
    for _, key in ipairs({run, events, endlist}) do redis.call('EXPIRE', key, expire) end
    if expire_leases then redis.call('EXPIRE', leases, expire) end
  end
  return {1, open}
end
