//! One engine made live: its iteration loop on tokio, its HTTP server, its
//! event stream to the router, and the faults tests inject.
//!
//! The [`Engine`] and its [`EventLog`] sit behind one mutex (`Core`), held only
//! for short, non-async sections. The iteration loop takes a step, sleeps the
//! step's cost-model time, then publishes the pool's events and hands each
//! request its new tokens, so a block is announced once simulated time has
//! passed over its computation. Requests whose client went away are aborted.

pub mod http;
pub mod pd;
pub mod persona;
pub mod publisher;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use kvroute_cache::Priority;
use kvroute_index::ExtraKeys;
use kvroute_tls::{GrpcClientTls, Secret, ServerConfig};
use kvroute_tokenize::TokenizerSpec;
use tokio::net::TcpListener;
use tokio::sync::{Notify, mpsc, watch};
use tokio::task::JoinHandle;

use crate::SimError;
use crate::engine::{Emitted, Engine, EngineConfig, EngineStats, Handoff, Load, SeqId};
use crate::events::{DEFAULT_RING_EVENTS, EventLog};
use crate::worker::http::SharedTokenizer;
use crate::worker::http::responses::ResponseStore;
use crate::worker::pd::{HttpClient, LeaseKey, Leases, PdConfig, PdStats, Role};
use crate::worker::persona::Persona;

/// Events between two digests of the cache, by default.
pub const DEFAULT_DIGEST_EVENTS: u64 = 1000;
/// Longest time between two digests, by default.
pub const DEFAULT_DIGEST_INTERVAL: Duration = Duration::from_secs(2);
/// How long a stored response is kept by default (`--responses-ttl-s`).
pub const DEFAULT_RESPONSES_TTL: Duration = Duration::from_secs(3600);

/// How to run one simulated worker.
#[derive(Clone, Debug)]
pub struct WorkerConfig {
    pub worker_id: u64,
    /// The model name served and registered.
    pub model: String,
    pub engine: EngineConfig,
    /// Where the HTTP server listens (port 0: any free port).
    pub http_addr: SocketAddr,
    /// The router replicas' gRPC URLs, tried in turn (the next one after a failed
    /// stream); none: the worker publishes no events.
    pub routers: Vec<String>,
    /// Bearer token for the router's gRPC ingest, if it requires one.
    pub auth_token: Option<Secret>,
    /// CA and client certificate for an `https://` router.
    pub router_tls: GrpcClientTls,
    /// Serve HTTPS with this config instead of plain HTTP.
    pub http_tls: Option<Arc<ServerConfig>>,
    /// How text prompts are tokenized: must be the router's tokenizer.
    pub tokenizer: TokenizerSpec,
    pub load_report_interval: Duration,
    /// Recent events kept to answer resync requests.
    pub ring_events: usize,
    /// A digest of the cache goes to the router after this many events (0: never
    /// by count) ...
    pub digest_events: u64,
    /// ... and at this interval (zero: never by time).
    pub digest_interval: Duration,
    /// Log one line per eviction decision (time, policy, blocks freed, why).
    pub log_evictions: bool,
    /// Which engine's HTTP surface to imitate.
    pub persona: Persona,
    /// The engine's part in prefill/decode disaggregation.
    pub pd: PdConfig,
    /// How long a stored Responses API response (`/v1/responses`) is kept,
    /// for `previous_response_id` and `GET /v1/responses/{id}`.
    pub responses_ttl: Duration,
}

impl WorkerConfig {
    pub fn new(worker_id: u64, engine: EngineConfig) -> Self {
        WorkerConfig {
            worker_id,
            model: "sim-model".into(),
            engine,
            http_addr: ([127, 0, 0, 1], 0).into(),
            routers: Vec::new(),
            auth_token: None,
            router_tls: GrpcClientTls::default(),
            http_tls: None,
            tokenizer: TokenizerSpec::Tiktoken {
                encoding: "cl100k_base".into(),
            },
            load_report_interval: Duration::from_millis(100),
            ring_events: DEFAULT_RING_EVENTS,
            digest_events: DEFAULT_DIGEST_EVENTS,
            digest_interval: DEFAULT_DIGEST_INTERVAL,
            log_evictions: false,
            persona: Persona::Vllm,
            pd: PdConfig::default(),
            responses_ttl: DEFAULT_RESPONSES_TTL,
        }
    }
}

/// A fault to inject.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fault {
    /// Stop sending events (they keep accumulating in the log).
    StopEvents,
    /// Send everything held back since `StopEvents`.
    ResumeEvents,
    /// Never send the next `n` events: the router sees a gap.
    DropEvents(u64),
    /// Forget every request and cached block, as a new engine process: event
    /// ids start over and the worker registers again as a new instance.
    Restart,
    /// Stop serving HTTP and close the event stream, as if the process died.
    Die,
}

