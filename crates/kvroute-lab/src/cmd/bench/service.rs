//! `kvroute-lab bench service`: one router measured whole, at fleet scale.
//!
//! `kvroute serve` runs in its own process, so its memory and CPU are its own.
//! This process simulates the fleet cheaply instead of running thousands of
//! engines: `--workers` gRPC streams (over a few HTTP/2 connections, as a
//! fleet's bridges would each have one) register, store their share of
//! `--indexed-blocks` as chains of 16 blocks, then keep replacing one chain of
//! a worker at a time (a Removed and a Stored event in one batch) at
//! `--event-rate` batches per second. Every worker's base URL is one stub HTTP
//! worker answering at once.
//!
//! Two phases of `--seconds` each, one after the other: events alone, then
//! events while `--rate` token-id completions per second (open loop) are
//! routed through the router, each a stored chain's tokens and new ones after
//! them. Reported: the router's resident memory, its CPU per routed request
//! (the second phase's CPU less the first's, per request), and the
//! event-apply lag in each phase: from sending a batch to receiving the
//! router's ack of it, which the router sends once the batch is applied to its
//! index.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context;
use bytes::Bytes;
use clap::Args;
use hdrhistogram::Histogram;
use kvroute_index::BlockHasher;
use kvroute_proto::kv_router_client::KvRouterClient;
use kvroute_proto::{
    EventBatch, KvEvent, Register, Removed, Stored, StoredBlock, WorkerMessage, kv_event,
    router_message, worker_message,
};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;

use super::cpu_time::process_cpu_ns;
use super::fixture::{HttpClient, Lcg, pooled_client, post, stub_worker};
use super::soak::RouterProcess;

#[derive(Args)]
pub struct ServiceArgs {
    /// Simulated workers, one gRPC stream each.
    #[arg(long, default_value_t = 4000)]
    workers: u64,
    /// Blocks indexed across the fleet before routing starts.
    #[arg(long, default_value_t = 1_000_000)]
    indexed_blocks: usize,
    /// Routed requests per second in the second phase.
    #[arg(long, default_value_t = 1000.0)]
    rate: f64,
    /// Event batches per second across the fleet, in both phases.
    #[arg(long, default_value_t = 1000.0)]
    event_rate: f64,
    /// Length of each phase.
    #[arg(long, default_value_t = 20.0)]
    seconds: f64,
    /// Tokens per routed prompt (token ids, so no tokenizer runs).
    #[arg(long, default_value_t = 1024)]
    prompt_tokens: usize,
}

const BLOCK_SIZE: usize = 16;
const CHAIN_BLOCKS: usize = 16;
const MODEL: &str = "bench";
/// Workers per HTTP/2 connection to the router.
const STREAMS_PER_CONNECTION: usize = 100;

/// One simulated worker's side of its stream.
struct SimWorker {
    id: u64,
    tx: mpsc::Sender<WorkerMessage>,
    next_event: u64,
    next_block: u64,
    /// Its chains' engine block hashes, oldest first.
    chains: VecDeque<Vec<u64>>,
    /// Event ids sent and not yet acked, with when they were sent.
    unacked: Arc<Mutex<VecDeque<(u64, Instant)>>>,
}

/// Apply lags of acked batches, recorded while `recording`.
struct Lags {
    histogram: Mutex<Histogram<u64>>,
    recording: std::sync::atomic::AtomicBool,
    /// Workers whose every sent event is acked at least once.
    caught_up: std::sync::atomic::AtomicUsize,
}

fn message(body: worker_message::Body) -> WorkerMessage {
    WorkerMessage { body: Some(body) }
}

