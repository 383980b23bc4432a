//! The event-fed index of which worker holds which block.
//!
//! A worker's state is the set of blocks it holds, each identified by a chain
//! key computed like the *sequence hash* (see [`crate::hash`]) from the blocks'
//! local hashes, which names a block together with its whole prefix. The engine's own block hashes are kept only as opaque ids, per
//! worker, to resolve `Removed` events and chain parents.
//!
//! Layout (see DESIGN.md): distinct blocks live once in the sharded [`crate::table`]
//! with a bitset of the interned workers holding them; each worker keeps, behind
//! its own lock, the map from its engine hashes to those blocks. Events of one
//! worker are applied under that worker's lock, so different workers ingest in
//! parallel and contend only on the shards they share. Lookups take shard read
//! locks only, at most two per request.
//!
//! With `max_blocks`, an [`crate::lru`] order evicts least-recently-used leaf
//! blocks when the index holds more memberships than the limit.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, RwLock};

use crate::event::{
    ApplyOutcome, EventKind, EventStatus, EventType, KvEvent, StoredBlock, WorkerKey,
};
use crate::lru::{Cursor, Lru};
use crate::table::{
    BlockRef, HolderSet, NO_PARENT, ShardReader, ShardWriter, Table, bits, map_bytes, path_refs,
    shrink_sparse,
};

/// Limits of the index.
#[derive(Clone, Debug, Default)]
pub struct IndexConfig {
    /// Most (worker, block) memberships kept; none: unbounded.
    pub max_blocks: Option<usize>,
}

/// How far one worker's cache covers a request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WorkerMatch {
    pub worker: WorkerKey,
    /// Leading blocks of the request that the worker holds, all of them contiguous from block 0.
    pub depth: u32,
    /// All blocks the worker holds, for tie-breaks.
    pub total_blocks: u64,
}

/// A worker's whole state, as `Stored` events, parents before children.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WorkerDump {
    pub last_event_id: Option<u64>,
    pub events: Vec<EventKind>,
}

/// Counters and sizes, for metrics.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct IndexStats {
    pub workers: u64,
    /// Distinct blocks held by at least one worker.
    pub blocks: u64,
    /// (worker, block) pairs.
    pub memberships: u64,
    /// Events offered, by type and status.
    pub events: Vec<(EventType, EventStatus, u64)>,
    pub rejected_blocks: u64,
    pub unknown_removals: u64,
}

/// Mixes engine block hashes, which are opaque and may be small or structured.
#[derive(Default)]
struct EngineHasher(u64);

impl Hasher for EngineHasher {
    fn finish(&self) -> u64 {
        let z = self.0.wrapping_mul(0x9E37_79B9_7F4A_7C15);
        z ^ (z >> 29)
    }
    fn write(&mut self, _: &[u8]) {
        unreachable!("EngineHasher only hashes integers")
    }
    fn write_u64(&mut self, n: u64) {
        self.0 = self.0.rotate_left(26) ^ n;
    }
    fn write_u32(&mut self, n: u32) {
        self.write_u64(u64::from(n));
    }
}

/// Outcome counts of one worker, folded into the index's on removal.
#[derive(Clone, Default)]
struct Counters {
    events: [[u64; EventStatus::ALL.len()]; EventType::ALL.len()],
    rejected_blocks: u64,
    unknown_removals: u64,
}

impl Counters {
    fn count(&mut self, kind: EventType, outcome: ApplyOutcome) {
        self.events[kind as usize][outcome.status() as usize] += 1;
        if let ApplyOutcome::Applied {
            rejected_blocks,
            unknown_removals,
        } = outcome
        {
            self.rejected_blocks += rejected_blocks;
            self.unknown_removals += unknown_removals;
        }
    }

    fn add(&mut self, other: &Counters) {
        for (row, other_row) in self.events.iter_mut().zip(&other.events) {
            for (n, m) in row.iter_mut().zip(other_row) {
                *n += m;
            }
        }
        self.rejected_blocks += other.rejected_blocks;
        self.unknown_removals += other.unknown_removals;
    }
}

