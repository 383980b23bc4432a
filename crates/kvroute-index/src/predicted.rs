//! Predicted entries: the router's own routing decisions, remembered for a while.
//!
//! When the router sends a request to a worker, that worker will soon hold the
//! request's prefix. Recording it closes the race where sibling requests arrive
//! before the engine's first `Stored` event, and lets workers that publish no
//! events be routed by affinity at all. Entries expire after a TTL (refreshed
//! when the same path is routed again) and the layer is capped in size.
//!
//! Entries are kept per block (chain key → the workers predicted to hold it),
//! so a lookup walks the request's blocks once, like the event-fed index, and
//! never scans a worker's other entries.

use std::collections::HashMap;
use std::sync::RwLock;
use std::time::{Duration, Instant};

use crate::event::WorkerKey;
use crate::index::WorkerMatch;
use crate::table::chain_keys;

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

/// One worker predicted to hold one block.
#[derive(Clone, Copy)]
struct Prediction {
    worker: WorkerKey,
    depth: u32,
    expires: Instant,
}

#[derive(Default)]
struct Inner {
    /// Sequence hash → its predictions, one per worker.
    blocks: HashMap<u64, Vec<Prediction>>,
    /// Entries per worker, for `total_blocks`.
    per_worker: HashMap<WorkerKey, u64>,
    len: usize,
    /// When expired entries were last dropped.
    swept: Option<Instant>,
}

/// Routing decisions as predicted cache contents, per worker.
pub struct PredictedIndex {
    config: PredictedConfig,
    inner: RwLock<Inner>,
}

impl PredictedIndex {
    pub fn new(config: PredictedConfig) -> Self {
        Self {
            config,
            inner: RwLock::default(),
        }
    }

    /// Records that `worker` was chosen for a request with these local hashes;
    /// entries already there get a fresh TTL.
    pub fn record(&self, worker: WorkerKey, local_hashes: &[u64], now: Instant) {
        self.record_for(worker, local_hashes, now, self.config.ttl);
    }

    /// [`Self::record`] with its own TTL, at most the layer's.
    pub fn record_for(&self, worker: WorkerKey, local_hashes: &[u64], now: Instant, ttl: Duration) {
        let expires = now + ttl.min(self.config.ttl);
        let seqs = chain_keys(local_hashes);
        let mut inner = self.inner.write().unwrap();
        let mut added = 0;
        for (depth, seq) in seqs.into_iter().enumerate() {
            let list = inner.blocks.entry(seq).or_default();
            match list.iter_mut().find(|p| p.worker == worker) {
                Some(p) => p.expires = expires,
                None => {
                    list.push(Prediction {
                        worker,
                        depth: depth as u32,
                        expires,
                    });
                    added += 1;
                }
            }
        }
        inner.len += added as usize;
        *inner.per_worker.entry(worker).or_default() += added;
        // Expired entries go at least once per TTL, so memory follows live entries.
        if inner.swept.is_none_or(|t| now >= t + self.config.ttl) {
            inner.swept = Some(now);
            inner.retain(|p| p.expires > now);
        }
        if inner.len > self.config.max_blocks {
            inner.retain(|p| p.expires > now);
            inner.prune_deepest(self.config.max_blocks * 4 / 5);
        }
    }

    /// Per worker with an unexpired predicted prefix of `local_hashes`: its depth.
    /// `total_blocks` is the worker's count of predicted entries.
    pub fn find_matches(&self, local_hashes: &[u64], now: Instant) -> Vec<WorkerMatch> {
        let seqs = chain_keys(local_hashes);
        let inner = self.inner.read().unwrap();
        let live =
            |seq: &u64| -> &[Prediction] { inner.blocks.get(seq).map_or(&[], Vec::as_slice) };
        let Some(first) = seqs.first() else {
            return Vec::new();
        };
        let mut active: Vec<WorkerKey> = live(first)
            .iter()
            .filter(|p| p.expires > now)
            .map(|p| p.worker)
            .collect();
        let mut matches = Vec::new();
        for (depth, seq) in seqs.iter().enumerate().skip(1) {
            if active.is_empty() {
                break;
            }
            // No allocation per block: a block has few predicted holders.
            let holders = live(seq);
            active.retain(|w| {
                let kept = holders.iter().any(|p| p.worker == *w && p.expires > now);
                if !kept {
                    matches.push((*w, depth as u32));
                }
                kept
            });
        }
        matches.extend(active.into_iter().map(|w| (w, seqs.len() as u32)));
        matches
            .into_iter()
            .map(|(worker, depth)| WorkerMatch {
                worker,
                depth,
                total_blocks: inner.per_worker.get(&worker).copied().unwrap_or(0),
            })
            .collect()
    }

    /// Forgets `worker`'s entries along the path of `local_hashes`: the request
    /// recorded for it was served elsewhere (entries an earlier request left on
    /// that path go too, which costs affinity at worst).
    pub fn forget(&self, worker: WorkerKey, local_hashes: &[u64]) {
        let seqs = chain_keys(local_hashes);
        let mut inner = self.inner.write().unwrap();
        let Inner {
            blocks,
            per_worker,
            len,
            ..
        } = &mut *inner;
        let mut removed = 0;
        for seq in seqs {
            let Some(list) = blocks.get_mut(&seq) else {
                continue;
            };
            let before = list.len();
            list.retain(|p| p.worker != worker);
            removed += before - list.len();
            if list.is_empty() {
                blocks.remove(&seq);
            }
        }
        if removed > 0 {
            *len -= removed;
            let n = per_worker.get_mut(&worker).expect("counted");
            *n -= removed as u64;
            if *n == 0 {
                per_worker.remove(&worker);
            }
        }
    }

