//! A rank's two caches: the device tier (GPU memory) and the offload tier (host
//! memory or disk, from which the engine loads blocks instead of computing them).
//!
//! Each tier is its own [`KvIndex`], so the offload tier has its own memory
//! bound and a lookup sees how deep each tier covers a request. The engine
//! publishes both tiers' events on one stream with one id sequence per rank
//! (as vLLM does), so gaps, acks, resyncs and dumps stay per rank: every event
//! is applied to its own tier's index and *skipped* (taken in sequence, nothing
//! applied) by the other, and both always stand at the same event id. A chain's
//! parent is looked up in the chain's own tier. `Cleared` clears both.
//!
//! The rank's digest covers both tiers: the sum of the two tiers' digests, a
//! hash held in both counted twice (see [`BlockSetDigest::plus`]).

use std::sync::Arc;

use crate::digest::IndexedDigest;
use crate::event::{ApplyOutcome, EventKind, KvEvent, WorkerKey};
use crate::index::{IndexConfig, KvIndex, WorkerEvents};

/// Where a block's KV lives.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Tier {
    /// GPU memory: a hit costs nothing.
    #[default]
    Device,
    /// Host memory or disk: the worker loads the block instead of computing it.
    Offload,
}

/// The device-tier and offload-tier indexes over one event sequence per rank.
#[derive(Clone)]
pub struct TieredIndex {
    pub device: Arc<KvIndex>,
    pub offload: Arc<KvIndex>,
}

/// A rank's whole state in both tiers, as `Stored` events, parents first.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TieredDump {
    pub last_event_id: Option<u64>,
    pub device: Vec<EventKind>,
    pub offload: Vec<EventKind>,
}

impl Default for TieredIndex {
    fn default() -> Self {
        Self::new(IndexConfig::default(), IndexConfig::default())
    }
}

/// Events applied under one hold of a worker's locks. A message may bring
/// 64 Ki of them, and the worker's registry shard stays read-locked meanwhile
/// (a worker joining that shard waits); a run of 256 keeps that wait under a
/// millisecond while the lookup and lock stay a small part of each event (the
/// comparator's runs average 20.5 events at 16 workers).
const RUN_EVENTS: usize = 256;

impl TieredIndex {
    pub fn new(device: IndexConfig, offload: IndexConfig) -> Self {
        Self {
            device: Arc::new(KvIndex::new(device)),
            offload: Arc::new(KvIndex::new(offload)),
        }
    }

    pub fn tier(&self, tier: Tier) -> &KvIndex {
        match tier {
            Tier::Device => &self.device,
            Tier::Offload => &self.offload,
        }
    }

    /// Offers one event of `worker` on `tier` (ignored for `Cleared`, which
    /// clears both); the outcome is judged on the rank's one sequence.
    pub fn apply(&self, worker: WorkerKey, tier: Tier, event: &KvEvent) -> ApplyOutcome {
        self.with_worker(worker, |device, offload| {
            Self::apply_to(device, offload, tier, event)
        })
    }

    /// [`Self::apply`] of each of a run of `worker`'s events, in order (one
    /// message of its stream), with the worker looked up and locked once in
    /// each tier for every [`RUN_EVENTS`] of them (see
    /// [`KvIndex::with_worker`]); appends each event's outcome to `outcomes`.
    pub fn apply_batch(
        &self,
        worker: WorkerKey,
        events: &[(Tier, KvEvent)],
        outcomes: &mut Vec<ApplyOutcome>,
    ) {
        for run in events.chunks(RUN_EVENTS) {
            self.with_worker(worker, |device, offload| {
                outcomes.extend(
                    run.iter()
                        .map(|(tier, event)| Self::apply_to(device, offload, *tier, event)),
                );
            });
        }
    }

    /// `f` with `worker` locked in both tiers, the device tier's first.
    fn with_worker<R>(
        &self,
        worker: WorkerKey,
        f: impl FnOnce(&mut WorkerEvents<'_>, &mut WorkerEvents<'_>) -> R,
    ) -> R {
        self.device.with_worker(worker, |device| {
            self.offload
                .with_worker(worker, |offload| f(device, offload))
        })
    }

    fn apply_to(
        device: &mut WorkerEvents<'_>,
        offload: &mut WorkerEvents<'_>,
        tier: Tier,
        event: &KvEvent,
    ) -> ApplyOutcome {
        // One tier's limit held at a time (see `WorkerEvents::let_limit_go`).
        if matches!(event.kind, EventKind::Cleared) {
            offload.let_limit_go();
            let outcome = device.apply(event);
            if matches!(outcome, ApplyOutcome::Applied { .. }) {
                device.let_limit_go();
                offload.apply(event);
            }
            return outcome;
        }
        match tier {
            Tier::Device => Self::apply_on(device, offload, event),
            Tier::Offload => Self::apply_on(offload, device, event),
        }
    }

    /// `event` applied on the tier `on`, its id taken in sequence by `other`.
    fn apply_on(
        on: &mut WorkerEvents<'_>,
        other: &mut WorkerEvents<'_>,
        event: &KvEvent,
    ) -> ApplyOutcome {
        other.let_limit_go();
        let outcome = on.apply(event);
        if matches!(outcome, ApplyOutcome::Applied { .. }) {
            other.skip(event.event_id);
        }
        outcome
    }

