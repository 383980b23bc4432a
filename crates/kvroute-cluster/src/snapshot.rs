//! Index snapshots in the JetStream object store `kvroute-snapshots`, so that
//! a replica that starts need not replay the whole stream, and the stream
//! need not keep it: retention (age, bytes) only has to outlast the newest
//! snapshot.
//!
//! A snapshot is the applier's state after one record ([`Snapshot`]), taken
//! by the follower between two records, with that record's stream sequence.
//! Each replica writes under its own name (`index-<replica_id>`), so two
//! writers never replace each other's chunks. Any replica may write; one whose
//! turn comes first does (the newest snapshot is older than
//! `snapshot_interval_s`, plus a delay of up to a fifth of it fixed by the
//! replica's name, or the records after it fill half of the stream's byte
//! bound), and the others see its snapshot in the store and wait. No lease:
//! two writing at once cost an upload, nothing else, and a dead replica never
//! holds the others up.
//!
//! The bytes: a magic line, the header (sequence, claims, which worker each
//! rank is) as JSON behind its length, then each rank as a length-delimited
//! protobuf `Dump` (the worker protocol's own message), chains parents first.

use std::collections::hash_map::DefaultHasher;
use std::hash::{Hash, Hasher};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use async_nats::jetstream::{self, object_store};
use futures_util::StreamExt;
use kvroute_proto::Dump;
use kvroute_router::ingest::log::ReplicaApplier;
use kvroute_router::metrics;
use kvroute_router::replica::{Replica, Snapshot, SnapshotWorker};
use prost::Message as _;
use serde::{Deserialize, Serialize};
use tokio::io::AsyncReadExt;
use tokio::sync::{mpsc, oneshot, watch};

use crate::{ClusterError, record};

pub const BUCKET: &str = "kvroute-snapshots";

const MAGIC: &[u8] = b"kvroute index snapshot 1\n";
/// Object metadata: the sequence covered, and when it was written.
const SEQ: &str = "seq";
const WRITTEN_MS: &str = "written_ms";
/// Chunks well under NATS' default max_payload (1 MiB).
const CHUNK_BYTES: usize = 512 << 10;

/// A request to the follower for its state between two records.
pub type Capture = oneshot::Sender<Option<Snapshot>>;

#[derive(Serialize, Deserialize)]
struct Header {
    seq: u64,
    workers: Vec<SnapshotWorker>,
    /// The worker of each rank that follows, in order.
    rank_workers: Vec<u64>,
}

/// `snapshot` as bytes.
pub fn encode(snapshot: &Snapshot) -> Vec<u8> {
    let header = Header {
        seq: snapshot.seq,
        workers: snapshot.workers.clone(),
        rank_workers: snapshot.ranks.iter().map(|(w, _)| *w).collect(),
    };
    let header = serde_json::to_vec(&header).expect("a header serializes");
    let ranks: usize = snapshot
        .ranks
        .iter()
        .map(|(_, d)| d.encoded_len() + 10)
        .sum();
    let mut bytes = Vec::with_capacity(MAGIC.len() + 4 + header.len() + ranks);
    bytes.extend_from_slice(MAGIC);
    bytes.extend_from_slice(&(header.len() as u32).to_le_bytes());
    bytes.extend_from_slice(&header);
    for (_, dump) in &snapshot.ranks {
        dump.encode_length_delimited(&mut bytes)
            .expect("a Vec grows as needed");
    }
    bytes
}

/// Bytes back into a snapshot; `Err` says what is wrong with them.
pub fn decode(bytes: &[u8]) -> Result<Snapshot, String> {
    let rest = bytes
        .strip_prefix(MAGIC)
        .ok_or("not a kvroute index snapshot (version 1)")?;
    let (len, rest) = rest.split_at_checked(4).ok_or("truncated header")?;
    let len = u32::from_le_bytes(len.try_into().expect("4 bytes")) as usize;
    let (header, mut rest) = rest.split_at_checked(len).ok_or("truncated header")?;
    let header: Header = serde_json::from_slice(header).map_err(|e| format!("header: {e}"))?;
    let mut ranks = Vec::with_capacity(header.rank_workers.len());
    for worker_id in header.rank_workers {
        let dump = Dump::decode_length_delimited(&mut rest)
            .map_err(|e| format!("rank {} of worker {worker_id}: {e}", ranks.len()))?;
        ranks.push((worker_id, dump));
    }
    if !rest.is_empty() {
        return Err(format!("{} bytes after the last rank", rest.len()));
    }
    Ok(Snapshot {
        seq: header.seq,
        workers: header.workers,
        ranks,
    })
}

