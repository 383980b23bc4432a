//! dynamo-compare: kvroute's index against NVIDIA Dynamo's production index
//! (`dynamo-kv-router`, `ThreadPoolIndexer<ConcurrentRadixTreeCompressed>` with
//! two event threads) on the same timelines, in alternating runs, with the
//! ratios printed. A dashmap-backed variant of kvroute's table runs beside them,
//! and kvroute's index bounded as the router runs it (`kvroute-bounded`).
//!
//! Timelines come from kvroute-index's own [`kvroute_index::timeline`] (a fleet
//! of LRU block pools fed by a Mooncake trace), so this harness and
//! `kvroute-lab bench index` replay the same workload. Every index gets the same
//! threads: two replay threads, each applying the events of half the workers
//! and every other lookup, in timeline order (kvroute's events a run of one
//! worker's at a time, as its router applies a message), each prefetching its
//! next operations' input, which a router has in its cache. Dynamo's events are applied by its
//! own two event threads (the replay threads enqueue them, as its router does)
//! and a run ends when its queues are flushed; its lookups run inline on the
//! replay threads, as in Dynamo. Throughput (ops/s, and ops per CPU-second of
//! the whole process) comes from these runs.
//!
//! Lookup latency comes from a separate, settled pass: in such a concurrent run
//! Dynamo's lookups meet whatever its queues have applied so far (a smaller
//! tree while they lag), so the pass applies the timeline on one thread and,
//! before each timed lookup, waits until every earlier event is applied. Both
//! indexes then answer each lookup on the same state.
//!
//! Run from this directory (it is outside the workspace, with its own lock):
//! `cargo run --release -- [--quick] [--rounds N] [--trace FILE] [--timeline NAME]`.

mod alloc;
mod dash;

use std::path::PathBuf;
use std::sync::Barrier;
use std::time::{Duration, Instant};

use dynamo_kv_router::protocols::{
    ExternalSequenceBlockHash, KvCacheEvent, KvCacheEventData, KvCacheRemoveData, KvCacheStoreData,
    KvCacheStoredBlockData, LocalBlockHash, RouterEvent,
};
use dynamo_kv_router::{ConcurrentRadixTreeCompressed, SyncIndexer, ThreadPoolIndexer};
use hdrhistogram::Histogram;
use kvroute_index::timeline::{TimelineOp, derive_timeline};
use kvroute_index::{EventKind, IndexConfig, KvEvent, KvIndex, Matches, WorkerKey};

/// Whether each replay prints its threads' usage (`--threads`).
static THREAD_DETAIL: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

#[global_allocator]
static ALLOC: alloc::Counting = alloc::Counting;

/// Replay threads (unless `--replay-threads`), and Dynamo's event threads.
const THREADS: usize = 2;
/// Tokens per block of the Mooncake traces (Dynamo wants a block size).
const BLOCK_SIZE: u32 = 512;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Indexer {
    Kvroute,
    Dynamo,
    Dashmap,
    /// kvroute's index with the router's default `index.max_blocks`, as
    /// operators run it: its LRU order is kept on every store and removal.
    KvrouteBounded,
}

/// The router's default `index.max_blocks` (crates/kvroute-router's config).
const ROUTER_MAX_BLOCKS: usize = 32 << 20;

impl Indexer {
    const ALL: [Indexer; 4] = [
        Indexer::Kvroute,
        Indexer::Dynamo,
        Indexer::Dashmap,
        Indexer::KvrouteBounded,
    ];

    fn name(self) -> &'static str {
        match self {
            Indexer::Kvroute => "kvroute",
            Indexer::Dynamo => "dynamo",
            Indexer::Dashmap => "dashmap",
            Indexer::KvrouteBounded => "kvroute-bounded",
        }
    }

    /// Whether it is kvroute's own index (bounded or not).
    fn is_kvroute(self) -> bool {
        matches!(self, Indexer::Kvroute | Indexer::KvrouteBounded)
    }
}

struct Args {
    trace: PathBuf,
    rounds: usize,
    /// Requests of the trace used (all unless quick).
    requests: Option<usize>,
    only: Option<String>,
    /// The indexes run (all four unless `--index`, for profiling one or
    /// comparing two).
    indexers: Vec<Indexer>,
    /// Print each replay thread's user and system CPU, page faults and
    /// context switches (`--threads`): where a replay's CPU went.
    threads: bool,
    /// Replay threads (`--replay-threads`, for diagnosis: one thread shows
    /// what two cost each other); the reported runs use [`THREADS`].
    replay_threads: usize,
}

