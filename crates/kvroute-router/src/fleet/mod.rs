//! The worker registry: who can take requests, how loaded each one is, and the
//! load-ordered structure that keeps scheduling independent of the fleet size.
//!
//! A *worker* is one HTTP endpoint (a worker id and a base URL) with one or more
//! data-parallel *ranks*; a rank (a [`WorkerKey`]) is what holds a KV cache and
//! what the scheduler picks. Every name a worker serves (its models and its LoRA
//! adapters) has a [`Group`] of the routable ranks that serve it.
//!
//! Invariants kept under the one lock:
//! - a rank is in the groups of its worker's names iff the worker is routable
//!   (connected or static, and not draining), with its current load key, and
//!   then holds those groups' numbers ([`crate::fleet::groups`]); a rank its worker's
//!   registration no longer lists is in no group;
//! - a rank's load key is a pure function of its booked and reported load, and
//!   is updated (removed and reinserted) whenever either changes.
//!
//! So the request path touches only matched ranks and the first few entries of
//! one group's load order: O(matches + log workers), never O(workers).
//!
//! What changes a rank's load and a worker's availability per request lives in
//! its own modules, under the same lock: [`crate::fleet::booking`] (the router's own
//! count of a request's load) and [`crate::fleet::breaker`] (failures that take a
//! worker out of routing).

pub mod booking;
pub mod breaker;
pub mod claims;
pub mod groups;
pub mod shared_load;

