//! kvroute: a KV-cache-aware request router for LLM inference fleets.
//!
//! This binary is a thin command line over the library crates in `crates/`; each
//! subcommand lives in its own module under `cmd/`. It is what operators run and
//! what the image ships; the benchmarks, the replay lab and their charts are
//! the separate `kvroute-lab` binary (`crates/kvroute-lab`).

mod cmd;

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
    /// Print the Dynamo-compatible block hashes of a token sequence.
    Hash(cmd::hash::HashArgs),
    /// Turn a vLLM / SGLang engine's ZeroMQ KV events into kvroute's worker stream.
    Bridge(cmd::bridge::BridgeArgs),
    /// Start a router and a simulated fleet, compare kv and round_robin routing, keep serving.
    Demo(cmd::demo::DemoArgs),
    /// Run the router service: gRPC KV-event ingest and the OpenAI-compatible proxy.
    Serve(cmd::serve::ServeArgs),
    /// Run simulated inference engines that publish KV events to a router.
    Sim(cmd::sim::SimArgs),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Hash(args) => cmd::hash::run(args),
        Command::Bridge(args) => cmd::bridge::run(args),
        Command::Demo(args) => cmd::demo::run(args),
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
