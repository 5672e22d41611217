//! Single-session behaviour, run inside the server by `cargo pgrx test` (one fresh connection
//! per test; tests run one at a time, see the Makefile). Multi-session behaviour, restarts and
//! other server configurations are in `tests/` (pytest against real clusters).

#[pgrx::pg_schema]
mod tests {
    use pgrx::prelude::*;

    fn one<T: IntoDatum + FromDatum>(sql: &str) -> Option<T> {
        Spi::get_one::<T>(sql).expect("query runs")
    }

    fn counter(name: &str) -> i64 {
        one::<i64>(&format!(
            "SELECT coalesce(sum({name}), 0)::bigint FROM stage_e_stats() WHERE cap = 'default'"
        ))
        .unwrap()
    }

    /// The previous test's connection may still be exiting: wait until its slots are free.
    fn settle() {
        for _ in 0..500 {
            if one::<i32>("SELECT count(*)::int FROM stage_e_slot_holders") == Some(0) {
                return;
            }
            Spi::run("SELECT pg_sleep(0.01)").unwrap();
        }
        panic!("slots still held by an earlier session");
    }

    /// Reclaims the cap at `at` once nothing refers to it. The launcher may pin it, or flush
    /// its counts, for a moment (a lease's horizon, a flush round), and a loaded machine makes
    /// that moment longer: polled, not slept, for at most 5 s.
    fn reclaimed(at: stage_e_core::state::CapRef) -> bool {
        for _ in 0..500 {
            if crate::shmem::reclaim_now(at) {
                return true;
            }
            Spi::run("SELECT pg_sleep(0.01)").unwrap();
        }
        false
    }

    fn my_locks() -> Vec<i32> {
        Spi::connect(|c| {
            c.select(
                "SELECT objid::int FROM pg_locks WHERE locktype = 'advisory' AND pid = pg_backend_pid() \
                 AND classid = current_setting('stage_e_slots.lock_key')::oid AND objsubid = 2 \
                 AND granted ORDER BY 1",
                None,
                &[],
            )
            .unwrap()
            .map(|r| r.get::<i32>(1).unwrap().unwrap())
            .collect()
        })
    }

    /// A pin that fails (its cap was reclaimed since the backend looked it up) must leave the
    /// entry as it was. With this backend's hazard slot taken by another pin, the pin is
    /// counted; a handle built for the failed pin and then dropped used to unpin what was never
    /// pinned, underflowing the count into the LOCKED bit, after which every pin of the entry
    /// spun for ever.
    #[pg_test]
    fn a_pin_that_fails_on_a_reclaimed_cap_leaves_its_entry_unpinned() {
        use crate::shmem;
        settle();
        assert_eq!(one::<i32>("SELECT stage_e_try_slot('keep', 1)"), Some(0));
        assert_eq!(one::<i32>("SELECT stage_e_try_slot('gone', 1)"), Some(0));
        assert_eq!(one::<bool>("SELECT stage_e_release('gone', 0)"), Some(true));
        let db = crate::session::database();
        let keep = shmem::lookup(db, "keep").expect("cap keep").at;
        let gone = shmem::lookup(db, "gone").expect("cap gone").at;
        assert!(reclaimed(gone), "nothing refers to cap gone");
        let hazard = shmem::pin(keep).expect("keep holds a slot: never reclaimed");
        assert!(shmem::pin(gone).is_none(), "a reclaimed cap does not pin");
        drop(hazard);
        assert_eq!(shmem::pin_state(gone.entry), (0, false));
        // The name is a cap again (a new one), and its slot is free.
        assert_eq!(one::<i32>("SELECT stage_e_try_slot('gone', 1)"), Some(0));
        assert_eq!(one::<i32>("SELECT stage_e_release_all()"), Some(2));
    }

