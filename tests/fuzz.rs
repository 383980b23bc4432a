//! Fuzz targets on the stable toolchain (cargo-fuzz needs nightly): proptest
//! inputs, random and adversarial, into every place that takes bytes from
//! outside:
//! - each gRPC ingest message, as raw bytes the router itself must decode, on
//!   a real stream to an in-process router;
//! - JSON bodies into the HTTP API;
//! - msgpack payloads into the bridge's decoder;
//! - config files into `Config::load`.
//!
//! Each input must give a clear error (a gRPC status, a 4xx with a JSON body,
//! a decode error, an error naming the file) or be accepted; no thread may
//! panic, and a worker registered before (with a chain in the index) must
//! keep exactly its index entries.
//!
//! Under `cargo test` each target runs a bounded number of cases. With
//! `KVROUTE_FUZZ_SECONDS=N` each runs for N seconds and prints how many inputs
//! it tried; `tests/fuzz.sh` does that.

mod common;

use std::collections::BTreeSet;
use std::sync::Once;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use bytes::{Buf, BufMut, Bytes};
use common::{GrpcWorker, Http, TestWorker};
use kvroute_proto::{
    Cleared, Dump, EventBatch, KvEvent, LoadReport, Register, Removed, Stored, StoredBlock,
    kv_event,
};
use kvroute_router::config::Config;
use kvroute_router::server::{self, Running};
use proptest::prelude::*;
use proptest::test_runner::{Config as RunnerConfig, TestCaseError, TestRunner};
use prost::Message;
use serde_json::Value;
use tonic::codec::{Codec, DecodeBuf, Decoder, EncodeBuf, Encoder};

/// Cases per target under `cargo test`.
const CI_CASES: u32 = 64;

/// Panics in the routers' runtime threads (tokio would otherwise turn a
/// task's panic into a silently ended task). Panics on a test's own thread
/// are caught by proptest as failures of that input.
static PANICS: AtomicUsize = AtomicUsize::new(0);

fn count_panics() {
    static HOOK: Once = Once::new();
    HOOK.call_once(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            if std::thread::current().name() == Some("tokio-runtime-worker") {
                PANICS.fetch_add(1, Ordering::SeqCst);
            }
            previous(info);
        }));
    });
}

fn runner(cases: u32) -> TestRunner {
    TestRunner::new(RunnerConfig {
        cases,
        // Inputs are printed on failure; there is no source file to save them next to.
        failure_persistence: None,
        ..RunnerConfig::default()
    })
}

/// Runs `check` on inputs from `strategy`: `CI_CASES` of them, or as many as
/// `KVROUTE_FUZZ_SECONDS` allows.
fn fuzz<S: Strategy>(name: &str, strategy: S, check: impl Fn(S::Value) -> Result<(), TestCaseError>)
where
    S::Value: std::fmt::Debug,
{
    count_panics();
    let seconds: Option<u64> = std::env::var("KVROUTE_FUZZ_SECONDS").ok().map(|s| {
        s.parse()
            .expect("KVROUTE_FUZZ_SECONDS is a number of seconds")
    });
    let check = |input| {
        let result = check(input);
        prop_assert_eq!(PANICS.load(Ordering::SeqCst), 0, "a router thread panicked");
        result
    };
    let Some(seconds) = seconds else {
        let mut runner = runner(CI_CASES);
        if let Err(e) = runner.run(&strategy, check) {
            panic!("fuzz {name}: {e}");
        }
        return;
    };
    const CHUNK: u32 = 256;
    let start = Instant::now();
    let mut tried: u64 = 0;
    while start.elapsed() < Duration::from_secs(seconds) {
        let mut runner = runner(CHUNK);
        if let Err(e) = runner.run(&strategy, check) {
            panic!("fuzz {name}: after {tried} inputs: {e}");
        }
        tried += u64::from(CHUNK);
    }
    println!(
        "fuzz {name}: {tried} inputs in {:.0} s, no failure",
        start.elapsed().as_secs_f64()
    );
}

