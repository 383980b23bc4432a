//! OpenAI Responses conversations: which worker created each response id.
//!
//! An engine stores a response where it served it, and answers a follow-up
//! (`previous_response_id`), a retrieval or a deletion only there. So the
//! router records the worker of every response id it proxies, read from the
//! start of the response body ([`IdTap`]: the response object's `id`, or the
//! `response.created` event's), and sends what names the id to that worker.
//!
//! What must stay true: a record lives at most `responses.owner_ttl_s` (the
//! engines' own store keeps a response about that long), and the table holds
//! at most `limits.max_response_owners` ids, the least used forgotten first
//! and counted. A forgotten or unknown id costs the conversation its worker,
//! never an error of the router's own: the request is routed by its prefix
//! and the engine answers for the id.

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};

use crate::limits;
use crate::metrics;

/// The id's worker serves it.
pub const OWNER: &str = metrics::RESPONSE_OWNER_OUTCOMES[0];
/// The id's worker has left routing: the request is routed like any other.
pub const OWNER_GONE: &str = metrics::RESPONSE_OWNER_OUTCOMES[1];
/// The router has no record of the id (never seen, expired or forgotten).
pub const UNKNOWN: &str = metrics::RESPONSE_OWNER_OUTCOMES[2];

/// Longest response id recorded; engines make ids of a few dozen bytes.
const MAX_ID_BYTES: usize = 256;

/// How far into a response body its id is looked for.
const ID_SCAN_BYTES: usize = 16 << 10;

/// Which worker created each response id, for `owner_ttl`.
pub struct ResponseOwners {
    owners: quick_cache::sync::Cache<
        Box<str>,
        Owner,
        quick_cache::UnitWeighter,
        quick_cache::DefaultHashBuilder,
        CountEvictions,
    >,
    ttl: Duration,
}

#[derive(Clone, Copy)]
struct Owner {
    worker_id: u64,
    expires: Instant,
}

/// Counts a record forgotten before its time as a limit refusal.
#[derive(Clone, Copy, Default)]
struct CountEvictions;

impl quick_cache::Lifecycle<Box<str>, Owner> for CountEvictions {
    type RequestState = ();

    fn on_evict(&self, _: &mut (), _: Box<str>, owner: Owner) {
        if owner.expires > Instant::now() {
            limits::count(limits::RESPONSE_OWNERS);
        }
    }
}

impl ResponseOwners {
    pub fn new(ttl: Duration, capacity: usize) -> Self {
        Self {
            owners: quick_cache::sync::Cache::with(
                // Grown as ids come, not allocated for the cap up front.
                capacity.min(1 << 16),
                capacity as u64,
                quick_cache::UnitWeighter,
                quick_cache::DefaultHashBuilder::default(),
                CountEvictions,
            ),
            ttl,
        }
    }

    /// Records that `worker_id` created the response `id`.
    pub fn record(&self, id: &str, worker_id: u64) {
        if id.is_empty() || id.len() > MAX_ID_BYTES {
            return;
        }
        let owner = Owner {
            worker_id,
            expires: Instant::now() + self.ttl,
        };
        self.owners.insert(id.into(), owner);
    }

    /// The worker that created the response `id`, if recorded and not expired.
    pub fn owner(&self, id: &str) -> Option<u64> {
        let owner = self.owners.get(id)?;
        if owner.expires <= Instant::now() {
            self.owners.remove(id);
            return None;
        }
        Some(owner.worker_id)
    }

    /// Ids recorded, expired ones not yet dropped included.
    pub fn len(&self) -> usize {
        self.owners.len()
    }

    pub fn is_empty(&self) -> bool {
        self.owners.is_empty()
    }
}

/// Counts one lookup of a response id's owner by `outcome` ([`OWNER`], [`OWNER_GONE`] or [`UNKNOWN`]).
pub fn count_lookup(outcome: &'static str) {
    ::metrics::counter!(metrics::RESPONSE_OWNER_LOOKUPS, "outcome" => outcome).increment(1);
}

/// A Responses body on its way to the client, passed through unchanged,
/// whose first `"id"` (the response's: the object's first field, or in a
/// stream the `response.created` event's `response.id`) is recorded as
/// `worker_id`'s. Looked for in the first [`ID_SCAN_BYTES`] only.
pub struct IdTap<B> {
    inner: B,
    /// `None` once recorded or given up.
    scan: Option<Scan>,
}

struct Scan {
    seen: Vec<u8>,
    owners: Arc<ResponseOwners>,
    worker_id: u64,
}

impl<B> IdTap<B> {
    pub fn new(inner: B, owners: Arc<ResponseOwners>, worker_id: u64) -> Self {
        Self {
            inner,
            scan: Some(Scan {
                seen: Vec::new(),
                owners,
                worker_id,
            }),
        }
    }
}