/// `text` as a count of at least one, else an error naming `flag`.
fn positive(flag: &str, text: String) -> Result<usize, String> {
    text.parse()
        .ok()
        .filter(|&n| n > 0)
        .ok_or(format!("{flag} must be a positive integer"))
}

fn parse_args() -> Result<Args, String> {
    let mut args = Args {
        trace: PathBuf::from(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../tests/data/traces/conversation_trace.jsonl"
        )),
        rounds: 3,
        requests: None,
        only: None,
        indexers: Indexer::ALL.to_vec(),
        threads: false,
        replay_threads: THREADS,
    };
    let mut it = std::env::args().skip(1);
    while let Some(arg) = it.next() {
        let mut value = |name: &str| it.next().ok_or(format!("{name} needs a value"));
        match arg.as_str() {
            "--quick" => {
                args.rounds = 1;
                args.requests = Some(2_000);
            }
            "--rounds" => args.rounds = positive("--rounds", value("--rounds")?)?,
            "--threads" => args.threads = true,
            "--replay-threads" => {
                args.replay_threads = positive("--replay-threads", value("--replay-threads")?)?;
            }
            "--trace" => args.trace = PathBuf::from(value("--trace")?),
            "--timeline" => args.only = Some(value("--timeline")?),
            "--index" => {
                args.indexers = value("--index")?
                    .split(',')
                    .map(|name| Indexer::ALL.into_iter().find(|i| i.name() == name))
                    .collect::<Option<_>>()
                    .ok_or("--index takes kvroute, dynamo, dashmap or kvroute-bounded, or several joined by commas")?;
            }
            other => {
                return Err(format!(
                    "unknown argument {other}; usage: [--quick] [--rounds N] [--trace FILE] [--timeline 16|1024|7000] [--index kvroute|dynamo|dashmap|kvroute-bounded[,...]] [--threads] [--replay-threads N]"
                ));
            }
        }
    }
    Ok(args)
}

/// Bytes freed that glibc's allocator keeps for reuse instead of giving back to
/// the system, and the size from which it maps a block of its own: fixed
/// (glibc's maximum for the latter), so that every index's replays reuse the
/// memory of the rounds before them alike. glibc moves both thresholds as
/// blocks are freed, so whether a replay faulted in its memory afresh depended
/// on what the harness had freed before it: owning each thread's input made
/// every kvroute replay at 7,000 workers fault in ~1,600 pages a thread, not
/// only the first (docs/measurements/index-vs-dynamo.md, "Layout choices":
/// "Fifth pass at 16 workers").
const MALLOC_KEEPS: libc::c_int = 32 << 20;

fn main() {
    // SAFETY: mallopt only sets the allocator's parameters; nothing has been
    // allocated on another thread yet.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, MALLOC_KEEPS);
        libc::mallopt(libc::M_TRIM_THRESHOLD, MALLOC_KEEPS);
    }
    let args = match parse_args() {
        Ok(args) => args,
        Err(e) => {
            eprintln!("dynamo-compare: {e}");
            std::process::exit(2);
        }
    };
    let trace = match kvroute_trace::read_trace(&args.trace, args.requests) {
        Ok(trace) => trace,
        Err(e) => {
            eprintln!("dynamo-compare: {e}");
            std::process::exit(1);
        }
    };
    let requests: Vec<Vec<u64>> = trace.into_iter().map(|r| r.hash_ids).collect();
    println!(
        "trace {} ({} requests), {} rounds, {} replay threads, Dynamo with {THREADS} event threads",
        args.trace.display(),
        requests.len(),
        args.rounds,
        args.replay_threads
    );
    let runtime = tokio::runtime::Builder::new_current_thread()
        .build()
        .expect("a current-thread runtime");
    for workers in [16usize, 1_024, 7_000] {
        if args
            .only
            .as_ref()
            .is_some_and(|o| *o != workers.to_string())
        {
            continue;
        }
        THREAD_DETAIL.store(args.threads, std::sync::atomic::Ordering::Relaxed);
        compare(&runtime, &requests, workers, &args);
    }
}

