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

use std::collections::HashMap;

use kvroute_cache::{BlockCache, PolicyKind, S3FifoParams};

use crate::SimError;

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
        })
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

    /// References block `depth` of a prompt: shares it if held (taking it out
    /// of the cached pool), otherwise takes a slot for it, unpublished.
    pub fn acquire(
        &mut self,
        key: BlockKey,
        parent: Option<u64>,
        depth: u32,
    ) -> Result<(), OutOfBlocks> {
        if let Some(held) = self.held.get_mut(&key.hash) {
            if held.refs == 0 {
                self.cached.remove(key.hash);
                self.active += 1;
            }
            held.refs += 1;
            return Ok(());
        }
        self.take_slot()?;
        self.active += 1;
        self.held.insert(
            key.hash,
            Held {
                parent,
                local: key.local,
                depth,
                refs: 1,
                published: false,
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
        let mut evicted = Vec::new();
        self.cached.access(hash, &mut evicted);
        // The policy's capacity is the whole pool, so admitting never evicts;
        // handled anyway so the pool stays consistent with the policy.
        for victim in evicted {
            self.forget(victim);
        }
    }

    pub fn alloc_private(&mut self) -> Result<(), OutOfBlocks> {
        self.take_slot()?;
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

    fn take_slot(&mut self) -> Result<(), OutOfBlocks> {
        if self.free() > 0 {
            return Ok(());
        }
        let victim = self.cached.evict_one().ok_or(OutOfBlocks)?;
        self.forget(victim);
        Ok(())
    }

    fn forget(&mut self, victim: u64) {
        self.held.remove(&victim);
        self.evictions += 1;
        self.events.push(PoolEvent::Removed { hash: victim });
    }

    /// Asserts the slot accounting (tests only).
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
