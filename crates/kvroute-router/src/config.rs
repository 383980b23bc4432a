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
    pub trust: TrustConfig,
    /// How text prompts and chat messages become tokens: one spec
    /// (`tiktoken:ENCODING`, `hf:PATH`) or a list of them, each worker using
    /// the one with the fingerprint it declares; `none`: text is routed on
    /// load alone.
    pub tokenizer: TokenizerSpecs,
    /// Accept workers that declare a tokenizer none of the router's has.
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
    pub responses: ResponsesConfig,
    pub sessions: SessionsConfig,
    pub disaggregation: DisaggregationConfig,
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
    /// pinning (`x-kvroute-worker`) and the worker URLs and prefix overlaps in
    /// `/v1/route`.
    pub admin_token: Secret,
    /// Allows serving without tokens on a non-loopback address.
    pub insecure: bool,
    /// Lets clients without the admin token pin requests and see worker URLs.
    pub clients_may_pin: bool,
    /// Lets clients without the admin token see the prefix overlaps in
    /// `/v1/route`'s answer: an exact oracle of what the caches hold.
    pub clients_see_overlaps: bool,
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

/// The units of the `kv` policy's cost (see [`crate::schedule`]).
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

/// The order of the router's own wait queue (see [`crate::schedule::queue`]).
#[derive(Clone, Copy, Debug, Default, Deserialize, Serialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum QueueOrder {
    /// Arrival order.
    Fifo,
    /// The deepest cached prefix on a rank that can take it first, starvation
    /// bounded by `queue_max_bypass`. Under load it keeps the hit rate FIFO
    /// loses (docs/measurements/e2e.md, "The router's queue in prefix order").
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
    /// trace it hits more of the cache with lower TTFT and the same fairness
    /// (docs/measurements/e2e.md).
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
    /// Bytes of unfinished dumps (parts gathered until the last arrives) one
    /// worker's stream may hold, as decoded.
    pub dump_parts_bytes_per_worker: usize,
    /// The same over all streams at once.
    pub dump_parts_bytes: usize,
    /// A connection with no stream open for this long is closed, so one that
    /// never opens a stream cannot hold a `limits.max_grpc_connections` place.
    pub idle_connection_timeout_ms: u64,
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
    /// index on purpose (see `crate::faults`). For tests only: a build
    /// without the `test-hooks` feature refuses `true`.
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
    /// Workers registered with one worker token (or, without tokens, by all).
    pub max_workers_per_token: usize,
    /// Worker streams open at once.
    pub max_streams: usize,
    /// Worker streams open at once with one worker token.
    pub max_streams_per_token: usize,
    /// Addresses a worker's base URL may have although the rules refuse them
    /// (link-local, cloud metadata, unspecified).
    pub allowed_base_url_addresses: Vec<std::net::IpAddr>,
    /// Events in one `EventBatch`.
    pub max_events_per_batch: usize,
    /// Largest gRPC message accepted, in bytes.
    pub max_grpc_message_bytes: usize,
    /// Blocks of one request recorded in the predicted layer (a prefix of its path).
    pub max_predicted_blocks_per_request: usize,
    /// Proxied and dry-run requests handled at once; beyond it 503 with Retry-After.
    pub max_inflight_requests: usize,
    /// Content parts of a chat request's messages, all messages together.
    pub max_chat_parts: usize,
    /// Image parts of a chat request.
    pub max_chat_images: usize,
    /// Response ids whose worker the router remembers; past it the least
    /// used are forgotten (their follow-ups are routed by their prefix).
    pub max_response_owners: usize,
    /// Session bindings held (`[sessions]`); a request naming a new session
    /// past it gets 503 with Retry-After.
    pub max_session_bindings: usize,
    /// Bytes in a session id (the `[sessions] header`'s value).
    pub max_session_id_bytes: usize,
    /// Connections open at once on the HTTP port; more are refused at accept.
    pub max_http_connections: usize,
    /// The same from one peer IP address.
    pub max_http_connections_per_peer: usize,
    /// Connections open at once on the gRPC port; more are closed at accept.
    pub max_grpc_connections: usize,
    /// The same from one peer IP address.
    pub max_grpc_connections_per_peer: usize,
    /// From a connection's start or its previous response's end until a whole
    /// request head has arrived; past it the connection is closed. It is also
    /// how long a kept-alive HTTP connection may sit idle.
    pub header_read_timeout_ms: u64,
    /// How long a request body may take, extended by a second for every
    /// `min_body_bytes_per_s` bytes that arrived; past it 408.
    pub body_read_timeout_ms: u64,
    /// The slowest a request body may arrive once `body_read_timeout_ms` is spent.
    pub min_body_bytes_per_s: u64,
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
    /// Sent to every worker as `Authorization: Bearer <api_key>` (an engine's
    /// own key, e.g. vLLM's `--api-key`); empty: no `Authorization` at all.
    pub api_key: Secret,
}

