//! One simulated engine: the scheduler of a vLLM-like engine over a [`KvPool`],
//! driven one iteration at a time by [`Engine::step`].
//!
//! The engine never sleeps or reads a clock: `step` returns how long the
//! iteration takes by the [`CostModel`], and the caller (the async worker, or a
//! test) decides what to do with that time. So tests drive it deterministically.
//!
//! Each iteration, like vLLM v1's scheduler with chunked prefill:
//! 1. running requests first, in admission order: a request still prefilling
//!    gets a chunk of its remaining prompt, a decoding one gets one token, all
//!    within `max_num_batched_tokens`; a request that needs a block when none
//!    can be freed preempts the most recently admitted request (its blocks are
//!    released and it waits at the head of the queue to be recomputed);
//! 2. then waiting requests, oldest first, while there is token budget, fewer
//!    than `max_num_seqs` running, and slots for all their full prompt blocks:
//!    the longest published prefix is a hit (counted once per request, at its
//!    first admission), the rest is computed.
//!
//! A request's full prompt blocks are referenced at admission (shared with any
//! other request holding the same hash) and published as their tokens get
//! computed; its partial last block and generated tokens use private blocks.
//! At least one prompt token is always computed, even on a full hit, because
//! the first output token needs a forward pass. When a request ends its blocks
//! go back to the cached pool tail first, as in vLLM (or are unlocked, in
//! SGLang's radix tree): one engine fed one request at a time hits exactly
//! what `kvroute-lab replay --order vllm` (or `--order sglang`) predicts.

use std::collections::{HashMap, VecDeque};
use std::time::Duration;

use kvroute_cache::{PolicyKind, Priority};
use kvroute_index::{BlockHasher, ExtraKeys, sequence_hashes};

use crate::SimError;
use crate::cost::{BatchShape, CostModel};
use crate::eviction::{EvictionRecord, PolicyFigures};
use crate::pool::{BlockKey, EngineKind, KvPool, PoolEvent};

/// The engine's limits and costs.
#[derive(Clone, Debug)]
pub struct EngineConfig {
    pub kv_blocks: usize,
    pub block_size: usize,
    pub max_num_seqs: usize,
    pub max_num_batched_tokens: usize,
    pub eviction: PolicyKind,
    /// Whose prefix cache the pool imitates.
    pub kind: EngineKind,
    pub cost: CostModel,
    /// Blocks of the host tier (see [`crate::pool::host`]); 0: none.
    pub offload_blocks: usize,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            kv_blocks: 8192,
            block_size: 16,
            max_num_seqs: 256,
            max_num_batched_tokens: 8192,
            eviction: PolicyKind::Lru,
            kind: EngineKind::Vllm,
            cost: CostModel::default(),
            offload_blocks: 0,
        }
    }
}

pub type SeqId = u64;

/// One request's progress reported by a step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Emitted {
    pub seq: SeqId,
    /// Output tokens generated so far (this step produced the last one).
    pub generated: u32,
    pub finished: bool,
    pub prompt_tokens: u32,
    /// Prompt tokens found in the cache at the request's first admission.
    pub cached_tokens: u32,
}

/// What one iteration did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Step {
    pub duration: Duration,
    pub batch: BatchShape,
    pub emitted: Vec<Emitted>,
}

/// Cumulative counters.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct EngineStats {
    pub requests: u64,
    pub finished: u64,
    pub aborted: u64,
    pub prompt_tokens: u64,
    /// Prompt tokens that were prefix-cache hits.
    pub cached_tokens: u64,
    /// Prompt tokens loaded from the host tier instead of computed.
    pub offload_tokens: u64,
    pub computed_prompt_tokens: u64,
    /// Prompt tokens received from a prefill engine (disaggregated decode)
    /// beyond the local prefix hit; counted in `cached_tokens` too.
    pub transferred_tokens: u64,
    pub generated_tokens: u64,
    pub preemptions: u64,
    pub steps: u64,
    /// Requests, prompt and cached tokens per priority class (low, normal, high).
    pub classes: [ClassStats; 3],
}

/// One priority class's share of the counters.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ClassStats {
    pub requests: u64,
    pub prompt_tokens: u64,
    pub cached_tokens: u64,
}

/// Current load, as the router and `/metrics` see it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Load {
    pub running: u32,
    pub waiting: u32,
    pub kv_blocks_used: u64,
    pub kv_blocks_cached: u64,
    pub kv_blocks_total: u64,
    pub prefill_tokens: u64,
}

struct Seq {
    id: SeqId,
    blocks: Vec<BlockKey>,
    prompt_len: usize,
    max_tokens: u32,
    generated: u32,
    /// Tokens whose KV is in the pool.
    computed: usize,
    /// Whether `blocks` are referenced in the pool (false while waiting).
    holds_blocks: bool,
    private: usize,
    /// Leading blocks known published.
    published: usize,
    cached_tokens: usize,
    counted: bool,
    priority: Priority,
    /// Keep the blocks when the request finishes, until [`Engine::release_held`]:
    /// a prefill whose KV a decode engine is yet to pull.
    hold: bool,
    /// Leading block hashes whose KV a prefill engine sent (see [`Handoff`]);
    /// emptied at the first admission.
    transferred: Vec<u64>,
    transferred_tokens: usize,
}

impl Seq {
    /// Tokens to compute before decoding: the prompt, plus after a preemption
    /// every generated token but the last (the next decode step computes that).
    fn prefill_target(&self) -> usize {
        self.prompt_len + (self.generated as usize).saturating_sub(1)
    }

