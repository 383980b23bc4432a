//! `kvroute-lab bench soak`: the whole service under steady load for minutes, to
//! catch what short tests cannot: slow leaks of memory, file descriptors or
//! tasks, and requests lost while workers come and go.
//!
//! The router runs as its own process (`kvroute serve`), so its resident memory
//! and descriptors are its own; a simulated fleet runs in this process and the
//! bundled trace is replayed through the router in passes. Between passes one
//! churn step runs, in turn: a worker restarts (a new instance under the same
//! id), a worker leaves, a new one joins. Each departure is drained first (and
//! waited on until the router has nothing in flight to it), so a failed request
//! is the router's fault, not the churn's.
//!
//! The router is sampled only at idle moments with the fleet at its starting
//! size, so in-flight work never counts as growth: at the start (after a first
//! churn cycle), when warm (after `--warmup-minutes` more of load) and at the
//! end (after `--minutes` more). Growth over 5% between warm and end is
//! "missed"; start to warm is reported beside it. Warm-up is not a leak, and it
//! is more than caches, index and pools filling: the heap's peak comes from
//! the requests in flight (bodies and their parsed JSON prompts), and the
//! allocator keeps the pages of that peak after they are freed, so resident
//! memory at rest follows the highest concurrency reached so far, which the
//! first minutes of a trace replay do not reach yet.

use std::io::{BufRead, BufReader, Read};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use bytes::Bytes;
use clap::Args;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use kvroute_cache::PolicyKind;
use kvroute_router::metrics::ALIVE_TASKS;
use kvroute_sim::trace::trace_tokens;
use kvroute_sim::{CostModel, EngineConfig, EngineKind, Worker, WorkerConfig};
use kvroute_trace::TraceRequest;
use serde::Serialize;
use serde_json::{Value, json};

use super::fixture::kvroute_binary;

#[derive(Args)]
pub struct SoakArgs {
    /// How long to measure, in minutes, from the warm sample to the end
    /// sample (the churn cycle under way is finished).
    #[arg(long, default_value_t = 10.0)]
    minutes: f64,
    /// Minutes of load between the start sample and the warm one (measured:
    /// the retained peak stops rising 2-3 minutes after the start sample).
    #[arg(long, default_value_t = 4.0)]
    warmup_minutes: f64,
    /// Simulated workers at the start (and at every sample).
    #[arg(long, default_value_t = 4)]
    workers: usize,
    /// The Mooncake trace replayed.
    #[arg(long, default_value = concat!(env!("CARGO_MANIFEST_DIR"), "/../../tests/data/traces/conversation_trace.jsonl"))]
    trace: PathBuf,
    /// Requests per pass, from the start of the trace.
    #[arg(long, default_value_t = 300)]
    requests: usize,
    /// Trace time runs this many times faster than real time, engines too.
    #[arg(long, default_value_t = 20.0)]
    speedup: f64,
    /// Idle seconds before each sample: the router's pooled connections to
    /// workers (a descriptor and a task each, as many as the last pass's peak
    /// concurrency) go once idle for 90 s, at the pool's next sweep (up to
    /// 180 s), so a shorter wait measures the pool, not a leak.
    #[arg(long, default_value_t = 190.0)]
    settle_s: f64,
}

/// Largest growth between the warm and end samples that still counts as flat.
const FLAT: f64 = 0.05;

/// The router's footprint at one idle moment.
#[derive(Clone, Copy, Debug, Serialize)]
struct Sample {
    elapsed_s: f64,
    rss_bytes: u64,
    open_fds: u64,
    alive_tasks: u64,
}

#[derive(Serialize)]
struct Growth {
    start: u64,
    end: u64,
    ratio: f64,
    met: bool,
}

impl Growth {
    fn new(start: u64, end: u64) -> Self {
        let ratio = end as f64 / start.max(1) as f64;
        Growth {
            start,
            end,
            ratio,
            met: ratio <= 1.0 + FLAT,
        }
    }
}

#[derive(Serialize)]
struct SoakReport {
    minutes: f64,
    passes: usize,
    requests: usize,
    requests_failed: usize,
    restarts: usize,
    leaves: usize,
    joins: usize,
    /// At the start, warm, and at the end.
    samples: Vec<Sample>,
    /// Resident memory from the start sample to the warm one: warm-up, no verdict.
    rss_warmup_ratio: f64,
    /// Warm to end, as the next two.
    rss: Growth,
    open_fds: Growth,
    alive_tasks: Growth,
    /// All three flat within 5% and no request failed.
    met: bool,
}

