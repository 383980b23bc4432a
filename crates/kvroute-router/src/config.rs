//! The router's one configuration struct.
//!
//! Layers, later ones winning: built-in defaults, a TOML file (`--config`),
//! `KVROUTE_...` environment variables, then command-line flags (applied by the
//! binary). `config/router.toml` documents every option and its default. Unknown
//! keys in the file are errors, so a typo fails at start instead of silently
//! doing nothing.
//!
//! Environment variables name a key by its path in upper case, sections joined
//! with a double underscore: `KVROUTE_HTTP_ADDR`, `KVROUTE_SCHEDULER__POLICY`.
//! The environment of a deployed router holds `KVROUTE_...` variables that are
//! not ours: Kubernetes injects `KVROUTE_PORT=tcp://...` and the like for a
//! Service named `kvroute`, and the bridge and the simulator read their own
//! (`KVROUTE_ROUTER_TOKEN`). So a variable that names no key is skipped (logged
//! at debug level once logging is up); only one that goes into a known section
//! with `__` and misses there is an error, as that can only be a typo.
//! Which keys exist, and their types, come from the serialized defaults of the
//! struct itself: a string key takes the value verbatim (`123456` stays a
//! string), numbers and booleans must parse as such, arrays are read as TOML.

use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use kvroute_tokenize::TokenizerSpec;
use serde::{Deserialize, Serialize};

use crate::error::RouterError;

pub use kvroute_tls::Secret;

#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct Config {
    /// OpenAI-compatible API, admin endpoints, health and metrics.
    pub http_addr: SocketAddr,
    /// gRPC ingest (worker event streams) and the `Route` RPC.
    pub grpc_addr: SocketAddr,
    /// Tokens per KV block; workers registering another size are refused.
    pub block_size: u32,
    /// Deprecated: sets both `auth.worker_token` and `auth.admin_token` where
    /// those are empty (with a warning at start).
    pub auth_token: Secret,
    /// Largest request body accepted, in bytes.
    pub body_limit_bytes: usize,
    pub auth: AuthConfig,
    pub log: LogConfig,
    pub scheduler: SchedulerConfig,
    pub ingest: IngestConfig,
    pub upstream: UpstreamConfig,
    /// How text prompts and chat messages become tokens: `tiktoken:ENCODING`,
    /// `hf:PATH` or `none` (adopt the tokenizer the workers declare).
    pub tokenizer: TokenizerSpec,
    /// Accept workers that declare another tokenizer than the router's.
    pub allow_tokenizer_mismatch: bool,
    /// Token ids of recent prompt text kept, in tokens (4 bytes each; 0: none).
    pub tokenizer_cache_tokens: u64,
    /// Threads tokenizing at once, off the async runtime (0: one per CPU).
    pub tokenize_threads: usize,
    pub index: IndexConfig,
    pub limits: LimitsConfig,
    pub tls: TlsConfig,
    pub cluster: ClusterConfig,
    pub epp: EppConfig,
    /// Workers without an event stream, routed on predicted entries alone.
    pub workers: Vec<StaticWorker>,
    /// `KVROUTE_...` variables that named no key and were skipped, for the log.
    #[serde(skip)]
    pub skipped_env: Vec<String>,
}

/// Who may stream worker events, and who may act as an operator.
#[derive(Clone, Debug, Default, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct AuthConfig {
    /// Bearer token for the gRPC `Stream` (worker ingest), good for any worker id.
    pub worker_token: Secret,
    /// Worker tokens each good only for the worker ids listed with it.
    pub bound_worker_tokens: Vec<BoundWorkerToken>,
    /// Bearer token for the admin endpoints (`/workers...`), the `Route` RPC,
    /// pinning (`x-kvroute-worker`) and the worker URLs in `/v1/route`.
    pub admin_token: Secret,
    /// Allows serving without tokens on a non-loopback address.
    pub insecure: bool,
    /// Lets clients without the admin token pin requests and see worker URLs.
    pub clients_may_pin: bool,
}

/// A worker token that may register only `worker_ids`.
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct BoundWorkerToken {
    pub token: Secret,
    pub worker_ids: Vec<u64>,
}

#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct LogConfig {
    /// `text` or `json`.
    pub format: LogFormat,
    /// A tracing-subscriber filter, e.g. `info` or `kvroute_router=debug`.
    pub level: String,
}

#[derive(Clone, Copy, Debug, Deserialize, Serialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum LogFormat {
    Text,
    Json,
}

#[derive(Clone, Copy, Debug, Deserialize, Serialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum Policy {
    Kv,
    RoundRobin,
    Random,
    LeastLoaded,
    PowerOfTwo,
    Approx,
}

impl Policy {
    pub fn as_str(self) -> &'static str {
        match self {
            Policy::Kv => "kv",
            Policy::RoundRobin => "round_robin",
            Policy::Random => "random",
            Policy::LeastLoaded => "least_loaded",
            Policy::PowerOfTwo => "power_of_two",
            Policy::Approx => "approx",
        }
    }
}

impl std::str::FromStr for Policy {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Policy::deserialize(serde::de::value::StrDeserializer::<serde::de::value::Error>::new(s))
            .map_err(|e| e.to_string())
    }
}

/// The units of the `kv` policy's cost (see [`crate::scheduler`]).
#[derive(Clone, Copy, Debug, Default, Deserialize, Serialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum Cost {
    /// Dynamo's: `overlap_weight × prefill blocks + decode blocks`.
    #[default]
    Blocks,
    /// Seconds to the first token: the rank's prefill queue and this request's
    /// uncached tokens at the rank's measured rate, plus decode pressure.
    Seconds,
}

impl Cost {
    pub fn as_str(self) -> &'static str {
        match self {
            Cost::Blocks => "blocks",
            Cost::Seconds => "seconds",
        }
    }
}