/// One timeline: replays (alternating the indexers' order each round), memory,
/// and the ratios.
fn compare(runtime: &tokio::runtime::Runtime, requests: &[Vec<u64>], workers: usize, args: &Args) {
    let (rounds, indexers) = (args.rounds, &args.indexers[..]);
    let ops = derive_timeline(requests.iter().map(Vec::as_slice), workers, 512);
    let shape = Shape::of(&ops);
    println!(
        "\n== {workers} workers x 512-block pools: {} ops ({} lookups, {} events, {:.0}% removes)",
        shape.ops(),
        shape.lookups,
        shape.events,
        100.0 * shape.removes as f64 / shape.ops() as f64
    );
    let mut results: Vec<Totals> = indexers.iter().map(|_| Totals::new()).collect();
    for round in 0..rounds {
        let mut order = indexers.to_vec();
        order.rotate_left(round % indexers.len());
        for indexer in order {
            let i = indexers.iter().position(|&x| x == indexer).unwrap();
            let run = replay(runtime, indexer, &ops, args.replay_threads);
            results[i].add(run, shape.ops());
            let settled = settled_lookups(runtime, indexer, &ops, &mut results[i].preempted);
            results[i]
                .lookups
                .add(settled)
                .expect("histograms share bounds");
        }
    }
    // Memory: the same fleet with unbounded pools (nothing evicted), and the
    // shared case: every worker holds every block of the trace.
    let unbounded = derive_timeline(requests.iter().map(Vec::as_slice), workers, usize::MAX);
    let mut memory: Vec<(&str, Vec<f64>)> = vec![("unbounded pools", Vec::new())];
    let shared = (workers == 16).then(|| replicated(requests, workers));
    if shared.is_some() {
        memory.push(("every block on every worker", Vec::new()));
    }
    for &indexer in indexers {
        memory[0]
            .1
            .push(bytes_per_membership(runtime, indexer, &unbounded));
        if let Some(shared) = &shared {
            memory[1]
                .1
                .push(bytes_per_membership(runtime, indexer, shared));
        }
    }

    println!(
        "{:<15} {:>12} {:>14} {:>9} {:>9} {:>9}",
        "index", "ops/s", "ops/CPU-s", "p50 us", "p99 us", "p999 us"
    );
    for (indexer, t) in indexers.iter().zip(&results) {
        println!(
            "{:<15} {:>12.0} {:>14.0} {:>9.2} {:>9.2} {:>9.2}   ({} of {} lookups preempted, left out)",
            indexer.name(),
            t.ops_per_s(),
            t.ops_per_cpu_s(),
            t.us(0.5),
            t.us(0.99),
            t.us(0.999),
            t.preempted,
            t.preempted + t.lookups.len(),
        );
    }
    for (name, per) in &memory {
        println!(
            "heap B per membership, {name}: {}",
            indexers
                .iter()
                .zip(per)
                .map(|(i, b)| format!("{} {b:.1}", i.name()))
                .collect::<Vec<_>>()
                .join(", ")
        );
    }
    // Where each index's results and memory are, if it ran.
    let at = |indexer| indexers.iter().position(|&x| x == indexer);
    if let Some(d) = at(Indexer::Dynamo) {
        for kvroute in [Indexer::Kvroute, Indexer::KvrouteBounded] {
            let Some(k) = at(kvroute) else {
                continue;
            };
            let (kr, dr) = (&results[k], &results[d]);
            println!(
                "ratios {}/dynamo: ops/s {:.2}x, ops/CPU-s {:.2}x, p50 {:.2}, p99 {:.2}, p999 {:.2}, memory {} (lower is better except ops)",
                kvroute.name(),
                kr.ops_per_s() / dr.ops_per_s(),
                kr.ops_per_cpu_s() / dr.ops_per_cpu_s(),
                kr.us(0.5) / dr.us(0.5),
                kr.us(0.99) / dr.us(0.99),
                kr.us(0.999) / dr.us(0.999),
                memory
                    .iter()
                    .map(|(name, per)| format!("{:.2} ({name})", per[k] / per[d]))
                    .collect::<Vec<_>>()
                    .join(", ")
            );
        }
    }
    if let (Some(k), Some(m)) = (at(Indexer::Kvroute), at(Indexer::Dashmap)) {
        let (kr, mr) = (&results[k], &results[m]);
        println!(
            "ratios dashmap/kvroute: ops/s {:.2}x, ops/CPU-s {:.2}x, p99 {:.2}, memory {:.2}",
            mr.ops_per_s() / kr.ops_per_s(),
            mr.ops_per_cpu_s() / kr.ops_per_cpu_s(),
            mr.us(0.99) / kr.us(0.99),
            memory[0].1[m] / memory[0].1[k]
        );
    }
}