    fn prefill_left(&self) -> usize {
        self.prefill_target().saturating_sub(self.computed)
    }
}

/// A request's part in a prefill/decode handoff.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Handoff {
    /// A prefill leg: its blocks stay held once it finishes, until released.
    pub hold: bool,
    /// A decode leg: the full block hashes a prefill engine computed. The
    /// prompt's leading blocks that match them count as cached, less the
    /// prompt's last token (the first output token needs a forward pass).
    pub transferred: Vec<u64>,
    /// The prefill's prompt length: when every full block matched, its
    /// partial last block came too.
    pub transferred_tokens: usize,
}

pub struct Engine {
    config: EngineConfig,
    hasher: BlockHasher,
    pool: KvPool,
    waiting: VecDeque<Seq>,
    running: Vec<Seq>,
    /// Finished prefill legs whose blocks wait for a decode engine.
    held: HashMap<SeqId, Seq>,
    next_id: SeqId,
    stats: EngineStats,
}

impl Engine {
    pub fn new(config: EngineConfig) -> Result<Self, SimError> {
        for (name, value) in [
            ("kv-blocks", config.kv_blocks),
            ("block-size", config.block_size),
            ("max-num-seqs", config.max_num_seqs),
            ("max-num-batched-tokens", config.max_num_batched_tokens),
        ] {
            if value == 0 {
                return Err(SimError::Config(format!("--{name} must be at least 1")));
            }
        }
        if !(config.cost.speedup > 0.0 && config.cost.speedup.is_finite()) {
            return Err(SimError::Config(format!(
                "--speedup must be a positive number, got {}",
                config.cost.speedup
            )));
        }
        Ok(Engine {
            hasher: BlockHasher::new(config.block_size),
            pool: KvPool::new(config.kv_blocks, config.eviction, config.kind)?
                .with_host_tier(config.offload_blocks),
            config,
            waiting: VecDeque::new(),
            running: Vec::new(),
            held: HashMap::new(),
            next_id: 0,
            stats: EngineStats::default(),
        })
    }

    pub fn config(&self) -> &EngineConfig {
        &self.config
    }

    pub fn stats(&self) -> EngineStats {
        self.stats
    }

    pub fn evictions(&self) -> u64 {
        self.pool.evictions()
    }

    pub fn eviction_policy(&self) -> PolicyKind {
        self.pool.policy()
    }

    /// Switches the cached blocks' eviction policy at run time; none is lost.
    /// Returns the old policy.
    pub fn set_eviction_policy(&mut self, policy: PolicyKind) -> Result<PolicyKind, SimError> {
        let old = self.pool.set_policy(policy)?;
        self.config.eviction = policy;
        Ok(old)
    }

    /// What each policy cost while it ran (see [`crate::eviction`]).
    pub fn eviction_figures(&self) -> Vec<PolicyFigures> {
        self.pool.eviction_stats().figures()
    }

    pub fn log_evictions(&mut self, on: bool) {
        self.pool.log_evictions(on);
    }

    /// Eviction decisions since the last call, when logging.
    pub fn take_eviction_log(&mut self) -> Vec<EvictionRecord> {
        self.pool.take_eviction_log()
    }

    pub fn is_idle(&self) -> bool {
        self.running.is_empty() && self.waiting.is_empty()
    }

    pub fn load(&self) -> Load {
        // A waiting request will find its cached prefix at admission, as the
        // router assumes when it books the request: report only what is left
        // to compute, or a worker holding a hot prefix would look busier than it is.
        let bs = self.config.block_size;
        let prefill = |s: &Seq| {
            let cached = if s.holds_blocks {
                0
            } else {
                self.pool.match_prefix(&s.blocks).max(s.transferred.len()) * bs
            };
            s.prefill_left().saturating_sub(cached) as u64
        };
        Load {
            running: self.running.len() as u32,
            waiting: self.waiting.len() as u32,
            kv_blocks_used: self.pool.used() as u64,
            kv_blocks_cached: self.pool.cached() as u64,
            kv_blocks_total: self.pool.total() as u64,
            prefill_tokens: self.running.iter().chain(&self.waiting).map(prefill).sum(),
        }
    }

    /// Queues a request. Refused when it could never fit in the pool.
    pub fn submit(&mut self, tokens: &[u32], max_tokens: u32) -> Result<SeqId, SimError> {
        self.submit_with(tokens, max_tokens, &ExtraKeys::default())
    }

    /// Queues a request whose blocks are also keyed by `extra` (a `cache_salt`,
    /// images), as vLLM keys them: such blocks are shared only with requests
    /// that have the same keys.
    pub fn submit_with(
        &mut self,
        tokens: &[u32],
        max_tokens: u32,
        extra: &ExtraKeys,
    ) -> Result<SeqId, SimError> {
        self.submit_prioritized(tokens, max_tokens, extra, Priority::Normal)
    }

    /// Queues a request of a priority class: under the `qos` policy its blocks
    /// are kept before those of lower classes.
    pub fn submit_prioritized(
        &mut self,
        tokens: &[u32],
        max_tokens: u32,
        extra: &ExtraKeys,
        priority: Priority,
    ) -> Result<SeqId, SimError> {
        self.submit_handoff(tokens, max_tokens, extra, priority, Handoff::default())
    }

