//! Records as NATS messages: a subject per worker and rank, the record's kind
//! and claim in headers, the batch or dump as its protobuf in the payload.
//!
//! Subjects: `kvroute.events.<worker>.<rank>` for batches, dumps, clears,
//! digests and divergences,
//! `kvroute.claims.<worker>` for claims. All are in one stream, so one
//! consumer sees every record in the one order all replicas apply.

use async_nats::HeaderMap;
use bytes::Bytes;
use kvroute_proto::{Digest, Dump, EventBatch};
use kvroute_router::replica::Record;
use prost::Message as _;
use serde::{Deserialize, Serialize};

pub const STREAM: &str = "KVROUTE_EVENTS";
pub const SUBJECTS: [&str; 2] = ["kvroute.events.>", "kvroute.claims.>"];
/// Replicas' own digests for each other (core NATS, outside the stream).
pub const PEER_DIGESTS: &str = "kvroute.peer-digests";

const KIND: &str = "Kvroute-Kind";
const WORKER: &str = "Kvroute-Worker";
const CLAIM: &str = "Kvroute-Claim";
const RANK: &str = "Kvroute-Rank";
const SEQ: &str = "Kvroute-Seq";
/// When the holder took the record from its worker's queue, in microseconds
/// since the Unix epoch: every replica measures its apply lag from it.
const SENT: &str = "Kvroute-Sent";

/// Stamps `headers` with the time now (see [`SENT`]).
pub fn stamp_sent(headers: &mut HeaderMap) {
    let micros = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default()
        .as_micros();
    headers.insert(SENT, micros.to_string().as_str());
}

/// How long ago the record was stamped; `None` without a stamp (or with a
/// clock that went back).
pub fn since_sent(headers: Option<&HeaderMap>) -> Option<std::time::Duration> {
    let micros: u64 = headers?.get(SENT)?.as_str().parse().ok()?;
    let sent = std::time::UNIX_EPOCH + std::time::Duration::from_micros(micros);
    std::time::SystemTime::now().duration_since(sent).ok()
}

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
        Record::Digest {
            worker_id,
            claim,
            digest,
        } => {
            headers.insert(CLAIM, claim.to_string().as_str());
            let subject = format!("kvroute.events.{worker_id}.{}", digest.dp_rank);
            (subject, digest.encode_to_vec())
        }
        Record::Diverged {
            worker_id,
            claim,
            dp_rank,
            seq,
            replica_id,
        } => {
            headers.insert(CLAIM, claim.to_string().as_str());
            headers.insert(RANK, dp_rank.to_string().as_str());
            headers.insert(SEQ, seq.to_string().as_str());
            let subject = format!("kvroute.events.{worker_id}.{dp_rank}");
            (subject, replica_id.as_bytes().to_vec())
        }
    };
    (subject, headers, Bytes::from(payload))
}

/// `record` in pieces whose payloads fit in `max_bytes` (the NATS server's
/// `max_payload`): a batch as consecutive batches, a dump part as consecutive
/// parts of the same dump (`more` on all but the last). Applied in order, the
/// pieces mean what the whole does. A single event or chain over the limit
/// stays one piece, which the server will refuse.
pub fn split(record: Record, max_bytes: usize) -> Vec<Record> {
    let budget = budget(max_bytes);
    match record {
        Record::Events {
            worker_id,
            claim,
            batch,
        } if batch.encoded_len() > budget => {
            let dp_rank = batch.dp_rank;
            chunks(batch.events, budget, |e| e.encoded_len())
                .into_iter()
                .map(|events| Record::Events {
                    worker_id,
                    claim,
                    batch: EventBatch { dp_rank, events },
                })
                .collect()
        }
        Record::Dump {
            worker_id,
            claim,
            dump,
        } if dump.encoded_len() > budget => {
            let (dp_rank, last_event_id, more) = (dump.dp_rank, dump.last_event_id, dump.more);
            // The device tier's chains, then the offload tier's, each in order.
            // (Over the budget, so at least one of them holds a chain.)
            let device = chunks(dump.chains, budget, |c| c.encoded_len())
                .into_iter()
                .map(|chains| (chains, Vec::new()));
            let offload = chunks(dump.offload_chains, budget, |c| c.encoded_len())
                .into_iter()
                .map(|chains| (Vec::new(), chains));
            let parts: Vec<_> = device
                .chain(offload)
                .filter(|(d, o)| !d.is_empty() || !o.is_empty())
                .collect();
            let count = parts.len();
            parts
                .into_iter()
                .enumerate()
                .map(|(i, (chains, offload_chains))| Record::Dump {
                    worker_id,
                    claim,
                    dump: Dump {
                        dp_rank,
                        last_event_id,
                        chains,
                        more: more || i + 1 < count,
                        offload_chains,
                    },
                })
                .collect()
        }
        record => vec![record],
    }
}

