//! Prefill/decode disaggregation, in vLLM's and SGLang's conventions.
//!
//! A prefill engine (`--role prefill`) runs a handoff request to its first
//! token and then keeps the request's blocks under a lease, until a decode
//! engine takes them or `--kv-lease-timeout-secs` passes (those blocks are
//! counted: a router that strands KV shows up there). It serves a side channel
//! on its bootstrap port (`--bootstrap-port`) where decode engines take leases:
//!
//! - `POST /kv/pull` `{"remote_request_id", "remote_block_ids"}` (vLLM: the
//!   decode pulls what the prefill response's `kv_transfer_params` named);
//! - `POST /kv/rendezvous` `{"room", "wait_ms"}` (SGLang: both legs arrive at
//!   once and meet here, keyed by `bootstrap_room`; the decode waits for a
//!   prefill not yet finished).
//!
//! Both answer `{"block_hashes": [...], "prompt_tokens": N}` (the full
//! blocks' hashes; the partial last block comes with them), or 404 when there
//! is no such lease.
//! The lease is released as it is taken, so a decode that goes away during
//! the transfer strands nothing; the decode then waits the transfer time
//! ([`crate::CostModel::transfer_time`]) and queues the request with the
//! received blocks counted as cached, less the prompt's last token.
//!
//! A vLLM decode leg whose parameters are missing, unknown or expired is
//! recomputed in full, as vLLM does; an SGLang decode whose prefill never comes
//! fails after `--bootstrap-timeout-secs`.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use axum::Json;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use serde_json::{Value, json};
use tokio::net::TcpListener;

use crate::engine::{Handoff, SeqId};
use crate::worker::{Core, Shared};

/// A worker's part in a disaggregated fleet (`Register.role`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum Role {
    /// Serves whole requests.
    #[default]
    Aggregated,
    /// Computes prompts' KV and hands it to decode engines.
    Prefill,
    /// Receives prompts' KV from prefill engines and generates.
    Decode,
}

impl Role {
    pub fn name(self) -> &'static str {
        match self {
            Role::Aggregated => "aggregated",
            Role::Prefill => "prefill",
            Role::Decode => "decode",
        }
    }
}

impl From<Role> for kvroute_proto::WorkerRole {
    fn from(role: Role) -> Self {
        match role {
            Role::Aggregated => kvroute_proto::WorkerRole::Aggregated,
            Role::Prefill => kvroute_proto::WorkerRole::Prefill,
            Role::Decode => kvroute_proto::WorkerRole::Decode,
        }
    }
}

/// How a prefill engine hands its KV to a decode engine (`Register.pd_convention`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum PdConvention {
    /// `bootstrap_host`, `bootstrap_port` and `bootstrap_room` in both legs' bodies.
    Sglang,
    /// `kv_transfer_params` returned by the prefill leg, carried by the decode leg.
    Vllm,
}

impl From<PdConvention> for kvroute_proto::PdConvention {
    fn from(convention: PdConvention) -> Self {
        match convention {
            PdConvention::Sglang => kvroute_proto::PdConvention::Sglang,
            PdConvention::Vllm => kvroute_proto::PdConvention::Vllm,
        }
    }
}

/// How one engine takes part in disaggregation.
#[derive(Clone, Debug)]
pub struct PdConfig {
    pub role: Role,
    pub convention: PdConvention,
    /// The side channel's port on a prefill engine (0: any free port).
    pub bootstrap_port: u16,
    /// Bandwidth between engines, in gigabits per second.
    pub kv_transfer_gbps: f64,
    /// How long a finished prefill keeps its blocks for a decode that has not come.
    pub lease_timeout: Duration,
    /// How long an SGLang decode waits for its prefill.
    pub bootstrap_timeout: Duration,
}

impl Default for PdConfig {
    fn default() -> Self {
        PdConfig {
            role: Role::Aggregated,
            convention: PdConvention::Vllm,
            bootstrap_port: 0,
            kv_transfer_gbps: 100.0,
            // vLLM's VLLM_NIXL_ABORT_REQUEST_TIMEOUT default.
            lease_timeout: Duration::from_secs(480),
            // SGLang's SGLANG_DISAGGREGATION_WAITING_TIMEOUT default.
            bootstrap_timeout: Duration::from_secs(300),
        }
    }
}

