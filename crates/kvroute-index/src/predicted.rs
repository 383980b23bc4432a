//! Predicted entries: the router's own routing decisions, remembered for a while.
//!
//! When the router sends a request to a worker, that worker will soon hold the
//! request's prefix. Recording it closes the race where sibling requests arrive
//! before the engine's first `Stored` event, and lets workers that publish no
//! events be routed by affinity at all. Entries expire after a TTL (refreshed
//! when the same path is routed again) and the layer is capped in size.
//!
//! This first implementation is deliberately simple; it fixes the API.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::event::WorkerKey;
use crate::hash::sequence_hashes;
use crate::index::WorkerMatch;

/// Limits of the predicted layer.
#[derive(Clone, Debug)]
pub struct PredictedConfig {
    /// How long a routed path counts as cached (default 120 s).
    pub ttl: Duration,
    /// Most (worker, block) entries; over it, the deepest are pruned down to 80%.
    pub max_blocks: usize,
}

impl Default for PredictedConfig {
    fn default() -> Self {
        Self {
            ttl: Duration::from_secs(120),
            max_blocks: 1 << 20,
        }
    }
}

/// Routing decisions as predicted cache contents, per worker.
pub struct PredictedIndex {
    config: PredictedConfig,
    /// (worker, sequence hash) → (depth, expiry).
    entries: Mutex<HashMap<(WorkerKey, u64), (u32, Instant)>>,
}

impl PredictedIndex {
    pub fn new(config: PredictedConfig) -> Self {
        Self {
            config,
            entries: Mutex::new(HashMap::new()),
        }
    }

    /// Records that `worker` was chosen for a request with these local hashes.
    pub fn record(&self, worker: WorkerKey, local_hashes: &[u64], now: Instant) {
        let expiry = now + self.config.ttl;
        let mut entries = self.entries.lock().unwrap();
        for (depth, seq) in sequence_hashes(local_hashes).into_iter().enumerate() {
            entries.insert((worker, seq), (depth as u32, expiry));
        }
        if entries.len() > self.config.max_blocks {
            entries.retain(|_, &mut (_, expiry)| expiry > now);
            let target = self.config.max_blocks * 4 / 5;
            if entries.len() > target {
                let mut by_depth: Vec<_> = entries.iter().map(|(&k, &(d, _))| (d, k)).collect();
                by_depth.sort_unstable_by_key(|&(depth, _)| std::cmp::Reverse(depth));
                let excess = entries.len() - target;
                for (_, key) in by_depth.into_iter().take(excess) {
                    entries.remove(&key);
                }
            }
        }
    }

    /// Per worker with an unexpired predicted prefix of `local_hashes`: its depth.
    /// `total_blocks` is the worker's count of predicted entries.
    pub fn find_matches(&self, local_hashes: &[u64], now: Instant) -> Vec<WorkerMatch> {
        let seq = sequence_hashes(local_hashes);
        let entries = self.entries.lock().unwrap();
        let workers: std::collections::HashSet<WorkerKey> =
            entries.keys().map(|&(w, _)| w).collect();
        workers
            .into_iter()
            .filter_map(|worker| {
                let depth = seq
                    .iter()
                    .take_while(|&&h| entries.get(&(worker, h)).is_some_and(|&(_, e)| e > now))
                    .count() as u32;
                let total_blocks = entries.keys().filter(|(w, _)| *w == worker).count() as u64;
                (depth > 0).then_some(WorkerMatch {
                    worker,
                    depth,
                    total_blocks,
                })
            })
            .collect()
    }

    /// Forgets every prediction for `worker`.
    pub fn remove_worker(&self, worker: WorkerKey) {
        self.entries
            .lock()
            .unwrap()
            .retain(|(w, _), _| *w != worker);
    }

    /// Entries held, expired ones included until pruned.
    pub fn len(&self) -> usize {
        self.entries.lock().unwrap().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}
