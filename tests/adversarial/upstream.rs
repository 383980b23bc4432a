//! Attacks through upstream: the router's way to its workers (see
//! tests/adversarial.rs). A client or operator must not reach a worker with
//! the router's credentials, open breakers with bodies a worker refuses, learn
//! the fleet's addresses from errors, or be left hanging by a broken or
//! frozen worker.

use std::time::{Duration, Instant};

use serde_json::{Value, json};

use crate::common::*;

/// A completion of `tokens` token ids, a body of about 7 bytes a token.
fn completion_of(tokens: usize) -> Value {
    let prompt: Vec<u32> = (0..tokens as u32).map(|i| 100_000 + i).collect();
    json!({"model": "m", "prompt": prompt, "max_tokens": 1})
}

/// A body the test workers in [`Mode::ResetLargeBodies`] reset mid-upload.
fn refused_body() -> Value {
    completion_of(2 * RESET_AFTER_BYTES / 7)
}

async fn scrape(router: &RouterProcess, name: &str) -> f64 {
    let text = Http::default()
        .get(&format!("{}/metrics", router.http))
        .await
        .text();
    metric(&text, name, &[])
}

/// Asserts a client-facing error names no address and no library's error text.
fn assert_no_internals(reply: &Reply, urls: &[&str]) {
    let text = reply.text();
    for url in urls {
        let authority = url.trim_start_matches("http://");
        let port = authority.rsplit(':').next().unwrap();
        assert!(!text.contains(authority), "{text}");
        assert!(!text.contains(port), "{text}");
    }
    for internal in ["127.0.0.1", "hyper", "Error(", "Os {", "os error", "tcp "] {
        assert!(!text.contains(internal), "{internal:?} in {text}");
    }
}

/// Attack: an operator's pinned request (or any client's) carried the
/// router's `Authorization` to the worker, so a worker's operator got the
/// admin token. The router's tokens stay with it; a worker gets the key
/// configured for workers, and only that.
#[tokio::test]
async fn the_routers_tokens_never_reach_a_worker_and_the_worker_key_does() {
    let worker = TestWorker::start(1).await;
    let router = RouterProcess::start(&format!(
        "[auth]\nadmin_token = \"admin-secret\"\n[upstream]\napi_key = \"worker-key\"\n{}",
        static_workers(std::slice::from_ref(&worker))
    ));
    let http = Http::default();
    let url = format!("{}/v1/completions", router.http);
    let body = completion("m", &tokens(0, 40)).to_string();
    let pinned = http
        .call(
            "POST",
            &url,
            &[
                ("authorization", "Bearer admin-secret"),
                ("x-kvroute-worker", "1"),
            ],
            body.clone(),
        )
        .await;
    assert_eq!(pinned.status, 200, "{}", pinned.text());
    let client = http
        .call(
            "POST",
            &url,
            &[("authorization", "Bearer client-token")],
            body,
        )
        .await;
    assert_eq!(client.status, 200, "{}", client.text());
    assert_eq!(
        *worker.state.authorizations.lock().unwrap(),
        ["Bearer worker-key", "Bearer worker-key"],
        "the worker saw only its own key"
    );
}

/// Attack: ten requests with a body every worker refuses (the engine resets
/// the connection mid-upload) counted as worker failures, each retried on
/// more workers, and opened every breaker: every client got 503 for each
/// cool-down. A refused body is the client's: its request fails with a clear
/// error, on one worker, and no breaker moves.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bodies_the_workers_refuse_open_no_breaker() {
    let workers = [
        TestWorker::start(1).await,
        TestWorker::start(2).await,
        TestWorker::start(3).await,
    ];
    for worker in &workers {
        worker.set_mode(Mode::ResetLargeBodies);
    }
    let router = RouterProcess::start(&format!(
        "[upstream]\nbreaker_failures = 2\n{}",
        static_workers(&workers)
    ));
    let http = Http::default();
    let url = format!("{}/v1/completions", router.http);
    let refused = refused_body();
    let mut replies = Vec::new();
    for _ in 0..10 {
        replies.push(http.post(&url, &refused).await);
    }
    let fleet = http.get(&format!("{}/workers", router.http)).await.json();
    for worker in fleet["workers"].as_array().unwrap() {
        assert_eq!(worker["breaker"], "closed", "{worker}");
    }
    assert_eq!(scrape(&router, "kvroute_retries_total").await, 0.0);
    let urls: Vec<&str> = workers.iter().map(|w| w.url.as_str()).collect();
    for reply in &replies {
        reply.assert_error(502, "upstream_error");
        assert_no_internals(reply, &urls);
    }
    let honest = http.post(&url, &completion("m", &tokens(0, 40))).await;
    assert_eq!(honest.status, 200, "{}", honest.text());
}

