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
    scores(router, prompt, "overlap_blocks").await
}

/// The same, of the index alone: a replica's route-time predictions are its
/// own (not shared yet), a restarted one has none.
async fn event_overlaps(router: &RouterProcess, prompt: &[u32]) -> Vec<(u64, u64)> {
    scores(router, prompt, "event_overlap_blocks").await
}

/// Worker → `field` of its score in `router`'s dry run of `prompt`, for the
/// workers where it is not 0. Which unmatched workers a dry run costs at all
/// follows that replica's own load order (its requests in flight), so only
/// the matched ones are the same everywhere.
async fn scores(router: &RouterProcess, prompt: &[u32], field: &str) -> Vec<(u64, u64)> {
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
        .map(|s: &Value| (s["worker_id"].as_u64().unwrap(), s[field].as_u64().unwrap()))
        .filter(|&(_, blocks)| blocks > 0)
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
    every_replica_indexes_every_cache(&routers, &sim).await;
    for prompt in &prompts {
        let first = overlaps(&routers[0], prompt).await;
        assert!(!first.is_empty(), "the prompt overlaps no cache");
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

/// The `[cluster]` section of replica `replica_id`, with snapshots every second.
fn snapshotting(nats: &NatsServer, replica_id: &str, extra: &str) -> String {
    format!(
        "{}snapshot_interval_s = 1\n{extra}",
        nats.cluster_config(replica_id)
    )
}

/// Stores the full blocks of `tokens` below the engine block `parent`, and
/// waits for the ack; returns their engine hashes.
async fn store_below(worker: &mut GrpcWorker, parent: Option<u64>, tokens: &[u32]) -> Vec<u64> {
    let (mut stored, hashes) = worker.chain(tokens);
    stored.parent_hash = parent;
    let id = worker
        .event(None, kvroute_proto::kv_event::Kind::Stored(stored))
        .await;
    worker.wait_ack(id).await;
    hashes
}

/// (first, last) sequence the event stream holds.
async fn stream_bounds(nats: &NatsServer) -> (u64, u64) {
    let client = async_nats::connect(&nats.url).await.unwrap();
    let js = async_nats::jetstream::new(client);
    let mut stream = js
        .get_stream(kvroute_cluster::record::STREAM)
        .await
        .unwrap();
    let state = &stream.info().await.unwrap().state;
    (state.first_sequence, state.last_sequence)
}

#[tokio::test]
async fn a_replica_started_after_the_stream_forgot_its_head_converges_from_a_snapshot() {
    let nats = NatsServer::start();
    let config = |id: &str| snapshotting(&nats, id, "stream_max_age_s = 3\n");
    let first = RouterProcess::start(&config("r0"));
    let http_worker = TestWorker::start(7).await;
    let mut worker = GrpcWorker::connect(
        &first.grpc,
        None,
        register(7, &http_worker.url, &["sim-model"], BLOCK_SIZE as u32),
    )
    .await
    .unwrap();
    // One chain of 4 × 4 blocks, each store below the one before.
    let prompt = tokens(0, 512);
    let mut parent = None;
    for part in prompt[..256].chunks(64) {
        parent = store_below(&mut worker, parent, part).await.last().copied();
    }
    assert_eq!(indexed(&first, 7).await, (16, 3));
    let (_, head) = stream_bounds(&nats).await;
    // The stream forgets the claim and those events (older than 3 s);
    // snapshots written meanwhile cover them.
    eventually("the stream to forget its head", || async {
        stream_bounds(&nats).await.0 > head
    })
    .await;
    // The tail: blocks whose parent only a snapshot still knows, and more.
    store_below(&mut worker, parent, &prompt[256..320]).await;
    let other = store_below(&mut worker, None, &tokens(5_000, 64)).await;
    worker.remove(vec![other[3]]).await;
    assert_eq!(indexed(&first, 7).await, (23, 6));

    let late = RouterProcess::start(&config("late"));
    let http = Http::default();
    eventually("the late replica to be ready", || async {
        http.get(&format!("{}/readyz", late.http)).await.status == 200
    })
    .await;
    assert_eq!(indexed(&late, 7).await, (23, 6));
    assert_eq!(event_overlaps(&late, &prompt[..320]).await, vec![(7, 20)]);
    let text = metrics(&late).await;
    let loaded = &[("outcome", "loaded")];
    assert_eq!(
        metric(&text, "kvroute_cluster_snapshots_total", loaded),
        1.0
    );
    // It never saw the claim: the stream had forgotten it.
    let claims = &[("kind", "claim")];
    assert_eq!(
        metric(&text, "kvroute_cluster_records_applied_total", claims),
        0.0
    );
    assert_eq!(metric(&text, "kvroute_rejected_blocks_total", &[]), 0.0);
}

/// The first `n` requests of the conversation trace, each cut to its first
/// 1,024 tokens (64 blocks), so that the simulated caches keep several.
fn trace_prompts(n: usize) -> Vec<Vec<u32>> {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/data/traces/conversation_trace.jsonl"
    );
    kvroute_trace::read_trace(path.as_ref(), Some(n))
        .unwrap()
        .iter()
        .map(|r| kvroute_sim::trace::trace_tokens(&r.hash_ids, 1_024))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_killed_mid_replay_cold_starts_from_a_snapshot_and_agrees_with_the_others() {
    let nats = NatsServer::start();
    let config = |id: &str| snapshotting(&nats, id, "");
    let mut routers: Vec<RouterProcess> = (0..3)
        .map(|i| RouterProcess::start(&config(&format!("r{i}"))))
        .collect();
    let sim = SimFleet::start(Some(&routers[0].grpc), 3);
    for router in &routers {
        wait_registered(router, 3).await;
    }
    let prompts = trace_prompts(150);
    let http = Http::default();
    for (i, prompt) in prompts[..50].iter().enumerate() {
        let url = format!("{}/v1/completions", routers[i % 3].http);
        let reply = http.post(&url, &completion("sim-model", prompt)).await;
        assert_eq!(reply.status, 200, "{}", reply.text());
    }
    eventually("a snapshot to be written", || async {
        let text = metrics(&routers[2]).await;
        metric(&text, "kvroute_cluster_snapshot_age_seconds", &[]) > 0.0
    })
    .await;

    // The rest of the replay goes to the first two replicas, while the third
    // is killed and started again.
    let live: Vec<String> = routers[..2].iter().map(|r| r.http.clone()).collect();
    let sent = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let replay = tokio::spawn({
        let prompts = prompts[50..].to_vec();
        let sent = std::sync::Arc::clone(&sent);
        async move {
            let http = Http::default();
            let mut failed = Vec::new();
            for (i, prompt) in prompts.iter().enumerate() {
                let url = format!("{}/v1/completions", live[i % 2]);
                let reply = http.post(&url, &completion("sim-model", prompt)).await;
                if reply.status != 200 {
                    failed.push((i, reply.status, reply.text()));
                }
                sent.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            }
            failed
        }
    });
    let progress = |n: usize| {
        let sent = std::sync::Arc::clone(&sent);
        move || {
            let sent = std::sync::Arc::clone(&sent);
            async move { sent.load(std::sync::atomic::Ordering::Relaxed) >= n }
        }
    };
    eventually("the replay to go on", progress(20)).await;
    drop(routers.pop()); // SIGKILL
    eventually("the replay to go on without it", progress(50)).await;
    let config_r2 = config("r2");
    let restarted = tokio::task::spawn_blocking(move || RouterProcess::start(&config_r2))
        .await
        .unwrap();
    eventually("the restarted replica to be ready", || async {
        http.get(&format!("{}/readyz", restarted.http)).await.status == 200
    })
    .await;
    let text = metrics(&restarted).await;
    let loaded = &[("outcome", "loaded")];
    assert_eq!(
        metric(&text, "kvroute_cluster_snapshots_total", loaded),
        1.0
    );
    let failed = replay.await.unwrap();
    assert!(
        failed.is_empty(),
        "requests to live replicas failed: {failed:?}"
    );
    routers.push(restarted);

    // Every replica's index is every worker's cache ...
    every_replica_indexes_every_cache(&routers, &sim).await;
    // ... and they route with the same overlaps.
    let mut matched = 0;
    for prompt in prompts.iter().step_by(10) {
        let first = event_overlaps(&routers[0], prompt).await;
        matched += first.len();
        for router in &routers[1..] {
            assert_eq!(event_overlaps(router, prompt).await, first);
        }
    }
    assert!(matched > 0, "no prompt overlaps any cache");
}

/// Benchmark, not in CI (`#[ignore]`): a replica joining a fleet with 1M
/// indexed blocks (8 workers × 131,072, in chains of 64) is ready in ≤ 5 s.
/// Prints the time from the process's start to `/readyz` 200 and the
/// snapshot's size. Run in release:
/// `cargo test --release --test cluster -- --ignored --nocapture a_replica_joining`
/// (`KVROUTE_BENCH_BLOCKS` sets another total).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore]
async fn a_replica_joining_a_fleet_of_a_million_blocks_is_ready_within_5_s() {
    use futures_util::StreamExt;
    use kvroute_proto::{Stored, StoredBlock};

    let total: u64 = std::env::var("KVROUTE_BENCH_BLOCKS")
        .ok()
        .and_then(|b| b.parse().ok())
        .unwrap_or(1 << 20);
    let (workers, chain) = (8u64, 64u64);
    let nats = NatsServer::start();
    let config = |id: &str| {
        format!(
            "{}snapshot_interval_s = 10\n[index]\nmax_blocks = {}\n",
            nats.cluster_config(id),
            2 * total
        )
    };
    let fleet = RouterProcess::start(&config("fleet"));
    let http_worker = TestWorker::start(1).await;
    let mut streams = Vec::new();
    for id in 0..workers {
        let mut register = register(id, &http_worker.url, &["sim-model"], BLOCK_SIZE as u32);
        register.total_kv_blocks = total / workers;
        let worker = GrpcWorker::connect(&fleet.grpc, None, register)
            .await
            .unwrap();
        // Distinct chains: every block is its own in the index.
        let chains = (0..total / workers / chain)
            .map(|c| Stored {
                parent_hash: None,
                blocks: (0..chain)
                    .map(|b| {
                        let n = (id << 40) | (c << 16) | b;
                        StoredBlock {
                            block_hash: n,
                            tokens_hash: n.wrapping_mul(0x9E37_79B9_7F4A_7C15),
                        }
                    })
                    .collect(),
            })
            .collect();
        send_dump(&worker, 0, chains, false).await;
        streams.push(worker);
    }
    for worker in &mut streams {
        worker.wait_ack(0).await;
    }
    let http = Http::default();
    let indexed_blocks = |text: &str| metric(text, "kvroute_index_memberships", &[]) as u64;
    assert_eq!(indexed_blocks(&metrics(&fleet).await), total);

    // A snapshot covering the whole stream.
    let client = async_nats::connect(&nats.url).await.unwrap();
    let js = async_nats::jetstream::new(client);
    let (_, last) = stream_bounds(&nats).await;
    let waiting = std::time::Instant::now();
    let size = loop {
        if let Ok(store) = js.get_object_store(kvroute_cluster::snapshot::BUCKET).await {
            let mut list = store.list().await.unwrap();
            let mut covering = None;
            while let Some(Ok(info)) = list.next().await {
                let seq: u64 = info
                    .metadata
                    .get("seq")
                    .and_then(|s| s.parse().ok())
                    .unwrap_or(0);
                if seq >= last {
                    covering = Some(info.size);
                }
            }
            if let Some(size) = covering {
                break size;
            }
        }
        assert!(
            waiting.elapsed() < DEADLINE,
            "no snapshot of the whole stream"
        );
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    };

    let started = std::time::Instant::now();
    let joining = config("joining");
    let joiner = tokio::task::spawn_blocking(move || RouterProcess::start(&joining))
        .await
        .unwrap();
    let readyz = format!("{}/readyz", joiner.http);
    while http.get(&readyz).await.status != 200 {
        assert!(
            started.elapsed() < DEADLINE,
            "the joining replica never got ready"
        );
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
    let ready = started.elapsed();
    let text = metrics(&joiner).await;
    assert_eq!(
        metric(
            &text,
            "kvroute_cluster_snapshots_total",
            &[("outcome", "loaded")]
        ),
        1.0
    );
    assert_eq!(indexed_blocks(&text), total);
    println!(
        "cold start: {total} blocks ({workers} workers), snapshot {:.1} MB ({:.1} B/block) at stream sequence {last}; ready {} ms after the process started (goal ≤ 5000 ms)",
        size as f64 / 1e6,
        size as f64 / total as f64,
        ready.as_millis()
    );
}

/// The sum over `routers` of `name{labels}`.
async fn total(routers: &[RouterProcess], name: &str, labels: Labels<'_>) -> f64 {
    let mut sum = 0.0;
    for router in routers {
        sum += metric(&metrics(router).await, name, labels);
    }
    sum
}

async fn dumps_applied(router: &RouterProcess, id: u64) -> f64 {
    let label = id.to_string();
    metric(
        &metrics(router).await,
        "kvroute_dumps_applied_total",
        &[("worker", &label)],
    )
}

/// Waits until each of `routers` indexes each of `sim`'s workers' caches.
async fn every_replica_indexes_every_cache(routers: &[RouterProcess], sim: &SimFleet) {
    for (id, url) in &sim.workers {
        let cache = sim_cache(url).await;
        for router in routers {
            eventually("every replica to index the worker's cache", || async {
                indexed(router, *id).await == cache
            })
            .await;
        }
    }
}

/// The worker's cache as it tells it: (blocks cached, last event id).
async fn sim_cache(url: &str) -> (u64, u64) {
    let text = Http::default().get(&format!("{url}/metrics")).await.text();
    (
        metric(&text, "kvroute_sim_kv_blocks_cached", &[]) as u64,
        metric(&text, "kvroute_sim_last_event_id", &[]) as u64,
    )
}

/// Digests travel the log, so every replica checks the worker's digest at the
/// same point and compares its own digest with its peers'. One replica's view
/// of the worker is corrupted on purpose (`index.test_faults`: the content of
/// its next events dropped, ids kept, so no gap tells); the digest catches it
/// there, it is counted, and the dump the holder asks for heals it. Then the
/// holder's own view is corrupted: the same. Last, a replica misses an event
/// whole: only the replicas' comparison of their own digests can tell.
#[tokio::test]
async fn a_replicas_corrupted_view_of_a_worker_is_caught_by_the_digest_counted_and_healed() {
    let nats = NatsServer::start();
    let routers: Vec<_> = (0..3)
        .map(|i| {
            let cluster = nats.cluster_config(&format!("r{i}"));
            RouterProcess::start(&format!("{cluster}[index]\ntest_faults = true\n"))
        })
        .collect();
    let sim = SimFleet::start_with(
        Some(&routers[0].grpc),
        1,
        &["--digest-interval-ms", "50"],
        &[],
    );
    let (id, sim_url) = sim.workers[0].clone();
    for router in &routers {
        wait_registered(router, 1).await;
    }
    let http = Http::default();
    let prompts: Vec<Vec<u32>> = (0..8).map(|i| tokens(i * 10_000, 64)).collect();
    let fill = |range: std::ops::Range<usize>| {
        let http = &http;
        let prompts = &prompts;
        let url = format!("{}/v1/completions", routers[0].http);
        async move {
            for prompt in &prompts[range] {
                let reply = http.post(&url, &completion("sim-model", prompt)).await;
                assert_eq!(reply.status, 200, "{}", reply.text());
            }
        }
    };
    let converged = || async {
        let cache = sim_cache(&sim_url).await;
        for router in &routers {
            if indexed(router, id).await != cache {
                return false;
            }
        }
        true
    };
    fill(0..2).await;
    eventually("every replica to index the worker's cache", converged).await;
    // The replicas compare their own digests with each other's, and agree.
    eventually("the replicas' digests to be compared", || async {
        total(
            &routers,
            "kvroute_cluster_peer_digests_total",
            &[("outcome", "matched")],
        )
        .await
            >= 6.0
    })
    .await;
    let label = id.to_string();
    let divergence = [("worker", label.as_str())];
    assert_eq!(
        total(&routers, "kvroute_index_divergence_total", &divergence).await,
        0.0
    );
    let differed = [("outcome", "differed")];
    assert_eq!(
        total(&routers, "kvroute_cluster_peer_digests_total", &differed).await,
        0.0
    );

    let mut diverged = [0.0; 3];
    for (corrupted, range) in [(1, 2..4), (0, 4..6)] {
        let router = &routers[corrupted];
        let dumps_before = dumps_applied(router, id).await;
        let drop = http
            .post(
                &format!("{}/workers/{id}/drop-events", router.http),
                &json!({"dp_rank": 0, "events": 1}),
            )
            .await;
        assert_eq!(drop.status, 200, "{}", drop.text());
        fill(range).await;

        eventually("the divergence to be counted there", || async {
            metric(
                &metrics(router).await,
                "kvroute_index_divergence_total",
                &divergence,
            ) > diverged[corrupted]
        })
        .await;
        diverged[corrupted] += 1.0;
        eventually("the dump to heal every replica", converged).await;
        // By one dump, however many replicas asked for it.
        assert_eq!(dumps_applied(router, id).await, dumps_before + 1.0);
        // Counted once, and only where the view was wrong.
        for (i, other) in routers.iter().enumerate() {
            let text = metrics(other).await;
            let counted = metric(&text, "kvroute_index_divergence_total", &divergence);
            assert_eq!(counted, diverged[i], "r{i}");
        }
        for prompt in &prompts {
            let first = overlaps(&routers[0], prompt).await;
            for other in &routers[1..] {
                assert_eq!(overlaps(other, prompt).await, first);
            }
        }
    }
    // The peers saw the difference too, at the same point of the log.
    let peers_differed = total(&routers, "kvroute_cluster_peer_digests_total", &differed).await;
    assert!(peers_differed >= 1.0);

    // A replica that does not hold the worker's stream misses an event whole:
    // a gap that only the holder could ask the worker to fill, and the holder
    // has none. The worker's digests are then "not current" there, never
    // diverged; the replicas' own digests differ, and that heals it.
    let router = &routers[2];
    let dumps_before = dumps_applied(router, id).await;
    let drop = http
        .post(
            &format!("{}/workers/{id}/drop-events", router.http),
            &json!({"dp_rank": 0, "events": 1, "whole": true}),
        )
        .await;
    assert_eq!(drop.status, 200, "{}", drop.text());
    fill(6..8).await;
    // The missed event's blocks may be evicted by later ones, so the views can
    // agree for a moment before the gap is found: wait for the dump too.
    eventually("the dump to heal the replica behind", || async {
        dumps_applied(router, id).await > dumps_before && converged().await
    })
    .await;
    assert_eq!(dumps_applied(router, id).await, dumps_before + 1.0);
    assert!(
        total(&routers, "kvroute_cluster_peer_digests_total", &differed).await > peers_differed
    );
    for (i, other) in routers.iter().enumerate() {
        let text = metrics(other).await;
        let counted = metric(&text, "kvroute_index_divergence_total", &divergence);
        assert_eq!(counted, diverged[i], "r{i}");
    }

    // Off by default: the hook is refused.
    let plain = RouterProcess::start(&nats.cluster_config("plain"));
    let refused = http
        .post(
            &format!("{}/workers/{id}/drop-events", plain.http),
            &json!({"dp_rank": 0, "events": 1}),
        )
        .await;
    assert_eq!(refused.status, 403, "{}", refused.text());
    assert!(refused.text().contains("test_faults"), "{}", refused.text());
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
