//! `kvroute-lab bench proxy`: the proxy hop of kvroute beside nginx's, in one run.
//!
//! A stub worker answers small completions, or streams SSE chunks back to
//! back. The client and the worker share one CPU in this process; kvroute
//! (`kvroute-lab bench router-proxy`) and nginx (Debian's package, a plain reverse
//! proxy with a generated configuration under a temporary prefix) each run in
//! processes of their own pinned to another CPU. Each round measures the
//! worker directly, through kvroute and through nginx, in rotating order, with
//! the same 16 concurrent clients: the throughput each proxy loses against
//! direct calls, and the CPU the proxy process spends per request or per
//! streamed chunk (the scheduler's per-thread nanoseconds, /proc/PID/task/*/schedstat).
//! With `--baseline PATH`, a router from another kvroute-lab binary is measured as a
//! fourth target in the same rounds: a before/after beside nginx. With
//! `--syscalls`, each proxy's system calls (by kind, with reads that found
//! nothing) and its threads' context switches are counted per request or chunk:
//! `perf stat` on syscall tracepoints, attached for each measurement, and
//! /proc/PID/task/*/status.
//!
//! nginx is installed with `crates/kvroute-lab/nginx/install.sh` if it is missing.
//!
//! Then, as `bench router` does at its end, streamed-chunk delay and event
//! ingest latency with the router idle and tokenizing at saturation
//! ([`super::saturation`]).

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::Context;
use bytes::Bytes;
use clap::Args;
use http_body_util::{BodyExt, Full};

use super::cpu_time::process_cpu_ns;
use super::fixture::{HttpClient, pooled_client, text_prompts};
use super::router::{pinned_runtime, router_process, router_process_of};

#[derive(Args)]
pub struct BenchProxyArgs {
    /// Rounds of direct, kvroute and nginx measurements.
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// Small non-streaming requests per measurement.
    #[arg(long, default_value_t = 4000)]
    requests: usize,
    /// Streamed responses per measurement (each of `--chunks` chunks).
    #[arg(long, default_value_t = 160)]
    streams: usize,
    /// SSE chunks per streamed response.
    #[arg(long, default_value_t = 200)]
    chunks: usize,
    /// Another kvroute-lab binary (an earlier build; from before the lab's
    /// split, a kvroute binary) to measure as a fourth target in the same
    /// rounds, for a before/after beside nginx.
    #[arg(long)]
    baseline: Option<PathBuf>,
    /// Only the proxy hop: skip the streamed-chunk delay and ingest latency
    /// at saturation (for quicker before/after runs).
    #[arg(long)]
    hop_only: bool,
    /// Also count each proxy's system calls and context switches per request
    /// or chunk (needs `perf` and tracepoint access; CPU figures of such a run
    /// include perf's attaching, so compare them only with each other).
    #[arg(long)]
    syscalls: bool,
}

/// Concurrent clients in every measurement.
const CONCURRENCY: usize = 16;

/// One SSE chunk as an OpenAI-compatible server streams a token.
const CHUNK: &str = "data: {\"id\":\"cmpl-1\",\"object\":\"text_completion\",\"choices\":[{\"index\":0,\"text\":\" tok\",\"logprobs\":null,\"finish_reason\":null}]}\n\n";

