//! The HTTP API: OpenAI-compatible endpoints (parsed here, routed and forwarded
//! by [`crate::http::proxy`]), the dry run, admin endpoints over the registry, health
//! and metrics.

use std::borrow::Cow;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::Router;
use axum::extract::{Path, Request, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use bytes::Bytes;
use http_body::Body as _;
use http_body_util::{BodyExt, LengthLimitError, Limited};
use kvroute_index::ExtraKeys;
use serde::Deserialize;
use serde::de::IgnoredAny;
use serde_json::value::RawValue;
use serde_json::{Value, json};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::error::RouterError;
use crate::http::proxy::Forward;
use crate::limits;
use crate::metrics;
use crate::state::{AppState, RouteInput};
use crate::tokenize::Prompt;

pub use crate::http::proxy::WORKER_HEADER;

/// The HTTP API, every response counted by status ([`metrics::HTTP_RESPONSES`]).
pub fn service(state: Arc<AppState>) -> Router {
    let inflight = Inflight::new(state.config.limits.max_inflight_requests);
    router(state, inflight).layer(middleware::map_response(count_response))
}

async fn count_response(response: Response) -> Response {
    metrics::count_response(response.status().as_u16());
    response
}

/// The endpoints; the proxied ones' other methods get a JSON 405.
fn router(state: Arc<AppState>, inflight: Inflight) -> Router {
    let admin = Router::new()
        .route("/workers", get(list_workers))
        .route("/workers/{id}", get(get_worker).delete(delete_worker))
        .route("/workers/{id}/drain", post(drain_worker));
    #[cfg(feature = "test-hooks")]
    let admin = admin.route("/workers/{id}/drop-events", post(drop_events));
    let admin = admin.route_layer(middleware::from_fn_with_state(
        Arc::clone(&state),
        require_admin,
    ));
    let proxied = |endpoint: Endpoint| {
        let inflight = inflight.clone();
        post(move |State(state), request| proxy(state, inflight.clone(), request, endpoint))
            .fallback(post_only)
    };
    let mut routes = Router::new();
    for endpoint in Endpoint::ALL {
        routes = routes.route(endpoint.path(), proxied(endpoint));
    }
    routes
        .route(
            "/v1/responses/{id}",
            get(response_by_id).delete(response_by_id),
        )
        .route("/v1/responses/{id}/cancel", post(response_by_id))
        .route(
            "/v1/route",
            post(move |State(state), request| dry_run(state, inflight.clone(), request)),
        )
        .route("/v1/models", get(models))
        .route(
            "/healthz",
            get(|| async { axum::Json(json!({"status": "ok"})) }),
        )
        .route("/readyz", get(readyz))
        .route("/metrics", get(render_metrics))
        .merge(admin)
        .fallback(|| async {
            RouterError::BadRequest("no such endpoint".into()).with_status(StatusCode::NOT_FOUND)
        })
        .with_state(state)
}

/// The proxied endpoints' methods other than POST: a JSON 405.
async fn post_only() -> Response {
    let mut response = RouterError::BadRequest("this endpoint takes POST only".into())
        .with_status(StatusCode::METHOD_NOT_ALLOWED);
    response
        .headers_mut()
        .insert(header::ALLOW, header::HeaderValue::from_static("POST"));
    response
}

impl RouterError {
    fn with_status(self, status: StatusCode) -> Response {
        let mut response = self.into_response();
        *response.status_mut() = status;
        response
    }
}

/// The router's requests in flight, against `limits.max_inflight_requests`.
#[derive(Clone)]
struct Inflight {
    permits: Arc<Semaphore>,
    max: usize,
}

impl Inflight {
    fn new(max: usize) -> Self {
        Self {
            permits: Arc::new(Semaphore::new(max)),
            max,
        }
    }

    /// Caps requests in flight across the router, from the arrival of the
    /// whole request body to the end of the response body (the permit goes
    /// with the body): beyond
    /// `limits.max_inflight_requests`, 503 with Retry-After. Not tower's
    /// `ConcurrencyLimit`: it lets its permit go once the response headers are
    /// out, so streams — the long part of a request — would escape it.
    fn admit(&self) -> Result<OwnedSemaphorePermit, RouterError> {
        Arc::clone(&self.permits).try_acquire_owned().map_err(|_| {
            limits::count(limits::INFLIGHT_REQUESTS);
            RouterError::Overloaded(self.max)
        })
    }
}

async fn require_admin(
    State(state): State<Arc<AppState>>,
    request: Request,
    next: Next,
) -> Response {
    if state.credentials.admin_http(request.headers()) {
        next.run(request).await
    } else {
        RouterError::Unauthorized.into_response()
    }
}

/// Which proxied endpoint a body is for.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Endpoint {
    Completions,
    Chat,
    /// OpenAI's Responses API: routed like chat, and to the worker that
    /// stores the response a request continues ([`crate::responses`]).
    Responses,
    /// Anthropic's Messages API: routed like chat, errors in Anthropic's shape.
    Messages,
    /// Anthropic's token counting: routed on load alone.
    CountTokens,
    /// An endpoint passed through to a worker serving the model, routed on
    /// load alone: embeddings, rerank, score, tokenize, detokenize.
    PassThrough(&'static str),
}

impl Endpoint {
    /// Every proxied endpoint.
    const ALL: [Endpoint; 10] = [
        Endpoint::Completions,
        Endpoint::Chat,
        Endpoint::Responses,
        Endpoint::Messages,
        Endpoint::CountTokens,
        Endpoint::PassThrough("/v1/embeddings"),
        Endpoint::PassThrough("/v1/rerank"),
        Endpoint::PassThrough("/v1/score"),
        Endpoint::PassThrough("/tokenize"),
        Endpoint::PassThrough("/detokenize"),
    ];

    /// The endpoint a request's path names, if it is one of the proxied ones.
    pub(crate) fn of_path(path: &str) -> Option<Endpoint> {
        match path {
            "/v1/completions" => Some(Endpoint::Completions),
            "/v1/chat/completions" => Some(Endpoint::Chat),
            _ => Self::ALL[2..].iter().copied().find(|e| e.path() == path),
        }
    }

    fn path(self) -> &'static str {
        match self {
            Endpoint::Completions => "/v1/completions",
            Endpoint::Chat => "/v1/chat/completions",
            Endpoint::Responses => "/v1/responses",
            Endpoint::Messages => "/v1/messages",
            Endpoint::CountTokens => "/v1/messages/count_tokens",
            Endpoint::PassThrough(path) => path,
        }
    }

    /// Whether errors are answered in Anthropic's shape.
    fn anthropic(self) -> bool {
        matches!(self, Endpoint::Messages | Endpoint::CountTokens)
    }
}

