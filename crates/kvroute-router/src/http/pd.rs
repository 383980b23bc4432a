//! Prefill/decode disaggregation: a request for a name that decode workers
//! serve runs as a prefill leg on a prefill worker, whose KV cache a decode
//! worker takes over, and a decode leg whose answer the client gets.
//!
//! The path (`kvroute_pd_requests_total{path}`), decided before anything is sent:
//! - `decode_only`: a decode worker serves the request alone, as an aggregated
//!   one would: a pinned request, `n > 1` (one handoff cannot seed several
//!   sequences), a prompt shorter than `disaggregation.min_prompt_tokens`
//!   (or one the router could not tokenize), a name without a routable
//!   prefill worker, and a request whose decode pool holds all but
//!   `disaggregation.max_local_prefill_tokens` of its prompt already
//!   (conditional disaggregation).
//! - `disaggregated`: a decode worker booked on load alone (it prefills
//!   nothing), a prefill worker chosen as whole requests are, on its cached
//!   prefix against its prefill load. Both bookings are shared with other
//!   replicas as every booking is.
//!
//! The prefill worker's convention says how the legs go:
//! - vLLM: the prefill leg first, with `kv_transfer_params` asking for a remote
//!   decode, one token, no stream; then the client's own body with the
//!   `kv_transfer_params` of the prefill answer to the decode worker. Both
//!   legs carry the same `X-Request-Id`. A prefill answer without
//!   `kv_transfer_params` is not the client's answer (it was generated under
//!   the leg's rules: one token, no stream, no `min_tokens`): the decode
//!   worker computes the request itself, counted as a handoff failure.
//! - SGLang: the body with `bootstrap_host`, `bootstrap_port` and
//!   `bootstrap_room` goes to both workers at once; the client gets the decode
//!   answer, the prefill answer is read and dropped (its failures counted).
//!
//! What must stay true, so that no KV cache is stranded on a prefill worker
//! until its engine's timeout:
//! - The legs run in a task of their own, which the client leaving does not
//!   stop: a vLLM prefill leg once sent is read to its end, and its
//!   `kv_transfer_params` always go to a decode leg, the client's if it is
//!   still there, else a one-token leg read and dropped, which makes the
//!   decode worker take the blocks over.
//! - Once the decode leg is sent, the client leaving cancels it (it ends the
//!   response) and, SGLang, the prefill leg too.
//! - A prefill leg that fails before anything reached the client is retried
//!   on another prefill worker (SGLang: the decode leg is cancelled and sent
//!   again with a new room). Out of prefill workers, the decode worker
//!   computes the request alone (`kvroute_pd_handoff_failures_total`).

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Instant;

use axum::body::Body;
use bytes::Bytes;
use http::{HeaderMap, HeaderName, HeaderValue, Response};
use http_body::{Frame, SizeHint};
use http_body_util::BodyExt;
use kvroute_index::ExtraKeys;
use serde_json::{Map, Value, json};
use tokio::sync::{OwnedSemaphorePermit, oneshot};

use crate::config::PdConvention;
use crate::error::RouterError;
use crate::fleet::booking::Booking;
use crate::http::proxy::{Forward, WORKER_HEADER_NAME};
use crate::http::upstream::{
    BoxError, Failure, GiveUpAt, Held, TrackedBody, WorkerBody, strip_hop_by_hop,
};
use crate::metrics;
use crate::schedule::Pool;
use crate::state::{AppState, RouteInput, Routed};

/// Response header naming the prefill worker of a disaggregated request.
pub const PREFILL_WORKER_HEADER: &str = "x-kvroute-prefill-worker";

const PREFILL_WORKER_HEADER_NAME: HeaderName = HeaderName::from_static(PREFILL_WORKER_HEADER);
const REQUEST_ID: HeaderName = HeaderName::from_static("x-request-id");

/// `kvroute_pd_handoff_failures_total{reason}`: every prefill worker tried failed.
const PREFILL_FAILED: &str = "prefill_failed";
/// No prefill worker could be had (none routable, or all busy past the queue timeout).
const NO_PREFILL_WORKER: &str = "no_prefill_worker";
/// A vLLM prefill answer without `kv_transfer_params`.
const NO_KV_TRANSFER_PARAMS: &str = "no_kv_transfer_params";
/// A vLLM prefill answer over `disaggregation.max_prefill_response_bytes`, or not JSON.
const BAD_PREFILL_ANSWER: &str = "bad_prefill_answer";
/// An SGLang prefill answer that failed after its decode leg had started.
const PREFILL_ANSWER_FAILED: &str = "prefill_answer_failed";

