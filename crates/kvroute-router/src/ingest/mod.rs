//! gRPC ingest: workers' event streams.
//!
//! Per stream, a reader task takes messages off the wire and an applier task
//! applies event batches to the index in order. Between them is a queue bounded
//! in bytes (`ingest.event_queue_bytes`, each message measured by what it
//! holds once decoded, up to ~28 times its size on the wire): when the index falls behind, the reader drops the batch, counts it and asks
//! the worker to resend from the first dropped id, so a slow index neither
//! stalls anything else nor silently loses an event. The HTTP path never waits on
//! this queue; it only reads the index.
//!
//! After a drop the reader also drops that rank's later batches, without asking
//! again, until the answer arrives: a batch starting at or before the id asked
//! for (the worker resends everything from there to its latest event), or a dump
//! at least that recent. Passing later batches on would only make gaps — or,
//! for a rank with nothing applied yet, be applied over the hole. An answer that
//! is itself dropped is asked for again.
//!
//! Per dp rank the applier keeps the id it last asked to be resent from, so that
//! a burst of out-of-order events after a gap asks once, not once per event. A
//! request unanswered for `resync_timeout_ms` is sent again; after
//! `resync_attempts` the rank is cleared (index and predicted entries) rather
//! than left frozen on blocks it may no longer hold, attracting traffic.
//!
//! Restarts are known from `Register.instance_id`, never guessed from event ids
//! (a stale resend from id 1 is not a restart, and a restart may well reuse the
//! ids seen last): a new instance of a known worker clears all its ranks. Each
//! registration claims the worker in [`Writers`](crate::ingest::writers::Writers), which
//! fences the previous stream: it ends, and nothing more of it is applied.
//!
//! A dump may come in parts (`Dump.more`), each under the gRPC message limit;
//! the applier gathers a rank's parts and replaces the rank's state with all of
//! them at once, so routing never sees half a dump. A stream's first dump of a
//! rank is the worker's picture as it (re)connects and always applies; a later
//! one older than what is applied is refused (a late answer to an earlier
//! resync would roll the rank back). Blocks a dump cannot place under a parent
//! are counted, not dropped silently. Parts gathered are bounded per worker
//! and over all streams (`ingest.dump_parts_bytes_per_worker`,
//! `ingest.dump_parts_bytes`): past either the stream ends with a status, so a
//! dump that never finishes cannot grow without bound.
//!
//! Warnings a worker causes (events without a kind, unregistered ranks) are
//! logged and sent back at most [`WARNINGS_PER_INTERVAL`] per stream per
//! [`WARNING_INTERVAL`]; the rest are counted and summed up in one line, so a
//! worker cannot write the router's log at the rate it sends bytes.
//!
//! A worker's `Digest` of a rank takes the same queue, so it is checked against
//! the index after exactly the events sent before it ([`crate::ingest::verify`]); a
//! difference asks for a full dump, and no applied event settles that request.

pub mod log;
pub mod verify;
pub(crate) mod work;
pub mod writers;

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use dashmap::DashMap;
use kvroute_index::{EventKind, KvEvent, StoredBlock, Tier, WorkerKey};
use kvroute_proto::{
    Ack, Digest, Dump, Error as ErrorMessage, EventBatch, LoadReport, PdConvention, Register,
    ResyncRequest, RouterMessage, WorkerMessage, WorkerRole, kv_event, router_message,
    worker_message,
};
use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore, mpsc, watch};
use tokio::time::Instant;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};

use crate::config::{self, PdRole, Role};
use crate::fleet::{Claimant, Registration, ReportedLoad, worker_label};
use crate::ingest::verify::Verdict;
use crate::ingest::work::Work;
use crate::ingest::writers::{ApplierAlive, Fence, Fenced, fenced};
use crate::limits;
use crate::metrics;
use crate::replica::HeldStream;
use crate::state::AppState;
use crate::tokenize::Agreement;

pub struct Ingest {
    state: Arc<AppState>,
    /// Set on shutdown: streams end, so that the gRPC server can stop.
    stopped: watch::Receiver<bool>,
    /// Worker streams open now, against `limits.max_streams`.
    streams: Arc<AtomicUsize>,
    /// The same per worker token, against `limits.max_streams_per_token`.
    token_streams: Arc<[AtomicUsize]>,
}

impl Ingest {
    pub fn new(state: Arc<AppState>, stopped: watch::Receiver<bool>) -> Self {
        Self {
            stopped,
            streams: Arc::default(),
            token_streams: (0..state.credentials.worker_tokens())
                .map(|_| AtomicUsize::new(0))
                .collect(),
            state,
        }
    }
}

/// Ranks awaiting a resync.
type Pending = Arc<DashMap<u32, Resync>>;

/// A resync request awaiting its answer.
#[derive(Clone, Copy, Debug)]
struct Resync {
    /// The event id asked for.
    from: u64,
    /// Requests sent so far.
    attempts: u32,
    /// When it is asked again, or given up.
    deadline: Instant,
    /// Only a dump answers it: the index diverged from the worker's digest.
    dump: bool,
}

/// The parts of a rank's dump gathered so far.
struct DumpParts {
    last_event_id: u64,
    chains: Vec<EventKind>,
    offload_chains: Vec<EventKind>,
    blocks: usize,
    offload_blocks: usize,
    /// Decoded bytes of the parts held until the last arrives, and their
    /// share of `ingest.dump_parts_bytes`.
    bytes: usize,
    budget: Option<OwnedSemaphorePermit>,
}

/// A stream's dumps per dp rank: parts gathered, and ranks it has applied to.
#[derive(Default)]
pub(crate) struct DumpState {
    parts: HashMap<u32, DumpParts>,
    pub(crate) applied: HashSet<u32>,
}

impl DumpState {
    /// Whether a dump's first parts are in and its last is still due.
    pub(crate) fn gathering(&self) -> bool {
        !self.parts.is_empty()
    }
}

/// What a batch holds in memory once decoded: its structs and its vectors'
/// capacity. An empty event is 2 bytes on the wire and a few dozen decoded.
fn batch_bytes(batch: &EventBatch) -> usize {
    let kinds: usize = batch
        .events
        .iter()
        .map(|e| match &e.kind {
            Some(kv_event::Kind::Stored(stored)) => blocks_bytes(stored),
            Some(kv_event::Kind::Removed(removed)) => {
                removed.block_hashes.capacity() * size_of::<u64>()
            }
            Some(kv_event::Kind::Cleared(_)) | None => 0,
        })
        .sum();
    size_of::<EventBatch>() + batch.events.capacity() * size_of::<kvroute_proto::KvEvent>() + kinds
}

