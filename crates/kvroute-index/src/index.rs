//! The event-fed index of which worker holds which block.
//!
//! A worker's state is the set of blocks it holds, each identified by its
//! *sequence hash* (see [`crate::hash`]), which names a block together with its
//! whole prefix. The engine's own block hashes are kept only as opaque ids, per
//! worker, to resolve `Removed` events and chain parents.
//!
//! This first implementation is deliberately simple (one lock, a linear scan over
//! workers); it fixes the API the router builds on.

use std::collections::{HashMap, HashSet};
use std::sync::RwLock;

use crate::event::{
    ApplyOutcome, EventKind, EventStatus, EventType, KvEvent, StoredBlock, WorkerKey,
};
use crate::hash::{sequence_hash, sequence_hashes};

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

#[derive(Default)]
struct WorkerState {
    last_event_id: Option<u64>,
    /// Engine block hash → (sequence hash, parent engine hash, tokens hash).
    by_engine_hash: HashMap<u64, HeldBlock>,
    /// Sequence hashes held.
    held: HashSet<u64>,
}

#[derive(Clone, Copy)]
struct HeldBlock {
    seq_hash: u64,
    parent: Option<u64>,
    tokens_hash: u64,
}

#[derive(Default)]
struct Inner {
    workers: HashMap<WorkerKey, WorkerState>,
    events: HashMap<(EventType, EventStatus), u64>,
    rejected_blocks: u64,
    unknown_removals: u64,
}

/// The global index. All methods take `&self` and may be called from many threads.
#[derive(Default)]
pub struct KvIndex {
    inner: RwLock<Inner>,
}

impl KvIndex {
    pub fn new(_config: IndexConfig) -> Self {
        Self::default()
    }

    /// Offers one event of `worker`; see [`ApplyOutcome`].
    pub fn apply(&self, worker: WorkerKey, event: &KvEvent) -> ApplyOutcome {
        let mut inner = self.inner.write().unwrap();
        let state = inner.workers.entry(worker).or_default();
        let outcome = match state.last_event_id {
            Some(last) if event.event_id <= last => ApplyOutcome::Stale { last_applied: last },
            Some(last) if event.event_id > last + 1 => ApplyOutcome::Gap {
                expected: last + 1,
                got: event.event_id,
            },
            _ => {
                state.last_event_id = Some(event.event_id);
                state.apply(&event.kind)
            }
        };
        let Inner {
            events,
            rejected_blocks,
            unknown_removals,
            ..
        } = &mut *inner;
        *events
            .entry((event.kind.type_name(), outcome.status()))
            .or_default() += 1;
        if let ApplyOutcome::Applied {
            rejected_blocks: r,
            unknown_removals: u,
        } = outcome
        {
            *rejected_blocks += r;
            *unknown_removals += u;
        }
        outcome
    }

    /// Forgets `worker` entirely, its event sequence included.
    pub fn remove_worker(&self, worker: WorkerKey) {
        self.inner.write().unwrap().workers.remove(&worker);
    }

    /// Replaces `worker`'s state with a dump: `Stored` events, parents first, as of `last_event_id`.
    pub fn replace_worker(&self, worker: WorkerKey, last_event_id: u64, events: &[EventKind]) {
        let mut inner = self.inner.write().unwrap();
        let mut state = WorkerState {
            last_event_id: Some(last_event_id),
            ..WorkerState::default()
        };
        for kind in events {
            state.apply(kind);
        }
        inner.workers.insert(worker, state);
    }

    /// `worker`'s blocks reachable from the root, as `Stored` events, parents first.
    pub fn dump(&self, worker: WorkerKey) -> Option<WorkerDump> {
        let inner = self.inner.read().unwrap();
        let state = inner.workers.get(&worker)?;
        let mut children: HashMap<Option<u64>, Vec<(u64, HeldBlock)>> = HashMap::new();
        for (&hash, block) in &state.by_engine_hash {
            children
                .entry(block.parent)
                .or_default()
                .push((hash, *block));
        }
        let mut events = Vec::new();
        let mut frontier = vec![None];
        while let Some(parent) = frontier.pop() {
            for &(hash, block) in children.get(&parent).into_iter().flatten() {
                events.push(EventKind::Stored {
                    parent_hash: parent,
                    blocks: vec![StoredBlock {
                        block_hash: hash,
                        tokens_hash: block.tokens_hash,
                    }],
                });
                frontier.push(Some(hash));
            }
        }
        Some(WorkerDump {
            last_event_id: state.last_event_id,
            events,
        })
    }

