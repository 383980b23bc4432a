//! Load shared between replicas (`share_load`): bookings and predictions over
//! core NATS publish/subscribe, not JetStream.
//!
//! Why not the stream: this state is soft and short-lived. A booking lasts as
//! long as its request, a prediction a few seconds; neither has to survive a
//! restart, be replayed to a replica that joins, or be acked. What matters is
//! latency, and a lost message is repaired by the next one: each message
//! carries a rank's current bookings (absolute values, not increments), and
//! every replica sends all its bookings every `load_full_state_ms`, so a lost
//! or reordered change is corrected within that period. A replica not heard
//! from for `load_expiry_ms` (killed, partitioned) has its bookings dropped
//! ([`Peers`]); a restarted replica is a new sender, its old bookings expire.
//!
//! - `kvroute.load`: [`Bookings`], on every change of this replica's bookings
//!   (the ranks that changed) and periodically (all of them, `full`);
//! - `kvroute.predictions`: [`Prediction`], each route-time prediction.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures_util::StreamExt;
use kvroute_index::WorkerKey;
use kvroute_router::fleet::shared_load::{RankLoad, SharedPrediction};
use kvroute_router::state::AppState;
use serde::{Deserialize, Serialize};
use tokio::sync::{mpsc, watch};

pub const LOAD_SUBJECT: &str = "kvroute.load";
pub const PREDICTIONS_SUBJECT: &str = "kvroute.predictions";

/// Predictions waiting to be published; past this, new ones are dropped.
const PREDICTION_QUEUE: usize = 4096;

/// One replica's bookings of some ranks (all of them when `full`).
#[derive(Debug, PartialEq, Serialize, Deserialize)]
pub struct Bookings {
    /// The sending process (not its `replica_id`: a restart is a new sender).
    pub sender: u64,
    pub full: bool,
    pub ranks: Vec<RankBooking>,
}

#[derive(Debug, PartialEq, Serialize, Deserialize)]
pub struct RankBooking {
    pub worker_id: u64,
    pub dp_rank: u32,
    #[serde(flatten)]
    pub load: RankLoad,
}

#[derive(Debug, PartialEq, Serialize, Deserialize)]
pub struct Prediction {
    pub sender: u64,
    #[serde(flatten)]
    pub prediction: SharedPrediction,
}

/// Other replicas' bookings, by sender, and when each was last heard from.
pub struct Peers {
    expiry: Duration,
    peers: HashMap<u64, Peer>,
}

struct Peer {
    ranks: HashMap<WorkerKey, RankLoad>,
    seen: Instant,
}

impl Peers {
    pub fn new(expiry: Duration) -> Self {
        Self {
            expiry,
            peers: HashMap::new(),
        }
    }

    /// Takes in a sender's message; returns the ranks whose sum to set again.
    pub fn apply(&mut self, message: Bookings, now: Instant) -> Vec<WorkerKey> {
        let peer = self.peers.entry(message.sender).or_insert_with(|| Peer {
            ranks: HashMap::new(),
            seen: now,
        });
        peer.seen = now;
        let mut touched: Vec<WorkerKey> = Vec::new();
        if message.full {
            // What the full state leaves out is no longer booked there.
            touched.extend(peer.ranks.drain().map(|(key, _)| key));
        }
        for rank in message.ranks {
            let key = WorkerKey::new(rank.worker_id, rank.dp_rank);
            if rank.load.is_zero() {
                peer.ranks.remove(&key);
            } else {
                peer.ranks.insert(key, rank.load);
            }
            touched.push(key);
        }
        touched.sort_unstable();
        touched.dedup();
        touched
    }

    /// Drops the senders not heard from within the expiry; returns their ranks.
    pub fn expire(&mut self, now: Instant) -> Vec<WorkerKey> {
        let expiry = self.expiry;
        let mut touched = Vec::new();
        self.peers.retain(|_, peer| {
            let alive = now.duration_since(peer.seen) < expiry;
            if !alive {
                touched.extend(peer.ranks.keys().copied());
            }
            alive
        });
        touched
    }

    /// Every live sender's bookings of `key`, summed.
    pub fn sum(&self, key: WorkerKey) -> RankLoad {
        let mut sum = RankLoad::default();
        for peer in self.peers.values() {
            if let Some(load) = peer.ranks.get(&key) {
                sum.add(load);
            }
        }
        sum
    }
}

