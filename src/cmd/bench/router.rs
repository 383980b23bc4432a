//! `kvroute bench router`: the router's speed goals, measured in one run.
//!
//! 1. Routing decision latency (hash + match + schedule) for 8k- and 128k-token
//!    prompts over a fleet whose index holds ~1M blocks, with 64 and with 4,000
//!    registered workers; tokenization is measured separately.
//! 2. Routing throughput on one core for 8k-token text prompts, tokenization
//!    (tiktoken cl100k_base) included: parse nothing, but tokenize, hash, match,
//!    schedule, book and release, as the HTTP path does per request.
//! 3. Proxy overhead: small non-streaming responses from a stub worker, called
//!    directly and through a router started in-process, both over loopback.
//!
//! Everything runs in one process on a shared machine, so only ratios measured
//! in the same run are meaningful.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use bytes::Bytes;
use clap::Args;
use hdrhistogram::Histogram;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use kvroute_index::{BlockHasher, EventKind, KvEvent, StoredBlock, WorkerKey};
use kvroute_router::config::{StaticWorker, TokenizerConfig, TokenizerKind};
use kvroute_router::registry::{Registration, Source};
use kvroute_router::state::{AppState, RouteInput};
use kvroute_router::{Config, server};

#[derive(Args)]
pub struct BenchRouterArgs {
    /// Routing decisions measured per scenario.
    #[arg(long, default_value_t = 2000)]
    decisions: usize,
    /// Blocks indexed across the fleet.
    #[arg(long, default_value_t = 1_000_000)]
    indexed_blocks: usize,
    /// Requests per proxy measurement.
    #[arg(long, default_value_t = 4000)]
    proxy_requests: usize,
    /// Tokenized requests for the throughput measurement.
    #[arg(long, default_value_t = 300)]
    throughput_requests: usize,
}

const BLOCK_SIZE: usize = 16;
const MODEL: &str = "bench";

/// A small deterministic generator (no seeding from the OS: runs are repeatable).
struct Lcg(u64);

impl Lcg {
    fn next(&mut self) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        self.0 >> 33
    }

    fn tokens(&mut self, n: usize) -> Vec<u32> {
        (0..n).map(|_| (self.next() % 100_000) as u32).collect()
    }
}

fn quiet_config() -> Config {
    let mut config = Config {
        http_addr: ([127, 0, 0, 1], 0).into(),
        grpc_addr: ([127, 0, 0, 1], 0).into(),
        ..Config::default()
    };
    config.upstream.health_interval_ms = 0;
    config
}

fn summary(name: &str, h: &Histogram<u64>) -> String {
    format!(
        "{name}: p50 {:.1} µs, p99 {:.1} µs, max {:.1} µs (n={})",
        h.value_at_quantile(0.5) as f64 / 1000.0,
        h.value_at_quantile(0.99) as f64 / 1000.0,
        h.max() as f64 / 1000.0,
        h.len()
    )
}

pub fn run(args: BenchRouterArgs) -> anyhow::Result<()> {
    for (workers, prompt_tokens) in [
        (64, 8 * 1024),
        (64, 128 * 1024),
        (4000, 8 * 1024),
        (4000, 128 * 1024),
    ] {
        decision_latency(&args, workers, prompt_tokens)?;
    }
    throughput(&args)?;
    let runtime = tokio::runtime::Runtime::new().context("cannot start the async runtime")?;
    runtime.block_on(proxy_overhead(&args))
}

/// Registers `n` streamed workers serving [`MODEL`].
fn register_workers(state: &AppState, n: u64) -> anyhow::Result<()> {
    for id in 0..n {
        state
            .registry
            .register(
                Registration {
                    worker_id: id,
                    dp_ranks: vec![0],
                    models: vec![MODEL.into()],
                    lora_names: Vec::new(),
                    base_url: format!("http://127.0.0.1:{}", 10_000 + id),
                    total_kv_blocks: 1 << 20,
                },
                Source::Stream,
            )
            .map_err(anyhow::Error::msg)?;
    }
    Ok(())
}

