//! The lab's replay in the engines' eviction orders, so that "one shared cache
//! of the fleet's size" is measured on the same terms as the simulated engines.
//!
//! - [`ReplayOrder::Seed`]: Mooncake's replay semantics ([`crate::replay`]),
//!   every block accessed root first; the default, and what the published
//!   figures were measured with.
//! - [`ReplayOrder::Vllm`]: each request runs as in a vLLM engine: its cached
//!   blocks are taken out of the evictable set while it runs, room is made for
//!   its new blocks, and when it finishes all its blocks go back in reverse
//!   order, tail first, so the policy evicts a chain's tail before its root.
//! - [`ReplayOrder::Sglang`]: SGLang's radix cache ([`RadixLru`]): the request
//!   locks its cached prefix, the least recent unlocked leaves are evicted to
//!   make room for its new blocks (each the child of the block before it), and
//!   when it finishes it unlocks them and touches its path, the root last.
//!
//! In both engine orders a request's blocks cannot be evicted while it is being
//! admitted, as in an engine, where they are in use.

use std::fmt;
use std::str::FromStr;
use std::time::Instant;

use crate::replay::{PreparedTrace, ReplayReport, Tally, resident_prefix};
use crate::{BlockCache, BlockId, RadixLru};

/// How blocks go back to the cache after a request; see the module docs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum ReplayOrder {
    #[default]
    Seed,
    Vllm,
    Sglang,
}

impl ReplayOrder {
    pub const NAMES: [&'static str; 3] = ["seed", "vllm", "sglang"];

    pub fn name(self) -> &'static str {
        Self::NAMES[self as usize]
    }
}

impl fmt::Display for ReplayOrder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for ReplayOrder {
    type Err = String;

    fn from_str(name: &str) -> Result<Self, String> {
        [ReplayOrder::Seed, ReplayOrder::Vllm, ReplayOrder::Sglang]
            .into_iter()
            .find(|order| order.name() == name)
            .ok_or_else(|| {
                format!(
                    "unknown order `{name}` (expected one of: {})",
                    Self::NAMES.join(", ")
                )
            })
    }
}

/// Marks each block the first time a request uses it, so a block repeated
/// within a prompt takes one slot, as in an engine.
struct FirstUse {
    request_of: Vec<usize>,
}

impl FirstUse {
    fn new(trace: &PreparedTrace) -> Self {
        FirstUse {
            request_of: vec![usize::MAX; trace.last_use.len()],
        }
    }

    fn first(&mut self, request: usize, block: BlockId) -> bool {
        let seen = &mut self.request_of[block as usize];
        std::mem::replace(seen, request) != request
    }
}

/// Replays `trace` through `cache` in vLLM's order: see [`ReplayOrder::Vllm`].
pub fn replay_vllm<C: BlockCache + ?Sized>(
    cache: &mut C,
    trace: &PreparedTrace,
    block_size: u64,
    mut after_request: impl FnMut(),
) -> ReplayReport {
    let capacity = cache.capacity();
    let mut tally = Tally::new(trace, capacity);
    let mut first_use = FirstUse::new(trace);
    let mut evicted = Vec::new();
    let mut start = 0;
    for (request, &(input_length, end)) in trace.requests.iter().enumerate() {
        let blocks = &trace.accesses[start..end];
        let resident_prefix = resident_prefix(blocks, |block| cache.contains(block));
        let started = Instant::now();
        let mut in_use = 0;
        for &block in blocks {
            if first_use.first(request, block) {
                in_use += 1;
                if cache.remove(block) {
                    tally.report.block_hits += 1;
                }
            }
        }
        if let Some(capacity) = capacity {
            while cache.len() + in_use > capacity {
                match cache.evict_one() {
                    Some(victim) => evicted.push(victim),
                    None => break,
                }
            }
        }
        tally.evicted(trace, &mut evicted, start, started);
        for (position, &block) in (start..end).zip(blocks).rev() {
            let started = Instant::now();
            cache.access(block, &mut evicted);
            tally.evicted(trace, &mut evicted, position, started);
        }
        start = end;
        tally.request(input_length, resident_prefix, block_size, cache.len());
        after_request();
    }
    tally.finish(cache.len())
}

/// Replays `trace` through SGLang's radix cache of `capacity` blocks (`None`:
/// unbounded): see [`ReplayOrder::Sglang`].
pub fn replay_sglang(
    capacity: Option<usize>,
    trace: &PreparedTrace,
    block_size: u64,
    mut after_request: impl FnMut(),
) -> ReplayReport {
    let mut cache = RadixLru::new();
    let mut tally = Tally::new(trace, capacity);
    let mut first_use = FirstUse::new(trace);
    let mut evicted = Vec::new();
    let mut locked = Vec::new();
    let mut start = 0;
    for (request, &(input_length, end)) in trace.requests.iter().enumerate() {
        let blocks = &trace.accesses[start..end];
        let resident_prefix = resident_prefix(blocks, |block| cache.contains(block));
        let mut new = 0;
        for &block in blocks {
            if first_use.first(request, block) {
                if cache.lock(block) {
                    tally.report.block_hits += 1;
                    locked.push(block);
                } else {
                    new += 1;
                }
            }
        }
        let started = Instant::now();
        if let Some(capacity) = capacity {
            let free = capacity.saturating_sub(cache.len());
            if new > free {
                cache.evict(new - free, &mut evicted);
            }
        }
        tally.evicted(trace, &mut evicted, start, started);
        let mut parent = None;
        for &block in blocks {
            if !cache.contains(block) {
                if capacity.is_some_and(|c| cache.len() >= c) {
                    // Every other block is held by this request: the rest of
                    // the prompt is computed but not cached.
                    break;
                }
                cache.insert(block, parent);
                cache.lock(block);
                locked.push(block);
            }
            parent = Some(block);
        }
        for block in locked.drain(..).rev() {
            cache.unlock(block);
        }
        if let Some(&deepest) = blocks.iter().rev().find(|&&b| cache.contains(b)) {
            cache.touch(deepest);
        }
        start = end;
        tally.request(input_length, resident_prefix, block_size, cache.len());
        after_request();
    }
    tally.finish(cache.len())
}