/// What identifies a lease: vLLM's request id, or SGLang's bootstrap room.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub(crate) enum LeaseKey {
    Vllm(String),
    Sglang(u64),
}

/// A finished prefill's blocks, held for a decode engine.
struct Lease {
    seq: SeqId,
    /// The ids named in `kv_transfer_params.remote_block_ids`.
    block_ids: Vec<u64>,
    hashes: Vec<u64>,
    prompt_tokens: usize,
}

/// Handoff counters of one engine.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PdStats {
    /// Prefill: leases a decode engine took. Decode: prefills received.
    pub handoffs: u64,
    /// Prefill: blocks given back because no decode took them in time.
    pub lease_expired_blocks: u64,
    /// Decode: handoff legs computed in full (unknown, expired or missing KV).
    pub recomputes: u64,
}

/// A prefill engine's leases, in the worker's core.
#[derive(Default)]
pub(crate) struct Leases {
    /// Prefill legs still running: their key once they finish.
    running: HashMap<SeqId, LeaseKey>,
    held: HashMap<LeaseKey, Lease>,
    next_block_id: u64,
    pub stats: PdStats,
}

impl Leases {
    pub fn start(&mut self, seq: SeqId, key: LeaseKey) {
        self.running.insert(seq, key);
    }

    /// A prefill leg ended before finishing (aborted, dropped).
    pub fn forget(&mut self, seq: SeqId) {
        self.running.remove(&seq);
    }

    /// The engine restarted: every held block is gone with it.
    pub fn clear(&mut self) {
        self.running.clear();
        self.held.clear();
    }

    /// The block ids of a held lease, for the prefill response.
    pub fn block_ids(&self, key: &LeaseKey) -> Option<Vec<u64>> {
        self.held.get(key).map(|lease| lease.block_ids.clone())
    }
}

/// A request finished in the engine: if it was a prefill leg, its blocks are
/// now held; lease them and start the lease's clock.
pub(crate) fn finished(shared: &Arc<Shared>, core: &mut Core, seq: SeqId) {
    let Some(key) = core.pd.running.remove(&seq) else {
        return;
    };
    let (hashes, prompt_tokens) = core.engine.held_prompt(seq).unwrap_or_default();
    let first = core.pd.next_block_id;
    core.pd.next_block_id += hashes.len() as u64;
    let lease = Lease {
        seq,
        block_ids: (first..core.pd.next_block_id).collect(),
        hashes,
        prompt_tokens,
    };
    if let Some(old) = core.pd.held.insert(key.clone(), lease) {
        // A client reused a room or request id: the older lease is dropped.
        core.engine.release_held(old.seq);
    }
    shared.lease_added.notify_waiters();
    let shared = Arc::clone(shared);
    tokio::spawn(async move {
        let mut stopped = shared.stop.subscribe();
        tokio::select! {
            _ = tokio::time::sleep(shared.config.pd.lease_timeout) => expire(&shared, &key, seq),
            _ = crate::worker::until_stopped(&mut stopped) => {}
        }
    });
}

fn expire(shared: &Shared, key: &LeaseKey, seq: SeqId) {
    let mut core = shared.core();
    if core.pd.held.get(key).is_none_or(|lease| lease.seq != seq) {
        return;
    }
    core.pd.held.remove(key);
    let blocks = core.engine.release_held(seq);
    core.pd.stats.lease_expired_blocks += blocks as u64;
    tracing::warn!(
        worker = shared.config.worker_id,
        ?key,
        blocks,
        "no decode engine took a prefill's KV in time: its blocks are freed"
    );
}

/// Takes a lease: its blocks go back to the cache; returns what the decode receives.
fn take(shared: &Shared, key: &LeaseKey, block_ids: Option<&[u64]>) -> Option<Lease> {
    let mut core = shared.core();
    let lease = core.pd.held.get(key)?;
    if block_ids.is_some_and(|ids| ids != lease.block_ids) {
        return None;
    }
    let lease = core.pd.held.remove(key)?;
    core.engine.release_held(lease.seq);
    core.pd.stats.handoffs += 1;
    Some(lease)
}