impl std::str::FromStr for Cost {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Cost::deserialize(serde::de::value::StrDeserializer::<serde::de::value::Error>::new(s))
            .map_err(|e| e.to_string())
    }
}

/// The order of the router's own wait queue (see [`crate::queue`]).
#[derive(Clone, Copy, Debug, Default, Deserialize, Serialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum QueueOrder {
    /// Arrival order.
    Fifo,
    /// The deepest cached prefix on a rank that can take it first, starvation
    /// bounded by `queue_max_bypass` (measured in the README: under load it
    /// keeps the hit rate FIFO loses).
    #[default]
    LongestPrefix,
}

impl QueueOrder {
    pub fn as_str(self) -> &'static str {
        match self {
            QueueOrder::Fifo => "fifo",
            QueueOrder::LongestPrefix => "longest_prefix",
        }
    }
}

impl std::str::FromStr for QueueOrder {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        QueueOrder::deserialize(
            serde::de::value::StrDeserializer::<serde::de::value::Error>::new(s),
        )
        .map_err(|e| e.to_string())
    }
}

#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct SchedulerConfig {
    pub policy: Policy,
    /// The `kv` cost's units: `blocks` (Dynamo's) or `seconds`.
    pub cost: Cost,
    /// Weight of prefill blocks against decode blocks in the `blocks` cost.
    /// Dynamo's default is 1; 32 is measured here: on the Mooncake conversation
    /// trace it hits more of the cache with lower TTFT and the same fairness (README).
    pub overlap_weight: f64,
    /// `seconds` cost: prefill seconds per token until a rank's rate is measured.
    pub prefill_seconds_per_token: f64,
    /// `seconds` cost: seconds charged per KV block the rank holds for running
    /// requests (this one's included), for decode slowing its prefill down.
    pub decode_seconds_per_block: f64,
    /// Ranks whose cost is within this much of the cheapest (in the cost's
    /// units) count as tied on load, and the deepest overlap among them wins.
    pub overlap_slack: f64,
    /// 0: off. Above 0: a rank's overlap credit is scaled by D / (D + its
    /// prefill blocks in flight), halving when D blocks of prefill wait there.
    pub overlap_decay_blocks: f64,
    /// 0: always the lowest cost; above 0: sample a softmax over normalised costs.
    pub temperature: f64,
    /// A worker with this many requests in flight is busy; 0: no limit.
    pub busy_max_inflight: u32,
    /// A worker whose KV cache is at least this full is busy (0 < x ≤ 1).
    pub busy_kv_ratio: f64,
    /// How long a request waits for a worker when all are busy.
    pub queue_timeout_ms: u64,
    /// Most requests waiting at once; more are refused with 503 at once.
    pub max_queued: usize,
    /// Which waiter gets released capacity first: `fifo` or `longest_prefix`.
    pub queue_order: QueueOrder,
    /// `longest_prefix`: a waiter passed over by this many later arrivals goes next.
    pub queue_max_bypass: u32,
    /// How long a routed prefix counts as cached on a chosen worker that
    /// publishes no events (static workers; every worker under `approx`).
    pub predicted_ttl_ms: u64,
    /// The same for a worker that publishes events: only until its `Stored`
    /// events can have arrived. After that its events are the truth, and a
    /// prediction could only be stale (it never hears of evictions).
    pub predicted_bridge_ms: u64,
    /// Most (worker, block) predicted entries kept.
    pub predicted_max_blocks: usize,
    /// What a block past a rank's device (GPU) prefix that it can load from its
    /// offload tier (host memory, disk) counts for, as a fraction of a cached
    /// block, in [0, 1]; 0: the offload tier is ignored.
    pub offload_weight: f64,
}

#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct IngestConfig {
    /// How long a disconnected worker's index entries are kept for a reconnect.
    pub grace_period_ms: u64,
    /// Bytes of event batches buffered per worker stream before the router drops and resyncs.
    pub event_queue_bytes: usize,
    /// HTTP/2 ping interval on idle worker connections; 0: none.
    pub keepalive_interval_ms: u64,
    /// A ping unanswered this long closes the connection: the worker leaves routing.
    pub keepalive_timeout_ms: u64,
    /// How long a resync request may go unanswered before it is asked again.
    pub resync_timeout_ms: u64,
    /// Resync requests sent for one gap before the rank is cleared instead.
    pub resync_attempts: u32,
    /// How long a new stream may take to send its `Register`; past it the
    /// stream is closed, so a silent one cannot hold a `limits.max_streams` slot.
    pub register_timeout_ms: u64,
}

/// The event index.
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct IndexConfig {
    /// Most (worker, block) entries kept; beyond it the least recently used
    /// unpinned leaves go first.
    pub max_blocks: usize,
    /// The same for the offload tier's index (blocks workers keep in host
    /// memory or on disk), and the most offload blocks one dump may hold.
    pub max_offload_blocks: usize,
    /// Enables `POST /workers/{id}/drop-events`, which corrupts this replica's
    /// index on purpose (see `crate::faults`). For tests only.
    pub test_faults: bool,
}

/// Caps on what clients and workers can make the router hold or do. Each
/// refusal is counted in `kvroute_limit_refusals_total{limit}`.
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct LimitsConfig {
    /// Data-parallel ranks per registration.
    pub max_dp_ranks: usize,
    /// Model names per registration.
    pub max_models: usize,
    /// LoRA adapter names per registration.
    pub max_lora_names: usize,
    /// Bytes in a model or LoRA name, and in a base URL.
    pub max_name_bytes: usize,
    /// Registered workers, static ones included.
    pub max_workers: usize,
    /// Worker streams open at once.
    pub max_streams: usize,
    /// Events in one `EventBatch`.
    pub max_events_per_batch: usize,
    /// Largest gRPC message accepted, in bytes.
    pub max_grpc_message_bytes: usize,
    /// Blocks of one request recorded in the predicted layer (a prefix of its path).
    pub max_predicted_blocks_per_request: usize,
    /// Proxied and dry-run requests handled at once; beyond it 503 with Retry-After.
    pub max_inflight_requests: usize,
}

