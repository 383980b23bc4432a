//! The proxy policy for one OpenAI request: route it (choosing and booking a
//! rank), forward it, retry a failure that cannot have reached a model on the
//! next-best worker, and feed every outcome to the worker's breaker.
//!
//! Kept apart from the HTTP handlers in [`crate::api`], which only parse and
//! answer: the policy decides what a failure means for routing (retry, breaker,
//! predictions), and [`crate::upstream`] does the talking and the measuring.

use std::pin::Pin;
use std::time::Instant;

use axum::body::Body;
use bytes::Bytes;
use http::{HeaderMap, HeaderValue, Response, header};
use kvroute_index::ExtraKeys;
use tokio::sync::OwnedSemaphorePermit;

use crate::booking::Booking;
use crate::cached_tokens::{Check, Prediction};
use crate::error::RouterError;
use crate::metrics;
use crate::state::{AppState, RouteInput, Routed};
use crate::upstream::{Failure, Held, TrackedBody, strip_hop_by_hop};

/// Request and response header naming the worker (pins a request; tells the choice).
pub const WORKER_HEADER: &str = "x-kvroute-worker";

/// A parsed OpenAI request, ready to route.
pub struct Forward<'a> {
    /// The model or adapter name.
    pub model: &'a str,
    pub tokens: &'a [u32],
    /// What keys its blocks besides the tokens (`cache_salt`, images).
    pub extra: &'a ExtraKeys,
    /// The worker the client pinned with [`WORKER_HEADER`].
    pub pin: Option<u64>,
    /// The endpoint's path on the worker.
    pub path: &'static str,
    pub headers: &'a HeaderMap,
    /// The body, forwarded unchanged.
    pub body: Bytes,
    /// When the router received the request, for the overhead metric.
    pub received: Instant,
    /// Its place under `limits.max_inflight_requests`, until the response ends.
    pub permit: OwnedSemaphorePermit,
}

/// Routes and forwards one request; retries a connect error or a 5xx on the
/// next-best worker, never once the response has started.
pub async fn forward(
    state: &AppState,
    request: Forward<'_>,
) -> Result<Response<Body>, RouterError> {
    let retries = state.config.upstream.retries;
    let mut tried: Vec<u64> = Vec::new();
    let mut last_error = None;
    let mut permit = Some(request.permit);
    for _attempt in 0..=retries {
        let routed = match state
            .route_and_book(
                request.model,
                RouteInput::Prompt {
                    tokens: request.tokens,
                    extra: request.extra,
                },
                request.pin,
                &tried,
            )
            .await
        {
            Ok(routed) => routed,
            // Out of workers to retry on: report what went wrong upstream.
            Err(e) => return Err(last_error.unwrap_or(e)),
        };
        state.record_prediction(&routed);
        // The worker uses these blocks until the response ends: keep them indexed.
        let pinned = state.index.pin_path_owned(&routed.local_hashes);
        let Routed {
            decision,
            mut booking,
            ..
        } = routed;
        let worker = decision.worker;
        if decision.request_blocks > 0 {
            metrics::hot()
                .predicted_overlap
                .record(decision.overlap_blocks as f64 / decision.request_blocks as f64);
        }
        let prompt_tokens = request.tokens.len() as u64;
        let hot = metrics::hot();
        hot.routed_prompt_tokens.increment(prompt_tokens);
        let predicted_cached_tokens = prompt_tokens.saturating_sub(decision.new_prefill_tokens);
        hot.predicted_cached_tokens
            .increment(predicted_cached_tokens);
        if tried.is_empty() {
            metrics::observe_phase("total", request.received);
        }
        let sent = Instant::now();
        let post = std::pin::pin!(state.upstream.post(
            &decision.base_url,
            request.path,
            request.headers,
            request.body.clone(),
        ));
        let result = until_response(post, &mut booking).await;
        let reason = match result {
            Ok(response) if !response.status().is_server_error() => {
                let (mut parts, incoming) = response.into_parts();
                strip_hop_by_hop(&mut parts.headers);
                parts
                    .headers
                    .insert(WORKER_HEADER, HeaderValue::from(worker.worker_id));
                let sse = parts
                    .headers
                    .get(header::CONTENT_TYPE)
                    .is_some_and(|v| v.as_bytes().starts_with(b"text/event-stream"));
                let check = parts.status.is_success().then(|| {
                    Check::new(Prediction {
                        prompt_tokens,
                        cached_tokens: predicted_cached_tokens,
                    })
                });
                let held = Held {
                    blocks: pinned,
                    permit: permit
                        .take()
                        .expect("only the attempt that answers takes it"),
                };
                let body = TrackedBody::new(
                    incoming,
                    booking,
                    held,
                    sent,
                    state.upstream.idle_timeout(),
                    sse,
                    check,
                );
                return Ok(Response::from_parts(parts, Body::new(body)));
            }
            Ok(response) => {
                last_error = Some(RouterError::Upstream(format!(
                    "worker {} answered {}",
                    worker.worker_id,
                    response.status()
                )));
                "status"
            }
            Err(Failure::Connect(e)) => {
                last_error = Some(RouterError::Upstream(format!(
                    "cannot connect to worker {}: {e}",
                    worker.worker_id
                )));
                "connect"
            }
            Err(Failure::Timeout) => {
                booking.record_outcome(false);
                return Err(RouterError::UpstreamTimeout(format!(
                    "worker {} sent no response within {} ms",
                    worker.worker_id, state.config.upstream.first_byte_timeout_ms
                )));
            }
            Err(Failure::Other(e)) => {
                booking.record_outcome(false);
                return Err(RouterError::Upstream(format!(
                    "worker {} failed: {e}",
                    worker.worker_id
                )));
            }
        };
        booking.record_outcome(false);
        tracing::warn!(worker = worker.worker_id, reason, "upstream attempt failed");
        // The prefix will be cached where the request is served, not here. The
        // predicted layer cannot drop one path without breaking the prefix
        // order its lookups rely on, so the failed worker loses all its
        // predictions: it just failed, and its events still say what it holds.
        state.predicted.remove_worker(worker);
        drop(booking);
        tried.push(worker.worker_id);
        if request.pin.is_some() {
            break;
        }
        ::metrics::counter!(metrics::RETRIES, "reason" => reason).increment(1);
    }
    Err(last_error.expect("the loop ran at least once and failed"))
}

