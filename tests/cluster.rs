//! Router replicas on NATS JetStream, end to end: a real nats-server
//! (tests/nats/install.sh), three `kvroute serve` replicas and workers over
//! loopback.

mod common;

use common::*;
use serde_json::{Value, json};

/// Three replicas of one cluster, ready (caught up with the log).
async fn replicas(nats: &NatsServer) -> Vec<RouterProcess> {
    let routers: Vec<_> = (0..3)
        .map(|i| RouterProcess::start(&nats.cluster_config(&format!("r{i}"))))
        .collect();
    routers
}

/// `(indexed_blocks, last_event_id)` of worker `id`'s rank 0 on `router`.
async fn indexed(router: &RouterProcess, id: u64) -> (u64, u64) {
    let info = Http::default()
        .get(&format!("{}/workers/{id}", router.http))
        .await
        .json();
    (
        info["index"][0]["indexed_blocks"].as_u64().unwrap_or(0),
        info["index"][0]["last_event_id"].as_u64().unwrap_or(0),
    )
}

async fn metrics(router: &RouterProcess) -> String {
    Http::default()
        .get(&format!("{}/metrics", router.http))
        .await
        .text()
}

/// Worker → overlap blocks in `router`'s dry run of `prompt` (costs differ per
/// replica with their own requests in flight; overlaps must not).
async fn overlaps(router: &RouterProcess, prompt: &[u32]) -> Vec<(u64, u64)> {
    let answer = Http::default()
        .post(
            &format!("{}/v1/route", router.http),
            &json!({"model": "sim-model", "prompt": prompt}),
        )
        .await
        .json();
    let mut overlaps: Vec<(u64, u64)> = answer["scores"]
        .as_array()
        .unwrap_or_else(|| panic!("no scores in {answer}"))
        .iter()
        .map(|s: &Value| {
            (
                s["worker_id"].as_u64().unwrap(),
                s["overlap_blocks"].as_u64().unwrap(),
            )
        })
        .collect();
    overlaps.sort_unstable();
    overlaps
}

#[tokio::test]
async fn every_replica_routes_with_the_same_overlaps_as_the_fleet_caches() {
    let nats = NatsServer::start();
    let routers = replicas(&nats).await;
    // Every worker streams to the first replica only.
    let sim = SimFleet::start(Some(&routers[0].grpc), 3);
    for router in &routers {
        wait_registered(router, 3).await;
    }
    // Requests through every replica fill the workers' caches.
    let http = Http::default();
    let prompts: Vec<Vec<u32>> = (0..6).map(|i| tokens(i * 10_000, 96)).collect();
    for (i, prompt) in prompts.iter().enumerate() {
        let router = &routers[i % 3];
        let url = format!("{}/v1/completions", router.http);
        let reply = http.post(&url, &completion("sim-model", prompt)).await;
        assert_eq!(reply.status, 200, "{}", reply.text());
    }
    // Each replica's index is each worker's cache, as the worker tells it.
    for (id, url) in &sim.workers {
        let sim_metrics = http.get(&format!("{url}/metrics")).await.text();
        let last_id = metric(&sim_metrics, "kvroute_sim_last_event_id", &[]) as u64;
        let cached = metric(&sim_metrics, "kvroute_sim_kv_blocks_cached", &[]) as u64;
        for router in &routers {
            eventually("every replica to index the worker's cache", || async {
                indexed(router, *id).await == (cached, last_id)
            })
            .await;
        }
    }
    for prompt in &prompts {
        let first = overlaps(&routers[0], prompt).await;
        assert!(first.iter().any(|&(_, o)| o > 0), "{first:?}");
        for router in &routers[1..] {
            assert_eq!(overlaps(router, prompt).await, first);
        }
    }
}

