// Each test binary uses a different part of this shared support module.
#![allow(dead_code)]

//! The reference model of the index: one plain map per worker, no sharing, no
//! concurrency. Tests check the real index against it.

use std::collections::{HashMap, HashSet};

use kvroute_index::{
    ApplyOutcome, EventKind, KvEvent, WorkerKey, WorkerMatch, sequence_hash, sequence_hashes,
};

#[derive(Default, Clone)]
pub struct ModelWorker {
    pub last_event_id: Option<u64>,
    /// Engine hash → (sequence hash, parent sequence hash, tokens hash).
    pub by_engine: HashMap<u64, (u64, Option<u64>, u64)>,
    pub held: HashSet<u64>,
}

#[derive(Default, Clone)]
pub struct Model {
    pub workers: HashMap<WorkerKey, ModelWorker>,
}

impl Model {
    pub fn apply(&mut self, worker: WorkerKey, event: &KvEvent) -> ApplyOutcome {
        let w = self.workers.entry(worker).or_default();
        match w.last_event_id {
            Some(last) if event.event_id <= last => ApplyOutcome::Stale { last_applied: last },
            Some(last) if event.event_id > last + 1 => ApplyOutcome::Gap {
                expected: last + 1,
                got: event.event_id,
            },
            _ => {
                w.last_event_id = Some(event.event_id);
                w.apply(&event.kind)
            }
        }
    }

    pub fn remove_worker(&mut self, worker: WorkerKey) {
        self.workers.remove(&worker);
    }

    pub fn replace_worker(&mut self, worker: WorkerKey, last_event_id: u64, events: &[EventKind]) {
        let mut w = ModelWorker {
            last_event_id: Some(last_event_id),
            ..ModelWorker::default()
        };
        for kind in events {
            w.apply(kind);
        }
        self.workers.insert(worker, w);
    }

    /// Sorted by worker.
    pub fn find_matches(&self, local_hashes: &[u64]) -> Vec<WorkerMatch> {
        let seqs = sequence_hashes(local_hashes);
        let mut out: Vec<WorkerMatch> = self
            .workers
            .iter()
            .filter_map(|(&worker, w)| {
                let depth = seqs.iter().take_while(|s| w.held.contains(s)).count() as u32;
                (depth > 0).then_some(WorkerMatch {
                    worker,
                    depth,
                    total_blocks: w.held.len() as u64,
                })
            })
            .collect();
        out.sort_by_key(|m| m.worker);
        out
    }

    /// Engine hashes a dump of `worker` must contain: held blocks whose whole
    /// ancestry is held.
    pub fn dumped_engine_hashes(&self, worker: WorkerKey) -> HashSet<u64> {
        let Some(w) = self.workers.get(&worker) else {
            return HashSet::new();
        };
        let parent_of: HashMap<u64, Option<u64>> =
            w.by_engine.values().map(|&(s, p, _)| (s, p)).collect();
        let reachable = |mut seq: u64| loop {
            if !w.held.contains(&seq) {
                return false;
            }
            match parent_of[&seq] {
                None => return true,
                Some(p) => seq = p,
            }
        };
        w.by_engine
            .iter()
            .filter(|&(_, &(s, _, _))| reachable(s))
            .map(|(&e, _)| e)
            .collect()
    }

    pub fn memberships(&self) -> u64 {
        self.workers.values().map(|w| w.held.len() as u64).sum()
    }

    pub fn distinct_blocks(&self) -> u64 {
        let all: HashSet<u64> = self
            .workers
            .values()
            .flat_map(|w| w.held.iter().copied())
            .collect();
        all.len() as u64
    }
}

impl ModelWorker {
    fn apply(&mut self, kind: &EventKind) -> ApplyOutcome {
        let mut rejected_blocks = 0;
        let mut unknown_removals = 0;
        match kind {
            EventKind::Stored {
                parent_hash,
                blocks,
            } => {
                let parent = match parent_hash {
                    None => Some(None),
                    Some(p) => self.by_engine.get(p).map(|&(s, _, _)| Some(s)),
                };
                match parent {
                    None => rejected_blocks = blocks.len() as u64,
                    Some(mut parent) => {
                        for b in blocks {
                            let seq = sequence_hash(parent, b.tokens_hash);
                            if let Some(old) = self
                                .by_engine
                                .insert(b.block_hash, (seq, parent, b.tokens_hash))
                                && old.0 != seq
                            {
                                self.held.remove(&old.0);
                            }
                            self.held.insert(seq);
                            parent = Some(seq);
                        }
                    }
                }
            }
            EventKind::Removed { block_hashes } => {
                for h in block_hashes {
                    match self.by_engine.remove(h) {
                        Some((seq, _, _)) => {
                            self.held.remove(&seq);
                        }
                        None => unknown_removals += 1,
                    }
                }
            }
            EventKind::Cleared => {
                self.by_engine.clear();
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