/// The same for a dump (part).
fn dump_bytes(dump: &Dump) -> usize {
    let chains = |chains: &Vec<kvroute_proto::Stored>| {
        chains.capacity() * size_of::<kvroute_proto::Stored>()
            + chains.iter().map(blocks_bytes).sum::<usize>()
    };
    size_of::<Dump>() + chains(&dump.chains) + chains(&dump.offload_chains)
}

fn blocks_bytes(stored: &kvroute_proto::Stored) -> usize {
    stored.blocks.capacity() * size_of::<kvroute_proto::StoredBlock>()
}

/// A message's share of the queue's bytes, or the status that ends a stream
/// sending one larger than the whole queue (it could never be queued).
fn queue_bytes(decoded: usize, queue_max: usize, what: &str) -> Result<u32, Status> {
    if decoded > queue_max {
        return Err(limits::refuse(
            limits::EVENT_QUEUE_BYTES,
            Status::resource_exhausted(format!(
                "a {what} that takes {decoded} bytes decoded is over the whole event queue \
                 (ingest.event_queue_bytes = {queue_max})"
            )),
        ));
    }
    // The config keeps the queue under `u32::MAX`.
    Ok(decoded as u32)
}

/// One open stream's place under `limits.max_streams` and its token's
/// `limits.max_streams_per_token`, given back on drop.
struct StreamSlot {
    streams: Arc<AtomicUsize>,
    token_streams: Arc<[AtomicUsize]>,
    token: usize,
}

impl StreamSlot {
    fn take(ingest: &Ingest, token: usize) -> Result<Self, Status> {
        let limits = &ingest.state.config.limits;
        let take = |n: &AtomicUsize, max: usize| {
            n.fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < max).then_some(n + 1)
            })
            .is_ok()
        };
        let max = limits.max_streams;
        if !take(&ingest.streams, max) {
            return Err(limits::refuse(
                limits::STREAMS,
                Status::resource_exhausted(format!(
                    "{max} worker streams are open already (limits.max_streams)"
                )),
            ));
        }
        let max = limits.max_streams_per_token;
        if !take(&ingest.token_streams[token], max) {
            ingest.streams.fetch_sub(1, Ordering::AcqRel);
            return Err(limits::refuse(
                limits::STREAMS_PER_TOKEN,
                Status::resource_exhausted(format!(
                    "{max} worker streams are open with this token already \
                     (limits.max_streams_per_token)"
                )),
            ));
        }
        Ok(Self {
            streams: Arc::clone(&ingest.streams),
            token_streams: Arc::clone(&ingest.token_streams),
            token,
        })
    }
}

impl Drop for StreamSlot {
    fn drop(&mut self) {
        self.streams.fetch_sub(1, Ordering::AcqRel);
        self.token_streams[self.token].fetch_sub(1, Ordering::AcqRel);
    }
}

/// Warnings a stream logs (and sends its worker) per [`WARNING_INTERVAL`];
/// the rest are only counted.
pub(crate) const WARNINGS_PER_INTERVAL: u32 = 10;
pub(crate) const WARNING_INTERVAL: Duration = Duration::from_secs(10);

/// A stream's warnings in the current interval.
#[derive(Default)]
struct Warnings {
    since: Option<Instant>,
    shown: u32,
    suppressed: u64,
}

impl Warnings {
    /// Whether a warning at `now` is shown; and the count suppressed in the
    /// interval that ended, to be summed up first.
    fn admit(&mut self, now: Instant) -> (bool, u64) {
        let mut ended = 0;
        if self
            .since
            .is_none_or(|since| now.duration_since(since) >= WARNING_INTERVAL)
        {
            ended = std::mem::take(&mut self.suppressed);
            self.since = Some(now);
            self.shown = 0;
        }
        if self.shown < WARNINGS_PER_INTERVAL {
            self.shown += 1;
            return (true, ended);
        }
        self.suppressed += 1;
        (false, ended)
    }
}

/// One registered stream's context, shared by its reader and applier; on a
/// replica that does not hold the worker's stream, the context its records are
/// applied in (see [`crate::replica`]).
#[derive(Clone)]
pub(crate) struct Stream {
    state: Arc<AppState>,
    worker_id: u64,
    dp_ranks: Vec<u32>,
    out: mpsc::Sender<Result<RouterMessage, Status>>,
    pending: Pending,
    /// Wakes the applier to reckon with a new resync deadline.
    resync_asked: Arc<Notify>,
    /// Set once a newer registration or an operator's removal takes over.
    fence: Fence,
    /// This replica holds the worker's stream: it answers the worker (acks,
    /// resync requests, errors). False for another replica's worker.
    holds: bool,
    /// Replicated: the sequence of the stream's claim in the cluster's log,
    /// which its batches and dumps are appended to instead of applied here.
    logged: Option<u64>,
    warnings: Arc<Mutex<Warnings>>,
}

fn message(body: router_message::Body) -> Result<RouterMessage, Status> {
    Ok(RouterMessage { body: Some(body) })
}

/// A worker's stream of events, as the router answers it.
pub type RouterStream = ReceiverStream<Result<RouterMessage, Status>>;

