//! Attacks through peers: clients and would-be workers that connect and then
//! send too little, too slowly or nothing, to hold the router's connections,
//! its in-flight places and its file descriptors (issue #36, attack 4). No
//! credentials are needed for any of them. See tests/adversarial.rs.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use serde_json::json;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpSocket, TcpStream};

use crate::common::*;

/// Longest wait for the router to answer or close a connection: far beyond
/// every deadline configured here, for a loaded machine.
const GUARD: Duration = Duration::from_secs(15);

/// A connection to the router's `url` (`http://HOST:PORT`) from the loopback
/// address `from`: each 127.0.0.x is a peer of its own.
async fn connect_from(from: [u8; 4], url: &str) -> TcpStream {
    let to: SocketAddr = url.trim_start_matches("http://").parse().unwrap();
    let socket = TcpSocket::new_v4().unwrap();
    socket.bind(SocketAddr::from((from, 0))).unwrap();
    socket.connect(to).await.unwrap()
}

/// All the router sends until it closes the connection (a reset counts as
/// closed); fails if it is still open after [`GUARD`].
async fn read_until_closed(stream: &mut TcpStream) -> Vec<u8> {
    let mut received = Vec::new();
    let read = tokio::time::timeout(GUARD, async {
        let mut buf = [0; 4096];
        while let Ok(n @ 1..) = stream.read(&mut buf).await {
            received.extend_from_slice(&buf[..n]);
        }
    });
    read.await.unwrap_or_else(|_| {
        panic!(
            "the router kept the connection open; it sent {:?}",
            String::from_utf8_lossy(&received)
        )
    });
    received
}

/// An HTTP response's status and OpenAI-style error body, from its bytes.
fn error_response(response: &[u8]) -> (u16, serde_json::Value) {
    let text = String::from_utf8_lossy(response);
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let status = head
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("no status line in {text:?}"));
    let body = serde_json::from_str(body).unwrap_or_else(|e| panic!("{e}: {text:?}"));
    (status, body)
}

/// Sends `GET /healthz` on a kept connection; the response's status line.
async fn healthz_on(stream: &mut TcpStream) -> String {
    stream
        .write_all(b"GET /healthz HTTP/1.1\r\nhost: router\r\n\r\n")
        .await
        .unwrap();
    let mut response = Vec::new();
    let read = tokio::time::timeout(GUARD, async {
        while !response.ends_with(b"}") {
            let mut buf = [0; 1024];
            match stream.read(&mut buf).await {
                Ok(n @ 1..) => response.extend_from_slice(&buf[..n]),
                _ => break,
            }
        }
    });
    read.await.expect("an answer to /healthz");
    let text = String::from_utf8_lossy(&response);
    text.lines().next().unwrap_or_default().to_string()
}

/// Whether the gRPC port served this connection: HTTP/2's server preface, a
/// SETTINGS frame (type 4), is the first thing it sends; a connection closed
/// at accept gets nothing.
async fn grpc_served(stream: &mut TcpStream) -> bool {
    let mut frame_header = [0; 9];
    match tokio::time::timeout(GUARD, stream.read_exact(&mut frame_header)).await {
        Ok(Ok(_)) => frame_header[3] == 4,
        Ok(Err(_)) => false,
        Err(_) => panic!("the gRPC port neither served nor closed the connection"),
    }
}