/// Every `reason` of `kvroute_pd_handoff_failures_total`.
pub const HANDOFF_FAILURES: [&str; 5] = [
    PREFILL_FAILED,
    NO_PREFILL_WORKER,
    NO_KV_TRANSFER_PARAMS,
    BAD_PREFILL_ANSWER,
    PREFILL_ANSWER_FAILED,
];

/// Routes and forwards one request for a name decode workers serve.
pub async fn forward(
    state: &Arc<AppState>,
    request: Forward<'_>,
) -> Result<Response<Body>, RouterError> {
    let body: Map<String, Value> = serde_json::from_slice(&request.body)
        .map_err(|e| RouterError::BadRequest(format!("the body is not a JSON object: {e}")))?;
    if decode_alone(state, &request, &body)? {
        ::metrics::counter!(metrics::PD_REQUESTS, "path" => "decode_only").increment(1);
        return crate::http::proxy::forward(state, request).await;
    }
    ::metrics::counter!(metrics::PD_REQUESTS, "path" => "disaggregated").increment(1);
    let input = RouteInput::Prompt {
        tokens: request.tokens,
        extra: request.extra,
    };
    let decode = state
        .route_and_book_in(request.model, Pool::Decode, input, None, None, &[])
        .await?;
    // The decode worker holds the prefix once it has taken the KV over.
    state.record_prediction(&decode);
    let mut headers = request.headers.clone();
    if !headers.contains_key(&REQUEST_ID) {
        let id = format!("{:032x}", rand::random::<u128>());
        headers.insert(REQUEST_ID, HeaderValue::from_str(&id).expect("hex digits"));
    }
    let job = Legs {
        state: Arc::clone(state),
        model: request.model.to_owned(),
        tokens: request.tokens.to_vec(),
        extra: request.extra.clone(),
        path: request.path,
        headers,
        body,
        permit: Some(request.permit),
    };
    // The legs go on if the client leaves: see the module doc.
    let (reply, answer) = oneshot::channel();
    tokio::spawn(job.run(decode, reply));
    answer.await.unwrap_or_else(|_| {
        Err(RouterError::Upstream(
            "the disaggregated request ended without an answer".into(),
        ))
    })
}

/// Whether the request goes to a decode worker alone (see the module doc).
fn decode_alone(
    state: &AppState,
    request: &Forward<'_>,
    body: &Map<String, Value>,
) -> Result<bool, RouterError> {
    let config = &state.config.disaggregation;
    let several = body.get("n").and_then(Value::as_u64).is_some_and(|n| n > 1);
    if request.pin.is_some()
        || several
        || (request.tokens.len() as u64) < config.min_prompt_tokens
        || Pool::Prefill
            .group(&state.registry.lock(), request.model)
            .is_none()
    {
        return Ok(true);
    }
    let input = RouteInput::Prompt {
        tokens: request.tokens,
        extra: request.extra,
    };
    let (cached_blocks, prompt_tokens) = state.cached_now(request.model, Pool::Decode, input)?;
    let cached_tokens = u64::from(cached_blocks) * u64::from(state.config.block_size);
    Ok((prompt_tokens as u64).saturating_sub(cached_tokens) <= config.max_local_prefill_tokens)
}

/// What a prefill worker's response means for the request.
enum Judged {
    /// A success: go on with it.
    Go(Response<WorkerBody>),
    /// The client's body refused (a 4xx), which another worker would refuse
    /// too: the client's answer.
    Refused(Response<Body>),
    /// The worker failed: try another.
    Failed,
}

/// A disaggregated request's legs, run in a task of their own.
struct Legs {
    state: Arc<AppState>,
    model: String,
    tokens: Vec<u32>,
    extra: ExtraKeys,
    path: &'static str,
    /// The client's, with an `X-Request-Id` for both legs.
    headers: HeaderMap,
    /// The client's body.
    body: Map<String, Value>,
    /// The request's place under `limits.max_inflight_requests`, until the
    /// client's answer ends; taken by that answer.
    permit: Option<OwnedSemaphorePermit>,
}

