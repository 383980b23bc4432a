//! Hard limits on what a worker or client can make the router hold or do.
//!
//! Everything a peer controls has a cap from `[limits]` (or `[ingest]`,
//! `[index]`), checked before any work that grows with it — a registration's
//! sizes before the registry lock is taken — and every refusal is counted in
//! one metric family, `kvroute_limit_refusals_total{limit}`, so an operator sees
//! which cap a fleet runs into.

use kvroute_proto::Register;
use tonic::Status;

use crate::config::LimitsConfig;
use crate::metrics;

/// The `limit` label of each cap.
pub const DP_RANKS: &str = "dp_ranks";
pub const MODELS: &str = "models";
pub const LORA_NAMES: &str = "lora_names";
pub const NAME_BYTES: &str = "name_bytes";
pub const WORKERS: &str = "workers";
pub const WORKERS_PER_TOKEN: &str = "workers_per_token";
pub const STREAMS: &str = "streams";
pub const STREAMS_PER_TOKEN: &str = "streams_per_token";
/// A registration of a worker id whose stream is alive, by another instance.
pub const LIVE_WORKER_ID: &str = "live_worker_id";
/// A base URL the rules of [`crate::http::worker_url`] refuse.
pub const BASE_URL: &str = "base_url";
pub const REGISTER_TIMEOUT: &str = "register_timeout";
pub const EVENTS_PER_BATCH: &str = "events_per_batch";
pub const GRPC_MESSAGE_BYTES: &str = "grpc_message_bytes";
pub const EVENT_QUEUE_BYTES: &str = "event_queue_bytes";
pub const DUMP_BLOCKS: &str = "dump_blocks";
pub const DUMP_PARTS_BYTES_PER_WORKER: &str = "dump_parts_bytes_per_worker";
pub const DUMP_PARTS_BYTES: &str = "dump_parts_bytes";
/// Warnings of one stream past the rate that is logged (see [`crate::ingest`]).
pub const STREAM_WARNINGS: &str = "stream_warnings";
pub const PREDICTED_BLOCKS: &str = "predicted_blocks";
pub const INFLIGHT_REQUESTS: &str = "inflight_requests";
pub const CHAT_PARTS: &str = "chat_parts";
pub const CHAT_IMAGES: &str = "chat_images";
/// A response id forgotten before its TTL to make room (`max_response_owners`).
pub const RESPONSE_OWNERS: &str = "response_owners";
pub const HTTP_CONNECTIONS: &str = "http_connections";
pub const HTTP_CONNECTIONS_PER_PEER: &str = "http_connections_per_peer";
pub const GRPC_CONNECTIONS: &str = "grpc_connections";
pub const GRPC_CONNECTIONS_PER_PEER: &str = "grpc_connections_per_peer";
pub const HEADER_READ_TIMEOUT: &str = "header_read_timeout";
pub const BODY_READ_TIMEOUT: &str = "body_read_timeout";
pub const GRPC_IDLE_TIMEOUT: &str = "grpc_idle_timeout";

pub const ALL: &[&str] = &[
    DP_RANKS,
    MODELS,
    LORA_NAMES,
    NAME_BYTES,
    WORKERS,
    WORKERS_PER_TOKEN,
    STREAMS,
    STREAMS_PER_TOKEN,
    LIVE_WORKER_ID,
    BASE_URL,
    REGISTER_TIMEOUT,
    EVENTS_PER_BATCH,
    GRPC_MESSAGE_BYTES,
    EVENT_QUEUE_BYTES,
    DUMP_BLOCKS,
    DUMP_PARTS_BYTES_PER_WORKER,
    DUMP_PARTS_BYTES,
    STREAM_WARNINGS,
    PREDICTED_BLOCKS,
    INFLIGHT_REQUESTS,
    CHAT_PARTS,
    CHAT_IMAGES,
    RESPONSE_OWNERS,
    HTTP_CONNECTIONS,
    HTTP_CONNECTIONS_PER_PEER,
    GRPC_CONNECTIONS,
    GRPC_CONNECTIONS_PER_PEER,
    HEADER_READ_TIMEOUT,
    BODY_READ_TIMEOUT,
    GRPC_IDLE_TIMEOUT,
];

/// Makes every limit's refusal count exist, at zero, in the process's
/// recorder, so dashboards and alerts see zeros instead of "no data".
pub fn count_from_zero() {
    for &limit in ALL {
        let _ = ::metrics::counter!(metrics::LIMIT_REFUSALS, "limit" => limit);
    }
}

/// Counts one refusal (or truncation) by `limit`.
pub fn count(limit: &'static str) {
    ::metrics::counter!(metrics::LIMIT_REFUSALS, "limit" => limit).increment(1);
}

/// Counts the refusal and returns `status` for it.
pub fn refuse(limit: &'static str, status: Status) -> Status {
    count(limit);
    status
}

/// Checks a registration's sizes; cheap, and done before the registry lock.
pub fn check_registration(limits: &LimitsConfig, register: &Register) -> Result<(), Status> {
    let too_many = |limit: &'static str, what: &str, n: usize, max: usize| {
        refuse(
            limit,
            Status::invalid_argument(format!(
                "Register has {n} {what}; at most {max} are accepted (limits.max_{limit})"
            )),
        )
    };
    let counts = [
        (
            DP_RANKS,
            "dp_ranks",
            register.dp_ranks.len(),
            limits.max_dp_ranks,
        ),
        (MODELS, "models", register.models.len(), limits.max_models),
        (
            LORA_NAMES,
            "lora_names",
            register.lora_names.len(),
            limits.max_lora_names,
        ),
    ];
    for (limit, what, n, max) in counts {
        if n > max {
            return Err(too_many(limit, what, n, max));
        }
    }
    let names = register.models.iter().chain(&register.lora_names);
    let tokenizer = register
        .tokenizer
        .iter()
        .flat_map(|t| [&t.spec, &t.fingerprint]);
    for name in names.chain(tokenizer).chain([&register.base_url]) {
        if name.len() > limits.max_name_bytes {
            let shown: String = name.chars().take(40).collect();
            return Err(refuse(
                NAME_BYTES,
                Status::invalid_argument(format!(
                    "a name, base_url or tokenizer of {} bytes ({shown:?}…) is longer than {} (limits.max_name_bytes)",
                    name.len(),
                    limits.max_name_bytes
                )),
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn register() -> Register {
        Register {
            worker_id: 1,
            dp_ranks: vec![0],
            models: vec!["m".into()],
            base_url: "http://127.0.0.1:1".into(),
            block_size: 16,
            total_kv_blocks: 1,
            lora_names: Vec::new(),
            ..Register::default()
        }
    }

    #[test]
    fn registrations_over_a_limit_are_refused_naming_it() {
        let limits = LimitsConfig::default();
        assert!(check_registration(&limits, &register()).is_ok());
        let mut r = register();
        r.dp_ranks = (0..1_000_000).collect();
        let status = check_registration(&limits, &r).unwrap_err();
        assert_eq!(status.code(), tonic::Code::InvalidArgument);
        assert!(status.message().contains("limits.max_dp_ranks"), "{status}");
        let mut r = register();
        r.lora_names = vec!["a".into(); limits.max_lora_names + 1];
        let status = check_registration(&limits, &r).unwrap_err();
        assert!(status.message().contains("max_lora_names"), "{status}");
        let mut r = register();
        r.models = vec!["x".repeat(limits.max_name_bytes + 1)];
        let status = check_registration(&limits, &r).unwrap_err();
        assert!(status.message().contains("max_name_bytes"), "{status}");
    }
}
