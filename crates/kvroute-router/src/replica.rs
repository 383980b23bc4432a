//! The seam between ingest and a log shared by router replicas (`[cluster]`).
//!
//! With one replica, a worker stream's applier applies its batches and dumps to
//! the index itself. With several, the replica that holds the stream appends
//! them to a shared, ordered log ([`EventLog`]; NATS JetStream in
//! `kvroute-cluster`) and every replica, the holder included, applies the log
//! in order through a [`ReplicaApplier`]. So every index goes through the same
//! states, and one replica's index is every replica's.
//!
//! The holder learns the outcome of its worker's records from its own applier:
//! a gap asks the worker for a resync, an applied record is acked (so an ack
//! means the log stored it), a refused dump answers with an error. Gaps,
//! resyncs, dumps, restarts and refusals thus mean what they mean with one
//! replica; the other replicas apply the same records and answer nobody.
//!
//! Each stream opens with a [`Record::Claim`]; its sequence in the log names
//! the claim, and the stream's records carry it. A record of any claim but its
//! worker's latest is skipped on every replica alike, so a replica that lost a
//! worker to another can no longer write its state. A claim with a new
//! instance id is the worker's restart: its ranks are cleared everywhere.
//! Event ids make a resent event stale, so a worker that moves to another
//! replica and resends has nothing applied twice.
//!
//! A replica that starts later need not replay the whole log: a [`Snapshot`]
//! is the applier's state at one record (the workers' claims and every
//! indexed rank's blocks), taken between two records, so that restoring it
//! and applying the records after it gives what applying them all gives.
//!
//! Workers' digests are records too ([`Record::Digest`]): every replica checks
//! one against its own index at the same point of the log, and publishes its
//! own digest of that point for its peers ([`PeerDigest`]). A replica that
//! finds its view wrong cannot ask the worker itself: it appends a
//! [`Record::Diverged`], and the holder asks for the dump that heals everyone.
//!
//! This module knows nothing of NATS: without `[cluster]` none of it runs.

use std::any::Any;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use dashmap::DashMap;
use futures_util::future::BoxFuture;
use kvroute_index::WorkerKey;
use kvroute_proto::{Digest, Dump, EventBatch};
use serde::{Deserialize, Serialize};
use tokio::sync::OwnedSemaphorePermit;

use crate::fleet::Registration;
use crate::ingest::work::Work;
use crate::metrics;

/// One entry of the shared log.
#[derive(Clone, Debug, PartialEq)]
pub enum Record {
    /// A worker's stream opened on `replica_id`.
    Claim {
        worker_id: u64,
        instance_id: u64,
        dp_ranks: Vec<u32>,
        replica_id: String,
    },
    /// A batch of the stream of `claim` (the claim's sequence), ids kept.
    Events {
        worker_id: u64,
        claim: u64,
        batch: EventBatch,
    },
    /// A dump, or a part of one, of the stream of `claim`.
    Dump {
        worker_id: u64,
        claim: u64,
        dump: Dump,
    },
    /// The holder gave up resyncing a rank: it is cleared.
    Clear {
        worker_id: u64,
        claim: u64,
        dp_rank: u32,
    },
    /// The worker's digest of a rank, checked by every replica at this point
    /// of the log: after exactly the events the holder appended before it.
    Digest {
        worker_id: u64,
        claim: u64,
        digest: Digest,
    },
    /// Replica `replica_id` found its view of a rank wrong at the log's record
    /// `seq` (a worker's digest): the holder asks the worker for a full dump,
    /// which heals every replica, unless one was applied since.
    Diverged {
        worker_id: u64,
        claim: u64,
        dp_rank: u32,
        seq: u64,
        replica_id: String,
    },
}

impl Record {
    pub fn worker_id(&self) -> u64 {
        match self {
            Record::Claim { worker_id, .. }
            | Record::Events { worker_id, .. }
            | Record::Dump { worker_id, .. }
            | Record::Clear { worker_id, .. }
            | Record::Digest { worker_id, .. }
            | Record::Diverged { worker_id, .. } => *worker_id,
        }
    }

    /// The kind's name, for subjects and metrics.
    pub fn kind(&self) -> &'static str {
        match self {
            Record::Claim { .. } => "claim",
            Record::Events { .. } => "events",
            Record::Dump { .. } => "dump",
            Record::Clear { .. } => "clear",
            Record::Digest { .. } => "digest",
            Record::Diverged { .. } => "diverged",
        }
    }
}

/// A record the log did not store, given back with why.
pub struct Unlogged {
    pub error: String,
    pub record: Record,
    /// The log answered, and refused this record (too large): resending it
    /// would not help.
    pub refused: bool,
}

