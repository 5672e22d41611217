-- Flushing and resetting write the counter table: superusers and the extension's owner only.
REVOKE EXECUTE ON FUNCTION stage_e_flush() FROM PUBLIC;
REVOKE EXECUTE ON FUNCTION stage_e_reset_stats() FROM PUBLIC;
REVOKE EXECUTE ON FUNCTION stage_e_reset_stats(text) FROM PUBLIC;