/// A parsed request: what to route; the body is forwarded unchanged.
pub(crate) struct Parsed<'a> {
    pub(crate) model: Cow<'a, str>,
    pub(crate) tokens: Vec<u32>,
    /// vLLM's extra keys of the request's blocks (`cache_salt`, images).
    extra: ExtraKeys,
    /// Why a text prompt has no tokens (no tokenizer): it scores no overlap.
    untokenized: Option<&'static str>,
    pub(crate) pin: Option<u64>,
    /// The Responses request's `previous_response_id`.
    follows: Option<Cow<'a, str>>,
    /// The session the request names (`sessions.header`).
    pub(crate) session: Option<String>,
}

impl Parsed<'_> {
    pub(crate) fn route_input(&self) -> RouteInput<'_> {
        RouteInput::Prompt {
            tokens: &self.tokens,
            extra: &self.extra,
        }
    }
}

/// The request's headers and whole body; `arrived`: when its head was read,
/// from which the body's deadline runs.
async fn read_body<B: ClientBody>(
    state: &AppState,
    request: axum::http::Request<B>,
    arrived: Instant,
) -> Result<(HeaderMap, Bytes), RouterError> {
    let (parts, body) = request.into_parts();
    let pace = BodyPace::new(&state.config.limits, arrived);
    let body = whole_body(body, state.config.body_limit_bytes, pace).await?;
    Ok((parts.headers, body))
}

/// How long a client may take over a request body: `limits.body_read_timeout_ms`
/// from its head's arrival, and a second more for every
/// `limits.min_body_bytes_per_s` bytes that came. A client that stalls or
/// trickles is cut; one that keeps sending at the rate is not, however long
/// its body (up to `body_limit_bytes`).
#[derive(Clone, Copy)]
struct BodyPace {
    started: tokio::time::Instant,
    timeout: Duration,
    min_bytes_per_s: u64,
}

impl BodyPace {
    fn new(limits: &crate::config::LimitsConfig, arrived: Instant) -> Self {
        Self {
            started: tokio::time::Instant::from_std(arrived),
            timeout: Duration::from_millis(limits.body_read_timeout_ms),
            min_bytes_per_s: limits.min_body_bytes_per_s,
        }
    }

    /// By when the next bytes must have come, `received` having come.
    fn deadline(&self, received: usize) -> tokio::time::Instant {
        let earned_ms = (received as u64).saturating_mul(1000) / self.min_bytes_per_s;
        // At most a day more, so the deadline never overflows.
        let earned = Duration::from_millis(earned_ms.min(86_400_000));
        self.started + self.timeout + earned
    }

    /// The body's next frame, or the 408 for a client too slow to send it.
    async fn next_frame<B: ClientBody>(
        &self,
        body: &mut Limited<B>,
        received: usize,
    ) -> Result<Option<Result<http_body::Frame<Bytes>, BoxError>>, RouterError> {
        tokio::time::timeout_at(self.deadline(received), body.frame())
            .await
            .map_err(|_| {
                limits::count(limits::BODY_READ_TIMEOUT);
                RouterError::RequestTimeout(format!(
                    "the request body came too slowly: {received} bytes in {} ms \
                     (limits.body_read_timeout_ms, limits.min_body_bytes_per_s)",
                    self.started.elapsed().as_millis()
                ))
            })
    }
}

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// A client's request body: hyper's on the proxied endpoints, axum's on the
/// others.
trait ClientBody:
    http_body::Body<Data = Bytes, Error: Into<Box<dyn std::error::Error + Send + Sync>>> + Unpin
{
}