/// The shared, ordered log and the registrations beside it.
pub trait EventLog: Send + Sync {
    /// Appends `record`; resolves with its sequence once the log has stored it.
    fn append(&self, record: Record) -> BoxFuture<'static, Result<u64, Unlogged>>;
    /// Publishes the registration of a worker whose stream this replica holds,
    /// and keeps it alive until the returned guard is dropped.
    fn hold(&self, registration: Registration) -> Box<dyn Any + Send>;
    /// Tells the other replicas this replica's digest of a rank at a point of
    /// the log; best effort (a lost one is one comparison missed).
    fn publish_digest(&self, digest: PeerDigest);
}

/// A replica's own digest of a worker's rank just after applying the log's
/// record `seq` (a worker's digest): every replica computes one at the same
/// point, so any two of them must be equal.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct PeerDigest {
    pub replica_id: String,
    pub seq: u64,
    pub worker_id: u64,
    pub claim: u64,
    pub dp_rank: u32,
    pub last_event_id: Option<u64>,
    pub block_count: u64,
    pub block_set_hash: u64,
}

impl PeerDigest {
    fn key(&self) -> (u64, u64, u32) {
        (self.seq, self.worker_id, self.dp_rank)
    }

    fn agrees(&self, other: &PeerDigest) -> bool {
        (self.last_event_id, self.block_count, self.block_set_hash)
            == (other.last_event_id, other.block_count, other.block_set_hash)
    }
}

/// Digests kept for comparison, this replica's and its peers', by (seq,
/// worker, rank); the oldest go past [`PEER_DIGESTS_KEPT`] each.
#[derive(Default)]
/// Two books under one lock, on purpose: a digest filed in one is looked for
/// in the other in the same step, so a peer's and this replica's digests of a
/// point that arrive at once are still compared. (Not a concurrent map's job.)
struct PeerDigests {
    own: BTreeMap<(u64, u64, u32), PeerDigest>,
    theirs: BTreeMap<(u64, u64, u32), Vec<PeerDigest>>,
}

/// Enough for peers a few seconds apart at one digest per worker rank and second.
const PEER_DIGESTS_KEPT: usize = 4_096;

/// A worker stream held by this replica, as the replica reaches it: to ask its
/// worker to replay, and to clear a rank when the log does not answer. The
/// log's applier ([`crate::ingest::log`]) takes it back as the stream itself.
pub trait HeldStream: Any + Send + Sync {
    fn worker_id(&self) -> u64;
    fn ask_replay(&self, dp_rank: u32, from: u64) -> BoxFuture<'_, ()>;
    fn clear_rank(&self, key: WorkerKey);
}

/// A stream held here: its claim, and the stream.
type Holding = (u64, Arc<dyn HeldStream>);

/// A replica's side of the cluster, in [`crate::state::AppState::replica`].
pub struct Replica {
    pub log: Arc<dyn EventLog>,
    /// This replica's name (`cluster.replica_id`), in its claims.
    pub replica_id: String,
    /// Streams held here, by worker: their claim, and their context.
    held: DashMap<u64, Holding>,
    connected: AtomicBool,
    caught_up: AtomicBool,
    /// Records of the log not applied here yet, as the last one read said.
    behind: AtomicU64,
    /// (worker, rank) → the claim and the first event id applied here only.
    unlogged: DashMap<(u64, u32), (u64, u64)>,
    peer_digests: Mutex<PeerDigests>,
}

impl Replica {
    pub fn new(log: Arc<dyn EventLog>, replica_id: String) -> Self {
        Self {
            log,
            replica_id,
            held: DashMap::new(),
            connected: AtomicBool::new(true),
            caught_up: AtomicBool::new(false),
            behind: AtomicU64::new(0),
            unlogged: DashMap::new(),
            peer_digests: Mutex::default(),
        }
    }

    /// Whether the log answered the last time it was used.
    pub fn connected(&self) -> bool {
        self.connected.load(Ordering::Acquire)
    }

    /// Records whether the log answers; says so in the log on a change only.
    /// Back in touch, asks the workers to resend what was applied here alone.
    pub async fn set_connected(&self, connected: bool) {
        if self.connected.swap(connected, Ordering::AcqRel) != connected {
            if connected {
                tracing::info!("the cluster's event log answers again");
            } else {
                tracing::warn!(
                    "the cluster's event log does not answer: routing on the state at hand, applying events here only"
                );
            }
        }
        if connected {
            self.replay_unlogged().await;
        }
    }