impl Ingest {
    /// Serves one worker's event stream: registration first, then its
    /// batches, dumps, digests and load reports until it ends or is fenced.
    pub async fn stream(
        &self,
        request: Request<Streaming<WorkerMessage>>,
    ) -> Result<Response<RouterStream>, Status> {
        let grant = self.state.credentials.worker(request.metadata())?;
        let slot = StreamSlot::take(self, grant.token)?;
        let mut inbound = request.into_inner();
        let register_timeout = self.state.config.ingest.register_timeout_ms;
        let first =
            tokio::time::timeout(Duration::from_millis(register_timeout), inbound.message())
                .await
                .map_err(|_| {
                    limits::refuse(
                        limits::REGISTER_TIMEOUT,
                        Status::deadline_exceeded(format!(
                            "no Register within {register_timeout} ms of opening the stream \
                     (ingest.register_timeout_ms)"
                        )),
                    )
                })??
                .ok_or_else(|| Status::invalid_argument("the stream ended before Register"))?;
        let Some(worker_message::Body::Register(register)) = first.body else {
            return Err(Status::invalid_argument(
                "the first message of a stream must be Register",
            ));
        };
        grant.permits(register.worker_id)?;
        let state = Arc::clone(&self.state);
        let instance_id = register.instance_id;
        let claimant = Claimant {
            instance_id,
            token: grant.token,
        };
        let (registration, generation) = register_worker(&state, register, claimant)?;
        let worker_id = registration.worker_id;
        let dp_ranks = registration.dp_ranks.clone();
        let claim = state
            .writers
            .claim(worker_id, generation, instance_id, &dp_ranks)
            .await
            .ok_or_else(|| Fenced::Superseded.status(worker_id))?;
        let replica = state.replica.get().cloned();
        // Replicated, a restart is known from the log's claims instead, on every replica.
        if replica.is_none() && !claim.stale_ranks.is_empty() {
            tracing::info!(
                worker = worker_id,
                instance_id,
                "a new instance of the worker registered: clearing its ranks"
            );
            ::metrics::counter!(metrics::WORKER_RESTARTS, "worker" => worker_id.to_string())
                .increment(1);
            for &key in &claim.stale_ranks {
                state.tiers.remove_worker(key);
                state.predicted.remove_worker(key);
            }
        }
        tracing::info!(
            worker = worker_id,
            generation,
            instance_id,
            "worker registered"
        );

        let logged = match &replica {
            Some(replica) => Some(
                replica
                    .claim(worker_id, instance_id, &dp_ranks)
                    .await
                    .inspect_err(|_| {
                        state.registry.disconnect(worker_id, generation);
                    })?,
            ),
            None => None,
        };

        let (out, out_rx) = mpsc::channel(256);
        // Bounded by the semaphore's bytes, not by the count of items.
        let (work_tx, work_rx) = mpsc::unbounded_channel();
        let queue = Arc::new(Semaphore::new(state.config.ingest.event_queue_bytes));
        let stream = Stream {
            state,
            worker_id,
            dp_ranks,
            out,
            pending: Pending::default(),
            resync_asked: Arc::default(),
            fence: claim.fence,
            holds: true,
            logged,
            warnings: Arc::default(),
        };
        // Published for the other replicas while the stream lasts.
        let hold = replica.as_ref().map(|r| {
            if let Some(claim) = logged {
                r.hold(claim, Arc::new(stream.clone()));
            }
            r.log.hold(registration)
        });
        tokio::spawn(stream.clone().apply_loop(work_rx, claim.applier_alive));
        let stopped = self.stopped.clone();
        tokio::spawn(async move {
            let _slot = slot;
            let _hold = hold;
            let result = stream
                .read_loop(&mut inbound, work_tx, queue, stopped)
                .await;
            if let Err(status) = result {
                tracing::warn!(worker = stream.worker_id, %status, "worker stream failed");
                // Ours are counted where raised; this one comes from the decoder.
                if status.code() == tonic::Code::OutOfRange {
                    limits::count(limits::GRPC_MESSAGE_BYTES);
                }
                // The worker learns why: the status ends its response stream.
                let _ = stream.out.send(Err(status)).await;
            }
            stream.disconnected(generation);
        });
        Ok(Response::new(ReceiverStream::new(out_rx)))
    }
}

/// Refuses a worker that declares a tokenizer none of the router's has (text
/// prompts would never match its cache); the fingerprint it shares with one of
/// them, for its registration. Compares strings only: nothing is loaded.
fn check_tokenizer(state: &AppState, register: &Register) -> Result<String, Status> {
    let worker_id = register.worker_id;
    let (spec, fingerprint) = register
        .tokenizer
        .as_ref()
        .map_or(("", ""), |t| (t.spec.as_str(), t.fingerprint.as_str()));
    match state.tokenizer.check_worker(worker_id, spec, fingerprint) {
        Ok(Agreement::Agrees(fingerprint)) => return Ok(fingerprint),
        Ok(Agreement::Undeclared) if !state.tokenizer.configured().is_empty() => {
            tracing::warn!(
                worker = worker_id,
                "the worker declares no tokenizer: cannot check that it tokenizes like the router"
            );
        }
        Ok(Agreement::AllowedMismatch(message)) => {
            tracing::warn!("{message} (allowed by allow_tokenizer_mismatch)");
        }
        Ok(_) => {}
        Err(message) => {
            tracing::warn!("registration refused: {message}");
            return Err(Status::failed_precondition(message));
        }
    }
    Ok(String::new())
}

/// The worker's part in prefill/decode disaggregation, as `Register` declares it.
fn pd_role(register: &Register) -> Result<PdRole, Status> {
    let role = match WorkerRole::try_from(register.role) {
        Ok(WorkerRole::Aggregated) => Role::Aggregated,
        Ok(WorkerRole::Prefill) => Role::Prefill,
        Ok(WorkerRole::Decode) => Role::Decode,
        Err(_) => {
            return Err(Status::invalid_argument(format!(
                "unknown Register.role {}",
                register.role
            )));
        }
    };
    let convention = match PdConvention::try_from(register.pd_convention) {
        Ok(PdConvention::Unspecified) => None,
        Ok(PdConvention::Sglang) => Some(config::PdConvention::Sglang),
        Ok(PdConvention::Vllm) => Some(config::PdConvention::Vllm),
        Err(_) => {
            return Err(Status::invalid_argument(format!(
                "unknown Register.pd_convention {}",
                register.pd_convention
            )));
        }
    };
    let bootstrap_port = match register.bootstrap_port {
        0 => None,
        port => Some(u16::try_from(port).map_err(|_| {
            Status::invalid_argument(format!("Register.bootstrap_port {port} is not a port"))
        })?),
    };
    let pd = PdRole {
        role,
        convention,
        bootstrap_port,
    };
    pd.check().map_err(Status::invalid_argument)?;
    Ok(pd)
}

