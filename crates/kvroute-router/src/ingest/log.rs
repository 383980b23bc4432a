//! Applying the log shared by router replicas (`[cluster]`, see
//! [`crate::replica`]) to this replica's index, in the log's order, with the
//! same stream context and checks a worker's own stream uses: one record at a
//! time through [`ReplicaApplier`], and [`Snapshot`]s of what it applied.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvroute_index::{EventKind, WorkerKey};
use kvroute_proto::{Dump, Stored};

use crate::ingest::verify::Verdict;
use crate::ingest::{DumpState, Stream, convert_stored};
use crate::metrics;
use crate::replica::{PeerDigest, Record, Snapshot, SnapshotWorker};
use crate::state::AppState;

/// A dump's single-block `Stored` events (parents first, a child often
/// right after its parent) as chains: each event whose parent is the
/// previous one's last block joins it. A third of the bytes, and the
/// same blocks when applied in order.
fn chains(events: Vec<EventKind>) -> Vec<Stored> {
    let mut chains: Vec<Stored> = Vec::new();
    for event in events {
        let EventKind::Stored {
            parent_hash,
            blocks,
        } = event
        else {
            continue;
        };
        let blocks = blocks.into_iter().map(|b| kvroute_proto::StoredBlock {
            block_hash: b.block_hash,
            tokens_hash: b.tokens_hash,
        });
        match chains.last_mut() {
            Some(chain)
                if parent_hash.is_some()
                    && chain.blocks.last().map(|b| b.block_hash) == parent_hash =>
            {
                chain.blocks.extend(blocks);
            }
            _ => chains.push(Stored {
                parent_hash,
                blocks: blocks.collect(),
            }),
        }
    }
    chains
}

/// A worker as the log has it: its latest claim, and that stream's dumps.
struct Follower {
    claim: u64,
    /// None when the claim itself was never seen (see [`ReplicaApplier::current`]).
    instance_id: Option<u64>,
    dumps: DumpState,
    /// Ranks this replica asked the holder to have dumped, until when.
    dump_asked: HashMap<u32, Instant>,
    /// Per rank, the record that last replaced it whole (a dump's last part, a clear).
    replaced: HashMap<u32, u64>,
    /// Its records' context here when this replica does not hold the stream.
    context: Stream,
}

/// Applies the log, in order, to this replica's index. One per replica, driven
/// by the task that reads the log.
pub struct ReplicaApplier {
    state: Arc<AppState>,
    workers: HashMap<u64, Follower>,
}

impl ReplicaApplier {
    pub fn new(state: Arc<AppState>) -> Self {
        Self {
            state,
            workers: HashMap::new(),
        }
    }

    /// The state after the record at `seq`, the last one applied; `None`
    /// while a dump's parts are being gathered (they are not part of it).
    /// Reads the whole index: seconds for millions of blocks, off the async
    /// threads; no record is applied meanwhile, routing goes on.
    pub async fn snapshot(&self, seq: u64) -> Option<Snapshot> {
        if self.workers.values().any(|f| f.dumps.gathering()) {
            return None;
        }
        let workers = self
            .workers
            .iter()
            .map(|(&worker_id, f)| {
                let mut applied: Vec<u32> = f.dumps.applied.iter().copied().collect();
                applied.sort_unstable();
                SnapshotWorker {
                    worker_id,
                    claim: f.claim,
                    instance_id: f.instance_id,
                    dp_ranks: f.context.dp_ranks().to_vec(),
                    applied,
                }
            })
            .collect();
        let index = self.state.tiers.clone();
        let ranks = tokio::task::spawn_blocking(move || {
            let mut keys = index.device.workers();
            keys.sort_unstable();
            keys.into_iter()
                .filter_map(|key| {
                    let dump = index.dump(key)?;
                    let last_event_id = dump.last_event_id?;
                    let dump = Dump {
                        dp_rank: key.dp_rank,
                        last_event_id,
                        chains: chains(dump.device),
                        more: false,
                        offload_chains: chains(dump.offload),
                    };
                    Some((key.worker_id, dump))
                })
                .collect()
        })
        .await
        .unwrap_or_else(|e| std::panic::resume_unwind(e.into_panic()));
        Some(Snapshot {
            seq,
            workers,
            ranks,
        })
    }