/// What the client is answered with, or why not.
type Answer = Result<Response<Body>, RouterError>;

/// How one prefill attempt went.
enum Prefilled {
    /// The client's answer (from the decode leg, or a refusal from the prefill worker).
    Answered(Answer),
    /// The prefill worker failed before anything reached the client: try
    /// another, with the decode worker's booking given back.
    Failed(Routed<Booking>),
    /// The handoff failed for `reason`: the decode worker computes the request alone.
    Handoff(&'static str, Routed<Booking>),
    /// The client left; the legs are over.
    Left,
}

impl Legs {
    async fn run(mut self, mut decode: Routed<Booking>, mut reply: oneshot::Sender<Answer>) {
        let mut tried = Vec::new();
        let mut failure = NO_PREFILL_WORKER;
        for _ in 0..=self.state.config.upstream.retries {
            if reply.is_closed() {
                // Nothing holds KV for this request yet.
                return;
            }
            let input = RouteInput::Prompt {
                tokens: &self.tokens,
                extra: &self.extra,
            };
            let prefill = match self
                .state
                .route_and_book_in(&self.model, Pool::Prefill, input, None, None, &tried)
                .await
            {
                Ok(prefill) => prefill,
                Err(e) => {
                    tracing::warn!("no prefill worker for a disaggregated request: {e}");
                    break;
                }
            };
            self.state.record_prediction(&prefill);
            let key = prefill.decision.worker;
            let worker = key.worker_id;
            let pd = self.state.registry.pd_role(worker).unwrap_or_default();
            let outcome = match (pd.convention, pd.bootstrap_port) {
                (Some(PdConvention::Vllm), _) => self.vllm(prefill, decode, &reply).await,
                (Some(PdConvention::Sglang), Some(port)) => {
                    self.sglang(prefill, port, decode, &mut reply).await
                }
                // Registrations without them are refused: a worker that
                // registered again as something else in between.
                _ => Prefilled::Failed(decode),
            };
            match outcome {
                Prefilled::Answered(answer) => {
                    let _ = reply.send(answer);
                    return;
                }
                Prefilled::Left => return,
                Prefilled::Handoff(reason, kept) => {
                    (failure, decode) = (reason, kept);
                    break;
                }
                Prefilled::Failed(kept) => {
                    (failure, decode) = (PREFILL_FAILED, kept);
                    // As the proxy does: the prefix is cached elsewhere now.
                    self.state.predicted.remove_worker(key);
                    tried.push(worker);
                }
            }
        }
        ::metrics::counter!(metrics::PD_HANDOFF_FAILURES, "reason" => failure).increment(1);
        if reply.is_closed() {
            return;
        }
        // The decode worker computes the whole request: the client's body as it came.
        let sent = Instant::now();
        let response = self.post(&decode.decision.base_url, json_bytes(&self.body));
        let answer = self.answer(decode, response.await, None, sent, None);
        let _ = reply.send(answer);
    }

