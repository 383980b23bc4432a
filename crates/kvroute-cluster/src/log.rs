//! The event log on JetStream: appends are publishes that resolve once the
//! stream stored the record (JetStream's publish ack), so the holder acks a
//! worker's events only once they survive the loss of any replica.

use std::any::Any;
use std::time::Duration;

use async_nats::connection::State;
use async_nats::jetstream::{self, kv};
use futures_util::future::BoxFuture;
use kvroute_router::fleet::Registration;
use kvroute_router::replica::{EventLog, PeerDigest, Record, Unlogged};

use crate::record;
use crate::registrations::Held;

pub struct NatsLog {
    client: async_nats::Client,
    js: jetstream::Context,
    kv: kv::Store,
    replica_id: String,
    ttl: Duration,
}

impl NatsLog {
    pub fn new(
        client: async_nats::Client,
        js: jetstream::Context,
        kv: kv::Store,
        replica_id: String,
        ttl: Duration,
    ) -> Self {
        Self {
            client,
            js,
            kv,
            replica_id,
            ttl,
        }
    }
}

fn encode_len(record: &Record) -> usize {
    record::encode(record).2.len()
}

/// Aborts the refreshing task when the stream ends.
struct Refresh(tokio::task::JoinHandle<()>);

impl Drop for Refresh {
    fn drop(&mut self) {
        self.0.abort();
    }
}

impl EventLog for NatsLog {
    fn append(&self, record: Record) -> BoxFuture<'static, Result<u64, Unlogged>> {
        let client = self.client.clone();
        let js = self.js.clone();
        Box::pin(async move {
            // Disconnected, a publish would wait for its timeout: the caller
            // applies the record here at once instead.
            if client.connection_state() != State::Connected {
                return Err(Unlogged {
                    error: "not connected to NATS".into(),
                    record,
                    refused: false,
                });
            }
            let max_payload = client.server_info().max_payload;
            // Split (a copy) only when the record does not fit in one message.
            let split = (!record::fits(&record, max_payload))
                .then(|| record::split(record.clone(), max_payload));
            let pieces = split.as_deref().unwrap_or(std::slice::from_ref(&record));
            let mut sequence = 0;
            for piece in pieces {
                let (subject, mut headers, payload) = record::encode(piece);
                record::stamp_sent(&mut headers);
                let stored = async {
                    js.publish_with_headers(subject, headers, payload)
                        .await?
                        .await
                }
                .await;
                match stored {
                    Ok(ack) => sequence = ack.sequence,
                    // Pieces already stored are applied again with the resend: stale.
                    Err(e) => {
                        // Over max_payload even alone: the server will never take it.
                        let refused = encode_len(piece) > max_payload;
                        return Err(Unlogged {
                            error: e.to_string(),
                            record,
                            refused,
                        });
                    }
                }
            }
            Ok(sequence)
        })
    }

    fn publish_digest(&self, digest: PeerDigest) {
        let payload = serde_json::to_vec(&digest).expect("a digest serializes");
        let client = self.client.clone();
        // Core NATS: a digest matters now or never, so it is not stored.
        tokio::spawn(async move {
            if let Err(e) = client.publish(record::PEER_DIGESTS, payload.into()).await {
                tracing::debug!("peer digest not published: {e}");
            }
        });
    }

    fn hold(&self, registration: Registration) -> Box<dyn Any + Send> {
        let key = registration.worker_id.to_string();
        let held = Held {
            registration,
            replica_id: self.replica_id.clone(),
        };
        let value = serde_json::to_vec(&held).expect("a registration serializes");
        let kv = self.kv.clone();
        // Three refreshes per TTL: one lost put does not expire the worker.
        let every = self.ttl / 3;
        Box::new(Refresh(tokio::spawn(async move {
            loop {
                if let Err(e) = kv.put(&key, value.clone().into()).await {
                    tracing::debug!(worker = %key, "registration not refreshed: {e}");
                }
                tokio::time::sleep(every).await;
            }
        })))
    }
}
