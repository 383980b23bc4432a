//! The one set of helpers for the end-to-end tests in `tests/`: real parts over
//! loopback. Processes: `kvroute` and `kvroute-lab` one-shot runs, the `kvroute
//! serve` router and the `kvroute sim` fleet, killed on drop. In the test process: a small
//! OpenAI-compatible test worker (an axum server), a gRPC worker client
//! streaming KV events, a plain HTTP client, polling and metric reading.
//! TLS: a test CA with server and client certificates made at run time, and an
//! HTTPS client. Each test binary uses a part of it.

#![allow(dead_code)]

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Read};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Body;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use kvroute_index::BlockHasher;
use kvroute_proto::kv_router_client::KvRouterClient;
use kvroute_proto::{
    Dump, KvEvent, Register, RouterMessage, Stored, StoredBlock, WorkerMessage, kv_event,
    router_message, worker_message,
};
use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, DnType, ExtendedKeyUsagePurpose, IsCa,
    KeyPair, KeyUsagePurpose,
};
use serde_json::{Value, json};
use tokio::sync::{Notify, mpsc};
use tokio_stream::wrappers::ReceiverStream;

pub const BLOCK_SIZE: usize = 16;

/// The `kvroute` binary, logging warnings only.
pub fn kvroute() -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_kvroute"));
    command.env("RUST_LOG", "warn");
    command
}

/// Runs `kvroute ARGS` to the end.
pub fn kvroute_output(args: &[&str]) -> Output {
    kvroute().args(args).output().expect("kvroute runs")
}

/// Runs `kvroute-lab ARGS` to the end, logging warnings only.
pub fn kvroute_lab_output(args: &[&str]) -> Output {
    Command::new(kvroute_lab_binary())
        .args(args)
        .env("RUST_LOG", "warn")
        .output()
        .expect("kvroute-lab runs")
}

/// The `kvroute-lab` binary, built on first use. Cargo gives a test only its
/// own package's binaries, so this asks Cargo to build the lab's (at once if it
/// is fresh) into the same target directory and profile as `kvroute`: a
/// binary merely found there could be stale.
fn kvroute_lab_binary() -> PathBuf {
    static BUILT: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    BUILT
        .get_or_init(|| {
            let kvroute = Path::new(env!("CARGO_BIN_EXE_kvroute"));
            let profile_dir = kvroute.parent().unwrap();
            let profile = match profile_dir.file_name().unwrap().to_str().unwrap() {
                "debug" => "dev",
                other => other,
            };
            let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
            let output = Command::new(cargo)
                .args([
                    "build",
                    "--quiet",
                    "-p",
                    "kvroute-lab",
                    "--bin",
                    "kvroute-lab",
                ])
                .args(["--profile", profile, "--target-dir"])
                .arg(profile_dir.parent().unwrap())
                .current_dir(env!("CARGO_MANIFEST_DIR"))
                .output()
                .expect("cargo runs");
            assert!(
                output.status.success(),
                "cargo build -p kvroute-lab failed: {}",
                String::from_utf8_lossy(&output.stderr)
            );
            profile_dir.join("kvroute-lab")
        })
        .clone()
}

/// A running `kvroute` process, killed on drop, with the stdout lines it printed
/// until it was ready.
pub struct Process {
    pub child: Child,
    pub lines: Vec<String>,
}

impl Process {
    /// Starts `kvroute ARGS` (its stderr on the test's) and reads stdout lines
    /// until `ready` holds for them.
    pub fn spawn(args: &[&str], ready: impl Fn(&[String]) -> bool) -> Self {
        let mut command = kvroute();
        command.args(args).stderr(Stdio::inherit());
        Self::start(command, ready)
    }

    /// Starts `command` and reads stdout lines until `ready` holds for them;
    /// stdout is drained from then on so the child never blocks on a full pipe.
    pub fn start(mut command: Command, ready: impl Fn(&[String]) -> bool) -> Self {
        let args: Vec<_> = command.get_args().map(|a| a.to_owned()).collect();
        let mut child = command
            .stdout(Stdio::piped())
            .spawn()
            .expect("kvroute starts");
        let mut reader = BufReader::new(child.stdout.take().unwrap());
        let mut lines = Vec::new();
        while !ready(&lines) {
            let mut line = String::new();
            if reader.read_line(&mut line).unwrap() == 0 {
                let _ = child.kill();
                panic!("kvroute {args:?} exited; printed {lines:?}");
            }
            lines.push(line.trim().to_string());
        }
        std::thread::spawn(move || {
            let mut sink = String::new();
            let _ = reader.read_to_string(&mut sink);
        });
        Self { child, lines }
    }

    /// Sends SIGTERM, as Kubernetes does on shutdown.
    pub fn terminate(&self) {
        let status = Command::new("kill")
            .arg("-TERM")
            .arg(self.child.id().to_string())
            .status()
            .unwrap();
        assert!(status.success());
    }

