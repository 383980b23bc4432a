//! The worker's side of the router's gRPC stream.
//!
//! Each connection starts with `Register`, then a full `Dump` (in parts) of the pool taken
//! under the same lock as the event log's last id, so the router's view is
//! exact whatever it knew before (it may have restarted, or purged this
//! worker). Events after that id follow in batches as the engine produces them,
//! load reports at a fixed interval. A `ResyncRequest` is answered from the
//! ring of recent events, or with a dump when they have left it. A digest of
//! what the router should hold ([`RouterView`]) follows every
//! `digest_events` events and every `digest_interval`, so the router can check
//! its index. A failed connection is retried on the next of the configured
//! routers (replicas), round and round, with exponential backoff (50 ms
//! doubling to 5 s; back to 50 ms once a stream had registered).
//!
//! Faults act here: events can be held back (`StopEvents`) or skipped
//! (`DropEvents`, which leaves a gap the router must detect). A restart ends
//! the connection: the worker registers again at once with its new instance id,
//! as a restarted engine process would, and the router forgets the old one.

use std::sync::Arc;
use std::time::Duration;

use kvroute_proto::kv_router_client::KvRouterClient;
use kvroute_proto::{
    Dump, EventBatch, KvEvent, LoadReport, Register, TokenizerInfo, WorkerMessage, router_message,
    worker_message,
};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::metadata::MetadataValue;

use crate::events::stored;
use crate::pool::PoolEvent;
use crate::view::RouterView;
use crate::worker::Shared;
use crate::worker::pd::Role;

const FIRST_BACKOFF: Duration = Duration::from_millis(50);
const MAX_BACKOFF: Duration = Duration::from_secs(5);

pub(crate) async fn run(shared: Arc<Shared>) {
    let routers = &shared.config.routers;
    let mut stopped = shared.stop.subscribe();
    let mut backoff = FIRST_BACKOFF;
    let mut turn = 0;
    // Loading the tokenizer for its fingerprint blocks: not on the async threads.
    let loading = Arc::clone(&shared);
    let tokenizer = tokio::task::spawn_blocking(move || loading.tokenizer.declaration())
        .await
        .ok()
        .flatten();
    loop {
        let router = &routers[turn % routers.len()];
        let mut session = Session::new(&shared);
        tokio::select! {
            result = session.run(router, tokenizer.clone()) => match result {
                Ok(Ended::Stopped) => return,
                Ok(Ended::Restarted) => {
                    backoff = FIRST_BACKOFF;
                    continue;
                }
                Err(e) => {
                    if session.registered {
                        backoff = FIRST_BACKOFF;
                    }
                    turn += 1;
                    tracing::warn!(
                        worker = shared.config.worker_id,
                        "event stream to {router} failed: {e}; trying {} in {backoff:?}",
                        routers[turn % routers.len()]
                    );
                }
            },
            _ = crate::worker::until_stopped(&mut stopped) => return,
        }
        tokio::select! {
            _ = tokio::time::sleep(backoff) => {}
            _ = crate::worker::until_stopped(&mut stopped) => return,
        }
        backoff = (backoff * 2).min(MAX_BACKOFF);
    }
}

struct Session<'a> {
    shared: &'a Shared,
    /// The last event id sent (or deliberately skipped).
    sent_upto: u64,
    /// The engine instance this connection registered.
    instance_id: u64,
    /// The router accepted the stream.
    registered: bool,
    /// What the router should hold, for digests.
    view: RouterView,
}

/// Why a connection ended well.
enum Ended {
    /// The worker stops.
    Stopped,
    /// The engine restarted: register the new instance.
    Restarted,
}

/// The engine restarted since the connection registered.
struct Restarted;

fn message(body: worker_message::Body) -> WorkerMessage {
    WorkerMessage { body: Some(body) }
}

impl<'a> Session<'a> {
    fn new(shared: &'a Shared) -> Self {
        Session {
            shared,
            sent_upto: 0,
            instance_id: 0,
            registered: false,
            view: RouterView::default(),
        }
    }