/// Routes `tokens` as the proxy does: decide, record the prediction, book the
/// load (released at once, as if the response were instant).
fn route_and_book(state: &AppState, tokens: &[u32]) -> anyhow::Result<WorkerKey> {
    let routed = state
        .route_now(MODEL, RouteInput::Tokens(tokens), None, &[])?
        .map_err(|e| anyhow::anyhow!("no worker: {e:?}"))?;
    let decision = routed.decision;
    state
        .predicted
        .record(decision.worker, &routed.local_hashes, Instant::now());
    drop(state.registry.book(
        decision.worker,
        decision.new_prefill_tokens,
        decision.request_blocks,
    ));
    Ok(decision.worker)
}

/// Token sequences of cached chains, with the worker holding each.
type HeldChains = Vec<(u64, Vec<u32>)>;

/// A fleet of `workers` ranks whose chains add up to `indexed_blocks`, and the
/// chains' token sequences, so that requests can share real prefixes.
fn build_fleet(
    args: &BenchRouterArgs,
    workers: u64,
    chain_tokens: usize,
) -> anyhow::Result<(Arc<AppState>, HeldChains)> {
    let state = AppState::new(quiet_config(), None, None)?;
    let hasher = BlockHasher::new(BLOCK_SIZE);
    register_workers(&state, workers)?;
    let blocks_per_chain = chain_tokens / BLOCK_SIZE;
    let chains = args.indexed_blocks.div_ceil(blocks_per_chain);
    let mut rng = Lcg(7);
    let mut held = Vec::new();
    let mut next_event = vec![0u64; workers as usize];
    for chain in 0..chains {
        let worker = chain as u64 % workers;
        let tokens = rng.tokens(chain_tokens);
        let blocks = hasher
            .local_hashes(&tokens)
            .into_iter()
            .enumerate()
            .map(|(i, tokens_hash)| StoredBlock {
                block_hash: ((chain as u64) << 24) | i as u64,
                tokens_hash,
            })
            .collect();
        let event_id = &mut next_event[worker as usize];
        state.index.apply(
            WorkerKey::new(worker, 0),
            &KvEvent {
                event_id: *event_id,
                kind: EventKind::Stored {
                    parent_hash: None,
                    blocks,
                },
            },
        );
        *event_id += 1;
        if held.len() < 256 {
            held.push((worker, tokens));
        }
    }
    Ok((state, held))
}

fn decision_latency(
    args: &BenchRouterArgs,
    workers: u64,
    prompt_tokens: usize,
) -> anyhow::Result<()> {
    let started = Instant::now();
    // Chains as long as the prompts' shared half, so requests find real prefixes.
    let (state, held) = build_fleet(args, workers, (prompt_tokens / 2).min(4096))?;
    let stats = state.index.stats();
    println!(
        "\n== decision: {workers} workers, {prompt_tokens}-token prompts, {} blocks indexed ({} memberships), built in {:.1} s",
        stats.blocks,
        stats.memberships,
        started.elapsed().as_secs_f64()
    );
    let mut rng = Lcg(11);
    let mut total = Histogram::<u64>::new(3)?;
    let mut hash_only = Histogram::<u64>::new(3)?;
    let mut index_only = Histogram::<u64>::new(3)?;
    let mut predicted_only = Histogram::<u64>::new(3)?;
    let mut rest = Histogram::<u64>::new(3)?;
    let hasher = BlockHasher::new(BLOCK_SIZE);
    let mut matched = 0usize;
    for i in 0..args.decisions {
        // Half the prompt is a cached chain's prefix, the rest is new.
        let (owner, chain) = &held[i % held.len()];
        let mut prompt: Vec<u32> = chain
            .iter()
            .copied()
            .cycle()
            .take(prompt_tokens / 2)
            .collect();
        prompt.extend(rng.tokens(prompt_tokens - prompt.len()));
        let t = Instant::now();
        let local = hasher.local_hashes(&prompt);
        let hash_ns = t.elapsed().as_nanos() as u64;
        hash_only.record(hash_ns)?;
        let t = Instant::now();
        std::hint::black_box(state.index.find_matches(&local));
        let index_ns = t.elapsed().as_nanos() as u64;
        index_only.record(index_ns)?;
        let t = Instant::now();
        std::hint::black_box(state.predicted.find_matches(&local, Instant::now()));
        let predicted_ns = t.elapsed().as_nanos() as u64;
        predicted_only.record(predicted_ns)?;
        let t = Instant::now();
        let worker = route_and_book(&state, &prompt)?;
        let total_ns = t.elapsed().as_nanos() as u64;
        total.record(total_ns)?;
        rest.record(total_ns.saturating_sub(hash_ns + index_ns + predicted_ns))?;
        matched += (worker.worker_id == *owner) as usize;
    }
    println!("{}", summary("  hash only", &hash_only));
    println!("{}", summary("  KvIndex::find_matches only", &index_only));
    println!(
        "{}",
        summary("  PredictedIndex::find_matches only", &predicted_only)
    );
    println!(
        "{}",
        summary(
            "  decision (hash + match + schedule + record + book)",
            &total
        )
    );
    println!(
        "{}",
        summary(
            "  the rest (schedule + record + book: decision minus the three above)",
            &rest
        )
    );
    println!(
        "  routed to the prefix's owner: {matched}/{} (target p99 ≤ 100 µs at 8k tokens: {})",
        args.decisions,
        if total.value_at_quantile(0.99) <= 100_000 {
            "met"
        } else {
            "MISSED"
        }
    );
    Ok(())
}

