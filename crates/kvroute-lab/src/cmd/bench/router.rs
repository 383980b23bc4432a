//! `kvroute-lab bench router`: the router's speed goals, measured in one run.
//!
//! 1. Routing decision latency (hash + match + schedule) for 8k- and 128k-token
//!    prompts over a fleet whose index holds ~1M blocks, with 64 and with 4,000
//!    registered workers; tokenization is measured separately. Beside the
//!    wall-clock figures, each decision's thread CPU time and whether the
//!    kernel switched the thread out during it or just before it, so that a
//!    p99 set by a busy machine can be told from one set by the router.
//! 2. Routing throughput on one core for 8k-token text prompts, tokenization
//!    included, with tiktoken cl100k_base and with a Hugging Face
//!    `tokenizer.json` of cl100k_base's 100k tokens: parse nothing, but
//!    tokenize, hash, match, schedule, book and release, as the HTTP path does
//!    per request. Then multi-turn conversations: a follow-up turn of a
//!    32k-token conversation against tokenizing it whole (`tokenize` module),
//!    and streamed chunks passing through a router that tokenizes at
//!    saturation (`saturation` module).
//! 3. Proxy overhead: small non-streaming responses from a stub worker, called
//!    directly and through a router, over loopback, twice: with client, router
//!    and worker in one process sharing every core (the router's CPU is taken
//!    from the client and the worker), and as deployed, with the router in a
//!    process of its own pinned to its own CPU while the client and the worker
//!    share another, plus the CPU each side spends per request.
//!
//! The machine is shared, so only ratios measured in the same run are
//! meaningful.

use std::sync::Arc;
use std::time::Instant;

use anyhow::Context;
use bytes::Bytes;
use clap::Args;
use hdrhistogram::Histogram;
use kvroute_index::{BlockHasher, EventKind, KvEvent, StoredBlock, WorkerKey};
use kvroute_router::server;
use kvroute_router::state::{AppState, RouteInput};
use kvroute_tokenize::TokenizerSpec;

use super::cpu_time::{process_cpu_ns, thread_cpu_time};
use super::fixture::{
    HttpClient, Lcg, MODEL, pooled_client, post, proxy_config, quiet_config, register_workers,
    stub_worker, text_prompts,
};

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
    /// Fleet sizes the decision latency is measured at, comma-separated.
    #[arg(long, value_delimiter = ',', default_values_t = [64, 4000])]
    workers: Vec<u64>,
    /// Only the tokenization parts: throughput and multi-turn (for profiling).
    #[arg(long)]
    tokenize_only: bool,
}

