//! `kvroute bridge`: the sidecar that makes a vLLM or SGLang engine a kvroute
//! worker, by turning its ZeroMQ KV events into the router's gRPC stream.

use std::net::SocketAddr;

use clap::Args;
use kvroute_bridge::BridgeConfig;
use kvroute_bridge::{PdConvention, WorkerRole};
use kvroute_tokenize::TokenizerSpec;

#[derive(Args)]
pub struct BridgeArgs {
    /// The engine's KV event publisher (vLLM `--kv-events-config` "endpoint");
    /// data-parallel rank N publishes on this port + N.
    #[arg(long, value_name = "tcp://HOST:PORT")]
    engine_events: String,
    /// The engine's replay socket ("replay_endpoint"), used to recover lost batches;
    /// rank N on this port + N. Without it, lost batches clear the rank.
    #[arg(long, value_name = "tcp://HOST:PORT")]
    engine_replay: Option<String>,
    /// Topic to subscribe to; empty: every topic.
    #[arg(long, default_value = "")]
    topic: String,
    /// The engine's data-parallel size: one publisher per rank.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..))]
    data_parallel_size: u32,
    /// The router's gRPC URL, e.g. http://router:50051 (https:// for TLS), or
    /// several replicas' URLs separated by commas: a failed or refused stream
    /// moves on to the next, round and round.
    #[arg(
        long,
        value_name = "URL[,URL...]",
        value_delimiter = ',',
        required = true
    )]
    router: Vec<String>,
    /// Bearer token for the router's gRPC ingest, when it requires one.
    #[arg(long, env = "KVROUTE_ROUTER_TOKEN", hide_env_values = true)]
    router_token: Option<String>,
    #[command(flatten)]
    router_tls: crate::cmd::sim::RouterTlsArgs,
    #[command(flatten)]
    digest: crate::cmd::sim::DigestArgs,
    /// This engine's worker id at the router.
    #[arg(long)]
    worker_id: u64,
    /// The engine's OpenAI-compatible HTTP server: registered with the router,
    /// and scraped for `/v1/models` and `/metrics`.
    #[arg(long, value_name = "URL")]
    engine_url: String,
    /// Tokens per KV block: must equal the engine's and the router's.
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..))]
    block_size: u32,
    /// The medium whose blocks are forwarded as the device tier (engines also
    /// report CPU, disk, ...); names compare ignoring case.
    #[arg(long, default_value = "GPU")]
    medium: String,
    /// A medium whose blocks are forwarded as the offload tier: blocks the engine
    /// can load instead of recomputing, which the router weighs below device
    /// blocks (scheduler.offload_weight). Repeatable, e.g. `--offload-medium CPU
    /// --offload-medium DISK`. Other media are skipped.
    #[arg(long = "offload-medium", value_name = "MEDIUM")]
    offload_media: Vec<String>,
    /// Where the bridge serves its own Prometheus `/metrics`.
    #[arg(long, default_value = "0.0.0.0:9401")]
    metrics_addr: SocketAddr,
    /// The engine's tokenizer (tiktoken:ENCODING, hf:PATH or none), declared to the
    /// router, which refuses a different one; without it the router cannot check.
    #[arg(long, value_name = "SPEC")]
    tokenizer: Option<TokenizerSpec>,
    /// The engine's part in prefill/decode disaggregation (vLLM's
    /// `kv_role`, SGLang's `--disaggregation-mode`), declared to the router.
    #[arg(long, value_enum, default_value_t = RoleArg::Aggregated)]
    role: RoleArg,
    /// How a prefill engine hands its KV cache to a decode engine; required
    /// with `--role prefill`.
    #[arg(long, value_enum)]
    pd_convention: Option<ConventionArg>,
    /// A prefill engine's bootstrap server port on the engine URL's host
    /// (SGLang's `--disaggregation-bootstrap-port`); required with
    /// `--pd-convention sglang`.
    #[arg(long, value_parser = clap::value_parser!(u16).range(1..))]
    bootstrap_port: Option<u16>,
}

#[derive(Clone, Copy, clap::ValueEnum)]
enum RoleArg {
    Aggregated,
    Prefill,
    Decode,
}

#[derive(Clone, Copy, clap::ValueEnum)]
enum ConventionArg {
    Sglang,
    Vllm,
}

pub fn run(args: BridgeArgs) -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let config = BridgeConfig {
        engine_events: args.engine_events,
        engine_replay: args.engine_replay,
        topic: args.topic,
        data_parallel_size: args.data_parallel_size,
        routers: args.router,
        router_token: args.router_token.map(kvroute_tls::Secret::new),
        router_tls: args.router_tls.into(),
        worker_id: args.worker_id,
        engine_url: args.engine_url,
        block_size: args.block_size,
        medium: args.medium,
        offload_media: args.offload_media,
        metrics_addr: args.metrics_addr,
        tokenizer: args.tokenizer,
        digest_events: args.digest.digest_events,
        digest_interval: std::time::Duration::from_millis(args.digest.digest_interval_ms),
        role: match args.role {
            RoleArg::Aggregated => WorkerRole::Aggregated,
            RoleArg::Prefill => WorkerRole::Prefill,
            RoleArg::Decode => WorkerRole::Decode,
        },
        pd_convention: match args.pd_convention {
            None => PdConvention::Unspecified,
            Some(ConventionArg::Sglang) => PdConvention::Sglang,
            Some(ConventionArg::Vllm) => PdConvention::Vllm,
        },
        bootstrap_port: args.bootstrap_port,
    };
    let runtime = tokio::runtime::Runtime::new()?;
    runtime.block_on(kvroute_bridge::run(config))?;
    Ok(())
}