    #[pg_test]
    fn hands_out_distinct_slots_then_null_at_the_cap() {
        settle();
        let (acq, thr) = (counter("acquired"), counter("throttled"));
        let got: Vec<Option<i32>> = (0..5).map(|_| one("SELECT stage_e_try_slot(4)")).collect();
        assert_eq!(got, vec![Some(0), Some(1), Some(2), Some(3), None]);
        assert_eq!(one::<i32>("SELECT stage_e_try_slot(4)"), None);
        assert_eq!(my_locks(), vec![0, 1, 2, 3]);
        assert_eq!(counter("acquired") - acq, 4);
        assert_eq!(counter("throttled") - thr, 2);
        assert_eq!(
            one::<i32>("SELECT held FROM stage_e_stats() WHERE cap = 'default'"),
            Some(4)
        );
        // A larger n over the same cap sees the slots beyond 4.
        assert_eq!(one::<i32>("SELECT stage_e_try_slot(5)"), Some(4));
        assert_eq!(one::<i32>("SELECT stage_e_release_all()"), Some(5));
        assert!(my_locks().is_empty());
    }

    #[pg_test]
    fn never_returns_a_slot_this_session_already_holds() {
        settle();
        // Slot 0 taken with a raw advisory lock by this very session: a naive
        // pg_try_advisory_lock loop would get it again (re-entrant) and count it twice.
        Spi::run("SELECT pg_advisory_lock(current_setting('stage_e_slots.lock_key')::int, 0)")
            .unwrap();
        assert_eq!(one::<i32>("SELECT stage_e_try_slot(2)"), Some(1));
        assert_eq!(one::<i32>("SELECT stage_e_try_slot(2)"), None);
        // The raw lock was not doubled: one unlock frees it completely.
        Spi::run("SELECT pg_advisory_unlock(current_setting('stage_e_slots.lock_key')::int, 0)")
            .unwrap();
        assert_eq!(my_locks(), vec![1]);
        assert_eq!(one::<bool>("SELECT stage_e_release(1)"), Some(true));
        assert!(my_locks().is_empty());
    }

    #[pg_test]
    fn release_returns_true_once_and_holding_follows() {
        settle();
        let rel = counter("released");
        let slot = one::<i32>("SELECT stage_e_try_slot(8)").unwrap();
        assert_eq!(
            one::<bool>(&format!("SELECT stage_e_holding({slot})")),
            Some(true)
        );
        assert_eq!(
            one::<bool>(&format!("SELECT stage_e_release({slot})")),
            Some(true)
        );
        assert_eq!(
            one::<bool>(&format!("SELECT stage_e_holding({slot})")),
            Some(false)
        );
        assert_eq!(counter("released") - rel, 1);
        let foreign = counter("foreign_releases");
        assert_eq!(
            one::<bool>(&format!("SELECT stage_e_release({slot})")),
            Some(false)
        );
        assert_eq!(counter("foreign_releases") - foreign, 1);
        assert_eq!(counter("released") - rel, 1);
    }

    #[pg_test]
    fn release_all_counts_only_what_it_released() {
        settle();
        assert_eq!(one::<i32>("SELECT stage_e_release_all()"), Some(0));
        for _ in 0..3 {
            one::<i32>("SELECT stage_e_try_slot(8)").unwrap();
        }
        assert_eq!(one::<i32>("SELECT stage_e_release_all()"), Some(3));
        assert_eq!(one::<i32>("SELECT stage_e_release_all()"), Some(0));
        assert!(my_locks().is_empty());
    }

    #[pg_test]
    fn a_lock_dropped_behind_our_back_is_noticed_by_holding() {
        settle();
        assert_eq!(one::<i32>("SELECT stage_e_try_slot(1)"), Some(0));
        Spi::run("SELECT pg_advisory_unlock_all()").unwrap();
        assert_eq!(one::<bool>("SELECT stage_e_holding(0)"), Some(false));
        // The slot is usable again at once, not stuck as "held".
        assert_eq!(one::<i32>("SELECT stage_e_try_slot(1)"), Some(0));
        assert_eq!(one::<i32>("SELECT stage_e_release_all()"), Some(1));
    }

