//! kvroute: a KV-cache-aware request router for LLM inference fleets.
//!
//! This binary is a thin command line over the library crates in `crates/`; each
//! subcommand lives in its own module under `cmd/`.

mod cmd;
mod e2e;
mod plot;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "kvroute",
    version,
    about = "KV-cache-aware request router for LLM inference fleets"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Measure kvroute's parts on production-shaped workloads.
    Bench(cmd::bench::BenchArgs),
    /// Print the Dynamo-compatible block hashes of a token sequence.
    Hash(cmd::hash::HashArgs),
    /// Turn a vLLM / SGLang engine's ZeroMQ KV events into kvroute's worker stream.
    Bridge(cmd::bridge::BridgeArgs),
    /// Start a router and a simulated fleet, compare kv and round_robin routing, keep serving.
    Demo(cmd::demo::DemoArgs),
    /// Replay a Mooncake trace through KV-cache eviction policies.
    Replay(cmd::replay::ReplayArgs),
    /// Run the router service: gRPC KV-event ingest and the OpenAI-compatible proxy.
    Serve(cmd::serve::ServeArgs),
    /// Run simulated inference engines that publish KV events to a router.
    Sim(cmd::sim::SimArgs),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Bench(args) => cmd::bench::run(args),
        Command::Hash(args) => cmd::hash::run(args),
        Command::Bridge(args) => cmd::bridge::run(args),
        Command::Demo(args) => cmd::demo::run(args),
        Command::Replay(args) => cmd::replay::run(args),
        Command::Serve(args) => cmd::serve::run(args),
        Command::Sim(args) => cmd::sim::run(args),
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