/// `kvroute serve` on loopback ports, killed on drop.
pub(super) struct RouterProcess {
    child: Child,
    pub(super) http: String,
    pub(super) grpc: String,
    /// The endpoint picker's `host:port`, with `[epp] addr`.
    pub(super) epp: Option<String>,
}

impl RouterProcess {
    fn start(block_size: usize) -> anyhow::Result<Self> {
        Self::start_with(block_size, "")
    }

    /// With `config` at the head of its configuration file (top-level keys first).
    pub(super) fn start_with(block_size: usize, config: &str) -> anyhow::Result<Self> {
        let exe = kvroute_binary()?;
        let block_size = block_size.to_string();
        // Warnings only: churn would log every registration.
        let config_text = format!("{config}\n[log]\nlevel = \"warn\"\n");
        let config = std::env::temp_dir().join(format!("kvroute-soak-{}.toml", std::process::id()));
        std::fs::write(&config, config_text)?;
        let mut child = Command::new(exe)
            .args(["serve", "--http-addr", "127.0.0.1:0", "--grpc-addr"])
            .args(["127.0.0.1:0", "--block-size", &block_size, "--config"])
            .arg(&config)
            .stdout(Stdio::piped())
            .spawn()
            .context("cannot start kvroute serve")?;
        let mut stdout = BufReader::new(child.stdout.take().context("no stdout")?);
        let mut line = String::new();
        stdout.read_line(&mut line)?;
        let _ = std::fs::remove_file(&config);
        // Keep reading so the router never blocks on a full pipe.
        std::thread::spawn(move || std::io::copy(&mut stdout, &mut std::io::sink()));
        let addr = |key: &str| {
            line.split_whitespace()
                .find_map(|w| w.strip_prefix(key))
                .map(|a| format!("http://{a}"))
        };
        let (Some(http), Some(grpc)) = (addr("http="), addr("grpc=")) else {
            let _ = child.kill();
            bail!("kvroute serve printed {line:?}, not its addresses");
        };
        let epp = line
            .split_whitespace()
            .find_map(|w| w.strip_prefix("epp="))
            .map(str::to_string);
        Ok(RouterProcess {
            child,
            http,
            grpc,
            epp,
        })
    }

    pub(super) fn pid(&self) -> u32 {
        self.child.id()
    }
}

impl Drop for RouterProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

type HttpClient = Client<HttpConnector, Full<Bytes>>;

async fn call(client: &HttpClient, method: &str, url: &str) -> anyhow::Result<Value> {
    let request = hyper::Request::builder()
        .method(method)
        .uri(url)
        .body(Full::new(Bytes::new()))?;
    let response = client.request(request).await?;
    let status = response.status();
    let body = response.into_body().collect().await?.to_bytes();
    if !status.is_success() {
        bail!(
            "{method} {url}: {status} {}",
            String::from_utf8_lossy(&body)
        );
    }
    Ok(serde_json::from_slice(&body).unwrap_or(Value::Null))
}

async fn metrics_text(client: &HttpClient, router: &RouterProcess) -> anyhow::Result<String> {
    let url: hyper::Uri = format!("{}/metrics", router.http).parse()?;
    let response = client.get(url).await?;
    let body = response.into_body().collect().await?.to_bytes();
    Ok(String::from_utf8_lossy(&body).into_owned())
}

async fn sample(
    client: &HttpClient,
    router: &RouterProcess,
    start: Instant,
) -> anyhow::Result<Sample> {
    let pid = router.pid();
    let mut status = String::new();
    std::fs::File::open(format!("/proc/{pid}/status"))?.read_to_string(&mut status)?;
    let rss_kb: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .context("no VmRSS in /proc/PID/status")?;
    let open_fds = std::fs::read_dir(format!("/proc/{pid}/fd"))?.count() as u64;
    let text = metrics_text(client, router).await?;
    let alive_tasks =
        text.lines()
            .find_map(|l| l.strip_prefix(ALIVE_TASKS)?.trim().parse::<f64>().ok())
            .with_context(|| format!("the router exports no {ALIVE_TASKS}"))? as u64;
    Ok(Sample {
        elapsed_s: start.elapsed().as_secs_f64(),
        rss_bytes: rss_kb * 1024,
        open_fds,
        alive_tasks,
    })
}

/// A sample after `settle` idle.
async fn idle_sample(
    client: &HttpClient,
    router: &RouterProcess,
    settle: Duration,
    start: Instant,
    passes: usize,
    failed: usize,
) -> anyhow::Result<Sample> {
    tokio::time::sleep(settle).await;
    let s = sample(client, router, start).await?;
    eprintln!("soak: {s:?} after pass {passes}, {failed} failed so far");
    Ok(s)
}