/// Every request of the trace stored on every one of `workers` workers, so
/// each block has `workers` holders.
fn replicated(requests: &[Vec<u64>], workers: usize) -> Vec<TimelineOp> {
    let one = derive_timeline(requests.iter().map(Vec::as_slice), 1, usize::MAX);
    let mut ops = Vec::new();
    for op in &one {
        if let TimelineOp::Event { event, .. } = op {
            for w in 0..workers as u64 {
                ops.push(TimelineOp::Event {
                    worker: WorkerKey::new(w, 0),
                    event: event.clone(),
                });
            }
        }
    }
    ops
}

struct Shape {
    lookups: u64,
    events: u64,
    removes: u64,
}

impl Shape {
    fn of(ops: &[TimelineOp]) -> Shape {
        let mut shape = Shape {
            lookups: 0,
            events: 0,
            removes: 0,
        };
        for op in ops {
            match op {
                TimelineOp::Match { .. } => shape.lookups += 1,
                TimelineOp::Event { event, .. } => {
                    shape.events += 1;
                    shape.removes += matches!(event.kind, EventKind::Removed { .. }) as u64;
                }
            }
        }
        shape
    }

    fn ops(&self) -> u64 {
        self.lookups + self.events
    }
}

struct Run {
    wall: Duration,
    cpu: Duration,
}

struct Totals {
    ops_per_s: Vec<f64>,
    ops_per_cpu_s: Vec<f64>,
    lookups: Histogram<u64>,
    /// Lookups left out of `lookups`: the thread was descheduled meanwhile.
    preempted: u64,
}

impl Totals {
    fn new() -> Self {
        Totals {
            ops_per_s: Vec::new(),
            ops_per_cpu_s: Vec::new(),
            lookups: histogram(),
            preempted: 0,
        }
    }

    fn add(&mut self, run: Run, ops: u64) {
        self.ops_per_s.push(ops as f64 / run.wall.as_secs_f64());
        self.ops_per_cpu_s
            .push(ops as f64 / run.cpu.as_secs_f64().max(1e-3));
    }

    fn ops_per_s(&self) -> f64 {
        median(&self.ops_per_s)
    }

    fn ops_per_cpu_s(&self) -> f64 {
        median(&self.ops_per_cpu_s)
    }

    fn us(&self, q: f64) -> f64 {
        self.lookups.value_at_quantile(q) as f64 / 1000.0
    }
}

fn median(xs: &[f64]) -> f64 {
    let mut xs = xs.to_vec();
    xs.sort_by(f64::total_cmp);
    xs[xs.len() / 2]
}

/// Nanoseconds from 1 ns to 10 s at 3 significant figures.
fn histogram() -> Histogram<u64> {
    Histogram::new_with_bounds(1, 10_000_000_000, 3).expect("valid bounds")
}

/// CPU time of the whole process so far, every thread's (Dynamo's event
/// threads included).
fn process_cpu() -> Duration {
    cpu_clock(libc::CLOCK_PROCESS_CPUTIME_ID)
}

/// CPU time so far of `clock`, a CPU-time clock.
fn cpu_clock(clock: libc::clockid_t) -> Duration {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes one timespec, which `ts` is.
    unsafe { libc::clock_gettime(clock, &mut ts) };
    Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
}