    pub fn last_event_id(&self, worker: WorkerKey) -> Option<u64> {
        self.inner
            .read()
            .unwrap()
            .workers
            .get(&worker)?
            .last_event_id
    }

    /// Workers the index knows, in no particular order.
    pub fn workers(&self) -> Vec<WorkerKey> {
        self.inner.read().unwrap().workers.keys().copied().collect()
    }

    pub fn worker_blocks(&self, worker: WorkerKey) -> u64 {
        let inner = self.inner.read().unwrap();
        inner
            .workers
            .get(&worker)
            .map_or(0, |s| s.held.len() as u64)
    }

    /// Per worker with at least one matching block: the matched depth of
    /// `local_hashes` (a request's local block hashes from block 0) and its size.
    pub fn find_matches(&self, local_hashes: &[u64]) -> Vec<WorkerMatch> {
        let seq = sequence_hashes(local_hashes);
        let inner = self.inner.read().unwrap();
        inner
            .workers
            .iter()
            .filter_map(|(&worker, state)| {
                let depth = seq.iter().take_while(|h| state.held.contains(h)).count();
                (depth > 0).then_some(WorkerMatch {
                    worker,
                    depth: depth as u32,
                    total_blocks: state.held.len() as u64,
                })
            })
            .collect()
    }

    pub fn stats(&self) -> IndexStats {
        let inner = self.inner.read().unwrap();
        let mut distinct = HashSet::new();
        let mut memberships = 0;
        for state in inner.workers.values() {
            memberships += state.held.len() as u64;
            distinct.extend(state.held.iter().copied());
        }
        let mut events: Vec<_> = inner.events.iter().map(|(&(t, s), &n)| (t, s, n)).collect();
        events.sort_by_key(|&(t, s, _)| (t.as_str(), s.as_str()));
        IndexStats {
            workers: inner.workers.len() as u64,
            blocks: distinct.len() as u64,
            memberships,
            events,
            rejected_blocks: inner.rejected_blocks,
            unknown_removals: inner.unknown_removals,
        }
    }
}

impl WorkerState {
    fn apply(&mut self, kind: &EventKind) -> ApplyOutcome {
        let mut rejected_blocks = 0;
        let mut unknown_removals = 0;
        match kind {
            EventKind::Stored {
                parent_hash,
                blocks,
            } => {
                let parent_seq = match parent_hash {
                    None => Some(None),
                    Some(p) => self.by_engine_hash.get(p).map(|b| Some(b.seq_hash)),
                };
                match parent_seq {
                    None => rejected_blocks = blocks.len() as u64,
                    Some(mut parent_seq) => {
                        let mut parent = *parent_hash;
                        for block in blocks {
                            let seq_hash = sequence_hash(parent_seq, block.tokens_hash);
                            self.by_engine_hash.insert(
                                block.block_hash,
                                HeldBlock {
                                    seq_hash,
                                    parent,
                                    tokens_hash: block.tokens_hash,
                                },
                            );
                            self.held.insert(seq_hash);
                            parent_seq = Some(seq_hash);
                            parent = Some(block.block_hash);
                        }
                    }
                }
            }
            EventKind::Removed { block_hashes } => {
                for hash in block_hashes {
                    match self.by_engine_hash.remove(hash) {
                        Some(block) => {
                            self.held.remove(&block.seq_hash);
                        }
                        None => unknown_removals += 1,
                    }
                }
            }
            EventKind::Cleared => {
                self.by_engine_hash.clear();
                self.held.clear();
            }
        }
        ApplyOutcome::Applied {
            rejected_blocks,
            unknown_removals,
        }
    }
}
