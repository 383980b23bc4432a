//! Vectors a runtime thread keeps from one request for the next.
//!
//! A proxied request made vectors of its own (its block hashes, its
//! decision's scores) and freed them once used: an allocation and a free
//! each per request. Given back to the thread instead, they are filled again
//! by the thread's next request. One whose room is over the caller's limit is
//! let go, so that a rare huge prompt's does not stay.

use std::cell::Cell;
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
