//! End to end: a test engine publisher (both wire encodings) drives the real
//! `kvroute bridge` process over loopback ZeroMQ, and the bridge streams to the
//! real `kvroute serve`, whose index (read through its HTTP API) must end up
//! holding exactly what the publisher stored. The same scenario also runs against
//! a recording gRPC router that loses a batch on purpose, to drive the resync
//! path, and whose index can be compared block by block.

#[path = "../common/mod.rs"]
mod common;
mod publisher;
mod recorder;

use std::net::SocketAddr;
use std::process::Stdio;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::{Router, routing::get};
use common::{
    Certs, DEADLINE, Http, HttpsClient, Labels, Process, RouterProcess, eventually, free_ports,
    https, kvroute, metric,
};
use kvroute_index::{BlockHasher, EventKind, KvEvent, KvIndex, StoredBlock, WorkerKey};
use kvroute_proto::{PdConvention, WorkerRole};
use publisher::{Encoding, EngineEvent, Hash, Publisher, encode};
use recorder::{ROUTER_BLOCK_SIZE, Recorded};

const WORKER_ID: u64 = 42;
/// The worker token the real router requires on gRPC ingest.
const TOKEN: &str = "s3cret";
/// The real router's admin token, for its admin endpoints.
const ADMIN_TOKEN: &str = "admin-s3cret";

