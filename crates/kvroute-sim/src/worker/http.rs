//! The worker's OpenAI-compatible HTTP server, its metrics, and its admin
//! endpoint for faults.
//!
//! Prompts are tokenized with `kvroute-tokenize`, the crate the router uses,
//! so a text prompt hashes to the same blocks on both sides. The generated
//! text is filler, one word per token, but token counts, cached-token counts
//! and timing are the engine's.
//!
//! - `POST /v1/completions`, `POST /v1/chat/completions`: `cache_salt` and a
//!   chat's `image_url` parts key the prompt's blocks as vLLM and the router
//!   key them (see `kvroute_index::hash`); `stream: true` for
//!   SSE (a final usage chunk when `stream_options.include_usage` is set);
//!   `usage.prompt_tokens_details.cached_tokens` reports the prefix hit.
//! - `GET /metrics` (Prometheus text), and the endpoints of the engine's
//!   persona (see [`crate::worker::persona`]): `/health`, `/v1/models`, ...
//! - Validated as the engines validate: `stream_options` without `stream`,
//!   or both `max_tokens` and `max_completion_tokens`, is a 400 in the
//!   persona's error shape.
//! - Prefill and decode legs of a disaggregated fleet: see [`crate::worker::pd`].
//! - `POST /admin/fault` with `{"fault": "stop_events" | "resume_events" |
//!   "drop_events" | "restart" | "die", "count": N}` (count for drop_events).
//! - `POST /admin/eviction` with `{"policy": NAME}` switches the eviction
//!   policy while the engine runs (no restart, no cached block lost, no
//!   event); `GET /admin/eviction` gives the current policy, each policy's
//!   figures (see [`crate::eviction`]) and the per-class counters. Like
//!   `/admin/fault`, these have no token: the simulator is a test fixture.
//! - A request's `priority_class` (0 low, 1 normal, 2 high; default 1) is its
//!   class under the `qos` eviction policy; the router forwards the body as is.
//! - The OpenAI Responses API ([`responses`]), the Anthropic Messages API
//!   ([`messages`]) and vLLM's endpoints without KV cache ([`passthrough`]).

pub mod messages;
pub mod passthrough;
pub mod responses;

use std::convert::Infallible;
use std::fmt::Write as _;
use std::sync::{Arc, OnceLock};
use std::time::{SystemTime, UNIX_EPOCH};

use axum::Json;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::serve::ListenerExt;
use futures_util::StreamExt;
use kvroute_cache::{PolicyKind, Priority};
use kvroute_index::ExtraKeys;
use kvroute_proto::TokenizerInfo;
use kvroute_tokenize::{Prompt, Tokenizer, TokenizerSpec, parse_completion_prompt};
use serde_json::{Value, json};
use tokio::net::TcpListener;
use tokio::sync::mpsc;

use crate::SimError;
use crate::engine::{Emitted, Handoff, SeqId};
use crate::worker::pd::{LeaseKey, Leg, PdConvention};
use crate::worker::persona::Persona;
use crate::worker::{Fault, Shared, inject};

/// The tokenizer, loaded on the first text prompt (token-id traffic never pays for it).
pub(crate) struct SharedTokenizer {
    spec: TokenizerSpec,
    loaded: OnceLock<Result<Tokenizer, String>>,
}

impl SharedTokenizer {
    pub fn new(spec: TokenizerSpec) -> Self {
        SharedTokenizer {
            spec,
            loaded: OnceLock::new(),
        }
    }

    /// The tokenizer as declared to the router at registration; `None` (and a
    /// warning) when it does not load, since then it cannot be fingerprinted.
    pub fn declaration(&self) -> Option<TokenizerInfo> {
        if self.spec == TokenizerSpec::None {
            return Some(TokenizerInfo {
                spec: self.spec.to_string(),
                fingerprint: String::new(),
            });
        }
        match self.get() {
            Ok(tokenizer) => Some(TokenizerInfo {
                spec: self.spec.to_string(),
                fingerprint: tokenizer.fingerprint().to_string(),
            }),
            Err(e) => {
                tracing::warn!("{}: the router cannot check it", e.message);
                None
            }
        }
    }

