//! The paged KV block pool, with vLLM's or SGLang's prefix caching.
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
//!   for reuse until it is evicted to free a slot;
//! - **free**.
//!
//! Which cached block is evicted depends on the engine ([`EngineKind`]):
//! - **vLLM**: cached blocks sit in a `kvroute-cache` policy (LRU: vLLM's free
//!   block queue), which alone picks the victim, one block whenever a slot is
//!   needed (the mapping is documented in that crate). A request gives its
//!   blocks back in reverse order, tail first, as vLLM does, so LRU evicts a
//!   chain's tail before its root.
//! - **SGLang**: every held block is a node of a radix tree
//!   ([`kvroute_cache::RadixLru`]) whose lock references are the requests
//!   referencing it; the victim is the least recently used unlocked leaf, so a
//!   chain is never cut above a cached block. Admitting a request locks its
//!   cached prefix and evicts the room its new blocks need in one scan, as
//!   SGLang evicts before scheduling a batch; admitting and finishing touch the
//!   request's path, its root last.
//!
//! SGLang keeps runs of tokens per tree node and evicts a whole leaf node at a
//! time; this tree has one block per node, so it evicts exactly what it needs.
//!
//! A hashed block is *published* (visible to prefix matching, and announced with
//! a `Stored` event) once its tokens have been computed; a block being prefilled
//! holds its slot but cannot be hit yet. Evicting a cached block announces
//! `Removed`. [`KvPool::clear`] empties everything and announces `Cleared`.
//! These are the events both engines publish (vLLM's and SGLang's
//! `BlockStored` with the parent's hash, `BlockRemoved`, `AllBlocksCleared`),
//! one block per event as SGLang sends them.

use std::collections::HashMap;
use std::fmt;
use std::str::FromStr;

use kvroute_cache::{BlockCache, PolicyKind, RadixLru, S3FifoParams};

use crate::SimError;

/// Whose prefix cache the engine imitates.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum EngineKind {
    #[default]
    Vllm,
    Sglang,
}

impl EngineKind {
    pub const NAMES: [&'static str; 2] = ["vllm", "sglang"];

    pub fn name(self) -> &'static str {
        Self::NAMES[self as usize]
    }
}

impl fmt::Display for EngineKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for EngineKind {
    type Err = String;

    fn from_str(name: &str) -> Result<Self, String> {
        [EngineKind::Vllm, EngineKind::Sglang]
            .into_iter()
            .find(|kind| kind.name() == name)
            .ok_or_else(|| {
                format!(
                    "unknown engine `{name}` (expected one of: {})",
                    Self::NAMES.join(", ")
                )
            })
    }
}

/// Where the cached (unreferenced) blocks wait.
enum Cached {
    /// vLLM: only the unreferenced blocks, in the eviction policy.
    Policy(Box<dyn BlockCache + Send>),
    /// SGLang: every held block, the referenced ones locked.
    Radix(RadixLru),
}

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
    cached: Cached,
    policy: PolicyKind,
    kind: EngineKind,
    events: Vec<PoolEvent>,
    evictions: u64,
}