/// Serves a prefill engine's side channel until the worker stops.
pub(crate) async fn serve_side_channel(shared: Arc<Shared>, listener: TcpListener) {
    let app = axum::Router::new()
        .route("/kv/pull", post(pull))
        .route("/kv/rendezvous", post(rendezvous))
        .with_state(Arc::clone(&shared));
    let mut stopped = shared.stop.subscribe();
    tokio::select! {
        result = axum::serve(listener, app) => {
            if let Err(e) = result {
                tracing::error!("side channel failed: {e}");
            }
        }
        _ = crate::worker::until_stopped(&mut stopped) => {}
    }
}

fn no_lease(what: String) -> Response {
    (StatusCode::NOT_FOUND, Json(json!({"error": what}))).into_response()
}

fn lease_response(lease: Lease) -> Response {
    Json(json!({"block_hashes": lease.hashes, "prompt_tokens": lease.prompt_tokens}))
        .into_response()
}

async fn pull(State(shared): State<Arc<Shared>>, body: Bytes) -> Response {
    let json: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
    let Some(id) = json.get("remote_request_id").and_then(Value::as_str) else {
        return no_lease("missing `remote_request_id`".into());
    };
    let ids: Option<Vec<u64>> = json
        .get("remote_block_ids")
        .and_then(Value::as_array)
        .map(|ids| ids.iter().filter_map(Value::as_u64).collect());
    match take(&shared, &LeaseKey::Vllm(id.to_string()), ids.as_deref()) {
        Some(lease) => lease_response(lease),
        None => no_lease(format!("no KV held for request `{id}` with these blocks")),
    }
}

async fn rendezvous(State(shared): State<Arc<Shared>>, body: Bytes) -> Response {
    let json: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
    let Some(room) = json.get("room").and_then(Value::as_u64) else {
        return no_lease("missing `room`".into());
    };
    // Never longer than the prefill keeps a lease for a decode.
    let wait = json
        .get("wait_ms")
        .and_then(Value::as_u64)
        .map_or(Duration::ZERO, Duration::from_millis)
        .min(shared.config.pd.lease_timeout);
    let key = LeaseKey::Sglang(room);
    let deadline = tokio::time::Instant::now() + wait;
    loop {
        // Registered before looking, so a lease added in between wakes it.
        let added = shared.lease_added.notified();
        tokio::pin!(added);
        added.as_mut().enable();
        if let Some(lease) = take(&shared, &key, None) {
            return lease_response(lease);
        }
        if tokio::time::timeout_at(deadline, added).await.is_err() {
            return no_lease(format!("no prefill for bootstrap room {room}"));
        }
    }
}

/// What a request body asks of this engine's role and convention.
pub(crate) enum Leg {
    /// An ordinary request.
    Whole,
    /// A prefill leg: hold its blocks under this key once it finishes.
    Prefill(LeaseKey),
    /// A decode leg: take the KV from `url` (a side channel endpoint) first.
    Decode { url: String, request: Value },
}

