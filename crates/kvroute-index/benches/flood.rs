//! What a flooding worker's store over the `max_blocks` limit costs while
//! every other worker stays within its fair share: the eviction must take
//! the flooder's own blocks without walking the others' (DESIGN.md,
//! "Eviction cost bound").
//!
//! `cargo bench -p kvroute-index --bench flood`: 255 workers holding 1,000
//! blocks each (chains of 8) under a limit of 262,144, then a flooder
//! storing 16-block chains: the mean, p99 and maximum of its stores once it
//! is over the limit, the evictions cut at their bound and the most
//! memberships seen over the limit after a store, as JSON. `FLOOD_MAX_BLOCKS=N` for another limit (the
//! honest workers keep 1,000 blocks each).

use std::time::{Duration, Instant};

use kvroute_index::{EventKind, IndexConfig, KvEvent, KvIndex, StoredBlock, WorkerKey};

const HONEST_WORKERS: u64 = 255;
const HONEST_BLOCKS: u64 = 1_000;
const HONEST_CHAIN: u64 = 8;
const FLOOD_CHAIN: u64 = 16;
/// Stores timed once the flooder is over the limit.
const TIMED_STORES: usize = 20_000;

fn chain(first_hash: u64, len: u64) -> EventKind {
    EventKind::Stored {
        parent_hash: None,
        blocks: (first_hash..first_hash + len)
            .map(|h| StoredBlock {
                block_hash: h,
                tokens_hash: h,
            })
            .collect(),
    }
}

fn worker(worker_id: u64) -> WorkerKey {
    WorkerKey {
        worker_id,
        dp_rank: 0,
    }
}

fn main() {
    let max_blocks = std::env::var("FLOOD_MAX_BLOCKS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(262_144_usize);
    let index = KvIndex::new(IndexConfig {
        max_blocks: Some(max_blocks),
    });
    let mut event_id = vec![0u64; HONEST_WORKERS as usize + 1];
    let mut store = |w: u64, kind: EventKind| {
        event_id[w as usize] += 1;
        index.apply(
            worker(w),
            &KvEvent {
                event_id: event_id[w as usize],
                kind,
            },
        );
    };
    for w in 1..=HONEST_WORKERS {
        for c in 0..HONEST_BLOCKS / HONEST_CHAIN {
            // Distinct hashes per worker and chain.
            store(
                w,
                chain((w << 40) | (c * HONEST_CHAIN + 1) << 8, HONEST_CHAIN),
            );
        }
    }
    let flooder = HONEST_WORKERS + 1;
    let mut next = 0u64;
    let mut flood = |store: &mut dyn FnMut(u64, EventKind)| {
        next += 1;
        store(0, chain((flooder << 40) | next << 8, FLOOD_CHAIN));
    };
    // Fill up to the limit and past it once.
    while index.evicted_blocks() == 0 {
        flood(&mut store);
    }
    let mut took = Vec::with_capacity(TIMED_STORES);
    let mut most_over = 0;
    for _ in 0..TIMED_STORES {
        let start = Instant::now();
        flood(&mut store);
        took.push(start.elapsed());
        most_over = most_over.max(index.stats().memberships.saturating_sub(max_blocks as u64));
    }
    let honest_left: u64 = (1..=HONEST_WORKERS)
        .map(|w| index.worker_blocks(worker(w)))
        .sum();
    took.sort_unstable();
    let us = |d: Duration| d.as_secs_f64() * 1e6;
    let mean = took.iter().sum::<Duration>() / took.len() as u32;
    println!(
        "{{\"max_blocks\": {max_blocks}, \"stores\": {}, \"mean_us\": {:.1}, \"p99_us\": {:.1}, \"max_us\": {:.1}, \"honest_blocks_left\": {honest_left}, \"honest_blocks\": {}, \"scans_cut\": {}, \"most_over_limit\": {most_over}}}",
        took.len(),
        us(mean),
        us(took[took.len() * 99 / 100]),
        us(took[took.len() - 1]),
        HONEST_WORKERS * HONEST_BLOCKS,
        index.eviction_scans_cut(),
    );
}
