//! Serving the HTTP API's connections: the axum [`Router`] on hyper-util's
//! auto builder (HTTP/1.1, and HTTP/2 by prior knowledge or by ALPN over
//! TLS), each connection told to finish gracefully when the router stops.
//!
//! Not `axum::serve`: it sets no header-read deadline, so a client could hold
//! a connection by never finishing a request head, or by never sending one.
//! This is how axum documents serving its router at a lower level, with the
//! deadlines the adversarial tests hold the router to:
//! - a request head must come within `limits.header_read_timeout_ms` of the
//!   connection's start: until a connection has made its first request, it is
//!   closed at that deadline, whatever its protocol (the auto builder's
//!   protocol sniff has no timer of its own, so a silent client would stay);
//! - on HTTP/1, hyper's header-read timer runs whenever the connection waits
//!   for a head, so it also closes a kept-alive connection left idle.
//!
//! No timer runs while a response is sent: long streams are never cut here.
//! Closing a connection at a head deadline is counted as
//! `kvroute_limit_refusals_total{limit="header_read_timeout"}`.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::serve::Listener;
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use hyper_util::server::graceful::GracefulShutdown;
use tokio::sync::watch;
use tower::Service;

use crate::limits;

/// Serves `api` on the connections `listener` accepts until `stopped` turns
/// true; then stops accepting, lets each connection finish the responses it
/// is on (an idle one closes at once), and returns when all have closed.
pub async fn serve<L: Listener>(
    mut listener: L,
    api: Router,
    header_read_timeout: Duration,
    mut stopped: watch::Receiver<bool>,
) {
    let mut builder = auto::Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(header_read_timeout);
    let graceful = GracefulShutdown::new();
    loop {
        let (io, _) = tokio::select! {
            accepted = listener.accept() => accepted,
            _ = stopped.wait_for(|&s| s) => break,
        };
        let (builder, api, watcher) = (builder.clone(), api.clone(), graceful.watcher());
        tokio::spawn(async move {
            let asked = Arc::new(AtomicBool::new(false));
            let service = {
                let asked = Arc::clone(&asked);
                service_fn(move |request: hyper::Request<Incoming>| {
                    asked.store(true, Ordering::Relaxed);
                    api.clone().call(request.map(Body::new))
                })
            };
            let connection = watcher.watch(builder.serve_connection(TokioIo::new(io), service));
            let mut connection = std::pin::pin!(connection);
            let ended = match tokio::time::timeout(header_read_timeout, &mut connection).await {
                Ok(ended) => ended,
                Err(_) if !asked.load(Ordering::Relaxed) => {
                    limits::count(limits::HEADER_READ_TIMEOUT);
                    return;
                }
                Err(_) => connection.await,
            };
            if let Err(e) = ended {
                // A later head that did not finish in time, or none that
                // began on a kept-alive connection: hyper does not tell them
                // apart.
                if e.downcast_ref::<hyper::Error>()
                    .is_some_and(hyper::Error::is_timeout)
                {
                    limits::count(limits::HEADER_READ_TIMEOUT);
                }
                tracing::trace!("connection ended: {e}");
            }
        });
    }
    drop(listener);
    graceful.shutdown().await;
}

#[cfg(test)]
mod tests {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::{TcpListener, TcpStream};

    use super::*;
    use crate::config::Config;
    use crate::state::AppState;

    /// Reads one response to `GET /healthz` (its body is the last thing sent).
    async fn healthz(client: &mut TcpStream) -> String {
        client
            .write_all(b"GET /healthz HTTP/1.1\r\nhost: router\r\n\r\n")
            .await
            .unwrap();
        let mut response = Vec::new();
        while !response.ends_with(b"}") {
            let mut buf = [0; 1024];
            let n = client.read(&mut buf).await.unwrap();
            assert!(n > 0, "closed mid-response: {response:?}");
            response.extend_from_slice(&buf[..n]);
        }
        String::from_utf8(response).unwrap()
    }

    #[tokio::test]
    async fn a_stop_closes_idle_kept_connections_and_serving_returns() {
        let state = AppState::new(Config::default(), None).unwrap();
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (stop, stopped) = watch::channel(false);
        let api = crate::http::api::service(state);
        let serving = tokio::spawn(serve(listener, api, Duration::from_secs(60), stopped));
        let mut client = TcpStream::connect(addr).await.unwrap();
        // Two requests on one connection: it is kept, and is idle now.
        assert!(healthz(&mut client).await.starts_with("HTTP/1.1 200"));
        assert!(healthz(&mut client).await.starts_with("HTTP/1.1 200"));
        stop.send(true).unwrap();
        // Only a guard against hanging: serving returns once the connection closed.
        tokio::time::timeout(Duration::from_secs(30), serving)
            .await
            .expect("serving returned")
            .unwrap();
        let mut rest = Vec::new();
        client.read_to_end(&mut rest).await.unwrap();
        assert!(rest.is_empty(), "{rest:?}");
    }
}