/// A stub worker: `/v1/completions` answers a small completion, or with
/// `"stream":true` streams `chunks` chunks, yielding between them so that
/// each leaves in a write of its own.
async fn stub_worker(chunks: usize) -> anyhow::Result<std::net::SocketAddr> {
    use axum::response::IntoResponse;
    let app = axum::Router::new()
        .route(
            "/v1/completions",
            axum::routing::post(move |body: Bytes| async move {
                if !body.windows(13).any(|w| w == b"\"stream\":true") {
                    return (
                        [(axum::http::header::CONTENT_TYPE, "application/json")],
                        r#"{"id":"cmpl-1","object":"text_completion","choices":[{"index":0,"text":"ok","finish_reason":"stop"}]}"#,
                    )
                        .into_response();
                }
                let stream = futures_util::stream::unfold(0, move |i| async move {
                    if i == chunks {
                        return None;
                    }
                    tokio::task::yield_now().await;
                    Some((
                        Ok::<_, std::convert::Infallible>(Bytes::from_static(CHUNK.as_bytes())),
                        i + 1,
                    ))
                });
                (
                    [(axum::http::header::CONTENT_TYPE, "text/event-stream")],
                    axum::body::Body::from_stream(stream),
                )
                    .into_response()
            }),
        )
        .route("/health", axum::routing::get(|| async { "ok" }));
    super::saturation::serve_stub(app).await
}

/// nginx as a plain reverse proxy to the stub worker, its one worker process
/// pinned to `cpu`, under a temporary prefix.
struct Nginx {
    master: Child,
    prefix: PathBuf,
    addr: String,
}

impl Nginx {
    fn start(worker: std::net::SocketAddr, cpu: usize) -> anyhow::Result<Self> {
        let binary = nginx_binary()?;
        let prefix =
            std::env::temp_dir().join(format!("kvroute-bench-nginx-{}", std::process::id()));
        std::fs::create_dir_all(&prefix)?;
        let port = std::net::TcpListener::bind("127.0.0.1:0")?
            .local_addr()?
            .port();
        let p = prefix.display();
        // worker_cpu_affinity is a bit mask, lowest CPU rightmost.
        let mask = format!("1{}", "0".repeat(cpu));
        // As an LLM gateway is set up: keep-alive to the worker, and no
        // response buffering, so that streamed chunks pass at once.
        let config = format!(
            "daemon off;
worker_processes 1;
worker_cpu_affinity {mask};
pid {p}/nginx.pid;
error_log {p}/error.log error;
events {{ worker_connections 4096; }}
http {{
    access_log off;
    client_body_temp_path {p}/body;
    proxy_temp_path {p}/proxy;
    fastcgi_temp_path {p}/fastcgi;
    uwsgi_temp_path {p}/uwsgi;
    scgi_temp_path {p}/scgi;
    upstream worker {{
        server {worker};
        keepalive 64;
    }}
    server {{
        listen 127.0.0.1:{port};
        location / {{
            proxy_pass http://worker;
            proxy_http_version 1.1;
            proxy_set_header Connection \"\";
            proxy_buffering off;
        }}
    }}
}}
"
        );
        let conf = prefix.join("nginx.conf");
        std::fs::write(&conf, config)?;
        let master = Command::new(&binary)
            .arg("-p")
            .arg(&prefix)
            .arg("-e")
            .arg(prefix.join("error.log"))
            .arg("-c")
            .arg(&conf)
            .stdin(Stdio::null())
            .spawn()
            .with_context(|| format!("cannot start {}", binary.display()))?;
        let addr = format!("127.0.0.1:{port}");
        let deadline = Instant::now() + Duration::from_secs(10);
        while std::net::TcpStream::connect(&addr).is_err() {
            anyhow::ensure!(
                Instant::now() < deadline,
                "nginx did not listen on {addr}; see {}",
                prefix.join("error.log").display()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(Nginx {
            master,
            prefix,
            addr,
        })
    }

    /// The master and its worker processes.
    fn pids(&self) -> Vec<u32> {
        let master = self.master.id();
        let mut pids = vec![master];
        pids.extend(children_of(master));
        pids
    }

    fn cpu_ns(&self) -> anyhow::Result<u64> {
        self.pids().into_iter().map(process_cpu_ns).sum()
    }
}

impl Drop for Nginx {
    fn drop(&mut self) {
        // SIGQUIT through the master's own pid file: a graceful stop of this
        // instance and its workers only.
        let _ = Command::new(nginx_binary().unwrap_or_else(|_| "nginx".into()))
            .arg("-p")
            .arg(&self.prefix)
            .arg("-e")
            .arg(self.prefix.join("error.log"))
            .arg("-c")
            .arg(self.prefix.join("nginx.conf"))
            .args(["-s", "quit"])
            .status();
        let _ = self.master.wait();
        let _ = std::fs::remove_dir_all(&self.prefix);
    }
}

/// The nginx binary, installed with `crates/kvroute-lab/nginx/install.sh` if missing.
fn nginx_binary() -> anyhow::Result<PathBuf> {
    let installed = Path::new("/usr/sbin/nginx");
    if !installed.exists() {
        let script = concat!(env!("CARGO_MANIFEST_DIR"), "/nginx/install.sh");
        let status = Command::new("sh").arg(script).status()?;
        anyhow::ensure!(status.success(), "{script} failed: {status}");
    }
    anyhow::ensure!(installed.exists(), "no nginx at {}", installed.display());
    Ok(installed.to_path_buf())
}

/// The processes whose parent is `pid`.
fn children_of(pid: u32) -> Vec<u32> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter(|child| {
            std::fs::read_to_string(format!("/proc/{child}/stat")).is_ok_and(|stat| {
                // After the command name in parentheses: state, then the parent's pid.
                stat.rsplit_once(')')
                    .and_then(|(_, rest)| rest.split_whitespace().nth(1)?.parse::<u32>().ok())
                    == Some(pid)
            })
        })
        .collect()
}

/// What is measured: small completions, or streams of chunks.
#[derive(Clone, Copy)]
enum Load {
    Plain { requests: usize },
    Streamed { streams: usize, chunks: usize },
}

impl Load {
    fn body(self) -> Bytes {
        let stream = matches!(self, Load::Streamed { .. });
        Bytes::from(
            serde_json::json!({"model": "bench", "prompt": (0..64).collect::<Vec<u32>>(), "max_tokens": 16, "stream": stream})
                .to_string(),
        )
    }