const BLOCK_SIZE: usize = 16;

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
    let workers = if args.tokenize_only {
        &[][..]
    } else {
        &args.workers[..]
    };
    for &workers in workers {
        for prompt_tokens in [8 * 1024, 128 * 1024] {
            decision_latency(&args, workers, prompt_tokens)?;
        }
    }
    // A Hugging Face tokenizer of real size, written for this run.
    let hf_dir = std::env::temp_dir().join(format!("kvroute-bench-cl100k-{}", std::process::id()));
    super::tokenize::write_cl100k_tokenizer_json(&hf_dir)?;
    let tiktoken: TokenizerSpec = "tiktoken:cl100k_base".parse()?;
    let hf = TokenizerSpec::HuggingFace {
        dir_or_file: hf_dir.clone(),
    };
    super::tokenize::throughput(
        args.throughput_requests,
        &[
            (&tiktoken, "tiktoken cl100k_base"),
            (
                &hf,
                "Hugging Face tokenizer.json of cl100k_base's 100k tokens",
            ),
        ],
    )?;
    println!(
        "\n== multi-turn: the last turn of a conversation whose earlier turns were routed, against tokenizing it with no cache (wall clock, one thread)"
    );
    super::tokenize::multi_turn(&tiktoken, "tiktoken chat", true)?;
    super::tokenize::multi_turn(&hf, "Hugging Face chat", true)?;
    super::tokenize::multi_turn(&tiktoken, "tiktoken completions prompt", false)?;
    super::tokenize::multi_turn(&hf, "Hugging Face completions prompt", false)?;
    let _ = std::fs::remove_dir_all(&hf_dir);
    if args.tokenize_only {
        return Ok(());
    }
    let runtime = tokio::runtime::Runtime::new().context("cannot start the async runtime")?;
    runtime.block_on(super::saturation::sse_while_tokenizing(text_prompts(32), 4))?;
    runtime.block_on(proxy_same_process(&args))?;
    proxy_separated(&args)
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
    // With the process's metrics recorder, as `serve` runs, and installed
    // before the first decision is timed (installing it calibrates a clock for
    // up to 200 ms, once per process).
    let state = AppState::new(quiet_config(), Some(kvroute_router::metrics::handle()))?;
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
    let mut record = Histogram::<u64>::new(3)?;
    let mut book = Histogram::<u64>::new(3)?;
    let hasher = BlockHasher::new(BLOCK_SIZE);
    let mut matched = 0usize;
    let mut switches = Switches::new()?;
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
        // The decision first, on caches no separate timing has warmed for it.
        let before = ThreadUsage::now();
        let t = Instant::now();
        let routed = state
            .route_now(MODEL, RouteInput::Tokens(&prompt), None, None, &[])?
            .map_err(|e| anyhow::anyhow!("no worker: {e:?}"))?;
        let wall = t.elapsed().as_nanos() as u64;
        switches.record(before, ThreadUsage::now(), wall)?;
        total.record(wall)?;
        let t = Instant::now();
        state.record_prediction(&routed);
        record.record(t.elapsed().as_nanos() as u64)?;
        let decision = &routed.decision;
        let t = Instant::now();
        drop(state.registry.book(
            decision.worker,
            decision.new_prefill_tokens,
            decision.request_blocks,
        ));
        book.record(t.elapsed().as_nanos() as u64)?;
        let worker = decision.worker;
        // Then its parts on their own.
        let t = Instant::now();
        let local = hasher.local_hashes(&prompt);
        hash_only.record(t.elapsed().as_nanos() as u64)?;
        let t = Instant::now();
        std::hint::black_box(state.index.find_matches(&local));
        index_only.record(t.elapsed().as_nanos() as u64)?;
        let t = Instant::now();
        std::hint::black_box(state.predicted.find_matches(&local, Instant::now()));
        predicted_only.record(t.elapsed().as_nanos() as u64)?;
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
        summary("  decision (hash + match + schedule)", &total)
    );
    switches.report();
    println!(
        "{}",
        summary(
            "  then, on the request path: recording the prediction",
            &record
        )
    );
    println!("{}", summary("  then: booking the load", &book));
    println!(
        "  routed to the prefix's owner: {matched}/{}",
        args.decisions
    );
    let (target_us, size) = if prompt_tokens <= 8192 {
        (50, "8k")
    } else {
        (150, "128k")
    };
    let met = |ok: bool| if ok { "met" } else { "MISSED" };
    println!(
        "  target: decision p99 ≤ {target_us} µs at {size} tokens: {}",
        met(total.value_at_quantile(0.99) <= target_us * 1000)
    );
    println!(
        "  target: recording p50 ≤ decision p50: {}",
        met(record.value_at_quantile(0.5) <= total.value_at_quantile(0.5))
    );
    Ok(())
}

/// What the calling thread has used so far, as the kernel counts it.
#[derive(Clone, Copy)]
struct ThreadUsage {
    cpu_ns: u64,
    /// Times it was preempted (involuntary switches) or waited (voluntary).
    preempted: u64,
    waited: u64,
    faults: u64,
}

impl ThreadUsage {
    fn now() -> Self {
        // SAFETY: the call only writes the struct passed.
        let ru = unsafe {
            let mut ru: libc::rusage = std::mem::zeroed();
            libc::getrusage(libc::RUSAGE_THREAD, &mut ru);
            ru
        };
        Self {
            cpu_ns: thread_cpu_time().map_or(0, |t| t.as_nanos() as u64),
            preempted: ru.ru_nivcsw as u64,
            waited: ru.ru_nvcsw as u64,
            faults: (ru.ru_minflt + ru.ru_majflt) as u64,
        }
    }

    fn since(&self, before: &Self) -> Self {
        Self {
            cpu_ns: self.cpu_ns - before.cpu_ns,
            preempted: self.preempted - before.preempted,
            waited: self.waited - before.waited,
            faults: self.faults - before.faults,
        }
    }

    fn switched(&self) -> bool {
        self.preempted + self.waited > 0
    }
}

