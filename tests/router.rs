//! End-to-end tests of `kvroute serve`: the real binary, real test workers (HTTP
//! servers) and real gRPC event streams, all over loopback.

mod common;

use std::time::Duration;

use common::*;
use kvroute_proto::{kv_event, worker_message};
use serde_json::json;

/// Registers `n` HTTP test workers over gRPC (no events); ids 1..=n.
async fn fleet(router: &RouterProcess, n: u64) -> (Vec<TestWorker>, Vec<GrpcWorker>) {
    let mut http = Vec::new();
    let mut grpc = Vec::new();
    for id in 1..=n {
        let worker = TestWorker::start(id).await;
        let stream = GrpcWorker::connect(
            &router.grpc,
            None,
            register(id, &worker.url, &["m"], BLOCK_SIZE as u32),
        )
        .await
        .unwrap();
        http.push(worker);
        grpc.push(stream);
    }
    (http, grpc)
}

async fn dry_run(router: &RouterProcess, tokens: &[u32]) -> serde_json::Value {
    dry_run_at(&router.http, tokens).await
}

async fn dry_run_at(http: &str, tokens: &[u32]) -> serde_json::Value {
    let reply = Http::default()
        .post(&format!("{http}/v1/route"), &completion("m", tokens))
        .await;
    assert_eq!(
        reply.status,
        200,
        "{}",
        String::from_utf8_lossy(&reply.body)
    );
    reply.json()
}

fn prompt(prefix: &[u32], suffix_start: u32) -> Vec<u32> {
    let mut t = prefix.to_vec();
    t.extend(tokens(suffix_start, 40));
    t
}

#[tokio::test]
async fn shared_prefix_goes_to_the_same_static_worker() {
    let workers = [
        TestWorker::start(1).await,
        TestWorker::start(2).await,
        TestWorker::start(3).await,
    ];
    let router = RouterProcess::start(&static_workers(&workers));
    let http = Http::default();
    let url = format!("{}/v1/completions", router.http);
    for round in 0..3u32 {
        let prefix = tokens(10_000 * (round + 1), 128);
        let first = http.post(&url, &completion("m", &prompt(&prefix, 1))).await;
        assert_eq!(first.status, 200);
        assert_eq!(first.json()["worker"], first.worker());
        for suffix in 2..5 {
            let next = http
                .post(&url, &completion("m", &prompt(&prefix, suffix * 100)))
                .await;
            assert_eq!(next.worker(), first.worker(), "round {round}");
        }
    }
    // Non-streaming bodies pass through unchanged.
    let reply = http.post(&url, &completion("m", &tokens(0, 20))).await;
    assert_eq!(
        reply.json(),
        json!({"id": "cmpl-test", "object": "text_completion", "worker": reply.worker(),
               "choices": [{"index": 0, "text": "hello", "finish_reason": "stop"}]})
    );
}

#[tokio::test]
async fn stored_events_attract_and_removed_events_release() {
    let router = RouterProcess::start("");
    let (_http, mut grpc) = fleet(&router, 3).await;
    let prefix = tokens(500, 128);
    let hashes = grpc[1].store(&prefix).await;
    let route = dry_run(&router, &prompt(&prefix, 1)).await;
    assert_eq!(route["worker_id"], 2, "{route}");
    assert_eq!(route["overlap_blocks"], 128 / BLOCK_SIZE);
    assert!(route["predicted_hit_ratio"].as_f64().unwrap() > 0.7);

    grpc[1].remove(hashes).await;
    let route = dry_run(&router, &prompt(&prefix, 1)).await;
    for score in route["scores"].as_array().unwrap() {
        assert_eq!(score["overlap_blocks"], 0, "{route}");
    }
}

#[tokio::test]
async fn a_gap_triggers_a_resync_that_restores_the_index() {
    let router = RouterProcess::start("");
    let (_http, mut grpc) = fleet(&router, 2).await;
    let worker = &mut grpc[0];
    let a = tokens(1000, 64);
    let b = tokens(2000, 64);
    worker.store(&a).await; // event 0
    // Event 1 (B) is lost on the way; event 2 (C) arrives.
    let (stored_b, _) = worker.chain(&b);
    let c = tokens(3000, 64);
    let (stored_c, _) = worker.chain(&c);
    worker
        .event(Some(2), kv_event::Kind::Stored(stored_c.clone()))
        .await;
    let resync = worker.wait_resync().await;
    assert_eq!(resync.from_event_id, 1);
    // The worker answers with a full dump, which replaces its state.
    let (stored_a, _) = worker.chain(&a);
    send_dump(worker, 2, vec![stored_a, stored_b, stored_c], false).await;
    worker.wait_ack(2).await;
    for t in [&a, &b, &c] {
        let route = dry_run(&router, &prompt(t, 1)).await;
        assert_eq!(route["worker_id"], 1, "{route}");
        assert_eq!(route["overlap_blocks"], 4);
    }
    // Later events continue from the dump's id; a replay by events works too.
    let d = tokens(4000, 64);
    let (stored_d, _) = worker.chain(&d);
    worker
        .event(Some(4), kv_event::Kind::Stored(stored_d.clone()))
        .await;
    let resync = worker.wait_resync().await;
    assert_eq!(resync.from_event_id, 3);
    worker
        .event(Some(3), kv_event::Kind::Cleared(kvroute_proto::Cleared {}))
        .await;
    worker
        .event(Some(4), kv_event::Kind::Stored(stored_d))
        .await;
    worker.wait_ack(4).await;
    assert_eq!(dry_run(&router, &prompt(&a, 1)).await["overlap_blocks"], 0);
    assert_eq!(dry_run(&router, &prompt(&d, 1)).await["overlap_blocks"], 4);
}

/// Reads the stream until the router ends it; returns its status.
async fn closed_with(worker: &mut GrpcWorker) -> tonic::Status {
    tokio::time::timeout(Duration::from_secs(10), async {
        loop {
            match worker.rx.message().await {
                Ok(Some(_)) => {}
                Ok(None) => panic!("the stream ended without a status"),
                Err(status) => return status,
            }
        }
    })
    .await
    .expect("the router closes the stream within 10 s")
}

/// The index's (worker, block) pairs, as `/metrics` reports them.
async fn index_memberships(router: &RouterProcess) -> f64 {
    let text = Http::default()
        .get(&format!("{}/metrics", router.http))
        .await
        .text();
    metric(&text, "kvroute_index_memberships", &[])
}

#[tokio::test]
async fn a_stale_resend_from_the_first_id_leaves_a_healthy_rank_alone() {
    let router = RouterProcess::start("");
    let (_http, mut grpc) = fleet(&router, 1).await;
    let worker = &mut grpc[0];
    let (a, b, c) = (tokens(1000, 64), tokens(2000, 64), tokens(3000, 64));
    let (stored_a, _) = worker.chain(&a);
    worker
        .event(Some(0), kv_event::Kind::Stored(stored_a.clone()))
        .await;
    worker.store(&b).await;
    worker.store(&c).await;
    // A late duplicate of the first event (a resend overtaken by the rest) is
    // stale, not a restart: nothing is cleared.
    worker
        .event(Some(0), kv_event::Kind::Stored(stored_a))
        .await;
    worker.wait_ack(0).await;
    for t in [&a, &b, &c] {
        assert_eq!(dry_run(&router, &prompt(t, 1)).await["overlap_blocks"], 4);
    }
}