/// Starts sharing this replica's load and taking in the others'.
pub async fn share(
    client: async_nats::Client,
    state: Arc<AppState>,
    stopped: watch::Receiver<bool>,
) -> Result<Vec<tokio::task::JoinHandle<()>>, crate::ClusterError> {
    let config = &state.config.cluster;
    let sender = process_nonce();
    let full_every = Duration::from_millis(config.load_full_state_ms);
    let expiry = Duration::from_millis(config.load_expiry_ms);
    let subscribe = |subject: &'static str| {
        let client = client.clone();
        async move {
            client
                .subscribe(subject)
                .await
                .map_err(crate::ClusterError::jetstream)
        }
    };
    let loads = subscribe(LOAD_SUBJECT).await?;
    let predictions = subscribe(PREDICTIONS_SUBJECT).await?;
    let (queue, queued) = mpsc::channel(PREDICTION_QUEUE);
    let _ = state.shared_predictions.set(queue);
    state.registry.share_bookings();
    Ok(vec![
        tokio::spawn(publish(
            client,
            Arc::clone(&state),
            sender,
            full_every,
            queued,
            stopped.clone(),
        )),
        tokio::spawn(receive(state, sender, expiry, loads, predictions, stopped)),
    ])
}

/// Distinguishes this process from every other sender, restarts included.
fn process_nonce() -> u64 {
    use std::hash::BuildHasher;
    // Randomly keyed per process; the pid and the clock on top.
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default()
        .as_nanos();
    std::collections::hash_map::RandomState::new().hash_one((std::process::id(), nanos))
}

async fn publish(
    client: async_nats::Client,
    state: Arc<AppState>,
    sender: u64,
    full_every: Duration,
    mut predictions: mpsc::Receiver<SharedPrediction>,
    mut stopped: watch::Receiver<bool>,
) {
    let registry = &state.registry;
    let mut full = tokio::time::interval(full_every);
    full.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let send = |subject: &'static str, payload: Vec<u8>| {
        let client = client.clone();
        async move {
            // Only fails with the client closed or its buffer full: the next
            // full state repairs a lost change.
            if let Err(e) = client.publish(subject, payload.into()).await {
                tracing::debug!("{subject} not published: {e}");
            }
        }
    };
    let bookings = |full: bool, ranks: Vec<(WorkerKey, RankLoad)>| {
        let message = Bookings {
            sender,
            full,
            ranks: ranks
                .into_iter()
                .map(|(key, load)| RankBooking {
                    worker_id: key.worker_id,
                    dp_rank: key.dp_rank,
                    load,
                })
                .collect(),
        };
        serde_json::to_vec(&message).expect("bookings serialize")
    };
    enum Next {
        Changed,
        Full,
        Predicted(SharedPrediction),
        Stop,
    }
    loop {
        // Awaited outside the select: its stop branch's output is not Send.
        let next = tokio::select! {
            _ = registry.bookings_changed.notified() => Next::Changed,
            _ = full.tick() => Next::Full,
            Some(prediction) = predictions.recv() => Next::Predicted(prediction),
            _ = stopped.wait_for(|&s| s) => Next::Stop,
        };
        match next {
            Next::Changed => {
                let changed = registry.take_changed_bookings();
                if !changed.is_empty() {
                    send(LOAD_SUBJECT, bookings(false, changed)).await;
                }
            }
            Next::Full => send(LOAD_SUBJECT, bookings(true, registry.own_bookings())).await,
            Next::Predicted(prediction) => {
                let message = Prediction { sender, prediction };
                let payload = serde_json::to_vec(&message).expect("a prediction serializes");
                send(PREDICTIONS_SUBJECT, payload).await;
            }
            Next::Stop => return,
        }
    }
}