/// The decisions' wall times split by what the kernel did meanwhile, so that
/// a p99 set by a busy machine says so: a decision switched out (preempted,
/// or waiting for a lock) costs milliseconds, and one that starts right after
/// its thread got its core back starts on caches someone else filled.
struct Switches {
    cpu: Histogram<u64>,
    kept_core: Histogram<u64>,
    settled: Histogram<u64>,
    preempted: usize,
    waited: usize,
    after_switch: usize,
    faulted: usize,
    faults: u64,
    last: ThreadUsage,
}

impl Switches {
    fn new() -> anyhow::Result<Self> {
        Ok(Self {
            cpu: Histogram::new(3)?,
            kept_core: Histogram::new(3)?,
            settled: Histogram::new(3)?,
            preempted: 0,
            waited: 0,
            after_switch: 0,
            faulted: 0,
            faults: 0,
            last: ThreadUsage::now(),
        })
    }

    /// One decision of `wall` ns, between the two readings.
    fn record(&mut self, before: ThreadUsage, after: ThreadUsage, wall: u64) -> anyhow::Result<()> {
        let during = after.since(&before);
        let switched_before = before.since(&self.last).switched();
        self.last = after;
        self.cpu.record(during.cpu_ns.max(1))?;
        self.preempted += (during.preempted > 0) as usize;
        self.waited += (during.waited > 0) as usize;
        self.faulted += (during.faults > 0) as usize;
        self.faults += during.faults;
        if !during.switched() {
            self.kept_core.record(wall)?;
            if switched_before {
                self.after_switch += 1;
            } else {
                self.settled.record(wall)?;
            }
        }
        Ok(())
    }

    fn report(&self) {
        println!("{}", summary("    on the thread's CPU clock", &self.cpu));
        println!("{}", summary("    wall, not switched out", &self.kept_core));
        println!(
            "{}",
            summary("    wall, nor switched out just before", &self.settled)
        );
        println!(
            "    switched out: {} preempted, {} waited; {} more right after a switch; {} with page faults ({} faults)",
            self.preempted, self.waited, self.after_switch, self.faulted, self.faults
        );
    }
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

/// Prints the direct and proxied lines and whether the targets are met.
fn report_proxy(direct: (f64, f64), proxied: (f64, f64)) {
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
}

/// The proxy measured with client, router and worker sharing one process and
/// every core: the router's CPU is taken from the client and the worker.
async fn proxy_same_process(args: &BenchRouterArgs) -> anyhow::Result<()> {
    let worker = stub_worker().await?;
    let router = server::start(proxy_config(&format!("http://{worker}"))).await?;
    let client = pooled_client();
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
        "\n== proxy, same process: small non-streaming responses over loopback; client, router and worker share one runtime on every core"
    );
    report_proxy(direct, proxied);
    router.shutdown().await;
    Ok(())
}

/// `kvroute-lab bench router-proxy` (hidden): the router half of the separated
/// proxy measurement, started by [`proxy_separated`]. It pins itself to `cpu`,
/// prints its HTTP address on stdout and serves until its stdin closes.
#[derive(Args)]
pub struct RouterProxyArgs {
    /// Base URL of the stub worker to proxy to.
    #[arg(long)]
    worker_url: String,
    /// The CPU the router runs on.
    #[arg(long)]
    cpu: usize,
}

pub fn router_proxy(args: RouterProxyArgs) -> anyhow::Result<()> {
    anyhow::ensure!(
        core_affinity::set_for_current(core_affinity::CoreId { id: args.cpu }),
        "cannot pin the router to CPU {}",
        args.cpu
    );
    // The runtime `kvroute serve` chooses on one CPU (its `runtime()`): the
    // single-threaded scheduler.
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("cannot start the async runtime")?
        .block_on(async {
            let router = server::start(proxy_config(&args.worker_url)).await?;
            println!("{}", router.http_addr);
            std::io::Write::flush(&mut std::io::stdout())?;
            tokio::task::spawn_blocking(|| {
                std::io::copy(&mut std::io::stdin(), &mut std::io::sink())
            })
            .await??;
            router.shutdown().await;
            Ok(())
        })
}

/// Pins the calling thread to `cpu` and builds a runtime with one worker
/// thread, which inherits the pinning (threads inherit their creator's affinity).
pub(super) fn pinned_runtime(cpu: usize) -> anyhow::Result<tokio::runtime::Runtime> {
    anyhow::ensure!(
        core_affinity::set_for_current(core_affinity::CoreId { id: cpu }),
        "cannot pin this thread to CPU {cpu}"
    );
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .context("cannot start the async runtime")
}