pub(crate) struct Core {
    pub engine: Engine,
    pub log: EventLog,
    /// This life of the engine (`Register.instance_id`): drawn at start and at
    /// every restart, so the router knows everything it held is gone.
    pub instance_id: u64,
    pub streams: HashMap<SeqId, mpsc::UnboundedSender<Emitted>>,
    pub publishing: bool,
    pub drop_next: u64,
    pub pacing: Pacing,
    /// Prefill legs' blocks held for decode engines.
    pub pd: Leases,
}

/// How far the iteration loop ran behind the cost model's clock.
///
/// A step's results are delivered when wall time reaches the step's simulated
/// end; if the machine is too busy to keep up (too high a `--speedup`, too many
/// engines per core), every latency measured through the fleet inflates. Benches
/// report this so that CPU-bound runs are recognised, not mistaken for results.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Pacing {
    pub steps: u64,
    /// Sum over steps of the wall time between a step's deadline and its delivery.
    pub total_lag: Duration,
    pub max_lag: Duration,
}

impl Pacing {
    fn record(&mut self, lag: Duration) {
        self.steps += 1;
        self.total_lag += lag;
        self.max_lag = self.max_lag.max(lag);
    }

    pub fn mean_lag(&self) -> Duration {
        if self.steps == 0 {
            Duration::ZERO
        } else {
            self.total_lag / self.steps as u32
        }
    }
}

pub(crate) struct Shared {
    pub config: WorkerConfig,
    pub base_url: String,
    pub core: Mutex<Core>,
    /// New work for the iteration loop.
    pub wake: Notify,
    /// New events for the publisher.
    pub events_ready: Notify,
    pub stop: watch::Sender<bool>,
    pub tokenizer: SharedTokenizer,
    /// A prefill leg finished: a decode waiting at the rendezvous may take it.
    pub lease_added: Notify,
    /// Takes decode legs' KV from prefill engines' side channels.
    pub client: HttpClient,
    /// The side channel's port (prefill engines; 0 for the others).
    pub bootstrap_port: u16,
    /// The stored Responses API responses.
    pub responses: ResponseStore,
}

impl Shared {
    pub fn core(&self) -> MutexGuard<'_, Core> {
        self.core
            .lock()
            .expect("no code panics while holding the core")
    }

    /// Queues a request; its tokens arrive on the returned channel. A prefill
    /// leg (`lease`) keeps its blocks under that key once it finishes.
    pub fn submit(
        &self,
        tokens: &[u32],
        max_tokens: u32,
        extra: &ExtraKeys,
        priority: Priority,
        handoff: Handoff,
        lease: Option<LeaseKey>,
    ) -> Result<(SeqId, mpsc::UnboundedReceiver<Emitted>), SimError> {
        if *self.stop.borrow() {
            return Err(SimError::Stopped);
        }
        let (tx, rx) = mpsc::unbounded_channel();
        let id = {
            let mut core = self.core();
            let handoff = Handoff {
                hold: lease.is_some(),
                ..handoff
            };
            let id = core
                .engine
                .submit_handoff(tokens, max_tokens, extra, priority, handoff)?;
            core.streams.insert(id, tx);
            if let Some(key) = lease {
                core.pd.start(id, key);
            }
            id
        };
        self.wake.notify_one();
        Ok((id, rx))
    }

    pub fn abort(&self, id: SeqId) {
        let mut core = self.core();
        if core.streams.remove(&id).is_some() {
            core.engine.abort(id);
            core.pd.forget(id);
        }
    }

    /// Moves the pool's new events into the log; wakes the publisher. Writes
    /// the eviction log when asked to.
    fn log_events(&self, core: &mut Core) {
        for record in core.engine.take_eviction_log() {
            tracing::info!(
                target: "kvroute_sim::eviction",
                worker = self.config.worker_id,
                policy = %record.policy,
                blocks_freed = record.blocks_freed,
                why = record.reason.as_str(),
                "eviction"
            );
        }
        let events = core.engine.take_events();
        if !events.is_empty() {
            for event in events {
                core.log.append(event);
            }
            self.events_ready.notify_one();
        }
    }
}

/// A running simulated worker.
pub struct Worker {
    shared: Arc<Shared>,
    http_addr: SocketAddr,
    tasks: Vec<JoinHandle<()>>,
}