    pub fn get(&self) -> Result<&Tokenizer, ApiError> {
        self.loaded
            .get_or_init(|| Tokenizer::load(&self.spec).map_err(|e| e.to_string()))
            .as_ref()
            .map_err(|e| ApiError::server(format!("tokenizer {}: {e}", self.spec)))
    }
}

pub(crate) async fn serve(shared: Arc<Shared>, listener: TcpListener) {
    let app = axum::Router::new()
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/responses", post(responses::create))
        .route(
            "/v1/responses/{id}",
            get(responses::retrieve).delete(responses::delete),
        )
        .route("/v1/responses/{id}/cancel", post(responses::cancel))
        .route("/v1/messages", post(messages::create))
        .route("/v1/messages/count_tokens", post(messages::count_tokens))
        .route("/v1/embeddings", post(passthrough::embeddings))
        .route("/v1/rerank", post(passthrough::rerank))
        .route("/v1/score", post(passthrough::score))
        .route("/tokenize", post(passthrough::tokenize))
        .route("/detokenize", post(passthrough::detokenize))
        .merge(shared.config.persona.routes())
        .route("/metrics", get(metrics))
        .route("/admin/fault", post(fault))
        .route("/admin/eviction", get(eviction_stats).post(switch_eviction))
        .fallback(|| async { ApiError::new(StatusCode::NOT_FOUND, "no such endpoint") })
        .with_state(Arc::clone(&shared));
    let mut stopped = shared.stop.subscribe();
    // On `die` the server future is dropped, which closes the listener and
    // every open connection at once, as a crashed process would.
    // Small SSE chunks must not wait for Nagle's algorithm (see the router's server).
    let listener = listener.tap_io(|tcp| {
        let _ = tcp.set_nodelay(true);
    });
    let serve = async {
        match shared.config.http_tls.clone() {
            None => axum::serve(listener, app).await,
            Some(config) => {
                let listener = kvroute_tls::TlsListener::new(
                    listener,
                    config,
                    kvroute_tls::Serves::Http,
                    |_| {},
                );
                axum::serve(listener, app).await
            }
        }
    };
    tokio::select! {
        result = serve => {
            if let Err(e) = result {
                tracing::error!("worker http server failed: {e}");
            }
        }
        _ = crate::worker::until_stopped(&mut stopped) => {}
    }
}

/// An OpenAI-style error response.
pub(crate) struct ApiError {
    pub status: StatusCode,
    pub message: String,
}

impl ApiError {
    pub fn new(status: StatusCode, message: impl Into<String>) -> Self {
        ApiError {
            status,
            message: message.into(),
        }
    }

    pub fn bad(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, message)
    }

    pub fn server(message: impl Into<String>) -> Self {
        Self::new(StatusCode::INTERNAL_SERVER_ERROR, message)
    }
}

impl From<SimError> for ApiError {
    fn from(e: SimError) -> Self {
        match e {
            SimError::BadRequest(_) | SimError::Tokenize(_) => Self::bad(e.to_string()),
            SimError::Stopped => Self::new(StatusCode::SERVICE_UNAVAILABLE, e.to_string()),
            _ => Self::server(e.to_string()),
        }
    }
}

impl ApiError {
    /// The error in `persona`'s shape.
    fn render(self, persona: Persona) -> Response {
        let body = persona.error_body(self.status, &self.message);
        (self.status, Json(body)).into_response()
    }
}

