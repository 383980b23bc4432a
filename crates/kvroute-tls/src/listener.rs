//! An HTTPS listener for `axum::serve`: TCP accept, then the TLS handshake.
//!
//! Handshakes run concurrently, each bounded by [`HANDSHAKE_TIMEOUT`], so a
//! client that connects and says nothing holds up no one else; `accept` returns
//! connections in the order their handshakes finish. Dropping the listener
//! closes the port and abandons the handshakes under way, as dropping a
//! `TcpListener` would.
//!
//! A client speaking plain HTTP to this port would otherwise only see its
//! connection closed. Its first byte cannot open a TLS record, so it gets a
//! plain `400` whose JSON body says to use `https://`, then the connection closes.

use std::io;
use std::net::SocketAddr;
use std::sync::Arc;

use rustls::ServerConfig;
use tokio::io::AsyncWriteExt;
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinSet;
use tokio_rustls::TlsAcceptor;
use tokio_rustls::server::TlsStream;

use crate::server::HANDSHAKE_TIMEOUT;

/// The first byte of every TLS connection: a handshake record.
const TLS_HANDSHAKE_RECORD: u8 = 0x16;

const PLAIN_HTTP_REFUSAL: &str = r#"{"error": {"message": "this port speaks HTTPS (TLS): use an https:// URL", "type": "invalid_request_error", "code": "plain_http_on_https_port"}}"#;

type Handshake = io::Result<(TlsStream<TcpStream>, SocketAddr)>;

pub struct TlsListener {
    tcp: TcpListener,
    acceptor: TlsAcceptor,
    handshakes: JoinSet<Handshake>,
}

impl TlsListener {
    pub fn new(tcp: TcpListener, config: Arc<ServerConfig>) -> Self {
        TlsListener {
            tcp,
            acceptor: TlsAcceptor::from(config),
            handshakes: JoinSet::new(),
        }
    }
}

async fn handshake(acceptor: TlsAcceptor, tcp: TcpStream, peer: SocketAddr) -> Handshake {
    // Small SSE chunks must not wait for Nagle's algorithm.
    tcp.set_nodelay(true)?;
    let mut first = [0u8; 1];
    if tcp.peek(&mut first).await? == 1 && first[0] != TLS_HANDSHAKE_RECORD {
        let mut tcp = tcp;
        let response = format!(
            "HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\n\
             connection: close\r\ncontent-length: {}\r\n\r\n{PLAIN_HTTP_REFUSAL}",
            PLAIN_HTTP_REFUSAL.len()
        );
        tcp.write_all(response.as_bytes()).await?;
        tcp.shutdown().await?;
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "plain HTTP on the HTTPS port",
        ));
    }
    Ok((acceptor.accept(tcp).await?, peer))
}

impl axum::serve::Listener for TlsListener {
    type Io = TlsStream<TcpStream>;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        loop {
            tokio::select! {
                accepted = self.tcp.accept() => match accepted {
                    Ok((tcp, peer)) => {
                        let acceptor = self.acceptor.clone();
                        self.handshakes.spawn(async move {
                            tokio::time::timeout(HANDSHAKE_TIMEOUT, handshake(acceptor, tcp, peer))
                                .await
                                .unwrap_or_else(|_| Err(io::ErrorKind::TimedOut.into()))
                        });
                    }
                    // A client that left before it was accepted.
                    Err(e) if matches!(
                        e.kind(),
                        io::ErrorKind::ConnectionAborted | io::ErrorKind::ConnectionReset
                    ) => {}
                    // Out of file descriptors and the like: new connections wait
                    // (as axum's own listener does) instead of spinning.
                    Err(e) => {
                        tracing::warn!("accept failed: {e}");
                        tokio::time::sleep(std::time::Duration::from_secs(1)).await;
                    }
                },
                Some(done) = self.handshakes.join_next() => match done {
                    Ok(Ok(connection)) => return connection,
                    Ok(Err(e)) => tracing::debug!("TLS handshake failed: {e}"),
                    Err(e) => tracing::debug!("TLS handshake task failed: {e}"),
                },
            }
        }
    }

    fn local_addr(&self) -> io::Result<Self::Addr> {
        self.tcp.local_addr()
    }
}
