//! `kvroute sim`: a fleet of simulated inference engines in one process (see
//! `crates/kvroute-sim`), each with its own HTTP port and its own event stream
//! to the router. Prints `worker ID http://ADDR` per engine once all listen
//! (followed by `role=ROLE bootstrap=PORT` for prefill and decode engines),
//! then serves until SIGINT or SIGTERM.

use std::net::IpAddr;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use clap::Args;
use kvroute_sim::cli::{EngineArgs, PdArgs};
use kvroute_sim::{Role, Worker, WorkerConfig, start_fleet};
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
    /// Number of engines (of --role).
    #[arg(long, default_value_t = 1)]
    workers: usize,
    /// Start a disaggregated fleet: this many prefill engines (ids and ports
    /// first), beside --decode-workers decode engines; replaces --workers and --role.
    #[arg(long, requires = "decode_workers", conflicts_with_all = ["workers", "role"])]
    prefill_workers: Option<usize>,
    /// Decode engines of a disaggregated fleet (with --prefill-workers).
    #[arg(long, requires = "prefill_workers")]
    decode_workers: Option<usize>,
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
    #[command(flatten)]
    pd: PdArgs,
}

pub fn run(args: SimArgs) -> anyhow::Result<()> {
    // (role, engines) of each pool, in the order of their ids and ports.
    let pools = match (args.prefill_workers, args.decode_workers) {
        (Some(prefill), Some(decode)) => {
            anyhow::ensure!(
                prefill > 0 && decode > 0,
                "--prefill-workers and --decode-workers must be at least 1"
            );
            vec![(Role::Prefill, prefill), (Role::Decode, decode)]
        }
        _ => {
            anyhow::ensure!(args.workers > 0, "--workers must be at least 1");
            vec![(args.pd.role, args.workers)]
        }
    };
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
    template.persona = args.pd.persona;
    template.responses_ttl = Duration::from_secs(args.responses_ttl_s);
    let runtime = tokio::runtime::Runtime::new().context("cannot start the async runtime")?;
    runtime.block_on(async {
        let mut workers: Vec<Worker> = Vec::new();
        for (role, count) in pools {
            let mut pool = template.clone();
            pool.pd = args.pd.pd_config(role)?;
            pool.worker_id = template.worker_id + workers.len() as u64;
            let base_port = match args.base_port {
                0 => 0,
                port => u16::try_from(port as usize + workers.len())
                    .context("--base-port plus the engines passes port 65535")?,
            };
            workers.extend(start_fleet(&pool, count, base_port).await?);
        }
        for worker in &workers {
            match worker.role() {
                Role::Aggregated => println!("worker {} {}", worker.id(), worker.base_url()),
                role => println!(
                    "worker {} {} role={} bootstrap={}",
                    worker.id(),
                    worker.base_url(),
                    role.name(),
                    worker.bootstrap_port()
                ),
            }
        }
        crate::cmd::serve::shutdown_signal().await;
        for worker in workers {
            worker.shutdown().await;
        }
        anyhow::Ok(())
    })
}