#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct UpstreamConfig {
    pub connect_timeout_ms: u64,
    /// Until the worker's response headers arrive.
    pub first_byte_timeout_ms: u64,
    /// Longest silence inside a response body.
    pub idle_timeout_ms: u64,
    /// Extra attempts on other workers after a connect error or a 5xx.
    pub retries: u32,
    /// Consecutive failures that open a worker's circuit breaker.
    pub breaker_failures: u32,
    /// How long an open breaker waits before letting one probe through.
    pub breaker_cooldown_ms: u64,
    /// A worker without traffic for this long gets its `/health` checked; 0: never.
    pub health_interval_ms: u64,
    pub health_timeout_ms: u64,
    /// On shutdown, how long in-flight responses may take to finish.
    pub shutdown_grace_ms: u64,
    /// PEM CA certificates trusted for `https://` workers, beside the system's roots.
    pub ca_file: String,
}

/// TLS on both listeners; empty paths: plain TCP.
#[derive(Clone, Debug, Default, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct TlsConfig {
    /// PEM certificate chain of both listeners.
    pub cert_file: String,
    /// PEM private key of `cert_file`.
    pub key_file: String,
    /// PEM CA certificates; when set, gRPC ingest requires a client certificate
    /// signed by one of them (mTLS).
    pub client_ca_file: String,
}

impl TlsConfig {
    pub fn enabled(&self) -> bool {
        !self.cert_file.is_empty()
    }
}

/// Router replicas sharing one index through NATS JetStream (`kvroute-cluster`).
/// Without `nats_url`, the router is one replica on its own, as before.
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct ClusterConfig {
    /// NATS server(s), e.g. `nats://nats:4222`; empty: no cluster.
    pub nats_url: String,
    /// This replica's name in records and registrations; empty: the host name.
    pub replica_id: String,
    /// Events older than this leave the stream, in seconds.
    pub stream_max_age_s: u64,
    /// The stream's size bound, in bytes; the oldest events leave first.
    pub stream_max_bytes: i64,
    /// A worker's registration lives this long unless its replica refreshes it.
    pub registration_ttl_ms: u64,
    /// An index snapshot is written to the object store when the newest is
    /// this old, in seconds; at most half of `stream_max_age_s`, so a
    /// snapshot always covers what the stream forgot.
    pub snapshot_interval_s: u64,
    /// Share bookings and predictions with the other replicas (core NATS).
    pub share_load: bool,
    /// Each replica sends all its bookings this often, besides every change.
    pub load_full_state_ms: u64,
    /// A replica not heard from for this long: its bookings are dropped.
    pub load_expiry_ms: u64,
}

impl ClusterConfig {
    pub fn enabled(&self) -> bool {
        !self.nats_url.is_empty()
    }
}

impl Default for ClusterConfig {
    fn default() -> Self {
        Self {
            nats_url: String::new(),
            replica_id: String::new(),
            stream_max_age_s: 3_600,
            stream_max_bytes: 1 << 30,
            registration_ttl_ms: 10_000,
            snapshot_interval_s: 300,
            share_load: true,
            load_full_state_ms: 500,
            load_expiry_ms: 3_000,
        }
    }
}

/// The Gateway API Inference Extension's endpoint picker (`crate::epp`): Envoy's
/// ext_proc v3 and gRPC health, for gateways that proxy themselves.
#[derive(Clone, Debug, Default, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct EppConfig {
    /// Where the endpoint picker listens, HOST:PORT; empty: off.
    pub addr: String,
}

impl EppConfig {
    /// The address to serve on, if the picker is on.
    pub fn addr(&self) -> Result<Option<SocketAddr>, RouterError> {
        if self.addr.is_empty() {
            return Ok(None);
        }
        self.addr.parse().map(Some).map_err(|e| {
            RouterError::Config(format!("epp.addr {:?} is not HOST:PORT: {e}", self.addr))
        })
    }
}

#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct StaticWorker {
    pub id: u64,
    pub base_url: String,
    pub models: Vec<String>,
    #[serde(default)]
    pub lora_names: Vec<String>,
    #[serde(default = "default_dp_ranks")]
    pub dp_ranks: Vec<u32>,
}

fn default_dp_ranks() -> Vec<u32> {
    vec![0]
}

impl Default for Config {
    fn default() -> Self {
        Self {
            http_addr: ([0, 0, 0, 0], 8000).into(),
            grpc_addr: ([0, 0, 0, 0], 50051).into(),
            block_size: 16,
            auth_token: Secret::default(),
            body_limit_bytes: 8 << 20,
            auth: AuthConfig::default(),
            log: LogConfig::default(),
            scheduler: SchedulerConfig::default(),
            ingest: IngestConfig::default(),
            upstream: UpstreamConfig::default(),
            tokenizer: TokenizerSpec::None,
            allow_tokenizer_mismatch: false,
            tokenizer_cache_tokens: kvroute_tokenize::DEFAULT_CACHE_TOKENS,
            tokenize_threads: 0,
            index: IndexConfig::default(),
            limits: LimitsConfig::default(),
            tls: TlsConfig::default(),
            cluster: ClusterConfig::default(),
            epp: EppConfig::default(),
            workers: Vec::new(),
            skipped_env: Vec::new(),
        }
    }
}

impl Default for LogConfig {
    fn default() -> Self {
        Self {
            format: LogFormat::Text,
            level: "info".into(),
        }
    }
}

