//! Exact prefix-cache replay of a Mooncake trace through a [`BlockCache`].
//!
//! For each request, in file order:
//! 1. before the cache changes, `k` = the number of leading `hash_ids` that are
//!    all resident, stopping at the first that is not;
//! 2. `hit_tokens = min(k × block_size, input_length)`, `prompt_tokens =
//!    input_length`;
//! 3. every block of the request, hit or miss, is then accessed in order,
//!    each described by its depth in the prompt ([`crate::AccessHint`]; every
//!    request is of normal priority).
//!
//! Alongside the token counts it measures what an operator weighs when picking
//! a policy: evictions, how long accesses that evicted took, how many evicted
//! blocks the trace asks for again (each one is prefilled again), and how full
//! the cache stays.

use std::time::Instant;

use hdrhistogram::Histogram;
use kvroute_trace::TraceRequest;
use rustc_hash::FxHashMap;

use crate::{AccessHint, BlockCache, BlockId, Priority};

/// One request's result.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RequestOutcome {
    pub prompt_tokens: u64,
    pub hit_tokens: u64,
}

/// The totals of one replay.
#[derive(Clone, Debug)]
pub struct ReplayReport {
    pub total_requests: usize,
    pub total_prompt_tokens: u64,
    pub total_hit_tokens: u64,
    /// Resident blocks at the end (never ghosts).
    pub final_cache_blocks: usize,
    pub block_accesses: u64,
    /// Accesses that found their block resident (any position in the prompt).
    pub block_hits: u64,
    pub evictions: u64,
    /// Evictions of a block that the trace requests again later.
    pub re_prefilled_evictions: u64,
    /// Mean over requests of resident / capacity after each request; `None`
    /// for the unbounded cache.
    pub mean_utilisation: Option<f64>,
    /// Median and 99th percentile wall time of the accesses that evicted a
    /// block (lookup, victim choice and admission); `None` without evictions.
    pub eviction_latency_p50_ns: Option<u64>,
    pub eviction_latency_p99_ns: Option<u64>,
    pub per_request: Vec<RequestOutcome>,
}

impl ReplayReport {
    /// Hit tokens over prompt tokens; 0 for an empty trace.
    pub fn overall_hit_rate(&self) -> f64 {
        ratio(self.total_hit_tokens, self.total_prompt_tokens)
    }

    /// The fraction of evicted blocks that are requested again later.
    pub fn re_prefill_rate(&self) -> f64 {
        ratio(self.re_prefilled_evictions, self.evictions)
    }
}

fn ratio(part: u64, whole: u64) -> f64 {
    if whole == 0 {
        0.0
    } else {
        part as f64 / whole as f64
    }
}

/// A trace laid out for fast replays, built once and replayed many times.
///
/// Block ids are relabelled densely (0, 1, 2, ... in order of first use).
/// Policies only compare ids for equality, so hits, evictions and sizes are
/// unchanged, and per-block facts become plain array lookups: which evicted
/// blocks are requested again later is one `Vec` read per eviction instead of
/// a probe into a hash map of every block in the trace.
#[derive(Clone, Debug)]
pub struct PreparedTrace {
    /// Every block access, in replay order, as dense ids.
    pub(crate) accesses: Vec<BlockId>,
    /// Per request: `input_length` and the end of its blocks in `accesses`.
    pub(crate) requests: Vec<(u64, usize)>,
    /// Per dense id: the position of its last access.
    pub(crate) last_use: Vec<usize>,
}

impl PreparedTrace {
    pub fn new(trace: &[TraceRequest]) -> Self {
        let mut dense: FxHashMap<BlockId, BlockId> = FxHashMap::default();
        let mut accesses = Vec::with_capacity(trace.iter().map(|r| r.hash_ids.len()).sum());
        let mut last_use = Vec::new();
        let mut requests = Vec::with_capacity(trace.len());
        for request in trace {
            for &block in &request.hash_ids {
                let next_id = dense.len() as BlockId;
                let id = *dense.entry(block).or_insert(next_id);
                if id == next_id {
                    last_use.push(0);
                }
                last_use[id as usize] = accesses.len();
                accesses.push(id);
            }
            requests.push((request.input_length, accesses.len()));
        }
        PreparedTrace {
            accesses,
            requests,
            last_use,
        }
    }

    /// All block accesses in replay order, relabelled: the future that
    /// [`crate::Belady`] must be given for a replay of this trace.
    pub fn accesses(&self) -> &[BlockId] {
        &self.accesses
    }

    pub fn requests(&self) -> usize {
        self.requests.len()
    }
}

/// Replays `trace` through `cache`, calling `after_request` once per request
/// (for progress reporting).
pub fn replay<C: BlockCache + ?Sized>(
    cache: &mut C,
    trace: &PreparedTrace,
    block_size: u64,
    mut after_request: impl FnMut(),
) -> ReplayReport {
    let mut tally = Tally::new(trace, cache.capacity());
    let mut evicted = Vec::new();
    let mut start = 0;
    for &(input_length, end) in &trace.requests {
        let blocks = &trace.accesses[start..end];
        let resident_prefix = resident_prefix(blocks, |block| cache.contains(block));
        for (position, &block) in (start..).zip(blocks) {
            cache.hint(AccessHint {
                depth: (position - start) as u32,
                priority: Priority::Normal,
            });
            let started = Instant::now();
            let access = cache.access(block, &mut evicted);
            tally.evicted(trace, &mut evicted, position, started);
            tally.report.block_hits += u64::from(access == crate::Access::Hit);
        }
        start = end;
        tally.request(input_length, resident_prefix, block_size, cache.len());
        after_request();
    }
    tally.finish(cache.len())
}