impl<B> ClientBody for B where
    B: http_body::Body<Data = Bytes, Error: Into<Box<dyn std::error::Error + Send + Sync>>> + Unpin
{
}

/// A request's body, at most `limit` bytes of it, sent at `pace`.
async fn whole_body<B: ClientBody>(
    body: B,
    limit: usize,
    pace: BodyPace,
) -> Result<Bytes, RouterError> {
    let failed = |e: BoxError| {
        if e.downcast_ref::<LengthLimitError>().is_some() {
            RouterError::PayloadTooLarge(limit)
        } else {
            RouterError::BadRequest(format!("cannot read the request body: {e}"))
        }
    };
    let mut body = Limited::new(body, limit);
    // A small body comes whole in its first frame: taken as it is, not
    // copied into a buffer first.
    let first = match pace.next_frame(&mut body, 0).await? {
        None => return Ok(Bytes::new()),
        Some(frame) => frame.map_err(failed)?.into_data().unwrap_or_default(),
    };
    if body.is_end_stream() {
        return Ok(first);
    }
    let mut whole = bytes::BytesMut::from(first);
    while let Some(frame) = pace.next_frame(&mut body, whole.len()).await? {
        // Trailers carry no body bytes.
        if let Ok(data) = frame.map_err(failed)?.into_data() {
            whole.extend_from_slice(&data);
        }
    }
    Ok(whole.freeze())
}

/// The fields of an OpenAI request body that routing needs, borrowing from
/// the body's bytes. The worker gets the original bytes, so every other field
/// (`kv_transfer_params`, `stream_options`, ...) reaches it unchanged: none is
/// read, none is dropped. `prompt` and `messages` are only located here: a
/// completions prompt is read once the endpoint is known to be completions,
/// and chat `messages` on the tokenizing pool if there is a tokenizer.
#[derive(Deserialize)]
struct RequestBody<'a> {
    #[serde(borrow)]
    model: Option<Text<'a>>,
    #[serde(borrow)]
    prompt: Option<&'a RawValue>,
    #[serde(borrow)]
    messages: Option<&'a RawValue>,
    add_generation_prompt: Option<bool>,
    #[serde(borrow)]
    cache_salt: Option<Text<'a>>,
}

/// A string of the body, borrowed unless it has escapes. (Serde borrows a
/// `Cow` only where it is a field's whole type, not inside an `Option`.)
#[derive(Deserialize)]
struct Text<'a>(#[serde(borrow)] Cow<'a, str>);

/// The JSON object `body` as `T`, or the 400 that says what is wrong with it.
fn json_object<'a, T: Deserialize<'a>>(body: &'a [u8]) -> Result<T, RouterError> {
    let invalid_json =
        |e: serde_json::Error| RouterError::BadRequest(format!("the body is not valid JSON: {e}"));
    if body.trim_ascii_start().first() != Some(&b'{') {
        serde_json::from_slice::<IgnoredAny>(body).map_err(invalid_json)?;
        return Err(RouterError::BadRequest(
            "the body must be a JSON object".into(),
        ));
    }
    serde_json::from_slice(body).map_err(|e| {
        if !e.is_data() {
            return invalid_json(e);
        }
        // A field of the wrong shape: read again (only on this error
        // path) to name the field.
        let mut json = serde_json::Deserializer::from_slice(body);
        match serde_path_to_error::deserialize::<_, T>(&mut json) {
            Err(named) => RouterError::BadRequest(format!("invalid request body: {named}")),
            Ok(_) => RouterError::BadRequest(format!("invalid request body: {e}")),
        }
    })
}

/// The fields of a Responses, Messages or passed-through request body that
/// routing reads besides the prompt, which is read on the tokenizing pool.
#[derive(Deserialize)]
struct ApiBody<'a> {
    #[serde(borrow)]
    model: Option<Text<'a>>,
    #[serde(borrow)]
    previous_response_id: Option<Text<'a>>,
    #[serde(borrow)]
    cache_salt: Option<Text<'a>>,
}

impl<'a> RequestBody<'a> {
    fn parse(body: &'a [u8]) -> Result<Self, RouterError> {
        json_object(body)
    }
}

/// A completions `prompt`: text, or an array of token ids.
fn prompt(raw: &RawValue) -> Result<Prompt, RouterError> {
    serde_json::from_str(raw.get())
        .map_err(|e| RouterError::BadRequest(format!("invalid request body: prompt: {e}")))
}

