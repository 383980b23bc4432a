//! Index self-verification and router failover with real parts: `kvroute sim`
//! processes streaming to routers over loopback gRPC. The digest catches an
//! index corrupted on purpose, counts it and heals it; a correct index never
//! diverges however much the workers' caches churn; a worker whose router dies
//! moves on to the next URL of `--router`.

mod common;

use std::collections::BTreeSet;

use common::*;
use kvroute_index::{EventKind, WorkerKey};
use serde_json::json;

fn prompt(seed: u32) -> Vec<u32> {
    (seed * 1000..seed * 1000 + 64).collect()
}

async fn complete(http_url: &str, tokens: &[u32]) -> Reply {
    let body = json!({"model": "sim-model", "prompt": tokens, "max_tokens": 2});
    Http::default()
        .post(&format!("{http_url}/v1/completions"), &body)
        .await
}

async fn scrape(http_url: &str, name: &str, labels: Labels<'_>) -> f64 {
    let text = Http::default().get(&format!("{http_url}/metrics")).await;
    metric(&text.text(), name, labels)
}

/// A rank's blocks as (parent, engine hash, tokens hash), order aside.
fn links(events: &[EventKind]) -> BTreeSet<(Option<u64>, u64, u64)> {
    let mut links = BTreeSet::new();
    for event in events {
        if let EventKind::Stored {
            parent_hash,
            blocks,
        } = event
        {
            let mut parent = *parent_hash;
            for b in blocks {
                links.insert((parent, b.block_hash, b.tokens_hash));
                parent = Some(b.block_hash);
            }
        }
    }
    links
}

/// The router runs in this process, so the test can corrupt its index under
/// the ingest gate (nothing is applied meanwhile); the worker is a real
/// `kvroute sim` over loopback.
#[tokio::test]
async fn a_corrupted_index_is_caught_by_the_digest_counted_and_healed() {
    let config = kvroute_router::Config {
        http_addr: ([127, 0, 0, 1], 0).into(),
        grpc_addr: ([127, 0, 0, 1], 0).into(),
        ..kvroute_router::Config::default()
    };
    let router = kvroute_router::server::start(config).await.unwrap();
    let http_url = format!("http://{}", router.http_addr);
    let grpc_url = format!("http://{}", router.grpc_addr);
    let sim = SimFleet::start_with(Some(&grpc_url), 1, &["--digest-interval-ms", "50"], &[]);
    wait_registered_at(&http_url, 1).await;
    let key = WorkerKey::new(sim.workers[0].0, 0);
    let label = key.worker_id.to_string();
    let labels = [("worker", label.as_str())];
    let matched = || {
        let url = http_url.clone();
        let label = label.clone();
        async move {
            scrape(
                &url,
                "kvroute_index_digests_total",
                &[("worker", &label), ("outcome", "matched")],
            )
            .await
        }
    };

    for seed in 1..=3 {
        assert_eq!(complete(&http_url, &prompt(seed)).await.status, 200);
    }
    let index = &router.state.index;
    eventually("12 blocks indexed", || async {
        index.worker_blocks(key) == 12
    })
    .await;
    // Two digests matched since: the worker is idle and both sides agree.
    let before = matched().await;
    eventually("digests to match", || async {
        matched().await >= before + 2.0
    })
    .await;
    let truth = index.dump(key).unwrap();
    assert_eq!(links(&truth.events).len(), 12);

    // Corrupt the router's view: the worker's last chain vanishes from it,
    // its event id untouched, so no gap tells.
    {
        let _gate = router.state.ingest_gate.write().await;
        let held = index.dump(key).unwrap();
        let kept = held.events[..held.events.len() - 4].to_vec();
        index.replace_worker(key, held.last_event_id.unwrap(), &kept);
    }
    assert_eq!(index.worker_blocks(key), 8);

    // Caught, counted, and healed by the dump it asks for.
    eventually("the divergence to be counted", || async {
        scrape(&http_url, "kvroute_index_divergence_total", &labels).await >= 1.0
    })
    .await;
    eventually("the index to be healed", || async {
        index.worker_blocks(key) == 12
    })
    .await;
    let healed = index.dump(key).unwrap();
    assert_eq!(links(&healed.events), links(&truth.events));
    assert_eq!(healed.last_event_id, truth.last_event_id);
    for seed in 1..=3 {
        let reply = Http::default()
            .post(
                &format!("{http_url}/v1/route"),
                &json!({"model": "sim-model", "prompt": prompt(seed)}),
            )
            .await
            .json();
        assert_eq!(reply["overlap_blocks"], 4, "{reply}");
    }
    // Once healed, digests match again, and the divergence was counted once.
    let before = matched().await;
    eventually("digests to match again", || async {
        matched().await >= before + 2.0
    })
    .await;
    assert_eq!(
        scrape(&http_url, "kvroute_index_divergence_total", &labels).await,
        1.0
    );
    drop(sim);
    router.shutdown().await;
}

