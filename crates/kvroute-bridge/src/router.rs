//! The router side: one gRPC stream, re-opened with backoff for as long as the
//! bridge runs. With several router URLs (replicas), a stream that fails or is
//! refused moves on to the next URL, round and round; only a refusal no replica
//! would reconsider (a block-size mismatch, a bad token) ends the bridge.
//!
//! Each time the stream opens, the bridge registers the engine (models and LoRA
//! adapters as the engine lists them now, and the engine's instance id) and
//! sends every rank's full dump, so a router that restarted or purged the worker
//! meanwhile holds exactly the mirror again; queued events the dump already
//! covers are then left out. When the engine restarts, the stream is re-opened
//! at once to register the new instance: the router then clears every rank. Afterwards the
//! stream carries event batches and load reports out, and acks, resync requests
//! (answered with a dump) and errors in. Each rank's digest goes out behind the
//! batch that completes `digest_events` events, and every `digest_interval`
//! for all ranks, so the router can check its index.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kvroute_proto as proto;
use kvroute_proto::kv_router_client::KvRouterClient;
use metrics::counter;
use proto::router_message::Body as RouterBody;
use proto::worker_message::Body as WorkerBody;
use tokio::sync::{mpsc, watch};
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Code, Request, Status};
use tracing::{info, warn};

use crate::load::ServedModels;
use crate::rank::RankMirror;
use crate::{Backoff, BridgeError};

const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// What the router link needs to know and share.
pub struct RouterLink {
    /// The router replicas' gRPC URLs, tried in turn.
    pub urls: Vec<String>,
    pub token: Option<kvroute_tls::Secret>,
    pub tls: kvroute_tls::GrpcClientTls,
    pub worker_id: u64,
    pub engine_url: String,
    pub block_size: u32,
    pub tokenizer: Option<proto::TokenizerInfo>,
    pub mirrors: Vec<Arc<Mutex<RankMirror>>>,
    pub engine: crate::EngineHttp,
    /// The engine's instance id; changes when a rank sees the engine restart.
    pub instance: watch::Receiver<u64>,
    /// Every rank's digest goes out at this interval (zero: never).
    pub digest_interval: Duration,
}

/// Why a stream ended.
enum Ended {
    /// The router went away or the stream broke: reconnect.
    Lost(String),
    /// The router refused the bridge for good (a block-size mismatch, a bad token).
    Refused(Status),
    /// The engine restarted: register its new instance, without waiting.
    Restarted,
}

impl RouterLink {
    /// Runs until the router refuses the bridge, which is a configuration error.
    pub async fn run(
        self,
        mut events: mpsc::Receiver<WorkerBody>,
        mut loads: mpsc::Receiver<proto::LoadReport>,
    ) -> BridgeError {
        let mut backoff = Backoff::default();
        let mut instance = self.instance.clone();
        let mut turn = 0;
        loop {
            let url = &self.urls[turn % self.urls.len()];
            let served = self.engine.models().await;
            match served {
                Ok(served) => match self
                    .session(
                        url,
                        &served,
                        &mut instance,
                        &mut events,
                        &mut loads,
                        &mut backoff,
                    )
                    .await
                {
                    Ended::Restarted => {
                        info!(router = %url, "the engine restarted: registering its new instance");
                        continue;
                    }
                    Ended::Refused(status) => {
                        counter!(crate::metrics::ROUTER_CONNECTS, "outcome" => "refused")
                            .increment(1);
                        return BridgeError::Refused(status.message().to_owned());
                    }
                    Ended::Lost(why) => {
                        counter!(crate::metrics::ROUTER_CONNECTS, "outcome" => "lost").increment(1);
                        turn += 1;
                        warn!(router = %url, next = %self.urls[turn % self.urls.len()], "router stream: {why}");
                    }
                },
                Err(e) => warn!("engine models: {e}"),
            }
            backoff.wait().await;
        }
    }