/// Random bytes, or a valid encoding of `structured`, as it is or cut short
/// or with bytes flipped.
fn bytes_like<T: Message + std::fmt::Debug + 'static>(
    structured: BoxedStrategy<T>,
) -> BoxedStrategy<Vec<u8>> {
    let mutated = (
        structured.clone(),
        prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 0..4),
        any::<prop::sample::Index>(),
        any::<bool>(),
    )
        .prop_map(|(message, flips, cut, truncate)| {
            let mut bytes = message.encode_to_vec();
            if !bytes.is_empty() {
                for (at, byte) in flips {
                    let at = at.index(bytes.len());
                    bytes[at] ^= byte;
                }
                if truncate {
                    bytes.truncate(cut.index(bytes.len()));
                }
            }
            bytes
        });
    prop_oneof![
        2 => prop::collection::vec(any::<u8>(), 0..200),
        3 => structured.prop_map(|message| message.encode_to_vec()),
        3 => mutated,
    ]
    .boxed()
}

// ------------------------------------------------------------- the router

/// An in-process router with worker 1 registered over gRPC, holding one chain.
struct Fixture {
    runtime: tokio::runtime::Runtime,
    router: Running,
    worker: TestWorker,
    _stream: GrpcWorker,
    /// Worker 1's index as `/workers/1` reported it once its chain was in.
    indexed: Value,
}

impl Fixture {
    fn start() -> Self {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        let (router, worker, stream, indexed) = runtime.block_on(async {
            let mut config = Config {
                http_addr: ([127, 0, 0, 1], 0).into(),
                grpc_addr: ([127, 0, 0, 1], 0).into(),
                ..Config::default()
            };
            // Streams the fuzzer opens leave the registry soon after they end.
            config.ingest.grace_period_ms = 50;
            let router = server::start(config).await.unwrap();
            let worker = TestWorker::start(1).await;
            let grpc = format!("http://{}", router.grpc_addr);
            let registration = common::register(1, &worker.url, &["m"], common::BLOCK_SIZE as u32);
            let mut stream = GrpcWorker::connect(&grpc, None, registration)
                .await
                .unwrap();
            stream
                .store(&common::tokens(0, 8 * common::BLOCK_SIZE))
                .await;
            let http = Http::default();
            let url = format!("http://{}/workers/1", router.http_addr);
            common::eventually("worker 1's chain is indexed", || async {
                http.get(&url).await.json()["index"][0]["indexed_blocks"] == 8
            })
            .await;
            let indexed = http.get(&url).await.json()["index"].clone();
            (router, worker, stream, indexed)
        });
        Fixture {
            runtime,
            router,
            worker,
            _stream: stream,
            indexed,
        }
    }

    fn http(&self) -> String {
        format!("http://{}", self.router.http_addr)
    }

    /// A gRPC client that sends and receives raw bytes ([`RawCodec`]).
    async fn grpc(&self) -> tonic::client::Grpc<tonic::transport::Channel> {
        let url = format!("http://{}", self.router.grpc_addr);
        let channel = tonic::transport::Endpoint::from_shared(url)
            .unwrap()
            .connect()
            .await
            .unwrap();
        let mut grpc = tonic::client::Grpc::new(channel);
        grpc.ready().await.unwrap();
        grpc
    }

    /// Worker 1 still holds exactly its chain, and the router answers.
    async fn undisturbed(&self) -> Result<(), TestCaseError> {
        let reply = Http::default()
            .get(&format!("{}/workers/1", self.http()))
            .await;
        prop_assert_eq!(reply.status, 200);
        prop_assert_eq!(&reply.json()["index"], &self.indexed);
        Ok(())
    }
}

/// Passes bytes through unchanged both ways, so the router's own decoder is
/// the one that meets the fuzzed bytes.
struct RawCodec;

impl Codec for RawCodec {
    type Encode = Bytes;
    type Decode = Bytes;
    type Encoder = RawCodec;
    type Decoder = RawCodec;
    fn encoder(&mut self) -> RawCodec {
        RawCodec
    }
    fn decoder(&mut self) -> RawCodec {
        RawCodec
    }
}

impl Encoder for RawCodec {
    type Item = Bytes;
    type Error = tonic::Status;
    fn encode(&mut self, item: Bytes, dst: &mut EncodeBuf<'_>) -> Result<(), tonic::Status> {
        dst.put(item);
        Ok(())
    }
}

impl Decoder for RawCodec {
    type Item = Bytes;
    type Error = tonic::Status;
    fn decode(&mut self, src: &mut DecodeBuf<'_>) -> Result<Option<Bytes>, tonic::Status> {
        Ok(Some(src.copy_to_bytes(src.remaining())))
    }
}