    /// Forgets every prediction for `worker`.
    pub fn remove_worker(&self, worker: WorkerKey) {
        self.inner.write().unwrap().retain(|p| p.worker != worker);
    }

    /// Entries held, expired ones included until pruned.
    pub fn len(&self) -> usize {
        self.inner.read().unwrap().len
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl Inner {
    fn retain(&mut self, mut keep: impl FnMut(&Prediction) -> bool) {
        let Inner {
            blocks,
            per_worker,
            len,
            ..
        } = self;
        blocks.retain(|_, list| {
            list.retain(|p| {
                let kept = keep(p);
                if !kept {
                    *len -= 1;
                    let n = per_worker.get_mut(&p.worker).expect("counted");
                    *n -= 1;
                    if *n == 0 {
                        per_worker.remove(&p.worker);
                    }
                }
                kept
            });
            !list.is_empty()
        });
    }

    /// Drops the deepest entries until at most `target` remain: a shallow block
    /// is shared by more requests than a deep one, so it is worth more.
    fn prune_deepest(&mut self, target: usize) {
        if self.len <= target {
            return;
        }
        let mut depths: Vec<u32> = self.blocks.values().flatten().map(|p| p.depth).collect();
        let excess = self.len - target;
        // The depth at and above which entries go; ties at it go until `excess`.
        let cut = depths.len() - excess;
        let (_, &mut threshold, _) = depths.select_nth_unstable(cut);
        let mut at_threshold =
            excess - depths[cut + 1..].iter().filter(|&&d| d > threshold).count();
        self.retain(|p| match p.depth.cmp(&threshold) {
            std::cmp::Ordering::Greater => false,
            std::cmp::Ordering::Equal if at_threshold > 0 => {
                at_threshold -= 1;
                false
            }
            _ => true,
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const A: WorkerKey = WorkerKey {
        worker_id: 1,
        dp_rank: 0,
    };
    const B: WorkerKey = WorkerKey {
        worker_id: 2,
        dp_rank: 0,
    };

    fn depth_of(matches: &[WorkerMatch], worker: WorkerKey) -> u32 {
        matches
            .iter()
            .find(|m| m.worker == worker)
            .map_or(0, |m| m.depth)
    }

    #[test]
    fn routed_prefixes_match_per_worker() {
        let p = PredictedIndex::new(PredictedConfig::default());
        let now = Instant::now();
        p.record(A, &[1, 2, 3], now);
        p.record(B, &[1, 2, 9, 9], now);
        let m = p.find_matches(&[1, 2, 3, 4], now);
        assert_eq!(depth_of(&m, A), 3);
        assert_eq!(depth_of(&m, B), 2);
        assert_eq!(m.iter().find(|m| m.worker == B).unwrap().total_blocks, 4);
        assert!(p.find_matches(&[7], now).is_empty());
        p.remove_worker(A);
        assert_eq!(depth_of(&p.find_matches(&[1, 2, 3], now), A), 0);
        assert_eq!(p.len(), 4);
    }

    #[test]
    fn forgetting_a_path_keeps_the_worker_s_other_entries_and_other_workers() {
        let p = PredictedIndex::new(PredictedConfig::default());
        let now = Instant::now();
        p.record(A, &[1, 2, 3], now);
        p.record(A, &[7], now);
        p.record(B, &[1, 2], now);
        p.forget(A, &[1, 2, 3, 4]);
        assert_eq!(depth_of(&p.find_matches(&[1, 2, 3], now), A), 0);
        assert_eq!(depth_of(&p.find_matches(&[1, 2, 3], now), B), 2);
        let m = p.find_matches(&[7], now);
        assert_eq!(depth_of(&m, A), 1);
        assert_eq!(m[0].total_blocks, 1);
        assert_eq!(p.len(), 3);
    }

    #[test]
    fn entries_expire_unless_routed_again() {
        let ttl = Duration::from_secs(120);
        let p = PredictedIndex::new(PredictedConfig {
            ttl,
            ..PredictedConfig::default()
        });
        let t0 = Instant::now();
        p.record(A, &[1, 2], t0);
        p.record(B, &[1, 2], t0);
        // A's path is routed again halfway: its TTL restarts.
        p.record(A, &[1, 2], t0 + ttl / 2);
        let later = t0 + ttl + Duration::from_secs(1);
        let m = p.find_matches(&[1, 2], later);
        assert_eq!(depth_of(&m, A), 2);
        assert_eq!(depth_of(&m, B), 0);
        // Recording after a TTL drops what expired.
        p.record(A, &[5], later);
        assert_eq!(p.len(), 3);
    }

    #[test]
    fn over_the_cap_the_deepest_entries_go_first() {
        let p = PredictedIndex::new(PredictedConfig {
            max_blocks: 10,
            ..PredictedConfig::default()
        });
        let now = Instant::now();
        p.record(A, &[1, 2, 3, 4, 5, 6], now);
        p.record(B, &[1, 2, 3, 4, 5], now);
        // 11 entries > 10: pruned to 8, so A's depth-5 and both depth-4 entries go.
        assert_eq!(p.len(), 8);
        let m = p.find_matches(&[1, 2, 3, 4, 5, 6], now);
        assert_eq!((depth_of(&m, A), depth_of(&m, B)), (4, 4));
    }
}
