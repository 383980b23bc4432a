//! Hard limits, the bounded index, dumps in parts and keepalive, end to end:
//! the real `kvroute serve` (and `kvroute sim`) over loopback, driven by test
//! workers and raw gRPC streams as a misbehaving or unlucky fleet would.

mod common;

use std::process::Command;
use std::time::Instant;

use common::*;
use kvroute_proto::{EventBatch, KvEvent, Stored, StoredBlock, kv_event, worker_message};
use serde_json::json;

async fn metrics(router: &RouterProcess) -> String {
    Http::default()
        .get(&format!("{}/metrics", router.http))
        .await
        .text()
}

#[tokio::test]
async fn registrations_streams_and_workers_over_their_limits_are_refused_and_counted() {
    let router = RouterProcess::start("[limits]\nmax_workers = 2\nmax_streams = 2\n");
    // A million ranks: refused before the registry does anything with them.
    let mut huge = register(1, "http://127.0.0.1:9001", &["m"], BLOCK_SIZE as u32);
    huge.dp_ranks = (0..1_000_000).collect();
    let status = GrpcWorker::connect(&router.grpc, None, huge)
        .await
        .err()
        .expect("refused");
    assert_eq!(status.code(), tonic::Code::InvalidArgument);
    assert!(status.message().contains("limits.max_dp_ranks"), "{status}");
    assert_eq!(refusals(&router, "dp_ranks").await, 1.0);
    let mut long_name = register(1, "http://127.0.0.1:9001", &["m"], BLOCK_SIZE as u32);
    long_name.lora_names = vec!["x".repeat(100_000)];
    let status = GrpcWorker::connect(&router.grpc, None, long_name)
        .await
        .err()
        .expect("refused");
    assert!(
        status.message().contains("limits.max_name_bytes"),
        "{status}"
    );

    let _one = connect(&router, 1).await.unwrap();
    let two = connect(&router, 2).await.unwrap();
    let status = connect(&router, 3).await.err().expect("refused");
    assert_eq!(status.code(), tonic::Code::ResourceExhausted, "{status}");
    assert!(status.message().contains("limits.max_streams"), "{status}");
    assert_eq!(refusals(&router, "streams").await, 1.0);

    // Worker 2's stream closes: in its grace period it keeps its slot only
    // while nobody needs it, so a third worker id takes it, purging it early.
    drop(two);
    let http = Http::default();
    eventually("worker 2 to be disconnected", || async {
        let info = http.get(&format!("{}/workers/2", router.http)).await.json();
        info["worker"]["state"] == "disconnected"
    })
    .await;
    connect(&router, 3).await.expect("worker 3 registers");
    let gone = http.get(&format!("{}/workers/2", router.http)).await;
    assert_eq!(gone.status, 404, "{}", gone.text());
    assert_eq!(refusals(&router, "workers").await, 0.0);
}

#[tokio::test]
async fn a_stream_that_never_registers_is_closed_at_the_deadline_and_frees_its_slot() {
    let router =
        RouterProcess::start("[ingest]\nregister_timeout_ms = 300\n[limits]\nmax_streams = 1\n");
    // A stream opened, kept open, and never sent anything on.
    let channel = tonic::transport::Endpoint::from_shared(router.grpc.clone())
        .unwrap()
        .connect()
        .await
        .unwrap();
    let (_silent, messages) = tokio::sync::mpsc::channel::<kvroute_proto::WorkerMessage>(1);
    let mut client = kvroute_proto::kv_router_client::KvRouterClient::new(channel);
    let opened = client.stream(tokio_stream::wrappers::ReceiverStream::new(messages));
    let status = tokio::time::timeout(std::time::Duration::from_secs(30), opened)
        .await
        .expect("the router answers a silent stream (without a deadline it never does)")
        .expect_err("refused");
    assert_eq!(status.code(), tonic::Code::DeadlineExceeded, "{status}");
    assert!(
        status.message().contains("ingest.register_timeout_ms"),
        "{status}"
    );
    assert_eq!(refusals(&router, "register_timeout").await, 1.0);
    // Its slot of the one allowed is free again.
    connect(&router, 1).await.expect("a worker registers");
}