/// `payload` as field `field` of an enclosing message (a `WorkerMessage` body).
fn wrap(field: u32, payload: &[u8]) -> Bytes {
    let mut out = Vec::new();
    prost::encoding::encode_key(field, prost::encoding::WireType::LengthDelimited, &mut out);
    prost::encoding::encode_varint(payload.len() as u64, &mut out);
    out.extend_from_slice(payload);
    out.into()
}

/// Fuzzed streams register as these ids, never as worker 1.
static NEXT_ID: AtomicU64 = AtomicU64::new(1000);

/// Opens a raw stream with `messages` (encoded `WorkerMessage`s), closes its
/// sending side and reads the router's answers to the end.
async fn raw_stream(fixture: &Fixture, messages: Vec<Bytes>) -> Result<(), TestCaseError> {
    let mut grpc = fixture.grpc().await;
    let path = http::uri::PathAndQuery::from_static("/kvroute.v1.KvRouter/Stream");
    let request = tonic::Request::new(tokio_stream::iter(messages));
    let answers = tokio::time::timeout(Duration::from_secs(10), async {
        let mut answers = grpc.streaming(request, path, RawCodec).await?.into_inner();
        while answers.message().await?.is_some() {}
        Ok::<_, tonic::Status>(())
    })
    .await;
    match answers {
        Err(_) => prop_assert!(false, "the stream did not end within 10 s"),
        Ok(Err(status)) => prop_assert!(!status.message().is_empty(), "{:?}", status),
        Ok(Ok(())) => {}
    }
    fixture.undisturbed().await
}

fn fuzz_ingest(name: &str, field: u32, payload: BoxedStrategy<Vec<u8>>) {
    let fixture = Fixture::start();
    fuzz(name, payload, |bytes| {
        fixture.runtime.block_on(async {
            let mut messages = Vec::new();
            if field != 1 {
                let id = NEXT_ID.fetch_add(1, Ordering::Relaxed);
                let registration = common::register(id, "http://127.0.0.1:9", &["m"], 16);
                messages.push(wrap(1, &registration.encode_to_vec()));
            } else if Register::decode(bytes.as_slice()).is_ok_and(|r| r.worker_id == 1) {
                // Taking over a live id is a registration rule, not a decoding one.
                return Ok(());
            }
            messages.push(wrap(field, &bytes));
            raw_stream(&fixture, messages).await
        })
    });
}

fn event_id() -> impl Strategy<Value = u64> {
    prop_oneof![0..4u64, Just(u64::MAX), any::<u64>()]
}

fn stored() -> impl Strategy<Value = Stored> {
    (
        prop::option::of(prop_oneof![0..4u64, any::<u64>()]),
        prop::collection::vec((0..8u64, any::<u64>()), 0..6),
    )
        .prop_map(|(parent_hash, blocks)| Stored {
            parent_hash,
            blocks: blocks
                .into_iter()
                .map(|(block_hash, tokens_hash)| StoredBlock {
                    block_hash,
                    tokens_hash,
                })
                .collect(),
        })
}

fn event() -> impl Strategy<Value = KvEvent> {
    let kind = prop_oneof![
        stored().prop_map(kv_event::Kind::Stored),
        prop::collection::vec(0..8u64, 0..4)
            .prop_map(|block_hashes| kv_event::Kind::Removed(Removed { block_hashes })),
        Just(kv_event::Kind::Cleared(Cleared {})),
    ];
    (event_id(), prop::option::of(kind)).prop_map(|(event_id, kind)| KvEvent {
        tier: Default::default(),
        event_id,
        kind,
    })
}

/// Mostly the registered rank 0, so that events reach the index.
fn dp_rank() -> impl Strategy<Value = u32> {
    prop_oneof![4 => Just(0), 1 => Just(1), 1 => Just(u32::MAX)]
}

#[test]
fn fuzz_register() {
    let register = (
        prop_oneof![Just(0u64), 2..10u64, any::<u64>()],
        prop::collection::vec(dp_rank(), 0..4),
        prop::collection::vec("[a-z\u{0}-\u{7f}]{0,8}", 0..3),
        "(http://)?[a-z0-9:./]{0,20}",
        prop_oneof![Just(16u32), any::<u32>()],
        any::<u64>(),
        prop_oneof![Just(0u64), any::<u64>()],
    )
        .prop_map(
            |(worker_id, dp_ranks, models, base_url, block_size, total_kv_blocks, instance_id)| {
                Register {
                    worker_id,
                    dp_ranks,
                    lora_names: models.iter().rev().cloned().collect(),
                    models,
                    base_url,
                    block_size,
                    total_kv_blocks,
                    instance_id,
                    tokenizer: None,
                    ..Default::default()
                }
            },
        );
    fuzz_ingest("ingest Register", 1, bytes_like(register.boxed()));
}