    /// Responses to fetch, and units (requests or chunks) each one counts.
    fn shape(self) -> (usize, usize) {
        match self {
            Load::Plain { requests } => (requests, 1),
            Load::Streamed { streams, chunks } => (streams, chunks),
        }
    }
}

/// Fetches the load's responses with [`CONCURRENCY`] clients; returns units per second.
async fn throughput(client: &HttpClient, url: &str, load: Load) -> anyhow::Result<f64> {
    let (responses, units) = load.shape();
    let body = load.body();
    let expected = match load {
        Load::Plain { .. } => None,
        Load::Streamed { chunks, .. } => Some(chunks * CHUNK.len()),
    };
    let per_client = responses / CONCURRENCY;
    let started = Instant::now();
    let tasks: Vec<_> = (0..CONCURRENCY)
        .map(|_| {
            let (client, url, body) = (client.clone(), url.to_string(), body.clone());
            tokio::spawn(async move {
                for _ in 0..per_client {
                    let request = http::Request::post(&url)
                        .header("content-type", "application/json")
                        .body(Full::new(body.clone()))?;
                    let response = client.request(request).await?;
                    anyhow::ensure!(response.status().is_success(), "{}", response.status());
                    let received = response.into_body().collect().await?.to_bytes();
                    if let Some(expected) = expected {
                        anyhow::ensure!(received.len() == expected, "a stream was cut short");
                    }
                }
                anyhow::Ok(())
            })
        })
        .collect();
    for task in tasks {
        task.await??;
    }
    Ok((per_client * CONCURRENCY * units) as f64 / started.elapsed().as_secs_f64())
}

/// Per target: units per second, and the proxy's CPU nanoseconds per unit.
#[derive(Default)]
struct Samples {
    rate: Vec<f64>,
    cpu_per_unit: Vec<f64>,
    /// With `--syscalls`: counts summed over the rounds, and the units they cover.
    counts: std::collections::BTreeMap<String, u64>,
    counted_units: u64,
}

/// The system calls `--syscalls` counts by kind (all of them are counted too).
const SYSCALLS: [&str; 11] = [
    "recvfrom",
    "read",
    "writev",
    "write",
    "sendto",
    "epoll_wait",
    "epoll_ctl",
    "futex",
    "sched_yield",
    "getsockopt",
    "mprotect",
];

/// Reads of these that end in EAGAIN are counted as reads that found nothing.
const READS: [&str; 2] = ["recvfrom", "read"];

/// `perf stat` counting the syscalls of some processes during one measurement.
struct SyscallCount {
    perf: Child,
    output: PathBuf,
    pids: Vec<u32>,
    switches: std::collections::BTreeMap<String, u64>,
}

impl SyscallCount {
    async fn start(pids: Vec<u32>) -> anyhow::Result<Self> {
        let output =
            std::env::temp_dir().join(format!("kvroute-bench-syscalls-{}.csv", std::process::id()));
        let mut perf = Command::new("perf");
        perf.args(["stat", "-x", ",", "-o"]).arg(&output);
        perf.args(["-e", "raw_syscalls:sys_enter"]);
        for call in SYSCALLS {
            perf.arg("-e").arg(format!("syscalls:sys_enter_{call}"));
        }
        for call in READS {
            perf.arg("-e").arg(format!("syscalls:sys_exit_{call}"));
            perf.args(["--filter", "ret == -11"]);
        }
        let list: Vec<String> = pids.iter().map(u32::to_string).collect();
        perf.arg("-p").arg(list.join(","));
        let perf = perf
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .context("--syscalls needs perf")?;
        // perf says nothing once it is attached; give it time to.
        tokio::time::sleep(Duration::from_millis(300)).await;
        let switches = context_switches(&pids);
        Ok(SyscallCount {
            perf,
            output,
            pids,
            switches,
        })
    }