/// One worker: its interned index and, behind its lock, its event state.
struct WorkerSlot {
    key: WorkerKey,
    idx: u32,
    /// The block of counters holding this worker's: blocks whose bit is set
    /// for it (its memberships). Read without locks; written only through
    /// [`WorkerSlot::add_held`].
    held: Arc<HeldCounters>,
    /// Engine-hash entries whose block was evicted, not yet swept from `state`.
    dangling: AtomicU64,
    state: Mutex<WorkerState>,
}

/// The `held` counters of 64 consecutive worker indices side by side, so that a
/// lookup returning thousands of workers reads them without a pointer chase
/// per worker.
struct HeldCounters([AtomicU64; 64]);

impl HeldCounters {
    fn new() -> Self {
        HeldCounters(std::array::from_fn(|_| AtomicU64::new(0)))
    }
}

impl WorkerSlot {
    fn held(&self) -> &AtomicU64 {
        &self.held.0[self.idx as usize % 64]
    }

    /// Adds `delta` to `held` with a plain load and store, not a locked
    /// read-modify-write (one per block op was a large share of ingest cost):
    /// writers of `held` are serialised. Without a limit only the worker's own
    /// event writer (holding its mutex) changes it; with a limit every writer,
    /// the evictor included, holds the eviction mutex.
    fn add_held(&self, delta: i64) {
        if delta != 0 {
            let held = self.held().load(Ordering::Relaxed);
            self.held()
                .store(held.wrapping_add_signed(delta), Ordering::Relaxed);
        }
    }
}

#[derive(Default)]
struct WorkerState {
    last_event_id: Option<u64>,
    /// Engine block hash → the block it names.
    blocks: HashMap<u64, BlockRef, BuildHasherDefault<EngineHasher>>,
    counters: Counters,
}

/// Shards of the worker registry: ingest threads applying different workers'
/// events then rarely share the lock's cache line.
const REGISTRY_SHARDS: usize = 16;

type WorkerMap = HashMap<WorkerKey, Arc<WorkerSlot>, BuildHasherDefault<EngineHasher>>;

/// Interned worker indices. Indices are reused smallest first, so a fleet of up
/// to 63 ranks stays in the blocks' inline bitsets.
#[derive(Default)]
struct Indices {
    by_idx: Vec<Option<Arc<WorkerSlot>>>,
    /// The key of each index (stale where free), and the held counters by 64
    /// indices: dense, for lookups' results.
    keys: Vec<WorkerKey>,
    held: Vec<Arc<HeldCounters>>,
    free: BinaryHeap<Reverse<u32>>,
}

/// The `max_blocks` limit's state; writers hold it for a whole event.
struct Eviction {
    lru: Lru,
    memberships: u64,
    max_memberships: u64,
    evicted_blocks: u64,
}

/// The global index. All methods take `&self` and may be called from many threads.
pub struct KvIndex {
    table: Table,
    /// Workers by key, sharded by key.
    registry: Box<[RwLock<WorkerMap>]>,
    indices: RwLock<Indices>,
    eviction: Option<Mutex<Eviction>>,
    /// Counters of removed workers.
    retired: Mutex<Counters>,
}

impl Default for KvIndex {
    fn default() -> Self {
        Self::new(IndexConfig::default())
    }
}

impl KvIndex {
    pub fn new(config: IndexConfig) -> Self {
        Self {
            table: Table::new(),
            registry: (0..REGISTRY_SHARDS).map(|_| RwLock::default()).collect(),
            indices: RwLock::default(),
            eviction: config.max_blocks.map(|max| {
                Mutex::new(Eviction {
                    lru: Lru::default(),
                    memberships: 0,
                    max_memberships: max as u64,
                    evicted_blocks: 0,
                })
            }),
            retired: Mutex::default(),
        }
    }

