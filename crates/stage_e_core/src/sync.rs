//! The atomics the lock-free protocols are written in: std's, or loom's in the crate's own tests
//! built with `--cfg loom` (`RUSTFLAGS="--cfg loom" cargo test -p stage_e_core --release`), so
//! the same code is model-checked over every interleaving of a few threads.
//!
//! Only the tests switch (`cfg(all(test, loom))`, as tokio does): loom is a dev-dependency, and
//! the types the extension places in shared memory are always std's, whose layout is the
//! integer's (loom's atomics are not: they live only in a model).
//!
//! **SeqCst under loom.** Loom treats a SeqCst *access* as AcqRel (its "unsupported features",
//! tokio-rs/loom#180): the store-buffering pattern "store x; load y" against "store y; load x"
//! may then read both old values, which C++'s single total order S forbids. A SeqCst *fence* it
//! does model. So where a protocol relies on S between accesses to two locations (a Dekker
//! pair: the wait queue's "no lost wake-up"), the code calls [`seqcst_pair`] between them: a
//! no-op in every build (the SeqCst accesses already give that order), a `fence(SeqCst)` under
//! loom, which gives the model what S gives the real code. Everything else loom models as is.

#![allow(unused_imports)]

#[cfg(all(test, loom))]
pub(crate) use loom::{
    hint::spin_loop,
    sync::atomic::{fence, AtomicI32, AtomicI64, AtomicU32, AtomicU64, AtomicUsize, Ordering},
    thread::yield_now,
};

#[cfg(not(all(test, loom)))]
pub(crate) use std::{
    hint::spin_loop,
    sync::atomic::{fence, AtomicI32, AtomicI64, AtomicU32, AtomicU64, AtomicUsize, Ordering},
    thread::yield_now,
};

/// Between the two SeqCst halves of a Dekker pair (a store or RMW to one location, then a load
/// of another): nothing in a build; under loom, the SeqCst fence that stands for the total
/// order loom does not give SeqCst accesses (see the module note).
#[inline(always)]
pub(crate) fn seqcst_pair() {
    #[cfg(all(test, loom))]
    fence(Ordering::SeqCst);
}

/// Runs a loom model of `f`: every interleaving of its threads with at most
/// `LOOM_MAX_PREEMPTIONS` preemptions, 2 when unset (the suite then runs in about a minute on
/// two cores; 3 takes over ten minutes and walks the spinning queue model past loom's branch
/// limit).
#[cfg(all(test, loom))]
pub(crate) fn model(f: impl Fn() + Sync + Send + 'static) {
    model_long(loom::model::Builder::new().max_branches, f);
}

/// [`model`] for an execution of more than loom's default 1,000 branches (each atomic access
/// and each yield of a spinlock is one): a model with several rounds of the queue lock.
#[cfg(all(test, loom))]
pub(crate) fn model_long(max_branches: usize, f: impl Fn() + Sync + Send + 'static) {
    let mut b = loom::model::Builder::new();
    if b.preemption_bound.is_none() {
        b.preemption_bound = Some(2);
    }
    b.max_branches = max_branches;
    b.check(f);
}

/// The queue lock (the extension's waits LWLock) in a loom model: a spinlock on a loom atomic
/// around a std mutex that only the spinlock's holder touches, so it never blocks. Loom's own
/// `Mutex` does not mix with `unpark` (an unpark makes a thread blocked on it runnable, and
/// loom then panics), and a latch does not wake a process waiting for an LWLock.
#[cfg(all(test, loom))]
pub(crate) struct SpinLock<T> {
    held: loom::sync::atomic::AtomicBool,
    list: std::sync::Mutex<T>,
}

#[cfg(all(test, loom))]
impl<T> SpinLock<T> {
    pub(crate) fn new(t: T) -> Self {
        SpinLock {
            held: loom::sync::atomic::AtomicBool::new(false),
            list: std::sync::Mutex::new(t),
        }
    }

    pub(crate) fn with<R>(&self, f: impl FnOnce(&mut T) -> R) -> R {
        while self
            .held
            .compare_exchange(false, true, Ordering::Acquire, Ordering::Relaxed)
            .is_err()
        {
            yield_now();
        }
        let r = f(&mut self.list.lock().unwrap());
        self.held.store(false, Ordering::Release);
        r
    }
}