impl IntoResponse for ApiError {
    /// The admin endpoints' errors, in vLLM's shape.
    fn into_response(self) -> Response {
        self.render(Persona::Vllm)
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    Completion,
    Chat,
}

/// What a request asks for, once its prompt is tokens.
struct Parsed {
    model: String,
    tokens: Vec<u32>,
    /// What keys the prompt's blocks besides their tokens (`cache_salt`).
    extra: ExtraKeys,
    max_tokens: u32,
    stream: bool,
    include_usage: bool,
    priority: Priority,
    /// The whole body, for the handoff fields (see [`crate::worker::pd::leg`]).
    body: Value,
}

fn parse(shared: &Shared, body: &[u8], kind: Kind) -> Result<Parsed, ApiError> {
    let json: Value = serde_json::from_slice(body)
        .map_err(|e| ApiError::bad(format!("the body is not valid JSON: {e}")))?;
    let present = |name: &str| json.get(name).is_some_and(|v| !v.is_null());
    let stream = json.get("stream").and_then(Value::as_bool).unwrap_or(false);
    if present("stream_options") && !stream {
        return Err(ApiError::bad(
            "stream_options can only be defined when stream is true",
        ));
    }
    if present("max_tokens") && present("max_completion_tokens") {
        return Err(ApiError::bad(
            "max_tokens and max_completion_tokens cannot both be set; use max_completion_tokens",
        ));
    }
    let model = served_model(shared, &json)?;
    let mut multimodal = Vec::new();
    let tokens = match kind {
        Kind::Completion => {
            let prompt = json
                .get("prompt")
                .ok_or_else(|| ApiError::bad("missing field `prompt`"))?;
            match parse_completion_prompt(prompt).map_err(|e| ApiError::bad(e.to_string()))? {
                Prompt::Tokens(tokens) => tokens,
                Prompt::Text(text) => shared
                    .tokenizer
                    .get()?
                    .encode(&text)
                    .map_err(|e| ApiError::bad(e.to_string()))?,
            }
        }
        Kind::Chat => {
            let messages = json
                .get("messages")
                .and_then(Value::as_array)
                .ok_or_else(|| ApiError::bad("missing field `messages` (an array)"))?;
            // Images key the blocks they are in, as in vLLM and the router.
            let (tokens, images) = shared
                .tokenizer
                .get()?
                .encode_chat_with_images(messages, true)
                .map_err(|e| ApiError::bad(e.to_string()))?;
            multimodal = images;
            tokens
        }
    };
    let max_tokens = match json
        .get("max_completion_tokens")
        .or_else(|| json.get("max_tokens"))
    {
        None | Some(Value::Null) => 16,
        Some(v) => v
            .as_u64()
            .and_then(|n| u32::try_from(n).ok())
            .filter(|&n| n > 0)
            .ok_or_else(|| ApiError::bad("max_tokens must be a positive integer"))?,
    };
    Ok(Parsed {
        priority: priority(&json)?,
        model: model.to_string(),
        tokens,
        extra: ExtraKeys {
            cache_salt: cache_salt(&json)?,
            multimodal,
        },
        max_tokens,
        stream,
        include_usage: json
            .pointer("/stream_options/include_usage")
            .and_then(Value::as_bool)
            .unwrap_or(false),
        body: json,
    })
}

/// The request's `model`, if this engine serves it (else 404).
pub(crate) fn served_model<'a>(shared: &Shared, json: &'a Value) -> Result<&'a str, ApiError> {
    let model = json
        .get("model")
        .and_then(Value::as_str)
        .ok_or_else(|| ApiError::bad("missing field `model` (a string)"))?;
    if model != shared.config.model {
        return Err(ApiError::new(
            StatusCode::NOT_FOUND,
            format!(
                "model `{model}` is not served here (serving `{}`)",
                shared.config.model
            ),
        ));
    }
    Ok(model)
}

/// The request's `cache_salt`, which keys its blocks.
pub(crate) fn cache_salt(json: &Value) -> Result<Option<String>, ApiError> {
    match json.get("cache_salt") {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(salt)) => Ok(Some(salt.clone())),
        Some(_) => Err(ApiError::bad("`cache_salt` must be a string")),
    }
}

/// The request's `priority_class`, its class under the `qos` eviction policy.
pub(crate) fn priority(json: &Value) -> Result<Priority, ApiError> {
    match json.get("priority_class") {
        None | Some(Value::Null) => Ok(Priority::Normal),
        Some(v) => v.as_u64().and_then(Priority::from_class).ok_or_else(|| {
            ApiError::bad("`priority_class` must be 0 (low), 1 (normal) or 2 (high)")
        }),
    }
}

