//! Benchmark workloads: a merged timeline of lookups and KV events derived from a
//! request trace by simulating a fleet of workers.
//!
//! Each request (a list of trace block ids) is looked up, routed to a worker, and
//! that worker's block pool (LRU at a fixed capacity, as an engine's prefix cache)
//! emits the `Removed` events of the blocks it evicts, one event per block, then
//! one `Stored` event for the request's blocks it did not hold. The timeline
//! therefore has the shape an index meets in production: bursts of stores, a
//! steady stream of single-block removals under churn, and lookups in between.
//!
//! Pure computation (no I/O) so the `kvroute-lab bench index` command, tests and other
//! indexers' harnesses all replay the same workload.

use std::collections::{BTreeMap, HashMap};

use xxhash_rust::xxh3::xxh3_64_with_seed;

use crate::event::{EventKind, KvEvent, StoredBlock, WorkerKey};
use crate::hash::SEED;

/// One operation of a timeline.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TimelineOp {
    /// A worker's event.
    Event { worker: WorkerKey, event: KvEvent },
    /// A request's lookup, by its local block hashes.
    Match { tokens_hashes: Vec<u64> },
}

/// The local (tokens) hash standing for trace block `id`: the trace gives no
/// tokens, so the id itself is hashed like a block's token bytes.
pub fn block_tokens_hash(id: u64) -> u64 {
    xxh3_64_with_seed(&id.to_le_bytes(), SEED)
}

/// The simulated engine's own hash of each block of a request: an opaque chain
/// with a seed of its own, as real engines' hashes differ from kvroute's.
fn engine_hashes(ids: &[u64]) -> Vec<u64> {
    let mut parent = 0u64;
    ids.iter()
        .map(|&id| {
            let mut bytes = [0u8; 16];
            bytes[..8].copy_from_slice(&parent.to_le_bytes());
            bytes[8..].copy_from_slice(&id.to_le_bytes());
            parent = xxh3_64_with_seed(&bytes, 0);
            parent
        })
        .collect()
}

/// One simulated worker: an LRU pool of engine block hashes.
struct PoolWorker {
    key: WorkerKey,
    next_event_id: u64,
    /// Engine hash → last-use tick, and tick → engine hash (oldest first).
    last_use: HashMap<u64, u64>,
    by_age: BTreeMap<u64, u64>,
}

impl PoolWorker {
    fn touch(&mut self, engine: u64, tick: &mut u64) {
        if let Some(old) = self.last_use.insert(engine, *tick) {
            self.by_age.remove(&old);
        }
        self.by_age.insert(*tick, engine);
        *tick += 1;
    }

    /// Leading blocks of `engines` in the pool.
    fn held_prefix(&self, engines: &[u64]) -> usize {
        engines
            .iter()
            .take_while(|e| self.last_use.contains_key(e))
            .count()
    }

    fn event(&mut self, kind: EventKind) -> TimelineOp {
        self.next_event_id += 1;
        TimelineOp::Event {
            worker: self.key,
            event: KvEvent {
                event_id: self.next_event_id,
                kind,
            },
        }
    }
}

/// A fleet of simulated workers turning requests into timeline operations.
///
/// Routing is cache-aware with a load-spreading fallback: a request goes to the
/// worker holding the longest prefix of it when that covers more than half of its
/// blocks, otherwise to the next worker in turn.
pub struct FleetSimulator {
    workers: Vec<PoolWorker>,
    capacity: usize,
    next_turn: usize,
    tick: u64,
}

impl FleetSimulator {
    /// `workers` workers (ids 0.., dp rank 0) of `blocks_per_worker` blocks each.
    pub fn new(workers: usize, blocks_per_worker: usize) -> Self {
        assert!(workers > 0 && blocks_per_worker > 0);
        Self {
            workers: (0..workers as u64)
                .map(|id| PoolWorker {
                    key: WorkerKey::new(id, 0),
                    next_event_id: 0,
                    last_use: HashMap::new(),
                    by_age: BTreeMap::new(),
                })
                .collect(),
            capacity: blocks_per_worker,
            next_turn: 0,
            tick: 0,
        }
    }