/// How many leading blocks of a request are resident before it runs: its
/// prefix hit, whatever order the replay then gives blocks back in.
pub(crate) fn resident_prefix(blocks: &[BlockId], contains: impl Fn(BlockId) -> bool) -> usize {
    blocks.iter().take_while(|&&block| contains(block)).count()
}

/// The running totals of a replay, whatever order it gives blocks back in.
pub(crate) struct Tally {
    pub(crate) report: ReplayReport,
    capacity: Option<f64>,
    latency: Histogram<u64>,
    utilisation_sum: f64,
}

impl Tally {
    pub(crate) fn new(trace: &PreparedTrace, capacity: Option<usize>) -> Self {
        Tally {
            report: ReplayReport {
                total_requests: trace.requests(),
                total_prompt_tokens: 0,
                total_hit_tokens: 0,
                final_cache_blocks: 0,
                block_accesses: trace.accesses.len() as u64,
                block_hits: 0,
                evictions: 0,
                re_prefilled_evictions: 0,
                mean_utilisation: None,
                eviction_latency_p50_ns: None,
                eviction_latency_p99_ns: None,
                per_request: Vec::with_capacity(trace.requests()),
            },
            capacity: capacity.map(|c| c as f64),
            // Bounded explicitly: `saturating_record` never grows an auto-resizing
            // histogram, so one from `new(3)` clamps anything past 2 µs down to 2 ns.
            latency: Histogram::new_with_bounds(1, 3_600_000_000_000, 3)
                .expect("1 ns to 1 h at 3 significant figures is a valid range"),
            utilisation_sum: 0.0,
        }
    }

    /// Counts and drains `victims`, evicted by an operation that began at
    /// `started` while the replay was at access `position`.
    pub(crate) fn evicted(
        &mut self,
        trace: &PreparedTrace,
        victims: &mut Vec<BlockId>,
        position: usize,
        started: Instant,
    ) {
        if victims.is_empty() {
            return;
        }
        self.latency
            .saturating_record(started.elapsed().as_nanos() as u64);
        for victim in victims.drain(..) {
            self.report.evictions += 1;
            // Ids outside the trace can only come from a cache that was
            // filled before the replay; they are not re-requested.
            let last_use = trace.last_use.get(victim as usize);
            if last_use.is_some_and(|&last| last > position) {
                self.report.re_prefilled_evictions += 1;
            }
        }
    }

    /// Records one request whose first `resident_prefix` blocks were cached;
    /// `resident` blocks are cached after it.
    pub(crate) fn request(
        &mut self,
        input_length: u64,
        resident_prefix: usize,
        block_size: u64,
        resident: usize,
    ) {
        let outcome = RequestOutcome {
            prompt_tokens: input_length,
            hit_tokens: (resident_prefix as u64)
                .saturating_mul(block_size)
                .min(input_length),
        };
        self.report.total_prompt_tokens += outcome.prompt_tokens;
        self.report.total_hit_tokens += outcome.hit_tokens;
        self.report.per_request.push(outcome);
        if let Some(capacity) = self.capacity {
            self.utilisation_sum += resident as f64 / capacity;
        }
    }

    pub(crate) fn finish(mut self, resident: usize) -> ReplayReport {
        let report = &mut self.report;
        report.final_cache_blocks = resident;
        if self.capacity.is_some() && report.total_requests > 0 {
            report.mean_utilisation = Some(self.utilisation_sum / report.total_requests as f64);
        }
        if !self.latency.is_empty() {
            report.eviction_latency_p50_ns = Some(self.latency.value_at_quantile(0.5));
            report.eviction_latency_p99_ns = Some(self.latency.value_at_quantile(0.99));
        }
        self.report
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Access, Lru};

    /// LRU that takes at least 5 µs over every access.
    struct Slow(Lru);

    impl BlockCache for Slow {
        fn access(&mut self, block: BlockId, evicted: &mut Vec<BlockId>) -> Access {
            std::thread::sleep(std::time::Duration::from_micros(5));
            self.0.access(block, evicted)
        }
        fn contains(&self, block: BlockId) -> bool {
            self.0.contains(block)
        }
        fn remove(&mut self, block: BlockId) -> bool {
            self.0.remove(block)
        }
        fn evict_one(&mut self) -> Option<BlockId> {
            self.0.evict_one()
        }
        fn len(&self) -> usize {
            self.0.len()
        }
        fn capacity(&self) -> Option<usize> {
            self.0.capacity()
        }
    }

    #[test]
    fn eviction_latencies_past_two_microseconds_are_not_clamped() {
        let trace: Vec<TraceRequest> = (0..20)
            .map(|i| TraceRequest {
                timestamp_ms: 0,
                input_length: 8,
                output_length: 1,
                hash_ids: vec![i, i + 100],
            })
            .collect();
        let mut cache = Slow(Lru::new(4).unwrap());
        let report = replay(&mut cache, &PreparedTrace::new(&trace), 4, || {});
        assert!(report.evictions > 0);
        assert!(
            report.eviction_latency_p50_ns.unwrap() >= 5_000,
            "{report:?}"
        );
    }
}
