-- PostgreSQL's own hand-off at equal contention: the blocking advisory lock on one of :n keys,
-- the clients spread evenly over them (client i on key i mod n), so that every key always has
-- its share of waiters, as every slot of a saturated cap does.
\set s :client_id % :n
SELECT pg_advisory_lock(:key, :s);
SELECT pg_advisory_unlock(:key, :s);