    /// Serves one connection until it fails, the worker stops or the engine restarts.
    async fn run(
        &mut self,
        router: &str,
        tokenizer: Option<TokenizerInfo>,
    ) -> Result<Ended, String> {
        let shared = self.shared;
        let config = &shared.config;
        let endpoint =
            kvroute_tls::grpc_endpoint(router, &config.router_tls).map_err(|e| e.to_string())?;
        let channel = kvroute_proto::with_keepalive(endpoint)
            .connect()
            .await
            .map_err(|e| format!("cannot connect: {e:?}"))?;
        let mut client = KvRouterClient::new(channel);
        let (tx, rx) = mpsc::channel::<WorkerMessage>(256);
        // Taken with the dump, so both describe the same instance.
        let dump = self.dump();
        let register = Register {
            worker_id: config.worker_id,
            dp_ranks: vec![0],
            models: vec![config.model.clone()],
            base_url: shared.base_url.clone(),
            block_size: config.engine.block_size as u32,
            total_kv_blocks: config.engine.kv_blocks as u64,
            lora_names: Vec::new(),
            tokenizer,
            instance_id: self.instance_id,
            role: kvroute_proto::WorkerRole::from(config.pd.role) as i32,
            pd_convention: match config.pd.role {
                Role::Aggregated => kvroute_proto::PdConvention::Unspecified,
                _ => config.pd.convention.into(),
            } as i32,
            bootstrap_port: u32::from(shared.bootstrap_port),
        };
        let _ = tx.try_send(message(worker_message::Body::Register(register)));
        let mut request = tonic::Request::new(ReceiverStream::new(rx));
        if let Some(token) = &config.auth_token {
            let value = MetadataValue::try_from(format!("Bearer {}", token.expose()))
                .map_err(|e| format!("the auth token is not a valid header value: {e}"))?;
            request.metadata_mut().insert("authorization", value);
        }
        let mut inbound = client
            .stream(request)
            .await
            .map_err(|status| format!("the router refused the stream: {}", status.message()))?
            .into_inner();
        self.registered = true;
        tracing::info!(worker = config.worker_id, "registered with {router}");
        send_all(&tx, dump).await?;
        let mut stopped = shared.stop.subscribe();
        let mut load_tick = tokio::time::interval(config.load_report_interval);
        let digest_period = config.digest_interval.max(Duration::from_millis(1));
        let mut digest_tick =
            tokio::time::interval_at(tokio::time::Instant::now() + digest_period, digest_period);
        loop {
            tokio::select! {
                _ = shared.events_ready.notified() => {
                    let Ok(pending) = self.pending() else {
                        tracing::info!(worker = config.worker_id, "engine restarted: registering the new instance");
                        return Ok(Ended::Restarted);
                    };
                    send_all(&tx, pending).await?;
                    let every = config.digest_events;
                    if every > 0 && self.view.since_digest() >= every {
                        send(&tx, self.digest()).await?;
                    }
                }
                _ = digest_tick.tick(), if !config.digest_interval.is_zero() => {
                    send(&tx, self.digest()).await?;
                }
                reply = inbound.message() => {
                    let reply = reply.map_err(|status| format!("stream error: {}", status.message()))?
                        .ok_or("the router closed the stream")?;
                    match reply.body {
                        Some(router_message::Body::Resync(resync)) => {
                            tracing::debug!(worker = config.worker_id, from = resync.from_event_id, "resync requested");
                            let Ok(answer) = self.resync(resync.from_event_id) else {
                                return Ok(Ended::Restarted);
                            };
                            send_all(&tx, answer).await?;
                        }
                        Some(router_message::Body::Error(error)) => {
                            tracing::warn!(worker = config.worker_id, "router error: {}", error.message);
                        }
                        Some(router_message::Body::Ack(_)) | None => {}
                    }
                }
                _ = load_tick.tick() => {
                    send(&tx, self.load_report()).await?;
                }
                _ = crate::worker::until_stopped(&mut stopped) => return Ok(Ended::Stopped),
            }
        }
    }