/// One operation in an indexer's own types, converted before the clock starts,
/// each replay thread's in its order and owned by it (allocated one thread's
/// after the other's), for every index alike. Run in place (`&mut`), so that a
/// replay neither copies each operation out of its vector nor frees the vector
/// inside the timed span: both were charged to the index (at 16 workers, about
/// a tenth of kvroute's replay CPU). kvroute's events were references into the
/// timeline, two threads' and the lookups' interleaved and one indirection
/// deeper than Dynamo's converted events (docs/measurements/index-vs-dynamo.md,
/// "Layout choices": "Fifth pass at 16 workers").
enum Op {
    Event(WorkerKey, KvEvent),
    /// A run of one worker's events with no lookup between them, as the
    /// worker publishes them in one message (the events of one engine step:
    /// a routed request's stored chain and the evictions it caused) and
    /// kvroute's router applies them ([`KvIndex::with_worker`]).
    Events(WorkerKey, Vec<KvEvent>),
    /// Taken when run: Dynamo's queue owns its events.
    Dynamo(Option<RouterEvent>),
    Match(Vec<u64>),
    DynamoMatch(Vec<LocalBlockHash>),
}

/// How many operations ahead of the one running each [`Op::prefetch`] level
/// is fetched.
const PREFETCH_LEVELS: [(usize, u8); 2] = [(2, 0), (1, 1)];
/// How many operations ahead of the one running the operation itself (its
/// place in the thread's vector) is fetched, before its levels.
const OPS_AHEAD: usize = 4;

impl Op {
    /// Operations of the timeline this one stands for.
    fn ops(&self) -> usize {
        match self {
            Op::Events(_, events) => events.len(),
            _ => 1,
        }
    }

    /// Starts bringing the operation's input into the cache, one level of
    /// indirection at a time: `level` 0 a run's events, 1 the block hashes (or a
    /// lookup's hashes). A router applies an event it has just decoded from its
    /// stream, and hashes a request it has just read, so its input is in the
    /// cache; the timeline's, made long before the clock started (tens of MB),
    /// is not. Reading it cold was a tenth of kvroute's replay at 16 workers
    /// (docs/measurements/index-vs-dynamo.md, "Layout choices": "Ingest under
    /// churn"). Each replay thread fetches the input of the next two operations
    /// while it runs one, for every index alike.
    fn prefetch(&self, level: u8) {
        match (self, level) {
            (Op::Events(_, events), 0) => prefetch_slice(events),
            (Op::Event(_, event), 1) => prefetch_event(event),
            (Op::Events(_, events), 1) => events.iter().for_each(prefetch_event),
            (Op::Dynamo(Some(event)), 1) => match &event.event.data {
                KvCacheEventData::Stored(stored) => prefetch_slice(&stored.blocks),
                KvCacheEventData::Removed(removed) => prefetch_slice(&removed.block_hashes),
                _ => {}
            },
            (Op::Match(hashes), 1) => prefetch_slice(hashes),
            (Op::DynamoMatch(hashes), 1) => prefetch_slice(hashes),
            _ => {}
        }
    }
}

fn prefetch_event(event: &KvEvent) {
    match &event.kind {
        EventKind::Stored { blocks, .. } => prefetch_slice(blocks),
        EventKind::Removed { block_hashes } => prefetch_slice(block_hashes),
        EventKind::Cleared => {}
    }
}

/// Prefetches the cache lines of `items`.
fn prefetch_slice<T>(items: &[T]) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_MM_HINT_T0, _mm_prefetch};
        let start: *const i8 = items.as_ptr().cast();
        for offset in (0..size_of_val(items)).step_by(64) {
            // SAFETY: SSE is part of x86_64's baseline; a prefetch reads
            // nothing architecturally and cannot fault, and the address is
            // inside `items`.
            unsafe { _mm_prefetch::<_MM_HINT_T0>(start.wrapping_add(offset)) };
        }
    }
}

fn to_dynamo(worker: WorkerKey, event: &KvEvent) -> RouterEvent {
    let data = match &event.kind {
        EventKind::Stored {
            parent_hash,
            blocks,
        } => KvCacheEventData::Stored(KvCacheStoreData {
            parent_hash: parent_hash.map(ExternalSequenceBlockHash),
            start_position: None,
            blocks: blocks
                .iter()
                .map(|b| KvCacheStoredBlockData {
                    block_hash: ExternalSequenceBlockHash(b.block_hash),
                    tokens_hash: LocalBlockHash(b.tokens_hash),
                    mm_extra_info: None,
                })
                .collect(),
        }),
        EventKind::Removed { block_hashes } => KvCacheEventData::Removed(KvCacheRemoveData {
            block_hashes: block_hashes
                .iter()
                .copied()
                .map(ExternalSequenceBlockHash)
                .collect(),
        }),
        EventKind::Cleared => KvCacheEventData::Cleared,
    };
    RouterEvent::new(
        worker.worker_id,
        KvCacheEvent {
            event_id: event.event_id,
            data,
            dp_rank: worker.dp_rank,
        },
    )
}