async fn completions(State(shared): State<Arc<Shared>>, body: axum::body::Bytes) -> Response {
    let persona = shared.config.persona;
    generate(shared, &body, Kind::Completion)
        .await
        .unwrap_or_else(|e| e.render(persona))
}

async fn chat_completions(State(shared): State<Arc<Shared>>, body: axum::body::Bytes) -> Response {
    let persona = shared.config.persona;
    generate(shared, &body, Kind::Chat)
        .await
        .unwrap_or_else(|e| e.render(persona))
}

/// Aborts the request in the engine if the response is dropped before it finished.
pub(crate) struct AbortGuard {
    pub shared: Arc<Shared>,
    pub id: SeqId,
    pub done: bool,
}

impl Drop for AbortGuard {
    fn drop(&mut self) {
        if !self.done {
            self.shared.abort(self.id);
        }
    }
}

const FILLER: [&str; 8] = [
    " the", " quick", " brown", " fox", " jumps", " over", " a", " dog",
];

pub(crate) fn filler(index: u32) -> &'static str {
    FILLER[index as usize % FILLER.len()]
}

fn usage(last: &Emitted) -> Value {
    json!({
        "prompt_tokens": last.prompt_tokens,
        "completion_tokens": last.generated,
        "total_tokens": last.prompt_tokens + last.generated,
        "prompt_tokens_details": {"cached_tokens": last.cached_tokens},
    })
}

async fn generate(shared: Arc<Shared>, body: &[u8], kind: Kind) -> Result<Response, ApiError> {
    let parsed = parse(&shared, body, kind)?;
    let prefix = if kind == Kind::Chat {
        "chatcmpl"
    } else {
        "cmpl"
    };
    let request_id = format!(
        "{prefix}-{}-{:016x}",
        shared.config.worker_id,
        rand::random::<u64>()
    );
    let pd = &shared.config.pd;
    let (handoff, lease) = match crate::worker::pd::leg(pd, &parsed.body, &request_id) {
        Leg::Whole => (Handoff::default(), None),
        Leg::Prefill(key) => (Handoff::default(), Some(key)),
        Leg::Decode { url, request } => {
            match crate::worker::pd::receive(&shared, &url, &request).await {
                Ok(handoff) => (handoff, None),
                Err(why) if pd.convention == PdConvention::Vllm => {
                    tracing::warn!(
                        worker = shared.config.worker_id,
                        "KV transfer failed, recomputing: {why}"
                    );
                    shared.core().pd.stats.recomputes += 1;
                    (Handoff::default(), None)
                }
                Err(why) => return Err(ApiError::server(format!("KV transfer failed: {why}"))),
            }
        }
    };
    // An SGLang prefill server stops at the first token whatever the body
    // asks: the same body goes to the decode, which generates the rest.
    let max_tokens = match lease {
        Some(LeaseKey::Sglang(_)) => 1,
        _ => parsed.max_tokens,
    };
    let (id, rx) = shared.submit(
        &parsed.tokens,
        max_tokens,
        &parsed.extra,
        parsed.priority,
        handoff,
        lease.clone(),
    )?;
    let guard = AbortGuard {
        shared: Arc::clone(&shared),
        id,
        done: false,
    };
    let created = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let meta = Meta {
        id: request_id,
        created,
        model: parsed.model,
        kind,
    };
    if parsed.stream {
        return Ok(stream_response(meta, rx, guard, parsed.include_usage));
    }
    let request_id = meta.id.clone();
    let mut body = whole_response(meta, rx, guard).await?;
    if let Some(key @ LeaseKey::Vllm(_)) = &lease {
        let block_ids = shared.core().pd.block_ids(key);
        if let Some(block_ids) = block_ids {
            body["kv_transfer_params"] = kv_transfer_params(&shared, &request_id, block_ids);
        }
    }
    Ok(Json(body).into_response())
}

