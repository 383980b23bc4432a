//! A large dump applied while routing and other workers' ingest go on: how long
//! the apply takes, and how long `find_matches` calls and another worker's
//! events took meanwhile (a stall shows as a maximum close to the apply time).
//! The lookups and the other worker's events each run on their own thread with a
//! 50 µs pause between two, a steady load rather than two threads contending for
//! the locks flat out. A first round without a dump gives the latencies the
//! machine's own load causes.
//!
//! `cargo bench -p kvroute-index --bench dump` (2M blocks); `DUMP_BLOCKS=N` for
//! another size. The index is limited (`max_blocks`), as in the service. Two
//! dumps are applied: to a new worker, then again over the same blocks (a resync).

use std::sync::atomic::{AtomicBool, Ordering};
use std::thread;
use std::time::{Duration, Instant};

use kvroute_index::{EventKind, IndexConfig, KvEvent, KvIndex, StoredBlock, WorkerKey};

/// Blocks per chain, as the bridge's 2M-block test mirrors them.
const CHAIN: u64 = 10_000;
const OTHER_WORKERS: u64 = 16;
const OTHER_CHAINS: u64 = 64;
const OTHER_CHAIN: u64 = 64;
const PAUSE: Duration = Duration::from_micros(50);

fn chain(first_hash: u64, len: u64, parent: Option<u64>) -> EventKind {
    EventKind::Stored {
        parent_hash: parent,
        blocks: (first_hash..first_hash + len)
            .map(|h| StoredBlock {
                block_hash: h,
                tokens_hash: h,
            })
            .collect(),
    }
}

/// Latencies in milliseconds, as JSON.
fn summary(mut took: Vec<Duration>) -> String {
    took.sort_unstable();
    let at = |q: f64| took[((took.len() - 1) as f64 * q) as usize].as_secs_f64() * 1e3;
    format!(
        "{{\"n\":{},\"p50_ms\":{:.3},\"p99_ms\":{:.3},\"p999_ms\":{:.3},\"max_ms\":{:.3}}}",
        took.len(),
        at(0.5),
        at(0.99),
        at(0.999),
        at(1.0)
    )
}

/// Runs lookups and another worker's events while `work` runs; returns how long
/// `work` took and the latencies of both.
fn during(
    index: &KvIndex,
    event_id: &mut u64,
    work: impl FnOnce(),
) -> (Duration, Vec<Duration>, Vec<Duration>) {
    let running = AtomicBool::new(true);
    let router = WorkerKey::new(1, 0);
    let ingest = WorkerKey::new(2, 0);
    let prefix: Vec<u64> = (1 << 40..(1 << 40) + OTHER_CHAIN).collect();
    thread::scope(|s| {
        let lookups = s.spawn(|| {
            let mut took = Vec::new();
            while running.load(Ordering::Relaxed) {
                let started = Instant::now();
                let matches = index.find_matches(&prefix);
                took.push(started.elapsed());
                assert!(matches.iter().any(|m| m.worker == router));
                thread::sleep(PAUSE);
            }
            took
        });
        let events = s.spawn(|| {
            let mut took = Vec::new();
            let base = 1 << 50;
            while running.load(Ordering::Relaxed) {
                *event_id += 1;
                let kind = if *event_id % 2 == 1 {
                    chain(base, 16, None)
                } else {
                    EventKind::Removed {
                        block_hashes: (base..base + 16).rev().collect(),
                    }
                };
                let started = Instant::now();
                index.apply(
                    ingest,
                    &KvEvent {
                        event_id: *event_id,
                        kind,
                    },
                );
                took.push(started.elapsed());
                thread::sleep(PAUSE);
            }
            took
        });
        // Let both threads start first.
        thread::sleep(Duration::from_millis(50));
        let started = Instant::now();
        work();
        let took = started.elapsed();
        running.store(false, Ordering::Relaxed);
        (took, lookups.join().unwrap(), events.join().unwrap())
    })
}

fn main() {
    let blocks: u64 = std::env::var("DUMP_BLOCKS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(2_000_000);
    let index = KvIndex::new(IndexConfig {
        max_blocks: Some(2 * blocks as usize),
    });
    for w in 1..=OTHER_WORKERS {
        for c in 0..OTHER_CHAINS {
            // Chain 0 is the routed prefix, shared by every worker.
            let first = if c == 0 {
                1 << 40
            } else {
                (w << 32) + c * (1 << 20)
            };
            index.apply(
                WorkerKey::new(w, 0),
                &KvEvent {
                    event_id: c + 1,
                    kind: chain(first, OTHER_CHAIN, None),
                },
            );
        }
    }
    let dump: Vec<EventKind> = (0..blocks.div_ceil(CHAIN))
        .map(|c| chain(c * CHAIN + 1, CHAIN.min(blocks - c * CHAIN), None))
        .collect();
    let mut event_id = 0;
    let apply = |event_id| index.replace_worker(WorkerKey::new(99, 0), event_id, &dump);
    let rounds: [(&str, Option<u64>); 3] =
        [("none", None), ("new worker", Some(1)), ("resync", Some(2))];
    for (name, dump_id) in rounds {
        let (took, lookups, events) = during(&index, &mut event_id, || match dump_id {
            Some(id) => _ = apply(id),
            None => thread::sleep(Duration::from_secs(3)),
        });
        println!(
            "{{\"dump\":\"{name}\",\"blocks\":{blocks},\"seconds\":{:.3},\"find_matches\":{},\"other_events\":{}}}",
            took.as_secs_f64(),
            summary(lookups),
            summary(events),
        );
    }
}