    /// Offers one event of `worker`; see [`ApplyOutcome`].
    pub fn apply(&self, worker: WorkerKey, event: &KvEvent) -> ApplyOutcome {
        self.with_slot(worker, |slot| {
            let mut state = slot.state.lock().unwrap();
            let outcome = match state.last_event_id {
                Some(last) if event.event_id <= last => ApplyOutcome::Stale { last_applied: last },
                Some(last) if event.event_id > last + 1 => ApplyOutcome::Gap {
                    expected: last + 1,
                    got: event.event_id,
                },
                _ => {
                    state.last_event_id = Some(event.event_id);
                    let mut eviction = self.lock_eviction();
                    self.sweep_dangling(slot, &mut state, eviction.is_some());
                    let outcome = self.apply_kind(slot, &mut state, &event.kind, &mut eviction);
                    if let Some(eviction) = eviction.as_deref_mut() {
                        self.evict_over_limit(eviction);
                    }
                    outcome
                }
            };
            state.counters.count(event.kind.type_name(), outcome);
            outcome
        })
    }

    /// Forgets `worker` entirely, its event sequence included.
    pub fn remove_worker(&self, worker: WorkerKey) {
        let Some(slot) = self.registry_shard(worker).write().unwrap().remove(&worker) else {
            return;
        };
        {
            let mut state = slot.state.lock().unwrap();
            let mut eviction = self.lock_eviction();
            self.clear(&slot, &mut state, &mut eviction);
            self.retired.lock().unwrap().add(&state.counters);
        }
        let mut indices = self.indices.write().unwrap();
        indices.by_idx[slot.idx as usize] = None;
        indices.free.push(Reverse(slot.idx));
    }

    /// Replaces `worker`'s state with a dump: `Stored` events, parents first, as
    /// of `last_event_id`. Returns the blocks it could not place: those whose
    /// parent the dump did not hold.
    pub fn replace_worker(
        &self,
        worker: WorkerKey,
        last_event_id: u64,
        events: &[EventKind],
    ) -> u64 {
        self.with_slot(worker, |slot| {
            let mut state = slot.state.lock().unwrap();
            let mut eviction = self.lock_eviction();
            self.clear(slot, &mut state, &mut eviction);
            state.last_event_id = Some(last_event_id);
            let mut orphans = 0;
            for kind in events {
                if let ApplyOutcome::Applied {
                    rejected_blocks, ..
                } = self.apply_kind(slot, &mut state, kind, &mut eviction)
                {
                    orphans += rejected_blocks;
                }
            }
            if let Some(eviction) = eviction.as_deref_mut() {
                self.evict_over_limit(eviction);
            }
            orphans
        })
    }

    /// `worker`'s blocks reachable from the root through blocks it holds, as
    /// single-block `Stored` events, parents first.
    pub fn dump(&self, worker: WorkerKey) -> Option<WorkerDump> {
        let slot = self.find_slot(worker)?;
        let state = slot.state.lock().unwrap();
        let mut held: Vec<(u64, BlockRef)> = state.blocks.iter().map(|(&e, &r)| (e, r)).collect();
        held.sort_unstable_by_key(|&(engine, r)| (r.shard(), engine));
        // Block key → (the engine hashes naming it, tokens hash); parent key → children.
        let mut blocks: HashMap<u64, Vec<(u64, u64)>> = HashMap::new();
        let mut children: HashMap<u64, Vec<u64>> = HashMap::new();
        let mut reader = ShardReader::new(&self.table);
        for (engine, r) in held {
            let shard = reader.shard(r.shard());
            if !shard.holds(r.key(), slot.idx) {
                continue;
            }
            let Some(&entry) = shard.entries.get(&r.key()) else {
                continue;
            };
            let names = blocks.entry(r.key()).or_default();
            if names.is_empty() {
                children.entry(entry.parent).or_default().push(r.key());
            }
            names.push((engine, entry.tokens_hash));
        }
        drop(reader);
        let mut events = Vec::new();
        let mut frontier = vec![(NO_PARENT, None)];
        while let Some((parent_seq, parent_engine)) = frontier.pop() {
            for seq in children.remove(&parent_seq).into_iter().flatten() {
                for &(engine, tokens_hash) in &blocks[&seq] {
                    events.push(EventKind::Stored {
                        parent_hash: parent_engine,
                        blocks: vec![StoredBlock {
                            block_hash: engine,
                            tokens_hash,
                        }],
                    });
                }
                frontier.push((seq, Some(blocks[&seq][0].0)));
            }
        }
        Some(WorkerDump {
            last_event_id: state.last_event_id,
            events,
        })
    }