    /// Asks held workers to resend the ranks whose events were applied here
    /// only while the log did not answer, so that they reach the log, and
    /// every other replica, after all. Here they are stale: nothing changes.
    async fn replay_unlogged(&self) {
        let mut unlogged = Vec::new();
        self.unlogged.retain(|&rank, &mut since| {
            unlogged.push((rank, since));
            false
        });
        for ((worker_id, dp_rank), (claim, from)) in unlogged {
            if let Some(stream) = self.holder(worker_id, claim) {
                tracing::info!(
                    worker = worker_id,
                    dp_rank,
                    from,
                    "asking the worker to resend what the cluster's log missed"
                );
                stream.ask_replay(dp_rank, from).await;
            }
        }
    }

    /// Whether this replica has applied the log as far as it stood at start.
    pub fn caught_up(&self) -> bool {
        self.caught_up.load(Ordering::Acquire)
    }

    /// Records of the log not applied here yet (the replication lag).
    pub fn behind(&self) -> u64 {
        self.behind.load(Ordering::Relaxed)
    }

    pub fn set_behind(&self, records: u64) {
        self.behind.store(records, Ordering::Relaxed);
    }

    pub fn set_caught_up(&self) {
        if !self.caught_up.swap(true, Ordering::AcqRel) {
            tracing::info!("caught up with the cluster's event log");
        }
    }

    /// Records this replica's digest at a point of the log, publishes it, and
    /// compares it with the peers' digests of the same point that came first.
    pub(crate) fn own_digest(&self, digest: PeerDigest) {
        self.log.publish_digest(digest.clone());
        let theirs = {
            let mut book = self.peer_digests.lock().unwrap();
            let theirs = book.theirs.remove(&digest.key()).unwrap_or_default();
            book.own.insert(digest.key(), digest.clone());
            if book.own.len() > PEER_DIGESTS_KEPT {
                book.own.pop_first();
            }
            theirs
        };
        for peer in theirs {
            self.compare(&digest, &peer);
        }
    }

    /// A peer's digest at a point of the log: compared with this replica's
    /// there, now or once this replica has applied that far.
    pub fn peer_digest(&self, peer: PeerDigest) {
        if peer.replica_id == self.replica_id {
            return;
        }
        let own = {
            let mut book = self.peer_digests.lock().unwrap();
            let own = book.own.get(&peer.key()).cloned();
            if own.is_none() {
                book.theirs
                    .entry(peer.key())
                    .or_default()
                    .push(peer.clone());
                if book.theirs.len() > PEER_DIGESTS_KEPT {
                    book.theirs.pop_first();
                }
            }
            own
        };
        if let Some(own) = own {
            self.compare(&own, &peer);
        }
    }

    /// Counts the comparison; a difference asks the worker's holder, through
    /// the log, for a dump (the holder asks once however many replicas do).
    fn compare(&self, own: &PeerDigest, peer: &PeerDigest) {
        if own.claim != peer.claim {
            return;
        }
        let agrees = own.agrees(peer);
        let outcome = if agrees { "matched" } else { "differed" };
        ::metrics::counter!(metrics::CLUSTER_PEER_DIGESTS, "outcome" => outcome).increment(1);
        if agrees {
            return;
        }
        tracing::warn!(
            worker = own.worker_id,
            dp_rank = own.dp_rank,
            seq = own.seq,
            peer = %peer.replica_id,
            own_blocks = own.block_count,
            peer_blocks = peer.block_count,
            own_event_id = ?own.last_event_id,
            peer_event_id = ?peer.last_event_id,
            "another replica's index differs from this one's at the same point of the log: asking for a full dump"
        );
        self.ask_for_dump(own.worker_id, own.claim, own.dp_rank, own.seq);
    }

    /// Asks the worker's holder, through the log, for a dump of `dp_rank`, as
    /// the rank stood wrong at record `seq`: only the holder can ask the
    /// worker. Not awaited: the log goes on meanwhile.
    pub(crate) fn ask_for_dump(&self, worker_id: u64, claim: u64, dp_rank: u32, seq: u64) {
        let record = Record::Diverged {
            worker_id,
            claim,
            dp_rank,
            seq,
            replica_id: self.replica_id.clone(),
        };
        let log = Arc::clone(&self.log);
        tokio::spawn(async move {
            if let Err(e) = log.append(record).await {
                ::metrics::counter!(metrics::CLUSTER_APPEND_FAILURES).increment(1);
                tracing::warn!(worker = worker_id, dp_rank, error = %e.error, "could not ask the worker's holder for a dump");
            }
        });
    }

    /// Opens a stream in the log; the claim's sequence names it.
    pub(crate) async fn claim(
        &self,
        worker_id: u64,
        instance_id: u64,
        dp_ranks: &[u32],
    ) -> Result<u64, tonic::Status> {
        let record = Record::Claim {
            worker_id,
            instance_id,
            dp_ranks: dp_ranks.to_vec(),
            replica_id: self.replica_id.clone(),
        };
        let result = self.log.append(record).await;
        self.set_connected(result.is_ok()).await;
        result.map_err(|e| {
            tonic::Status::unavailable(format!("the cluster's event log: {}", e.error))
        })
    }