/// When a worker's KV events stop counting in routing: its responses keep
/// reporting fewer cached tokens than its events claimed (see `crate::fleet::claims`).
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct TrustConfig {
    /// The last this many checked claims of a rank are judged (1 to 64).
    pub claim_window: u32,
    /// A rank is demoted once this many of them failed (1 to `claim_window`).
    pub max_failed_claims: u32,
    /// A claim fails when the worker reports fewer cached tokens than this
    /// share of the tokens its events claimed, less one block (in (0, 1]).
    pub min_cached_share: f64,
}

impl Default for TrustConfig {
    fn default() -> Self {
        Self {
            claim_window: 32,
            max_failed_claims: 16,
            min_cached_share: 0.5,
        }
    }
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

/// The tokenizers the router may use, in the configured order: in the file
/// one spec as a string (`"tiktoken:cl100k_base"`), several as a list, or
/// `"none"` (no tokenizer, the empty list).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TokenizerSpecs(pub Vec<TokenizerSpec>);

impl TokenizerSpecs {
    fn new(specs: Vec<TokenizerSpec>) -> Result<Self, String> {
        if specs.len() > 1 && specs.contains(&TokenizerSpec::None) {
            return Err("\"none\" cannot be listed with other tokenizers".into());
        }
        Ok(Self(
            specs
                .into_iter()
                .filter(|s| *s != TokenizerSpec::None)
                .collect(),
        ))
    }
}

impl std::str::FromStr for TokenizerSpecs {
    type Err = kvroute_tokenize::TokenizeError;

    /// One spec, as `--tokenizer` and `KVROUTE_TOKENIZER` take it.
    fn from_str(spec: &str) -> Result<Self, Self::Err> {
        let spec: TokenizerSpec = spec.parse()?;
        Ok(Self::new(vec![spec]).expect("one spec is a valid list"))
    }
}

impl std::fmt::Display for TokenizerSpecs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.0.is_empty() {
            return f.write_str("none");
        }
        let specs: Vec<String> = self.0.iter().map(ToString::to_string).collect();
        f.write_str(&specs.join(", "))
    }
}

impl Serialize for TokenizerSpecs {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        match self.0.as_slice() {
            [] => serializer.serialize_str("none"),
            [one] => one.serialize(serializer),
            many => many.serialize(serializer),
        }
    }
}

impl<'de> Deserialize<'de> for TokenizerSpecs {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged, expecting = "a tokenizer spec or a list of them")]
        enum OneOrMany {
            One(String),
            Many(Vec<String>),
        }
        let specs = match OneOrMany::deserialize(deserializer)? {
            OneOrMany::One(spec) => vec![spec],
            OneOrMany::Many(specs) => specs,
        };
        let specs = specs
            .iter()
            .map(|spec| spec.parse())
            .collect::<Result<_, _>>()
            .map_err(serde::de::Error::custom)?;
        Self::new(specs).map_err(serde::de::Error::custom)
    }
}

/// The Gateway API Inference Extension's endpoint picker (`crate::epp`): Envoy's
/// ext_proc v3 and gRPC health, for gateways that proxy themselves.
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct EppConfig {
    /// Where the endpoint picker listens, HOST:PORT; empty: off.
    pub addr: String,
    /// How many fallback endpoints follow the pick in
    /// `x-gateway-destination-endpoint`. Bounded so that the header stays
    /// small in a large fleet; 0 for gateways that read one endpoint (Envoy's
    /// `ORIGINAL_DST` cluster).
    pub fallbacks: usize,
}

