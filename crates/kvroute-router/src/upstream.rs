//! Talking to workers' HTTP servers: the pooled client with its timeouts, and the
//! response body wrapper that measures a response and releases its booking.
//!
//! The worker's body is handed to the client frame by frame as it arrives, so a
//! slow client slows the worker's stream down (backpressure) instead of the
//! router buffering it, and a client that goes away drops the body, which closes
//! the upstream connection: the worker sees the cancel.
//!
//! `https://` workers go through a second client with rustls (trusting the
//! system's roots and `upstream.ca_file`); `http://` ones never touch TLS.

use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{HeaderMap, Request, Response, header};
use http_body::{Body, Frame, SizeHint};
use http_body_util::Full;
use hyper::body::Incoming;
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::{Client, ResponseFuture};
use hyper_util::rt::{TokioExecutor, TokioTimer};
use kvroute_index::OwnedPinnedPath;
use tokio::sync::OwnedSemaphorePermit;

use crate::booking::Booking;
use crate::cached_tokens::Check;
use crate::config::UpstreamConfig;
use crate::error::RouterError;
use crate::metrics;

pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

pub struct Upstream {
    client: Client<HttpConnector, Full<Bytes>>,
    https: Client<HttpsConnector<HttpConnector>, Full<Bytes>>,
    first_byte_timeout: Duration,
    idle_timeout: Duration,
    health_timeout: Duration,
}

/// Why an upstream attempt failed before a response started.
#[derive(Debug)]
pub enum Failure {
    /// The connection could not be made: nothing reached the worker, safe to retry.
    Connect(String),
    /// No response headers within the first-byte timeout.
    Timeout,
    /// Anything else (the worker may have seen the request).
    Other(String),
}

/// Request headers not forwarded: hop-by-hop ones, and the router's own.
const DROPPED_REQUEST_HEADERS: [&str; 6] = [
    "host",
    "content-length",
    "connection",
    "transfer-encoding",
    "keep-alive",
    "x-kvroute-worker",
];

impl Upstream {
    pub fn new(config: &UpstreamConfig) -> Result<Self, RouterError> {
        let mut connector = HttpConnector::new();
        connector.set_connect_timeout(Some(Duration::from_millis(config.connect_timeout_ms)));
        connector.set_nodelay(true);
        let ca_file =
            Some(std::path::Path::new(&config.ca_file)).filter(|_| !config.ca_file.is_empty());
        let tls = kvroute_tls::https_client_config(ca_file)
            .map_err(|e| RouterError::Config(format!("upstream.ca_file: {e}")))?;
        let mut tls_connector = connector.clone();
        // The plain connector refuses https:// URIs; here TLS wraps it.
        tls_connector.enforce_http(false);
        let tls_connector = hyper_rustls::HttpsConnectorBuilder::new()
            .with_tls_config(tls)
            .https_only()
            .enable_http1()
            .wrap_connector(tls_connector);
        let mut builder = Client::builder(TokioExecutor::new());
        // Without a pool timer hyper-util enforces the idle timeout only at
        // checkout, so a worker's idle connections from its busiest moment
        // (a descriptor and a task each) would stay open for good.
        builder
            .pool_idle_timeout(Duration::from_secs(90))
            .pool_timer(TokioTimer::new());
        Ok(Self {
            client: builder.build(connector),
            https: builder.build(tls_connector),
            first_byte_timeout: Duration::from_millis(config.first_byte_timeout_ms),
            idle_timeout: Duration::from_millis(config.idle_timeout_ms),
            health_timeout: Duration::from_millis(config.health_timeout_ms),
        })
    }

    fn send(&self, request: Request<Full<Bytes>>) -> ResponseFuture {
        if request.uri().scheme() == Some(&http::uri::Scheme::HTTPS) {
            self.https.request(request)
        } else {
            self.client.request(request)
        }
    }

    pub fn idle_timeout(&self) -> Duration {
        self.idle_timeout
    }

