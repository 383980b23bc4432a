//! Talking to workers' HTTP servers: HTTP/1 connections driven by the request
//! that uses them, kept per worker between requests, and the response body
//! wrapper that measures a response and releases its booking.
//!
//! A connection is not a task of its own (as in hyper-util's pooled client):
//! the request's task drives it while it waits for the response headers, and
//! the response body drives it as the server polls the body. That saves the
//! wake-up and task switch between a connection's task and the server's, per
//! request and per streamed chunk, and lets the server write every chunk the
//! connection has already read in one go. Between requests a connection waits,
//! unpolled, in its worker's idle list, and is dropped after [`IDLE_CONNECTION`].
//! A worker that closed it meanwhile is seen when the next request goes on
//! it: the request, never written, goes on another connection. It also
//! keeps the timer its requests wait for their response headers under.
//!
//! The worker's body is handed to the client frame by frame as it arrives, so a
//! slow client slows the worker's stream down (backpressure) instead of the
//! router buffering it, and a client that goes away drops the body, which closes
//! the upstream connection: the worker sees the cancel.
//!
//! `https://` workers get rustls (trusting the system's roots and
//! `upstream.ca_file`); `http://` ones never touch TLS.

use std::future::poll_fn;
use std::pin::Pin;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll, Wake, Waker};
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures_util::task::AtomicWaker;
use http::uri::PathAndQuery;
use http::{HeaderMap, HeaderName, HeaderValue, Method, Request, Response, Uri, header};
use http_body::{Body, Frame, SizeHint};
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::client::conn::http1;
use hyper_rustls::{HttpsConnector, MaybeHttpsStream};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioIo;
use kvroute_index::OwnedPinnedPath;
use rustc_hash::FxHashMap;
use tokio::net::TcpStream;
use tokio::sync::OwnedSemaphorePermit;
use tokio::time::Sleep;
use tower::Service;

use crate::cached_tokens::Check;
use crate::config::UpstreamConfig;
use crate::error::RouterError;
use crate::fleet::booking::Booking;
use crate::metrics;

pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// How long a connection may wait unused before it is closed.
const IDLE_CONNECTION: Duration = Duration::from_secs(90);

pub struct Upstream {
    connector: HttpsConnector<HttpConnector>,
    pool: Arc<Pool>,
    /// `Bearer <upstream.api_key>`, marked sensitive; sent to every worker.
    authorization: Option<HeaderValue>,
    first_byte_timeout: Duration,
    idle_timeout: Duration,
    health_timeout: Duration,
}

/// Why an upstream attempt failed before a response started. The strings are
/// the library's detail, for the operator's log only: they name addresses.
#[derive(Debug)]
pub enum Failure {
    /// The connection could not be made: nothing reached the worker, safe to retry.
    Connect(String),
    /// No response headers within the first-byte timeout.
    Timeout,
    /// The worker left routing (see [`Deadlines::poll_left`]) before it answered.
    Left,
    /// The connection failed after the request went on it and before the
    /// response: the worker may have seen the request. A worker refusing a
    /// body (an engine resets the connection mid-upload) and one that died
    /// look alike here.
    Other(String),
}

/// Request headers not forwarded: hop-by-hop ones, and the router's own,
/// credentials included: a client's or operator's token is the router's to
/// check, and would hand a worker the operator's rights.
const DROPPED_REQUEST_HEADERS: [&str; 9] = [
    "host",
    "content-length",
    "connection",
    "transfer-encoding",
    "keep-alive",
    "x-kvroute-worker",
    "authorization",
    "proxy-authorization",
    // Anthropic clients send their key here.
    "x-api-key",
];

/// Whether a `Content-Length` value says `length`, in plain digits.
fn states(value: &HeaderValue, length: usize) -> bool {
    let digits = value.as_bytes();
    (1..=19).contains(&digits.len())
        && digits.iter().all(u8::is_ascii_digit)
        && digits
            .iter()
            .fold(0u64, |n, digit| n * 10 + u64::from(digit - b'0'))
            == length as u64
}

/// One HTTP/1 connection to a worker; it moves only while someone polls it.
struct Conn {
    link: Link,
    /// The timer of its requests' waits for response headers (see
    /// [`Deadlines`]), kept from one request to the next: a new one is put in
    /// the runtime's timer wheel at its first poll and taken out when dropped,
    /// both under the wheel's lock, while one set to a later deadline than
    /// it had is only told the new one (the wheel moves it on when the old
    /// one comes). Out of the connection while a request waits on it. Between
    /// requests it holds the waker of the task that polled it last.
    first_byte: Option<Pin<Box<Sleep>>>,
    /// What hyper's parts of the connection are given to wake their poller.
    waker: Waker,
    wakes: Arc<Wakes>,
}

/// hyper's two halves of a connection.
struct Link {
    send: http1::SendRequest<Full<Bytes>>,
    /// `None` once it finished: the connection is closed.
    driver: Option<http1::Connection<MaybeHttpsStream<TokioIo<TcpStream>>, Full<Bytes>>>,
}

impl Link {
    /// Reads and writes what the connection can now; `true` once it is closed.
    /// A finished driver is dropped at once: a request it had not written yet
    /// (the worker closed the connection while it waited idle) goes back to
    /// its sender unsent, where a kept driver would hold it.
    fn drive(&mut self, cx: &mut Context<'_>) -> bool {
        if let Some(driver) = &mut self.driver
            && Pin::new(driver).poll(cx).is_ready()
        {
            self.driver = None;
        }
        self.closed()
    }

    fn closed(&self) -> bool {
        self.driver.is_none()
    }

