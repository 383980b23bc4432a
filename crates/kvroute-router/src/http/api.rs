//! The HTTP API: OpenAI-compatible endpoints (parsed here, routed and forwarded
//! by [`crate::http::proxy`]), the dry run, admin endpoints over the registry, health
//! and metrics.

use std::borrow::Cow;
use std::cell::RefCell;
use std::convert::Infallible;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::Router;
use axum::extract::{Path, Request, State};
use axum::http::{HeaderMap, Method, StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use bytes::Bytes;
use http_body::Body as _;
use http_body_util::{BodyExt, LengthLimitError, Limited};
use hyper::body::Incoming;
use kvroute_index::ExtraKeys;
use serde::Deserialize;
use serde::de::IgnoredAny;
use serde_json::value::RawValue;
use serde_json::{Value, json};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tower::Service;

use crate::error::RouterError;
use crate::http::proxy::Forward;
use crate::limits;
use crate::metrics;
use crate::state::{AppState, RouteInput};
use crate::tokenize::Prompt;

pub use crate::http::proxy::WORKER_HEADER;

/// The HTTP API: the two proxied endpoints, then everything else through
/// axum's router; every response counted.
pub fn service(state: Arc<AppState>) -> Api {
    let inflight = Inflight::new(state.config.limits.max_inflight_requests);
    Api {
        rest: router(Arc::clone(&state), inflight.clone()),
        state,
        inflight,
    }
}

/// The proxied endpoints are matched before axum's router is asked: they are
/// most of the traffic, and the router's matching, method routing, extractors
/// and boxed services cost a few microseconds of a proxy hop that is otherwise
/// little more than two loopback round trips. They read hyper's body as it
/// is; axum's router boxes it.
#[derive(Clone)]
pub struct Api {
    state: Arc<AppState>,
    inflight: Inflight,
    rest: Router,
}

impl Api {
    /// Answers one request, counted by status ([`metrics::HTTP_RESPONSES`]).
    /// Counted here rather than by a middleware (`middleware::from_fn` boxes
    /// a clone of the inner service and a future per request).
    pub async fn respond(
        self,
        request: axum::http::Request<Incoming>,
    ) -> Result<Response, Infallible> {
        let response = match Endpoint::of_path(request.uri().path()) {
            Some(endpoint) if request.method() == Method::POST => {
                proxy(self.state, self.inflight, request, endpoint).await
            }
            _ => {
                let mut rest = self.rest;
                rest.call(request).await?
            }
        };
        metrics::count_response(response.status().as_u16());
        Ok(response)
    }
}

/// Everything but the proxied endpoints' POSTs (their other methods get a 405 here).
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
    Router::new()
        .route("/v1/completions", axum::routing::any(post_only))
        .route("/v1/chat/completions", axum::routing::any(post_only))
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

/// The proxied endpoints' other methods: their POSTs never reach this router
/// ([`Api::respond`] takes them first), the rest get a JSON 405.
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

/// Which OpenAI endpoint a body is for.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Endpoint {
    Completions,
    Chat,
}

impl Endpoint {
    /// The endpoint a request's path names, if it is one of the proxied ones.
    pub(crate) fn of_path(path: &str) -> Option<Endpoint> {
        match path {
            "/v1/completions" => Some(Endpoint::Completions),
            "/v1/chat/completions" => Some(Endpoint::Chat),
            _ => None,
        }
    }

    fn path(self) -> &'static str {
        match self {
            Endpoint::Completions => "/v1/completions",
            Endpoint::Chat => "/v1/chat/completions",
        }
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

/// The fields of an OpenAI request body that routing needs, read straight
/// from the body's bytes and borrowing from them: no `serde_json::Value` tree
/// (a token-id prompt costs 4 bytes a token), and chat `messages` are only
/// located here, then parsed on the tokenizing pool if there is a tokenizer.
/// Every other field is skipped; the worker gets the original bytes.
#[derive(Deserialize)]
struct RequestBody<'a> {
    #[serde(borrow)]
    model: Option<Text<'a>>,
    #[serde(borrow)]
    prompt: Option<PromptField<'a>>,
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

/// A completions `prompt` as the body holds it: read already when it is a
/// plain array of token ids ([`token_ids`]), else its JSON, read by [`prompt`]
/// once the body is known to be valid JSON.
enum PromptField<'a> {
    Ids(Vec<u32>),
    Json(&'a RawValue),
}

impl<'de: 'a, 'a> Deserialize<'de> for PromptField<'a> {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        <&RawValue>::deserialize(deserializer).map(PromptField::Json)
    }
}

