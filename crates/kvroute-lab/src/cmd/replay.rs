//! `kvroute-lab replay`: the cache-policy lab. Replays a Mooncake trace through one
//! eviction policy (`--policy`), or through several at several capacities
//! (`--compare`) to show which policy wins where. `--order` gives blocks back
//! as Mooncake's replay does (`seed`, the default) or as the simulated engines
//! do (`vllm`: tail first; `sglang`: SGLang's radix tree, leaf first), so the
//! lab's "one shared cache" bound compares like for like with `bench e2e`.

use std::fs::File;
use std::io::{BufWriter, IsTerminal, Write};
use std::path::{Path, PathBuf};

use anyhow::{Context, bail};
use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};
use kvroute_cache::{
    PolicyKind, PreparedTrace, ReplayOrder, ReplayReport, S3FifoParams, replay, replay_sglang,
    replay_vllm,
};
use kvroute_trace::read_trace;
use serde_json::json;

use crate::plot::{LineChart, Series, write_line_chart};

#[derive(Args)]
pub struct ReplayArgs {
    /// Mooncake JSON Lines trace.
    trace: PathBuf,
    /// Eviction policy: lru, lfu, fifo, s3fifo, arc, predictive, qos, or the bounds belady and infinite.
    #[arg(long, required_unless_present = "compare", conflicts_with = "compare")]
    policy: Option<PolicyKind>,
    /// Cache capacity in blocks (ignored by `infinite`).
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
    capacity_blocks: Option<u64>,
    /// Tokens per block.
    #[arg(long, default_value_t = 512, value_parser = clap::value_parser!(u64).range(1..))]
    block_size: u64,
    /// S3FIFO: share of the capacity given to the small queue.
    #[arg(long, default_value_t = 0.1)]
    small_ratio: f64,
    /// S3FIFO: saturation of a block's access count.
    #[arg(long, default_value_t = 3)]
    max_freq: u8,
    /// Replay only the first N requests.
    #[arg(long)]
    max_requests: Option<usize>,
    /// How a request's blocks go back to the cache: seed (Mooncake's replay,
    /// root first), vllm (in-use blocks leave the policy, all come back tail
    /// first), sglang (SGLang's radix tree, least recently used leaf first;
    /// lru and infinite only).
    #[arg(long, default_value = "seed")]
    order: ReplayOrder,
    /// Print one JSON object instead of text.
    #[arg(long, conflicts_with = "compare")]
    json: bool,
    /// Write one JSON line per request (`prompt_tokens`, `hit_tokens`) to FILE.
    #[arg(long, value_name = "FILE", conflicts_with = "compare")]
    per_request: Option<PathBuf>,
    /// Compare these policies (comma-separated) at every `--capacities` size.
    #[arg(long, value_delimiter = ',', requires = "capacities")]
    compare: Vec<PolicyKind>,
    /// Capacities in blocks for `--compare` (comma-separated).
    #[arg(long, value_delimiter = ',', requires = "compare",
          value_parser = clap::value_parser!(u64).range(1..))]
    capacities: Vec<u64>,
    /// `--compare`: draw hit rate against capacity to FILE.svg or FILE.png.
    #[arg(long, value_name = "FILE", requires = "compare")]
    plot: Option<PathBuf>,
    /// `--compare`: write every run's numbers as CSV to FILE.
    #[arg(long, value_name = "FILE", requires = "compare")]
    csv: Option<PathBuf>,
}

