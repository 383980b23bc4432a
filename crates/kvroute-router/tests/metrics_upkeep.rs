//! A router nobody scrapes does not keep every histogram sample it records:
//! the exporter queues them, and the router's upkeep drains the queue.
//!
//! Its own test binary: it counts the process's live heap bytes, and installs
//! the process-wide recorder.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicIsize, Ordering};
use std::time::{Duration, Instant};

struct Counting;

static LIVE: AtomicIsize = AtomicIsize::new(0);

// SAFETY: forwards to the system allocator, only counting sizes.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        LIVE.fetch_add(layout.size() as isize, Ordering::Relaxed);
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        LIVE.fetch_sub(layout.size() as isize, Ordering::Relaxed);
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        LIVE.fetch_add(
            new_size as isize - layout.size() as isize,
            Ordering::Relaxed,
        );
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

const MIB: isize = 1 << 20;

/// Records two million samples into `histogram` (after a first one, which
/// may set it up); returns the live heap bytes before them and how many more
/// there are after.
fn heap_growth(histogram: &metrics::Histogram) -> (isize, isize) {
    histogram.record(0.001);
    let before = LIVE.load(Ordering::Relaxed);
    for i in 0..2_000_000 {
        histogram.record(i as f64 * 1e-9);
    }
    (before, LIVE.load(Ordering::Relaxed) - before)
}

/// Records two million samples into `histogram`, which the exporter queues,
/// then waits until a drain without any scrape has freed them.
fn drained_without_a_scrape(histogram: &metrics::Histogram) {
    let (before, held) = heap_growth(histogram);
    assert!(held > 8 * MIB, "the samples wait somewhere: {held} bytes");
    // Drained samples are freed once the recorder's epoch moves on, which
    // recording does, as a live router's would.
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        for _ in 0..1_000 {
            histogram.record(0.001);
        }
        let still = LIVE.load(Ordering::Relaxed) - before;
        if still < MIB {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "{still} bytes of samples still held, none drained"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn histogram_samples_are_drained_without_a_scrape() {
    let _renderer = kvroute_router::metrics::handle();
    // Bucketed, as every histogram family the router exports.
    drained_without_a_scrape(&metrics::histogram!("kvroute_test_upkeep_seconds"));
}
