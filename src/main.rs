//! kvroute: a KV-cache-aware request router for LLM inference fleets.
//!
//! This binary is a thin command line over the library crates in `crates/`; each
//! subcommand lives in its own module under `cmd/`.

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
    /// Run the router service: gRPC KV-event ingest and the OpenAI-compatible proxy.
    Serve(cmd::serve::ServeArgs),
    /// Benchmarks of kvroute's speed goals.
    #[command(subcommand)]
    Bench(cmd::bench::BenchCommand),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Hash(args) => cmd::hash::run(args),
        Command::Serve(args) => cmd::serve::run(args),
        Command::Bench(command) => cmd::bench::run(command),
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