    /// POSTs `body` to `base_url` + `path` and waits for the response headers.
    pub async fn post(
        &self,
        base_url: &str,
        path: &str,
        headers: &HeaderMap,
        body: Bytes,
    ) -> Result<Response<Incoming>, Failure> {
        let mut request = Request::post(format!("{base_url}{path}"))
            .body(Full::new(body))
            .map_err(|e| Failure::Other(e.to_string()))?;
        for (name, value) in headers {
            if !DROPPED_REQUEST_HEADERS.contains(&name.as_str()) {
                request.headers_mut().append(name, value.clone());
            }
        }
        match tokio::time::timeout(self.first_byte_timeout, self.send(request)).await {
            Err(_) => Err(Failure::Timeout),
            Ok(Err(e)) if e.is_connect() => Err(Failure::Connect(format!("{e:?}"))),
            Ok(Err(e)) => Err(Failure::Other(format!("{e:?}"))),
            Ok(Ok(response)) => Ok(response),
        }
    }

    /// Whether the worker's `/health` answers 2xx within the health timeout.
    pub async fn healthy(&self, base_url: &str) -> bool {
        let Ok(request) = Request::get(format!("{base_url}/health")).body(Full::new(Bytes::new()))
        else {
            return false;
        };
        matches!(
            tokio::time::timeout(self.health_timeout, self.send(request)).await,
            Ok(Ok(response)) if response.status().is_success()
        )
    }
}

/// Response headers that describe the worker's connection, not the response.
pub fn strip_hop_by_hop(headers: &mut HeaderMap) {
    for name in [header::CONNECTION, header::TRANSFER_ENCODING] {
        headers.remove(name);
    }
    headers.remove("keep-alive");
}

/// What a proxied response keeps until it ends: the blocks its worker uses stay
/// indexed, and the request keeps its place under `limits.max_inflight_requests`.
pub struct Held {
    pub blocks: OwnedPinnedPath,
    pub permit: OwnedSemaphorePermit,
}

/// The request's booking and whether its response finished; dropping it early is a cancel.
struct Flight {
    booking: Option<Booking>,
    finished: bool,
}

impl Flight {
    /// The response ended; `ok`: completely, as the worker meant it to.
    fn finish(&mut self, ok: bool) {
        self.finished = true;
        if let Some(mut booking) = self.booking.take() {
            booking.record_outcome(ok);
        }
    }
}

impl Drop for Flight {
    fn drop(&mut self) {
        if !self.finished {
            ::metrics::counter!(metrics::CANCELLED).increment(1);
        }
    }
}

pin_project_lite::pin_project! {
    /// A worker's response body on its way to the client. It releases the
    /// booking's prefill at the first byte and the rest at the end or when
    /// dropped, and records TTFT, inter-chunk and end-to-end latency. The end
    /// is the last data frame when the worker's body says it is complete:
    /// hyper drops a body that reports `is_end_stream` without polling it again.
    /// A response that completes is a success for the worker's breaker; an error
    /// in the middle of the body is a failure.
    ///
    /// A worker silent for longer than the idle timeout is cut off: its body is
    /// dropped at once, which closes the upstream connection so the worker stops
    /// generating, and the failure counts for its breaker. An SSE client then gets a last event with an OpenAI-style
    /// error (the status line went out long ago, so an event is the only way to
    /// say why) and the stream ends without `[DONE]`; any other body ends with
    /// an error, which aborts the response so it cannot pass for a complete one.
    pub struct TrackedBody {
        // `None` once cut off by the idle timeout.
        inner: Option<Incoming>,
        // Moved to the last data frame's deadline only when it fires: resetting
        // a timer per frame takes the timer wheel's lock, and wakes the I/O
        // driver with a syscall whenever it becomes the earliest timer.
        #[pin]
        idle: tokio::time::Sleep,
        idle_timeout: Duration,
        last_data: tokio::time::Instant,
        sse: bool,
        flight: Flight,
        sent: Instant,
        last_frame: Option<Instant>,
        // `None` for a response not worth checking (an error status).
        check: Option<Check>,
        _held: Held,
    }
}