/// English-looking text of about `words` words (≈ one cl100k token each).
fn text(rng: &mut Lcg, words: usize) -> String {
    const WORDS: [&str; 32] = [
        "the", "cache", "router", "worker", "prefix", "token", "block", "model", "request", "load",
        "time", "first", "stream", "event", "index", "score", "quick", "brown", "fox", "jumps",
        "over", "lazy", "dog", "and", "then", "some", "more", "text", "with", "many", "plain",
        "words",
    ];
    let mut s = String::with_capacity(words * 6);
    for _ in 0..words {
        s.push(' ');
        s.push_str(WORDS[(rng.next() % WORDS.len() as u64) as usize]);
    }
    s
}

fn throughput(args: &BenchRouterArgs) -> anyhow::Result<()> {
    let mut config = quiet_config();
    config.tokenizer = TokenizerConfig {
        kind: TokenizerKind::Tiktoken,
        path: String::new(),
        encoding: "cl100k_base".into(),
    };
    let tokenizer = kvroute_router::tokenize::Tokenizer::load(&config.tokenizer)?;
    let state = AppState::new(config, tokenizer, None)?;
    register_workers(&state, 64)?;
    let mut rng = Lcg(3);
    // 1,000 shared "system prompt" words, then ~7,200 unique ones: distinct texts, no cache hits.
    let system = text(&mut rng, 1000);
    let prompts: Vec<String> = (0..args.throughput_requests)
        .map(|_| format!("{system}{}", text(&mut rng, 7200)))
        .collect();
    let tokenizer = state.tokenizer.as_ref().expect("loaded above");
    let mut tokenize = Histogram::<u64>::new(3)?;
    let mut tokens_total = 0usize;
    let started = Instant::now();
    for prompt in &prompts {
        let t = Instant::now();
        let tokens = tokenizer.encode(prompt)?;
        tokenize.record(t.elapsed().as_nanos() as u64)?;
        tokens_total += tokens.len();
        route_and_book(&state, &tokens)?;
    }
    let elapsed = started.elapsed().as_secs_f64();
    let per_second = prompts.len() as f64 / elapsed;
    println!(
        "\n== throughput: {} text prompts of {} tokens on average, one thread",
        prompts.len(),
        tokens_total / prompts.len().max(1)
    );
    println!(
        "{}",
        summary("  tokenize (tiktoken cl100k_base)", &tokenize)
    );
    println!(
        "  routed {per_second:.0} requests/s on one core, tokenization included (target ≥ 1,500: {})",
        if per_second >= 1500.0 {
            "met"
        } else {
            "MISSED"
        }
    );
    Ok(())
}

