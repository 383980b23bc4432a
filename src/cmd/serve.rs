//! `kvroute serve`: the router service (see `crates/kvroute-router`).
//!
//! Configuration comes from defaults, then `--config FILE`, then `KVROUTE_...`
//! variables, then these flags. Once both listeners are bound it prints one line,
//! `listening http=ADDR grpc=ADDR [epp=ADDR]`, on stdout (tests and scripts read the real
//! ports from it when started on port 0), and serves until SIGINT or SIGTERM.

use std::net::SocketAddr;
use std::path::PathBuf;

use anyhow::Context;
use clap::Args;
use kvroute_router::config::{LogFormat, Policy, TokenizerSpecs};
use kvroute_router::{Config, server};

#[derive(Args)]
pub struct ServeArgs {
    /// TOML configuration file (see config/router.toml).
    #[arg(long, env = "KVROUTE_CONFIG")]
    config: Option<PathBuf>,
    /// Address of the OpenAI-compatible API, admin endpoints and /metrics.
    #[arg(long)]
    http_addr: Option<SocketAddr>,
    /// Address of the gRPC ingest.
    #[arg(long)]
    grpc_addr: Option<SocketAddr>,
    /// Tokens per KV block; must match every worker's.
    #[arg(long)]
    block_size: Option<u32>,
    /// Address of the endpoint picker (Envoy ext_proc and gRPC health, for a
    /// Gateway API Inference Extension gateway); off unless given.
    #[arg(long)]
    epp_addr: Option<SocketAddr>,
    /// Scheduling policy: kv, round_robin, random, least_loaded, power_of_two, approx.
    #[arg(long)]
    policy: Option<Policy>,
    /// How text becomes tokens: tiktoken:ENCODING, hf:PATH or none (text is
    /// routed on load alone); must be the workers'. A list: in the config file.
    #[arg(long, value_name = "SPEC")]
    tokenizer: Option<TokenizerSpecs>,
    /// How long a disconnected worker's index entries are kept, in milliseconds.
    #[arg(long)]
    grace_period_ms: Option<u64>,
    /// Log as JSON lines instead of text.
    #[arg(long)]
    log_json: bool,
    /// Serve without tokens on a non-loopback address (auth.insecure): anyone
    /// who reaches the gRPC port can then register workers.
    #[arg(long)]
    insecure: bool,
}

pub fn run(args: ServeArgs) -> anyhow::Result<()> {
    let mut config = Config::load(args.config.as_deref(), std::env::vars())?;
    if let Some(addr) = args.http_addr {
        config.http_addr = addr;
    }
    if let Some(addr) = args.grpc_addr {
        config.grpc_addr = addr;
    }
    if let Some(addr) = args.epp_addr {
        config.epp.addr = addr.to_string();
    }
    if let Some(block_size) = args.block_size {
        config.block_size = block_size;
    }
    if let Some(policy) = args.policy {
        config.scheduler.policy = policy;
    }
    if let Some(spec) = args.tokenizer {
        config.tokenizer = spec;
    }
    if let Some(ms) = args.grace_period_ms {
        config.ingest.grace_period_ms = ms;
    }
    if args.log_json {
        config.log.format = LogFormat::Json;
    }
    if args.insecure {
        config.auth.insecure = true;
    }
    config.validate()?;
    server::init_logging(&config.log)?;
    runtime()?.block_on(async {
        let running = if config.cluster.enabled() {
            kvroute_cluster::start(config).await?
        } else {
            server::start(config).await?
        };
        let epp = running
            .epp_addr
            .map_or(String::new(), |addr| format!(" epp={addr}"));
        println!(
            "listening http={} grpc={}{epp}",
            running.http_addr, running.grpc_addr
        );
        tracing::info!(http = %running.http_addr, grpc = %running.grpc_addr, "kvroute serving");
        shutdown_signal().await;
        tracing::info!("shutting down: draining in-flight requests");
        running.shutdown().await;
        anyhow::Ok(())
    })
}

/// The runtime the router serves on. On one CPU (pinned, or a container's
/// quota of one) the multi-threaded scheduler would run every task on its one
/// worker thread anyway, paying for queues and wake-ups built for several; the
/// single-threaded scheduler does the same work for less (see
/// docs/measurements/proxy-vs-nginx.md, "Current numbers"). Tokenization and
/// blocking work have threads of their own either way.
pub fn runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    let one_cpu = std::thread::available_parallelism().is_ok_and(|cpus| cpus.get() == 1);
    let mut builder = if one_cpu {
        tokio::runtime::Builder::new_current_thread()
    } else {
        tokio::runtime::Builder::new_multi_thread()
    };
    builder
        .enable_all()
        .build()
        .context("cannot start the async runtime")
}

pub async fn shutdown_signal() {
    let mut terminate = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .expect("SIGTERM handler installs");
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = terminate.recv() => {}
    }
}

#[cfg(test)]
mod tests {
    use tokio::runtime::RuntimeFlavor;

    /// Pinned to one CPU, the router runs the single-threaded scheduler; with
    /// more, the multi-threaded one (threads inherit the pinning, and the
    /// choice reads the calling thread's CPU set).
    #[test]
    fn one_cpu_serves_on_the_single_threaded_scheduler() {
        let cpus = core_affinity::get_core_ids().unwrap_or_default();
        if cpus.len() >= 2 {
            let flavor = super::runtime().unwrap().handle().runtime_flavor();
            assert_eq!(flavor, RuntimeFlavor::MultiThread);
        }
        let pinned = std::thread::spawn(move || {
            assert!(core_affinity::set_for_current(cpus[0]));
            super::runtime().unwrap().handle().runtime_flavor()
        });
        assert_eq!(pinned.join().unwrap(), RuntimeFlavor::CurrentThread);
    }
}