impl TrackedBody {
    /// `sse`: the response is a `text/event-stream`; `check`: compare the
    /// worker's reported cached tokens with the prediction at the end.
    pub fn new(
        inner: Incoming,
        booking: Booking,
        held: Held,
        sent: Instant,
        idle_timeout: Duration,
        sse: bool,
        check: Option<Check>,
    ) -> Self {
        // An empty body is complete before hyper would ever poll it.
        let empty = inner.is_end_stream();
        let mut body = Self {
            inner: Some(inner),
            idle: tokio::time::sleep(idle_timeout),
            idle_timeout,
            last_data: tokio::time::Instant::now(),
            sse,
            flight: Flight {
                booking: Some(booking),
                finished: false,
            },
            sent,
            last_frame: None,
            check,
            _held: held,
        };
        if empty {
            complete(&mut body.flight, sent, None);
        }
        body
    }
}

/// The worker's body ended as it meant to: once, with its end-to-end latency.
fn complete(flight: &mut Flight, sent: Instant, check: Option<&Check>) {
    if !flight.finished {
        metrics::hot().e2e.record(sent.elapsed().as_secs_f64());
        if let Some(check) = check {
            check.finish();
        }
        flight.finish(true);
    }
}

impl Body for TrackedBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let mut this = self.project();
        let Some(inner) = this.inner.as_mut() else {
            return Poll::Ready(None);
        };
        match Pin::new(inner).poll_frame(cx) {
            Poll::Ready(Some(Ok(frame))) => {
                if frame.is_data() {
                    let now = Instant::now();
                    match *this.last_frame {
                        None => {
                            let ttft = now.duration_since(*this.sent);
                            metrics::hot().ttft.record(ttft.as_secs_f64());
                            if let Some(booking) = this.flight.booking.as_mut() {
                                // Only a stream's first frame is its first token.
                                if *this.sse {
                                    booking.first_token(ttft);
                                } else {
                                    booking.release_prefill();
                                }
                            }
                        }
                        Some(previous) => metrics::hot()
                            .inter_token
                            .record(now.duration_since(previous).as_secs_f64()),
                    }
                    *this.last_frame = Some(now);
                    *this.last_data = tokio::time::Instant::now();
                }
                if let (Some(check), Some(data)) = (this.check.as_mut(), frame.data_ref()) {
                    check.push(data);
                }
                if this.inner.as_ref().is_some_and(Incoming::is_end_stream) {
                    complete(this.flight, *this.sent, this.check.as_ref());
                }
                Poll::Ready(Some(Ok(frame)))
            }
            Poll::Ready(Some(Err(e))) => {
                this.flight.finish(false);
                Poll::Ready(Some(Err(e.into())))
            }
            Poll::Ready(None) => {
                complete(this.flight, *this.sent, this.check.as_ref());
                Poll::Ready(None)
            }
            Poll::Pending => {
                loop {
                    if this.idle.as_mut().poll(cx).is_pending() {
                        return Poll::Pending;
                    }
                    let deadline = *this.last_data + *this.idle_timeout;
                    if deadline <= this.idle.deadline() {
                        break;
                    }
                    this.idle.as_mut().reset(deadline);
                }
                let worker = this.flight.booking.as_ref().map(|b| b.key().worker_id);
                let error = RouterError::UpstreamTimeout(format!(
                    "worker {} sent nothing for {} ms",
                    worker.map_or("?".to_string(), |w| w.to_string()),
                    this.idle_timeout.as_millis()
                ));
                tracing::warn!(worker, "{error}; response cut off");
                ::metrics::counter!(metrics::IDLE_TIMEOUTS).increment(1);
                *this.inner = None;
                this.flight.finish(false);
                if *this.sse {
                    let event = format!("data: {}\n\n", error.body());
                    Poll::Ready(Some(Ok(Frame::data(Bytes::from(event)))))
                } else {
                    Poll::Ready(Some(Err(error.into())))
                }
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.as_ref().is_none_or(Incoming::is_end_stream)
    }

    fn size_hint(&self) -> SizeHint {
        match &self.inner {
            Some(inner) => inner.size_hint(),
            None => SizeHint::with_exact(0),
        }
    }
}
