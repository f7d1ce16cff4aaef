-- limits.lua: one fleet-limits operation (see lib_limits.lua for KEYS, ARGV and the ops).
-- uses: lib_limits

return limit_op(KEYS, ARGV)
