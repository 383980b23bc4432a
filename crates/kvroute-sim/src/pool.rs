//! The paged KV block pool, with vLLM's prefix caching.
//!
//! Every block slot is in exactly one of four states, and the counts always add
//! up to the pool's size (the invariant `check` asserts in tests):
//!
//! - **active, hashed**: a full prompt block referenced by running requests,
//!   named by its sequence hash and reference-counted, so two requests with the
//!   same prefix share one slot;
//! - **active, private**: a request's partial last prompt block and the blocks
//!   its generated tokens fill; never shared, freed when the request ends
//!   (generated filler text has no reuse, so it is not cached);
//! - **inactive, cached**: a hashed block no request references any more, kept
//!   for reuse in a `kvroute-cache` policy, which alone decides which one is
//!   evicted when a slot is needed (the mapping is documented in that crate);
//! - **free**.
//!
//! A hashed block is *published* (visible to prefix matching, and announced with
//! a `Stored` event) once its tokens have been computed; a block being prefilled
//! holds its slot but cannot be hit yet. Evicting a cached block announces
//! `Removed`. [`KvPool::clear`] empties everything and announces `Cleared`.
//!
//! The policy can be replaced while the engine runs ([`KvPool::set_policy`]):
//! the cached blocks move to the new policy in the old one's eviction order,
//! so none is lost and no event is sent. Each held block remembers its depth
//! and the highest [`Priority`] of the requests that used it since it was
//! last cached, which the policy is told ([`AccessHint`]) when it gets the block.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use kvroute_cache::{AccessHint, BlockCache, PolicyKind, Priority, S3FifoParams};

use crate::SimError;
use crate::eviction::{EvictionRecord, EvictionStats, Reason};

/// What changed in the pool, for the event stream.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PoolEvent {
    Stored {
        parent: Option<u64>,
        hash: u64,
        local: u64,
    },
    Removed {
        hash: u64,
    },
    Cleared,
}

/// A full prompt block: its local (tokens) hash and its sequence hash.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BlockKey {
    pub local: u64,
    pub hash: u64,
}

/// No slot is free and no cached block can be evicted.
#[derive(Debug, PartialEq, Eq)]
pub struct OutOfBlocks;

struct Held {
    parent: Option<u64>,
    local: u64,
    /// Position in its prompt (0 = first block), to dump parents first.
    depth: u32,
    refs: u32,
    published: bool,
    priority: Priority,
}

pub struct KvPool {
    total: usize,
    held: HashMap<u64, Held>,
    /// Active hashed blocks (`refs > 0`).
    active: usize,
    private: usize,
    cached: Box<dyn BlockCache + Send>,
    policy: PolicyKind,
    events: Vec<PoolEvent>,
    evictions: u64,
    stats: EvictionStats,
    /// Eviction decisions since the last `take_eviction_log`, when logging.
    log: Option<Vec<EvictionRecord>>,
}

impl KvPool {
    pub fn new(total: usize, policy: PolicyKind) -> Result<Self, SimError> {
        Ok(KvPool {
            total,
            held: HashMap::new(),
            active: 0,
            private: 0,
            cached: build_cache(policy, total)?,
            policy,
            events: vec![PoolEvent::Cleared],
            evictions: 0,
            stats: EvictionStats::new(policy, total),
            log: None,
        })
    }

    pub fn policy(&self) -> PolicyKind {
        self.policy
    }

    /// Replaces the eviction policy without losing a cached block: the old
    /// policy gives up its blocks in its own eviction order (first victim
    /// first) and the new one adopts them in that order, so what was about to
    /// go still goes first. Returns the old policy.
    pub fn set_policy(&mut self, policy: PolicyKind) -> Result<PolicyKind, SimError> {
        let mut next = build_cache(policy, self.total)?;
        while let Some(block) = self.cached.evict_one() {
            self.adopt(next.as_mut(), block);
        }
        // Every policy gives up all its blocks; should one ever keep some, the
        // pool's own record still brings them over.
        let left: Vec<u64> = self
            .held
            .iter()
            .filter(|(hash, h)| h.refs == 0 && !next.contains(**hash))
            .map(|(hash, _)| *hash)
            .collect();
        for block in left {
            self.adopt(next.as_mut(), block);
        }
        self.cached = next;
        self.stats.switch_to(policy);
        Ok(std::mem::replace(&mut self.policy, policy))
    }

