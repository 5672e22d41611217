\set c random(1, :caps)
SELECT stage_e_try_slot('tenant:' || :c, :n::int);
