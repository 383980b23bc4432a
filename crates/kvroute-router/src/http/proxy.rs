//! The proxy policy for one OpenAI request: route it (choosing and booking a
//! rank), forward it, retry a failure that cannot have reached a model on the
//! next-best worker, and feed every outcome to the worker's breaker.
//!
//! Kept apart from the HTTP handlers in [`crate::http::api`], which only parse and
//! answer: the policy decides what a failure means for routing (retry, breaker,
//! predictions), and [`crate::http::upstream`] does the talking and the measuring.

use std::cell::RefCell;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use axum::body::Body;
use bytes::Bytes;
use http::{HeaderMap, HeaderName, HeaderValue, Response, header};
use kvroute_index::ExtraKeys;
use rustc_hash::FxHashMap;
use tokio::sync::OwnedSemaphorePermit;

use crate::cached_tokens::{Check, Prediction};
use crate::error::RouterError;
use crate::fleet::booking::Booking;
use crate::http::upstream::{Deadlines, Failure, Held, TrackedBody, strip_hop_by_hop};
use crate::metrics;
use crate::state::{AppState, RouteInput, Routed};

/// Request and response header naming the worker (pins a request; tells the choice).
pub const WORKER_HEADER: &str = "x-kvroute-worker";

/// [`WORKER_HEADER`] as a header name, not parsed from the string per use.
pub(crate) const WORKER_HEADER_NAME: HeaderName = HeaderName::from_static(WORKER_HEADER);

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
        let claimed_tokens = (u64::from(decision.claimed_blocks)
            * u64::from(state.config.block_size))
        .min(prompt_tokens);
        hot.predicted_cached_tokens
            .increment(predicted_cached_tokens);
        // One reading: the overhead's end, the first-byte timeout's start and
        // the response's (latency, idle deadline).
        let sent_at = tokio::time::Instant::now();
        let sent = sent_at.into_std();
        if tried.is_empty() {
            metrics::record_phase(metrics::Phase::Total, sent.duration_since(request.received));
        }
        let timeout = state.upstream.first_byte_timeout();
        // Taken before sending: a departure from then on ends the wait.
        let mut left = booking.departures();
        let left = std::pin::pin!(async move {
            if let Some(left) = &mut left {
                // A closed channel (the worker is gone) is a departure too.
                let _ = left.changed().await;
            }
        });
        let result = state
            .upstream
            .post(
                &decision.base_url,
                request.path,
                request.headers,
                request.body.clone(),
                &mut FirstByte::new(&mut booking, sent_at, timeout, left),
            )
            .await;
        // The client is told what failed, never how: the detail names the
        // worker's address and the library's internals, and goes to the log.
        let worker_id = worker.worker_id;
        let (reason, error, retry) = match result {
            Ok(response) if !response.status().is_server_error() => {
                let (mut parts, incoming) = response.into_parts();
                strip_hop_by_hop(&mut parts.headers);
                parts
                    .headers
                    .insert(WORKER_HEADER_NAME, worker_header_value(worker.worker_id));
                let sse = parts
                    .headers
                    .get(header::CONTENT_TYPE)
                    .is_some_and(|v| v.as_bytes().starts_with(b"text/event-stream"));
                let check = parts.status.is_success().then(|| {
                    Check::new(Prediction {
                        prompt_tokens,
                        cached_tokens: predicted_cached_tokens,
                        claimed_tokens,
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
                booking.record_outcome(false);
                tracing::warn!(worker = worker_id, status = %response.status(), "upstream attempt failed");
                let error = format!("worker {worker_id} answered {}", response.status());
                ("status", RouterError::Upstream(error), true)
            }
            Err(Failure::Connect(detail)) => {
                booking.record_outcome(false);
                tracing::warn!(worker = worker_id, "cannot connect to the worker: {detail}");
                let error = format!("cannot connect to worker {worker_id}");
                ("connect", RouterError::Upstream(error), true)
            }
            // The departure was the verdict on the worker: no outcome of its own.
            Err(Failure::Left) => {
                tracing::warn!(
                    worker = worker_id,
                    "the worker left routing before it answered"
                );
                let error = format!("worker {worker_id} left routing before it answered");
                ("left", RouterError::Upstream(error), true)
            }
            Err(Failure::Timeout) => {
                booking.record_outcome(false);
                let error = RouterError::UpstreamTimeout(format!(
                    "worker {worker_id} sent no response within {} ms",
                    state.config.upstream.first_byte_timeout_ms
                ));
                ("timeout", error, false)
            }
            // A body the worker refused looks like this, and another worker
            // would refuse it too: not retried, and not a failure for the
            // breaker, which a client could otherwise open with such bodies.
            // A worker that died fails its health check (asked for now) and
            // its next connects, which do count.
            Err(Failure::Other(detail)) => {
                tracing::warn!(
                    worker = worker_id,
                    "the worker's connection failed before it answered: {detail}"
                );
                state.registry.suspect(worker_id);
                let error = format!(
                    "worker {worker_id} closed the connection before it answered \
                     (it may refuse this request, e.g. its size)"
                );
                ("closed", RouterError::Upstream(error), false)
            }
        };
        // The prefix will be cached where the request is served, not here. The
        // predicted layer cannot drop one path without breaking the prefix
        // order its lookups rely on, so the failed worker loses all its
        // predictions: it just failed, and its events still say what it holds.
        state.predicted.remove_worker(worker);
        drop(booking);
        if !retry {
            return Err(error);
        }
        last_error = Some(error);
        tried.push(worker_id);
        if request.pin.is_some() {
            break;
        }
        ::metrics::counter!(metrics::RETRIES, "reason" => reason).increment(1);
    }
    Err(last_error.expect("the loop ran at least once and failed"))
}

/// The [`WORKER_HEADER`] value naming `worker_id`, made once per worker and
/// runtime thread: formatting it per response took two allocations.
fn worker_header_value(worker_id: u64) -> HeaderValue {
    /// Workers come and go: the values of ones long gone are dropped now and then.
    const KEPT: usize = 4096;
    thread_local! {
        static VALUES: RefCell<FxHashMap<u64, HeaderValue>> = RefCell::default();
    }
    VALUES.with_borrow_mut(|values| {
        if values.len() >= KEPT && !values.contains_key(&worker_id) {
            values.clear();
        }
        values
            .entry(worker_id)
            .or_insert_with(|| HeaderValue::from(worker_id))
            .clone()
    })
}

/// The deadlines of a wait for the worker's response headers: at most
/// `first_byte_timeout`. A non-streaming response's headers come only when
/// generation is over, so the request's prefill booking is released at the
/// estimated first token meanwhile (see [`crate::fleet::booking`]). One timer serves
/// both deadlines: set for the estimate, then moved to the timeout when it
/// fires. The timer is the worker connection's, kept from one request to the
/// next (see [`crate::http::upstream`]).
struct FirstByte<'a, L> {
    booking: &'a mut Booking,
    estimate: Option<tokio::time::Instant>,
    timed_out: tokio::time::Instant,
    /// Ready once the worker left routing.
    left: Pin<&'a mut L>,
}

impl<'a, L: Future<Output = ()>> FirstByte<'a, L> {
    /// For a request sent at `started`.
    fn new(
        booking: &'a mut Booking,
        started: tokio::time::Instant,
        first_byte_timeout: Duration,
        left: Pin<&'a mut L>,
    ) -> Self {
        // An estimate past the timeout would never be reached.
        let estimate = booking
            .first_token_estimate()
            .filter(|&estimate| estimate < first_byte_timeout)
            .map(|estimate| started + estimate);
        Self {
            booking,
            estimate,
            timed_out: started + first_byte_timeout,
            left,
        }
    }
}

impl<L: Future<Output = ()>> Deadlines for FirstByte<'_, L> {
    fn next(&self) -> tokio::time::Instant {
        self.estimate.unwrap_or(self.timed_out)
    }

    fn passed(&mut self) -> bool {
        if self.estimate.take().is_none() {
            return false;
        }
        self.booking.release_prefill();
        true
    }

    fn poll_left(&mut self, cx: &mut Context<'_>) -> Poll<()> {
        self.left.as_mut().poll(cx)
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::Duration;

    use kvroute_index::WorkerKey;

    use super::FirstByte;
    use crate::fleet::booking::Booking;
    use crate::fleet::tests::{limits, reg};
    use crate::fleet::{Registry, Source};
    use crate::http::upstream::{Deadlines, Failure, within};

    const KEY: WorkerKey = WorkerKey {
        worker_id: 1,
        dp_rank: 0,
    };

    fn booked_prefill(registry: &Registry) -> u64 {
        registry.lock().ranks[&KEY].booked_prefill_tokens
    }

    /// A rank whose streams took 1 ms per prefilled token to their first
    /// token, and a booking of 200 prompt tokens on it (estimate: 200 ms).
    fn booked_with_estimate() -> (Arc<Registry>, crate::fleet::booking::Booking) {
        let registry = Arc::new(Registry::new(limits()));
        registry.register(reg(1, &["m"]), Source::Stream).unwrap();
        let mut stream = registry.book(KEY, 100, 1);
        stream.first_token(Duration::from_millis(100));
        drop(stream);
        let booking = registry.book(KEY, 200, 1);
        assert_eq!(
            booking.first_token_estimate(),
            Some(Duration::from_millis(200))
        );
        (registry, booking)
    }

    /// Waits for `answer` as [`crate::http::upstream::Upstream::post`] waits for a
    /// worker's response headers, for a request sent at `started`.
    async fn until_response(
        answer: impl Future<Output = Result<(), Failure>>,
        booking: &mut Booking,
        started: tokio::time::Instant,
        first_byte_timeout: Duration,
    ) -> Result<(), Failure> {
        let never = std::pin::pin!(std::future::pending());
        let mut deadlines = FirstByte::new(booking, started, first_byte_timeout, never);
        let mut timer = Box::pin(tokio::time::sleep_until(deadlines.next()));
        within(answer, &mut timer, &mut deadlines).await
    }

    /// A worker that answers only when generation is over, after `after`.
    async fn answers_after(after: Duration) -> Result<(), Failure> {
        tokio::time::sleep(after).await;
        Ok(())
    }

    #[tokio::test(start_paused = true)]
    async fn a_non_streaming_requests_prefill_is_released_at_its_estimated_first_token() {
        let (registry, mut booking) = booked_with_estimate();
        let generation = std::pin::pin!(answers_after(Duration::from_secs(5)));
        let observe = async {
            tokio::time::sleep(Duration::from_millis(150)).await;
            let before = booked_prefill(&registry);
            tokio::time::sleep(Duration::from_millis(100)).await;
            (before, booked_prefill(&registry))
        };
        let (answer, (before, after)) = tokio::join!(
            until_response(
                generation,
                &mut booking,
                tokio::time::Instant::now(),
                Duration::from_secs(60)
            ),
            observe
        );
        assert!(answer.is_ok());
        assert_eq!((before, after), (200, 0));
        assert_eq!(
            registry.lock().ranks[&KEY].booked_requests,
            1,
            "still in flight"
        );
    }

    /// Waits for a worker that never answers, from [`booked_with_estimate`],
    /// with `first_byte_timeout`: the answer, the time it took and the
    /// prefill still booked after.
    async fn silent_worker(first_byte_timeout: Duration) -> (Result<(), Failure>, Duration, u64) {
        let (registry, mut booking) = booked_with_estimate();
        let started = tokio::time::Instant::now();
        let silent = std::pin::pin!(answers_after(Duration::from_secs(3600)));
        let answer = until_response(silent, &mut booking, started, first_byte_timeout).await;
        (answer, started.elapsed(), booked_prefill(&registry))
    }

    #[tokio::test(start_paused = true)]
    async fn the_first_byte_timeout_fires_after_the_estimate_released_the_prefill() {
        let (answer, waited, booked) = silent_worker(Duration::from_secs(2)).await;
        assert!(matches!(answer, Err(Failure::Timeout)), "{answer:?}");
        assert_eq!(waited, Duration::from_secs(2));
        assert_eq!(booked, 0, "released at the estimate");
    }

    #[tokio::test(start_paused = true)]
    async fn a_timeout_before_the_estimate_fires_at_the_timeout() {
        let (answer, waited, booked) = silent_worker(Duration::from_millis(50)).await;
        assert!(matches!(answer, Err(Failure::Timeout)), "{answer:?}");
        assert_eq!(waited, Duration::from_millis(50));
        assert_eq!(booked, 200, "the estimate never came");
    }
}