/// What a vLLM prefill returns for its decode leg to pull with.
fn kv_transfer_params(shared: &Shared, request_id: &str, block_ids: Vec<u64>) -> Value {
    let ip = shared.config.http_addr.ip();
    let host = if ip.is_unspecified() {
        "127.0.0.1".to_string()
    } else {
        ip.to_string()
    };
    json!({
        "do_remote_prefill": true,
        "do_remote_decode": false,
        "remote_engine_id": format!("sim-{}", shared.config.worker_id),
        "remote_block_ids": block_ids,
        "remote_host": host,
        "remote_port": shared.bootstrap_port,
        "remote_request_id": request_id,
        "tp_size": 1,
    })
}

struct Meta {
    id: String,
    created: u64,
    model: String,
    kind: Kind,
}

impl Meta {
    fn object(&self, chunk: bool) -> &'static str {
        match (self.kind, chunk) {
            (Kind::Completion, _) => "text_completion",
            (Kind::Chat, false) => "chat.completion",
            (Kind::Chat, true) => "chat.completion.chunk",
        }
    }

    fn choice(&self, text: &str, finish: Option<&str>, chunk: bool) -> Value {
        match self.kind {
            Kind::Completion => json!({"index": 0, "text": text, "finish_reason": finish}),
            Kind::Chat if chunk => {
                json!({"index": 0, "delta": {"content": text}, "finish_reason": finish})
            }
            Kind::Chat => json!({"index": 0, "message": {"role": "assistant", "content": text},
                                 "finish_reason": finish}),
        }
    }

    fn body(&self, choices: Vec<Value>, usage: Option<Value>, chunk: bool) -> Value {
        let mut body = json!({
            "id": self.id, "object": self.object(chunk), "created": self.created,
            "model": self.model, "choices": choices,
        });
        if let Some(usage) = usage {
            body["usage"] = usage;
        }
        body
    }
}

pub(crate) fn ended_early() -> ApiError {
    ApiError::new(
        StatusCode::SERVICE_UNAVAILABLE,
        "the engine dropped the request (restarted or stopped)",
    )
}

/// The whole reply: its text and its last emission (with the usage);
/// `None` if the engine dropped the request first.
pub(crate) async fn reply(
    mut rx: mpsc::UnboundedReceiver<Emitted>,
    mut guard: AbortGuard,
) -> Option<(String, Emitted)> {
    let mut text = String::new();
    loop {
        let emitted = rx.recv().await?;
        text.push_str(filler(emitted.generated - 1));
        if emitted.finished {
            guard.done = true;
            return Some((text, emitted));
        }
    }
}

async fn whole_response(
    meta: Meta,
    rx: mpsc::UnboundedReceiver<Emitted>,
    guard: AbortGuard,
) -> Result<Value, ApiError> {
    let (text, last) = reply(rx, guard).await.ok_or_else(ended_early)?;
    let choice = meta.choice(&text, Some("length"), false);
    Ok(meta.body(vec![choice], Some(usage(&last)), false))
}

fn stream_response(
    meta: Meta,
    rx: mpsc::UnboundedReceiver<Emitted>,
    guard: AbortGuard,
    include_usage: bool,
) -> Response {
    let state = (rx, guard, meta, false);
    let chunks =
        futures_util::stream::unfold(state, move |(mut rx, mut guard, meta, ended)| async move {
            if ended {
                return None;
            }
            // None: the engine dropped the request; the stream ends without [DONE].
            let emitted = rx.recv().await?;
            let finish = emitted.finished.then_some("length");
            let choice = meta.choice(filler(emitted.generated - 1), finish, true);
            let mut events = vec![meta.body(vec![choice], None, true).to_string()];
            if emitted.finished {
                guard.done = true;
                if include_usage {
                    events.push(
                        meta.body(Vec::new(), Some(usage(&emitted)), true)
                            .to_string(),
                    );
                }
                events.push("[DONE]".to_string());
            }
            Some((events, (rx, guard, meta, emitted.finished)))
        });
    let events = chunks
        .map(|events| {
            futures_util::stream::iter(
                events
                    .into_iter()
                    .map(|data| Ok::<_, Infallible>(Event::default().data(data))),
            )
        })
        .flatten();
    Sse::new(events).into_response()
}

