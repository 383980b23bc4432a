//! kvroute-bridge: a sidecar that makes a vLLM or SGLang engine a kvroute worker.
//!
//! Real engines do not speak kvroute's gRPC: they publish KV-cache events on a
//! ZeroMQ socket in msgpack. The bridge runs beside one engine and
//! - decodes every shape of those batches ([`wire`]),
//! - turns engine events into kvroute events with kvroute's own block hashes,
//!   leaving out other memory tiers and refusing foreign block sizes, and keeps a
//!   mirror of each data-parallel rank's cache ([`rank`]),
//! - follows each rank's publisher, recovering lost batches from the engine's
//!   replay socket and clearing the rank when that is not possible ([`engine`]),
//! - registers the engine with the router (again, as a new instance, when the
//!   engine restarted), streams the events, and answers the router's resync
//!   requests with full dumps of the mirror ([`router`]),
//! - reports the engine's load, scraped from its Prometheus endpoint ([`load`]),
//! - and exports its own counters at `/metrics` ([`metrics`]).
//!
//! [`run`] wires these together: one task per rank, one for the router stream,
//! one for load, one for `/metrics`.

pub mod engine;
pub mod load;
pub mod metrics;
pub mod rank;
pub mod router;
pub mod wire;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Empty};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use kvroute_proto as proto;
use tokio::sync::mpsc;
use tracing::warn;

use crate::engine::{RankEndpoints, RankFollower};
use crate::load::{RankLoad, ServedModels, parse_load, parse_models};
use crate::rank::{EventFilter, RankMirror};
use crate::router::RouterLink;

/// How often the engine's load is scraped and reported.
const LOAD_INTERVAL: Duration = Duration::from_secs(1);
/// Event batches waiting for the router; beyond it they are dropped and the router resyncs.
const OUTBOX_BATCHES: usize = 4096;

#[derive(Debug, thiserror::Error)]
pub enum BridgeError {
    #[error("invalid configuration: {0}")]
    Config(String),
    #[error("ZeroMQ socket {0}: {1}")]
    Zmq(String, zeromq::ZmqError),
    #[error("replay: {0}")]
    Replay(String),
    #[error("engine HTTP {0}: {1}")]
    EngineHttp(String, String),
    #[error("the router refused this bridge: {0}")]
    Refused(String),
    #[error("{0}: {1}")]
    Io(String, std::io::Error),
    #[error("metrics recorder: {0}")]
    Metrics(String),
}

/// The types of [`BridgeConfig`]'s disaggregation fields, as `Register` carries them.
pub use kvroute_proto::{PdConvention, WorkerRole};

/// Everything `kvroute bridge` is told on its command line.
#[derive(Clone, Debug)]
pub struct BridgeConfig {
    /// The engine's event publisher, `tcp://HOST:PORT`; rank N publishes on PORT + N.
    pub engine_events: String,
    /// The engine's replay socket, `tcp://HOST:PORT`; rank N on PORT + N.
    pub engine_replay: Option<String>,
    /// Topic prefix to subscribe to; empty: every topic.
    pub topic: String,
    /// Data-parallel ranks of the engine.
    pub data_parallel_size: u32,
    /// The router replicas' gRPC URLs (at least one): a failed stream moves on
    /// to the next.
    pub routers: Vec<String>,
    /// Bearer token for the router's gRPC ingest, when it requires one.
    pub router_token: Option<kvroute_tls::Secret>,
    /// CA and client certificate for an `https://` router.
    pub router_tls: kvroute_tls::GrpcClientTls,
    pub worker_id: u64,
    /// The engine's OpenAI-compatible HTTP server: registered with the router, and
    /// where `/v1/models` and `/metrics` are read.
    pub engine_url: String,
    pub block_size: u32,
    /// The medium whose blocks are forwarded as the device tier.
    pub medium: String,
    /// Media whose blocks are forwarded as the offload tier.
    pub offload_media: Vec<String>,
    /// Where the bridge serves its own `/metrics`.
    pub metrics_addr: SocketAddr,
    /// The engine's tokenizer, declared to the router at registration (the
    /// engine does not tell); `None`: not declared, the router cannot check it.
    pub tokenizer: Option<kvroute_tokenize::TokenizerSpec>,
    /// A rank's digest follows the batch that makes this many events (0: never).
    pub digest_events: u64,
    /// Every rank's digest goes out at this interval (zero: never).
    pub digest_interval: Duration,
    /// The engine's part in prefill/decode disaggregation.
    pub role: kvroute_proto::WorkerRole,
    /// A prefill engine's handoff convention.
    pub pd_convention: kvroute_proto::PdConvention,
    /// A prefill engine's bootstrap server port (SGLang convention).
    pub bootstrap_port: Option<u16>,
}