/// A snapshot in the store, as its metadata tells.
#[derive(Clone, Debug)]
struct Listed {
    name: String,
    seq: u64,
    written_ms: u64,
}

impl Listed {
    fn of(info: &object_store::ObjectInfo) -> Option<Self> {
        let number = |key: &str| info.metadata.get(key)?.parse().ok();
        (!info.deleted).then_some(())?;
        Some(Self {
            name: info.name.clone(),
            seq: number(SEQ)?,
            written_ms: number(WRITTEN_MS)?,
        })
    }
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

fn count(outcome: &'static str) {
    ::metrics::counter!(metrics::CLUSTER_SNAPSHOTS, "outcome" => outcome).increment(1);
}

/// Whether the `uncovered` newest of a stream's `messages` (of `bytes` in
/// all, at their average size) fill over half of its bound `max_bytes`
/// (none when not positive): the stream would forget them next.
fn uncovered_over_half(max_bytes: i64, bytes: u64, messages: u64, uncovered: u64) -> bool {
    if max_bytes <= 0 || messages == 0 {
        return false;
    }
    let share = (uncovered as f64 / messages as f64).min(1.0);
    bytes as f64 * share > max_bytes as f64 / 2.0
}

/// This replica's side of the snapshots: its object, and the newest
/// snapshot it knows of (its own or another replica's).
pub struct Snapshots {
    js: jetstream::Context,
    store: object_store::ObjectStore,
    /// This replica's object.
    name: String,
    interval: Duration,
    /// This replica's share of the delay: its turn after the interval.
    turn: Duration,
    newest: Mutex<Option<Listed>>,
}

impl Snapshots {
    /// The store, made if missing; its objects live as long as the stream's
    /// records (a snapshot older than that covers nothing the stream lacks).
    pub async fn open(
        js: &jetstream::Context,
        replica_id: &str,
        interval: Duration,
        max_age: Duration,
    ) -> Result<Self, ClusterError> {
        let store = match js.get_object_store(BUCKET).await {
            Ok(store) => store,
            Err(_) => js
                .create_object_store(object_store::Config {
                    bucket: BUCKET.into(),
                    description: Some("kvroute index snapshots".into()),
                    max_age,
                    ..Default::default()
                })
                .await
                .map_err(ClusterError::jetstream)?,
        };
        for outcome in ["written", "loaded", "failed"] {
            let _ = ::metrics::counter!(metrics::CLUSTER_SNAPSHOTS, "outcome" => outcome);
        }
        let mut hasher = DefaultHasher::new();
        replica_id.hash(&mut hasher);
        let turn = interval.mul_f64((hasher.finish() % 1000) as f64 / 5000.0);
        Ok(Self {
            js: js.clone(),
            store,
            name: format!("index-{replica_id}"),
            interval,
            turn,
            newest: Mutex::new(None),
        })
    }

    fn know(&self, stored: Listed) {
        let mut newest = self.newest.lock().unwrap();
        if newest
            .as_ref()
            .is_none_or(|n| stored.written_ms >= n.written_ms)
        {
            *newest = Some(stored);
        }
    }

    fn newest(&self) -> Option<Listed> {
        self.newest.lock().unwrap().clone()
    }

    /// Restores the newest snapshot the stream can go on from, retrying
    /// while NATS does not answer; returns the sequence it covers (0: none,
    /// the stream is replayed from its first record).
    pub async fn load(&self, applier: &mut ReplicaApplier) -> u64 {
        loop {
            match self.try_load(applier).await {
                Ok(seq) => return seq,
                Err(e) => {
                    tracing::warn!("cannot read the snapshots yet: {e}");
                    tokio::time::sleep(Duration::from_millis(500)).await;
                }
            }
        }
    }