/// What a request's tokens come from.
enum PromptSource {
    /// Token ids the client sent.
    Tokens(Vec<u32>),
    /// A completions prompt's text.
    Text(String),
    /// A chat's `messages`: the JSON array's bytes, a slice of the body.
    Chat {
        messages: Bytes,
        add_generation_prompt: bool,
    },
    /// A Responses or Messages body, whose prompt is made chat messages by
    /// [`kvroute_tokenize::responses_messages`] or
    /// [`kvroute_tokenize::anthropic_messages`].
    Converted { responses: bool, body: Bytes },
    /// No prompt: routed on load alone.
    LoadOnly,
}

/// Parses the JSON body, then turns its prompt into tokens on the tokenizing
/// pool (off the async runtime). `endpoint` None: either kind (dry run).
pub(crate) async fn parse<'a>(
    state: &AppState,
    headers: &HeaderMap,
    body: &'a Bytes,
    endpoint: Option<Endpoint>,
) -> Result<Parsed<'a>, RouterError> {
    let (mut parsed, source) = parse_body(state, headers, body, endpoint)?;
    // Token ids take no tokenizing: no clock reads for them.
    let started =
        (!matches!(source, PromptSource::Tokens(_) | PromptSource::LoadOnly)).then(Instant::now);
    let tokenizer = match source {
        PromptSource::Tokens(_) | PromptSource::LoadOnly => None,
        _ => state.tokenizer.for_name(&state.registry, &parsed.model),
    };
    let tokenized = match (source, tokenizer) {
        (PromptSource::Tokens(tokens), _) => Some((tokens, Vec::new())),
        (PromptSource::LoadOnly, _) => Some((Vec::new(), Vec::new())),
        (_, None) => None,
        (PromptSource::Converted { responses, body }, Some(tokenizer)) => {
            let limits = state.config.limits.clone();
            Some(
                state
                    .tokenizer
                    .run(tokenizer, move |t| {
                        // A body already read as a JSON object: it parses.
                        let body: Value = serde_json::from_slice(&body)
                            .map_err(|e| RouterError::BadRequest(e.to_string()))?;
                        // A follow-up's earlier turns are the engine's: the
                        // router routes it to their worker, not by them.
                        let messages = if responses {
                            kvroute_tokenize::responses_messages(&body, &[])
                        } else {
                            kvroute_tokenize::anthropic_messages(&body)
                        }
                        .map_err(|e| match e {
                            kvroute_tokenize::TokenizeError::InvalidPrompt { message } => {
                                RouterError::BadRequest(message)
                            }
                            e => RouterError::Tokenize(e.to_string()),
                        })?;
                        crate::tokenize::check_chat_size(&messages, &limits)?;
                        t.encode_chat(&messages, true)
                    })
                    .await?,
            )
        }
        (PromptSource::Text(text), Some(tokenizer)) => Some(
            state
                .tokenizer
                .run(tokenizer, move |t| Ok((t.encode(&text)?, Vec::new())))
                .await?,
        ),
        (
            PromptSource::Chat {
                messages,
                add_generation_prompt,
            },
            Some(tokenizer),
        ) => {
            let limits = state.config.limits.clone();
            Some(
                state
                    .tokenizer
                    .run(tokenizer, move |t| {
                        let messages: Vec<Value> =
                            serde_json::from_slice(&messages).map_err(|e| {
                                RouterError::BadRequest(format!("invalid `messages`: {e}"))
                            })?;
                        crate::tokenize::check_chat_size(&messages, &limits)?;
                        t.encode_chat(&messages, add_generation_prompt)
                    })
                    .await?,
            )
        }
    };
    let took = started.map_or(std::time::Duration::ZERO, |started| started.elapsed());
    metrics::record_phase(metrics::Phase::Tokenize, took);
    match tokenized {
        Some((tokens, multimodal)) => {
            parsed.tokens = tokens;
            parsed.extra.multimodal = multimodal;
        }
        None => {
            parsed.untokenized = Some(state.tokenizer.missing_reason());
            ::metrics::counter!(metrics::UNTOKENIZED).increment(1);
        }
    }
    Ok(parsed)
}