/// Runs the bridge until the router refuses it or `/metrics` cannot be served.
pub async fn run(config: BridgeConfig) -> Result<(), BridgeError> {
    if config.block_size == 0 {
        return Err(BridgeError::Config(
            "--block-size must be at least 1".into(),
        ));
    }
    check_pd(&config)?;
    let ranks = rank_endpoints(&config)?;
    if config.routers.is_empty() {
        return Err(BridgeError::Config("--router is required".into()));
    }
    // Bad URLs or TLS files stop the bridge here instead of failing every reconnect.
    for router in &config.routers {
        kvroute_tls::grpc_endpoint(router, &config.router_tls)
            .map_err(|e| BridgeError::Config(format!("--router {router}: {e}")))?;
    }
    let engine_uri: hyper::Uri = config
        .engine_url
        .parse()
        .map_err(|e| BridgeError::Config(format!("--engine-url {:?}: {e}", config.engine_url)))?;
    if engine_uri.scheme_str() != Some("http") || engine_uri.host().is_none() {
        return Err(BridgeError::Config(format!(
            "--engine-url {:?} is not http://HOST:PORT",
            config.engine_url
        )));
    }
    let tokenizer = config
        .tokenizer
        .as_ref()
        .map(declare_tokenizer)
        .transpose()?;
    let listener = metrics::bind(config.metrics_addr).await?;
    let handle = metrics::install()?;
    let filter = EventFilter {
        block_size: config.block_size,
        medium: config.medium.clone(),
        offload_media: config.offload_media.clone(),
    };
    let (events_tx, events_rx) = mpsc::channel(OUTBOX_BATCHES);
    let (loads_tx, loads_rx) = mpsc::channel(16);
    // This life of the engine, as the router knows it: a follower that sees the
    // engine restart draws a new one, and the link registers it.
    let (instance, instance_rx) = tokio::sync::watch::channel(rand::random::<u64>());
    let instance = Arc::new(instance);
    let mut mirrors = Vec::new();
    for endpoints in ranks {
        let mirror = Arc::new(Mutex::new(RankMirror::new(
            config.worker_id,
            endpoints.dp_rank,
        )));
        mirrors.push(mirror.clone());
        let follower = RankFollower::new(
            endpoints,
            config.topic.clone(),
            filter.clone(),
            mirror,
            events_tx.clone(),
            config.digest_events,
            Arc::clone(&instance),
        );
        tokio::spawn(follower.run());
    }
    let engine = EngineHttp::new(&config.engine_url);
    tokio::spawn(report_load(
        engine.clone(),
        config.block_size,
        config.data_parallel_size,
        loads_tx,
    ));
    let link = RouterLink {
        urls: config.routers.clone(),
        token: config.router_token.clone(),
        tls: config.router_tls.clone(),
        worker_id: config.worker_id,
        engine_url: config.engine_url.clone(),
        block_size: config.block_size,
        tokenizer,
        mirrors,
        engine,
        instance: instance_rx,
        digest_interval: config.digest_interval,
        pd: (
            config.role,
            config.pd_convention,
            config.bootstrap_port.map_or(0, u32::from),
        ),
    };
    tokio::select! {
        refused = link.run(events_rx, loads_rx) => Err(refused),
        served = metrics::serve(listener, handle) => served,
    }
}

/// What the router refuses a prefill worker for, refused here at start
/// instead of at every registration.
fn check_pd(config: &BridgeConfig) -> Result<(), BridgeError> {
    use kvroute_proto::{PdConvention, WorkerRole};
    match (config.role, config.pd_convention, config.bootstrap_port) {
        (WorkerRole::Prefill, PdConvention::Unspecified, _) => Err(BridgeError::Config(
            "--role prefill needs --pd-convention sglang|vllm".into(),
        )),
        (WorkerRole::Prefill, PdConvention::Sglang, None) => Err(BridgeError::Config(
            "--pd-convention sglang needs --bootstrap-port (the engine's \
             --disaggregation-bootstrap-port)"
                .into(),
        )),
        _ => Ok(()),
    }
}