    /// A dump of the pool and the id it is current to, in parts; later events follow it.
    fn dump(&mut self) -> Vec<WorkerMessage> {
        let core = self.shared.core();
        self.instance_id = core.instance_id;
        self.sent_upto = core.log.last_id();
        let dump = dump_of(&core.engine.dump(), core.log.last_id());
        self.view.reset(&dump);
        dump.into_parts(kvroute_proto::DUMP_PART_BLOCKS)
            .into_iter()
            .map(|part| message(worker_message::Body::Dump(part)))
            .collect()
    }

    /// The events not yet sent, minus any the `DropEvents` fault swallows.
    fn pending(&mut self) -> Result<Vec<WorkerMessage>, Restarted> {
        let mut core = self.shared.core();
        if core.instance_id != self.instance_id {
            return Err(Restarted);
        }
        if !core.publishing {
            return Ok(Vec::new());
        }
        let Some(mut events) = core.log.since(self.sent_upto + 1) else {
            drop(core);
            return Ok(self.dump());
        };
        self.sent_upto = core.log.last_id();
        self.view.apply(&events);
        let dropped = (core.drop_next as usize).min(events.len());
        if dropped > 0 {
            core.drop_next -= dropped as u64;
            // Keep the first event so the gap sits between sent events.
            let start = usize::from(events.len() > dropped);
            events.drain(start..start + dropped);
        }
        Ok((!events.is_empty())
            .then(|| batch(events))
            .into_iter()
            .collect())
    }

    fn resync(&mut self, from: u64) -> Result<Vec<WorkerMessage>, Restarted> {
        let core = self.shared.core();
        if core.instance_id != self.instance_id {
            return Err(Restarted);
        }
        Ok(match core.log.since(from) {
            Some(events) => {
                self.view.apply(&events);
                self.sent_upto = self.sent_upto.max(core.log.last_id());
                vec![batch(events)]
            }
            None => {
                drop(core);
                self.dump()
            }
        })
    }

    /// What the router should hold as of the last event taken from the log.
    fn digest(&mut self) -> WorkerMessage {
        message(worker_message::Body::Digest(self.view.take_digest()))
    }

    fn load_report(&self) -> WorkerMessage {
        let load = self.shared.core().engine.load();
        message(worker_message::Body::Load(LoadReport {
            dp_rank: 0,
            running_requests: load.running,
            queued_requests: load.waiting,
            kv_blocks_used: load.kv_blocks_used,
            kv_blocks_total: load.kv_blocks_total,
            prefill_tokens_in_flight: load.prefill_tokens,
        }))
    }
}

async fn send_all(
    tx: &mpsc::Sender<WorkerMessage>,
    messages: Vec<WorkerMessage>,
) -> Result<(), String> {
    for message in messages {
        send(tx, message).await?;
    }
    Ok(())
}

async fn send(tx: &mpsc::Sender<WorkerMessage>, message: WorkerMessage) -> Result<(), String> {
    tx.send(message)
        .await
        .map_err(|_| "the stream to the router closed".to_string())
}

fn batch(events: Vec<KvEvent>) -> WorkerMessage {
    message(worker_message::Body::Events(EventBatch {
        dp_rank: 0,
        events,
    }))
}

fn dump_of(blocks: &[PoolEvent], last_event_id: u64) -> Dump {
    let mut dump = Dump {
        dp_rank: 0,
        last_event_id,
        ..Dump::default()
    };
    for event in blocks {
        match *event {
            PoolEvent::Stored {
                parent,
                hash,
                local,
            } => dump.chains.push(stored(parent, hash, local)),
            PoolEvent::HostStored {
                parent,
                hash,
                local,
            } => dump.offload_chains.push(stored(parent, hash, local)),
            _ => {}
        }
    }
    dump
}
