//! A routing decision's lookup on caches nothing warmed: 4,000 workers each
//! holding 256-block chains (1M blocks), and lookups of 512 blocks whose first
//! 256 are one worker's chain, each after reading 64 MB of other memory. Every
//! matched block is then a cache miss unless the walk fetched it ahead; this is
//! what `kvroute-lab bench router` measured as the decision's 70–110 µs at 8k
//! tokens. Prints the store time of the 1M blocks and the lookups' p50/p90/p99.
//!
//! `cargo bench -p kvroute-index --bench cold_walk`

use std::hint::black_box;
use std::time::Instant;

use kvroute_index::{EventKind, KvEvent, KvIndex, Matches, StoredBlock, WorkerKey};

const WORKERS: u64 = 4_000;
const CHAIN: usize = 256;
const LOOKUPS: usize = 3_000;

fn main() {
    let mut state = 0x9E37_79B9_7F4A_7C15u64;
    let mut random = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    let chains: Vec<Vec<u64>> = (0..WORKERS)
        .map(|_| (0..CHAIN).map(|_| random()).collect())
        .collect();
    let index = KvIndex::default();
    let started = Instant::now();
    for (worker, locals) in (0..WORKERS).zip(&chains) {
        let blocks = locals
            .iter()
            .zip(0..)
            .map(|(&tokens_hash, i)| StoredBlock {
                block_hash: (worker << 24) | i,
                tokens_hash,
            })
            .collect();
        let kind = EventKind::Stored {
            parent_hash: None,
            blocks,
        };
        index.apply(WorkerKey::new(worker, 0), &KvEvent { event_id: 1, kind });
    }
    let store = started.elapsed();
    let other: Vec<u64> = (0..8 << 20).collect();
    let mut matches = Matches::default();
    let mut times = Vec::with_capacity(LOOKUPS);
    for _ in 0..LOOKUPS {
        let mut path = chains[(random() % WORKERS) as usize].clone();
        path.extend((0..CHAIN).map(|_| random()));
        black_box(other.iter().step_by(8).sum::<u64>());
        let t = Instant::now();
        index.find_matches_into(&path, &mut matches);
        let deepest = matches.deepest().and_then(|m| index.resolve(&matches, m));
        times.push(t.elapsed().as_nanos() as u64);
        assert_eq!(deepest.map(|m| m.depth), Some(CHAIN as u32));
    }
    times.sort_unstable();
    let us = |q: f64| times[((times.len() - 1) as f64 * q) as usize] as f64 / 1000.0;
    println!(
        "{} blocks stored in {:.2} s ({} heap MB); cold lookups of {} blocks, {} matched: p50 {:.1} us, p90 {:.1} us, p99 {:.1} us",
        WORKERS as usize * CHAIN,
        store.as_secs_f64(),
        index.heap_bytes() >> 20,
        2 * CHAIN,
        CHAIN,
        us(0.5),
        us(0.9),
        us(0.99)
    );
}