    async fn try_load(&self, applier: &mut ReplicaApplier) -> Result<u64, String> {
        let stream = self
            .js
            .get_stream(record::STREAM)
            .await
            .map_err(|e| e.to_string())?
            .cached_info()
            .state
            .clone();
        let mut candidates = Vec::new();
        let mut list = self.store.list().await.map_err(|e| e.to_string())?;
        while let Some(info) = list.next().await {
            let info = info.map_err(|e| e.to_string())?;
            if let Some(stored) = Listed::of(&info) {
                self.know(stored.clone());
                // A later sequence than the stream's last: another stream's.
                if stored.seq <= stream.last_sequence {
                    candidates.push(stored);
                }
            }
        }
        candidates.sort_by_key(|c| std::cmp::Reverse(c.seq));
        let mut covered = 0;
        for candidate in candidates {
            let started = Instant::now();
            // Replaced since it was listed: the newer one is as good.
            let snapshot = match self.read(&candidate.name).await {
                Ok(snapshot) => snapshot,
                Err(e) => {
                    count("failed");
                    tracing::warn!(name = %candidate.name, "snapshot not loaded: {e}");
                    continue;
                }
            };
            let seq = snapshot.seq;
            let blocks: usize = snapshot
                .ranks
                .iter()
                .flat_map(|(_, d)| &d.chains)
                .map(|c| c.blocks.len())
                .sum();
            applier.restore(snapshot).await;
            count("loaded");
            tracing::info!(
                name = %candidate.name,
                seq,
                blocks,
                ms = started.elapsed().as_millis() as u64,
                "cold start from an index snapshot"
            );
            covered = seq;
            break;
        }
        if stream.messages > 0 && stream.first_sequence > covered + 1 {
            tracing::warn!(
                covered,
                first = stream.first_sequence,
                "the stream forgot records that no snapshot covers: this replica's index lacks them until the workers' next dumps"
            );
        }
        Ok(covered)
    }

    async fn read(&self, name: &str) -> Result<Snapshot, String> {
        let mut object = self.store.get(name).await.map_err(|e| e.to_string())?;
        let mut bytes = Vec::with_capacity(object.info().size);
        object
            .read_to_end(&mut bytes)
            .await
            .map_err(|e| e.to_string())?;
        tokio::task::spawn_blocking(move || decode(&bytes))
            .await
            .map_err(|e| e.to_string())?
    }

    /// Keeps track of the newest snapshot, exports its age, and writes one
    /// when it is this replica's turn, until shutdown.
    pub async fn run(
        self: Arc<Self>,
        replica: Arc<Replica>,
        captures: mpsc::Sender<Capture>,
        mut stopped: watch::Receiver<bool>,
    ) {
        let watcher = tokio::spawn(Arc::clone(&self).watch());
        let mut writing: Option<tokio::task::JoinHandle<()>> = None;
        loop {
            if let Some(newest) = self.newest() {
                let age = now_ms().saturating_sub(newest.written_ms) as f64 / 1000.0;
                ::metrics::gauge!(metrics::CLUSTER_SNAPSHOT_AGE).set(age);
            }
            let idle = writing.as_ref().is_none_or(|w| w.is_finished());
            if idle && replica.caught_up() && replica.connected() && self.due().await {
                let this = Arc::clone(&self);
                let captures = captures.clone();
                writing = Some(tokio::spawn(async move {
                    if let Err(e) = this.write(&captures).await {
                        count("failed");
                        tracing::warn!("index snapshot not written: {e}");
                    }
                }));
            }
            tokio::select! {
                _ = tokio::time::sleep(Duration::from_secs(1)) => {}
                _ = stopped.wait_for(|&s| s) => break,
            }
        }
        watcher.abort();
        if let Some(writing) = writing {
            writing.abort();
        }
    }