    /// Whether an idle connection can take a request now. One that asked hyper
    /// for the next request when its last response ended is not driven here:
    /// the request's own first drive finds the connection's state anyway. A
    /// close by the worker is seen there instead, and the request must then
    /// come back unsent (see [`Upstream::send`]).
    fn usable(&mut self, cx: &mut Context<'_>) -> bool {
        match self.send.poll_ready(cx) {
            Poll::Ready(ready) => ready.is_ok() && !self.closed(),
            Poll::Pending => {
                !self.drive(cx) && matches!(self.send.poll_ready(cx), Poll::Ready(Ok(())))
            }
        }
    }
}

/// `Wakes::state` bits: a task is polling the connection; something woke it meanwhile.
const POLLING: u8 = 1;
const WOKEN: u8 = 2;

/// The connection's waker. hyper's halves of a connection wake whoever polls
/// them each time one hands the other something (a request, a response's head,
/// a body's chunk, room for the next one), and here one task polls both: each
/// such wake would have the runtime poll the whole HTTP connection's task again
/// for nothing (three per small request on a kept connection). A wake that
/// comes while the task polls the connection re-runs that poll at once instead
/// (see [`Conn::poll`]); any other wake goes to the task.
struct Wakes {
    state: AtomicU8,
    /// The task that polls the connection now, or polled it last.
    task: AtomicWaker,
}

impl Wake for Wakes {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        if self.state.fetch_or(WOKEN, Ordering::AcqRel) & POLLING == 0 {
            self.task.wake();
        }
    }
}

impl Conn {
    fn new(link: Link, first_byte: Pin<Box<Sleep>>) -> Box<Self> {
        let wakes = Arc::new(Wakes {
            state: AtomicU8::new(0),
            task: AtomicWaker::new(),
        });
        Box::new(Conn {
            link,
            first_byte: Some(first_byte),
            waker: Waker::from(Arc::clone(&wakes)),
            wakes,
        })
    }

    /// Polls the connection with `poll`, for the task of `cx`, until it is
    /// ready or nothing woke the connection while it ran. Only one task at a
    /// time may poll a connection: the one holding it. A task out of tokio's
    /// budget is not re-run here: the runtime defers that wake past the poll.
    fn poll<T>(
        &mut self,
        cx: &mut Context<'_>,
        mut poll: impl FnMut(&mut Link, &mut Context<'_>) -> Poll<T>,
    ) -> Poll<T> {
        self.wakes.task.register(cx.waker());
        let mut own = Context::from_waker(&self.waker);
        loop {
            self.wakes.state.store(POLLING, Ordering::Release);
            let result = poll(&mut self.link, &mut own);
            let woken = self.wakes.state.swap(0, Ordering::AcqRel) & WOKEN != 0;
            // A ready result's wakes are not lost: whatever comes of it (the
            // response, a body's frame) has its holder poll the connection again.
            if result.is_ready() || !woken {
                return result;
            }
        }
    }

    /// Runs `hand`, which gives the connection something, without waking the
    /// task: the caller polls the connection next.
    fn hand<T>(&mut self, hand: impl FnOnce(&mut Link) -> T) -> T {
        self.wakes.state.store(POLLING, Ordering::Release);
        let handed = hand(&mut self.link);
        self.wakes.state.store(0, Ordering::Release);
        handed
    }
}

/// A worker's address as requests need it, parsed once.
struct Target {
    /// Scheme and authority, for the connector.
    uri: Uri,
    host: HeaderValue,
    /// A path the base URL ends with, put before each request's path.
    prefix: Option<String>,
}

impl Target {
    fn parse(base_url: &str) -> Result<Self, String> {
        let uri: Uri = base_url
            .parse()
            .map_err(|e| format!("base_url {base_url:?}: {e}"))?;
        let authority = uri
            .authority()
            .ok_or_else(|| format!("base_url {base_url:?} has no host"))?;
        let host = HeaderValue::from_str(authority.as_str()).map_err(|e| e.to_string())?;
        let prefix = Some(uri.path().trim_end_matches('/'))
            .filter(|p| !p.is_empty())
            .map(str::to_string);
        Ok(Self { uri, host, prefix })
    }

    /// The request line's origin-form URI for `path`.
    fn path(&self, path: PathAndQuery) -> Result<Uri, String> {
        match &self.prefix {
            None => Ok(Uri::from(path)),
            Some(prefix) => format!("{prefix}{path}")
                .parse()
                .map_err(|e| format!("{e}")),
        }
    }
}

/// Each worker's address and idle connections, most recently used last.
struct Pool {
    /// How long a connection may wait unused before it is closed.
    idle_for: Duration,
    hosts: Mutex<Hosts>,
}

#[derive(Default)]
struct Hosts {
    by_url: FxHashMap<Arc<str>, Host>,
    /// When idle connections are next looked over, on every worker.
    next_sweep: Option<Instant>,
}

struct Host {
    target: Arc<Target>,
    idle: Vec<(Box<Conn>, Instant)>,
    /// When a request last took a connection to it.
    used: Instant,
}

impl Pool {
    fn new(idle_for: Duration) -> Self {
        Self {
            idle_for,
            hosts: Mutex::default(),
        }
    }

    /// The worker's address and its most recently used idle connection, if any.
    fn take(&self, base_url: &Arc<str>) -> Result<(Arc<Target>, Option<Box<Conn>>), String> {
        let now = Instant::now();
        let mut hosts = self.hosts.lock().unwrap_or_else(PoisonError::into_inner);
        let host = match hosts.by_url.get_mut(&**base_url) {
            Some(host) => host,
            None => hosts.by_url.entry(Arc::clone(base_url)).or_insert(Host {
                target: Arc::new(Target::parse(base_url)?),
                idle: Vec::new(),
                used: now,
            }),
        };
        host.used = now;
        while let Some((conn, since)) = host.idle.pop() {
            if now.duration_since(since) < self.idle_for {
                return Ok((Arc::clone(&host.target), Some(conn)));
            }
        }
        Ok((Arc::clone(&host.target), None))
    }