/// `op` in `indexer`'s own types.
fn convert(indexer: Indexer, op: &TimelineOp) -> Op {
    match (op, indexer) {
        (TimelineOp::Event { worker, event }, Indexer::Dynamo) => {
            Op::Dynamo(Some(to_dynamo(*worker, event)))
        }
        (TimelineOp::Event { worker, event }, _) => Op::Event(*worker, event.clone()),
        (TimelineOp::Match { tokens_hashes }, Indexer::Dynamo) => {
            Op::DynamoMatch(tokens_hashes.iter().copied().map(LocalBlockHash).collect())
        }
        (TimelineOp::Match { tokens_hashes }, _) => Op::Match(tokens_hashes.clone()),
    }
}

/// The whole timeline in `indexer`'s own types, in order.
fn converted(indexer: Indexer, ops: &[TimelineOp]) -> Vec<Op> {
    ops.iter().map(|op| convert(indexer, op)).collect()
}

/// An operation of one replay thread before conversion: kvroute's runs of one
/// worker's events (see [`Op::Events`]) or one operation.
enum Planned<'a> {
    Run(WorkerKey, Vec<&'a KvEvent>),
    One(&'a TimelineOp),
}

/// The timeline split over `threads` replay threads: each thread gets the
/// events of its share of the workers and every `threads`-th lookup, in
/// timeline order, converted one thread after the other.
fn shares(indexer: Indexer, ops: &[TimelineOp], threads: usize) -> Vec<Vec<Op>> {
    let mut plans: Vec<Vec<Planned>> = (0..threads).map(|_| Vec::new()).collect();
    let mut lookups = 0;
    // kvroute's events go in runs: the worker of the run the last operation
    // began or extended.
    let mut run = None;
    for op in ops {
        let thread = match op {
            TimelineOp::Event { worker, event } => {
                let thread = worker.worker_id as usize % threads;
                if indexer.is_kvroute() {
                    if run == Some(*worker)
                        && let Some(Planned::Run(_, events)) = plans[thread].last_mut()
                    {
                        events.push(event);
                    } else {
                        plans[thread].push(Planned::Run(*worker, vec![event]));
                    }
                    run = Some(*worker);
                    continue;
                }
                thread
            }
            TimelineOp::Match { .. } => {
                run = None;
                lookups += 1;
                lookups % threads
            }
        };
        plans[thread].push(Planned::One(op));
    }
    plans
        .into_iter()
        .map(|plan| {
            plan.into_iter()
                .map(|planned| match planned {
                    Planned::Run(worker, events) => {
                        Op::Events(worker, events.into_iter().cloned().collect())
                    }
                    Planned::One(op) => convert(indexer, op),
                })
                .collect()
        })
        .collect()
}

thread_local! {
    /// Each replay thread's buffer for kvroute's lookups, kept across lookups
    /// as a router keeps one per routing thread (`KvIndex::find_matches_into`).
    static MATCHES: std::cell::RefCell<Matches> = std::cell::RefCell::new(Matches::default());
}

enum Live {
    Kvroute(Box<KvIndex>),
    Dynamo(ThreadPoolIndexer<ConcurrentRadixTreeCompressed>),
    Dashmap(dash::DashIndex),
}

impl Live {
    fn new(indexer: Indexer) -> Live {
        match indexer {
            Indexer::Kvroute => Live::Kvroute(Box::new(KvIndex::new(IndexConfig::default()))),
            Indexer::KvrouteBounded => Live::Kvroute(Box::new(KvIndex::new(IndexConfig {
                max_blocks: Some(ROUTER_MAX_BLOCKS),
            }))),
            Indexer::Dynamo => Live::Dynamo(ThreadPoolIndexer::new(
                ConcurrentRadixTreeCompressed::new(),
                THREADS,
                BLOCK_SIZE,
            )),
            Indexer::Dashmap => Live::Dashmap(dash::DashIndex::default()),
        }
    }

    fn run(&self, op: &mut Op) {
        match (self, op) {
            (Live::Kvroute(index), Op::Event(worker, event)) => {
                std::hint::black_box(index.apply(*worker, event));
            }
            (Live::Kvroute(index), Op::Events(worker, events)) => {
                index.with_worker(*worker, |worker| {
                    for event in events {
                        std::hint::black_box(worker.apply(event));
                    }
                });
            }
            // Every matching worker as an (index, depth) pair, and the key of
            // the deepest resolved: what a decision needs named.
            (Live::Kvroute(index), Op::Match(hashes)) => MATCHES.with_borrow_mut(|matches| {
                index.find_matches_into(hashes, matches);
                let best = matches.deepest().and_then(|m| index.resolve(matches, m));
                std::hint::black_box((matches.pairs(), best));
            }),
            (Live::Dashmap(index), Op::Event(worker, event)) => index.apply(*worker, event),
            (Live::Dashmap(index), Op::Match(hashes)) => {
                std::hint::black_box(index.find_matches(hashes));
            }
            (Live::Dynamo(index), Op::Dynamo(event)) => {
                let event = event.take().expect("each operation runs once");
                index
                    .enqueue_event(event)
                    .expect("Dynamo's event threads are running");
            }
            (Live::Dynamo(index), Op::DynamoMatch(hashes)) => {
                std::hint::black_box(index.backend().find_matches(hashes, false));
            }
            _ => unreachable!("ops are converted for their indexer"),
        }
    }

    /// Waits until every event enqueued so far is applied.
    fn settle(&self, runtime: &tokio::runtime::Runtime) {
        if let Live::Dynamo(index) = self {
            runtime
                .block_on(index.flush_and_wait())
                .expect("Dynamo's event threads are running");
        }
    }
}

/// One replay of `ops` on a fresh index.
fn replay(
    runtime: &tokio::runtime::Runtime,
    indexer: Indexer,
    ops: &[TimelineOp],
    threads: usize,
) -> Run {
    let shares = shares(indexer, ops, threads);
    let live = Live::new(indexer);
    let start = Barrier::new(threads + 1);
    let mut run = Run {
        wall: Duration::ZERO,
        cpu: Duration::ZERO,
    };
    std::thread::scope(|scope| {
        let handles: Vec<_> = shares
            .into_iter()
            .map(|mut share| {
                let (live, start) = (&live, &start);
                // Named, so that a profile can select the replay (`perf
                // report --comm replay`).
                let thread = std::thread::Builder::new().name("replay".into());
                let spawned = thread.spawn_scoped(scope, move || {
                    start.wait();
                    let before = thread_usage();
                    for i in 0..share.len() {
                        // The operation itself, before its levels.
                        if let Some(op) = share.get(i + OPS_AHEAD) {
                            prefetch_slice(std::slice::from_ref(op));
                        }
                        for (ahead, level) in PREFETCH_LEVELS {
                            if let Some(op) = share.get(i + ahead) {
                                op.prefetch(level);
                            }
                        }
                        live.run(&mut share[i]);
                    }
                    let usage = thread_usage().since(&before);
                    // Freed by the caller, after the clock stops.
                    (share, usage)
                });
                spawned.expect("a replay thread starts")
            })
            .collect();
        let cpu = process_cpu();
        start.wait();
        let t = Instant::now();
        let done: Vec<_> = handles.into_iter().map(|h| h.join().unwrap()).collect();
        live.settle(runtime);
        run.wall = t.elapsed();
        run.cpu = process_cpu().saturating_sub(cpu);
        if THREAD_DETAIL.load(std::sync::atomic::Ordering::Relaxed) {
            println!(
                "  {} replay: process CPU {:.1} ms",
                indexer.name(),
                run.cpu.as_secs_f64() * 1e3
            );
            for (thread, (share, usage)) in done.iter().enumerate() {
                let ops: usize = share.iter().map(Op::ops).sum();
                println!(
                    "  {} replay thread {thread}: {ops} ops, {usage}",
                    indexer.name()
                );
            }
            // What the pools' churn left: tables laid out for churn, not growth.
            if let Live::Kvroute(index) = &live {
                let memberships = index.stats().memberships.max(1);
                println!(
                    "  kvroute heap at the end of the replay: {:.1} B per membership ({memberships} memberships)",
                    index.heap_bytes() as f64 / memberships as f64
                );
            }
        }
    });
    drop(live);
    run
}

/// find_matches latencies (ns) of one settled pass: the timeline applied on
/// one thread, every earlier event applied before each timed lookup.
fn settled_lookups(
    runtime: &tokio::runtime::Runtime,
    indexer: Indexer,
    ops: &[TimelineOp],
    preempted: &mut u64,
) -> Histogram<u64> {
    let live = Live::new(indexer);
    let mut hist = histogram();
    let mut unsettled = false;
    for mut op in converted(indexer, ops) {
        if matches!(op, Op::Match(_) | Op::DynamoMatch(_)) {
            if std::mem::take(&mut unsettled) {
                live.settle(runtime);
            }
            let switches = involuntary_switches();
            let t = Instant::now();
            live.run(&mut op);
            let elapsed = t.elapsed();
            // A lookup during which the scheduler took the CPU away measures
            // the machine's other load, not the index: left out, and counted.
            if involuntary_switches() == switches {
                hist.saturating_record(elapsed.as_nanos() as u64);
            } else {
                *preempted += 1;
            }
        } else {
            live.run(&mut op);
            unsettled = true;
        }
    }
    hist
}

/// One thread's resource usage so far, or between two readings.
struct Usage {
    /// The thread's CPU time (`CLOCK_THREAD_CPUTIME_ID`): exact, where `user`
    /// and `system` are split by the kernel's ticks.
    cpu: Duration,
    user: Duration,
    system: Duration,
    minor_faults: i64,
    voluntary_switches: i64,
    involuntary_switches: i64,
}

impl Usage {
    fn since(&self, earlier: &Usage) -> Usage {
        Usage {
            cpu: self.cpu.saturating_sub(earlier.cpu),
            user: self.user.saturating_sub(earlier.user),
            system: self.system.saturating_sub(earlier.system),
            minor_faults: self.minor_faults - earlier.minor_faults,
            voluntary_switches: self.voluntary_switches - earlier.voluntary_switches,
            involuntary_switches: self.involuntary_switches - earlier.involuntary_switches,
        }
    }
}

impl std::fmt::Display for Usage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "CPU {:.1} ms (user {:.1} ms, system {:.1} ms), {} minor faults, {} voluntary and {} involuntary switches",
            self.cpu.as_secs_f64() * 1e3,
            self.user.as_secs_f64() * 1e3,
            self.system.as_secs_f64() * 1e3,
            self.minor_faults,
            self.voluntary_switches,
            self.involuntary_switches
        )
    }
}

