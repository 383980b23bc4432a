//! `kvroute-lab bench e2e`: a Mooncake trace through the router and a simulated
//! fleet (all in this process, on loopback) under each routing policy:
//! client-side TTFT, inter-token and end-to-end latency, throughput, the workers'
//! actual prefix hit rate, the router's predicted hit rate, and Jain's fairness
//! of the workers' load. With `--eviction a,b,...` every routing policy runs
//! once per eviction policy, and the table adds each eviction policy's goals
//! (see `kvroute_sim::eviction`) and hit rate and TTFT per priority class
//! (requests take classes 0, 1, 2 in turn). With `--replicas N` the routers
//! are replicas on NATS JetStream instead (see `replicas`). Writes
//! JSON, and a chart with `--plot`.
//!
//! `kv` runs once per `--kv-costs` entry, so the old cost and the new show side
//! by side: `blocks` is Dynamo's cost as it was (`overlap_weight`, no slack),
//! `seconds` the time cost with the configuration's knobs. `--rate 1,2,3` runs
//! everything at each rate. With `round_robin` among the policies, every `kv`
//! run is checked against issue 13's routing goals (see [`goals`]). `--api
//! chat|responses|messages` replays the trace as text through that API
//! instead of token ids through completions.

mod goals;
mod replicas;

use std::path::PathBuf;

use anyhow::Context;
use clap::Args;
use kvroute_e2e::{Fleet, PolicyReport, Replay};
use kvroute_router::config::{Cost, Policy, QueueOrder};
use kvroute_sim::EngineConfig;
use kvroute_sim::cli::EngineArgs;
use serde_json::json;

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
    /// Arrival rate multipliers on top of the speedup (2: twice the trace's
    /// rate); comma-separated, each a run of every policy.
    #[arg(long, value_delimiter = ',', default_value = "1")]
    rate: Vec<f64>,
    /// The `kv` policy runs once per cost: `blocks` (Dynamo's, as before:
    /// `overlap_weight`, no slack) and `seconds` (the config's knobs).
    #[arg(long, value_delimiter = ',', default_value = "blocks,seconds")]
    kv_costs: Vec<Cost>,
    /// The `kv` policy runs once per order of the router's own queue
    /// (`fifo`, `longest_prefix`; it matters only when a busy limit makes
    /// requests queue); default: the configuration's.
    #[arg(long, value_delimiter = ',')]
    queue_orders: Vec<QueueOrder>,
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
    /// The API the requests use: `completions` (the trace's token ids), or
    /// `chat`, `responses` or `messages` (a text of the same prefixes, one
    /// user turn, tokenized by router and engines with the engines' tokenizer
    /// unless the config names one).
    #[arg(long, default_value = "completions")]
    api: kvroute_e2e::Api,
    /// Engines (the trace needs `--block-size 512` for its blocks to be engine blocks).
    #[command(flatten)]
    engine: EngineArgs,
}