impl SimWorker {
    /// A chain of new blocks hashed from `tokens`.
    fn stored(&mut self, tokens: &[u32], hasher: &BlockHasher) -> KvEvent {
        let blocks: Vec<StoredBlock> = hasher
            .local_hashes(tokens)
            .into_iter()
            .map(|tokens_hash| {
                self.next_block += 1;
                StoredBlock {
                    block_hash: (self.id << 32) | self.next_block,
                    tokens_hash,
                }
            })
            .collect();
        self.chains
            .push_back(blocks.iter().map(|b| b.block_hash).collect());
        self.event(kv_event::Kind::Stored(Stored {
            parent_hash: None,
            blocks,
        }))
    }

    fn event(&mut self, kind: kv_event::Kind) -> KvEvent {
        self.next_event += 1;
        KvEvent {
            tier: Default::default(),
            event_id: self.next_event,
            kind: Some(kind),
        }
    }

    async fn send(&mut self, events: Vec<KvEvent>) -> anyhow::Result<()> {
        self.unacked
            .lock()
            .unwrap()
            .push_back((self.next_event, Instant::now()));
        let batch = EventBatch { dp_rank: 0, events };
        self.tx
            .send(message(worker_message::Body::Events(batch)))
            .await
            .context("the router closed a worker's stream")
    }
}

/// Opens `id`'s stream on `channel` and registers it; a task records the lag
/// of each ack.
async fn connect(
    channel: tonic::transport::Channel,
    id: u64,
    base_url: &str,
    lags: Arc<Lags>,
) -> anyhow::Result<SimWorker> {
    let (tx, rx) = mpsc::channel(64);
    let register = Register {
        worker_id: id,
        dp_ranks: vec![0],
        models: vec![MODEL.into()],
        base_url: base_url.to_string(),
        block_size: BLOCK_SIZE as u32,
        total_kv_blocks: 1 << 20,
        lora_names: Vec::new(),
        instance_id: 1,
        tokenizer: None,
        ..Default::default()
    };
    tx.send(message(worker_message::Body::Register(register)))
        .await?;
    let mut inbound = KvRouterClient::new(channel)
        .stream(ReceiverStream::new(rx))
        .await
        .with_context(|| format!("worker {id}: the router refused the stream"))?
        .into_inner();
    let unacked: Arc<Mutex<VecDeque<(u64, Instant)>>> = Arc::default();
    let pending = unacked.clone();
    tokio::spawn(async move {
        while let Ok(Some(reply)) = inbound.message().await {
            let Some(router_message::Body::Ack(ack)) = reply.body else {
                continue;
            };
            let now = Instant::now();
            let mut pending = pending.lock().unwrap();
            let mut acked = false;
            while pending
                .front()
                .is_some_and(|&(event, _)| event <= ack.last_event_id)
            {
                let (_, sent) = pending.pop_front().expect("checked");
                acked = true;
                if lags.recording.load(std::sync::atomic::Ordering::Relaxed) {
                    let _ = lags
                        .histogram
                        .lock()
                        .unwrap()
                        .record((now - sent).as_micros() as u64);
                }
            }
            if acked && pending.is_empty() {
                lags.caught_up
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            }
        }
    });
    Ok(SimWorker {
        id,
        tx,
        next_event: 0,
        next_block: 0,
        chains: VecDeque::new(),
        unacked,
    })
}

/// Resident memory of process `pid`, in bytes.
fn rss_bytes(pid: u32) -> anyhow::Result<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    let kb: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .context("no VmRSS in /proc/PID/status")?;
    Ok(kb * 1024)
}

fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|l| l.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_default()
}

