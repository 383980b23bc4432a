//! `kvroute demo`: the router and a 4-worker simulated fleet in this process,
//! a slice of the bundled conversation trace replayed under `kv` and under
//! `round_robin`, the results side by side; then a fleet under `kv` keeps
//! serving so it can be tried with curl (`--once` exits after the table).
//!
//! The slice is compiled into the binary, so the demo runs from an installed
//! binary or an image with no source tree.

use std::path::PathBuf;

use anyhow::Context;
use clap::Args;
use kvroute_cache::PolicyKind;
use kvroute_e2e::{Fleet, Replay};
use kvroute_router::config::Policy;
use kvroute_sim::{CostModel, EngineConfig, EngineKind};
use kvroute_trace::TraceRequest;

/// The first requests of `tests/data/traces/conversation_trace.jsonl`, as
/// many as `--requests` defaults to: the whole trace would add 3 MB to the
/// binary for a demo that replays its start.
const BUNDLED_TRACE: &str = include_str!("demo_trace.jsonl");
const BUNDLED_REQUESTS: usize = 1000;

#[derive(Args)]
pub struct DemoArgs {
    /// Exit after printing the table.
    #[arg(long)]
    once: bool,
    /// The Mooncake trace to replay; without it, the start of the bundled
    /// conversation trace (1,000 requests).
    #[arg(long)]
    trace: Option<PathBuf>,
    /// Requests replayed per policy, from the start of the trace.
    #[arg(long, default_value_t = BUNDLED_REQUESTS)]
    requests: usize,
    /// Whose prefix cache the simulated engines imitate: vllm or sglang.
    #[arg(long, default_value = "vllm")]
    engine: EngineKind,
    /// Blocks of each engine's host (CPU) tier, which keeps the blocks the GPU
    /// evicts to load them back instead of prefilling them; 0: none.
    #[arg(long, default_value_t = 0)]
    offload_blocks: usize,
}

const WORKERS: usize = 4;
const SPEEDUP: f64 = 20.0;

/// Engines with 4,096 blocks of 512 tokens (2M tokens of KV) each, sped up
/// 20×: the trace's first 1,000 requests (330 s) run in about 17 s per policy,
/// and their working set (about 20,000 blocks) still overflows the fleet.
fn engine(kind: EngineKind, offload_blocks: usize) -> EngineConfig {
    EngineConfig {
        kv_blocks: 4096,
        block_size: 512,
        max_num_seqs: 64,
        max_num_batched_tokens: 8192,
        eviction: PolicyKind::Lru,
        kind,
        cost: CostModel {
            speedup: SPEEDUP,
            ..CostModel::default()
        },
        offload_blocks,
    }
}

/// The requests to replay and what to call their trace.
fn trace(args: &DemoArgs) -> anyhow::Result<(Vec<TraceRequest>, String)> {
    if let Some(path) = &args.trace {
        // The error names the file (and line).
        let trace = kvroute_trace::read_trace(path, Some(args.requests))?;
        return Ok((trace, path.display().to_string()));
    }
    anyhow::ensure!(
        args.requests <= BUNDLED_REQUESTS,
        "the bundled trace holds {BUNDLED_REQUESTS} requests; give --trace FILE to replay more"
    );
    let trace = kvroute_trace::parse_trace(BUNDLED_TRACE, Some(args.requests))
        .map_err(|(line, message)| anyhow::anyhow!("bundled trace:{line}: {message}"))?;
    Ok((trace, "the bundled conversation trace".into()))
}

pub fn run(args: DemoArgs) -> anyhow::Result<()> {
    let (trace, trace_name) = trace(&args)?;
    let replay = Replay {
        time_scale: SPEEDUP,
        max_output_tokens: Some(32),
        api: kvroute_e2e::Api::Completions,
    };
    let runtime = tokio::runtime::Runtime::new().context("cannot start the async runtime")?;
    runtime.block_on(async {
        println!(
            "kvroute demo: {} requests of {} through the router to {WORKERS} simulated {} workers \
             (4096 KV blocks of 512 tokens each, {SPEEDUP}x speed), once per policy",
            trace.len(),
            trace_name,
            args.engine
        );
        let mut reports = Vec::new();
        for policy in [Policy::Kv, Policy::RoundRobin] {
            let fleet = Fleet::start(
                WORKERS,
                &engine(args.engine, args.offload_blocks),
                &Default::default(),
                policy,
            )
            .await?;
            reports.push(kvroute_e2e::run(&fleet, policy, &trace, replay).await?);
            fleet.shutdown().await;
        }
        println!("\n{}", kvroute_e2e::table(&reports, false));
        if args.once {
            return anyhow::Ok(());
        }
        let fleet = Fleet::start(
            WORKERS,
            &engine(args.engine, args.offload_blocks),
            &Default::default(),
            Policy::Kv,
        )
        .await?;
        let url = fleet.http_url();
        println!("Serving under `kv` at {url} (Ctrl-C to stop). Try:\n");
        println!(
            "  curl -s {url}/v1/completions -H 'content-type: application/json' \\\n    \
             -d '{{\"model\": \"{}\", \"prompt\": [1, 2, 3, 4], \"max_tokens\": 8}}'\n",
            kvroute_e2e::MODEL
        );
        println!("  curl -s {url}/workers    # the fleet as the router sees it");
        crate::cmd::serve::shutdown_signal().await;
        fleet.shutdown().await;
        anyhow::Ok(())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The bundled slice is the start of the repository's trace, whole lines,
    /// as many as `--requests` defaults to.
    #[test]
    fn the_bundled_trace_is_the_start_of_the_conversation_trace() {
        let full = std::fs::read_to_string(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/data/traces/conversation_trace.jsonl"
        ))
        .unwrap();
        let head: Vec<&str> = full.lines().take(BUNDLED_REQUESTS).collect();
        assert_eq!(BUNDLED_TRACE.lines().collect::<Vec<_>>(), head);
        let parsed = kvroute_trace::parse_trace(BUNDLED_TRACE, None).unwrap();
        assert_eq!(parsed.len(), BUNDLED_REQUESTS);
    }
}
