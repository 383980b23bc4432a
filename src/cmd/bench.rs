//! `kvroute bench ...`: benchmarks of the speed goals, one subcommand each.

use clap::Subcommand;

use super::bench_router;

#[derive(Subcommand)]
pub enum BenchCommand {
    /// Routing decision latency, routing throughput with tokenization, proxy overhead.
    Router(bench_router::BenchRouterArgs),
}

pub fn run(command: BenchCommand) -> anyhow::Result<()> {
    match command {
        BenchCommand::Router(args) => bench_router::run(args),
    }
}