#[tokio::test]
async fn oversized_batches_and_messages_end_the_stream_with_a_status() {
    let router = RouterProcess::start(
        "[limits]\nmax_events_per_batch = 4\nmax_grpc_message_bytes = 65536\n",
    );
    let mut worker = connect(&router, 1).await.unwrap();
    let kept = worker.store(&tokens(0, 64)).await;
    let events = (1..=5)
        .map(|i| KvEvent {
            tier: Default::default(),
            event_id: 100 + i,
            kind: Some(kv_event::Kind::Cleared(kvroute_proto::Cleared {})),
        })
        .collect();
    worker
        .send(worker_message::Body::Events(EventBatch {
            dp_rank: 0,
            events,
        }))
        .await;
    let status = end_of(&mut worker).await;
    assert_eq!(status.code(), tonic::Code::InvalidArgument, "{status}");
    assert!(
        status.message().contains("limits.max_events_per_batch"),
        "{status}"
    );
    assert_eq!(refusals(&router, "events_per_batch").await, 1.0);
    // Nothing the worker had indexed was lost by the refusal.
    let info = Http::default()
        .get(&format!("{}/workers/1", router.http))
        .await
        .json();
    assert_eq!(info["index"][0]["indexed_blocks"], kept.len(), "{info}");

    let mut worker = connect(&router, 2).await.unwrap();
    let (big, _) = worker.chain(&tokens(1_000_000, BLOCK_SIZE * 10_000));
    worker.event(None, kv_event::Kind::Stored(big)).await;
    let status = end_of(&mut worker).await;
    assert_eq!(status.code(), tonic::Code::OutOfRange, "{status}");
    eventually("the oversized message to be counted", || async {
        refusals(&router, "grpc_message_bytes").await == 1.0
    })
    .await;
}

#[tokio::test]
async fn requests_beyond_the_inflight_limit_get_503_with_retry_after() {
    let router = RouterProcess::start(
        "[limits]\nmax_inflight_requests = 2\nmax_predicted_blocks_per_request = 2\n",
    );
    let worker = TestWorker::start(1).await;
    let _stream = GrpcWorker::connect(
        &router.grpc,
        None,
        register(1, &worker.url, &["m"], BLOCK_SIZE as u32),
    )
    .await
    .unwrap();
    worker.set_mode(Mode::Hold);
    let http = Http::default();
    let url = format!("{}/v1/completions", router.http);
    let held: Vec<_> = (0..2)
        .map(|i| {
            let (http, url) = (http.clone(), url.clone());
            tokio::spawn(async move {
                http.post(&url, &completion("m", &tokens(i * 1000, 64)))
                    .await
                    .status
            })
        })
        .collect();
    eventually("both requests to reach the worker", || async {
        worker.inflight() == 2
    })
    .await;
    let third = completion("m", &tokens(5000, 64));
    let refused = tokio::time::timeout(DEADLINE, http.post(&url, &third))
        .await
        .expect("refused at once, not held");
    refused.assert_error(503, "overloaded");
    assert_eq!(refused.headers["retry-after"], "1");
    assert!(refused.text().contains("limits.max_inflight_requests"));
    assert_eq!(refusals(&router, "inflight_requests").await, 1.0);
    // Health and metrics stay reachable for the operator meanwhile.
    assert_eq!(
        http.get(&format!("{}/healthz", router.http)).await.status,
        200
    );
    worker.release();
    for task in held {
        assert_eq!(task.await.unwrap(), 200);
    }
    let reply = http.post(&url, &completion("m", &tokens(5000, 64))).await;
    assert_eq!(reply.status, 200, "{}", reply.text());
    // Each 4-block prompt recorded only its first 2 blocks as predicted.
    assert_eq!(refusals(&router, "predicted_blocks").await, 3.0);
}

fn chain(parent: Option<u64>, hashes: std::ops::Range<u64>, tokens: &[u32]) -> Stored {
    let locals = kvroute_index::BlockHasher::new(BLOCK_SIZE).local_hashes(tokens);
    Stored {
        parent_hash: parent,
        blocks: hashes
            .zip(locals)
            .map(|(block_hash, tokens_hash)| StoredBlock {
                block_hash,
                tokens_hash,
            })
            .collect(),
    }
}