    /// Starts from `snapshot` instead of from the log's first record: the
    /// records after `snapshot.seq` are to be applied next.
    pub async fn restore(&mut self, snapshot: Snapshot) {
        for worker in snapshot.workers {
            let mut dumps = DumpState::default();
            dumps.applied.extend(worker.applied);
            let context =
                Stream::follower(Arc::clone(&self.state), worker.worker_id, worker.dp_ranks);
            self.workers.insert(
                worker.worker_id,
                Follower {
                    claim: worker.claim,
                    instance_id: worker.instance_id,
                    dumps,
                    dump_asked: HashMap::new(),
                    replaced: HashMap::new(),
                    context,
                },
            );
        }
        let index = self.state.tiers.clone();
        tokio::task::spawn_blocking(move || {
            for (worker_id, dump) in snapshot.ranks {
                let key = WorkerKey::new(worker_id, dump.dp_rank);
                let convert = |chains: Vec<Stored>| -> Vec<EventKind> {
                    chains.into_iter().map(convert_stored).collect()
                };
                let (device, offload) = (convert(dump.chains), convert(dump.offload_chains));
                index.replace_worker(key, dump.last_event_id, &device, &offload);
            }
        })
        .await
        .unwrap_or_else(|e| std::panic::resume_unwind(e.into_panic()));
    }

    /// Applies the record at `seq`, which follows every record applied before.
    pub async fn apply(&mut self, seq: u64, record: Record) {
        let kind = record.kind();
        let applied = match record {
            Record::Claim {
                worker_id,
                instance_id,
                dp_ranks,
                replica_id,
            } => {
                self.claim(seq, worker_id, instance_id, dp_ranks, &replica_id);
                true
            }
            Record::Events {
                worker_id,
                claim,
                batch,
            } => match self.current(worker_id, claim, batch.dp_rank) {
                Some((follower, context)) => {
                    // What this stream applied: a later, older dump would roll it back.
                    follower.dumps.applied.insert(batch.dp_rank);
                    context.apply_batch(batch).await;
                    true
                }
                None => false,
            },
            Record::Dump {
                worker_id,
                claim,
                dump,
            } => match self.current(worker_id, claim, dump.dp_rank) {
                Some((follower, context)) => {
                    let (rank, last) = (dump.dp_rank, !dump.more);
                    // The holder refuses the same parts, and ends the worker's stream.
                    if let Err(status) = context.apply_dump_part(dump, &mut follower.dumps).await {
                        tracing::debug!(worker_id, %status, "replicated dump part refused");
                    }
                    if last {
                        follower.dump_asked.remove(&rank);
                        follower.replaced.insert(rank, seq);
                    }
                    true
                }
                None => false,
            },
            Record::Clear {
                worker_id,
                claim,
                dp_rank,
            } => match self.current(worker_id, claim, dp_rank) {
                Some((follower, context)) => {
                    follower.dump_asked.remove(&dp_rank);
                    follower.replaced.insert(dp_rank, seq);
                    context.clear_rank(WorkerKey::new(worker_id, dp_rank));
                    true
                }
                None => false,
            },
            Record::Digest {
                worker_id,
                claim,
                digest,
            } => {
                let asked_for = self.dump_wait();
                match self.current(worker_id, claim, digest.dp_rank) {
                    Some((follower, context)) => {
                        let rank = digest.dp_rank;
                        let now = Instant::now();
                        // A dump asked for by this replica is on its way: until it
                        // is applied, nothing is proved (the holder knows the same
                        // of its own requests).
                        let asked = follower.dump_asked.get(&rank).is_some_and(|&t| t > now);
                        let verdict = context.check_digest(digest, asked).await;
                        if verdict == Some(Verdict::Diverged) && !context.holds() {
                            follower.dump_asked.insert(rank, now + asked_for);
                            if let Some(replica) = self.state.replica.get() {
                                replica.ask_for_dump(worker_id, claim, rank, seq);
                            }
                        }
                        // Mid-resync or trimmed, this view proves nothing to peers.
                        if !asked && !context.resyncing(rank) {
                            self.publish_own(seq, worker_id, claim, rank);
                        }
                        true
                    }
                    None => false,
                }
            }
            Record::Diverged {
                worker_id,
                claim,
                dp_rank,
                seq: wrong_at,
                replica_id,
            } => match self.current(worker_id, claim, dp_rank) {
                Some((follower, context)) => {
                    // Several replicas may ask about one difference; a dump
                    // applied since answers all of them.
                    if follower
                        .replaced
                        .get(&dp_rank)
                        .is_none_or(|&at| at < wrong_at)
                    {
                        context.dump_for_replica(dp_rank, &replica_id).await;
                    }
                    true
                }
                None => false,
            },
        };
        if applied {
            ::metrics::counter!(metrics::CLUSTER_RECORDS, "kind" => kind).increment(1);
        } else {
            ::metrics::counter!(metrics::CLUSTER_SKIPPED).increment(1);
        }
    }