/// The tokenizer as declared to the router: its spec and fingerprint, which
/// takes loading it here.
fn declare_tokenizer(
    spec: &kvroute_tokenize::TokenizerSpec,
) -> Result<kvroute_proto::TokenizerInfo, BridgeError> {
    let fingerprint = match spec {
        kvroute_tokenize::TokenizerSpec::None => String::new(),
        spec => kvroute_tokenize::Tokenizer::load(spec)
            .map_err(|e| BridgeError::Config(format!("--tokenizer {spec}: {e}")))?
            .fingerprint()
            .to_string(),
    };
    Ok(kvroute_proto::TokenizerInfo {
        spec: spec.to_string(),
        fingerprint,
    })
}

/// Each rank's sockets: the configured ports plus the rank.
fn rank_endpoints(config: &BridgeConfig) -> Result<Vec<RankEndpoints>, BridgeError> {
    if config.data_parallel_size == 0 {
        return Err(BridgeError::Config(
            "--data-parallel-size must be at least 1".into(),
        ));
    }
    (0..config.data_parallel_size)
        .map(|dp_rank| {
            Ok(RankEndpoints {
                dp_rank,
                events: offset_port(&config.engine_events, dp_rank)?,
                replay: config
                    .engine_replay
                    .as_deref()
                    .map(|e| offset_port(e, dp_rank))
                    .transpose()?,
            })
        })
        .collect()
}

/// `tcp://HOST:PORT` with PORT + `offset`, as engines number their ranks' sockets.
fn offset_port(endpoint: &str, offset: u32) -> Result<String, BridgeError> {
    let invalid = || BridgeError::Config(format!("{endpoint:?} is not tcp://HOST:PORT"));
    let (host, port) = endpoint
        .strip_prefix("tcp://")
        .and_then(|rest| rest.rsplit_once(':'))
        .ok_or_else(invalid)?;
    let port: u16 = port.parse().map_err(|_| invalid())?;
    let port = u16::try_from(u32::from(port) + offset).map_err(|_| invalid())?;
    Ok(format!("tcp://{host}:{port}"))
}

/// The engine's HTTP server: what it serves and how loaded it is.
#[derive(Clone)]
pub struct EngineHttp {
    base: String,
    client: Client<HttpConnector, Empty<Bytes>>,
    /// The KV pool of rank 0 in blocks, as last scraped; 0 until known.
    total_kv_blocks: Arc<AtomicU64>,
}

impl EngineHttp {
    const TIMEOUT: Duration = Duration::from_secs(5);

    fn new(base: &str) -> Self {
        let mut connector = HttpConnector::new();
        connector.set_connect_timeout(Some(Self::TIMEOUT));
        Self {
            base: base.trim_end_matches('/').to_owned(),
            client: Client::builder(TokioExecutor::new()).build(connector),
            total_kv_blocks: Arc::default(),
        }
    }

    /// The body of a successful `GET` of `path`.
    async fn get(&self, path: &str) -> Result<Bytes, BridgeError> {
        let url = format!("{}{path}", self.base);
        let error = |e: String| BridgeError::EngineHttp(url.clone(), e);
        let uri: hyper::Uri = url
            .parse()
            .map_err(|e: hyper::http::uri::InvalidUri| error(e.to_string()))?;
        let fetch = async {
            let response = self
                .client
                .get(uri)
                .await
                .map_err(|e| error(e.to_string()))?;
            if !response.status().is_success() {
                return Err(error(format!("status {}", response.status())));
            }
            let body = response
                .into_body()
                .collect()
                .await
                .map_err(|e| error(e.to_string()))?;
            Ok(body.to_bytes())
        };
        tokio::time::timeout(Self::TIMEOUT, fetch)
            .await
            .map_err(|_| error(format!("no answer within {:?}", Self::TIMEOUT)))?
    }

    pub async fn models(&self) -> Result<ServedModels, BridgeError> {
        let body = self.get("/v1/models").await?;
        serde_json::from_slice(&body)
            .ok()
            .as_ref()
            .and_then(parse_models)
            .ok_or_else(|| {
                BridgeError::EngineHttp(
                    format!("{}/v1/models", self.base),
                    "not an OpenAI model list".into(),
                )
            })
    }