impl Worker {
    /// Binds the HTTP listener, starts the engine, and connects to the router.
    pub async fn start(config: WorkerConfig) -> Result<Worker, SimError> {
        let engine = Engine::new(config.engine.clone())?;
        let listener = TcpListener::bind(config.http_addr)
            .await
            .map_err(|source| SimError::Io {
                context: format!("cannot listen on {}", config.http_addr),
                source,
            })?;
        let http_addr = listener.local_addr().map_err(|source| SimError::Io {
            context: "cannot read the listener's address".into(),
            source,
        })?;
        // Prefill engines serve the side channel decode engines take KV from.
        let side_channel = match config.pd.role {
            Role::Prefill => {
                let addr = SocketAddr::new(http_addr.ip(), config.pd.bootstrap_port);
                Some(
                    TcpListener::bind(addr)
                        .await
                        .map_err(|source| SimError::Io {
                            context: format!("cannot listen on {addr} (--bootstrap-port)"),
                            source,
                        })?,
                )
            }
            _ => None,
        };
        let bootstrap_port = match &side_channel {
            Some(listener) => listener.local_addr().map_or(0, |a| a.port()),
            None => 0,
        };
        let (stop, _) = watch::channel(false);
        let mut log = EventLog::new(config.ring_events);
        let mut engine = engine;
        engine.log_evictions(config.log_evictions);
        for event in engine.take_events() {
            log.append(event);
        }
        let shared = Arc::new(Shared {
            base_url: match config.http_tls {
                Some(_) => format!("https://{http_addr}"),
                None => format!("http://{http_addr}"),
            },
            tokenizer: SharedTokenizer::new(config.tokenizer.clone()),
            responses: ResponseStore::new(config.responses_ttl),
            config,
            core: Mutex::new(Core {
                engine,
                log,
                instance_id: rand::random(),
                streams: HashMap::new(),
                publishing: true,
                drop_next: 0,
                pacing: Pacing::default(),
                pd: Leases::default(),
            }),
            wake: Notify::new(),
            events_ready: Notify::new(),
            stop,
            lease_added: Notify::new(),
            client: crate::worker::pd::http_client(),
            bootstrap_port,
        });
        let mut tasks = vec![
            tokio::spawn(iterate(Arc::clone(&shared))),
            tokio::spawn(crate::worker::http::serve(Arc::clone(&shared), listener)),
        ];
        if !shared.config.routers.is_empty() {
            tasks.push(tokio::spawn(crate::worker::publisher::run(Arc::clone(
                &shared,
            ))));
        }
        if let Some(listener) = side_channel {
            tasks.push(tokio::spawn(crate::worker::pd::serve_side_channel(
                Arc::clone(&shared),
                listener,
            )));
        }
        tracing::info!(worker = shared.config.worker_id, %http_addr, "simulated worker started");
        Ok(Worker {
            shared,
            http_addr,
            tasks,
        })
    }

    pub fn id(&self) -> u64 {
        self.shared.config.worker_id
    }

    pub fn http_addr(&self) -> SocketAddr {
        self.http_addr
    }

    pub fn base_url(&self) -> &str {
        &self.shared.base_url
    }

    pub fn role(&self) -> Role {
        self.shared.config.pd.role
    }

    /// The side channel's port on a prefill engine; 0 on the others.
    pub fn bootstrap_port(&self) -> u16 {
        self.shared.bootstrap_port
    }

    /// Handoffs served and blocks freed by lease timeout.
    pub fn pd_stats(&self) -> PdStats {
        self.shared.core().pd.stats
    }

    pub fn stats(&self) -> (EngineStats, Load) {
        let core = self.shared.core();
        (core.engine.stats(), core.engine.load())
    }

    pub fn eviction_policy(&self) -> kvroute_cache::PolicyKind {
        self.shared.core().engine.eviction_policy()
    }

    /// What each eviction policy cost this engine while it ran.
    pub fn eviction_figures(&self) -> Vec<crate::eviction::PolicyFigures> {
        self.shared.core().engine.eviction_figures()
    }

    /// How far this worker's iteration loop has run behind simulated time.
    pub fn pacing(&self) -> Pacing {
        self.shared.core().pacing
    }

    pub fn last_event_id(&self) -> u64 {
        self.shared.core().log.last_id()
    }

    pub fn inject(&self, fault: Fault) {
        inject(&self.shared, fault);
    }

    /// Stops everything (the `Die` fault) and waits for the tasks to end.
    pub async fn shutdown(self) {
        inject(&self.shared, Fault::Die);
        for task in self.tasks {
            let _ = task.await;
        }
    }
}

