//! `kvroute demo`: the router and a 4-worker simulated fleet in this process,
//! a slice of the bundled conversation trace replayed under `kv` and under
//! `round_robin`, the results side by side; then a fleet under `kv` keeps
//! serving so it can be tried with curl (`--once` exits after the table).

use std::path::PathBuf;

use anyhow::Context;
use clap::Args;
use kvroute_cache::PolicyKind;
use kvroute_router::config::Policy;
use kvroute_sim::{CostModel, EngineConfig, EngineKind};

use crate::e2e::{self, Fleet, Replay};

#[derive(Args)]
pub struct DemoArgs {
    /// Exit after printing the table.
    #[arg(long)]
    once: bool,
    /// The Mooncake trace to replay.
    #[arg(long, default_value = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/traces/conversation_trace.jsonl"))]
    trace: PathBuf,
    /// Requests replayed per policy, from the start of the trace.
    #[arg(long, default_value_t = 1000)]
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

pub fn run(args: DemoArgs) -> anyhow::Result<()> {
    let trace = kvroute_trace::read_trace(&args.trace, Some(args.requests))
        .with_context(|| format!("cannot read the trace {}", args.trace.display()))?;
    let replay = Replay {
        time_scale: SPEEDUP,
        max_output_tokens: Some(32),
    };
    let runtime = tokio::runtime::Runtime::new().context("cannot start the async runtime")?;
    runtime.block_on(async {
        println!(
            "kvroute demo: {} requests of {} through the router to {WORKERS} simulated {} workers \
             (4096 KV blocks of 512 tokens each, {SPEEDUP}x speed), once per policy",
            trace.len(),
            args.trace.display(),
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
            reports.push(e2e::run(&fleet, policy, &trace, replay).await?);
            fleet.shutdown().await;
        }
        println!("\n{}", e2e::table(&reports, false));
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
            e2e::MODEL
        );
        println!("  curl -s {url}/workers    # the fleet as the router sees it");
        crate::cmd::serve::shutdown_signal().await;
        fleet.shutdown().await;
        anyhow::Ok(())
    })
}