    /// How long a dump asked for from the holder is awaited before this
    /// replica's digests count again: as long as the holder awaits it.
    fn dump_wait(&self) -> Duration {
        let ingest = &self.state.config.ingest;
        Duration::from_millis(ingest.resync_timeout_ms * u64::from(ingest.resync_attempts.max(1)))
    }

    /// This replica's digest of the rank now, for its peers to compare.
    fn publish_own(&self, seq: u64, worker_id: u64, claim: u64, dp_rank: u32) {
        let (Some(replica), Some(indexed)) = (
            self.state.replica.get(),
            self.state.tiers.digest(WorkerKey::new(worker_id, dp_rank)),
        ) else {
            return;
        };
        if indexed.trimmed {
            return;
        }
        replica.own_digest(PeerDigest {
            replica_id: replica.replica_id.clone(),
            seq,
            worker_id,
            claim,
            dp_rank,
            last_event_id: indexed.last_event_id,
            block_count: indexed.digest.block_count,
            block_set_hash: indexed.digest.block_set_hash,
        });
    }

    fn claim(
        &mut self,
        seq: u64,
        worker_id: u64,
        instance_id: u64,
        dp_ranks: Vec<u32>,
        replica_id: &str,
    ) {
        let context = Stream::follower(Arc::clone(&self.state), worker_id, dp_ranks.clone());
        if let Some(previous) = self.workers.get(&worker_id)
            && previous.instance_id.is_some_and(|i| i != instance_id)
        {
            tracing::info!(
                worker = worker_id,
                instance_id,
                "a new instance of the worker registered: clearing its ranks"
            );
            ::metrics::counter!(metrics::WORKER_RESTARTS, "worker" => worker_id.to_string())
                .increment(1);
            let mut ranks = previous.context.dp_ranks().to_vec();
            for &rank in &dp_ranks {
                if !ranks.contains(&rank) {
                    ranks.push(rank);
                }
            }
            for rank in ranks {
                context.clear_rank(WorkerKey::new(worker_id, rank));
            }
        }
        tracing::debug!(
            worker = worker_id,
            claim = seq,
            replica = replica_id,
            "claim applied"
        );
        self.workers.insert(
            worker_id,
            Follower {
                claim: seq,
                instance_id: Some(instance_id),
                dumps: DumpState::default(),
                dump_asked: HashMap::new(),
                replaced: HashMap::new(),
                context,
            },
        );
    }