#[test]
fn fuzz_event_batch() {
    let batch = (dp_rank(), prop::collection::vec(event(), 0..6))
        .prop_map(|(dp_rank, events)| EventBatch { dp_rank, events });
    fuzz_ingest("ingest EventBatch", 2, bytes_like(batch.boxed()));
}

#[test]
fn fuzz_load_report() {
    let load = (
        dp_rank(),
        any::<u32>(),
        any::<u32>(),
        any::<u64>(),
        any::<u64>(),
    )
        .prop_map(
            |(dp_rank, running_requests, queued_requests, kv_blocks_used, kv_blocks_total)| {
                LoadReport {
                    dp_rank,
                    running_requests,
                    queued_requests,
                    kv_blocks_used,
                    kv_blocks_total,
                    ..LoadReport::default()
                }
            },
        );
    fuzz_ingest("ingest LoadReport", 3, bytes_like(load.boxed()));
}

#[test]
fn fuzz_dump() {
    let dump = (dp_rank(), event_id(), prop::collection::vec(stored(), 0..6)).prop_map(
        |(dp_rank, last_event_id, chains)| Dump {
            dp_rank,
            last_event_id,
            chains,
            more: false,
            offload_chains: Vec::new(),
        },
    );
    fuzz_ingest("ingest Dump", 4, bytes_like(dump.boxed()));
}

#[test]
fn fuzz_digest() {
    let digest = (dp_rank(), event_id(), any::<u64>(), any::<u64>()).prop_map(
        |(dp_rank, last_event_id, block_count, block_set_hash)| kvroute_proto::Digest {
            dp_rank,
            last_event_id,
            block_count,
            block_set_hash,
        },
    );
    fuzz_ingest("ingest Digest", 5, bytes_like(digest.boxed()));
}

#[test]
fn fuzz_route_rpc() {
    let fixture = Fixture::start();
    let request = (
        prop_oneof![Just("m".to_string()), ".{0,6}"],
        prop::collection::vec(any::<u32>(), 0..64),
    )
        .prop_map(|(model, ids)| kvroute_proto::RouteRequest {
            model,
            input: Some(kvroute_proto::route_request::Input::TokenIds(
                kvroute_proto::TokenIds { ids },
            )),
            ..Default::default()
        });
    fuzz("Route RPC", bytes_like(request.boxed()), |bytes| {
        fixture.runtime.block_on(async {
            let mut grpc = fixture.grpc().await;
            let path = http::uri::PathAndQuery::from_static("/kvroute.v1.KvRouter/Route");
            let request = tonic::Request::new(Bytes::from(bytes));
            if let Err(status) = grpc.unary(request, path, RawCodec).await {
                prop_assert!(!status.message().is_empty(), "{:?}", status);
            }
            fixture.undisturbed().await
        })
    });
}

// ---------------------------------------------------------------- HTTP API

/// JSON values with the awkward cases: huge and negative numbers, deep nesting.
fn json_value() -> impl Strategy<Value = String> {
    let leaf = prop_oneof![
        Just("null".to_string()),
        any::<bool>().prop_map(|b| b.to_string()),
        any::<i64>().prop_map(|n| n.to_string()),
        any::<f64>().prop_map(|f| serde_json::json!(f).to_string()),
        prop::sample::select(vec![
            "1e400",
            "-1e400",
            "18446744073709551616",
            "-1",
            "0.5",
            "4294967296",
            "\"\"",
            "\"m\"",
            "\"\\u0000\"",
            "\"\\ud800\"",
        ])
        .prop_map(str::to_string),
        ".{0,12}".prop_map(|s| serde_json::json!(s).to_string()),
    ];
    leaf.prop_recursive(4, 32, 6, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..6).prop_map(|v| format!("[{}]", v.join(","))),
            prop::collection::vec(
                (
                    prop::sample::select(vec![
                        "model",
                        "prompt",
                        "messages",
                        "role",
                        "content",
                        "max_tokens",
                        "stream",
                        "cache_salt",
                        "x",
                    ]),
                    inner
                ),
                0..6
            )
            .prop_map(|fields| {
                let fields: Vec<String> =
                    fields.iter().map(|(k, v)| format!("\"{k}\":{v}")).collect();
                format!("{{{}}}", fields.join(","))
            }),
        ]
    })
}

