//! Every Prometheus series the router exports, named in one place.
//!
//! Conventions: prefix `kvroute_`, base units (seconds, tokens, blocks), `_total`
//! for counters. The Grafana dashboard in `deploy/` is checked against [`FAMILIES`].
//! Histograms carry no worker label, to keep the series count flat in the fleet size.

use metrics_exporter_prometheus::{Matcher, PrometheusBuilder};
use metrics_util::MetricKindMask;

use crate::series::{Expiring, Renderer};

pub const EVENTS: &str = "kvroute_events_total";
pub const REJECTED_BLOCKS: &str = "kvroute_rejected_blocks_total";
pub const UNKNOWN_REMOVALS: &str = "kvroute_unknown_removals_total";
pub const EVENT_GAPS: &str = "kvroute_event_gaps_total";
pub const RESYNCS: &str = "kvroute_resyncs_total";
pub const DUMPS: &str = "kvroute_dumps_applied_total";
pub const DROPPED_BATCHES: &str = "kvroute_event_batches_dropped_total";
pub const WORKER_RESTARTS: &str = "kvroute_worker_restarts_total";
pub const RESYNCS_ABANDONED: &str = "kvroute_resyncs_abandoned_total";
pub const INDEXED_BLOCKS: &str = "kvroute_indexed_blocks";
pub const INDEX_MEMBERSHIPS: &str = "kvroute_index_memberships";
pub const PREDICTED_ENTRIES: &str = "kvroute_predicted_entries";
pub const WORKERS: &str = "kvroute_workers";
pub const OVERHEAD: &str = "kvroute_overhead_seconds";
pub const ROUTED: &str = "kvroute_routed_requests_total";
pub const PREDICTED_OVERLAP: &str = "kvroute_predicted_overlap_ratio";
pub const ROUTED_PROMPT_TOKENS: &str = "kvroute_routed_prompt_tokens_total";
pub const PREDICTED_CACHED_TOKENS: &str = "kvroute_predicted_cached_tokens_total";
pub const ACTUAL_CACHED_TOKENS: &str = "kvroute_actual_cached_tokens_total";
pub const CACHED_TOKENS_ERROR: &str = "kvroute_cached_tokens_error_tokens";
pub const CACHED_TOKENS_GAP: &str = "kvroute_cached_tokens_gap";
pub const CLAIMS_FAILED: &str = "kvroute_worker_claims_failed_total";
pub const DEMOTED: &str = "kvroute_worker_demoted";
pub const TTFT: &str = "kvroute_upstream_ttft_seconds";
pub const INTER_TOKEN: &str = "kvroute_upstream_inter_token_seconds";
pub const E2E: &str = "kvroute_upstream_e2e_seconds";
pub const WORKER_INFLIGHT: &str = "kvroute_worker_inflight_requests";
pub const WORKER_PREFILL: &str = "kvroute_worker_prefill_tokens";
pub const RETRIES: &str = "kvroute_retries_total";
pub const BREAKER_STATE: &str = "kvroute_breaker_state";
pub const HEALTH_CHECKS: &str = "kvroute_health_checks_total";
pub const HTTP_RESPONSES: &str = "kvroute_http_responses_total";
pub const QUEUED: &str = "kvroute_queued_requests";
pub const QUEUE_WAITS: &str = "kvroute_queue_waits_total";
pub const CANCELLED: &str = "kvroute_cancelled_requests_total";
pub const IDLE_TIMEOUTS: &str = "kvroute_upstream_idle_timeouts_total";
pub const UNTOKENIZED: &str = "kvroute_untokenized_requests_total";
pub const LIMIT_REFUSALS: &str = "kvroute_limit_refusals_total";
pub const INDEX_EVICTED: &str = "kvroute_index_evicted_blocks_total";
pub const INDEX_EVICTION_SCANS_CUT: &str = "kvroute_index_eviction_scans_cut_total";
pub const STALE_DUMPS: &str = "kvroute_stale_dumps_total";
pub const DUMP_ORPHANS: &str = "kvroute_dump_orphan_blocks_total";
pub const INDEX_DIGESTS: &str = "kvroute_index_digests_total";
pub const INDEX_DIVERGENCE: &str = "kvroute_index_divergence_total";
pub const ALIVE_TASKS: &str = "kvroute_runtime_alive_tasks";
pub const TLS_HANDSHAKE_FAILURES: &str = "kvroute_tls_handshake_failures_total";
pub const CLUSTER_CONNECTED: &str = "kvroute_cluster_connected";
pub const CLUSTER_CAUGHT_UP: &str = "kvroute_cluster_caught_up";
pub const CLUSTER_RECORDS: &str = "kvroute_cluster_records_applied_total";
pub const CLUSTER_SKIPPED: &str = "kvroute_cluster_records_skipped_total";
pub const CLUSTER_APPEND_FAILURES: &str = "kvroute_cluster_append_failures_total";
pub const CLUSTER_SNAPSHOT_AGE: &str = "kvroute_cluster_snapshot_age_seconds";
pub const CLUSTER_SNAPSHOTS: &str = "kvroute_cluster_snapshots_total";
pub const CLUSTER_PEER_DIGESTS: &str = "kvroute_cluster_peer_digests_total";
pub const CLUSTER_RECORDS_BEHIND: &str = "kvroute_cluster_records_behind";
pub const CLUSTER_APPLY_LAG: &str = "kvroute_cluster_apply_lag_seconds";
pub const TOKENIZER_CACHE_TOKENS: &str = "kvroute_tokenizer_cache_tokens";
pub const TOKENIZER_CACHE_HITS: &str = "kvroute_tokenizer_cache_hit_tokens_total";
pub const TOKENIZED_TOKENS: &str = "kvroute_tokenized_tokens_total";
pub const TOKENIZE_ABANDONED: &str = "kvroute_tokenize_abandoned_total";
pub const RESPONSE_OWNERS: &str = "kvroute_response_owners";
pub const RESPONSE_OWNER_LOOKUPS: &str = "kvroute_response_owner_lookups_total";
/// The `outcome`s of [`RESPONSE_OWNER_LOOKUPS`] (see `http::responses`).
pub const RESPONSE_OWNER_OUTCOMES: [&str; 3] = ["owner", "owner_gone", "unknown"];