#[tokio::test]
async fn a_new_instance_clears_the_worker_the_same_instance_keeps_it_and_old_streams_are_fenced() {
    let router = RouterProcess::start("");
    let http_worker = TestWorker::start(1).await;
    let connect = |instance_id: u64| {
        let mut register = register(1, &http_worker.url, &["m"], BLOCK_SIZE as u32);
        register.instance_id = instance_id;
        GrpcWorker::connect(&router.grpc, None, register)
    };
    let mut first = connect(7).await.unwrap();
    let (a, b, c, d) = (
        tokens(1000, 64),
        tokens(2000, 64),
        tokens(3000, 64),
        tokens(4000, 64),
    );
    first.store(&a).await; // event 0: the router has seen no id above 0
    // A proxied request leaves predicted entries for its prefix.
    let reply = Http::default()
        .post(
            &format!("{}/v1/completions", router.http),
            &completion("m", &prompt(&d, 1)),
        )
        .await;
    assert_eq!(reply.status, 200);
    let predicted = dry_run(&router, &prompt(&d, 1)).await["overlap_blocks"].clone();
    assert_eq!(predicted, 6, "the whole prompt's blocks are predicted");

    // The same instance registers again (a new connection): the old stream is
    // closed with a clear status, and the state is kept.
    let mut second = connect(7).await.unwrap();
    let status = closed_with(&mut first).await;
    assert_eq!(status.code(), tonic::Code::Aborted, "{status:?}");
    assert!(status.message().contains("registered again"), "{status:?}");
    assert_eq!(dry_run(&router, &prompt(&a, 1)).await["overlap_blocks"], 4);
    assert_eq!(
        dry_run(&router, &prompt(&d, 1)).await["overlap_blocks"],
        predicted
    );
    // Its events continue where the old stream left off, without a resync.
    let (stored_b, _) = second.chain(&b);
    second
        .event(Some(1), kv_event::Kind::Stored(stored_b))
        .await;
    second.wait_ack(1).await;
    assert_eq!(dry_run(&router, &prompt(&b, 1)).await["overlap_blocks"], 4);

    // A new instance may not take the id while that stream is alive.
    let status = connect(8).await.err().expect("refused");
    assert_eq!(status.code(), tonic::Code::AlreadyExists, "{status:?}");
    // Once it has ended, a new instance (a restarted engine) reuses ids the
    // router has seen: all it held before, predicted entries included, is gone.
    drop(second);
    let mut third = loop {
        match connect(8).await {
            Ok(third) => break third,
            Err(status) if status.code() == tonic::Code::AlreadyExists => {
                tokio::time::sleep(std::time::Duration::from_millis(20)).await;
            }
            Err(status) => panic!("{status:?}"),
        }
    };
    let (stored_c, _) = third.chain(&c);
    third.event(Some(0), kv_event::Kind::Stored(stored_c)).await;
    third.wait_ack(0).await;
    assert_eq!(dry_run(&router, &prompt(&c, 1)).await["overlap_blocks"], 4);
    for t in [&a, &b, &d] {
        assert_eq!(dry_run(&router, &prompt(t, 1)).await["overlap_blocks"], 0);
    }
    assert_eq!(index_memberships(&router).await, 4.0);
    let text = Http::default()
        .get(&format!("{}/metrics", router.http))
        .await
        .text();
    assert_eq!(
        metric(&text, "kvroute_worker_restarts_total", &[("worker", "1")]),
        1.0
    );
}

#[tokio::test]
async fn a_removed_workers_stream_is_closed_and_its_events_stay_out() {
    let router = RouterProcess::start("");
    let (http_workers, mut grpc) = fleet(&router, 2).await;
    let mut worker = grpc.remove(0);
    let (a, b) = (tokens(1000, 64), tokens(2000, 64));
    worker.store(&a).await;
    let http = Http::default();
    let reply = http
        .call("DELETE", &format!("{}/workers/1", router.http), &[], "")
        .await;
    assert_eq!(reply.status, 204, "{}", reply.text());
    let status = closed_with(&mut worker).await;
    assert_eq!(status.code(), tonic::Code::Aborted, "{status:?}");
    assert!(status.message().contains("removed"), "{status:?}");
    // Whatever the old stream still sends goes nowhere.
    let (stored_b, _) = worker.chain(&b);
    worker.offer(1, kv_event::Kind::Stored(stored_b)).await;
    assert_eq!(index_memberships(&router).await, 0.0);
    series_of_worker_1_go_and_worker_2s_stay(&router).await;
    // Registered again, the worker starts from nothing.
    let mut again = GrpcWorker::connect(
        &router.grpc,
        None,
        register(1, &http_workers[0].url, &["m"], BLOCK_SIZE as u32),
    )
    .await
    .unwrap();
    again.store(&tokens(3000, 64)).await;
    for t in [&a, &b] {
        assert_eq!(dry_run(&router, &prompt(t, 1)).await["overlap_blocks"], 0);
    }
}

#[tokio::test]
async fn a_block_size_mismatch_is_refused() {
    let router = RouterProcess::start("");
    let err = GrpcWorker::connect(
        &router.grpc,
        None,
        register(1, "http://127.0.0.1:9", &["m"], 32),
    )
    .await
    .err()
    .expect("refused");
    assert_eq!(err.code(), tonic::Code::FailedPrecondition);
    assert_eq!(
        err.message(),
        "block size 32 does not match the router's 16"
    );
    let workers = Http::default()
        .get(&format!("{}/workers", router.http))
        .await;
    assert_eq!(workers.json()["workers"], json!([]));
}

/// A grace period no test outlives, so "kept during it" does not depend on
/// how fast the machine is.
#[tokio::test]
async fn a_disconnected_worker_is_not_routed_but_kept_for_the_grace_period() {
    let router = RouterProcess::start("[ingest]\ngrace_period_ms = 3600000\n");
    let (_http, mut grpc) = fleet(&router, 2).await;
    let prefix = tokens(700, 128);
    grpc[0].store(&prefix).await;
    assert_eq!(dry_run(&router, &prompt(&prefix, 1)).await["worker_id"], 1);
    drop(grpc.remove(0));
    let http = Http::default();
    let worker_url = format!("{}/workers/1", router.http);
    eventually("worker 1 is disconnected", || async {
        http.get(&worker_url).await.json()["worker"]["state"] == "disconnected"
    })
    .await;
    // Out of routing at once, even though it holds the prefix.
    let route = dry_run(&router, &prompt(&prefix, 1)).await;
    assert_eq!(route["worker_id"], 2, "{route}");
    let status = http.get(&worker_url).await.json();
    assert_eq!(
        status["index"][0]["indexed_blocks"], 8,
        "kept during the grace period"
    );
}

/// The purge once the grace period is over; a condition waited on, not a window.
#[tokio::test]
async fn a_disconnected_worker_is_purged_after_the_grace_period() {
    let router = RouterProcess::start("[ingest]\ngrace_period_ms = 1\n");
    let (_http, mut grpc) = fleet(&router, 2).await;
    grpc[0].store(&tokens(700, 128)).await;
    let http = Http::default();
    let worker_url = format!("{}/workers/1", router.http);
    eventually("worker 1's chain is indexed", || async {
        http.get(&worker_url).await.json()["index"][0]["indexed_blocks"] == 8
    })
    .await;
    drop(grpc.remove(0));
    eventually("worker 1 is purged", || async {
        http.get(&worker_url).await.status == 404
    })
    .await;
    let metrics = http.get(&format!("{}/metrics", router.http)).await;
    let text = String::from_utf8_lossy(&metrics.body).to_string();
    assert!(text.contains("kvroute_index_memberships 0"), "{text}");
    series_of_worker_1_go_and_worker_2s_stay(&router).await;
}

/// Worker 1 is gone: its series (breaker state, in-flight and prefill gauges,
/// routed and event counters) leave `/metrics`; worker 2's stay, render after render.
async fn series_of_worker_1_go_and_worker_2s_stay(router: &RouterProcess) {
    let http = Http::default();
    let url = format!("{}/metrics", router.http);
    eventually("worker 1's series to leave /metrics", || async {
        !http.get(&url).await.text().contains("worker=\"1")
    })
    .await;
    for _ in 0..3 {
        let text = http.get(&url).await.text();
        assert!(!text.contains("worker=\"1"), "{text}");
        for series in [
            "kvroute_breaker_state{worker=\"2\"}",
            "kvroute_worker_inflight_requests{worker=\"2\"}",
        ] {
            assert!(text.contains(series), "{series} in {text}");
        }
    }
}