pub fn run(args: E2eArgs) -> anyhow::Result<()> {
    anyhow::ensure!(args.workers > 0, "--workers must be at least 1");
    anyhow::ensure!(
        !args.rate.is_empty() && args.rate.iter().all(|&r| r > 0.0),
        "--rate must be positive"
    );
    anyhow::ensure!(!args.kv_costs.is_empty(), "--kv-costs must name a cost");
    let trace = kvroute_trace::read_trace(&args.trace, args.max_requests)
        .with_context(|| format!("cannot read the trace {}", args.trace.display()))?;
    let engine = args.engine.engine_config();
    let evictions = args.engine.eviction.clone();
    let mut router = kvroute_router::Config::load(args.config.as_deref(), std::env::vars())?;
    if args.api != kvroute_e2e::Api::Completions && router.tokenizer.0.is_empty() {
        router.tokenizer.0 = vec![kvroute_sim::WorkerConfig::new(0, engine.clone()).tokenizer];
    }
    let top_rate = args.rate.iter().copied().fold(0.0, f64::max);
    let runtime = tokio::runtime::Runtime::new().context("cannot start the async runtime")?;
    if let Some(replicas) = args.replicas {
        anyhow::ensure!(args.rate.len() == 1, "--replicas runs at one --rate");
        anyhow::ensure!(
            args.api == kvroute_e2e::Api::Completions,
            "--replicas replays completions only"
        );
        let replay = Replay {
            time_scale: args.engine.speedup * args.rate[0],
            max_output_tokens: args.max_output_tokens,
            api: args.api,
        };
        return run_replicas(&args, replicas, &trace, &router, replay, &runtime);
    }
    let mut runs = Vec::new();
    for &rate in &args.rate {
        let replay = Replay {
            time_scale: args.engine.speedup * rate,
            max_output_tokens: args.max_output_tokens,
            api: args.api,
        };
        let reports = runtime.block_on(async {
            let mut reports = Vec::new();
            for &eviction in &evictions {
                let engine = EngineConfig {
                    eviction,
                    ..engine.clone()
                };
                for &policy in &args.policies {
                    for (label, router) in
                        variants(policy, &router, &args.kv_costs, &args.queue_orders)
                    {
                        eprintln!(
                            "bench e2e: {} requests at rate {rate} under {label} on {} engines, \
                             evicting with {eviction} ...",
                            trace.len(),
                            engine.kind
                        );
                        let fleet = Fleet::start(args.workers, &engine, &router, policy).await?;
                        let mut report = kvroute_e2e::run(&fleet, policy, &trace, replay).await?;
                        report.policy = label;
                        reports.push(report);
                        fleet.shutdown().await;
                    }
                }
            }
            anyhow::Ok(reports)
        })?;
        eprintln!(
            "\nengines: {}, rate {rate}\n{}",
            engine.kind,
            kvroute_e2e::table(&reports, true)
        );
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
        runs.push((rate, reports));
    }
    let goals = check_goals(&args, &trace, &engine, &runs, top_rate)?;
    let report = json!({
        "trace": args.trace,
        "requests": trace.len(),
        "workers": args.workers,
        "engine": engine.kind.name(),
        "kv_blocks": engine.kv_blocks,
        "offload_blocks": engine.offload_blocks,
        "offload_weight": router.scheduler.offload_weight,
        "block_size": engine.block_size,
        "evictions": evictions.iter().map(|e| e.name()).collect::<Vec<_>>(),
        "speedup": args.engine.speedup,
        "max_output_tokens": args.max_output_tokens,
        "api": args.api,
        "runs": runs.iter().map(|(rate, reports)| json!({
            "rate": rate,
            "policies": reports,
        })).collect::<Vec<_>>(),
        "goals": goals,
    });
    let text = serde_json::to_string_pretty(&report)?;
    match &args.json {
        Some(path) => std::fs::write(path, text)
            .with_context(|| format!("cannot write {}", path.display()))?,
        None => println!("{text}"),
    }
    if let Some(path) = &args.plot {
        let (_, top) = runs.last().expect("at least one rate");
        plot(path, top)?;
        if runs.len() > 1 {
            plot_rates(path, &runs, &goals)?;
        }
    }
    Ok(())
}

/// The runs `policy` makes: `kv` one per cost and queue order (labelled
/// `kv:COST:ORDER` with the parts that vary), the others one each.
fn variants(
    policy: Policy,
    router: &kvroute_router::Config,
    costs: &[Cost],
    orders: &[QueueOrder],
) -> Vec<(String, kvroute_router::Config)> {
    if policy != Policy::Kv {
        return vec![(policy.as_str().to_string(), router.clone())];
    }
    let orders = if orders.is_empty() {
        &[router.scheduler.queue_order][..]
    } else {
        orders
    };
    let mut out = Vec::new();
    for &cost in costs {
        for &order in orders {
            let mut config = router.clone();
            config.scheduler.cost = cost;
            config.scheduler.queue_order = order;
            if cost == Cost::Blocks {
                config.scheduler.overlap_slack = 0.0;
            }
            let mut label = "kv".to_string();
            if costs.len() > 1 {
                label += &format!(":{}", cost.as_str());
            }
            if orders.len() > 1 {
                label += &format!(":{}", order.as_str());
            }
            out.push((label, config));
        }
    }
    out
}

