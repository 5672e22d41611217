SELECT peer_plpgsql_try_counted(:key, :n);