impl<'a> RequestBody<'a> {
    fn parse(body: &'a [u8]) -> Result<Self, RouterError> {
        if let Some(fields) = Self::read_plain(body) {
            return Ok(fields);
        }
        let invalid_json = |e: serde_json::Error| {
            RouterError::BadRequest(format!("the body is not valid JSON: {e}"))
        };
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
            match serde_path_to_error::deserialize::<_, RequestBody>(&mut json) {
                Err(named) => RouterError::BadRequest(format!("invalid request body: {named}")),
                Ok(_) => RouterError::BadRequest(format!("invalid request body: {e}")),
            }
        })
    }

    /// Reads the body as the derived parse would, but walks the top-level
    /// object itself, so that a plain token-id `prompt` is read by one scan
    /// ([`token_ids`]) instead of serde skimming it first to find its end
    /// (about 90 instructions a token, as much as reading it). The other
    /// values are serde's, each parsed where it starts. `None` for anything
    /// read differently or wrong (a key with an escape or beyond ASCII, a
    /// field twice, bad JSON): the derived parse reads that, and says what is
    /// wrong. The one other difference: each value may nest 128 deep, one
    /// level more than inside the whole body.
    fn read_plain(body: &'a [u8]) -> Option<Self> {
        let mut json = Walk { body, at: 0 };
        let mut fields = RequestBody {
            model: None,
            prompt: None,
            messages: None,
            add_generation_prompt: None,
            cache_salt: None,
        };
        json.skip_whitespace();
        json.expect(b'{')?;
        json.skip_whitespace();
        if json.peek() == Some(b'}') {
            json.at += 1;
        } else {
            // Which of the five fields were seen: serde refuses one twice.
            let mut seen = 0u8;
            loop {
                let key = json.plain_key()?;
                let field = match key {
                    b"model" => 1,
                    b"prompt" => 2,
                    b"messages" => 4,
                    b"add_generation_prompt" => 8,
                    b"cache_salt" => 16,
                    _ => 0,
                };
                if seen & field != 0 {
                    return None;
                }
                seen |= field;
                match field {
                    1 => fields.model = json.text()?,
                    2 => {
                        fields.prompt = match token_ids(&body[json.at..]) {
                            Some((ids, len)) => {
                                json.at += len;
                                Some(PromptField::Ids(ids))
                            }
                            None => json.value::<Option<&RawValue>>()?.map(PromptField::Json),
                        }
                    }
                    4 => fields.messages = json.value()?,
                    8 => fields.add_generation_prompt = json.value()?,
                    16 => fields.cache_salt = json.text()?,
                    _ => {
                        if !json.skip_plain_scalar() {
                            json.value::<IgnoredAny>()?;
                        }
                    }
                }
                json.skip_whitespace();
                match json.peek()? {
                    b',' => json.at += 1,
                    b'}' => {
                        json.at += 1;
                        break;
                    }
                    _ => return None,
                }
                json.skip_whitespace();
            }
        }
        json.skip_whitespace();
        (json.at == body.len()).then_some(fields)
    }
}

/// A place in a body that [`RequestBody::read_plain`] walks.
struct Walk<'a> {
    body: &'a [u8],
    at: usize,
}

impl<'a> Walk<'a> {
    fn peek(&self) -> Option<u8> {
        self.body.get(self.at).copied()
    }

    fn expect(&mut self, byte: u8) -> Option<()> {
        (self.peek()? == byte).then(|| self.at += 1)
    }

    /// JSON's whitespace: space, tab, line feed, carriage return.
    fn skip_whitespace(&mut self) {
        while let Some(b' ' | b'\t' | b'\n' | b'\r') = self.peek() {
            self.at += 1;
        }
    }