    fn adopt(&self, cache: &mut (dyn BlockCache + Send), block: u64) {
        if let Some(held) = self.held.get(&block) {
            cache.hint(AccessHint {
                depth: held.depth,
                priority: held.priority,
            });
        }
        cache.adopt(block);
    }

    /// Records each eviction decision for [`KvPool::take_eviction_log`].
    pub fn log_evictions(&mut self, on: bool) {
        self.log = on.then(Vec::new);
    }

    /// Eviction decisions since the last call (empty unless logging).
    pub fn take_eviction_log(&mut self) -> Vec<EvictionRecord> {
        self.log.as_mut().map(std::mem::take).unwrap_or_default()
    }

    pub fn eviction_stats(&self) -> &EvictionStats {
        &self.stats
    }

    pub fn eviction_stats_mut(&mut self) -> &mut EvictionStats {
        &mut self.stats
    }

    /// Share of the slots holding a block, running or cached.
    pub fn utilisation(&self) -> f64 {
        (self.total - self.free()) as f64 / self.total.max(1) as f64
    }

    pub fn total(&self) -> usize {
        self.total
    }

    /// Slots referenced by running requests (what vLLM reports as KV usage;
    /// cached inactive blocks count as reusable, not used).
    pub fn used(&self) -> usize {
        self.active + self.private
    }

    pub fn cached(&self) -> usize {
        self.cached.len()
    }

    pub fn free(&self) -> usize {
        self.total - self.active - self.private - self.cached.len()
    }

    pub fn evictions(&self) -> u64 {
        self.evictions
    }

    /// Slots that could be handed out now: free ones plus evictable cached ones.
    pub fn available(&self) -> usize {
        self.total - self.active - self.private
    }

    /// Whether `hash` is held in a cached (evictable) slot.
    pub fn is_cached(&self, hash: u64) -> bool {
        self.held.get(&hash).is_some_and(|h| h.refs == 0)
    }

    pub fn is_held(&self, hash: u64) -> bool {
        self.held.contains_key(&hash)
    }

    /// How many leading blocks of `blocks` are published (a prefix hit).
    pub fn match_prefix(&self, blocks: &[BlockKey]) -> usize {
        blocks
            .iter()
            .take_while(|b| self.held.get(&b.hash).is_some_and(|h| h.published))
            .count()
    }

    /// References block `depth` of a prompt for a request of `priority`:
    /// shares it if held (taking it out of the cached pool), otherwise takes a
    /// slot for it, unpublished.
    pub fn acquire(
        &mut self,
        key: BlockKey,
        parent: Option<u64>,
        depth: u32,
        priority: Priority,
    ) -> Result<(), OutOfBlocks> {
        if let Some(held) = self.held.get_mut(&key.hash) {
            if held.refs == 0 {
                self.cached.remove(key.hash);
                self.active += 1;
                held.priority = priority;
            }
            held.priority = held.priority.max(priority);
            held.refs += 1;
            return Ok(());
        }
        self.take_slot(Reason::Prefill)?;
        self.stats.re_prefilled(key.hash);
        self.active += 1;
        self.held.insert(
            key.hash,
            Held {
                parent,
                local: key.local,
                depth,
                refs: 1,
                published: false,
                priority,
            },
        );
        Ok(())
    }

    /// The block's tokens are computed: it can be hit from now on.
    pub fn publish(&mut self, hash: u64) {
        if let Some(held) = self.held.get_mut(&hash)
            && !held.published
        {
            held.published = true;
            self.events.push(PoolEvent::Stored {
                parent: held.parent,
                hash,
                local: held.local,
            });
        }
    }

