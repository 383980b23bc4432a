//! `kvroute-lab bench router`'s saturation measurement: how late streamed chunks
//! pass through the router, and how long a worker's events take to be
//! applied, while it tokenizes long text prompts as fast as it can.
//! Tokenization runs on a bounded pool of blocking threads, so the async
//! runtime that forwards the chunks and applies the events is never held up
//! by a prompt; only the CPU is shared.
//!
//! A stub worker streams chunks stamped with the time it sends them; the
//! client measures each chunk's delay (same process, same clock). A gRPC
//! worker sends Stored batches and times each until the router's ack for it
//! (sent once the batch is applied to the index). Both first with the router
//! idle, then while tasks keep it busy with 8k-token text prompts.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::Context;
use bytes::Bytes;
use futures_util::StreamExt;
use futures_util::stream::BoxStream;
use hdrhistogram::Histogram;
use http_body_util::{BodyExt, Full};
use kvroute_proto::kv_router_client::KvRouterClient;
use kvroute_proto::{
    EventBatch, KvEvent, Register, RouterMessage, Stored, StoredBlock, WorkerMessage, kv_event,
    router_message, worker_message,
};
use kvroute_router::server;

use super::fixture::{HttpClient, pooled_client, proxy_config};

/// Chunks per streamed response, and the worker's pause between them.
const CHUNKS: usize = 10;
const CHUNK_GAP: Duration = Duration::from_millis(2);

/// A stub worker: `/v1/completions` streams [`CHUNKS`] SSE chunks stamped with
/// the nanoseconds since `epoch` when `"stream":true`, else a small completion.
async fn streaming_stub(epoch: Instant) -> anyhow::Result<std::net::SocketAddr> {
    let app = axum::Router::new()
        .route(
            "/v1/completions",
            axum::routing::post(move |body: Bytes| async move {
                use axum::response::IntoResponse;
                if !body.windows(13).any(|w| w == b"\"stream\":true") {
                    return (
                        [(axum::http::header::CONTENT_TYPE, "application/json")],
                        r#"{"choices":[{"text":"ok"}]}"#,
                    )
                        .into_response();
                }
                let chunks = futures_util::stream::unfold(0, move |i| async move {
                    if i == CHUNKS {
                        return None;
                    }
                    tokio::time::sleep(CHUNK_GAP).await;
                    let stamp = epoch.elapsed().as_nanos();
                    let chunk = Bytes::from(format!("data: {stamp}\n\n"));
                    Some((Ok::<_, std::convert::Infallible>(chunk), i + 1))
                });
                (
                    [(axum::http::header::CONTENT_TYPE, "text/event-stream")],
                    axum::body::Body::from_stream(chunks),
                )
                    .into_response()
            }),
        )
        .route("/health", axum::routing::get(|| async { "ok" }));
    serve_stub(app).await
}

/// Serves a stub worker's `app` on a loopback port, in the background.
pub(super) async fn serve_stub(app: axum::Router) -> anyhow::Result<std::net::SocketAddr> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    // Nagle's algorithm would hold back each small chunk for the last one's ACK.
    let listener = axum::serve::ListenerExt::tap_io(listener, |tcp| {
        let _ = tcp.set_nodelay(true);
    });
    tokio::spawn(async move { axum::serve(listener, app).await });
    Ok(addr)
}