    pub fn last_event_id(&self, worker: WorkerKey) -> Option<u64> {
        let slot = self.find_slot(worker)?;
        slot.state.lock().unwrap().last_event_id
    }

    /// Workers the index knows, in no particular order.
    pub fn workers(&self) -> Vec<WorkerKey> {
        self.slots().iter().map(|s| s.key).collect()
    }

    pub fn worker_blocks(&self, worker: WorkerKey) -> u64 {
        self.find_slot(worker)
            .map_or(0, |s| s.held().load(Ordering::Relaxed))
    }

    /// Per worker with at least one matching block: the matched depth of
    /// `local_hashes` (a request's local block hashes from block 0) and its size.
    pub fn find_matches(&self, local_hashes: &[u64]) -> Vec<WorkerMatch> {
        let (depths, seqs) = self.match_depths(local_hashes);
        if let Some(eviction) = &self.eviction {
            let deepest = depths.iter().map(|&(_, d)| d).max().unwrap_or(0);
            eviction
                .lock()
                .unwrap()
                .lru
                .touch(&seqs[..deepest as usize]);
        }
        if depths.is_empty() {
            return Vec::new();
        }
        let indices = self.indices.read().unwrap();
        let mut matches = Vec::with_capacity(depths.len());
        matches.extend(depths.into_iter().filter_map(|(idx, depth)| {
            let i = idx as usize;
            indices.by_idx.get(i)?.as_ref()?;
            Some(WorkerMatch {
                worker: indices.keys[i],
                depth,
                total_blocks: indices.held[i / 64].0[i % 64].load(Ordering::Relaxed),
            })
        }));
        matches
    }

