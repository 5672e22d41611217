SELECT stage_e_try_slot(:n);
