//! The simulated fleet against a real router, both as real processes on
//! loopback: restarts, deaths and lost events are detected and repaired.

mod common;

use common::*;
use serde_json::json;

fn prompt(seed: u32) -> Vec<u32> {
    (seed * 1000..seed * 1000 + 64).collect()
}

/// A router on free ports and `n` simulated workers registered with it.
async fn router_and_sim(n: usize) -> (RouterProcess, SimFleet) {
    let router = RouterProcess::start("");
    let sim = SimFleet::start(Some(&router.grpc), n);
    wait_registered(&router, n).await;
    (router, sim)
}

/// A completion of `tokens` through the router.
async fn complete(router: &RouterProcess, tokens: &[u32]) -> Reply {
    let body = json!({"model": "sim-model", "prompt": tokens, "max_tokens": 2});
    Http::default()
        .post(&format!("{}/v1/completions", router.http), &body)
        .await
}

/// Waits until the router's view of `worker` is `expected`.
async fn wait_indexed(router: &RouterProcess, worker: u64, what: &str, expected: (u64, u64)) {
    eventually(what, || async { indexed(router, worker).await == expected }).await;
}

/// Whether the counter `name` counted anything.
async fn counted(url: &str, name: &str) -> bool {
    metric(
        &Http::default().get(&format!("{url}/metrics")).await.text(),
        name,
        &[],
    ) >= 1.0
}

#[tokio::test]
async fn a_restarting_worker_is_cleared_and_resynced() {
    let (router, sim) = router_and_sim(1).await;
    let (id, url) = sim.workers[0].clone();
    let http = Http::default();
    assert_eq!(complete(&router, &prompt(1)).await.status, 200);
    eventually("4 blocks indexed", || async {
        indexed(&router, id).await.0 == 4
    })
    .await;

    let reply = http
        .post(&format!("{url}/admin/fault"), &json!({"fault": "restart"}))
        .await;
    assert_eq!(reply.status, 200, "{}", reply.text());
    // The engine registers again as a new instance: the router drops everything it knew.
    wait_indexed(&router, id, "the index to be cleared", (0, 1)).await;
    assert!(counted(&router.http, "kvroute_worker_restarts_total").await);

    // New blocks after the restart are indexed again, ids starting over at 1.
    assert_eq!(complete(&router, &prompt(2)).await.status, 200);
    wait_indexed(&router, id, "the new blocks", (4, 5)).await;
}

#[tokio::test]
async fn a_dead_worker_is_routed_around() {
    let (router, sim) = router_and_sim(2).await;
    let (dead, dead_url) = sim.workers[0].clone();
    let http = Http::default();
    let reply = http
        .post(&format!("{dead_url}/admin/fault"), &json!({"fault": "die"}))
        .await;
    assert_eq!(reply.status, 200);
    let worker_url = format!("{}/workers/{dead}", router.http);
    eventually("the router to see the stream close", || async {
        http.get(&worker_url).await.json()["worker"]["state"] == "disconnected"
    })
    .await;
    for seed in 0..6 {
        let reply = complete(&router, &prompt(seed)).await;
        assert_eq!(reply.status, 200, "{}", reply.text());
        assert_ne!(reply.worker(), dead);
    }
    let dead_addr = dead_url.trim_start_matches("http://");
    assert!(
        std::net::TcpStream::connect(dead_addr).is_err(),
        "the dead worker still listens"
    );
}

#[tokio::test]
async fn a_dropped_range_of_events_is_detected_and_resynced() {
    let (router, sim) = router_and_sim(1).await;
    let (id, url) = sim.workers[0].clone();
    let http = Http::default();
    let reply = http
        .post(
            &format!("{url}/admin/fault"),
            &json!({"fault": "drop_events", "count": 2}),
        )
        .await;
    assert_eq!(reply.status, 200, "{}", reply.text());
    for seed in 1..=2 {
        assert_eq!(complete(&router, &prompt(seed)).await.status, 200);
    }
    // The worker's log: Cleared, then 4 Stored per prompt.
    let worker_metrics = http.get(&format!("{url}/metrics")).await.text();
    assert_eq!(
        metric(&worker_metrics, "kvroute_sim_last_event_id", &[]),
        9.0
    );
    wait_indexed(&router, id, "the router to catch up", (8, 9)).await;
    assert!(counted(&router.http, "kvroute_event_gaps_total").await);
    assert!(counted(&router.http, "kvroute_resyncs_total").await);
}

#[tokio::test]
async fn the_worker_http_api_speaks_openai_and_refuses_bad_input() {
    // No router: the engine serves HTTP alone.
    let sim = SimFleet::start(None, 1);
    let url = &sim.workers[0].1;
    let http = Http::default();
    let completions = format!("{url}/v1/completions");
    let body =
        json!({"model": "sim-model", "prompt": "Hello there, routing world", "max_tokens": 3});
    let first = http.post(&completions, &body).await.json();
    let prompt_tokens = first["usage"]["prompt_tokens"].as_u64().unwrap();
    assert!(prompt_tokens > 0);
    assert_eq!(first["usage"]["completion_tokens"], 3);
    let chat = json!({"model": "sim-model", "stream": true, "max_tokens": 4,
                      "stream_options": {"include_usage": true},
                      "messages": [{"role": "user", "content": "hi"}]});
    let stream = http
        .post(&format!("{url}/v1/chat/completions"), &chat)
        .await
        .text();
    let events: Vec<&str> = stream
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .collect();
    assert_eq!(events.last(), Some(&"[DONE]"));
    assert_eq!(events.len(), 4 + 2, "{stream}");
    assert!(events[4].contains("\"completion_tokens\":4"), "{stream}");
    let bad = http
        .post(&completions, &json!({"model": "sim-model"}))
        .await;
    assert_eq!(bad.status, 400);
    assert!(
        bad.json()["error"]["message"]
            .as_str()
            .unwrap()
            .contains("prompt")
    );
    let unknown = json!({"model": "other", "prompt": [1]});
    assert_eq!(http.post(&completions, &unknown).await.status, 404);
    assert_eq!(http.get(&format!("{url}/health")).await.status, 200);
    assert_eq!(
        http.get(&format!("{url}/v1/models")).await.json()["data"][0]["id"],
        "sim-model"
    );
    let metrics = http.get(&format!("{url}/metrics")).await.text();
    assert_eq!(metric(&metrics, "kvroute_sim_requests_total", &[]), 2.0);
}

#[tokio::test]
async fn workers_connect_with_backoff_and_resend_their_state_when_the_router_comes_back() {
    let grpc = format!("127.0.0.1:{}", free_ports(1));
    // The workers start first and retry until the router listens.
    let sim = SimFleet::start(Some(&format!("http://{grpc}")), 1);
    let router = RouterProcess::start_on(&grpc, "");
    wait_registered(&router, 1).await;
    let id = sim.workers[0].0;
    assert_eq!(complete(&router, &prompt(3)).await.status, 200);
    eventually("4 blocks indexed", || async {
        indexed(&router, id).await.0 == 4
    })
    .await;

    // A new router knows nothing; the reconnecting worker's dump restores it.
    drop(router);
    let router = RouterProcess::start_on(&grpc, "");
    wait_registered(&router, 1).await;
    wait_indexed(&router, id, "the dump to be applied", (4, 5)).await;
}