impl KvPool {
    pub fn new(total: usize, policy: PolicyKind, kind: EngineKind) -> Result<Self, SimError> {
        Ok(KvPool {
            total,
            held: HashMap::new(),
            active: 0,
            private: 0,
            cached: build_cache(policy, kind, total)?,
            policy,
            kind,
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
        match &self.cached {
            Cached::Policy(policy) => policy.len(),
            Cached::Radix(tree) => tree.len() - self.active,
        }
    }

    pub fn free(&self) -> usize {
        self.total - self.active - self.private - self.cached()
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

    /// References every full block of a prompt, root first: shares the held
    /// ones, takes slots for the others (unpublished until computed).
    pub fn acquire_prompt(&mut self, blocks: &[BlockKey]) -> Result<(), OutOfBlocks> {
        let mut shared = vec![false; blocks.len()];
        if let Cached::Radix(_) = self.cached {
            // Lock what is held first, so that making room cannot evict it.
            for (shared, block) in shared.iter_mut().zip(blocks) {
                *shared = self.share(block.hash);
            }
            self.make_room(shared.iter().filter(|&&s| !s).count());
        }
        let mut parent = None;
        for (depth, (block, shared)) in blocks.iter().zip(shared).enumerate() {
            if !shared {
                self.acquire(*block, parent, depth as u32)?;
            }
            parent = Some(block.hash);
        }
        if let (Cached::Radix(tree), Some(last)) = (&mut self.cached, blocks.last()) {
            tree.touch(last.hash);
        }
        Ok(())
    }

    /// Drops a prompt's references, tail first (see the module docs).
    pub fn release_prompt(&mut self, blocks: &[BlockKey]) {
        for block in blocks.iter().rev() {
            self.release(block.hash);
        }
        if let Cached::Radix(tree) = &mut self.cached
            && let Some(deepest) = blocks.iter().rev().find(|b| tree.contains(b.hash))
        {
            tree.touch(deepest.hash);
        }
    }

    /// References a held block; false when it is not held.
    fn share(&mut self, hash: u64) -> bool {
        let Some(held) = self.held.get_mut(&hash) else {
            return false;
        };
        match &mut self.cached {
            Cached::Policy(policy) => {
                if held.refs == 0 {
                    policy.remove(hash);
                }
            }
            Cached::Radix(tree) => {
                tree.lock(hash);
            }
        }
        if held.refs == 0 {
            self.active += 1;
        }
        held.refs += 1;
        true
    }

    /// References block `depth` of a prompt: shares it if held (taking it out
    /// of the cached pool), otherwise takes a slot for it, unpublished.
    fn acquire(
        &mut self,
        key: BlockKey,
        parent: Option<u64>,
        depth: u32,
    ) -> Result<(), OutOfBlocks> {
        if self.share(key.hash) {
            return Ok(());
        }
        self.take_slot()?;
        self.active += 1;
        if let Cached::Radix(tree) = &mut self.cached {
            tree.insert(key.hash, parent);
            tree.lock(key.hash);
        }
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
    fn release(&mut self, hash: u64) {
        let Some(held) = self.held.get_mut(&hash) else {
            return;
        };
        held.refs -= 1;
        if let Cached::Radix(tree) = &mut self.cached {
            tree.unlock(hash);
        }
        if held.refs > 0 {
            return;
        }
        self.active -= 1;
        let published = held.published;
        let mut evicted = Vec::new();
        match &mut self.cached {
            Cached::Radix(tree) => {
                if !published {
                    // Released tail first, so it has no children left.
                    tree.remove(hash);
                }
            }
            Cached::Policy(policy) => {
                if published {
                    policy.access(hash, &mut evicted);
                }
            }
        }
        if !published {
            self.held.remove(&hash);
        }
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
        self.cached = build_cache(self.policy, self.kind, self.total)?;
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
        if self.free() == 0 {
            self.make_room(1);
        }
        if self.free() == 0 {
            return Err(OutOfBlocks);
        }
        Ok(())
    }

    /// Evicts until `slots` are free, or nothing more can be evicted.
    fn make_room(&mut self, slots: usize) {
        let needed = slots.saturating_sub(self.free());
        let mut victims = Vec::new();
        match &mut self.cached {
            Cached::Policy(policy) => {
                victims.extend(std::iter::from_fn(|| policy.evict_one()).take(needed))
            }
            Cached::Radix(tree) => {
                tree.evict(needed, &mut victims);
            }
        }
        for victim in victims {
            self.forget(victim);
        }
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
        assert_eq!(cached, self.cached());
        assert!(self.active + self.private + self.cached() <= self.total);
        if let Cached::Radix(tree) = &self.cached {
            assert_eq!(tree.len(), self.held.len());
        }
        for (hash, held) in &self.held {
            match &self.cached {
                Cached::Policy(policy) => assert_eq!(held.refs == 0, policy.contains(*hash)),
                Cached::Radix(tree) => {
                    assert_eq!(tree.locks(*hash), Some(held.refs));
                    // Leaf-first eviction never cuts a chain above a held block.
                    assert!(held.parent.is_none_or(|p| self.held.contains_key(&p)));
                }
            }
        }
    }
}

fn build_cache(policy: PolicyKind, kind: EngineKind, total: usize) -> Result<Cached, SimError> {
    if policy.is_bound() {
        return Err(SimError::Config(format!(
            "eviction policy `{policy}` is a reference bound, not one a worker can run"
        )));
    }
    match kind {
        EngineKind::Vllm => Ok(Cached::Policy(policy.build(
            total,
            S3FifoParams::default(),
            &[],
        )?)),
        EngineKind::Sglang if policy == PolicyKind::Lru => Ok(Cached::Radix(RadixLru::new())),
        EngineKind::Sglang => Err(SimError::Config(format!(
            "--engine sglang evicts like SGLang's radix cache (least recently used leaf first); \
             --eviction {policy} is only available with --engine vllm"
        ))),
    }
}
