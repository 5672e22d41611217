SELECT stage_e_try_slot(:n) AS slot \gset
SELECT stage_e_release(:slot);