    async fn session(
        &self,
        url: &str,
        served: &ServedModels,
        instance: &mut watch::Receiver<u64>,
        events: &mut mpsc::Receiver<WorkerBody>,
        loads: &mut mpsc::Receiver<proto::LoadReport>,
        backoff: &mut Backoff,
    ) -> Ended {
        let channel = match kvroute_tls::grpc_endpoint(url, &self.tls) {
            Ok(endpoint) => {
                proto::with_keepalive(endpoint)
                    .connect_timeout(CONNECT_TIMEOUT)
                    .connect()
                    .await
            }
            Err(e) => return Ended::Refused(Status::invalid_argument(e.to_string())),
        };
        let channel = match channel {
            Ok(channel) => channel,
            Err(e) => return Ended::Lost(format!("connecting: {e}")),
        };
        let (out, out_rx) = mpsc::channel(256);
        let register = proto::Register {
            worker_id: self.worker_id,
            dp_ranks: (0..self.mirrors.len() as u32).collect(),
            models: served.models.clone(),
            base_url: self.engine_url.clone(),
            block_size: self.block_size,
            total_kv_blocks: self.engine.total_kv_blocks(self.block_size).await,
            lora_names: served.lora_names.clone(),
            tokenizer: self.tokenizer.clone(),
            instance_id: *instance.borrow_and_update(),
            ..Default::default()
        };
        // Queued before the call starts, so it is the stream's first message;
        // the dumps follow once the call is open, before any event.
        let _ = out.try_send(message(WorkerBody::Register(register)));
        let mut dumped = HashMap::new();
        let mut dumps = Vec::new();
        for mirror in &self.mirrors {
            let dump = mirror.lock().unwrap().dump();
            dumped.insert(dump.dp_rank, dump.last_event_id);
            dumps.extend(dump_parts(dump));
            counter!(crate::metrics::DUMPS_SENT, "reason" => "connect").increment(1);
        }
        let mut request = Request::new(ReceiverStream::new(out_rx));
        if let Some(token) = &self.token {
            match format!("Bearer {}", token.expose()).parse() {
                Ok(value) => {
                    request.metadata_mut().insert("authorization", value);
                }
                Err(_) => {
                    return Ended::Refused(Status::invalid_argument(
                        "the router token is not a valid header value",
                    ));
                }
            }
        }
        let mut inbound = match KvRouterClient::new(channel).stream(request).await {
            Ok(response) => response.into_inner(),
            Err(status) => return ended_by(status),
        };
        counter!(crate::metrics::ROUTER_CONNECTS, "outcome" => "registered").increment(1);
        // A stream that worked: when it fails, the next URL gets the shortest back-off.
        backoff.reset();
        info!(router = %url, worker_id = self.worker_id, models = ?served.models, "registered with the router");
        for part in dumps {
            if out.send(message(part)).await.is_err() {
                return Ended::Lost("request stream closed".into());
            }
        }
        let digest_period = self.digest_interval.max(Duration::from_millis(1));
        let mut digest_tick =
            tokio::time::interval_at(tokio::time::Instant::now() + digest_period, digest_period);
        loop {
            let outgoing = tokio::select! {
                body = events.recv() => match body {
                    Some(WorkerBody::Events(mut batch)) => {
                        let covered = dumped.get(&batch.dp_rank).copied().unwrap_or(0);
                        batch.events.retain(|e| e.event_id > covered);
                        if batch.events.is_empty() {
                            continue;
                        }
                        vec![WorkerBody::Events(batch)]
                    }
                    Some(body) => vec![body],
                    None => return Ended::Lost("bridge shutting down".into()),
                },
                // Exact when the outbox is empty; otherwise ahead of the router,
                // which then skips it.
                _ = digest_tick.tick(), if !self.digest_interval.is_zero() => self
                    .mirrors
                    .iter()
                    .map(|m| WorkerBody::Digest(m.lock().unwrap().take_digest()))
                    .collect(),
                load = loads.recv() => match load {
                    Some(load) => vec![WorkerBody::Load(load)],
                    None => return Ended::Lost("bridge shutting down".into()),
                },
                Ok(()) = instance.changed() => return Ended::Restarted,
                reply = inbound.message() => match reply {
                    Ok(Some(reply)) => self.on_reply(reply),
                    Ok(None) => return Ended::Lost("closed by the router".into()),
                    Err(status) => return ended_by(status),
                },
            };
            for body in outgoing {
                if out.send(message(body)).await.is_err() {
                    return Ended::Lost("request stream closed".into());
                }
            }
        }
    }

    /// What to send back, if the router's message calls for anything.
    fn on_reply(&self, reply: proto::RouterMessage) -> Vec<WorkerBody> {
        let Some(body) = reply.body else {
            return Vec::new();
        };
        match body {
            RouterBody::Ack(_) => Vec::new(),
            RouterBody::Resync(resync) => {
                let mirror = self.mirrors.get(resync.dp_rank as usize);
                let Some(mirror) = mirror else {
                    warn!(
                        dp_rank = resync.dp_rank,
                        "router asked to resync a rank this bridge does not have"
                    );
                    return Vec::new();
                };
                info!(
                    dp_rank = resync.dp_rank,
                    from_event_id = resync.from_event_id,
                    "router asked for a resync: sending a full dump"
                );
                counter!(crate::metrics::DUMPS_SENT, "reason" => "resync").increment(1);
                let dump = mirror.lock().unwrap().dump();
                dump_parts(dump)
            }
            RouterBody::Error(error) => {
                warn!("router reported: {}", error.message);
                Vec::new()
            }
        }
    }
}

/// A dump in parts that each fit the router's message limit.
fn dump_parts(dump: proto::Dump) -> Vec<WorkerBody> {
    dump.into_parts(proto::DUMP_PART_BLOCKS)
        .into_iter()
        .map(WorkerBody::Dump)
        .collect()
}

fn message(body: WorkerBody) -> proto::WorkerMessage {
    proto::WorkerMessage { body: Some(body) }
}

/// Statuses that retrying cannot fix end the bridge; the rest reconnect.
fn ended_by(status: Status) -> Ended {
    match status.code() {
        Code::InvalidArgument
        | Code::FailedPrecondition
        | Code::Unauthenticated
        | Code::PermissionDenied => Ended::Refused(status),
        _ => Ended::Lost(status.to_string()),
    }
}