    /// Queues a request that takes part in a prefill/decode handoff.
    pub fn submit_handoff(
        &mut self,
        tokens: &[u32],
        max_tokens: u32,
        extra: &ExtraKeys,
        priority: Priority,
        handoff: Handoff,
    ) -> Result<SeqId, SimError> {
        if tokens.is_empty() {
            return Err(SimError::BadRequest("the prompt has no tokens".into()));
        }
        if max_tokens == 0 {
            return Err(SimError::BadRequest("max_tokens must be at least 1".into()));
        }
        let bs = self.config.block_size;
        let needed = (tokens.len() + max_tokens as usize - 1).div_ceil(bs);
        if needed > self.pool.total() {
            return Err(SimError::BadRequest(format!(
                "the prompt ({} tokens) and max_tokens ({max_tokens}) need {needed} KV blocks of {bs} \
                 tokens; this engine has {}",
                tokens.len(),
                self.pool.total()
            )));
        }
        let locals = self.hasher.local_hashes_with(tokens, extra);
        let blocks = sequence_hashes(&locals)
            .into_iter()
            .zip(locals)
            .map(|(hash, local)| BlockKey { local, hash })
            .collect();
        let id = self.next_id;
        self.next_id += 1;
        self.waiting.push_back(Seq {
            id,
            blocks,
            prompt_len: tokens.len(),
            max_tokens,
            generated: 0,
            computed: 0,
            holds_blocks: false,
            private: 0,
            published: 0,
            cached_tokens: 0,
            counted: false,
            priority,
            hold: handoff.hold,
            transferred: handoff.transferred,
            transferred_tokens: handoff.transferred_tokens,
        });
        Ok(id)
    }

    /// The full prompt blocks' hashes and the prompt length of a held
    /// (finished prefill) request.
    pub fn held_prompt(&self, id: SeqId) -> Option<(Vec<u64>, usize)> {
        let seq = self.held.get(&id)?;
        Some((seq.blocks.iter().map(|b| b.hash).collect(), seq.prompt_len))
    }

    /// Gives a held request's blocks back to the cache, tail first; returns
    /// how many blocks it held (none if it is not held).
    pub fn release_held(&mut self, id: SeqId) -> usize {
        let Some(mut seq) = self.held.remove(&id) else {
            return 0;
        };
        let blocks = seq.blocks.len() + seq.private;
        self.release(&mut seq);
        blocks
    }

    /// Drops a request (its client went away); its blocks are released.
    pub fn abort(&mut self, id: SeqId) {
        if let Some(pos) = self.waiting.iter().position(|s| s.id == id) {
            let seq = self.waiting.remove(pos).expect("position is in range");
            self.stats.aborted += 1;
            drop(seq);
        } else if let Some(pos) = self.running.iter().position(|s| s.id == id) {
            let mut seq = self.running.remove(pos);
            self.release(&mut seq);
            self.stats.aborted += 1;
        } else {
            self.release_held(id);
        }
    }

    /// Forgets every request and cached block (a restart); the pool announces `Cleared`.
    pub fn clear(&mut self) -> Result<Vec<SeqId>, SimError> {
        let dropped = self
            .running
            .drain(..)
            .chain(self.waiting.drain(..))
            .map(|s| s.id)
            .collect();
        self.held.clear();
        self.pool.clear()?;
        Ok(dropped)
    }

    /// Pool events since the last call.
    pub fn take_events(&mut self) -> Vec<PoolEvent> {
        self.pool.take_events()
    }

    /// The published blocks, parents first, for a full dump.
    pub fn dump(&self) -> Vec<PoolEvent> {
        self.pool.dump()
    }

    /// Runs one iteration; `None` when there is nothing to do.
    pub fn step(&mut self) -> Option<Step> {
        if self.is_idle() {
            return None;
        }
        let mut budget = self.config.max_num_batched_tokens;
        let mut batch = BatchShape::default();
        // (index into running, tokens computed this step)
        let mut plan: Vec<(usize, usize)> = Vec::new();

        let mut i = 0;
        while i < self.running.len() && budget > 0 {
            let seq = &self.running[i];
            let tokens = seq.prefill_left().min(budget).max(1);
            if !self.reserve(i, seq.computed + tokens) {
                // `reserve` preempted from the back, possibly this request.
                continue;
            }
            plan.push((i, tokens));
            budget -= tokens;
            i += 1;
        }
        while budget > 0 && self.running.len() < self.config.max_num_seqs {
            let Some(seq) = self.waiting.front() else {
                break;
            };
            let must_take = seq
                .blocks
                .iter()
                .filter(|b| !self.pool.is_held(b.hash) || self.pool.is_cached(b.hash))
                .count();
            if must_take > self.pool.available() {
                break;
            }
            let seq = self.waiting.pop_front().expect("front exists");
            batch.loaded_tokens += self.admit(seq) as u64;
            let index = self.running.len() - 1;
            let seq = &self.running[index];
            let tokens = seq.prefill_left().min(budget).max(1);
            if !self.reserve(index, seq.computed + tokens) {
                break;
            }
            plan.push((index, tokens));
            budget -= tokens;
        }
        if plan.is_empty() {
            // Everything waits for blocks that running requests hold; cannot
            // happen with requests checked at submit, but never spin silently.
            return Some(Step {
                duration: self.config.cost.step_time(batch),
                batch,
                emitted: Vec::new(),
            });
        }

        let mut emitted = Vec::new();
        for &(index, tokens) in &plan {
            let seq = &self.running[index];
            if seq.prefill_left() > 0 {
                batch.prefill_tokens += tokens as u64;
            } else {
                batch.decode_seqs += 1;
                batch.decode_kv_tokens += seq.computed as u64 + 1;
            }
        }
        for &(index, tokens) in &plan {
            let bs = self.config.block_size;
            let seq = &mut self.running[index];
            let prefilling = seq.prefill_left() > 0;
            seq.computed += tokens;
            let full = (seq.computed / bs).min(seq.blocks.len());
            for block in &seq.blocks[seq.published.min(full)..full] {
                self.pool.publish(block.hash);
            }
            seq.published = seq.published.max(full);
            if prefilling {
                self.stats.computed_prompt_tokens += tokens as u64;
                if seq.prefill_left() > 0 || seq.generated > 0 {
                    continue;
                }
            }
            seq.generated += 1;
            self.stats.generated_tokens += 1;
            emitted.push(Emitted {
                seq: seq.id,
                generated: seq.generated,
                finished: seq.generated >= seq.max_tokens,
                prompt_tokens: seq.prompt_len as u32,
                cached_tokens: seq.cached_tokens as u32,
            });
        }
        // Finished requests leave; iterate from the back so indices stay valid.
        let mut finished: Vec<usize> = plan
            .iter()
            .map(|&(index, _)| index)
            .filter(|&index| self.running[index].generated >= self.running[index].max_tokens)
            .collect();
        finished.sort_unstable();
        for index in finished.into_iter().rev() {
            let mut seq = self.running.remove(index);
            self.stats.finished += 1;
            if seq.hold {
                self.held.insert(seq.id, seq);
            } else {
                self.release(&mut seq);
            }
        }
        self.stats.steps += 1;
        let duration = self.config.cost.step_time(batch);
        let utilisation = self.pool.utilisation();
        self.pool.eviction_stats_mut().step(duration, utilisation);
        Some(Step {
            duration,
            batch,
            emitted,
        })
    }