fn register_worker(
    state: &AppState,
    register: Register,
    claimant: Claimant,
) -> Result<(Registration, u64), Status> {
    limits::check_registration(&state.config.limits, &register)?;
    let tokenizer = check_tokenizer(state, &register)?;
    if state
        .config
        .workers
        .iter()
        .any(|w| w.id == register.worker_id)
    {
        return Err(Status::permission_denied(format!(
            "worker id {} is a static worker in the router's config; a stream may not take it over",
            register.worker_id
        )));
    }
    let router_block_size = state.config.block_size;
    if register.block_size != router_block_size {
        return Err(Status::failed_precondition(format!(
            "block size {} does not match the router's {router_block_size}",
            register.block_size
        )));
    }
    let dp_ranks = if register.dp_ranks.is_empty() {
        vec![0]
    } else {
        register.dp_ranks.clone()
    };
    let pd = pd_role(&register)?;
    let registration = Registration {
        worker_id: register.worker_id,
        dp_ranks,
        models: register.models,
        lora_names: register.lora_names,
        base_url: register.base_url,
        total_kv_blocks: register.total_kv_blocks,
        tokenizer,
        pd,
    };
    let registered = state
        .registry
        .register_stream(registration.clone(), claimant)?;
    for evicted in registered.evicted {
        state.writers.forget(evicted.worker_id, evicted.generation);
        for key in evicted.keys {
            state.tiers.remove_worker(key);
            state.predicted.remove_worker(key);
        }
        tracing::info!(
            worker = evicted.worker_id,
            "disconnected worker purged before its grace period ended, to make room"
        );
    }
    Ok((registration, registered.generation))
}

impl Stream {
    /// The context another replica's stream of `worker_id` is applied in here.
    pub(crate) fn follower(state: Arc<AppState>, worker_id: u64, dp_ranks: Vec<u32>) -> Self {
        // Nothing is sent to a worker from here: the holder answers it.
        let (out, _) = mpsc::channel(1);
        let (_, fence) = watch::channel(None);
        Self {
            state,
            worker_id,
            dp_ranks,
            out,
            pending: Pending::default(),
            resync_asked: Arc::default(),
            fence,
            holds: false,
            logged: None,
            warnings: Arc::default(),
        }
    }

    async fn read_loop(
        &self,
        inbound: &mut Streaming<WorkerMessage>,
        work: mpsc::UnboundedSender<Work>,
        queue: Arc<Semaphore>,
        mut stopped: watch::Receiver<bool>,
    ) -> Result<(), Status> {
        let max_events = self.state.config.limits.max_events_per_batch;
        let queue_max = self.state.config.ingest.event_queue_bytes;
        // dp rank → the first id of the batch dropped on a full queue, until resent.
        let mut dropped_from: HashMap<u32, u64> = HashMap::new();
        let mut fence = self.fence.clone();
        loop {
            let message = tokio::select! {
                message = inbound.message() => message?,
                _ = stopped.wait_for(|&s| s) => None,
                why = fenced(&mut fence) => {
                    tracing::info!(worker = self.worker_id, ?why, "stream fenced: closing it");
                    let _ = self.out.try_send(Err(why.status(self.worker_id)));
                    return Ok(());
                }
            };
            let Some(message) = message else {
                break;
            };
            match message.body {
                Some(worker_message::Body::Events(batch)) => {
                    if batch.events.len() > max_events {
                        return Err(limits::refuse(
                            limits::EVENTS_PER_BATCH,
                            Status::invalid_argument(format!(
                                "a batch of {} events is over limits.max_events_per_batch ({max_events})",
                                batch.events.len()
                            )),
                        ));
                    }
                    let Some(first_id) = batch.events.first().map(|e| e.event_id) else {
                        continue;
                    };
                    let rank = batch.dp_rank;
                    if let Some(&from) = dropped_from.get(&rank) {
                        // The answer to the resync request will hold these events
                        // too, unless it was given up (the rank cleared, to start afresh).
                        let awaited = self.pending.contains_key(&rank);
                        if awaited && first_id > from {
                            self.count_dropped_batch();
                            continue;
                        }
                        dropped_from.remove(&rank);
                    }
                    let bytes = queue_bytes(batch_bytes(&batch), queue_max, "batch")?;
                    if let Ok(permit) = Arc::clone(&queue).try_acquire_many_owned(bytes) {
                        if work.send(Work::Events(batch, permit)).is_err() {
                            break;
                        }
                    } else {
                        limits::count(limits::EVENT_QUEUE_BYTES);
                        self.count_dropped_batch();
                        tracing::debug!(
                            worker = self.worker_id,
                            rank,
                            first_id,
                            "event queue full: batch dropped"
                        );
                        dropped_from.insert(rank, first_id);
                        self.request_resync(rank, first_id).await;
                    }
                }
                // A dump replaces state wholesale; it must not be dropped, so wait for room.
                Some(worker_message::Body::Dump(dump)) => {
                    if dropped_from
                        .get(&dump.dp_rank)
                        .is_some_and(|&from| dump.last_event_id >= from)
                    {
                        dropped_from.remove(&dump.dp_rank);
                    }
                    let bytes = queue_bytes(dump_bytes(&dump), queue_max, "dump part")?;
                    let Ok(permit) = Arc::clone(&queue).acquire_many_owned(bytes).await else {
                        break;
                    };
                    if work.send(Work::Dump(dump, permit)).is_err() {
                        break;
                    }
                }
                // Only worth checking in order; on a full queue the next one will do.
                Some(worker_message::Body::Digest(digest)) => {
                    let bytes = queue_bytes(size_of::<Digest>(), queue_max, "digest")?;
                    if let Ok(permit) = Arc::clone(&queue).try_acquire_many_owned(bytes)
                        && work.send(Work::Digest(digest, permit)).is_err()
                    {
                        break;
                    }
                }
                Some(worker_message::Body::Load(load)) => self.report_load(load),
                Some(worker_message::Body::Register(_)) => {
                    self.send_error("Register is only valid as the first message".into())
                        .await;
                }
                None => self.send_error("empty message".into()).await,
            }
        }
        Ok(())
    }

    /// Applies the queue in order until the stream ends or is fenced, and keeps
    /// resync requests' deadlines. `_alive` is dropped on return: whoever fenced
    /// the stream waits for that before touching the worker's state.
    async fn apply_loop(self, mut work: mpsc::UnboundedReceiver<Work>, _alive: ApplierAlive) {
        let mut fence = self.fence.clone();
        let mut dumps = DumpState::default();
        loop {
            let deadline = self.next_resync_deadline();
            let item = tokio::select! {
                biased;
                _ = fenced(&mut fence) => return,
                _ = self.resync_asked.notified() => continue,
                _ = sleep_until(deadline) => {
                    self.expire_resyncs().await;
                    continue;
                }
                item = work.recv() => item,
            };
            let Some(item) = item else {
                return;
            };
            // Checked before applying, and again at every wait inside: a fenced
            // stream's events never reach the index.
            let refused = tokio::select! {
                biased;
                _ = fenced(&mut fence) => return,
                applied = self.apply(item, &mut dumps) => applied.err(),
            };
            // The worker learns why; its reader ends once it has nothing to queue to.
            if let Some(status) = refused {
                tracing::warn!(worker = self.worker_id, %status, "worker stream refused");
                let _ = self.out.send(Err(status)).await;
                return;
            }
        }
    }