    /// Whether the process has exited, and how.
    pub fn exited(&mut self) -> Option<std::process::ExitStatus> {
        self.child.try_wait().unwrap()
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A `kvroute serve` process on loopback; `http` and `grpc` are its URLs.
pub struct RouterProcess {
    pub process: Process,
    pub http: String,
    pub grpc: String,
    config_path: std::path::PathBuf,
}

impl RouterProcess {
    /// Starts the router on ephemeral ports with `config` (TOML) appended to test defaults.
    pub fn start(config: &str) -> Self {
        Self::start_on("127.0.0.1:0", config)
    }

    /// Starts the router with its gRPC ingest on `grpc_addr` (HOST:PORT).
    pub fn start_on(grpc_addr: &str, config: &str) -> Self {
        Self::start_logging(grpc_addr, config, None)
    }

    /// The same; with `log`, warnings and errors are written to that file
    /// instead of the test's stderr.
    pub fn start_logging(grpc_addr: &str, config: &str, log: Option<&Path>) -> Self {
        Self::start_limited(grpc_addr, config, log, None)
    }

    /// Like [`Self::start`], the process allowed at most `open_files` file
    /// descriptors (soft and hard limit).
    pub fn start_with_open_files(config: &str, open_files: u64) -> Self {
        Self::start_limited("127.0.0.1:0", config, None, Some(open_files))
    }

    fn start_limited(
        grpc_addr: &str,
        config: &str,
        log: Option<&Path>,
        open_files: Option<u64>,
    ) -> Self {
        static NEXT: AtomicUsize = AtomicUsize::new(0);
        let config_path = std::env::temp_dir().join(format!(
            "kvroute-test-{}-{}.toml",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        ));
        let level = if log.is_some() { "warn" } else { "error" };
        let text = format!(
            "http_addr = \"127.0.0.1:0\"\ngrpc_addr = \"{grpc_addr}\"\n{config}\n[log]\nlevel = \"{level}\"\n"
        );
        std::fs::write(&config_path, text).unwrap();
        let mut command = kvroute();
        command.args(["serve", "--config", config_path.to_str().unwrap()]);
        if let Some(open_files) = open_files {
            let limit = libc::rlimit {
                rlim_cur: open_files,
                rlim_max: open_files,
            };
            // SAFETY: the closure runs in the child between fork and exec and
            // only calls setrlimit, which is async-signal-safe.
            unsafe {
                std::os::unix::process::CommandExt::pre_exec(&mut command, move || {
                    match libc::setrlimit(libc::RLIMIT_NOFILE, &limit) {
                        0 => Ok(()),
                        _ => Err(std::io::Error::last_os_error()),
                    }
                });
            }
        }
        match log {
            Some(log) => command.stderr(std::fs::File::create(log).unwrap()),
            None => command.stderr(Stdio::inherit()),
        };
        let process = Process::start(command, |lines| {
            lines.iter().any(|l| l.starts_with("listening "))
        });
        let line = process.lines.last().unwrap().clone();
        let addr = |key: &str| {
            line.split_whitespace()
                .find_map(|part| part.strip_prefix(key))
                .unwrap_or_else(|| panic!("no {key} in the ready line {line:?}"))
                .to_string()
        };
        Self {
            http: format!("http://{}", addr("http=")),
            grpc: format!("http://{}", addr("grpc=")),
            process,
            config_path,
        }
    }
}

impl Drop for RouterProcess {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.config_path);
    }
}

/// A `kvroute sim` fleet of simulated workers.
pub struct SimFleet {
    pub process: Process,
    /// (worker id, base URL) per worker.
    pub workers: Vec<(u64, String)>,
}

impl SimFleet {
    /// `n` workers registering with the router at `router` (its gRPC URL), if any.
    pub fn start(router: Option<&str>, n: usize) -> Self {
        Self::start_with(router, n, &[], &[])
    }

    /// The same, with these environment variables (e.g. `KVROUTE_ROUTER_TOKEN`).
    pub fn start_with_env(router: Option<&str>, n: usize, env: &[(&str, &str)]) -> Self {
        Self::start_with(router, n, &[], env)
    }

    /// The same with `extra` arguments for `kvroute sim` and environment variables.
    pub fn start_with(
        router: Option<&str>,
        n: usize,
        extra: &[&str],
        env: &[(&str, &str)],
    ) -> Self {
        let count = n.to_string();
        let mut args = vec![
            "sim",
            "--workers",
            &count,
            "--block-size",
            "16",
            "--kv-blocks",
            "256",
            "--speedup",
            "100",
            "--load-report-ms",
            "50",
        ];
        if let Some(router) = router {
            args.extend(["--router", router]);
        }
        args.extend(extra);
        let mut command = kvroute();
        command
            .args(&args)
            .envs(env.iter().copied())
            .stderr(Stdio::inherit());
        let process = Process::start(command, |lines| {
            lines.iter().filter(|l| l.starts_with("worker ")).count() == n
        });
        let workers = process
            .lines
            .iter()
            .filter_map(|l| {
                let mut parts = l.split(' ');
                parts.next()?;
                let id = parts.next()?.parse().ok()?;
                Some((id, parts.next()?.to_string()))
            })
            .collect();
        Self { process, workers }
    }
}

/// The first of `count` consecutive loopback ports that were free a moment ago.
pub fn free_ports(count: u16) -> u16 {
    for _ in 0..100 {
        let first = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let all_free = (0..count).all(|i| {
            first
                .checked_add(i)
                .is_some_and(|p| std::net::TcpListener::bind(("127.0.0.1", p)).is_ok())
        });
        if all_free {
            return first;
        }
    }
    panic!("no {count} consecutive free ports");
}

/// An HTTP response, fully read.
pub struct Reply {
    pub status: StatusCode,
    pub headers: http::HeaderMap,
    pub body: Bytes,
}

impl Reply {
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body).unwrap_or_else(|e| {
            panic!(
                "body is not JSON ({e}): {}",
                String::from_utf8_lossy(&self.body)
            )
        })
    }

    /// The worker id the router named in `x-kvroute-worker`.
    pub fn worker(&self) -> u64 {
        self.headers["x-kvroute-worker"]
            .to_str()
            .unwrap()
            .parse()
            .unwrap()
    }

    /// Asserts an OpenAI-style error body with this status.
    pub fn assert_error(&self, status: u16, code: &str) {
        assert_eq!(
            self.status.as_u16(),
            status,
            "{}",
            String::from_utf8_lossy(&self.body)
        );
        let error = &self.json()["error"];
        assert_eq!(error["code"], code, "{error}");
        assert!(error["message"].as_str().is_some_and(|m| !m.is_empty()));
        assert!(error["type"].is_string());
    }
}

#[derive(Clone)]
pub struct Http {
    client: Client<HttpConnector, Full<Bytes>>,
}