/// Small engines, so the fleet's caches fill and evict within one pass.
fn engine(speedup: f64) -> EngineConfig {
    EngineConfig {
        kv_blocks: 2048,
        block_size: 512,
        max_num_seqs: 64,
        max_num_batched_tokens: 8192,
        eviction: PolicyKind::Lru,
        kind: EngineKind::Vllm,
        cost: CostModel {
            speedup,
            ..CostModel::default()
        },
        offload_blocks: 0,
    }
}

struct Fleet {
    template: WorkerConfig,
    workers: Vec<Worker>,
    next_id: u64,
}

impl Fleet {
    async fn join(&mut self, id: u64) -> anyhow::Result<()> {
        let mut config = self.template.clone();
        config.worker_id = id;
        self.workers.push(Worker::start(config).await?);
        Ok(())
    }

    /// Drains worker `at` in the router, waits until nothing is in flight to
    /// it, then stops it; returns its id.
    async fn leave(
        &mut self,
        at: usize,
        client: &HttpClient,
        router: &RouterProcess,
    ) -> anyhow::Result<u64> {
        let id = self.workers[at].id();
        let url = format!("{}/workers/{id}", router.http);
        call(client, "POST", &format!("{url}/drain")).await?;
        let deadline = Instant::now() + Duration::from_secs(120);
        loop {
            let info = call(client, "GET", &url).await?;
            let routed: u64 = info["worker"]["ranks"].as_array().map_or(0, |r| {
                r.iter()
                    .filter_map(|r| r["inflight_requests"].as_u64())
                    .sum()
            });
            let load = self.workers[at].stats().1;
            if routed == 0 && load.running == 0 && load.waiting == 0 {
                break;
            }
            if Instant::now() > deadline {
                bail!("worker {id} still busy 120 s after draining: {info}");
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        self.workers.remove(at).shutdown().await;
        Ok(id)
    }

    /// Waits until the router lists every worker of the fleet as connected.
    async fn wait_registered(
        &self,
        client: &HttpClient,
        router: &RouterProcess,
    ) -> anyhow::Result<()> {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let listed = call(client, "GET", &format!("{}/workers", router.http)).await?;
            let connected = |id: u64| {
                listed["workers"].as_array().is_some_and(|ws| {
                    ws.iter()
                        .any(|w| w["id"] == json!(id) && w["state"] == "connected")
                })
            };
            if self.workers.iter().all(|w| connected(w.id())) {
                return Ok(());
            }
            if Instant::now() > deadline {
                bail!("workers not registered within 30 s: {listed}");
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

/// Replays `trace` at its timestamps; returns how many requests failed.
async fn pass(
    client: &HttpClient,
    router: &RouterProcess,
    trace: &[TraceRequest],
    speedup: f64,
) -> anyhow::Result<usize> {
    let url: hyper::Uri = format!("{}/v1/completions", router.http).parse()?;
    let first_ts = trace.first().map_or(0, |r| r.timestamp_ms);
    let start = Instant::now();
    let mut tasks = Vec::with_capacity(trace.len());
    for request in trace {
        let offset = (request.timestamp_ms - first_ts) as f64 / speedup / 1000.0;
        tokio::time::sleep_until((start + Duration::from_secs_f64(offset)).into()).await;
        let tokens = trace_tokens(&request.hash_ids, request.input_length as usize);
        let body = kvroute_e2e::completion_body(&tokens, request.output_length.clamp(1, 32), 1);
        let (client, url) = (client.clone(), url.clone());
        tasks.push(tokio::spawn(async move {
            kvroute_e2e::send(&client, url, body)
                .await
                .is_some_and(|o| o.ok)
        }));
    }
    let mut failed = 0;
    for task in tasks {
        if !task.await.unwrap_or(false) {
            failed += 1;
        }
    }
    Ok(failed)
}

pub fn run(args: SoakArgs) -> anyhow::Result<()> {
    anyhow::ensure!(
        args.workers >= 2,
        "--workers must be at least 2 (one leaves at a time)"
    );
    let trace = kvroute_trace::read_trace(&args.trace, Some(args.requests))
        .with_context(|| format!("cannot read the trace {}", args.trace.display()))?;
    let engine = engine(args.speedup);
    let router = RouterProcess::start(engine.block_size)?;
    let runtime = tokio::runtime::Runtime::new().context("cannot start the async runtime")?;
    let report = runtime.block_on(async {
        // No idle connections kept: the router's descriptors then count only
        // what it holds on its own.
        let client: HttpClient = Client::builder(TokioExecutor::new())
            .pool_max_idle_per_host(0)
            .build(HttpConnector::new());
        let mut template = WorkerConfig::new(0, engine);
        template.model = kvroute_e2e::MODEL.into();
        template.routers = vec![router.grpc.clone()];
        let mut fleet = Fleet {
            template,
            workers: Vec::new(),
            next_id: 1,
        };
        for _ in 0..args.workers {
            let id = fleet.next_id;
            fleet.next_id += 1;
            fleet.join(id).await?;
        }
        fleet.wait_registered(&client, &router).await?;
        eprintln!(
            "soak: router pid {} at {}, {} workers, passes of {} requests for {} min",
            router.pid(),
            router.http,
            args.workers,
            trace.len(),
            args.minutes
        );
        let settle = Duration::from_secs_f64(args.settle_s);
        let start = Instant::now();
        let warmup = Duration::from_secs_f64(args.warmup_minutes * 60.0);
        let duration = Duration::from_secs_f64(args.minutes * 60.0);
        // When the last sample was taken: the next one is due after the
        // warm-up, then after the measured span.
        let mut sampled_at: Option<Instant> = None;
        let (mut passes, mut failed) = (0, 0);
        let (mut restarts, mut leaves, mut joins) = (0, 0, 0);
        let mut samples = Vec::new();
        // Each pass after the first runs with one churn step in its middle. A
        // churn cycle is restart, leave, join: back to the starting size.
        // Samples are taken after the first cycle, after the first cycle past
        // the warm-up, and after the first past `minutes` from there.
        failed += pass(&client, &router, &trace, args.speedup).await?;
        passes += 1;
        let span_ms = trace.last().map_or(0, |r| r.timestamp_ms) - trace[0].timestamp_ms;
        let half_pass = Duration::from_secs_f64(span_ms as f64 / args.speedup / 2000.0);
        let mut step = 0usize;
        loop {
            let churn = async {
                tokio::time::sleep(half_pass).await;
                match step % 3 {
                    0 => {
                        let at = restarts % fleet.workers.len();
                        let id = fleet.leave(at, &client, &router).await?;
                        fleet.join(id).await?;
                        restarts += 1;
                    }
                    1 => {
                        fleet.leave(0, &client, &router).await?;
                        leaves += 1;
                    }
                    _ => {
                        let id = fleet.next_id;
                        fleet.next_id += 1;
                        fleet.join(id).await?;
                        joins += 1;
                    }
                }
                fleet.wait_registered(&client, &router).await
            };
            let (pass_failed, churned) =
                tokio::join!(pass(&client, &router, &trace, args.speedup), churn);
            failed += pass_failed?;
            churned?;
            passes += 1;
            step += 1;
            if !step.is_multiple_of(3) {
                continue;
            }
            let due = match (sampled_at, samples.len()) {
                (None, _) => true,
                (Some(at), 1) => at.elapsed() >= warmup,
                (Some(at), _) => at.elapsed() >= duration,
            };
            if due {
                samples.push(idle_sample(&client, &router, settle, start, passes, failed).await?);
                sampled_at = Some(Instant::now());
                if samples.len() == 3 {
                    break;
                }
            }
        }
        for worker in fleet.workers {
            worker.shutdown().await;
        }
        let (first, warm, last) = (samples[0], samples[1], samples[2]);
        let rss = Growth::new(warm.rss_bytes, last.rss_bytes);
        let open_fds = Growth::new(warm.open_fds, last.open_fds);
        let alive_tasks = Growth::new(warm.alive_tasks, last.alive_tasks);
        let met = rss.met && open_fds.met && alive_tasks.met && failed == 0;
        anyhow::Ok(SoakReport {
            minutes: (last.elapsed_s - warm.elapsed_s) / 60.0,
            passes,
            requests: passes * trace.len(),
            requests_failed: failed,
            restarts,
            leaves,
            joins,
            samples,
            rss_warmup_ratio: warm.rss_bytes as f64 / first.rss_bytes.max(1) as f64,
            rss,
            open_fds,
            alive_tasks,
            met,
        })
    })?;
    println!("{}", serde_json::to_string_pretty(&report)?);
    let verdict = |met: bool| if met { "met" } else { "missed" };
    eprintln!(
        "soak: rss {:.3}x over the warm-up; from warm to end: rss {} ({:.3}x), open fds {} \
         ({:.3}x), alive tasks {} ({:.3}x), flat within 5%; requests failed {} of {}: {}",
        report.rss_warmup_ratio,
        verdict(report.rss.met),
        report.rss.ratio,
        verdict(report.open_fds.met),
        report.open_fds.ratio,
        verdict(report.alive_tasks.met),
        report.alive_tasks.ratio,
        report.requests_failed,
        report.requests,
        verdict(report.requests_failed == 0),
    );
    Ok(())
}
