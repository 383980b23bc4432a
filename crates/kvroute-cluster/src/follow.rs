//! Every replica reads the whole stream in order with an ordered consumer and
//! applies each record ([`ReplicaApplier`]); it is ready (`/readyz`) once it
//! has applied the stream as far as it stood when the replica started. It
//! starts from the newest snapshot, if any, and takes snapshots between two
//! records when asked ([`crate::snapshot`]).

use std::sync::Arc;
use std::time::Duration;

use async_nats::connection::State;
use async_nats::jetstream::{self, consumer};
use futures_util::StreamExt;
use kvroute_router::ingest::log::ReplicaApplier;
use kvroute_router::metrics;
use kvroute_router::replica::{PeerDigest, Record, Replica};
use kvroute_router::state::AppState;
use tokio::sync::{mpsc, watch};

use crate::record;
use crate::snapshot::{Capture, Snapshots};

/// Restores the newest snapshot, then applies the stream from the record
/// after it until shutdown, resuming after the last applied record whenever
/// the consumer has to be made again.
pub async fn follow(
    js: jetstream::Context,
    state: Arc<AppState>,
    snapshots: Arc<Snapshots>,
    mut captures: mpsc::Receiver<Capture>,
    mut stopped: watch::Receiver<bool>,
) {
    let replica = Arc::clone(state.replica.get().expect("a replica is set up"));
    let mut applier = ReplicaApplier::new(Arc::clone(&state));
    let mut applied = tokio::select! {
        seq = snapshots.load(&mut applier) => seq,
        _ = stopped.wait_for(|&s| s) => return,
    };
    let mut caught_up_at: Option<u64> = None;
    loop {
        let run = read(
            &js,
            &replica,
            &mut applier,
            &mut captures,
            &mut applied,
            &mut caught_up_at,
        );
        tokio::select! {
            result = run => {
                if let Err(e) = result {
                    tracing::debug!("reading the event log: {e}");
                }
            }
            _ = stopped.wait_for(|&s| s) => return,
        }
        tokio::select! {
            _ = tokio::time::sleep(Duration::from_millis(500)) => {}
            _ = stopped.wait_for(|&s| s) => return,
        }
    }
}

async fn read(
    js: &jetstream::Context,
    replica: &Replica,
    applier: &mut ReplicaApplier,
    captures: &mut mpsc::Receiver<Capture>,
    applied: &mut u64,
    caught_up_at: &mut Option<u64>,
) -> Result<(), String> {
    let mut stream = js
        .get_stream(record::STREAM)
        .await
        .map_err(|e| e.to_string())?;
    let last = stream
        .info()
        .await
        .map_err(|e| e.to_string())?
        .state
        .last_sequence;
    let target = *caught_up_at.get_or_insert(last);
    if *applied >= target {
        replica.set_caught_up();
    }
    let deliver_policy = if *applied == 0 {
        consumer::DeliverPolicy::All
    } else {
        consumer::DeliverPolicy::ByStartSequence {
            start_sequence: *applied + 1,
        }
    };
    let consumer = stream
        .create_consumer(consumer::pull::OrderedConfig {
            deliver_policy,
            ..Default::default()
        })
        .await
        .map_err(|e| e.to_string())?;
    let mut messages = consumer.messages().await.map_err(|e| e.to_string())?;
    loop {
        let message = tokio::select! {
            message = messages.next() => message,
            Some(capture) = captures.recv() => {
                // Between two records: the state after the last one applied.
                let snapshot = match *applied {
                    0 => None,
                    seq => applier.snapshot(seq).await,
                };
                let _ = capture.send(snapshot);
                continue;
            }
        };
        let Some(message) = message else { break };
        let message = message.map_err(|e| e.to_string())?;
        let info = message.info().map_err(|e| e.to_string())?;
        let seq = info.stream_sequence;
        let pending = info.pending;
        match record::decode(message.headers.as_ref(), &message.payload) {
            Ok(record) => {
                let events = matches!(record, Record::Events { .. });
                applier.apply(seq, record).await;
                // Batches only, and only live ones: a replay from the start
                // is not lag.
                if events
                    && *caught_up_at <= Some(seq)
                    && let Some(lag) = record::since_sent(message.headers.as_ref())
                {
                    ::metrics::histogram!(metrics::CLUSTER_APPLY_LAG).record(lag.as_secs_f64());
                }
            }
            Err(e) => tracing::warn!(seq, "unreadable record skipped: {e}"),
        }
        *applied = seq;
        replica.set_behind(pending);
        if seq >= target || pending == 0 {
            replica.set_caught_up();
        }
    }
    Ok(())
}

/// Tells the replica whether NATS answers, as the client sees it.
pub async fn watch_connection(
    client: async_nats::Client,
    replica: Arc<Replica>,
    mut stopped: watch::Receiver<bool>,
) {
    loop {
        replica
            .set_connected(client.connection_state() == State::Connected)
            .await;
        tokio::select! {
            _ = tokio::time::sleep(Duration::from_millis(250)) => {}
            _ = stopped.wait_for(|&s| s) => return,
        }
    }
}

/// Hands the other replicas' digests to this one for comparison.
pub async fn watch_peer_digests(
    client: async_nats::Client,
    replica: Arc<Replica>,
    mut stopped: watch::Receiver<bool>,
) {
    let mut digests = match client.subscribe(record::PEER_DIGESTS).await {
        Ok(digests) => digests,
        Err(e) => {
            tracing::warn!("not comparing digests with the other replicas: {e}");
            return;
        }
    };
    loop {
        tokio::select! {
            message = digests.next() => {
                let Some(message) = message else { return };
                match serde_json::from_slice::<PeerDigest>(&message.payload) {
                    Ok(digest) => replica.peer_digest(digest),
                    Err(e) => tracing::debug!("unreadable peer digest: {e}"),
                }
            }
            _ = stopped.wait_for(|&s| s) => return,
        }
    }
}