    /// The vLLM convention: the prefill leg, then the decode leg with the
    /// prefill answer's `kv_transfer_params`.
    async fn vllm(
        &mut self,
        prefill: Routed<Booking>,
        decode: Routed<Booking>,
        reply: &oneshot::Sender<Answer>,
    ) -> Prefilled {
        let Routed {
            decision,
            booking: mut prefill_booking,
            ..
        } = prefill;
        let worker = decision.worker.worker_id;
        let mut leg = self.body.clone();
        leg.insert(
            "kv_transfer_params".into(),
            json!({
                "do_remote_decode": true,
                "do_remote_prefill": false,
                "remote_engine_id": null,
                "remote_block_ids": null,
                "remote_host": null,
                "remote_port": null,
            }),
        );
        one_token(&mut leg);
        let started = Instant::now();
        let response = self.post(&decision.base_url, json_bytes(&leg)).await;
        let response = match self.judge_prefill(worker, &mut prefill_booking, response) {
            Judged::Go(response) => response,
            Judged::Refused(refusal) => return Prefilled::Answered(Ok(refusal)),
            Judged::Failed => return Prefilled::Failed(decode),
        };
        // Read to its end whatever the client does: see the module doc.
        let max = self.state.config.disaggregation.max_prefill_response_bytes;
        let read = tokio::time::timeout(
            self.state.upstream.idle_timeout(),
            read_to_end(response.into_body(), max),
        )
        .await;
        ::metrics::histogram!(metrics::PD_PREFILL).record(started.elapsed().as_secs_f64());
        let answer = match read {
            Ok(Ok(answer)) => answer,
            Ok(Err(Read::TooLarge)) => {
                crate::limits::count(crate::limits::PREFILL_RESPONSE_BYTES);
                tracing::warn!(
                    worker,
                    "the prefill answer is over disaggregation.max_prefill_response_bytes ({max})"
                );
                prefill_booking.record_outcome(true);
                return Prefilled::Handoff(BAD_PREFILL_ANSWER, decode);
            }
            Ok(Err(Read::Broken(e))) => {
                tracing::warn!(worker, "the prefill answer broke off: {e:?}");
                prefill_booking.record_outcome(false);
                return Prefilled::Failed(decode);
            }
            Err(_) => {
                tracing::warn!(worker, "the prefill answer stalled past the idle timeout");
                prefill_booking.record_outcome(false);
                return Prefilled::Failed(decode);
            }
        };
        prefill_booking.record_outcome(true);
        drop(prefill_booking);
        let params = match serde_json::from_slice::<Value>(&answer) {
            Ok(mut answer) => match answer.get_mut("kv_transfer_params").map(Value::take) {
                Some(params @ Value::Object(_)) => params,
                _ => return Prefilled::Handoff(NO_KV_TRANSFER_PARAMS, decode),
            },
            Err(e) => {
                tracing::warn!(worker, "the prefill answer is not JSON: {e}");
                return Prefilled::Handoff(BAD_PREFILL_ANSWER, decode);
            }
        };
        let mut leg = self.body.clone();
        leg.insert("kv_transfer_params".into(), params);
        if reply.is_closed() {
            // Between the legs: the decode worker takes the KV over for one
            // token, read and dropped, and the prefill worker frees it.
            one_token(&mut leg);
            let response = self.post(&decode.decision.base_url, json_bytes(&leg)).await;
            if let Ok(response) = response {
                let _ = read_to_end(response.into_body(), usize::MAX).await;
            }
            return Prefilled::Left;
        }
        // Not cut if the client leaves meanwhile: the decode worker must get
        // the leg to take the KV over, and its answer's end cancels it.
        let sent = Instant::now();
        let response = self.post(&decode.decision.base_url, json_bytes(&leg)).await;
        Prefilled::Answered(self.answer(decode, response, Some(worker), sent, None))
    }

    /// The SGLang convention: both legs at once, meeting at the prefill
    /// worker's bootstrap server in the room the router draws.
    async fn sglang(
        &mut self,
        prefill: Routed<Booking>,
        bootstrap_port: u16,
        decode: Routed<Booking>,
        reply: &mut oneshot::Sender<Answer>,
    ) -> Prefilled {
        let Routed {
            decision,
            booking: mut prefill_booking,
            ..
        } = prefill;
        let worker = decision.worker.worker_id;
        let dp_size = {
            let fleet = self.state.registry.lock();
            fleet
                .workers
                .get(&decode.decision.worker.worker_id)
                .map_or(1, |w| w.dp_ranks.len())
        };
        let mut leg = self.body.clone();
        leg.insert("bootstrap_host".into(), json!(host(&decision.base_url)));
        leg.insert("bootstrap_port".into(), json!(bootstrap_port));
        leg.insert(
            "bootstrap_room".into(),
            json!(bootstrap_room(
                rand::random(),
                decode.decision.worker.dp_rank,
                dp_size
            )),
        );
        let leg = json_bytes(&leg);
        let sent = Instant::now();
        let mut decode_leg = tokio::spawn(post(
            Arc::clone(&self.state),
            Arc::clone(&decode.decision.base_url),
            self.path,
            self.headers.clone(),
            leg.clone(),
        ));
        let response = tokio::select! {
            response = self.post(&decision.base_url, leg) => response,
            () = reply.closed() => {
                decode_leg.abort();
                return Prefilled::Left;
            }
        };
        let response = match self.judge_prefill(worker, &mut prefill_booking, response) {
            Judged::Go(response) => response,
            Judged::Refused(refusal) => {
                decode_leg.abort();
                return Prefilled::Answered(Ok(refusal));
            }
            Judged::Failed => {
                decode_leg.abort();
                return Prefilled::Failed(decode);
            }
        };
        let (ended, client_left) = oneshot::channel();
        tokio::spawn(drain_prefill(
            response.into_body(),
            prefill_booking,
            sent,
            self.state.upstream.first_byte_timeout(),
            client_left,
        ));
        // The prefill leg's reader cancels it once `ended` is dropped unsent.
        let response = tokio::select! {
            joined = &mut decode_leg => {
                joined.unwrap_or_else(|e| Err(Failure::Other(e.to_string())))
            }
            () = reply.closed() => {
                decode_leg.abort();
                return Prefilled::Left;
            }
        };
        Prefilled::Answered(self.answer(decode, response, Some(worker), sent, Some(ended)))
    }