/// Sends a batch replacing one worker's oldest chain, round robin, at
/// `rate` batches per second until `until`.
async fn churn(
    workers: &mut [SimWorker],
    next: &mut usize,
    rate: f64,
    until: Instant,
    rng: &mut Lcg,
    hasher: &BlockHasher,
) -> anyhow::Result<u64> {
    let mut sent = 0u64;
    let started = Instant::now();
    let mut tick = tokio::time::interval(Duration::from_millis(1));
    while Instant::now() < until {
        tick.tick().await;
        let due = (started.elapsed().as_secs_f64() * rate) as u64;
        while sent < due {
            let worker = &mut workers[*next % workers.len()];
            *next += 1;
            let removed = worker.chains.pop_front().unwrap_or_default();
            let remove = worker.event(kv_event::Kind::Removed(Removed {
                block_hashes: removed,
            }));
            let tokens = rng.tokens(BLOCK_SIZE * CHAIN_BLOCKS);
            let store = worker.stored(&tokens, hasher);
            worker.send(vec![remove, store]).await?;
            sent += 1;
        }
    }
    Ok(sent)
}

/// Posts token-id prompts at `rate` per second until `until`, each a held
/// chain's tokens then new ones; returns (sent, failed).
async fn route_load(
    client: &HttpClient,
    url: &str,
    held: &Arc<Vec<Vec<u32>>>,
    prompt_tokens: usize,
    rate: f64,
    until: Instant,
) -> (
    u64,
    Arc<std::sync::atomic::AtomicU64>,
    Vec<tokio::task::JoinHandle<()>>,
) {
    let failed = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let mut tasks = Vec::new();
    let mut sent = 0u64;
    let started = Instant::now();
    let mut tick = tokio::time::interval(Duration::from_millis(1));
    let mut rng = Lcg(17);
    while Instant::now() < until {
        tick.tick().await;
        let due = (started.elapsed().as_secs_f64() * rate) as u64;
        while sent < due {
            let chain = &held[(rng.next() % held.len() as u64) as usize];
            let mut prompt = chain.clone();
            prompt.extend(rng.tokens(prompt_tokens.saturating_sub(prompt.len())));
            let body = Bytes::from(
                serde_json::json!({"model": MODEL, "prompt": prompt, "max_tokens": 1}).to_string(),
            );
            let (client, url, failed) = (client.clone(), url.to_string(), failed.clone());
            tasks.push(tokio::spawn(async move {
                if post(&client, &url, &body).await.is_err() {
                    failed.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                }
            }));
            sent += 1;
        }
    }
    (sent, failed, tasks)
}

fn lag_summary(lags: &Lags) -> String {
    let mut h = lags.histogram.lock().unwrap();
    let line = format!(
        "p50 {:.2} ms, p99 {:.2} ms, max {:.2} ms (n={})",
        h.value_at_quantile(0.5) as f64 / 1000.0,
        h.value_at_quantile(0.99) as f64 / 1000.0,
        h.max() as f64 / 1000.0,
        h.len()
    );
    h.reset();
    line
}

pub fn run(args: ServiceArgs) -> anyhow::Result<()> {
    let runtime = tokio::runtime::Runtime::new().context("cannot start the async runtime")?;
    runtime.block_on(measure(args))
}