    /// Applies one item; `Err` ends the stream with that status.
    async fn apply(&self, item: Work, dumps: &mut DumpState) -> Result<(), Status> {
        // Held for writing only by tests that fill the queue on purpose.
        #[cfg(feature = "test-hooks")]
        let _gate = self.state.ingest_gate.read().await;
        let item = match (self.logged, self.state.replica.get()) {
            (Some(claim), Some(replica)) => {
                let Some(item) = replica.append(self.worker_id, claim, item).await else {
                    return Ok(());
                };
                item
            }
            _ => item,
        };
        match item {
            Work::Events(batch, _permit) => {
                // What this stream applied: a later, older dump would roll it back.
                dumps.applied.insert(batch.dp_rank);
                self.apply_batch(batch).await;
            }
            Work::Dump(dump, permit) => {
                drop(permit);
                return self.apply_dump_part(dump, dumps).await;
            }
            Work::Digest(digest, _permit) => {
                self.check_digest(digest, false).await;
            }
        }
        Ok(())
    }

    /// Checks the worker's digest (`asked`: a dump is on its way already), and
    /// on the holder asks for a full dump when the index diverged; the caller
    /// gets the verdict (`None`: not a registered rank).
    pub(crate) async fn check_digest(&self, digest: Digest, asked: bool) -> Option<Verdict> {
        let Some(key) = self.key(digest.dp_rank) else {
            self.send_error(format!("dp rank {} was not registered", digest.dp_rank))
                .await;
            return None;
        };
        let resyncing = asked || self.pending.contains_key(&key.dp_rank);
        let verdict = crate::ingest::verify::check(&self.state, key, &digest, resyncing);
        if verdict == Verdict::Diverged {
            self.request_dump(key.dp_rank).await;
        }
        Some(verdict)
    }

    /// Another replica found its view of `dp_rank` wrong: the holder asks the
    /// worker for a full dump, unless one is asked for already. Elsewhere, nothing.
    pub(crate) async fn dump_for_replica(&self, dp_rank: u32, replica_id: &str) {
        if !self.holds || self.key(dp_rank).is_none() {
            return;
        }
        let asked = self.pending.get(&dp_rank).is_some_and(|r| r.dump);
        if !asked {
            tracing::info!(
                worker = self.worker_id,
                dp_rank,
                replica = replica_id,
                "another replica's index differs from the worker's digest: asking for a full dump"
            );
            self.request_dump(dp_rank).await;
        }
    }

    /// Whether a resync of `dp_rank` is awaited (only the holder awaits any).
    pub(crate) fn resyncing(&self, dp_rank: u32) -> bool {
        self.pending.contains_key(&dp_rank)
    }

    /// Whether this replica holds the worker's stream.
    pub(crate) fn holds(&self) -> bool {
        self.holds
    }

    fn next_resync_deadline(&self) -> Option<Instant> {
        self.pending.iter().map(|r| r.deadline).min()
    }

    /// Asks again for resyncs past their deadline; clears the ranks whose every
    /// attempt went unanswered.
    async fn expire_resyncs(&self) {
        let ingest = &self.state.config.ingest;
        let now = Instant::now();
        let mut again = Vec::new();
        let mut abandoned = Vec::new();
        self.pending.retain(|&rank, resync| {
            if resync.deadline > now {
                return true;
            }
            if resync.attempts >= ingest.resync_attempts {
                abandoned.push((rank, *resync));
                return false;
            }
            resync.attempts += 1;
            resync.deadline = now + resync_timeout(&self.state);
            again.push((rank, resync.from));
            true
        });
        for (rank, from) in again {
            tracing::debug!(
                worker = self.worker_id,
                rank,
                from,
                "resync unanswered: asking again"
            );
            self.send_resync(rank, from).await;
        }
        for (rank, resync) in abandoned {
            let key = WorkerKey::new(self.worker_id, rank);
            match (self.logged, self.state.replica.get()) {
                (Some(claim), Some(replica)) => replica.clear(self.worker_id, claim, rank).await,
                _ => self.clear_rank(key),
            }
            ::metrics::counter!(metrics::RESYNCS_ABANDONED, "worker" => worker_label(key))
                .increment(1);
            tracing::warn!(
                worker = %worker_label(key),
                from = resync.from,
                attempts = resync.attempts,
                "resync requests went unanswered: rank cleared"
            );
        }
    }

    pub(crate) fn dp_ranks(&self) -> &[u32] {
        &self.dp_ranks
    }

    pub(crate) fn clear_rank(&self, key: WorkerKey) {
        self.state.tiers.remove_worker(key);
        self.state.predicted.remove_worker(key);
    }

    fn key(&self, dp_rank: u32) -> Option<WorkerKey> {
        self.dp_ranks
            .contains(&dp_rank)
            .then(|| WorkerKey::new(self.worker_id, dp_rank))
    }

    pub(crate) async fn apply_batch(&self, batch: EventBatch) {
        let Some(key) = self.key(batch.dp_rank) else {
            self.send_error(format!("dp rank {} was not registered", batch.dp_rank))
                .await;
            return;
        };
        let label = worker_label(key);
        let mut events = Vec::with_capacity(batch.events.len());
        let mut kindless = 0;
        for event in batch.events {
            let Some((tier, event)) = convert_event(event) else {
                kindless += 1;
                continue;
            };
            #[cfg(feature = "test-hooks")]
            let Some(event) = self.state.faults.pass(key, event) else {
                continue;
            };
            events.push((tier, event));
        }
        if kindless > 0 {
            self.send_error(format!(
                "{kindless} events without a kind were skipped (dp rank {})",
                key.dp_rank
            ))
            .await;
        }
        // The whole message under one lock of the rank (a run of one-block
        // removals costs a fraction of one event each); its outcomes are
        // acted on after, in order.
        let mut outcomes = Vec::with_capacity(events.len());
        self.state.tiers.apply_batch(key, &events, &mut outcomes);
        for ((_, event), outcome) in events.iter().zip(outcomes) {
            count_outcome(&label, event, outcome);
            match outcome {
                kvroute_index::ApplyOutcome::Gap { expected, got } => {
                    ::metrics::counter!(metrics::EVENT_GAPS, "worker" => label.clone())
                        .increment(1);
                    tracing::debug!(worker = %label, expected, got, "event gap");
                    let asked = self
                        .pending
                        .get(&key.dp_rank)
                        .is_some_and(|r| r.from == expected);
                    if !asked {
                        self.request_resync(key.dp_rank, expected).await;
                    }
                }
                kvroute_index::ApplyOutcome::Applied { .. } => {
                    self.pending
                        .remove_if(&key.dp_rank, |_, r| !r.dump && event.event_id >= r.from);
                }
                kvroute_index::ApplyOutcome::Stale { .. } => {}
            }
        }
        self.ack(key);
    }

