//! Starting and stopping the service: listeners, background tasks, graceful shutdown.
//!
//! On shutdown both listeners stop accepting at once; responses already
//! streaming get up to `upstream.shutdown_grace_ms` to finish, then the process
//! ends regardless.

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use kvroute_proto::kv_router_server::KvRouterServer;
use kvroute_tls::{ServerTls, Serves, TlsListener};
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::config::{Config, LimitsConfig, LogConfig, LogFormat, TlsConfig};
use crate::connections::{self, CappedListener, ConnectionCaps, CountStreamsLayer, Port, incoming};
use crate::error::RouterError;
use crate::grpc::KvRouterService;
use crate::http;
use crate::ingest::Ingest;
use crate::metrics;
use crate::replica::Replica;
use crate::state::AppState;

/// A started router.
pub struct Running {
    pub http_addr: SocketAddr,
    pub grpc_addr: SocketAddr,
    /// The endpoint picker's address, with `[epp] addr`.
    pub epp_addr: Option<SocketAddr>,
    pub state: Arc<AppState>,
    stop: watch::Sender<bool>,
    tasks: Vec<JoinHandle<()>>,
}

/// Installs the tracing subscriber; text or JSON lines on stderr.
pub fn init_logging(log: &LogConfig) -> Result<(), RouterError> {
    let filter = tracing_subscriber::EnvFilter::try_new(&log.level)
        .map_err(|e| RouterError::Config(format!("log.level {:?}: {e}", log.level)))?;
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()));
    let result = match log.format {
        LogFormat::Json => builder.json().try_init(),
        LogFormat::Text => builder.try_init(),
    };
    result.map_err(|e| RouterError::Config(format!("cannot install the logger: {e}")))
}

/// Binds both listeners and starts serving.
pub async fn start(config: Config) -> Result<Running, RouterError> {
    start_with(config, None).await
}

/// Like [`start`], as one replica of a cluster sharing `replica`'s log; the
/// caller (`kvroute-cluster`) adds the tasks that follow the log.
pub async fn start_replica(config: Config, replica: Arc<Replica>) -> Result<Running, RouterError> {
    start_with(config, Some(replica)).await
}

async fn start_with(config: Config, replica: Option<Arc<Replica>>) -> Result<Running, RouterError> {
    config.log_notices();
    crate::auth::check_exposure(&config)?;
    let tls = load_tls(&config.tls)?;
    // Before binding: a tokenizer that does not load stops the start.
    let state = AppState::new(config, Some(metrics::handle()))?;
    if let Some(replica) = replica {
        let _ = state.replica.set(replica);
    }
    let config = &state.config;
    let http = TcpListener::bind(config.http_addr).await.map_err(|e| {
        RouterError::Config(format!(
            "cannot listen on http_addr {}: {e}",
            config.http_addr
        ))
    })?;
    let grpc = TcpListener::bind(config.grpc_addr).await.map_err(|e| {
        RouterError::Config(format!(
            "cannot listen on grpc_addr {}: {e}",
            config.grpc_addr
        ))
    })?;
    let epp = crate::epp::bind(config.epp.addr()?).await?;
    let http_addr = http.local_addr()?;
    let grpc_addr = grpc.local_addr()?;
    raise_open_files_limit(&config.limits);
    let limits = &config.limits;
    let http = CappedListener::new(
        http,
        ConnectionCaps::new(
            Port::Http,
            limits.max_http_connections,
            limits.max_http_connections_per_peer,
        ),
    );
    let grpc = CappedListener::new(
        grpc,
        ConnectionCaps::new(
            Port::Grpc,
            limits.max_grpc_connections,
            limits.max_grpc_connections_per_peer,
        ),
    )
    .closing_streamless(Duration::from_millis(
        config.ingest.idle_connection_timeout_ms,
    ));
    let header_read_timeout = Duration::from_millis(limits.header_read_timeout_ms);
    let epp_addr = epp.as_ref().map(TcpListener::local_addr).transpose()?;
    let (stop, stopped) = watch::channel(false);

    let mut tasks = Vec::new();
    let api = crate::http::api::service(Arc::clone(&state));
    let epp_tls = tls.as_ref().map(|tls| Arc::clone(&tls.grpc));
    if let Some(epp) = epp {
        let serving = crate::epp::serve(epp, epp_tls, Arc::clone(&state), stopped.clone());
        tasks.push(tokio::spawn(serving));
    }
    let (http_tls, grpc_tls) = match tls {
        Some(tls) => (Some(tls.http), Some(tls.grpc)),
        None => (None, None),
    };
    let http_stop = stopped.clone();
    tasks.push(tokio::spawn(async move {
        match http_tls {
            None => http::serve::serve(http, api, header_read_timeout, http_stop).await,
            Some(config) => {
                let listener =
                    TlsListener::new(http, config, Serves::Http, connections::count_tls_failure);
                http::serve::serve(listener, api, header_read_timeout, http_stop).await;
            }
        }
    }));

    let max_message = state.config.limits.max_grpc_message_bytes;
    let ingest = Ingest::new(Arc::clone(&state), stopped.clone());
    let ingest = KvRouterServer::new(KvRouterService::new(ingest, Arc::clone(&state)))
        .max_decoding_message_size(max_message);
    // Pings find half-open connections (a worker host gone without a FIN): an
    // unanswered one closes the connection, which ends the worker's stream.
    let keepalive = &state.config.ingest;
    let interval = (keepalive.keepalive_interval_ms > 0)
        .then(|| Duration::from_millis(keepalive.keepalive_interval_ms));
    let mut grpc_server = tonic::transport::Server::builder()
        .http2_keepalive_interval(interval)
        .http2_keepalive_timeout(Some(Duration::from_millis(keepalive.keepalive_timeout_ms)))
        .layer(CountStreamsLayer);
    let mut grpc_stop = stopped.clone();
    tasks.push(tokio::spawn(async move {
        let shutdown = async move {
            let _ = grpc_stop.wait_for(|&s| s).await;
        };
        let grpc_server = grpc_server.add_service(ingest);
        // Our own TLS listener rather than tonic's, which drops failed
        // handshakes unseen.
        let result = match grpc_tls {
            None => {
                let incoming = incoming(grpc);
                grpc_server
                    .serve_with_incoming_shutdown(incoming, shutdown)
                    .await
            }
            Some(config) => {
                let listener =
                    TlsListener::new(grpc, config, Serves::Grpc, connections::count_tls_failure);
                let incoming = incoming(listener);
                grpc_server
                    .serve_with_incoming_shutdown(incoming, shutdown)
                    .await
            }
        };
        if let Err(e) = result {
            tracing::error!("grpc server failed: {e}");
        }
    }));
    tasks.push(tokio::spawn(
        crate::schedule::sessions::expire_periodically(
            Arc::clone(&state.sessions),
            stopped.clone(),
        ),
    ));
    tasks.push(tokio::spawn(health_checks(Arc::clone(&state), stopped)));
    Ok(Running {
        http_addr,
        grpc_addr,
        epp_addr,
        state,
        stop,
        tasks,
    })
}

