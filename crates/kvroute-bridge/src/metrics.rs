//! The bridge's own Prometheus metrics, served at `/metrics`.
//!
//! Operators need to see a bridge that quietly drops everything (the failure peers
//! hit after each engine format change), so every way an engine message can fail
//! to become a router event has a counter with a reason.

use std::net::SocketAddr;

use axum::{Router, routing::get};
use metrics::{describe_counter, describe_gauge};
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};
use tokio::net::TcpListener;

use crate::BridgeError;

/// Engine batches received, live or replayed.
pub const BATCHES_RECEIVED: &str = "kvroute_bridge_batches_received_total";
/// Engine events decoded, by type.
pub const EVENTS_RECEIVED: &str = "kvroute_bridge_events_received_total";
/// kvroute events given an id and queued for the router, by type.
pub const EVENTS_SENT: &str = "kvroute_bridge_events_sent_total";
/// Engine events left out, by reason (medium, group, block_size, unnamed_lora, token_count, unknown_type).
pub const EVENTS_SKIPPED: &str = "kvroute_bridge_events_skipped_total";
/// Extra keys of stored blocks of no known kind (neither LoRA name, multimodal
/// object nor cache salt); their blocks can never match a router request.
pub const EXTRA_KEYS_UNDECODED: &str = "kvroute_bridge_extra_keys_undecoded_total";
/// Engine messages that could not be decoded, by reason; they are skipped.
pub const DECODE_FAILURES: &str = "kvroute_bridge_decode_failures_total";
/// Missing engine sequence numbers detected.
pub const GAPS: &str = "kvroute_bridge_gaps_total";
/// Engine restarts detected (the sequence went backwards).
pub const RESTARTS: &str = "kvroute_bridge_restarts_total";
/// Replay requests to the engine, by outcome (complete, incomplete, failed).
pub const REPLAYS: &str = "kvroute_bridge_replays_total";
/// Mirror resets that told the router to clear the rank (lost events, no full replay).
pub const RESETS: &str = "kvroute_bridge_mirror_resets_total";
/// Router connection attempts, by outcome.
pub const ROUTER_CONNECTS: &str = "kvroute_bridge_router_connects_total";
/// Full dumps sent to the router (after a resync request or a reconnect).
pub const DUMPS_SENT: &str = "kvroute_bridge_dumps_sent_total";
/// Event batches dropped because the router link was backed up; a resync repairs them.
pub const BATCHES_DROPPED: &str = "kvroute_bridge_batches_dropped_total";
/// Scrapes of the engine's metrics, by outcome.
pub const LOAD_SCRAPES: &str = "kvroute_bridge_load_scrapes_total";
/// Blocks in each rank's mirror.
pub const MIRROR_BLOCKS: &str = "kvroute_bridge_mirror_blocks";

/// Installs the process-wide recorder. Call once, from the binary.
pub fn install() -> Result<PrometheusHandle, BridgeError> {
    let handle = PrometheusBuilder::new()
        .install_recorder()
        .map_err(|e| BridgeError::Metrics(e.to_string()))?;
    for (name, help) in [
        (
            BATCHES_RECEIVED,
            "Engine event batches received, live or replayed",
        ),
        (EVENTS_RECEIVED, "Engine events decoded, by type"),
        (EVENTS_SENT, "kvroute events queued for the router, by type"),
        (EVENTS_SKIPPED, "Engine events left out, by reason"),
        (
            DECODE_FAILURES,
            "Engine messages that could not be decoded, by reason",
        ),
        (GAPS, "Gaps in the engine's sequence numbers"),
        (RESTARTS, "Engine restarts detected"),
        (REPLAYS, "Replay requests to the engine, by outcome"),
        (RESETS, "Mirror resets sent to the router as Cleared"),
        (ROUTER_CONNECTS, "Router connection attempts, by outcome"),
        (DUMPS_SENT, "Full dumps sent to the router"),
        (
            BATCHES_DROPPED,
            "Event batches dropped while the router link was backed up",
        ),
        (LOAD_SCRAPES, "Scrapes of the engine's metrics, by outcome"),
        (
            EXTRA_KEYS_UNDECODED,
            "Block extra keys of no known kind (their blocks never match a request)",
        ),
    ] {
        describe_counter!(name, help);
    }
    describe_gauge!(MIRROR_BLOCKS, "Blocks in each rank's mirror");
    Ok(handle)
}

/// Serves `/metrics` on `listener` until the process ends.
pub async fn serve(listener: TcpListener, handle: PrometheusHandle) -> Result<(), BridgeError> {
    let app = Router::new().route("/metrics", get(move || async move { handle.render() }));
    axum::serve(listener, app)
        .await
        .map_err(|e| BridgeError::Io("serving /metrics".into(), e))
}

/// Binds the metrics listener, so that a taken port fails at start.
pub async fn bind(addr: SocketAddr) -> Result<TcpListener, BridgeError> {
    TcpListener::bind(addr)
        .await
        .map_err(|e| BridgeError::Io(format!("binding the metrics address {addr}"), e))
}