#[tokio::test]
async fn dumps_apply_whole_late_older_ones_are_refused_and_orphans_counted() {
    let router = RouterProcess::start("");
    let mut worker = connect(&router, 1).await.unwrap();
    let (a, b, c) = (tokens(0, 64), tokens(10_000, 64), tokens(20_000, 64));
    send_dump(&worker, 10, vec![chain(None, 1..5, &a)], false).await;
    worker.wait_ack(10).await;
    assert_eq!(event_overlap(&router, &a, 1).await, 4);

    // A dump in two parts: nothing of it shows until the last part is in.
    send_dump(&worker, 12, vec![chain(None, 11..15, &b)], true).await;
    let removed = kv_event::Kind::Removed(kvroute_proto::Removed {
        block_hashes: vec![4],
    });
    worker.event(Some(11), removed).await;
    worker.wait_ack(11).await;
    assert_eq!(event_overlap(&router, &a, 1).await, 3);
    assert_eq!(event_overlap(&router, &b, 1).await, 0);
    send_dump(&worker, 12, vec![chain(None, 21..25, &c)], false).await;
    worker.wait_ack(12).await;
    assert_eq!(event_overlap(&router, &a, 1).await, 0);
    assert_eq!(event_overlap(&router, &b, 1).await, 4);
    assert_eq!(event_overlap(&router, &c, 1).await, 4);

    // The answer to an older resync, arriving late, would roll the rank back.
    send_dump(&worker, 5, vec![chain(None, 1..5, &a)], false).await;
    let error = loop {
        if let kvroute_proto::router_message::Body::Error(e) = worker.next().await {
            break e.message;
        }
    };
    assert!(error.contains("refused"), "{error}");
    assert_eq!(event_overlap(&router, &a, 1).await, 0);
    assert_eq!(event_overlap(&router, &b, 1).await, 4);
    assert_eq!(
        metric(&metrics(&router).await, "kvroute_stale_dumps_total", &[]),
        1.0
    );

    // Blocks under a parent the dump does not hold cannot be placed: counted.
    let orphan = chain(Some(999), 31..34, &tokens(30_000, 48));
    send_dump(&worker, 13, vec![chain(None, 1..5, &a), orphan], false).await;
    worker.wait_ack(13).await;
    assert_eq!(event_overlap(&router, &a, 1).await, 4);
    assert_eq!(
        metric(
            &metrics(&router).await,
            "kvroute_dump_orphan_blocks_total",
            &[]
        ),
        3.0
    );
}

#[tokio::test]
async fn a_fleet_reporting_more_than_the_cap_stays_within_it_and_keeps_hot_prefixes() {
    const CAP: u64 = 200;
    let router = RouterProcess::start(&format!("[index]\nmax_blocks = {CAP}\n"));
    let mut workers = [
        connect(&router, 1).await.unwrap(),
        connect(&router, 2).await.unwrap(),
    ];
    // Each worker owns one hot 8-block prefix, asked for all along.
    let hot = [tokens(0, 128), tokens(100_000, 128)];
    for (worker, prefix) in workers.iter_mut().zip(&hot) {
        worker.store(prefix).await;
    }
    let mut stored = 16;
    for round in 0..30u32 {
        for (w, worker) in workers.iter_mut().enumerate() {
            let cold = tokens(1_000_000 + (round * 2 + w as u32) * 1000, 128);
            worker.store(&cold).await;
            stored += 8;
        }
        for (w, prefix) in hot.iter().enumerate() {
            let route = dry_run(&router, prefix).await;
            assert_eq!(route["worker_id"], w + 1, "round {round}: {route}");
            assert_eq!(route["overlap_blocks"], 8, "round {round}: {route}");
        }
    }
    assert!(stored > 2 * CAP);
    let text = metrics(&router).await;
    let held = metric(&text, "kvroute_index_memberships", &[]);
    assert!(held <= CAP as f64, "{held} entries held, cap {CAP}");
    let evicted = metric(&text, "kvroute_index_evicted_blocks_total", &[]);
    assert_eq!(evicted as u64, stored - held as u64);
}

fn signal(process: &Process, name: &str) {
    let status = Command::new("kill")
        .arg(format!("-{name}"))
        .arg(process.child.id().to_string())
        .status()
        .unwrap();
    assert!(status.success());
}

