//! Whose HTTP surface an engine shows (`--persona`): what vLLM or SGLang
//! answer on their informational endpoints, in their error shapes and metric
//! names, so that tools built for those engines (the bridge, peer routers)
//! take a simulated engine for a real one.
//!
//! - vLLM: `GET /health` (200, empty), `/version`, `/v1/models` (`owned_by:
//!   "vllm"`), and in `/metrics` `vllm:num_requests_running`,
//!   `vllm:num_requests_waiting`, `vllm:kv_cache_usage_perc` (0..1),
//!   `vllm:cache_config_info` and the prefix-cache counters (in tokens).
//!   Errors: `{"error": {"message", "type", "param", "code"}}`.
//! - SGLang: `GET /health`, `/server_info` (its server arguments, among them
//!   `disaggregation_mode`: "null", "prefill" or "decode", as SGLang spells
//!   them), `/get_model_info`, `/get_load`, `/v1/models` (`owned_by:
//!   "sglang"`), and `sglang:*` load gauges in `/metrics`. Errors:
//!   `{"object": "error", "message", "type", "param", "code"}`.
//!
//! The `kvroute_sim_*` series stay in `/metrics` under both personas.

use std::fmt::Write as _;
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::Json;
use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::get;
use serde_json::{Value, json};

use crate::engine::{EngineStats, Load};
use crate::worker::Shared;
use crate::worker::pd::Role;

/// The version the personas report.
const VLLM_VERSION: &str = "0.11.0";
const SGLANG_VERSION: &str = "0.5.4";

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum Persona {
    #[default]
    Vllm,
    Sglang,
}

impl Persona {
    pub fn owned_by(self) -> &'static str {
        match self {
            Persona::Vllm => "vllm",
            Persona::Sglang => "sglang",
        }
    }

    /// An error body in the engine's own shape.
    pub(crate) fn error_body(self, status: StatusCode, message: &str) -> Value {
        let kind = match status.as_u16() {
            400 => "BadRequestError",
            404 => "NotFoundError",
            503 => "ServiceUnavailableError",
            _ => "InternalServerError",
        };
        let code = status.as_u16();
        match self {
            Persona::Vllm => {
                json!({"error": {"message": message, "type": kind, "param": null, "code": code}})
            }
            Persona::Sglang => json!({
                "object": "error", "message": message, "type": kind, "param": null, "code": code,
            }),
        }
    }

    /// The persona's informational endpoints.
    pub(crate) fn routes(self) -> axum::Router<Arc<Shared>> {
        let router = axum::Router::new()
            .route("/health", get(|| async { StatusCode::OK }))
            .route("/v1/models", get(models));
        match self {
            Persona::Vllm => router.route(
                "/version",
                get(|| async { Json(json!({"version": VLLM_VERSION})) }),
            ),
            Persona::Sglang => router
                .route("/server_info", get(server_info))
                .route("/get_model_info", get(model_info))
                .route("/get_load", get(load)),
        }
    }

    /// The engine's own series, appended to `/metrics`.
    pub(crate) fn metrics(
        self,
        model: &str,
        block_size: usize,
        stats: &EngineStats,
        load: &Load,
        text: &mut String,
    ) {
        let usage = load.kv_blocks_used as f64 / load.kv_blocks_total.max(1) as f64;
        let labels = format!("engine=\"0\",model_name=\"{model}\"");
        let series: Vec<(&str, &str, &str, f64)> = match self {
            Persona::Vllm => vec![
                (
                    "vllm:num_requests_running",
                    "gauge",
                    "Number of requests in model execution batches.",
                    load.running as f64,
                ),
                (
                    "vllm:num_requests_waiting",
                    "gauge",
                    "Number of requests waiting to be processed.",
                    load.waiting as f64,
                ),
                (
                    "vllm:kv_cache_usage_perc",
                    "gauge",
                    "KV-cache usage. 1 means 100 percent usage.",
                    usage,
                ),
                (
                    "vllm:prefix_cache_queries_total",
                    "counter",
                    "Prefix cache queries, in terms of number of queried tokens.",
                    stats.prompt_tokens as f64,
                ),
                (
                    "vllm:prefix_cache_hits_total",
                    "counter",
                    "Prefix cache hits, in terms of number of cached tokens.",
                    stats.cached_tokens as f64,
                ),
            ],
            Persona::Sglang => vec![
                (
                    "sglang:num_running_reqs",
                    "gauge",
                    "The number of running requests.",
                    load.running as f64,
                ),
                (
                    "sglang:num_queue_reqs",
                    "gauge",
                    "The number of requests in the waiting queue.",
                    load.waiting as f64,
                ),
                ("sglang:token_usage", "gauge", "The token usage.", usage),
                (
                    "sglang:cache_hit_rate",
                    "gauge",
                    "The prefix cache hit rate.",
                    hit_rate(stats),
                ),
            ],
        };
        for (name, kind, help, value) in series {
            let _ = writeln!(
                text,
                "# HELP {name} {help}\n# TYPE {name} {kind}\n{name}{{{labels}}} {value}"
            );
        }
        let (name, help, value, extra) = match self {
            Persona::Vllm => (
                "vllm:cache_config_info",
                "Information of the LLMEngine CacheConfig",
                1.0,
                format!(
                    ",block_size=\"{}\",num_gpu_blocks=\"{}\"",
                    block_size, load.kv_blocks_total
                ),
            ),
            Persona::Sglang => (
                "sglang:max_total_num_tokens",
                "Maximum total number of tokens in the KV cache pool.",
                (load.kv_blocks_total as usize * block_size) as f64,
                String::new(),
            ),
        };
        let _ = writeln!(
            text,
            "# HELP {name} {help}\n# TYPE {name} gauge\n{name}{{{labels}{extra}}} {value}"
        );
    }
}