impl Default for SchedulerConfig {
    fn default() -> Self {
        Self {
            policy: Policy::Kv,
            cost: Cost::Blocks,
            overlap_weight: 32.0,
            prefill_seconds_per_token: 50e-6,
            decode_seconds_per_block: 0.8e-3,
            overlap_slack: 0.0,
            overlap_decay_blocks: 0.0,
            temperature: 0.0,
            busy_max_inflight: 0,
            busy_kv_ratio: 1.0,
            queue_timeout_ms: 2_000,
            max_queued: 1024,
            queue_order: QueueOrder::LongestPrefix,
            queue_max_bypass: 8,
            predicted_ttl_ms: 120_000,
            predicted_bridge_ms: 10_000,
            predicted_max_blocks: 1 << 20,
            offload_weight: 0.9,
        }
    }
}

impl Default for IngestConfig {
    fn default() -> Self {
        Self {
            grace_period_ms: 30_000,
            event_queue_bytes: 64 << 20,
            keepalive_interval_ms: 10_000,
            keepalive_timeout_ms: 10_000,
            resync_timeout_ms: 5_000,
            resync_attempts: 3,
            register_timeout_ms: 10_000,
        }
    }
}

impl Default for IndexConfig {
    fn default() -> Self {
        // 32 Mi entries, about 2.5 GiB of heap at ~75–85 bytes per entry with the
        // eviction order (kvroute-index's MEASUREMENTS.md): 160 engines holding
        // 200k blocks each.
        Self {
            max_blocks: 32 << 20,
            // Half the device tier's: an offload block is worth less to
            // routing than a GPU block (offload_weight), so over the bound it
            // is the first to go; 1.5 GiB more heap at most.
            max_offload_blocks: 16 << 20,
            test_faults: false,
        }
    }
}

impl Default for LimitsConfig {
    fn default() -> Self {
        Self {
            max_dp_ranks: 256,
            max_models: 64,
            max_lora_names: 1024,
            max_name_bytes: 512,
            max_workers: 4096,
            max_streams: 4096,
            max_events_per_batch: 65_536,
            max_grpc_message_bytes: 16 << 20,
            max_predicted_blocks_per_request: 16_384,
            max_inflight_requests: 8192,
        }
    }
}

impl Default for UpstreamConfig {
    fn default() -> Self {
        Self {
            connect_timeout_ms: 2_000,
            first_byte_timeout_ms: 300_000,
            idle_timeout_ms: 60_000,
            retries: 2,
            breaker_failures: 5,
            breaker_cooldown_ms: 10_000,
            health_interval_ms: 5_000,
            health_timeout_ms: 1_000,
            shutdown_grace_ms: 30_000,
            ca_file: String::new(),
        }
    }
}

/// The longest timeout accepted (a day), so that deadlines never overflow.
const MAX_TIMEOUT_MS: u64 = 86_400_000;

impl Config {
    /// Defaults, then the TOML file (if any), then `KVROUTE_...` variables from `env`.
    pub fn load(
        path: Option<&Path>,
        env: impl IntoIterator<Item = (String, String)>,
    ) -> Result<Self, RouterError> {
        let mut table = match path {
            Some(path) => {
                let text = std::fs::read_to_string(path).map_err(|e| {
                    RouterError::Config(format!("cannot read {}: {e}", path.display()))
                })?;
                text.parse::<toml::Table>()
                    .map_err(|e| RouterError::Config(format!("{}: {e}", path.display())))?
            }
            None => toml::Table::new(),
        };
        let keys = serde_json::to_value(Config::default()).expect("the defaults serialize");
        let mut skipped_env = Vec::new();
        for (name, value) in env {
            let Some(key) = name.strip_prefix("KVROUTE_") else {
                continue;
            };
            // The config file's own path is not a config key.
            if key == "CONFIG" {
                continue;
            }
            let applied = set_from_env(&mut table, &keys, &key.to_ascii_lowercase(), &value)
                .map_err(|e| RouterError::Config(format!("environment variable {name}: {e}")))?;
            if !applied {
                skipped_env.push(name);
            }
        }
        let origin = path.map_or("configuration".to_string(), |p| p.display().to_string());
        let mut config: Config = toml::Value::Table(table)
            .try_into()
            .map_err(|e: toml::de::Error| RouterError::Config(format!("{origin}: {e}")))?;
        config.skipped_env = skipped_env;
        // Say where the bad value came from (the file's errors above name it too).
        config.validate().map_err(|e| match e {
            RouterError::Config(problem) => RouterError::Config(format!("{origin}: {problem}")),
            other => other,
        })?;
        Ok(config)
    }

    /// `auth.worker_token`, or the deprecated `auth_token` when that is empty.
    pub fn worker_token(&self) -> &Secret {
        self.or_legacy(&self.auth.worker_token)
    }

    /// `auth.admin_token`, or the deprecated `auth_token` when that is empty.
    pub fn admin_token(&self) -> &Secret {
        self.or_legacy(&self.auth.admin_token)
    }

    fn or_legacy<'a>(&'a self, token: &'a Secret) -> &'a Secret {
        if token.is_empty() {
            &self.auth_token
        } else {
            token
        }
    }

    /// Logs what loading noticed, once logging is set up: skipped variables
    /// (names only: their values may be secrets) and deprecated keys.
    pub fn log_notices(&self) {
        for name in &self.skipped_env {
            tracing::debug!("environment variable {name} names no configuration key: ignored");
        }
        if !self.auth_token.is_empty() {
            tracing::warn!(
                "auth_token is deprecated: set auth.worker_token and auth.admin_token instead"
            );
        }
    }