    /// POSTs a leg's `body` to `base_url`, with the client's headers.
    fn post(
        &self,
        base_url: &Arc<str>,
        body: Bytes,
    ) -> impl Future<Output = Result<Response<WorkerBody>, Failure>> + use<> {
        post(
            Arc::clone(&self.state),
            Arc::clone(base_url),
            self.path,
            self.headers.clone(),
            body,
        )
    }

    /// What the prefill worker's response means for the request.
    fn judge_prefill(
        &self,
        worker: u64,
        booking: &mut Booking,
        response: Result<Response<WorkerBody>, Failure>,
    ) -> Judged {
        match response {
            Ok(response) if response.status().is_success() => Judged::Go(response),
            Ok(response) if response.status().is_client_error() => {
                booking.record_outcome(true);
                let (mut parts, body) = response.into_parts();
                strip_hop_by_hop(&mut parts.headers);
                parts
                    .headers
                    .insert(PREFILL_WORKER_HEADER_NAME, HeaderValue::from(worker));
                Judged::Refused(Response::from_parts(parts, Body::new(body)))
            }
            Ok(response) => {
                booking.record_outcome(false);
                tracing::warn!(worker, status = %response.status(), "prefill leg failed");
                Judged::Failed
            }
            Err(failure) => {
                tracing::warn!(worker, "prefill leg failed: {failure:?}");
                self.failed(worker, booking, &failure);
                Judged::Failed
            }
        }
    }

    /// Counts `failure` for the worker's breaker, as the proxy does.
    fn failed(&self, worker: u64, booking: &mut Booking, failure: &Failure) {
        match failure {
            Failure::Connect(_) | Failure::Timeout => booking.record_outcome(false),
            Failure::Other(_) => self.state.registry.suspect(worker),
            Failure::Left => {}
        }
    }