pub(crate) fn inject(shared: &Shared, fault: Fault) {
    tracing::info!(worker = shared.config.worker_id, ?fault, "fault injected");
    match fault {
        Fault::StopEvents => shared.core().publishing = false,
        Fault::ResumeEvents => {
            shared.core().publishing = true;
            shared.events_ready.notify_one();
        }
        Fault::DropEvents(n) => shared.core().drop_next += n,
        Fault::Restart => {
            let mut core = shared.core();
            // Clients of the dropped requests see their streams end.
            core.streams.clear();
            core.pd.clear();
            if let Err(e) = core.engine.clear() {
                tracing::error!("restart failed: {e}");
            }
            core.log.restart();
            core.instance_id = rand::random();
            // A new engine process has none of the old one's stored responses.
            shared.responses.clear();
            shared.log_events(&mut core);
            // The publisher registers the new instance even if no event follows.
            shared.events_ready.notify_one();
        }
        Fault::Die => {
            shared.stop.send_replace(true);
            shared.core().streams.clear();
        }
    }
}

/// The iteration loop: step, let the step's time pass, deliver.
///
/// Steps are paced against a running deadline rather than by sleeping each
/// step's duration: the timer's millisecond granularity (and a busy machine)
/// then only delays a step, without making simulated time fall behind.
async fn iterate(shared: Arc<Shared>) {
    let mut stopped = shared.stop.subscribe();
    let mut deadline = tokio::time::Instant::now();
    loop {
        let step = {
            let mut core = shared.core();
            let step = core.engine.step();
            if step.is_none() {
                shared.log_events(&mut core);
            }
            step
        };
        let Some(step) = step else {
            tokio::select! {
                _ = shared.wake.notified() => {
                    deadline = tokio::time::Instant::now();
                    continue;
                }
                _ = until_stopped(&mut stopped) => return,
            }
        };
        deadline += step.duration;
        tokio::select! {
            _ = tokio::time::sleep_until(deadline) => {}
            _ = until_stopped(&mut stopped) => return,
        }
        let lag = tokio::time::Instant::now().saturating_duration_since(deadline);
        let mut core = shared.core();
        core.pacing.record(lag);
        shared.log_events(&mut core);
        for emitted in step.emitted {
            if emitted.finished {
                // Leased before the client hears of it, so its response can name it.
                crate::worker::pd::finished(&shared, &mut core, emitted.seq);
            }
            let delivered = core
                .streams
                .get(&emitted.seq)
                .is_some_and(|tx| tx.send(emitted).is_ok());
            if emitted.finished {
                core.streams.remove(&emitted.seq);
            } else if !delivered {
                core.streams.remove(&emitted.seq);
                core.engine.abort(emitted.seq);
                core.pd.forget(emitted.seq);
            }
        }
    }
}

/// Resolves once the worker is told to stop (the guard `wait_for` returns is
/// not `Send`, so it must not live across the caller's awaits).
pub(crate) async fn until_stopped(stopped: &mut watch::Receiver<bool>) {
    let _ = stopped.wait_for(|&s| s).await;
}

/// Starts `count` workers from `template`: worker `i` gets id
/// `template.worker_id + i` and, when `base_port` is not 0, port `base_port + i`
/// (and bootstrap port `template.pd.bootstrap_port + i` when that is not 0).
pub async fn start_fleet(
    template: &WorkerConfig,
    count: usize,
    base_port: u16,
) -> Result<Vec<Worker>, SimError> {
    let mut workers = Vec::with_capacity(count);
    for i in 0..count {
        let mut config = template.clone();
        config.worker_id = template.worker_id + i as u64;
        if base_port != 0 {
            let port = u16::try_from(base_port as usize + i).map_err(|_| {
                SimError::Config(format!(
                    "--base-port {base_port} + {count} workers passes port 65535"
                ))
            })?;
            config.http_addr.set_port(port);
        }
        if template.pd.bootstrap_port != 0 {
            config.pd.bootstrap_port = u16::try_from(template.pd.bootstrap_port as usize + i)
                .map_err(|_| {
                    SimError::Config(format!(
                        "--bootstrap-port {} + {count} workers passes port 65535",
                        template.pd.bootstrap_port
                    ))
                })?;
        }
        workers.push(Worker::start(config).await?);
    }
    Ok(workers)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_router_token_does_not_show_in_debug_output() {
        let mut config = WorkerConfig::new(1, EngineConfig::default());
        config.auth_token = Some(Secret::new("sim-secret"));
        let printed = format!("{config:?} {config:#?}");
        assert!(!printed.contains("sim-secret"), "{printed}");
        assert!(printed.contains("<redacted>"), "{printed}");
    }
}