/// `kvroute_limit_refusals_total{limit}`, read on a new connection once one
/// is served.
async fn refusals(router: &RouterProcess, limit: &str) -> f64 {
    let url = format!("{}/metrics", router.http);
    let started = Instant::now();
    loop {
        let reply = Http::default().get(&url).await;
        if reply.status == 200 {
            return metric(
                &reply.text(),
                "kvroute_limit_refusals_total",
                &[("limit", limit)],
            );
        }
        assert!(started.elapsed() < DEADLINE, "/metrics: {}", reply.text());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Worker 1, serving model `m` at `url`, registered over a real gRPC stream.
async fn registered_worker(router: &RouterProcess, url: &str) -> GrpcWorker {
    let register = register(1, url, &["m"], BLOCK_SIZE as u32);
    let worker = GrpcWorker::connect(&router.grpc, None, register)
        .await
        .unwrap();
    wait_registered(router, 1).await;
    worker
}

/// Head of a completion request declaring a body of `length` bytes.
fn completion_head(length: usize) -> String {
    format!(
        "POST /v1/completions HTTP/1.1\r\nhost: router\r\ncontent-type: application/json\r\n\
         content-length: {length}\r\n\r\n"
    )
}

#[tokio::test]
async fn half_a_header_silence_and_idle_kept_connections_are_closed_at_the_header_deadline() {
    let router = RouterProcess::start("[limits]\nheader_read_timeout_ms = 500\n");
    let from = [127, 0, 0, 1];

    // Slowloris: a request head that never ends.
    let started = Instant::now();
    let mut half = connect_from(from, &router.http).await;
    half.write_all(b"POST /v1/completions HTTP/1.1\r\nhost: rou")
        .await
        .unwrap();
    let sent = read_until_closed(&mut half).await;
    assert!(sent.is_empty(), "{:?}", String::from_utf8_lossy(&sent));
    assert!(
        started.elapsed() >= Duration::from_millis(450),
        "closed at {:?}, before its deadline",
        started.elapsed()
    );

    // A connection that never sends a byte.
    let mut silent = connect_from(from, &router.http).await;
    assert!(read_until_closed(&mut silent).await.is_empty());

    // A kept-alive connection idle after its request.
    let mut kept = connect_from(from, &router.http).await;
    assert_eq!(healthz_on(&mut kept).await, "HTTP/1.1 200 OK");
    assert!(read_until_closed(&mut kept).await.is_empty());

    eventually("the three closes to be counted", || async {
        refusals(&router, "header_read_timeout").await == 3.0
    })
    .await;
}

#[tokio::test]
async fn slow_request_bodies_are_cut_and_hold_no_inflight_place_while_an_honest_client_is_served() {
    let router = RouterProcess::start(
        "[limits]\nmax_inflight_requests = 1\nbody_read_timeout_ms = 2000\nmin_body_bytes_per_s = 1000\n",
    );
    let worker = TestWorker::start(1).await;
    let _stream = registered_worker(&router, &worker.url).await;
    let from = [127, 0, 0, 1];

    // One declares 1000 bytes, sends one and stalls; the other trickles a
    // byte every 100 ms, 10 bytes a second against the 1000 asked for.
    let mut stalled = connect_from(from, &router.http).await;
    stalled
        .write_all(format!("{}{{", completion_head(1000)).as_bytes())
        .await
        .unwrap();
    let trickler = connect_from(from, &router.http).await;
    let (mut trickled_reads, mut trickled_writes) = trickler.into_split();
    trickled_writes
        .write_all(completion_head(1000).as_bytes())
        .await
        .unwrap();
    let trickle = tokio::spawn(async move {
        while trickled_writes.write_all(b" ").await.is_ok() {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    });

    // The only in-flight place is free for an honest client meanwhile.
    let honest = Http::default()
        .post(
            &format!("{}/v1/completions", router.http),
            &completion("m", &tokens(0, 64)),
        )
        .await;
    assert_eq!(honest.status, 200, "{}", honest.text());
    assert_eq!(
        refusals(&router, "body_read_timeout").await,
        0.0,
        "too late"
    );

    // Both slow clients get a 408 in OpenAI's shape, and are closed.
    let (status, body) = error_response(&read_until_closed(&mut stalled).await);
    assert_eq!(status, 408, "{body}");
    assert_eq!(body["error"]["code"], "request_timeout", "{body}");
    let mut answer = Vec::new();
    let closed = tokio::time::timeout(GUARD, trickled_reads.read_to_end(&mut answer)).await;
    assert!(closed.is_ok(), "the trickling client is still connected");
    assert_eq!(error_response(&answer).0, 408);
    trickle.abort();
    assert_eq!(refusals(&router, "body_read_timeout").await, 2.0);
    assert_eq!(refusals(&router, "inflight_requests").await, 0.0);
}

#[tokio::test]
async fn connection_caps_per_peer_and_per_listener_refuse_the_next_connection_on_both_ports() {
    let router = RouterProcess::start(
        "[limits]\nmax_http_connections = 3\nmax_http_connections_per_peer = 2\n\
         max_grpc_connections = 3\nmax_grpc_connections_per_peer = 2\n",
    );
    let (a, b, c) = ([127, 0, 0, 2], [127, 0, 0, 3], [127, 0, 0, 4]);

    // HTTP: two from one address are served, its third is refused.
    let mut a1 = connect_from(a, &router.http).await;
    let mut a2 = connect_from(a, &router.http).await;
    assert_eq!(healthz_on(&mut a1).await, "HTTP/1.1 200 OK");
    assert_eq!(healthz_on(&mut a2).await, "HTTP/1.1 200 OK");
    let mut a3 = connect_from(a, &router.http).await;
    let (status, body) = error_response(&read_until_closed(&mut a3).await);
    assert_eq!(status, 503);
    assert_eq!(body["error"]["code"], "too_many_connections");
    let message = body["error"]["message"].as_str().unwrap();
    assert!(
        message.contains("max_http_connections_per_peer"),
        "{message}"
    );
    // Another address takes the listener's last place; a third address finds none.
    let mut b1 = connect_from(b, &router.http).await;
    assert_eq!(healthz_on(&mut b1).await, "HTTP/1.1 200 OK");
    let mut c1 = connect_from(c, &router.http).await;
    let (status, body) = error_response(&read_until_closed(&mut c1).await);
    assert_eq!(status, 503);
    let message = body["error"]["message"].as_str().unwrap();
    assert!(message.contains("max_http_connections)"), "{message}");
    // A place freed is a place taken again.
    drop(a1);
    eventually("a freed place to serve a new connection", || async {
        let mut again = connect_from(c, &router.http).await;
        healthz_on(&mut again).await == "HTTP/1.1 200 OK"
    })
    .await;
    drop((a2, b1));

    // gRPC: the same caps, the connections closed at accept.
    let mut g1 = connect_from(a, &router.grpc).await;
    let mut g2 = connect_from(a, &router.grpc).await;
    assert!(grpc_served(&mut g1).await && grpc_served(&mut g2).await);
    let mut g3 = connect_from(a, &router.grpc).await;
    assert!(!grpc_served(&mut g3).await, "a third from one address");
    // A real worker, from 127.0.0.1, takes the last place and registers.
    let worker = registered_worker(&router, "http://127.0.0.1:9").await;
    let mut g4 = connect_from(c, &router.grpc).await;
    assert!(!grpc_served(&mut g4).await, "a fourth on the port");
    drop(g1);
    eventually("a freed gRPC place to serve a new connection", || async {
        grpc_served(&mut connect_from(c, &router.grpc).await).await
    })
    .await;
    drop(worker);

    assert!(refusals(&router, "http_connections_per_peer").await >= 1.0);
    assert!(refusals(&router, "http_connections").await >= 1.0);
    assert_eq!(refusals(&router, "grpc_connections_per_peer").await, 1.0);
    assert!(refusals(&router, "grpc_connections").await >= 1.0);
}

#[tokio::test]
async fn http_stays_up_while_the_grpc_port_is_flooded_with_idle_connections() {
    // File descriptors are few enough that the flood below would take them
    // all: both ports would stop accepting.
    let router = RouterProcess::start_with_open_files(
        "[limits]\nmax_grpc_connections = 64\n[ingest]\nidle_connection_timeout_ms = 1000\n",
        256,
    );
    let flood_from = [127, 0, 0, 2];
    let mut flood = Vec::new();
    for _ in 0..400 {
        flood.push(connect_from(flood_from, &router.grpc).await);
    }

    let healthz = format!("{}/healthz", router.http);
    let health = tokio::time::timeout(GUARD, Http::default().get(&healthz)).await;
    assert_eq!(health.expect("HTTP answers").status, 200);
    assert!(refusals(&router, "grpc_connections").await >= 1.0);

    // The flood's admitted connections never open a stream: closed at their
    // deadline, they free the port for a real worker. Each of the 400 is
    // refused at accept or closed so (late ones find places freed).
    eventually(
        "every flooding connection to be refused or closed",
        || async {
            refusals(&router, "grpc_connections").await
                + refusals(&router, "grpc_idle_timeout").await
                == 400.0
        },
    )
    .await;
    let _worker = registered_worker(&router, "http://127.0.0.1:9").await;
    drop(flood);
}

#[tokio::test]
async fn long_streams_that_keep_sending_are_not_cut_on_either_port() {
    let router = RouterProcess::start(
        "[limits]\nheader_read_timeout_ms = 300\nbody_read_timeout_ms = 300\n\
         [ingest]\nidle_connection_timeout_ms = 300\n",
    );
    let worker = TestWorker::start(1).await;
    let mut stream = registered_worker(&router, &worker.url).await;

    // 40 chunks 50 ms apart: a response of 2 s, past every deadline.
    let started = Instant::now();
    let mut request = completion("m", &tokens(0, 64));
    request["stream"] = json!(true);
    request["max_tokens"] = json!(40);
    request["chunk_delay_ms"] = json!(50);
    let reply = Http::default()
        .post(&format!("{}/v1/completions", router.http), &request)
        .await;
    assert_eq!(reply.status, 200);
    assert!(started.elapsed() >= Duration::from_secs(2));
    let text = reply.text();
    assert_eq!(text.matches("\"text\":\"tok").count(), 40, "{text}");
    assert!(text.ends_with("data: [DONE]\n\n"), "{text}");

    // The worker's gRPC stream, open all along, is still read.
    stream.store(&tokens(0, 64)).await;
    eventually("its events to be indexed", || async {
        indexed(&router, 1).await.0 == 4
    })
    .await;
    assert_eq!(refusals(&router, "grpc_idle_timeout").await, 0.0);
}
