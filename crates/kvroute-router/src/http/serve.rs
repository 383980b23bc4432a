//! Serving the HTTP API's connections: hyper's HTTP/1 server on each accepted
//! connection, told to finish gracefully when the router stops.
//!
//! Not `axum::serve`, whose layers cost a small proxied request ~2.7k
//! instructions of the router's ~55k (callgrind; docs/measurements/proxy-vs-nginx.md): it
//! serves through hyper-util's auto builder, which sniffs every connection for
//! HTTP/2 (this build serves HTTP/1 only) and passes every read through a
//! rewinding wrapper; it boxes every request's body into axum's `Body`; and
//! every poll of a connection, several a request, also polls the shutdown
//! watch, in a `select!` that draws a random number for its order. Here the
//! proxied endpoints read hyper's body as it is, and a connection polls its
//! shutdown signal only when that signal woke it.
//!
//! A request's service future is polled only when something it waits for woke
//! it ([`Gated`]): hyper's server polls it at every poll of the connection, and
//! hyper wakes the connection's task for its own parts too (taking a request
//! body's data wakes the body's sender, the connection), whose next poll ran
//! the whole proxied request's future (its worker connection, its timer) again
//! for nothing, once a small request.

use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Poll, Wake, Waker};
use std::time::Duration;

use axum::serve::Listener;
use futures_util::task::AtomicWaker;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::sync::watch;

use crate::http::api::Api;
use crate::limits;

/// Serves `api` on the connections `listener` accepts until `stopped` turns
/// true; then stops accepting, lets each connection finish the response it is
/// on (an idle one closes at once), and returns when all have closed.
///
/// A connection must deliver each request head within `header_read_timeout`
/// of its start or of its previous response's end, else it is closed: hyper's
/// timer runs from when it waits for a head, so it also bounds how long a
/// kept-alive connection sits idle. No timer runs while a response is sent.
pub async fn serve<L: Listener>(
    mut listener: L,
    api: Api,
    header_read_timeout: Duration,
    mut stopped: watch::Receiver<bool>,
) {
    // Each connection's task holds a receiver: the sender sees them all gone.
    let (open_tx, open) = watch::channel(());
    loop {
        let (io, _) = tokio::select! {
            accepted = listener.accept() => accepted,
            _ = stopped.wait_for(|&s| s) => break,
        };
        let mut stop = stopped.clone();
        let stop = Box::pin(async move {
            let _ = stop.wait_for(|&s| s).await;
        });
        let (api, open) = (api.clone(), open.clone());
        tokio::spawn(async move {
            // One request at a time on an HTTP/1 connection: its gate serves each.
            let gate = MarkingWaker::new();
            let service =
                service_fn(move |request| Gated::new(api.clone().respond(request), &gate));
            // Head and body copied into one buffer and sent with one write:
            // ~400 instructions a small request less than queueing them for
            // `writev` (callgrind); a response body is copied once more
            // (memcpy, about an instruction per 32 bytes).
            let connection = http1::Builder::new()
                .writev(false)
                .timer(TokioTimer::new())
                .header_read_timeout(header_read_timeout)
                .serve_connection(TokioIo::new(io), service);
            if let Err(e) = Graceful::new(connection, stop).await {
                // A head that did not finish in time, or none that began:
                // hyper does not tell them apart.
                if e.is_timeout() {
                    limits::count(limits::HEADER_READ_TIMEOUT);
                }
                tracing::trace!("connection ended: {e}");
            }
            drop(open);
        });
    }
    drop(open);
    drop(listener);
    open_tx.closed().await;
}

type Stop = Pin<Box<dyn Future<Output = ()> + Send>>;

pin_project_lite::pin_project! {
    /// A connection, shut down gracefully once `stop` is ready. `stop` is
    /// polled at first and then only when it woke the task, which it does
    /// through a [`MarkingWaker`]: the connection's own wake-ups cost one
    /// atomic swap each here.
    struct Graceful<I, S>
    where
        S: hyper::service::HttpService<hyper::body::Incoming>,
    {
        #[pin]
        connection: http1::Connection<I, S>,
        stop: Option<Stop>,
        stop_waker: Arc<MarkingWaker>,
    }
}

pin_project_lite::pin_project! {
    /// A request's service future, polled at first and then only when it
    /// woke the task, through its connection's [`MarkingWaker`] (see the
    /// module's doc).
    struct Gated<F> {
        #[pin]
        future: F,
        gate: Arc<MarkingWaker>,
    }
}