    pub(crate) fn hold(&self, claim: u64, stream: Arc<dyn HeldStream>) {
        let worker_id = stream.worker_id();
        self.held.insert(worker_id, (claim, stream));
    }

    /// The stream of `claim` ended.
    pub(crate) fn release(&self, worker_id: u64, claim: u64) {
        self.held.remove_if(&worker_id, |_, (c, _)| *c == claim);
    }

    pub(crate) fn holder(&self, worker_id: u64, claim: u64) -> Option<Arc<dyn HeldStream>> {
        self.held
            .get(&worker_id)
            .filter(|held| held.0 == claim)
            .map(|held| Arc::clone(&held.1))
    }

    /// Appends a stream's queued work; gives it back when the log did not take
    /// it, to be applied here (so no event is lost while NATS is away).
    pub(crate) async fn append(&self, worker_id: u64, claim: u64, item: Work) -> Option<Work> {
        let (record, permit): (Record, OwnedSemaphorePermit) = match item {
            Work::Events(batch, permit) => (
                Record::Events {
                    worker_id,
                    claim,
                    batch,
                },
                permit,
            ),
            Work::Dump(dump, permit) => (
                Record::Dump {
                    worker_id,
                    claim,
                    dump,
                },
                permit,
            ),
            // Checked in the log's order, on every replica, like the events
            // it covers: here the index may still be behind the log.
            Work::Digest(digest, permit) => (
                Record::Digest {
                    worker_id,
                    claim,
                    digest,
                },
                permit,
            ),
        };
        match self.log.append(record).await {
            Ok(_) => {
                self.set_connected(true).await;
                None
            }
            Err(unlogged) => {
                ::metrics::counter!(metrics::CLUSTER_APPEND_FAILURES).increment(1);
                if unlogged.refused {
                    tracing::warn!(worker = worker_id, error = %unlogged.error, "the cluster's log refused a record: applied on this replica only");
                } else {
                    self.set_connected(false).await;
                    tracing::debug!(worker = worker_id, error = %unlogged.error, "not appended");
                }
                let refused = unlogged.refused;
                let (rank, from, work) = match unlogged.record {
                    Record::Events { batch, .. } => (
                        batch.dp_rank,
                        batch.events.first().map_or(0, |e| e.event_id),
                        Work::Events(batch, permit),
                    ),
                    // Nobody else has it: the whole rank is to be resent.
                    Record::Dump { dump, .. } => (dump.dp_rank, 0, Work::Dump(dump, permit)),
                    // Checked here alone, against what was applied here alone.
                    Record::Digest { digest, .. } => return Some(Work::Digest(digest, permit)),
                    _ => return None,
                };
                if refused {
                    return Some(work);
                }
                self.unlogged
                    .entry((worker_id, rank))
                    .and_modify(|(c, f)| {
                        if *c == claim {
                            *f = (*f).min(from);
                        } else {
                            (*c, *f) = (claim, from);
                        }
                    })
                    .or_insert((claim, from));
                Some(work)
            }
        }
    }

    /// Clears a rank on every replica (here too if the log does not answer).
    pub(crate) async fn clear(&self, worker_id: u64, claim: u64, dp_rank: u32) {
        let record = Record::Clear {
            worker_id,
            claim,
            dp_rank,
        };
        let result = self.log.append(record).await;
        self.set_connected(result.is_ok()).await;
        if result.is_err()
            && let Some(stream) = self.holder(worker_id, claim)
        {
            stream.clear_rank(WorkerKey::new(worker_id, dp_rank));
        }
    }
}

/// The log as applied up to one record, for a replica that starts later.
#[derive(Clone, Debug, PartialEq)]
pub struct Snapshot {
    /// The sequence of the last record it covers.
    pub seq: u64,
    pub workers: Vec<SnapshotWorker>,
    /// Every indexed rank, by worker id, as a dump: its blocks as chains,
    /// parents first, as of the rank's last applied event.
    pub ranks: Vec<(u64, Dump)>,
}

/// A worker's latest claim, as a [`Snapshot`] keeps it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SnapshotWorker {
    pub worker_id: u64,
    pub claim: u64,
    /// None when the claim itself left the log before it was applied.
    pub instance_id: Option<u64>,
    pub dp_ranks: Vec<u32>,
    /// Ranks the claim's stream applied to: an older dump is refused there.
    pub applied: Vec<u32>,
}