    /// The worker's state and the context to apply its record in, if `claim`
    /// is its latest: the stream itself when held here.
    ///
    /// A worker whose claim this replica never saw (it left the stream's
    /// retention before this replica started) is taken to be on that claim,
    /// with the ranks its records name: without it, a replica started later
    /// would never apply that worker's records until it reconnected.
    fn current(
        &mut self,
        worker_id: u64,
        claim: u64,
        dp_rank: u32,
    ) -> Option<(&mut Follower, Stream)> {
        let state = &self.state;
        let follower = self.workers.entry(worker_id).or_insert_with(|| Follower {
            claim,
            instance_id: None,
            dumps: DumpState::default(),
            dump_asked: HashMap::new(),
            replaced: HashMap::new(),
            context: Stream::follower(Arc::clone(state), worker_id, Vec::new()),
        });
        if follower.claim != claim {
            return None;
        }
        if follower.instance_id.is_none() && !follower.context.dp_ranks().contains(&dp_rank) {
            let mut ranks = follower.context.dp_ranks().to_vec();
            ranks.push(dp_rank);
            follower.context = Stream::follower(Arc::clone(state), worker_id, ranks);
        }
        let context = self
            .state
            .replica
            .get()
            .and_then(|r| r.holder(worker_id, claim))
            .and_then(|held| {
                (held as Arc<dyn std::any::Any + Send + Sync>)
                    .downcast::<Stream>()
                    .ok()
            })
            .map(|stream| (*stream).clone())
            .unwrap_or_else(|| follower.context.clone());
        Some((follower, context))
    }
}

#[cfg(test)]
mod tests {
    use kvroute_proto::{KvEvent, Stored, StoredBlock, kv_event};

    use std::any::Any;
    use std::sync::Mutex;

    use futures_util::future::BoxFuture;
    use kvroute_proto::EventBatch;

    use super::*;
    use crate::config::Config;
    use crate::fleet::Registration;
    use crate::replica::{EventLog, Replica, Unlogged};

    fn batch(first_id: u64, blocks: &[u64]) -> EventBatch {
        // One Stored event per block, chained from the root.
        let events = blocks
            .iter()
            .enumerate()
            .map(|(i, &hash)| KvEvent {
                tier: Default::default(),
                event_id: first_id + i as u64,
                kind: Some(kv_event::Kind::Stored(Stored {
                    parent_hash: (i > 0).then(|| blocks[i - 1]),
                    blocks: vec![StoredBlock {
                        block_hash: hash,
                        tokens_hash: hash * 10,
                    }],
                })),
            })
            .collect();
        EventBatch { dp_rank: 0, events }
    }

    fn claim(worker_id: u64, instance_id: u64) -> Record {
        Record::Claim {
            worker_id,
            instance_id,
            dp_ranks: vec![0],
            replica_id: "r".into(),
        }
    }

    fn events(claim: u64, batch: EventBatch) -> Record {
        Record::Events {
            worker_id: 1,
            claim,
            batch,
        }
    }

    /// (blocks, last event id) of worker 1's rank 0.
    fn rank(state: &AppState) -> (u64, Option<u64>) {
        let key = WorkerKey::new(1, 0);
        (
            state.index.worker_blocks(key),
            state.index.last_event_id(key),
        )
    }

    #[tokio::test]
    async fn only_the_latest_claims_records_apply_and_resent_events_apply_once() {
        let state = AppState::new(Config::default(), None).unwrap();
        let mut applier = ReplicaApplier::new(Arc::clone(&state));
        applier.apply(1, claim(1, 7)).await;
        applier.apply(2, events(1, batch(0, &[11, 12]))).await;
        assert_eq!(rank(&state), (2, Some(1)));
        // The worker moved: a claim of the same instance keeps its state.
        applier.apply(3, claim(1, 7)).await;
        assert_eq!(rank(&state), (2, Some(1)));
        // The old stream's late record is skipped; the new one's resend of
        // event 1 is stale, event 2 applies.
        applier.apply(4, events(1, batch(2, &[13]))).await;
        assert_eq!(rank(&state), (2, Some(1)));
        applier.apply(5, events(3, batch(1, &[12, 13]))).await;
        assert_eq!(rank(&state), (3, Some(2)));
        // A clear of the old claim is skipped too; the current one's applies.
        let clear = |claim| Record::Clear {
            worker_id: 1,
            claim,
            dp_rank: 0,
        };
        applier.apply(6, clear(1)).await;
        assert_eq!(rank(&state), (3, Some(2)));
        applier.apply(7, clear(3)).await;
        assert_eq!(rank(&state), (0, None));
    }