/// Whether `record` goes as one message under `max_bytes`.
pub fn fits(record: &Record, max_bytes: usize) -> bool {
    let budget = budget(max_bytes);
    match record {
        Record::Events { batch, .. } => batch.encoded_len() <= budget,
        Record::Dump { dump, .. } => dump.encoded_len() <= budget,
        Record::Claim { .. }
        | Record::Clear { .. }
        | Record::Digest { .. }
        | Record::Diverged { .. } => true,
    }
}

/// A payload's bytes under `max_bytes`, with room for the fields around the
/// repeated ones.
fn budget(max_bytes: usize) -> usize {
    max_bytes.saturating_sub(64).max(1)
}

/// `items` in consecutive runs of at most `budget` bytes each (a field's tag
/// and length prefix counted as 8 bytes).
fn chunks<T>(items: Vec<T>, budget: usize, size: impl Fn(&T) -> usize) -> Vec<Vec<T>> {
    let mut runs = vec![Vec::new()];
    let mut bytes = 0;
    for item in items {
        let n = size(&item) + 8;
        let run = runs.last_mut().expect("one run at least");
        if !run.is_empty() && bytes + n > budget {
            runs.push(Vec::new());
            bytes = 0;
        }
        bytes += n;
        runs.last_mut().expect("one run at least").push(item);
    }
    runs
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
        "digest" => Record::Digest {
            worker_id,
            claim: number(CLAIM)?,
            digest: Digest::decode(payload).map_err(|e| format!("digest: {e}"))?,
        },
        "diverged" => Record::Diverged {
            worker_id,
            claim: number(CLAIM)?,
            dp_rank: u32::try_from(number(RANK)?).map_err(|e| format!("{RANK}: {e}"))?,
            seq: number(SEQ)?,
            replica_id: String::from_utf8(payload.to_vec())
                .map_err(|e| format!("diverged: {e}"))?,
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
                        tier: kvroute_proto::Tier::Offload.into(),
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
                    chains: vec![stored.clone()],
                    more: true,
                    offload_chains: vec![stored],
                },
            },
            Record::Clear {
                worker_id: 3,
                claim: 12,
                dp_rank: 1,
            },
            Record::Digest {
                worker_id: 3,
                claim: 12,
                digest: Digest {
                    dp_rank: 1,
                    last_event_id: 5,
                    block_count: 1,
                    block_set_hash: 0xfeed,
                },
            },
            Record::Diverged {
                worker_id: 3,
                claim: 12,
                dp_rank: 1,
                seq: 40,
                replica_id: "b".into(),
            },
        ];
        for record in records {
            let (subject, headers, payload) = encode(&record);
            assert!(subject.starts_with("kvroute."), "{subject}");
            assert_eq!(decode(Some(&headers), &payload).unwrap(), record);
        }
        assert!(decode(None, b"").is_err());
    }

    fn stored(hash: u64) -> Stored {
        Stored {
            parent_hash: None,
            blocks: vec![StoredBlock {
                block_hash: hash,
                tokens_hash: hash,
            }],
        }
    }

    #[test]
    fn large_records_split_into_pieces_that_fit_and_mean_the_same() {
        let events: Vec<KvEvent> = (0..1_000)
            .map(|id| KvEvent {
                tier: Default::default(),
                event_id: id,
                kind: Some(kv_event::Kind::Stored(stored(id + 1_000_000))),
            })
            .collect();
        let batch = EventBatch {
            dp_rank: 2,
            events: events.clone(),
        };
        let whole = Record::Events {
            worker_id: 1,
            claim: 5,
            batch: batch.clone(),
        };
        let max = 2_000;
        let pieces = split(whole.clone(), max);
        assert!(pieces.len() > 1);
        let mut rejoined = Vec::new();
        for piece in pieces {
            let (_, _, payload) = encode(&piece);
            assert!(payload.len() <= max, "{}", payload.len());
            let Record::Events { claim, batch, .. } = piece else {
                panic!("{piece:?}");
            };
            assert_eq!((claim, batch.dp_rank), (5, 2));
            rejoined.extend(batch.events);
        }
        assert_eq!(rejoined, events);
        assert!(!fits(&whole, max));
        assert!(fits(&whole, 1 << 20));
        assert_eq!(split(whole.clone(), 1 << 20), vec![whole]);

        for more in [false, true] {
            let chains: Vec<Stored> = (0..1_000).map(stored).collect();
            let offload_chains: Vec<Stored> = (2_000..2_500).map(stored).collect();
            let dump = Record::Dump {
                worker_id: 1,
                claim: 5,
                dump: Dump {
                    dp_rank: 0,
                    last_event_id: 9,
                    chains: chains.clone(),
                    more,
                    offload_chains: offload_chains.clone(),
                },
            };
            let pieces = split(dump, max);
            let count = pieces.len();
            assert!(count > 1);
            let mut rejoined = Vec::new();
            let mut rejoined_offload = Vec::new();
            for (i, piece) in pieces.into_iter().enumerate() {
                assert!(encode(&piece).2.len() <= max);
                let Record::Dump { dump, .. } = piece else {
                    panic!("{piece:?}");
                };
                assert_eq!(dump.last_event_id, 9);
                // Only the last piece may end the dump, and only if the whole did.
                assert_eq!(dump.more, more || i + 1 < count);
                rejoined.extend(dump.chains);
                rejoined_offload.extend(dump.offload_chains);
            }
            assert_eq!(rejoined, chains);
            assert_eq!(rejoined_offload, offload_chains);
        }
    }

    /// An offload-tier event and dump through the log's encoding: a replica
    /// applying them indexes the blocks in its offload tier, not on the device.
    #[tokio::test]
    async fn a_replica_indexes_offload_tier_blocks_from_the_log() {
        use kvroute_index::WorkerKey;
        use kvroute_router::ingest::log::ReplicaApplier;
        use kvroute_router::state::AppState;

        let block = |hash: u64| StoredBlock {
            block_hash: hash,
            tokens_hash: hash * 10,
        };
        let offload = |event_id, parent_hash, hash| KvEvent {
            tier: kvroute_proto::Tier::Offload.into(),
            event_id,
            kind: Some(kv_event::Kind::Stored(Stored {
                parent_hash,
                blocks: vec![block(hash)],
            })),
        };
        let records = [
            Record::Claim {
                worker_id: 1,
                instance_id: 7,
                dp_ranks: vec![0],
                replica_id: "r".into(),
            },
            Record::Events {
                worker_id: 1,
                claim: 1,
                batch: EventBatch {
                    dp_rank: 0,
                    events: vec![offload(0, None, 11), offload(1, Some(11), 12)],
                },
            },
        ];
        let state = AppState::new(kvroute_router::Config::default(), None).unwrap();
        let mut applier = ReplicaApplier::new(std::sync::Arc::clone(&state));
        let through_the_log = |record: &Record| {
            let (_, headers, payload) = encode(record);
            decode(Some(&headers), &payload).unwrap()
        };
        for (seq, record) in records.iter().enumerate() {
            applier.apply(seq as u64 + 1, through_the_log(record)).await;
        }
        let key = WorkerKey::new(1, 0);
        assert_eq!(state.tiers.offload.worker_blocks(key), 2);
        assert_eq!(state.tiers.device.worker_blocks(key), 0);
        assert_eq!(state.tiers.last_event_id(key), Some(1));
        // A dump replaces both tiers.
        let dump = Record::Dump {
            worker_id: 1,
            claim: 1,
            dump: Dump {
                dp_rank: 0,
                last_event_id: 4,
                chains: vec![Stored {
                    parent_hash: None,
                    blocks: vec![block(21)],
                }],
                more: false,
                offload_chains: vec![Stored {
                    parent_hash: None,
                    blocks: vec![block(31), block(32), block(33)],
                }],
            },
        };
        applier.apply(3, through_the_log(&dump)).await;
        assert_eq!(state.tiers.offload.worker_blocks(key), 3);
        assert_eq!(state.tiers.device.worker_blocks(key), 1);
        // A snapshot carries the offload tier to a replica started later.
        let snapshot = applier.snapshot(3).await.unwrap();
        let snapshot = crate::snapshot::decode(&crate::snapshot::encode(&snapshot)).unwrap();
        let later = AppState::new(kvroute_router::Config::default(), None).unwrap();
        ReplicaApplier::new(std::sync::Arc::clone(&later))
            .restore(snapshot)
            .await;
        assert_eq!(later.tiers.offload.worker_blocks(key), 3);
        assert_eq!(later.tiers.digest(key), state.tiers.digest(key));
    }
}