    /// Starts a waiting request: its GPU prefix hit is free, the blocks that
    /// continue it in the host tier are loaded; returns the tokens loaded.
    fn admit(&mut self, mut seq: Seq) -> usize {
        let bs = self.config.block_size;
        let first_admission = !seq.counted;
        let hit = self.pool.match_prefix(&seq.blocks);
        // Blocks an eviction took that this request must prefill again.
        let lost = seq.blocks[hit..]
            .iter()
            .filter(|b| {
                !self.pool.is_held(b.hash) && self.pool.eviction_stats().was_evicted(b.hash)
            })
            .count();
        let cost = self.config.cost;
        let stats = self.pool.eviction_stats_mut();
        stats.lost(Duration::from_secs_f64(
            (lost * bs) as f64 * cost.prefill_per_token_s / cost.speedup,
        ));
        if !seq.counted {
            stats.request(lost, seq.blocks.len());
            seq.counted = true;
            seq.cached_tokens = (hit * bs).min(seq.prompt_len);
            self.stats.requests += 1;
            self.stats.prompt_tokens += seq.prompt_len as u64;
            self.stats.cached_tokens += seq.cached_tokens as u64;
            let class = &mut self.stats.classes[seq.priority.class() as usize];
            class.requests += 1;
            class.prompt_tokens += seq.prompt_len as u64;
            class.cached_tokens += seq.cached_tokens as u64;
        }
        self.pool
            .acquire_prompt(&seq.blocks, seq.priority)
            .expect("admission checked that every block fits");
        let loaded = self.pool.load_from_host(&seq.blocks, hit);
        seq.holds_blocks = true;
        seq.published = hit + loaded;
        // Received blocks are published as the next step computes past them.
        let sent = seq.transferred.len();
        let matched = seq
            .blocks
            .iter()
            .zip(std::mem::take(&mut seq.transferred))
            .take_while(|(block, hash)| block.hash == *hash)
            .count();
        // The partial last block is the prefill's only if the full ones all are.
        let transferred = if matched > 0 && matched == seq.blocks.len() && matched == sent {
            std::mem::take(&mut seq.transferred_tokens).min(seq.prompt_len)
        } else {
            matched * bs
        };
        let cap = seq.prefill_target() - 1;
        let computed = ((hit + loaded) * bs).min(cap);
        let loaded_tokens = computed.saturating_sub(hit * bs);
        let received = transferred.min(cap).saturating_sub(computed);
        if first_admission {
            self.stats.offload_tokens += loaded_tokens as u64;
            self.stats.transferred_tokens += received as u64;
            self.stats.cached_tokens += received as u64;
            self.stats.classes[seq.priority.class() as usize].cached_tokens += received as u64;
            seq.cached_tokens += received;
        }
        seq.computed = computed + received;
        self.running.push(seq);
        loaded_tokens
    }

    /// Makes room for `tokens` KV tokens of running request `index`,
    /// preempting the most recently admitted requests if needed. False when the
    /// request itself had to be preempted.
    fn reserve(&mut self, index: usize, tokens: usize) -> bool {
        let bs = self.config.block_size;
        loop {
            let seq = &self.running[index];
            let needed = tokens.div_ceil(bs).saturating_sub(seq.blocks.len());
            if seq.private >= needed {
                return true;
            }
            if self.pool.alloc_private().is_ok() {
                self.running[index].private += 1;
                continue;
            }
            let mut victim = self.running.pop().expect("index is in range");
            let was_self = self.running.len() == index;
            self.release(&mut victim);
            victim.computed = 0;
            victim.published = 0;
            self.stats.preemptions += 1;
            self.waiting.push_front(victim);
            if was_self {
                return false;
            }
        }
    }

    fn release(&mut self, seq: &mut Seq) {
        if seq.holds_blocks {
            self.pool.release_prompt(&seq.blocks);
            seq.holds_blocks = false;
        }
        self.pool.release_private(seq.private);
        seq.private = 0;
    }