    /// A key of printable ASCII without escapes, and the colon after it.
    fn plain_key(&mut self) -> Option<&'a [u8]> {
        self.expect(b'"')?;
        let start = self.at;
        loop {
            match self.peek()? {
                b'"' => break,
                b'\\' | ..=0x1f | 0x80.. => return None,
                _ => self.at += 1,
            }
        }
        let key = &self.body[start..self.at];
        self.at += 1;
        self.skip_whitespace();
        self.expect(b':')?;
        self.skip_whitespace();
        Some(key)
    }

    /// The string (or null) that starts here, as serde reads an `Option<Text>`.
    fn text(&mut self) -> Option<Option<Text<'a>>> {
        match self.plain_string() {
            Some(text) => Some(Some(Text(Cow::Borrowed(text)))),
            None => self.value(),
        }
    }

    /// The string that starts here if it is a plain one (no escape, no
    /// control character, UTF-8), read as serde reads it but without its
    /// stream deserializer: about 150 instructions less a value.
    fn plain_string(&mut self) -> Option<&'a str> {
        let rest = self.body.get(self.at..)?.strip_prefix(b"\"")?;
        // Names are short: a plain loop, not memchr's setup.
        let len = rest
            .iter()
            .position(|&b| b == b'"' || b == b'\\' || b < 0x20)?;
        if rest[len] != b'"' {
            return None;
        }
        let text = std::str::from_utf8(&rest[..len]).ok()?;
        self.at += len + 2;
        Some(text)
    }

    /// Skips the value that starts here if it is a plain scalar (a plain
    /// string, a non-negative integer, `true`, `false` or `null`) that ends
    /// where serde would end it (whitespace, `,` or `}` after it); anything
    /// else is left to serde.
    fn skip_plain_scalar(&mut self) -> bool {
        let rest = &self.body[self.at..];
        let len = match rest.first() {
            Some(b'"') => return self.plain_string().is_some(),
            Some(b'1'..=b'9') => 1 + rest[1..].iter().take_while(|b| b.is_ascii_digit()).count(),
            Some(b'0') => 1,
            Some(b't') if rest.starts_with(b"true") => 4,
            Some(b'f') if rest.starts_with(b"false") => 5,
            Some(b'n') if rest.starts_with(b"null") => 4,
            _ => return false,
        };
        let ends = matches!(
            rest.get(len),
            Some(b' ' | b'\t' | b'\n' | b'\r' | b',' | b'}')
        );
        if ends {
            self.at += len;
        }
        ends
    }

    /// The JSON value that starts here, read by serde.
    fn value<T: Deserialize<'a>>(&mut self) -> Option<T> {
        let mut values = serde_json::Deserializer::from_slice(&self.body[self.at..]).into_iter();
        let value = values.next()?.ok()?;
        self.at += values.byte_offset();
        Some(value)
    }
}

/// A completions `prompt`: see [`PromptField`]. Anything but a plain array of
/// token ids (text, a nested array, a bad element) goes through [`Prompt`]'s
/// parse, which also says what is wrong.
fn prompt(field: PromptField<'_>) -> Result<Prompt, RouterError> {
    let raw = match field {
        PromptField::Ids(ids) => return Ok(Prompt::Tokens(ids)),
        PromptField::Json(raw) => raw.get(),
    };
    if let Some((ids, len)) = token_ids(raw.as_bytes())
        && len == raw.len()
    {
        return Ok(Prompt::Tokens(ids));
    }
    serde_json::from_str(raw)
        .map_err(|e| RouterError::BadRequest(format!("invalid request body: prompt: {e}")))
}

