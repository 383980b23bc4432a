//! The engine side: one subscriber per data-parallel rank, gap recovery through
//! the engine's replay socket, and the events that come out.
//!
//! Each rank publishes `[topic, sequence (u64 BE), payload]` on its own port. A
//! sequence that skips ahead means ZeroMQ dropped batches (it does for slow
//! subscribers, and for every subscriber until its subscription has reached the
//! publisher); a sequence that goes backwards means the engine restarted. Both
//! end in the same place: the missing range is asked of the replay socket, and
//! when it cannot be had in full, the mirror is reset and the router told
//! `Cleared`, because a router that keeps stale blocks routes worse than one that
//! knows nothing.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use kvroute_index::{EventKind, Tier};
use kvroute_proto as proto;
use metrics::{counter, gauge};
use proto::worker_message::Body as WorkerBody;
use tokio::sync::{mpsc, watch};
use tracing::{error, info, warn};
use zeromq::{DealerSocket, Socket, SocketRecv, SocketSend, SubSocket, ZmqMessage};

use crate::rank::{EventFilter, RankMirror, Sequence, SequenceTracker, SkipReason, event_to_proto};
use crate::wire::{EngineEvent, decode_batch};
use crate::{Backoff, BridgeError};

/// The replay socket's end-of-replay marker: sequence -1.
const END_OF_REPLAY: u64 = u64::MAX;
/// How long a replay may take before the bridge gives up and resets instead.
const REPLAY_TIMEOUT: Duration = Duration::from_secs(5);

/// Where one rank's engine sockets are and what to forward from them.
#[derive(Clone, Debug)]
pub struct RankEndpoints {
    pub dp_rank: u32,
    pub events: String,
    pub replay: Option<String>,
}

/// Follows one rank's publisher for ever, reconnecting with backoff.
pub struct RankFollower {
    endpoints: RankEndpoints,
    topic: String,
    filter: EventFilter,
    tracker: SequenceTracker,
    mirror: Arc<Mutex<RankMirror>>,
    /// Event batches, and digests behind them, for the router.
    outbox: mpsc::Sender<WorkerBody>,
    /// A digest follows the batch that makes this many events since the last (0: never).
    digest_events: u64,
    /// The engine's instance id, renewed when this rank sees the engine restart.
    instance: Arc<watch::Sender<u64>>,
    rank_label: String,
    block_size_refusals: u64,
}

impl RankFollower {
    pub fn new(
        endpoints: RankEndpoints,
        topic: String,
        filter: EventFilter,
        mirror: Arc<Mutex<RankMirror>>,
        outbox: mpsc::Sender<WorkerBody>,
        digest_events: u64,
        instance: Arc<watch::Sender<u64>>,
    ) -> Self {
        Self {
            rank_label: endpoints.dp_rank.to_string(),
            endpoints,
            topic,
            filter,
            tracker: SequenceTracker::default(),
            mirror,
            outbox,
            digest_events,
            instance,
            block_size_refusals: 0,
        }
    }

    pub async fn run(mut self) {
        let mut backoff = Backoff::default();
        loop {
            match self.subscribe().await {
                Ok(socket) => {
                    backoff.reset();
                    info!(rank = self.endpoints.dp_rank, endpoint = %self.endpoints.events, "subscribed to engine events");
                    self.follow(socket).await;
                }
                Err(e) => warn!(rank = self.endpoints.dp_rank, "engine events: {e}"),
            }
            backoff.wait().await;
        }
    }

    async fn subscribe(&self) -> Result<SubSocket, BridgeError> {
        let zmq = |e| BridgeError::Zmq(self.endpoints.events.clone(), e);
        let mut socket = SubSocket::new();
        socket.subscribe(&self.topic).await.map_err(zmq)?;
        socket.connect(&self.endpoints.events).await.map_err(zmq)?;
        Ok(socket)
    }

    /// Handles messages until the socket fails; the socket reconnects to a
    /// restarted publisher by itself, so only hard errors end this.
    async fn follow(&mut self, mut socket: SubSocket) {
        loop {
            match socket.recv().await {
                Ok(message) => self.on_message(message).await,
                Err(e) => {
                    warn!(rank = self.endpoints.dp_rank, "engine events: {e}");
                    return;
                }
            }
        }
    }