/// Streams `requests` responses one after another and records each chunk's
/// delay from the worker's stamp to its arrival here.
async fn chunk_delays(
    client: &HttpClient,
    url: &str,
    epoch: Instant,
    requests: usize,
) -> anyhow::Result<Histogram<u64>> {
    let body = Bytes::from(r#"{"model":"bench","prompt":[1,2,3,4],"stream":true}"#);
    let mut delays = Histogram::<u64>::new(3)?;
    for _ in 0..requests {
        let request = http::Request::post(url)
            .header("content-type", "application/json")
            .body(Full::new(body.clone()))?;
        let mut response = client.request(request).await?.into_body();
        while let Some(frame) = response.frame().await {
            let arrived = epoch.elapsed().as_nanos() as u64;
            let Ok(data) = frame?.into_data() else {
                continue;
            };
            for line in data.split(|&b| b == b'\n') {
                if let Some(stamp) = line.strip_prefix(b"data: ") {
                    let stamp: u64 = std::str::from_utf8(stamp)?.trim().parse()?;
                    delays.record(arrived.saturating_sub(stamp))?;
                }
            }
        }
    }
    Ok(delays)
}

/// Stored batches per ingest measurement, blocks per batch, and the pause between batches.
const BATCHES: usize = 100;
const BATCH_BLOCKS: u64 = 32;
const BATCH_GAP: Duration = Duration::from_millis(3);

/// A worker's event stream to the router, for timing batches to their acks.
struct IngestProbe {
    events: tokio::sync::mpsc::Sender<WorkerMessage>,
    acks: BoxStream<'static, anyhow::Result<RouterMessage>>,
    next_event: u64,
}

impl IngestProbe {
    /// Registers worker 1,000,000 serving a model nobody requests.
    async fn connect(grpc: std::net::SocketAddr) -> anyhow::Result<Self> {
        let mut client = KvRouterClient::connect(format!("http://{grpc}")).await?;
        let (events, mut rx) = tokio::sync::mpsc::channel(16);
        events
            .send(WorkerMessage {
                body: Some(worker_message::Body::Register(Register {
                    worker_id: 1_000_000,
                    dp_ranks: vec![0],
                    models: vec!["ingest-probe".into()],
                    base_url: "http://127.0.0.1:9".into(),
                    block_size: 16,
                    total_kv_blocks: 1 << 20,
                    instance_id: 1,
                    ..Default::default()
                })),
            })
            .await?;
        let outgoing = futures_util::stream::poll_fn(move |cx| rx.poll_recv(cx));
        let acks = client
            .stream(outgoing)
            .await?
            .into_inner()
            .map(|message| message.map_err(|status| anyhow::anyhow!("{status}")))
            .boxed();
        Ok(IngestProbe {
            events,
            acks,
            next_event: 0,
        })
    }

    /// Sends [`BATCHES`] Stored batches and records each one's time to its ack.
    async fn measure(&mut self) -> anyhow::Result<Histogram<u64>> {
        let mut latency = Histogram::<u64>::new(3)?;
        for _ in 0..BATCHES {
            let event_id = self.next_event;
            self.next_event += 1;
            let first = event_id * BATCH_BLOCKS;
            let blocks = (first..first + BATCH_BLOCKS)
                .map(|h| StoredBlock {
                    block_hash: h + 1,
                    tokens_hash: h.wrapping_mul(0x9e37_79b9_7f4a_7c15),
                })
                .collect();
            let parent_hash = (first > 0).then_some(first);
            let batch = EventBatch {
                dp_rank: 0,
                events: vec![KvEvent {
                    tier: Default::default(),
                    event_id,
                    kind: Some(kv_event::Kind::Stored(Stored {
                        parent_hash,
                        blocks,
                    })),
                }],
            };
            let sent = Instant::now();
            self.events
                .send(WorkerMessage {
                    body: Some(worker_message::Body::Events(batch)),
                })
                .await?;
            loop {
                let message = self
                    .acks
                    .next()
                    .await
                    .context("the router closed the event stream")??;
                if let Some(router_message::Body::Ack(ack)) = message.body
                    && ack.last_event_id >= event_id
                {
                    break;
                }
            }
            latency.record(sent.elapsed().as_nanos() as u64)?;
            tokio::time::sleep(BATCH_GAP).await;
        }
        Ok(latency)
    }
}

fn summary(h: &Histogram<u64>) -> String {
    format!(
        "p50 {:.0} µs, p99 {:.0} µs, max {:.0} µs (n={})",
        h.value_at_quantile(0.5) as f64 / 1000.0,
        h.value_at_quantile(0.99) as f64 / 1000.0,
        h.max() as f64 / 1000.0,
        h.len()
    )
}

/// Chunk delays idle and with `loaders` tasks sending `prompts` (text, ~8k
/// tokens each) back to back.
pub(super) async fn sse_while_tokenizing(
    prompts: Vec<String>,
    loaders: usize,
) -> anyhow::Result<()> {
    let epoch = Instant::now();
    let worker = streaming_stub(epoch).await?;
    let mut config = proxy_config(&format!("http://{worker}"));
    config.tokenizer = "tiktoken:cl100k_base".parse()?;
    // No cache of recent prompts: the load repeats a few prompts, and each
    // must be tokenized whole to load the tokenizing threads as fresh text would.
    config.tokenizer_cache_tokens = 0;
    let router = server::start(config).await?;
    let url = format!("http://{}/v1/completions", router.http_addr);
    let client = pooled_client();
    chunk_delays(&client, &url, epoch, 20).await?;
    let idle = chunk_delays(&client, &url, epoch, 100).await?;
    let mut probe = IngestProbe::connect(router.grpc_addr).await?;
    let ingest_idle = probe.measure().await?;

    let bodies: Arc<Vec<Bytes>> = Arc::new(
        prompts
            .iter()
            .map(|p| Bytes::from(serde_json::json!({"model": "bench", "prompt": p}).to_string()))
            .collect(),
    );
    let stop = Arc::new(AtomicBool::new(false));
    let tokenized = Arc::new(AtomicUsize::new(0));
    let tasks: Vec<_> = (0..loaders)
        .map(|i| {
            let (client, url) = (client.clone(), url.clone());
            let (bodies, stop, tokenized) = (bodies.clone(), stop.clone(), tokenized.clone());
            tokio::spawn(async move {
                let mut next = i;
                while !stop.load(Ordering::Relaxed) {
                    let request = http::Request::post(&url)
                        .header("content-type", "application/json")
                        .body(Full::new(bodies[next % bodies.len()].clone()))?;
                    let response = client.request(request).await?;
                    anyhow::ensure!(response.status().is_success(), "{}", response.status());
                    response.into_body().collect().await?;
                    tokenized.fetch_add(1, Ordering::Relaxed);
                    next += loaders;
                }
                anyhow::Ok(())
            })
        })
        .collect();
    // Let the load reach its pace before measuring.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let started = (Instant::now(), tokenized.load(Ordering::Relaxed));
    let loaded = chunk_delays(&client, &url, epoch, 100).await?;
    let ingest_loaded = probe.measure().await?;
    let rate =
        (tokenized.load(Ordering::Relaxed) - started.1) as f64 / started.0.elapsed().as_secs_f64();
    stop.store(true, Ordering::Relaxed);
    for task in tasks {
        task.await.context("a load task panicked")??;
    }
    router.shutdown().await;
    println!(
        "\n== streamed chunks through the router while it tokenizes: {CHUNKS} chunks {} ms apart per response, delay from the worker's send to the client's receipt",
        CHUNK_GAP.as_millis()
    );
    println!("  router idle:        {}", summary(&idle));
    println!(
        "  tokenizing at saturation ({loaders} clients sending ~8k-token text prompts, {rate:.0} tokenized requests/s): {}",
        summary(&loaded)
    );
    println!(
        "== event ingest while it tokenizes: {BATCHES} Stored batches of {BATCH_BLOCKS} blocks, {} ms apart, from send to the router's ack (applied)",
        BATCH_GAP.as_millis()
    );
    println!("  router idle:        {}", summary(&ingest_idle));
    println!("  tokenizing at saturation: {}", summary(&ingest_loaded));
    Ok(())
}