/// Whole request bodies: well-formed requests with one field replaced, any
/// JSON, deep nesting, huge arrays, and bytes that are not JSON.
fn json_body() -> impl Strategy<Value = String> {
    prop_oneof![
        3 => (
            prop::sample::select(vec!["model", "prompt", "messages", "max_tokens", "stream"]),
            json_value()
        )
            .prop_map(|(field, value)| {
                let mut body = serde_json::json!({
                    "model": "m",
                    "prompt": [1, 2, 3],
                    "messages": [{"role": "user", "content": "hi"}],
                    "max_tokens": 2,
                });
                body[field] = Value::Null;
                body.to_string().replace(&format!("\"{field}\":null"), &format!("\"{field}\":{value}"))
            }),
        2 => json_value(),
        1 => (1..100_000usize, prop::sample::select(vec!["[", "{\"a\":"])).prop_map(|(depth, open)| open.repeat(depth)),
        1 => (1..200_000usize).prop_map(|n| format!(
            "{{\"model\":\"m\",\"max_tokens\":1,\"prompt\":[{}1]}}",
            "4294967295,".repeat(n)
        )),
        1 => prop::collection::vec(any::<u8>(), 0..64)
            .prop_map(|b| String::from_utf8_lossy(&b).into_owned()),
    ]
}

#[test]
fn fuzz_http_api() {
    let fixture = Fixture::start();
    let http = Http::default();
    let paths = prop::sample::select(vec!["/v1/route", "/v1/completions", "/v1/chat/completions"]);
    fuzz("HTTP API", (paths, json_body()), |(path, body)| {
        fixture.runtime.block_on(async {
            let url = format!("{}{path}", fixture.http());
            let forwarded = fixture.worker.received();
            let reply = http.call("POST", &url, &[], body).await;
            let status = reply.status.as_u16();
            prop_assert!(status < 500, "{} {}", status, reply.text());
            // The router's own refusals are JSON; a worker's answer passes through as it is.
            if status >= 400 && fixture.worker.received() == forwarded {
                let error: Value = serde_json::from_slice(&reply.body)
                    .map_err(|e| TestCaseError::fail(format!("{status}, not JSON: {e}")))?;
                prop_assert!(error.get("error").is_some(), "{}", error);
            }
            fixture.undisturbed().await
        })
    });
}

// ---------------------------------------------------------- bridge decoder

/// msgpack values, random and shaped like vLLM's event batches.
fn msgpack() -> impl Strategy<Value = rmpv::Value> {
    use rmpv::Value as V;
    let leaf = prop_oneof![
        Just(V::Nil),
        any::<bool>().prop_map(V::from),
        any::<i64>().prop_map(V::from),
        any::<u64>().prop_map(V::from),
        any::<f64>().prop_map(V::from),
        prop::sample::select(vec![
            "BlockStored",
            "BlockRemoved",
            "AllBlocksCleared",
            "events",
            "data_parallel_rank",
            "block_hashes",
            "token_ids",
            "parent_block_hash",
            "",
        ])
        .prop_map(V::from),
        prop::collection::vec(any::<u8>(), 0..40).prop_map(V::Binary),
    ];
    let value = leaf.prop_recursive(4, 48, 6, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..7).prop_map(V::Array),
            prop::collection::vec((inner.clone(), inner), 0..5).prop_map(V::Map),
        ]
    });
    let event = (
        prop::sample::select(vec!["BlockStored", "BlockRemoved", "AllBlocksCleared"]),
        prop::collection::vec(value.clone(), 0..8),
    )
        .prop_map(|(tag, mut fields)| {
            fields.insert(0, V::from(tag));
            V::Array(fields)
        });
    let batch = (
        value.clone(),
        prop::collection::vec(event, 0..4),
        value.clone(),
    )
        .prop_map(|(ts, events, rank)| V::Array(vec![ts, V::Array(events), rank]));
    prop_oneof![value, batch]
}