    /// Follows the store's objects as replicas write them.
    async fn watch(self: Arc<Self>) {
        loop {
            match self.store.watch_with_history().await {
                Ok(mut objects) => {
                    while let Some(info) = objects.next().await {
                        match info {
                            Ok(info) => {
                                if let Some(stored) = Listed::of(&info) {
                                    self.know(stored);
                                }
                            }
                            Err(e) => tracing::debug!("snapshot watch: {e}"),
                        }
                    }
                }
                Err(e) => tracing::debug!("cannot watch the snapshots yet: {e}"),
            }
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
    }

    /// Whether this replica should write a snapshot now: the newest one is
    /// past the interval and this replica's turn, or the records after it
    /// fill half of the stream's byte bound (they would be forgotten next).
    async fn due(&self) -> bool {
        let newest = self.newest();
        let Some(newest) = newest else {
            return true;
        };
        let age = Duration::from_millis(now_ms().saturating_sub(newest.written_ms));
        if age >= self.interval + self.turn {
            return true;
        }
        let Ok(stream) = self.js.get_stream(record::STREAM).await else {
            return false;
        };
        let info = stream.cached_info();
        let state = &info.state;
        uncovered_over_half(
            info.config.max_bytes,
            state.bytes,
            state.messages,
            state.last_sequence.saturating_sub(newest.seq),
        )
    }

    /// Asks the follower for its state, and stores it under this replica's name.
    async fn write(&self, captures: &mpsc::Sender<Capture>) -> Result<(), String> {
        let started = Instant::now();
        let (reply, snapshot) = oneshot::channel();
        captures
            .send(reply)
            .await
            .map_err(|_| "the follower stopped")?;
        // None: nothing applied yet, or a dump half gathered; next time.
        let Some(snapshot) = snapshot.await.map_err(|_| "the follower stopped")? else {
            return Ok(());
        };
        let captured = started.elapsed();
        let seq = snapshot.seq;
        let bytes = tokio::task::spawn_blocking(move || encode(&snapshot))
            .await
            .map_err(|e| e.to_string())?;
        let written_ms = now_ms();
        let meta = object_store::ObjectMetadata {
            name: self.name.clone(),
            description: Some(format!("kvroute index as of stream sequence {seq}")),
            chunk_size: Some(CHUNK_BYTES),
            metadata: [
                (SEQ.to_string(), seq.to_string()),
                (WRITTEN_MS.to_string(), written_ms.to_string()),
            ]
            .into(),
            headers: None,
        };
        self.store
            .put(meta, &mut bytes.as_slice())
            .await
            .map_err(|e| e.to_string())?;
        self.know(Listed {
            name: self.name.clone(),
            seq,
            written_ms,
        });
        ::metrics::gauge!(metrics::CLUSTER_SNAPSHOT_AGE).set(0.0);
        count("written");
        tracing::info!(
            seq,
            bytes = bytes.len(),
            capture_ms = captured.as_millis() as u64,
            ms = started.elapsed().as_millis() as u64,
            "index snapshot written"
        );
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvroute_proto::{Stored as Chain, StoredBlock};

    #[test]
    fn a_snapshot_is_due_before_the_stream_forgets_half_its_bytes_uncovered() {
        // 1,000 records of 1,000 bytes in a 2 MB stream.
        assert!(!uncovered_over_half(2_000_000, 1_000_000, 1_000, 1_000));
        // 1,000,000 bytes uncovered of a 1.5 MB bound: over half.
        assert!(uncovered_over_half(1_500_000, 1_000_000, 1_000, 1_000));
        assert!(!uncovered_over_half(1_500_000, 1_000_000, 1_000, 700));
        assert!(uncovered_over_half(1_500_000, 1_000_000, 1_000, 800));
        // No byte bound, or nothing kept.
        assert!(!uncovered_over_half(-1, 1_000_000, 1_000, 1_000));
        assert!(!uncovered_over_half(1_000, 0, 0, 5));
    }

    #[test]
    fn a_snapshot_comes_back_as_it_went_and_bad_bytes_are_errors() {
        let chain = |parent, hashes: &[u64]| Chain {
            parent_hash: parent,
            blocks: hashes
                .iter()
                .map(|&h| StoredBlock {
                    block_hash: h,
                    tokens_hash: h ^ u64::MAX,
                })
                .collect(),
        };
        let snapshot = Snapshot {
            seq: 42,
            workers: vec![SnapshotWorker {
                worker_id: 3,
                claim: 7,
                instance_id: None,
                dp_ranks: vec![0, 1],
                applied: vec![1],
            }],
            ranks: vec![
                (
                    3,
                    Dump {
                        dp_rank: 0,
                        last_event_id: 9,
                        chains: vec![chain(None, &[1, 2, 3]), chain(Some(1), &[u64::MAX])],
                        more: false,
                        offload_chains: Vec::new(),
                    },
                ),
                (
                    3,
                    Dump {
                        dp_rank: 1,
                        last_event_id: 0,
                        chains: Vec::new(),
                        more: false,
                        offload_chains: Vec::new(),
                    },
                ),
            ],
        };
        let bytes = encode(&snapshot);
        assert_eq!(decode(&bytes).unwrap(), snapshot);
        assert!(decode(b"something else").is_err());
        assert!(decode(&bytes[..bytes.len() - 1]).is_err());
        let mut longer = bytes.clone();
        longer.push(0);
        assert!(decode(&longer).is_err());
    }
}
