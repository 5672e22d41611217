CREATE TYPE stage_e_lease_slot AS (slot integer, token bigint);
COMMENT ON TYPE stage_e_lease_slot IS 'A leased slot and its fencing token.';