    /// The KV pool size to register: as last scraped, or scraped now if still unknown.
    pub async fn total_kv_blocks(&self, block_size: u32) -> u64 {
        let known = self.total_kv_blocks.load(Ordering::Relaxed);
        if known > 0 {
            return known;
        }
        // Unknown stays 0: the router then relies on the load reports alone.
        let _ = self.scrape(block_size).await;
        self.total_kv_blocks.load(Ordering::Relaxed)
    }

    /// Per-rank load, remembering rank 0's pool size for registration.
    async fn scrape(&self, block_size: u32) -> Result<BTreeMap<u32, RankLoad>, BridgeError> {
        let body = self.get("/metrics").await?;
        let load = parse_load(&String::from_utf8_lossy(&body), block_size);
        if let Some(total) = load.get(&0).and_then(|l| l.total_blocks) {
            self.total_kv_blocks.store(total, Ordering::Relaxed);
        }
        Ok(load)
    }
}

/// Scrapes the engine's load every [`LOAD_INTERVAL`] and queues one report per rank.
async fn report_load(
    engine: EngineHttp,
    block_size: u32,
    ranks: u32,
    reports: mpsc::Sender<proto::LoadReport>,
) {
    let mut ticks = tokio::time::interval(LOAD_INTERVAL);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        ticks.tick().await;
        let load = match engine.scrape(block_size).await {
            Ok(load) => load,
            Err(e) => {
                ::metrics::counter!(metrics::LOAD_SCRAPES, "outcome" => "failed").increment(1);
                warn!("engine load: {e}");
                continue;
            }
        };
        ::metrics::counter!(metrics::LOAD_SCRAPES, "outcome" => "ok").increment(1);
        for (&dp_rank, rank_load) in load.iter().filter(|(r, _)| **r < ranks) {
            // A full queue means the router link is down; the next report supersedes this one.
            let _ = reports.try_send(rank_load.report(dp_rank));
        }
    }
}

/// Exponential backoff between reconnection attempts: 100 ms doubling to 5 s.
#[derive(Debug)]
struct Backoff {
    next: Duration,
}

impl Default for Backoff {
    fn default() -> Self {
        Self { next: Self::FIRST }
    }
}

impl Backoff {
    const FIRST: Duration = Duration::from_millis(100);
    const MAX: Duration = Duration::from_secs(5);

    async fn wait(&mut self) {
        tokio::time::sleep(self.next).await;
        self.next = (self.next * 2).min(Self::MAX);
    }

    fn reset(&mut self) {
        self.next = Self::FIRST;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rank_ports_follow_the_base_port() {
        assert_eq!(
            offset_port("tcp://10.0.0.5:5557", 2).unwrap(),
            "tcp://10.0.0.5:5559"
        );
        assert_eq!(
            offset_port("tcp://[::1]:5557", 0).unwrap(),
            "tcp://[::1]:5557"
        );
        assert!(offset_port("tcp://host", 0).is_err());
        assert!(offset_port("ipc:///tmp/x:1", 0).is_err());
        assert!(offset_port("tcp://host:65535", 1).is_err());
    }

    #[test]
    fn the_router_token_does_not_show_in_debug_output() {
        let config = BridgeConfig {
            engine_events: "tcp://127.0.0.1:5557".into(),
            engine_replay: None,
            topic: String::new(),
            data_parallel_size: 1,
            routers: vec!["http://127.0.0.1:50051".into()],
            router_token: Some(kvroute_tls::Secret::new("bridge-secret")),
            router_tls: Default::default(),
            worker_id: 1,
            engine_url: "http://127.0.0.1:8000".into(),
            block_size: 16,
            medium: "GPU".into(),
            offload_media: Vec::new(),
            metrics_addr: ([127, 0, 0, 1], 0).into(),
            tokenizer: None,
            digest_events: 0,
            digest_interval: Duration::ZERO,
            role: kvroute_proto::WorkerRole::Aggregated,
            pd_convention: kvroute_proto::PdConvention::Unspecified,
            bootstrap_port: None,
        };
        let printed = format!("{config:?} {config:#?}");
        assert!(!printed.contains("bridge-secret"), "{printed}");
        assert!(printed.contains("<redacted>"), "{printed}");
    }
}
