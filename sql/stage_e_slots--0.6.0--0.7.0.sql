-- stage_e_slots 0.6.0 -> 0.7.0: no role can make another role's cap name unusable.
--
-- Each counter row records its cap's lock key (lock_key), so that a name whose 32-bit key
-- collides with another name's (found by brute force in seconds) gets a key of its own and
-- keeps it, instead of being refused with 42710 while the other is in use (src/keys.rs).
-- Until a database is updated, the 0.7.0 library serves it as 0.6.0 did. Rows made before the
-- update record the key their cap had under 0.6.0, which is what stage_e_cap_key answers here
-- (a live cap's key; else, with no key recorded yet, the name's FNV key; `default`'s is
-- stage_e_slots.lock_key). The result is the same schema as a fresh 0.7.0 install (the update
-- test compares them).
\echo Use "ALTER EXTENSION stage_e_slots UPDATE TO '0.7.0'" to load this file. \quit

ALTER TABLE stage_e_throttle_counter ADD COLUMN lock_key integer;
UPDATE stage_e_throttle_counter SET lock_key = stage_e_cap_key(cap);
CREATE INDEX stage_e_throttle_counter_lock_key ON stage_e_throttle_counter (lock_key);
COMMENT ON COLUMN stage_e_throttle_counter.lock_key IS
  'The first int4 of the cap''s advisory locks (stage_e_cap_key), kept while this row lives.';