impl Default for EppConfig {
    fn default() -> Self {
        Self {
            addr: String::new(),
            fallbacks: 2,
        }
    }
}

impl SessionsConfig {
    /// The session header's name, if sessions are on.
    pub fn header(&self) -> Result<Option<http::HeaderName>, RouterError> {
        if self.header.is_empty() {
            return Ok(None);
        }
        http::HeaderName::from_bytes(self.header.as_bytes())
            .map(Some)
            .map_err(|e| {
                RouterError::Config(format!(
                    "sessions.header {:?} is not a header name: {e}",
                    self.header
                ))
            })
    }
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

/// OpenAI Responses conversations: which worker stores each response.
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct ResponsesConfig {
    /// How long the router remembers which worker created a response id:
    /// as long as the engines keep stored responses.
    pub owner_ttl_s: u64,
}

impl Default for ResponsesConfig {
    fn default() -> Self {
        Self { owner_ttl_s: 3600 }
    }
}

/// Agent sessions kept on the worker that holds their cache (`crate::schedule::sessions`).
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct SessionsConfig {
    /// The request header naming a session; empty: sessions off.
    pub header: String,
    /// How long a binding lives after its session's last request, in seconds.
    pub ttl_s: u64,
    /// A bound session stays on its rank while that rank's load, with the
    /// request, is at most this many times the least loaded eligible rank's.
    pub max_load_ratio: f64,
}

impl Default for SessionsConfig {
    fn default() -> Self {
        Self {
            header: "x-session-id".into(),
            // An agent's pause between tool calls, with room to spare.
            ttl_s: 600,
            // Moving re-prefills the whole history elsewhere: worth it only
            // once the bound rank carries twice the least loaded one's load.
            max_load_ratio: 2.0,
        }
    }
}

/// When a name served by prefill and decode workers skips the prefill leg
/// (see [`crate::pd`]).
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct DisaggregationConfig {
    /// Prompts shorter than this (in tokens) go to a decode worker alone: a
    /// transfer of their KV cache costs more than prefilling them there.
    pub min_prompt_tokens: u64,
    /// Conditional disaggregation: a request whose decode worker already holds
    /// all but at most this many of its prompt tokens is prefilled there,
    /// without a prefill leg.
    pub max_local_prefill_tokens: u64,
    /// Largest prefill leg response read (vLLM convention), in bytes: the
    /// router parses it for `kv_transfer_params`.
    pub max_prefill_response_bytes: usize,
}

impl Default for DisaggregationConfig {
    fn default() -> Self {
        Self {
            min_prompt_tokens: 512,
            max_local_prefill_tokens: 256,
            max_prefill_response_bytes: 1 << 20,
        }
    }
}

/// A worker's part in prefill/decode disaggregation (`Register.role`).
#[derive(Clone, Copy, Debug, Default, Deserialize, Serialize, PartialEq, Eq, Hash)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    /// Serves whole requests.
    #[default]
    Aggregated,
    /// Computes prompts' KV caches and hands them to decode workers.
    Prefill,
    /// Generates from KV caches handed over by prefill workers (or computes
    /// short prompts itself).
    Decode,
}

impl Role {
    pub const ALL: [Role; 3] = [Role::Aggregated, Role::Prefill, Role::Decode];

    pub fn as_str(self) -> &'static str {
        match self {
            Role::Aggregated => "aggregated",
            Role::Prefill => "prefill",
            Role::Decode => "decode",
        }
    }
}

impl std::str::FromStr for Role {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Role::deserialize(serde::de::value::StrDeserializer::<serde::de::value::Error>::new(s))
            .map_err(|e| e.to_string())
    }
}

/// How a prefill worker hands its KV cache to a decode worker (`Register.pd_convention`).
#[derive(Clone, Copy, Debug, Deserialize, Serialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum PdConvention {
    /// Bootstrap host, port and room in both legs' bodies, sent at once.
    Sglang,
    /// The prefill leg returns `kv_transfer_params`; the decode leg carries them.
    Vllm,
}