async fn measure(args: ServiceArgs) -> anyhow::Result<()> {
    use std::sync::atomic::Ordering::Relaxed;
    let stub = stub_worker().await?;
    let base_url = format!("http://{stub}");
    let router = RouterProcess::start_with(BLOCK_SIZE, "[upstream]\nhealth_interval_ms = 0\n")?;
    let pid = router.pid();
    let lags = Arc::new(Lags {
        histogram: Mutex::new(Histogram::new(3)?),
        recording: false.into(),
        caught_up: 0.into(),
    });
    let connections = (args.workers as usize).div_ceil(STREAMS_PER_CONNECTION);
    let mut channels = Vec::new();
    for _ in 0..connections {
        let endpoint = tonic::transport::Endpoint::from_shared(router.grpc.clone())?;
        channels.push(kvroute_proto::with_keepalive(endpoint).connect().await?);
    }
    let started = Instant::now();
    let mut workers = Vec::new();
    for id in 0..args.workers {
        let channel = channels[id as usize % connections].clone();
        workers.push(connect(channel, id, &base_url, lags.clone()).await?);
    }
    let rss_registered = rss_bytes(pid)?;
    // Each worker's share of the blocks, as chains of CHAIN_BLOCKS.
    let hasher = BlockHasher::new(BLOCK_SIZE);
    let chains_per_worker = args
        .indexed_blocks
        .div_ceil(CHAIN_BLOCKS * args.workers as usize);
    let mut rng = Lcg(5);
    let mut held = Vec::new();
    for worker in &mut workers {
        let mut events = Vec::new();
        for _ in 0..chains_per_worker {
            let tokens = rng.tokens(BLOCK_SIZE * CHAIN_BLOCKS);
            events.push(worker.stored(&tokens, &hasher));
            if held.len() < 4096 {
                held.push(tokens);
            }
        }
        worker.send(events).await?;
    }
    while lags.caught_up.load(Relaxed) < workers.len() {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let blocks = chains_per_worker * CHAIN_BLOCKS * workers.len();
    println!(
        "== service: kvroute serve with {} workers on {connections} gRPC connections, {blocks} blocks indexed in {:.1} s; RSS {:.0} MiB registered, {:.0} MiB indexed",
        workers.len(),
        started.elapsed().as_secs_f64(),
        rss_registered as f64 / (1 << 20) as f64,
        rss_bytes(pid)? as f64 / (1 << 20) as f64,
    );
    let phase = Duration::from_secs_f64(args.seconds);
    let mut next = 0;

    // Phase 1: events alone.
    lags.recording.store(true, Relaxed);
    let cpu_before = process_cpu_ns(pid)?;
    let t = Instant::now();
    let batches = churn(
        &mut workers,
        &mut next,
        args.event_rate,
        t + phase,
        &mut rng,
        &hasher,
    )
    .await?;
    let events_cpu = process_cpu_ns(pid)? - cpu_before;
    let events_elapsed = t.elapsed().as_secs_f64();
    println!(
        "  events alone: {:.0} batches/s (a Removed and a Stored chain of {CHAIN_BLOCKS} blocks each), router CPU {:.1}% of a core; apply lag {} (load average {})",
        batches as f64 / events_elapsed,
        100.0 * events_cpu as f64 / 1e9 / events_elapsed,
        lag_summary(&lags),
        load_average()
    );

    // Phase 2: events while routing.
    let client = pooled_client();
    let url = format!("{}/v1/completions", router.http);
    let held = Arc::new(held);
    let cpu_before = process_cpu_ns(pid)?;
    let t = Instant::now();
    let until = t + phase;
    let routing = route_load(&client, &url, &held, args.prompt_tokens, args.rate, until);
    let events = churn(
        &mut workers,
        &mut next,
        args.event_rate,
        until,
        &mut rng,
        &hasher,
    );
    let ((requests, failed, tasks), batches) = tokio::join!(routing, events);
    let batches = batches?;
    for task in tasks {
        let _ = task.await;
    }
    let both_cpu = process_cpu_ns(pid)? - cpu_before;
    let elapsed = t.elapsed().as_secs_f64();
    let rss_end = rss_bytes(pid)?;
    let routing_cpu = both_cpu as f64 - events_cpu as f64 * elapsed / events_elapsed;
    println!(
        "  events and routing: {:.0} requests/s of {} tokens ({} failed), {:.0} batches/s; router CPU {:.1}% of a core; apply lag {} (load average {})",
        requests as f64 / elapsed,
        args.prompt_tokens,
        failed.load(Relaxed),
        batches as f64 / elapsed,
        100.0 * both_cpu as f64 / 1e9 / elapsed,
        lag_summary(&lags),
        load_average()
    );
    println!(
        "  router CPU per routed request (less the events' CPU): {:.0} µs; RSS at the end {:.0} MiB",
        routing_cpu / requests.max(1) as f64 / 1000.0,
        rss_end as f64 / (1 << 20) as f64
    );
    drop(workers);
    Ok(())
}
