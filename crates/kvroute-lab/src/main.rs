//! kvroute-lab: kvroute's measurement lab, a binary apart from the `kvroute`
//! that operators run and the image ships.
//!
//! `bench` measures kvroute's parts and the whole service on
//! production-shaped workloads, `replay` runs traces through the KV-cache
//! eviction policies (with charts, `plot`), `sim stats` reads a running
//! simulated engine's eviction figures. Each subcommand lives in its own
//! module under `cmd/`, over the library crates in `crates/`; the end-to-end
//! runs it shares with `kvroute demo` are `kvroute-e2e`. Benchmarks that run
//! the router as a process of its own run the `kvroute` binary built beside
//! this one.

mod cmd;
mod plot;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "kvroute-lab",
    version,
    about = "kvroute's benchmarks and cache-policy lab"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Measure kvroute's parts on production-shaped workloads.
    Bench(cmd::bench::BenchArgs),
    /// Replay a Mooncake trace through KV-cache eviction policies.
    Replay(cmd::replay::ReplayArgs),
    /// Read a running simulated engine (`kvroute sim`).
    Sim(cmd::sim_stats::SimArgs),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Bench(args) => cmd::bench::run(args),
        Command::Replay(args) => cmd::replay::run(args),
        Command::Sim(args) => cmd::sim_stats::run(args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("error: {err:#}");
            // Like clap's own usage errors: the command could not do what was asked.
            ExitCode::from(2)
        }
    }
}
