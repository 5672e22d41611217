-- PostgreSQL's own hand-off: a blocking advisory lock on one of :n keys picked at random (with
-- n = 1, one queue in the lock manager: the floor of any waiting design).
\set s random(0, :n - 1)
SELECT pg_advisory_lock(:key, :s);
SELECT pg_advisory_unlock(:key, :s);