impl<F> Gated<F> {
    fn new(future: F, gate: &Arc<MarkingWaker>) -> Self {
        gate.woken.store(true, Ordering::Release);
        Self {
            future,
            gate: Arc::clone(gate),
        }
    }
}

impl<F: Future> Future for Gated<F> {
    type Output = F::Output;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
        let this = self.project();
        this.gate.task.register(cx.waker());
        if !this.gate.woken.swap(false, Ordering::Acquire) {
            return Poll::Pending;
        }
        let waker = Waker::from(Arc::clone(this.gate));
        this.future.poll(&mut Context::from_waker(&waker))
    }
}

impl<I, S> Graceful<I, S>
where
    S: hyper::service::HttpService<hyper::body::Incoming>,
{
    fn new(connection: http1::Connection<I, S>, stop: Stop) -> Self {
        Self {
            connection,
            stop: Some(stop),
            stop_waker: MarkingWaker::new(),
        }
    }
}

impl<I, S, B> Future for Graceful<I, S>
where
    I: hyper::rt::Read + hyper::rt::Write + Unpin,
    S: hyper::service::HttpService<hyper::body::Incoming, ResBody = B>,
    S::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
    B: hyper::body::Body + 'static,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    type Output = hyper::Result<()>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut this = self.project();
        if let Some(stop) = this.stop
            && this.stop_waker.woken.swap(false, Ordering::Acquire)
        {
            this.stop_waker.task.register(cx.waker());
            let waker = Waker::from(Arc::clone(this.stop_waker));
            if stop
                .as_mut()
                .poll(&mut Context::from_waker(&waker))
                .is_ready()
            {
                *this.stop = None;
                this.connection.as_mut().graceful_shutdown();
            }
        }
        this.connection.poll(cx)
    }
}

/// The waker a future polled only when it woke the task (a connection's
/// `stop`, a request's service future) is polled with: it marks that the
/// future woke the task, then wakes the task. The task's waker is registered
/// whenever the future's poller is polled; a spawned task's waker does not
/// change between polls.
struct MarkingWaker {
    woken: AtomicBool,
    task: AtomicWaker,
}

impl MarkingWaker {
    /// Marked: the future is polled at first.
    fn new() -> Arc<Self> {
        Arc::new(Self {
            woken: AtomicBool::new(true),
            task: AtomicWaker::new(),
        })
    }
}

impl Wake for MarkingWaker {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        self.woken.store(true, Ordering::Release);
        self.task.wake();
    }
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

    /// Counts the wakes of the task it stands for.
    #[derive(Default)]
    struct Task(std::sync::atomic::AtomicUsize);

    impl Wake for Task {
        fn wake(self: Arc<Self>) {
            self.0.fetch_add(1, Ordering::Relaxed);
        }
    }

    #[test]
    fn a_service_future_is_polled_again_only_once_it_woke_the_task() {
        let (polls, kept) = (
            std::sync::atomic::AtomicUsize::new(0),
            std::sync::Mutex::new(None::<Waker>),
        );
        let future = std::future::poll_fn(|cx| {
            polls.fetch_add(1, Ordering::Relaxed);
            *kept.lock().unwrap() = Some(cx.waker().clone());
            Poll::<()>::Pending
        });
        let gate = MarkingWaker::new();
        let mut gated = std::pin::pin!(Gated::new(future, &gate));
        let task = Arc::new(Task::default());
        let waker = Waker::from(Arc::clone(&task));
        let mut cx = Context::from_waker(&waker);
        assert!(gated.as_mut().poll(&mut cx).is_pending());
        assert_eq!(polls.load(Ordering::Relaxed), 1, "polled at first");
        // The task polled again for something else (hyper's own parts).
        assert!(gated.as_mut().poll(&mut cx).is_pending());
        assert_eq!(polls.load(Ordering::Relaxed), 1, "not woken: not polled");
        kept.lock().unwrap().take().unwrap().wake();
        assert_eq!(task.0.load(Ordering::Relaxed), 1, "its wake wakes the task");
        assert!(gated.as_mut().poll(&mut cx).is_pending());
        assert_eq!(polls.load(Ordering::Relaxed), 2, "woken: polled");
        // A connection's next request is polled at first, whatever came before.
        let mut next = std::pin::pin!(Gated::new(std::future::ready(7), &gate));
        assert_eq!(next.as_mut().poll(&mut cx), Poll::Ready(7));
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
