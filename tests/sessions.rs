//! Agent sessions (`[sessions]`), end to end: real `kvroute serve` processes,
//! simulated or test workers over loopback, and for replicas a real
//! nats-server (tests/nats/install.sh).
//!
//! Each test sends a session's requests with prompts that share nothing, so
//! that only the binding keeps them on one worker: cache-aware routing alone
//! would send an unrelated prompt to a worker holding fewer blocks.

mod common;

use common::*;
use serde_json::{Value, json};

const SESSION: &str = "x-session-id";

/// A completion of session `session` through the router at `http`.
async fn send(http: &str, session: &str, model: &str, prompt: &[u32]) -> Reply {
    let reply = Http::default()
        .call(
            "POST",
            &format!("{http}/v1/completions"),
            &[(SESSION, session)],
            completion(model, prompt).to_string(),
        )
        .await;
    assert_eq!(reply.status, 200, "{}", reply.text());
    reply
}

/// The dry run's `session` for a request of `session`.
async fn binding(http: &str, session: &str, model: &str) -> Value {
    let reply = Http::default()
        .call(
            "POST",
            &format!("{http}/v1/route"),
            &[(SESSION, session)],
            completion(model, &tokens(900_000, 32)).to_string(),
        )
        .await;
    assert_eq!(reply.status, 200, "{}", reply.text());
    reply.json()["session"].clone()
}

async fn session_routes(http: &str, outcome: &str) -> f64 {
    let text = Http::default().get(&format!("{http}/metrics")).await.text();
    metric(
        &text,
        "kvroute_session_routes_total",
        &[("outcome", outcome)],
    )
}

async fn bindings(http: &str) -> f64 {
    let text = Http::default().get(&format!("{http}/metrics")).await.text();
    metric(&text, "kvroute_session_bindings", &[])
}

#[tokio::test]
async fn a_session_stays_on_its_worker_moves_when_it_is_loaded_and_the_binding_follows() {
    let workers = [
        TestWorker::start(1).await,
        TestWorker::start(2).await,
        TestWorker::start(3).await,
    ];
    let router = RouterProcess::start(&format!(
        "{}[sessions]\nmax_load_ratio = 2.0\n",
        static_workers(&workers)
    ));
    let http = &router.http;
    let first = send(http, "agent-1", "m", &tokens(0, 64)).await.worker();
    // Unrelated prompts: each worker ties on cost, and the tie is drawn at random.
    for i in 1..=6 {
        let reply = send(http, "agent-1", "m", &tokens(i * 1_000, 64)).await;
        assert_eq!(
            reply.worker(),
            first,
            "request {i} left the session's worker"
        );
    }
    assert_eq!(
        binding(http, "agent-1", "m").await,
        json!({"outcome": "bound", "bound_worker_id": first, "bound_dp_rank": 0})
    );
    assert_eq!(binding(http, "agent-2", "m").await["outcome"], "new");

    // A long request held on the session's worker: 64 blocks against the
    // idle workers' none, past twice the least loaded one's load.
    let held = &workers[first as usize - 1];
    held.set_mode(Mode::Hold);
    let pinned = {
        let url = format!("{http}/v1/completions");
        let body = completion("m", &tokens(500_000, 1024)).to_string();
        let worker = first.to_string();
        tokio::spawn(async move {
            Http::default()
                .call("POST", &url, &[("x-kvroute-worker", &worker)], body)
                .await
        })
    };
    eventually("the long request to reach the worker", || async {
        held.inflight() == 1
    })
    .await;
    let moved = send(http, "agent-1", "m", &tokens(20_000, 64))
        .await
        .worker();
    assert_ne!(moved, first);
    held.release();
    assert_eq!(pinned.await.unwrap().status, 200);
    // The binding followed: the session stays where it moved to.
    for i in 0..3 {
        let reply = send(http, "agent-1", "m", &tokens(30_000 + i * 1_000, 64)).await;
        assert_eq!(reply.worker(), moved);
    }
    assert_eq!(session_routes(http, "new").await, 1.0);
    assert_eq!(session_routes(http, "bound").await, 9.0);
    assert_eq!(session_routes(http, "moved").await, 1.0);
    assert_eq!(bindings(http).await, 1.0);
}

#[tokio::test]
async fn a_binding_expires_its_ttl_after_the_sessions_last_request() {
    let workers = [TestWorker::start(1).await, TestWorker::start(2).await];
    let router = RouterProcess::start(&format!(
        "{}[sessions]\nttl_s = 1\n",
        static_workers(&workers)
    ));
    let http = &router.http;
    let worker = send(http, "agent-1", "m", &tokens(0, 64)).await.worker();
    assert_eq!(
        binding(http, "agent-1", "m").await["bound_worker_id"],
        worker
    );
    eventually("the binding to expire", || async {
        binding(http, "agent-1", "m").await["outcome"] == "new" && bindings(http).await == 0.0
    })
    .await;
}