async fn receive(
    state: Arc<AppState>,
    sender: u64,
    expiry: Duration,
    mut loads: async_nats::Subscriber,
    mut predictions: async_nats::Subscriber,
    mut stopped: watch::Receiver<bool>,
) {
    let registry = &state.registry;
    let max_blocks = state.config.limits.max_predicted_blocks_per_request;
    let mut peers = Peers::new(expiry);
    let mut sweep = tokio::time::interval(expiry / 4);
    let set = |peers: &Peers, keys: Vec<WorkerKey>| {
        for key in keys {
            registry.set_remote_bookings(key, peers.sum(key));
        }
    };
    loop {
        tokio::select! {
            Some(message) = loads.next() => {
                match serde_json::from_slice::<Bookings>(&message.payload) {
                    Ok(bookings) if bookings.sender != sender => {
                        let touched = peers.apply(bookings, Instant::now());
                        set(&peers, touched);
                    }
                    Ok(_) => {}
                    Err(e) => tracing::debug!("unreadable bookings: {e}"),
                }
            }
            Some(message) = predictions.next() => {
                match serde_json::from_slice::<Prediction>(&message.payload) {
                    Ok(Prediction { sender: from, prediction }) if from != sender => {
                        let hashes = &prediction.local_hashes;
                        state.predicted.record_for(
                            WorkerKey::new(prediction.worker_id, prediction.dp_rank),
                            &hashes[..hashes.len().min(max_blocks)],
                            Instant::now(),
                            Duration::from_millis(prediction.ttl_ms),
                        );
                    }
                    Ok(_) => {}
                    Err(e) => tracing::debug!("unreadable prediction: {e}"),
                }
            }
            _ = sweep.tick() => {
                let expired = peers.expire(Instant::now());
                if !expired.is_empty() {
                    tracing::info!(ranks = expired.len(), "a replica went quiet: its bookings dropped");
                }
                set(&peers, expired);
            }
            _ = stopped.wait_for(|&s| s) => return,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn load(requests: u64, blocks: u64) -> RankLoad {
        RankLoad {
            requests,
            prefill_tokens: requests * 100,
            blocks,
        }
    }

    fn message(sender: u64, full: bool, ranks: &[(u64, RankLoad)]) -> Bookings {
        Bookings {
            sender,
            full,
            ranks: ranks
                .iter()
                .map(|&(worker_id, load)| RankBooking {
                    worker_id,
                    dp_rank: 0,
                    load,
                })
                .collect(),
        }
    }

    fn key(worker_id: u64) -> WorkerKey {
        WorkerKey::new(worker_id, 0)
    }

    /// A rank's sum is, over senders heard from within the expiry, each
    /// sender's latest value, where a full state first zeroes its sender's ranks.
    #[test]
    fn sums_follow_changes_full_states_and_expiry() {
        let start = Instant::now();
        let at = |ms: u64| start + Duration::from_millis(ms);
        let mut peers = Peers::new(Duration::from_millis(3_000));
        assert_eq!(
            peers.apply(message(1, false, &[(7, load(2, 8))]), at(0)),
            vec![key(7)]
        );
        peers.apply(
            message(2, false, &[(7, load(1, 4)), (8, load(3, 3))]),
            at(10),
        );
        assert_eq!(peers.sum(key(7)), load(3, 12));
        assert_eq!(peers.sum(key(8)), load(3, 3));
        // A change is a rank's new value, not an increment.
        peers.apply(message(1, false, &[(7, load(1, 2))]), at(20));
        assert_eq!(peers.sum(key(7)), load(2, 6));
        // Sender 2's full state no longer has rank 8: released.
        let touched = peers.apply(message(2, true, &[(7, load(1, 4))]), at(1_000));
        assert_eq!(touched, vec![key(7), key(8)]);
        assert_eq!(peers.sum(key(8)), RankLoad::default());
        // Sender 1 goes quiet; sender 2 does not.
        assert!(peers.expire(at(3_019)).is_empty());
        assert_eq!(peers.expire(at(3_020)), vec![key(7)]);
        assert_eq!(peers.sum(key(7)), load(1, 4));
        assert!(peers.expire(at(3_999)).is_empty());
        assert_eq!(peers.expire(at(4_000)), vec![key(7)]);
        assert_eq!(peers.sum(key(7)), RankLoad::default());
    }

    #[test]
    fn messages_keep_their_shape_on_the_wire() {
        let bookings = message(9, true, &[(7, load(2, 8))]);
        let text = serde_json::to_string(&bookings).unwrap();
        assert_eq!(
            text,
            r#"{"sender":9,"full":true,"ranks":[{"worker_id":7,"dp_rank":0,"requests":2,"prefill_tokens":200,"blocks":8}]}"#
        );
        assert_eq!(serde_json::from_str::<Bookings>(&text).unwrap(), bookings);
    }
}