/// The JSON array `json` starts with, and its length in bytes, if it is a
/// non-empty array of integers that fit a `u32`, written plainly (no sign,
/// fraction, exponent or leading zero); else `None`. What it accepts is
/// exactly such an array of valid JSON: it also reads raw bodies.
fn token_ids(json: &[u8]) -> Option<(Vec<u32>, usize)> {
    if json.first() != Some(&b'[') {
        return None;
    }
    // A plain array ends at its first `]`, which ends every run of digits,
    // whitespace or separators before it: the scan stays within it (reading
    // eight bytes at a time may look past it). Each id takes two bytes at
    // least with its separator, so there are at most `end / 2`: written in
    // place, not pushed (a push's check for room kept the loop's state in
    // memory; this is the request's hottest loop), into a vector an earlier
    // request on the thread gave back if there is one.
    let end = memchr::memchr(b']', json)?;
    let mut ids = crate::kept::take_pooled(&SPARE_TOKENS);
    ids.resize(end / 2, 0);
    let mut count = 0;
    let mut at = 1;
    loop {
        let (id, len) = match eight_bytes(json, at).and_then(short_id) {
            Some(found) => found,
            None => {
                while let b' ' | b'\t' | b'\n' | b'\r' = json[at] {
                    at += 1;
                }
                eight_bytes(json, at)
                    .and_then(short_id)
                    .or_else(|| long_id(&json[at..]))?
            }
        };
        ids[count] = id;
        count += 1;
        at += len;
        if json[at] != b',' {
            while let b' ' | b'\t' | b'\n' | b'\r' = json[at] {
                at += 1;
            }
            match json[at] {
                b',' => {}
                b']' => {
                    ids.truncate(count);
                    return Some((ids, at + 1));
                }
                _ => return None,
            }
        }
        at += 1;
    }
}

/// Most token-id vectors a thread keeps for later prompts, in a pool (see
/// [`crate::kept`]).
const SPARE_TOKEN_VECTORS: usize = 32;

/// Token ids of the longest vector kept (16 KiB); a longer one is let go.
const SPARE_TOKENS_MAX: usize = 4096;

thread_local! {
    static SPARE_TOKENS: RefCell<Vec<Vec<u32>>> = const { RefCell::new(Vec::new()) };
}

/// Keeps a proxied request's token ids, once it is answered, for a later
/// token-id prompt on this thread to be read into: a vector made per request
/// was an allocation and a free.
fn keep_tokens(tokens: Vec<u32>) {
    crate::kept::keep_pooled(&SPARE_TOKENS, tokens, SPARE_TOKENS_MAX, SPARE_TOKEN_VECTORS);
}

/// The eight bytes of `json` from `at` on, as one little-endian word.
fn eight_bytes(json: &[u8], at: usize) -> Option<u64> {
    let bytes = json.get(at..at + 8)?;
    Some(u64::from_le_bytes(bytes.try_into().ok()?))
}

/// The id of one to seven digits (no leading zero) that `word`'s bytes start
/// with, and its length; `None` for anything else, which [`long_id`] reads.
/// The digits are found by the bytes' bits and added up by three
/// multiplications (Lemire's), in fewer instructions than a loop took for
/// the second digit on.
fn short_id(word: u64) -> Option<(u32, usize)> {
    const BYTES: u64 = 0x0101_0101_0101_0101;
    // Digits become 0..=9, every other byte something else.
    let values = word ^ (BYTES * u64::from(b'0'));
    // The top bit of the first byte that is not a digit is set: from 10 to
    // 0x89 by adding 0x76, from 0x80 on in the value itself. Only bytes
    // after it can have a carry added.
    let not_digits = (values.wrapping_add(BYTES * 0x76) | values) & (BYTES * 0x80);
    let len = (not_digits.trailing_zeros() / 8) as usize;
    if !(1..8).contains(&len) || (len > 1 && values as u8 == 0) {
        return None;
    }
    // The digits to the top, the first (most significant) lowest, zeros below.
    let digits = values << (64 - 8 * len);
    let pairs = digits.wrapping_mul(10 * 256 + 1) >> 8 & 0x00ff_00ff_00ff_00ff;
    let quads = pairs.wrapping_mul(100 * 65536 + 1) >> 16 & 0x0000_ffff_0000_ffff;
    let id = quads.wrapping_mul(10000 * (1 << 32) + 1) >> 32;
    Some((id as u32, len))
}

