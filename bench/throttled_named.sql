SELECT stage_e_try_slot('tenant:1', :n::int);
