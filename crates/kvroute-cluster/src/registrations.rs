//! Workers' registrations in a JetStream KV bucket, one key per worker id.
//!
//! The replica that holds a worker's stream puts its registration (base URL,
//! models, LoRA names, ranks, KV blocks) with its own replica id, and puts it
//! again three times per TTL while the stream lasts. Every other replica
//! registers the worker from the bucket, so it routes to it; when the entry
//! expires (its holder died, or the stream ended) the bucket's MaxAge marker
//! takes the worker out of routing on every replica, and its index entries go
//! after the grace period unless it registers again, as with one router.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::{self, kv};
use futures_util::StreamExt;
use kvroute_router::fleet::{Registration, Source};
use kvroute_router::state::AppState;
use serde::{Deserialize, Serialize};
use tokio::sync::watch;

use crate::ClusterError;

pub const BUCKET: &str = "kvroute-workers";

/// A registration as the bucket holds it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Held {
    pub registration: Registration,
    /// The replica holding the worker's stream.
    pub replica_id: String,
}

/// The bucket, made if missing: entries live `ttl` past their last put.
pub async fn bucket(js: &jetstream::Context, ttl: Duration) -> Result<kv::Store, ClusterError> {
    js.create_or_update_key_value(kv::Config {
        bucket: BUCKET.into(),
        history: 1,
        max_age: ttl,
        // Expiry leaves a marker that watchers see, so every replica learns it.
        limit_markers: Some(ttl),
        ..Default::default()
    })
    .await
    .map_err(ClusterError::jetstream)
}

/// Registers other replicas' workers from the bucket, and forgets them when
/// their entries go.
pub async fn watch(
    kv: kv::Store,
    state: Arc<AppState>,
    replica_id: String,
    mut stopped: watch::Receiver<bool>,
) {
    // Worker id → what was registered from the bucket, and its generation.
    let mut remote: HashMap<u64, (Held, u64)> = HashMap::new();
    follow_bucket(&kv, "registrations", &mut stopped, |entry| {
        apply(&state, &replica_id, &mut remote, entry)
    })
    .await;
}

/// Hands `on_entry` every entry of the bucket `kv`, its current keys first,
/// then each change, watching again whenever the watch ends, until `stopped`.
pub(crate) async fn follow_bucket(
    kv: &kv::Store,
    what: &str,
    stopped: &mut watch::Receiver<bool>,
    mut on_entry: impl FnMut(kv::Entry),
) {
    loop {
        let mut entries = match kv.watch_with_history(">").await {
            Ok(entries) => entries,
            Err(e) => {
                tracing::debug!("cannot watch the {what} yet: {e}");
                tokio::select! {
                    _ = tokio::time::sleep(Duration::from_secs(1)) => continue,
                    _ = stopped.wait_for(|&s| s) => return,
                }
            }
        };
        loop {
            let entry = tokio::select! {
                entry = entries.next() => entry,
                _ = stopped.wait_for(|&s| s) => return,
            };
            match entry {
                Some(Ok(entry)) => on_entry(entry),
                Some(Err(e)) => tracing::debug!("{what} watch: {e}"),
                None => break,
            }
        }
    }
}

fn apply(
    state: &Arc<AppState>,
    replica_id: &str,
    remote: &mut HashMap<u64, (Held, u64)>,
    entry: kv::Entry,
) {
    let Ok(worker_id) = entry.key.parse::<u64>() else {
        return;
    };
    match entry.operation {
        kv::Operation::Put => {
            let held: Held = match serde_json::from_slice(&entry.value) {
                Ok(held) => held,
                Err(e) => {
                    tracing::warn!(worker = worker_id, "unreadable registration: {e}");
                    return;
                }
            };
            if held.replica_id == replica_id {
                // Registered here by its own stream.
                remote.remove(&worker_id);
                return;
            }
            // A refresh changes nothing (registering again would reset the breaker).
            if remote.get(&worker_id).is_some_and(|(h, _)| *h == held) {
                return;
            }
            match state
                .registry
                .register(held.registration.clone(), Source::Stream)
            {
                Ok(generation) => {
                    tracing::info!(worker = worker_id, replica = %held.replica_id, "worker registered on another replica");
                    remote.insert(worker_id, (held, generation));
                }
                Err(e) => tracing::warn!(worker = worker_id, "registration refused: {e}"),
            }
        }
        kv::Operation::Delete | kv::Operation::Purge => {
            let Some((held, generation)) = remote.remove(&worker_id) else {
                return;
            };
            if !state.registry.disconnect(worker_id, generation) {
                return;
            }
            tracing::info!(worker = worker_id, replica = %held.replica_id, "registration expired: worker out of routing");
            // Like a closed stream with one router: its index entries stay for
            // the grace period, in case it registers again (or the expiry was
            // only NATS being away longer than the TTL).
            let grace = Duration::from_millis(state.config.ingest.grace_period_ms);
            let state = Arc::clone(state);
            tokio::spawn(async move {
                tokio::time::sleep(grace).await;
                if let Some(keys) = state.registry.purge(worker_id, generation) {
                    for key in keys {
                        state.index.remove_worker(key);
                        state.predicted.remove_worker(key);
                    }
                    tracing::info!(worker = worker_id, "worker purged after the grace period");
                }
            });
        }
    }
}