#[tokio::test]
async fn a_frozen_worker_leaves_routing_within_the_keepalive_and_resyncs_when_it_thaws() {
    let router =
        RouterProcess::start("[ingest]\nkeepalive_interval_ms = 300\nkeepalive_timeout_ms = 300\n");
    let sim = SimFleet::start(Some(&router.grpc), 1);
    let (id, url) = sim.workers[0].clone();
    let http = Http::default();
    let worker_url = format!("{}/workers/{id}", router.http);
    let state = || async { http.get(&worker_url).await.json()["worker"]["state"].clone() };
    eventually("the worker to register", || async {
        state().await == "connected"
    })
    .await;
    let body = json!({"model": "sim-model", "prompt": tokens(0, 64), "max_tokens": 2});
    let completions = format!("{}/v1/completions", router.http);
    assert_eq!(http.post(&completions, &body).await.status, 200);
    let indexed = || async {
        let info = http.get(&worker_url).await.json();
        (
            info["index"][0]["indexed_blocks"].as_u64().unwrap_or(0),
            info["index"][0]["last_event_id"].as_u64().unwrap_or(0),
        )
    };
    eventually("4 blocks indexed", || async { indexed().await.0 == 4 }).await;

    // Frozen: its TCP connection stays open, but it answers no ping.
    signal(&sim.process, "STOP");
    let frozen = Instant::now();
    eventually("the frozen worker to leave routing", || async {
        state().await == "disconnected"
    })
    .await;
    // 600 ms configured; the margin is for a loaded machine.
    assert!(frozen.elapsed().as_secs() < 10, "{:?}", frozen.elapsed());
    http.post(&completions, &body)
        .await
        .assert_error(503, "no_worker_available");

    signal(&sim.process, "CONT");
    eventually("the worker to reconnect", || async {
        state().await == "connected"
    })
    .await;
    // It resends its whole cache on reconnecting (a second dump after the one
    // it registered with), and the index is its cache again.
    let dumps = || async {
        metric(
            &metrics(&router).await,
            "kvroute_dumps_applied_total",
            &[("worker", &id.to_string())],
        )
    };
    eventually("the reconnect's dump", || async { dumps().await >= 2.0 }).await;
    let sim_metrics = http.get(&format!("{url}/metrics")).await.text();
    let last_id = metric(&sim_metrics, "kvroute_sim_last_event_id", &[]) as u64;
    let cached = metric(&sim_metrics, "kvroute_sim_kv_blocks_cached", &[]) as u64;
    assert_eq!(indexed().await, (cached, last_id));
    assert_eq!(http.post(&completions, &body).await.status, 200);
}

#[tokio::test]
async fn a_request_in_flight_keeps_its_path_indexed_past_the_cap() {
    let router = RouterProcess::start("[index]\nmax_blocks = 40\n");
    let http_worker = TestWorker::start(1).await;
    let mut owner = GrpcWorker::connect(
        &router.grpc,
        None,
        register(1, &http_worker.url, &["m"], BLOCK_SIZE as u32),
    )
    .await
    .unwrap();
    let mut other = connect(&router, 2).await.unwrap();
    let prompt = tokens(0, 128);
    owner.store(&prompt).await;
    let indexed = |id: u64| {
        let url = format!("{}/workers/{id}", router.http);
        async move {
            Http::default().get(&url).await.json()["index"][0]["indexed_blocks"]
                .as_u64()
                .unwrap()
        }
    };
    http_worker.set_mode(Mode::Hold);
    let url = format!("{}/v1/completions", router.http);
    let body = completion("m", &prompt);
    let held = tokio::spawn(async move { Http::default().post(&url, &body).await.status });
    eventually("the request to reach its worker", || async {
        http_worker.inflight() == 1
    })
    .await;
    // The owner goes over its share of the cap (20 of 40) with 24 newer
    // blocks, so its oldest, the held request's 8, would go first.
    owner.store(&tokens(50_000, 24 * BLOCK_SIZE)).await;
    // Twice the cap of newer blocks: the held request's 8 stay.
    for i in 0..10 {
        other.store(&tokens(100_000 + i * 1000, 128)).await;
    }
    assert_eq!(indexed(1).await, 20);
    assert!(indexed(2).await <= 20);
    assert_eq!(event_overlap(&router, &prompt, 1).await, 8);
    http_worker.release();
    assert_eq!(held.await.unwrap(), 200);
    // Unpinned, they go once the owner is over its share again: before
    // the 24 newer ones, after the rest of the older chain.
    owner.store(&tokens(200_000, 24 * BLOCK_SIZE)).await;
    assert_eq!(indexed(1).await, 20);
    assert_eq!(event_overlap(&router, &prompt, 1).await, 0);
}
