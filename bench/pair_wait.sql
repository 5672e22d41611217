SELECT stage_e_try_slot('handoff', :n, '60 s') AS slot \gset
SELECT stage_e_release('handoff', :slot);