    /// Keeps a connection whose response ended for the worker's next request.
    /// Every half idle period it also closes the connections idle for too long
    /// and forgets the workers nothing used meanwhile, of the whole fleet: a
    /// worker that left gets no more requests to do it at, and its address
    /// may never come back.
    fn put(&self, base_url: &str, conn: Box<Conn>) {
        if conn.link.closed() || conn.link.send.is_closed() {
            return;
        }
        let now = Instant::now();
        let mut hosts = self.hosts.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(host) = hosts.by_url.get_mut(base_url) {
            host.idle.push((conn, now));
        }
        if hosts.next_sweep.is_none_or(|at| at <= now) {
            let idle_for = self.idle_for;
            hosts.by_url.retain(|_, host| {
                host.idle
                    .retain(|(_, since)| now.duration_since(*since) < idle_for);
                !host.idle.is_empty() || now.duration_since(host.used) < idle_for
            });
            hosts.next_sweep = Some(now + idle_for / 2);
        }
    }
}

impl Upstream {
    pub fn new(config: &UpstreamConfig) -> Result<Self, RouterError> {
        let mut connector = HttpConnector::new();
        connector.set_connect_timeout(Some(Duration::from_millis(config.connect_timeout_ms)));
        connector.set_nodelay(true);
        // TLS wraps it for https:// URIs, which the plain connector refuses.
        connector.enforce_http(false);
        let ca_file =
            Some(std::path::Path::new(&config.ca_file)).filter(|_| !config.ca_file.is_empty());
        let tls = kvroute_tls::https_client_config(ca_file)
            .map_err(|e| RouterError::Config(format!("upstream.ca_file: {e}")))?;
        let connector = hyper_rustls::HttpsConnectorBuilder::new()
            .with_tls_config(tls)
            .https_or_http()
            .enable_http1()
            .wrap_connector(connector);
        let authorization = Some(&config.api_key)
            .filter(|key| !key.is_empty())
            .map(|key| {
                let mut value =
                    HeaderValue::try_from(format!("Bearer {}", key.expose())).map_err(|_| {
                        RouterError::Config(
                            "upstream.api_key must be visible ASCII, without line breaks".into(),
                        )
                    })?;
                value.set_sensitive(true);
                Ok::<_, RouterError>(value)
            })
            .transpose()?;
        Ok(Self {
            connector,
            pool: Arc::new(Pool::new(IDLE_CONNECTION)),
            authorization,
            first_byte_timeout: Duration::from_millis(config.first_byte_timeout_ms),
            idle_timeout: Duration::from_millis(config.idle_timeout_ms),
            health_timeout: Duration::from_millis(config.health_timeout_ms),
        })
    }

    pub fn idle_timeout(&self) -> Duration {
        self.idle_timeout
    }

    /// How long a request may wait for its response headers.
    pub fn first_byte_timeout(&self) -> Duration {
        self.first_byte_timeout
    }

    /// A new connection to the worker.
    async fn connect(&self, target: &Target) -> Result<Link, Failure> {
        let io = self
            .connector
            .clone()
            .call(target.uri.clone())
            .await
            .map_err(|e| Failure::Connect(format!("{e:?}")))?;
        let (send, driver) = http1::handshake(io)
            .await
            .map_err(|e| Failure::Connect(format!("{e:?}")))?;
        Ok(Link {
            send,
            driver: Some(driver),
        })
    }

    /// Sends `request` on an idle connection to the worker, or a new one, and
    /// drives the connection until the response headers arrive, within
    /// `deadlines`. A request an idle connection could not take (the worker
    /// had closed it) goes on the next one; one that never reached the worker
    /// fails as a connect error.
    async fn send(
        &self,
        base_url: &Arc<str>,
        method: Method,
        path: PathAndQuery,
        headers: Option<&HeaderMap>,
        body: Bytes,
        deadlines: &mut impl Deadlines,
    ) -> Result<(Response<Incoming>, Box<Conn>), Failure> {
        let (target, mut idle) = self.pool.take(base_url).map_err(Failure::Connect)?;
        let length = body.len();
        let mut request = Request::new(Full::new(body));
        *request.method_mut() = method;
        *request.uri_mut() = target.path(path).map_err(Failure::Other)?;
        let forwarded = request.headers_mut();
        if let Some(headers) = headers {
            forwarded.reserve(headers.len() + 1);
            let (mut content_length, mut lengths) = (None, 0);
            for (name, value) in headers {
                if name == header::CONTENT_LENGTH {
                    (content_length, lengths) = (Some(value), lengths + 1);
                } else if !DROPPED_REQUEST_HEADERS.contains(&name.as_str()) {
                    forwarded.append(name, value.clone());
                }
            }
            // The client's own length, when it gave one and it is the body's:
            // else hyper makes one per request (two allocations).
            if let Some(value) = content_length.filter(|v| lengths == 1 && states(v, length)) {
                forwarded.insert(header::CONTENT_LENGTH, value.clone());
            }
        }
        forwarded.insert(header::HOST, target.host.clone());
        if let Some(authorization) = &self.authorization {
            forwarded.insert(header::AUTHORIZATION, authorization.clone());
        }
        loop {
            let reused = idle.is_some();
            let mut conn = match idle.take() {
                Some(mut conn) => {
                    if !poll_fn(|cx| conn.poll(cx, |link, cx| Poll::Ready(link.usable(cx)))).await {
                        idle = self.pool.take(base_url).map_err(Failure::Connect)?.1;
                        continue;
                    }
                    conn
                }
                None => {
                    let mut timer = Box::pin(tokio::time::sleep_until(deadlines.next()));
                    // Boxed: rare, and its future would make every request's larger.
                    let connected = Box::pin(self.connect(&target));
                    Conn::new(within(connected, &mut timer, deadlines).await?, timer)
                }
            };
            let mut timer = conn.first_byte.take().expect("kept while not in use");
            timer.as_mut().reset(deadlines.next());
            let response = conn.hand(|link| link.send.try_send_request(request));
            let mut response = std::pin::pin!(response);
            let answered = poll_fn(|cx| {
                conn.poll(cx, |link, cx| {
                    link.drive(cx);
                    response.as_mut().poll(cx).map(Ok)
                })
            });
            let result = within(answered, &mut timer, deadlines).await?;
            match result {
                Ok(response) => {
                    conn.first_byte = Some(timer);
                    return Ok((response, conn));
                }
                Err(mut e) => match e.take_message() {
                    Some(unsent) if reused => {
                        request = unsent;
                        idle = self.pool.take(base_url).map_err(Failure::Connect)?.1;
                    }
                    Some(_) => return Err(Failure::Connect(format!("{:?}", e.error()))),
                    None => return Err(Failure::Other(format!("{:?}", e.into_error()))),
                },
            }
        }
    }

