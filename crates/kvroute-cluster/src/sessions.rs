//! Session bindings in a JetStream KV bucket, one key per session, so that a
//! session bound on one replica is followed by every other.
//!
//! Each binding a replica makes is put under the session's key with the
//! replica's id; every other replica makes it too, with what is left of its
//! TTL (the bucket's MaxAge is `sessions.ttl_s`, so a key outlives the
//! session's last request by the TTL, as a binding does). Each replica expires
//! its bindings itself; the bucket's expiry only forgets the key. The last
//! put of a key wins: a replica that binds a session while an older put of
//! it is on its way may follow the older binding until the session's next
//! request, which every replica then follows.

use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::{self, kv};
use futures_util::StreamExt;
use kvroute_router::schedule::sessions::SharedBinding;
use kvroute_router::state::AppState;
use serde::{Deserialize, Serialize};
use tokio::sync::{mpsc, watch};

use crate::ClusterError;

pub const BUCKET: &str = "kvroute-sessions";

/// Puts in flight at once.
const CONCURRENT_PUTS: usize = 64;

/// A binding as the bucket holds it.
#[derive(Debug, PartialEq, Serialize, Deserialize)]
pub struct Held {
    #[serde(flatten)]
    pub binding: SharedBinding,
    /// The replica that made it.
    pub replica_id: String,
}

/// The bucket, made if missing: keys live `ttl` past their last put.
pub async fn bucket(js: &jetstream::Context, ttl: Duration) -> Result<kv::Store, ClusterError> {
    js.create_or_update_key_value(kv::Config {
        bucket: BUCKET.into(),
        history: 1,
        max_age: ttl,
        ..Default::default()
    })
    .await
    .map_err(ClusterError::jetstream)
}

/// A session id as a key: its bytes in hex, as keys allow few characters.
pub fn key(session: &str) -> String {
    session.bytes().map(|b| format!("{b:02x}")).collect()
}

/// Starts putting this replica's bindings and following the others'.
pub fn share(
    kv: kv::Store,
    state: Arc<AppState>,
    replica_id: String,
    stopped: watch::Receiver<bool>,
) -> Vec<tokio::task::JoinHandle<()>> {
    let Some(bindings) = state.sessions.share() else {
        return Vec::new();
    };
    vec![
        tokio::spawn(put(
            kv.clone(),
            bindings,
            replica_id.clone(),
            stopped.clone(),
        )),
        tokio::spawn(follow(kv, state, replica_id, stopped)),
    ]
}

async fn put(
    kv: kv::Store,
    bindings: mpsc::Receiver<SharedBinding>,
    replica_id: String,
    mut stopped: watch::Receiver<bool>,
) {
    let bindings = futures_util::stream::unfold(bindings, |mut bindings| async move {
        bindings.recv().await.map(|b| (b, bindings))
    });
    let puts = bindings.for_each_concurrent(CONCURRENT_PUTS, |binding| {
        let kv = kv.clone();
        let key = key(&binding.session);
        let held = Held {
            binding,
            replica_id: replica_id.clone(),
        };
        async move {
            let value = match serde_json::to_vec(&held) {
                Ok(value) => value,
                Err(e) => return tracing::warn!("session binding not encoded: {e}"),
            };
            // NATS away: the other replicas miss this binding until the
            // session's next request is bound again.
            if let Err(e) = kv.put(key, value.into()).await {
                tracing::debug!("session binding not shared: {e}");
            }
        }
    });
    tokio::select! {
        () = puts => {}
        _ = stopped.wait_for(|&s| s) => {}
    }
}

/// Makes the bindings other replicas put, from the bucket's current keys on.
async fn follow(
    kv: kv::Store,
    state: Arc<AppState>,
    replica_id: String,
    mut stopped: watch::Receiver<bool>,
) {
    let ttl = state.sessions.ttl();
    crate::registrations::follow_bucket(&kv, "session bindings", &mut stopped, |entry| {
        apply(&state, &replica_id, ttl, entry)
    })
    .await;
}

fn apply(state: &AppState, replica_id: &str, ttl: Duration, entry: kv::Entry) {
    // Expiries and deletes: each replica expires its bindings itself.
    if entry.operation != kv::Operation::Put {
        return;
    }
    let held: Held = match serde_json::from_slice(&entry.value) {
        Ok(held) => held,
        Err(e) => return tracing::warn!("unreadable session binding: {e}"),
    };
    if held.replica_id == replica_id {
        return;
    }
    // The key's age by the server's clock, which stamped it.
    let age = std::time::SystemTime::now()
        .duration_since(entry.created.into())
        .unwrap_or(Duration::ZERO);
    if let Some(left) = ttl.checked_sub(age).filter(|left| !left.is_zero()) {
        state.sessions.bind_shared(held.binding, left);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_valid_nats_keys_and_distinct_per_session() {
        let keys: Vec<String> = ["a", "A", "conversation/42 é", "a.b"]
            .iter()
            .map(|s| key(s))
            .collect();
        for k in &keys {
            assert!(k.bytes().all(|b| b.is_ascii_hexdigit()), "{k}");
        }
        let mut distinct = keys.clone();
        distinct.sort();
        distinct.dedup();
        assert_eq!(distinct.len(), keys.len());
    }
}
