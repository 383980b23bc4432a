//! Records as NATS messages: a subject per worker and rank, the record's kind
//! and claim in headers, the batch or dump as its protobuf in the payload.
//!
//! Subjects: `kvroute.events.<worker>.<rank>` for batches, dumps and clears,
//! `kvroute.claims.<worker>` for claims. All are in one stream, so one
//! consumer sees every record in the one order all replicas apply.

use async_nats::HeaderMap;
use bytes::Bytes;
use kvroute_proto::{Dump, EventBatch};
use kvroute_router::replica::Record;
use prost::Message as _;
use serde::{Deserialize, Serialize};

pub const STREAM: &str = "KVROUTE_EVENTS";
pub const SUBJECTS: [&str; 2] = ["kvroute.events.>", "kvroute.claims.>"];

const KIND: &str = "Kvroute-Kind";
const WORKER: &str = "Kvroute-Worker";
const CLAIM: &str = "Kvroute-Claim";
const RANK: &str = "Kvroute-Rank";

#[derive(Serialize, Deserialize)]
struct ClaimBody {
    instance_id: u64,
    dp_ranks: Vec<u32>,
    replica_id: String,
}

/// A record as a message: subject, headers, payload.
pub fn encode(record: &Record) -> (String, HeaderMap, Bytes) {
    let mut headers = HeaderMap::new();
    headers.insert(KIND, record.kind());
    headers.insert(WORKER, record.worker_id().to_string().as_str());
    let (subject, payload) = match record {
        Record::Claim {
            worker_id,
            instance_id,
            dp_ranks,
            replica_id,
        } => {
            let body = ClaimBody {
                instance_id: *instance_id,
                dp_ranks: dp_ranks.clone(),
                replica_id: replica_id.clone(),
            };
            let payload = serde_json::to_vec(&body).expect("a claim serializes");
            (format!("kvroute.claims.{worker_id}"), payload)
        }
        Record::Events {
            worker_id,
            claim,
            batch,
        } => {
            headers.insert(CLAIM, claim.to_string().as_str());
            let subject = format!("kvroute.events.{worker_id}.{}", batch.dp_rank);
            (subject, batch.encode_to_vec())
        }
        Record::Dump {
            worker_id,
            claim,
            dump,
        } => {
            headers.insert(CLAIM, claim.to_string().as_str());
            let subject = format!("kvroute.events.{worker_id}.{}", dump.dp_rank);
            (subject, dump.encode_to_vec())
        }
        Record::Clear {
            worker_id,
            claim,
            dp_rank,
        } => {
            headers.insert(CLAIM, claim.to_string().as_str());
            headers.insert(RANK, dp_rank.to_string().as_str());
            (format!("kvroute.events.{worker_id}.{dp_rank}"), Vec::new())
        }
    };
    (subject, headers, Bytes::from(payload))
}

/// A message back into its record; `Err` says what is wrong with it.
pub fn decode(headers: Option<&HeaderMap>, payload: &[u8]) -> Result<Record, String> {
    let headers = headers.ok_or("no headers")?;
    let text = |name: &str| {
        headers
            .get(name)
            .map(|v| v.as_str().to_string())
            .ok_or(format!("no {name} header"))
    };
    let number = |name: &str| {
        text(name)?
            .parse::<u64>()
            .map_err(|e| format!("{name}: {e}"))
    };
    let worker_id = number(WORKER)?;
    let record = match text(KIND)?.as_str() {
        "claim" => {
            let body: ClaimBody =
                serde_json::from_slice(payload).map_err(|e| format!("claim: {e}"))?;
            Record::Claim {
                worker_id,
                instance_id: body.instance_id,
                dp_ranks: body.dp_ranks,
                replica_id: body.replica_id,
            }
        }
        "events" => Record::Events {
            worker_id,
            claim: number(CLAIM)?,
            batch: EventBatch::decode(payload).map_err(|e| format!("events: {e}"))?,
        },
        "dump" => Record::Dump {
            worker_id,
            claim: number(CLAIM)?,
            dump: Dump::decode(payload).map_err(|e| format!("dump: {e}"))?,
        },
        "clear" => Record::Clear {
            worker_id,
            claim: number(CLAIM)?,
            dp_rank: u32::try_from(number(RANK)?).map_err(|e| format!("{RANK}: {e}"))?,
        },
        other => return Err(format!("unknown kind {other:?}")),
    };
    Ok(record)
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvroute_proto::{KvEvent, Stored, StoredBlock, kv_event};

    #[test]
    fn every_kind_of_record_comes_back_as_it_went() {
        let stored = Stored {
            parent_hash: Some(7),
            blocks: vec![StoredBlock {
                block_hash: 1,
                tokens_hash: 2,
            }],
        };
        let records = [
            Record::Claim {
                worker_id: 3,
                instance_id: 99,
                dp_ranks: vec![0, 1],
                replica_id: "a".into(),
            },
            Record::Events {
                worker_id: 3,
                claim: 12,
                batch: EventBatch {
                    dp_rank: 1,
                    events: vec![KvEvent {
                        event_id: 5,
                        kind: Some(kv_event::Kind::Stored(stored.clone())),
                    }],
                },
            },
            Record::Dump {
                worker_id: 3,
                claim: 12,
                dump: Dump {
                    dp_rank: 0,
                    last_event_id: 8,
                    chains: vec![stored],
                    more: true,
                },
            },
            Record::Clear {
                worker_id: 3,
                claim: 12,
                dp_rank: 1,
            },
        ];
        for record in records {
            let (subject, headers, payload) = encode(&record);
            assert!(subject.starts_with("kvroute."), "{subject}");
            assert_eq!(decode(Some(&headers), &payload).unwrap(), record);
        }
        assert!(decode(None, b"").is_err());
    }
}
