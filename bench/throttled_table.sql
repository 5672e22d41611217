UPDATE peer_semaphores SET value = value - 1 WHERE key = 'full' AND value > 0;