    #[tokio::test]
    async fn records_whose_claim_left_the_retention_still_apply() {
        let state = AppState::new(Config::default(), None).unwrap();
        let mut applier = ReplicaApplier::new(Arc::clone(&state));
        // Claim 1 is gone from the stream: its records come first.
        applier.apply(40, events(1, batch(30, &[11, 12]))).await;
        assert_eq!(rank(&state), (2, Some(31)));
        // A later claim still fences it.
        applier.apply(41, claim(1, 7)).await;
        applier.apply(42, events(1, batch(32, &[13]))).await;
        assert_eq!(rank(&state), (2, Some(31)));
    }

    #[tokio::test]
    async fn a_claim_of_a_new_instance_clears_the_workers_ranks() {
        let state = AppState::new(Config::default(), None).unwrap();
        let mut applier = ReplicaApplier::new(Arc::clone(&state));
        applier.apply(1, claim(1, 7)).await;
        applier.apply(2, events(1, batch(0, &[11, 12]))).await;
        assert_eq!(rank(&state), (2, Some(1)));
        applier.apply(3, claim(1, 8)).await;
        assert_eq!(rank(&state), (0, None));
        // The new instance's ids start again.
        applier.apply(4, events(3, batch(0, &[21]))).await;
        assert_eq!(rank(&state), (1, Some(0)));
    }

    /// Every rank of `state`'s index: (key, last event id, blocks as a dump).
    fn ranks(state: &AppState) -> Vec<(WorkerKey, Option<u64>, Vec<EventKind>)> {
        let mut keys = state.index.workers();
        keys.sort_unstable();
        keys.into_iter()
            .map(|key| {
                let dump = state.index.dump(key).unwrap();
                let mut events = dump.events;
                events.sort_by_key(|e| format!("{e:?}"));
                (key, dump.last_event_id, events)
            })
            .collect()
    }

    fn dump_record(
        worker_id: u64,
        claim: u64,
        last_event_id: u64,
        hashes: &[u64],
        more: bool,
    ) -> Record {
        // One chain from the root.
        Record::Dump {
            worker_id,
            claim,
            dump: Dump {
                dp_rank: 0,
                last_event_id,
                chains: vec![Stored {
                    parent_hash: None,
                    blocks: hashes
                        .iter()
                        .map(|&h| StoredBlock {
                            block_hash: h,
                            tokens_hash: h * 10,
                        })
                        .collect(),
                }],
                more,
                offload_chains: Vec::new(),
            },
        }
    }