/// (name, help) of every family.
pub const FAMILIES: &[(&str, &str)] = &[
    (
        UNTOKENIZED,
        "Text prompts routed on load alone because the router has no tokenizer",
    ),
    (
        EVENTS,
        "KV events offered to the index, by worker, type and status",
    ),
    (
        REJECTED_BLOCKS,
        "Stored blocks dropped because their parent was unknown",
    ),
    (
        UNKNOWN_REMOVALS,
        "Removed block hashes the worker did not hold",
    ),
    (EVENT_GAPS, "Event id gaps detected, by worker"),
    (RESYNCS, "Resync requests sent to workers"),
    (DUMPS, "Full dumps that replaced a worker's index state"),
    (
        DROPPED_BATCHES,
        "Event batches dropped on a full queue (the worker is resynced)",
    ),
    (
        WORKER_RESTARTS,
        "Registrations of a new worker instance, treated as Cleared for all its ranks",
    ),
    (
        RESYNCS_ABANDONED,
        "Resync requests never answered after every attempt: the rank was cleared",
    ),
    (
        INDEXED_BLOCKS,
        "Distinct blocks held by at least one worker",
    ),
    (INDEX_MEMBERSHIPS, "(worker, block) pairs in the index"),
    (PREDICTED_ENTRIES, "Predicted (worker, block) entries"),
    (WORKERS, "Registered workers (dp ranks) by state"),
    (
        OVERHEAD,
        "Router overhead per request, by phase (tokenize, hash, find_matches, schedule, total)",
    ),
    (ROUTED, "Requests routed, by worker and policy"),
    (
        PREDICTED_OVERLAP,
        "Share of a request's blocks the chosen worker was expected to hold",
    ),
    (ROUTED_PROMPT_TOKENS, "Prompt tokens of routed requests"),
    (
        PREDICTED_CACHED_TOKENS,
        "Prompt tokens the chosen worker was expected to hold in its prefix cache",
    ),
    (
        ACTUAL_CACHED_TOKENS,
        "Prompt tokens workers reported serving from their prefix cache (usage.prompt_tokens_details.cached_tokens)",
    ),
    (
        CACHED_TOKENS_ERROR,
        "Per request that reported it: predicted minus actual cached prompt tokens",
    ),
    (
        CACHED_TOKENS_GAP,
        "Rolling mean (about 100 requests) of |predicted - actual| cached tokens over prompt tokens: 0 exact, 1 always wrong",
    ),
    (
        CLAIMS_FAILED,
        "Responses that reported far fewer cached tokens than the worker's KV events claimed, by worker (rank)",
    ),
    (
        DEMOTED,
        "1 while a worker rank's claims kept failing and its overlaps do not count in routing (until it sends a full dump), else 0",
    ),
    (
        TTFT,
        "Time from sending upstream to the first response byte",
    ),
    (INTER_TOKEN, "Time between response chunks of a stream"),
    (E2E, "Time from sending upstream to the end of the response"),
    (WORKER_INFLIGHT, "Requests in flight per worker"),
    (WORKER_PREFILL, "Prefill tokens in flight per worker"),
    (
        RETRIES,
        "Upstream attempts retried on another worker, by reason",
    ),
    (
        BREAKER_STATE,
        "Circuit breaker per worker: 0 closed, 1 half-open, 2 open",
    ),
    (HEALTH_CHECKS, "Health checks of quiet workers, by result"),
    (HTTP_RESPONSES, "HTTP responses, by status code"),
    (QUEUED, "Requests waiting for a non-busy worker"),
    (
        QUEUE_WAITS,
        "Requests that found every worker busy and joined the queue",
    ),
    (
        CANCELLED,
        "Proxied responses the client abandoned before the end",
    ),
    (
        IDLE_TIMEOUTS,
        "Proxied responses cut off because the worker went silent past the idle timeout",
    ),
    (
        LIMIT_REFUSALS,
        "Inputs refused (or, for predicted_blocks, cut) at a configured limit, by limit",
    ),
    (
        INDEX_EVICTED,
        "Blocks evicted from the index by its index.max_blocks bound",
    ),
    (
        INDEX_EVICTION_SCANS_CUT,
        "Evictions that stopped over index.max_blocks at their bound of blocks met and not taken",
    ),
    (
        STALE_DUMPS,
        "Dumps refused because they were older than the state already applied",
    ),
    (
        DUMP_ORPHANS,
        "Dump blocks whose parent the dump did not hold, not indexed",
    ),
    (
        INDEX_DIGESTS,
        "Workers' digests of their cache checked against the index, by outcome (matched, diverged; not_current or trimmed: skipped)",
    ),
    (
        INDEX_DIVERGENCE,
        "Workers' digests that differed from the index at the same event id: the rank was asked for a full dump",
    ),
    (
        ALIVE_TASKS,
        "Tokio tasks alive in the router's runtime (a leak shows as growth under steady load)",
    ),
    (
        TLS_HANDSHAKE_FAILURES,
        "TLS handshakes that failed, by listener (http, grpc): plain-text clients, missing or untrusted certificates, timeouts",
    ),
    (
        CLUSTER_CONNECTED,
        "Replicas ([cluster]): 1 while the NATS event log answers, 0 while it does not (and without [cluster])",
    ),
    (
        CLUSTER_CAUGHT_UP,
        "Replicas: 1 once this replica has applied the event log as far as it stood at start (0 without [cluster])",
    ),
    (
        CLUSTER_RECORDS,
        "Replicas: records of the event log applied here, by kind",
    ),
    (
        CLUSTER_SKIPPED,
        "Replicas: records skipped because a later claim of their worker superseded their stream",
    ),
    (
        CLUSTER_APPEND_FAILURES,
        "Replicas: records the event log did not take (batches, dumps and digests: applied or checked here only; requests for a dump)",
    ),
    (
        CLUSTER_PEER_DIGESTS,
        "Replicas: this replica's digest of a worker rank compared with another replica's at the same point of the event log, by outcome (matched, differed: a full dump was asked for)",
    ),
    (
        CLUSTER_RECORDS_BEHIND,
        "Replicas: records of the event log not yet applied here (replication lag, in records)",
    ),
    (
        CLUSTER_SNAPSHOT_AGE,
        "Replicas: age of the newest index snapshot in the object store that this replica knows of or wrote",
    ),
    (
        CLUSTER_SNAPSHOTS,
        "Replicas: index snapshots by outcome (written, loaded at start, failed to write or load)",
    ),
    (
        CLUSTER_APPLY_LAG,
        "Replicas: from the holder taking a worker's batch to this replica applying it from the log",
    ),
    (
        TOKENIZER_CACHE_TOKENS,
        "Token ids of recent prompt text the tokenizer's cache holds (bounded by tokenizer_cache_tokens)",
    ),
    (
        TOKENIZER_CACHE_HITS,
        "Prompt tokens taken from the tokenizer's cache instead of tokenized",
    ),
    (TOKENIZED_TOKENS, "Prompt tokens tokenized (cache misses)"),
    (
        TOKENIZE_ABANDONED,
        "Requests not tokenized because their client went away while they waited for a tokenizing thread",
    ),
    (
        RESPONSE_OWNERS,
        "Response ids whose creating worker the router remembers",
    ),
    (
        RESPONSE_OWNER_LOOKUPS,
        "Requests naming a response id (previous_response_id, or the id in the path), by outcome: owner, owner_gone, unknown",
    ),
];