    /// Looks up, routes and caches one request of trace block ids; appends its
    /// operations to `out`. A request longer than a pool is cut to the pool size.
    pub fn request(&mut self, ids: &[u64], out: &mut Vec<TimelineOp>) {
        out.push(TimelineOp::Match {
            tokens_hashes: ids.iter().map(|&id| block_tokens_hash(id)).collect(),
        });
        let ids = &ids[..ids.len().min(self.capacity)];
        if ids.is_empty() {
            return;
        }
        let engines = engine_hashes(ids);
        let (best, best_depth) = self
            .workers
            .iter()
            .enumerate()
            .map(|(i, w)| (i, w.held_prefix(&engines)))
            .fold((0, 0), |acc, x| if x.1 > acc.1 { x } else { acc });
        let chosen = if best_depth * 2 > ids.len() {
            best
        } else {
            self.next_turn = (self.next_turn + 1) % self.workers.len();
            self.next_turn
        };
        let worker = &mut self.workers[chosen];
        let held = worker.held_prefix(&engines);
        // Ancestors stay newer than descendants: the pool evicts leaves first.
        for &e in engines[..held].iter().rev() {
            worker.touch(e, &mut self.tick);
        }
        let new = ids.len() - held;
        while worker.last_use.len() + new > self.capacity {
            let (_, victim) = worker.by_age.pop_first().expect("pool is not empty");
            worker.last_use.remove(&victim);
            let op = worker.event(EventKind::Removed {
                block_hashes: vec![victim],
            });
            out.push(op);
        }
        if new > 0 {
            let blocks = (held..ids.len())
                .map(|i| StoredBlock {
                    block_hash: engines[i],
                    tokens_hash: block_tokens_hash(ids[i]),
                })
                .collect();
            let op = worker.event(EventKind::Stored {
                parent_hash: held.checked_sub(1).map(|i| engines[i]),
                blocks,
            });
            out.push(op);
            for &e in engines.iter().rev() {
                worker.touch(e, &mut self.tick);
            }
        }
    }
}

/// The whole timeline of a trace's requests (block ids, in arrival order).
pub fn derive_timeline<'a>(
    requests: impl IntoIterator<Item = &'a [u64]>,
    workers: usize,
    blocks_per_worker: usize,
) -> Vec<TimelineOp> {
    let mut fleet = FleetSimulator::new(workers, blocks_per_worker);
    let mut out = Vec::new();
    for ids in requests {
        fleet.request(ids, &mut out);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{IndexConfig, KvIndex};

    fn removed_count(ops: &[TimelineOp]) -> usize {
        ops.iter()
            .filter(|op| {
                matches!(
                    op,
                    TimelineOp::Event {
                        event: KvEvent {
                            kind: EventKind::Removed { .. },
                            ..
                        },
                        ..
                    }
                )
            })
            .count()
    }

    #[test]
    fn pools_stay_at_capacity_and_events_apply_cleanly() {
        let requests: Vec<Vec<u64>> = (0..200u64)
            .map(|r| {
                (0..1 + r % 7)
                    .map(|b| if b == 0 { 0 } else { r * 10 + b })
                    .collect()
            })
            .collect();
        let ops = derive_timeline(requests.iter().map(Vec::as_slice), 3, 8);
        assert_eq!(
            ops.iter()
                .filter(|op| matches!(op, TimelineOp::Match { .. }))
                .count(),
            200
        );
        assert!(removed_count(&ops) > 0);
        let index = KvIndex::new(IndexConfig::default());
        for op in &ops {
            if let TimelineOp::Event { worker, event } = op {
                let outcome = index.apply(*worker, event);
                assert_eq!(
                    outcome.status(),
                    crate::EventStatus::Applied,
                    "{event:?}: {outcome:?}"
                );
            }
        }
        for w in index.workers() {
            assert!(index.worker_blocks(w) <= 8);
        }
        assert!(index.stats().memberships > 0);
    }

    #[test]
    fn a_repeated_request_hits_the_worker_holding_it() {
        let ops = derive_timeline([&[1u64, 2, 3][..], &[1, 2, 3]], 4, 16);
        let stores: Vec<WorkerKey> = ops
            .iter()
            .filter_map(|op| match op {
                TimelineOp::Event { worker, .. } => Some(*worker),
                _ => None,
            })
            .collect();
        // The second request is fully cached: no second Stored event.
        assert_eq!(stores.len(), 1);
    }
}