#[tokio::test]
async fn bad_session_ids_and_sessions_past_the_table_are_refused() {
    let workers = [TestWorker::start(1).await];
    let router = RouterProcess::start(&format!(
        "{}[limits]\nmax_session_bindings = 1\nmax_session_id_bytes = 16\n",
        static_workers(&workers)
    ));
    let http = &router.http;
    let post = |session: String| async move {
        Http::default()
            .call(
                "POST",
                &format!("{http}/v1/completions"),
                &[(SESSION, &session)],
                completion("m", &tokens(0, 64)).to_string(),
            )
            .await
    };
    post("a".repeat(17))
        .await
        .assert_error(400, "invalid_request");
    assert_eq!(refusals(&router, "session_id_bytes").await, 1.0);
    assert_eq!(post("first".into()).await.status, 200);
    assert_eq!(post("first".into()).await.status, 200);
    let full = post("second".into()).await;
    full.assert_error(503, "no_worker_available");
    assert!(full.text().contains("limits.max_session_bindings"));
    assert_eq!(refusals(&router, "session_bindings").await, 1.0);
    // Without a session the request goes through.
    let plain = Http::default()
        .post(
            &format!("{http}/v1/completions"),
            &completion("m", &tokens(0, 64)),
        )
        .await;
    assert_eq!(plain.status, 200);
}

#[tokio::test]
async fn a_sessions_prefix_stays_indexed_while_eviction_takes_others() {
    let router = RouterProcess::start("[index]\nmax_blocks = 48\n");
    let sim = SimFleet::start_with(Some(&router.grpc), 2, &["--model", "m"], &[]);
    wait_registered(&router, 2).await;
    let http = &router.http;
    // 10 blocks each: the session's prompt, and the same size without a session.
    let session_prompt = tokens(0, 160);
    let plain = tokens(100_000, 160);
    let worker = send(http, "agent-1", "m", &session_prompt).await.worker();
    let plain_worker = Http::default()
        .post(&format!("{http}/v1/completions"), &completion("m", &plain))
        .await
        .worker();
    eventually("both prompts to be indexed", || async {
        event_overlap(&router, &session_prompt, worker).await == 10
            && event_overlap(&router, &plain, plain_worker).await == 10
    })
    .await;
    // The session's next turn: bound, and its binding pins the indexed prefix.
    let mut next = session_prompt.clone();
    next.extend(tokens(200_000, 16));
    assert_eq!(send(http, "agent-1", "m", &next).await.worker(), worker);
    // Other traffic: 16 prompts of 6 blocks, well past the index's 48 blocks
    // (and well inside the workers' caches).
    for i in 0..16 {
        let reply = Http::default()
            .post(
                &format!("{http}/v1/completions"),
                &completion("m", &tokens(300_000 + i * 1_000, 96)),
            )
            .await;
        assert_eq!(reply.status, 200);
    }
    eventually(
        "eviction to forget the prompt without a session",
        || async { event_overlap(&router, &plain, plain_worker).await < 10 },
    )
    .await;
    assert_eq!(event_overlap(&router, &session_prompt, worker).await, 10);
    drop(sim);
}

#[tokio::test]
async fn a_session_bound_on_one_replica_is_followed_by_the_others_and_outlives_it() {
    let nats = NatsServer::start();
    // Turns come back to back here: the worker's load report of the turn
    // before may still stand and count as load on it.
    let config = |i| {
        format!(
            "{}[sessions]\nmax_load_ratio = 4.0\n",
            nats.cluster_config(&format!("r{i}"))
        )
    };
    let mut routers: Vec<RouterProcess> =
        (0..3).map(|i| RouterProcess::start(&config(i))).collect();
    let urls: Vec<&str> = routers.iter().map(|r| r.grpc.as_str()).collect();
    let sim = SimFleet::start(Some(&urls.join(",")), 4);
    for router in &routers {
        wait_registered(router, 4).await;
    }
    let first = send(&routers[0].http, "agent-1", "sim-model", &tokens(0, 64))
        .await
        .worker();
    // Each next request goes to another replica, with a prompt of its own.
    for i in 1..=6u32 {
        let router = &routers[i as usize % 3];
        eventually("the replica to follow the binding", || async {
            binding(&router.http, "agent-1", "sim-model").await["bound_worker_id"] == first
        })
        .await;
        let reply = send(
            &router.http,
            "agent-1",
            "sim-model",
            &tokens(i * 10_000, 64),
        )
        .await;
        assert_eq!(
            reply.worker(),
            first,
            "request {i} through replica {}",
            i % 3
        );
    }
    // The replica that made the binding (and held the workers' streams) dies.
    routers.remove(0);
    for router in &routers {
        wait_registered(router, 4).await;
        let reply = send(&router.http, "agent-1", "sim-model", &tokens(90_000, 64)).await;
        assert_eq!(reply.worker(), first);
        assert!(session_routes(&router.http, "bound").await >= 1.0);
    }
    drop(sim);
}