/// Waits for the worker's response headers. A non-streaming response's headers
/// come only when generation is over, so the request's prefill booking is
/// released at the estimated first token meanwhile (see [`crate::booking`]).
/// `post` is pinned by the caller, so that its future is stored once.
async fn until_response<T>(
    mut post: Pin<&mut impl Future<Output = T>>,
    booking: &mut Booking,
) -> T {
    let Some(estimate) = booking.first_token_estimate() else {
        return post.await;
    };
    tokio::select! {
        response = &mut post => response,
        _ = tokio::time::sleep(estimate) => {
            booking.release_prefill();
            post.await
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::Duration;

    use kvroute_index::WorkerKey;

    use super::until_response;
    use crate::registry::tests::{limits, reg};
    use crate::registry::{Registry, Source};

    const KEY: WorkerKey = WorkerKey {
        worker_id: 1,
        dp_rank: 0,
    };

    fn booked_prefill(registry: &Registry) -> u64 {
        registry.lock().ranks[&KEY].booked_prefill_tokens
    }

    #[tokio::test(start_paused = true)]
    async fn a_non_streaming_requests_prefill_is_released_at_its_estimated_first_token() {
        let registry = Arc::new(Registry::new(limits()));
        registry.register(reg(1, &["m"]), Source::Stream).unwrap();
        // A stream on the rank took 1 ms per prefilled token to its first token.
        let mut stream = registry.book(KEY, 100, 1);
        stream.first_token(Duration::from_millis(100));
        drop(stream);

        let mut booking = registry.book(KEY, 200, 1);
        assert_eq!(
            booking.first_token_estimate(),
            Some(Duration::from_millis(200))
        );
        // The worker answers only when generation is over, after 5 s.
        let generation = std::pin::pin!(tokio::time::sleep(Duration::from_secs(5)));
        let observe = async {
            tokio::time::sleep(Duration::from_millis(150)).await;
            let before = booked_prefill(&registry);
            tokio::time::sleep(Duration::from_millis(100)).await;
            (before, booked_prefill(&registry))
        };
        let ((), (before, after)) = tokio::join!(until_response(generation, &mut booking), observe);
        assert_eq!((before, after), (200, 0));
        assert_eq!(
            registry.lock().ranks[&KEY].booked_requests,
            1,
            "still in flight"
        );
    }
}