    /// POSTs `body` to `base_url` + `path` and waits for the response headers
    /// within `deadlines`.
    pub async fn post(
        &self,
        base_url: &Arc<str>,
        path: &'static str,
        headers: &HeaderMap,
        body: Bytes,
        deadlines: &mut impl Deadlines,
    ) -> Result<Response<WorkerBody>, Failure> {
        self.call(
            base_url,
            Method::POST,
            PathAndQuery::from_static(path),
            headers,
            body,
            deadlines,
        )
        .await
    }

    /// Sends `method` `path` with `body` to `base_url` and waits for the
    /// response headers within `deadlines`: [`Self::post`] for any method and
    /// a path made per request (a stored response's id).
    pub async fn call(
        &self,
        base_url: &Arc<str>,
        method: Method,
        path: PathAndQuery,
        headers: &HeaderMap,
        body: Bytes,
        deadlines: &mut impl Deadlines,
    ) -> Result<Response<WorkerBody>, Failure> {
        let (response, conn) = self
            .send(base_url, method, path, Some(headers), body, deadlines)
            .await?;
        let (parts, body) = response.into_parts();
        let body = WorkerBody::new(body, conn, Arc::clone(&self.pool), Arc::clone(base_url));
        Ok(Response::from_parts(parts, body))
    }

    /// Whether the worker's `/health` answers 2xx within the health timeout.
    pub async fn healthy(&self, base_url: &Arc<str>) -> bool {
        let mut deadline = GiveUpAt(tokio::time::Instant::now() + self.health_timeout);
        let sent = self.send(
            base_url,
            Method::GET,
            PathAndQuery::from_static("/health"),
            None,
            Bytes::new(),
            &mut deadline,
        );
        matches!(sent.await, Ok((response, _)) if response.status().is_success())
    }
}

/// When a request stops waiting for its response headers, and what it does
/// at a deadline on the way.
pub trait Deadlines {
    /// The next deadline.
    fn next(&self) -> tokio::time::Instant;
    /// [`Self::next`] passed: `false` gives up (a [`Failure::Timeout`]),
    /// `true` waits on to the new [`Self::next`].
    fn passed(&mut self) -> bool;
    /// Ready once the worker left routing: the request gives up (a
    /// [`Failure::Left`]) rather than wait for a worker found dead or frozen.
    fn poll_left(&mut self, _cx: &mut Context<'_>) -> Poll<()> {
        Poll::Pending
    }
}

/// One deadline.
pub(crate) struct GiveUpAt(pub(crate) tokio::time::Instant);

impl Deadlines for GiveUpAt {
    fn next(&self) -> tokio::time::Instant {
        self.0
    }

    fn passed(&mut self) -> bool {
        false
    }
}

/// `work`, given up as a [`Failure::Timeout`] once `deadlines` give up, which
/// `timer` (set for [`Deadlines::next`]) times.
pub(crate) async fn within<T>(
    work: impl Future<Output = Result<T, Failure>>,
    timer: &mut Pin<Box<Sleep>>,
    deadlines: &mut impl Deadlines,
) -> Result<T, Failure> {
    let mut work = std::pin::pin!(work);
    poll_fn(|cx| {
        if let Poll::Ready(result) = work.as_mut().poll(cx) {
            return Poll::Ready(result);
        }
        if deadlines.poll_left(cx).is_ready() {
            return Poll::Ready(Err(Failure::Left));
        }
        while timer.as_mut().poll(cx).is_ready() {
            if !deadlines.passed() {
                return Poll::Ready(Err(Failure::Timeout));
            }
            timer.as_mut().reset(deadlines.next());
        }
        Poll::Pending
    })
    .await
}

/// At most this many bytes of data frames that are ready together are joined
/// into one (see [`WorkerBody`]).
const JOINED_BYTES: usize = 64 * 1024;

/// A worker's response body with the connection it arrives on: polling the
/// body drives the connection, and a body read to its end gives the connection
/// back to the worker's idle list. Dropped before its end, it closes the
/// connection (the worker sees the cancel).
///
/// hyper decodes a chunked body into one frame per chunk, so chunks that one
/// read brought in (a worker streaming tokens faster than they are forwarded)
/// come out as many frames, each written on its own by the server once its
/// queue of buffers is full, and each paying the server's and the tracking's
/// per-frame work. Data frames that are ready without waiting are therefore
/// joined into one, as nginx forwards what one read gave in one write; a frame
/// that is alone goes out at once.
pub struct WorkerBody {
    body: Incoming,
    // `None` once back in the pool, or closed.
    conn: Option<Box<Conn>>,
    pool: Arc<Pool>,
    base_url: Arc<str>,
    /// What ended the last join (trailers, an error or the end), given next.
    held: Option<Option<Result<Frame<Bytes>, hyper::Error>>>,
    /// How many of the worker's frames the last data frame joined.
    joined: usize,
}

impl WorkerBody {
    fn new(body: Incoming, conn: Box<Conn>, pool: Arc<Pool>, base_url: Arc<str>) -> Self {
        let mut body = Self {
            body,
            conn: Some(conn),
            pool,
            base_url,
            held: None,
            joined: 0,
        };
        // An empty body is complete before anyone would poll it.
        if body.body.is_end_stream() {
            body.release();
        }
        body
    }

