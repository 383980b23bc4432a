//! TLS listeners: TCP accept, then the TLS handshake, for `axum::serve` (the
//! HTTPS API, a simulated engine's HTTPS) and for tonic (gRPC ingest). The TCP
//! side is any [`Listener`] whose connections can [`Peek`]: a `TcpListener`,
//! or the router's, which caps connections before any handshake.
//!
//! Handshakes run concurrently, each bounded by [`HANDSHAKE_TIMEOUT`], so a
//! client that connects and says nothing holds up no one else; `accept` returns
//! connections in the order their handshakes finish. Dropping the listener
//! closes the port and abandons the handshakes under way, as dropping a
//! `TcpListener` would.
//!
//! A failed handshake (a plain-text client, a worker without the client
//! certificate asked for, a peer that does not trust our CA or that we do not
//! trust) would otherwise be seen by no one but the client. Each one is passed
//! to the listener's `on_failure` (the router counts it in a metric) and logged
//! with the peer's address and rustls' reason: the first at once, then at most
//! one line per [`LOG_INTERVAL`], which also says how many were not logged, so
//! a flood of bad clients cannot flood the log. A connection closed before its
//! first byte (a TCP health probe) is no handshake and no failure.
//!
//! A client speaking plain HTTP to the HTTPS port would otherwise only see its
//! connection closed. Its first byte cannot open a TLS record, so it gets a
//! plain `400` whose JSON body says to use `https://`, then the connection closes.

use std::io;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::serve::Listener;
use rustls::ServerConfig;
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinSet;
use tokio::time::Instant;
use tokio_rustls::TlsAcceptor;
use tokio_rustls::server::TlsStream;

use crate::server::HANDSHAKE_TIMEOUT;

/// The first byte of every TLS connection: a handshake record.
const TLS_HANDSHAKE_RECORD: u8 = 0x16;

/// At most one log line about failed handshakes per listener this often.
pub const LOG_INTERVAL: Duration = Duration::from_secs(10);

const PLAIN_HTTP_REFUSAL: &str = r#"{"error": {"message": "this port speaks HTTPS (TLS): use an https:// URL", "type": "invalid_request_error", "code": "plain_http_on_https_port"}}"#;

/// What a listener serves: its name in logs and metrics, and whether a
/// plain-text client is answered (an HTTP/1.1 client can read a 400; a gRPC
/// client speaking HTTP/2 could not).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Serves {
    Http,
    Grpc,
}

impl Serves {
    pub fn name(self) -> &'static str {
        match self {
            Serves::Http => "http",
            Serves::Grpc => "grpc",
        }
    }
}

/// A connection whose first bytes can be seen without taking them: how a
/// plain-text client is told from a TLS one.
pub trait Peek: AsyncRead + AsyncWrite + Unpin + Send + 'static {
    fn peek(&self, buf: &mut [u8]) -> impl Future<Output = io::Result<usize>> + Send;
}

impl Peek for TcpStream {
    async fn peek(&self, buf: &mut [u8]) -> io::Result<usize> {
        TcpStream::peek(self, buf).await
    }
}

/// How one connection's handshake ended.
enum Handshake<IO> {
    Done(Box<TlsStream<IO>>, SocketAddr),
    Failed(SocketAddr, String),
    /// Closed or reset before its first byte.
    Closed,
}

pub struct TlsListener<L: Listener = TcpListener> {
    tcp: L,
    acceptor: TlsAcceptor,
    serves: Serves,
    on_failure: fn(Serves),
    handshakes: JoinSet<Handshake<L::Io>>,
    log: FailureLog,
}

