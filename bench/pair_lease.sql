SELECT slot, token FROM stage_e_lease('leases', :n::int, '60 s') \gset
SELECT stage_e_release_lease('leases', :slot::int, :token::bigint);