pub fn run(args: ReplayArgs) -> anyhow::Result<()> {
    let params = S3FifoParams {
        small_ratio: args.small_ratio,
        max_freq: args.max_freq,
    };
    if let Some(chart) = &args.plot {
        check_chart_extension(chart)?;
    }
    for &policy in args.policy.iter().chain(&args.compare) {
        check_order(policy, args.order)?;
    }
    let trace = PreparedTrace::new(&read_trace(&args.trace, args.max_requests)?);
    match args.policy {
        Some(policy) => {
            let capacity = match (policy, args.capacity_blocks) {
                (_, Some(capacity)) => capacity,
                (PolicyKind::Infinite, None) => 1,
                (_, None) => bail!("--capacity-blocks is required for policy {policy}"),
            };
            let progress = progress_bar(trace.requests());
            let report = run_one(
                policy,
                capacity,
                params,
                args.order,
                &trace,
                args.block_size,
                &progress,
            )?;
            progress.finish_and_clear();
            if let Some(path) = &args.per_request {
                write_per_request(path, &report)?;
            }
            let capacity_blocks = (policy != PolicyKind::Infinite).then_some(capacity);
            let summary = summary(
                policy,
                args.order,
                capacity_blocks,
                args.block_size,
                &report,
            );
            if args.json {
                let object: serde_json::Map<String, serde_json::Value> = summary
                    .into_iter()
                    .map(|(name, value)| (name.to_owned(), value))
                    .collect();
                println!("{}", serde_json::Value::Object(object));
            } else {
                println!("replay of {}", args.trace.display());
                for (name, value) in summary {
                    println!("  {name:<24} {value}");
                }
            }
            Ok(())
        }
        None => compare(&args, params, &trace),
    }
}

/// Orders other than `seed` take blocks out and give them back in another
/// order than the trace's, which Belady's future does not describe; SGLang's
/// tree evicts by recency only.
fn check_order(policy: PolicyKind, order: ReplayOrder) -> anyhow::Result<()> {
    match (order, policy) {
        (ReplayOrder::Seed, _) | (_, PolicyKind::Infinite) => Ok(()),
        (ReplayOrder::Vllm, PolicyKind::Belady) => {
            bail!("--order vllm: belady needs the access order of --order seed")
        }
        (ReplayOrder::Sglang, PolicyKind::Lru) | (ReplayOrder::Vllm, _) => Ok(()),
        (ReplayOrder::Sglang, _) => bail!(
            "--order sglang evicts like SGLang's radix cache (least recently used leaf first): \
             use policy lru (or the infinite bound), not {policy}"
        ),
    }
}

/// Builds `policy` and replays the whole trace through it in `order`.
fn run_one(
    policy: PolicyKind,
    capacity: u64,
    params: S3FifoParams,
    order: ReplayOrder,
    trace: &PreparedTrace,
    block_size: u64,
    progress: &ProgressBar,
) -> anyhow::Result<ReplayReport> {
    let capacity = usize::try_from(capacity).context("--capacity-blocks is too large")?;
    let tick = || progress.inc(1);
    if order == ReplayOrder::Sglang {
        let capacity = (policy != PolicyKind::Infinite).then_some(capacity);
        return Ok(replay_sglang(capacity, trace, block_size, tick));
    }
    let mut cache = policy.build(capacity, params, trace.accesses())?;
    Ok(match order {
        ReplayOrder::Vllm => replay_vllm(cache.as_mut(), trace, block_size, tick),
        _ => replay(cache.as_mut(), trace, block_size, tick),
    })
}

/// A bar on stderr, or nothing when stderr is not a terminal.
fn progress_bar(requests: usize) -> ProgressBar {
    if !std::io::stderr().is_terminal() {
        return ProgressBar::hidden();
    }
    let bar = ProgressBar::new(requests as u64);
    bar.set_style(
        ProgressStyle::with_template("{bar:40} {pos}/{len} requests ({percent}%), eta {eta}")
            .expect("the progress template is valid"),
    );
    bar
}

