-- cas.lua: one guarded batch write on one run (see lib_cas.lua for KEYS, ARGV and the batch).
-- uses: lib_cas

local batch = cjson.decode(ARGV[1])
local refused = cas_guards(KEYS[1], batch)
if refused then return refused end
return cas_apply(KEYS, ARGV, batch)