/// Everything of a request but its tokens, and what they come from.
fn parse_body<'a>(
    state: &AppState,
    headers: &HeaderMap,
    body: &'a Bytes,
    endpoint: Option<Endpoint>,
) -> Result<(Parsed<'a>, PromptSource), RouterError> {
    let (model, cache_salt, source, follows) = match endpoint {
        None | Some(Endpoint::Completions | Endpoint::Chat) => prompt_body(body, endpoint)?,
        Some(endpoint) => api_body(body, endpoint)?,
    };
    let Text(model) =
        model.ok_or_else(|| RouterError::BadRequest("missing field `model` (a string)".into()))?;
    let pin = match headers.get(crate::http::proxy::WORKER_HEADER_NAME) {
        None => None,
        Some(value) => Some(
            value
                .to_str()
                .ok()
                .and_then(|v| v.trim().parse::<u64>().ok())
                .ok_or_else(|| {
                    RouterError::BadRequest(format!("{WORKER_HEADER} must be a worker id"))
                })?,
        ),
    };
    if pin.is_some() && !state.credentials.may_see_workers(headers) {
        return Err(RouterError::Forbidden(format!(
            "{WORKER_HEADER} needs the admin token (or auth.clients_may_pin = true)"
        )));
    }
    if let Some(id) = pin
        && !state.registry.contains(id)
    {
        return Err(RouterError::UnknownWorker(id.to_string()));
    }
    let parsed = Parsed {
        model,
        tokens: Vec::new(),
        extra: ExtraKeys {
            // vLLM keys a salted request's first block with its salt.
            cache_salt: cache_salt.map(|Text(salt)| salt.into_owned()),
            multimodal: Vec::new(),
        },
        untokenized: None,
        pin,
        follows,
        session: state.sessions.id_of(headers)?,
    };
    Ok((parsed, source))
}

/// What [`parse_body`] reads of a body: the model, the cache salt, the
/// prompt and the response it continues.
type BodyFields<'a> = (
    Option<Text<'a>>,
    Option<Text<'a>>,
    PromptSource,
    Option<Cow<'a, str>>,
);

/// A completions or chat body's fields; `endpoint` None: either (dry run).
fn prompt_body(body: &Bytes, endpoint: Option<Endpoint>) -> Result<BodyFields<'_>, RouterError> {
    let fields = RequestBody::parse(body)?;
    let chat = match endpoint {
        Some(endpoint) => endpoint == Endpoint::Chat,
        None => fields.messages.is_some(),
    };
    let source = if chat {
        match fields.messages {
            Some(messages) if messages.get().starts_with('[') => PromptSource::Chat {
                messages: body.slice_ref(messages.get().as_bytes()),
                // vLLM's default: the prompt ends with the assistant's header.
                add_generation_prompt: fields.add_generation_prompt.unwrap_or(true),
            },
            _ => {
                return Err(RouterError::BadRequest(
                    "missing field `messages` (an array)".into(),
                ));
            }
        }
    } else {
        match fields.prompt.map(prompt).transpose()? {
            Some(Prompt::Tokens(tokens)) => PromptSource::Tokens(tokens),
            Some(Prompt::Text(text)) => PromptSource::Text(text),
            None => return Err(RouterError::BadRequest("missing field `prompt`".into())),
        }
    };
    Ok((fields.model, fields.cache_salt, source, None))
}

/// A Responses, Messages or passed-through body's fields.
fn api_body(body: &Bytes, endpoint: Endpoint) -> Result<BodyFields<'_>, RouterError> {
    let fields: ApiBody = json_object(body)?;
    let source = match endpoint {
        Endpoint::Responses | Endpoint::Messages => PromptSource::Converted {
            responses: endpoint == Endpoint::Responses,
            body: body.clone(),
        },
        _ => PromptSource::LoadOnly,
    };
    let follows = fields.previous_response_id.map(|Text(id)| id);
    Ok((fields.model, fields.cache_salt, source, follows))
}

/// Reads and parses an OpenAI request, then hands it to [`crate::http::proxy`].
async fn proxy(
    state: Arc<AppState>,
    inflight: Inflight,
    request: Request,
    endpoint: Endpoint,
) -> Response {
    let forwarded = async {
        let received = Instant::now();
        let (headers, body) = read_body(&state, request, received).await?;
        // Only now: a client that is slow to send its body holds no place.
        let permit = inflight.admit()?;
        let parsed = parse(&state, &headers, &body, Some(endpoint)).await?;
        let pin = parsed
            .pin
            .or_else(|| owner(&state, parsed.follows.as_deref()?, &parsed.model));
        let request = Forward {
            model: &parsed.model,
            tokens: &parsed.tokens,
            extra: &parsed.extra,
            pin,
            session: parsed.session.as_deref(),
            path: endpoint.path(),
            headers: &headers,
            body: body.clone(),
            received,
            permit,
        };
        let response = if state.disaggregated(request.model) {
            crate::http::pd::forward(&state, request).await
        } else {
            crate::http::proxy::forward(&state, request).await
        };
        match response {
            Ok(response) if endpoint == Endpoint::Responses => Ok(record_owner(&state, response)),
            response => response,
        }
    };
    match forwarded.await {
        Ok(response) => response,
        Err(e) if endpoint.anthropic() => e.into_anthropic(),
        Err(e) => e.into_response(),
    }
}

/// The worker that stores the response `id`, if it still serves `model`;
/// the lookup counted.
fn owner(state: &AppState, id: &str, model: &str) -> Option<u64> {
    let Some(worker) = state.response_owners.owner(id) else {
        crate::http::responses::count_lookup(crate::http::responses::UNKNOWN);
        return None;
    };
    if state.registry.serves(worker, model) {
        crate::http::responses::count_lookup(crate::http::responses::OWNER);
        Some(worker)
    } else {
        crate::http::responses::count_lookup(crate::http::responses::OWNER_GONE);
        None
    }
}

