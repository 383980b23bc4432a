//! A global allocator that counts live heap bytes while asked to, so both
//! indexes' memory is measured the same way: bytes they asked the allocator for
//! and still hold, from every thread (Dynamo applies events on its own threads).

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};

pub struct Counting;

static ON: AtomicBool = AtomicBool::new(false);
static LIVE: AtomicI64 = AtomicI64::new(0);

fn count(delta: i64) {
    if ON.load(Ordering::Relaxed) {
        LIVE.fetch_add(delta, Ordering::Relaxed);
    }
}

// SAFETY: every call is forwarded to the system allocator unchanged.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        count(layout.size() as i64);
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        count(-(layout.size() as i64));
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        count(layout.size() as i64);
        unsafe { System.alloc_zeroed(layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        count(new_size as i64 - layout.size() as i64);
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

/// Starts counting from zero. Everything freed while counting must also have
/// been allocated while counting, or the count comes out low.
pub fn start() {
    LIVE.store(0, Ordering::Relaxed);
    ON.store(true, Ordering::Relaxed);
}

/// Stops counting; returns the net bytes allocated since [`start`].
pub fn stop() -> i64 {
    ON.store(false, Ordering::Relaxed);
    LIVE.load(Ordering::Relaxed)
}