    /// Stops counting; adds the counts, by kind, to `into`.
    fn finish(mut self, into: &mut std::collections::BTreeMap<String, u64>) -> anyhow::Result<()> {
        for (thread, after) in context_switches(&self.pids) {
            let before = self.switches.get(&thread).copied().unwrap_or(0);
            *into.entry(format!("switches {thread}")).or_default() += after - before;
        }
        // SIGINT makes perf stat print its counts and exit.
        let pid = i32::try_from(self.perf.id())?;
        // SAFETY: kill has no memory effects; pid is our own child, not yet waited for.
        unsafe { libc::kill(pid, libc::SIGINT) };
        self.perf.wait()?;
        let text = std::fs::read_to_string(&self.output)
            .with_context(|| format!("perf wrote no {}", self.output.display()))?;
        let _ = std::fs::remove_file(&self.output);
        let mut counted = false;
        for line in text.lines() {
            let mut fields = line.split(',');
            let (Some(Ok(count)), Some(event)) =
                (fields.next().map(str::parse::<u64>), fields.nth(1))
            else {
                continue;
            };
            let kind = match event.split_once(':').map_or(event, |(_, name)| name) {
                "sys_enter" => {
                    counted = true;
                    "all".to_string()
                }
                name => match (
                    name.strip_prefix("sys_enter_"),
                    name.strip_prefix("sys_exit_"),
                ) {
                    (Some(call), _) => call.to_string(),
                    (_, Some(call)) => format!("{call} EAGAIN"),
                    _ => continue,
                },
            };
            *into.entry(kind).or_default() += count;
        }
        anyhow::ensure!(
            counted,
            "perf stat counted no syscalls (its tracepoints need root or a low kernel.perf_event_paranoid): {}",
            text.trim()
        );
        Ok(())
    }
}

/// Voluntary and involuntary context switches so far, by thread name, of every
/// thread of `pids` (/proc/PID/task/*/status).
fn context_switches(pids: &[u32]) -> std::collections::BTreeMap<String, u64> {
    let mut by_thread = std::collections::BTreeMap::new();
    for pid in pids {
        let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
            continue;
        };
        for task in tasks.filter_map(Result::ok) {
            let Ok(status) = std::fs::read_to_string(task.path().join("status")) else {
                continue;
            };
            let mut name = String::new();
            for line in status.lines() {
                if let Some(value) = line.strip_prefix("Name:") {
                    name = value.trim().to_string();
                }
                for kind in ["voluntary", "nonvoluntary"] {
                    if let Some(n) = line
                        .strip_prefix(kind)
                        .and_then(|rest| rest.strip_prefix("_ctxt_switches:"))
                        .and_then(|n| n.trim().parse::<u64>().ok())
                    {
                        *by_thread.entry(format!("{kind} {name}")).or_default() += n;
                    }
                }
            }
        }
    }
    by_thread
}