/// Attack: a request that failed writing its body left its predicted blocks
/// (up to `limits.max_predicted_blocks_per_request`) on the worker, pulling
/// later requests with that prefix to a worker that never saw it.
#[tokio::test]
async fn a_body_write_failure_leaves_no_predicted_blocks() {
    let worker = TestWorker::start(1).await;
    worker.set_mode(Mode::ResetLargeBodies);
    let router = RouterProcess::start(&static_workers(std::slice::from_ref(&worker)));
    let http = Http::default();
    let reply = http
        .post(&format!("{}/v1/completions", router.http), &refused_body())
        .await;
    reply.assert_error(502, "upstream_error");
    // The refused prompt's first ten blocks, asked where they would go.
    let route = http
        .post(&format!("{}/v1/route", router.http), &completion_of(160))
        .await
        .json();
    assert_eq!(route["request_blocks"], 10, "{route}");
    assert_eq!(route["overlap_blocks"], 0, "{route}");
}

/// Attack: a connect error showed any client the worker's IP:port and
/// hyper's error text.
#[tokio::test]
async fn a_connect_error_names_no_address_and_no_library_text() {
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}", closed.local_addr().unwrap());
    drop(closed);
    let router = RouterProcess::start(&format!(
        "[upstream]\nhealth_interval_ms = 0\n[[workers]]\nid = 1\nbase_url = \"{url}\"\nmodels = [\"m\"]\n"
    ));
    let reply = Http::default()
        .post(
            &format!("{}/v1/completions", router.http),
            &completion("m", &tokens(0, 40)),
        )
        .await;
    reply.assert_error(502, "upstream_error");
    assert_no_internals(&reply, &[&url]);
}

/// Attack: a worker that died mid-stream cut the client's SSE stream with no
/// final event, so the client could not tell a failure from a network fault.
/// It ends with an OpenAI-style error event, as the idle timeout does.
#[tokio::test]
async fn a_worker_that_dies_mid_stream_ends_the_stream_with_an_error_event() {
    let worker = TestWorker::start(1).await;
    let router = RouterProcess::start(&static_workers(std::slice::from_ref(&worker)));
    let text = broken_stream(&router.http).await;
    let events: Vec<&str> = text
        .split("\n\n")
        .filter_map(|e| e.strip_prefix("data: "))
        .collect();
    let (last, chunks) = events.split_last().unwrap();
    assert!(!chunks.is_empty(), "what the worker sent went on: {text}");
    for chunk in chunks {
        let chunk: Value = serde_json::from_str(chunk).unwrap();
        assert_eq!(chunk["object"], "text_completion", "{chunk}");
    }
    let last: Value = serde_json::from_str(last).unwrap();
    assert_eq!(last["error"]["code"], "upstream_error", "{last}");
    assert!(!text.contains("[DONE]"), "{text}");
}

/// Attack: a request sent to a worker that then froze (SIGSTOP) waited the
/// whole first-byte timeout, long after health checks took the worker out of
/// routing. It ends when the worker leaves routing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frozen_workers_request_ends_when_the_worker_leaves_routing() {
    let router = RouterProcess::start(
        "[upstream]\nfirst_byte_timeout_ms = 120000\nhealth_interval_ms = 200\nhealth_timeout_ms = 300\nbreaker_failures = 2\n",
    );
    let fleet = SimFleet::start(Some(&router.grpc), 1);
    wait_registered(&router, 1).await;
    let (worker, _) = fleet.workers[0];
    let stopped = std::process::Command::new("kill")
        .args(["-STOP", &fleet.process.child.id().to_string()])
        .status()
        .unwrap();
    assert!(stopped.success());
    let started = Instant::now();
    let reply = Http::default()
        .call(
            "POST",
            &format!("{}/v1/completions", router.http),
            &[("x-kvroute-worker", &worker.to_string())],
            json!({"model": "sim-model", "prompt": tokens(0, 40), "max_tokens": 4}).to_string(),
        )
        .await;
    let waited = started.elapsed();
    reply.assert_error(502, "upstream_error");
    // Two failed health checks (interval 200 ms, timeout 300 ms) open the breaker.
    assert!(waited < Duration::from_secs(10), "waited {waited:?}");
}