    /// Gathers one part of a rank's dump; with the last part, applies them all.
    /// `Err`: the parts held are over a budget, and the stream must end.
    pub(crate) async fn apply_dump_part(
        &self,
        dump: Dump,
        dumps: &mut DumpState,
    ) -> Result<(), Status> {
        let Some(key) = self.key(dump.dp_rank) else {
            self.send_error(format!("dp rank {} was not registered", dump.dp_rank))
                .await;
            return Ok(());
        };
        let rank = key.dp_rank;
        // A part of another dump than the one gathered: that one was abandoned.
        let parts = match dumps.parts.remove(&rank) {
            Some(parts) if parts.last_event_id == dump.last_event_id => parts,
            _ => DumpParts {
                last_event_id: dump.last_event_id,
                chains: Vec::new(),
                offload_chains: Vec::new(),
                blocks: 0,
                offload_blocks: 0,
                bytes: 0,
                budget: None,
            },
        };
        let Some(parts) = self.gather(key, parts, dump, dumps).await? else {
            return Ok(());
        };
        // Seconds for millions of blocks: off the async threads, so that other
        // streams and the connections' keepalive pings go on meanwhile.
        let index = self.state.tiers.clone();
        let orphans = tokio::task::spawn_blocking(move || {
            index.replace_worker(
                key,
                parts.last_event_id,
                &parts.chains,
                &parts.offload_chains,
            )
        })
        .await
        .unwrap_or_else(|e| std::panic::resume_unwind(e.into_panic()));
        dumps.applied.insert(rank);
        self.pending.remove(&rank);
        // The rank holds exactly what the worker says now: its claims start afresh.
        self.state.registry.restore_claims(key);
        let label = worker_label(key);
        ::metrics::counter!(metrics::DUMPS, "worker" => label.clone()).increment(1);
        if orphans > 0 {
            ::metrics::counter!(metrics::DUMP_ORPHANS, "worker" => label.clone())
                .increment(orphans);
            tracing::warn!(worker = %label, orphans, "dump blocks without their parent were not indexed");
        }
        tracing::info!(worker = %label, blocks = self.state.index.worker_blocks(key), "dump applied");
        self.ack(key);
        Ok(())
    }

    /// Adds `dump`'s chains to `parts`: the whole dump once its last part is in,
    /// `None` while more are due or when it is refused (stale, or too large);
    /// `Err` when the parts to hold are over a budget.
    async fn gather(
        &self,
        key: WorkerKey,
        mut parts: DumpParts,
        dump: Dump,
        dumps: &mut DumpState,
    ) -> Result<Option<DumpParts>, Status> {
        let rank = key.dp_rank;
        let applied = self.state.index.last_event_id(key);
        if dumps.applied.contains(&rank) && applied.is_some_and(|a| dump.last_event_id < a) {
            ::metrics::counter!(metrics::STALE_DUMPS, "worker" => worker_label(key)).increment(1);
            self.send_error(format!(
                "dump of dp rank {rank} as of event {} refused: event {} is applied already",
                dump.last_event_id,
                applied.unwrap_or_default()
            ))
            .await;
            return Ok(None);
        }
        if dump.more {
            self.hold_part(&mut parts, dump_bytes(&dump), dumps)?;
        }
        let blocks = |chains: &[kvroute_proto::Stored]| -> usize {
            chains.iter().map(|c| c.blocks.len()).sum()
        };
        parts.blocks += blocks(&dump.chains);
        parts.offload_blocks += blocks(&dump.offload_chains);
        let index = &self.state.config.index;
        for (held, max, name) in [
            (parts.blocks, index.max_blocks, "max_blocks"),
            (
                parts.offload_blocks,
                index.max_offload_blocks,
                "max_offload_blocks",
            ),
        ] {
            if held > max {
                limits::count(limits::DUMP_BLOCKS);
                self.send_error(format!(
                    "dump of dp rank {rank} refused: over {max} blocks (index.{name})"
                ))
                .await;
                return Ok(None);
            }
        }
        parts
            .chains
            .extend(dump.chains.into_iter().map(convert_stored));
        parts
            .offload_chains
            .extend(dump.offload_chains.into_iter().map(convert_stored));
        if dump.more {
            dumps.parts.insert(rank, parts);
            return Ok(None);
        }
        Ok(Some(parts))
    }

    /// Takes `bytes` more of the worker's and of all streams' budgets for
    /// dump parts held until their last part arrives.
    fn hold_part(
        &self,
        parts: &mut DumpParts,
        bytes: usize,
        dumps: &DumpState,
    ) -> Result<(), Status> {
        let ingest = &self.state.config.ingest;
        parts.bytes += bytes;
        let held = parts.bytes + dumps.parts.values().map(|p| p.bytes).sum::<usize>();
        let per_worker = ingest.dump_parts_bytes_per_worker;
        if held > per_worker {
            return Err(limits::refuse(
                limits::DUMP_PARTS_BYTES_PER_WORKER,
                Status::resource_exhausted(format!(
                    "unfinished dumps (Dump.more) of worker {} hold over {per_worker} bytes \
                     (ingest.dump_parts_bytes_per_worker): send the last part",
                    self.worker_id
                )),
            ));
        }
        let taken = u32::try_from(bytes).ok().and_then(|n| {
            Arc::clone(&self.state.dump_parts)
                .try_acquire_many_owned(n)
                .ok()
        });
        let Some(taken) = taken else {
            return Err(limits::refuse(
                limits::DUMP_PARTS_BYTES,
                Status::resource_exhausted(format!(
                    "unfinished dumps of all workers hold {} bytes (ingest.dump_parts_bytes): \
                     retry later",
                    ingest.dump_parts_bytes
                )),
            ));
        };
        match &mut parts.budget {
            Some(budget) => budget.merge(taken),
            None => parts.budget = Some(taken),
        }
        Ok(())
    }

