//! What a peer that connects and then sends too little can hold: connection
//! caps on both listeners, and the gRPC port's deadline for connections that
//! open no stream.
//!
//! Both ports share the process's file descriptors, so each listener has a cap
//! of its own (`limits.max_http_connections`, `limits.max_grpc_connections`)
//! and one per peer IP address (`..._per_peer`): a flood of one port, or from
//! one address, cannot starve the other. A connection over a cap is closed at
//! accept, before any TLS handshake; on the plain HTTP port it first gets a
//! 503 with an OpenAI-style body. Each refusal is counted in
//! `kvroute_limit_refusals_total{limit}`.
//!
//! A worker's gRPC stream lives for hours, so no deadline applies while a
//! connection has a stream open (HTTP/2 pings find dead peers then,
//! `ingest.keepalive_*`). A connection with none open for
//! `ingest.idle_connection_timeout_ms` — one that never sent a byte, never
//! finished HTTP/2's handshake, or only answers pings — is closed. A worker's
//! client reconnects on its next call.
//!
//! The HTTP port's deadlines are hyper's (the header read timeout, which also
//! closes idle kept-alive connections, see [`crate::http::serve`]) and the
//! request body's ([`crate::http::api`]).

use std::io;
use std::net::{IpAddr, SocketAddr};
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, ready};
use std::time::Duration;

use axum::serve::Listener;
use bytes::Bytes;
use futures_util::future::BoxFuture;
use rustc_hash::FxHashMap;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::time::{Instant, Sleep};
use tonic::transport::server::{Connected, TlsConnectInfo};

use crate::{limits, metrics};

/// Which listener a cap is for: its limits' labels, and whether an over-cap
/// client is told why (an HTTP/1.1 client can read a 503 sent before its
/// request; a gRPC client could not read one).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Port {
    Http,
    Grpc,
}

impl Port {
    fn limits(self) -> (&'static str, &'static str) {
        match self {
            Port::Http => (limits::HTTP_CONNECTIONS, limits::HTTP_CONNECTIONS_PER_PEER),
            Port::Grpc => (limits::GRPC_CONNECTIONS, limits::GRPC_CONNECTIONS_PER_PEER),
        }
    }
}

/// The connections open on one listener, in all and per peer address.
pub struct ConnectionCaps {
    port: Port,
    max: usize,
    max_per_peer: usize,
    open: Mutex<Open>,
}

#[derive(Default)]
struct Open {
    all: usize,
    per_peer: FxHashMap<IpAddr, usize>,
}

impl ConnectionCaps {
    pub fn new(port: Port, max: usize, max_per_peer: usize) -> Arc<Self> {
        Arc::new(Self {
            port,
            max,
            max_per_peer,
            open: Mutex::new(Open::default()),
        })
    }

    /// A place for a connection from `peer`, held until the [`Slot`] drops;
    /// `Err(the limit's label)` when a cap is reached (counted).
    fn admit(self: &Arc<Self>, peer: IpAddr) -> Result<Slot, &'static str> {
        let (all_limit, peer_limit) = self.port.limits();
        let mut open = self.open.lock().unwrap_or_else(|e| e.into_inner());
        let refused = if open.all >= self.max {
            Some(all_limit)
        } else if open.per_peer.get(&peer).copied().unwrap_or(0) >= self.max_per_peer {
            Some(peer_limit)
        } else {
            None
        };
        if let Some(limit) = refused {
            drop(open);
            limits::count(limit);
            return Err(limit);
        }
        open.all += 1;
        *open.per_peer.entry(peer).or_default() += 1;
        Ok(Slot {
            caps: Arc::clone(self),
            peer,
        })
    }
}

/// One connection's place under its listener's caps.
struct Slot {
    caps: Arc<ConnectionCaps>,
    peer: IpAddr,
}

impl Drop for Slot {
    fn drop(&mut self) {
        let mut open = self.caps.open.lock().unwrap_or_else(|e| e.into_inner());
        open.all -= 1;
        // An address's entry goes with its last connection: the map holds
        // only peers connected now.
        if let Some(n) = open.per_peer.get_mut(&self.peer) {
            *n -= 1;
            if *n == 0 {
                open.per_peer.remove(&self.peer);
            }
        }
    }
}

/// A TCP listener that admits connections under its [`ConnectionCaps`].
pub struct CappedListener {
    tcp: TcpListener,
    caps: Arc<ConnectionCaps>,
    stream_deadline: Option<Duration>,
}

impl CappedListener {
    pub fn new(tcp: TcpListener, caps: Arc<ConnectionCaps>) -> Self {
        Self {
            tcp,
            caps,
            stream_deadline: None,
        }
    }

    /// For the gRPC port: each connection closed once it has had no stream
    /// open for `timeout` (counted by [`CountStreamsLayer`]).
    pub fn closing_streamless(self, timeout: Duration) -> Self {
        Self {
            stream_deadline: Some(timeout),
            ..self
        }
    }
}