    #[tokio::test]
    async fn a_restored_snapshot_then_the_rest_of_the_log_gives_what_the_whole_log_gives() {
        let head = [
            claim(1, 7),
            events(1, batch(0, &[11, 12, 13])),
            Record::Events {
                worker_id: 1,
                claim: 1,
                batch: EventBatch {
                    dp_rank: 0,
                    events: vec![KvEvent {
                        tier: Default::default(),
                        event_id: 3,
                        kind: Some(kv_event::Kind::Stored(Stored {
                            // A branch below block 11.
                            parent_hash: Some(11),
                            blocks: vec![StoredBlock {
                                block_hash: 14,
                                tokens_hash: 140,
                            }],
                        })),
                    }],
                },
            },
            claim(2, 5),
            dump_record(2, 4, 9, &[21, 22], false),
            // Worker 3's claim left the log: its records name claim 6.
            Record::Events {
                worker_id: 3,
                claim: 6,
                batch: batch(40, &[31]),
            },
        ];
        let tail = vec![
            // Resent (stale), then new.
            events(1, batch(2, &[13, 15])),
            // Older than what worker 2's stream applied: refused.
            dump_record(2, 4, 8, &[21], false),
            Record::Events {
                worker_id: 2,
                claim: 4,
                batch: batch(10, &[23]),
            },
            Record::Events {
                worker_id: 3,
                claim: 6,
                batch: batch(41, &[32]),
            },
            // Worker 1 restarts: cleared, then ids start again.
            claim(1, 8),
            events(11, batch(0, &[16])),
        ];
        let whole = AppState::new(Config::default(), None).unwrap();
        let mut applier = ReplicaApplier::new(Arc::clone(&whole));
        let mut seq = 0;
        let mut restored_state = None;
        for record in head.iter().chain(&tail) {
            seq += 1;
            applier.apply(seq, record.clone()).await;
            if seq as usize == head.len() {
                // Taken between two records, restored on a fresh replica.
                let snapshot = applier.snapshot(seq).await.unwrap();
                assert_eq!(snapshot.seq, seq);
                let later = AppState::new(Config::default(), None).unwrap();
                let mut restored = ReplicaApplier::new(Arc::clone(&later));
                restored.restore(snapshot).await;
                assert_eq!(ranks(&later), ranks(&whole));
                let mut next = seq;
                for record in &tail {
                    next += 1;
                    restored.apply(next, record.clone()).await;
                }
                // Compared once the whole log is applied below.
                restored_state = Some(later);
            }
        }
        let later = restored_state.unwrap();
        assert_eq!(ranks(&later), ranks(&whole));
        let (blocks, last) = rank(&later);
        assert_eq!((blocks, last), (1, Some(0)));
    }

    #[tokio::test]
    async fn no_snapshot_while_a_dump_is_half_gathered() {
        let state = AppState::new(Config::default(), None).unwrap();
        let mut applier = ReplicaApplier::new(Arc::clone(&state));
        applier.apply(1, claim(1, 7)).await;
        applier
            .apply(2, dump_record(1, 1, 4, &[31, 32], true))
            .await;
        assert_eq!(applier.snapshot(2).await, None);
        applier.apply(3, dump_record(1, 1, 4, &[33], false)).await;
        assert!(applier.snapshot(3).await.is_some());
    }

    #[test]
    fn a_dumps_events_become_chains_with_the_same_blocks() {
        let stored = |parent: Option<u64>, hash: u64| EventKind::Stored {
            parent_hash: parent,
            blocks: vec![kvroute_index::StoredBlock {
                block_hash: hash,
                tokens_hash: hash + 100,
            }],
        };
        // 1 → 2 → 3, 1 → 4 → 5, a second name 6 for block 2's place, a root 7.
        let events = vec![
            stored(None, 1),
            stored(Some(1), 2),
            stored(Some(1), 6),
            stored(Some(2), 3),
            stored(Some(1), 4),
            stored(Some(4), 5),
            stored(None, 7),
        ];
        let chains = chains(events);
        let shape: Vec<(Option<u64>, Vec<u64>)> = chains
            .iter()
            .map(|c| {
                (
                    c.parent_hash,
                    c.blocks.iter().map(|b| b.block_hash).collect(),
                )
            })
            .collect();
        assert_eq!(
            shape,
            vec![
                (None, vec![1, 2]),
                (Some(1), vec![6]),
                (Some(2), vec![3]),
                (Some(1), vec![4, 5]),
                (None, vec![7]),
            ]
        );
        assert!(
            chains
                .iter()
                .flat_map(|c| &c.blocks)
                .all(|b| b.tokens_hash == b.block_hash + 100)
        );
    }