    /// Drops one reference; an unreferenced published block becomes cached, an
    /// unpublished one (its prefill never finished) is freed.
    pub fn release(&mut self, hash: u64) {
        let Some(held) = self.held.get_mut(&hash) else {
            return;
        };
        held.refs -= 1;
        if held.refs > 0 {
            return;
        }
        self.active -= 1;
        if !held.published {
            self.held.remove(&hash);
            return;
        }
        let hint = AccessHint {
            depth: held.depth,
            priority: held.priority,
        };
        let mut evicted = Vec::new();
        let started = Instant::now();
        self.cached.hint(hint);
        self.cached.access(hash, &mut evicted);
        // The policy's capacity is the whole pool, so admitting needs no room,
        // but S3FIFO drops its small queue's overflow all the same.
        let elapsed = started.elapsed();
        for victim in evicted {
            self.forget(victim, elapsed, Reason::Admission);
        }
    }

    pub fn alloc_private(&mut self) -> Result<(), OutOfBlocks> {
        self.take_slot(Reason::Decode)?;
        self.private += 1;
        Ok(())
    }

    pub fn release_private(&mut self, count: usize) {
        self.private -= count;
    }

    /// Empties the pool (an engine restart): everything is forgotten.
    pub fn clear(&mut self) -> Result<(), SimError> {
        self.held.clear();
        self.active = 0;
        self.private = 0;
        self.cached = build_cache(self.policy, self.total)?;
        self.events.push(PoolEvent::Cleared);
        Ok(())
    }

    /// Events since the last call.
    pub fn take_events(&mut self) -> Vec<PoolEvent> {
        std::mem::take(&mut self.events)
    }

    /// Every published block whose parent is also published, parents first:
    /// the state a router should know (a block whose parent was evicted can
    /// never be part of a prefix hit).
    pub fn dump(&self) -> Vec<PoolEvent> {
        let mut blocks: Vec<(&u64, &Held)> =
            self.held.iter().filter(|(_, h)| h.published).collect();
        blocks.sort_by_key(|(hash, h)| (h.depth, **hash));
        let mut reachable = std::collections::HashSet::new();
        let mut out = Vec::new();
        for (&hash, held) in blocks {
            if held.parent.is_none_or(|p| reachable.contains(&p)) {
                reachable.insert(hash);
                out.push(PoolEvent::Stored {
                    parent: held.parent,
                    hash,
                    local: held.local,
                });
            }
        }
        out
    }

    fn take_slot(&mut self, reason: Reason) -> Result<(), OutOfBlocks> {
        if self.free() > 0 {
            return Ok(());
        }
        let started = Instant::now();
        let victim = self.cached.evict_one().ok_or(OutOfBlocks)?;
        self.forget(victim, started.elapsed(), reason);
        Ok(())
    }

    fn forget(&mut self, victim: u64, decision: Duration, reason: Reason) {
        self.held.remove(&victim);
        self.evictions += 1;
        self.events.push(PoolEvent::Removed { hash: victim });
        self.stats.evicted(victim, decision);
        if let Some(log) = &mut self.log {
            log.push(EvictionRecord {
                policy: self.policy,
                blocks_freed: 1,
                reason,
            });
        }
    }

    /// Asserts the slot accounting (tests only).
    #[cfg(test)]
    pub fn cached_blocks(&self) -> std::collections::BTreeSet<u64> {
        self.held
            .iter()
            .filter(|(_, h)| h.refs == 0)
            .map(|(hash, _)| *hash)
            .collect()
    }

    /// Every published block, reachable from a root or not (tests only).
    #[cfg(test)]
    pub fn published_blocks(&self) -> std::collections::BTreeSet<u64> {
        self.held
            .iter()
            .filter(|(_, h)| h.published)
            .map(|(hash, _)| *hash)
            .collect()
    }

    #[cfg(test)]
    pub fn check(&self) {
        let active = self.held.values().filter(|h| h.refs > 0).count();
        let cached = self.held.values().filter(|h| h.refs == 0).count();
        assert_eq!(active, self.active);
        assert_eq!(cached, self.cached.len());
        assert!(self.active + self.private + self.cached.len() <= self.total);
        for (hash, held) in &self.held {
            assert_eq!(held.refs == 0, self.cached.contains(*hash));
        }
    }
}

fn build_cache(policy: PolicyKind, total: usize) -> Result<Box<dyn BlockCache + Send>, SimError> {
    if policy.is_bound() {
        return Err(SimError::Config(format!(
            "eviction policy `{policy}` is a reference bound, not one a worker can run"
        )));
    }
    Ok(policy.build(total, S3FifoParams::default(), &[])?)
}