    /// Replaces both tiers of `worker` with a dump as of `last_event_id`;
    /// returns the blocks that could not be placed (see [`KvIndex::replace_worker`]).
    pub fn replace_worker(
        &self,
        worker: WorkerKey,
        last_event_id: u64,
        device: &[EventKind],
        offload: &[EventKind],
    ) -> u64 {
        self.device.replace_worker(worker, last_event_id, device)
            + self.offload.replace_worker(worker, last_event_id, offload)
    }

    /// Forgets `worker` in both tiers.
    pub fn remove_worker(&self, worker: WorkerKey) {
        self.device.remove_worker(worker);
        self.offload.remove_worker(worker);
    }

    pub fn last_event_id(&self, worker: WorkerKey) -> Option<u64> {
        self.device.last_event_id(worker)
    }

    /// The digest of both tiers of `worker` (see the module docs).
    pub fn digest(&self, worker: WorkerKey) -> Option<IndexedDigest> {
        let device = self.device.digest(worker)?;
        let Some(offload) = self.offload.digest(worker) else {
            return Some(device);
        };
        Some(IndexedDigest {
            last_event_id: device.last_event_id,
            digest: device.digest.plus(offload.digest),
            trimmed: device.trimmed || offload.trimmed,
        })
    }

    /// Both tiers of `worker`, for a dump or a snapshot.
    pub fn dump(&self, worker: WorkerKey) -> Option<TieredDump> {
        let device = self.device.dump(worker)?;
        let offload = self.offload.dump(worker).map(|d| d.events);
        Some(TieredDump {
            last_event_id: device.last_event_id,
            device: device.events,
            offload: offload.unwrap_or_default(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::digest::BlockSetDigest;
    use crate::event::StoredBlock;

    const W: WorkerKey = WorkerKey {
        worker_id: 1,
        dp_rank: 0,
    };

    fn stored(event_id: u64, parent: Option<u64>, hash: u64) -> KvEvent {
        KvEvent {
            event_id,
            kind: EventKind::Stored {
                parent_hash: parent,
                blocks: vec![StoredBlock {
                    block_hash: hash,
                    tokens_hash: hash + 100,
                }],
            },
        }
    }

    fn depth(index: &KvIndex, locals: &[u64]) -> u32 {
        index.find_matches(locals).first().map_or(0, |m| m.depth)
    }

    #[test]
    fn both_tiers_share_one_sequence_and_each_chain_stays_in_its_tier() {
        let tiers = TieredIndex::default();
        let ok = |o: ApplyOutcome| assert!(matches!(o, ApplyOutcome::Applied { .. }), "{o:?}");
        ok(tiers.apply(W, Tier::Device, &stored(1, None, 1)));
        ok(tiers.apply(W, Tier::Offload, &stored(2, None, 1)));
        ok(tiers.apply(W, Tier::Offload, &stored(3, Some(1), 2)));
        // Its parent (3) is held on the device only: refused in the offload tier.
        let refused = tiers.apply(W, Tier::Offload, &stored(4, Some(3), 4));
        assert_eq!(refused.status(), crate::EventStatus::Rejected);
        assert_eq!(tiers.device.last_event_id(W), Some(4));
        assert_eq!(tiers.offload.last_event_id(W), Some(4));
        // A gap on either tier is a gap of the rank.
        assert_eq!(
            tiers.apply(W, Tier::Device, &stored(6, Some(1), 2)),
            ApplyOutcome::Gap {
                expected: 5,
                got: 6
            }
        );
        assert_eq!(depth(&tiers.device, &[101, 102]), 1);
        assert_eq!(depth(&tiers.offload, &[101, 102]), 2);
        // The digest covers both tiers, hash 1 (in both) twice.
        let digest = tiers.digest(W).unwrap();
        assert_eq!(digest.last_event_id, Some(4));
        let both = BlockSetDigest::of([1]).plus(BlockSetDigest::of([1, 2]));
        assert_eq!(digest.digest, both);
        // The dump and a replacement by it keep each tier's blocks.
        let dump = tiers.dump(W).unwrap();
        let copy = TieredIndex::default();
        assert_eq!(copy.replace_worker(W, 4, &dump.device, &dump.offload), 0);
        assert_eq!(copy.digest(W), Some(digest));
        assert_eq!(copy.dump(W), Some(dump));
        // Cleared clears both.
        let cleared = KvEvent {
            event_id: 5,
            kind: EventKind::Cleared,
        };
        ok(tiers.apply(W, Tier::Offload, &cleared));
        assert_eq!(tiers.digest(W).unwrap().digest, BlockSetDigest::default());
        assert_eq!(tiers.offload.last_event_id(W), Some(5));
        tiers.remove_worker(W);
        assert_eq!(tiers.digest(W), None);
        assert_eq!(tiers.offload.worker_blocks(W), 0);
    }

    #[test]
    fn a_batch_is_its_events_applied_one_by_one() {
        let cleared = |event_id| KvEvent {
            event_id,
            kind: EventKind::Cleared,
        };
        let removed = |event_id, hash| KvEvent {
            event_id,
            kind: EventKind::Removed {
                block_hashes: vec![hash],
            },
        };
        // Both tiers, a parent missing from its tier, a stale id, a removal,
        // a clear, a gap and what follows it.
        let events = vec![
            (Tier::Device, stored(1, None, 1)),
            (Tier::Offload, stored(2, None, 1)),
            (Tier::Offload, stored(3, Some(1), 2)),
            (Tier::Device, stored(4, Some(2), 3)),
            (Tier::Device, stored(3, Some(1), 5)),
            (Tier::Offload, removed(5, 1)),
            (Tier::Device, stored(6, Some(1), 4)),
            (Tier::Offload, cleared(7)),
            (Tier::Device, stored(8, None, 6)),
            (Tier::Device, stored(10, None, 7)),
            (Tier::Offload, stored(11, None, 8)),
        ];
        // A message longer than one run: stores and removals across runs.
        let mut events = events;
        for i in 0..2 * RUN_EVENTS as u64 + 7 {
            let (event_id, hash) = (12 + i, 100 + i / 2);
            events.push(if i % 2 == 0 {
                (Tier::Device, stored(event_id, Some(6), hash))
            } else {
                // Every other one a block it holds, else an unknown one.
                (Tier::Device, removed(event_id, hash + 1000 * (i % 4 / 2)))
            });
        }
        let one_by_one = TieredIndex::default();
        let expected: Vec<_> = events
            .iter()
            .map(|(tier, event)| one_by_one.apply(W, *tier, event))
            .collect();
        let batched = TieredIndex::default();
        let mut outcomes = Vec::new();
        batched.apply_batch(W, &events[..5], &mut outcomes);
        batched.apply_batch(W, &events[5..], &mut outcomes);
        assert_eq!(outcomes, expected);
        assert_eq!(batched.digest(W), one_by_one.digest(W));
        assert_eq!(batched.dump(W), one_by_one.dump(W));
        for tier in [Tier::Device, Tier::Offload] {
            assert_eq!(
                batched.tier(tier).stats().memberships,
                one_by_one.tier(tier).stats().memberships
            );
        }
    }

    /// Runs that apply both tiers' events hold one tier's limit at a time:
    /// two ranks whose messages take the tiers in opposite orders never wait
    /// for each other (holding the first tier's limit while taking the
    /// second's, they did).
    #[test]
    fn runs_across_both_tiers_never_wait_for_each_other() {
        let bounded = IndexConfig {
            max_blocks: Some(1 << 20),
        };
        runs_across_both_tiers_finish(bounded, |run| EventKind::Removed {
            block_hashes: vec![run],
        });
    }

    /// The same for the block-table shard an unbounded run keeps locked from
    /// one event to the next (see `WorkerEvents`): one tier's at a time. Every
    /// store is of the same block, in the same shard of both tiers' tables;
    /// holding it in the first tier while taking it in the second, the two
    /// ranks waited for each other.
    #[test]
    fn unbounded_runs_across_both_tiers_never_wait_for_each_other() {
        runs_across_both_tiers_finish(IndexConfig::default(), |run| EventKind::Stored {
            parent_hash: None,
            blocks: vec![StoredBlock {
                block_hash: run,
                tokens_hash: 42,
            }],
        });
    }

    /// Two ranks apply runs of one event on each tier, the tiers taken in
    /// opposite orders, each event `event(run)`; both must finish.
    fn runs_across_both_tiers_finish(config: IndexConfig, event: fn(u64) -> EventKind) {
        const RUNS: u64 = 100_000;
        let tiers = Arc::new(TieredIndex::new(config.clone(), config));
        let (done, finished) = std::sync::mpsc::channel();
        let start = Arc::new(std::sync::Barrier::new(2));
        for (worker, tiers_in_order) in [
            (1, [Tier::Device, Tier::Offload]),
            (2, [Tier::Offload, Tier::Device]),
        ] {
            let (tiers, done, start) = (tiers.clone(), done.clone(), start.clone());
            std::thread::spawn(move || {
                let key = WorkerKey::new(worker, 0);
                let mut outcomes = Vec::new();
                start.wait();
                for run in 0..RUNS {
                    let events: Vec<_> = tiers_in_order
                        .iter()
                        .enumerate()
                        .map(|(i, &tier)| {
                            let kind = event(run);
                            (
                                tier,
                                KvEvent {
                                    event_id: 2 * run + i as u64 + 1,
                                    kind,
                                },
                            )
                        })
                        .collect();
                    outcomes.clear();
                    tiers.apply_batch(key, &events, &mut outcomes);
                    assert!(
                        outcomes
                            .iter()
                            .all(|o| matches!(o, ApplyOutcome::Applied { .. }))
                    );
                }
                done.send(()).unwrap();
            });
        }
        for _ in 0..2 {
            finished
                .recv_timeout(std::time::Duration::from_secs(60))
                .expect("both ranks' runs finish");
        }
    }
}