/// A Responses answer on its way to the client, its id recorded as the
/// answering worker's once its body shows it ([`crate::http::responses::IdTap`]).
fn record_owner(state: &AppState, response: Response) -> Response {
    let worker = response
        .headers()
        .get(crate::http::proxy::WORKER_HEADER_NAME)
        .and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
    match worker {
        Some(worker) if response.status().is_success() => response.map(|body| {
            let owners = Arc::clone(&state.response_owners);
            axum::body::Body::new(crate::http::responses::IdTap::new(body, owners, worker))
        }),
        _ => response,
    }
}

/// `GET` and `DELETE /v1/responses/{id}`, `POST /v1/responses/{id}/cancel`:
/// passed to the worker that stores the response, as the client sent them.
/// An id the router has no worker for is a 404, as an engine answers one it
/// does not store.
async fn response_by_id(
    State(state): State<Arc<AppState>>,
    Path(id): Path<String>,
    request: Request,
) -> Result<Response, RouterError> {
    let not_found = || {
        RouterError::BadRequest(format!(
            "no stored response with id `{id}` is known to this router"
        ))
        .with_status(StatusCode::NOT_FOUND)
    };
    let Some(worker) = state.response_owners.owner(&id) else {
        crate::http::responses::count_lookup(crate::http::responses::UNKNOWN);
        return Ok(not_found());
    };
    let Some(base_url) = state.registry.connected_base_url(worker) else {
        crate::http::responses::count_lookup(crate::http::responses::OWNER_GONE);
        return Ok(not_found());
    };
    crate::http::responses::count_lookup(crate::http::responses::OWNER);
    let method = request.method().clone();
    let path = request
        .uri()
        .path_and_query()
        .cloned()
        .ok_or_else(|| RouterError::BadRequest("the request has no path".into()))?;
    let (headers, body) = read_body(&state, request, Instant::now()).await?;
    let mut deadline = crate::http::upstream::GiveUpAt(
        tokio::time::Instant::now() + state.upstream.first_byte_timeout(),
    );
    let response = state
        .upstream
        .call(&base_url, method, path, &headers, body, &mut deadline)
        .await
        .map_err(|failure| {
            tracing::warn!(
                worker,
                "a stored response's worker did not answer: {failure:?}"
            );
            RouterError::Upstream(format!("worker {worker} did not answer"))
        })?;
    let (mut parts, body) = response.into_parts();
    crate::http::upstream::strip_hop_by_hop(&mut parts.headers);
    parts.headers.insert(
        crate::http::proxy::WORKER_HEADER_NAME,
        header::HeaderValue::from(worker),
    );
    Ok(Response::from_parts(parts, axum::body::Body::new(body)))
}

/// `POST /v1/route`: what would happen to this request, without proxying it.
async fn dry_run(
    state: Arc<AppState>,
    inflight: Inflight,
    request: Request,
) -> Result<axum::Json<Value>, RouterError> {
    let (headers, body) = read_body(&state, request, Instant::now()).await?;
    let _permit = inflight.admit()?;
    let parsed = parse(&state, &headers, &body, None).await?;
    let routed = state
        .route_now(
            &parsed.model,
            parsed.route_input(),
            parsed.pin,
            parsed.session.as_deref(),
            &[],
        )?
        .map_err(|e| RouterError::Unavailable {
            message: format!(
                "no worker can take a request for `{}` now: {e:?}",
                parsed.model
            ),
            retry_after_s: 1,
        })?;
    let d = routed.decision;
    let mut answer = json!({
        "worker_id": d.worker.worker_id,
        "dp_rank": d.worker.dp_rank,
        "policy": state.config.scheduler.policy.as_str(),
        "prompt_tokens": routed.prompt_tokens,
        "request_blocks": d.request_blocks,
        "untokenized": parsed.untokenized,
    });
    // What the session's binding would do; the proxy binds, a dry run does not.
    if let Some(session) = routed.session {
        answer["session"] = json!({
            "outcome": session.outcome.as_str(),
            "bound_worker_id": session.bound.map(|k| k.worker_id),
            "bound_dp_rank": session.bound.map(|k| k.dp_rank),
        });
    }
    // Worker addresses are the fleet's layout: for operators, not every client.
    if state.credentials.may_see_workers(&headers) {
        answer["base_url"] = json!(&*d.base_url);
    }
    // Overlaps confirm, block by block, prompts the caches hold (any tenant's):
    // a client without the right gets the decision alone, which each proxied
    // response names anyway (`x-kvroute-worker`).
    if !state.credentials.may_see_overlaps(&headers) {
        return Ok(axum::Json(answer));
    }
    let offload_overlap = d
        .scores
        .iter()
        .find(|s| s.worker_id == d.worker.worker_id && s.dp_rank == d.worker.dp_rank)
        .map_or(d.overlap_blocks, |s| s.offload_overlap_blocks);
    let ratio = if d.request_blocks > 0 {
        d.overlap_blocks as f64 / d.request_blocks as f64
    } else {
        0.0
    };
    answer["overlap_blocks"] = json!(d.overlap_blocks);
    // How deep the chosen rank's GPU and offload tiers cover the prompt.
    answer["offload_overlap_blocks"] = json!(offload_overlap);
    answer["predicted_hit_ratio"] = json!(ratio);
    answer["scores"] = json!(d.scores);
    Ok(axum::Json(answer))
}

