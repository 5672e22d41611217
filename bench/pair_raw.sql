-- Floor: one raw advisory-lock acquire and release, a fixed slot per client. Like every
-- contender, the client reads the acquire's result (it must know whether it got the lock).
SELECT pg_try_advisory_lock(:key, :client_id) AS got \gset
SELECT pg_advisory_unlock(:key, :client_id);
