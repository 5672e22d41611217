-- Waiting at equal contention on independent queues: :n caps of one slot, the clients spread
-- evenly over them (client i on cap i mod n), as pair_blocking_even.sql spreads them over keys.
\set c :client_id % :n
SELECT stage_e_try_slot('handoff-' || :c, 1, '60 s') AS slot \gset
SELECT stage_e_release('handoff-' || :c, :slot::int);