/// The id `json` starts with, of any length, and its length: `None` unless
/// it is one or more digits without a leading zero that fit a `u32`.
fn long_id(json: &[u8]) -> Option<(u32, usize)> {
    let digits = json.iter().take_while(|b| b.is_ascii_digit()).count();
    if digits == 0 || digits > 10 || (digits > 1 && json[0] == b'0') {
        return None;
    }
    let id = json[..digits]
        .iter()
        .fold(0u64, |id, &digit| id * 10 + u64::from(digit - b'0'));
    Some((u32::try_from(id).ok()?, digits))
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
    let started = (!matches!(source, PromptSource::Tokens(_))).then(Instant::now);
    let tokenizer = match source {
        PromptSource::Tokens(_) => None,
        _ => state.tokenizer.for_name(&state.registry, &parsed.model),
    };
    let tokenized = match (source, tokenizer) {
        (PromptSource::Tokens(tokens), _) => Some((tokens, Vec::new())),
        (_, None) => None,
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
    let fields = RequestBody::parse(body)?;
    let Text(model) = fields
        .model
        .ok_or_else(|| RouterError::BadRequest("missing field `model` (a string)".into()))?;
    let endpoint = match endpoint {
        Some(e) => e,
        None if fields.messages.is_some() => Endpoint::Chat,
        None => Endpoint::Completions,
    };
    let source = match endpoint {
        Endpoint::Completions => match fields.prompt.map(prompt).transpose()? {
            Some(Prompt::Tokens(tokens)) => PromptSource::Tokens(tokens),
            Some(Prompt::Text(text)) => PromptSource::Text(text),
            None => return Err(RouterError::BadRequest("missing field `prompt`".into())),
        },
        Endpoint::Chat => match fields.messages {
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
        },
    };
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
            cache_salt: fields.cache_salt.map(|Text(salt)| salt.into_owned()),
            multimodal: Vec::new(),
        },
        untokenized: None,
        pin,
    };
    Ok((parsed, source))
}

