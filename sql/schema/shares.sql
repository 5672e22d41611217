-- Fair shares (0.11.0): a share's weight and ceiling on a cap, as stage_e_share sets them. A
-- row for share '*' is the default of every share of the cap without a row of its own (the
-- unnamed share of calls that name none included). Read by the acquisitions of the cap (each
-- backend keeps what it read until a write of this table commits); written by stage_e_share,
-- whose EXECUTE is revoked from PUBLIC (a share's policy binds every role that uses the cap),
-- or by its owner's own statements and a restore's COPY, which the trigger below makes bind
-- from their commit as well. Every statement of the extension names this table with its
-- schema.
CREATE TABLE stage_e_share_policy (
    cap       text NOT NULL
              CHECK (pg_catalog.octet_length(cap) OPERATOR(pg_catalog.>=) 1
                     AND pg_catalog.octet_length(cap) OPERATOR(pg_catalog.<=) 63),
    share     text NOT NULL
              CHECK (pg_catalog.octet_length(share) OPERATOR(pg_catalog.>=) 1
                     AND pg_catalog.octet_length(share) OPERATOR(pg_catalog.<=) 63),
    weight    integer NOT NULL DEFAULT 1
              CHECK (weight OPERATOR(pg_catalog.>=) 1 AND weight OPERATOR(pg_catalog.<=) 16),
    max_slots integer CHECK (max_slots OPERATOR(pg_catalog.>=) 1),
    PRIMARY KEY (cap, share)
);
COMMENT ON TABLE stage_e_share_policy IS
  'Fair shares of caps (stage_e_share): each share''s weight (1 to 16) and ceiling (max_slots, NULL for none); share ''*'' is the default of the cap''s other shares.';
COMMENT ON COLUMN stage_e_share_policy.weight IS
  'The share''s part of the cap''s slots when shares compete, against the others'' weights (1 to 16).';
COMMENT ON COLUMN stage_e_share_policy.max_slots IS
  'The most slots of the cap the share holds at once; NULL for no ceiling.';
-- Kept by pg_dump with the extension's objects (a restore runs CREATE EXTENSION first and
-- must find it empty).
SELECT pg_catalog.pg_extension_config_dump('stage_e_share_policy', '');
GRANT SELECT ON stage_e_share_policy TO PUBLIC;
-- A write not made by stage_e_share (an UPDATE by hand, a restore's COPY, a TRUNCATE) moves
-- the database's generation of share policies at its commit too: no session keeps a policy
-- it read before.
CREATE TRIGGER stage_e_share_policy_written
    AFTER INSERT OR UPDATE OR DELETE OR TRUNCATE ON stage_e_share_policy
    FOR EACH STATEMENT EXECUTE FUNCTION stage_e_share_policy_written();
ALTER TABLE stage_e_share_policy ENABLE ALWAYS TRIGGER stage_e_share_policy_written;