/// The answer of the plain HTTP port to a connection over a cap, sent before
/// its request is read.
fn over_cap_response(limit: &str) -> String {
    let body = serde_json::json!({"error": {
        "message": format!("too many connections to the router (limits.max_{limit}); retry later"),
        "type": "server_error",
        "code": "too_many_connections",
    }})
    .to_string();
    format!(
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n\
         retry-after: 1\r\nconnection: close\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    )
}

impl Listener for CappedListener {
    type Io = Admitted<TcpStream>;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Self::Io, SocketAddr) {
        loop {
            let (tcp, peer) = Listener::accept(&mut self.tcp).await;
            match self.caps.admit(peer.ip()) {
                Ok(slot) => {
                    // Small SSE chunks and gRPC acks must not wait for
                    // Nagle's algorithm (the peer's delayed ACK, ~40 ms).
                    let _ = tcp.set_nodelay(true);
                    let admitted = Admitted {
                        io: tcp,
                        _slot: slot,
                        streams: self.stream_deadline.map(StreamDeadline::new),
                    };
                    return (admitted, peer);
                }
                Err(limit) => {
                    // One non-blocking write into a fresh socket's empty
                    // buffer: the accept loop never waits on a refused peer.
                    if self.caps.port == Port::Http {
                        let _ = tcp.try_write(over_cap_response(limit).as_bytes());
                    }
                }
            }
        }
    }

    fn local_addr(&self) -> io::Result<SocketAddr> {
        self.tcp.local_addr()
    }
}

/// A connection holding its place under its listener's caps until it drops;
/// on the gRPC port, closed once it has had no stream open for its deadline.
pub struct Admitted<IO> {
    io: IO,
    _slot: Slot,
    streams: Option<StreamDeadline>,
}

impl<IO> Connected for Admitted<IO> {
    type ConnectInfo = Option<OpenStreams>;

    fn connect_info(&self) -> Option<OpenStreams> {
        self.streams.as_ref().map(|s| s.streams.clone())
    }
}

impl kvroute_tls::Peek for Admitted<TcpStream> {
    async fn peek(&self, buf: &mut [u8]) -> io::Result<usize> {
        self.io.peek(buf).await
    }
}

impl<IO: AsyncRead + Unpin> AsyncRead for Admitted<IO> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = &mut *self;
        match (Pin::new(&mut this.io).poll_read(cx, buf), &mut this.streams) {
            (Poll::Pending, Some(streams)) => streams.poll_expired(cx),
            (read, _) => read,
        }
    }
}

impl<IO: AsyncWrite + Unpin> AsyncWrite for Admitted<IO> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.io).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.io).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
}

/// The gRPC streams open on one connection, and since when it has had none.
#[derive(Clone)]
pub struct OpenStreams(Arc<Mutex<Streams>>);

struct Streams {
    open: usize,
    none_since: Instant,
}

impl OpenStreams {
    fn new() -> Self {
        Self(Arc::new(Mutex::new(Streams {
            open: 0,
            none_since: Instant::now(),
        })))
    }

    /// When the connection has had no stream open for `timeout`: `None`
    /// while one is open.
    fn idle_deadline(&self, timeout: Duration) -> Option<Instant> {
        let streams = self.0.lock().unwrap_or_else(|e| e.into_inner());
        (streams.open == 0).then(|| streams.none_since + timeout)
    }

    fn opened(&self) -> StreamOpen {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).open += 1;
        StreamOpen(self.clone())
    }
}

/// One gRPC stream (or unary call) open on its connection, until its
/// response body drops.
struct StreamOpen(OpenStreams);

impl Drop for StreamOpen {
    fn drop(&mut self) {
        let mut streams = self.0.0.lock().unwrap_or_else(|e| e.into_inner());
        streams.open -= 1;
        if streams.open == 0 {
            streams.none_since = Instant::now();
        }
    }
}

/// The deadline of a gRPC connection with no stream open. HTTP/2 reads a
/// connection whenever it is woken, and ending a stream wakes it (to send the
/// stream's end), so the deadline is armed whenever it is due.
struct StreamDeadline {
    streams: OpenStreams,
    timeout: Duration,
    deadline: Pin<Box<Sleep>>,
}

impl StreamDeadline {
    fn new(timeout: Duration) -> Self {
        Self {
            streams: OpenStreams::new(),
            timeout,
            deadline: Box::pin(tokio::time::sleep(timeout)),
        }
    }

    /// For a read that found nothing: the error that closes the connection
    /// once it has had no stream open for the timeout, else pending.
    fn poll_expired(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let Some(deadline) = self.streams.idle_deadline(self.timeout) else {
            return Poll::Pending;
        };
        if self.deadline.deadline() != deadline {
            self.deadline.as_mut().reset(deadline);
        }
        ready!(self.deadline.as_mut().poll(cx));
        limits::count(limits::GRPC_IDLE_TIMEOUT);
        Poll::Ready(Err(io::Error::new(
            io::ErrorKind::TimedOut,
            "no gRPC stream open within ingest.idle_connection_timeout_ms",
        )))
    }
}