/// The run's results, in reading order.
fn summary(
    policy: PolicyKind,
    order: ReplayOrder,
    capacity_blocks: Option<u64>,
    block_size: u64,
    report: &ReplayReport,
) -> Vec<(&'static str, serde_json::Value)> {
    vec![
        ("policy", json!(policy.name())),
        ("order", json!(order.name())),
        ("capacity_blocks", json!(capacity_blocks)),
        ("block_size", json!(block_size)),
        ("total_requests", json!(report.total_requests)),
        ("total_prompt_tokens", json!(report.total_prompt_tokens)),
        ("total_hit_tokens", json!(report.total_hit_tokens)),
        ("overall_hit_rate", json!(report.overall_hit_rate())),
        ("final_cache_blocks", json!(report.final_cache_blocks)),
        ("block_accesses", json!(report.block_accesses)),
        ("block_hits", json!(report.block_hits)),
        ("evictions", json!(report.evictions)),
        (
            "eviction_latency_p50_ns",
            json!(report.eviction_latency_p50_ns),
        ),
        (
            "eviction_latency_p99_ns",
            json!(report.eviction_latency_p99_ns),
        ),
        ("re_prefill_rate", json!(report.re_prefill_rate())),
        ("mean_utilisation", json!(report.mean_utilisation)),
    ]
}

fn write_per_request(path: &Path, report: &ReplayReport) -> anyhow::Result<()> {
    let context = || format!("cannot write per-request results to {}", path.display());
    let mut out = BufWriter::new(File::create(path).with_context(context)?);
    for outcome in &report.per_request {
        let line =
            json!({"prompt_tokens": outcome.prompt_tokens, "hit_tokens": outcome.hit_tokens});
        writeln!(out, "{line}").with_context(context)?;
    }
    out.flush().with_context(context)
}

fn check_chart_extension(path: &Path) -> anyhow::Result<()> {
    match path.extension().and_then(|e| e.to_str()) {
        Some(ext) if ext.eq_ignore_ascii_case("svg") || ext.eq_ignore_ascii_case("png") => Ok(()),
        _ => bail!(
            "--plot {}: the file name must end in .svg or .png",
            path.display()
        ),
    }
}

/// One replay of the comparison grid.
struct Run {
    policy: PolicyKind,
    capacity: u64,
    report: ReplayReport,
}

fn compare(args: &ReplayArgs, params: S3FifoParams, trace: &PreparedTrace) -> anyhow::Result<()> {
    let policies = &args.compare;
    let capacities = &args.capacities;
    let progress = progress_bar(trace.requests() * policies.len() * capacities.len());
    let mut runs = Vec::new();
    for &capacity in capacities {
        for &policy in policies {
            let report = run_one(
                policy,
                capacity,
                params,
                args.order,
                trace,
                args.block_size,
                &progress,
            )?;
            runs.push(Run {
                policy,
                capacity,
                report,
            });
        }
    }
    progress.finish_and_clear();

    let trace_name = args.trace.file_name().map_or_else(
        || args.trace.display().to_string(),
        |n| n.to_string_lossy().into_owned(),
    );
    if args.order != ReplayOrder::Seed {
        println!("blocks given back to the cache in {} order", args.order);
    }
    print_table(
        &trace_name,
        args.block_size,
        trace.requests(),
        policies,
        capacities,
        &runs,
    );
    print_run_details(&runs);
    if let Some(path) = &args.csv {
        write_csv(path, &runs)?;
    }
    if let Some(path) = &args.plot {
        let series = policies
            .iter()
            .map(|&policy| Series {
                name: label(policy),
                points: runs
                    .iter()
                    .filter(|run| run.policy == policy)
                    .map(|run| (run.capacity as f64, 100.0 * run.report.overall_hit_rate()))
                    .collect(),
                dashed: policy.is_bound(),
            })
            .collect();
        // Room above the best line for the legend, in whole tens of percent.
        let highest = runs
            .iter()
            .map(|run| 100.0 * run.report.overall_hit_rate())
            .fold(0.0, f64::max);
        let y_max = ((highest * 1.25 / 10.0).ceil() * 10.0).clamp(10.0, 100.0);
        let chart = LineChart {
            title: format!("Prefix hit rate by cache size: {trace_name}"),
            x_label: "cache capacity (blocks, log scale)",
            y_label: "hit rate (% of prompt tokens)",
            log_x: true,
            y_range: 0.0..y_max,
            series,
        };
        write_line_chart(path, &chart)?;
    }
    Ok(())
}

