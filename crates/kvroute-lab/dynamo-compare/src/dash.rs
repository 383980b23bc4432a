//! The dashmap variant of kvroute's block table, measured against the index's own
//! shards (the design card named dashmap; this is the measurement). Private to
//! the comparator on purpose: kvroute-index keeps one implementation.
//!
//! Same layout and event semantics as kvroute-index, except where blocks live:
//! one `DashMap` keyed by each block's chain key (dashmap picks the shard from
//! the key, so every probed block takes its own shard lock) instead of the
//! index's conversation-anchored shards. Workers keep their engine-hash maps
//! behind their own mutex, as in the index.

use std::collections::HashMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU32, Ordering};

use dashmap::DashMap;
use kvroute_index::{EventKind, KvEvent, WorkerKey};

/// One distinct block: holders 0..64 inline, higher ones in `wide` (word 0 =
/// workers 64..128), as the index did before its layout change.
struct Entry {
    workers: u64,
    wide: Option<Box<[u64]>>,
    #[allow(dead_code)] // stored for dumps, as the index does
    tokens_hash: u64,
    #[allow(dead_code)]
    parent: u64,
}

impl Entry {
    fn word(&self, group: usize) -> u64 {
        match group {
            0 => self.workers,
            g => self
                .wide
                .as_ref()
                .and_then(|w| w.get(g - 1).copied())
                .unwrap_or(0),
        }
    }

    fn set(&mut self, idx: u32, on: bool) {
        let (group, bit) = (idx as usize / 64, 1u64 << (idx % 64));
        let word = if group == 0 {
            &mut self.workers
        } else {
            let wide = self.wide.get_or_insert_with(|| Box::new([]));
            if wide.len() < group {
                let mut grown = wide.to_vec();
                grown.resize(group, 0);
                *wide = grown.into_boxed_slice();
            }
            &mut wide[group - 1]
        };
        if on { *word |= bit } else { *word &= !bit }
    }

    fn is_empty(&self) -> bool {
        self.workers == 0 && self.wide.as_ref().is_none_or(|w| w.iter().all(|&x| x == 0))
    }
}

struct Worker {
    idx: u32,
    last_event_id: Option<u64>,
    /// Engine hash → block key.
    blocks: HashMap<u64, u64>,
}

#[derive(Default)]
pub struct DashIndex {
    blocks: DashMap<u64, Entry>,
    workers: DashMap<WorkerKey, Mutex<Worker>>,
    next_idx: AtomicU32,
}

fn chain(parent: u64, local: u64) -> u64 {
    let product =
        u128::from(parent ^ 0x1319_8A2E_0370_7344) * u128::from(local ^ 0xA409_3822_299F_31D0);
    (product as u64) ^ ((product >> 64) as u64) | 1
}

impl DashIndex {
    pub fn apply(&self, key: WorkerKey, event: &KvEvent) {
        if !self.workers.contains_key(&key) {
            let idx = self.next_idx.fetch_add(1, Ordering::Relaxed);
            self.workers.entry(key).or_insert_with(|| {
                Mutex::new(Worker {
                    idx,
                    last_event_id: None,
                    blocks: HashMap::new(),
                })
            });
        }
        let slot = self.workers.get(&key).expect("inserted above");
        let mut worker = slot.lock().unwrap();
        if worker
            .last_event_id
            .is_some_and(|last| event.event_id != last + 1)
        {
            return;
        }
        worker.last_event_id = Some(event.event_id);
        let idx = worker.idx;
        match &event.kind {
            EventKind::Stored {
                parent_hash,
                blocks,
            } => {
                let mut parent = match parent_hash {
                    None => 0,
                    Some(p) => match worker.blocks.get(p) {
                        Some(&k) => k,
                        None => return,
                    },
                };
                for block in blocks {
                    let k = chain(parent, block.tokens_hash);
                    if let Some(old) = worker.blocks.insert(block.block_hash, k)
                        && old != k
                    {
                        self.unhold(old, idx);
                    }
                    self.blocks
                        .entry(k)
                        .or_insert_with(|| Entry {
                            workers: 0,
                            wide: None,
                            tokens_hash: block.tokens_hash,
                            parent,
                        })
                        .set(idx, true);
                    parent = k;
                }
            }
            EventKind::Removed { block_hashes } => {
                for h in block_hashes {
                    if let Some(k) = worker.blocks.remove(h) {
                        self.unhold(k, idx);
                    }
                }
            }
            EventKind::Cleared => {
                for (_, k) in worker.blocks.drain() {
                    self.unhold(k, idx);
                }
            }
        }
    }

    fn unhold(&self, key: u64, idx: u32) {
        self.blocks.remove_if_mut(&key, |_, entry| {
            entry.set(idx, false);
            entry.is_empty()
        });
    }

    /// Matched depth per worker holding block 0 (worker indices, not keys: the
    /// comparison is of the table).
    pub fn find_matches(&self, local_hashes: &[u64]) -> Vec<(u32, u32)> {
        let groups = (self.next_idx.load(Ordering::Relaxed) as usize)
            .div_ceil(64)
            .max(1);
        let mut active = vec![0u64; groups];
        let mut depths = Vec::new();
        let mut parent = 0;
        for (depth, &local) in local_hashes.iter().enumerate() {
            let k = chain(parent, local);
            parent = k;
            let entry = self.blocks.get(&k);
            let mut any = 0;
            for (g, word) in active.iter_mut().enumerate() {
                let holders = entry.as_ref().map_or(0, |e| e.word(g));
                let still = if depth == 0 { holders } else { *word & holders };
                let mut gone = *word & !still;
                while gone != 0 {
                    depths.push((64 * g as u32 + gone.trailing_zeros(), depth as u32));
                    gone &= gone - 1;
                }
                *word = still;
                any |= still;
            }
            if any == 0 {
                return depths;
            }
        }
        for (g, &word) in active.iter().enumerate() {
            let mut w = word;
            while w != 0 {
                depths.push((
                    64 * g as u32 + w.trailing_zeros(),
                    local_hashes.len() as u32,
                ));
                w &= w - 1;
            }
        }
        depths
    }
}