async fn models(State(state): State<Arc<AppState>>) -> axum::Json<Value> {
    let data: Vec<Value> = state
        .registry
        .served_names()
        .into_iter()
        .map(|id| json!({"id": id, "object": "model", "owned_by": "kvroute"}))
        .collect();
    axum::Json(json!({"object": "list", "data": data}))
}

async fn readyz(State(state): State<Arc<AppState>>) -> Response {
    // A replica behind the shared log would route on a partial index.
    if state.replica.get().is_some_and(|r| !r.caught_up()) {
        return RouterError::Unavailable {
            message: "catching up with the cluster's event log".into(),
            retry_after_s: 1,
        }
        .into_response();
    }
    if state.registry.any_routable() {
        let mut answer = json!({"status": "ready"});
        // Ready on what it has, but say whether it is in touch with the others.
        if let Some(replica) = state.replica.get() {
            let log = if replica.connected() {
                "connected"
            } else {
                "disconnected"
            };
            answer["cluster"] = json!({"replica_id": replica.replica_id, "event_log": log});
        }
        axum::Json(answer).into_response()
    } else {
        RouterError::Unavailable {
            message: "no routable worker".into(),
            retry_after_s: 1,
        }
        .into_response()
    }
}

async fn render_metrics(State(state): State<Arc<AppState>>) -> Response {
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        state.render_metrics(),
    )
        .into_response()
}

fn worker_id(id: &str) -> Result<u64, RouterError> {
    id.parse()
        .map_err(|_| RouterError::UnknownWorker(id.to_string()))
}

async fn list_workers(State(state): State<Arc<AppState>>) -> axum::Json<Value> {
    axum::Json(json!({"workers": state.registry.worker_info(None)}))
}

async fn get_worker(
    State(state): State<Arc<AppState>>,
    Path(id): Path<String>,
) -> Result<axum::Json<Value>, RouterError> {
    let id = worker_id(&id)?;
    let info = state.registry.worker_info(Some(id));
    let worker = info
        .into_iter()
        .next()
        .ok_or_else(|| RouterError::UnknownWorker(id.to_string()))?;
    let blocks: Vec<Value> = worker
        .ranks
        .iter()
        .map(|r| {
            let key = kvroute_index::WorkerKey::new(id, r.dp_rank);
            json!({
                "dp_rank": r.dp_rank,
                "indexed_blocks": state.index.worker_blocks(key),
                "last_event_id": state.index.last_event_id(key),
            })
        })
        .collect();
    Ok(axum::Json(json!({"worker": worker, "index": blocks})))
}

async fn drain_worker(
    State(state): State<Arc<AppState>>,
    Path(id): Path<String>,
) -> Result<axum::Json<Value>, RouterError> {
    let id = worker_id(&id)?;
    if !state.registry.drain(id) {
        return Err(RouterError::UnknownWorker(id.to_string()));
    }
    tracing::info!(worker = id, "draining");
    Ok(axum::Json(json!({"id": id, "state": "draining"})))
}

async fn delete_worker(
    State(state): State<Arc<AppState>>,
    Path(id): Path<String>,
) -> Result<StatusCode, RouterError> {
    let id = worker_id(&id)?;
    let keys = state
        .registry
        .remove(id)
        .ok_or_else(|| RouterError::UnknownWorker(id.to_string()))?;
    // Its stream is closed first, so that no event of it lands after the purge.
    state.writers.remove(id).await;
    for key in keys {
        state.tiers.remove_worker(key);
        state.predicted.remove_worker(key);
    }
    tracing::info!(worker = id, "removed by an operator");
    Ok(StatusCode::NO_CONTENT)
}

/// The test-only hook of [`crate::faults`]: `{"dp_rank": R, "events": N,
/// "whole": false}`.
#[cfg(feature = "test-hooks")]
async fn drop_events(
    State(state): State<Arc<AppState>>,
    Path(id): Path<String>,
    body: Bytes,
) -> Result<axum::Json<Value>, RouterError> {
    #[derive(serde::Deserialize)]
    #[serde(deny_unknown_fields)]
    struct DropEvents {
        dp_rank: u32,
        events: u64,
        /// Not applied at all, ids included (a gap), instead of applied empty.
        #[serde(default)]
        whole: bool,
    }
    if !state.faults.enabled() {
        return Err(RouterError::Forbidden(
            "drop-events is a test hook, off unless index.test_faults = true".into(),
        ));
    }
    let id = worker_id(&id)?;
    let request: DropEvents = serde_json::from_slice(&body)
        .map_err(|e| RouterError::BadRequest(format!("drop-events body: {e}")))?;
    let key = kvroute_index::WorkerKey::new(id, request.dp_rank);
    state.faults.drop_events(key, request.events, request.whole);
    tracing::warn!(
        worker = id,
        dp_rank = request.dp_rank,
        events = request.events,
        "test hook: the next events of this rank will be applied empty here"
    );
    Ok(axum::Json(
        json!({"id": id, "dp_rank": request.dp_rank, "events": request.events}),
    ))
}