/// The proxy as deployed: the router on a CPU of its own. The client and the
/// stub worker run on one CPU in this process, the router in a child process
/// pinned to another, so direct and proxied runs give the client and the worker
/// the same CPU, and the difference is what the router costs them.
fn proxy_separated(args: &BenchRouterArgs) -> anyhow::Result<()> {
    let cpus = core_affinity::get_core_ids().unwrap_or_default();
    let [client_cpu, router_cpu, ..] = cpus[..] else {
        println!("\n== proxy, separated: skipped, fewer than 2 CPUs available");
        return Ok(());
    };
    let requests = args.proxy_requests;
    // A thread of its own, so that pinning it pins only this measurement's runtime.
    std::thread::scope(|scope| {
        scope
            .spawn(|| {
                pinned_runtime(client_cpu.id)?.block_on(proxy_separated_on(
                    requests,
                    client_cpu.id,
                    router_cpu.id,
                ))
            })
            .join()
            .map_err(|_| anyhow::anyhow!("the separated proxy measurement panicked"))?
    })
}

/// Starts `kvroute-lab bench router-proxy` in a child process pinned to `cpu`,
/// proxying to `worker_url`; returns it and its HTTP address. Closing its
/// stdin stops it.
pub(super) async fn router_process(
    worker_url: &str,
    cpu: usize,
) -> anyhow::Result<(std::process::Child, String)> {
    router_process_of(&std::env::current_exe()?, worker_url, cpu).await
}

/// Like [`router_process`], from the kvroute-lab binary `exe` (another build).
pub(super) async fn router_process_of(
    exe: &std::path::Path,
    worker_url: &str,
    cpu: usize,
) -> anyhow::Result<(std::process::Child, String)> {
    let mut child = std::process::Command::new(exe)
        .args(["bench", "router-proxy", "--cpu", &cpu.to_string()])
        .args(["--worker-url", worker_url])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .context("cannot start the router process")?;
    let stdout = child.stdout.take().context("no stdout")?;
    let router_addr = tokio::task::spawn_blocking(move || {
        let mut line = String::new();
        std::io::BufRead::read_line(&mut std::io::BufReader::new(stdout), &mut line)?;
        anyhow::Ok(line.trim().to_string())
    })
    .await??;
    anyhow::ensure!(
        !router_addr.is_empty(),
        "the router process printed no address"
    );
    Ok((child, router_addr))
}

async fn proxy_separated_on(
    requests: usize,
    client_cpu: usize,
    router_cpu: usize,
) -> anyhow::Result<()> {
    let worker = stub_worker().await?;
    let (mut child, router_addr) = router_process(&format!("http://{worker}"), router_cpu).await?;
    let client = pooled_client();
    let own = std::process::id();
    let before = process_cpu_ns(own)?;
    let direct = measure(
        &client,
        &format!("http://{worker}/v1/completions"),
        requests,
    )
    .await?;
    let direct_cpu = process_cpu_ns(own)? - before;
    let (before, router_before) = (process_cpu_ns(own)?, process_cpu_ns(child.id())?);
    let proxied = measure(
        &client,
        &format!("http://{router_addr}/v1/completions"),
        requests,
    )
    .await?;
    let proxied_cpu = process_cpu_ns(own)? - before;
    let router_cpu_used = process_cpu_ns(child.id())? - router_before;
    // Closing stdin stops the router.
    drop(child.stdin.take());
    child.wait()?;
    // measure() sends 200 warm-up, requests/4 sequential and requests concurrent ones.
    let sent = (200 + requests / 4 + requests / 16 * 16) as f64;
    println!(
        "\n== proxy, separated: client and stub worker in this process on CPU {client_cpu}, router in its own process on CPU {router_cpu}"
    );
    report_proxy(direct, proxied);
    println!(
        "  CPU per request: client + worker {:.0} µs direct, {:.0} µs proxied; router {:.0} µs (≈ {:.0} requests/s per router core)",
        direct_cpu as f64 / sent / 1000.0,
        proxied_cpu as f64 / sent / 1000.0,
        router_cpu_used as f64 / sent / 1000.0,
        sent * 1e9 / router_cpu_used as f64
    );
    Ok(())
}
