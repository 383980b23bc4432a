//! Vectors a runtime thread keeps from one request for the next.
//!
//! A proxied request made vectors of its own (its block hashes, its
//! decision's scores) and freed them once used: an allocation and a free
//! each per request. Given back to the thread instead, they are filled again
//! by the thread's next request. One whose room is over the caller's limit is
//! let go, so that a rare huge prompt's does not stay.
//!
//! A vector a request holds while others start (its token ids, until its
//! response starts: a retry routes them again) is kept in a pool of several
//! instead ([`take_pooled`], [`keep_pooled`]): one kept vector was mostly
//! taken when the next prompt came.

use std::cell::{Cell, RefCell};
use std::thread::LocalKey;

/// The thread's kept vector, empty (a new one if none is kept).
pub fn take<T>(kept: &'static LocalKey<Cell<Vec<T>>>) -> Vec<T> {
    let mut vector = kept.take();
    vector.clear();
    vector
}

/// Keeps `vector` for the thread's next [`take`] if it has room for at most
/// `max` elements.
pub fn keep<T>(kept: &'static LocalKey<Cell<Vec<T>>>, vector: Vec<T>, max: usize) {
    if vector.capacity() <= max {
        kept.set(vector);
    }
}

/// A vector from the thread's pool, empty (a new one if the pool is empty).
pub fn take_pooled<T>(pool: &'static LocalKey<RefCell<Vec<Vec<T>>>>) -> Vec<T> {
    let mut vector = pool.with_borrow_mut(Vec::pop).unwrap_or_default();
    vector.clear();
    vector
}

/// Puts `vector` in the thread's pool for a later [`take_pooled`] if it has
/// room for at most `max` elements and the pool holds fewer than `most`.
pub fn keep_pooled<T>(
    pool: &'static LocalKey<RefCell<Vec<Vec<T>>>>,
    vector: Vec<T>,
    max: usize,
    most: usize,
) {
    if vector.capacity() <= max {
        pool.with_borrow_mut(|pool| {
            if pool.len() < most {
                pool.push(vector);
            }
        });
    }
}