const SECONDS_BUCKETS: &[f64] = &[
    0.000_01, 0.000_025, 0.000_05, 0.000_1, 0.000_25, 0.000_5, 0.001, 0.002_5, 0.005, 0.01, 0.025,
    0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
];
/// Finer below 10 ms: the apply lag's goal is a p99 of 5 ms on loopback.
const APPLY_LAG_BUCKETS: &[f64] = &[
    0.000_1, 0.000_25, 0.000_5, 0.000_75, 0.001, 0.001_5, 0.002, 0.003, 0.004, 0.005, 0.007_5,
    0.01, 0.025, 0.05, 0.1, 0.25, 1.0, 5.0,
];
const RATIO_BUCKETS: &[f64] = &[0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0];
/// Signed token differences: 0 is exact, a block or two either way is rounding.
const TOKEN_ERROR_BUCKETS: &[f64] = &[
    -16384.0, -4096.0, -1024.0, -256.0, -64.0, -16.0, 0.0, 16.0, 64.0, 256.0, 1024.0, 4096.0,
    16384.0,
];

/// Which histogram families have which bucket bounds. A full name wins over
/// a suffix, as it does in the exporter, which is given this table.
enum Families {
    Named(&'static str),
    EndingIn(&'static str),
}

const BUCKETS: [(Families, &[f64]); 4] = [
    (Families::Named(CLUSTER_APPLY_LAG), APPLY_LAG_BUCKETS),
    (Families::Named(CACHED_TOKENS_ERROR), TOKEN_ERROR_BUCKETS),
    (Families::EndingIn("_seconds"), SECONDS_BUCKETS),
    (Families::EndingIn("_ratio"), RATIO_BUCKETS),
];

impl Families {
    fn matcher(&self) -> Matcher {
        match *self {
            Families::Named(name) => Matcher::Full(name.into()),
            Families::EndingIn(suffix) => Matcher::Suffix(suffix.into()),
        }
    }
}

/// Whether the family `name` is a histogram (exported as `_bucket`, `_sum` and `_count`).
pub fn is_histogram(name: &str) -> bool {
    BUCKETS.iter().any(|(families, _)| match *families {
        Families::Named(full) => name == full,
        Families::EndingIn(suffix) => name.ends_with(suffix),
    })
}

static HANDLE: std::sync::OnceLock<Renderer> = std::sync::OnceLock::new();

/// The process's recorder, installed (and every family described) on first use.
pub fn handle() -> Renderer {
    HANDLE.get_or_init(install).clone()
}

/// The worker is gone: its series leave `/metrics` (see [`crate::series`]).
pub fn forget_worker(worker_id: u64) {
    if let Some(handle) = HANDLE.get() {
        handle.forget_worker(worker_id);
    }
}

/// How often histogram samples are folded into their buckets.
const UPKEEP_INTERVAL: std::time::Duration = std::time::Duration::from_secs(5);

/// The exporter queues every histogram sample until something drains the
/// queue into the buckets; a render does, but a router nobody scrapes would
/// hold every sample it ever recorded. A thread of its own drains them, as
/// the exporter's own `install` would (that one also opens a listener, which
/// `/metrics` already is).
fn drain_histograms_periodically(handle: metrics_exporter_prometheus::PrometheusHandle) {
    let started = std::thread::Builder::new()
        .name("kvroute-metrics-upkeep".into())
        .spawn(move || {
            loop {
                std::thread::sleep(UPKEEP_INTERVAL);
                handle.run_upkeep();
            }
        });
    if let Err(error) = started {
        tracing::warn!(%error, "cannot start the metrics upkeep thread: histogram samples are drained only by scrapes");
    }
}

fn install() -> Renderer {
    let builder = BUCKETS
        .iter()
        .fold(PrometheusBuilder::new(), |builder, (families, bounds)| {
            builder
                .set_buckets_for_metric(families.matcher(), bounds)
                .expect("every family's bucket bounds are given")
        });
    let recorder = builder
        // Counters and gauges not touched before a render go: series::Expiring
        // touches all but those of forgotten workers.
        .idle_timeout(
            MetricKindMask::COUNTER | MetricKindMask::GAUGE,
            Some(std::time::Duration::ZERO),
        )
        .build_recorder();
    drain_histograms_periodically(recorder.handle());
    let (recorder, handle) = Expiring::new(recorder);
    metrics::set_global_recorder(recorder)
        .expect("the metrics recorder is installed once per process");
    for &(name, help) in FAMILIES {
        if name.ends_with("_total") {
            metrics::describe_counter!(name, help);
        } else if is_histogram(name) {
            metrics::describe_histogram!(name, help);
        } else {
            metrics::describe_gauge!(name, help);
        }
    }
    // Families without worker labels exist from the start, so dashboards and
    // alerts see zeros instead of "no data".
    for &(name, _) in FAMILIES {
        if name.ends_with("_total") {
            let _ = metrics::counter!(name);
        }
    }
    for phase in PHASES {
        let _ = metrics::histogram!(OVERHEAD, "phase" => phase);
    }
    for listener in ["http", "grpc"] {
        let _ = metrics::counter!(TLS_HANDSHAKE_FAILURES, "listener" => listener);
    }
    for reason in ["connect", "status", "left"] {
        let _ = metrics::counter!(RETRIES, "reason" => reason);
    }
    for outcome in RESPONSE_OWNER_OUTCOMES {
        let _ = metrics::counter!(RESPONSE_OWNER_LOOKUPS, "outcome" => outcome);
    }
    for name in [
        PREDICTED_OVERLAP,
        TTFT,
        INTER_TOKEN,
        E2E,
        CACHED_TOKENS_ERROR,
        CACHED_TOKENS_GAP,
        INDEXED_BLOCKS,
        INDEX_MEMBERSHIPS,
        PREDICTED_ENTRIES,
        QUEUED,
        CLUSTER_CONNECTED,
        CLUSTER_CAUGHT_UP,
        CLUSTER_RECORDS_BEHIND,
        CLUSTER_APPLY_LAG,
        CLUSTER_SNAPSHOT_AGE,
    ] {
        if is_histogram(name) {
            let _ = metrics::histogram!(name);
        } else {
            let _ = metrics::gauge!(name);
        }
    }
    handle
}

/// The histograms every request (or every streamed chunk) records into,
/// resolved once: looking a series up by name and labels hashes the key and
/// takes the registry's lock each time.
pub struct Hot {
    pub ttft: metrics::Histogram,
    pub inter_token: metrics::Histogram,
    pub e2e: metrics::Histogram,
    pub predicted_overlap: metrics::Histogram,
    phases: [metrics::Histogram; PHASES.len()],
    pub routed_prompt_tokens: metrics::Counter,
    pub predicted_cached_tokens: metrics::Counter,
    responses: [metrics::Counter; STATUSES.len()],
}

/// The common statuses of [`HTTP_RESPONSES`], counted through handles.
const STATUSES: [(u16, &str); 6] = [
    (200, "200"),
    (400, "400"),
    (404, "404"),
    (429, "429"),
    (502, "502"),
    (503, "503"),
];

/// The phases of [`OVERHEAD`], labelled by [`PHASES`].
#[derive(Clone, Copy)]
pub enum Phase {
    Tokenize,
    Hash,
    FindMatches,
    Schedule,
    Total,
}

/// Each [`Phase`]'s label, in its order.
const PHASES: [&str; 5] = ["tokenize", "hash", "find_matches", "schedule", "total"];

static HOT: std::sync::LazyLock<Hot> = std::sync::LazyLock::new(|| {
    // The recorder first, or the handles would be bound to none for good.
    handle();
    Hot {
        ttft: metrics::histogram!(TTFT),
        inter_token: metrics::histogram!(INTER_TOKEN),
        e2e: metrics::histogram!(E2E),
        predicted_overlap: metrics::histogram!(PREDICTED_OVERLAP),
        phases: PHASES.map(|phase| metrics::histogram!(OVERHEAD, "phase" => phase)),
        routed_prompt_tokens: metrics::counter!(ROUTED_PROMPT_TOKENS),
        predicted_cached_tokens: metrics::counter!(PREDICTED_CACHED_TOKENS),
        responses: STATUSES.map(|(_, label)| metrics::counter!(HTTP_RESPONSES, "status" => label)),
    }
});

/// Counts a response of the router's HTTP API by status.
pub fn count_response(status: u16) {
    match STATUSES.iter().position(|&(s, _)| s == status) {
        Some(i) => hot().responses[i].increment(1),
        None => metrics::counter!(HTTP_RESPONSES, "status" => status.to_string()).increment(1),
    }
}

/// The request path's histograms (installing the recorder on first use).
pub fn hot() -> &'static Hot {
    &HOT
}

/// Records the time since `started` as one phase of the routing overhead.
pub fn observe_phase(phase: Phase, started: std::time::Instant) {
    record_phase(phase, started.elapsed());
}

/// Records `took` as one phase of the routing overhead (for a caller that
/// has read the clock already). A phase is its histogram's index, not a
/// label looked for among the five at each of a request's five records.
pub fn record_phase(phase: Phase, took: std::time::Duration) {
    hot().phases[phase as usize].record(took.as_secs_f64());
}
