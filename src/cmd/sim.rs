//! `kvroute sim`: a fleet of simulated inference engines in one process (see
//! `crates/kvroute-sim`), each with its own HTTP port and its own event stream
//! to the router. Prints `worker ID http://ADDR` per engine once all listen,
//! then serves until SIGINT or SIGTERM.

use std::net::IpAddr;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use clap::Args;
use kvroute_sim::cli::EngineArgs;
use kvroute_sim::{WorkerConfig, start_fleet};
use kvroute_tls::GrpcClientTls;
use kvroute_tokenize::TokenizerSpec;

/// How often workers send the router a digest of their cache, to check its
/// index against; shared by `sim` and `bridge`.
#[derive(Args, Clone, Debug)]
pub struct DigestArgs {
    /// Send a digest after this many events of a rank (0: not by count).
    #[arg(long, default_value_t = kvroute_sim::worker::DEFAULT_DIGEST_EVENTS)]
    pub digest_events: u64,
    /// Send a digest of every rank at this interval, in milliseconds (0: not by time).
    #[arg(long, default_value_t = kvroute_sim::worker::DEFAULT_DIGEST_INTERVAL.as_millis() as u64)]
    pub digest_interval_ms: u64,
}

/// TLS toward an `https://` router, shared by `sim` and `bridge`.
#[derive(Args, Clone, Debug)]
pub struct RouterTlsArgs {
    /// PEM CA certificate(s) trusted for the router, beside the system's roots.
    #[arg(long, value_name = "PEM")]
    pub router_ca_file: Option<PathBuf>,
    /// PEM client certificate, for a router that requires one (its tls.client_ca_file).
    #[arg(long, value_name = "PEM", requires = "router_key_file")]
    pub router_cert_file: Option<PathBuf>,
    /// PEM private key of --router-cert-file.
    #[arg(long, value_name = "PEM", requires = "router_cert_file")]
    pub router_key_file: Option<PathBuf>,
}

impl From<RouterTlsArgs> for GrpcClientTls {
    fn from(args: RouterTlsArgs) -> Self {
        GrpcClientTls {
            ca_file: args.router_ca_file,
            cert_file: args.router_cert_file,
            key_file: args.router_key_file,
        }
    }
}

#[derive(Args)]
pub struct SimArgs {
    /// Number of engines.
    #[arg(long, default_value_t = 1)]
    workers: usize,
    /// The router's gRPC URL, e.g. http://127.0.0.1:50051 (https:// for TLS),
    /// or several replicas' URLs separated by commas: a failed or refused stream
    /// moves on to the next, round and round. Without it no events are published.
    #[arg(long, value_name = "URL[,URL...]", value_delimiter = ',')]
    router: Vec<String>,
    #[command(flatten)]
    router_tls: RouterTlsArgs,
    /// PEM certificate chain: the engines serve HTTPS, and register https:// URLs.
    #[arg(long, value_name = "PEM", requires = "tls_key_file")]
    tls_cert_file: Option<PathBuf>,
    /// PEM private key of --tls-cert-file.
    #[arg(long, value_name = "PEM", requires = "tls_cert_file")]
    tls_key_file: Option<PathBuf>,
    /// First HTTP port (engine i listens on P+i); 0: any free ports.
    #[arg(long, default_value_t = 0)]
    base_port: u16,
    /// Address the engines listen on.
    #[arg(long, default_value = "127.0.0.1")]
    host: IpAddr,
    /// Id of the first engine; the others follow.
    #[arg(long, default_value_t = 0)]
    first_worker_id: u64,
    /// Model name served and registered.
    #[arg(long, default_value = "sim-model")]
    model: String,
    /// Tokenizer for text prompts (tiktoken:ENCODING, hf:PATH or none), declared to
    /// the router at registration; must be the router's.
    #[arg(long, default_value = "tiktoken:cl100k_base")]
    tokenizer: TokenizerSpec,
    /// The router's worker token (auth.worker_token), sent on the gRPC ingest;
    /// the same variable as the bridge's.
    #[arg(long, env = "KVROUTE_ROUTER_TOKEN", hide_env_values = true)]
    router_token: Option<String>,
    /// How often each engine reports its load, in milliseconds.
    #[arg(long, default_value_t = 100)]
    load_report_ms: u64,
    /// Log one line per eviction (time, policy, blocks freed, why).
    #[arg(long)]
    log_evictions: bool,
    /// How long each engine keeps a stored Responses API response, for
    /// previous_response_id and GET /v1/responses/{id}, in seconds.
    #[arg(long, default_value_t = kvroute_sim::worker::DEFAULT_RESPONSES_TTL.as_secs())]
    responses_ttl_s: u64,
    #[command(flatten)]
    digest: DigestArgs,
    #[command(flatten)]
    engine: EngineArgs,
}

pub fn run(args: SimArgs) -> anyhow::Result<()> {
    anyhow::ensure!(args.workers > 0, "--workers must be at least 1");
    anyhow::ensure!(
        args.engine.eviction.len() == 1,
        "--eviction takes one policy here (bench e2e compares several)"
    );
    kvroute_router::server::init_logging(&Default::default())?;
    let mut template = WorkerConfig::new(args.first_worker_id, args.engine.engine_config());
    template.model = args.model;
    template.http_addr = (args.host, 0).into();
    template.router_tls = args.router_tls.into();
    for router in &args.router {
        kvroute_tls::grpc_endpoint(router, &template.router_tls)
            .with_context(|| format!("--router {router}"))?;
    }
    template.routers = args.router;
    template.digest_events = args.digest.digest_events;
    template.digest_interval = Duration::from_millis(args.digest.digest_interval_ms);
    if let (Some(cert), Some(key)) = (&args.tls_cert_file, &args.tls_key_file) {
        template.http_tls = Some(kvroute_tls::https_server_config(cert, key)?);
    }
    template.auth_token = args.router_token.map(kvroute_tls::Secret::new);
    template.tokenizer = args.tokenizer;
    template.load_report_interval = Duration::from_millis(args.load_report_ms.max(1));
    template.log_evictions = args.log_evictions;
    template.responses_ttl = Duration::from_secs(args.responses_ttl_s);
    let runtime = tokio::runtime::Runtime::new().context("cannot start the async runtime")?;
    runtime.block_on(async {
        let workers = start_fleet(&template, args.workers, args.base_port).await?;
        for worker in &workers {
            println!("worker {} {}", worker.id(), worker.base_url());
        }
        crate::cmd::serve::shutdown_signal().await;
        for worker in workers {
            worker.shutdown().await;
        }
        anyhow::Ok(())
    })
}