use std::collections::{BTreeSet, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use kvroute_index::WorkerKey;
use rustc_hash::{FxHashMap, FxHashSet};
use serde::Serialize;

use crate::config::{Config, Policy};
use crate::fleet::breaker::Breaker;
use crate::fleet::claims::{ClaimRules, Claims};
use crate::fleet::groups::{Group, GroupId, Groups};
use crate::fleet::shared_load::RankLoad;
use crate::metrics;

/// What a worker tells about itself, over gRPC or in the config file (or, from
/// another replica, in the cluster's registrations).
#[derive(Clone, Debug, PartialEq, Serialize, serde::Deserialize)]
pub struct Registration {
    pub worker_id: u64,
    pub dp_ranks: Vec<u32>,
    pub models: Vec<String>,
    pub lora_names: Vec<String>,
    pub base_url: String,
    pub total_kv_blocks: u64,
    /// The fingerprint of the router's tokenizer the worker declared it
    /// tokenizes with; empty if it declared none the router has.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub tokenizer: String,
}

impl Registration {
    /// For tests: worker `worker_id` with one rank serving model "m" at a
    /// loopback URL of its own.
    #[cfg(test)]
    pub(crate) fn for_test(worker_id: u64) -> Self {
        Self {
            worker_id,
            dp_ranks: vec![0],
            models: vec!["m".into()],
            lora_names: Vec::new(),
            base_url: format!("http://127.0.0.1:{}", 9000 + worker_id),
            total_kv_blocks: 1024,
            tokenizer: String::new(),
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Source {
    /// Registered over a gRPC stream; publishes events.
    Stream,
    /// Listed in the config; routed on predicted entries alone.
    Static,
}

/// Who registered a worker over a stream on this replica.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Claimant {
    /// `Register.instance_id`: only the same instance takes over a live stream.
    pub instance_id: u64,
    /// Which worker token, for `limits.max_workers_per_token`.
    pub token: usize,
}

/// A stream's registration, accepted.
#[derive(Debug)]
pub struct Registered {
    pub generation: u64,
    /// Disconnected workers purged early to make room for it, whose index
    /// entries the caller clears.
    pub evicted: Vec<Evicted>,
}

/// A disconnected worker purged before its grace period ended.
#[derive(Debug)]
pub struct Evicted {
    pub worker_id: u64,
    pub generation: u64,
    pub keys: Vec<WorkerKey>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Connection {
    Connected,
    Disconnected { since: Instant },
}

/// Load a rank reported itself, for blending with the router's own bookings.
#[derive(Clone, Copy, Debug, Default, Serialize)]
pub struct ReportedLoad {
    pub running_requests: u32,
    pub queued_requests: u32,
    pub kv_blocks_used: u64,
    pub kv_blocks_total: u64,
    pub prefill_tokens: u64,
}

pub struct Worker {
    pub id: u64,
    pub base_url: Arc<str>,
    pub models: Vec<String>,
    pub lora_names: Vec<String>,
    pub dp_ranks: Vec<u32>,
    pub total_kv_blocks: u64,
    /// [`Registration::tokenizer`].
    pub tokenizer: String,
    pub source: Source,
    /// Registered over a stream on this replica: by whom.
    pub claimant: Option<Claimant>,
    pub connection: Connection,
    pub draining: bool,
    /// Bumped by every registration, so a stale stream's end cannot disconnect a newer one.
    pub generation: u64,
    pub breaker: Breaker,
    /// On the runtime's clock, as bookings read it.
    pub last_request: tokio::time::Instant,
    /// A request failed on it in a way a client could cause as well as a dead
    /// worker (see [`Registry::suspect`]): its health is checked next round.
    suspect: bool,
    /// Tells requests waiting for the worker's response headers that it left
    /// routing ([`Registry::departed`]); dropped with the worker, which tells
    /// them too. Kept across its registrations.
    departures: tokio::sync::watch::Sender<()>,
    pub(crate) breaker_gauge: ::metrics::Gauge,
}

impl Worker {
    pub fn routable(&self) -> bool {
        self.connection == Connection::Connected && !self.draining
    }

    fn names(&self) -> impl Iterator<Item = &String> {
        self.models.iter().chain(&self.lora_names)
    }

    pub fn state_name(&self) -> &'static str {
        match (self.connection, self.draining, self.source) {
            (Connection::Disconnected { .. }, _, _) => "disconnected",
            (_, true, _) => "draining",
            _ if self.breaker.is_open() => "breaker_open",
            (_, _, Source::Static) => "static",
            (_, _, Source::Stream) => "connected",
        }
    }
}

pub struct Rank {
    pub booked_requests: u32,
    pub booked_prefill_tokens: u64,
    pub booked_blocks: u64,
    /// Other router replicas' bookings here, summed ([`crate::fleet::shared_load`]).
    pub remote: RankLoad,
    pub reported: ReportedLoad,
    /// The rank's position in its groups' load order.
    pub load_key: u64,
    /// Its worker's names' groups while the worker is routable, none while it
    /// is not: the groups whose load order holds the rank.
    groups: Vec<GroupId>,
    /// Recent time to first token per prefilled token, from its streams
    /// (see [`crate::fleet::booking`]); `None` until one is measured.
    pub prefill_seconds_per_token: Option<f64>,
    /// Recent time to first token per token the rank had to prefill up to it
    /// (those in flight when the request was booked, and its own): the rank's
    /// measured prefill rate, decode slow-down included, for the `seconds` cost.
    pub queued_seconds_per_token: Option<f64>,
    inflight_gauge: ::metrics::Gauge,
    prefill_gauge: ::metrics::Gauge,
    pub routed: ::metrics::Counter,
    /// Its judged claims, and whether its overlaps count in routing.
    pub claims: Claims,
}

impl Rank {
    /// Requests in flight: every replica's bookings, or the worker's own count
    /// if higher (its report may count requests no booking knows of).
    pub fn inflight(&self) -> u64 {
        let reported = self.reported.running_requests as u64 + self.reported.queued_requests as u64;
        (self.booked_requests as u64 + self.remote.requests).max(reported)
    }

    pub fn prefill_tokens(&self) -> u64 {
        (self.booked_prefill_tokens + self.remote.prefill_tokens).max(self.reported.prefill_tokens)
    }

    pub fn active_blocks(&self) -> u64 {
        (self.booked_blocks + self.remote.blocks).max(self.reported.kv_blocks_used)
    }
}

/// What a name is served as, over all registered workers in any state.
#[derive(Default, Clone)]
struct NameUse {
    models: usize,
    loras: usize,
    /// The tokenizer fingerprints its workers declared, each with how many
    /// declared it.
    tokenizers: Vec<(String, usize)>,
}

/// Fx-hashed maps: the request path looks ranks, workers and names up several
/// times per decision, and the keys are the fleet's, not clients', so SipHash's
/// flood resistance buys nothing here.
pub struct Fleet {
    pub workers: FxHashMap<u64, Worker>,
    pub ranks: FxHashMap<WorkerKey, Rank>,
    pub groups: Groups,
    names: FxHashMap<String, NameUse>,
    /// Workers whose breaker is not closed: the few the scheduler checks for a due probe.
    pub(crate) tripped: BTreeSet<u64>,
    /// Ranks whose bookings changed since other replicas were last told;
    /// `None` unless bookings are shared ([`crate::fleet::shared_load`]).
    pub(crate) changed_bookings: Option<FxHashSet<WorkerKey>>,
}

/// Load keys count the `kv` cost's rank part in sixteenths of a block.
const LOAD_KEY_SCALE: f64 = 16.0;

/// Tunables the registry needs from the config.
#[derive(Clone, Debug)]
pub struct Limits {
    pub block_size: u32,
    pub overlap_weight: f64,
    pub cost: crate::config::Cost,
    pub prefill_seconds_per_token: f64,
    pub decode_seconds_per_block: f64,
    pub overlap_slack: f64,
    pub overlap_decay_blocks: f64,
    pub busy_max_inflight: u32,
    pub busy_kv_ratio: f64,
    pub breaker_failures: u32,
    pub breaker_cooldown: Duration,
    pub policy: Policy,
    pub max_workers: usize,
    pub claims: ClaimRules,
    pub max_workers_per_token: usize,
    /// `limits.allowed_base_url_addresses`.
    pub allowed_addresses: Vec<std::net::IpAddr>,
}

impl Limits {
    pub fn from_config(config: &Config) -> Self {
        Self {
            block_size: config.block_size,
            overlap_weight: config.scheduler.overlap_weight,
            cost: config.scheduler.cost,
            prefill_seconds_per_token: config.scheduler.prefill_seconds_per_token,
            decode_seconds_per_block: config.scheduler.decode_seconds_per_block,
            overlap_slack: config.scheduler.overlap_slack,
            overlap_decay_blocks: config.scheduler.overlap_decay_blocks,
            busy_max_inflight: config.scheduler.busy_max_inflight,
            busy_kv_ratio: config.scheduler.busy_kv_ratio,
            breaker_failures: config.upstream.breaker_failures,
            breaker_cooldown: Duration::from_millis(config.upstream.breaker_cooldown_ms),
            policy: config.scheduler.policy,
            max_workers: config.limits.max_workers,
            claims: ClaimRules::from_config(&config.trust),
            max_workers_per_token: config.limits.max_workers_per_token,
            allowed_addresses: config.limits.allowed_base_url_addresses.clone(),
        }
    }
}

pub struct Registry {
    pub limits: Limits,
    fleet: Mutex<Fleet>,
    /// Signalled whenever load is released, to wake requests queued on busy workers.
    pub released: tokio::sync::Notify,
    /// The last registration's generation.
    generations: AtomicU64,
    /// Signalled when a booking changes while bookings are shared.
    pub bookings_changed: tokio::sync::Notify,
}

/// A worker as `/workers` shows it.
#[derive(Serialize)]
pub struct WorkerInfo {
    pub id: u64,
    pub base_url: String,
    pub models: Vec<String>,
    pub lora_names: Vec<String>,
    pub source: Source,
    pub state: &'static str,
    pub breaker: &'static str,
    pub total_kv_blocks: u64,
    pub ranks: Vec<RankInfo>,
}

#[derive(Serialize)]
pub struct RankInfo {
    pub dp_rank: u32,
    pub inflight_requests: u64,
    pub prefill_tokens: u64,
    pub active_blocks: u64,
    pub reported: ReportedLoad,
    /// Its claims kept failing: its overlaps do not count until it sends a dump.
    pub demoted: bool,
}

pub fn worker_label(key: WorkerKey) -> String {
    if key.dp_rank == 0 {
        key.worker_id.to_string()
    } else {
        format!("{}:{}", key.worker_id, key.dp_rank)
    }
}

impl Registry {
    pub fn new(limits: Limits) -> Self {
        Self {
            limits,
            fleet: Mutex::new(Fleet {
                workers: FxHashMap::default(),
                ranks: FxHashMap::default(),
                groups: Groups::default(),
                names: FxHashMap::default(),
                tripped: BTreeSet::new(),
                changed_bookings: None,
            }),
            released: tokio::sync::Notify::new(),
            generations: AtomicU64::new(0),
            bookings_changed: tokio::sync::Notify::new(),
        }
    }

    pub fn lock(&self) -> MutexGuard<'_, Fleet> {
        self.fleet
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Adds or replaces a worker; returns the registration's generation. A worker
    /// that registers again keeps its ranks' bookings (its requests are still in flight).
    pub fn register(&self, reg: Registration, source: Source) -> Result<u64, String> {
        let (base_url, dp_ranks) = self.check(&reg)?;
        let mut fleet = self.lock();
        let max = self.limits.max_workers;
        if !fleet.workers.contains_key(&reg.worker_id) && fleet.workers.len() >= max {
            crate::limits::count(crate::limits::WORKERS);
            return Err(format!(
                "{max} workers are registered already (limits.max_workers)"
            ));
        }
        Ok(self.insert(&mut fleet, reg, base_url, dp_ranks, source, None))
    }

    /// Registers a worker for the stream of `claimant` on this replica.
    ///
    /// A worker id whose stream is alive is taken over only by the same
    /// instance (a reconnect); another must wait for that stream to end or for
    /// an operator's removal. A worker disconnected and in its grace period
    /// keeps its slot only while there is room: a new worker that would go over
    /// `limits.max_workers`, or over its token's `limits.max_workers_per_token`,
    /// takes the slot of the worker disconnected longest that the limit counts,
    /// which is purged early. So one token's live workers never exceed its
    /// share, and its closed registrations hold no slot anyone else needs.
    pub fn register_stream(
        &self,
        reg: Registration,
        claimant: Claimant,
    ) -> Result<Registered, tonic::Status> {
        use crate::limits::{self, refuse};
        use tonic::Status;
        // A registration with models has only its base URL left to be wrong.
        let (base_url, dp_ranks) = self.check(&reg).map_err(|e| {
            if reg.models.is_empty() {
                Status::invalid_argument(e)
            } else {
                refuse(limits::BASE_URL, Status::invalid_argument(e))
            }
        })?;
        let id = reg.worker_id;
        let mut fleet = self.lock();
        if let Some(live) = fleet.workers.get(&id)
            && live.connection == Connection::Connected
            && live
                .claimant
                .is_some_and(|c| c.instance_id != claimant.instance_id)
        {
            return Err(refuse(
                limits::LIVE_WORKER_ID,
                Status::already_exists(format!(
                    "worker id {id} is connected on a live stream of another instance; \
                     it may register once that stream has ended, or after an operator \
                     removes the worker (DELETE /workers/{id} with the admin token)"
                )),
            ));
        }
        let mut evicted = Vec::new();
        let per_token = self.limits.max_workers_per_token;
        let of_token = |w: &Worker| w.claimant.is_some_and(|c| c.token == claimant.token);
        let held = fleet
            .workers
            .values()
            .filter(|w| w.id != id && of_token(w))
            .count();
        if held >= per_token {
            let Some(room) = fleet.make_room(id, of_token) else {
                return Err(refuse(
                    limits::WORKERS_PER_TOKEN,
                    Status::resource_exhausted(format!(
                        "{per_token} workers are registered with this token already \
                         (limits.max_workers_per_token)"
                    )),
                ));
            };
            evicted.push(room);
        }
        let max = self.limits.max_workers;
        if !fleet.workers.contains_key(&id) && fleet.workers.len() >= max {
            let Some(room) = fleet.make_room(id, |_| true) else {
                return Err(refuse(
                    limits::WORKERS,
                    Status::resource_exhausted(format!(
                        "{max} workers are registered already (limits.max_workers)"
                    )),
                ));
            };
            evicted.push(room);
        }
        let generation = self.insert(
            &mut fleet,
            reg,
            base_url,
            dp_ranks,
            Source::Stream,
            Some(claimant),
        );
        Ok(Registered {
            generation,
            evicted,
        })
    }

    /// A registration's base URL and ranks, checked before the lock is taken.
    fn check(&self, reg: &Registration) -> Result<(String, Vec<u32>), String> {
        if reg.models.is_empty() {
            return Err("a worker must serve at least one model".into());
        }
        let base_url =
            crate::http::worker_url::parse_base_url(&reg.base_url, &self.limits.allowed_addresses)?;
        let dp_ranks = if reg.dp_ranks.is_empty() {
            vec![0]
        } else {
            reg.dp_ranks.clone()
        };
        Ok((base_url, dp_ranks))
    }

    fn insert(
        &self,
        fleet: &mut Fleet,
        reg: Registration,
        base_url: String,
        dp_ranks: Vec<u32>,
        source: Source,
        claimant: Option<Claimant>,
    ) -> u64 {
        // Its requests in flight stay: a registration again is not a departure.
        let departures = fleet.workers.get(&reg.worker_id).map_or_else(
            || tokio::sync::watch::Sender::new(()),
            |w| w.departures.clone(),
        );
        fleet.remove_worker_entry(reg.worker_id, false);
        // Unique across workers and removals, so a later registration always has a
        // greater generation, even after the worker was forgotten in between.
        let generation = self.generations.fetch_add(1, Ordering::Relaxed) + 1;
        let worker = Worker {
            id: reg.worker_id,
            base_url: base_url.into(),
            models: reg.models,
            lora_names: reg.lora_names,
            dp_ranks,
            total_kv_blocks: reg.total_kv_blocks,
            tokenizer: reg.tokenizer,
            source,
            claimant,
            connection: Connection::Connected,
            draining: false,
            generation,
            breaker: Breaker::default(),
            last_request: tokio::time::Instant::now(),
            suspect: false,
            departures,
            breaker_gauge: ::metrics::gauge!(metrics::BREAKER_STATE, "worker" => reg.worker_id.to_string()),
        };
        worker.breaker_gauge.set(0.0);
        for &dp_rank in &worker.dp_ranks {
            let key = WorkerKey::new(worker.id, dp_rank);
            fleet
                .ranks
                .entry(key)
                .or_insert_with(|| new_rank(key, self.limits.policy));
        }
        for name in worker.names() {
            let usage = fleet.names.entry(name.clone()).or_default();
            if worker.models.contains(name) {
                usage.models += 1;
            } else {
                usage.loras += 1;
            }
            if !worker.tokenizer.is_empty() {
                match usage
                    .tokenizers
                    .iter_mut()
                    .find(|(f, _)| *f == worker.tokenizer)
                {
                    Some((_, count)) => *count += 1,
                    None => usage.tokenizers.push((worker.tokenizer.clone(), 1)),
                }
            }
        }
        fleet.workers.insert(worker.id, worker);
        fleet.refresh_membership(reg.worker_id, &self.limits);
        generation
    }

    /// A stream ended: out of routing at once. False if a newer registration owns the worker.
    pub fn disconnect(&self, worker_id: u64, generation: u64) -> bool {
        let mut fleet = self.lock();
        let Some(worker) = fleet.workers.get_mut(&worker_id) else {
            return false;
        };
        if worker.generation != generation {
            return false;
        }
        worker.connection = Connection::Disconnected {
            since: Instant::now(),
        };
        Self::departed(worker);
        fleet.refresh_membership(worker_id, &self.limits);
        true
    }

    /// A departure's receiver for a request booked on the worker now.
    pub(crate) fn departures(
        fleet: &Fleet,
        worker_id: u64,
    ) -> Option<tokio::sync::watch::Receiver<()>> {
        fleet
            .workers
            .get(&worker_id)
            .map(|w| w.departures.subscribe())
    }

    /// The worker left routing (disconnected, or its breaker opened): its
    /// requests still waiting for response headers give up, and go to
    /// another worker if they may.
    pub(crate) fn departed(worker: &Worker) {
        worker.departures.send_replace(());
    }

    /// A request failed on the worker in a way that does not tell whether the
    /// worker is at fault (its connection closed mid-request): its health is
    /// checked at the next health round, whatever its traffic, and that
    /// check's outcome goes to its breaker.
    pub fn suspect(&self, worker_id: u64) {
        if let Some(worker) = self.lock().workers.get_mut(&worker_id) {
            worker.suspect = true;
        }
    }

    /// After the grace period: forgets the worker if it is still the same disconnected
    /// registration. Returns its ranks, for purging the indexes.
    pub fn purge(&self, worker_id: u64, generation: u64) -> Option<Vec<WorkerKey>> {
        self.remove_if(worker_id, |w| {
            w.generation == generation && w.connection != Connection::Connected
        })
    }

    /// Admin removal; returns the worker's ranks, for purging the indexes.
    pub fn remove(&self, worker_id: u64) -> Option<Vec<WorkerKey>> {
        self.remove_if(worker_id, |_| true)
    }

    fn remove_if(
        &self,
        worker_id: u64,
        condition: impl Fn(&Worker) -> bool,
    ) -> Option<Vec<WorkerKey>> {
        let mut fleet = self.lock();
        let worker = fleet.workers.get(&worker_id).filter(|w| condition(w))?;
        let keys = worker
            .dp_ranks
            .iter()
            .map(|&r| WorkerKey::new(worker_id, r))
            .collect();
        fleet.remove_worker_entry(worker_id, true);
        Some(keys)
    }

    /// No new requests; in-flight ones finish.
    pub fn drain(&self, worker_id: u64) -> bool {
        let mut fleet = self.lock();
        let Some(worker) = fleet.workers.get_mut(&worker_id) else {
            return false;
        };
        worker.draining = true;
        fleet.refresh_membership(worker_id, &self.limits);
        true
    }

    pub fn report_load(&self, key: WorkerKey, load: ReportedLoad) {
        let mut fleet = self.lock();
        fleet.update_rank(key, &self.limits, |rank| rank.reported = load);
        drop(fleet);
        self.released.notify_waiters();
    }

    /// Judges the claim of `claimed` tokens a response from `key` answered
    /// with `reported` cached tokens ([`crate::fleet::claims`]); the fleet is locked
    /// only for a claim large enough to judge.
    pub fn judge_claim(&self, key: WorkerKey, claimed: u64, reported: u64) {
        let rules = &self.limits.claims;
        let Some(failed) = rules.failed(claimed, reported, u64::from(self.limits.block_size))
        else {
            return;
        };
        let mut fleet = self.lock();
        let Some(rank) = fleet.ranks.get_mut(&key) else {
            return;
        };
        if rank.claims.record(failed, rules) {
            drop(fleet);
            tracing::warn!(
                worker = %worker_label(key),
                failed = rules.max_failed,
                judged = rules.window,
                "the worker's responses keep reporting far fewer cached tokens than its KV events \
                 claim: its overlaps no longer count in routing until it sends a full dump"
            );
        }
    }

    /// A full dump replaced `key`'s index state: its claims count again.
    pub fn restore_claims(&self, key: WorkerKey) {
        let restored = self
            .lock()
            .ranks
            .get_mut(&key)
            .is_some_and(|rank| rank.claims.restore());
        if restored {
            tracing::info!(worker = %worker_label(key), "a full dump restored the worker's claims");
        }
    }

    /// Workers due a health check: those with no request for `quiet`, and the
    /// suspect ones ([`Self::suspect`]), no longer suspect from now: (id, base URL).
    pub fn due_health_checks(&self, quiet: Duration) -> Vec<(u64, Arc<str>)> {
        let now = tokio::time::Instant::now();
        self.lock()
            .workers
            .values_mut()
            .filter(|w| w.connection == Connection::Connected)
            .filter_map(|w| {
                let due =
                    std::mem::take(&mut w.suspect) || now.duration_since(w.last_request) >= quiet;
                due.then(|| (w.id, Arc::clone(&w.base_url)))
            })
            .collect()
    }

    /// Whether `name` is a LoRA adapter (hashed with its seed) rather than a base
    /// model; `None` if no registered worker serves it at all.
    pub fn name_kind(&self, name: &str) -> Option<NameKind> {
        let fleet = self.lock();
        let usage = fleet.names.get(name)?;
        Some(if usage.models > 0 {
            NameKind::Model
        } else {
            NameKind::Lora
        })
    }

    /// Which of `fingerprints` the most registered workers serving `name`
    /// declared, as an index into it: the first of those tied, and 0 when
    /// none of them declared any.
    pub fn most_declared_tokenizer(&self, name: &str, fingerprints: &[&str]) -> usize {
        let fleet = self.lock();
        let Some(usage) = fleet.names.get(name) else {
            return 0;
        };
        let declared = |fingerprint: &str| {
            usage
                .tokenizers
                .iter()
                .find(|(f, _)| f == fingerprint)
                .map_or(0, |&(_, count)| count)
        };
        (0..fingerprints.len())
            .max_by_key(|&i| (declared(fingerprints[i]), std::cmp::Reverse(i)))
            .unwrap_or(0)
    }

    /// Names served by routable workers, sorted.
    pub fn served_names(&self) -> Vec<String> {
        let fleet = self.lock();
        let mut names: Vec<String> = fleet
            .groups
            .iter()
            .filter(|(_, g)| !g.members.is_empty())
            .map(|(n, _)| n.to_owned())
            .collect();
        names.sort();
        names
    }

    pub fn contains(&self, worker_id: u64) -> bool {
        self.lock().workers.contains_key(&worker_id)
    }

    /// Whether a routable rank of `worker_id` serves `name`.
    pub fn serves(&self, worker_id: u64, name: &str) -> bool {
        self.lock()
            .groups
            .get(name)
            .is_some_and(|g| g.members.iter().any(|k| k.worker_id == worker_id))
    }

    /// The base URL of `worker_id` while it is connected (draining or not):
    /// where what it stores can still be asked for.
    pub fn connected_base_url(&self, worker_id: u64) -> Option<Arc<str>> {
        let fleet = self.lock();
        let worker = fleet.workers.get(&worker_id)?;
        (worker.connection == Connection::Connected).then(|| Arc::clone(&worker.base_url))
    }

    pub fn any_routable(&self) -> bool {
        self.lock()
            .groups
            .iter()
            .any(|(_, g)| !g.members.is_empty())
    }

    pub fn worker_info(&self, worker_id: Option<u64>) -> Vec<WorkerInfo> {
        let fleet = self.lock();
        let mut infos: Vec<WorkerInfo> = fleet
            .workers
            .values()
            .filter(|w| worker_id.is_none_or(|id| id == w.id))
            .map(|w| WorkerInfo {
                id: w.id,
                base_url: w.base_url.to_string(),
                models: w.models.clone(),
                lora_names: w.lora_names.clone(),
                source: w.source,
                state: w.state_name(),
                breaker: w.breaker.name(),
                total_kv_blocks: w.total_kv_blocks,
                ranks: w
                    .dp_ranks
                    .iter()
                    .filter_map(|&r| {
                        let rank = fleet.ranks.get(&WorkerKey::new(w.id, r))?;
                        Some(RankInfo {
                            dp_rank: r,
                            inflight_requests: rank.inflight(),
                            prefill_tokens: rank.prefill_tokens(),
                            active_blocks: rank.active_blocks(),
                            reported: rank.reported,
                            demoted: rank.claims.demoted(),
                        })
                    })
                    .collect(),
            })
            .collect();
        infos.sort_by_key(|w| w.id);
        infos
    }

    /// Ranks per worker state, for the `kvroute_workers` gauge.
    pub fn state_counts(&self) -> HashMap<&'static str, u64> {
        let fleet = self.lock();
        let mut counts: HashMap<&'static str, u64> = [
            "connected",
            "static",
            "disconnected",
            "draining",
            "breaker_open",
        ]
        .into_iter()
        .map(|s| (s, 0))
        .collect();
        for w in fleet.workers.values() {
            *counts.entry(w.state_name()).or_default() += w.dp_ranks.len() as u64;
        }
        counts
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NameKind {
    Model,
    Lora,
}

fn new_rank(key: WorkerKey, policy: Policy) -> Rank {
    let label = worker_label(key);
    Rank {
        booked_requests: 0,
        booked_prefill_tokens: 0,
        booked_blocks: 0,
        remote: RankLoad::default(),
        reported: ReportedLoad::default(),
        load_key: 0,
        groups: Vec::new(),
        prefill_seconds_per_token: None,
        queued_seconds_per_token: None,
        inflight_gauge: ::metrics::gauge!(metrics::WORKER_INFLIGHT, "worker" => label.clone()),
        prefill_gauge: ::metrics::gauge!(metrics::WORKER_PREFILL, "worker" => label.clone()),
        routed: ::metrics::counter!(metrics::ROUTED, "worker" => label, "policy" => policy.as_str()),
        claims: Claims::new(key),
    }
}

impl Fleet {
    /// Whether `key` can take a new request now: its worker is routable, its
    /// breaker lets a request through and it is under its busy thresholds.
    pub fn available(&self, key: WorkerKey, limits: &Limits, now: tokio::time::Instant) -> bool {
        let (Some(worker), Some(rank)) = (self.workers.get(&key.worker_id), self.ranks.get(&key))
        else {
            return false;
        };
        worker.routable() && worker.breaker.available(now) && !is_busy(worker, rank, limits)
    }

    /// A rank for `group` whose worker's breaker is due a probe (open past its
    /// cool-down) and that `usable` accepts.
    /// The scheduler sends it the next request whatever its cost: otherwise a
    /// worker that is never the cheapest would never be probed, and its breaker
    /// never closed. O(tripped workers), which is almost always none.
    pub fn probe_due(
        &self,
        group: &Group,
        now: tokio::time::Instant,
        usable: impl Fn(WorkerKey) -> bool,
    ) -> Option<WorkerKey> {
        self.tripped
            .iter()
            .filter_map(|id| self.workers.get(id))
            .filter(|w| w.breaker.available(now))
            .flat_map(|w| w.dp_ranks.iter().map(|&r| WorkerKey::new(w.id, r)))
            .find(|&k| group.members.binary_search(&k).is_ok() && usable(k))
    }

    /// When the first cool-down of a tripped worker serving `group` (and not
    /// in `exclude`) ends: a request that found every rank busy waits at most
    /// until then, as that worker's probe may be due.
    pub fn next_probe_at(
        &self,
        group: &Group,
        exclude: &[u64],
        now: tokio::time::Instant,
    ) -> Option<tokio::time::Instant> {
        self.tripped
            .iter()
            .filter(|id| !exclude.contains(id))
            .filter_map(|id| self.workers.get(id))
            .filter(|w| {
                w.dp_ranks.iter().any(|&r| {
                    group
                        .members
                        .binary_search(&WorkerKey::new(w.id, r))
                        .is_ok()
                })
            })
            .filter_map(|w| w.breaker.probe_at(now))
            .min()
    }

    /// The part of the `kv` cost that depends on the rank alone, scaled to an integer
    /// so that it orders ranks in a BTreeSet.
    fn load_key(rank: &Rank, limits: &Limits) -> u64 {
        let cost = limits.overlap_weight * rank.prefill_tokens() as f64 / limits.block_size as f64
            + rank.active_blocks() as f64;
        (cost * LOAD_KEY_SCALE) as u64
    }

    /// That part of the cost for a load key: truncated, the key keeps at
    /// least this much of it (up to rounding).
    pub(crate) fn load_from_key(load_key: u64) -> f64 {
        load_key as f64 / LOAD_KEY_SCALE
    }

    /// Changes the rank at `key` by `change` (one lookup for both) and re-keys
    /// it in the load order; `None` if there is no such rank.
    pub(crate) fn update_rank<R>(
        &mut self,
        key: WorkerKey,
        limits: &Limits,
        change: impl FnOnce(&mut Rank) -> R,
    ) -> Option<R> {
        let rank = self.ranks.get_mut(&key)?;
        let changed = change(rank);
        rank.inflight_gauge.set(rank.inflight() as f64);
        rank.prefill_gauge.set(rank.prefill_tokens() as f64);
        let new_key = Self::load_key(rank, limits);
        let old_key = std::mem::replace(&mut rank.load_key, new_key);
        if old_key != new_key {
            for &id in &rank.groups {
                let by_load = &mut self.groups[id].by_load;
                by_load.remove(&(old_key, key));
                by_load.insert((new_key, key));
            }
        }
        Some(changed)
    }

    /// Puts the worker's ranks into its groups if routable, takes them out if not.
    fn refresh_membership(&mut self, worker_id: u64, limits: &Limits) {
        let Some(worker) = self.workers.get(&worker_id) else {
            return;
        };
        let routable = worker.routable();
        let ids: Vec<GroupId> = worker
            .names()
            .map(|name| self.groups.id_or_insert(name))
            .collect();
        for &dp_rank in &worker.dp_ranks {
            let key = WorkerKey::new(worker_id, dp_rank);
            let Some(rank) = self.ranks.get_mut(&key) else {
                continue;
            };
            rank.load_key = Self::load_key(rank, limits);
            rank.groups = if routable { ids.clone() } else { Vec::new() };
            for &id in &ids {
                let group = &mut self.groups[id];
                group.by_load.retain(|&(_, k)| k != key);
                let pos = group.members.binary_search(&key);
                match (routable, pos) {
                    (true, Err(at)) => group.members.insert(at, key),
                    (false, Ok(at)) => {
                        group.members.remove(at);
                    }
                    _ => {}
                }
                if routable {
                    group.by_load.insert((rank.load_key, key));
                }
            }
        }
    }

    /// Takes a worker out entirely; `drop_ranks` also forgets its ranks' load.
    /// Purges the worker other than `id` disconnected longest among those
    /// `counted`, to make room for `id`; `None` if none is disconnected.
    fn make_room(&mut self, id: u64, counted: impl Fn(&Worker) -> bool) -> Option<Evicted> {
        let oldest = self
            .workers
            .values()
            .filter(|w| w.id != id && counted(w))
            .filter_map(|w| match w.connection {
                Connection::Disconnected { since } => Some((since, w.id, w.generation)),
                Connection::Connected => None,
            })
            .min()?;
        let (_, worker_id, generation) = oldest;
        let keys = self.workers[&worker_id]
            .dp_ranks
            .iter()
            .map(|&r| WorkerKey::new(worker_id, r))
            .collect();
        self.remove_worker_entry(worker_id, true);
        Some(Evicted {
            worker_id,
            generation,
            keys,
        })
    }

    fn remove_worker_entry(&mut self, worker_id: u64, drop_ranks: bool) {
        let Some(worker) = self.workers.remove(&worker_id) else {
            return;
        };
        self.tripped.remove(&worker_id);
        // Kept ranks leave their groups too: a registration again puts back those it lists.
        for &dp_rank in &worker.dp_ranks {
            if let Some(rank) = self.ranks.get_mut(&WorkerKey::new(worker_id, dp_rank)) {
                rank.groups.clear();
            }
        }
        for name in worker.names() {
            if let Some(id) = self.groups.id(name) {
                let group = &mut self.groups[id];
                group.by_load.retain(|&(_, k)| k.worker_id != worker_id);
                group.members.retain(|k| k.worker_id != worker_id);
                if group.members.is_empty() {
                    self.groups.remove(name);
                }
            }
            if let Some(usage) = self.names.get_mut(name) {
                if worker.models.contains(name) {
                    usage.models -= 1;
                } else {
                    usage.loras -= 1;
                }
                if let Some(at) = usage
                    .tokenizers
                    .iter()
                    .position(|(f, _)| *f == worker.tokenizer)
                {
                    usage.tokenizers[at].1 -= 1;
                    if usage.tokenizers[at].1 == 0 {
                        usage.tokenizers.swap_remove(at);
                    }
                }
                if usage.models + usage.loras == 0 {
                    self.names.remove(name);
                }
            }
        }
        if drop_ranks {
            for &dp_rank in &worker.dp_ranks {
                self.ranks.remove(&WorkerKey::new(worker_id, dp_rank));
            }
            // Under the fleet lock, so a newer registration's series are not forgotten.
            metrics::forget_worker(worker_id);
        }
    }
}

fn is_busy(worker: &Worker, rank: &Rank, limits: &Limits) -> bool {
    if limits.busy_max_inflight > 0 && rank.inflight() >= limits.busy_max_inflight as u64 {
        return true;
    }
    let total = if rank.reported.kv_blocks_total > 0 {
        rank.reported.kv_blocks_total
    } else {
        worker.total_kv_blocks
    };
    limits.busy_kv_ratio < 1.0
        && total > 0
        && rank.active_blocks() as f64 >= limits.busy_kv_ratio * total as f64
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    pub(crate) fn limits() -> Limits {
        Limits::from_config(&Config::default())
    }

    pub(crate) fn reg(id: u64, models: &[&str]) -> Registration {
        Registration {
            worker_id: id,
            dp_ranks: vec![0],
            models: models.iter().map(|m| m.to_string()).collect(),
            lora_names: vec!["adapter".into()],
            base_url: format!("http://127.0.0.1:{}", 9000 + id),
            total_kv_blocks: 100,
            tokenizer: String::new(),
        }
    }

    /// A hostile first worker does not pick the tokenizer of a name: the one
    /// most of its workers declared does, and leaving takes its vote away.
    #[test]
    fn a_names_tokenizer_is_the_one_most_of_its_workers_declared() {
        let registry = Registry::new(Limits::from_config(&Config::default()));
        let declaring = |id, fingerprint: &str| Registration {
            tokenizer: fingerprint.into(),
            ..reg(id, &["m"])
        };
        let fingerprints = ["aa", "bb"];
        assert_eq!(registry.most_declared_tokenizer("m", &fingerprints), 0);
        registry
            .register(declaring(1, "bb"), Source::Stream)
            .unwrap();
        assert_eq!(registry.most_declared_tokenizer("m", &fingerprints), 1);
        registry
            .register(declaring(2, "aa"), Source::Stream)
            .unwrap();
        assert_eq!(
            registry.most_declared_tokenizer("m", &fingerprints),
            0,
            "a tie goes to the first configured"
        );
        registry
            .register(declaring(3, "aa"), Source::Stream)
            .unwrap();
        registry.register(declaring(4, ""), Source::Stream).unwrap();
        assert_eq!(registry.most_declared_tokenizer("m", &fingerprints), 0);
        assert_eq!(
            registry.most_declared_tokenizer("adapter", &fingerprints),
            0
        );
        registry.remove(2).unwrap();
        registry.remove(3).unwrap();
        assert_eq!(registry.most_declared_tokenizer("m", &fingerprints), 1);
        assert_eq!(registry.most_declared_tokenizer("other", &fingerprints), 0);
    }

    /// The invariant: group members are exactly the routable ranks, each in the
    /// load order under its current key, and a rank holds the numbers of
    /// exactly the groups it is a member of.
    fn check_invariant(registry: &Registry) {
        let fleet = registry.lock();
        for (name, group) in fleet.groups.iter() {
            assert_eq!(group.members.len(), group.by_load.len(), "{name}");
            let id = fleet.groups.id(name).unwrap();
            for &(load_key, key) in &group.by_load {
                assert_eq!(fleet.ranks[&key].load_key, load_key);
                assert!(fleet.workers[&key.worker_id].routable());
                assert!(fleet.ranks[&key].groups.contains(&id), "{name} {key:?}");
            }
        }
        for (key, rank) in &fleet.ranks {
            for &id in &rank.groups {
                assert!(fleet.groups[id].members.contains(key), "{key:?}");
            }
        }
    }

    #[test]
    fn bookings_reorder_and_release_restores() {
        let registry = Arc::new(Registry::new(limits()));
        for id in 1..=3 {
            registry.register(reg(id, &["m"]), Source::Stream).unwrap();
        }
        let mut booking = registry.book(WorkerKey::new(1, 0), 64, 4);
        check_invariant(&registry);
        {
            let fleet = registry.lock();
            let last = fleet
                .groups
                .get("m")
                .unwrap()
                .by_load
                .iter()
                .last()
                .unwrap()
                .1;
            assert_eq!(last, WorkerKey::new(1, 0));
        }
        booking.release_prefill();
        check_invariant(&registry);
        drop(booking);
        check_invariant(&registry);
        assert_eq!(registry.lock().ranks[&WorkerKey::new(1, 0)].load_key, 0);
    }

    /// A rank a registration no longer lists keeps its load (its requests are
    /// still in flight) but not its place: their release must not put it back in
    /// the load order, where the scheduler could pick it.
    #[test]
    fn a_rank_a_registration_drops_stays_out_of_the_load_order() {
        let registry = Arc::new(Registry::new(limits()));
        let mut two_ranks = reg(1, &["m"]);
        two_ranks.dp_ranks = vec![0, 1];
        registry.register(two_ranks, Source::Stream).unwrap();
        let booking = registry.book(WorkerKey::new(1, 1), 64, 4);
        registry.register(reg(1, &["m"]), Source::Stream).unwrap();
        drop(booking);
        check_invariant(&registry);
        let fleet = registry.lock();
        let ranks: Vec<WorkerKey> = fleet
            .groups
            .get("m")
            .unwrap()
            .by_load
            .iter()
            .map(|&(_, k)| k)
            .collect();
        assert_eq!(ranks, vec![WorkerKey::new(1, 0)]);
    }

    #[test]
    fn disconnect_drain_and_purge_keep_groups_consistent() {
        let registry = Arc::new(Registry::new(limits()));
        let g1 = registry.register(reg(1, &["m"]), Source::Stream).unwrap();
        registry
            .register(reg(2, &["m", "n"]), Source::Stream)
            .unwrap();
        assert_eq!(registry.name_kind("adapter"), Some(NameKind::Lora));
        assert!(registry.disconnect(1, g1));
        check_invariant(&registry);
        assert_eq!(registry.lock().groups.get("m").unwrap().members.len(), 1);
        // A reconnect takes over; the old stream's purge must not remove it.
        let g2 = registry.register(reg(1, &["m"]), Source::Stream).unwrap();
        assert!(registry.purge(1, g1).is_none());
        assert!(!registry.disconnect(1, g1));
        assert!(registry.drain(2));
        check_invariant(&registry);
        assert_eq!(registry.served_names(), vec!["adapter", "m"]);
        assert!(registry.disconnect(1, g2));
        assert_eq!(registry.purge(1, g2), Some(vec![WorkerKey::new(1, 0)]));
        check_invariant(&registry);
        assert!(!registry.any_routable());
        assert_eq!(registry.name_kind("m"), Some(NameKind::Model));
        registry.remove(2);
        assert_eq!(registry.name_kind("m"), None);
    }

    #[test]
    fn a_live_id_is_kept_and_closed_registrations_make_room_within_each_token() {
        let mut limits = limits();
        limits.max_workers = 3;
        limits.max_workers_per_token = 2;
        let registry = Registry::new(limits);
        let by = |token, instance_id| Claimant { instance_id, token };
        registry.register_stream(reg(1, &["m"]), by(0, 1)).unwrap();
        // Another instance may not take a live id; the same one reconnects.
        let status = registry
            .register_stream(reg(1, &["m"]), by(0, 2))
            .unwrap_err();
        assert_eq!(status.code(), tonic::Code::AlreadyExists);
        assert!(status.message().contains("DELETE /workers/1"), "{status}");
        let g1 = registry
            .register_stream(reg(1, &["m"]), by(0, 1))
            .unwrap()
            .generation;
        registry.register_stream(reg(2, &["m"]), by(0, 1)).unwrap();
        // Token 0 has its two: a third is refused while both are connected.
        let status = registry
            .register_stream(reg(3, &["m"]), by(0, 1))
            .unwrap_err();
        assert!(
            status.message().contains("max_workers_per_token"),
            "{status}"
        );
        // Closed, worker 1 gives its slot to the token's next worker.
        assert!(registry.disconnect(1, g1));
        let registered = registry.register_stream(reg(3, &["m"]), by(0, 1)).unwrap();
        let evicted: Vec<u64> = registered.evicted.iter().map(|e| e.worker_id).collect();
        assert_eq!(evicted, [1]);
        assert!(!registry.contains(1));
        // Token 1 fills the registry; nothing is disconnected to make room.
        let g4 = registry
            .register_stream(reg(4, &["m"]), by(1, 1))
            .unwrap()
            .generation;
        let status = registry
            .register_stream(reg(5, &["m"]), by(1, 1))
            .unwrap_err();
        assert!(
            status.message().contains("(limits.max_workers)"),
            "{status}"
        );
        // Over max_workers, the worker disconnected longest goes, whoever's it is.
        assert!(registry.disconnect(4, g4));
        let registered = registry.register_stream(reg(5, &["m"]), by(2, 1)).unwrap();
        assert_eq!(registered.evicted[0].worker_id, 4);
        check_invariant(&registry);
    }
}