#[tokio::test]
async fn a_worker_moved_to_another_replica_loses_nothing_and_applies_nothing_twice() {
    let nats = NatsServer::start();
    let mut routers = replicas(&nats).await;
    let http_worker = TestWorker::start(7).await;
    let register = || register(7, &http_worker.url, &["m"], BLOCK_SIZE as u32);
    let mut worker = GrpcWorker::connect(&routers[0].grpc, None, register())
        .await
        .unwrap();
    // Acked: stored by JetStream and applied by the holder.
    for i in 0..3 {
        worker.store(&tokens(i * 1_000, 64)).await;
    }
    let first = worker.store(&tokens(5_000, 64)).await;
    worker.remove(first[2..].to_vec()).await;
    // 5 events (ids 0 to 4), 4 × 4 blocks stored, 2 removed.
    for router in &routers {
        eventually("every replica to apply the 5 events", || async {
            indexed(router, 7).await == (14, 4)
        })
        .await;
    }

    // The holder dies; the worker reconnects to another replica and, not
    // knowing what survived, sends everything again, then goes on.
    routers.remove(0);
    worker
        .reconnect(&routers[0].grpc, None, register())
        .await
        .unwrap();
    let everything = kvroute_proto::ResyncRequest {
        dp_rank: 0,
        from_event_id: 0,
    };
    worker.answer_resync(&everything).await;
    worker.store(&tokens(9_000, 64)).await;
    for router in &routers {
        eventually("both replicas to apply the 6th event", || async {
            indexed(router, 7).await == (18, 5)
        })
        .await;
        let text = metrics(router).await;
        let applied = metric(
            &text,
            "kvroute_events_total",
            &[("worker", "7"), ("status", "applied")],
        );
        assert_eq!(applied, 6.0, "each event applied once:\n{text}");
    }

    // A replica started now replays the log to the same state before it is ready.
    let late = RouterProcess::start(&nats.cluster_config("late"));
    let http = Http::default();
    eventually("the late replica to be ready", || async {
        http.get(&format!("{}/readyz", late.http)).await.status == 200
    })
    .await;
    assert_eq!(indexed(&late, 7).await, (18, 5));
    let applied = metric(
        &metrics(&late).await,
        "kvroute_events_total",
        &[("worker", "7"), ("status", "applied")],
    );
    assert_eq!(applied, 6.0);
}

/// The state of worker `id` on `router` ("connected", "disconnected"), or null.
async fn worker_state(router: &RouterProcess, id: u64) -> Value {
    Http::default()
        .get(&format!("{}/workers/{id}", router.http))
        .await
        .json()["worker"]["state"]
        .clone()
}

#[tokio::test]
async fn a_dead_replicas_workers_leave_routing_everywhere_when_their_registrations_expire() {
    let nats = NatsServer::start();
    let mut routers = replicas(&nats).await;
    let http_worker = TestWorker::start(7).await;
    let mut worker = GrpcWorker::connect(
        &routers[0].grpc,
        None,
        register(7, &http_worker.url, &["m"], BLOCK_SIZE as u32),
    )
    .await
    .unwrap();
    worker.store(&tokens(0, 64)).await;
    for router in &routers {
        eventually("every replica to route to the worker", || async {
            worker_state(router, 7).await == "connected"
        })
        .await;
    }
    // Its replica dies (SIGKILL); the worker does not come back.
    routers.remove(0);
    for router in &routers {
        eventually("the registration to expire on every replica", || async {
            worker_state(router, 7).await == "disconnected"
        })
        .await;
        let reply = Http::default()
            .post(
                &format!("{}/v1/route", router.http),
                &json!({"model": "m", "prompt": tokens(0, 64)}),
            )
            .await;
        assert_eq!(reply.status, 503, "{}", reply.text());
    }
}