impl<B: Body<Data = Bytes> + Unpin> Body for IdTap<B> {
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, B::Error>>> {
        let polled = Pin::new(&mut self.inner).poll_frame(cx);
        if let Poll::Ready(Some(Ok(frame))) = &polled
            && let Some(data) = frame.data_ref()
            && let Some(scan) = &mut self.scan
        {
            let room = ID_SCAN_BYTES.saturating_sub(scan.seen.len());
            scan.seen.extend_from_slice(&data[..data.len().min(room)]);
            match first_id(&scan.seen) {
                Found::Id(id) => {
                    scan.owners.record(id, scan.worker_id);
                    self.scan = None;
                }
                Found::Nothing => self.scan = None,
                Found::NotYet if scan.seen.len() >= ID_SCAN_BYTES => self.scan = None,
                Found::NotYet => {}
            }
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

enum Found<'a> {
    Id(&'a str),
    /// The text so far holds no whole `"id"` member yet.
    NotYet,
    /// The first `"id"` member's value is not a plain string.
    Nothing,
}

/// The value of the first `"id": "..."` member in `text`, a prefix of JSON
/// or of an event stream of it.
fn first_id(text: &[u8]) -> Found<'_> {
    let mut from = 0;
    while let Some(at) = memchr::memmem::find(&text[from..], b"\"id\"") {
        let mut rest = &text[from + at + 4..];
        rest = rest.trim_ascii_start();
        match rest.first() {
            None => return Found::NotYet,
            Some(b':') => {}
            // `"id"` as a value, not a key.
            Some(_) => {
                from += at + 4;
                continue;
            }
        }
        rest = rest[1..].trim_ascii_start();
        let Some(value) = rest.strip_prefix(b"\"") else {
            return if rest.is_empty() {
                Found::NotYet
            } else {
                Found::Nothing
            };
        };
        let Some(end) = value.iter().position(|&b| b == b'"' || b == b'\\') else {
            return Found::NotYet;
        };
        return match (value[end], std::str::from_utf8(&value[..end])) {
            (b'"', Ok(id)) => Found::Id(id),
            _ => Found::Nothing,
        };
    }
    Found::NotYet
}

#[cfg(test)]
mod tests {
    use http_body_util::BodyExt;

    use super::*;

    fn id(text: &str) -> Option<&str> {
        match first_id(text.as_bytes()) {
            Found::Id(id) => Some(id),
            _ => None,
        }
    }

    #[test]
    fn the_first_id_member_is_found_in_an_object_or_a_stream() {
        assert_eq!(
            id(r#"{"id": "resp_1","object":"response","output":[{"id":"msg_2"}]}"#),
            Some("resp_1")
        );
        let sse = "event: response.created\ndata: {\"type\":\"response.created\",\"sequence_number\":0,\"response\":{\"id\":\"resp_9\",";
        assert_eq!(id(sse), Some("resp_9"));
        assert_eq!(id(r#"{"type":"id","id":"resp_3"}"#), Some("resp_3"));
        assert!(matches!(first_id(br#"{"id":"resp_"#), Found::NotYet));
        assert!(matches!(first_id(br#"{"id""#), Found::NotYet));
        assert!(matches!(first_id(br#"{"id":3}"#), Found::Nothing));
        assert!(matches!(first_id(br#"{"id":"a\"b"}"#), Found::Nothing));
    }

    #[tokio::test]
    async fn a_tapped_body_passes_through_and_records_its_id_across_frames() {
        let owners = Arc::new(ResponseOwners::new(Duration::from_secs(60), 16));
        let frames = ["{\"object\":\"response\",\"i", "d\":\"resp_", "7\"}"];
        let stream = futures_util::stream::iter(
            frames.map(|f| Ok::<_, std::convert::Infallible>(Bytes::from_static(f.as_bytes()))),
        );
        let body = axum::body::Body::from_stream(stream);
        let tapped = IdTap::new(body, Arc::clone(&owners), 4);
        let whole = tapped.collect().await.unwrap().to_bytes();
        assert_eq!(whole, frames.concat());
        assert_eq!(owners.owner("resp_7"), Some(4));
        assert_eq!(owners.owner("resp_8"), None);
    }

    #[test]
    fn an_owner_expires_after_its_ttl_and_long_ids_are_not_recorded() {
        let owners = ResponseOwners::new(Duration::ZERO, 16);
        owners.record("resp_1", 1);
        assert_eq!(owners.owner("resp_1"), None);
        let owners = ResponseOwners::new(Duration::from_secs(60), 16);
        owners.record(&"x".repeat(MAX_ID_BYTES + 1), 1);
        assert!(owners.is_empty());
        owners.record("resp_1", 1);
        owners.record("resp_1", 2);
        assert_eq!(owners.owner("resp_1"), Some(2), "the latest record wins");
    }
}