    /// The client's answer from the decode leg sent at `sent`; `ended` is told
    /// when that answer has ended as the worker meant it to.
    fn answer(
        &mut self,
        decode: Routed<Booking>,
        response: Result<Response<WorkerBody>, Failure>,
        prefill: Option<u64>,
        sent: Instant,
        ended: Option<oneshot::Sender<()>>,
    ) -> Answer {
        let Routed {
            decision,
            mut booking,
            local_hashes,
            ..
        } = decode;
        let worker = decision.worker.worker_id;
        let response = match response {
            Ok(response) if !response.status().is_server_error() => response,
            Ok(response) => {
                booking.record_outcome(false);
                tracing::warn!(worker, status = %response.status(), "decode leg failed");
                let error = format!("worker {worker} answered {}", response.status());
                return Err(RouterError::Upstream(error));
            }
            Err(failure) => {
                tracing::warn!(worker, "decode leg failed: {failure:?}");
                self.failed(worker, &mut booking, &failure);
                return Err(match failure {
                    Failure::Timeout => RouterError::UpstreamTimeout(format!(
                        "worker {worker} sent no response within {} ms",
                        self.state.config.upstream.first_byte_timeout_ms
                    )),
                    Failure::Connect(_) => {
                        RouterError::Upstream(format!("cannot connect to worker {worker}"))
                    }
                    Failure::Other(_) | Failure::Left => RouterError::Upstream(format!(
                        "worker {worker} closed the connection before it answered"
                    )),
                });
            }
        };
        let Some(permit) = self.permit.take() else {
            return Err(RouterError::Upstream("a request answered twice".into()));
        };
        let (mut parts, incoming) = response.into_parts();
        strip_hop_by_hop(&mut parts.headers);
        parts
            .headers
            .insert(WORKER_HEADER_NAME, HeaderValue::from(worker));
        if let Some(prefill) = prefill {
            parts
                .headers
                .insert(PREFILL_WORKER_HEADER_NAME, HeaderValue::from(prefill));
        }
        let sse = parts
            .headers
            .get(http::header::CONTENT_TYPE)
            .is_some_and(|v| v.as_bytes().starts_with(b"text/event-stream"));
        let held = Held {
            blocks: self.state.index.pin_path_owned(&local_hashes),
            permit,
        };
        // No cached-tokens check: a handed-over prefix is transferred, not cached.
        let body = TrackedBody::new(
            incoming,
            booking,
            held,
            sent,
            self.state.upstream.idle_timeout(),
            sse,
            None,
        );
        Ok(Response::from_parts(
            parts,
            Body::new(Ended { inner: body, ended }),
        ))
    }
}

/// POSTs `body` to `base_url` + `path`, waiting at most the first-byte timeout
/// for the response's headers.
async fn post(
    state: Arc<AppState>,
    base_url: Arc<str>,
    path: &'static str,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response<WorkerBody>, Failure> {
    let mut deadline = GiveUpAt(tokio::time::Instant::now() + state.upstream.first_byte_timeout());
    state
        .upstream
        .post(&base_url, path, &headers, body, &mut deadline)
        .await
}

/// Makes a leg generate one token and answer in one piece: what the prefill
/// leg and the leg that only takes the KV over ask, with nothing strict
/// engines refuse (`stream_options` without `stream`, `min_tokens` above
/// `max_tokens`, or `max_tokens` beside `max_completion_tokens` the client
/// did not send).
fn one_token(leg: &mut Map<String, Value>) {
    if leg.contains_key("max_completion_tokens") {
        leg.insert("max_completion_tokens".into(), json!(1));
        if leg.contains_key("max_tokens") {
            leg.insert("max_tokens".into(), json!(1));
        }
    } else {
        leg.insert("max_tokens".into(), json!(1));
    }
    leg.insert("stream".into(), json!(false));
    for field in ["stream_options", "min_tokens", "min_completion_tokens"] {
        leg.remove(field);
    }
}

fn json_bytes(body: &Map<String, Value>) -> Bytes {
    serde_json::to_vec(body)
        .expect("a JSON object serializes")
        .into()
}

/// The host of a worker's base URL (checked where it entered), without IPv6 brackets.
fn host(base_url: &str) -> String {
    let host = base_url
        .parse::<http::Uri>()
        .ok()
        .and_then(|uri| uri.host().map(str::to_owned))
        .unwrap_or_default();
    host.trim_start_matches('[')
        .trim_end_matches(']')
        .to_owned()
}

/// An SGLang bootstrap room from `random`: a non-negative 63-bit integer that
/// the decode worker's `dp_size` data-parallel ranks map to `dp_rank` (they
/// take `room % dp_size`), so the rank the router booked is the one that decodes.
fn bootstrap_room(random: u64, dp_rank: u32, dp_size: usize) -> u64 {
    let size = dp_size.max(1) as u64;
    let random = random >> 1;
    let room = random - random % size + u64::from(dp_rank) % size;
    if room > i64::MAX as u64 {
        room - size
    } else {
        room
    }
}

/// Why a body was not read whole.
#[derive(Debug)]
enum Read {
    TooLarge,
    Broken(BoxError),
}

/// Reads `body` to its end, holding at most `max` bytes of it.
async fn read_to_end(mut body: WorkerBody, max: usize) -> Result<Vec<u8>, Read> {
    let mut read = Vec::new();
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(|e| Read::Broken(e.into()))?;
        if let Some(data) = frame.data_ref() {
            if read.len() + data.len() > max {
                return Err(Read::TooLarge);
            }
            if max != usize::MAX {
                read.extend_from_slice(data);
            }
        }
    }
    Ok(read)
}