    #[pg_test]
    fn a_slot_unlocked_earlier_in_this_transaction_is_reused_at_once() {
        settle();
        assert_eq!(one::<i32>("SELECT stage_e_try_slot(1)"), Some(0));
        Spi::run("SELECT pg_advisory_unlock(current_setting('stage_e_slots.lock_key')::int, 0)")
            .unwrap();
        // Same transaction, no stage_e_holding call in between: try_slot notices by itself.
        assert_eq!(one::<i32>("SELECT stage_e_try_slot(1)"), Some(0));
        assert_eq!(my_locks(), vec![0]);
        assert_eq!(one::<i32>("SELECT stage_e_release_all()"), Some(1));
    }

    #[pg_test]
    fn holders_view_shows_this_session_with_acquisition_time() {
        settle();
        let slot = one::<i32>("SELECT stage_e_try_slot(8)").unwrap();
        // The slot was taken by this test's statement (the whole test is one top-level
        // statement): acquired_at is its start, and held_for counts from there.
        let row = Spi::get_two::<i32, bool>(&format!(
            "SELECT pid, acquired_at = statement_timestamp() \
                    AND held_for >= clock_timestamp() - statement_timestamp() - '1 second'::interval \
                    AND held_for <= clock_timestamp() - statement_timestamp() \
             FROM stage_e_slot_holders WHERE slot = {slot}"
        ))
        .unwrap();
        assert_eq!(row.0, one::<i32>("SELECT pg_backend_pid()"));
        assert_eq!(row.1, Some(true));
        assert_eq!(
            one::<bool>(&format!("SELECT stage_e_release({slot})")),
            Some(true)
        );
        assert_eq!(
            one::<i64>("SELECT count(*) FROM stage_e_slot_holders"),
            Some(0)
        );
    }

    #[pg_test]
    fn functions_are_volatile_and_parallel_unsafe_but_the_key() {
        let bad = one::<i64>(
            "SELECT count(*) FROM pg_proc WHERE proname LIKE 'stage_e_%' \
             AND proname <> 'stage_e_cap_key' AND (provolatile <> 'v' OR proparallel <> 'u')",
        );
        assert_eq!(bad, Some(0));
        assert_eq!(
            one::<String>(
                "SELECT provolatile::text || proparallel::text FROM pg_proc \
                 WHERE proname = 'stage_e_cap_key'"
            ),
            Some("ss".into())
        );
        assert_eq!(
            // 0.5.0 retired stage_e_try_slot(n integer, wait interval): 24; 0.6.0 adds
            // stage_e_held_back_internal, 0.8.0 stage_e_histograms and
            // stage_e_histogram_quantiles_internal, 0.9.0 stage_e_adapt, stage_e_adapt_off and
            // stage_e_cap_limits_internal, 0.10.0 stage_e_try_rate, stage_e_rate_limit,
            // stage_e_rate_limit_off and stage_e_rate_limits_internal, 0.11.0 the share forms of
            // stage_e_try_slot, stage_e_try_slots and stage_e_lease, stage_e_share,
            // stage_e_shares_internal and the trigger functions stage_e_share_policy_written and
            // stage_e_throttle_counter_written.
            one::<i64>("SELECT count(*) FROM pg_proc WHERE proname LIKE 'stage_e_%'"),
            Some(41)
        );
        // stage_e_lease (both forms) returns its own row type, (slot integer, token bigint).
        assert_eq!(
            one::<String>(
                "SELECT string_agg(DISTINCT pg_catalog.format_type(prorettype, NULL), ',') \
                   FROM pg_proc WHERE proname = 'stage_e_lease'"
            ),
            Some("stage_e_lease_slot".into())
        );
    }