/// A stub worker answering every POST with a small completion.
async fn stub_worker() -> anyhow::Result<std::net::SocketAddr> {
    let body: &'static str = r#"{"id":"cmpl-1","object":"text_completion","choices":[{"index":0,"text":"ok","finish_reason":"stop"}]}"#;
    let app = axum::Router::new()
        .route(
            "/v1/completions",
            axum::routing::post(move || async move {
                (
                    [(axum::http::header::CONTENT_TYPE, "application/json")],
                    body,
                )
            }),
        )
        .route("/health", axum::routing::get(|| async { "ok" }));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    tokio::spawn(async move { axum::serve(listener, app).await });
    Ok(addr)
}

type HttpClient = Client<HttpConnector, Full<Bytes>>;

async fn post(client: &HttpClient, url: &str, body: &Bytes) -> anyhow::Result<()> {
    let request = http::Request::post(url)
        .header("content-type", "application/json")
        .body(Full::new(body.clone()))?;
    let response = client.request(request).await?;
    anyhow::ensure!(
        response.status().is_success(),
        "status {}",
        response.status()
    );
    response.into_body().collect().await?;
    Ok(())
}

/// p50 latency (sequential) and throughput (16 concurrent clients) against `url`.
async fn measure(client: &HttpClient, url: &str, requests: usize) -> anyhow::Result<(f64, f64)> {
    let body = Bytes::from(
        serde_json::json!({"model": MODEL, "prompt": (0..64).collect::<Vec<u32>>(), "max_tokens": 1})
            .to_string(),
    );
    for _ in 0..200 {
        post(client, url, &body).await?;
    }
    let mut latency = Histogram::<u64>::new(3)?;
    for _ in 0..requests / 4 {
        let t = Instant::now();
        post(client, url, &body).await?;
        latency.record(t.elapsed().as_nanos() as u64)?;
    }
    let concurrency = 16;
    let started = Instant::now();
    let tasks: Vec<_> = (0..concurrency)
        .map(|_| {
            let client = client.clone();
            let url = url.to_string();
            let body = body.clone();
            tokio::spawn(async move {
                for _ in 0..requests / concurrency {
                    post(&client, &url, &body).await?;
                }
                anyhow::Ok(())
            })
        })
        .collect();
    for task in tasks {
        task.await??;
    }
    let throughput =
        (requests / concurrency * concurrency) as f64 / started.elapsed().as_secs_f64();
    Ok((latency.value_at_quantile(0.5) as f64 / 1000.0, throughput))
}

async fn proxy_overhead(args: &BenchRouterArgs) -> anyhow::Result<()> {
    let worker = stub_worker().await?;
    let mut config = quiet_config();
    config.log.level = "error".into();
    config.upstream.shutdown_grace_ms = 1000;
    config.workers = vec![StaticWorker {
        id: 1,
        base_url: format!("http://{worker}"),
        models: vec![MODEL.into()],
        lora_names: Vec::new(),
        dp_ranks: vec![0],
    }];
    let router = server::start(config).await?;
    let client: HttpClient = Client::builder(TokioExecutor::new())
        .pool_idle_timeout(Duration::from_secs(30))
        .build(HttpConnector::new());
    let direct = measure(
        &client,
        &format!("http://{worker}/v1/completions"),
        args.proxy_requests,
    )
    .await?;
    let proxied = measure(
        &client,
        &format!("http://{}/v1/completions", router.http_addr),
        args.proxy_requests,
    )
    .await?;
    println!(
        "\n== proxy: small non-streaming responses over loopback, client, router and worker in one process"
    );
    println!(
        "  direct:  p50 {:.0} µs, {:.0} requests/s (16 concurrent)",
        direct.0, direct.1
    );
    println!(
        "  proxied: p50 {:.0} µs, {:.0} requests/s (16 concurrent)",
        proxied.0, proxied.1
    );
    let added = proxied.0 - direct.0;
    let loss = 100.0 * (1.0 - proxied.1 / direct.1);
    println!(
        "  added p50 {added:.0} µs (target ≤ 300: {}), throughput loss {loss:.1}% (target ≤ 10%: {})",
        if added <= 300.0 { "met" } else { "MISSED" },
        if loss <= 10.0 { "met" } else { "MISSED" }
    );
    router.shutdown().await;
    Ok(())
}