#[test]
fn fuzz_bridge_decoder() {
    let payload = prop_oneof![
        prop::collection::vec(any::<u8>(), 0..128),
        msgpack().prop_map(|v| {
            let mut bytes = Vec::new();
            rmpv::encode::write_value(&mut bytes, &v).unwrap();
            bytes
        }),
    ];
    fuzz("bridge decoder", payload, |bytes| {
        if let Err(e) = kvroute_bridge::wire::decode_batch(&bytes) {
            prop_assert!(!e.to_string().is_empty());
            prop_assert!(!e.reason().is_empty());
        }
        Ok(())
    });
}

// ------------------------------------------------------------- config files

/// `(section, key)` pairs documented in config/router.toml.
fn documented_keys() -> Vec<(String, String)> {
    let text = include_str!("../config/router.toml");
    let mut section = String::new();
    let mut keys = BTreeSet::new();
    for line in text.lines() {
        let line = line.trim_start_matches('#').trim();
        if let Some(name) = line.strip_prefix('[').and_then(|l| l.strip_suffix(']')) {
            section = name
                .trim_start_matches('[')
                .trim_end_matches(']')
                .to_string();
        } else if let Some((key, _)) = line.split_once(" = ")
            && key.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
        {
            keys.insert((section.clone(), key.to_string()));
        }
    }
    keys.into_iter().collect()
}

fn config_text() -> impl Strategy<Value = Vec<u8>> {
    let keys = documented_keys();
    assert!(keys.len() > 10, "config/router.toml documents its keys");
    let value = prop_oneof![
        prop::sample::select(vec![
            "0",
            "-1",
            "18446744073709551615",
            "9223372036854775807",
            "1e400",
            "nan",
            "inf",
            "-inf",
            "true",
            "\"\"",
            "\"x\"",
            "\"127.0.0.1:0\"",
            "\"[::1]:99999\"",
            "[]",
            "[1, \"a\"]",
            "{}",
            "{ a = 1 }",
            "1979-05-27T07:32:00Z",
            "'''\n",
            "\"unterminated",
        ])
        .prop_map(str::to_string),
        any::<i64>().prop_map(|n| n.to_string()),
        any::<f64>().prop_map(|f| format!("{f:?}")),
        "\"[ -~]{0,10}\"",
    ];
    let line = (prop::sample::select(keys), value, any::<bool>()).prop_map(
        |((section, key), value, in_section)| {
            if in_section && !section.is_empty() {
                format!("[{section}]\n{key} = {value}\n")
            } else {
                format!("{key} = {value}\n")
            }
        },
    );
    prop_oneof![
        4 => prop::collection::vec(line, 0..6).prop_map(|lines| lines.concat().into_bytes()),
        1 => prop::collection::vec(any::<u8>(), 0..100),
        1 => "[ -~\n]{0,80}".prop_map(String::into_bytes),
    ]
}

#[test]
fn fuzz_config_files() {
    let dir = std::env::temp_dir().join(format!("kvroute-fuzz-config-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("router.toml");
    fuzz("config files", config_text(), |text| {
        std::fs::write(&path, &text).unwrap();
        if let Err(e) = Config::load(Some(&path), std::iter::empty()) {
            let message = e.to_string();
            prop_assert!(message.contains(&*path.to_string_lossy()), "{}", message);
            let is_toml =
                std::str::from_utf8(&text).is_ok_and(|t| t.parse::<toml::Table>().is_ok());
            if std::str::from_utf8(&text).is_ok() && !is_toml {
                prop_assert!(message.contains("line"), "{}", message);
            }
        }
        Ok(())
    });
    let _ = std::fs::remove_dir_all(&dir);
}

/// Found by `fuzz_config_files`: a value the types accept but the checks
/// refuse was reported without saying which file it came from.
#[test]
fn a_refused_config_value_names_its_file() {
    let dir = std::env::temp_dir().join(format!("kvroute-config-range-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("router.toml");
    std::fs::write(&path, "[scheduler]\noverlap_weight = -1\n").unwrap();
    let error = Config::load(Some(&path), std::iter::empty())
        .expect_err("a negative weight is refused")
        .to_string();
    let _ = std::fs::remove_dir_all(&dir);
    assert!(error.contains(&*path.to_string_lossy()), "{error}");
    assert!(error.contains("overlap_weight"), "{error}");
}