impl PdConvention {
    pub fn as_str(self) -> &'static str {
        match self {
            PdConvention::Sglang => "sglang",
            PdConvention::Vllm => "vllm",
        }
    }
}

impl std::str::FromStr for PdConvention {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        PdConvention::deserialize(
            serde::de::value::StrDeserializer::<serde::de::value::Error>::new(s),
        )
        .map_err(|e| e.to_string())
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
    #[serde(default)]
    pub role: Role,
    /// A prefill worker's handoff convention.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pd_convention: Option<PdConvention>,
    /// A prefill worker's bootstrap server port (SGLang convention).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bootstrap_port: Option<u16>,
}

impl StaticWorker {
    pub fn pd(&self) -> PdRole {
        PdRole {
            role: self.role,
            convention: self.pd_convention,
            bootstrap_port: self.bootstrap_port,
        }
    }
}

/// A worker's part in prefill/decode disaggregation, as it registered.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PdRole {
    pub role: Role,
    /// How a prefill worker hands over its KV cache.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub convention: Option<PdConvention>,
    /// A prefill worker's bootstrap server port, on its base URL's host (SGLang).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bootstrap_port: Option<u16>,
}

impl PdRole {
    pub fn is_aggregated(&self) -> bool {
        *self == PdRole::default()
    }

    /// What a prefill worker must declare for the router to hand its KV cache on.
    pub fn check(&self) -> Result<(), String> {
        match (self.role, self.convention, self.bootstrap_port) {
            (Role::Prefill, None, _) => {
                Err("a prefill worker must declare its pd_convention (sglang or vllm)".into())
            }
            (Role::Prefill, Some(PdConvention::Sglang), None | Some(0)) => Err(
                "a prefill worker of the sglang convention must declare its bootstrap_port".into(),
            ),
            _ => Ok(()),
        }
    }
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
            trust: TrustConfig::default(),
            tokenizer: TokenizerSpecs::default(),
            allow_tokenizer_mismatch: false,
            tokenizer_cache_tokens: kvroute_tokenize::DEFAULT_CACHE_TOKENS,
            tokenize_threads: 0,
            index: IndexConfig::default(),
            limits: LimitsConfig::default(),
            tls: TlsConfig::default(),
            cluster: ClusterConfig::default(),
            epp: EppConfig::default(),
            responses: ResponsesConfig::default(),
            sessions: SessionsConfig::default(),
            disaggregation: DisaggregationConfig::default(),
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
            // A dump costs about 16 bytes a block held: 16 Mi blocks per
            // worker, 64 Mi over the fleet at once.
            dump_parts_bytes_per_worker: 256 << 20,
            dump_parts_bytes: 1 << 30,
            idle_connection_timeout_ms: 60_000,
        }
    }
}

