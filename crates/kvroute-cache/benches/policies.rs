//! Throughput of the eviction policies and of the whole policy comparison.
//!
//! `access`: raw block accesses per second, single-threaded, over the
//! conversation trace's block sequence repeated 10 times (target: ≥ 20M/s for
//! LRU, FIFO and S3FIFO). `compare_grid`: the replay of the 6-policy ×
//! 3-capacity × 2-trace comparison (target: well under 5 s).
//!
//! Run: `cargo bench -p kvroute-cache --bench policies`.

use std::hint::black_box;
use std::path::Path;
use std::time::Duration;

use criterion::{BatchSize, Criterion, Throughput, criterion_group, criterion_main};
use kvroute_cache::replay::flatten;
use kvroute_cache::{PolicyKind, S3FifoParams, replay};
use kvroute_trace::{TraceRequest, read_trace};

const CAPACITIES: [usize; 3] = [1024, 4096, 16384];

fn trace(name: &str) -> Vec<TraceRequest> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/data/traces")
        .join(name);
    read_trace(&path, None).expect("the bundled traces parse")
}

fn access(c: &mut Criterion) {
    let once = flatten(&trace("conversation_trace.jsonl"));
    let sequence: Vec<u64> = (0..10).flat_map(|_| once.iter().copied()).collect();
    let mut group = c.benchmark_group("access");
    group.throughput(Throughput::Elements(sequence.len() as u64));
    group.sample_size(10);
    group.measurement_time(Duration::from_secs(3));
    for policy in [
        PolicyKind::Lru,
        PolicyKind::Fifo,
        PolicyKind::S3Fifo,
        PolicyKind::Arc,
        PolicyKind::Lfu,
    ] {
        for capacity in CAPACITIES {
            group.bench_function(format!("{policy}/{capacity}"), |b| {
                b.iter_batched_ref(
                    || {
                        policy
                            .build(capacity, S3FifoParams::default(), &[])
                            .expect("valid capacity")
                    },
                    |cache| {
                        let mut evicted = Vec::with_capacity(4);
                        for &block in &sequence {
                            black_box(cache.access(block, &mut evicted));
                            evicted.clear();
                        }
                    },
                    BatchSize::PerIteration,
                )
            });
        }
    }
    group.finish();
}

fn compare_grid(c: &mut Criterion) {
    let traces = [
        trace("conversation_trace.jsonl"),
        trace("synthetic_trace.jsonl"),
    ];
    let futures: Vec<Vec<u64>> = traces.iter().map(|t| flatten(t)).collect();
    let mut group = c.benchmark_group("compare_grid");
    group.sample_size(10);
    group.bench_function("6 policies x 3 capacities x 2 traces", |b| {
        b.iter(|| {
            for (trace, future) in traces.iter().zip(&futures) {
                for capacity in CAPACITIES {
                    // The five policies and Belady; infinite needs no run per capacity.
                    for policy in PolicyKind::ALL
                        .into_iter()
                        .filter(|&p| p != PolicyKind::Infinite)
                    {
                        let mut cache = policy
                            .build(capacity, S3FifoParams::default(), future)
                            .expect("valid capacity");
                        black_box(replay(cache.as_mut(), trace, 512, || {}));
                    }
                }
            }
        })
    });
    group.finish();
}

criterion_group!(benches, access, compare_grid);
criterion_main!(benches);