/// Reads the handoff fields of a body for an engine of `config`'s role and
/// convention; fields another role or convention would use are ignored, as
/// the engines ignore them. `request_id` names a vLLM prefill's lease.
pub(crate) fn leg(config: &PdConfig, body: &Value, request_id: &str) -> Leg {
    match (config.role, config.convention) {
        (Role::Aggregated, _) => Leg::Whole,
        (role, PdConvention::Vllm) => {
            let Some(params) = body.get("kv_transfer_params") else {
                return Leg::Whole;
            };
            let flag = |name: &str| params.get(name).and_then(Value::as_bool) == Some(true);
            match role {
                Role::Prefill if flag("do_remote_decode") => {
                    Leg::Prefill(LeaseKey::Vllm(request_id.to_string()))
                }
                Role::Decode if flag("do_remote_prefill") => {
                    let host = params.get("remote_host").and_then(Value::as_str);
                    let port = params.get("remote_port").and_then(Value::as_u64);
                    match (host, port) {
                        (Some(host), Some(port)) => Leg::Decode {
                            url: format!("http://{}/kv/pull", host_port(host, port)),
                            request: json!({
                                "remote_request_id": params.get("remote_request_id"),
                                "remote_block_ids": params.get("remote_block_ids"),
                            }),
                        },
                        // Nowhere to pull from: recomputed (see `receive`).
                        _ => Leg::Decode {
                            url: String::new(),
                            request: Value::Null,
                        },
                    }
                }
                _ => Leg::Whole,
            }
        }
        (role, PdConvention::Sglang) => {
            let Some(room) = body.get("bootstrap_room").and_then(Value::as_u64) else {
                return Leg::Whole;
            };
            match role {
                Role::Prefill => Leg::Prefill(LeaseKey::Sglang(room)),
                _ => {
                    let host = body.get("bootstrap_host").and_then(Value::as_str);
                    let port = body.get("bootstrap_port").and_then(Value::as_u64);
                    Leg::Decode {
                        url: match (host, port) {
                            (Some(host), Some(port)) => {
                                format!("http://{}/kv/rendezvous", host_port(host, port))
                            }
                            _ => String::new(),
                        },
                        request: json!({
                            "room": room,
                            "wait_ms": config.bootstrap_timeout.as_millis() as u64,
                        }),
                    }
                }
            }
        }
    }
}

fn host_port(host: &str, port: u64) -> String {
    if host.contains(':') && !host.starts_with('[') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    }
}

pub(crate) type HttpClient = Client<HttpConnector, Full<Bytes>>;

pub(crate) fn http_client() -> HttpClient {
    Client::builder(TokioExecutor::new()).build_http()
}

/// Takes a decode leg's KV from its prefill engine and waits the transfer
/// time. Returns the handoff to queue the request with, or why the KV could
/// not be had: a vLLM decode then recomputes (the caller counts it), an
/// SGLang one fails.
pub(crate) async fn receive(
    shared: &Shared,
    url: &str,
    request: &Value,
) -> Result<Handoff, String> {
    if url.is_empty() {
        return Err("the request names no prefill engine".into());
    }
    // The rendezvous waits for its prefill; a pull answers at once.
    let wait = shared.config.pd.bootstrap_timeout + Duration::from_secs(5);
    let (hashes, tokens) = match post_json(&shared.client, url, request, wait).await? {
        (StatusCode::OK, json) => (
            json.get("block_hashes")
                .and_then(Value::as_array)
                .map(|hashes| hashes.iter().filter_map(Value::as_u64).collect::<Vec<_>>())
                .ok_or_else(|| format!("{url} answered without block_hashes"))?,
            json.get("prompt_tokens")
                .and_then(Value::as_u64)
                .unwrap_or_default() as usize,
        ),
        (status, json) => return Err(format!("{url} answered {status}: {json}")),
    };
    let config = &shared.config;
    let bs = config.engine.block_size;
    let pause = config.engine.cost.transfer_time(
        tokens.div_ceil(bs).max(hashes.len()),
        bs,
        config.pd.kv_transfer_gbps,
    );
    tokio::time::sleep(pause).await;
    shared.core().pd.stats.handoffs += 1;
    Ok(Handoff {
        hold: false,
        transferred: hashes,
        transferred_tokens: tokens,
    })
}

async fn post_json(
    client: &HttpClient,
    url: &str,
    body: &Value,
    timeout: Duration,
) -> Result<(StatusCode, Value), String> {
    let request = hyper::Request::post(url)
        .header(hyper::header::CONTENT_TYPE, "application/json")
        .body(Full::new(Bytes::from(body.to_string())))
        .map_err(|e| format!("bad side channel URL {url}: {e}"))?;
    let exchange = async {
        let response = client
            .request(request)
            .await
            .map_err(|e| format!("{url}: {e}"))?;
        let status = response.status();
        let bytes = response
            .into_body()
            .collect()
            .await
            .map_err(|e| format!("{url}: {e}"))?
            .to_bytes();
        Ok((
            status,
            serde_json::from_slice(&bytes).unwrap_or(Value::Null),
        ))
    };
    tokio::time::timeout(timeout, exchange)
        .await
        .map_err(|_| format!("{url} did not answer within {timeout:?}"))?
}