/// File descriptors beside the connections' own: the listeners, the log,
/// tokenizer files, the cluster's connections.
const SPARE_FILES: u64 = 256;

/// Raises the soft limit on open files to the hard one (as Go's runtime
/// does): the connection caps assume the descriptors are there. Warns when
/// both ports' caps and a worker connection per request in flight do not fit.
fn raise_open_files_limit(limits: &LimitsConfig) {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit and setrlimit only read and write the struct passed.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) } != 0 {
        return;
    }
    if limit.rlim_cur < limit.rlim_max {
        let raised = libc::rlimit {
            rlim_cur: limit.rlim_max,
            ..limit
        };
        // SAFETY: as above.
        if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &raised) } == 0 {
            limit = raised;
        }
    }
    let needed = [
        limits.max_http_connections,
        limits.max_grpc_connections,
        limits.max_inflight_requests,
    ]
    .iter()
    .fold(SPARE_FILES, |sum, &n| sum.saturating_add(n as u64));
    if needed > limit.rlim_cur {
        tracing::warn!(
            "the open-file limit ({}) is below limits.max_http_connections, \
             limits.max_grpc_connections and limits.max_inflight_requests together ({needed} \
             with {SPARE_FILES} spare): a flood of one port can take the other's descriptors; \
             raise the limit (ulimit -n, LimitNOFILE=) or lower the caps",
            limit.rlim_cur
        );
    }
}

/// The listeners' TLS from `[tls]`, read at start so a bad file stops the router.
fn load_tls(tls: &TlsConfig) -> Result<Option<ServerTls>, RouterError> {
    if !tls.enabled() {
        return Ok(None);
    }
    let client_ca = Some(Path::new(&tls.client_ca_file)).filter(|_| !tls.client_ca_file.is_empty());
    ServerTls::load(
        Path::new(&tls.cert_file),
        Path::new(&tls.key_file),
        client_ca,
    )
    .map(Some)
    .map_err(|e| RouterError::Config(format!("tls: {e}")))
}

impl Running {
    /// Turns true when the router shuts down: tasks added with
    /// [`Self::add_task`] stop on it.
    pub fn stopped(&self) -> watch::Receiver<bool> {
        self.stop.subscribe()
    }

    /// A task the shutdown waits for, like the router's own.
    pub fn add_task(&mut self, task: JoinHandle<()>) {
        self.tasks.push(task);
    }

    /// Stops accepting and waits for in-flight responses, up to the shutdown grace.
    pub async fn shutdown(self) {
        let _ = self.stop.send(true);
        let grace = Duration::from_millis(self.state.config.upstream.shutdown_grace_ms);
        let all = futures_util::future::join_all(self.tasks);
        if tokio::time::timeout(grace, all).await.is_err() {
            tracing::warn!(
                "in-flight requests did not finish within {} ms; stopping anyway",
                grace.as_millis()
            );
        }
    }
}

/// Checks `/health` of workers that had no request for a health interval, feeding
/// the result into their breakers (a recovered worker closes its breaker this way).
async fn health_checks(state: Arc<AppState>, mut stopped: watch::Receiver<bool>) {
    let interval = Duration::from_millis(state.config.upstream.health_interval_ms);
    if interval.is_zero() {
        return;
    }
    loop {
        tokio::select! {
            _ = tokio::time::sleep(interval) => {}
            _ = stopped.wait_for(|&s| s) => return,
        }
        let checks = state
            .registry
            .due_health_checks(interval)
            .into_iter()
            .map(|(id, url)| {
                let state = Arc::clone(&state);
                async move {
                    let ok = state.upstream.healthy(&url).await;
                    let result = if ok { "ok" } else { "failed" };
                    ::metrics::counter!(metrics::HEALTH_CHECKS, "result" => result).increment(1);
                    if !ok {
                        tracing::warn!(worker = id, "health check failed");
                    }
                    state.registry.record_outcome(id, ok);
                }
            });
        futures_util::future::join_all(checks).await;
    }
}