/// The calling thread's usage so far.
fn thread_usage() -> Usage {
    // SAFETY: an all-zero rusage is valid, and getrusage writes one.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    unsafe { libc::getrusage(libc::RUSAGE_THREAD, &mut usage) };
    let time = |t: libc::timeval| Duration::new(t.tv_sec as u64, t.tv_usec as u32 * 1000);
    Usage {
        cpu: cpu_clock(libc::CLOCK_THREAD_CPUTIME_ID),
        user: time(usage.ru_utime),
        system: time(usage.ru_stime),
        minor_faults: usage.ru_minflt,
        voluntary_switches: usage.ru_nvcsw,
        involuntary_switches: usage.ru_nivcsw,
    }
}

/// Times the calling thread was descheduled against its will so far.
fn involuntary_switches() -> i64 {
    thread_usage().involuntary_switches
}

/// Heap bytes an index holds per (worker, block) membership after applying the
/// events of `ops`, counted by the allocator the same way for every index.
fn bytes_per_membership(
    runtime: &tokio::runtime::Runtime,
    indexer: Indexer,
    ops: &[TimelineOp],
) -> f64 {
    let live = Live::new(indexer);
    alloc::start();
    for op in ops {
        if let TimelineOp::Event { .. } = op {
            // Converted inside the counted span, so the events Dynamo frees
            // after applying them were counted when allocated.
            live.run(&mut convert(indexer, op));
        }
    }
    live.settle(runtime);
    let bytes = alloc::stop();
    let memberships = match &live {
        Live::Kvroute(index) => index.stats().memberships,
        _ => {
            let reference = KvIndex::new(IndexConfig::default());
            for op in ops {
                if let TimelineOp::Event { worker, event } = op {
                    reference.apply(*worker, event);
                }
            }
            reference.stats().memberships
        }
    };
    bytes as f64 / memberships.max(1) as f64
}
