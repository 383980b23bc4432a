//! `kvroute bench ...`: workloads that measure kvroute's parts, each printing one
//! JSON line of results. Speed and memory goals live here, not in timed tests.

mod index;

use clap::{Args, Subcommand};

#[derive(Args)]
pub struct BenchArgs {
    #[command(subcommand)]
    target: BenchTarget,
}

#[derive(Subcommand)]
enum BenchTarget {
    /// Replay a trace-derived timeline of KV events and lookups against the index.
    Index(index::IndexBenchArgs),
}

pub fn run(args: BenchArgs) -> anyhow::Result<()> {
    match args.target {
        BenchTarget::Index(args) => index::run(args),
    }
}
