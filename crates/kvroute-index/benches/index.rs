//! Micro-benchmarks of the index's hot paths: hashing, storing, removing and
//! matching. `kvroute-lab bench index` measures them together under a real workload.

use std::hint::black_box;
use std::path::Path;

use criterion::{BatchSize, Criterion, criterion_group, criterion_main};
use kvroute_index::timeline::{TimelineOp, derive_timeline};
use kvroute_index::{
    ApplyOutcome, BlockHasher, EventKind, EventStatus, IndexConfig, KvEvent, KvIndex, StoredBlock,
    WorkerKey, sequence_hashes,
};

const CHAIN: u64 = 16;

fn hashing(c: &mut Criterion) {
    let tokens: Vec<u32> = (0..32 * 16).collect();
    let hasher = BlockHasher::new(16);
    c.bench_function("hash/local_32_blocks_of_16", |b| {
        b.iter(|| hasher.local_hashes(black_box(&tokens)))
    });
    let locals = hasher.local_hashes(&tokens);
    c.bench_function("hash/sequence_32_blocks", |b| {
        b.iter(|| sequence_hashes(black_box(&locals)))
    });
}

fn chain(base: u64) -> EventKind {
    EventKind::Stored {
        parent_hash: None,
        blocks: (0..CHAIN)
            .map(|i| StoredBlock {
                block_hash: base + i,
                tokens_hash: base + i,
            })
            .collect(),
    }
}

fn removal(base: u64) -> EventKind {
    EventKind::Removed {
        block_hashes: (0..CHAIN).rev().map(|i| base + i).collect(),
    }
}

/// Store and remove: each iteration applies one 16-block chain event (or one
/// 16-hash removal) to an index that holds 16 workers' worth of other blocks.
/// Per-iteration batches: a worker's events must be applied in id order, so
/// each setup (the opposite event) has to run right before its routine.
fn store_and_remove(c: &mut Criterion) {
    let index = KvIndex::new(IndexConfig::default());
    let worker = WorkerKey::new(0, 0);
    let mut event_id = 0;
    let mut next = |kind| {
        event_id += 1;
        KvEvent { event_id, kind }
    };
    for w in 1..16 {
        for chain_no in 0..32 {
            let event = KvEvent {
                event_id: chain_no + 1,
                kind: chain(chain_no << 20),
            };
            index.apply(WorkerKey::new(w, 0), &event);
        }
    }
    let mut base = 1 << 40;
    c.bench_function("store/chain_of_16", |b| {
        b.iter_batched(
            || {
                base += CHAIN;
                index.apply(worker, &next(removal(base - CHAIN)));
                next(chain(base))
            },
            |event| assert_applied(index.apply(worker, &event)),
            BatchSize::PerIteration,
        )
    });
    c.bench_function("remove/16_hashes", |b| {
        b.iter_batched(
            || {
                base += CHAIN;
                index.apply(worker, &next(chain(base)));
                next(removal(base))
            },
            |event| assert_applied(index.apply(worker, &event)),
            BatchSize::PerIteration,
        )
    });
}

fn assert_applied(outcome: ApplyOutcome) {
    assert_eq!(outcome.status(), EventStatus::Applied, "{outcome:?}");
}

/// find_matches on the state and lookups of the bundled conversation trace
/// (16 workers × 512-block pools).
fn find_matches(c: &mut Criterion) {
    let trace = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/data/traces/conversation_trace.jsonl");
    let requests = kvroute_trace::read_trace(&trace, Some(4000)).expect("bundled trace");
    let ops = derive_timeline(requests.iter().map(|r| r.hash_ids.as_slice()), 16, 512);
    let index = KvIndex::new(IndexConfig::default());
    let mut lookups = Vec::new();
    for op in &ops {
        match op {
            TimelineOp::Event { worker, event } => {
                index.apply(*worker, event);
            }
            TimelineOp::Match { tokens_hashes } => lookups.push(tokens_hashes.clone()),
        }
    }
    let mut i = 0;
    c.bench_function("find_matches/conversation_trace", |b| {
        b.iter(|| {
            i = (i + 1) % lookups.len();
            index.find_matches(black_box(&lookups[i]))
        })
    });
}

criterion_group!(benches, hashing, store_and_remove, find_matches);
criterion_main!(benches);
