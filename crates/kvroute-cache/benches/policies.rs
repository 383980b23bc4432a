//! Throughput of the eviction policies and of the whole policy comparison.
//!
//! `access`: raw block accesses per second, single-threaded, over the
//! conversation trace's block sequence repeated 10 times (target: ≥ 20M/s for
//! LRU, FIFO and S3FIFO). `compare_grid`: the replay of the 6-policy ×
//! 3-capacity × 2-trace comparison (target: well under 5 s).
//!
//! Run: `cargo bench -p kvroute-cache --bench policies`.
//!
//! Times are the benchmark thread's CPU time, not wall time: the machines this
//! runs on are shared (other builds run alongside), and wall time there mostly
//! measures how long the scheduler kept the core elsewhere.

use std::hint::black_box;
use std::path::Path;
use std::time::Duration;

use criterion::measurement::{Measurement, ValueFormatter, WallTime};
use criterion::{BatchSize, Criterion, Throughput, criterion_group, criterion_main};
use kvroute_cache::{PolicyKind, PreparedTrace, S3FifoParams, replay};
use kvroute_trace::{TraceRequest, read_trace};

const CAPACITIES: [usize; 3] = [1024, 4096, 16384];

/// CPU time consumed by the calling thread.
struct ThreadCpuTime {
    /// Only lends its duration formatter: both measure nanoseconds.
    wall: WallTime,
}

fn thread_cpu_time() -> Duration {
    let mut now = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `now` is a valid, writable timespec for the duration of the call.
    let status = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut now) };
    assert_eq!(status, 0, "CLOCK_THREAD_CPUTIME_ID is supported on Linux");
    Duration::new(now.tv_sec as u64, now.tv_nsec as u32)
}

impl Measurement for ThreadCpuTime {
    type Intermediate = Duration;
    type Value = Duration;

    fn start(&self) -> Duration {
        thread_cpu_time()
    }
    fn end(&self, started: Duration) -> Duration {
        thread_cpu_time().saturating_sub(started)
    }
    fn add(&self, a: &Duration, b: &Duration) -> Duration {
        *a + *b
    }
    fn zero(&self) -> Duration {
        Duration::ZERO
    }
    fn to_f64(&self, value: &Duration) -> f64 {
        value.as_nanos() as f64
    }
    fn formatter(&self) -> &dyn ValueFormatter {
        self.wall.formatter()
    }
}

fn trace(name: &str) -> Vec<TraceRequest> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/data/traces")
        .join(name);
    read_trace(&path, None).expect("the bundled traces parse")
}

fn access(c: &mut Criterion<ThreadCpuTime>) {
    // The trace's own block ids, as a worker would see them.
    let once = trace("conversation_trace.jsonl");
    let sequence: Vec<u64> = (0..10)
        .flat_map(|_| once.iter().flat_map(|r| r.hash_ids.iter().copied()))
        .collect();
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

fn compare_grid(c: &mut Criterion<ThreadCpuTime>) {
    let traces = [
        PreparedTrace::new(&trace("conversation_trace.jsonl")),
        PreparedTrace::new(&trace("synthetic_trace.jsonl")),
    ];
    let mut group = c.benchmark_group("compare_grid");
    group.sample_size(10);
    group.bench_function("6 policies x 3 capacities x 2 traces", |b| {
        b.iter(|| {
            for trace in &traces {
                for capacity in CAPACITIES {
                    // The five policies and Belady; infinite needs no run per capacity.
                    for policy in PolicyKind::ALL
                        .into_iter()
                        .filter(|&p| p != PolicyKind::Infinite)
                    {
                        let mut cache = policy
                            .build(capacity, S3FifoParams::default(), trace.accesses())
                            .expect("valid capacity");
                        black_box(replay(cache.as_mut(), trace, 512, || {}));
                    }
                }
            }
        })
    });
    group.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default().with_measurement(ThreadCpuTime { wall: WallTime });
    targets = access, compare_grid
}
criterion_main!(benches);