/// One line of `--syscalls` counts per unit: all calls, then by kind, then
/// context switches by thread.
fn describe_counts(samples: &Samples) -> String {
    let units = samples.counted_units.max(1) as f64;
    let per = |n: u64| n as f64 / units;
    let mut parts = Vec::new();
    let mut switches = Vec::new();
    for (kind, &n) in &samples.counts {
        if n == 0 {
            continue;
        }
        match kind.strip_prefix("switches ") {
            Some(thread) => switches.push(format!("{thread} {:.3}", per(n))),
            None if kind == "all" => parts.insert(0, format!("{:.2} syscalls", per(n))),
            None => parts.push(format!("{kind} {:.3}", per(n))),
        }
    }
    format!(
        "{}; context switches: {}",
        parts.join(", "),
        if switches.is_empty() {
            "none".to_string()
        } else {
            switches.join(", ")
        }
    )
}

fn median(values: &[f64]) -> f64 {
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    sorted.get(sorted.len() / 2).copied().unwrap_or(f64::NAN)
}

pub fn run(args: BenchProxyArgs) -> anyhow::Result<()> {
    let cpus = core_affinity::get_core_ids().unwrap_or_default();
    let [client_cpu, proxy_cpu, ..] = cpus[..] else {
        anyhow::bail!("bench proxy needs 2 CPUs");
    };
    nginx_binary()?;
    // A thread of its own, so that pinning it pins only this measurement's runtime.
    std::thread::scope(|scope| {
        scope
            .spawn(|| {
                pinned_runtime(client_cpu.id)?.block_on(measure_all(
                    &args,
                    client_cpu.id,
                    proxy_cpu.id,
                ))
            })
            .join()
            .map_err(|_| anyhow::anyhow!("the proxy measurement panicked"))
    })??;
    if args.hop_only {
        return Ok(());
    }
    let runtime = tokio::runtime::Runtime::new().context("cannot start the async runtime")?;
    runtime.block_on(super::saturation::sse_while_tokenizing(text_prompts(32), 4))
}