impl Default for Http {
    fn default() -> Self {
        Self {
            client: Client::builder(TokioExecutor::new()).build(HttpConnector::new()),
        }
    }
}

impl Http {
    /// A client that speaks HTTP/2 only, by prior knowledge (h2c).
    pub fn http2() -> Self {
        Self {
            client: Client::builder(TokioExecutor::new())
                .http2_only(true)
                .build(HttpConnector::new()),
        }
    }

    pub async fn send(
        &self,
        method: &str,
        url: &str,
        headers: &[(&str, &str)],
        body: impl Into<Bytes>,
    ) -> http::Response<hyper::body::Incoming> {
        let mut request = http::Request::builder()
            .method(method)
            .uri(url)
            .header("content-type", "application/json");
        for (k, v) in headers {
            request = request.header(*k, *v);
        }
        self.client
            .request(request.body(Full::new(body.into())).unwrap())
            .await
            .expect("the request reaches the server")
    }

    pub async fn call(
        &self,
        method: &str,
        url: &str,
        headers: &[(&str, &str)],
        body: impl Into<Bytes>,
    ) -> Reply {
        let response = self.send(method, url, headers, body).await;
        let (parts, body) = response.into_parts();
        Reply {
            status: parts.status,
            headers: parts.headers,
            body: body.collect().await.unwrap().to_bytes(),
        }
    }

    pub async fn post(&self, url: &str, body: &Value) -> Reply {
        self.call("POST", url, &[], body.to_string()).await
    }

    pub async fn get(&self, url: &str) -> Reply {
        self.call("GET", url, &[], "").await
    }
}

/// A completion request for token ids.
pub fn completion(model: &str, tokens: &[u32]) -> Value {
    json!({"model": model, "prompt": tokens, "max_tokens": 4})
}

/// The router's `[[workers]]` entries for `workers`, ids 1, 2, ... serving "m".
pub fn static_workers(workers: &[TestWorker]) -> String {
    workers
        .iter()
        .enumerate()
        .map(|(i, w)| {
            format!(
                "[[workers]]\nid = {}\nbase_url = \"{}\"\nmodels = [\"m\"]\n",
                i + 1,
                w.url
            )
        })
        .collect()
}

/// Streams a completion through the router at `router_http` from a test
/// worker that breaks its connection after two chunks; the whole body the
/// client got, which must end, not break, with a 200 status line.
pub async fn broken_stream(router_http: &str) -> String {
    let body = json!({"model": "m", "prompt": tokens(0, 40), "stream": true,
                      "max_tokens": 10, "abort_after_chunks": 2});
    let response = Http::default()
        .send(
            "POST",
            &format!("{router_http}/v1/completions"),
            &[],
            body.to_string(),
        )
        .await;
    assert_eq!(response.status(), 200);
    let body = response
        .into_body()
        .collect()
        .await
        .expect("the stream ends, not breaks")
        .to_bytes();
    String::from_utf8_lossy(&body).into_owned()
}

/// `n` token ids starting at `start`.
pub fn tokens(start: u32, n: usize) -> Vec<u32> {
    (start..start + n as u32).collect()
}

/// How long [`eventually`] waits: generous, for a loaded CI machine.
pub const DEADLINE: Duration = Duration::from_secs(30);

/// The router's view of a worker's rank 0: (indexed blocks, last event id).
pub async fn indexed(router: &RouterProcess, worker: u64) -> (u64, u64) {
    let info = Http::default()
        .get(&format!("{}/workers/{worker}", router.http))
        .await
        .json();
    let rank = &info["index"][0];
    (
        rank["indexed_blocks"].as_u64().unwrap_or(0),
        rank["last_event_id"].as_u64().unwrap_or(0),
    )
}

/// Worker `id` (one rank, model "m") connected to `router` over gRPC; the
/// router's refusal comes back as the error.
pub async fn connect(router: &RouterProcess, id: u64) -> Result<GrpcWorker, tonic::Status> {
    let url = format!("http://127.0.0.1:{}", 9000 + id);
    GrpcWorker::connect(
        &router.grpc,
        None,
        register(id, &url, &["m"], BLOCK_SIZE as u32),
    )
    .await
}

/// The router's `/v1/route` answer for a completion over `tokens` (which
/// touches the path in its index, as routing does).
pub async fn dry_run(router: &RouterProcess, tokens: &[u32]) -> Value {
    let reply = Http::default()
        .post(
            &format!("{}/v1/route", router.http),
            &completion("m", tokens),
        )
        .await;
    assert_eq!(reply.status, 200, "{}", reply.text());
    reply.json()
}

/// The blocks of `tokens` that `worker`'s events cover, as the router scores them.
pub async fn event_overlap(router: &RouterProcess, tokens: &[u32], worker: u64) -> u64 {
    dry_run(router, tokens).await["scores"]
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["worker_id"] == worker)
        .map_or(0, |s| s["event_overlap_blocks"].as_u64().unwrap())
}

/// Waits until `n` workers are connected to `router`.
pub async fn wait_registered(router: &RouterProcess, n: usize) {
    wait_registered_at(&router.http, n).await;
}

/// Waits until `n` workers are connected to the router serving HTTP at `http_url`.
pub async fn wait_registered_at(http_url: &str, n: usize) {
    let http = Http::default();
    let url = format!("{http_url}/workers");
    eventually("workers to register", || async {
        let workers = http.get(&url).await.json();
        let connected = workers["workers"].as_array().map_or(0, |w| {
            w.iter().filter(|w| w["state"] == "connected").count()
        });
        connected == n
    })
    .await;
}