#[tokio::test]
async fn sse_passes_through_intact_and_a_client_cancel_reaches_the_worker() {
    let router = RouterProcess::start("");
    let (workers, _grpc) = fleet(&router, 1).await;
    let http = Http::default();
    let url = format!("{}/v1/completions", router.http);
    let body = json!({"model": "m", "prompt": tokens(0, 40), "stream": true, "max_tokens": 6});
    let reply = http.post(&url, &body).await;
    assert_eq!(reply.status, 200);
    assert_eq!(reply.headers["content-type"], "text/event-stream");
    let expected: String = (0..6).map(|i| sse_chunk(1, i)).collect::<String>() + "data: [DONE]\n\n";
    assert_eq!(String::from_utf8_lossy(&reply.body), expected);
    assert_eq!(
        workers[0]
            .state
            .completed_streams
            .load(std::sync::atomic::Ordering::SeqCst),
        1
    );

    // A long stream: read one chunk, then hang up.
    let body = json!({"model": "m", "prompt": tokens(0, 40), "stream": true,
                      "max_tokens": 100000, "chunk_delay_ms": 2});
    let response = http.send("POST", &url, &[], body.to_string()).await;
    let mut incoming = response.into_body();
    let first = http_body_util::BodyExt::frame(&mut incoming)
        .await
        .unwrap()
        .unwrap();
    assert!(first.into_data().unwrap().starts_with(b"data: "));
    drop(incoming);
    eventually("the worker saw the cancel", || async {
        workers[0].cancelled() == 1
    })
    .await;
}

#[tokio::test]
async fn an_http2_client_gets_answers_streams_and_json_errors() {
    let router = RouterProcess::start("");
    let (workers, _grpc) = fleet(&router, 1).await;
    let http = Http::http2();
    let url = format!("{}/v1/completions", router.http);

    let response = http
        .send(
            "POST",
            &url,
            &[],
            completion("m", &tokens(0, 40)).to_string(),
        )
        .await;
    assert_eq!(response.version(), http::Version::HTTP_2);
    assert_eq!(response.status(), 200);
    assert_eq!(response.headers()["x-kvroute-worker"], "1");

    let body = json!({"model": "m", "prompt": tokens(0, 40), "stream": true, "max_tokens": 6});
    let reply = http.post(&url, &body).await;
    assert_eq!(reply.status, 200, "{}", reply.text());
    assert_eq!(reply.headers["content-type"], "text/event-stream");
    let expected: String = (0..6).map(|i| sse_chunk(1, i)).collect::<String>() + "data: [DONE]\n\n";
    assert_eq!(reply.text(), expected);
    assert_eq!(workers[0].received(), 2);

    assert_eq!(
        http.get(&format!("{}/healthz", router.http)).await.status,
        200
    );
    http.get(&url).await.assert_error(405, "invalid_request");
}

#[tokio::test]
async fn dead_and_failing_workers_are_retried_around() {
    let router = RouterProcess::start("");
    let (workers, mut grpc) = fleet(&router, 2).await;
    // Worker 3 is dead: its port refuses connections. It holds the prefix, so it
    // is the first choice.
    let dead_port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let mut dead = GrpcWorker::connect(
        &router.grpc,
        None,
        register(3, &format!("http://127.0.0.1:{dead_port}"), &["m"], 16),
    )
    .await
    .unwrap();
    let prefix = tokens(900, 128);
    dead.store(&prefix).await;
    assert_eq!(dry_run(&router, &prompt(&prefix, 1)).await["worker_id"], 3);
    let http = Http::default();
    let url = format!("{}/v1/completions", router.http);
    let reply = http.post(&url, &completion("m", &prompt(&prefix, 1))).await;
    assert_eq!(reply.status, 200);
    assert_ne!(reply.worker(), 3);

    // Worker 1 answers 500: retried on worker 2, which was never preferred.
    workers[0].set_mode(Mode::Fail);
    let received_before = workers[0].received();
    let prefix = tokens(20_000, 128);
    grpc[0].store(&prefix).await;
    let reply = http.post(&url, &completion("m", &prompt(&prefix, 2))).await;
    assert_eq!(
        reply.status,
        200,
        "{}",
        String::from_utf8_lossy(&reply.body)
    );
    assert_eq!(reply.worker(), 2);
    assert_eq!(workers[0].received(), received_before + 1);

    // Pinned to the failing worker: no retry elsewhere, a 502.
    let reply = http
        .call(
            "POST",
            &url,
            &[("x-kvroute-worker", "1")],
            completion("m", &prefix).to_string(),
        )
        .await;
    reply.assert_error(502, "upstream_error");
}

#[tokio::test]
async fn error_bodies_are_openai_style() {
    let router = RouterProcess::start(
        "body_limit_bytes = 65536\n[scheduler]\nbusy_max_inflight = 1\nqueue_timeout_ms = 200\n",
    );
    let (workers, _grpc) = fleet(&router, 1).await;
    let http = Http::default();
    let url = format!("{}/v1/completions", router.http);
    http.call("POST", &url, &[], "{not json")
        .await
        .assert_error(400, "invalid_request");
    http.post(&url, &json!({"prompt": [1, 2]}))
        .await
        .assert_error(400, "invalid_request");
    http.post(&url, &json!({"model": "m"}))
        .await
        .assert_error(400, "invalid_request");
    http.post(
        &format!("{}/v1/chat/completions", router.http),
        &json!({"model": "m"}),
    )
    .await
    .assert_error(400, "invalid_request");
    http.call("POST", &url, &[], vec![b' '; 100_000])
        .await
        .assert_error(413, "request_too_large");
    http.post(&url, &completion("nope", &[1, 2, 3]))
        .await
        .assert_error(404, "model_not_found");
    // Their other methods: a 405 naming the one allowed, with a JSON body.
    for path in ["/v1/completions", "/v1/chat/completions"] {
        let reply = http
            .call("GET", &format!("{}{path}", router.http), &[], "")
            .await;
        reply.assert_error(405, "invalid_request");
        assert_eq!(reply.headers["allow"], "POST");
    }

    // The only worker is busy with a held request: the next one waits, then 503.
    workers[0].set_mode(Mode::Hold);
    let held = {
        let http = http.clone();
        let url = url.clone();
        tokio::spawn(async move { http.post(&url, &completion("m", &tokens(0, 32))).await })
    };
    eventually("the first request is held", || async {
        workers[0].inflight() == 1
    })
    .await;
    let reply = http.post(&url, &completion("m", &tokens(0, 32))).await;
    reply.assert_error(503, "no_worker_available");
    assert_eq!(reply.headers["retry-after"], "1");
    workers[0].release();
    assert_eq!(held.await.unwrap().status, 200);
}