async fn fault(
    State(shared): State<Arc<Shared>>,
    body: axum::body::Bytes,
) -> Result<Json<Value>, ApiError> {
    let json = json_body(&body)?;
    let name = json
        .get("fault")
        .and_then(Value::as_str)
        .unwrap_or_default();
    let fault = match name {
        "stop_events" => Fault::StopEvents,
        "resume_events" => Fault::ResumeEvents,
        "drop_events" => Fault::DropEvents(
            json.get("count")
                .and_then(Value::as_u64)
                .filter(|&n| n > 0)
                .ok_or_else(|| ApiError::bad("drop_events needs a positive `count`"))?,
        ),
        "restart" => Fault::Restart,
        "die" => Fault::Die,
        other => {
            return Err(ApiError::bad(format!(
                "unknown fault `{other}` (expected stop_events, resume_events, drop_events, restart or die)"
            )));
        }
    };
    inject(&shared, fault);
    Ok(Json(
        json!({"worker_id": shared.config.worker_id, "fault": name}),
    ))
}

/// An admin request's body as JSON, or a 400 saying why not.
pub(crate) fn json_body(body: &[u8]) -> Result<Value, ApiError> {
    serde_json::from_slice(body)
        .map_err(|e| ApiError::bad(format!("the body is not valid JSON: {e}")))
}

/// Switches the eviction policy: `{"policy": NAME}`.
async fn switch_eviction(
    State(shared): State<Arc<Shared>>,
    body: axum::body::Bytes,
) -> Result<Json<Value>, ApiError> {
    let json = json_body(&body)?;
    let name = json
        .get("policy")
        .and_then(Value::as_str)
        .ok_or_else(|| ApiError::bad("missing field `policy` (a string)"))?;
    let policy: PolicyKind = name
        .parse()
        .map_err(|e: kvroute_cache::CacheError| ApiError::bad(e.to_string()))?;
    if policy.is_bound() {
        return Err(ApiError::bad(format!(
            "`{policy}` is a reference bound, not a policy an engine can run"
        )));
    }
    let (old, cached) = {
        let mut core = shared.core();
        let old = core.engine.set_eviction_policy(policy)?;
        (old, core.engine.load().kv_blocks_cached)
    };
    tracing::info!(worker = shared.config.worker_id, from = %old, to = %policy, cached, "eviction policy switched");
    Ok(Json(json!({
        "worker_id": shared.config.worker_id,
        "from": old.name(),
        "to": policy.name(),
        "cached_blocks": cached,
    })))
}

/// The current policy, each policy's figures, and the per-class counters.
async fn eviction_stats(State(shared): State<Arc<Shared>>) -> Json<Value> {
    let core = shared.core();
    let stats = core.engine.stats();
    let classes: Vec<Value> = Priority::ALL
        .iter()
        .zip(stats.classes)
        .map(|(class, c)| {
            json!({
                "class": class.class(),
                "requests": c.requests,
                "prompt_tokens": c.prompt_tokens,
                "cached_tokens": c.cached_tokens,
            })
        })
        .collect();
    Json(json!({
        "worker_id": shared.config.worker_id,
        "policy": core.engine.eviction_policy().name(),
        "kv_blocks_cached": core.engine.load().kv_blocks_cached,
        "policies": core.engine.eviction_figures(),
        "classes": classes,
    }))
}