    async fn on_message(&mut self, message: ZmqMessage) {
        let frames = message.into_vec();
        let [_topic, seq, payload] = frames.as_slice() else {
            return self.decode_failure("frames", &format!("{} frames, not 3", frames.len()));
        };
        let Some(seq) = sequence(seq) else {
            return self.decode_failure("frames", "sequence frame is not 8 bytes");
        };
        let rank = self.endpoints.dp_rank;
        match self.tracker.check(seq) {
            Sequence::InOrder => {}
            Sequence::First => {
                if seq > 0 {
                    // Joined a running engine: catch up on what its buffer still holds.
                    self.recover(0, seq, false).await;
                }
            }
            Sequence::Gap { from } => {
                counter!(crate::metrics::GAPS, "rank" => self.rank_label.clone()).increment(1);
                warn!(
                    rank,
                    missing_from = from,
                    missing_to = seq - 1,
                    "engine events missing"
                );
                self.recover(from, seq, true).await;
            }
            Sequence::Restart => {
                counter!(crate::metrics::RESTARTS, "rank" => self.rank_label.clone()).increment(1);
                warn!(
                    rank,
                    seq, "engine sequence went backwards: the engine restarted"
                );
                self.forward(vec![(Tier::Device, EventKind::Cleared)]);
                // A new engine process: the router must forget the old one on every
                // rank, which only a registration of a new instance tells it.
                self.instance.send_replace(rand::random());
                if seq > 0 {
                    self.recover(0, seq, false).await;
                }
            }
        }
        self.on_payload(payload);
        self.tracker.advance(seq);
    }

    /// Brings the mirror from before batch `from` to just before batch `until`.
    /// With the engine's replay socket and a buffer that still holds the whole
    /// range, nothing is lost. Otherwise, if `reset_on_loss`, the rank is reset
    /// (the mirror and the router forget it) and whatever tail of the range the
    /// buffer still had is applied on top.
    async fn recover(&mut self, from: u64, until: u64, reset_on_loss: bool) {
        let rank = self.endpoints.dp_rank;
        let replayed = match &self.endpoints.replay {
            None => Vec::new(),
            Some(endpoint) => {
                match tokio::time::timeout(REPLAY_TIMEOUT, replay(endpoint, from, until)).await {
                    Ok(Ok(batches)) => batches,
                    Ok(Err(e)) => {
                        self.replay_outcome("failed");
                        warn!(rank, "replay: {e}");
                        Vec::new()
                    }
                    Err(_) => {
                        self.replay_outcome("failed");
                        warn!(rank, "replay took longer than {REPLAY_TIMEOUT:?}");
                        Vec::new()
                    }
                }
            }
        };
        let tail = contiguous_tail(&replayed, until);
        let complete = tail.first().map(|(seq, _)| *seq) == Some(from);
        if !replayed.is_empty() {
            self.replay_outcome(if complete { "complete" } else { "incomplete" });
        }
        if !complete && reset_on_loss {
            counter!(crate::metrics::RESETS, "rank" => self.rank_label.clone()).increment(1);
            warn!(rank, "events {from}..{until} lost: clearing the rank");
            self.forward(vec![(Tier::Device, EventKind::Cleared)]);
        }
        for (_, payload) in tail {
            self.on_payload(payload);
        }
    }

    fn replay_outcome(&self, outcome: &'static str) {
        counter!(crate::metrics::REPLAYS, "rank" => self.rank_label.clone(), "outcome" => outcome)
            .increment(1);
    }

    /// Decodes one batch and forwards what passes the filter.
    fn on_payload(&mut self, payload: &[u8]) {
        counter!(crate::metrics::BATCHES_RECEIVED, "rank" => self.rank_label.clone()).increment(1);
        let batch = match decode_batch(payload) {
            Ok(batch) => batch,
            Err(e) => return self.decode_failure(e.reason(), &e.to_string()),
        };
        let rank = self.endpoints.dp_rank;
        if batch.dp_rank.is_some_and(|stamped| stamped != rank) {
            let detail = format!("stamped rank {:?} on rank {rank}'s socket", batch.dp_rank);
            return self.decode_failure("rank_mismatch", &detail);
        }
        let mut kinds = Vec::with_capacity(batch.events.len());
        for event in &batch.events {
            counter!(crate::metrics::EVENTS_RECEIVED, "rank" => self.rank_label.clone(), "type" => engine_type(event))
                .increment(1);
            if let EngineEvent::Stored(stored) = event {
                let undecoded: u64 = stored
                    .extra_keys
                    .iter()
                    .flatten()
                    .map(|keys| u64::from(keys.undecoded))
                    .sum();
                if undecoded > 0 {
                    counter!(crate::metrics::EXTRA_KEYS_UNDECODED, "rank" => self.rank_label.clone())
                        .increment(undecoded);
                }
            }
            match self.filter.translate(event) {
                Ok(tiered) => kinds.push(tiered),
                Err(reason) => self.skipped(event, reason),
            }
        }
        self.forward(kinds);
    }

    fn skipped(&mut self, event: &EngineEvent, reason: SkipReason) {
        counter!(crate::metrics::EVENTS_SKIPPED, "rank" => self.rank_label.clone(), "reason" => reason.as_str())
            .increment(1);
        if let (SkipReason::BlockSize, EngineEvent::Stored(stored)) = (reason, event) {
            // Loud, but not one line per event: the first, then every thousandth.
            if self.block_size_refusals.is_multiple_of(1000) {
                error!(
                    rank = self.endpoints.dp_rank,
                    engine_block_size = stored.block_size,
                    bridge_block_size = self.filter.block_size,
                    refused = self.block_size_refusals + 1,
                    "engine block size differs from --block-size: its blocks are refused"
                );
            }
            self.block_size_refusals += 1;
        }
    }

