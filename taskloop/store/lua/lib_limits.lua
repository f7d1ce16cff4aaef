-- lib_limits.lua: fleet flow control (SPEC §10), atomic per call: rate limits (a sliding window of
-- starts or of reported tokens) and concurrency limits (held slots that expire with the phase's
-- lease), each with its queue of waiting phases, oldest first. The pure model of the same
-- arithmetic is taskloop/core/limits.py (a property test compares the two).
--
-- KEYS: six per limit, in the order of the specs: cfg HASH, use ZSET, wait ZSET, sent HASH, meta HASH,
--       values SET
--       (store/keys.py LimitKeys); then, on a single Redis only, the due ZSET and the names SET
--       (on a Cluster they live in other slots: the store writes them from the reply).
-- ARGV: [1] op  [2] now (epoch seconds)  [3] the phase's wait member "<run>|<task>|<phase>|<round>|<token>"
--       [4] the phase's slot holder "<run>|<task>"  [5] a slot's expiry (the phase's lease)
--       [6] the specs (JSON list, one per limit): {"k": "rate"|"conc", "n": name, "v": key value,
--           "r": rate, "p": per_s, "u": "starts"|"tokens", "l": limit}; the cfg hash overrides r, p, l
--       [7] op "tokens": the tokens to count
--
-- ops:
--   acquire: all or nothing. Each limit must have room for the phase *and* for the phases that
--     wait ahead of it; then a start is counted (rate, starts), a slot taken (concurrency) and the
--     phase leaves the wait queue. Otherwise it joins (keeps its place in) the wait queue of the
--     first limit that refused it, and nothing is counted.
--     Returns {1, per limit: when its waiters may start (false: none wait, or a release wakes them)}
--     or {0, index of that limit, retry at, used, allowed}.
--   wake: the slot of holder ARGV[4] (if any) is released, and the oldest waiters the limits have
--     room for are picked to be sent again; a rate limit in starts counts each picked waiter's start
--     now (its acquire then finds it). Returns {members to send, per limit: when to look again
--     (false: no one waits)}.
--   renew: every slot of holder ARGV[4] expires at ARGV[5] now (the phase's lease was renewed).
--   leave: the phase leaves the wait queues (it ended while it waited, or moved on).
--   undo: what acquire took for this phase is given back (a Cluster's later limit refused it).
--   tokens: ARGV[7] tokens reported at ARGV[2] count in each (tokens) rate limit's window.
--
-- A library: it defines limit_op(KEYS, ARGV), called by limits.lua with the script's own KEYS and
-- ARGV, by begin.lua (acquire, in the call that begins a phase) and by cas_limits.lua (wake, in
-- the call that records a phase's outcome), each with the slices that are the limits'.

local function limit_op(KEYS, ARGV)
  local op, now, member, holder = ARGV[1], tonumber(ARGV[2]), ARGV[3], ARGV[4]
  local expiry = tonumber(ARGV[5])
  local specs = cjson.decode(ARGV[6])
  local globals = #KEYS > 6 * #specs
  local due_key, names_key = KEYS[6 * #specs + 1], KEYS[6 * #specs + 2]

  -- Time only moves forward within a limit: a caller whose clock reads earlier than the last call's
  -- (it read its clock before a round trip, or its host's clock is behind) acts at that last time.
  -- Otherwise its call could add a start against a window that a later-timed call has already
  -- pruned, and a window could hold more than its rate. The time is kept in each limit's meta hash.
  for i, _ in ipairs(specs) do
    local last = tonumber(redis.call('HGET', KEYS[6 * (i - 1) + 5], 'clock'))
    if last and last > now then now = last end
  end
  for i, _ in ipairs(specs) do redis.call('HSET', KEYS[6 * (i - 1) + 5], 'clock', string.format('%.6f', now)) end
  local RESENT_S = 5    -- a waiter sent again less than this long ago is on its way: not sent twice
  local GONE_S = 120    -- a waiter sent again this long ago that never came back is gone (ended elsewhere)
  local WAKE_PAGE, WAKE_SCAN = 100, 2000  -- a wake reads its wait queue in pages, at most this far

  local function keys_of(i)
    local b = 6 * (i - 1)
    return KEYS[b + 1], KEYS[b + 2], KEYS[b + 3], KEYS[b + 4], KEYS[b + 5], KEYS[b + 6]
  end

  local function numbers(spec, cfg)
    local o = redis.call('HMGET', cfg, 'rate', 'per_s', 'limit')
    return tonumber(o[1]) or spec.r, tonumber(o[2]) or spec.p, tonumber(o[3]) or spec.l
  end

  -- What a limit allows now: used, allowed, the free room (how many more may start), when the
  -- oldest use leaves (rate) or the first slot expires (concurrency): when to look again, and the
  -- window in seconds (rate; nil for concurrency), as the numbers it read give them.
  local function state(spec, cfg, use)
    local rate, per, limit = numbers(spec, cfg)
    if spec.k == 'conc' then
      redis.call('ZREMRANGEBYSCORE', use, '-inf', '(' .. now)  -- slots of dead workers: their lease ran out
      local held = redis.call('ZCARD', use)
      local first = redis.call('ZRANGE', use, 0, 0, 'WITHSCORES')
      return held, limit, limit - held, tonumber(first[2])
    end
    redis.call('ZREMRANGEBYSCORE', use, '-inf', now - per)
    if spec.u ~= 'tokens' then
      -- starts: a count, and when the start that must leave for one more to fit leaves the window
      local used = redis.call('ZCARD', use)
      local again = nil
      if used >= rate then
        local leaving = redis.call('ZRANGE', use, used - rate, used - rate, 'WITHSCORES')
        again = tonumber(leaving[2]) + per
      end
      return used, rate, rate - used, again, per
    end
    local entries = redis.call('ZRANGE', use, 0, -1, 'WITHSCORES')
    do
      local total = 0
      for i = 1, #entries, 2 do total = total + tonumber(string.match(entries[i], '|(%d+)$') or 0) end
      -- the window reopens when enough of its oldest reports leave it to bring it under the rate
      local again, left = nil, total
      for i = 1, #entries, 2 do
        if left < rate then break end
        left = left - tonumber(string.match(entries[i], '|(%d+)$') or 0)
        again = tonumber(entries[i + 1]) + per
      end
      local room = 0
      if total < rate then room = math.huge end
      return total, rate, room, again, per
    end
  end

  if op == 'acquire' then
    for i, spec in ipairs(specs) do
      local cfg, use, wait, sent, meta, values = keys_of(i)
      redis.call('HSET', meta, 'kind', spec.k, 'rate', spec.r, 'per_s', spec.p, 'unit', spec.u, 'limit', spec.l)
      if spec.v ~= '' then redis.call('SADD', values, spec.v) end
      local ok, used, allowed, room, again
      -- its slot, or its start in the window, is taken already (a replay, or its message came twice)
      local holds = false
      if spec.k == 'conc' then
        local until_ = redis.call('ZSCORE', use, holder)
        holds = until_ and tonumber(until_) >= now
      elseif spec.u ~= 'tokens' then
        local at = redis.call('ZSCORE', use, member)
        local _, per = numbers(spec, cfg)
        holds = at and tonumber(at) > now - per
        -- a wake counted its start when it picked it; the start is now: the window counts it from
        -- here on, so that one window's late arrivals and the next window's waiters cannot start
        -- their callbacks in the same second
        if holds then redis.call('ZADD', use, 'XX', 'GT', now, member) end
      end
      if holds then
        ok = true
      else
        used, allowed, room, again = state(spec, cfg, use)
        local rank = redis.call('ZRANK', wait, member)  -- false when it does not wait yet
        local ahead = rank or redis.call('ZCARD', wait)
        -- picked: a wake chose it, oldest first, for room it saw; those picked together may arrive
        -- in any order
        local picked = rank ~= false and redis.call('HEXISTS', sent, member) == 1
        if spec.u == 'tokens' then ok = room > 0 and (rank ~= false or ahead == 0)
        else ok = room > 0 and (picked or ahead < room) end
      end
      if not ok then
        redis.call('ZADD', wait, 'NX', now, member)
        redis.call('HDEL', sent, member)  -- it came back: not gone
        local retry = again or (now + RESENT_S)
        if room > 0 then retry = now end  -- room, but others wait ahead: send them now
        if globals then
          redis.call('ZADD', due_key, 'LT', retry, spec.n .. '|' .. spec.v)
          redis.call('SADD', names_key, spec.n)
        end
        return {0, i, string.format('%.6f', retry), used, allowed}
      end
    end
    local dues = {}
    for i, spec in ipairs(specs) do
      local cfg, use, wait, sent = keys_of(i)
      if spec.k == 'conc' then redis.call('ZADD', use, expiry, holder)
      elseif spec.u ~= 'tokens' then redis.call('ZADD', use, 'NX', now, member) end  -- a start a wake reserved keeps its time
      redis.call('ZREM', wait, member)
      redis.call('HDEL', sent, member)
      -- others still wait: look at them as soon as there is room again (at once when there is)
      dues[i] = false
      if redis.call('ZCARD', wait) > 0 then
        local _, _, room, again = state(spec, cfg, use)
        local at = again
        if room > 0 then at = now end
        if at then
          dues[i] = string.format('%.6f', at)
          if globals then redis.call('ZADD', due_key, 'LT', at, spec.n .. '|' .. spec.v) end
        end
      end
      if globals then redis.call('SADD', names_key, spec.n) end
    end
    return {1, dues}
  end

  if op == 'wake' then
    local picked, again_at = {}, {}
    for i, spec in ipairs(specs) do
      local cfg, use, wait, sent = keys_of(i)
      if spec.k == 'conc' and holder ~= '' then redis.call('ZREM', use, holder) end
      local _, _, room, again, per = state(spec, cfg, use)
      local starts = spec.k ~= 'conc' and spec.u ~= 'tokens'
      local sent_now, on_the_way = 0, false
      -- the oldest waiters first, a page at a time, until the room is taken (or WAKE_SCAN looked at)
      local from = 0
      while room > 0 and from < WAKE_SCAN do
        local waiting = redis.call('ZRANGE', wait, from, from + WAKE_PAGE - 1)
        if #waiting == 0 then break end
        from = from + #waiting
        for _, m in ipairs(waiting) do
          if room <= 0 then break end
          local last = tonumber(redis.call('HGET', sent, m))
          if last and now - last > GONE_S then
            redis.call('ZREM', wait, m)  -- sent again long ago and never came back: it ended elsewhere
            redis.call('HDEL', sent, m)
            from = from - 1
          elseif not last or now - last >= RESENT_S then
            table.insert(picked, m)
            sent_now = sent_now + 1
            redis.call('HSET', sent, m, string.format('%.6f', now))
            -- a rate limit counts the start now, when the window has room for it, not when its
            -- message has come back to a worker: the window's room is used as soon as it reopens
            if starts then redis.call('ZADD', use, 'NX', now, m) end
            room = room - 1
          else
            on_the_way = true
            -- on its way: a slot, or tokens, it will take when it arrives; a start the window
            -- still counts (the wake that picked it added it) takes no room twice
            local counted = false
            if starts then
              local at = redis.call('ZSCORE', use, m)
              counted = at ~= false and tonumber(at) > now - per
            end
            if not counted then room = room - 1 end
          end
        end
      end
      -- when to look again: soon while some are on their way (they start, or wait again and say when
      -- the window reopens), else when the window reopens or the first slot expires. A rate limit in
      -- starts has counted the starts of the waiters it picked, so when its window reopens is known
      -- now: it is looked at then (not when a picked waiter's message comes back to a worker, which
      -- would add that message's way to every window, and the delays would add up window by window).
      local next_at = false
      local waiting_n = redis.call('ZCARD', wait)
      if waiting_n > 0 then
        if spec.k ~= 'conc' and spec.u ~= 'tokens' then
          local _, _, _, reopens = state(spec, cfg, use)
          next_at = now + RESENT_S
          if reopens and reopens < next_at then next_at = reopens end
        elseif sent_now > 0 or on_the_way or not again then next_at = now + RESENT_S else next_at = again end
      elseif spec.v ~= '' and redis.call('ZCARD', use) == 0 then
        redis.call('SREM', select(6, keys_of(i)), spec.v)  -- nothing held, nothing waits: not listed
      end
      if globals then
        local due_member = spec.n .. '|' .. spec.v
        if next_at then redis.call('ZADD', due_key, next_at, due_member)
        else redis.call('ZREM', due_key, due_member) end
      end
      again_at[i] = next_at and string.format('%.6f', next_at) or false
    end
    return {picked, again_at}
  end

  if op == 'undo' then
    -- a Cluster's later limit refused the phase: give back what this call's limits took for it
    for i, spec in ipairs(specs) do
      local _, use = keys_of(i)
      if spec.k == 'conc' then redis.call('ZREM', use, holder) else redis.call('ZREM', use, member) end
    end
    return {1}
  end

  if op == 'leave' then
    -- the phase will not start (it ended while it waited, or it moved on): out of the wait queues
    for i, _ in ipairs(specs) do
      local _, _, wait, sent = keys_of(i)
      redis.call('ZREM', wait, member)
      redis.call('HDEL', sent, member)
    end
    return {1}
  end

  if op == 'renew' then
    for i, spec in ipairs(specs) do
      local _, use = keys_of(i)
      if spec.k == 'conc' then redis.call('ZADD', use, 'XX', expiry, holder) end
    end
    return {1}
  end

  if op == 'tokens' then
    local amount = tonumber(ARGV[7])
    for i, spec in ipairs(specs) do
      local _, use = keys_of(i)
      if spec.u == 'tokens' and amount > 0 then redis.call('ZADD', use, now, member .. '|' .. amount) end
    end
    return {1}
  end

  return redis.error_reply('limits.lua: unknown op ' .. tostring(op))
end