/// Polls `check` every 20 ms until it holds, failing after [`DEADLINE`].
pub async fn eventually<F, Fut>(what: &str, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let start = Instant::now();
    while !check().await {
        assert!(start.elapsed() < DEADLINE, "timed out waiting until {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// `kvroute_limit_refusals_total{limit}` on `router`'s /metrics now.
pub async fn refusals(router: &RouterProcess, limit: &str) -> f64 {
    let text = Http::default()
        .get(&format!("{}/metrics", router.http))
        .await
        .text();
    metric(&text, "kvroute_limit_refusals_total", &[("limit", limit)])
}

/// Reads a worker's stream until it ends with an error status; fails the
/// test if it does not within 10 s.
pub async fn end_of(worker: &mut GrpcWorker) -> tonic::Status {
    let ended = async {
        loop {
            match worker.rx.message().await {
                Ok(Some(_)) => {}
                Ok(None) => panic!("the stream ended without a status"),
                Err(status) => return status,
            }
        }
    };
    tokio::time::timeout(Duration::from_secs(10), ended)
        .await
        .expect("the router ends the stream with a status")
}

/// Label pairs a metric sample must carry.
pub type Labels<'a> = &'a [(&'a str, &'a str)];

/// The sum of the samples of `name` in Prometheus text whose labels include `labels`.
pub fn metric(text: &str, name: &str, labels: Labels<'_>) -> f64 {
    text.lines()
        .filter(|line| line.starts_with(name) && line[name.len()..].starts_with(['{', ' ']))
        .filter(|line| {
            labels
                .iter()
                .all(|(k, v)| line.contains(&format!("{k}=\"{v}\"")))
        })
        .filter_map(|line| line.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// How the test worker answers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    Ok,
    /// Every completion and health check fails with 500.
    Fail,
    /// Completions wait until [`TestWorker::release`].
    Hold,
    /// A connection that carries more than [`RESET_AFTER_BYTES`] of requests
    /// is reset mid-upload, as an engine refusing a body's size resets it.
    ResetLargeBodies,
}

/// How much a connection may carry in [`Mode::ResetLargeBodies`].
pub const RESET_AFTER_BYTES: usize = 1 << 20;

pub struct WorkerState {
    pub id: u64,
    mode: Mutex<Mode>,
    pub received: AtomicUsize,
    pub inflight: AtomicUsize,
    pub cancelled: AtomicUsize,
    pub completed_streams: AtomicUsize,
    release: Notify,
    released: Mutex<bool>,
    pub last_body: Mutex<Option<Value>>,
    /// What plain completions report as `usage.prompt_tokens_details.cached_tokens`;
    /// `None`: no usage at all.
    cached_tokens: Mutex<Option<u64>>,
    /// Every `Authorization` value of every completion request, in order.
    pub authorizations: Mutex<Vec<String>>,
}

/// A small OpenAI-compatible worker: answers completions with a body naming
/// itself, streams SSE chunks when asked, and counts what it saw.
pub struct TestWorker {
    pub url: String,
    pub state: Arc<WorkerState>,
}

impl TestWorker {
    pub async fn start(id: u64) -> Self {
        let state = Arc::new(WorkerState {
            id,
            mode: Mutex::new(Mode::Ok),
            received: AtomicUsize::new(0),
            inflight: AtomicUsize::new(0),
            cancelled: AtomicUsize::new(0),
            completed_streams: AtomicUsize::new(0),
            release: Notify::new(),
            released: Mutex::new(false),
            last_body: Mutex::new(None),
            cached_tokens: Mutex::new(None),
            authorizations: Mutex::new(Vec::new()),
        });
        let app = Router::new()
            .route("/v1/completions", post(complete))
            .route("/v1/chat/completions", post(complete))
            .route("/health", get(health))
            // Whatever the router forwards (its own limit applies) is counted here.
            .layer(axum::extract::DefaultBodyLimit::disable())
            .with_state(Arc::clone(&state));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr: SocketAddr = listener.local_addr().unwrap();
        let listener = CountingListener {
            listener,
            state: Arc::clone(&state),
        };
        tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
        Self {
            url: format!("http://{addr}"),
            state,
        }
    }

    pub fn set_mode(&self, mode: Mode) {
        *self.state.mode.lock().unwrap() = mode;
        *self.state.released.lock().unwrap() = false;
    }

    /// Plain completions report `cached` as their cached prompt tokens from
    /// now on (`None`: no usage).
    pub fn report_cached_tokens(&self, cached: Option<u64>) {
        *self.state.cached_tokens.lock().unwrap() = cached;
    }

    /// Lets every held request (and later ones) finish.
    pub fn release(&self) {
        *self.state.released.lock().unwrap() = true;
        self.state.release.notify_waiters();
    }

    pub fn received(&self) -> usize {
        self.state.received.load(Ordering::SeqCst)
    }

    pub fn inflight(&self) -> usize {
        self.state.inflight.load(Ordering::SeqCst)
    }

    /// Streams that ended before their end: the client (the router) hung up.
    pub fn cancelled(&self) -> usize {
        self.state.cancelled.load(Ordering::SeqCst)
    }
}

/// The test worker's listener: its connections count what they read, for
/// [`Mode::ResetLargeBodies`].
struct CountingListener {
    listener: tokio::net::TcpListener,
    state: Arc<WorkerState>,
}

impl axum::serve::Listener for CountingListener {
    type Io = CountingConnection;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (CountingConnection, SocketAddr) {
        loop {
            if let Ok((tcp, addr)) = self.listener.accept().await {
                let connection = CountingConnection {
                    tcp,
                    read: 0,
                    state: Arc::clone(&self.state),
                };
                return (connection, addr);
            }
        }
    }

    fn local_addr(&self) -> std::io::Result<SocketAddr> {
        self.listener.local_addr()
    }
}

/// A test worker's connection. Once reset, reads and writes fail (no response
/// goes out), and it is dropped with the rest of the upload unread, which
/// makes the kernel reset it.
struct CountingConnection {
    tcp: tokio::net::TcpStream,
    read: usize,
    state: Arc<WorkerState>,
}

impl CountingConnection {
    fn reset(&self) -> bool {
        self.read > RESET_AFTER_BYTES && *self.state.mode.lock().unwrap() == Mode::ResetLargeBodies
    }
}

fn reset_error<T>() -> std::task::Poll<std::io::Result<T>> {
    std::task::Poll::Ready(Err(std::io::ErrorKind::ConnectionReset.into()))
}

impl tokio::io::AsyncRead for CountingConnection {
    fn poll_read(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        let this = &mut *self;
        if this.reset() {
            return reset_error();
        }
        let before = buf.filled().len();
        let polled = std::pin::Pin::new(&mut this.tcp).poll_read(cx, buf);
        this.read += buf.filled().len() - before;
        polled
    }
}

impl tokio::io::AsyncWrite for CountingConnection {
    fn poll_write(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        if self.reset() {
            return reset_error();
        }
        std::pin::Pin::new(&mut self.tcp).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> std::task::Poll<std::io::Result<usize>> {
        if self.reset() {
            return reset_error();
        }
        std::pin::Pin::new(&mut self.tcp).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.tcp.is_write_vectored()
    }

    fn poll_flush(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.tcp).poll_flush(cx)
    }

    fn poll_shutdown(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.tcp).poll_shutdown(cx)
    }
}

/// The SSE body a test worker streams for `chunks` chunks.
pub fn sse_chunk(worker: u64, i: usize) -> String {
    format!(
        "data: {}\n\n",
        json!({"object": "text_completion", "worker": worker, "choices": [{"index": 0, "text": format!("tok{i} ")}]})
    )
}

struct InflightGuard(Arc<WorkerState>);

impl Drop for InflightGuard {
    fn drop(&mut self) {
        self.0.inflight.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Counts a stream dropped before its end as a cancel.
struct StreamGuard {
    state: Arc<WorkerState>,
    done: bool,
}

impl Drop for StreamGuard {
    fn drop(&mut self) {
        let counter = if self.done {
            &self.state.completed_streams
        } else {
            &self.state.cancelled
        };
        counter.fetch_add(1, Ordering::SeqCst);
    }
}

async fn complete(
    State(state): State<Arc<WorkerState>>,
    headers: http::HeaderMap,
    body: Bytes,
) -> Response {
    state.received.fetch_add(1, Ordering::SeqCst);
    state.authorizations.lock().unwrap().extend(
        headers
            .get_all(http::header::AUTHORIZATION)
            .iter()
            .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned()),
    );
    state.inflight.fetch_add(1, Ordering::SeqCst);
    let guard = InflightGuard(Arc::clone(&state));
    let request: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
    *state.last_body.lock().unwrap() = Some(request.clone());
    let mode = *state.mode.lock().unwrap();
    if mode == Mode::Fail {
        return (StatusCode::INTERNAL_SERVER_ERROR, "worker failure").into_response();
    }
    if mode == Mode::Hold {
        let released = state.release.notified();
        if !*state.released.lock().unwrap() {
            released.await;
        }
    }
    if request["stream"] == json!(true) {
        let chunks = request["max_tokens"].as_u64().unwrap_or(4) as usize;
        let delay = Duration::from_millis(request["chunk_delay_ms"].as_u64().unwrap_or(5));
        // A worker that hangs mid-stream: silent for good after this many chunks.
        let stall_after = request["stall_after_chunks"].as_u64().map(|n| n as usize);
        // A worker that fails mid-stream: the connection breaks after this many chunks.
        let abort_after = request["abort_after_chunks"].as_u64().map(|n| n as usize);
        let id = state.id;
        let stream = futures_util::stream::unfold(
            (
                0usize,
                StreamGuard {
                    state: Arc::clone(&state),
                    done: false,
                },
                guard,
            ),
            move |(i, mut stream_guard, guard)| async move {
                if i > chunks {
                    return None;
                }
                if stall_after == Some(i) {
                    std::future::pending::<()>().await;
                }
                if abort_after == Some(i) {
                    let error = std::io::Error::other("the worker failed mid-stream");
                    return Some((Err(error), (chunks + 1, stream_guard, guard)));
                }
                tokio::time::sleep(delay).await;
                let text = if i == chunks {
                    stream_guard.done = true;
                    "data: [DONE]\n\n".to_string()
                } else {
                    sse_chunk(id, i)
                };
                Some((
                    Ok::<_, std::io::Error>(Bytes::from(text)),
                    (i + 1, stream_guard, guard),
                ))
            },
        );
        return Response::builder()
            .header("content-type", "text/event-stream")
            .body(Body::from_stream(stream))
            .unwrap();
    }
    drop(guard);
    let mut answer = json!({
        "id": "cmpl-test",
        "object": "text_completion",
        "worker": state.id,
        "choices": [{"index": 0, "text": "hello", "finish_reason": "stop"}],
    });
    if let Some(cached) = *state.cached_tokens.lock().unwrap() {
        let prompt_tokens = request["prompt"].as_array().map_or(0, Vec::len);
        answer["usage"] = json!({
            "prompt_tokens": prompt_tokens,
            "completion_tokens": 1,
            "total_tokens": prompt_tokens + 1,
            "prompt_tokens_details": {"cached_tokens": cached},
        });
    }
    axum::Json(answer).into_response()
}

async fn health(State(state): State<Arc<WorkerState>>) -> StatusCode {
    if *state.mode.lock().unwrap() == Mode::Fail {
        StatusCode::INTERNAL_SERVER_ERROR
    } else {
        StatusCode::OK
    }
}

/// A worker's gRPC event stream to the router.
pub struct GrpcWorker {
    pub id: u64,
    tx: mpsc::Sender<WorkerMessage>,
    pub rx: tonic::Streaming<RouterMessage>,
    next_block_hash: u64,
    /// dp rank → the id of its next event.
    next_event_ids: HashMap<u32, u64>,
    /// Every event logged, by (dp rank, id): what a resync is answered from.
    log: std::collections::BTreeMap<(u32, u64), kv_event::Kind>,
}

/// A `Dump` of rank 0: `chains` as the rank's whole state as of
/// `last_event_id`, or a part of it when `more` is set.
pub fn dump(last_event_id: u64, chains: Vec<Stored>, more: bool) -> worker_message::Body {
    worker_message::Body::Dump(Dump {
        dp_rank: 0,
        last_event_id,
        chains,
        more,
        offload_chains: Vec::new(),
    })
}

pub async fn send_dump(worker: &GrpcWorker, last_event_id: u64, chains: Vec<Stored>, more: bool) {
    worker.send(dump(last_event_id, chains, more)).await;
}

pub fn register(id: u64, base_url: &str, models: &[&str], block_size: u32) -> Register {
    Register {
        worker_id: id,
        dp_ranks: vec![0],
        models: models.iter().map(|m| m.to_string()).collect(),
        base_url: base_url.to_string(),
        block_size,
        total_kv_blocks: 1000,
        lora_names: Vec::new(),
        tokenizer: None,
        instance_id: 1,
        ..Default::default()
    }
}

/// The declaration a worker tokenizing with `spec` sends, fingerprint and all.
pub fn declared(spec: &str) -> kvroute_proto::TokenizerInfo {
    let tokenizer = kvroute_tokenize::Tokenizer::load(&spec.parse().unwrap()).unwrap();
    kvroute_proto::TokenizerInfo {
        spec: spec.to_string(),
        fingerprint: tokenizer.fingerprint().to_string(),
    }
}

/// Registers worker `id` serving "m" at an address nothing listens on,
/// declaring `tokenizer`; a refusal comes back as the error, and a
/// registration that gets no answer fails the test.
pub async fn connect_declaring(
    router: &RouterProcess,
    id: u64,
    tokenizer: Option<kvroute_proto::TokenizerInfo>,
) -> Result<GrpcWorker, tonic::Status> {
    let mut register = register(id, "http://127.0.0.1:9", &["m"], BLOCK_SIZE as u32);
    register.tokenizer = tokenizer;
    tokio::time::timeout(DEADLINE, GrpcWorker::connect(&router.grpc, None, register))
        .await
        .unwrap_or_else(|_| panic!("worker {id}'s registration got no answer"))
}

impl GrpcWorker {
    /// Opens the stream and registers; the router's refusal comes back as the error.
    pub async fn connect(
        grpc: &str,
        token: Option<&str>,
        register: Register,
    ) -> Result<Self, tonic::Status> {
        let channel = tonic::transport::Endpoint::from_shared(grpc.to_string())
            .unwrap()
            .connect()
            .await
            .expect("the router's gRPC port accepts");
        let header = token.map(|t| {
            format!("Bearer {t}")
                .parse::<tonic::metadata::MetadataValue<_>>()
                .unwrap()
        });
        let mut client =
            KvRouterClient::with_interceptor(channel, move |mut req: tonic::Request<()>| {
                if let Some(h) = &header {
                    req.metadata_mut().insert("authorization", h.clone());
                }
                Ok(req)
            });
        let (tx, rx) = mpsc::channel(64);
        let id = register.worker_id;
        tx.send(WorkerMessage {
            body: Some(worker_message::Body::Register(register)),
        })
        .await
        .unwrap();
        let rx = client.stream(ReceiverStream::new(rx)).await?.into_inner();
        Ok(Self {
            id,
            tx,
            rx,
            next_block_hash: id << 32,
            next_event_ids: HashMap::new(),
            log: Default::default(),
        })
    }

    /// Opens a new stream (to the same router or another) as the same worker,
    /// keeping its event log and ids.
    pub async fn reconnect(
        &mut self,
        grpc: &str,
        token: Option<&str>,
        register: Register,
    ) -> Result<(), tonic::Status> {
        let fresh = Self::connect(grpc, token, register).await?;
        self.tx = fresh.tx;
        self.rx = fresh.rx;
        Ok(())
    }

    pub async fn send(&self, body: worker_message::Body) {
        self.tx
            .send(WorkerMessage { body: Some(body) })
            .await
            .unwrap();
    }

    /// Sends a message on a stream the router may have closed already; false if it has.
    pub async fn try_send(&self, body: worker_message::Body) -> bool {
        let message = WorkerMessage { body: Some(body) };
        self.tx.send(message).await.is_ok()
    }

    /// A Stored chain for the full blocks of `tokens` from the root; returns the
    /// engine block hashes used.
    pub fn chain(&mut self, tokens: &[u32]) -> (Stored, Vec<u64>) {
        let locals = BlockHasher::new(BLOCK_SIZE).local_hashes(tokens);
        let hashes: Vec<u64> = locals
            .iter()
            .map(|_| {
                self.next_block_hash += 1;
                self.next_block_hash
            })
            .collect();
        let stored = Stored {
            parent_hash: None,
            blocks: locals
                .iter()
                .zip(&hashes)
                .map(|(&tokens_hash, &block_hash)| StoredBlock {
                    block_hash,
                    tokens_hash,
                })
                .collect(),
        };
        (stored, hashes)
    }

    /// Sends one event with the next id (or `id` when given) and returns its id.
    pub async fn event(&mut self, id: Option<u64>, kind: kv_event::Kind) -> u64 {
        self.event_on(0, id, kind, false).await
    }

    /// Logs one event of dp rank `rank` with the next id (or `id`) and sends it
    /// unless `lost`, as an engine whose event went missing. Returns its id.
    pub async fn event_on(
        &mut self,
        rank: u32,
        id: Option<u64>,
        kind: kv_event::Kind,
        lost: bool,
    ) -> u64 {
        let next = self.next_event_ids.entry(rank).or_default();
        let event_id = id.unwrap_or(*next);
        *next = event_id + 1;
        self.log.insert((rank, event_id), kind.clone());
        if !lost {
            self.send(worker_message::Body::Events(kvroute_proto::EventBatch {
                dp_rank: rank,
                events: vec![KvEvent {
                    tier: Default::default(),
                    event_id,
                    kind: Some(kind),
                }],
            }))
            .await;
        }
        event_id
    }

    /// Sends one event on a stream the router may have closed already.
    pub async fn offer(&self, event_id: u64, kind: kv_event::Kind) {
        let batch = kvroute_proto::EventBatch {
            dp_rank: 0,
            events: vec![KvEvent {
                tier: Default::default(),
                event_id,
                kind: Some(kind),
            }],
        };
        let _ = self
            .tx
            .send(WorkerMessage {
                body: Some(worker_message::Body::Events(batch)),
            })
            .await;
    }

    /// Stores the full blocks of `tokens` and waits for the router's ack.
    pub async fn store(&mut self, tokens: &[u32]) -> Vec<u64> {
        let (stored, hashes) = self.chain(tokens);
        let id = self.event(None, kv_event::Kind::Stored(stored)).await;
        self.wait_ack(id).await;
        hashes
    }

    /// Removes blocks and waits for the router's ack.
    pub async fn remove(&mut self, block_hashes: Vec<u64>) {
        let id = self
            .event(
                None,
                kv_event::Kind::Removed(kvroute_proto::Removed { block_hashes }),
            )
            .await;
        self.wait_ack(id).await;
    }

    /// The router's next message.
    pub async fn next(&mut self) -> router_message::Body {
        let message = tokio::time::timeout(Duration::from_secs(10), self.rx.message())
            .await
            .expect("the router answers within 10 s")
            .expect("the stream is healthy")
            .expect("the stream is open");
        message.body.expect("a message with a body")
    }

    /// Reads messages until a resync request.
    pub async fn wait_resync(&mut self) -> kvroute_proto::ResyncRequest {
        loop {
            if let router_message::Body::Resync(r) = self.next().await {
                return r;
            }
        }
    }

    /// Answers a resync request as an engine does: every logged event of the
    /// rank from the id asked for, in one batch.
    pub async fn answer_resync(&self, request: &kvroute_proto::ResyncRequest) {
        let rank = request.dp_rank;
        let events = self
            .log
            .range((rank, request.from_event_id)..(rank + 1, 0))
            .map(|(&(_, event_id), kind)| KvEvent {
                tier: Default::default(),
                event_id,
                kind: Some(kind.clone()),
            })
            .collect();
        self.send(worker_message::Body::Events(kvroute_proto::EventBatch {
            dp_rank: rank,
            events,
        }))
        .await;
    }

    /// Answers resync requests until the router has acked each (dp rank, last id).
    pub async fn answer_resyncs_until_acked(&mut self, last: &[(u32, u64)]) {
        let mut acked: HashMap<u32, u64> = HashMap::new();
        while !last
            .iter()
            .all(|(rank, id)| acked.get(rank).is_some_and(|a| a >= id))
        {
            match self.next().await {
                router_message::Body::Resync(r) => self.answer_resync(&r).await,
                router_message::Body::Ack(ack) => {
                    acked.insert(ack.dp_rank, ack.last_event_id);
                }
                _ => {}
            }
        }
    }

    /// Reads messages until an ack of at least `event_id`.
    pub async fn wait_ack(&mut self, event_id: u64) {
        loop {
            if let router_message::Body::Ack(ack) = self.next().await
                && ack.last_event_id >= event_id
            {
                return;
            }
        }
    }
}

/// Per-worker counts of a batch of requests, by the `x-kvroute-worker` header.
pub fn count_by_worker(workers: &[u64]) -> HashMap<u64, usize> {
    let mut counts = HashMap::new();
    for w in workers {
        *counts.entry(*w).or_default() += 1;
    }
    counts
}

/// A test CA and the PEM files it signed, in a directory removed on drop.
pub struct Certs {
    dir: PathBuf,
    pub ca: PathBuf,
    /// For `localhost` and 127.0.0.1: the router's listeners and the engines' HTTPS.
    pub server_cert: PathBuf,
    pub server_key: PathBuf,
    /// A worker's client certificate.
    pub client_cert: PathBuf,
    pub client_key: PathBuf,
}

impl Certs {
    pub fn generate() -> Self {
        static NEXT: AtomicUsize = AtomicUsize::new(0);
        let dir = std::env::temp_dir().join(format!(
            "kvroute-tls-{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&dir).unwrap();
        let mut ca_params = CertificateParams::new(Vec::<String>::new()).unwrap();
        ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        ca_params
            .distinguished_name
            .push(DnType::CommonName, "kvroute test CA");
        ca_params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        let ca = CertifiedIssuer::self_signed(ca_params, KeyPair::generate().unwrap()).unwrap();
        let write = |name: &str, pem: String| {
            let path = dir.join(name);
            std::fs::write(&path, pem).unwrap();
            path
        };
        let leaf = |name: &str, sans: &[&str], usage: ExtendedKeyUsagePurpose| {
            let key = KeyPair::generate().unwrap();
            let sans: Vec<String> = sans.iter().map(|s| s.to_string()).collect();
            let mut params = CertificateParams::new(sans).unwrap();
            params.distinguished_name.push(DnType::CommonName, name);
            params.extended_key_usages = vec![usage];
            let cert = params.signed_by(&key, &ca).unwrap();
            (
                write(&format!("{name}.pem"), cert.pem()),
                write(&format!("{name}.key"), key.serialize_pem()),
            )
        };
        let (server_cert, server_key) = leaf(
            "server",
            &["localhost", "127.0.0.1"],
            ExtendedKeyUsagePurpose::ServerAuth,
        );
        let (client_cert, client_key) =
            leaf("worker", &["worker"], ExtendedKeyUsagePurpose::ClientAuth);
        let ca = write("ca.pem", ca.pem());
        Certs {
            dir,
            ca,
            server_cert,
            server_key,
            client_cert,
            client_key,
        }
    }

    /// The router's `[tls]` section; `mtls`: gRPC ingest requires client certificates.
    pub fn router_tls(&self, mtls: bool) -> String {
        let mut section = format!(
            "[tls]\ncert_file = {}\nkey_file = {}\n",
            toml_path(&self.server_cert),
            toml_path(&self.server_key)
        );
        if mtls {
            section += &format!("client_ca_file = {}\n", toml_path(&self.ca));
        }
        section
    }

    /// How a worker reaches the router: trusting the CA, with or without its certificate.
    pub fn worker_tls(&self, with_certificate: bool) -> kvroute_tls::GrpcClientTls {
        kvroute_tls::GrpcClientTls {
            ca_file: Some(self.ca.clone()),
            cert_file: with_certificate.then(|| self.client_cert.clone()),
            key_file: with_certificate.then(|| self.client_key.clone()),
        }
    }
}

impl Drop for Certs {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

pub fn toml_path(path: &Path) -> String {
    Value::String(path.display().to_string()).to_string()
}

pub fn https(url: &str) -> String {
    url.replacen("http://", "https://", 1)
}

/// An HTTPS client trusting the test CA (and only the roots the router trusts).
pub struct HttpsClient(Client<hyper_rustls::HttpsConnector<HttpConnector>, Full<Bytes>>);

impl HttpsClient {
    pub fn new(ca: &Path) -> Self {
        let tls = kvroute_tls::https_client_config(Some(ca)).unwrap();
        let connector = hyper_rustls::HttpsConnectorBuilder::new()
            .with_tls_config(tls)
            .https_only()
            .enable_http1()
            .build();
        HttpsClient(Client::builder(TokioExecutor::new()).build(connector))
    }

    pub async fn call(&self, method: &str, url: &str, body: String) -> (u16, Value) {
        let (status, body) = self
            .try_send(method, url, body)
            .await
            .expect("an HTTPS response");
        (status, serde_json::from_slice(&body).unwrap_or(Value::Null))
    }

    /// The status and body; a connection or handshake that fails is the error.
    pub async fn try_send(
        &self,
        method: &str,
        url: &str,
        body: String,
    ) -> Result<(u16, Bytes), String> {
        let request = http::Request::builder()
            .method(method)
            .uri(url)
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from(body)))
            .unwrap();
        let response = self
            .0
            .request(request)
            .await
            .map_err(|e| format!("{e:?}"))?;
        let status = response.status().as_u16();
        let body = response.into_body().collect().await.unwrap().to_bytes();
        Ok((status, body))
    }
}

/// A real `nats-server` with JetStream on a free loopback port and a temporary
/// store, stopped on drop. The binary is `KVROUTE_NATS_SERVER`, or else the one
/// `tests/nats/install.sh` installs (run here once per test process, so plain
/// `cargo test --workspace` needs no set-up step; it is quick once installed).
pub struct NatsServer {
    child: Child,
    binary: PathBuf,
    pub port: u16,
    pub url: String,
    /// Its config file and JetStream store.
    dir: PathBuf,
}

/// The nats-server binary, installing it on first use.
pub fn nats_server_binary() -> PathBuf {
    static BINARY: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    BINARY
        .get_or_init(|| {
            if let Some(binary) = std::env::var_os("KVROUTE_NATS_SERVER") {
                return PathBuf::from(binary);
            }
            let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/nats/install.sh");
            let out = Command::new("bash")
                .arg(&script)
                .stderr(Stdio::inherit())
                .output()
                .expect("bash runs tests/nats/install.sh");
            assert!(
                out.status.success(),
                "{} failed: nats-server could not be installed (or set KVROUTE_NATS_SERVER)",
                script.display()
            );
            PathBuf::from(String::from_utf8_lossy(&out.stdout).trim())
        })
        .clone()
}

impl NatsServer {
    pub fn start() -> Self {
        let binary = nats_server_binary();
        assert!(
            binary.exists(),
            "no nats-server at {}: run tests/nats/install.sh (or set KVROUTE_NATS_SERVER)",
            binary.display()
        );
        let port = free_ports(1);
        let dir = std::env::temp_dir().join(format!("kvroute-nats-{}-{port}", std::process::id()));
        let store = dir.join("store");
        std::fs::create_dir_all(&store).unwrap();
        std::fs::write(
            dir.join("nats.conf"),
            format!(
                "listen: \"127.0.0.1:{port}\"\njetstream {{\n  store_dir: {:?}\n}}\n",
                store.display().to_string()
            ),
        )
        .unwrap();
        let child = Self::spawn(&binary, &dir);
        let server = Self {
            child,
            binary,
            port,
            url: format!("nats://127.0.0.1:{port}"),
            dir,
        };
        server.wait_listening();
        server
    }

    fn spawn(binary: &Path, dir: &Path) -> Child {
        Command::new(binary)
            .arg("-c")
            .arg(dir.join("nats.conf"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("nats-server starts")
    }

    fn wait_listening(&self) {
        let start = Instant::now();
        while std::net::TcpStream::connect(("127.0.0.1", self.port)).is_err() {
            assert!(start.elapsed() < DEADLINE, "nats-server did not listen");
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Kills the server (SIGKILL); its store stays for [`Self::restart`].
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Starts the server again on the same port and store.
    pub fn restart(&mut self) {
        self.child = Self::spawn(&self.binary, &self.dir);
        self.wait_listening();
    }

    /// The `[cluster]` section of a replica named `replica_id` on this server.
    pub fn cluster_config(&self, replica_id: &str) -> String {
        format!(
            "[cluster]\nnats_url = \"{}\"\nreplica_id = \"{replica_id}\"\nregistration_ttl_ms = 2000\n",
            self.url
        )
    }
}

impl Drop for NatsServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