impl<L> TlsListener<L>
where
    L: Listener<Addr = SocketAddr>,
    L::Io: Peek,
{
    /// `on_failure` is called once per failed handshake, beside the log line.
    pub fn new(tcp: L, config: Arc<ServerConfig>, serves: Serves, on_failure: fn(Serves)) -> Self {
        TlsListener {
            tcp,
            acceptor: TlsAcceptor::from(config),
            serves,
            on_failure,
            handshakes: JoinSet::new(),
            log: FailureLog::default(),
        }
    }

    /// The next connection whose handshake succeeded.
    pub async fn accept(&mut self) -> (TlsStream<L::Io>, SocketAddr) {
        loop {
            tokio::select! {
                // Accept errors (a client gone, out of file descriptors) are
                // the TCP listener's to handle: it waits instead of spinning.
                (tcp, peer) = self.tcp.accept() => {
                    let (acceptor, serves) = (self.acceptor.clone(), self.serves);
                    self.handshakes.spawn(async move {
                        tokio::time::timeout(HANDSHAKE_TIMEOUT, handshake(acceptor, tcp, peer, serves))
                            .await
                            .unwrap_or_else(|_| Handshake::Failed(
                                peer,
                                format!("no handshake within {} s", HANDSHAKE_TIMEOUT.as_secs()),
                            ))
                    });
                }
                Some(done) = self.handshakes.join_next() => match done {
                    Ok(Handshake::Done(tls, peer)) => return (*tls, peer),
                    Ok(Handshake::Failed(peer, reason)) => self.failed(peer, &reason),
                    Ok(Handshake::Closed) => {}
                    Err(e) => tracing::debug!("TLS handshake task failed: {e}"),
                },
            }
        }
    }

    fn failed(&mut self, peer: SocketAddr, reason: &str) {
        (self.on_failure)(self.serves);
        if let Some(unlogged) = self.log.note(Instant::now()) {
            let listener = self.serves.name();
            if unlogged == 0 {
                tracing::warn!(listener, %peer, "TLS handshake failed: {reason}");
            } else {
                tracing::warn!(
                    listener,
                    %peer,
                    unlogged,
                    "TLS handshake failed: {reason} ({unlogged} more failed since the last line)"
                );
            }
        }
    }
}

async fn handshake<IO: Peek>(
    acceptor: TlsAcceptor,
    mut tcp: IO,
    peer: SocketAddr,
    serves: Serves,
) -> Handshake<IO> {
    let mut first = [0u8; 1];
    match tcp.peek(&mut first).await {
        Ok(1) if first[0] == TLS_HANDSHAKE_RECORD => {}
        Ok(1) => {
            if serves == Serves::Http {
                let response = format!(
                    "HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\n\
                     connection: close\r\ncontent-length: {}\r\n\r\n{PLAIN_HTTP_REFUSAL}",
                    PLAIN_HTTP_REFUSAL.len()
                );
                let _ = tcp.write_all(response.as_bytes()).await;
                let _ = tcp.shutdown().await;
            }
            return Handshake::Failed(
                peer,
                format!("plain text, not TLS (first byte {:#04x})", first[0]),
            );
        }
        _ => return Handshake::Closed,
    }
    match acceptor.accept(tcp).await {
        Ok(tls) => Handshake::Done(Box::new(tls), peer),
        // rustls' reason (e.g. "peer sent no certificates", "invalid peer
        // certificate: UnknownIssuer", "received fatal alert: UnknownCA").
        Err(e) => Handshake::Failed(peer, e.to_string()),
    }
}

impl<L> Listener for TlsListener<L>
where
    L: Listener<Addr = SocketAddr>,
    L::Io: Peek,
{
    type Io = TlsStream<L::Io>;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        TlsListener::accept(self).await
    }

    fn local_addr(&self) -> io::Result<Self::Addr> {
        self.tcp.local_addr()
    }
}

/// When to log a failure: the first at once, then at most once per [`LOG_INTERVAL`].
#[derive(Default)]
struct FailureLog {
    last_line: Option<Instant>,
    unlogged: u64,
}

impl FailureLog {
    /// Notes a failure at `now`; `Some(failures not logged before it)` when
    /// this one is to be logged.
    fn note(&mut self, now: Instant) -> Option<u64> {
        if self
            .last_line
            .is_some_and(|last| now.duration_since(last) < LOG_INTERVAL)
        {
            self.unlogged += 1;
            return None;
        }
        self.last_line = Some(now);
        Some(std::mem::take(&mut self.unlogged))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_flood_of_failures_logs_one_line_per_interval() {
        let mut log = FailureLog::default();
        let start = Instant::now();
        assert_eq!(log.note(start), Some(0));
        for _ in 0..1000 {
            assert_eq!(log.note(start), None);
        }
        let almost = start + LOG_INTERVAL - Duration::from_millis(1);
        assert_eq!(log.note(almost), None);
        assert_eq!(log.note(start + LOG_INTERVAL), Some(1001));
        assert_eq!(log.note(start + LOG_INTERVAL), None);
    }
}