    fn count_dropped_batch(&self) {
        ::metrics::counter!(metrics::DROPPED_BATCHES, "worker" => self.worker_id.to_string())
            .increment(1);
    }

    /// Asks for events from `from` on, with a first deadline for the answer.
    async fn request_resync(&self, dp_rank: u32, from: u64) {
        self.await_resync(dp_rank, from, false).await;
    }

    /// Asks for a full dump: a resync from event 0, which workers, numbering
    /// their events from 1 or resending only from their recent ones, answer
    /// with a dump. Events applied meanwhile do not settle it.
    async fn request_dump(&self, dp_rank: u32) {
        self.await_resync(dp_rank, 0, true).await;
    }

    async fn await_resync(&self, dp_rank: u32, from: u64, dump: bool) {
        if !self.holds {
            return;
        }
        let resync = Resync {
            from,
            attempts: 1,
            deadline: Instant::now() + resync_timeout(&self.state),
            dump,
        };
        self.pending.insert(dp_rank, resync);
        self.resync_asked.notify_one();
        self.send_resync(dp_rank, from).await;
    }

    /// Asks the worker to resend from `from` without awaiting the answer: the
    /// events are here already, and are missing only from the cluster's log.
    pub(crate) async fn ask_replay(&self, dp_rank: u32, from: u64) {
        self.send_resync(dp_rank, from).await;
    }

    async fn send_resync(&self, dp_rank: u32, from: u64) {
        ::metrics::counter!(metrics::RESYNCS, "worker" => self.worker_id.to_string()).increment(1);
        let body = router_message::Body::Resync(ResyncRequest {
            dp_rank,
            from_event_id: from,
        });
        // Must arrive: wait for room rather than drop it.
        let _ = self.out.send(message(body)).await;
    }

    fn ack(&self, key: WorkerKey) {
        if !self.holds {
            return;
        }
        if let Some(last_event_id) = self.state.index.last_event_id(key) {
            // Acks are advisory; a later one supersedes a dropped one.
            let _ = self.out.try_send(message(router_message::Body::Ack(Ack {
                dp_rank: key.dp_rank,
                last_event_id,
            })));
        }
    }

    /// Logs a warning and sends it to the worker, unless the stream has had
    /// its share of the interval already: then it is only counted.
    async fn send_error(&self, text: String) {
        if !self.holds {
            tracing::debug!(worker = self.worker_id, "{text}");
            return;
        }
        let (shown, ended) = self.warnings.lock().unwrap().admit(Instant::now());
        if ended > 0 {
            self.send_warning(self.suppressed_line(ended)).await;
        }
        if !shown {
            limits::count(limits::STREAM_WARNINGS);
            return;
        }
        self.send_warning(text).await;
    }

    async fn send_warning(&self, text: String) {
        tracing::warn!(worker = self.worker_id, "{text}");
        let _ = self
            .out
            .send(message(router_message::Body::Error(ErrorMessage {
                message: text,
            })))
            .await;
    }

    fn suppressed_line(&self, suppressed: u64) -> String {
        format!(
            "{suppressed} more warnings of this stream were suppressed \
             (at most {WARNINGS_PER_INTERVAL} are logged per {} s)",
            WARNING_INTERVAL.as_secs()
        )
    }

    fn report_load(&self, load: LoadReport) {
        if let Some(key) = self.key(load.dp_rank) {
            self.state.registry.report_load(
                key,
                ReportedLoad {
                    running_requests: load.running_requests,
                    queued_requests: load.queued_requests,
                    kv_blocks_used: load.kv_blocks_used,
                    kv_blocks_total: load.kv_blocks_total,
                    prefill_tokens: load.prefill_tokens_in_flight,
                },
            );
        }
    }

    /// The stream closed: out of routing now, purged after the grace period
    /// unless the worker registers again first.
    fn disconnected(&self, generation: u64) {
        let suppressed = std::mem::take(&mut self.warnings.lock().unwrap().suppressed);
        if suppressed > 0 {
            tracing::warn!(
                worker = self.worker_id,
                "{}",
                self.suppressed_line(suppressed)
            );
        }
        if let (Some(claim), Some(replica)) = (self.logged, self.state.replica.get()) {
            replica.release(self.worker_id, claim);
        }
        if !self.state.registry.disconnect(self.worker_id, generation) {
            return;
        }
        tracing::info!(worker = self.worker_id, "worker disconnected");
        let state = Arc::clone(&self.state);
        let worker_id = self.worker_id;
        let grace = Duration::from_millis(state.config.ingest.grace_period_ms);
        tokio::spawn(async move {
            tokio::time::sleep(grace).await;
            if let Some(keys) = state.registry.purge(worker_id, generation) {
                state.writers.forget(worker_id, generation);
                for key in keys {
                    state.tiers.remove_worker(key);
                    state.predicted.remove_worker(key);
                }
                tracing::info!(worker = worker_id, "worker purged after the grace period");
            }
        });
    }
}

impl HeldStream for Stream {
    fn worker_id(&self) -> u64 {
        self.worker_id
    }

    fn ask_replay(&self, dp_rank: u32, from: u64) -> futures_util::future::BoxFuture<'_, ()> {
        Box::pin(Stream::ask_replay(self, dp_rank, from))
    }

    fn clear_rank(&self, key: WorkerKey) {
        Stream::clear_rank(self, key);
    }
}

fn resync_timeout(state: &AppState) -> Duration {
    Duration::from_millis(state.config.ingest.resync_timeout_ms)
}

/// Sleeps until `deadline`, or for ever without one.
async fn sleep_until(deadline: Option<Instant>) {
    match deadline {
        Some(deadline) => tokio::time::sleep_until(deadline).await,
        None => std::future::pending().await,
    }
}

fn count_outcome(label: &str, event: &KvEvent, outcome: kvroute_index::ApplyOutcome) {
    ::metrics::counter!(
        metrics::EVENTS,
        "worker" => label.to_string(),
        "type" => event.kind.type_name().as_str(),
        "status" => outcome.status().as_str()
    )
    .increment(1);
    if let kvroute_index::ApplyOutcome::Applied {
        rejected_blocks,
        unknown_removals,
    } = outcome
    {
        if rejected_blocks > 0 {
            ::metrics::counter!(metrics::REJECTED_BLOCKS, "worker" => label.to_string())
                .increment(rejected_blocks);
        }
        if unknown_removals > 0 {
            ::metrics::counter!(metrics::UNKNOWN_REMOVALS, "worker" => label.to_string())
                .increment(unknown_removals);
        }
    }
}