/// Pools of 256 blocks and many prompts sharing prefixes: blocks are stored, evicted
/// (leaves and, under pressure, parents before children) and stored again all
/// the time, with a digest every 4 events. None may disagree.
#[tokio::test]
async fn a_correct_index_never_diverges_over_a_churny_run() {
    let router = RouterProcess::start("");
    let sim = SimFleet::start_with(
        Some(&router.grpc),
        2,
        &["--digest-events", "4", "--digest-interval-ms", "20"],
        &[],
    );
    wait_registered(&router, 2).await;
    let mut clients = Vec::new();
    for client in 0..4u32 {
        let url = router.http.clone();
        clients.push(tokio::spawn(async move {
            for i in 0..30u32 {
                // Eight shared 2-block prefixes, each with its own tail.
                let mut tokens: Vec<u32> = (0..32).map(|t| (i % 8) * 100 + t).collect();
                tokens.extend((0..192).map(|t| 1_000_000 + client * 10_000 + i * 200 + t));
                assert_eq!(complete(&url, &tokens).await.status, 200);
            }
        }));
    }
    for client in clients {
        client.await.unwrap();
    }
    let mut evictions = 0.0;
    for (_, url) in &sim.workers {
        evictions += scrape(url, "kvroute_sim_evictions_total", &[]).await;
    }
    assert!(evictions > 50.0, "the pools churned: {evictions} evictions");
    // The last state is checked too, once the workers are idle.
    let before = scrape(
        &router.http,
        "kvroute_index_digests_total",
        &[("outcome", "matched")],
    )
    .await;
    assert!(before >= 50.0, "{before} digests matched during the run");
    eventually("digests of the final state to match", || async {
        scrape(
            &router.http,
            "kvroute_index_digests_total",
            &[("outcome", "matched")],
        )
        .await
            >= before + 4.0
    })
    .await;
    assert_eq!(
        scrape(&router.http, "kvroute_index_divergence_total", &[]).await,
        0.0
    );
    assert_eq!(
        scrape(
            &router.http,
            "kvroute_index_digests_total",
            &[("outcome", "diverged")]
        )
        .await,
        0.0
    );
}

/// `--offload-blocks`: a prompt the GPU pool (256 blocks) evicted is still in
/// the engine's host tier; the router indexes it as the offload tier, shows it
/// in `/v1/route`, and the worker's digests (both tiers) match the router's.
#[tokio::test]
async fn evicted_blocks_in_the_host_tier_are_indexed_as_the_offload_tier() {
    let router = RouterProcess::start("");
    let sim = SimFleet::start_with(
        Some(&router.grpc),
        1,
        &[
            "--offload-blocks",
            "512",
            "--digest-events",
            "8",
            "--digest-interval-ms",
            "20",
        ],
        &[],
    );
    wait_registered(&router, 1).await;
    // Three prompts of 100 blocks each: the first is evicted from the GPU.
    let long = |seed: u32| -> Vec<u32> { (seed * 100_000..seed * 100_000 + 1_600).collect() };
    for seed in 1..=3 {
        assert_eq!(complete(&router.http, &long(seed)).await.status, 200);
    }
    let route = || async {
        Http::default()
            .post(
                &format!("{}/v1/route", router.http),
                &json!({"model": "sim-model", "prompt": long(1)}),
            )
            .await
            .json()
    };
    eventually(
        "the first prompt to be indexed in the offload tier",
        || async {
            let route = route().await;
            route["offload_overlap_blocks"] == 100 && route["overlap_blocks"].as_u64() < Some(100)
        },
    )
    .await;
    let on_gpu = route().await["overlap_blocks"].as_u64().unwrap();
    let matched = || {
        scrape(
            &router.http,
            "kvroute_index_digests_total",
            &[("outcome", "matched")],
        )
    };
    let before = matched().await;
    eventually("digests of both tiers to match", || async {
        matched().await >= before + 2.0
    })
    .await;
    assert_eq!(
        scrape(&router.http, "kvroute_index_divergence_total", &[]).await,
        0.0
    );
    // Its blocks are loaded back, not prefilled: the engine counts them.
    assert_eq!(complete(&router.http, &long(1)).await.status, 200);
    let (_, url) = &sim.workers[0];
    let loaded = scrape(url, "kvroute_sim_offload_loaded_prompt_tokens_total", &[]).await;
    // All but the GPU's blocks, less the last token, which is always computed.
    assert_eq!(loaded, ((100 - on_gpu) * 16 - 1) as f64);
}

/// `--router A,B`: the worker streams to A; A is killed (SIGKILL); the worker
/// registers with B, which then routes to it and indexes its blocks.
#[tokio::test]
async fn a_worker_moves_to_the_next_router_when_its_router_dies() {
    let mut first = RouterProcess::start("");
    let second = RouterProcess::start("");
    let routers = format!("{},{}", first.grpc, second.grpc);
    let sim = SimFleet::start(Some(&routers), 1);
    let (id, _) = sim.workers[0].clone();
    wait_registered(&first, 1).await;
    assert_eq!(complete(&first.http, &prompt(1)).await.status, 200);
    assert_eq!(
        Http::default()
            .get(&format!("{}/workers/{id}", second.http))
            .await
            .status,
        404,
        "the worker streams to one router at a time"
    );

    first.process.child.kill().unwrap();
    first.process.child.wait().unwrap();
    wait_registered(&second, 1).await;
    // Its dump follows the registration: the blocks cached through the first router.
    eventually("the second router to index the worker's cache", || async {
        let route = Http::default()
            .post(
                &format!("{}/v1/route", second.http),
                &json!({"model": "sim-model", "prompt": prompt(1)}),
            )
            .await
            .json();
        route["worker_id"] == id && route["overlap_blocks"] == 4
    })
    .await;
    let reply = complete(&second.http, &prompt(2)).await;
    assert_eq!(reply.status, 200, "{}", reply.text());
    assert_eq!(reply.worker(), id);
}
