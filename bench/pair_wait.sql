SELECT stage_e_try_slot('handoff', :n::int, '60 s') AS slot \gset
SELECT stage_e_release('handoff', :slot::int);