async fn measure_all(
    args: &BenchProxyArgs,
    client_cpu: usize,
    proxy_cpu: usize,
) -> anyhow::Result<()> {
    let worker = stub_worker(args.chunks).await?;
    let (mut router, router_addr) = router_process(&format!("http://{worker}"), proxy_cpu).await?;
    let nginx = Nginx::start(worker, proxy_cpu)?;
    let mut baseline = match &args.baseline {
        Some(exe) => Some(router_process_of(exe, &format!("http://{worker}"), proxy_cpu).await?),
        None => None,
    };
    let router_pid = router.id();
    let baseline_pid = baseline.as_ref().map(|(child, _)| child.id());
    let client = pooled_client();
    let loads = [
        (
            "plain",
            Load::Plain {
                requests: args.requests,
            },
        ),
        (
            "streamed",
            Load::Streamed {
                streams: args.streams,
                chunks: args.chunks,
            },
        ),
    ];
    println!(
        "== proxy hop: client and stub worker on CPU {client_cpu}, each proxy in its own process on CPU {proxy_cpu}; {CONCURRENCY} concurrent clients; {} rounds, rotating the order; load average before: {}",
        args.rounds,
        load_average()
    );
    for (name, load) in loads {
        let mut targets = vec![
            format!("http://{worker}/v1/completions"),
            format!("http://{router_addr}/v1/completions"),
            format!("http://{}/v1/completions", nginx.addr),
        ];
        if let Some((_, addr)) = &baseline {
            targets.push(format!("http://{addr}/v1/completions"));
        }
        let mut samples: Vec<Samples> = targets.iter().map(|_| Samples::default()).collect();
        // Warm-up: connections and pools, on every target.
        for url in &targets {
            throughput(&client, url, load).await?;
        }
        for round in 0..args.rounds {
            for i in 0..targets.len() {
                let target = (round + i) % targets.len();
                let cpu = || match target {
                    1 => process_cpu_ns(router_pid),
                    2 => nginx.cpu_ns(),
                    3 => baseline_pid.map_or(Ok(0), process_cpu_ns),
                    _ => Ok(0),
                };
                let pids = match target {
                    1 => vec![router_pid],
                    2 => nginx.pids(),
                    3 => baseline_pid.into_iter().collect(),
                    _ => Vec::new(),
                };
                let counting = if args.syscalls && !pids.is_empty() {
                    Some(SyscallCount::start(pids).await?)
                } else {
                    None
                };
                let before = cpu()?;
                let rate = throughput(&client, &targets[target], load).await?;
                let used = cpu()? - before;
                let (responses, units) = load.shape();
                let counted = (responses / CONCURRENCY * CONCURRENCY * units) as f64;
                let samples = &mut samples[target];
                samples.rate.push(rate);
                samples.cpu_per_unit.push(used as f64 / counted);
                if let Some(counting) = counting {
                    counting.finish(&mut samples.counts)?;
                    samples.counted_units += counted as u64;
                }
            }
        }
        let unit = match load {
            Load::Plain { .. } => "request",
            Load::Streamed { .. } => "chunk",
        };
        let direct = median(&samples[0].rate);
        println!("\n{name} ({}):", describe(load));
        println!("  direct:  {direct:.0} {unit}s/s");
        for (target, label) in [(1, "kvroute"), (2, "nginx"), (3, "baseline")] {
            if target >= targets.len() {
                continue;
            }
            let rate = median(&samples[target].rate);
            let cpu = median(&samples[target].cpu_per_unit) / 1000.0;
            println!(
                "  {label:<8} {rate:.0} {unit}s/s, throughput loss {:.1}%, proxy CPU {cpu:.2} µs per {unit}",
                100.0 * (1.0 - rate / direct)
            );
            if args.syscalls {
                println!(
                    "           per {unit}: {}",
                    describe_counts(&samples[target])
                );
            }
        }
        let loss = |t: usize| 1.0 - median(&samples[t].rate) / direct;
        let goal = match load {
            Load::Plain { .. } => 20.0,
            Load::Streamed { .. } => 1.0,
        };
        println!(
            "  goals: kvroute's loss no worse than nginx's: {}; kvroute CPU ≤ {goal} µs per {unit}: {}",
            met(loss(1) <= loss(2)),
            met(median(&samples[1].cpu_per_unit) / 1000.0 <= goal)
        );
    }
    println!("\nload average after: {}", load_average());
    drop(nginx);
    for child in std::iter::once(&mut router).chain(baseline.as_mut().map(|(c, _)| c)) {
        drop(child.stdin.take());
        child.wait()?;
    }
    Ok(())
}

fn describe(load: Load) -> String {
    match load {
        Load::Plain { requests } => {
            format!("{requests} small non-streaming completions, 64-token token-id prompts")
        }
        Load::Streamed { streams, chunks } => format!(
            "{streams} streamed responses of {chunks} SSE chunks of {} bytes, sent back to back; CPU per chunk includes each stream's request",
            CHUNK.len()
        ),
    }
}

fn met(ok: bool) -> &'static str {
    if ok { "met" } else { "MISSED" }
}

fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|l| l.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_default()
}