    /// Checks what the types alone cannot.
    pub fn validate(&self) -> Result<(), RouterError> {
        let fail = |msg: String| Err(RouterError::Config(msg));
        if self.block_size == 0 {
            return fail("block_size must be at least 1".into());
        }
        if self.body_limit_bytes == 0 {
            return fail("body_limit_bytes must be at least 1".into());
        }
        self.epp.addr()?;
        let s = &self.scheduler;
        if !(s.overlap_weight.is_finite() && s.overlap_weight >= 0.0) {
            return fail(format!(
                "scheduler.overlap_weight must be ≥ 0, got {}",
                s.overlap_weight
            ));
        }
        for (name, value) in [
            ("prefill_seconds_per_token", s.prefill_seconds_per_token),
            ("decode_seconds_per_block", s.decode_seconds_per_block),
            ("overlap_slack", s.overlap_slack),
            ("overlap_decay_blocks", s.overlap_decay_blocks),
        ] {
            if !(value.is_finite() && value >= 0.0) {
                return fail(format!("scheduler.{name} must be ≥ 0, got {value}"));
            }
        }
        if !(s.temperature.is_finite() && s.temperature >= 0.0) {
            return fail(format!(
                "scheduler.temperature must be ≥ 0, got {}",
                s.temperature
            ));
        }
        if !(s.offload_weight >= 0.0 && s.offload_weight <= 1.0) {
            return fail(format!(
                "scheduler.offload_weight must be in [0, 1], got {}",
                s.offload_weight
            ));
        }
        if !(s.busy_kv_ratio > 0.0 && s.busy_kv_ratio <= 1.0) {
            return fail(format!(
                "scheduler.busy_kv_ratio must be in (0, 1], got {}",
                s.busy_kv_ratio
            ));
        }
        let l = &self.limits;
        for (name, value) in [
            ("max_dp_ranks", l.max_dp_ranks),
            ("max_models", l.max_models),
            ("max_name_bytes", l.max_name_bytes),
            ("max_workers", l.max_workers),
            ("max_streams", l.max_streams),
            ("max_events_per_batch", l.max_events_per_batch),
            ("max_grpc_message_bytes", l.max_grpc_message_bytes),
            ("max_inflight_requests", l.max_inflight_requests),
            (
                "max_predicted_blocks_per_request",
                l.max_predicted_blocks_per_request,
            ),
        ] {
            if value == 0 {
                return fail(format!("limits.{name} must be at least 1"));
            }
        }
        if self.index.max_blocks == 0 {
            return fail("index.max_blocks must be at least 1".into());
        }
        if self.index.max_offload_blocks == 0 {
            return fail("index.max_offload_blocks must be at least 1".into());
        }
        // A batch the queue could never hold would be dropped and resent forever.
        if self.ingest.event_queue_bytes < l.max_grpc_message_bytes {
            return fail(format!(
                "ingest.event_queue_bytes ({}) must be at least limits.max_grpc_message_bytes ({})",
                self.ingest.event_queue_bytes, l.max_grpc_message_bytes
            ));
        }
        // Semaphore permits are counted in u32 chunks; keep the queue well inside.
        if self.ingest.event_queue_bytes > u32::MAX as usize {
            return fail("ingest.event_queue_bytes must be below 4 GiB".into());
        }
        let c = &self.cluster;
        if c.enabled() && (c.registration_ttl_ms < 1_000 || c.stream_max_age_s == 0) {
            return fail(
                "cluster.registration_ttl_ms must be at least 1000 and cluster.stream_max_age_s at least 1".into(),
            );
        }
        if c.enabled()
            && (c.snapshot_interval_s == 0
                || c.snapshot_interval_s.saturating_mul(2) > c.stream_max_age_s)
        {
            return fail(format!(
                "cluster.snapshot_interval_s ({}) must be at least 1 and at most half of cluster.stream_max_age_s ({}): a snapshot must cover what the stream forgets",
                c.snapshot_interval_s, c.stream_max_age_s
            ));
        }
        // An expiry within two full states would drop a live replica's load
        // whenever one of its messages is late.
        if c.enabled()
            && c.share_load
            && (c.load_full_state_ms < 10 || c.load_expiry_ms < 2 * c.load_full_state_ms)
        {
            return fail(format!(
                "cluster.load_full_state_ms must be at least 10 and cluster.load_expiry_ms ({}) at least twice it ({})",
                c.load_expiry_ms, c.load_full_state_ms
            ));
        }
        self.validate_durations()?;
        if !(1..=MAX_TIMEOUT_MS).contains(&self.ingest.resync_timeout_ms) {
            return fail(format!(
                "ingest.resync_timeout_ms must be in 1..={MAX_TIMEOUT_MS}, got {}",
                self.ingest.resync_timeout_ms
            ));
        }
        if !(1..=MAX_TIMEOUT_MS).contains(&self.ingest.register_timeout_ms) {
            return fail(format!(
                "ingest.register_timeout_ms must be in 1..={MAX_TIMEOUT_MS}, got {}",
                self.ingest.register_timeout_ms
            ));
        }
        if self.ingest.resync_attempts == 0 {
            return fail("ingest.resync_attempts must be at least 1".into());
        }
        if self.upstream.breaker_failures == 0 {
            return fail("upstream.breaker_failures must be at least 1".into());
        }
        let tls = &self.tls;
        if tls.cert_file.is_empty() != tls.key_file.is_empty() {
            return fail("tls.cert_file and tls.key_file are set together or not at all".into());
        }
        if !tls.client_ca_file.is_empty() && !tls.enabled() {
            return fail("tls.client_ca_file needs tls.cert_file and tls.key_file".into());
        }
        let mut tokens = std::collections::HashSet::new();
        for bound in &self.auth.bound_worker_tokens {
            if bound.token.is_empty() {
                return fail("auth.bound_worker_tokens: a token is empty".into());
            }
            if bound.worker_ids.is_empty() {
                return fail("auth.bound_worker_tokens: a token lists no worker_ids".into());
            }
            if bound.token == *self.worker_token() || !tokens.insert(bound.token.expose()) {
                return fail(
                    "auth.bound_worker_tokens: a token is listed twice (or is also auth.worker_token)"
                        .into(),
                );
            }
        }
        let mut ids = std::collections::HashSet::new();
        for w in &self.workers {
            if !ids.insert(w.id) {
                return fail(format!("workers: id {} is listed twice", w.id));
            }
            if let Err(e) = crate::worker_url::parse_base_url(&w.base_url) {
                return fail(format!("workers: id {}: {e}", w.id));
            }
            if w.models.is_empty() {
                return fail(format!("workers: id {} serves no model", w.id));
            }
            if w.dp_ranks.is_empty() {
                return fail(format!("workers: id {} has no dp rank", w.id));
            }
        }
        Ok(())
    }
}