async fn metrics(State(shared): State<Arc<Shared>>) -> Response {
    let (stats, load, last_event_id, evictions, pd) = {
        let core = shared.core();
        (
            core.engine.stats(),
            core.engine.load(),
            core.log.last_id(),
            core.engine.evictions(),
            core.pd.stats,
        )
    };
    let hit_ratio = if stats.prompt_tokens == 0 {
        0.0
    } else {
        stats.cached_tokens as f64 / stats.prompt_tokens as f64
    };
    let usage = load.kv_blocks_used as f64 / load.kv_blocks_total.max(1) as f64;
    let worker = shared.config.worker_id;
    let series: [(&str, &str, &str, f64); 21] = [
        (
            "kvroute_sim_requests_total",
            "counter",
            "Requests admitted",
            stats.requests as f64,
        ),
        (
            "kvroute_sim_finished_requests_total",
            "counter",
            "Requests finished",
            stats.finished as f64,
        ),
        (
            "kvroute_sim_aborted_requests_total",
            "counter",
            "Requests aborted by their client",
            stats.aborted as f64,
        ),
        (
            "kvroute_sim_prompt_tokens_total",
            "counter",
            "Prompt tokens of admitted requests",
            stats.prompt_tokens as f64,
        ),
        (
            "kvroute_sim_cached_prompt_tokens_total",
            "counter",
            "Prompt tokens found in the prefix cache",
            stats.cached_tokens as f64,
        ),
        (
            "kvroute_sim_offload_loaded_prompt_tokens_total",
            "counter",
            "Prompt tokens loaded from the host tier (--offload-blocks) instead of prefilled",
            stats.offload_tokens as f64,
        ),
        (
            "kvroute_sim_computed_prompt_tokens_total",
            "counter",
            "Prompt tokens prefilled",
            stats.computed_prompt_tokens as f64,
        ),
        (
            "kvroute_sim_generated_tokens_total",
            "counter",
            "Output tokens generated",
            stats.generated_tokens as f64,
        ),
        (
            "kvroute_sim_preemptions_total",
            "counter",
            "Requests preempted for lack of KV blocks",
            stats.preemptions as f64,
        ),
        (
            "kvroute_sim_evictions_total",
            "counter",
            "Cached blocks evicted",
            evictions as f64,
        ),
        (
            "kvroute_sim_prefix_hit_ratio",
            "gauge",
            "Cached over all prompt tokens since start",
            hit_ratio,
        ),
        (
            "kvroute_sim_running_requests",
            "gauge",
            "Requests in the running batch",
            load.running as f64,
        ),
        (
            "kvroute_sim_waiting_requests",
            "gauge",
            "Requests queued",
            load.waiting as f64,
        ),
        (
            "kvroute_sim_kv_blocks_used",
            "gauge",
            "KV blocks referenced by requests",
            load.kv_blocks_used as f64,
        ),
        (
            "kvroute_sim_kv_blocks_cached",
            "gauge",
            "Inactive KV blocks kept for reuse",
            load.kv_blocks_cached as f64,
        ),
        (
            "kvroute_sim_kv_usage_ratio",
            "gauge",
            "Used over total KV blocks",
            usage,
        ),
        (
            "kvroute_sim_last_event_id",
            "gauge",
            "Id of the last KV event",
            last_event_id as f64,
        ),
        (
            "kvroute_sim_transferred_prompt_tokens_total",
            "counter",
            "Prompt tokens received from prefill engines instead of prefilled",
            stats.transferred_tokens as f64,
        ),
        (
            "kvroute_sim_pd_handoffs_total",
            "counter",
            "Prefill/decode handoffs: leases taken (prefill), KV received (decode)",
            pd.handoffs as f64,
        ),
        (
            "kvroute_sim_pd_lease_expired_blocks_total",
            "counter",
            "Blocks a prefill held for a decode that never took them, freed by lease timeout",
            pd.lease_expired_blocks as f64,
        ),
        (
            "kvroute_sim_pd_recomputes_total",
            "counter",
            "Decode legs computed in full: their KV was unknown, expired or unreachable",
            pd.recomputes as f64,
        ),
    ];
    let mut text = String::new();
    for (name, kind, help, value) in series {
        let _ = writeln!(
            text,
            "# HELP {name} {help}\n# TYPE {name} {kind}\n{name}{{worker=\"{worker}\"}} {value}"
        );
    }
    let config = &shared.config;
    config.persona.metrics(
        &config.model,
        config.engine.block_size,
        &stats,
        &load,
        &mut text,
    );
    (
        [(
            axum::http::header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        text,
    )
        .into_response()
}