/// The engine's HTTP side: its model list (a base model and one adapter) and vLLM-style gauges.
async fn start_engine_http() -> String {
    const METRICS: &str = "\
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine=\"0\",model_name=\"test-model\"} 3.0
vllm:num_requests_running{engine=\"1\",model_name=\"test-model\"} 1.0
vllm:num_requests_waiting{engine=\"0\",model_name=\"test-model\"} 2.0
vllm:num_requests_waiting{engine=\"1\",model_name=\"test-model\"} 0.0
vllm:kv_cache_usage_perc{engine=\"0\",model_name=\"test-model\"} 0.25
vllm:cache_config_info{block_size=\"4\",engine=\"0\",num_gpu_blocks=\"1000\"} 1.0
";
    let models = serde_json::json!({"object": "list", "data": [
        {"id": "test-model", "object": "model", "parent": null},
        {"id": "adapter", "object": "model", "parent": "test-model"},
    ]});
    let app = Router::new()
        .route("/v1/models", get(move || async move { axum::Json(models) }))
        .route("/metrics", get(|| async { METRICS }))
        .route("/health", get(|| async { "ok" }));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await });
    url
}

/// A running `kvroute bridge`, killed when dropped; its stderr is piped.
struct Bridge {
    process: Process,
    metrics_addr: SocketAddr,
}

impl Bridge {
    fn spawn(extra: &[String], router: &str, engine_url: &str, block_size: u32) -> Self {
        let metrics_port = free_ports(1);
        let mut command = kvroute();
        command
            .arg("bridge")
            .args(extra)
            .args(["--router", router])
            .args(["--worker-id", &WORKER_ID.to_string()])
            .args(["--engine-url", engine_url])
            .args(["--block-size", &block_size.to_string()])
            .args(["--metrics-addr", &format!("127.0.0.1:{metrics_port}")])
            .stderr(Stdio::piped());
        Self {
            process: Process::start(command, |_| true),
            metrics_addr: SocketAddr::from(([127, 0, 0, 1], metrics_port)),
        }
    }

    /// The sum of the samples of `name` whose labels include `labels`; 0 when
    /// none, or while the bridge is not serving `/metrics` yet.
    async fn metric(&self, name: &str, labels: Labels<'_>) -> f64 {
        if tokio::net::TcpStream::connect(self.metrics_addr)
            .await
            .is_err()
        {
            return 0.0;
        }
        let reply = Http::default()
            .get(&format!("http://{}/metrics", self.metrics_addr))
            .await;
        metric(&reply.text(), name, labels)
    }
}

/// What the router should hold, built independently: kvroute's hashes of the
/// tokens the publisher stored, applied to a reference index.
#[derive(Default)]
struct Expected {
    index: KvIndex,
    next_id: u64,
}

impl Expected {
    fn apply(&mut self, dp_rank: u32, events: &[EngineEvent]) {
        for event in events {
            let kind = match event {
                EngineEvent::Stored {
                    medium: Some(m), ..
                }
                | EngineEvent::Removed {
                    medium: Some(m), ..
                } if *m != "GPU" => continue,
                EngineEvent::Stored { block_size, .. } if *block_size != ROUTER_BLOCK_SIZE => {
                    continue;
                }
                EngineEvent::Stored {
                    hashes,
                    parent,
                    tokens,
                    lora_name,
                    ..
                } => {
                    let hasher =
                        BlockHasher::with_lora(ROUTER_BLOCK_SIZE as usize, lora_name.unwrap_or(""));
                    EventKind::Stored {
                        parent_hash: parent.as_ref().map(Hash::id),
                        blocks: hashes
                            .iter()
                            .zip(hasher.local_hashes(tokens))
                            .map(|(h, tokens_hash)| StoredBlock {
                                block_hash: h.id(),
                                tokens_hash,
                            })
                            .collect(),
                    }
                }
                EngineEvent::Removed { hashes, .. } => EventKind::Removed {
                    block_hashes: hashes.iter().map(Hash::id).collect(),
                },
                EngineEvent::Cleared => EventKind::Cleared,
            };
            self.next_id += 1;
            self.index.apply(
                WorkerKey::new(WORKER_ID, dp_rank),
                &KvEvent {
                    event_id: self.next_id,
                    kind,
                },
            );
        }
    }
}

/// A rank's blocks as (parent, engine hash, tokens hash), sorted: what a dump shows.
fn held(index: &KvIndex, dp_rank: u32) -> Vec<(Option<u64>, u64, u64)> {
    let mut blocks: Vec<_> = index
        .dump(WorkerKey::new(WORKER_ID, dp_rank))
        .map(|d| d.events)
        .unwrap_or_default()
        .into_iter()
        .flat_map(|kind| match kind {
            EventKind::Stored {
                parent_hash,
                blocks,
            } => blocks
                .into_iter()
                .map(|b| (parent_hash, b.block_hash, b.tokens_hash))
                .collect(),
            _ => vec![],
        })
        .collect();
    blocks.sort();
    blocks
}

/// Distinct tokens for `blocks` blocks of 4.
fn tokens(first: u32, blocks: u32) -> Vec<u32> {
    (first..first + blocks * ROUTER_BLOCK_SIZE).collect()
}

fn stored(hashes: Vec<Hash>, parent: Option<Hash>, tokens: Vec<u32>) -> EngineEvent {
    EngineEvent::Stored {
        hashes,
        parent,
        tokens,
        block_size: ROUTER_BLOCK_SIZE,
        medium: None,
        lora_name: None,
    }
}

fn unsigned(ids: &[u64]) -> Vec<Hash> {
    ids.iter().map(|&h| Hash::Unsigned(h)).collect()
}

fn digest(last: u64) -> Hash {
    let mut bytes = [0x5a; 32];
    bytes[24..].copy_from_slice(&last.to_be_bytes());
    Hash::Bytes(bytes)
}

/// Publishes empty batches until the bridge has received one: the subscription is up.
async fn until_subscribed(
    publisher: &mut Publisher,
    bridge: &Bridge,
    encoding: Encoding,
    dp_rank: u32,
) {
    let name = "kvroute_bridge_batches_received_total";
    publish_until_counted(publisher, bridge, encoding, dp_rank, name).await;
}

/// Publishes empty batches of `dp_rank` until the bridge's counter `name` for
/// that rank counted something.
async fn publish_until_counted(
    publisher: &mut Publisher,
    bridge: &Bridge,
    encoding: Encoding,
    dp_rank: u32,
    name: &str,
) {
    let rank = dp_rank.to_string();
    let start = Instant::now();
    while bridge.metric(name, &[("rank", &rank)]).await < 1.0 {
        assert!(
            start.elapsed() < DEADLINE,
            "the bridge never counted {name} for rank {rank}"
        );
        publisher.publish(encode(&[], encoding, dp_rank)).await;
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Prompts whose cached prefix the router is asked about: (model or adapter, tokens).
type Probes = Vec<(&'static str, Vec<u32>)>;

/// What a router knows of one rank: its block count and the cached prefix, in
/// blocks, of each probe prompt.
#[derive(Debug, PartialEq)]
struct RankView {
    blocks: u64,
    overlaps: Vec<u32>,
}

fn index_view(index: &KvIndex, dp_rank: u32, probes: &Probes) -> RankView {
    let key = WorkerKey::new(WORKER_ID, dp_rank);
    let overlaps = probes
        .iter()
        .map(|(name, tokens)| {
            let lora = if *name == "adapter" { "adapter" } else { "" };
            let local =
                BlockHasher::with_lora(ROUTER_BLOCK_SIZE as usize, lora).local_hashes(tokens);
            index
                .find_matches(&local)
                .iter()
                .find(|m| m.worker == key)
                .map_or(0, |m| m.depth)
        })
        .collect();
    RankView {
        blocks: index.worker_blocks(key),
        overlaps,
    }
}

/// The router the bridge streams to in a scenario.
enum Target {
    /// The real router, asked through its HTTP API.
    Serve(RouterProcess),
    /// The recording router, whose index is read directly.
    Recorder(Arc<Recorded>, SocketAddr),
}

impl Target {
    fn grpc_url(&self) -> String {
        match self {
            Target::Serve(router) => router.grpc.clone(),
            Target::Recorder(_, addr) => format!("http://{addr}"),
        }
    }

    async fn view(&self, dp_rank: u32, probes: &Probes) -> RankView {
        let router = match self {
            Target::Recorder(recorded, _) => return index_view(&recorded.index, dp_rank, probes),
            Target::Serve(router) => router,
        };
        let http = Http::default();
        let worker = admin_get(&http, &format!("{}/workers/{WORKER_ID}", router.http)).await;
        if !worker.status.is_success() {
            return RankView {
                blocks: 0,
                overlaps: vec![],
            };
        }
        let blocks = worker.json()["index"]
            .as_array()
            .unwrap()
            .iter()
            .find(|r| r["dp_rank"] == dp_rank)
            .map_or(0, |r| r["indexed_blocks"].as_u64().unwrap());
        let mut overlaps = Vec::new();
        for (name, tokens) in probes {
            let body = serde_json::json!({"model": name, "prompt": tokens});
            let reply = admin_route(&http, &format!("{}/v1/route", router.http), &body).await;
            assert!(
                reply.status.is_success(),
                "/v1/route: {}",
                String::from_utf8_lossy(&reply.body)
            );
            let overlap = reply.json()["scores"]
                .as_array()
                .unwrap()
                .iter()
                .find(|s| s["worker_id"] == WORKER_ID && s["dp_rank"] == dp_rank)
                .map_or(0, |s| s["event_overlap_blocks"].as_u64().unwrap() as u32);
            overlaps.push(overlap);
        }
        RankView { blocks, overlaps }
    }

    /// The worker as the router knows it: models, adapters, engine URL and each rank's reported load.
    async fn worker(&self) -> Option<serde_json::Value> {
        match self {
            Target::Recorder(recorded, _) => {
                let registrations = recorded.registrations.lock().unwrap();
                let register = registrations.first()?;
                let loads = recorded.loads.lock().unwrap();
                let reported = |rank: u32| {
                    loads.iter().rev().find(|l| l.dp_rank == rank).map_or(
                        serde_json::Value::Null,
                        |l| {
                            serde_json::json!({
                                "running_requests": l.running_requests,
                                "queued_requests": l.queued_requests,
                                "kv_blocks_used": l.kv_blocks_used,
                                "kv_blocks_total": l.kv_blocks_total,
                            })
                        },
                    )
                };
                let ranks: Vec<_> = register
                    .dp_ranks
                    .iter()
                    .map(|&r| serde_json::json!({"dp_rank": r, "reported": reported(r)}))
                    .collect();
                Some(serde_json::json!({
                    "models": register.models,
                    "lora_names": register.lora_names,
                    "base_url": register.base_url,
                    "total_kv_blocks": register.total_kv_blocks,
                    "ranks": ranks,
                }))
            }
            Target::Serve(router) => {
                let reply = admin_get(
                    &Http::default(),
                    &format!("{}/workers/{WORKER_ID}", router.http),
                )
                .await;
                reply
                    .status
                    .is_success()
                    .then(|| reply.json()["worker"].clone())
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_real_router_indexes_what_the_engine_published() {
    engine_scenario(Target::Serve(start_router())).await;
}

/// The real router, requiring [`TOKEN`] of workers and [`ADMIN_TOKEN`] of operators.
fn start_router() -> RouterProcess {
    RouterProcess::start(&format!(
        "block_size = {ROUTER_BLOCK_SIZE}\n[auth]\nworker_token = \"{TOKEN}\"\nadmin_token = \"{ADMIN_TOKEN}\""
    ))
}

async fn admin_get(http: &Http, url: &str) -> common::Reply {
    let bearer = format!("Bearer {ADMIN_TOKEN}");
    http.call("GET", url, &[("authorization", &bearer)], "")
        .await
}

/// `/v1/route` as an operator asks it: only the admin sees overlaps.
async fn admin_route(http: &Http, url: &str, body: &serde_json::Value) -> common::Reply {
    let bearer = format!("Bearer {ADMIN_TOKEN}");
    http.call("POST", url, &[("authorization", &bearer)], body.to_string())
        .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_router_that_lost_a_batch_resyncs_from_the_mirror() {
    let recorded = Arc::new(Recorded::default());
    let addr = recorder::start("127.0.0.1:0".parse().unwrap(), recorded.clone()).await;
    engine_scenario(Target::Recorder(recorded, addr)).await;
}

/// Both encodings, two data-parallel ranks, a gap filled by replay, an engine
/// restart, filtered and malformed input: the router must end up holding what
/// the engine holds on GPU.
async fn engine_scenario(target: Target) {
    let engine_url = start_engine_http().await;
    let events_port = free_ports(2);
    let replay_port = free_ports(2);
    let mut rank0 = Publisher::bind(events_port, Some(replay_port), "kv").await;
    let mut rank1 = Publisher::bind(events_port + 1, Some(replay_port + 1), "kv").await;
    let bridge = Bridge::spawn(
        &[
            format!("--engine-events=tcp://127.0.0.1:{events_port}"),
            format!("--engine-replay=tcp://127.0.0.1:{replay_port}"),
            "--topic=kv".into(),
            "--data-parallel-size=2".into(),
            format!("--router-token={TOKEN}"),
            "--digest-interval-ms=50".into(),
        ],
        &target.grpc_url(),
        &engine_url,
        ROUTER_BLOCK_SIZE,
    );
    let mut expected = Expected::default();
    until_subscribed(&mut rank0, &bridge, Encoding::Array, 0).await;
    until_subscribed(&mut rank1, &bridge, Encoding::Map, 1).await;
    eventually("registration", || async { target.worker().await.is_some() }).await;
    let worker = target.worker().await.unwrap();
    assert_eq!(worker["models"], serde_json::json!(["test-model"]));
    assert_eq!(worker["lora_names"], serde_json::json!(["adapter"]));
    assert_eq!(worker["base_url"], engine_url.as_str());
    assert_eq!(worker["ranks"].as_array().unwrap().len(), 2);
    assert_eq!(worker["total_kv_blocks"], 1000);
    if let Target::Recorder(recorded, _) = &target {
        // The router loses rank 0's next batch (rank 0 sends more after it): it must
        // notice the gap and resync from the bridge's mirror.
        *recorded.lose_next_batch_of.lock().unwrap() = Some(0);
    }

    // Rank 0, array encoding, unsigned hashes.
    let batches: Vec<Vec<EngineEvent>> = vec![
        vec![stored(unsigned(&[101, 102, 103]), None, tokens(0, 3))],
        vec![
            stored(
                unsigned(&[104, 105]),
                Some(Hash::Unsigned(103)),
                tokens(12, 2),
            ),
            // CPU-tier copies and a foreign block size are left out.
            EngineEvent::Stored {
                hashes: unsigned(&[901]),
                parent: None,
                tokens: tokens(0, 1),
                block_size: 4,
                medium: Some("CPU"),
                lora_name: None,
            },
            EngineEvent::Removed {
                hashes: unsigned(&[101]),
                medium: Some("CPU"),
            },
            EngineEvent::Stored {
                hashes: unsigned(&[902]),
                parent: None,
                tokens: (0..8).collect(),
                block_size: 8,
                medium: None,
                lora_name: None,
            },
        ],
    ];
    for batch in &batches {
        rank0.publish(encode(batch, Encoding::Array, 0)).await;
        expected.apply(0, batch);
    }
    rank0.publish(b"\x92\x01".to_vec()).await; // malformed: counted and skipped
    // A batch ZeroMQ drops: the next one reveals the gap and the replay socket fills it.
    let lost = vec![stored(
        unsigned(&[106]),
        Some(Hash::Unsigned(105)),
        tokens(20, 1),
    )];
    rank0.drop_next(encode(&lost, Encoding::Array, 0));
    expected.apply(0, &lost);
    let after_gap = vec![EngineEvent::Removed {
        hashes: unsigned(&[106, 105]),
        medium: Some("GPU"),
    }];
    rank0.publish(encode(&after_gap, Encoding::Array, 0)).await;
    expected.apply(0, &after_gap);

    // Rank 1, map encoding: signed and byte hashes, a LoRA adapter, a clear, then an engine restart.
    let batches: Vec<Vec<EngineEvent>> = vec![
        vec![
            stored(
                vec![Hash::Signed(-5), Hash::Signed(-6)],
                None,
                tokens(100, 2),
            ),
            stored(vec![digest(7)], Some(Hash::Signed(-6)), tokens(108, 1)),
            EngineEvent::Stored {
                hashes: unsigned(&[300]),
                parent: None,
                tokens: tokens(100, 1),
                block_size: 4,
                medium: Some("GPU"),
                lora_name: Some("adapter"),
            },
        ],
        vec![
            EngineEvent::Cleared,
            stored(vec![Hash::Signed(-8)], None, tokens(200, 1)),
        ],
    ];
    let probes: Probes = vec![
        ("test-model", tokens(0, 3)),
        (
            "test-model",
            [tokens(0, 3), tokens(12, 2), tokens(20, 1)].concat(),
        ),
        ("test-model", [tokens(100, 2), tokens(108, 1)].concat()),
        ("adapter", tokens(100, 1)),
        ("test-model", tokens(200, 1)),
        ("test-model", tokens(300, 2)),
    ];
    rank1.publish(encode(&batches[0], Encoding::Map, 1)).await;
    expected.apply(1, &batches[0]);
    // A newer engine's event class is skipped; a map event without its tokens fails its batch.
    let batch_of = |event: Vec<(&str, rmpv::Value)>| {
        let event = rmpv::Value::Map(event.into_iter().map(|(k, v)| (k.into(), v)).collect());
        let batch = rmpv::Value::Map(vec![
            ("ts".into(), 1.0.into()),
            ("events".into(), rmpv::Value::Array(vec![event])),
        ]);
        let mut bytes = Vec::new();
        rmpv::encode::write_value(&mut bytes, &batch).unwrap();
        bytes
    };
    let hashes = || rmpv::Value::Array(vec![1.into()]);
    rank1
        .publish(batch_of(vec![
            ("type", "BlockMoved".into()),
            ("block_hashes", hashes()),
        ]))
        .await;
    rank1
        .publish(batch_of(vec![
            ("type", "BlockStored".into()),
            ("block_hashes", hashes()),
        ]))
        .await;
    eventually("rank 1's first batch, a LoRA block among it", || async {
        target.view(1, &probes).await == index_view(&expected.index, 1, &probes)
    })
    .await;
    assert_eq!(
        index_view(&expected.index, 1, &probes).overlaps,
        [0, 0, 3, 1, 0, 0]
    );
    rank1.publish(encode(&batches[1], Encoding::Map, 1)).await;
    expected.apply(1, &batches[1]);
    eventually("rank 1's batches before the restart", || async {
        target.view(1, &probes).await == index_view(&expected.index, 1, &probes)
    })
    .await;
    // Far enough ahead that the restarted engine cannot catch up before the bridge reconnects.
    for _ in 0..200 {
        rank1.publish(encode(&[], Encoding::Map, 1)).await;
    }
    rank1.restart().await;
    expected.apply(1, &[EngineEvent::Cleared]);
    let restarts = "kvroute_bridge_restarts_total";
    publish_until_counted(&mut rank1, &bridge, Encoding::Map, 1, restarts).await;
    let after_restart = vec![stored(vec![digest(1), digest(2)], None, tokens(300, 2))];
    rank1
        .publish(encode(&after_restart, Encoding::Map, 1))
        .await;
    expected.apply(1, &after_restart);

    eventually("the router index to equal what was stored", || async {
        target.view(0, &probes).await == index_view(&expected.index, 0, &probes)
            && target.view(1, &probes).await == index_view(&expected.index, 1, &probes)
    })
    .await;
    let rank0 = index_view(&expected.index, 0, &probes);
    assert_eq!(
        rank0,
        RankView {
            blocks: 4,
            overlaps: vec![3, 4, 0, 0, 0, 0]
        },
        "rank 0 keeps 101..104"
    );
    let rank1 = index_view(&expected.index, 1, &probes);
    assert_eq!(
        rank1,
        RankView {
            blocks: 2,
            overlaps: vec![0, 0, 0, 0, 0, 2]
        },
        "rank 1 keeps what followed the restart"
    );
    if let Target::Recorder(recorded, _) = &target {
        assert_eq!(held(&recorded.index, 0), held(&expected.index, 0));
        assert_eq!(held(&recorded.index, 1), held(&expected.index, 1));
        assert!(*recorded.resyncs_sent.lock().unwrap() >= 1);
        assert!(
            *recorded.dumps.lock().unwrap() >= 3,
            "two dumps at registration, one per resync"
        );
        // The engine's restart made the bridge register a new instance.
        let instances: Vec<u64> = (recorded.registrations.lock().unwrap())
            .iter()
            .map(|r| r.instance_id)
            .collect();
        assert!(instances.len() >= 2, "{instances:?}");
        assert_ne!(instances.first(), instances.last(), "{instances:?}");
        // The bridge's digests agree with the index whenever both are at the same
        // event id, and the final state is checked too.
        eventually("digests of the final state", || async {
            let digests = recorded.digests.lock().unwrap();
            (0..2).all(|rank| {
                let last = recorded
                    .index
                    .last_event_id(WorkerKey::new(WORKER_ID, rank));
                digests
                    .iter()
                    .any(|&(r, id, v)| r == rank && Some(id) == last && v == Some(true))
            })
        })
        .await;
        let digests = recorded.digests.lock().unwrap();
        assert!(digests.iter().all(|d| d.2 != Some(false)), "{digests:?}");
    }
    if let Target::Serve(router) = &target {
        let scrape = || async {
            Http::default()
                .get(&format!("{}/metrics", router.http))
                .await
                .text()
        };
        eventually("the router to match the bridge's digests", || async {
            let text = scrape().await;
            ["42", "42:1"].iter().all(|w| {
                metric(
                    &text,
                    "kvroute_index_digests_total",
                    &[("worker", w), ("outcome", "matched")],
                ) >= 1.0
            })
        })
        .await;
        assert_eq!(
            metric(&scrape().await, "kvroute_index_divergence_total", &[]),
            0.0
        );
    }

    let counts: [(&str, Labels, f64); 9] = [
        (
            "kvroute_bridge_decode_failures_total",
            &[("rank", "0"), ("reason", "not_msgpack")],
            1.0,
        ),
        (
            "kvroute_bridge_decode_failures_total",
            &[("rank", "1"), ("reason", "bad_field")],
            1.0,
        ),
        (
            "kvroute_bridge_events_skipped_total",
            &[("rank", "0"), ("reason", "medium")],
            2.0,
        ),
        (
            "kvroute_bridge_events_skipped_total",
            &[("rank", "0"), ("reason", "block_size")],
            1.0,
        ),
        (
            "kvroute_bridge_events_skipped_total",
            &[("rank", "1"), ("reason", "unknown_type")],
            1.0,
        ),
        ("kvroute_bridge_gaps_total", &[("rank", "0")], 1.0),
        ("kvroute_bridge_mirror_resets_total", &[], 0.0),
        ("kvroute_bridge_restarts_total", &[("rank", "0")], 0.0),
        ("kvroute_bridge_restarts_total", &[("rank", "1")], 1.0),
    ];
    for (name, labels, value) in counts {
        assert_eq!(
            bridge.metric(name, labels).await,
            value,
            "{name} {labels:?}"
        );
    }
    // At least the gap's; joining a running publisher may add one.
    let replays = bridge.metric(
        "kvroute_bridge_replays_total",
        &[("rank", "0"), ("outcome", "complete")],
    );
    assert!(replays.await >= 1.0);

    eventually("load reports of both ranks", || async {
        let Some(worker) = target.worker().await else {
            return false;
        };
        let reported = |rank: usize| worker["ranks"][rank]["reported"].clone();
        reported(0)["running_requests"] == 3
            && reported(0)["queued_requests"] == 2
            && reported(0)["kv_blocks_used"] == 250
            && reported(0)["kv_blocks_total"] == 1000
            && reported(1)["running_requests"] == 1
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_replay_a_gap_clears_the_rank_and_late_engine_and_router_are_joined() {
    let engine_url = start_engine_http().await;
    let events_port = free_ports(1);
    let router: SocketAddr = format!("127.0.0.1:{}", free_ports(1)).parse().unwrap();
    let bridge = Bridge::spawn(
        &[format!("--engine-events=tcp://127.0.0.1:{events_port}")],
        &format!("http://{router}"),
        &engine_url,
        ROUTER_BLOCK_SIZE,
    );
    // The engine's publisher comes up after the bridge, which keeps trying to connect.
    eventually("the bridge to serve /metrics", || async {
        tokio::net::TcpStream::connect(bridge.metrics_addr)
            .await
            .is_ok()
    })
    .await;
    let mut publisher = Publisher::bind(events_port, None, "").await;
    until_subscribed(&mut publisher, &bridge, Encoding::Map, 0).await;

    let mut expected = Expected::default();
    let first = vec![stored(unsigned(&[1, 2]), None, tokens(0, 2))];
    publisher.publish(encode(&first, Encoding::Map, 0)).await;
    expected.apply(0, &first);
    publisher.drop_next(encode(
        &[stored(
            unsigned(&[3]),
            Some(Hash::Unsigned(2)),
            tokens(8, 1),
        )],
        Encoding::Map,
        0,
    ));
    // Nothing can recover the lost batch: the rank is cleared, then goes on.
    expected.apply(0, &[EngineEvent::Cleared]);
    let after = vec![stored(unsigned(&[10]), None, tokens(50, 1))];
    publisher.publish(encode(&after, Encoding::Array, 0)).await;
    expected.apply(0, &after);
    eventually("the gap to be handled", || async {
        bridge
            .metric("kvroute_bridge_mirror_resets_total", &[("rank", "0")])
            .await
            == 1.0
    })
    .await;

    // The router comes up only now: the bridge has been retrying, and registers with its mirror.
    let recorded = Arc::new(Recorded::default());
    recorder::start(router, recorded.clone()).await;
    eventually("the router index to equal the mirror", || async {
        !held(&recorded.index, 0).is_empty() && held(&recorded.index, 0) == held(&expected.index, 0)
    })
    .await;
    assert_eq!(held(&recorded.index, 0).len(), 1);
    assert_eq!(
        bridge
            .metric("kvroute_bridge_gaps_total", &[("rank", "0")])
            .await,
        1.0
    );
    assert_eq!(
        bridge.metric("kvroute_bridge_replays_total", &[]).await,
        0.0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_block_size_or_token_stops_the_bridge_with_the_reason() {
    let router = start_router();
    let engine_url = start_engine_http().await;
    let events_port = free_ports(1);
    let _publisher = Publisher::bind(events_port, None, "").await;
    for (block_size, token, reason) in [
        (16, TOKEN, "block size 16 does not match the router's 4"),
        (ROUTER_BLOCK_SIZE, "wrong", "missing or wrong worker token"),
        (
            ROUTER_BLOCK_SIZE,
            ADMIN_TOKEN,
            "missing or wrong worker token",
        ),
    ] {
        let mut bridge = Bridge::spawn(
            &[
                format!("--engine-events=tcp://127.0.0.1:{events_port}"),
                format!("--router-token={token}"),
            ],
            &router.grpc,
            &engine_url,
            block_size,
        );
        let start = Instant::now();
        let status = loop {
            if let Some(status) = bridge.process.child.try_wait().unwrap() {
                break status;
            }
            assert!(
                start.elapsed() < DEADLINE,
                "the bridge kept running after: {reason}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        };
        assert!(!status.success());
        let mut stderr = String::new();
        std::io::Read::read_to_string(bridge.process.child.stderr.as_mut().unwrap(), &mut stderr)
            .unwrap();
        assert!(stderr.contains(reason), "stderr: {stderr}");
    }
}

/// Two router replicas requiring client certificates: the bridge registers with
/// the first over mTLS and, when that one is killed (SIGKILL), with the second,
/// its TLS flags holding for both URLs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_bridge_registers_over_mtls_and_moves_on_when_its_router_dies() {
    let certs = Certs::generate();
    let config = format!(
        "block_size = {ROUTER_BLOCK_SIZE}\n{}",
        certs.router_tls(true)
    );
    let mut first = RouterProcess::start(&config);
    let second = RouterProcess::start(&config);
    let engine_url = start_engine_http().await;
    let events_port = free_ports(1);
    let _publisher = Publisher::bind(events_port, None, "").await;
    let file = |flag: &str, path: &std::path::Path| format!("{flag}={}", path.display());
    let _bridge = Bridge::spawn(
        &[
            format!("--engine-events=tcp://127.0.0.1:{events_port}"),
            file("--router-ca-file", &certs.ca),
            file("--router-cert-file", &certs.client_cert),
            file("--router-key-file", &certs.client_key),
        ],
        &format!("{},{}", https(&first.grpc), https(&second.grpc)),
        &engine_url,
        ROUTER_BLOCK_SIZE,
    );
    let client = HttpsClient::new(&certs.ca);
    let registered = |router: &RouterProcess| {
        let (client, url) = (
            &client,
            format!("{}/workers/{WORKER_ID}", https(&router.http)),
        );
        async move {
            let (status, body) = client.call("GET", &url, String::new()).await;
            status == 200
                && body["worker"]["models"][0] == "test-model"
                && body["worker"]["state"] == "connected"
        }
    };
    eventually("the bridge registered over mTLS", || registered(&first)).await;
    assert!(!registered(&second).await, "one router at a time");

    first.process.child.kill().unwrap();
    first.process.child.wait().unwrap();
    eventually("the bridge registered with the next router", || {
        registered(&second)
    })
    .await;
}

#[test]
fn bad_endpoints_are_clear_errors_at_start() {
    for (flag, value, message) in [
        (
            "--engine-events",
            "localhost:5557",
            "\"localhost:5557\" is not tcp://HOST:PORT",
        ),
        (
            "--engine-url",
            "localhost:8000",
            "--engine-url \"localhost:8000\" is not http://HOST:PORT",
        ),
    ] {
        let mut args = [
            ("--engine-events", "tcp://127.0.0.1:5557"),
            ("--engine-url", "http://127.0.0.1:8000"),
            ("--router", "http://127.0.0.1:50051"),
            ("--worker-id", "1"),
            ("--block-size", "16"),
            ("--metrics-addr", "127.0.0.1:0"),
        ];
        args.iter_mut()
            .filter(|(f, _)| *f == flag)
            .for_each(|a| a.1 = value);
        let output = kvroute()
            .arg("bridge")
            .args(args.iter().map(|(f, v)| format!("{f}={v}")))
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(!output.status.success());
        assert!(stderr.contains(message), "stderr: {stderr}");
    }
}

/// A mirror twice tonic's 4 MiB default message size as one dump (about 28
/// bytes a block): the bridge registers with it and the router holds all of it,
/// also after the router restarts and the bridge resends it as a dump in parts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mirror_over_the_message_size_registers_and_resyncs() {
    mirror_registers_and_resyncs(300_000, DEADLINE).await;
}

/// The same with 2M blocks: minutes in a debug build (the bridge mirroring 2M
/// blocks' events and building its dump, more than the router applying it), so
/// not in CI. Run with `cargo test --test bridge -- --ignored`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore]
async fn a_mirror_of_two_million_blocks_registers_and_resyncs() {
    mirror_registers_and_resyncs(2_000_000, Duration::from_secs(600)).await;
}

async fn mirror_registers_and_resyncs(blocks: u64, deadline: Duration) {
    const CHAIN: u64 = 10_000;
    let grpc = format!("127.0.0.1:{}", free_ports(1));
    let config = format!(
        "block_size = {ROUTER_BLOCK_SIZE}\n[auth]\nworker_token = \"{TOKEN}\"\nadmin_token = \"{ADMIN_TOKEN}\"\n"
    );
    let router = RouterProcess::start_on(&grpc, &config);
    let engine_url = start_engine_http().await;
    let events_port = free_ports(1);
    let mut publisher = Publisher::bind(events_port, None, "kv").await;
    let mut bridge = Bridge::spawn(
        &[
            format!("--engine-events=tcp://127.0.0.1:{events_port}"),
            "--topic=kv".into(),
            format!("--router-token={TOKEN}"),
        ],
        &router.grpc,
        &engine_url,
        ROUTER_BLOCK_SIZE,
    );
    // Read the bridge's log as it comes, so that it never blocks on a full pipe.
    let mut log = bridge.process.child.stderr.take().unwrap();
    std::thread::spawn(move || std::io::copy(&mut log, &mut std::io::stderr()));
    until_subscribed(&mut publisher, &bridge, Encoding::Array, 0).await;
    for c in 0..blocks / CHAIN {
        let ids: Vec<u64> = (c * CHAIN + 1..=(c + 1) * CHAIN).collect();
        let first_token = (c * CHAIN) as u32 * ROUTER_BLOCK_SIZE;
        let chain = stored(unsigned(&ids), None, tokens(first_token, CHAIN as u32));
        publisher
            .publish(encode(&[chain], Encoding::Array, 0))
            .await;
    }
    let indexed = |router: &RouterProcess| {
        let url = format!("{}/workers/{WORKER_ID}", router.http);
        async move {
            let worker = admin_get(&Http::default(), &url).await;
            if !worker.status.is_success() {
                return 0;
            }
            worker.json()["index"][0]["indexed_blocks"]
                .as_u64()
                .unwrap_or(0)
        }
    };
    let started = Instant::now();
    while bridge.metric("kvroute_bridge_mirror_blocks", &[]).await != blocks as f64
        || indexed(&router).await != blocks
    {
        assert!(
            started.elapsed() < deadline,
            "the router never indexed every block"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    // A new router knows nothing: the bridge's dump on reconnecting restores it.
    drop(router);
    let router = RouterProcess::start_on(&grpc, &config);
    let started = Instant::now();
    while indexed(&router).await != blocks {
        assert!(
            started.elapsed() < deadline,
            "the reconnect's dump was never applied"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let probe = tokens((blocks - CHAIN) as u32 * ROUTER_BLOCK_SIZE, 8);
    let reply = admin_route(
        &Http::default(),
        &format!("{}/v1/route", router.http),
        &serde_json::json!({"model": "test-model", "prompt": probe}),
    )
    .await;
    assert_eq!(reply.json()["overlap_blocks"], 8, "{}", reply.text());
}

/// `kvroute sim`'s pools declare their roles, convention and bootstrap port at
/// registration, as a bridge in front of a real engine does.
#[tokio::test]
async fn the_sims_pools_register_their_roles() {
    let recorded = Arc::new(Recorded::default());
    let addr = recorder::start("127.0.0.1:0".parse().unwrap(), recorded.clone()).await;
    let router = format!("http://{addr}");
    let block_size = ROUTER_BLOCK_SIZE.to_string();
    let sim = Process::spawn(
        &[
            "sim",
            "--prefill-workers",
            "1",
            "--decode-workers",
            "1",
            "--pd-convention",
            "sglang",
            "--block-size",
            &block_size,
            "--tokenizer",
            "none",
            "--router",
            &router,
        ],
        |lines| lines.iter().filter(|l| l.starts_with("worker ")).count() == 2,
    );
    let bootstrap: u32 = sim.lines[0]
        .rsplit_once("bootstrap=")
        .and_then(|(_, port)| port.parse().ok())
        .unwrap();
    eventually("both pools to register", || async {
        recorded.registrations.lock().unwrap().len() >= 2
    })
    .await;
    let mut declared: Vec<(u64, i32, i32, u32)> = (recorded.registrations.lock().unwrap())
        .iter()
        .map(|r| (r.worker_id, r.role, r.pd_convention, r.bootstrap_port))
        .collect();
    declared.sort();
    declared.dedup();
    assert_eq!(
        declared,
        [
            (
                0,
                WorkerRole::Prefill as i32,
                PdConvention::Sglang as i32,
                bootstrap
            ),
            (1, WorkerRole::Decode as i32, PdConvention::Sglang as i32, 0),
        ]
    );
}
