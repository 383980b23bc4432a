//! `kvroute bench e2e`: a Mooncake trace through the router and a simulated
//! fleet (all in this process, on loopback) under each routing policy:
//! client-side TTFT, inter-token and end-to-end latency, throughput, the workers'
//! actual prefix hit rate, the router's predicted hit rate, and Jain's fairness
//! of the workers' load. With `--eviction a,b,...` every routing policy runs
//! once per eviction policy, and the table adds each eviction policy's goals
//! (see `kvroute_sim::eviction`) and hit rate and TTFT per priority class
//! (requests take classes 0, 1, 2 in turn). With `--replicas N` the routers
//! are replicas on NATS JetStream instead (see `crate::e2e::replicas`). Writes
//! JSON, and a chart with `--plot`.

use std::path::PathBuf;

use anyhow::Context;
use clap::Args;
use kvroute_router::config::Policy;
use serde_json::json;

use kvroute_sim::EngineConfig;

use crate::cmd::sim::EngineArgs;
use crate::e2e::{self, Fleet, PolicyReport, Replay, replicas};
use crate::plot::{LineChart, Series, write_line_chart};

#[derive(Args)]
pub struct E2eArgs {
    /// Mooncake JSON Lines trace.
    #[arg(long)]
    trace: PathBuf,
    /// Simulated workers.
    #[arg(long, default_value_t = 8)]
    workers: usize,
    /// Routing policies to compare (comma-separated).
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "kv,round_robin,random,approx"
    )]
    policies: Vec<Policy>,
    /// Replay only the first N requests.
    #[arg(long)]
    max_requests: Option<usize>,
    /// Arrival rate multiplier on top of the speedup (2: twice the trace's rate).
    #[arg(long, default_value_t = 1.0)]
    rate: f64,
    /// Router configuration (config/router.toml's format; `KVROUTE_...`
    /// variables apply too) for every run; the bench sets its addresses, block
    /// size and policy.
    #[arg(long)]
    config: Option<PathBuf>,
    /// Caps each request's output tokens.
    #[arg(long)]
    max_output_tokens: Option<u32>,
    /// Write the JSON report here instead of stdout.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Draw TTFT distributions and hit rates per policy to FILE.png or FILE.svg.
    #[arg(long, value_name = "FILE")]
    plot: Option<PathBuf>,
    /// Route through router replicas on NATS JetStream instead: one replica,
    /// N sharing load and N not sharing it, side by side (each a fresh
    /// nats-server and `kvroute serve` processes; clients round-robin).
    #[arg(long, value_name = "N")]
    replicas: Option<usize>,
    /// Engines (the trace needs `--block-size 512` for its blocks to be engine blocks).
    #[command(flatten)]
    engine: EngineArgs,
}

pub fn run(args: E2eArgs) -> anyhow::Result<()> {
    anyhow::ensure!(args.workers > 0, "--workers must be at least 1");
    anyhow::ensure!(args.rate > 0.0, "--rate must be positive");
    let trace = kvroute_trace::read_trace(&args.trace, args.max_requests)
        .with_context(|| format!("cannot read the trace {}", args.trace.display()))?;
    let engine = args.engine.engine_config();
    let evictions = args.engine.eviction.clone();
    let router = kvroute_router::Config::load(args.config.as_deref(), std::env::vars())?;
    let replay = Replay {
        time_scale: args.engine.speedup * args.rate,
        max_output_tokens: args.max_output_tokens,
    };
    let runtime = tokio::runtime::Runtime::new().context("cannot start the async runtime")?;
    if let Some(replicas) = args.replicas {
        return run_replicas(&args, replicas, &trace, &router, replay, &runtime);
    }
    let reports = runtime.block_on(async {
        let mut reports = Vec::new();
        for &eviction in &evictions {
            let engine = EngineConfig {
                eviction,
                ..engine.clone()
            };
            for &policy in &args.policies {
                eprintln!(
                    "bench e2e: {} requests under {} on {} engines, evicting with {eviction} ...",
                    trace.len(),
                    policy.as_str(),
                    engine.kind
                );
                let fleet = Fleet::start(args.workers, &engine, &router, policy).await?;
                reports.push(e2e::run(&fleet, policy, &trace, replay).await?);
                fleet.shutdown().await;
            }
        }
        anyhow::Ok(reports)
    })?;
    eprintln!("\nengines: {}\n{}", engine.kind, e2e::table(&reports, true));
    for r in &reports {
        // A step delivered late delays every token after it: past a few timer
        // ticks on average, the latencies measure this machine, not the model.
        if r.sim_lag_ms.mean > 5.0 {
            eprintln!(
                "warning: under {} the simulated engines ran {:.1} ms behind their cost model on \
                 average (at most {:.0} ms): this machine cannot keep up with --speedup {}; \
                 latencies are inflated, lower --speedup or --rate",
                r.policy, r.sim_lag_ms.mean, r.sim_lag_ms.max, args.engine.speedup
            );
        }
    }
    let report = json!({
        "trace": args.trace,
        "requests": trace.len(),
        "workers": args.workers,
        "engine": engine.kind.name(),
        "kv_blocks": engine.kv_blocks,
        "block_size": engine.block_size,
        "evictions": evictions.iter().map(|e| e.name()).collect::<Vec<_>>(),
        "speedup": args.engine.speedup,
        "rate": args.rate,
        "max_output_tokens": args.max_output_tokens,
        "policies": reports,
    });
    let text = serde_json::to_string_pretty(&report)?;
    match &args.json {
        Some(path) => std::fs::write(path, text)
            .with_context(|| format!("cannot write {}", path.display()))?,
        None => println!("{text}"),
    }
    if let Some(path) = &args.plot {
        plot(path, &reports)?;
    }
    Ok(())
}

