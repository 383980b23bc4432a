//! The router's one configuration struct.
//!
//! Layers, later ones winning: built-in defaults, a TOML file (`--config`),
//! `KVROUTE_...` environment variables, then command-line flags (applied by the
//! binary). `config/router.toml` documents every option and its default. Unknown
//! keys are errors, so a typo fails at start instead of silently doing nothing.
//!
//! Environment variables name a key by its path in upper case, sections joined
//! with a double underscore: `KVROUTE_HTTP_ADDR`, `KVROUTE_SCHEDULER__POLICY`.
//! Values are read as TOML (`16`, `true`, `["a"]`) and otherwise as strings.

use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use serde::Deserialize;

use crate::error::RouterError;

#[derive(Clone, Debug, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Config {
    /// OpenAI-compatible API, admin endpoints, health and metrics.
    pub http_addr: SocketAddr,
    /// gRPC ingest (worker event streams) and the `Route` RPC.
    pub grpc_addr: SocketAddr,
    /// Tokens per KV block; workers registering another size are refused.
    pub block_size: u32,
    /// Bearer token required on gRPC and `/workers` endpoints; empty: none.
    pub auth_token: String,
    /// Largest request body accepted, in bytes.
    pub body_limit_bytes: usize,
    pub log: LogConfig,
    pub scheduler: SchedulerConfig,
    pub ingest: IngestConfig,
    pub upstream: UpstreamConfig,
    pub tokenizer: TokenizerConfig,
    /// Workers without an event stream, routed on predicted entries alone.
    pub workers: Vec<StaticWorker>,
}

#[derive(Clone, Debug, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct LogConfig {
    /// `text` or `json`.
    pub format: LogFormat,
    /// A tracing-subscriber filter, e.g. `info` or `kvroute_router=debug`.
    pub level: String,
}

#[derive(Clone, Copy, Debug, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum LogFormat {
    Text,
    Json,
}

#[derive(Clone, Copy, Debug, Deserialize, PartialEq, Eq)]
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

#[derive(Clone, Debug, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SchedulerConfig {
    pub policy: Policy,
    /// Weight of prefill blocks against decode blocks in the `kv` cost.
    /// Dynamo's default is 1; 32 is measured here: on the Mooncake conversation
    /// trace it hits more of the cache with lower TTFT and the same fairness (README).
    pub overlap_weight: f64,
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
    /// How long a routed prefix counts as cached on a chosen worker that
    /// publishes no events (static workers; every worker under `approx`).
    pub predicted_ttl_ms: u64,
    /// The same for a worker that publishes events: only until its `Stored`
    /// events can have arrived. After that its events are the truth, and a
    /// prediction could only be stale (it never hears of evictions).
    pub predicted_bridge_ms: u64,
    /// Most (worker, block) predicted entries kept.
    pub predicted_max_blocks: usize,
}

#[derive(Clone, Debug, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct IngestConfig {
    /// How long a disconnected worker's index entries are kept for a reconnect.
    pub grace_period_ms: u64,
    /// Event batches buffered per worker stream before the router drops and resyncs.
    pub event_queue_batches: usize,
}

#[derive(Clone, Debug, Deserialize)]
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
}

/// How text prompts and chat messages become token ids.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TokenizerConfig {
    /// `none` (text is routed on load alone), `huggingface` or `tiktoken`.
    pub kind: TokenizerKind,
    /// For `huggingface`: a `tokenizer.json` or the directory holding it.
    pub path: String,
    /// For `tiktoken`: `cl100k_base` or `o200k_base`.
    pub encoding: String,
}

#[derive(Clone, Copy, Debug, Default, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum TokenizerKind {
    #[default]
    None,
    Huggingface,
    Tiktoken,
}

#[derive(Clone, Debug, Deserialize)]
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
            auth_token: String::new(),
            body_limit_bytes: 8 << 20,
            log: LogConfig::default(),
            scheduler: SchedulerConfig::default(),
            ingest: IngestConfig::default(),
            upstream: UpstreamConfig::default(),
            tokenizer: TokenizerConfig::default(),
            workers: Vec::new(),
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
            overlap_weight: 32.0,
            temperature: 0.0,
            busy_max_inflight: 0,
            busy_kv_ratio: 1.0,
            queue_timeout_ms: 2_000,
            max_queued: 1024,
            predicted_ttl_ms: 120_000,
            predicted_bridge_ms: 10_000,
            predicted_max_blocks: 1 << 20,
        }
    }
}