pub(crate) fn convert_stored(stored: kvroute_proto::Stored) -> EventKind {
    EventKind::Stored {
        parent_hash: stored.parent_hash,
        blocks: stored
            .blocks
            .into_iter()
            .map(|b| StoredBlock {
                block_hash: b.block_hash,
                tokens_hash: b.tokens_hash,
            })
            .collect(),
    }
}

/// The event and its tier; `None` without a kind.
fn convert_event(event: kvroute_proto::KvEvent) -> Option<(Tier, KvEvent)> {
    let tier = convert_tier(event.tier());
    let kind = match event.kind? {
        kv_event::Kind::Stored(stored) => convert_stored(stored),
        kv_event::Kind::Removed(removed) => EventKind::Removed {
            block_hashes: removed.block_hashes,
        },
        kv_event::Kind::Cleared(_) => EventKind::Cleared,
    };
    Some((
        tier,
        KvEvent {
            event_id: event.event_id,
            kind,
        },
    ))
}

pub(crate) fn convert_tier(tier: kvroute_proto::Tier) -> Tier {
    match tier {
        kvroute_proto::Tier::Device => Tier::Device,
        kvroute_proto::Tier::Offload => Tier::Offload,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;
    use prost::Message as _;

    fn stored(event_id: u64, block_hash: u64, tokens_hash: u64) -> kvroute_proto::KvEvent {
        kvroute_proto::KvEvent {
            tier: Default::default(),
            event_id,
            kind: Some(kv_event::Kind::Stored(kvroute_proto::Stored {
                parent_hash: None,
                blocks: vec![kvroute_proto::StoredBlock {
                    block_hash,
                    tokens_hash,
                }],
            })),
        }
    }

    /// Paused time: the deadlines pass exactly when nothing else can run.
    #[tokio::test(start_paused = true)]
    async fn an_unanswered_resync_is_asked_again_then_the_rank_is_cleared() {
        let mut config = Config::default();
        config.ingest.resync_timeout_ms = 1_000;
        config.ingest.resync_attempts = 3;
        let state = AppState::new(config, None).unwrap();
        let key = WorkerKey::new(1, 0);
        let claim = state.writers.claim(1, 1, 0, &[0]).await.unwrap();
        let (out, mut out_rx) = mpsc::channel(16);
        let stream = Stream {
            state: Arc::clone(&state),
            worker_id: 1,
            dp_ranks: vec![0],
            out,
            pending: Pending::default(),
            resync_asked: Arc::default(),
            fence: claim.fence,
            holds: true,
            logged: None,
            warnings: Arc::default(),
        };
        let (work, work_rx) = mpsc::unbounded_channel();
        let queue = Arc::new(Semaphore::new(1 << 20));
        tokio::spawn(stream.apply_loop(work_rx, claim.applier_alive));
        let now = std::time::Instant::now();
        state
            .predicted
            .record_for(key, &[111, 222], now, Duration::from_secs(3_600));
        // Event 1 is applied; event 3 leaves a gap at 2 that nobody fills.
        let batch = EventBatch {
            dp_rank: 0,
            events: vec![stored(1, 11, 111), stored(3, 13, 333)],
        };
        let permit = Arc::clone(&queue).try_acquire_owned().unwrap();
        work.send(Work::Events(batch, permit)).unwrap();

        let started = Instant::now();
        let mut asked_at = Vec::new();
        while asked_at.len() < 3 {
            let message = tokio::time::timeout(Duration::from_secs(60), out_rx.recv())
                .await
                .expect("the resync request is sent again")
                .unwrap()
                .unwrap();
            if let Some(router_message::Body::Resync(resync)) = message.body {
                assert_eq!((resync.dp_rank, resync.from_event_id), (0, 2));
                asked_at.push(started.elapsed().as_millis());
                // Until given up, the rank keeps what it had.
                assert_eq!(state.index.worker_blocks(key), 1);
            }
        }
        assert_eq!(asked_at, [0, 1_000, 2_000]);
        assert_eq!(state.predicted.find_matches(&[111], now).len(), 1);

        // The last attempt's deadline passes: the rank is cleared, predictions too.
        tokio::time::sleep(Duration::from_millis(1_001)).await;
        assert_eq!(state.index.worker_blocks(key), 0);
        assert_eq!(state.index.last_event_id(key), None);
        assert!(state.predicted.find_matches(&[111], now).is_empty());
        // And nothing more is asked.
        tokio::time::sleep(Duration::from_secs(10)).await;
        while let Ok(message) = out_rx.try_recv() {
            let body = message.unwrap().body;
            assert!(
                !matches!(body, Some(router_message::Body::Resync(_))),
                "{body:?}"
            );
        }
        // Later events rebuild the rank from scratch.
        let batch = EventBatch {
            dp_rank: 0,
            events: vec![stored(9, 19, 999)],
        };
        let permit = Arc::clone(&queue).try_acquire_owned().unwrap();
        work.send(Work::Events(batch, permit)).unwrap();
        tokio::time::sleep(Duration::from_millis(1)).await;
        assert_eq!(state.index.last_event_id(key), Some(9));
    }

    #[tokio::test(start_paused = true)]
    async fn warnings_past_the_rate_are_counted_and_summed_up_once() {
        let mut warnings = Warnings::default();
        let shown = (0..25).filter(|_| warnings.admit(Instant::now()).0).count();
        assert_eq!(shown, WARNINGS_PER_INTERVAL as usize);
        tokio::time::sleep(WARNING_INTERVAL).await;
        assert_eq!(warnings.admit(Instant::now()), (true, 15));
        assert_eq!(warnings.admit(Instant::now()), (true, 0));
    }

    #[test]
    fn empty_events_are_queued_at_their_decoded_size() {
        let sent = EventBatch {
            dp_rank: 0,
            events: vec![kvroute_proto::KvEvent::default(); 65_536],
        };
        let wire = sent.encode_to_vec();
        assert_eq!(wire.len(), 2 * 65_536);
        let batch = EventBatch::decode(wire.as_slice()).unwrap();
        let wire = wire.len();
        assert!(batch_bytes(&batch) > 20 * wire, "{}", batch_bytes(&batch));
        let status = queue_bytes(batch_bytes(&batch), 1 << 20, "batch").unwrap_err();
        assert!(
            status.message().contains("ingest.event_queue_bytes"),
            "{status}"
        );
    }
}