/// `--replicas N`: per eviction and routing policy, one replica, N sharing
/// load, N not sharing it.
fn run_replicas(
    args: &E2eArgs,
    replicas: usize,
    trace: &[kvroute_trace::TraceRequest],
    router: &kvroute_router::Config,
    replay: Replay,
    runtime: &tokio::runtime::Runtime,
) -> anyhow::Result<()> {
    anyhow::ensure!(
        replicas >= 2,
        "--replicas must be at least 2 (it is compared with 1)"
    );
    let engine = args.engine.engine_config();
    let routers = replicas::Routers {
        config: args.config.as_deref(),
        block_size: engine.block_size,
        speedup: engine.cost.speedup,
        router,
    };
    let setups = [
        replicas::Setup {
            replicas: 1,
            share_load: true,
        },
        replicas::Setup {
            replicas,
            share_load: true,
        },
        replicas::Setup {
            replicas,
            share_load: false,
        },
    ];
    let mut tables = String::new();
    let mut runs = Vec::new();
    for &eviction in &args.engine.eviction {
        let engine = EngineConfig {
            eviction,
            ..engine.clone()
        };
        for &policy in &args.policies {
            let mut reports = Vec::new();
            for setup in setups {
                eprintln!(
                    "bench e2e: {} requests under {} through {}, evicting with {eviction} ...",
                    trace.len(),
                    policy.as_str(),
                    setup.label()
                );
                reports.push(runtime.block_on(replicas::run(
                    setup,
                    args.workers,
                    &engine,
                    &routers,
                    policy,
                    trace,
                    replay,
                ))?);
            }
            tables.push_str(&format!(
                "
{} routing, {eviction} eviction, {} engines:
{}",
                policy.as_str(),
                engine.kind,
                replicas::table(&reports)
            ));
            runs.extend(reports);
        }
    }
    eprintln!("{tables}");
    let report = json!({
        "trace": args.trace,
        "requests": trace.len(),
        "workers": args.workers,
        "replicas": replicas,
        "engine": engine.kind.name(),
        "speedup": args.engine.speedup,
        "rate": args.rate,
        "runs": runs,
    });
    let text = serde_json::to_string_pretty(&report)?;
    match &args.json {
        Some(path) => std::fs::write(path, text)
            .with_context(|| format!("cannot write {}", path.display()))?,
        None => println!("{text}"),
    }
    Ok(())
}

/// TTFT CDF per policy; each series' name carries its hit rate.
fn plot(path: &std::path::Path, reports: &[PolicyReport]) -> anyhow::Result<()> {
    let series = reports
        .iter()
        .map(|r| {
            let mut samples = r.ttft_samples_ms.clone();
            samples.sort_by(f64::total_cmp);
            // One point per percentile keeps the chart readable at any trace size.
            let points = (0..=100)
                .filter(|_| !samples.is_empty())
                .map(|pct| {
                    let index = (samples.len() - 1) * pct / 100;
                    (samples[index], pct as f64)
                })
                .collect();
            Series {
                name: format!("{} (hit {:.0}%)", r.policy, r.worker_hit_rate * 100.0),
                points,
                dashed: false,
            }
        })
        .collect();
    write_line_chart(
        path,
        &LineChart {
            title: "TTFT distribution per policy (legend: workers' prefix hit rate)".into(),
            x_label: "time to first token (ms)",
            y_label: "requests with a shorter TTFT (%)",
            log_x: false,
            y_range: 0.0..100.0,
            series,
        },
    )
}