    /// What `names` writes where text cannot be converted (a message), what it says of bytes
    /// that are not UTF-8, and how it spells a schema name for a statement.
    #[pg_test]
    fn names_escape_report_and_quote_in_ascii() {
        use crate::failures::NameOf;
        use crate::names::{escape_non_ascii, not_utf8, unicode_escaped_identifier};
        use crate::slots::SlotError;
        assert_eq!(escape_non_ascii("cap \"café\""), "cap \"caf\\u00E9\"");
        assert_eq!(escape_non_ascii("😀 x"), "\\U0001F600 x");
        assert_eq!(escape_non_ascii("plain"), "plain");
        let bad = |b: &[u8]| not_utf8(b, std::str::from_utf8(b).unwrap_err());
        assert_eq!(
            bad(b"caf\xe9!"),
            SlotError::CapNotUtf8 {
                at: 3,
                bytes: [0xe9, 0, 0, 0],
                len: 1,
                what: NameOf::Cap,
            }
        );
        assert_eq!(
            bad(b"ab\xc3"),
            SlotError::CapNotUtf8 {
                at: 2,
                bytes: [0xc3, 0, 0, 0],
                len: 1,
                what: NameOf::Cap,
            }
        );
        assert_eq!(
            unicode_escaped_identifier("sché\\ma \"\"x\"\" 😀"),
            "U&\"sch\\00E9\\\\ma \"\"x\"\" \\+01F600\""
        );
        // In a UTF8 or SQL_ASCII database (the test server's) a quoted name stays as it is.
        assert_eq!(
            crate::names::sql_identifier("\"schéma\"".into()),
            "\"schéma\""
        );
    }

    /// `held` and `waiting` of a live share of `cap` (`stage_e_shares`; None: not live).
    fn share_row(cap: &str, share: Option<&str>) -> Option<(i32, i32)> {
        let which = share.map_or("share IS NULL".to_string(), |s| format!("share = '{s}'"));
        Spi::connect(|c| {
            c.select(
                &format!(
                    "SELECT held, waiting FROM stage_e_shares WHERE cap = '{cap}' AND {which}"
                ),
                None,
                &[],
            )
            .unwrap()
            .map(|r| {
                (
                    r.get::<i32>(1).unwrap().unwrap(),
                    r.get::<i32>(2).unwrap().unwrap(),
                )
            })
            .next()
        })
    }