fn hit_rate(stats: &EngineStats) -> f64 {
    if stats.prompt_tokens == 0 {
        0.0
    } else {
        stats.cached_tokens as f64 / stats.prompt_tokens as f64
    }
}

fn now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

async fn models(State(shared): State<Arc<Shared>>) -> Json<Value> {
    let config = &shared.config;
    let max_model_len = config.engine.kv_blocks * config.engine.block_size;
    Json(json!({"object": "list", "data": [{
        "id": config.model, "object": "model", "created": now(),
        "owned_by": config.persona.owned_by(), "root": config.model, "parent": null,
        "max_model_len": max_model_len,
    }]}))
}

async fn server_info(State(shared): State<Arc<Shared>>) -> Json<Value> {
    let config = &shared.config;
    let load = shared.core().engine.load();
    let mode = match config.pd.role {
        Role::Aggregated => "null",
        Role::Prefill => "prefill",
        Role::Decode => "decode",
    };
    Json(json!({
        "model_path": config.model,
        "tokenizer_path": config.model,
        "served_model_name": config.model,
        "tp_size": 1,
        "dp_size": 1,
        "page_size": config.engine.block_size,
        "max_running_requests": config.engine.max_num_seqs,
        "chunked_prefill_size": config.engine.max_num_batched_tokens,
        "disaggregation_mode": mode,
        "disaggregation_bootstrap_port": shared.bootstrap_port,
        "max_total_num_tokens": load.kv_blocks_total as usize * config.engine.block_size,
        "internal_states": [{"num_running_reqs": load.running}],
        "version": SGLANG_VERSION,
    }))
}

async fn model_info(State(shared): State<Arc<Shared>>) -> Json<Value> {
    let model = &shared.config.model;
    Json(json!({
        "model_path": model,
        "tokenizer_path": model,
        "is_generation": true,
        "preferred_sampling_params": null,
        "weight_version": "default",
    }))
}

async fn load(State(shared): State<Arc<Shared>>) -> Json<Value> {
    let load = shared.core().engine.load();
    let tokens = load.kv_blocks_used as usize * shared.config.engine.block_size;
    Json(json!([{
        "dp_rank": 0,
        "num_reqs": load.running + load.waiting,
        "num_waiting_reqs": load.waiting,
        "num_tokens": tokens,
    }]))
}
