-- Flushing and resetting write the counter table: superusers and the extension's owner only.
REVOKE EXECUTE ON FUNCTION stage_e_flush() FROM PUBLIC;
REVOKE EXECUTE ON FUNCTION stage_e_reset_stats() FROM PUBLIC;
REVOKE EXECUTE ON FUNCTION stage_e_reset_stats(text) FROM PUBLIC;
-- A cap's adaptive limit binds every role that uses it, and its policy is kept in the counter
-- table: the same.
REVOKE EXECUTE ON FUNCTION stage_e_adapt(text, integer, integer, boolean) FROM PUBLIC;
REVOKE EXECUTE ON FUNCTION stage_e_adapt_off(text) FROM PUBLIC;
-- A cap's rate policy binds every role that uses it, and is kept in the counter table: the same.
REVOKE EXECUTE ON FUNCTION stage_e_rate_limit(text, integer, interval, integer) FROM PUBLIC;
REVOKE EXECUTE ON FUNCTION stage_e_rate_limit_off(text) FROM PUBLIC;
-- A share's weight and ceiling bind every role that uses the cap, and are kept in
-- stage_e_share_policy: the same.
REVOKE EXECUTE ON FUNCTION stage_e_share(text, text, integer, integer) FROM PUBLIC;
-- The policy tables' trigger functions: CREATE TRIGGER needs EXECUTE, and no role but the
-- extension's tables has use for them (each refuses to fire on any other table too).
REVOKE EXECUTE ON FUNCTION stage_e_throttle_counter_written() FROM PUBLIC;
REVOKE EXECUTE ON FUNCTION stage_e_share_policy_written() FROM PUBLIC;
