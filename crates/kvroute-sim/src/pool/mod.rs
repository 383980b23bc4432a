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
//!
//! With a host tier ([`KvPool::with_host_tier`], `--offload-blocks`), an
//! evicted published block is first copied to it (see [`crate::pool::host`]), and
//! [`KvPool::load_from_host`] brings blocks back instead of prefilling them.
//!
//! These are the events both engines publish (vLLM's and SGLang's
//! `BlockStored` with the parent's hash, `BlockRemoved`, `AllBlocksCleared`),
//! one block per event as SGLang sends them.
//!
//! In vLLM mode the policy can be replaced while the engine runs
//! ([`KvPool::set_policy`]): the cached blocks move to the new policy in the
//! old one's eviction order, so none is lost and no event is sent. Each held
//! block remembers its depth and the highest [`Priority`] of the requests that
//! used it since it was last cached, which the policy is told ([`AccessHint`])
//! when it gets the block.

pub mod host;

use std::collections::HashMap;
use std::fmt;
use std::str::FromStr;
use std::time::{Duration, Instant};

use kvroute_cache::{AccessHint, BlockCache, PolicyKind, Priority, RadixLru, S3FifoParams};

use crate::SimError;
use crate::eviction::{EvictionRecord, EvictionStats, Reason};
use crate::pool::host::{Copied, HostTier};

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
    /// Clears the host tier too.
    Cleared,
    /// Copied to the host tier (the offload tier's `Stored`).
    HostStored {
        parent: Option<u64>,
        hash: u64,
        local: u64,
    },
    /// Evicted from the host tier.
    HostRemoved {
        hash: u64,
    },
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
    cached: Cached,
    policy: PolicyKind,
    kind: EngineKind,
    events: Vec<PoolEvent>,
    evictions: u64,
    stats: EvictionStats,
    /// Eviction decisions since the last `take_eviction_log`, when logging.
    log: Option<Vec<EvictionRecord>>,
    /// Evicted blocks kept in host memory; capacity 0: none.
    host: HostTier,
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
            stats: EvictionStats::new(policy, total),
            log: None,
            host: HostTier::new(0),
        })
    }

    /// Gives the pool a host tier of `blocks` blocks (0: none).
    pub fn with_host_tier(mut self, blocks: usize) -> Self {
        self.host = HostTier::new(blocks);
        self
    }

    /// Loads the blocks of a prompt that continue its GPU prefix hit (`from`
    /// blocks) in the host tier: they must be referenced already (see
    /// [`Self::acquire_prompt`]); they are published, as computed blocks are.
    /// Returns how many.
    pub fn load_from_host(&mut self, blocks: &[BlockKey], from: usize) -> usize {
        let loaded = self.host.continues(blocks, from);
        for block in &blocks[from..from + loaded] {
            self.publish(block.hash);
        }
        if loaded > 0 {
            self.host.touch(blocks[from + loaded - 1].hash);
        }
        loaded
    }

    pub fn policy(&self) -> PolicyKind {
        self.policy
    }

    /// Replaces the eviction policy without losing a cached block: the old
    /// policy gives up its blocks in its own eviction order (first victim
    /// first) and the new one adopts them in that order, so what was about to
    /// go still goes first. Returns the old policy.
    pub fn set_policy(&mut self, policy: PolicyKind) -> Result<PolicyKind, SimError> {
        let Cached::Policy(current) = &mut self.cached else {
            return Err(SimError::Config(format!(
                "--engine sglang evicts like SGLang's radix cache (least recently used leaf \
                 first); its eviction cannot be switched to `{policy}`"
            )));
        };
        let mut next = build_policy(policy, self.total)?;
        while let Some(block) = current.evict_one() {
            adopt(&self.held, next.as_mut(), block);
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
            adopt(&self.held, next.as_mut(), block);
        }
        *current = next;
        self.stats.switch_to(policy);
        Ok(std::mem::replace(&mut self.policy, policy))
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

    /// References every full block of a prompt for a request of `priority`,
    /// root first: shares the held ones, takes slots for the others
    /// (unpublished until computed).
    pub fn acquire_prompt(
        &mut self,
        blocks: &[BlockKey],
        priority: Priority,
    ) -> Result<(), OutOfBlocks> {
        let mut shared = vec![false; blocks.len()];
        if let Cached::Radix(_) = self.cached {
            // Lock what is held first, so that making room cannot evict it.
            for (shared, block) in shared.iter_mut().zip(blocks) {
                *shared = self.share(block.hash, priority);
            }
            self.make_room(shared.iter().filter(|&&s| !s).count(), Reason::Prefill);
        }
        let mut parent = None;
        for (depth, (block, shared)) in blocks.iter().zip(shared).enumerate() {
            if !shared {
                self.acquire(*block, parent, depth as u32, priority)?;
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

    /// References a held block for a request of `priority`; false when it is
    /// not held.
    fn share(&mut self, hash: u64, priority: Priority) -> bool {
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
            held.priority = priority;
        }
        held.priority = held.priority.max(priority);
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
        priority: Priority,
    ) -> Result<(), OutOfBlocks> {
        if self.share(key.hash, priority) {
            return Ok(());
        }
        self.take_slot(Reason::Prefill)?;
        self.stats.re_prefilled(key.hash);
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
        let hint = AccessHint {
            depth: held.depth,
            priority: held.priority,
        };
        let mut evicted = Vec::new();
        let started = Instant::now();
        match &mut self.cached {
            Cached::Radix(tree) => {
                if !published {
                    // Released tail first, so it has no children left.
                    tree.remove(hash);
                }
            }
            Cached::Policy(policy) => {
                if published {
                    policy.hint(hint);
                    policy.access(hash, &mut evicted);
                }
            }
        }
        let elapsed = started.elapsed();
        if !published {
            self.held.remove(&hash);
        }
        // The policy's capacity is the whole pool, so admitting needs no room,
        // but S3FIFO drops its small queue's overflow all the same.
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
        self.cached = build_cache(self.policy, self.kind, self.total)?;
        self.host.clear();
        self.events.push(PoolEvent::Cleared);
        Ok(())
    }

    /// Events since the last call.
    pub fn take_events(&mut self) -> Vec<PoolEvent> {
        std::mem::take(&mut self.events)
    }

    /// Every published block whose parent is also published, parents first:
    /// the state a router should know (a block whose parent was evicted can
    /// never be part of a prefix hit); then the host tier's blocks.
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
        out.extend(self.host.dump());
        out
    }

    fn take_slot(&mut self, reason: Reason) -> Result<(), OutOfBlocks> {
        if self.free() == 0 {
            self.make_room(1, reason);
        }
        if self.free() == 0 {
            return Err(OutOfBlocks);
        }
        Ok(())
    }

    /// Evicts until `slots` are free, or nothing more can be evicted.
    fn make_room(&mut self, slots: usize, reason: Reason) {
        let needed = slots.saturating_sub(self.free());
        if needed == 0 {
            return;
        }
        let mut victims = Vec::new();
        let started = Instant::now();
        match &mut self.cached {
            Cached::Policy(policy) => {
                victims.extend(std::iter::from_fn(|| policy.evict_one()).take(needed))
            }
            Cached::Radix(tree) => {
                tree.evict(needed, &mut victims);
            }
        }
        // One decision chose them all: each victim is charged its share.
        let decision = started.elapsed() / victims.len().max(1) as u32;
        for victim in victims {
            self.forget(victim, decision, reason);
        }
    }

    fn forget(&mut self, victim: u64, decision: Duration, reason: Reason) {
        self.offload(victim);
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

    /// Copies an evicted block to the host tier with its ancestors not there
    /// yet (all still published on the GPU); a block whose chain is broken on
    /// both tiers could never be hit, so it is not copied.
    fn offload(&mut self, victim: u64) {
        if !self.host.enabled() {
            return;
        }
        let mut chain = Vec::new();
        let mut at = Some(victim);
        while let Some(hash) = at {
            if self.host.contains(hash) {
                break;
            }
            let Some(held) = self.held.get(&hash).filter(|h| h.published) else {
                return;
            };
            chain.push(Copied {
                parent: held.parent,
                hash,
                local: held.local,
                depth: held.depth,
            });
            at = held.parent;
        }
        chain.reverse();
        if chain.is_empty() {
            self.host.touch(victim);
        } else {
            self.host.copy_in(&chain, &mut self.events);
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
        assert_eq!(cached, self.cached());
        assert!(self.active + self.private + self.cached() <= self.total);
        self.host.check();
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
    match kind {
        EngineKind::Vllm => Ok(Cached::Policy(build_policy(policy, total)?)),
        EngineKind::Sglang if policy == PolicyKind::Lru => Ok(Cached::Radix(RadixLru::new())),
        EngineKind::Sglang => Err(SimError::Config(format!(
            "--engine sglang evicts like SGLang's radix cache (least recently used leaf first); \
             --eviction {policy} is only available with --engine vllm"
        ))),
    }
}

fn build_policy(policy: PolicyKind, total: usize) -> Result<Box<dyn BlockCache + Send>, SimError> {
    if policy.is_bound() {
        return Err(SimError::Config(format!(
            "eviction policy `{policy}` is a reference bound, not one a worker can run"
        )));
    }
    Ok(policy.build(total, S3FifoParams::default(), &[])?)
}

/// Gives `block` to `cache`, with what the pool knows of it.
fn adopt(held: &HashMap<u64, Held>, cache: &mut (dyn BlockCache + Send), block: u64) {
    if let Some(held) = held.get(&block) {
        cache.hint(AccessHint {
            depth: held.depth,
            priority: held.priority,
        });
    }
    cache.adopt(block);
}