/// Reads an SGLang prefill answer to its end and drops it, counting its
/// failure; cancels it (drops it, which closes its connection) if the
/// client's answer ends before it does without ending as meant
/// (`client_left`'s sender dropped unsent).
async fn drain_prefill(
    body: WorkerBody,
    mut booking: Booking,
    sent: Instant,
    timeout: std::time::Duration,
    mut client_left: oneshot::Receiver<()>,
) {
    let read = std::pin::pin!(tokio::time::timeout(timeout, read_to_end(body, usize::MAX)));
    let mut read = read;
    let read = tokio::select! {
        read = read.as_mut() => read,
        ended = &mut client_left => match ended {
            Ok(()) => read.await,
            Err(_) => return,
        },
    };
    let worker = booking.key().worker_id;
    match read {
        Ok(Ok(_)) => {
            ::metrics::histogram!(metrics::PD_PREFILL).record(sent.elapsed().as_secs_f64());
            booking.record_outcome(true);
        }
        Ok(Err(e)) => {
            tracing::warn!(worker, "the prefill answer broke off: {e:?}");
            ::metrics::counter!(metrics::PD_HANDOFF_FAILURES, "reason" => PREFILL_ANSWER_FAILED)
                .increment(1);
            booking.record_outcome(false);
        }
        Err(_) => {
            tracing::warn!(
                worker,
                "the prefill answer did not end within the first-byte timeout"
            );
            ::metrics::counter!(metrics::PD_HANDOFF_FAILURES, "reason" => PREFILL_ANSWER_FAILED)
                .increment(1);
            booking.record_outcome(false);
        }
    }
}

pin_project_lite::pin_project! {
    /// The client's answer, telling `ended` once it has ended as the worker
    /// meant it to; dropped before that, `ended` goes unsent.
    struct Ended {
        #[pin]
        inner: TrackedBody,
        ended: Option<oneshot::Sender<()>>,
    }
}

impl http_body::Body for Ended {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let mut this = self.project();
        let polled = this.inner.as_mut().poll_frame(cx);
        let done = match &polled {
            Poll::Ready(None) => true,
            Poll::Ready(Some(Ok(_))) => this.inner.is_end_stream(),
            _ => false,
        };
        if done && let Some(ended) = this.ended.take() {
            let _ = ended.send(());
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bootstrap_room_is_63_bits_and_lands_on_the_booked_dp_rank() {
        for random in [0, 1, 7, u64::MAX, u64::MAX - 3, 1 << 63, (1 << 63) - 1] {
            for (dp_rank, dp_size) in [(0, 1), (3, 4), (0, 4), (5, 8), (2, 3)] {
                let room = bootstrap_room(random, dp_rank, dp_size);
                assert!(room <= i64::MAX as u64, "{room}");
                assert_eq!(room % dp_size as u64, u64::from(dp_rank));
            }
        }
    }

    #[test]
    fn a_one_token_leg_drops_what_strict_engines_refuse_and_keeps_the_rest() {
        let mut leg: Map<String, Value> = serde_json::from_value(json!({
            "model": "m", "prompt": [1, 2], "stream": true,
            "stream_options": {"include_usage": true}, "min_tokens": 4,
            "max_tokens": 64, "cache_salt": "s", "unknown_field": {"kept": true},
        }))
        .unwrap();
        one_token(&mut leg);
        assert_eq!(
            Value::Object(leg),
            json!({"model": "m", "prompt": [1, 2], "stream": false, "max_tokens": 1,
                   "cache_salt": "s", "unknown_field": {"kept": true}})
        );
        let mut chat: Map<String, Value> = serde_json::from_value(json!({
            "model": "m", "messages": [], "max_completion_tokens": 64,
            "min_completion_tokens": 2,
        }))
        .unwrap();
        one_token(&mut chat);
        assert_eq!(
            Value::Object(chat),
            json!({"model": "m", "messages": [], "max_completion_tokens": 1, "stream": false}),
            "max_tokens is not added beside the client's max_completion_tokens"
        );
    }

    #[test]
    fn a_bootstrap_host_is_the_base_urls_without_brackets() {
        assert_eq!(host("http://10.0.0.5:8000"), "10.0.0.5");
        assert_eq!(host("http://[::1]:8000/v1"), "::1");
        assert_eq!(host("https://prefill-0.svc:443"), "prefill-0.svc");
    }
}