    /// A share's ceiling binds; the other shares and a call without one (the cap's unnamed
    /// share, once the cap has shares) take the rest; every release gives its slot back to its
    /// share (one of k, a release_all, a grow's copy of the holder records in between); the
    /// holders view names each slot's share; and a cap whose shares are all idle forgets them,
    /// so that it can be reclaimed. The policies are this transaction's own rows (read through
    /// the transaction's snapshot; the commit that would make them everyone's is not needed).
    #[pg_test]
    fn a_share_takes_within_its_ceiling_and_every_release_gives_back() {
        use crate::shmem;
        settle();
        Spi::run("SELECT stage_e_share('fair', 'tenant-a', max_slots => 2)").unwrap();
        Spi::run("SELECT stage_e_share('fair', 'tenant-b', 3)").unwrap();
        let take = |s: &str, n: i32, k: i32| {
            one::<Vec<i32>>(&format!(
                "SELECT stage_e_try_slots('fair', {n}, {k}, '0', '{s}')"
            ))
        };
        let held = |s: Option<&str>| share_row("fair", s).map(|r| r.0);
        assert_eq!(take("tenant-a", 4, 1), Some(vec![0]));
        assert_eq!(take("tenant-a", 4, 1), Some(vec![1]));
        assert_eq!(take("tenant-a", 4, 1), None, "a is at its ceiling of 2");
        assert_eq!(held(Some("tenant-a")), Some(2));
        assert_eq!(
            one::<i32>(
                "SELECT weight * 100 + max_slots FROM stage_e_shares \
                  WHERE cap = 'fair' AND share = 'tenant-a'"
            ),
            Some(102)
        );
        assert_eq!(take("tenant-b", 4, 1), Some(vec![2]));
        assert_eq!(
            one::<i32>("SELECT stage_e_try_slot('fair', 4)"),
            Some(3),
            "a call without a share takes in the unnamed share"
        );
        assert_eq!(held(None), Some(1));
        assert_eq!(
            one::<String>(
                "SELECT string_agg(slot || ':' || coalesce(share, '-'), ',' ORDER BY slot) \
                   FROM stage_e_slot_holders WHERE cap = 'fair'"
            ),
            Some("0:tenant-a,1:tenant-a,2:tenant-b,3:-".into())
        );
        assert_eq!(take("tenant-b", 4, 1), None, "the cap is full");
        // A release gives its slot back to its share: a is under its ceiling again.
        assert_eq!(one::<bool>("SELECT stage_e_release('fair', 0)"), Some(true));
        assert_eq!(held(Some("tenant-a")), Some(1));
        assert_eq!(take("tenant-a", 4, 1), Some(vec![0]));
        // k slots at once, in b; then the cap grows (its holder records are copied to a new
        // block) and each of the k slots still gives back to b.
        assert_eq!(one::<bool>("SELECT stage_e_release('fair', 2)"), Some(true));
        assert_eq!(one::<bool>("SELECT stage_e_release('fair', 3)"), Some(true));
        assert_eq!(held(None), None, "an idle share is forgotten");
        assert_eq!(take("tenant-b", 4, 2), Some(vec![2, 3]));
        assert_eq!(held(Some("tenant-b")), Some(2));
        assert_eq!(take("tenant-b", 64, 1), Some(vec![4]), "grown to 64 slots");
        assert_eq!(held(Some("tenant-b")), Some(3));
        assert_eq!(one::<bool>("SELECT stage_e_release('fair', 3)"), Some(true));
        assert_eq!(held(Some("tenant-b")), Some(2));
        assert_eq!(held(Some("tenant-a")), Some(2));
        assert_eq!(
            one::<i64>(
                "SELECT granted FROM stage_e_shares WHERE cap = 'fair' AND share = 'tenant-b'"
            ),
            Some(3),
            "b was forgotten when its one slot went back; live again, it was granted 2 then 1"
        );
        assert_eq!(one::<i32>("SELECT stage_e_release_all('fair')"), Some(4));
        assert_eq!(
            one::<i64>("SELECT count(*) FROM stage_e_shares WHERE cap = 'fair'"),
            Some(0)
        );
        let db = crate::session::database();
        let at = shmem::lookup(db, "fair").expect("cap fair").at;
        assert!(reclaimed(at), "a cap without shares is reclaimed");
    }

    /// A lease taken in a share gives its slot back to the share when it is released by its
    /// token and when it expires.
    #[pg_test]
    fn a_lease_in_a_share_gives_back_when_released_and_when_expired() {
        settle();
        Spi::run("SELECT stage_e_share('fair_lease', 'tenant-a', 2, 1)").unwrap();
        let lease = |ttl: &str| {
            Spi::connect(|c| {
                c.select(
                    &format!(
                        "SELECT slot, token FROM stage_e_lease('fair_lease', 2, '{ttl}', '0', 'tenant-a')"
                    ),
                    None,
                    &[],
                )
                .unwrap()
                .map(|r| (r.get::<i32>(1).unwrap(), r.get::<i64>(2).unwrap()))
                .next()
                .and_then(|(s, t)| Some((s?, t?)))
            })
        };
        let held = || share_row("fair_lease", Some("tenant-a")).map(|r| r.0);
        let (slot, token) = lease("60 s").expect("a lease");
        assert_eq!(held(), Some(1));
        assert_eq!(
            one::<String>("SELECT share FROM stage_e_slot_holders WHERE cap = 'fair_lease'"),
            Some("tenant-a".into())
        );
        assert!(lease("60 s").is_none(), "a is at its ceiling of 1");
        assert_eq!(
            one::<bool>(&format!(
                "SELECT stage_e_release_lease('fair_lease', {slot}, {token})"
            )),
            Some(true)
        );
        assert_eq!(held(), None, "released: the share is idle, forgotten");
        // A lease of 1 ms, expired by the next call's sweep: its share is given back, so the
        // share, at its ceiling of 1 until then, takes again.
        lease("1 ms").expect("a short lease");
        Spi::run("SELECT pg_sleep(0.05)").unwrap();
        let (slot, token) = lease("60 s").expect("the expired lease gave its slot back to a");
        assert_eq!(held(), Some(1));
        assert_eq!(
            one::<bool>(&format!(
                "SELECT stage_e_release_lease('fair_lease', {slot}, {token})"
            )),
            Some(true)
        );
        assert_eq!(held(), None);
    }

