//! `kvroute bench router`'s saturation measurement: how late streamed chunks
//! pass through the router while it tokenizes long text prompts as fast as
//! it can. Tokenization runs on a bounded pool of blocking threads, so the
//! async runtime that forwards the chunks is never held up by a prompt; only
//! the CPU is shared.
//!
//! A stub worker streams chunks stamped with the time it sends them; the
//! client measures each chunk's delay (same process, same clock), first with
//! the router idle, then while tasks keep it busy with 8k-token text prompts.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::Context;
use bytes::Bytes;
use hdrhistogram::Histogram;
use http_body_util::{BodyExt, Full};
use kvroute_router::server;

use super::router::{HttpClient, pooled_client, proxy_config};

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
    let router = server::start(config).await?;
    let url = format!("http://{}/v1/completions", router.http_addr);
    let client = pooled_client();
    chunk_delays(&client, &url, epoch, 20).await?;
    let idle = chunk_delays(&client, &url, epoch, 100).await?;

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
    Ok(())
}
