//! The simulated fleet against a real router, both as real processes on
//! loopback: restarts, deaths and lost events are detected and repaired.

mod fleet;

use fleet::*;
use serde_json::json;

fn prompt(seed: u32) -> Vec<u32> {
    (seed * 1000..seed * 1000 + 64).collect()
}

#[test]
fn a_restarting_worker_is_cleared_and_resynced() {
    let (_router_proc, router, grpc) = router(&[]);
    let (_sim, workers) = sim(&grpc, 1);
    wait_registered(&router, 1);
    let (id, addr) = workers[0].clone();
    assert_eq!(complete(&router, &prompt(1), None).status, 200);
    wait_for(10, "4 blocks indexed", || {
        (indexed(&router, id).0 == 4).then_some(())
    });

    let reply = post(&addr, "/admin/fault", &json!({"fault": "restart"}));
    assert_eq!(reply.status, 200, "{}", reply.body);
    // Ids start over with Cleared: the router drops everything it knew.
    wait_for(10, "the index to be cleared", || {
        (indexed(&router, id) == (0, 1)).then_some(())
    });
    let metrics = get(&router, "/metrics").body;
    assert!(
        metrics_has(&metrics, "kvroute_worker_restarts_total"),
        "{metrics}"
    );

    // New blocks after the restart are indexed again, ids continuing from 1.
    assert_eq!(complete(&router, &prompt(2), None).status, 200);
    wait_for(10, "the new blocks", || {
        let (blocks, last) = indexed(&router, id);
        (blocks == 4 && last == 5).then_some(())
    });
}

fn metrics_has(text: &str, name: &str) -> bool {
    metric(text, name) >= 1.0
}

#[test]
fn a_dead_worker_is_routed_around() {
    let (_router_proc, router, grpc) = router(&[]);
    let (_sim, workers) = sim(&grpc, 2);
    wait_registered(&router, 2);
    let (dead, dead_addr) = workers[0].clone();
    let reply = post(&dead_addr, "/admin/fault", &json!({"fault": "die"}));
    assert_eq!(reply.status, 200);
    wait_for(10, "the router to see the stream close", || {
        let info = get(&router, &format!("/workers/{dead}")).json();
        (info["worker"]["state"] == "disconnected").then_some(())
    });
    for seed in 0..6 {
        let reply = complete(&router, &prompt(seed), None);
        assert_eq!(reply.status, 200, "{}", reply.body);
        assert_ne!(
            reply.header("x-kvroute-worker"),
            Some(dead.to_string().as_str())
        );
    }
    assert!(
        std::net::TcpStream::connect(&dead_addr).is_err(),
        "the dead worker still listens"
    );
}

#[test]
fn a_dropped_range_of_events_is_detected_and_resynced() {
    let (_router_proc, router, grpc) = router(&[]);
    let (_sim, workers) = sim(&grpc, 1);
    wait_registered(&router, 1);
    let (id, addr) = workers[0].clone();
    let reply = post(
        &addr,
        "/admin/fault",
        &json!({"fault": "drop_events", "count": 2}),
    );
    assert_eq!(reply.status, 200, "{}", reply.body);
    for seed in 1..=2 {
        assert_eq!(complete(&router, &prompt(seed), None).status, 200);
    }
    // The worker's log: Cleared, then 4 Stored per prompt.
    let worker_last = metric(&get(&addr, "/metrics").body, "kvroute_sim_last_event_id") as u64;
    assert_eq!(worker_last, 9);
    wait_for(10, "the router to catch up", || {
        (indexed(&router, id) == (8, 9)).then_some(())
    });
    let metrics = get(&router, "/metrics").body;
    assert!(
        metrics_has(&metrics, "kvroute_event_gaps_total"),
        "{metrics}"
    );
    assert!(metrics_has(&metrics, "kvroute_resyncs_total"), "{metrics}");
}

#[test]
fn the_worker_http_api_speaks_openai_and_refuses_bad_input() {
    let (_sim, workers) = {
        // No router: the engine serves HTTP alone.
        let proc = spawn(&["sim", "--workers", "1", "--speedup", "100"], |l| {
            l.iter().any(|l| l.starts_with("worker "))
        });
        let url = proc
            .lines
            .iter()
            .find(|l| l.starts_with("worker "))
            .unwrap()
            .clone();
        let addr = url.rsplit("http://").next().unwrap().to_string();
        (proc, addr)
    };
    let addr = workers;
    let body =
        json!({"model": "sim-model", "prompt": "Hello there, routing world", "max_tokens": 3});
    let first = post(&addr, "/v1/completions", &body).json();
    let prompt_tokens = first["usage"]["prompt_tokens"].as_u64().unwrap();
    assert!(prompt_tokens > 0);
    assert_eq!(first["usage"]["completion_tokens"], 3);
    let chat = json!({"model": "sim-model", "stream": true, "max_tokens": 4,
                      "stream_options": {"include_usage": true},
                      "messages": [{"role": "user", "content": "hi"}]});
    let stream = post(&addr, "/v1/chat/completions", &chat).body;
    let events: Vec<&str> = stream
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .collect();
    assert_eq!(events.last(), Some(&"[DONE]"));
    assert_eq!(events.len(), 4 + 2, "{stream}");
    assert!(events[4].contains("\"completion_tokens\":4"), "{stream}");
    let bad = post(&addr, "/v1/completions", &json!({"model": "sim-model"}));
    assert_eq!(bad.status, 400);
    assert!(
        bad.json()["error"]["message"]
            .as_str()
            .unwrap()
            .contains("prompt")
    );
    assert_eq!(
        post(
            &addr,
            "/v1/completions",
            &json!({"model": "other", "prompt": [1]})
        )
        .status,
        404
    );
    assert_eq!(get(&addr, "/health").status, 200);
    assert_eq!(
        get(&addr, "/v1/models").json()["data"][0]["id"],
        "sim-model"
    );
    let metrics = get(&addr, "/metrics").body;
    assert_eq!(metric(&metrics, "kvroute_sim_requests_total"), 2.0);
}

#[test]
fn workers_connect_with_backoff_and_resend_their_state_when_the_router_comes_back() {
    let grpc = format!("127.0.0.1:{}", free_port());
    // The workers start first and retry until the router listens.
    let (_sim, workers) = sim(&grpc, 1);
    let (router_proc, router, _) = router_on(&grpc, &[]);
    wait_registered(&router, 1);
    let id = workers[0].0;
    assert_eq!(complete(&router, &prompt(3), None).status, 200);
    wait_for(10, "4 blocks indexed", || {
        (indexed(&router, id).0 == 4).then_some(())
    });

    // A new router knows nothing; the reconnecting worker's dump restores it.
    drop(router_proc);
    let (_router_proc, router, _) = router_on(&grpc, &[]);
    wait_registered(&router, 1);
    wait_for(10, "the dump to be applied", || {
        (indexed(&router, id) == (4, 5)).then_some(())
    });
}