    /// A call that waits in a share joins the cap's fair queue and, served, is counted in its
    /// share (here when the lease of another share holding the cap's one slot expires, which
    /// the waiter's own sweep finds); one that times out leaves its share as if it had never
    /// come (forgotten, nothing counted), and the cap's clock has no waiter left.
    #[pg_test]
    fn a_waiter_in_a_share_is_served_in_it_and_one_that_times_out_leaves_no_trace() {
        use crate::shmem;
        settle();
        Spi::run("SELECT stage_e_share('fair_wait', '*', 1, 1)").unwrap();
        let lease = |ttl: &str, share: &str| {
            Spi::connect(|c| {
                c.select(
                    &format!(
                        "SELECT slot, token FROM stage_e_lease('fair_wait', 1, '{ttl}', '0', '{share}')"
                    ),
                    None,
                    &[],
                )
                .unwrap()
                .map(|r| (r.get::<i32>(1).unwrap().unwrap(), r.get::<i64>(2).unwrap().unwrap()))
                .next()
                .expect("the cap's slot, as a lease")
            })
        };
        let row = |s: &str| share_row("fair_wait", Some(s));
        lease("300 ms", "tenant-a");
        assert_eq!(row("tenant-a"), Some((1, 0)));
        let started = std::time::Instant::now();
        assert_eq!(
            one::<i32>("SELECT stage_e_try_slot('fair_wait', 1, '10 s', 'tenant-b')"),
            Some(0),
            "served once a's lease expired"
        );
        assert!(
            started.elapsed() >= std::time::Duration::from_millis(200),
            "it waited"
        );
        assert_eq!(
            row("tenant-b"),
            Some((1, 0)),
            "granted in b, no longer waiting"
        );
        assert!(
            one::<Interval>(
                "SELECT wait_time FROM stage_e_shares WHERE cap = 'fair_wait' AND share = 'tenant-b'"
            )
            .is_some_and(|w| w.micros() >= 150_000),
            "its wait is counted in its share"
        );
        assert_eq!(
            row("tenant-a"),
            None,
            "a's lease expired: a is idle, forgotten"
        );
        assert_eq!(
            one::<bool>("SELECT stage_e_release('fair_wait', 0)"),
            Some(true)
        );
        assert_eq!(row("tenant-b"), None);
        // b's lease holds the slot; a waits 100 ms in vain, as a session slot.
        let (slot, token) = lease("60 s", "tenant-b");
        assert_eq!(
            one::<i32>("SELECT stage_e_try_slot('fair_wait', 1, '100 ms', 'tenant-a')"),
            None,
            "timed out"
        );
        assert_eq!(
            row("tenant-a"),
            None,
            "a left unserved: nothing counted, forgotten"
        );
        assert_eq!(row("tenant-b"), Some((1, 0)));
        assert_eq!(
            one::<bool>(&format!(
                "SELECT stage_e_release_lease('fair_wait', {slot}, {token})"
            )),
            Some(true)
        );
        assert_eq!(
            one::<i64>("SELECT count(*) FROM stage_e_shares WHERE cap = 'fair_wait'"),
            Some(0)
        );
        assert_eq!(
            one::<i64>("SELECT count(*) FROM stage_e_slot_waiters WHERE cap = 'fair_wait'"),
            Some(0),
            "no waiter left behind"
        );
        let db = crate::session::database();
        let at = shmem::lookup(db, "fair_wait").expect("cap fair_wait").at;
        assert!(reclaimed(at), "no shares, no waiters: reclaimed");
    }
}
