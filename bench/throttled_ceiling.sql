-- Reference, not a contender: the cheapest possible statement, the protocol's ceiling.
SELECT 1;
