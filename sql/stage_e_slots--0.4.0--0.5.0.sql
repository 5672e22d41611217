-- stage_e_slots 0.4.0 -> 0.5.0: every call resolves when its parameters are untyped.
--
-- stage_e_try_slot(n integer, wait interval), the cap `default`'s waiting form, is retired: with
-- two parameters sent without a type (node-postgres, asyncpg, pgbench's prepared mode) it and
-- stage_e_try_slot(cap text, n integer) were equally good candidates, and the call failed with
-- "function stage_e_try_slot(unknown, unknown) is not unique". stage_e_try_slot('default', n,
-- wait) replaces it. Nothing else changes; the result is the same schema as a fresh 0.5.0
-- install (the update test compares them). A view or a BEGIN ATOMIC function of yours that
-- calls the retired form makes this update fail (it depends on the function) until it is
-- changed; a function whose body is a string fails when it next makes the call.
\echo Use "ALTER EXTENSION stage_e_slots UPDATE TO '0.5.0'" to load this file. \quit

DROP FUNCTION @extschema@.stage_e_try_slot(integer, interval);