#[cfg(test)]
mod tests {
    use std::convert::Infallible;

    use super::*;

    #[test]
    fn a_body_is_read_in_place_and_its_other_fields_skipped() {
        let body = Bytes::from_static(
            br#"{"model":"m","x":{"y":[1,{"z":null}]},"prompt":[1,2,4294967295],
                "messages":[{"role":"user","content":"hi"}],"cache_salt":"s\u0041"}"#,
        );
        let fields = RequestBody::parse(&body).unwrap();
        assert!(matches!(fields.model, Some(Text(Cow::Borrowed("m")))));
        let tokens = prompt(fields.prompt.unwrap()).unwrap();
        assert_eq!(tokens, Prompt::Tokens(vec![1, 2, u32::MAX]));
        let messages = fields.messages.unwrap().get();
        assert_eq!(messages, r#"[{"role":"user","content":"hi"}]"#);
        assert_eq!(body.slice_ref(messages.as_bytes()), messages.as_bytes());
        // An escaped string cannot be borrowed: it is unescaped into its own.
        assert!(matches!(fields.cache_salt, Some(Text(Cow::Owned(salt))) if salt == "sA"));
        assert_eq!(fields.add_generation_prompt, None);
    }

    /// A body of `frames`, sent one by one.
    fn streamed(frames: &[&'static str]) -> axum::body::Body {
        let frames: Vec<Result<Bytes, Infallible>> = frames
            .iter()
            .map(|f| Ok(Bytes::from_static(f.as_bytes())))
            .collect();
        axum::body::Body::from_stream(futures_util::stream::iter(frames))
    }

    /// A pace of 1 s and 100 bytes a second from now.
    fn pace() -> BodyPace {
        BodyPace {
            started: tokio::time::Instant::now(),
            timeout: Duration::from_secs(1),
            min_bytes_per_s: 100,
        }
    }

    #[tokio::test]
    async fn a_body_is_read_whole_from_one_frame_or_many_and_its_limit_holds() {
        let one = whole_body(axum::body::Body::from("{\"a\":1}"), 64, pace()).await;
        assert_eq!(one.unwrap(), "{\"a\":1}");
        let many = whole_body(streamed(&["{\"a\"", ":", "1}"]), 64, pace()).await;
        assert_eq!(many.unwrap(), "{\"a\":1}");
        let empty = whole_body(axum::body::Body::empty(), 64, pace()).await;
        assert_eq!(empty.unwrap(), "");
        let over = whole_body(streamed(&["12345", "67890"]), 8, pace()).await;
        assert!(
            matches!(over, Err(RouterError::PayloadTooLarge(8))),
            "{over:?}"
        );
        let over = whole_body(axum::body::Body::from("123456789"), 8, pace()).await;
        assert!(
            matches!(over, Err(RouterError::PayloadTooLarge(8))),
            "{over:?}"
        );
    }

    /// A body of 50-byte frames, one every `every`.
    fn trickled(frames: usize, every: Duration) -> axum::body::Body {
        let frames = futures_util::stream::unfold(0, move |sent| async move {
            (sent < frames).then_some(())?;
            tokio::time::sleep(every).await;
            Some((Ok::<_, Infallible>(Bytes::from(vec![b' '; 50])), sent + 1))
        });
        axum::body::Body::from_stream(frames)
    }

    #[tokio::test(start_paused = true)]
    async fn a_body_slower_than_the_pace_is_cut_and_one_at_the_pace_is_not() {
        // 50 bytes every 400 ms: 125 bytes a second, above the pace's 100.
        let at_pace = whole_body(trickled(20, Duration::from_millis(400)), 4096, pace()).await;
        assert_eq!(at_pace.unwrap().len(), 1000, "8 s, past the 1 s timeout");
        // 50 bytes every 600 ms: 83 bytes a second.
        let started = tokio::time::Instant::now();
        let slow = whole_body(trickled(20, Duration::from_millis(600)), 4096, pace()).await;
        assert!(
            matches!(&slow, Err(RouterError::RequestTimeout(m)) if m.contains("min_body_bytes_per_s")),
            "{slow:?}"
        );
        // Cut once 250 bytes came at 3 s: 1 s and 2.5 s earned.
        assert_eq!(started.elapsed(), Duration::from_millis(3500));
    }
}
