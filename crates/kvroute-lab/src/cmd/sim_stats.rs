//! `kvroute-lab sim stats --url URL`: a running simulated engine's eviction
//! figures per policy (`GET /admin/eviction`), each goal marked met or missed.
//! The figures are defined in `crates/kvroute-sim/src/eviction.rs` and docs/measurements/cache-policy.md.

use anyhow::{Context, bail};
use bytes::Bytes;
use clap::{Args, Subcommand};
use http_body_util::{BodyExt, Empty};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use kvroute_sim::eviction::PolicyFigures;
use serde_json::Value;

#[derive(Args)]
pub struct SimArgs {
    #[command(subcommand)]
    command: SimCommand,
}

#[derive(Subcommand)]
enum SimCommand {
    /// Print a running simulated engine's eviction figures per policy, with
    /// the goals met or missed.
    Stats(StatsArgs),
}

#[derive(Args)]
struct StatsArgs {
    /// The engine's HTTP URL, e.g. http://127.0.0.1:8001.
    #[arg(long)]
    url: String,
}

pub fn run(args: SimArgs) -> anyhow::Result<()> {
    let SimCommand::Stats(StatsArgs { url }) = args.command;
    let url = url.as_str();
    let endpoint = format!("{}/admin/eviction", url.trim_end_matches('/'));
    let uri: hyper::Uri = endpoint
        .parse()
        .with_context(|| format!("--url {url} is not a URL"))?;
    anyhow::ensure!(
        uri.scheme_str() == Some("http"),
        "--url must be an http:// URL of a simulated engine"
    );
    let runtime = tokio::runtime::Runtime::new().context("cannot start the async runtime")?;
    let body: Value = runtime.block_on(async {
        let client: Client<_, Empty<Bytes>> = Client::builder(TokioExecutor::new()).build_http();
        let response = client
            .get(uri)
            .await
            .with_context(|| format!("cannot reach {endpoint}"))?;
        let status = response.status();
        let bytes = response.into_body().collect().await?.to_bytes();
        if !status.is_success() {
            bail!(
                "{endpoint} answered {status}: {}",
                String::from_utf8_lossy(&bytes)
            );
        }
        serde_json::from_slice(&bytes).with_context(|| format!("{endpoint} did not send JSON"))
    })?;
    let figures: Vec<PolicyFigures> = serde_json::from_value(body["policies"].clone())
        .with_context(|| format!("{endpoint}: no per-policy figures"))?;
    print!("{}", render(&body, &figures));
    Ok(())
}

/// The table: one column per policy, one row per figure, goals marked.
fn render(body: &Value, figures: &[PolicyFigures]) -> String {
    use std::fmt::Write as _;
    let mut out = String::new();
    let _ = writeln!(
        out,
        "engine {} evicting with {} ({} cached blocks)",
        body["worker_id"], body["policy"], body["kv_blocks_cached"]
    );
    let _ = write!(out, "{:<30}{:>10}", "figure", "goal");
    for f in figures {
        let _ = write!(out, "{:>18}", f.policy);
    }
    out.push('\n');
    let mut row = |name: &str, goal: &str, cells: Vec<String>| {
        let _ = write!(out, "{name:<30}{goal:>10}");
        for cell in cells {
            let _ = write!(out, "{cell:>18}");
        }
        out.push('\n');
    };
    row(
        "evictions",
        "",
        figures.iter().map(|f| f.evictions.to_string()).collect(),
    );
    row(
        "requests",
        "",
        figures.iter().map(|f| f.requests.to_string()).collect(),
    );
    let goals: Vec<_> = figures.iter().map(PolicyFigures::goals).collect();
    for (i, goal) in goals.first().into_iter().flatten().enumerate() {
        row(
            goal.figure,
            goal.goal,
            goals
                .iter()
                .map(|g| {
                    let verdict = if g[i].met { "met" } else { "missed" };
                    format!("{} {verdict}", g[i].value)
                })
                .collect(),
        );
    }
    if let Some(classes) = body["classes"].as_array() {
        let _ = writeln!(out, "\nper priority class (all policies):");
        for class in classes {
            let prompt = class["prompt_tokens"].as_f64().unwrap_or(0.0);
            let cached = class["cached_tokens"].as_f64().unwrap_or(0.0);
            let rate = if prompt > 0.0 {
                cached / prompt * 100.0
            } else {
                0.0
            };
            let _ = writeln!(
                out,
                "  class {}: {} requests, prefix hit rate {rate:.1}%",
                class["class"], class["requests"]
            );
        }
    }
    out
}