/// The typed body parse: each malformed body gets a 400 whose message names
/// what is wrong (the field, the element), and none reaches the worker; the
/// well-formed ones, with fields the router does not read, pass unchanged.
#[tokio::test]
async fn malformed_bodies_get_a_400_that_names_the_problem_and_reach_no_worker() {
    let router = RouterProcess::start("");
    let (workers, _grpc) = fleet(&router, 1).await;
    let http = Http::default();
    let completions = format!("{}/v1/completions", router.http);
    let chat = format!("{}/v1/chat/completions", router.http);
    let nested = format!(
        "{{\"model\":\"m\",\"prompt\":{}1{}}}",
        "[".repeat(500),
        "]".repeat(500)
    );
    let cases: Vec<(&str, String, &str)> = vec![
        (&completions, "{\"model\":\"m\",".into(), "not valid JSON"),
        (
            &completions,
            "{\"model\":\"m\",\"prompt\":[1]} x".into(),
            "not valid JSON",
        ),
        (
            &completions,
            "[\"m\",[1,2]]".into(),
            "must be a JSON object",
        ),
        (&completions, "\"m\"".into(), "must be a JSON object"),
        (&completions, nested, "element 0 is an array"),
        (
            &completions,
            json!({"model": 5, "prompt": [1]}).to_string(),
            "model: invalid type: integer `5`",
        ),
        (
            &completions,
            json!({"model": "m", "prompt": [1, 2, -3]}).to_string(),
            "element 2 is -3",
        ),
        (
            &completions,
            json!({"model": "m", "prompt": [1, 2.5]}).to_string(),
            "element 1 is 2.5",
        ),
        (
            &completions,
            json!({"model": "m", "prompt": [[1], [2]]}).to_string(),
            "batch of 2 prompts",
        ),
        (
            &completions,
            json!({"model": "m", "prompt": {"ids": [1]}}).to_string(),
            "not an object",
        ),
        (
            &completions,
            json!({"model": "m", "prompt": []}).to_string(),
            "must not be an empty array",
        ),
        (
            &completions,
            json!({"model": "m", "prompt": [1], "cache_salt": 7}).to_string(),
            "cache_salt: invalid type",
        ),
        (
            &completions,
            r#"{"model":"m","model":"m","prompt":[1]}"#.into(),
            "duplicate field `model`",
        ),
        (
            &chat,
            json!({"model": "m", "messages": {"role": "user"}}).to_string(),
            "`messages` (an array)",
        ),
        (
            &chat,
            json!({"model": "m", "messages": [], "add_generation_prompt": "yes"}).to_string(),
            "add_generation_prompt: invalid type",
        ),
    ];
    for (url, body, expected) in cases {
        let reply = http.call("POST", url, &[], body.clone()).await;
        reply.assert_error(400, "invalid_request");
        let message = reply.json()["error"]["message"]
            .as_str()
            .unwrap()
            .to_string();
        assert!(message.contains(expected), "{body:.80}: {message}");
    }
    assert_eq!(workers[0].received(), 0);

    // Escaped strings, unknown fields and a long token-id prompt are fine.
    let long: Vec<u32> = (0..50_000).map(|i| i * 85_899).collect();
    let body = format!(
        r#"{{"model":"\u006d","prompt":{},"stream_options":{{"include_usage":true}},"priority_class":1,"cache_salt":"s\"alt"}}"#,
        json!(long)
    );
    let reply = http.call("POST", &completions, &[], body.clone()).await;
    assert_eq!(reply.status, 200, "{}", reply.text());
    assert_eq!(workers[0].received(), 1);
    let sent: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(
        workers[0].state.last_body.lock().unwrap().as_ref(),
        Some(&sent)
    );
}