/// Reads and parses an OpenAI request, then hands it to [`crate::http::proxy`].
async fn proxy(
    state: Arc<AppState>,
    inflight: Inflight,
    request: axum::http::Request<Incoming>,
    endpoint: Endpoint,
) -> Response {
    let forwarded = async {
        let received = Instant::now();
        let (headers, body) = read_body(&state, request, received).await?;
        // Only now: a client that is slow to send its body holds no place.
        let permit = inflight.admit()?;
        let parsed = parse(&state, &headers, &body, Some(endpoint)).await?;
        let response = crate::http::proxy::forward(
            &state,
            Forward {
                model: &parsed.model,
                tokens: &parsed.tokens,
                extra: &parsed.extra,
                pin: parsed.pin,
                path: endpoint.path(),
                headers: &headers,
                body: body.clone(),
                received,
                permit,
            },
        )
        .await;
        crate::http::upstream::recycle_headers(headers);
        keep_tokens(parsed.tokens);
        response
    };
    forwarded.await.unwrap_or_else(IntoResponse::into_response)
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
        .route_now(&parsed.model, parsed.route_input(), parsed.pin, &[])?
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
    use proptest::prelude::*;

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

    #[test]
    fn the_token_id_scan_reads_only_plain_json_arrays_and_says_where_they_end() {
        for refused in [
            "[",
            "[1",
            "[1 ",
            "[1,",
            "[1, ",
            "[ ",
            "[]",
            "[1,]",
            "[1 2]",
            "[01]",
            "[-1]",
            "[1.0]",
            "[1\x0c]",
            "[12345678901]",
            "[4294967296]",
            "[123456789012345678901234567890]",
            "[00]",
            "[1,0012]",
            "[0 1]",
            "[1,+2]",
            "[1,2 3,4]",
            "[1,2a]",
            " [1]",
        ] {
            assert_eq!(token_ids(refused.as_bytes()), None, "{refused:?}");
            // With room after it, ids are read eight bytes at a time.
            let padded = format!("{refused},\"max_tokens\":16}}");
            assert_eq!(token_ids(padded.as_bytes()), None, "{padded:?}");
        }
        assert_eq!(
            token_ids(b"[ 0 ,\t4294967295\r\n],\"more\":[2]}"),
            Some((vec![0, u32::MAX], 19))
        );
        // Every length of id, read eight bytes at a time or not.
        let ids = [
            0,
            7,
            10,
            99,
            305,
            4096,
            65535,
            100_000,
            1_234_567,
            12_345_678,
            99_999_999,
            123_456_789,
            u32::MAX,
        ];
        let array = serde_json::to_string(&ids).unwrap();
        let found = Some((ids.to_vec(), array.len()));
        assert_eq!(token_ids(array.as_bytes()), found);
        assert_eq!(token_ids(format!("{array},\"n\":1}}").as_bytes()), found);
    }

    #[test]
    fn a_body_of_the_usual_shape_is_walked_not_parsed_by_serde() {
        let body = br#"{"model": "m", "prompt": [1, 2, 3], "max_tokens": 16, "stream": false}"#;
        let fields = RequestBody::read_plain(body).expect("walked");
        assert!(matches!(fields.prompt, Some(PromptField::Ids(ids)) if ids == [1, 2, 3]));
        // A key with an escape is left to serde, which reads it the same.
        let escaped = br#"{"mod\u0065l": "m", "prompt": [1]}"#;
        assert!(RequestBody::read_plain(escaped).is_none());
        let fields = RequestBody::parse(escaped).unwrap();
        assert!(matches!(fields.model, Some(Text(Cow::Borrowed("m")))));
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

    /// One element of a `prompt` array as a client might write it.
    fn element() -> impl Strategy<Value = String> {
        prop_oneof![
            4 => any::<u32>().prop_map(|id| id.to_string()),
            4 => (0..65_536u32).prop_map(|id| id.to_string()),
            2 => (0..100_000_000u32).prop_map(|id| id.to_string()),
            1 => (u64::from(u32::MAX)..=u64::MAX).prop_map(|n| n.to_string()),
            1 => any::<i32>().prop_map(|n| n.to_string()),
            1 => Just("2.5".to_string()),
            1 => Just("1e3".to_string()),
            1 => Just("\"text\"".to_string()),
            1 => Just("[1, 2]".to_string()),
            1 => Just("null".to_string()),
        ]
    }

    proptest! {
        /// The scan of plain token-id arrays gives what serde's parse of a
        /// [`Prompt`] gives, for every array, whitespace and all.
        #[test]
        fn a_prompt_reads_as_serde_reads_it(
            elements in proptest::collection::vec((element(), "[ \t\n]{0,2}", "[ \t\n]{0,2}"), 0..12),
        ) {
            let array = elements
                .iter()
                .map(|(element, before, after)| format!("{before}{element}{after}"))
                .collect::<Vec<_>>()
                .join(",");
            let json = format!("[{array}]");
            let raw: Box<RawValue> = serde_json::from_str(&json).unwrap();
            let reference = serde_json::from_str::<Prompt>(&json).map_err(|e| e.to_string());
            let read = prompt(PromptField::Json(&raw)).map_err(|e| e.to_string());
            // In a body, ids are read eight bytes at a time up to its end.
            let in_body = format!("{json},\"max_tokens\":16}}");
            prop_assert_eq!(
                token_ids(in_body.as_bytes()),
                token_ids(json.as_bytes()).filter(|&(_, len)| len == json.len())
            );
            match (&read, &reference) {
                (Ok(read), Ok(reference)) => prop_assert_eq!(read, reference),
                (Err(read), Err(reference)) => prop_assert!(read.ends_with(reference.as_str()), "{read} / {reference}"),
                _ => prop_assert!(false, "{json}: {read:?} against {reference:?}"),
            }
        }
    }

    /// What routing reads of a body, to compare two parses.
    type Read = (
        Option<String>,
        Option<Result<Prompt, String>>,
        Option<String>,
        Option<bool>,
        Option<String>,
    );

    fn read(fields: RequestBody<'_>) -> Read {
        (
            fields.model.map(|Text(m)| m.into_owned()),
            fields.prompt.map(|p| prompt(p).map_err(|e| e.to_string())),
            fields.messages.map(|m| m.get().to_string()),
            fields.add_generation_prompt,
            fields.cache_salt.map(|Text(s)| s.into_owned()),
        )
    }

    /// A key of a request body: the five read, others, and some serde
    /// matches only after unescaping.
    fn key() -> impl Strategy<Value = &'static str> {
        prop_oneof![
            4 => Just("model"),
            4 => Just("prompt"),
            4 => Just("messages"),
            4 => Just("add_generation_prompt"),
            4 => Just("cache_salt"),
            4 => Just("max_tokens"),
            4 => Just("stream"),
            1 => Just("pro\\u006dpt"),
            1 => Just("mödel"),
        ]
    }

    /// An array of token ids, mostly plain ones.
    fn ids() -> impl Strategy<Value = String> {
        let id = prop_oneof![8 => any::<u32>().prop_map(|id| id.to_string()), 1 => element()];
        proptest::collection::vec((id, "[ \t\n]{0,1}"), 0..5).prop_map(|ids| {
            let ids: Vec<String> = ids
                .into_iter()
                .map(|(id, ws)| format!("{ws}{id}"))
                .collect();
            format!("[{}]", ids.join(","))
        })
    }

    /// A member's value, valid JSON or not; a `prompt`'s is mostly token ids.
    fn value(key: &str) -> impl Strategy<Value = String> + use<> {
        let ids_weight = if key.starts_with("pro") { 12 } else { 1 };
        prop_oneof![
            ids_weight => ids(),
            2 => "[a-z]{0,3}".prop_map(|s| format!("\"{s}\"")),
            1 => Just("\"s\\u0041\"".to_string()),
            1 => Just("\"é\"".to_string()),
            1 => Just("null".to_string()),
            1 => Just("true".to_string()),
            1 => Just("-1.5e3".to_string()),
            1 => prop_oneof![Just("0"), Just("16"), Just("1e3"), Just("0.5"), Just("false"), Just("nul")]
                .prop_map(String::from),
            1 => prop_oneof![Just("\"a\u{1}b\""), Just("\"a\\tb\""), Just("\"\""), Just("\"ü\"")]
                .prop_map(String::from),
            1 => Just(r#"{"a":[1,{"b":null}],"c":"]"}"#.to_string()),
            1 => Just(r#"[{"role":"user","content":"hi"}]"#.to_string()),
            // Not JSON.
            1 => prop_oneof![
                Just("01".to_string()),
                Just("[1,]".to_string()),
                Just("\"open".to_string()),
                Just("tru".to_string()),
            ],
        ]
    }

    fn member() -> impl Strategy<Value = (&'static str, String)> {
        key().prop_flat_map(|key| (Just(key), value(key)))
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(1024))]

        /// The walk of a body gives what serde's derived parse gives, or
        /// leaves the body to it: never a body serde refuses, never a
        /// different reading.
        #[test]
        fn a_body_walks_as_serde_reads_it(
            members in proptest::collection::vec((member(), "[ \t\r\n]{0,1}", "[ \t\n]{0,1}"), 0..6),
            tail in prop_oneof![12 => Just(""), 2 => Just(" \n"), 1 => Just("x"), 1 => Just("}"), 1 => Just("\u{c}")],
            cut in proptest::option::weighted(0.2, 0usize..200),
        ) {
            let members: Vec<String> = members
                .iter()
                .map(|((key, value), ws, ws2)| format!("{ws}\"{key}\"{ws2}:{ws}{value}{ws2}"))
                .collect();
            let mut body = format!("{{{}}}{tail}", members.join(","));
            if let Some(cut) = cut {
                let mut cut = cut.min(body.len());
                while !body.is_char_boundary(cut) {
                    cut -= 1;
                }
                body.truncate(cut);
            }
            let reference = serde_json::from_slice::<RequestBody>(body.as_bytes()).map(read);
            match (RequestBody::read_plain(body.as_bytes()).map(read), reference) {
                (None, _) => {}
                (Some(walked), Ok(reference)) => prop_assert_eq!(walked, reference),
                (Some(walked), Err(e)) => prop_assert!(false, "{body}: walked to {walked:?}, serde: {e}"),
            }
        }
    }
}