/// Each `kv` run's goals against round robin's run at the same rate and
/// eviction policy, printed per rate; empty without `round_robin`.
fn check_goals(
    args: &E2eArgs,
    trace: &[kvroute_trace::TraceRequest],
    engine: &EngineConfig,
    runs: &[(f64, Vec<PolicyReport>)],
    top_rate: f64,
) -> anyhow::Result<Vec<serde_json::Value>> {
    let mut out = Vec::new();
    if !args.policies.contains(&Policy::RoundRobin) {
        return Ok(out);
    }
    for &eviction in &args.engine.eviction {
        let engine = EngineConfig {
            eviction,
            ..engine.clone()
        };
        let bound = goals::shared_cache_bound(trace, args.workers, &engine)?;
        for (rate, reports) in runs {
            let of_eviction = |r: &&PolicyReport| r.eviction == eviction.name();
            let Some(round_robin) = reports
                .iter()
                .filter(of_eviction)
                .find(|r| r.policy == Policy::RoundRobin.as_str())
            else {
                continue;
            };
            let is_top = args.rate.len() > 1 && *rate == top_rate;
            let columns: Vec<(String, Vec<goals::Goal>)> = reports
                .iter()
                .filter(of_eviction)
                .filter(|r| r.policy.starts_with(Policy::Kv.as_str()))
                .map(|kv| {
                    (
                        kv.policy.clone(),
                        goals::goals(kv, round_robin, bound, is_top),
                    )
                })
                .collect();
            eprintln!(
                "\ngoals: {} engines evicting with {eviction}, rate {rate}{} \
                 (one shared cache of {} blocks: {:.1}%)\n{}",
                engine.kind,
                if is_top { " (top)" } else { "" },
                args.workers * engine.kv_blocks,
                bound * 100.0,
                goals::table(&columns)
            );
            for (policy, goals) in columns {
                out.push(json!({
                    "rate": rate,
                    "eviction": eviction.name(),
                    "policy": policy,
                    "shared_cache_hit_rate": bound,
                    "goals": goals,
                }));
            }
        }
    }
    Ok(out)
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
        "rate": args.rate[0],
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

/// Beside `path`: `STEM-hit.EXT`, each policy's hit rate against the rate
/// (with the shared-cache bound dashed), and `STEM-ttft.EXT`, TTFT p50 and p99.
fn plot_rates(
    path: &std::path::Path,
    runs: &[(f64, Vec<PolicyReport>)],
    goals: &[serde_json::Value],
) -> anyhow::Result<()> {
    let sibling = |suffix: &str| {
        let stem = path.file_stem().and_then(|s| s.to_str()).unwrap_or("e2e");
        let ext = path.extension().and_then(|s| s.to_str()).unwrap_or("png");
        path.with_file_name(format!("{stem}-{suffix}.{ext}"))
    };
    let labels: Vec<String> = runs[0]
        .1
        .iter()
        .map(|r| format!("{}/{}", r.policy, r.eviction))
        .collect();
    let line = |label: &str, name: String, figure: &dyn Fn(&PolicyReport) -> f64| Series {
        name,
        points: runs
            .iter()
            .filter_map(|(rate, reports)| {
                reports
                    .iter()
                    .find(|r| format!("{}/{}", r.policy, r.eviction) == label)
                    .map(|r| (*rate, figure(r)))
            })
            .collect(),
        dashed: false,
    };
    let single = |label: &str| label.split('/').next().unwrap_or(label).to_string();
    let mut hits: Vec<Series> = labels
        .iter()
        .map(|l| line(l, single(l), &|r| r.worker_hit_rate * 100.0))
        .collect();
    if let Some(bound) = goals
        .first()
        .and_then(|g| g["shared_cache_hit_rate"].as_f64())
    {
        hits.push(Series {
            name: "one shared cache".into(),
            points: runs
                .iter()
                .map(|(rate, _)| (*rate, bound * 100.0))
                .collect(),
            dashed: true,
        });
    }
    let top = hits
        .iter()
        .flat_map(|s| s.points.iter().map(|p| p.1))
        .fold(0.0, f64::max);
    write_line_chart(
        &sibling("hit"),
        &LineChart {
            title: "Prefix hit rate per arrival rate".into(),
            x_label: "arrival rate (x trace)",
            y_label: "prefix hit rate (%)",
            log_x: false,
            y_range: 0.0..(top * 1.15).max(1.0),
            series: hits,
        },
    )?;
    let mut ttft: Vec<Series> = Vec::new();
    for l in &labels {
        ttft.push(line(l, format!("{} p50", single(l)), &|r| r.ttft_ms.p50));
        let mut p99 = line(l, format!("{} p99", single(l)), &|r| r.ttft_ms.p99);
        p99.dashed = true;
        ttft.push(p99);
    }
    let top = ttft
        .iter()
        .flat_map(|s| s.points.iter().map(|p| p.1))
        .fold(0.0, f64::max);
    write_line_chart(
        &sibling("ttft"),
        &LineChart {
            title: "Time to first token per arrival rate (dashed: p99)".into(),
            x_label: "arrival rate (x trace)",
            y_label: "TTFT (ms)",
            log_x: false,
            y_range: 0.0..(top * 1.1).max(1.0),
            series: ttft,
        },
    )
}