#[tokio::test]
async fn metrics_list_every_family_and_route_agrees_with_the_proxied_choice() {
    let router = RouterProcess::start("");
    let (_workers, mut grpc) = fleet(&router, 4).await;
    let http = Http::default();
    let prefix = tokens(3000, 128);
    grpc[2].store(&prefix).await;
    let request = completion("m", &prompt(&prefix, 1));
    let route = dry_run(&router, &prompt(&prefix, 1)).await;
    assert_eq!(route["worker_id"], 3);
    let reply = http
        .post(&format!("{}/v1/completions", router.http), &request)
        .await;
    assert_eq!(reply.worker(), 3);

    // The Route RPC agrees too.
    let channel = tonic::transport::Endpoint::from_shared(router.grpc.clone())
        .unwrap()
        .connect()
        .await
        .unwrap();
    let response = kvroute_proto::kv_router_client::KvRouterClient::new(channel)
        .route(kvroute_proto::RouteRequest {
            model: "m".into(),
            lora_name: String::new(),
            input: Some(kvroute_proto::route_request::Input::TokenIds(
                kvroute_proto::TokenIds {
                    ids: prompt(&prefix, 1),
                },
            )),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(response.worker_id, 3);
    assert!(
        response
            .scores
            .iter()
            .any(|s| s.worker_id == 3 && s.overlap_blocks >= 8)
    );

    let text = String::from_utf8(
        http.get(&format!("{}/metrics", router.http))
            .await
            .body
            .to_vec(),
    )
    .unwrap();
    for (family, _) in kvroute_router::metrics::FAMILIES {
        assert!(
            text.contains(&format!("# TYPE {family} ")),
            "{family} missing from /metrics"
        );
    }
    assert!(text.contains("kvroute_routed_requests_total{worker=\"3\",policy=\"kv\"} 1"));
}

#[tokio::test]
async fn models_and_lora_adapters_are_routed_only_to_workers_that_serve_them() {
    let router = RouterProcess::start("");
    let base = TestWorker::start(1).await;
    let adapted = TestWorker::start(2).await;
    let _g1 = GrpcWorker::connect(&router.grpc, None, register(1, &base.url, &["m"], 16))
        .await
        .unwrap();
    let mut reg = register(2, &adapted.url, &["m"], 16);
    reg.lora_names = vec!["ad".into()];
    let mut g2 = GrpcWorker::connect(&router.grpc, None, reg).await.unwrap();
    let http = Http::default();
    let models = http.get(&format!("{}/v1/models", router.http)).await.json();
    let ids: Vec<&str> = models["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, ["ad", "m"]);
    // Worker 2 holds the prefix for the base model; it must not count for the adapter.
    let prefix = tokens(42, 128);
    g2.store(&prefix).await;
    let route = |model: &'static str| {
        let http = http.clone();
        let url = format!("{}/v1/route", router.http);
        let body = completion(model, &prefix);
        async move { http.post(&url, &body).await.json() }
    };
    let base_route = route("m").await;
    assert_eq!(base_route["worker_id"], 2);
    assert_eq!(base_route["overlap_blocks"], 8);
    let adapter_route = route("ad").await;
    assert_eq!(adapter_route["worker_id"], 2);
    assert_eq!(adapter_route["overlap_blocks"], 0, "{adapter_route}");
    let url = format!("{}/v1/completions", router.http);
    for i in 0..4 {
        let reply = http
            .post(&url, &completion("ad", &prompt(&prefix, i)))
            .await;
        assert_eq!(reply.worker(), 2, "only worker 2 has the adapter");
    }
}

/// Sends `prompts` concurrently to workers that hold every request, and returns
/// each worker's count of requests in flight once all have arrived.
async fn inflight_spread(
    router: &RouterProcess,
    workers: &[TestWorker],
    prompts: Vec<Vec<u32>>,
) -> Vec<usize> {
    for w in workers {
        w.set_mode(Mode::Hold);
    }
    let http = Http::default();
    let url = format!("{}/v1/completions", router.http);
    let total = prompts.len();
    let mut tasks = Vec::new();
    for p in prompts {
        let http = http.clone();
        let url = url.clone();
        tasks.push(tokio::spawn(async move {
            http.post(&url, &completion("m", &p)).await.status
        }));
    }
    eventually("every request reached a worker", || async {
        workers.iter().map(TestWorker::inflight).sum::<usize>() == total
    })
    .await;
    let spread: Vec<usize> = workers.iter().map(TestWorker::inflight).collect();
    for w in workers {
        w.release();
    }
    for t in tasks {
        assert_eq!(t.await.unwrap(), 200);
    }
    spread
}

#[tokio::test]
async fn no_hot_spotting_on_shared_system_prompts_or_zero_reuse_traffic() {
    let router = RouterProcess::start("");
    let (workers, _grpc) = fleet(&router, 8).await;
    let system = tokens(100_000, 512);
    let shared: Vec<Vec<u32>> = (0..64u32)
        .map(|i| {
            let mut p = system.clone();
            p.extend(tokens(200_000 + i * 1000, 64));
            p
        })
        .collect();
    let unique: Vec<Vec<u32>> = (0..64u32)
        .map(|i| tokens(300_000 + i * 1000, 576))
        .collect();
    for (name, prompts) in [("shared system prompt", shared), ("zero reuse", unique)] {
        let spread = inflight_spread(&router, &workers, prompts).await;
        let max = *spread.iter().max().unwrap();
        let min = *spread.iter().min().unwrap();
        assert!(
            min >= 1 && max <= 3 * min,
            "{name}: in flight per worker {spread:?}"
        );
    }
    tokio::time::sleep(Duration::from_millis(10)).await;
}

#[tokio::test]
async fn text_prompts_and_chat_messages_hash_like_the_workers_tokens() {
    let router = RouterProcess::start("tokenizer = \"tiktoken:cl100k_base\"\n");
    let (_http, mut grpc) = fleet(&router, 3).await;
    let tokenizer = kvroute_tokenize::Tokenizer::load(&kvroute_tokenize::TokenizerSpec::Tiktoken {
        encoding: "cl100k_base".into(),
    })
    .unwrap();
    let system = "You are a careful assistant. ".repeat(40);
    let messages = vec![
        kvroute_tokenize::ChatMessage::new("system", system.clone()),
        kvroute_tokenize::ChatMessage::new("user", "What is a KV cache?"),
    ];
    // Worker 2 cached exactly what the engine tokenized for this chat.
    let chat_tokens = tokenizer.encode_chat(&messages, true).unwrap();
    grpc[1].store(&chat_tokens).await;
    let chat = json!({"model": "m", "messages": messages});
    let http = Http::default();
    let route = http
        .post(&format!("{}/v1/route", router.http), &chat)
        .await
        .json();
    assert_eq!(route["worker_id"], 2, "{route}");
    assert_eq!(route["prompt_tokens"], chat_tokens.len());
    assert_eq!(route["overlap_blocks"], chat_tokens.len() / BLOCK_SIZE);
    let reply = http
        .post(&format!("{}/v1/chat/completions", router.http), &chat)
        .await;
    assert_eq!(reply.worker(), 2);

    // A completion's text prompt is tokenized the same way.
    let text_tokens = tokenizer.encode(&system).unwrap();
    grpc[2].store(&text_tokens).await;
    let route = http
        .post(
            &format!("{}/v1/route", router.http),
            &json!({"model": "m", "prompt": system}),
        )
        .await
        .json();
    assert_eq!(route["worker_id"], 3, "{route}");
    assert_eq!(route["overlap_blocks"], text_tokens.len() / BLOCK_SIZE);
}

#[tokio::test]
async fn shutdown_lets_in_flight_streams_finish() {
    let mut router = RouterProcess::start("");
    let (_workers, _grpc) = fleet(&router, 1).await;
    let http = Http::default();
    let body = json!({"model": "m", "prompt": tokens(0, 40), "stream": true,
                      "max_tokens": 20, "chunk_delay_ms": 20});
    let response = http
        .send(
            "POST",
            &format!("{}/v1/completions", router.http),
            &[],
            body.to_string(),
        )
        .await;
    assert_eq!(response.status(), 200);
    router.process.terminate();
    let received = http_body_util::BodyExt::collect(response.into_body())
        .await
        .unwrap()
        .to_bytes();
    let expected: String =
        (0..20).map(|i| sse_chunk(1, i)).collect::<String>() + "data: [DONE]\n\n";
    assert_eq!(String::from_utf8_lossy(&received), expected);
    let mut status = None;
    eventually("the router exits", || {
        status = router.process.exited();
        std::future::ready(status.is_some())
    })
    .await;
    assert!(status.unwrap().success());
}

#[tokio::test]
async fn a_worker_that_never_answers_gets_a_504() {
    let router = RouterProcess::start("[upstream]\nfirst_byte_timeout_ms = 300\n");
    let (workers, _grpc) = fleet(&router, 1).await;
    workers[0].set_mode(Mode::Hold);
    let reply = Http::default()
        .post(
            &format!("{}/v1/completions", router.http),
            &completion("m", &tokens(0, 40)),
        )
        .await;
    reply.assert_error(504, "upstream_timeout");
    assert_eq!(workers[0].received(), 1, "a timeout is not retried");
    workers[0].release();
}

/// Worker `id`'s breaker state from `GET /workers/{id}`.
async fn breaker(router: &RouterProcess, id: u64) -> String {
    let reply = Http::default()
        .get(&format!("{}/workers/{id}", router.http))
        .await;
    reply.json()["worker"]["breaker"]
        .as_str()
        .unwrap()
        .to_string()
}

/// A router with `config` and `n` registered workers (ids 1..=n).
async fn router_with_fleet(
    config: &str,
    n: u64,
) -> (RouterProcess, Vec<TestWorker>, Vec<GrpcWorker>) {
    let router = RouterProcess::start(config);
    let (workers, grpc) = fleet(&router, n).await;
    (router, workers, grpc)
}

/// Sends `n` sequential requests with distinct prompts; the chosen workers.
async fn route_distinct(router: &RouterProcess, n: u32) -> Vec<u64> {
    let http = Http::default();
    let url = format!("{}/v1/completions", router.http);
    let mut chosen = Vec::new();
    for i in 0..n {
        let reply = http
            .post(&url, &completion("m", &tokens(60_000 + i * 1000, 64)))
            .await;
        assert_eq!(reply.status, 200);
        chosen.push(reply.worker());
    }
    chosen
}

#[tokio::test]
async fn round_robin_and_random_spread_requests() {
    let (router, _workers, _grpc) =
        router_with_fleet("[scheduler]\npolicy = \"round_robin\"\n", 3).await;
    let counts = count_by_worker(&route_distinct(&router, 9).await);
    assert_eq!(counts.len(), 3, "{counts:?}");
    assert!(counts.values().all(|&c| c == 3), "{counts:?}");

    let (router, _workers, _grpc) =
        router_with_fleet("[scheduler]\npolicy = \"random\"\n", 3).await;
    // All 30 on one worker by chance: probability 3^-29.
    let counts = count_by_worker(&route_distinct(&router, 30).await);
    assert!(counts.len() > 1, "{counts:?}");
}

#[tokio::test]
async fn approx_follows_predicted_entries_without_events() {
    let (router, _workers, _grpc) =
        router_with_fleet("[scheduler]\npolicy = \"approx\"\n", 3).await;
    let http = Http::default();
    let url = format!("{}/v1/completions", router.http);
    for round in 0..3u32 {
        let prefix = tokens(80_000 + 10_000 * round, 128);
        let first = http.post(&url, &completion("m", &prompt(&prefix, 1))).await;
        assert_eq!(first.status, 200);
        for suffix in 2..5 {
            let next = http
                .post(&url, &completion("m", &prompt(&prefix, suffix * 100)))
                .await;
            assert_eq!(next.worker(), first.worker(), "round {round}");
        }
    }
}

#[tokio::test]
async fn temperature_samples_while_zero_always_picks_the_cheapest() {
    let prefix = tokens(90_000, 128);
    for (temperature, requests) in [(0.0, 20), (1.0, 40)] {
        let (router, _workers, mut grpc) =
            router_with_fleet(&format!("[scheduler]\ntemperature = {temperature}\n"), 3).await;
        grpc[1].store(&prefix).await;
        let http = Http::default();
        let url = format!("{}/v1/completions", router.http);
        let mut chosen = Vec::new();
        for i in 0..requests {
            let reply = http.post(&url, &completion("m", &prompt(&prefix, i))).await;
            assert_eq!(reply.status, 200);
            chosen.push(reply.worker());
        }
        let counts = count_by_worker(&chosen);
        if temperature == 0.0 {
            assert_eq!(counts.get(&2), Some(&(requests as usize)), "{counts:?}");
        } else {
            // Worker 2 (cost about 0.2 of the largest) has probability about 0.53
            // per request at temperature 1: missing it, or only it, 40 times is
            // below 1e-10.
            assert!(counts.contains_key(&2), "{counts:?}");
            assert!(counts.len() > 1, "{counts:?}");
        }
    }
}

#[tokio::test]
async fn a_quiet_worker_failing_health_checks_leaves_routing_until_healthy() {
    let (router, workers, mut grpc) = router_with_fleet(
        "[upstream]\nbreaker_failures = 2\nbreaker_cooldown_ms = 60000\n\
         health_interval_ms = 100\nhealth_timeout_ms = 500\n",
        2,
    )
    .await;
    let prefix = tokens(120_000, 128);
    grpc[0].store(&prefix).await;
    workers[0].set_mode(Mode::Fail);
    eventually("failed health checks open worker 1's breaker", || async {
        breaker(&router, 1).await == "open"
    })
    .await;
    let http = Http::default();
    let url = format!("{}/v1/completions", router.http);
    let reply = http.post(&url, &completion("m", &prompt(&prefix, 1))).await;
    assert_eq!(reply.worker(), 2);
    assert_eq!(workers[0].received(), 0);

    // The cool-down is a minute: only a passing health check can close it this soon.
    workers[0].set_mode(Mode::Ok);
    eventually("a passing health check closes the breaker", || async {
        breaker(&router, 1).await == "closed"
    })
    .await;
    let reply = http.post(&url, &completion("m", &prompt(&prefix, 2))).await;
    assert_eq!(reply.worker(), 1);
}

#[tokio::test]
async fn least_loaded_and_power_of_two_avoid_a_busy_worker() {
    for policy in ["least_loaded", "power_of_two"] {
        let (router, workers, _grpc) = router_with_fleet(
            &format!(
                "[scheduler]\npolicy = \"{policy}\"\n[upstream]\nfirst_byte_timeout_ms = 2000\n"
            ),
            2,
        )
        .await;
        workers[0].set_mode(Mode::Hold);
        let http = Http::default();
        let url = format!("{}/v1/completions", router.http);
        let held = {
            let (http, url) = (http.clone(), url.clone());
            tokio::spawn(async move {
                http.call(
                    "POST",
                    &url,
                    &[("x-kvroute-worker", "1")],
                    completion("m", &tokens(0, 64)).to_string(),
                )
                .await
                .status
            })
        };
        eventually("worker 1 holds a request", || async {
            workers[0].inflight() == 1
        })
        .await;
        let chosen = route_distinct(&router, 8).await;
        assert!(chosen.iter().all(|&w| w == 2), "{policy}: {chosen:?}");
        workers[0].release();
        assert_eq!(held.await.unwrap(), 200);
    }
}

#[tokio::test]
async fn a_failing_worker_is_skipped_while_its_breaker_is_open() {
    // Round robin offers worker 1 every other request, so only its breaker keeps
    // requests away from it.
    let (router, workers, _grpc) = router_with_fleet(
        "[scheduler]\npolicy = \"round_robin\"\n[upstream]\nbreaker_failures = 2\n\
         breaker_cooldown_ms = 3600000\nhealth_interval_ms = 0\n",
        2,
    )
    .await;
    workers[0].set_mode(Mode::Fail);
    let chosen = route_distinct(&router, 4).await;
    assert!(chosen.iter().all(|&w| w == 2), "retried around: {chosen:?}");
    assert_eq!(workers[0].received(), 2);
    assert_eq!(breaker(&router, 1).await, "open");
    // The cool-down outlasts the test, however slow the machine: no timing window.
    // (The probe after a cool-down is tested on paused time in the breaker's unit
    // tests, and end to end below with a short cool-down and no window.)
    workers[0].set_mode(Mode::Ok);
    let chosen = route_distinct(&router, 4).await;
    assert!(chosen.iter().all(|&w| w == 2), "{chosen:?}");
    assert_eq!(workers[0].received(), 2, "an open breaker skips the worker");
}

#[tokio::test]
async fn a_stream_that_goes_silent_is_cut_off_after_the_idle_timeout() {
    let router = RouterProcess::start("[upstream]\nidle_timeout_ms = 300\nbreaker_failures = 1\n");
    let (workers, _grpc) = fleet(&router, 1).await;
    let http = Http::default();
    let body = json!({"model": "m", "prompt": tokens(0, 40), "stream": true,
                      "max_tokens": 10, "stall_after_chunks": 1});
    let reply = http
        .post(&format!("{}/v1/completions", router.http), &body)
        .await;
    assert_eq!(reply.status, 200);
    // The chunk the worker sent, then an OpenAI-style error event, and no [DONE].
    let text = String::from_utf8_lossy(&reply.body).to_string();
    let rest = text
        .strip_prefix(&sse_chunk(1, 0))
        .unwrap_or_else(|| panic!("the first chunk passes through: {text:?}"));
    let event: serde_json::Value = serde_json::from_str(
        rest.strip_prefix("data: ")
            .and_then(|r| r.strip_suffix("\n\n"))
            .unwrap_or_else(|| panic!("one last event: {rest:?}")),
    )
    .unwrap();
    assert_eq!(event["error"]["code"], "upstream_timeout", "{event}");
    assert!(
        event["error"]["message"]
            .as_str()
            .unwrap()
            .contains("worker 1 sent nothing for 300 ms")
    );
    // The router hung up on the worker and released the request's load.
    eventually("the worker saw its stream dropped", || async {
        workers[0].cancelled() == 1
    })
    .await;
    let info = http.get(&format!("{}/workers/1", router.http)).await.json();
    assert_eq!(info["worker"]["ranks"][0]["inflight_requests"], 0, "{info}");
    assert_eq!(
        info["worker"]["breaker"], "open",
        "a hung stream is a failure"
    );
    let metrics = http.get(&format!("{}/metrics", router.http)).await;
    let text = String::from_utf8_lossy(&metrics.body);
    assert!(
        text.contains("kvroute_upstream_idle_timeouts_total 1"),
        "{text}"
    );
}

#[tokio::test]
async fn a_stream_that_keeps_talking_outlives_the_idle_timeout() {
    // The idle deadline moves with every chunk (lazily, when its timer fires):
    // a stream three times longer than the timeout, never silent that long,
    // passes whole.
    let router = RouterProcess::start("[upstream]\nidle_timeout_ms = 300\n");
    let (_workers, _grpc) = fleet(&router, 1).await;
    let http = Http::default();
    let body = json!({"model": "m", "prompt": tokens(0, 40), "stream": true,
                      "max_tokens": 8, "chunk_delay_ms": 120});
    let reply = http
        .post(&format!("{}/v1/completions", router.http), &body)
        .await;
    assert_eq!(reply.status, 200);
    let expected: String = (0..8).map(|i| sse_chunk(1, i)).collect::<String>() + "data: [DONE]\n\n";
    assert_eq!(String::from_utf8_lossy(&reply.body), expected);
    let metrics = http.get(&format!("{}/metrics", router.http)).await;
    let text = String::from_utf8_lossy(&metrics.body);
    assert!(
        text.contains("kvroute_upstream_idle_timeouts_total 0"),
        "{text}"
    );
}

/// The queue between a stream's reader and the index overflows on purpose:
/// the test holds the router's ingest gate (so nothing is applied) while
/// batches arrive, then checks that the index ends up exactly the worker's
/// cache. The router runs in this process for the gate; the rest is real
/// gRPC and HTTP over loopback.
#[tokio::test]
async fn an_overflowing_event_queue_drops_nothing_silently() {
    // The queue holds four of rank 1's 40-block batches (~1.1 kB each decoded)
    // but not five; the largest resync answer (three batches and a removal,
    // ~5.1 kB decoded) still fits, in one message under 4.2 kB on the wire.
    let mut config = kvroute_router::Config {
        http_addr: ([127, 0, 0, 1], 0).into(),
        grpc_addr: ([127, 0, 0, 1], 0).into(),
        ..kvroute_router::Config::default()
    };
    config.ingest.event_queue_bytes = 5200;
    config.limits.max_grpc_message_bytes = 4200;
    let router = kvroute_router::server::start(config).await.unwrap();
    let http_url = format!("http://{}", router.http_addr);
    let http_worker = TestWorker::start(1).await;
    let mut registration = register(1, &http_worker.url, &["m"], BLOCK_SIZE as u32);
    registration.dp_ranks = vec![0, 1];
    let grpc_url = format!("http://{}", router.grpc_addr);
    let mut worker = GrpcWorker::connect(&grpc_url, None, registration)
        .await
        .unwrap();
    let http = Http::default();
    let dropped_batches = || {
        let (http, url) = (http.clone(), format!("{http_url}/metrics"));
        async move {
            let text = http.get(&url).await.body;
            metric(
                &String::from_utf8_lossy(&text),
                "kvroute_event_batches_dropped_total",
                &[("worker", "1")],
            )
        }
    };
    // The worker's true cache per dp rank: live prompts with their engine block hashes.
    let mut live: [Vec<(Vec<u32>, Vec<u64>)>; 2] = Default::default();
    let mut removed: Vec<Vec<u32>> = Vec::new();
    let mut last = [0; 2];
    fn store(
        worker: &mut GrpcWorker,
        live: &mut Vec<(Vec<u32>, Vec<u64>)>,
        prompt: Vec<u32>,
    ) -> kv_event::Kind {
        let (stored, hashes) = worker.chain(&prompt);
        live.push((prompt, hashes));
        kv_event::Kind::Stored(stored)
    }
    // Rank 0 loses an event between two: the router asks for it again.
    for (i, lost) in [false, true, false].into_iter().enumerate() {
        let prompt = tokens(i as u32 * 1000, 64);
        let kind = store(&mut worker, &mut live[0], prompt);
        last[0] = worker.event_on(0, None, kind, lost).await;
    }
    let resync = worker.wait_resync().await;
    assert_eq!(resync.dp_rank, 0);

    // Nothing is applied from here on: of rank 1's eight batches, one is held
    // at the gate and about three wait in the queue; the rest overflow.
    let gate = router.state.ingest_gate.write().await;
    for i in 0..8 {
        let kind = if i == 5 {
            let (prompt, block_hashes) = live[1].pop().unwrap();
            removed.push(prompt);
            kv_event::Kind::Removed(kvroute_proto::Removed { block_hashes })
        } else {
            store(
                &mut worker,
                &mut live[1],
                tokens(500_000 + i * 1000, BLOCK_SIZE * 40),
            )
        };
        last[1] = worker.event_on(1, None, kind, false).await;
    }
    eventually("a batch is dropped on the full queue", || async {
        dropped_batches().await > 0.0
    })
    .await;
    // The answer to rank 0 goes into the full queue: it must wait, not be dropped.
    worker.answer_resync(&resync).await;
    drop(gate);
    worker
        .answer_resyncs_until_acked(&[(0, last[0]), (1, last[1])])
        .await;

    // The index holds exactly the worker's cache.
    let info = http.get(&format!("{http_url}/workers/1")).await.json();
    for rank in 0..2 {
        let blocks: usize = live[rank].iter().map(|(_, hashes)| hashes.len()).sum();
        assert_eq!(info["index"][rank]["indexed_blocks"], blocks, "{info}");
        assert_eq!(info["index"][rank]["last_event_id"], last[rank], "{info}");
        for (prompt, hashes) in &live[rank] {
            let route = dry_run_at(&http_url, prompt).await;
            assert_eq!(route["dp_rank"], rank, "{route}");
            assert_eq!(route["overlap_blocks"], hashes.len(), "{route}");
        }
    }
    for prompt in &removed {
        let route = dry_run_at(&http_url, prompt).await;
        assert_eq!(route["overlap_blocks"], 0, "{route}");
    }
    router.shutdown().await;
}

/// Token ids of ASCII text under `tests/data/tokenizer`: one per byte.
fn byte_ids(text: &str) -> Vec<u32> {
    text.bytes().map(u32::from).collect()
}
#[tokio::test]
async fn a_hugging_face_tokenizer_and_chat_template_hash_like_the_workers_tokens() {
    const BOS: u32 = 256;
    const START_HEADER: u32 = 257;
    const END_HEADER: u32 = 258;
    const EOT: u32 = 259;
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/tokenizer");
    let router = RouterProcess::start(&format!("tokenizer = \"hf:{dir}\"\n"));
    let (workers, mut grpc) = fleet(&router, 3).await;
    let http = Http::default();
    let route = |body: serde_json::Value| {
        let (http, url) = (http.clone(), format!("{}/v1/route", router.http));
        async move { http.post(&url, &body).await.json() }
    };

    // What the engine makes of this chat with the Llama-3-style template,
    // worked out by hand: worker 2 cached exactly that.
    let system = "You are a careful assistant. ".repeat(12);
    let user = "What is a KV cache?";
    let header = |role: &str| {
        let mut ids = vec![START_HEADER];
        ids.extend(byte_ids(role));
        ids.extend([END_HEADER, 10, 10]);
        ids
    };
    let mut chat_tokens = vec![BOS];
    chat_tokens.extend(header("system"));
    chat_tokens.extend(byte_ids(system.trim()));
    chat_tokens.push(EOT);
    chat_tokens.extend(header("user"));
    chat_tokens.extend(byte_ids(user));
    chat_tokens.push(EOT);
    chat_tokens.extend(header("assistant"));
    grpc[1].store(&chat_tokens).await;
    let chat = json!({"model": "m", "messages": [
        {"role": "system", "content": system},
        {"role": "user", "content": user},
    ]});
    let dry = route(chat.clone()).await;
    assert_eq!(dry["worker_id"], 2, "{dry}");
    assert_eq!(dry["prompt_tokens"], chat_tokens.len());
    assert_eq!(dry["overlap_blocks"], chat_tokens.len() / BLOCK_SIZE);
    let reply = http
        .post(&format!("{}/v1/chat/completions", router.http), &chat)
        .await;
    assert_eq!(reply.status, 200);
    assert_eq!(reply.worker(), 2);
    assert_eq!(
        workers[1].state.last_body.lock().unwrap().as_ref(),
        Some(&chat),
        "the body is forwarded as sent"
    );

    // A completion's text gets the BOS of the post-processor; the same tokens
    // sent as ids route the same way, with the same scores.
    let text = system.trim();
    let mut text_tokens = vec![BOS];
    text_tokens.extend(byte_ids(text));
    grpc[2].store(&text_tokens).await;
    let by_text = route(json!({"model": "m", "prompt": text})).await;
    let by_ids = route(json!({"model": "m", "prompt": text_tokens})).await;
    assert_eq!(by_text["worker_id"], 3, "{by_text}");
    assert_eq!(by_text["prompt_tokens"], text_tokens.len());
    assert_eq!(by_text["overlap_blocks"], text_tokens.len() / BLOCK_SIZE);
    for field in ["worker_id", "prompt_tokens", "overlap_blocks", "scores"] {
        assert_eq!(by_text[field], by_ids[field], "{field}");
    }
}

/// Sends worker `grpc`'s load report and waits until the router shows it.
async fn report_load(router: &RouterProcess, grpc: &GrpcWorker, kv_blocks_used: u64) {
    grpc.send(worker_message::Body::Load(kvroute_proto::LoadReport {
        dp_rank: 0,
        kv_blocks_used,
        kv_blocks_total: 1000,
        ..Default::default()
    }))
    .await;
    let http = Http::default();
    let url = format!("{}/workers/{}", router.http, grpc.id);
    eventually("the load report is applied", || async {
        http.get(&url).await.json()["worker"]["ranks"][0]["reported"]["kv_blocks_used"]
            == kv_blocks_used
    })
    .await;
}

#[tokio::test]
async fn a_retried_request_predicts_its_prefix_only_where_it_was_served() {
    let (router, workers, grpc) = router_with_fleet("", 2).await;
    // Worker 2 is loaded, so worker 1 is the first choice; worker 1 fails.
    report_load(&router, &grpc[1], 50).await;
    workers[0].set_mode(Mode::Fail);
    let prefix = tokens(130_000, 128);
    let reply = Http::default()
        .post(
            &format!("{}/v1/completions", router.http),
            &completion("m", &prompt(&prefix, 1)),
        )
        .await;
    assert_eq!(reply.worker(), 2);
    assert_eq!(workers[0].received(), 1, "worker 1 was tried first");

    // Equal load again: only worker 2 is expected to hold the prefix, so it
    // wins outright instead of tying with the worker that failed.
    report_load(&router, &grpc[1], 0).await;
    let route = dry_run(&router, &prompt(&prefix, 2)).await;
    assert_eq!(route["worker_id"], 2, "{route}");
    for score in route["scores"].as_array().unwrap() {
        let expected = if score["worker_id"] == 2 { 8 } else { 0 };
        assert_eq!(score["predicted_overlap_blocks"], expected, "{route}");
    }
}

#[tokio::test]
async fn a_cooled_down_breaker_gets_its_probe_even_when_others_are_cheaper() {
    let (router, workers, mut grpc) = router_with_fleet(
        "[upstream]\nbreaker_failures = 1\nbreaker_cooldown_ms = 300\nhealth_interval_ms = 0\n",
        2,
    )
    .await;
    // Every request shares a prefix worker 2 holds: worker 2 is always cheaper.
    let prefix = tokens(140_000, 256);
    grpc[1].store(&prefix).await;
    workers[0].set_mode(Mode::Fail);
    let http = Http::default();
    let url = format!("{}/v1/completions", router.http);
    http.call(
        "POST",
        &url,
        &[("x-kvroute-worker", "1")],
        completion("m", &prefix).to_string(),
    )
    .await
    .assert_error(502, "upstream_error");
    assert_eq!(breaker(&router, 1).await, "open");

    // Worker 1 recovers; after the cool-down the next request is its probe.
    workers[0].set_mode(Mode::Ok);
    eventually("worker 1 gets a probe", || async {
        let reply = http.post(&url, &completion("m", &prompt(&prefix, 1))).await;
        assert_eq!(reply.status, 200);
        reply.worker() == 1
    })
    .await;
    assert_eq!(workers[0].received(), 2, "exactly one probe");
    assert_eq!(breaker(&router, 1).await, "closed");
}

/// `name`'s value in the router's `/metrics` (summed over its samples).
async fn scrape(router: &RouterProcess, name: &str) -> f64 {
    let reply = Http::default()
        .get(&format!("{}/metrics", router.http))
        .await;
    metric(&reply.text(), name, &[])
}

#[tokio::test]
async fn plain_responses_are_not_cancels_and_record_their_latency() {
    let (router, _workers, _grpc) = router_with_fleet("", 2).await;
    let routed = route_distinct(&router, 5).await;
    assert_eq!(routed.len(), 5);
    // hyper drops a body as soon as it says it is complete: that is its end, not a cancel.
    assert_eq!(
        scrape(&router, "kvroute_cancelled_requests_total").await,
        0.0
    );
    assert_eq!(
        scrape(&router, "kvroute_upstream_e2e_seconds_count").await,
        5.0
    );
    let info = Http::default()
        .get(&format!("{}/workers", router.http))
        .await
        .json();
    for worker in info["workers"].as_array().unwrap() {
        assert_eq!(worker["ranks"][0]["inflight_requests"], 0, "{worker}");
    }
}

#[tokio::test]
async fn an_error_in_the_middle_of_a_body_is_a_failure_for_the_breaker() {
    let (router, _workers, _grpc) = router_with_fleet(
        "[upstream]\nbreaker_failures = 1\nhealth_interval_ms = 0\n",
        1,
    )
    .await;
    let text = broken_stream(&router.http).await;
    assert!(!text.contains("[DONE]"), "not a complete one: {text}");
    eventually("the broken stream opened the breaker", || async {
        breaker(&router, 1).await == "open"
    })
    .await;
    assert_eq!(
        scrape(&router, "kvroute_cancelled_requests_total").await,
        0.0
    );
}

/// The last `cached_tokens` count in a response body.
fn reported_cached_tokens(body: &str) -> u64 {
    let at = body
        .rfind("\"cached_tokens\":")
        .expect("the sim reports cached tokens");
    body[at + 16..]
        .chars()
        .take_while(char::is_ascii_digit)
        .collect::<String>()
        .parse()
        .unwrap()
}

#[tokio::test]
async fn the_workers_cached_tokens_are_recorded_beside_the_prediction() {
    let router = RouterProcess::start("");
    let _sim = SimFleet::start(Some(&router.grpc), 1);
    let http = Http::default();
    eventually("the sim worker registers", || async {
        http.get(&format!("{}/readyz", router.http)).await.status == 200
    })
    .await;
    let url = format!("{}/v1/completions", router.http);
    let prompt = tokens(90_000, 64);
    let plain = json!({"model": "sim-model", "prompt": prompt, "max_tokens": 2});
    let first = http.post(&url, &plain).await;
    assert_eq!(first.status, 200, "{}", first.text());
    // The same prompt again, as a stream with its usage in a last chunk.
    let stream = json!({"model": "sim-model", "prompt": prompt, "max_tokens": 2, "stream": true,
                        "stream_options": {"include_usage": true}});
    let second = http.post(&url, &stream).await;
    assert_eq!(second.status, 200);
    let actual = reported_cached_tokens(&first.text()) + reported_cached_tokens(&second.text());
    assert!(actual > 0, "the second request hit the sim's cache");
    let predicted = scrape(&router, "kvroute_predicted_cached_tokens_total").await;
    assert!(predicted > 0.0, "the router predicted the hit");
    assert_eq!(
        scrape(&router, "kvroute_actual_cached_tokens_total").await,
        actual as f64
    );
    assert_eq!(
        scrape(&router, "kvroute_cached_tokens_error_tokens_count").await,
        2.0
    );
    assert_eq!(
        scrape(&router, "kvroute_cached_tokens_error_tokens_sum").await,
        predicted - actual as f64
    );
    let gap = scrape(&router, "kvroute_cached_tokens_gap").await;
    let worst = (predicted - actual as f64).abs() / 64.0;
    assert!((0.0..=worst).contains(&gap), "gap {gap}, worst {worst}");
}

/// Both workers busy (`busy_max_inflight = 1`), worker 1 caching a prefix: an
/// unrelated request queues, then one sharing worker 1's prefix. When worker
/// 1's request ends, which waiter does the queue give it to?
async fn first_served_from_the_queue(order: &str) -> Vec<u32> {
    let (router, workers, mut grpc) = router_with_fleet(
        &format!(
            "[scheduler]\nbusy_max_inflight = 1\nqueue_timeout_ms = 30000\nqueue_order = \"{order}\"\n"
        ),
        2,
    )
    .await;
    let cached = tokens(1000, 64);
    grpc[0].store(&cached).await;
    let http = Http::default();
    let url = format!("{}/v1/completions", router.http);
    let send = |pin: Option<&'static str>, body: serde_json::Value| {
        let (http, url) = (http.clone(), url.clone());
        tokio::spawn(async move {
            let headers: Vec<(&str, &str)> =
                pin.map(|p| ("x-kvroute-worker", p)).into_iter().collect();
            http.call("POST", &url, &headers, body.to_string())
                .await
                .status
        })
    };
    // Worker 1 streams for a while (about 1 s); worker 2 holds its request.
    let mut streaming = completion("m", &tokens(5000, 32));
    streaming["stream"] = json!(true);
    streaming["max_tokens"] = json!(10);
    streaming["chunk_delay_ms"] = json!(100);
    workers[1].set_mode(Mode::Hold);
    let busy = [
        send(Some("1"), streaming),
        send(Some("2"), completion("m", &tokens(6000, 32))),
    ];
    eventually("both workers are busy", || async {
        workers[0].inflight() == 1 && workers[1].inflight() == 1
    })
    .await;
    // What reaches worker 1 next stays there.
    workers[0].set_mode(Mode::Hold);
    let unrelated = send(None, completion("m", &tokens(9000, 64)));
    eventually("the unrelated request is queued", || async {
        scrape(&router, "kvroute_queued_requests").await == 1.0
    })
    .await;
    let mut sharing_prompt = cached.clone();
    sharing_prompt.extend(tokens(2000, 16));
    let sharing = send(None, completion("m", &sharing_prompt));
    eventually("both are queued", || async {
        scrape(&router, "kvroute_queued_requests").await == 2.0
    })
    .await;
    eventually("worker 1 took a queued request", || async {
        workers[0].received() == 2
    })
    .await;
    let first = workers[0].state.last_body.lock().unwrap().clone().unwrap();
    assert_eq!(
        scrape(&router, "kvroute_queued_requests").await,
        1.0,
        "the other still waits"
    );
    workers[0].release();
    workers[1].release();
    for request in busy.into_iter().chain([unrelated, sharing]) {
        assert_eq!(request.await.unwrap(), 200);
    }
    serde_json::from_value(first["prompt"].clone()).unwrap()
}

#[tokio::test]
async fn longest_prefix_serves_a_queued_request_sharing_a_free_workers_cache_before_an_earlier_one()
{
    let first = first_served_from_the_queue("longest_prefix").await;
    assert_eq!(
        first[..64],
        tokens(1000, 64)[..],
        "the request sharing the prefix"
    );
    let first = first_served_from_the_queue("fifo").await;
    assert_eq!(first, tokens(9000, 64), "the earlier request");
}
