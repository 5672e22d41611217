-- Solid Queue's semaphore row: decrement when positive; increment on release if acquired.
WITH t AS (UPDATE peer_semaphores SET value = value - 1 WHERE key = 'bench' AND value > 0
           RETURNING 1)
SELECT count(*) AS got FROM t \gset
\if :got
UPDATE peer_semaphores SET value = value + 1 WHERE key = 'bench';
\endif