/// Longest duration any `_ms` key may take: a week. Far beyond any sensible
/// timeout, far below where `Instant + Duration` overflows and panics.
const MAX_DURATION_MS: u64 = 7 * 24 * 3600 * 1000;

impl Config {
    fn validate_durations(&self) -> Result<(), RouterError> {
        let (s, i, u) = (&self.scheduler, &self.ingest, &self.upstream);
        for (name, ms) in [
            ("scheduler.queue_timeout_ms", s.queue_timeout_ms),
            ("scheduler.predicted_ttl_ms", s.predicted_ttl_ms),
            ("scheduler.predicted_bridge_ms", s.predicted_bridge_ms),
            ("ingest.grace_period_ms", i.grace_period_ms),
            ("ingest.keepalive_interval_ms", i.keepalive_interval_ms),
            ("ingest.keepalive_timeout_ms", i.keepalive_timeout_ms),
            ("upstream.connect_timeout_ms", u.connect_timeout_ms),
            ("upstream.first_byte_timeout_ms", u.first_byte_timeout_ms),
            ("upstream.idle_timeout_ms", u.idle_timeout_ms),
            ("upstream.breaker_cooldown_ms", u.breaker_cooldown_ms),
            ("upstream.health_interval_ms", u.health_interval_ms),
            ("upstream.health_timeout_ms", u.health_timeout_ms),
            ("upstream.shutdown_grace_ms", u.shutdown_grace_ms),
            (
                "cluster.registration_ttl_ms",
                self.cluster.registration_ttl_ms,
            ),
            (
                "cluster.load_full_state_ms",
                self.cluster.load_full_state_ms,
            ),
            ("cluster.load_expiry_ms", self.cluster.load_expiry_ms),
        ] {
            if ms > MAX_DURATION_MS {
                return Err(RouterError::Config(format!(
                    "{name} = {ms} is longer than a week ({MAX_DURATION_MS} ms)"
                )));
            }
        }
        Ok(())
    }
}

/// Sets the key `a__b__c` in `table` to `value`, typed like the key's default in
/// `keys` (the serialized defaults). False: the variable names no key.
fn set_from_env(
    table: &mut toml::Table,
    keys: &serde_json::Value,
    key: &str,
    value: &str,
) -> Result<bool, String> {
    let path: Vec<&str> = key.split("__").collect();
    let (last, sections) = path.split_last().expect("split yields one part at least");
    let mut schema = keys;
    let mut node = table;
    for &section in sections {
        schema = &schema[section];
        if !schema.is_object() {
            return Ok(false);
        }
        node = node
            .entry(section.to_string())
            .or_insert_with(|| toml::Value::Table(toml::Table::new()))
            .as_table_mut()
            .ok_or_else(|| format!("{section} is not a section"))?;
    }
    let typed = match schema.get(*last) {
        None if sections.is_empty() => return Ok(false),
        None => return Err(format!("{} has no key {last}", sections.join("."))),
        // A section is not a key either: `KVROUTE_LOG` may well be someone else's.
        Some(serde_json::Value::Object(_)) => return Ok(false),
        Some(serde_json::Value::String(_)) => toml::Value::String(value.to_string()),
        Some(serde_json::Value::Bool(_)) => toml::Value::Boolean(
            value
                .parse()
                .map_err(|_| format!("expected true or false, got {value:?}"))?,
        ),
        Some(serde_json::Value::Number(n)) if n.is_f64() => toml::Value::Float(
            value
                .parse()
                .map_err(|_| format!("expected a number, got {value:?}"))?,
        ),
        Some(serde_json::Value::Number(_)) => toml::Value::Integer(
            value
                .parse()
                .map_err(|_| format!("expected an integer, got {value:?}"))?,
        ),
        // Not echoed: an array may hold tokens (`auth.bound_worker_tokens`).
        Some(serde_json::Value::Array(_)) => {
            toml_value(value).ok_or("expected a TOML array such as [1, 2]")?
        }
        // No default to go by (an unset option): TOML if it parses, else a string.
        Some(serde_json::Value::Null) => {
            toml_value(value).unwrap_or_else(|| toml::Value::String(value.to_string()))
        }
    };
    node.insert(last.to_string(), typed);
    Ok(true)
}

fn toml_value(text: &str) -> Option<toml::Value> {
    format!("v = {text}")
        .parse::<toml::Table>()
        .ok()
        .and_then(|mut t| t.remove("v"))
}