    #[cfg(test)]
    pub(crate) fn pool(&self) -> &KvPool {
        &self.pool
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(kv_blocks: usize) -> EngineConfig {
        EngineConfig {
            kv_blocks,
            block_size: 4,
            max_num_seqs: 8,
            max_num_batched_tokens: 64,
            ..EngineConfig::default()
        }
    }

    /// Steps until idle; returns every emission.
    fn run(engine: &mut Engine) -> Vec<Emitted> {
        let mut out = Vec::new();
        for _ in 0..10_000 {
            match engine.step() {
                Some(step) => out.extend(step.emitted),
                None => return out,
            }
            engine.pool().check();
        }
        panic!("the engine never became idle");
    }

    fn tokens(range: std::ops::Range<u32>) -> Vec<u32> {
        range.collect()
    }

    #[test]
    fn a_shared_prefix_is_a_hit_and_stored_events_chain_parents() {
        let mut engine = Engine::new(config(64)).unwrap();
        assert_eq!(engine.take_events(), [PoolEvent::Cleared]);
        engine.submit(&tokens(0..16), 2).unwrap();
        let first = run(&mut engine);
        assert_eq!(first.last().unwrap().cached_tokens, 0);
        let events = engine.take_events();
        let stored: Vec<_> = events
            .iter()
            .filter_map(|e| match e {
                PoolEvent::Stored { parent, hash, .. } => Some((*parent, *hash)),
                _ => None,
            })
            .collect();
        assert_eq!(stored.len(), 4);
        assert_eq!(stored[0].0, None);
        for pair in stored.windows(2) {
            assert_eq!(pair[1].0, Some(pair[0].1), "each block names its parent");
        }
        // 12 shared tokens (3 blocks) then different ones.
        let mut prompt = tokens(0..12);
        prompt.extend(100..110);
        engine.submit(&prompt, 1).unwrap();
        let second = run(&mut engine);
        assert_eq!(second[0].cached_tokens, 12);
        let stats = engine.stats();
        assert_eq!(stats.prompt_tokens, 16 + 22);
        assert_eq!(stats.cached_tokens, 12);
        assert_eq!(stats.computed_prompt_tokens, 16 + 10);
    }

    #[test]
    fn waiting_requests_report_only_their_uncached_prefill() {
        let mut engine = Engine::new(config(64)).unwrap();
        engine.submit(&tokens(0..16), 1).unwrap();
        run(&mut engine);
        // 12 of this prompt's 16 tokens are cached; the other prompt is cold.
        let mut warm = tokens(0..12);
        warm.extend(200..204);
        engine.submit(&warm, 1).unwrap();
        engine.submit(&tokens(300..316), 1).unwrap();
        let load = engine.load();
        assert_eq!(load.waiting, 2);
        assert_eq!(load.prefill_tokens, 4 + 16);
    }

    #[test]
    fn a_held_prefill_keeps_its_blocks_until_released_and_a_decode_receives_them() {
        let mut prefill = Engine::new(config(64)).unwrap();
        let prompt = tokens(0..18); // 4 full blocks and a partial one
        let hold = Handoff {
            hold: true,
            ..Handoff::default()
        };
        let seq = prefill
            .submit_handoff(&prompt, 1, &ExtraKeys::default(), Priority::Normal, hold)
            .unwrap();
        run(&mut prefill);
        assert_eq!(prefill.load().kv_blocks_used, 5, "held after finishing");
        let (hashes, prompt_tokens) = prefill.held_prompt(seq).unwrap();
        assert_eq!((hashes.len(), prompt_tokens), (4, 18));
        assert_eq!(prefill.release_held(seq), 5);
        assert_eq!(prefill.load().kv_blocks_used, 0);
        assert_eq!(prefill.release_held(seq), 0, "released once");
        prefill.pool().check();

        let mut decode = Engine::new(config(64)).unwrap();
        decode.take_events();
        let received = Handoff {
            hold: false,
            transferred: hashes.clone(),
            transferred_tokens: prompt_tokens,
        };
        decode
            .submit_handoff(
                &prompt,
                2,
                &ExtraKeys::default(),
                Priority::Normal,
                received,
            )
            .unwrap();
        let out = run(&mut decode);
        assert_eq!(
            out[0].cached_tokens, 17,
            "the whole prompt less its last token"
        );
        let stats = decode.stats();
        assert_eq!(
            (stats.transferred_tokens, stats.computed_prompt_tokens),
            (17, 1)
        );
        let stored = decode
            .take_events()
            .iter()
            .filter(|e| matches!(e, PoolEvent::Stored { .. }))
            .count();
        assert_eq!(
            stored, 4,
            "received blocks are announced as the decode's own"
        );

        // Blocks of another prompt are not this one's: recomputed.
        let mut other = Engine::new(config(64)).unwrap();
        let mismatched = Handoff {
            hold: false,
            transferred: hashes[1..].to_vec(),
            transferred_tokens: prompt_tokens,
        };
        other
            .submit_handoff(
                &prompt,
                1,
                &ExtraKeys::default(),
                Priority::Normal,
                mismatched,
            )
            .unwrap();
        assert_eq!(run(&mut other)[0].cached_tokens, 0);
        assert_eq!(other.stats().computed_prompt_tokens, 18);
    }

    #[test]
    fn a_full_hit_still_computes_one_token() {
        let mut engine = Engine::new(config(64)).unwrap();
        engine.submit(&tokens(0..16), 1).unwrap();
        run(&mut engine);
        engine.submit(&tokens(0..16), 1).unwrap();
        let out = run(&mut engine);
        assert_eq!(out[0].cached_tokens, 16);
        assert_eq!(engine.stats().computed_prompt_tokens, 17);
    }

    #[test]
    fn eviction_follows_the_policy_and_announces_removed() {
        // 8 blocks: two 4-block prompts fill the pool, a third evicts the LRU one.
        let mut engine = Engine::new(config(8)).unwrap();
        for start in [0, 1000, 2000] {
            engine.submit(&tokens(start..start + 16), 1).unwrap();
            run(&mut engine);
        }
        let removed = engine
            .take_events()
            .iter()
            .filter(|e| matches!(e, PoolEvent::Removed { .. }))
            .count();
        assert_eq!(removed, 4);
        assert_eq!(engine.evictions(), 4);
        // The first prompt was evicted, the second is still cached.
        engine.submit(&tokens(1000..1016), 1).unwrap();
        assert_eq!(run(&mut engine)[0].cached_tokens, 16);
        engine.submit(&tokens(0..16), 1).unwrap();
        assert_eq!(run(&mut engine)[0].cached_tokens, 0);
    }

    /// What a router learns from the events: the announced blocks. Panics on
    /// an event that contradicts it.
    fn apply(view: &mut std::collections::BTreeSet<u64>, events: Vec<PoolEvent>) {
        for event in events {
            match event {
                PoolEvent::Stored { hash, .. } => assert!(view.insert(hash), "stored twice"),
                PoolEvent::Removed { hash } => assert!(view.remove(&hash), "removed unknown"),
                PoolEvent::Cleared => view.clear(),
                // The host tier's: another set (see `evicted_blocks_are_loaded_from_the_host_tier`).
                PoolEvent::HostStored { .. } | PoolEvent::HostRemoved { .. } => {}
            }
        }
    }

    #[test]
    fn evicted_blocks_are_loaded_from_the_host_tier_instead_of_prefilled() {
        for kind in [EngineKind::Vllm, EngineKind::Sglang] {
            host_tier_round_trip(kind);
        }
    }

    fn host_tier_round_trip(kind: EngineKind) {
        let with_host = |offload_blocks| {
            Engine::new(EngineConfig {
                offload_blocks,
                kind,
                ..config(4)
            })
            .unwrap()
        };
        let a = tokens(0..13); // 3 full blocks
        let b = tokens(100..113);
        let mut engine = with_host(8);
        let mut plain = with_host(0);
        for e in [&mut engine, &mut plain] {
            e.submit(&a, 1).unwrap();
            run(e);
            // b's blocks take a's slots: a's are evicted.
            e.submit(&b, 1).unwrap();
            run(e);
        }
        let a_hashes = prompt_hashes(&engine, &a);
        let events = engine.take_events();
        // Each evicted block was copied to the host tier, parents first.
        let copied: Vec<(Option<u64>, u64)> = events
            .iter()
            .filter_map(|e| match e {
                PoolEvent::HostStored { parent, hash, .. } => Some((*parent, *hash)),
                _ => None,
            })
            .collect();
        assert_eq!(
            copied,
            [
                (None, a_hashes[0]),
                (Some(a_hashes[0]), a_hashes[1]),
                (Some(a_hashes[1]), a_hashes[2])
            ]
        );
        engine.pool().check();
        // a again: no GPU hit, its 3 blocks loaded, only the last token computed.
        engine.submit(&a, 1).unwrap();
        plain.submit(&a, 1).unwrap();
        let step = engine.step().unwrap();
        let plain_step = plain.step().unwrap();
        assert_eq!(step.batch.loaded_tokens, 12);
        assert_eq!(step.batch.prefill_tokens, 1);
        assert_eq!(plain_step.batch.prefill_tokens, 13);
        assert!(step.duration < plain_step.duration);
        run(&mut engine);
        assert_eq!(engine.stats().cached_tokens, 0);
        assert_eq!(engine.stats().offload_tokens, 12);
        // Loaded blocks are GPU blocks again, announced on the device tier.
        let stored: Vec<u64> = engine
            .take_events()
            .iter()
            .filter_map(|e| match e {
                PoolEvent::Stored { hash, .. } => Some(*hash),
                _ => None,
            })
            .collect();
        assert_eq!(stored, a_hashes[..3]);
        // A dump holds both tiers.
        let dump = engine.dump();
        assert!(dump.contains(&PoolEvent::HostStored {
            parent: None,
            hash: a_hashes[0],
            local: engine.hasher.local_hashes_with(&a, &ExtraKeys::default())[0],
        }));
    }

    fn prompt_hashes(engine: &Engine, prompt: &[u32]) -> Vec<u64> {
        sequence_hashes(
            &engine
                .hasher
                .local_hashes_with(prompt, &ExtraKeys::default()),
        )
    }

    #[test]
    fn switching_policy_keeps_every_cached_block_and_sends_no_event() {
        for (from, to) in [
            (PolicyKind::Lru, PolicyKind::S3Fifo),
            (PolicyKind::S3Fifo, PolicyKind::Arc),
            (PolicyKind::Arc, PolicyKind::Predictive),
            (PolicyKind::Predictive, PolicyKind::Qos),
            (PolicyKind::Qos, PolicyKind::Lru),
        ] {
            let mut engine = Engine::new(EngineConfig {
                eviction: from,
                ..config(40)
            })
            .unwrap();
            let mut view = std::collections::BTreeSet::new();
            for start in [0, 1000, 2000, 3000, 4000, 5000] {
                engine.submit(&tokens(start..start + 24), 1).unwrap();
                run(&mut engine);
            }
            apply(&mut view, engine.take_events());
            let before = engine.pool().cached_blocks();
            assert!(!before.is_empty());
            assert_eq!(engine.set_eviction_policy(to).unwrap(), from);
            assert_eq!(engine.pool().cached_blocks(), before, "{from} -> {to}");
            assert_eq!(engine.take_events(), [], "{from} -> {to}");
            engine.pool().check();
            // The carried-over blocks still hit, and the events stay consistent.
            let hashes = prompt_hashes(&engine, &tokens(5000..5024));
            let resident = hashes.iter().take_while(|h| before.contains(h)).count();
            assert!(from == PolicyKind::S3Fifo || resident == 6, "{from}");
            engine.submit(&tokens(5000..5024), 1).unwrap();
            let hit = run(&mut engine)[0].cached_tokens as usize;
            assert_eq!(hit, resident * 4, "{from} -> {to}");
            for start in [6000, 7000, 8000, 0] {
                engine.submit(&tokens(start..start + 24), 1).unwrap();
                run(&mut engine);
            }
            apply(&mut view, engine.take_events());
            assert_eq!(view, engine.pool().published_blocks(), "{from} -> {to}");
            engine.pool().check();
        }
        let mut engine = Engine::new(config(8)).unwrap();
        assert!(engine.set_eviction_policy(PolicyKind::Belady).is_err());
        assert_eq!(engine.eviction_policy(), PolicyKind::Lru);
        // SGLang's radix cache only evicts leaf-first LRU: a switch is refused.
        let mut engine = Engine::new(EngineConfig {
            kind: EngineKind::Sglang,
            ..config(8)
        })
        .unwrap();
        assert!(engine.set_eviction_policy(PolicyKind::Arc).is_err());
        assert_eq!(engine.eviction_policy(), PolicyKind::Lru);
    }

    #[test]
    fn qos_evicts_low_before_normal_before_high_then_lru() {
        // 12 blocks: three 4-block prompts fill the pool, oldest first: high, low, normal.
        let mut engine = Engine::new(EngineConfig {
            eviction: PolicyKind::Qos,
            ..config(12)
        })
        .unwrap();
        let none = ExtraKeys::default();
        let removed = |engine: &mut Engine| -> Vec<u64> {
            let mut out: Vec<u64> = engine
                .take_events()
                .into_iter()
                .filter_map(|e| match e {
                    PoolEvent::Removed { hash } => Some(hash),
                    _ => None,
                })
                .collect();
            out.sort_unstable();
            out
        };
        for (start, priority) in [
            (0, Priority::High),
            (100, Priority::Low),
            (200, Priority::Normal),
        ] {
            engine
                .submit_prioritized(&tokens(start..start + 16), 1, &none, priority)
                .unwrap();
            run(&mut engine);
        }
        removed(&mut engine);
        // Each new high prompt needs 4 slots: first the low prompt goes, then
        // the normal one, then the oldest high one (LRU within the class).
        for (new, gone) in [(300, 100), (400, 200), (500, 0)] {
            engine
                .submit_prioritized(&tokens(new..new + 16), 1, &none, Priority::High)
                .unwrap();
            run(&mut engine);
            let mut want = prompt_hashes(&engine, &tokens(gone..gone + 16));
            want.sort_unstable();
            assert_eq!(removed(&mut engine), want, "prompt {gone} goes");
        }
        let classes = engine.stats().classes;
        assert_eq!(classes[Priority::High as usize].requests, 4);
        assert_eq!(classes[Priority::Low as usize].requests, 1);
        assert_eq!(classes[Priority::Normal as usize].requests, 1);
    }

    #[test]
    fn eviction_log_and_figures_count_each_decision_and_re_prefill() {
        let mut engine = Engine::new(config(8)).unwrap();
        engine.log_evictions(true);
        for start in [0, 1000, 2000, 0] {
            engine.submit(&tokens(start..start + 16), 1).unwrap();
            run(&mut engine);
        }
        let log = engine.take_eviction_log();
        assert_eq!(log.len() as u64, engine.evictions());
        assert!(log.iter().all(|r| r.policy == PolicyKind::Lru
            && r.blocks_freed == 1
            && r.reason == crate::eviction::Reason::Prefill));
        let figures = &engine.eviction_figures()[0];
        assert_eq!(figures.evictions, 8);
        // The first prompt's 4 blocks were evicted, then asked for again.
        assert_eq!(figures.re_prefilled_blocks, 4);
        assert_eq!(figures.re_prefill_rate, 0.5);
        assert_eq!(figures.requests, 4);
        assert!(figures.jain_fairness < 1.0 && figures.jain_fairness > 0.0);
        assert!(figures.throughput_lost > 0.0 && figures.memory_utilisation > 0.5);
        assert!(engine.take_eviction_log().is_empty());
    }

    #[test]
    fn a_finished_chain_is_evicted_tail_first() {
        // 6 blocks: a 4-block chain, then an unrelated 4-block prompt takes two
        // of its slots. Given back tail first, the chain keeps its first two
        // blocks (given back root first, it would keep nothing usable).
        let mut engine = Engine::new(config(6)).unwrap();
        engine.submit(&tokens(0..16), 1).unwrap();
        run(&mut engine);
        engine.submit(&tokens(1000..1016), 1).unwrap();
        run(&mut engine);
        engine.submit(&tokens(0..16), 1).unwrap();
        assert_eq!(run(&mut engine)[0].cached_tokens, 8);
    }

    #[test]
    fn sglang_mode_never_evicts_a_running_request_and_never_cuts_a_chain() {
        let mut engine = Engine::new(EngineConfig {
            kind: EngineKind::Sglang,
            ..config(16)
        })
        .unwrap();
        let long = engine.submit(&tokens(0..12), 12).unwrap();
        engine.step().unwrap();
        let held: Vec<u64> = engine.running[0].blocks.iter().map(|b| b.hash).collect();
        assert_eq!(engine.running[0].id, long);
        // Six 3-block prompts through the 16 slots the long request shares.
        for i in 0..6 {
            let start = 1000 * (i + 1);
            let id = engine.submit(&tokens(start..start + 12), 1).unwrap();
            loop {
                let step = engine.step().unwrap();
                engine.pool().check();
                assert!(held.iter().all(|&h| engine.pool().is_held(h)));
                if step.emitted.iter().any(|e| e.seq == id && e.finished) {
                    break;
                }
            }
        }
        assert!(engine.evictions() > 0);
        run(&mut engine);
        // Every eviction took a leaf: each Removed block's parent was still
        // held, or removed after it.
        let mut removed = Vec::new();
        for event in engine.take_events() {
            if let PoolEvent::Removed { hash } = event {
                removed.push(hash);
            }
        }
        let mut parents = std::collections::HashMap::new();
        for seq_start in (0..7).map(|i| 1000 * i) {
            let seq_tokens = tokens(seq_start..seq_start + 12);
            let locals = engine
                .hasher
                .local_hashes_with(&seq_tokens, &ExtraKeys::default());
            let hashes = sequence_hashes(&locals);
            for pair in hashes.windows(2) {
                parents.insert(pair[1], pair[0]);
            }
        }
        for (i, hash) in removed.iter().enumerate() {
            if let Some(parent) = parents.get(hash) {
                assert!(
                    !removed[..i].contains(parent),
                    "{hash} removed after its parent"
                );
            }
        }
    }

    #[test]
    fn sglang_mode_refuses_policies_other_than_lru() {
        let err = Engine::new(EngineConfig {
            kind: EngineKind::Sglang,
            eviction: PolicyKind::S3Fifo,
            ..config(16)
        })
        .err()
        .unwrap()
        .to_string();
        assert!(
            err.contains("--engine sglang") && err.contains("s3fifo"),
            "{err}"
        );
    }

    #[test]
    fn chunked_prefill_spreads_a_long_prompt_over_steps() {
        let mut engine = Engine::new(EngineConfig {
            max_num_batched_tokens: 32,
            ..config(64)
        })
        .unwrap();
        engine.submit(&tokens(0..100), 2).unwrap();
        let mut steps_to_first = 0;
        loop {
            let step = engine.step().unwrap();
            steps_to_first += 1;
            assert!(step.batch.prefill_tokens <= 32);
            if !step.emitted.is_empty() {
                break;
            }
        }
        assert_eq!(steps_to_first, 4, "100 tokens in chunks of 32");
        let decode = engine.step().unwrap();
        assert_eq!(decode.batch.decode_seqs, 1);
        assert!(decode.emitted[0].finished);
    }

    #[test]
    fn max_num_seqs_bounds_the_batch() {
        let mut engine = Engine::new(EngineConfig {
            max_num_seqs: 2,
            ..config(64)
        })
        .unwrap();
        for i in 0..5 {
            engine.submit(&tokens(i * 100..i * 100 + 4), 3).unwrap();
        }
        engine.step().unwrap();
        assert_eq!(engine.load().running, 2);
        assert_eq!(engine.load().waiting, 3);
        assert_eq!(run(&mut engine).iter().filter(|e| e.finished).count(), 5);
    }

    #[test]
    fn running_out_of_blocks_preempts_and_everything_still_finishes() {
        // 6 blocks of 4 tokens; two requests of 8 prompt tokens each want 16 tokens of output.
        let mut engine = Engine::new(config(6)).unwrap();
        engine.submit(&tokens(0..8), 12).unwrap();
        engine.submit(&tokens(100..108), 12).unwrap();
        let out = run(&mut engine);
        assert_eq!(out.iter().filter(|e| e.finished).count(), 2);
        assert!(engine.stats().preemptions > 0);
        assert_eq!(engine.load().kv_blocks_used, 0);
    }

    #[test]
    fn requests_that_cannot_fit_or_are_empty_are_refused() {
        let mut engine = Engine::new(config(4)).unwrap();
        let err = engine.submit(&tokens(0..16), 2).unwrap_err().to_string();
        assert!(err.contains("need 5 KV blocks"), "{err}");
        assert!(engine.submit(&[], 1).is_err());
        assert!(engine.submit(&[1], 0).is_err());
        assert!(
            Engine::new(EngineConfig {
                eviction: PolicyKind::Belady,
                ..config(4)
            })
            .is_err()
        );
    }

    #[test]
    fn abort_and_clear_release_every_block() {
        let mut engine = Engine::new(config(64)).unwrap();
        let a = engine.submit(&tokens(0..40), 50).unwrap();
        engine.submit(&tokens(100..140), 50).unwrap();
        engine.step().unwrap();
        engine.abort(a);
        engine.pool().check();
        assert_eq!(engine.load().running, 1);
        engine.take_events();
        assert_eq!(engine.clear().unwrap().len(), 1);
        assert_eq!(engine.take_events(), [PoolEvent::Cleared]);
        assert_eq!(engine.load().kv_blocks_used, 0);
        assert_eq!(engine.dump(), []);
    }

    #[test]
    fn cost_grows_with_the_prefill_actually_computed() {
        let mut engine = Engine::new(config(64)).unwrap();
        engine.submit(&tokens(0..60), 1).unwrap();
        let cold = engine.step().unwrap().duration;
        engine.submit(&tokens(0..60), 1).unwrap();
        let warm = engine.step().unwrap().duration;
        assert!(cold > warm, "{cold:?} vs {warm:?}");
    }
}
