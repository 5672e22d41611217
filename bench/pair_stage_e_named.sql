-- Typed parameters: an untyped (cap, n) pair is ambiguous with stage_e_try_slot(n, wait).
SELECT stage_e_try_slot('exports', :n::int) AS slot \gset
SELECT stage_e_release('exports', :slot::int);