    /// Protects the blocks of a request's path from eviction until the guard is
    /// dropped: call it while the request is being routed. Free without `max_blocks`.
    pub fn pin_path(&self, local_hashes: &[u64]) -> PinnedPath<'_> {
        PinnedPath {
            index: self,
            seqs: self.pin_seqs(local_hashes),
        }
    }

    /// [`Self::pin_path`] for a guard that outlives the borrow: a proxied
    /// response's body holds it until the response ends.
    pub fn pin_path_owned(self: &Arc<Self>, local_hashes: &[u64]) -> OwnedPinnedPath {
        OwnedPinnedPath {
            seqs: self.pin_seqs(local_hashes),
            index: Arc::clone(self),
        }
    }

    fn pin_seqs(&self, local_hashes: &[u64]) -> Vec<u64> {
        let Some(eviction) = &self.eviction else {
            return Vec::new();
        };
        let seqs: Vec<u64> = path_refs(local_hashes).iter().map(|r| r.key()).collect();
        eviction.lock().unwrap().lru.pin(&seqs, 1);
        seqs
    }

    fn unpin_seqs(&self, seqs: &[u64]) {
        if let Some(eviction) = &self.eviction {
            eviction.lock().unwrap().lru.pin(seqs, -1);
        }
    }

    /// Heap bytes the index holds: block table, workers' engine-hash maps and the
    /// eviction order (hash tables counted by their allocated buckets).
    pub fn heap_bytes(&self) -> u64 {
        let slots = self.slots();
        let workers: u64 = slots
            .iter()
            .map(|s| size_of::<WorkerSlot>() as u64 + map_bytes(&s.state.lock().unwrap().blocks))
            .sum();
        let eviction = self
            .eviction
            .as_ref()
            .map_or(0, |e| e.lock().unwrap().lru.heap_bytes());
        self.table.heap_bytes() + workers + eviction
    }

    /// Blocks dropped by the `max_blocks` limit so far.
    pub fn evicted_blocks(&self) -> u64 {
        self.eviction
            .as_ref()
            .map_or(0, |e| e.lock().unwrap().evicted_blocks)
    }

    pub fn stats(&self) -> IndexStats {
        let slots = self.slots();
        let mut counters = self.retired.lock().unwrap().clone();
        let mut memberships = 0;
        for slot in &slots {
            memberships += slot.held().load(Ordering::Relaxed);
            counters.add(&slot.state.lock().unwrap().counters);
        }
        let mut events = Vec::new();
        for t in EventType::ALL {
            for s in EventStatus::ALL {
                let n = counters.events[t as usize][s as usize];
                if n > 0 {
                    events.push((t, s, n));
                }
            }
        }
        events.sort_by_key(|&(t, s, _)| (t.as_str(), s.as_str()));
        IndexStats {
            workers: slots.len() as u64,
            blocks: self.table.distinct_blocks(),
            memberships,
            events,
            rejected_blocks: counters.rejected_blocks,
            unknown_removals: counters.unknown_removals,
        }
    }

    /// (worker index, matched depth) for every worker holding at least block 0,
    /// and the keys of the path as deep as it was walked. One walk: keys are
    /// chained lazily, as most long requests match only a short prefix, and
    /// kept only for the LRU. The workers still matching are a bitset while
    /// they are all below 63 (any fleet of up to 63 ranks), else a sorted list.
    fn match_depths(&self, local_hashes: &[u64]) -> (Vec<(u32, u32)>, Vec<u64>) {
        enum Active {
            Bits(u64),
            Ids(Vec<u32>),
        }
        let keep_path = self.eviction.is_some();
        let mut depths = Vec::new();
        let mut path = Vec::new();
        let mut reader = ShardReader::new(&self.table);
        let mut parent = None;
        let mut active = Active::Bits(0);
        for (depth, &local) in local_hashes.iter().enumerate() {
            let r = BlockRef::child_of(parent, local);
            if keep_path {
                path.push(r.key());
            }
            parent = Some(r);
            let holders = reader.shard(r.shard()).holders(r.key());
            let depth = depth as u32;
            if depth == 0 {
                // The result is sized once, from the holders of block 0.
                active = match holders {
                    HolderSet::Bits(b) => {
                        depths.reserve(b.count_ones() as usize);
                        Active::Bits(b)
                    }
                    other => {
                        let ids = other.ids();
                        depths.reserve(ids.len());
                        Active::Ids(ids)
                    }
                };
                if matches!(&active, Active::Bits(0))
                    || matches!(&active, Active::Ids(ids) if ids.is_empty())
                {
                    return (depths, path);
                }
                continue;
            }
            let left = match &mut active {
                Active::Bits(set) => {
                    let still = holders.mask(*set);
                    depths.extend(bits(*set & !still, 0).map(|i| (i, depth)));
                    *set = still;
                    still != 0
                }
                Active::Ids(ids) => {
                    ids.retain(|&i| {
                        let keep = holders.contains(i);
                        if !keep {
                            depths.push((i, depth));
                        }
                        keep
                    });
                    !ids.is_empty()
                }
            };
            if !left {
                return (depths, path);
            }
        }
        let full = local_hashes.len() as u32;
        match active {
            Active::Bits(set) => depths.extend(bits(set, 0).map(|i| (i, full))),
            Active::Ids(ids) => depths.extend(ids.into_iter().map(|i| (i, full))),
        }
        (depths, path)
    }

    /// The workers now, for walks that lock each in turn.
    fn slots(&self) -> Vec<Arc<WorkerSlot>> {
        self.registry
            .iter()
            .flat_map(|shard| shard.read().unwrap().values().cloned().collect::<Vec<_>>())
            .collect()
    }

    fn registry_shard(&self, worker: WorkerKey) -> &RwLock<WorkerMap> {
        let h = (worker.worker_id ^ u64::from(worker.dp_rank).rotate_left(32))
            .wrapping_mul(0x9E37_79B9_7F4A_7C15);
        &self.registry[(h >> 60) as usize % REGISTRY_SHARDS]
    }

    fn find_slot(&self, worker: WorkerKey) -> Option<Arc<WorkerSlot>> {
        self.registry_shard(worker)
            .read()
            .unwrap()
            .get(&worker)
            .cloned()
    }

    /// Runs `f` on the worker's slot, creating it if needed. The registry shard's
    /// read lock is held meanwhile, so the worker cannot be removed under `f`.
    fn with_slot<R>(&self, worker: WorkerKey, f: impl FnOnce(&WorkerSlot) -> R) -> R {
        let shard = self.registry_shard(worker);
        loop {
            {
                let workers = shard.read().unwrap();
                if let Some(slot) = workers.get(&worker) {
                    return f(slot);
                }
            }
            let mut workers = shard.write().unwrap();
            if workers.contains_key(&worker) {
                continue;
            }
            let mut indices = self.indices.write().unwrap();
            let idx = match indices.free.pop() {
                Some(Reverse(idx)) => {
                    indices.keys[idx as usize] = worker;
                    idx
                }
                None => {
                    indices.by_idx.push(None);
                    indices.keys.push(worker);
                    if indices.by_idx.len() > 64 * indices.held.len() {
                        indices.held.push(Arc::new(HeldCounters::new()));
                    }
                    indices.by_idx.len() as u32 - 1
                }
            };
            let held = Arc::clone(&indices.held[idx as usize / 64]);
            held.0[idx as usize % 64].store(0, Ordering::Relaxed);
            let slot = Arc::new(WorkerSlot {
                key: worker,
                idx,
                held,
                dangling: AtomicU64::new(0),
                state: Mutex::default(),
            });
            indices.by_idx[idx as usize] = Some(slot.clone());
            workers.insert(worker, slot);
        }
    }

    fn lock_eviction(&self) -> Option<MutexGuard<'_, Eviction>> {
        self.eviction.as_ref().map(|e| e.lock().unwrap())
    }

    /// Applies one event's contents to the worker's state; returns its outcome.
    fn apply_kind(
        &self,
        slot: &WorkerSlot,
        state: &mut WorkerState,
        kind: &EventKind,
        eviction: &mut Option<MutexGuard<'_, Eviction>>,
    ) -> ApplyOutcome {
        let mut rejected_blocks = 0;
        let mut unknown_removals = 0;
        let mut held_delta = 0;
        let mut writer = ShardWriter::new(&self.table);
        match kind {
            EventKind::Stored {
                parent_hash,
                blocks,
            } => {
                let parent = match parent_hash {
                    None => Some(None),
                    Some(p) => state.blocks.get(p).map(|&r| Some(r)),
                };
                match parent {
                    None => rejected_blocks = blocks.len() as u64,
                    Some(mut parent) => {
                        let first_parent = parent;
                        let mut path = Vec::new();
                        for block in blocks {
                            let r = BlockRef::child_of(parent, block.tokens_hash);
                            let seq = r.key();
                            if let Some(old) = state.blocks.insert(block.block_hash, r)
                                && old.key() != seq
                            {
                                held_delta -= self.unhold(&mut writer, slot, old, eviction);
                            }
                            let parent_seq = parent.map_or(NO_PARENT, |p| p.key());
                            let (added, created) = writer.shard(r.shard()).insert(
                                seq,
                                block.tokens_hash,
                                parent_seq,
                                slot.idx,
                            );
                            held_delta += i64::from(added);
                            if let Some(eviction) = eviction.as_deref_mut() {
                                eviction.memberships += added as u64;
                                if created {
                                    eviction.lru.insert(seq, parent_seq);
                                }
                                path.push(seq);
                            }
                            parent = Some(r);
                        }
                        if let Some(eviction) = eviction.as_deref_mut() {
                            if let Some(p) = first_parent {
                                path.insert(0, p.key());
                            }
                            eviction.lru.touch(&path);
                        }
                    }
                }
            }
            EventKind::Removed { block_hashes } => {
                for hash in block_hashes {
                    match state.blocks.remove(hash) {
                        Some(r) => held_delta -= self.unhold(&mut writer, slot, r, eviction),
                        None => unknown_removals += 1,
                    }
                }
                shrink_sparse(&mut state.blocks);
            }
            EventKind::Cleared => {
                drop(writer);
                self.clear(slot, state, eviction);
            }
        }
        slot.add_held(held_delta);
        ApplyOutcome::Applied {
            rejected_blocks,
            unknown_removals,
        }
    }

    /// Drops every block of the worker.
    fn clear(
        &self,
        slot: &WorkerSlot,
        state: &mut WorkerState,
        eviction: &mut Option<MutexGuard<'_, Eviction>>,
    ) {
        let mut refs: Vec<BlockRef> = state.blocks.drain().map(|(_, r)| r).collect();
        refs.sort_unstable_by_key(|r| r.shard());
        let mut writer = ShardWriter::new(&self.table);
        let mut released = 0;
        for r in refs {
            released += self.unhold(&mut writer, slot, r, eviction);
        }
        slot.add_held(-released);
        state.blocks.shrink_to_fit();
        slot.dangling.store(0, Ordering::Relaxed);
    }

    /// Takes the worker's membership of one block away; returns 1 if the worker
    /// held it (for the caller to subtract from `held`), else 0.
    fn unhold(
        &self,
        writer: &mut ShardWriter<'_>,
        slot: &WorkerSlot,
        r: BlockRef,
        eviction: &mut Option<MutexGuard<'_, Eviction>>,
    ) -> i64 {
        let (held, gone) = writer.shard(r.shard()).remove(r.key(), slot.idx);
        if let Some(eviction) = eviction.as_deref_mut() {
            eviction.memberships -= held as u64;
            if gone {
                eviction.lru.remove(r.key());
            }
        }
        i64::from(held)
    }

    /// Evicts least-recently-used unpinned leaves until the limit holds, in
    /// cursor-resumed scans (one when path-touch order holds).
    fn evict_over_limit(&self, eviction: &mut Eviction) {
        if eviction.memberships <= eviction.max_memberships {
            return;
        }
        let mut writer = ShardWriter::new(&self.table);
        let mut holders = Vec::new();
        let mut cursor = Cursor::default();
        let mut evicted_this_pass = false;
        while eviction.memberships > eviction.max_memberships {
            let Some(seq) = eviction.lru.next_victim(&mut cursor) else {
                // A pass can end over the limit when evicting a leaf made its
                // parent a leaf behind the cursor: an ancestor older than its
                // descendants, as a store under an untouched ancestor leaves it.
                // Another pass then frees it; stop once a pass frees nothing.
                if !std::mem::take(&mut evicted_this_pass) {
                    break;
                }
                cursor = Cursor::default();
                continue;
            };
            evicted_this_pass = true;
            let dropped = writer.shard(BlockRef::from_key(seq).shard()).evict(seq);
            eviction.memberships -= dropped.len() as u64;
            eviction.evicted_blocks += 1;
            holders.extend(dropped);
        }
        drop(writer);
        let indices = self.indices.read().unwrap();
        for idx in holders {
            if let Some(slot) = indices.by_idx.get(idx as usize).and_then(Option::as_ref) {
                slot.add_held(-1);
                slot.dangling.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    /// Gives back the memory of engine-hash entries whose blocks were evicted,
    /// once they are at least half of the worker's entries (amortised O(1)).
    fn sweep_dangling(&self, slot: &WorkerSlot, state: &mut WorkerState, evicting: bool) {
        let dangling = slot.dangling.load(Ordering::Relaxed);
        if !evicting || dangling == 0 || (dangling as usize) * 2 < state.blocks.len() {
            return;
        }
        let mut reader = ShardReader::new(&self.table);
        state
            .blocks
            .retain(|_, r| reader.shard(r.shard()).holds(r.key(), slot.idx));
        state.blocks.shrink_to_fit();
        slot.dangling.store(0, Ordering::Relaxed);
    }
}

/// Blocks of a request being routed, protected from eviction while it lives.
pub struct PinnedPath<'a> {
    index: &'a KvIndex,
    seqs: Vec<u64>,
}

impl Drop for PinnedPath<'_> {
    fn drop(&mut self) {
        self.index.unpin_seqs(&self.seqs);
    }
}

/// A [`PinnedPath`] that owns its reference to the index.
pub struct OwnedPinnedPath {
    index: Arc<KvIndex>,
    seqs: Vec<u64>,
}

impl Drop for OwnedPinnedPath {
    fn drop(&mut self) {
        self.index.unpin_seqs(&self.seqs);
    }
}