#[tokio::test]
async fn with_nats_away_ingest_goes_on_and_every_replica_catches_up_when_it_returns() {
    let mut nats = NatsServer::start();
    let routers: Vec<_> = (0..2)
        .map(|i| RouterProcess::start(&nats.cluster_config(&format!("r{i}"))))
        .collect();
    let http_worker = TestWorker::start(7).await;
    let mut worker = GrpcWorker::connect(
        &routers[0].grpc,
        None,
        register(7, &http_worker.url, &["m"], BLOCK_SIZE as u32),
    )
    .await
    .unwrap();
    worker.store(&tokens(0, 64)).await;
    worker.store(&tokens(1_000, 64)).await;
    for router in &routers {
        eventually("both replicas to apply events 0 and 1", || async {
            indexed(router, 7).await == (8, 1)
        })
        .await;
        let text = metrics(router).await;
        assert_eq!(metric(&text, "kvroute_cluster_connected", &[]), 1.0);
        assert_eq!(metric(&text, "kvroute_cluster_caught_up", &[]), 1.0);
    }

    nats.kill();
    for router in &routers {
        eventually("the replicas to notice", || async {
            metric(&metrics(router).await, "kvroute_cluster_connected", &[]) == 0.0
        })
        .await;
    }
    // Applied (and acked) by the worker's replica at once; the other routes on
    // what it has, and both stay ready.
    worker.store(&tokens(2_000, 64)).await;
    assert_eq!(indexed(&routers[0], 7).await, (12, 2));
    assert_eq!(indexed(&routers[1], 7).await, (8, 1));
    let http = Http::default();
    for router in &routers {
        let ready = http.get(&format!("{}/readyz", router.http)).await;
        assert_eq!(ready.status, 200);
        assert_eq!(ready.json()["cluster"]["event_log"], "disconnected");
        let reply = http
            .post(
                &format!("{}/v1/route", router.http),
                &json!({"model": "m", "prompt": tokens(0, 64)}),
            )
            .await;
        assert_eq!(reply.status, 200, "{}", reply.text());
    }

    // Back: the worker is asked for what only its replica applied, and every
    // replica applies it, once.
    nats.restart();
    let request = worker.wait_resync().await;
    assert_eq!((request.dp_rank, request.from_event_id), (0, 2));
    worker.answer_resync(&request).await;
    for router in &routers {
        eventually("every replica to catch up", || async {
            indexed(router, 7).await == (12, 2)
        })
        .await;
        let text = metrics(router).await;
        assert_eq!(metric(&text, "kvroute_cluster_connected", &[]), 1.0);
        let applied = metric(
            &text,
            "kvroute_events_total",
            &[("worker", "7"), ("status", "applied")],
        );
        assert_eq!(applied, 3.0, "each event applied once:\n{text}");
    }
}

/// A replica's bookings are dropped on the others this long after it was last
/// heard from (the tests' `load_expiry_ms`).
const LOAD_EXPIRY: std::time::Duration = std::time::Duration::from_millis(1_500);

/// The `[cluster]` section of replica `id`, sharing load with short periods.
fn sharing_config(nats: &NatsServer, id: &str) -> String {
    format!(
        "{}load_full_state_ms = 200\nload_expiry_ms = {}\n",
        nats.cluster_config(id),
        LOAD_EXPIRY.as_millis()
    )
}

/// (requests in flight, active blocks) of worker `id`'s rank 0 as `router` scores it.
async fn load(router: &RouterProcess, id: u64) -> (u64, u64) {
    let info = Http::default()
        .get(&format!("{}/workers/{id}", router.http))
        .await
        .json();
    let rank = &info["worker"]["ranks"][0];
    (
        rank["inflight_requests"].as_u64().unwrap_or(0),
        rank["active_blocks"].as_u64().unwrap_or(0),
    )
}