/// The connections `listener` accepts, for tonic's `serve_with_incoming`.
pub fn incoming<L: Listener>(listener: L) -> impl futures_util::Stream<Item = io::Result<L::Io>> {
    futures_util::stream::unfold(listener, |mut listener| async move {
        let (io, _) = listener.accept().await;
        Some((Ok(io), listener))
    })
}

/// The tower layer of the gRPC server that counts each connection's open
/// streams ([`OpenStreams`]: tonic puts each connection's [`Connected`] info
/// in its requests' extensions, within TLS's over TLS).
#[derive(Clone, Copy)]
pub struct CountStreamsLayer;

impl<S> tower::Layer<S> for CountStreamsLayer {
    type Service = CountStreams<S>;

    fn layer(&self, inner: S) -> CountStreams<S> {
        CountStreams { inner }
    }
}

#[derive(Clone)]
pub struct CountStreams<S> {
    inner: S,
}

impl<S, ReqBody, ResBody> tower::Service<http::Request<ReqBody>> for CountStreams<S>
where
    S: tower::Service<http::Request<ReqBody>, Response = http::Response<ResBody>>,
    S::Future: Send + 'static,
    ResBody: http_body::Body<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<tonic::codegen::StdError>,
{
    type Response = http::Response<tonic::body::Body>;
    type Error = S::Error;
    type Future = BoxFuture<'static, Result<Self::Response, S::Error>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<ReqBody>) -> Self::Future {
        let extensions = request.extensions();
        let streams = match extensions.get::<Option<OpenStreams>>() {
            Some(plain) => plain.as_ref(),
            None => extensions
                .get::<TlsConnectInfo<Option<OpenStreams>>>()
                .and_then(|tls| tls.get_ref().as_ref()),
        };
        let open = streams.map(OpenStreams::opened);
        let response = self.inner.call(request);
        Box::pin(async move {
            let response = response.await?;
            Ok(response.map(|body| tonic::body::Body::new(WithStream { body, _open: open })))
        })
    }
}

pin_project_lite::pin_project! {
    /// A gRPC response body, its stream counted open until it drops.
    struct WithStream<B> {
        #[pin]
        body: B,
        _open: Option<StreamOpen>,
    }
}

impl<B: http_body::Body> http_body::Body for WithStream<B> {
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<B::Data>, B::Error>>> {
        self.project().body.poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.body.size_hint()
    }
}

/// Counts a TLS handshake that failed on either listener (HTTP, gRPC, `[epp]`).
pub(crate) fn count_tls_failure(serves: kvroute_tls::Serves) {
    ::metrics::counter!(metrics::TLS_HANDSHAKE_FAILURES, "listener" => serves.name()).increment(1);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn caps_count_connections_in_all_and_per_peer_until_they_close() {
        let caps = ConnectionCaps::new(Port::Grpc, 3, 2);
        let (a, b): (IpAddr, IpAddr) = ([10, 0, 0, 1].into(), [10, 0, 0, 2].into());
        let a1 = caps.admit(a).unwrap();
        let _a2 = caps.admit(a).unwrap();
        assert_eq!(caps.admit(a).err(), Some(limits::GRPC_CONNECTIONS_PER_PEER));
        let _b1 = caps.admit(b).unwrap();
        assert_eq!(caps.admit(b).err(), Some(limits::GRPC_CONNECTIONS));
        drop(a1);
        let _b2 = caps.admit(b).unwrap();
        assert_eq!(caps.open.lock().unwrap().per_peer.len(), 2);
    }

    #[test]
    fn a_peers_entry_goes_with_its_last_connection() {
        let caps = ConnectionCaps::new(Port::Http, 8, 8);
        let slots: Vec<Slot> = (0..3)
            .map(|_| caps.admit([10, 0, 0, 1].into()).unwrap())
            .collect();
        drop(slots);
        let open = caps.open.lock().unwrap();
        assert_eq!(open.all, 0);
        assert!(open.per_peer.is_empty());
    }

    #[tokio::test(start_paused = true)]
    async fn a_connection_without_a_stream_is_closed_at_its_deadline_and_one_with_a_stream_is_not()
    {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};

        let timeout = Duration::from_secs(60);
        let (mut client, server) = tokio::io::duplex(64);
        let caps = ConnectionCaps::new(Port::Grpc, 1, 1);
        let mut connection = Admitted {
            io: server,
            _slot: caps.admit([10, 0, 0, 1].into()).unwrap(),
            streams: Some(StreamDeadline::new(timeout)),
        };
        let open = connection.connect_info().unwrap().opened();
        // With a stream open for longer than the timeout, reads wait on.
        let mut buf = [0; 8];
        let waited = tokio::time::timeout(timeout * 2, connection.read(&mut buf)).await;
        assert!(waited.is_err(), "cut with a stream open");
        drop(open);
        let started = Instant::now();
        let read = connection.read(&mut buf).await;
        assert_eq!(read.unwrap_err().kind(), io::ErrorKind::TimedOut);
        assert_eq!(started.elapsed(), timeout, "counted from the stream's end");
        // Bytes that arrive are read as they are, deadline or not.
        client.write_all(b"hi").await.unwrap();
        assert_eq!(connection.read(&mut buf).await.unwrap(), 2);
    }
}