impl Default for IndexConfig {
    fn default() -> Self {
        // 32 Mi entries, about 2.5 GiB of heap at ~75–85 bytes per entry with the
        // eviction order (docs/measurements/index-vs-dynamo.md): 160 engines holding
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
            // Half of the whole: a leaked token leaves room for the others.
            max_workers_per_token: 2048,
            max_streams: 4096,
            max_streams_per_token: 2048,
            allowed_base_url_addresses: Vec::new(),
            max_events_per_batch: 65_536,
            max_grpc_message_bytes: 16 << 20,
            max_predicted_blocks_per_request: 16_384,
            max_inflight_requests: 8192,
            max_chat_parts: 4096,
            max_chat_images: 256,
            // About 100 bytes each: 50 MB.
            max_response_owners: 500_000,
            max_session_bindings: 100_000,
            max_session_id_bytes: 256,
            // Behind a load balancer every client shares its few addresses:
            // a peer may hold a quarter of the port.
            max_http_connections: 16_384,
            max_http_connections_per_peer: 4096,
            // Workers hold one connection each (limits.max_streams), those of
            // one host share its address.
            max_grpc_connections: 8192,
            max_grpc_connections_per_peer: 512,
            // Longer than load balancers keep idle connections to a backend
            // (60 s for most): the balancer, not the router, closes them,
            // so no request is sent on a connection the router is closing.
            header_read_timeout_ms: 75_000,
            body_read_timeout_ms: 30_000,
            min_body_bytes_per_s: 16_384,
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
            api_key: Secret::default(),
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
        self.sessions.header()?;
        let sessions = &self.sessions;
        if !(sessions.max_load_ratio.is_finite() && sessions.max_load_ratio >= 1.0) {
            return fail(format!(
                "sessions.max_load_ratio must be ≥ 1, got {}",
                sessions.max_load_ratio
            ));
        }
        if !(1..=MAX_DURATION_MS / 1000).contains(&sessions.ttl_s) {
            return fail(format!(
                "sessions.ttl_s must be in 1..={}, got {}",
                MAX_DURATION_MS / 1000,
                sessions.ttl_s
            ));
        }
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
            ("max_workers_per_token", l.max_workers_per_token),
            ("max_streams", l.max_streams),
            ("max_streams_per_token", l.max_streams_per_token),
            ("max_events_per_batch", l.max_events_per_batch),
            ("max_grpc_message_bytes", l.max_grpc_message_bytes),
            ("max_inflight_requests", l.max_inflight_requests),
            ("max_chat_parts", l.max_chat_parts),
            ("max_chat_images", l.max_chat_images),
            ("max_response_owners", l.max_response_owners),
            ("max_session_bindings", l.max_session_bindings),
            ("max_session_id_bytes", l.max_session_id_bytes),
            ("max_http_connections", l.max_http_connections),
            (
                "max_http_connections_per_peer",
                l.max_http_connections_per_peer,
            ),
            ("max_grpc_connections", l.max_grpc_connections),
            (
                "max_grpc_connections_per_peer",
                l.max_grpc_connections_per_peer,
            ),
            ("min_body_bytes_per_s", l.min_body_bytes_per_s as usize),
            (
                "max_predicted_blocks_per_request",
                l.max_predicted_blocks_per_request,
            ),
        ] {
            if value == 0 {
                return fail(format!("limits.{name} must be at least 1"));
            }
        }
        if self.disaggregation.max_prefill_response_bytes == 0 {
            return fail("disaggregation.max_prefill_response_bytes must be at least 1".into());
        }
        if self.index.max_blocks == 0 {
            return fail("index.max_blocks must be at least 1".into());
        }
        if self.index.max_offload_blocks == 0 {
            return fail("index.max_offload_blocks must be at least 1".into());
        }
        if self.index.test_faults && !cfg!(feature = "test-hooks") {
            return fail(
                "index.test_faults = true needs a build with the `test-hooks` feature (the \
                 tests'); this kvroute has no test hooks"
                    .into(),
            );
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
        let i = &self.ingest;
        if !(1..=i.dump_parts_bytes).contains(&i.dump_parts_bytes_per_worker)
            || i.dump_parts_bytes > u32::MAX as usize
        {
            return fail(format!(
                "ingest.dump_parts_bytes_per_worker ({}) must be at least 1 and at most \
                 ingest.dump_parts_bytes ({}), which must be below 4 GiB",
                i.dump_parts_bytes_per_worker, i.dump_parts_bytes
            ));
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
        for (name, ms) in [
            ("limits.header_read_timeout_ms", l.header_read_timeout_ms),
            ("limits.body_read_timeout_ms", l.body_read_timeout_ms),
            (
                "ingest.idle_connection_timeout_ms",
                self.ingest.idle_connection_timeout_ms,
            ),
        ] {
            if !(1..=MAX_TIMEOUT_MS).contains(&ms) {
                return fail(format!("{name} must be in 1..={MAX_TIMEOUT_MS}, got {ms}"));
            }
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
        let t = &self.trust;
        if !(1..=64).contains(&t.claim_window) {
            return fail(format!(
                "trust.claim_window must be in 1..=64, got {}",
                t.claim_window
            ));
        }
        if !(1..=t.claim_window).contains(&t.max_failed_claims) {
            return fail(format!(
                "trust.max_failed_claims must be in 1..=trust.claim_window ({}), got {}",
                t.claim_window, t.max_failed_claims
            ));
        }
        if !(t.min_cached_share > 0.0 && t.min_cached_share <= 1.0) {
            return fail(format!(
                "trust.min_cached_share must be in (0, 1], got {}",
                t.min_cached_share
            ));
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
            if let Err(e) =
                crate::http::worker_url::parse_base_url(&w.base_url, &l.allowed_base_url_addresses)
            {
                return fail(format!("workers: id {}: {e}", w.id));
            }
            if w.models.is_empty() {
                return fail(format!("workers: id {} serves no model", w.id));
            }
            if w.dp_ranks.is_empty() {
                return fail(format!("workers: id {} has no dp rank", w.id));
            }
            if let Err(e) = w.pd().check() {
                return fail(format!("workers: id {}: {e}", w.id));
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
            (
                "responses.owner_ttl_s (in ms)",
                self.responses.owner_ttl_s.saturating_mul(1000),
            ),
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
    fn the_tokenizer_is_one_spec_a_list_of_them_or_none() {
        let load = |text: &str| {
            let file = std::env::temp_dir().join(format!(
                "kvroute-tokenizers-{}-{}.toml",
                std::process::id(),
                text.len()
            ));
            std::fs::write(&file, text).unwrap();
            let config = Config::load(Some(&file), Vec::new());
            std::fs::remove_file(&file).unwrap();
            config
        };
        let one = load("tokenizer = \"tiktoken:cl100k_base\"\n").unwrap();
        assert_eq!(one.tokenizer.0, ["tiktoken:cl100k_base".parse().unwrap()]);
        let list = "tokenizer = [\"tiktoken:cl100k_base\", \"hf:/models/llama\"]\n";
        let two = load(list).unwrap();
        assert_eq!(two.tokenizer.0.len(), 2);
        assert_eq!(
            two.tokenizer.to_string(),
            "tiktoken:cl100k_base, hf:/models/llama"
        );
        assert!(
            load("tokenizer = \"none\"\n")
                .unwrap()
                .tokenizer
                .0
                .is_empty()
        );
        assert!(load("tokenizer = []\n").unwrap().tokenizer.0.is_empty());
        let err = load("tokenizer = [\"none\", \"tiktoken:o200k_base\"]\n").unwrap_err();
        assert!(
            err.to_string().contains("\"none\" cannot be listed"),
            "{err}"
        );
        let err = load("tokenizer = [\"tiktoken:gpt2\"]\n").unwrap_err();
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
    fn claim_thresholds_are_checked() {
        let trust = |window: &str, failed: &str, share: &str| {
            Config::load(
                None,
                env(&[
                    ("KVROUTE_TRUST__CLAIM_WINDOW", window),
                    ("KVROUTE_TRUST__MAX_FAILED_CLAIMS", failed),
                    ("KVROUTE_TRUST__MIN_CACHED_SHARE", share),
                ]),
            )
        };
        assert_eq!(trust("4", "3", "1.0").unwrap().trust.max_failed_claims, 3);
        for (bad, expected) in [
            (("0", "1", "0.5"), "claim_window"),
            (("65", "1", "0.5"), "claim_window"),
            (("4", "0", "0.5"), "max_failed_claims"),
            (("4", "5", "0.5"), "max_failed_claims"),
            (("4", "2", "0.0"), "min_cached_share"),
            (("4", "2", "nan"), "min_cached_share"),
        ] {
            let err = trust(bad.0, bad.1, bad.2).unwrap_err().to_string();
            assert!(err.contains(expected), "{bad:?}: {err}");
        }
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
    fn test_faults_load_only_in_a_build_with_the_test_hooks() {
        let loaded = Config::load(None, env(&[("KVROUTE_INDEX__TEST_FAULTS", "true")]));
        if cfg!(feature = "test-hooks") {
            assert!(loaded.unwrap().index.test_faults);
        } else {
            let err = loaded.unwrap_err();
            assert!(err.to_string().contains("index.test_faults"), "{err}");
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
