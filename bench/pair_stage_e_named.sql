SELECT stage_e_try_slot('exports', :n) AS slot \gset
SELECT stage_e_release('exports', :slot);
