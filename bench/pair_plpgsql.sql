SELECT peer_plpgsql_try(:key, :n) AS slot \gset
SELECT pg_advisory_unlock(:key, :slot);