impl Default for IngestConfig {
    fn default() -> Self {
        Self {
            grace_period_ms: 30_000,
            event_queue_batches: 1024,
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
        }
    }
}

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
        for (name, value) in env {
            let Some(key) = name.strip_prefix("KVROUTE_") else {
                continue;
            };
            // The config file's own path is not a config key.
            if key == "CONFIG" {
                continue;
            }
            set_path(&mut table, &key.to_ascii_lowercase(), &value)
                .map_err(|e| RouterError::Config(format!("environment variable {name}: {e}")))?;
        }
        let origin = path.map_or("configuration".to_string(), |p| p.display().to_string());
        let config: Config = toml::Value::Table(table)
            .try_into()
            .map_err(|e: toml::de::Error| RouterError::Config(format!("{origin}: {e}")))?;
        // Say where the bad value came from (the file's errors above name it too).
        config.validate().map_err(|e| match e {
            RouterError::Config(problem) => RouterError::Config(format!("{origin}: {problem}")),
            other => other,
        })?;
        Ok(config)
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
        let s = &self.scheduler;
        if !(s.overlap_weight.is_finite() && s.overlap_weight >= 0.0) {
            return fail(format!(
                "scheduler.overlap_weight must be ≥ 0, got {}",
                s.overlap_weight
            ));
        }
        if !(s.temperature.is_finite() && s.temperature >= 0.0) {
            return fail(format!(
                "scheduler.temperature must be ≥ 0, got {}",
                s.temperature
            ));
        }
        if !(s.busy_kv_ratio > 0.0 && s.busy_kv_ratio <= 1.0) {
            return fail(format!(
                "scheduler.busy_kv_ratio must be in (0, 1], got {}",
                s.busy_kv_ratio
            ));
        }
        if self.ingest.event_queue_batches == 0 {
            return fail("ingest.event_queue_batches must be at least 1".into());
        }
        if self.upstream.breaker_failures == 0 {
            return fail("upstream.breaker_failures must be at least 1".into());
        }
        match self.tokenizer.kind {
            TokenizerKind::Huggingface if self.tokenizer.path.is_empty() => {
                return fail("tokenizer.path is required for kind = \"huggingface\"".into());
            }
            TokenizerKind::Tiktoken if self.tokenizer.encoding.is_empty() => {
                return fail("tokenizer.encoding is required for kind = \"tiktoken\"".into());
            }
            _ => {}
        }
        let mut ids = std::collections::HashSet::new();
        for w in &self.workers {
            if !ids.insert(w.id) {
                return fail(format!("workers: id {} is listed twice", w.id));
            }
            if let Err(e) = crate::registry::parse_base_url(&w.base_url) {
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

/// Sets `a__b__c` in `table` to `value`, read as TOML when it parses as a value.
fn set_path(table: &mut toml::Table, key: &str, value: &str) -> Result<(), String> {
    let mut parts: Vec<&str> = key.split("__").collect();
    let last = parts.pop().filter(|k| !k.is_empty()).ok_or("empty key")?;
    let mut node = table;
    for part in parts {
        node = node
            .entry(part.to_string())
            .or_insert_with(|| toml::Value::Table(toml::Table::new()))
            .as_table_mut()
            .ok_or_else(|| format!("{part} is not a section"))?;
    }
    let parsed = format!("v = {value}")
        .parse::<toml::Table>()
        .ok()
        .and_then(|mut t| t.remove("v"))
        .unwrap_or_else(|| toml::Value::String(value.to_string()));
    node.insert(last.to_string(), parsed);
    Ok(())
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
                ("KVROUTE_AUTH_TOKEN", "s3cret"),
                ("OTHER", "ignored"),
            ]),
        )
        .unwrap();
        assert_eq!(config.block_size, 32);
        assert_eq!(config.scheduler.policy, Policy::RoundRobin);
        assert_eq!(config.auth_token, "s3cret");
    }

    #[test]
    fn unknown_keys_and_bad_values_are_clear_errors() {
        let err = Config::load(None, env(&[("KVROUTE_SCHEDULER__POLICYY", "kv")])).unwrap_err();
        assert!(err.to_string().contains("policyy"), "{err}");
        let err = Config::load(None, env(&[("KVROUTE_BLOCK_SIZE", "0")])).unwrap_err();
        assert!(err.to_string().contains("block_size"), "{err}");
        let err = Config::load(None, env(&[("KVROUTE_SCHEDULER__POLICY", "best")])).unwrap_err();
        assert!(err.to_string().contains("unknown variant"), "{err}");
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
    }
}
