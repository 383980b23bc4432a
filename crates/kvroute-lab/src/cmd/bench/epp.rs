//! `kvroute-lab bench epp`: kvroute as the endpoint picker of a real Envoy
//! (issue 33's goals), against Envoy alone with round robin and against
//! kvroute's own proxy, on the same stub workers and prompts.
//!
//! The router is `kvroute serve` with `[epp] addr` and the stub workers as
//! static workers; its HTTP port is kvroute's own proxy. Two Envoys run the
//! reference config (deploy/envoy/envoy-epp.yaml, installed by
//! tests/envoy/install.sh): one asking kvroute over ext_proc, one with the
//! ext_proc filter taken out, so that its pool's fallback policy (round robin)
//! picks. Measured:
//! - the picker's decisions per CPU-second of the router process, for
//!   ~8.2k-token text prompts (parse, tokenize, hash, score, book, and the
//!   response passing through the ext_proc stream), beside the proxy's;
//! - TTFT (first body byte of a stream) at a fixed arrival rate through each
//!   of the three, and what the picker adds to Envoy's round robin;
//! - with `--trace`, the engines' prefix hit rate on a Mooncake trace through
//!   Envoy and the picker against kvroute's own proxy, each on a fresh
//!   simulated fleet (as `bench e2e` runs it).

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::Context;
use bytes::Bytes;
use clap::Args;
use http_body_util::{BodyExt, Full};
use kvroute_e2e::{Fleet, Replay};
use kvroute_router::config::Policy;
use kvroute_sim::cli::EngineArgs;

use super::cpu_time::process_cpu_ns;
use super::fixture::{HttpClient, MODEL, pooled_client, text_prompts};
use super::proxy::{load_average, met, stub_worker};
use super::soak::RouterProcess;

#[derive(Args)]
pub struct EppArgs {
    /// Stub workers behind every target.
    #[arg(long, default_value_t = 4)]
    workers: usize,
    /// Requests per decisions-per-CPU-second measurement.
    #[arg(long, default_value_t = 600)]
    requests: usize,
    /// Concurrent clients of the decisions-per-CPU-second measurement.
    #[arg(long, default_value_t = 8)]
    concurrency: usize,
    /// Arrival rate of the TTFT measurement, requests per second.
    #[arg(long, default_value_t = 100.0)]
    rate: f64,
    /// Seconds of arrivals per target in the TTFT measurement.
    #[arg(long, default_value_t = 10)]
    seconds: u64,
    /// Mooncake trace for the hit-rate comparison (skipped without it).
    #[arg(long)]
    trace: Option<PathBuf>,
    /// Replay only the trace's first N requests.
    #[arg(long)]
    max_requests: Option<usize>,
    /// Simulated workers of the hit-rate comparison.
    #[arg(long, default_value_t = 8)]
    sim_workers: usize,
    /// Arrival rate multiplier on top of the speedup (as `bench e2e --rate`).
    #[arg(long, default_value_t = 1.0)]
    trace_rate: f64,
    /// Engines of the hit-rate comparison (the trace needs `--block-size 512`).
    #[command(flatten)]
    engine: EngineArgs,
}

/// SSE chunks of each streamed stub response.
const CHUNKS: usize = 8;

/// The reference Envoy config; its placeholders are filled per run.
const ENVOY_CONFIG: &str = include_str!("../../../../../deploy/envoy/envoy-epp.yaml");

/// A running Envoy, killed on drop.
struct Envoy {
    child: Child,
    config: PathBuf,
    url: String,
}