    fn decode_failure(&self, reason: &'static str, detail: &str) {
        counter!(crate::metrics::DECODE_FAILURES, "rank" => self.rank_label.clone(), "reason" => reason)
            .increment(1);
        warn!(
            rank = self.endpoints.dp_rank,
            reason, "skipped an engine message: {detail}"
        );
    }

    /// Gives the events ids, applies them to the mirror and queues them for the
    /// router, under the mirror's lock so that a dump and the queue agree.
    fn forward(&self, kinds: Vec<(Tier, EventKind)>) {
        if kinds.is_empty() {
            return;
        }
        let mut mirror = self.mirror.lock().unwrap();
        let events = kinds
            .into_iter()
            .map(|(tier, kind)| {
                let event = mirror.record(tier, kind);
                counter!(crate::metrics::EVENTS_SENT, "rank" => self.rank_label.clone(), "type" => event.kind.type_name().as_str())
                    .increment(1);
                event_to_proto(&event, tier)
            })
            .collect();
        gauge!(crate::metrics::MIRROR_BLOCKS, "rank" => self.rank_label.clone())
            .set(mirror.blocks() as f64);
        let batch = proto::EventBatch {
            dp_rank: mirror.dp_rank(),
            events,
        };
        if self.outbox.try_send(WorkerBody::Events(batch)).is_err() {
            // The router will see the gap in event ids and ask for a dump.
            counter!(crate::metrics::BATCHES_DROPPED, "rank" => self.rank_label.clone())
                .increment(1);
            return;
        }
        // Taken with the batch, under the same lock: exactly as of its last event.
        if self.digest_events > 0 && mirror.since_digest() >= self.digest_events {
            let _ = self
                .outbox
                .try_send(WorkerBody::Digest(mirror.take_digest()));
        }
    }
}

fn engine_type(event: &EngineEvent) -> &'static str {
    match event {
        EngineEvent::Stored(_) => "stored",
        EngineEvent::Removed { .. } => "removed",
        EngineEvent::AllCleared => "cleared",
        EngineEvent::Unknown(_) => "unknown",
    }
}

fn sequence(frame: &[u8]) -> Option<u64> {
    Some(u64::from_be_bytes(frame.try_into().ok()?))
}

/// The longest run of consecutive sequences in `batches` that ends just before `until`.
fn contiguous_tail(batches: &[(u64, Bytes)], until: u64) -> &[(u64, Bytes)] {
    let mut start = batches.len();
    let mut next = until;
    while start > 0 && batches[start - 1].0.checked_add(1) == Some(next) {
        start -= 1;
        next = batches[start].0;
    }
    &batches[start..]
}

/// Asks the engine's replay socket for batches `from..until`: an empty delimiter
/// and the start sequence go out; `(sequence, payload)` pairs come back until the
/// sequence -1.
async fn replay(endpoint: &str, from: u64, until: u64) -> Result<Vec<(u64, Bytes)>, BridgeError> {
    let zmq = |e| BridgeError::Zmq(endpoint.to_owned(), e);
    let mut socket = DealerSocket::new();
    socket.connect(endpoint).await.map_err(zmq)?;
    let mut request = ZmqMessage::from(Bytes::new());
    request.push_back(Bytes::copy_from_slice(&from.to_be_bytes()));
    socket.send(request).await.map_err(zmq)?;
    let mut batches = Vec::new();
    loop {
        let frames = socket.recv().await.map_err(zmq)?.into_vec();
        // The reply is `[empty delimiter, sequence, payload]`; a REQ-style peer may omit the delimiter.
        let [.., seq, payload] = frames.as_slice() else {
            return Err(BridgeError::Replay(format!(
                "a reply of {} frames",
                frames.len()
            )));
        };
        let seq = sequence(seq)
            .ok_or_else(|| BridgeError::Replay("a sequence frame that is not 8 bytes".into()))?;
        if seq == END_OF_REPLAY || seq >= until {
            return Ok(batches);
        }
        if seq >= from {
            batches.push((seq, payload.clone()));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn contiguous_tail_ends_just_before_the_live_batch() {
        let b = |s: u64| (s, Bytes::new());
        let seqs = |t: &[(u64, Bytes)]| t.iter().map(|x| x.0).collect::<Vec<_>>();
        assert_eq!(seqs(contiguous_tail(&[b(3), b(4), b(5)], 6)), [3, 4, 5]);
        assert_eq!(seqs(contiguous_tail(&[b(3), b(5)], 6)), [5]);
        assert_eq!(seqs(contiguous_tail(&[b(3), b(4)], 6)), Vec::<u64>::new());
        assert!(contiguous_tail(&[], 6).is_empty());
    }
}