    fn release(&mut self) {
        if let Some(conn) = self.conn.take() {
            self.pool.put(&self.base_url, conn);
        }
    }

    /// How many of the worker's frames the last data frame joined.
    pub fn joined(&self) -> usize {
        self.joined
    }

    /// The worker's next frame, driving the connection if it has none yet.
    fn poll_worker_frame(
        &mut self,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        let body = &mut self.body;
        let frame = match self.conn.as_mut() {
            // What the connection already read comes first; only then is it
            // driven to read more.
            Some(conn) => {
                let frame = conn.poll(cx, |link, cx| match Pin::new(&mut *body).poll_frame(cx) {
                    Poll::Pending => {
                        link.drive(cx);
                        Pin::new(&mut *body).poll_frame(cx)
                    }
                    frame => frame,
                });
                if conn.link.closed() {
                    self.conn = None;
                }
                frame
            }
            None => Pin::new(body).poll_frame(cx),
        };
        match &frame {
            Poll::Ready(None) => self.release(),
            Poll::Ready(Some(Ok(_))) if self.body.is_end_stream() => self.release(),
            Poll::Ready(Some(Err(_))) => self.conn = None,
            _ => {}
        }
        frame
    }
}

impl Body for WorkerBody {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        let this = &mut *self;
        if let Some(held) = this.held.take() {
            return Poll::Ready(held);
        }
        let first = match std::task::ready!(this.poll_worker_frame(cx)) {
            Some(Ok(frame)) => frame,
            other => return Poll::Ready(other),
        };
        let first = match first.into_data() {
            Ok(data) => data,
            Err(trailers) => return Poll::Ready(Some(Ok(trailers))),
        };
        this.joined = 1;
        // Join the data frames that are ready now; never wait for one.
        let mut joined: Option<bytes::BytesMut> = None;
        while !this.body.is_end_stream()
            && joined.as_ref().map_or(first.len(), |j| j.len()) < JOINED_BYTES
        {
            let next = match this.poll_worker_frame(cx) {
                Poll::Pending => break,
                Poll::Ready(Some(Ok(frame))) => frame,
                Poll::Ready(other) => {
                    this.held = Some(other);
                    break;
                }
            };
            match next.into_data() {
                Ok(data) => {
                    let joined = joined.get_or_insert_with(|| {
                        let mut joined =
                            bytes::BytesMut::with_capacity(2 * first.len() + data.len());
                        joined.extend_from_slice(&first);
                        joined
                    });
                    joined.extend_from_slice(&data);
                    this.joined += 1;
                }
                Err(trailers) => {
                    this.held = Some(Some(Ok(trailers)));
                    break;
                }
            }
        }
        let data = joined.map_or(first, bytes::BytesMut::freeze);
        Poll::Ready(Some(Ok(Frame::data(data))))
    }

