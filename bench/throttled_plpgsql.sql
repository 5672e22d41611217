SELECT peer_plpgsql_try(:key, :n);