impl Envoy {
    /// Envoy on the reference config with `pool` (`host:port` each); asking
    /// the picker at `epp`, or with no ext_proc filter (round robin).
    fn start(binary: &std::path::Path, pool: &[String], epp: Option<&str>) -> anyhow::Result<Self> {
        let port = || -> anyhow::Result<u16> {
            Ok(std::net::TcpListener::bind("127.0.0.1:0")?
                .local_addr()?
                .port())
        };
        let (listen, admin) = (port()?, port()?);
        let mut config = ENVOY_CONFIG.to_string();
        let (epp_host, epp_port) = match epp {
            Some(epp) => epp.rsplit_once(':').context("the picker's host:port")?,
            None => {
                let start = config
                    .find("          - name: envoy.filters.http.ext_proc\n")
                    .context("the ext_proc filter")?;
                let end = config
                    .find("          - name: envoy.filters.http.router\n")
                    .context("the router filter")?;
                config.replace_range(start..end, "");
                ("127.0.0.1", "9")
            }
        };
        let endpoints: Vec<String> = pool
            .iter()
            .map(|hostport| {
                let (host, port) = hostport.rsplit_once(':').unwrap_or((hostport, "80"));
                format!("{{endpoint: {{address: {{socket_address: {{address: {host}, port_value: {port}}}}}}}}}")
            })
            .collect();
        for (name, value) in [
            ("ADMIN_PORT", admin.to_string()),
            ("LISTEN_ADDRESS", "127.0.0.1".to_string()),
            ("LISTEN_PORT", listen.to_string()),
            ("EPP_HOST", epp_host.to_string()),
            ("EPP_PORT", epp_port.to_string()),
            ("POOL_ENDPOINTS", format!("[{}]", endpoints.join(", "))),
        ] {
            config = config.replace(&format!("${{{name}}}"), &value);
        }
        let path = std::env::temp_dir().join(format!(
            "kvroute-bench-envoy-{}-{listen}.yaml",
            std::process::id()
        ));
        std::fs::write(&path, config)?;
        let child = Command::new(binary)
            .arg("-c")
            .arg(&path)
            .args(["--disable-hot-restart", "--concurrency", "1", "-l", "error"])
            .stdout(Stdio::null())
            .spawn()
            .with_context(|| format!("cannot start {}", binary.display()))?;
        let envoy = Envoy {
            child,
            config: path,
            url: format!("http://127.0.0.1:{listen}"),
        };
        let deadline = Instant::now() + Duration::from_secs(30);
        while std::net::TcpStream::connect(("127.0.0.1", listen)).is_err() {
            anyhow::ensure!(
                Instant::now() < deadline,
                "envoy did not listen on {listen}"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(envoy)
    }
}

impl Drop for Envoy {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_file(&self.config);
    }
}

/// The Envoy binary that tests/envoy/install.sh installs (and installs if missing).
fn envoy_binary() -> anyhow::Result<PathBuf> {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/../../tests/envoy/install.sh");
    let output = Command::new("bash")
        .arg(script)
        .stderr(Stdio::inherit())
        .output()?;
    anyhow::ensure!(output.status.success(), "{script} failed");
    let stdout = String::from_utf8(output.stdout)?;
    Ok(PathBuf::from(
        stdout.lines().last().context("no path from the script")?,
    ))
}

/// The request body of `prompt`, streamed or not.
fn body(prompt: &str, stream: bool) -> Bytes {
    Bytes::from(
        serde_json::json!({"model": MODEL, "prompt": prompt, "max_tokens": 16, "stream": stream})
            .to_string(),
    )
}

/// POSTs `body` to `url`; the time to the first body byte, after reading all.
async fn fetch(client: &HttpClient, url: &str, body: Bytes) -> anyhow::Result<Duration> {
    let started = Instant::now();
    let request = http::Request::post(url)
        .header("content-type", "application/json")
        .body(Full::new(body))?;
    let mut response = client.request(request).await?;
    anyhow::ensure!(
        response.status().is_success(),
        "{url}: {}",
        response.status()
    );
    let mut first = None;
    while let Some(frame) = response.body_mut().frame().await {
        if frame?.is_data() && first.is_none() {
            first = Some(started.elapsed());
        }
    }
    first.context("an empty response")
}

/// Router CPU-seconds for `requests` plain requests to `url`, `concurrency` at a time.
async fn cpu_per_requests(
    client: &HttpClient,
    url: &str,
    bodies: &[Bytes],
    requests: usize,
    concurrency: usize,
    router_pid: u32,
) -> anyhow::Result<f64> {
    let before = process_cpu_ns(router_pid)?;
    let per_client = requests / concurrency;
    let tasks: Vec<_> = (0..concurrency)
        .map(|c| {
            let (client, url) = (client.clone(), url.to_string());
            let bodies: Vec<Bytes> = (0..per_client)
                .map(|i| bodies[(c * per_client + i) % bodies.len()].clone())
                .collect();
            tokio::spawn(async move {
                for body in bodies {
                    fetch(&client, &url, body).await?;
                }
                anyhow::Ok(())
            })
        })
        .collect();
    for task in tasks {
        task.await??;
    }
    let used = process_cpu_ns(router_pid)? - before;
    Ok(used as f64 / 1e9 / (per_client * concurrency) as f64)
}

/// TTFTs of streamed requests arriving at `rate` per second for `seconds`.
async fn ttft_at_rate(
    client: &HttpClient,
    url: &str,
    bodies: &[Bytes],
    rate: f64,
    seconds: u64,
) -> anyhow::Result<Vec<f64>> {
    let count = (rate * seconds as f64) as usize;
    let start = tokio::time::Instant::now();
    let mut tasks = Vec::with_capacity(count);
    for i in 0..count {
        tokio::time::sleep_until(start + Duration::from_secs_f64(i as f64 / rate)).await;
        let (client, url, body) = (
            client.clone(),
            url.to_string(),
            bodies[i % bodies.len()].clone(),
        );
        tasks.push(tokio::spawn(
            async move { fetch(&client, &url, body).await },
        ));
    }
    let mut ttfts = Vec::with_capacity(count);
    for task in tasks {
        ttfts.push(task.await??.as_secs_f64() * 1000.0);
    }
    ttfts.sort_by(f64::total_cmp);
    Ok(ttfts)
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

pub fn run(args: EppArgs) -> anyhow::Result<()> {
    anyhow::ensure!(
        args.workers > 0 && args.concurrency > 0,
        "--workers and --concurrency must be positive"
    );
    let envoy = envoy_binary()?;
    let runtime = tokio::runtime::Runtime::new().context("cannot start the async runtime")?;
    println!("== bench epp; load average before: {}", load_average());
    runtime.block_on(stub_fleet(&args, &envoy))?;
    if let Some(trace) = &args.trace {
        runtime.block_on(hit_rates(&args, trace, &envoy))?;
    }
    println!("\nload average after: {}", load_average());
    Ok(())
}

/// Decisions per CPU-second and TTFT on the stub workers.
async fn stub_fleet(args: &EppArgs, envoy_binary: &std::path::Path) -> anyhow::Result<()> {
    let mut pool = Vec::new();
    let mut workers = String::new();
    for id in 0..args.workers {
        let addr = stub_worker(CHUNKS).await?;
        workers += &format!(
            "[[workers]]\nid = {id}\nbase_url = \"http://{addr}\"\nmodels = [\"{MODEL}\"]\n"
        );
        pool.push(addr.to_string());
    }
    let router = RouterProcess::start_with(
        16,
        &format!(
            "tokenizer = \"tiktoken:cl100k_base\"\n{workers}[upstream]\nhealth_interval_ms = 0\n[epp]\naddr = \"127.0.0.1:0\"\n"
        ),
    )?;
    let epp = router
        .epp
        .clone()
        .context("the router printed no epp= address")?;
    let with_epp = Envoy::start(envoy_binary, &pool, Some(&epp))?;
    let round_robin = Envoy::start(envoy_binary, &pool, None)?;
    let client = pooled_client();
    let prompts = text_prompts(200);
    let plain: Vec<Bytes> = prompts.iter().map(|p| body(p, false)).collect();
    let streamed: Vec<Bytes> = prompts.iter().map(|p| body(p, true)).collect();
    let targets = [
        (
            "Envoy + kvroute EPP",
            format!("{}/v1/completions", with_epp.url),
        ),
        (
            "Envoy round robin",
            format!("{}/v1/completions", round_robin.url),
        ),
        ("kvroute proxy", format!("{}/v1/completions", router.http)),
    ];
    // Warm-up: connections, the tokenizer's caches, every stub.
    for (_, url) in &targets {
        for body in plain.iter().take(50) {
            fetch(&client, url, body.clone()).await?;
        }
    }

    println!(
        "\ndecisions per CPU-second of the router process: {} ~8.2k-token text prompts, {} concurrent, {} stub workers",
        args.requests, args.concurrency, args.workers
    );
    let mut per_cpu_s = Vec::new();
    for (label, url) in [&targets[0], &targets[2]] {
        let cpu = cpu_per_requests(
            &client,
            url,
            &plain,
            args.requests,
            args.concurrency,
            router.pid(),
        )
        .await?;
        println!(
            "  {label:<20} {:.0} requests per CPU-second ({:.0} µs each)",
            1.0 / cpu,
            cpu * 1e6
        );
        per_cpu_s.push(1.0 / cpu);
    }

    println!(
        "\nTTFT (first body byte of a stream of {CHUNKS} chunks) at {} requests/s for {} s, same prompts:",
        args.rate, args.seconds
    );
    let mut p50 = Vec::new();
    for (label, url) in &targets {
        let ttfts = ttft_at_rate(&client, url, &streamed, args.rate, args.seconds).await?;
        println!(
            "  {label:<20} p50 {:.2} ms, p90 {:.2} ms, p99 {:.2} ms",
            percentile(&ttfts, 0.5),
            percentile(&ttfts, 0.9),
            percentile(&ttfts, 0.99)
        );
        p50.push(percentile(&ttfts, 0.5));
    }
    let added = p50[0] - p50[1];
    println!(
        "\ngoals: EPP decisions per CPU-second ≥ 2,000: {:.0}, {}; TTFT p50 added over Envoy's round robin ≤ 0.5 ms: {added:.2} ms, {}",
        per_cpu_s[0],
        met(per_cpu_s[0] >= 2000.0),
        met(added <= 0.5)
    );
    Ok(())
}

/// The engines' prefix hit rate on the trace through kvroute's proxy and
/// through Envoy with the picker, each on a fresh fleet.
async fn hit_rates(
    args: &EppArgs,
    trace: &std::path::Path,
    envoy_binary: &std::path::Path,
) -> anyhow::Result<()> {
    let trace = kvroute_trace::read_trace(trace, args.max_requests)
        .with_context(|| format!("cannot read the trace {}", trace.display()))?;
    let engine = args.engine.engine_config();
    let replay = Replay {
        time_scale: args.engine.speedup * args.trace_rate,
        max_output_tokens: None,
        api: kvroute_e2e::Api::Completions,
    };
    let mut config = kvroute_router::Config::default();
    config.epp.addr = "127.0.0.1:0".into();
    config.log.level = "error".into();
    println!(
        "\nprefix hit rate on {} trace requests, {} simulated engines, rate {}:",
        trace.len(),
        args.sim_workers,
        args.trace_rate
    );
    let mut rates = Vec::new();
    for through_envoy in [false, true] {
        let fleet = Fleet::start(args.sim_workers, &engine, &config, Policy::Kv).await?;
        let report = if through_envoy {
            let epp = fleet
                .router
                .epp_addr
                .context("the fleet's router has no picker")?;
            let pool: Vec<String> = fleet
                .workers
                .iter()
                .map(|w| w.base_url().trim_start_matches("http://").to_string())
                .collect();
            let envoy = Envoy::start(envoy_binary, &pool, Some(&epp.to_string()))?;
            let url: hyper::Uri = format!("{}/v1/completions", envoy.url).parse()?;
            let before = fleet.router.state.render_metrics();
            let (outcomes, duration_s) = kvroute_e2e::replay_through(&[url], &trace, replay).await;
            let after = fleet.router.state.render_metrics();
            kvroute_e2e::report(
                Policy::Kv,
                &fleet.workers,
                &outcomes,
                duration_s,
                kvroute_e2e::token_sums(&before),
                kvroute_e2e::token_sums(&after),
            )
        } else {
            kvroute_e2e::run(&fleet, Policy::Kv, &trace, replay).await?
        };
        let label = if through_envoy {
            "Envoy + kvroute EPP"
        } else {
            "kvroute proxy"
        };
        println!(
            "  {label:<20} hit rate {:.2} %, TTFT p50 {:.1} ms, {} of {} failed",
            report.worker_hit_rate * 100.0,
            report.ttft_ms.p50,
            report.failed,
            report.requests
        );
        rates.push(report.worker_hit_rate * 100.0);
        fleet.shutdown().await;
    }
    let gap = rates[0] - rates[1];
    println!(
        "goal: hit rate through Envoy within 1 point of kvroute's proxy: {gap:+.2} points, {}",
        met(gap.abs() <= 1.0)
    );
    Ok(())
}