#[tokio::test]
async fn bookings_on_one_replica_count_on_the_others_and_vanish_when_it_is_killed() {
    let nats = NatsServer::start();
    let mut routers: Vec<_> = (0..2)
        .map(|i| RouterProcess::start(&sharing_config(&nats, &format!("r{i}"))))
        .collect();
    // The worker streams to replica 1, which outlives replica 0.
    let http_worker = TestWorker::start(7).await;
    http_worker.set_mode(Mode::Hold);
    let _worker = GrpcWorker::connect(
        &routers[1].grpc,
        None,
        register(7, &http_worker.url, &["m"], BLOCK_SIZE as u32),
    )
    .await
    .unwrap();
    for router in &routers {
        eventually("both replicas to route to the worker", || async {
            worker_state(router, 7).await == "connected"
        })
        .await;
    }

    // A request through replica 0 is held by the worker: booked on replica 0
    // (one request, 4 blocks of 16 tokens), and so on replica 1.
    let url = format!("{}/v1/completions", routers[0].http);
    let held = tokio::spawn(async move {
        Http::default()
            .post(&url, &completion("m", &tokens(0, 64)))
            .await
    });
    eventually("the worker to hold the request", || async {
        http_worker.inflight() == 1
    })
    .await;
    assert_eq!(load(&routers[0], 7).await, (1, 4));
    eventually("replica 1 to count replica 0's booking", || async {
        load(&routers[1], 7).await == (1, 4)
    })
    .await;
    // Replica 0's full states keep its booking alive past the expiry.
    tokio::time::sleep(LOAD_EXPIRY + std::time::Duration::from_millis(500)).await;
    assert_eq!(load(&routers[1], 7).await, (1, 4));

    // Replica 0 dies (SIGKILL) with its booking: gone on replica 1 within the
    // expiry (plus one sweep of a quarter of it, and slack for a busy machine).
    routers.remove(0);
    let killed = std::time::Instant::now();
    let bound = LOAD_EXPIRY * 2 + std::time::Duration::from_secs(1);
    while load(&routers[0], 7).await != (0, 0) {
        assert!(
            killed.elapsed() < bound,
            "replica 0's booking still counted {:?} after it was killed",
            killed.elapsed()
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    http_worker.release();
    let _ = held.await;
}

#[tokio::test]
async fn sibling_requests_at_different_replicas_land_on_the_same_worker() {
    let nats = NatsServer::start();
    let routers: Vec<_> = (0..3)
        .map(|i| RouterProcess::start(&sharing_config(&nats, &format!("r{i}"))))
        .collect();
    // Four idle workers that publish no events: only predictions tell where a
    // prompt went.
    let mut fleet = Vec::new();
    for id in 1..=4 {
        let http_worker = TestWorker::start(id).await;
        let stream = GrpcWorker::connect(
            &routers[(id % 3) as usize].grpc,
            None,
            register(id, &http_worker.url, &["m"], BLOCK_SIZE as u32),
        )
        .await
        .unwrap();
        fleet.push((http_worker, stream));
    }
    for router in &routers {
        wait_registered(router, 4).await;
    }
    let http = Http::default();
    for i in 0..4 {
        let prompt = tokens(i * 1_000, 64);
        let first = http
            .post(
                &format!("{}/v1/completions", routers[0].http),
                &completion("m", &prompt),
            )
            .await;
        assert_eq!(first.status, 200, "{}", first.text());
        let worker = first.worker();
        for router in &routers[1..] {
            // The first request's prediction reaches the other replicas...
            eventually(
                "the other replicas to predict the first one's worker",
                || async {
                    let answer = http
                        .post(
                            &format!("{}/v1/route", router.http),
                            &json!({"model": "m", "prompt": prompt}),
                        )
                        .await
                        .json();
                    answer["worker_id"] == worker && answer["overlap_blocks"] == 4
                },
            )
            .await;
            // ... and its siblings there land with it.
            let sibling = http
                .post(
                    &format!("{}/v1/completions", router.http),
                    &completion("m", &prompt),
                )
                .await;
            assert_eq!(sibling.status, 200, "{}", sibling.text());
            assert_eq!(sibling.worker(), worker, "prompt {i}");
        }
    }
}