    #[tokio::test]
    async fn an_older_dump_than_what_the_claims_stream_applied_is_refused() {
        let state = AppState::new(Config::default(), None).unwrap();
        let mut applier = ReplicaApplier::new(Arc::clone(&state));
        applier.apply(1, claim(1, 7)).await;
        let dump = |last_event_id, hashes: &[u64]| Record::Dump {
            worker_id: 1,
            claim: 1,
            dump: Dump {
                dp_rank: 0,
                last_event_id,
                chains: hashes
                    .iter()
                    .map(|&h| Stored {
                        parent_hash: None,
                        blocks: vec![StoredBlock {
                            block_hash: h,
                            tokens_hash: h * 10,
                        }],
                    })
                    .collect(),
                more: false,
                offload_chains: Vec::new(),
            },
        };
        applier.apply(2, dump(4, &[31, 32, 33])).await;
        assert_eq!(rank(&state), (3, Some(4)));
        applier.apply(3, events(1, batch(5, &[34]))).await;
        assert_eq!(rank(&state), (4, Some(5)));
        // A late answer to an earlier resync would roll the rank back.
        applier.apply(4, dump(3, &[31])).await;
        assert_eq!(rank(&state), (4, Some(5)));
    }

    /// A log that keeps what is appended or published.
    #[derive(Default)]
    struct Kept {
        appended: Mutex<Vec<Record>>,
        published: Mutex<Vec<PeerDigest>>,
    }

    impl EventLog for Kept {
        fn append(&self, record: Record) -> BoxFuture<'static, Result<u64, Unlogged>> {
            let mut appended = self.appended.lock().unwrap();
            appended.push(record);
            let seq = appended.len() as u64;
            Box::pin(async move { Ok(seq) })
        }

        fn hold(&self, _: Registration) -> Box<dyn Any + Send> {
            Box::new(())
        }

        fn publish_digest(&self, digest: PeerDigest) {
            self.published.lock().unwrap().push(digest);
        }
    }

    fn peer(replica_id: &str, seq: u64, block_count: u64) -> PeerDigest {
        PeerDigest {
            replica_id: replica_id.into(),
            seq,
            worker_id: 1,
            claim: 3,
            dp_rank: 0,
            last_event_id: Some(9),
            block_count,
            block_set_hash: block_count * 7,
        }
    }

    #[tokio::test]
    async fn digests_of_the_same_point_of_the_log_are_compared_whichever_comes_first() {
        let log = Arc::new(Kept::default());
        let replica = Replica::new(Arc::clone(&log) as Arc<dyn EventLog>, "a".into());
        // Own first, then agreeing peers: nothing asked; own digests are published.
        replica.own_digest(peer("a", 10, 4));
        replica.peer_digest(peer("b", 10, 4));
        // A peer's digest of a point not applied here yet waits for ours.
        replica.peer_digest(peer("b", 11, 4));
        replica.own_digest(peer("a", 11, 4));
        // Another point, another worker's claim: not comparable.
        replica.peer_digest(PeerDigest {
            claim: 4,
            ..peer("b", 12, 5)
        });
        replica.own_digest(peer("a", 12, 4));
        // Our own echo is not a peer.
        replica.peer_digest(peer("a", 10, 5));
        tokio::task::yield_now().await;
        assert!(log.appended.lock().unwrap().is_empty());
        assert_eq!(log.published.lock().unwrap().len(), 3);

        // A difference, either way round, asks the holder for a dump.
        replica.peer_digest(peer("c", 13, 5));
        replica.own_digest(peer("a", 13, 4));
        replica.peer_digest(peer("b", 10, 3));
        for _ in 0..10 {
            tokio::task::yield_now().await;
        }
        let wanted = |seq| Record::Diverged {
            worker_id: 1,
            claim: 3,
            dp_rank: 0,
            seq,
            replica_id: "a".into(),
        };
        assert_eq!(*log.appended.lock().unwrap(), vec![wanted(13), wanted(10)]);
    }
}
