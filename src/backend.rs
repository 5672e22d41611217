//! Backend-local statics: [`BackendLocal`], a process static touched only by this backend's one
//! thread. A leaf, so that every floor (shared memory's hazard slot, the hooks, the session) can
//! keep its per-backend state in one.

use std::cell::{Cell, RefCell};

/// A static of this backend's. A backend is one thread (pgrx refuses a call into PostgreSQL from
/// any other), and `thread_local!` in a dynamically loaded library costs a `__tls_get_addr` call
/// per access, several per acquire+release pair: so this backend's state is in process statics.
pub struct BackendLocal<T>(T);

// SAFETY: only the backend's own thread runs this crate's SQL functions, hooks and workers
// (pgrx checks it on every call into PostgreSQL), so nothing here is touched by another thread.
unsafe impl<T> Sync for BackendLocal<T> {}

impl<T> BackendLocal<T> {
    pub const fn new(value: T) -> Self {
        BackendLocal(value)
    }
}

impl<T> BackendLocal<RefCell<T>> {
    pub fn with_borrow<R>(&self, f: impl FnOnce(&T) -> R) -> R {
        f(&self.0.borrow())
    }

    /// `f` of the value, or None while it is borrowed mutably (for a caller that must not
    /// panic: one outside pgrx's guard).
    pub fn try_with_borrow<R>(&self, f: impl FnOnce(&T) -> R) -> Option<R> {
        self.0.try_borrow().ok().map(|t| f(&t))
    }

    pub fn with_borrow_mut<R>(&self, f: impl FnOnce(&mut T) -> R) -> R {
        f(&mut self.0.borrow_mut())
    }

    pub fn set(&self, value: T) {
        self.0.replace(value);
    }

    pub fn take(&self) -> T
    where
        T: Default,
    {
        self.0.take()
    }
}

impl<T: Copy> BackendLocal<Cell<T>> {
    pub fn get(&self) -> T {
        self.0.get()
    }

    pub fn set(&self, value: T) {
        self.0.set(value)
    }

    pub fn replace(&self, value: T) -> T {
        self.0.replace(value)
    }

    pub fn take(&self) -> T
    where
        T: Default,
    {
        self.0.take()
    }
}
