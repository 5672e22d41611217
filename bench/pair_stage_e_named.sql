-- Typed parameters, as before 0.5.0 (an untyped (cap, n) pair was then ambiguous with the retired
-- stage_e_try_slot(n, wait)); kept so that the figures stay comparable with earlier results.
SELECT stage_e_try_slot('exports', :n::int) AS slot \gset
SELECT stage_e_release('exports', :slot::int);