/// Bounds are labelled so a chart or table never passes them off as policies.
fn label(policy: PolicyKind) -> String {
    if policy.is_bound() {
        format!("{policy} (bound)")
    } else {
        policy.to_string()
    }
}

fn print_table(
    trace_name: &str,
    block_size: u64,
    requests: usize,
    policies: &[PolicyKind],
    capacities: &[u64],
    runs: &[Run],
) {
    let hit_rate = |policy, capacity| {
        runs.iter()
            .find(|run| run.policy == policy && run.capacity == capacity)
            .map_or(0.0, |run| run.report.overall_hit_rate())
    };
    println!(
        "prefix hit rate (% of prompt tokens) on {trace_name}: {requests} requests, {block_size}-token blocks"
    );
    print!("{:<18}", "policy \\ blocks");
    for capacity in capacities {
        print!("{capacity:>12}");
    }
    println!();
    for &policy in policies {
        print!("{:<18}", label(policy));
        for &capacity in capacities {
            print!("{:>12.2}", 100.0 * hit_rate(policy, capacity));
        }
        println!();
    }
    let online: Vec<PolicyKind> = policies.iter().copied().filter(|p| !p.is_bound()).collect();
    if online.is_empty() {
        return;
    }
    print!("{:<18}", "best policy");
    for &capacity in capacities {
        let best = online
            .iter()
            .copied()
            .max_by(|&a, &b| hit_rate(a, capacity).total_cmp(&hit_rate(b, capacity)))
            .map_or("", PolicyKind::name);
        print!("{best:>12}");
    }
    println!();
}

/// What each run cost besides its hits: evictions, how many of them the trace
/// paid for again, how long evicting accesses took and how full the cache was.
fn print_run_details(runs: &[Run]) {
    let show = |value: Option<u64>| value.map_or_else(|| "-".to_owned(), |v| v.to_string());
    println!();
    println!(
        "{:<18}{:>10}{:>12}{:>12}{:>10}{:>10}{:>13}",
        "policy", "blocks", "evictions", "re-prefill", "p50 ns", "p99 ns", "utilisation"
    );
    for run in runs {
        let r = &run.report;
        let utilisation = r
            .mean_utilisation
            .map_or_else(|| "-".to_owned(), |u| format!("{:.1}%", 100.0 * u));
        println!(
            "{:<18}{:>10}{:>12}{:>11.1}%{:>10}{:>10}{:>13}",
            label(run.policy),
            run.capacity,
            r.evictions,
            100.0 * r.re_prefill_rate(),
            show(r.eviction_latency_p50_ns),
            show(r.eviction_latency_p99_ns),
            utilisation,
        );
    }
}

fn write_csv(path: &Path, runs: &[Run]) -> anyhow::Result<()> {
    let context = || format!("cannot write CSV {}", path.display());
    let mut out = BufWriter::new(File::create(path).with_context(context)?);
    writeln!(
        out,
        "policy,capacity_blocks,total_requests,total_prompt_tokens,total_hit_tokens,overall_hit_rate,\
         final_cache_blocks,evictions,eviction_latency_p50_ns,eviction_latency_p99_ns,re_prefill_rate,mean_utilisation"
    )
    .with_context(context)?;
    let optional = |value: Option<String>| value.unwrap_or_default();
    for run in runs {
        let r = &run.report;
        writeln!(
            out,
            "{},{},{},{},{},{:.6},{},{},{},{},{:.6},{}",
            run.policy,
            run.capacity,
            r.total_requests,
            r.total_prompt_tokens,
            r.total_hit_tokens,
            r.overall_hit_rate(),
            r.final_cache_blocks,
            r.evictions,
            optional(r.eviction_latency_p50_ns.map(|v| v.to_string())),
            optional(r.eviction_latency_p99_ns.map(|v| v.to_string())),
            r.re_prefill_rate(),
            optional(r.mean_utilisation.map(|v| format!("{v:.6}"))),
        )
        .with_context(context)?;
    }
    out.flush().with_context(context)
}