impl SchedulerConfig {
    pub fn queue_timeout(&self) -> Duration {
        Duration::from_millis(self.queue_timeout_ms)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn environment_overrides_nested_keys_and_reads_toml_values() {
        let config = Config::load(
            None,
            env(&[
                ("KVROUTE_BLOCK_SIZE", "32"),
                ("KVROUTE_SCHEDULER__POLICY", "round_robin"),
                ("KVROUTE_AUTH__ADMIN_TOKEN", "s3cret"),
                ("KVROUTE_SCHEDULER__OVERLAP_WEIGHT", "4"),
                ("KVROUTE_SCHEDULER__OFFLOAD_WEIGHT", "0.5"),
                ("KVROUTE_SCHEDULER__QUEUE_ORDER", "fifo"),
                ("KVROUTE_AUTH__INSECURE", "true"),
                (
                    "KVROUTE_WORKERS",
                    r#"[{id = 3, base_url = "http://w:1", models = ["m"]}]"#,
                ),
                ("OTHER", "ignored"),
            ]),
        )
        .unwrap();
        assert_eq!(config.block_size, 32);
        assert_eq!(config.scheduler.policy, Policy::RoundRobin);
        assert_eq!(config.scheduler.overlap_weight, 4.0);
        assert_eq!(config.scheduler.offload_weight, 0.5);
        assert_eq!(config.scheduler.queue_order, QueueOrder::Fifo);
        assert_eq!(config.admin_token().expose(), "s3cret");
        assert!(config.auth.insecure);
        assert_eq!(config.workers[0].id, 3);
        let config =
            Config::load(None, env(&[("KVROUTE_TOKENIZER", "tiktoken:o200k_base")])).unwrap();
        assert_eq!(config.tokenizer.to_string(), "tiktoken:o200k_base");
    }

    #[test]
    fn environment_values_take_the_type_of_their_key() {
        let config = Config::load(
            None,
            env(&[
                ("KVROUTE_AUTH__WORKER_TOKEN", "123456"),
                ("KVROUTE_AUTH__ADMIN_TOKEN", "true"),
                ("KVROUTE_AUTH_TOKEN", "0x10"),
                ("KVROUTE_LOG__LEVEL", "[info]"),
            ]),
        )
        .unwrap();
        assert_eq!(config.auth.worker_token.expose(), "123456");
        assert_eq!(config.auth.admin_token.expose(), "true");
        assert_eq!(config.auth_token.expose(), "0x10");
        assert_eq!(config.log.level, "[info]");
        for (name, value, expected) in [
            ("KVROUTE_BLOCK_SIZE", "sixteen", "expected an integer"),
            ("KVROUTE_AUTH__INSECURE", "yes", "expected true or false"),
            (
                "KVROUTE_SCHEDULER__TEMPERATURE",
                "warm",
                "expected a number",
            ),
            ("KVROUTE_WORKERS", "none", "expected a TOML array"),
        ] {
            let err = Config::load(None, env(&[(name, value)])).unwrap_err();
            let err = err.to_string();
            assert!(err.contains(name) && err.contains(expected), "{err}");
        }
    }

    #[test]
    fn variables_that_name_no_key_are_skipped() {
        // What the kubelet injects for Services `kvroute` and `kvroute-ingest`,
        // and what the bridge and the simulator read.
        let foreign = [
            ("KVROUTE_PORT", "tcp://10.96.0.10:8000"),
            ("KVROUTE_SERVICE_HOST", "10.96.0.10"),
            ("KVROUTE_SERVICE_PORT", "8000"),
            ("KVROUTE_SERVICE_PORT_GRPC", "50051"),
            ("KVROUTE_PORT_8000_TCP", "tcp://10.96.0.10:8000"),
            ("KVROUTE_PORT_8000_TCP_ADDR", "10.96.0.10"),
            ("KVROUTE_PORT_8000_TCP_PORT", "8000"),
            ("KVROUTE_PORT_8000_TCP_PROTO", "tcp"),
            ("KVROUTE_INGEST_SERVICE_HOST", "10.96.0.11"),
            ("KVROUTE_ROUTER_TOKEN", "w"),
            ("KVROUTE_LOG", "debug"),
            ("KVROUTE_BLOCK_SIZE__X", "1"),
        ];
        let config = Config::load(None, env(&foreign)).unwrap();
        let skipped: Vec<&str> = config.skipped_env.iter().map(String::as_str).collect();
        let names: Vec<&str> = foreign.iter().map(|(n, _)| *n).collect();
        assert_eq!(skipped, names);
        assert_eq!(config.http_addr, Config::default().http_addr);
    }

    #[test]
    fn secrets_do_not_show_in_debug_output() {
        let config = Config::load(
            None,
            env(&[
                ("KVROUTE_AUTH_TOKEN", "legacy-secret"),
                ("KVROUTE_AUTH__WORKER_TOKEN", "worker-secret"),
                ("KVROUTE_AUTH__ADMIN_TOKEN", "admin-secret"),
                (
                    "KVROUTE_AUTH__BOUND_WORKER_TOKENS",
                    r#"[{token = "bound-secret", worker_ids = [1]}]"#,
                ),
            ]),
        )
        .unwrap();
        let printed = format!("{config:?} {config:#?}");
        assert!(!printed.contains("secret"), "{printed}");
        assert!(printed.contains("<redacted>"));
        let err = Config::load(
            None,
            env(&[(
                "KVROUTE_AUTH__BOUND_WORKER_TOKENS",
                "[{token = 'bound-secret'",
            )]),
        )
        .unwrap_err();
        assert!(!err.to_string().contains("secret"), "{err}");
    }

    #[test]
    fn bound_worker_tokens_are_checked() {
        let load = |value: &str| {
            Config::load(
                None,
                env(&[
                    ("KVROUTE_AUTH__WORKER_TOKEN", "fleet"),
                    ("KVROUTE_AUTH__BOUND_WORKER_TOKENS", value),
                ]),
            )
        };
        let ok = load(r#"[{token = "a", worker_ids = [1, 2]}]"#).unwrap();
        assert_eq!(ok.auth.bound_worker_tokens[0].worker_ids, [1, 2]);
        for (bad, expected) in [
            (r#"[{token = "a", worker_ids = []}]"#, "no worker_ids"),
            (r#"[{token = "", worker_ids = [1]}]"#, "empty"),
            (r#"[{token = "fleet", worker_ids = [1]}]"#, "twice"),
            (
                r#"[{token = "a", worker_ids = [1]}, {token = "a", worker_ids = [2]}]"#,
                "twice",
            ),
        ] {
            let err = load(bad).unwrap_err().to_string();
            assert!(err.contains(expected), "{bad}: {err}");
        }
    }

    #[test]
    fn unknown_keys_and_bad_values_are_clear_errors() {
        // `__` into a known section can only be a typo: an error, unlike a
        // variable that is not ours.
        let err = Config::load(None, env(&[("KVROUTE_SCHEDULER__POLICYY", "kv")])).unwrap_err();
        assert!(err.to_string().contains("policyy"), "{err}");
        let file =
            std::env::temp_dir().join(format!("kvroute-unknown-{}.toml", std::process::id()));
        std::fs::write(&file, "port = 1\n").unwrap();
        let err = Config::load(Some(&file), Vec::new()).unwrap_err();
        std::fs::remove_file(&file).unwrap();
        assert!(err.to_string().contains("unknown field `port`"), "{err}");
        let err = Config::load(None, env(&[("KVROUTE_BLOCK_SIZE", "0")])).unwrap_err();
        assert!(err.to_string().contains("block_size"), "{err}");
        let err = Config::load(None, env(&[("KVROUTE_SCHEDULER__POLICY", "best")])).unwrap_err();
        assert!(err.to_string().contains("unknown variant"), "{err}");
        let err = Config::load(None, env(&[("KVROUTE_TOKENIZER", "tiktoken:gpt2")])).unwrap_err();
        assert!(err.to_string().contains("gpt2"), "{err}");
    }

    #[test]
    fn the_cluster_is_off_unless_a_nats_url_is_set() {
        assert!(!Config::default().cluster.enabled());
        let config = Config::load(
            None,
            env(&[("KVROUTE_CLUSTER__NATS_URL", "nats://nats:4222")]),
        )
        .unwrap();
        assert!(config.cluster.enabled());
        assert_eq!(config.cluster.nats_url, "nats://nats:4222");
        assert_eq!(config.cluster.replica_id, "");
        assert_eq!(config.cluster.snapshot_interval_s, 300);
    }

    #[test]
    fn snapshots_must_come_within_the_streams_retention() {
        let cluster = |interval: &str| {
            Config::load(
                None,
                env(&[
                    ("KVROUTE_CLUSTER__NATS_URL", "nats://nats:4222"),
                    ("KVROUTE_CLUSTER__STREAM_MAX_AGE_S", "60"),
                    ("KVROUTE_CLUSTER__SNAPSHOT_INTERVAL_S", interval),
                ]),
            )
        };
        assert_eq!(cluster("30").unwrap().cluster.snapshot_interval_s, 30);
        for bad in ["0", "31"] {
            let err = cluster(bad).unwrap_err();
            assert!(err.to_string().contains("snapshot_interval_s"), "{err}");
        }
    }

    #[test]
    fn documented_example_config_loads_with_the_defaults() {
        let path = Path::new(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../config/router.toml"
        ));
        let config = Config::load(Some(path), Vec::new()).unwrap();
        let defaults = Config::default();
        assert_eq!(config.block_size, defaults.block_size);
        assert_eq!(config.http_addr, defaults.http_addr);
        assert_eq!(config.body_limit_bytes, defaults.body_limit_bytes);
        assert_eq!(
            config.ingest.grace_period_ms,
            defaults.ingest.grace_period_ms
        );
        assert_eq!(config.upstream.retries, defaults.upstream.retries);
        assert_eq!(config.tokenizer, defaults.tokenizer);
        assert_eq!(
            config.allow_tokenizer_mismatch,
            defaults.allow_tokenizer_mismatch
        );
        assert_eq!(
            config.tokenizer_cache_tokens,
            defaults.tokenizer_cache_tokens
        );
        assert_eq!(config.tokenize_threads, defaults.tokenize_threads);
        assert_eq!(
            config.ingest.resync_timeout_ms,
            defaults.ingest.resync_timeout_ms
        );
        assert_eq!(
            config.ingest.resync_attempts,
            defaults.ingest.resync_attempts
        );
        assert_eq!(
            config.ingest.register_timeout_ms,
            defaults.ingest.register_timeout_ms
        );
        assert_eq!(config.index.max_blocks, defaults.index.max_blocks);
        assert!(!config.cluster.enabled());
        assert_eq!(
            config.cluster.registration_ttl_ms,
            defaults.cluster.registration_ttl_ms
        );
        assert_eq!(
            config.limits.max_inflight_requests,
            defaults.limits.max_inflight_requests
        );
        assert_eq!(
            config.ingest.event_queue_bytes,
            defaults.ingest.event_queue_bytes
        );
    }

    #[test]
    fn durations_that_would_overflow_an_instant_are_refused() {
        for key in [
            "KVROUTE_UPSTREAM__IDLE_TIMEOUT_MS",
            "KVROUTE_INGEST__GRACE_PERIOD_MS",
            "KVROUTE_SCHEDULER__PREDICTED_TTL_MS",
        ] {
            let err = Config::load(None, env(&[(key, "9223372036854775807")])).unwrap_err();
            let name = key["KVROUTE_".len()..]
                .to_ascii_lowercase()
                .replace("__", ".");
            assert!(err.to_string().contains(&name), "{err}");
        }
        let config = Config::load(
            None,
            env(&[("KVROUTE_UPSTREAM__IDLE_TIMEOUT_MS", "604800000")]),
        );
        assert!(config.is_ok());
    }

    #[test]
    fn limits_and_index_bound_load_from_the_environment() {
        let config = Config::load(
            None,
            env(&[
                ("KVROUTE_INDEX__MAX_BLOCKS", "1000"),
                ("KVROUTE_LIMITS__MAX_DP_RANKS", "8"),
            ]),
        )
        .unwrap();
        assert_eq!(config.index.max_blocks, 1000);
        assert_eq!(config.limits.max_dp_ranks, 8);
        let err =
            Config::load(None, env(&[("KVROUTE_INGEST__EVENT_QUEUE_BYTES", "1024")])).unwrap_err();
        assert!(err.to_string().contains("max_grpc_message_bytes"), "{err}");
    }
}
