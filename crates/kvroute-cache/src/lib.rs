//! kvroute-cache: a block-level KV prefix cache with pluggable eviction policies.
//!
//! A worker's KV cache holds fixed-size blocks of a prompt's key/value tensors,
//! named by block id (a chained hash, or a Mooncake trace's `hash_ids`). Which
//! block to drop when memory runs out decides how much of the next prompt can
//! be reused. This crate gives every policy the same interface, [`BlockCache`],
//! so a policy behaves identically in the two places kvroute uses it:
//!
//! - **The cache-policy lab** ([`mod@replay`]): every block of every request is
//!   [`BlockCache::access`]ed in trace order. A resident block is a hit and
//!   updates the policy's recency/frequency state; any other block is admitted,
//!   and whatever the policy evicts to make room is reported back.
//! - **A simulated worker's pool of inactive cached blocks** (vLLM-like): blocks
//!   referenced by running requests are active and not in the policy at all, so
//!   they can never be chosen as victims. The pool's capacity is the worker's
//!   total number of blocks, so the cache never holds more than the engine has.
//!   - a request finishes: each of its blocks is offered with `access` (a miss
//!     admits it as an inactive cached block; anything evicted on the way is
//!     returned to the engine's free list);
//!   - a new request reuses a cached block: [`BlockCache::remove`] takes it out
//!     of the evictable set (it is active again), forgetting its policy state;
//!   - the engine needs a free block and has none: [`BlockCache::evict_one`]
//!     asks the policy for a victim.
//!
//!   Because `remove` forgets a block's count and queue, a block reused while
//!   cached comes back as a fresh admission: in a pool, LRU behaves exactly like
//!   vLLM's free-block queue, while LFU counts, S3FIFO promotion and ARC's T2
//!   see no reuse history: a pinned/unpinned pair that keeps policy state would
//!   be needed for those to differ from FIFO-like behaviour in a pool.
//!
//! The policies ([`PolicyKind`]) are [`Lru`], [`Fifo`], [`Lfu`], [`S3Fifo`],
//! [`ArcCache`], [`Predictive`] (learns reuse distances per prefix depth) and
//! [`Qos`] (priority classes, LRU within a class), plus two labelled bounds that are not real policies: [`Infinite`]
//! (never evicts: the most any policy can hit) and [`Belady`] (block-level MIN,
//! which needs the future block sequence). The queue-based policies share the
//! intrusive lists of `list.rs`, whose invariants are written there.
//!
//! Before an access, its caller may describe it with [`BlockCache::hint`] (the
//! block's depth in its prompt and the request's [`Priority`]); only the
//! policies that learn from depth or honour classes read it.
//!
//! [`RadixLru`] is not a [`BlockCache`]: it is SGLang's radix-tree cache (blocks
//! know their parent, leaves are evicted first, running requests lock theirs),
//! used by a simulated worker in SGLang mode and by the lab's `sglang` order.
//! The lab replays in the engines' orders too ([`ReplayOrder`]), so its bound
//! and the engines are measured on like terms.

mod arc;
mod belady;
mod infinite;
mod lfu;
mod list;
mod order;
mod predictive;
mod qos;
mod queue;
mod radix;
pub mod replay;
mod s3fifo;

use std::fmt;
use std::str::FromStr;

pub use arc::ArcCache;
pub use belady::Belady;
pub use infinite::Infinite;
pub use lfu::Lfu;
pub use order::{ReplayOrder, replay_sglang, replay_vllm};
pub use predictive::Predictive;
pub use qos::Qos;
pub use queue::{Fifo, Lru};
pub use radix::RadixLru;
pub use replay::{PreparedTrace, ReplayReport, RequestOutcome, replay};
pub use s3fifo::{S3Fifo, S3FifoParams};

/// A block id: a block hash, or a trace's `hash_ids` entry.
pub type BlockId = u64;

/// What an access found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Access {
    /// The block was resident; the policy recorded the use.
    Hit,
    /// The block was not resident (a ghost entry is not resident) and has been
    /// admitted.
    Miss,
}

/// A request's priority class: under [`Qos`], low blocks are evicted before
/// normal ones and normal before high.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Priority {
    Low = 0,
    #[default]
    Normal = 1,
    High = 2,
}

impl Priority {
    pub const ALL: [Priority; 3] = [Priority::Low, Priority::Normal, Priority::High];

    /// The class numbered 0, 1 or 2, as requests carry it.
    pub fn from_class(class: u64) -> Option<Priority> {
        Self::ALL.get(usize::try_from(class).ok()?).copied()
    }

    pub fn class(self) -> u8 {
        self as u8
    }
}

/// What the caller knows about the next [`BlockCache::access`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct AccessHint {
    /// The block's position in its prompt (0 = first block).
    pub depth: u32,
    pub priority: Priority,
}

/// A block cache with an eviction policy. See the crate docs for how the replay
/// and a worker's block pool map onto these methods.
pub trait BlockCache {
    /// Uses `block`: a hit if resident, otherwise the block is admitted. Blocks
    /// that stop being resident because of this access are appended to
    /// `evicted`, oldest decision first (never the accessed block itself).
    fn access(&mut self, block: BlockId, evicted: &mut Vec<BlockId>) -> Access;

    /// Whether `block` is resident (ghost entries are not).
    fn contains(&self, block: BlockId) -> bool;

    /// Takes a resident block out without counting an eviction and forgets its
    /// policy state; ghost entries stay. Returns whether it was resident.
    fn remove(&mut self, block: BlockId) -> bool;

