// Each test binary uses a different part of this shared support module.
#![allow(dead_code)]

//! The reference model of the index, written from the event rules of DESIGN.md
//! and `event.rs`'s documentation, not from `src/index.rs`: per worker, the
//! last applied event id and the blocks it holds, each block named by its whole
//! prefix (the list of token hashes from the root), so no hashing, no shared
//! tables and no sequencing code in common with the implementation.
//!
//! The rules it follows:
//! - a worker's first event is taken whatever its id; after that only the next
//!   id (last + 1) is applied, a lower or equal id is stale and a higher one a
//!   gap, and neither changes anything;
//! - `Stored` hangs its chain below the block its parent engine hash names (or
//!   the root); a parent hash the worker never stored, or has removed, rejects
//!   the whole event; storing an engine hash again under another prefix takes
//!   the old block away;
//! - `Removed` forgets each engine hash and takes its block away (a set: one
//!   removal is enough even if two hashes named the block); unknown hashes are
//!   counted;
//! - `Cleared` forgets everything; removing a worker forgets it entirely;
//! - a lookup's depth for a worker is the longest prefix of the request whose
//!   every block the worker holds;
//! - a dump holds the blocks whose every prefix is held.

use std::collections::{BTreeMap, BTreeSet};

use kvroute_index::{ApplyOutcome, EventKind, KvEvent, WorkerKey, WorkerMatch};

/// A block, named by the token hashes of its whole prefix, itself included.
type Path = Vec<u64>;

#[derive(Clone, Default)]
struct Worker {
    last_applied: Option<u64>,
    /// Engine hash → the block it was stored as.
    names: BTreeMap<u64, Path>,
    held: BTreeSet<Path>,
}

#[derive(Clone, Default)]
pub struct Model {
    workers: BTreeMap<WorkerKey, Worker>,
}

impl Model {
    pub fn apply(&mut self, key: WorkerKey, event: &KvEvent) -> ApplyOutcome {
        let worker = self.workers.entry(key).or_default();
        let id = event.event_id;
        if let Some(last) = worker.last_applied {
            if id <= last {
                return ApplyOutcome::Stale { last_applied: last };
            }
            if id != last + 1 {
                return ApplyOutcome::Gap {
                    expected: last + 1,
                    got: id,
                };
            }
        }
        worker.last_applied = Some(id);
        worker.apply(&event.kind)
    }

    pub fn remove_worker(&mut self, key: WorkerKey) {
        self.workers.remove(&key);
    }

    /// A resync: the worker's state becomes exactly what the dump's events build.
    pub fn replace_worker(&mut self, key: WorkerKey, last_event_id: u64, events: &[EventKind]) {
        let mut worker = Worker {
            last_applied: Some(last_event_id),
            ..Worker::default()
        };
        for kind in events {
            worker.apply(kind);
        }
        self.workers.insert(key, worker);
    }

    pub fn last_event_id(&self, key: WorkerKey) -> Option<u64> {
        self.workers.get(&key).and_then(|w| w.last_applied)
    }

    /// Blocks `key` holds.
    pub fn held(&self, key: WorkerKey) -> u64 {
        self.workers.get(&key).map_or(0, |w| w.held.len() as u64)
    }

    /// Engine hashes `key` has stored and not removed, sorted.
    pub fn engine_hashes(&self, key: WorkerKey) -> Vec<u64> {
        self.workers
            .get(&key)
            .map_or(Vec::new(), |w| w.names.keys().copied().collect())
    }

    /// Sorted by worker.
    pub fn find_matches(&self, request: &[u64]) -> Vec<WorkerMatch> {
        let mut out = Vec::new();
        for (&worker, w) in &self.workers {
            let mut depth = 0;
            while depth < request.len() && w.held.contains(&request[..=depth]) {
                depth += 1;
            }
            if depth > 0 {
                out.push(WorkerMatch {
                    worker,
                    depth: depth as u32,
                    total_blocks: w.held.len() as u64,
                });
            }
        }
        out
    }

    /// Engine hashes a dump of `key` must contain: those naming a held block
    /// whose every prefix is held too.
    pub fn dumped_engine_hashes(&self, key: WorkerKey) -> BTreeSet<u64> {
        let Some(w) = self.workers.get(&key) else {
            return BTreeSet::new();
        };
        w.names
            .iter()
            .filter(|(_, path)| (1..=path.len()).all(|n| w.held.contains(&path[..n])))
            .map(|(&engine, _)| engine)
            .collect()
    }

    pub fn memberships(&self) -> u64 {
        self.workers.values().map(|w| w.held.len() as u64).sum()
    }

    pub fn distinct_blocks(&self) -> u64 {
        let all: BTreeSet<&Path> = self.workers.values().flat_map(|w| &w.held).collect();
        all.len() as u64
    }
}

impl Worker {
    fn apply(&mut self, kind: &EventKind) -> ApplyOutcome {
        let mut rejected_blocks = 0;
        let mut unknown_removals = 0;
        match kind {
            EventKind::Stored {
                parent_hash,
                blocks,
            } => {
                let below = match parent_hash {
                    None => Some(Vec::new()),
                    Some(parent) => self.names.get(parent).cloned(),
                };
                if let Some(mut path) = below {
                    for block in blocks {
                        path.push(block.tokens_hash);
                        let before = self.names.insert(block.block_hash, path.clone());
                        if let Some(before) = before.filter(|b| *b != path) {
                            self.held.remove(&before);
                        }
                        self.held.insert(path.clone());
                    }
                } else {
                    rejected_blocks = blocks.len() as u64;
                }
            }
            EventKind::Removed { block_hashes } => {
                for engine in block_hashes {
                    if let Some(path) = self.names.remove(engine) {
                        self.held.remove(&path);
                    } else {
                        unknown_removals += 1;
                    }
                }
            }
            EventKind::Cleared => {
                self.names.clear();
                self.held.clear();
            }
        }
        ApplyOutcome::Applied {
            rejected_blocks,
            unknown_removals,
        }
    }
}

/// A `Stored` event of (engine hash, tokens hash) blocks.
pub fn stored(parent_hash: Option<u64>, blocks: &[(u64, u64)]) -> EventKind {
    EventKind::Stored {
        parent_hash,
        blocks: blocks
            .iter()
            .map(|&(block_hash, tokens_hash)| kvroute_index::StoredBlock {
                block_hash,
                tokens_hash,
            })
            .collect(),
    }
}