    fn is_end_stream(&self) -> bool {
        self.held.is_none() && self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

/// Response headers that describe the worker's connection, not the response.
/// Looked for before any is removed: a small response has a few headers and
/// none of these, and each removal is a hash lookup.
pub fn strip_hop_by_hop(headers: &mut HeaderMap) {
    let hop_by_hop = |name: &HeaderName| {
        name == header::CONNECTION || name == header::TRANSFER_ENCODING || name == "keep-alive"
    };
    if headers.keys().any(hop_by_hop) {
        for name in [header::CONNECTION, header::TRANSFER_ENCODING] {
            headers.remove(name);
        }
        headers.remove("keep-alive");
    }
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
    /// in the middle of the body is a failure, and the response is cut off (see
    /// [`cut_off`]).
    ///
    /// A worker silent for longer than the idle timeout is cut off too: its body
    /// is dropped at once, which closes the upstream connection so the worker
    /// stops generating, and the failure counts for its breaker.
    pub struct TrackedBody {
        // `None` once cut off by the idle timeout.
        inner: Option<WorkerBody>,
        // Made the first time the worker's body is not ready (never, for most
        // small responses, which arrive with their headers), and moved to the
        // last data frame's deadline only when it fires: resetting a timer per
        // frame takes the timer wheel's lock, and wakes the I/O driver with a
        // syscall whenever it becomes the earliest timer.
        idle: Option<Pin<Box<tokio::time::Sleep>>>,
        idle_timeout: Duration,
        // When the headers came, then the last data frame.
        last_data: Instant,
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
        inner: WorkerBody,
        booking: Booking,
        held: Held,
        sent: Instant,
        idle_timeout: Duration,
        sse: bool,
        check: Option<Check>,
    ) -> Self {
        // An empty body is complete before hyper would ever poll it.
        let empty = inner.is_end_stream();
        let now = Instant::now();
        let mut body = Self {
            inner: Some(inner),
            idle: None,
            idle_timeout,
            last_data: now,
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
            complete(&mut body.flight, now.duration_since(sent), None);
        }
        body
    }
}

/// The last frame of a response the worker failed in the middle of. An SSE
/// client gets an event with an OpenAI-style error (the status line went out
/// long ago, so an event is the only way to say why) and the stream ends
/// without `[DONE]`; any other body ends with an error, which aborts the
/// response so it cannot pass for a complete one.
fn cut_off(sse: bool, error: RouterError) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
    if sse {
        let event = format!("data: {}\n\n", error.body());
        Poll::Ready(Some(Ok(Frame::data(Bytes::from(event)))))
    } else {
        Poll::Ready(Some(Err(error.into())))
    }
}

/// The worker's body ended as it meant to, `latency` after it was sent:
/// once, with that end-to-end latency.
fn complete(flight: &mut Flight, latency: Duration, check: Option<&Check>) {
    if !flight.finished {
        metrics::hot().e2e.record(latency.as_secs_f64());
        if let Some(check) = check {
            check.finish(flight.booking.as_ref());
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
        let this = self.project();
        let Some(inner) = this.inner.as_mut() else {
            return Poll::Ready(None);
        };
        match Pin::new(inner).poll_frame(cx) {
            Poll::Ready(Some(Ok(frame))) => {
                // One clock read for the frame's metrics, deadline and end,
                // and for a first frame that is also the last, one latency.
                let (mut now, mut ttft) = (None, None);
                if frame.is_data() {
                    let now = *now.insert(Instant::now());
                    match *this.last_frame {
                        None => {
                            let ttft = *ttft.insert(now.duration_since(*this.sent));
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
                    // The worker's frames joined into this one came together.
                    let joined = this.inner.as_ref().map_or(1, WorkerBody::joined);
                    if joined > 1 {
                        metrics::hot().inter_token.record_many(0.0, joined - 1);
                    }
                    *this.last_frame = Some(now);
                    *this.last_data = now;
                }
                if let (Some(check), Some(data)) = (this.check.as_mut(), frame.data_ref()) {
                    check.push(data);
                }
                if this.inner.as_ref().is_some_and(WorkerBody::is_end_stream) {
                    let latency = ttft.unwrap_or_else(|| {
                        now.unwrap_or_else(Instant::now).duration_since(*this.sent)
                    });
                    complete(this.flight, latency, this.check.as_ref());
                }
                Poll::Ready(Some(Ok(frame)))
            }
            Poll::Ready(Some(Err(e))) => {
                let worker = this.flight.booking.as_ref().map(|b| b.key().worker_id);
                tracing::warn!(worker, "worker's response broke off: {e:?}");
                *this.inner = None;
                this.flight.finish(false);
                let error = RouterError::Upstream(format!(
                    "worker {} failed in the middle of the response",
                    worker.map_or("?".to_string(), |w| w.to_string()),
                ));
                cut_off(*this.sse, error)
            }
            Poll::Ready(None) => {
                complete(this.flight, this.sent.elapsed(), this.check.as_ref());
                Poll::Ready(None)
            }
            Poll::Pending => {
                let deadline =
                    || tokio::time::Instant::from_std(*this.last_data + *this.idle_timeout);
                let idle = this
                    .idle
                    .get_or_insert_with(|| Box::pin(tokio::time::sleep_until(deadline())));
                loop {
                    if idle.as_mut().poll(cx).is_pending() {
                        return Poll::Pending;
                    }
                    let deadline = deadline();
                    if deadline <= idle.deadline() {
                        break;
                    }
                    idle.as_mut().reset(deadline);
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
                cut_off(*this.sse, error)
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.as_ref().is_none_or(WorkerBody::is_end_stream)
    }

    fn size_hint(&self) -> SizeHint {
        match &self.inner {
            Some(inner) => inner.size_hint(),
            None => SizeHint::with_exact(0),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::Duration;

    use bytes::Bytes;
    use http::HeaderMap;
    use http_body_util::BodyExt;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpListener;
    use tokio::sync::mpsc;
    use tokio::time::Instant;

    use super::{Failure, GiveUpAt, Upstream};
    use crate::config::UpstreamConfig;

    /// A worker speaking raw HTTP/1.1: answers every request `ok`, and reports
    /// each connection it accepts and each request head it reads. With
    /// `close_idle`, it closes a connection once its response is out and the
    /// test says so (so the router has put it idle by then), as a
    /// worker with a short keep-alive timeout does, and reports that too.
    async fn raw_worker(
        close_idle: Option<Arc<tokio::sync::Notify>>,
    ) -> (Arc<str>, mpsc::UnboundedReceiver<String>) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url: Arc<str> = format!("http://{}", listener.local_addr().unwrap()).into();
        let (seen, events) = mpsc::unbounded_channel();
        tokio::spawn(async move {
            loop {
                let (mut tcp, _) = listener.accept().await.unwrap();
                seen.send("accepted".into()).unwrap();
                let (seen, close_idle) = (seen.clone(), close_idle.clone());
                tokio::spawn(async move {
                    let mut buf = Vec::new();
                    loop {
                        let mut chunk = [0; 4096];
                        let Ok(n @ 1..) = tcp.read(&mut chunk).await else {
                            let _ = seen.send("hung up".into());
                            return;
                        };
                        buf.extend_from_slice(&chunk[..n]);
                        let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") else {
                            continue;
                        };
                        let head = String::from_utf8_lossy(&buf[..end]).to_string();
                        let length: usize = head
                            .lines()
                            .find_map(|l| {
                                l.to_ascii_lowercase()
                                    .strip_prefix("content-length: ")
                                    .map(|v| v.parse().unwrap())
                            })
                            .unwrap_or(0);
                        if buf.len() < end + 4 + length {
                            continue;
                        }
                        buf.drain(..end + 4 + length);
                        seen.send(head).unwrap();
                        let response = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok";
                        tcp.write_all(response).await.unwrap();
                        if let Some(close) = &close_idle {
                            close.notified().await;
                            drop(tcp);
                            seen.send("closed".into()).unwrap();
                            return;
                        }
                    }
                });
            }
        });
        (url, events)
    }

    /// A deadline no test reaches.
    fn an_hour() -> Instant {
        Instant::now() + Duration::from_secs(3600)
    }

    /// A worker that reads one request, then writes each byte string the test
    /// sends it, in one write each, acknowledging each once written.
    async fn scripted_worker() -> (
        Arc<str>,
        mpsc::UnboundedSender<&'static [u8]>,
        mpsc::UnboundedReceiver<()>,
    ) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url: Arc<str> = format!("http://{}", listener.local_addr().unwrap()).into();
        let (writes, mut to_write) = mpsc::unbounded_channel::<&'static [u8]>();
        let (written, acks) = mpsc::unbounded_channel();
        tokio::spawn(async move {
            let (mut tcp, _) = listener.accept().await.unwrap();
            let mut request = Vec::new();
            // The request is small: its head and its 2-byte body.
            while !request.ends_with(b"\r\n\r\n{}") {
                let mut chunk = [0; 4096];
                let n = tcp.read(&mut chunk).await.unwrap();
                assert!(n > 0, "the router hung up");
                request.extend_from_slice(&chunk[..n]);
            }
            while let Some(bytes) = to_write.recv().await {
                tcp.write_all(bytes).await.unwrap();
                written.send(()).unwrap();
            }
        });
        (url, writes, acks)
    }

    #[test]
    fn hop_by_hop_response_headers_are_stripped_and_the_rest_kept() {
        let mut headers = HeaderMap::new();
        headers.insert("content-type", "application/json".parse().unwrap());
        super::strip_hop_by_hop(&mut headers);
        assert_eq!(headers.len(), 1);
        for name in ["connection", "transfer-encoding", "keep-alive"] {
            headers.insert(name, "x".parse().unwrap());
        }
        super::strip_hop_by_hop(&mut headers);
        assert_eq!(headers.keys().collect::<Vec<_>>(), ["content-type"]);
    }

    #[tokio::test]
    async fn chunks_that_arrive_together_go_on_as_one_frame_and_a_lone_one_at_once() {
        let (url, writes, mut written) = scripted_worker().await;
        let upstream = Upstream::new(&UpstreamConfig::default()).unwrap();
        writes
            .send(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n1\r\nA\r\n")
            .unwrap();
        let response = post_by(&upstream, &url, &HeaderMap::new(), an_hour())
            .await
            .unwrap();
        written.recv().await.unwrap();
        let mut body = response.into_body();
        // Nothing follows it yet: it is not held back waiting for company.
        let lone = body.frame().await.unwrap().unwrap();
        assert_eq!(lone.into_data().unwrap(), "A");
        assert_eq!(body.joined(), 1);
        // Three chunks in one write: one frame.
        writes.send(b"1\r\nB\r\n2\r\nCD\r\n1\r\nE\r\n").unwrap();
        written.recv().await.unwrap();
        let together = body.frame().await.unwrap().unwrap();
        assert_eq!(together.into_data().unwrap(), "BCDE");
        assert_eq!(body.joined(), 3);
        // A chunk and the end together: the chunk, then the end.
        writes.send(b"1\r\nF\r\n0\r\n\r\n").unwrap();
        written.recv().await.unwrap();
        let last = body.frame().await.unwrap().unwrap();
        assert_eq!(last.into_data().unwrap(), "F");
        assert!(body.frame().await.is_none());
        assert_eq!(
            upstream.pool.hosts.lock().unwrap().by_url[&*url].idle.len(),
            1,
            "the connection went back to the pool"
        );
    }

    #[tokio::test]
    async fn a_kept_connections_timer_times_the_next_request_to_its_own_deadline() {
        // The first request's deadline, then the second's: later, then earlier.
        for (first, second) in [(10, 3600), (3600, 2)] {
            let (url, writes, mut written) = scripted_worker().await;
            let upstream = Upstream::new(&UpstreamConfig::default()).unwrap();
            writes
                .send(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
                .unwrap();
            let first_deadline = Instant::now() + Duration::from_secs(first);
            let response = post_by(&upstream, &url, &HeaderMap::new(), first_deadline)
                .await
                .unwrap();
            written.recv().await.unwrap();
            response.into_body().collect().await.unwrap();
            assert_eq!(
                upstream.pool.hosts.lock().unwrap().by_url[&*url].idle.len(),
                1,
                "kept, with its timer"
            );
            // The worker reads no more: the next request on it is never answered.
            tokio::time::pause();
            let started = Instant::now();
            let answer = post_by(
                &upstream,
                &url,
                &HeaderMap::new(),
                started + Duration::from_secs(second),
            )
            .await;
            assert!(matches!(answer, Err(Failure::Timeout)));
            let waited = started.elapsed();
            let deadline = Duration::from_secs(second);
            assert!(
                deadline <= waited && waited <= deadline + Duration::from_millis(1),
                "{first} s then {second} s: timed out after {waited:?}"
            );
            tokio::time::resume();
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_silent_workers_health_check_fails_at_the_health_timeout() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url: Arc<str> = format!("http://{}", listener.local_addr().unwrap()).into();
        tokio::spawn(async move {
            let _held = listener.accept().await.unwrap();
            std::future::pending::<()>().await
        });
        let config = UpstreamConfig {
            health_timeout_ms: 2000,
            connect_timeout_ms: 3_600_000,
            ..UpstreamConfig::default()
        };
        let upstream = Upstream::new(&config).unwrap();
        let started = Instant::now();
        let checked = tokio::time::timeout(Duration::from_secs(10), upstream.healthy(&url)).await;
        assert_eq!(checked, Ok(false));
        assert_eq!(started.elapsed(), Duration::from_secs(2));
    }

    /// POSTs `{}` with `headers` to the worker, giving up at `deadline`.
    async fn post_by(
        upstream: &Upstream,
        url: &Arc<str>,
        headers: &HeaderMap,
        deadline: Instant,
    ) -> Result<http::Response<super::WorkerBody>, Failure> {
        let mut deadline = GiveUpAt(deadline);
        upstream
            .post(
                url,
                "/v1/completions",
                headers,
                Bytes::from("{}"),
                &mut deadline,
            )
            .await
    }

    async fn post(upstream: &Upstream, url: &Arc<str>) -> Bytes {
        let response = post_by(upstream, url, &HeaderMap::new(), an_hour())
            .await
            .unwrap();
        assert!(response.status().is_success());
        response.into_body().collect().await.unwrap().to_bytes()
    }

    /// A future's output and how many wakes it gave its own task while that
    /// task was polling it: each would have the runtime poll the task again
    /// for nothing. Wakes are passed on, so nothing waits for ever.
    async fn with_self_wakes<F: std::future::Future>(future: F) -> (F::Output, usize) {
        use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
        use std::task::{Context, Wake, Waker};

        #[derive(Default)]
        struct Counter {
            polling: AtomicBool,
            self_wakes: AtomicUsize,
            task: futures_util::task::AtomicWaker,
        }
        impl Wake for Counter {
            fn wake(self: Arc<Self>) {
                self.wake_by_ref();
            }
            fn wake_by_ref(self: &Arc<Self>) {
                if self.polling.load(Ordering::SeqCst) {
                    self.self_wakes.fetch_add(1, Ordering::SeqCst);
                }
                self.task.wake();
            }
        }
        let counter = Arc::new(Counter::default());
        let waker = Waker::from(Arc::clone(&counter));
        let mut future = std::pin::pin!(future);
        let output = std::future::poll_fn(|cx| {
            counter.task.register(cx.waker());
            counter.polling.store(true, Ordering::SeqCst);
            let poll = future.as_mut().poll(&mut Context::from_waker(&waker));
            counter.polling.store(false, Ordering::SeqCst);
            poll
        })
        .await;
        (output, counter.self_wakes.load(Ordering::SeqCst))
    }

    #[tokio::test]
    async fn a_request_on_a_kept_connection_wakes_its_task_only_for_the_network() {
        let (url, _events) = raw_worker(None).await;
        let upstream = Upstream::new(&UpstreamConfig::default()).unwrap();
        assert_eq!(post(&upstream, &url).await, "ok");
        let (body, self_wakes) = with_self_wakes(post(&upstream, &url)).await;
        assert_eq!(body, "ok");
        assert_eq!(self_wakes, 0, "hyper's hand-overs woke the polling task");
    }

    #[tokio::test]
    async fn a_request_goes_with_the_clients_length_if_it_is_the_bodys_else_with_the_bodys() {
        let (url, mut events) = raw_worker(None).await;
        let upstream = Upstream::new(&UpstreamConfig::default()).unwrap();
        for (given, sent) in [
            (&["2"][..], "2"),
            (&["02"], "02"),
            (&["5"], "2"),
            (&["+2"], "2"),
            (&["2", "2"], "2"),
            (&[], "2"),
        ] {
            let mut headers = HeaderMap::new();
            for value in given {
                headers.append("content-length", value.parse().unwrap());
            }
            let response = post_by(&upstream, &url, &headers, an_hour()).await.unwrap();
            assert!(response.status().is_success());
            response.into_body().collect().await.unwrap();
            let head = loop {
                match events.recv().await.unwrap() {
                    head if head.starts_with("POST") => break head,
                    _ => {}
                }
            };
            let lengths: Vec<_> = head
                .lines()
                .filter_map(|l| l.strip_prefix("content-length: "))
                .collect();
            assert_eq!(lengths, [sent], "{given:?}: {head}");
        }
    }

    #[tokio::test]
    async fn a_workers_connection_carries_request_after_request() {
        let (url, mut events) = raw_worker(None).await;
        let upstream = Upstream::new(&UpstreamConfig::default()).unwrap();
        for _ in 0..3 {
            assert_eq!(post(&upstream, &url).await, "ok");
        }
        assert_eq!(events.recv().await.unwrap(), "accepted");
        let authority = url.strip_prefix("http://").unwrap();
        for _ in 0..3 {
            let head = events.recv().await.unwrap();
            assert!(
                head.starts_with("POST /v1/completions HTTP/1.1\r\n"),
                "{head}"
            );
            assert!(head.contains(&format!("host: {authority}")), "{head}");
        }
        assert!(events.try_recv().is_err(), "one connection for all three");
    }

    #[tokio::test]
    async fn an_idle_connection_the_worker_closed_is_replaced_without_a_failure() {
        let close = Arc::new(tokio::sync::Notify::new());
        let (url, mut events) = raw_worker(Some(Arc::clone(&close))).await;
        let upstream = Upstream::new(&UpstreamConfig::default()).unwrap();
        assert_eq!(post(&upstream, &url).await, "ok");
        // The response was read whole: the connection waits idle when the
        // worker closes it, and the router sees that only when it uses it.
        close.notify_one();
        for expected in ["accepted", "POST", "closed"] {
            assert!(events.recv().await.unwrap().starts_with(expected));
        }
        // The request goes on a new connection.
        assert_eq!(post(&upstream, &url).await, "ok");
        assert_eq!(events.recv().await.unwrap(), "accepted");
    }

    #[tokio::test]
    async fn a_departed_workers_idle_connection_is_closed_and_the_worker_forgotten() {
        let (gone, mut gone_events) = raw_worker(None).await;
        let (staying, _staying_events) = raw_worker(None).await;
        let mut upstream = Upstream::new(&UpstreamConfig::default()).unwrap();
        upstream.pool = Arc::new(super::Pool::new(std::time::Duration::from_millis(50)));
        assert_eq!(post(&upstream, &gone).await, "ok");
        assert_eq!(gone_events.recv().await.unwrap(), "accepted");
        assert!(gone_events.recv().await.unwrap().starts_with("POST"));
        // Only requests to the other worker end from now on.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        loop {
            assert_eq!(post(&upstream, &staying).await, "ok");
            let known = upstream
                .pool
                .hosts
                .lock()
                .unwrap()
                .by_url
                .contains_key(&*gone);
            if !known {
                break;
            }
            assert!(std::time::Instant::now() < deadline, "never forgotten");
            tokio::task::yield_now().await;
        }
        assert_eq!(gone_events.recv().await.unwrap(), "hung up");
    }
}