    /// Chooses a victim by the policy's own eviction rule and drops it, as it
    /// would to make room for an admission; `None` when nothing is resident
    /// (and always for the infinite bound, which never needs room).
    fn evict_one(&mut self) -> Option<BlockId>;

    /// Describes the next `access` only. Policies that neither learn from
    /// depth nor honour priority classes ignore it.
    fn hint(&mut self, _hint: AccessHint) {}

    /// Takes in a block that was resident under another policy (a switch of
    /// policy at run time), called in that policy's eviction order, first
    /// victim first, with room guaranteed by the caller: nothing is evicted.
    /// By default an access, which evicts nothing below capacity.
    fn adopt(&mut self, block: BlockId) {
        let mut evicted = Vec::new();
        self.access(block, &mut evicted);
        debug_assert!(evicted.is_empty(), "adopt evicted {evicted:?}");
    }

    /// Resident blocks.
    fn len(&self) -> usize;

    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The most blocks the cache can hold; `None` for the infinite bound.
    fn capacity(&self) -> Option<usize>;
}

/// Why a cache could not be built.
#[derive(Debug, thiserror::Error)]
pub enum CacheError {
    #[error("capacity must be at least 1 block")]
    ZeroCapacity,
    #[error("unknown policy `{0}` (expected one of: {names})", names = PolicyKind::NAMES.join(", "))]
    UnknownPolicy(String),
    #[error("s3fifo small_ratio must be a number in (0, 1), got {0}")]
    SmallRatio(f64),
    #[error(
        "s3fifo with capacity {capacity} and small_ratio {small_ratio} leaves no room for the main queue \
         (small queue takes {small_cap} blocks); use a larger capacity or a smaller ratio"
    )]
    NoMainQueue {
        capacity: usize,
        small_ratio: f64,
        small_cap: usize,
    },
}

/// The policies and bounds that can be built by name.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum PolicyKind {
    Lru,
    Lfu,
    Fifo,
    S3Fifo,
    Arc,
    Predictive,
    Qos,
    Belady,
    Infinite,
}

impl PolicyKind {
    pub const ALL: [PolicyKind; 9] = [
        PolicyKind::Lru,
        PolicyKind::Lfu,
        PolicyKind::Fifo,
        PolicyKind::S3Fifo,
        PolicyKind::Arc,
        PolicyKind::Predictive,
        PolicyKind::Qos,
        PolicyKind::Belady,
        PolicyKind::Infinite,
    ];
    pub const NAMES: [&'static str; 9] = [
        "lru",
        "lfu",
        "fifo",
        "s3fifo",
        "arc",
        "predictive",
        "qos",
        "belady",
        "infinite",
    ];

    pub fn name(self) -> &'static str {
        Self::NAMES[self as usize]
    }

    /// Bounds are reference points, not policies a worker could run.
    pub fn is_bound(self) -> bool {
        matches!(self, PolicyKind::Belady | PolicyKind::Infinite)
    }

    /// Builds the cache. `future` is the whole block access sequence (for a
    /// replay, [`PreparedTrace::accesses`]), which only [`Belady`] reads;
    /// `capacity` is ignored by [`Infinite`].
    pub fn build(
        self,
        capacity: usize,
        s3fifo: S3FifoParams,
        future: &[BlockId],
    ) -> Result<Box<dyn BlockCache + Send>, CacheError> {
        if capacity == 0 {
            return Err(CacheError::ZeroCapacity);
        }
        Ok(match self {
            PolicyKind::Lru => Box::new(Lru::new(capacity)?),
            PolicyKind::Lfu => Box::new(Lfu::new(capacity)?),
            PolicyKind::Fifo => Box::new(Fifo::new(capacity)?),
            PolicyKind::S3Fifo => Box::new(S3Fifo::new(capacity, s3fifo)?),
            PolicyKind::Arc => Box::new(ArcCache::new(capacity)?),
            PolicyKind::Predictive => Box::new(Predictive::new(capacity)?),
            PolicyKind::Qos => Box::new(Qos::new(capacity)?),
            PolicyKind::Belady => Box::new(Belady::new(capacity, future)?),
            PolicyKind::Infinite => Box::new(Infinite::default()),
        })
    }
}

impl fmt::Display for PolicyKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for PolicyKind {
    type Err = CacheError;

    fn from_str(name: &str) -> Result<Self, CacheError> {
        Self::ALL
            .into_iter()
            .find(|kind| kind.name() == name)
            .ok_or_else(|| CacheError::UnknownPolicy(name.to_owned()))
    }
}

fn check_capacity(capacity: usize) -> Result<(), CacheError> {
    if capacity == 0 {
        Err(CacheError::ZeroCapacity)
    } else {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn policy_names_round_trip_and_unknown_is_an_error() {
        for kind in PolicyKind::ALL {
            assert_eq!(kind.name().parse::<PolicyKind>().unwrap(), kind);
        }
        let err = "mru".parse::<PolicyKind>().unwrap_err().to_string();
        assert!(
            err.contains("unknown policy `mru`") && err.contains("s3fifo"),
            "{err}"
        );
    }

    #[test]
    fn zero_capacity_is_an_error_for_every_policy() {
        for kind in PolicyKind::ALL {
            let err = kind.build(0, S3FifoParams::default(), &[]).err();
            assert!(matches!(err, Some(CacheError::ZeroCapacity)), "{kind}");
        }
    }
}
