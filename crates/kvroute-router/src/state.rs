//! The router's shared state, and the one routing entry point that the HTTP API,
//! the proxy and the `Route` RPC all use, so that a dry run and a proxied request
//! decide the same way.

use std::sync::Arc;

use kvroute_index::{
    BlockHasher, ExtraKeys, IndexConfig, KvIndex, PredictedConfig, PredictedIndex, TieredIndex,
};

use crate::auth::Credentials;
use crate::config::{Config, Policy};
use crate::error::RouterError;
use crate::fleet::booking::Booking;
use crate::fleet::shared_load::SharedPrediction;
use crate::fleet::{Limits, NameKind, Registration, Registry, Source};
use crate::http::upstream::Upstream;
use crate::ingest::writers::Writers;
use crate::metrics;
use crate::replica::Replica;
use crate::schedule::queue::WaitQueue;
use crate::schedule::sessions::{Outcome, SessionRoute, Sessions};
use crate::schedule::{Decision, NoWorker, Pool, RouteQuery, Scheduler};
use crate::series::Renderer;
use crate::tokenize::RouterTokenizer;

pub struct AppState {
    pub config: Config,
    pub credentials: Credentials,
    pub registry: Arc<Registry>,
    /// The device tier's index: `tiers.device`.
    pub index: Arc<KvIndex>,
    /// Both tiers; events and dumps go through it (see kvroute-index's `tiers`).
    pub tiers: TieredIndex,
    pub predicted: Arc<PredictedIndex>,
    pub scheduler: Scheduler,
    pub tokenizer: RouterTokenizer,
    pub upstream: Upstream,
    pub metrics: Option<Renderer>,
    /// Which event stream may write each worker's index entries.
    pub writers: Writers,
    /// Set once at start with `[cluster]`: this replica's side of the shared log.
    pub replica: std::sync::OnceLock<Arc<Replica>>,
    /// Set once at start with `[cluster]` sharing load: where this replica's
    /// predictions go for the others ([`crate::fleet::shared_load`]).
    pub shared_predictions: std::sync::OnceLock<tokio::sync::mpsc::Sender<SharedPrediction>>,
    /// Sessions bound to the rank that served their last request (`[sessions]`).
    pub sessions: Arc<Sessions>,
    /// Requests waiting for a non-busy worker.
    queue: WaitQueue<Waiting>,
    /// A test hook: while a test holds it for writing, event batches and dumps
    /// wait in their queues instead of being applied, so that a full queue
    /// is reached without racing the index. Nothing else takes it for writing.
    #[cfg(feature = "test-hooks")]
    pub ingest_gate: tokio::sync::RwLock<()>,
    /// Bytes of unfinished dumps all streams may hold (`ingest.dump_parts_bytes`).
    pub dump_parts: Arc<tokio::sync::Semaphore>,
    /// The test-only hook that corrupts the index on purpose (`index.test_faults`).
    #[cfg(feature = "test-hooks")]
    pub faults: crate::faults::Faults,
    /// Which worker created each OpenAI response id.
    pub response_owners: Arc<crate::http::responses::ResponseOwners>,
}

/// What to route: token ids, or block hashes computed elsewhere.
#[derive(Clone, Copy)]
pub enum RouteInput<'a> {
    Tokens(&'a [u32]),
    /// Token ids with the request's extra keys (`cache_salt`, images).
    Prompt {
        tokens: &'a [u32],
        extra: &'a ExtraKeys,
    },
    LocalHashes(&'a [u64]),
}

/// A routing decision with what the caller needs to record it; `B` is the
/// request's [`Booking`] when it was booked with the choice.
pub struct Routed<B = ()> {
    pub decision: Decision,
    pub local_hashes: Vec<u64>,
    pub prompt_tokens: usize,
    pub booking: B,
    /// The clock reading the decision was made as of.
    pub decided_at: tokio::time::Instant,
    /// For a request naming a session: its binding and what routing did with it.
    pub session: Option<SessionRoute>,
}

impl AppState {
    /// Loads the configured tokenizers (an error if one does not load).
    pub fn new(config: Config, metrics: Option<Renderer>) -> Result<Arc<Self>, RouterError> {
        if metrics.is_some() {
            crate::limits::count_from_zero();
        }
        let tokenizer = RouterTokenizer::new(
            &config.tokenizer.0,
            config.tokenizer_cache_tokens,
            config.tokenize_threads,
            config.allow_tokenizer_mismatch,
        )?;
        let registry = Arc::new(Registry::new(Limits::from_config(&config)));
        let tiers = TieredIndex::new(
            IndexConfig {
                max_blocks: Some(config.index.max_blocks),
            },
            IndexConfig {
                max_blocks: Some(config.index.max_offload_blocks),
            },
        );
        let index = Arc::clone(&tiers.device);
        let predicted = Arc::new(PredictedIndex::new(PredictedConfig {
            ttl: std::time::Duration::from_millis(config.scheduler.predicted_ttl_ms),
            max_blocks: config.scheduler.predicted_max_blocks,
        }));
        for w in &config.workers {
            registry
                .register(
                    Registration {
                        worker_id: w.id,
                        dp_ranks: w.dp_ranks.clone(),
                        models: w.models.clone(),
                        lora_names: w.lora_names.clone(),
                        base_url: w.base_url.clone(),
                        total_kv_blocks: 0,
                        tokenizer: String::new(),
                        pd: w.pd(),
                    },
                    Source::Static,
                )
                .map_err(|e| RouterError::Config(format!("workers: id {}: {e}", w.id)))?;
        }
        let scheduler = Scheduler {
            registry: Arc::clone(&registry),
            index: Arc::clone(&index),
            offload: Arc::clone(&tiers.offload),
            offload_weight: config.scheduler.offload_weight,
            predicted: Arc::clone(&predicted),
            policy: config.scheduler.policy,
            temperature: config.scheduler.temperature,
            max_load_ratio: config.sessions.max_load_ratio,
        };
        let upstream = Upstream::new(&config.upstream)?;
        #[cfg(feature = "test-hooks")]
        let faults = crate::faults::Faults::new(config.index.test_faults);
        let queue = WaitQueue::new(
            config.scheduler.queue_order,
            config.scheduler.max_queued,
            config.scheduler.queue_max_bypass,
        );
        let dump_parts = Arc::new(tokio::sync::Semaphore::new(config.ingest.dump_parts_bytes));
        let response_owners = Arc::new(crate::http::responses::ResponseOwners::new(
            std::time::Duration::from_secs(config.responses.owner_ttl_s),
            config.limits.max_response_owners,
        ));
        let sessions = Arc::new(Sessions::new(&config, Arc::clone(&index))?);
        Ok(Arc::new(Self {
            credentials: Credentials::new(&config),
            config,
            registry,
            index,
            tiers,
            predicted,
            scheduler,
            tokenizer,
            upstream,
            metrics,
            writers: Writers::default(),
            replica: std::sync::OnceLock::new(),
            shared_predictions: std::sync::OnceLock::new(),
            sessions,
            queue,
            #[cfg(feature = "test-hooks")]
            ingest_gate: tokio::sync::RwLock::new(()),
            dump_parts,
            #[cfg(feature = "test-hooks")]
            faults,
            response_owners,
        }))
    }

    /// Remembers that `routed` goes to its chosen worker. A worker that
    /// publishes events keeps the prediction only until its `Stored` events can
    /// have arrived (`predicted_bridge_ms`) under `kv`, which trusts events; the
    /// rest keep it for `predicted_ttl_ms`.
    /// Records at most `limits.max_predicted_blocks_per_request` blocks: a
    /// prefix of the path, which is still a valid prediction.
    pub fn record_prediction<B>(&self, routed: &Routed<B>) {
        let max_blocks = self.config.limits.max_predicted_blocks_per_request;
        let mut hashes = routed.local_hashes.as_slice();
        if hashes.len() > max_blocks {
            crate::limits::count(crate::limits::PREDICTED_BLOCKS);
            hashes = &hashes[..max_blocks];
        }
        let scheduler = &self.config.scheduler;
        let ttl_ms = if routed.decision.publishes_events && scheduler.policy == Policy::Kv {
            scheduler.predicted_bridge_ms
        } else {
            scheduler.predicted_ttl_ms
        };
        self.predicted.record_for(
            routed.decision.worker,
            hashes,
            routed.decided_at.into_std(),
            std::time::Duration::from_millis(ttl_ms),
        );
        if let Some(share) = self.shared_predictions.get() {
            // Full: the transport is behind; a lost prediction costs a hit at worst.
            let _ = share.try_send(SharedPrediction {
                worker_id: routed.decision.worker.worker_id,
                dp_rank: routed.decision.worker.dp_rank,
                ttl_ms,
                local_hashes: hashes.to_vec(),
            });
        }
    }

    /// Chooses a worker for `name` without waiting or booking: 404 for a name
    /// nobody serves, [`NoWorker`] when nobody can take it now.
    pub fn route_now(
        &self,
        name: &str,
        input: RouteInput<'_>,
        pin: Option<u64>,
        session: Option<&str>,
        exclude: &[u64],
    ) -> Result<Result<Routed, NoWorker>, RouterError> {
        self.try_route(name, input, pin, session, exclude, |query, now| {
            self.scheduler.choose(query, now).map(|d| (d, ()))
        })
    }

    /// Whether requests for `name` are served by a disaggregated fleet: it has
    /// routable decode ranks (see [`crate::pd`]).
    pub fn disaggregated(&self, name: &str) -> bool {
        Pool::Decode.group(&self.registry.lock(), name).is_some()
    }

    /// The deepest prefix of the prompt cached on a rank of `pool` that could
    /// take it now, in blocks, and the prompt's length in tokens.
    pub fn cached_now(
        &self,
        name: &str,
        pool: Pool,
        input: RouteInput<'_>,
    ) -> Result<(u32, usize), RouterError> {
        let (local_hashes, prompt_tokens) =
            self.hash_prompt(name, input, tokio::time::Instant::now())?;
        let query = RouteQuery {
            name,
            pool,
            prompt_tokens,
            local_hashes: &local_hashes,
            pin: None,
            bound: None,
            exclude: &[],
        };
        Ok((self.scheduler.overlap_now(&query), prompt_tokens))
    }

    /// Hashes the prompt and routes it with `choose` (which may book).
    fn try_route<B>(
        &self,
        name: &str,
        input: RouteInput<'_>,
        pin: Option<u64>,
        session: Option<&str>,
        exclude: &[u64],
        choose: impl FnOnce(&RouteQuery<'_>, tokio::time::Instant) -> Result<(Decision, B), NoWorker>,
    ) -> Result<Result<Routed<B>, NoWorker>, RouterError> {
        let decided_at = tokio::time::Instant::now();
        let (local_hashes, prompt_tokens) = self.hash_prompt(name, input, decided_at)?;
        let bound = session.and_then(|id| self.sessions.bound(id, decided_at));
        let query = RouteQuery {
            name,
            pool: Pool::Whole,
            prompt_tokens,
            local_hashes: &local_hashes,
            pin,
            bound,
            exclude,
        };
        Ok(
            choose(&query, decided_at).map(|(decision, booking)| Routed {
                session: session.map(|_| session_route(bound, &decision)),
                decision,
                local_hashes,
                prompt_tokens,
                booking,
                decided_at,
            }),
        )
    }

    /// The prompt's local block hashes and its length in tokens; 404 for a
    /// name nobody serves. The `hash` phase is timed from `started`, the
    /// caller's reading of the clock just before.
    fn hash_prompt(
        &self,
        name: &str,
        input: RouteInput<'_>,
        started: tokio::time::Instant,
    ) -> Result<(Vec<u64>, usize), RouterError> {
        let kind = self
            .registry
            .name_kind(name)
            .ok_or_else(|| RouterError::UnknownModel(name.to_string()))?;
        let block_size = self.config.block_size as usize;
        // An adapter's blocks hash with its seed, so base-model blocks never count for it.
        let hasher = match kind {
            NameKind::Lora => BlockHasher::with_lora(block_size, name),
            NameKind::Model => BlockHasher::new(block_size),
        };
        let mut hashes = Vec::new();
        let prompt_tokens = match input {
            RouteInput::Tokens(tokens) => {
                hasher.local_hashes_into(tokens, &mut hashes);
                tokens.len()
            }
            RouteInput::Prompt { tokens, extra } => {
                hasher.local_hashes_with_into(tokens, extra, &mut hashes);
                tokens.len()
            }
            RouteInput::LocalHashes(given) => {
                hashes.extend_from_slice(given);
                given.len() * block_size
            }
        };
        metrics::observe_phase(metrics::Phase::Hash, started.into_std());
        Ok((hashes, prompt_tokens))
    }

    /// Like [`Self::route_now`], but when every worker is busy waits up to the
    /// queue timeout for load to be released, then fails with 503.
    pub async fn route(
        &self,
        name: &str,
        input: RouteInput<'_>,
        pin: Option<u64>,
        exclude: &[u64],
    ) -> Result<Routed, RouterError> {
        self.route_queued(
            (name, Pool::Whole),
            input,
            pin,
            None,
            exclude,
            |query, now| self.scheduler.choose(query, now).map(|d| (d, ())),
        )
        .await
    }

    /// Like [`Self::route`], and books the request on the chosen rank in the
    /// same step as the choice (see [`Scheduler::choose_and_book`]). A request
    /// naming `session` goes to its bound rank (see [`crate::schedule::sessions`]); one
    /// naming a new session while the table is full is refused.
    pub async fn route_and_book(
        &self,
        name: &str,
        input: RouteInput<'_>,
        pin: Option<u64>,
        session: Option<&str>,
        exclude: &[u64],
    ) -> Result<Routed<Booking>, RouterError> {
        if let Some(id) = session {
            self.sessions.admit(id)?;
        }
        self.route_and_book_in(name, Pool::Whole, input, pin, session, exclude)
            .await
    }

    /// Like [`Self::route_and_book`], among the ranks of `pool`.
    pub async fn route_and_book_in(
        &self,
        name: &str,
        pool: Pool,
        input: RouteInput<'_>,
        pin: Option<u64>,
        session: Option<&str>,
        exclude: &[u64],
    ) -> Result<Routed<Booking>, RouterError> {
        self.route_queued((name, pool), input, pin, session, exclude, |query, now| {
            self.scheduler.choose_and_book(query, now)
        })
        .await
    }

    /// Routes with `choose`, waiting in the queue ([`crate::schedule::queue`]) while
    /// every worker is busy: a waiter tries again on its turn, which comes
    /// when load is released or a breaker's cool-down ends, until the queue
    /// timeout. `choose` gets the time of its attempt: a request's first
    /// attempt decides as of the clock reading that starts its queue timeout.
    /// The request is for `name`'s ranks of `pool`.
    async fn route_queued<B>(
        &self,
        (name, pool): (&str, Pool),
        input: RouteInput<'_>,
        pin: Option<u64>,
        session: Option<&str>,
        exclude: &[u64],
        choose: impl Fn(&RouteQuery<'_>, tokio::time::Instant) -> Result<(Decision, B), NoWorker>,
    ) -> Result<Routed<B>, RouterError> {
        let arrived = tokio::time::Instant::now();
        let deadline = arrived + self.config.scheduler.queue_timeout();
        let (local_hashes, prompt_tokens) = self.hash_prompt(name, input, arrived)?;
        let bound = session.and_then(|id| self.sessions.bound(id, arrived));
        let route = |decision: &Decision| session.map(|_| session_route(bound, decision));
        let query = RouteQuery {
            name,
            pool,
            prompt_tokens,
            local_hashes: &local_hashes,
            pin,
            bound,
            exclude,
        };
        // Ok(Ok): routed; Ok(Err(probe_at)): every worker is busy.
        let attempt = |now| match choose(&query, now) {
            Ok(chosen) => Ok(Ok(chosen)),
            Err(NoWorker::AllBusy { probe_at }) => Ok(Err(probe_at)),
            Err(NoWorker::NoneRoutable) => Err(self.unavailable(format!(
                "no routable worker serves `{name}`{}",
                pin.map_or(String::new(), |p| format!(" as worker {p}"))
            ))),
        };
        // Registered before each look, so that a release in between is not missed.
        let released = self.registry.released.notified();
        tokio::pin!(released);
        released.as_mut().enable();
        let mut probe_at = None;
        // During a sweep the waiters are being offered capacity: wait a turn like them.
        let tried = !self.queue.sweeping();
        if tried {
            match attempt(arrived)? {
                Ok((decision, booking)) => {
                    return Ok(Routed {
                        session: route(&decision),
                        decision,
                        local_hashes,
                        prompt_tokens,
                        booking,
                        decided_at: arrived,
                    });
                }
                Err(at) => probe_at = at,
            }
        }
        let key = |w: &Waiting| self.scheduler.overlap_now(&w.query());
        let waiting = Waiting {
            name: name.to_string(),
            pool,
            prompt_tokens,
            local_hashes: local_hashes.clone(),
            pin,
            bound,
            exclude: exclude.to_vec(),
        };
        // Requests for one model that neither pin nor exclude a worker all
        // find the same workers busy or not.
        let class = (pin.is_none() && exclude.is_empty()).then(|| format!("{pool:?} {name}"));
        let ticket = self
            .queue
            .join(waiting, class, &key, !tried)
            .ok_or(RouterError::QueueFull)?;
        loop {
            // A breaker's cool-down ending releases nothing: wake for it too.
            let wake = probe_at.map_or(deadline, |at: tokio::time::Instant| at.min(deadline));
            let watching = ticket.watching();
            tokio::select! {
                biased;
                () = ticket.wake() => {
                    if !ticket.has_turn() {
                        // Now the watcher: `released`, armed before this
                        // waiter's last look, catches what came since.
                        continue;
                    }
                    released.set(self.registry.released.notified());
                    released.as_mut().enable();
                    let now = tokio::time::Instant::now();
                    match attempt(now)? {
                        Ok((decision, booking)) => {
                            ticket.served();
                            return Ok(Routed {
                                session: route(&decision),
                                decision,
                                local_hashes,
                                prompt_tokens,
                                booking,
                                decided_at: now,
                            });
                        }
                        Err(at) => {
                            probe_at = at;
                            ticket.pass();
                        }
                    }
                }
                () = &mut released, if watching => {
                    released.set(self.registry.released.notified());
                    released.as_mut().enable();
                    self.queue.sweep(&key);
                }
                () = tokio::time::sleep_until(wake) => {
                    if tokio::time::Instant::now() >= deadline {
                        return Err(self.unavailable(format!(
                            "every worker serving `{name}` stayed busy for {} ms",
                            self.config.scheduler.queue_timeout_ms
                        )));
                    }
                    probe_at = None;
                    self.queue.sweep(&key);
                }
            }
        }
    }

    fn unavailable(&self, message: String) -> RouterError {
        RouterError::Unavailable {
            message,
            retry_after_s: 1,
        }
    }

    /// Refreshes the gauges that are cheaper to compute at scrape time, then renders.
    pub fn render_metrics(&self) -> String {
        let stats = self.index.stats();
        ::metrics::gauge!(metrics::INDEXED_BLOCKS).set(stats.blocks as f64);
        ::metrics::gauge!(metrics::INDEX_MEMBERSHIPS).set(stats.memberships as f64);
        ::metrics::gauge!(metrics::PREDICTED_ENTRIES).set(self.predicted.len() as f64);
        ::metrics::gauge!(metrics::RESPONSE_OWNERS).set(self.response_owners.len() as f64);
        ::metrics::gauge!(metrics::SESSION_BINDINGS).set(self.sessions.count() as f64);
        ::metrics::counter!(metrics::INDEX_EVICTED).absolute(self.index.evicted_blocks());
        ::metrics::counter!(metrics::INDEX_EVICTION_SCANS_CUT)
            .absolute(self.index.eviction_scans_cut());
        if let Some(replica) = self.replica.get() {
            let flag = |on: bool| f64::from(u8::from(on));
            ::metrics::gauge!(metrics::CLUSTER_CONNECTED).set(flag(replica.connected()));
            ::metrics::gauge!(metrics::CLUSTER_CAUGHT_UP).set(flag(replica.caught_up()));
            ::metrics::gauge!(metrics::CLUSTER_RECORDS_BEHIND).set(replica.behind() as f64);
        }
        for (state, count) in self.registry.state_counts() {
            ::metrics::gauge!(metrics::WORKERS, "state" => state).set(count as f64);
        }
        let cache = self.tokenizer.cache_stats();
        ::metrics::gauge!(metrics::TOKENIZER_CACHE_TOKENS).set(cache.cached_tokens as f64);
        ::metrics::counter!(metrics::TOKENIZER_CACHE_HITS).absolute(cache.hit_tokens);
        ::metrics::counter!(metrics::TOKENIZED_TOKENS).absolute(cache.tokenized_tokens);
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            let tasks = runtime.metrics().num_alive_tasks();
            ::metrics::gauge!(metrics::ALIVE_TASKS).set(tasks as f64);
        }
        self.metrics
            .as_ref()
            .map(|h| h.render())
            .unwrap_or_default()
    }
}

/// What routing a session bound to `bound` to `decision`'s rank did.
fn session_route(bound: Option<kvroute_index::WorkerKey>, decision: &Decision) -> SessionRoute {
    SessionRoute {
        bound,
        outcome: Outcome::of(bound, decision.worker),
    }
}

/// A request in the wait queue: what ranks it (see [`Scheduler::overlap_now`]).
struct Waiting {
    name: String,
    pool: Pool,
    prompt_tokens: usize,
    local_hashes: Vec<u64>,
    pin: Option<u64>,
    bound: Option<kvroute_index::WorkerKey>,
    exclude: Vec<u64>,
}

impl Waiting {
    fn query(&self) -> RouteQuery<'_> {
        RouteQuery {
            name: &self.name,
            pool: self.pool,
            prompt_tokens: self.prompt_tokens,
            local_hashes: &self.local_hashes,
            pin: self.pin,
            bound: self.bound,
            exclude: &self.exclude,
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use super::*;
    use crate::config::QueueOrder;

    /// Whether worker `id` still has a predicted prefix of `hashes` after `elapsed`.
    fn predicted_after(state: &AppState, hashes: &[u64], id: u64, elapsed: Duration) -> bool {
        state
            .predicted
            .find_matches(hashes, Instant::now() + elapsed)
            .iter()
            .any(|m| m.worker.worker_id == id && m.depth > 0)
    }

    #[test]
    fn predictions_for_event_publishing_workers_only_bridge_until_their_events() {
        let config = Config::default();
        let bridge = Duration::from_millis(config.scheduler.predicted_bridge_ms);
        let ttl = Duration::from_millis(config.scheduler.predicted_ttl_ms);
        assert!(bridge < ttl);
        let state = AppState::new(config, None).unwrap();
        state
            .registry
            .register(Registration::for_test(1), Source::Stream)
            .unwrap();
        state
            .registry
            .register(Registration::for_test(2), Source::Static)
            .unwrap();
        let tokens: Vec<u32> = (0..64).collect();
        for pin in [1, 2] {
            let routed = state
                .route_now("m", RouteInput::Tokens(&tokens), Some(pin), None, &[])
                .unwrap()
                .unwrap();
            state.record_prediction(&routed);
            let hashes = routed.local_hashes;
            let soon = bridge / 2;
            let later = bridge + Duration::from_secs(1);
            assert!(predicted_after(&state, &hashes, pin, soon));
            // The streaming worker's own Stored events take over after the
            // bridge; the static worker never sends any, so its entry lasts the TTL.
            assert_eq!(predicted_after(&state, &hashes, pin, later), pin == 2);
            assert!(!predicted_after(
                &state,
                &hashes,
                pin,
                ttl + Duration::from_secs(1)
            ));
        }
    }

    /// Routes a token prompt for "m" and books it, without waiting.
    fn route_and_book_now(state: &AppState, tokens: &[u32]) -> Option<Routed<Booking>> {
        state
            .try_route(
                "m",
                RouteInput::Tokens(tokens),
                None,
                None,
                &[],
                |query, now| state.scheduler.choose_and_book(query, now),
            )
            .unwrap()
            .ok()
    }

    /// Threads race to route: each booking must see the others'. With a choice
    /// and a booking as two steps, several threads pick the same free rank
    /// (overrunning `busy_max_inflight = 1`) or the same due probe.
    #[test]
    fn concurrent_requests_never_overrun_busy_max_inflight_or_share_a_probe() {
        const THREADS: usize = 6;
        let mut config = Config::default();
        config.scheduler.busy_max_inflight = 1;
        config.upstream.breaker_failures = 1;
        config.upstream.breaker_cooldown_ms = 0;
        let state = AppState::new(config, None).unwrap();
        for id in 1..=3 {
            state
                .registry
                .register(Registration::for_test(id), Source::Stream)
                .unwrap();
        }
        let tokens: Vec<u32> = (0..64).collect();
        let barrier = std::sync::Barrier::new(THREADS);
        for round in 0..300 {
            // Worker 3's breaker is open and due a probe at once.
            state.registry.record_outcome(3, false);
            let booked: Vec<u64> = std::thread::scope(|scope| {
                let threads: Vec<_> = (0..THREADS)
                    .map(|_| {
                        scope.spawn(|| {
                            barrier.wait();
                            let routed = route_and_book_now(&state, &tokens);
                            let worker = routed.as_ref().map(|r| r.decision.worker.worker_id);
                            // Hold the booking until every thread has routed.
                            barrier.wait();
                            worker
                        })
                    })
                    .collect();
                threads
                    .into_iter()
                    .filter_map(|t| t.join().unwrap())
                    .collect()
            });
            let mut counts = [0; 4];
            for &worker in &booked {
                counts[worker as usize] += 1;
            }
            assert_eq!(counts[1..], [1, 1, 1], "round {round}: {booked:?}");
        }
    }

    #[tokio::test(start_paused = true)]
    async fn the_end_of_a_breaker_cool_down_wakes_queued_requests() {
        let mut config = Config::default();
        config.upstream.breaker_failures = 1;
        config.upstream.breaker_cooldown_ms = 10_000;
        config.scheduler.queue_timeout_ms = 60_000;
        let state = AppState::new(config, None).unwrap();
        state
            .registry
            .register(Registration::for_test(1), Source::Stream)
            .unwrap();
        state.registry.record_outcome(1, false);
        let tokens: Vec<u32> = (0..64).collect();
        let queued = tokio::spawn({
            let state = Arc::clone(&state);
            async move {
                let routed = state
                    .route_and_book("m", RouteInput::Tokens(&tokens), None, None, &[])
                    .await;
                (
                    tokio::time::Instant::now(),
                    routed.map(|r| r.decision.worker),
                )
            }
        });
        let start = tokio::time::Instant::now();
        let (routed_at, routed) = queued.await.unwrap();
        assert_eq!(
            routed.unwrap().worker_id,
            1,
            "the queued request is the probe"
        );
        assert_eq!(
            routed_at - start,
            Duration::from_secs(10),
            "routed when the cool-down ended"
        );
    }

    /// Two workers, each busy with one pinned request (`busy_max_inflight = 1`);
    /// worker 1 holds the prefix `cached` (a prediction).
    fn busy_pair(order: QueueOrder, cached: &[u32]) -> (Arc<AppState>, Vec<Booking>) {
        let mut config = Config::default();
        config.scheduler.busy_max_inflight = 1;
        config.scheduler.queue_timeout_ms = 60_000;
        config.scheduler.queue_order = order;
        let state = AppState::new(config, None).unwrap();
        for id in [1, 2] {
            state
                .registry
                .register(Registration::for_test(id), Source::Static)
                .unwrap();
        }
        let routed = state
            .route_now("m", RouteInput::Tokens(cached), Some(1), None, &[])
            .unwrap()
            .unwrap();
        state.record_prediction(&routed);
        let holds = [1, 2]
            .map(|id| {
                state
                    .try_route(
                        "m",
                        RouteInput::Tokens(&[7; 64]),
                        Some(id),
                        None,
                        &[],
                        |q, now| state.scheduler.choose_and_book(q, now),
                    )
                    .unwrap()
                    .unwrap()
                    .booking
            })
            .into();
        (state, holds)
    }

    /// The worker a queued request was routed to, and its booking (held).
    type Queued = tokio::task::JoinHandle<Result<(u64, Booking), RouterError>>;

    /// Starts a request for `tokens` and waits until it is queued.
    async fn enqueue(state: &Arc<AppState>, tokens: Vec<u32>, exclude: Vec<u64>) -> Queued {
        let before = state.queue.len();
        let queued = tokio::spawn({
            let state = Arc::clone(state);
            async move {
                state
                    .route_and_book("m", RouteInput::Tokens(&tokens), None, None, &exclude)
                    .await
                    .map(|r| (r.decision.worker.worker_id, r.booking))
            }
        });
        while state.queue.len() == before {
            tokio::task::yield_now().await;
        }
        queued
    }

    async fn settle() {
        for _ in 0..100 {
            tokio::task::yield_now().await;
        }
    }

    /// Frees worker 1 while an unrelated request and then one sharing worker
    /// 1's cached prefix wait: which is served?
    async fn served_on_release(order: QueueOrder) -> (Option<u64>, Option<u64>) {
        let cached: Vec<u32> = (100..164).collect();
        let (state, mut holds) = busy_pair(order, &cached);
        let unrelated = enqueue(&state, (500..564).collect(), Vec::new()).await;
        let sharing = enqueue(&state, cached, Vec::new()).await;
        holds.remove(0); // worker 1's request ends
        settle().await;
        let done = |q: &Queued| q.is_finished();
        let result = (done(&unrelated), done(&sharing));
        assert!(result.0 != result.1, "exactly one is served: {result:?}");
        let first = if result.0 { unrelated } else { sharing };
        let (served, _booking) = first.await.unwrap().unwrap();
        assert_eq!(served, 1);
        (result.0.then_some(served), result.1.then_some(served))
    }

    #[tokio::test(start_paused = true)]
    async fn longest_prefix_gives_a_freed_worker_to_the_waiter_sharing_its_cached_prefix() {
        assert_eq!(
            served_on_release(QueueOrder::LongestPrefix).await,
            (None, Some(1))
        );
        assert_eq!(served_on_release(QueueOrder::Fifo).await, (Some(1), None));
    }

    #[tokio::test(start_paused = true)]
    async fn a_waiter_excluding_the_freed_worker_does_not_hold_up_the_next() {
        let (state, mut holds) = busy_pair(QueueOrder::Fifo, &[1; 64]);
        let retry = enqueue(&state, (0..64).collect(), vec![1]).await;
        let next = enqueue(&state, (0..64).collect(), Vec::new()).await;
        holds.remove(0);
        assert_eq!(next.await.unwrap().unwrap().0, 1);
        settle().await;
        assert!(!retry.is_finished());
        holds.clear(); // worker 2 is free too
        assert_eq!(retry.await.unwrap().unwrap().0, 2);
        assert_eq!(state.queue.len(), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn a_queued_request_gets_503_at_the_queue_timeout_and_leaves_the_queue() {
        let (state, _holds) = busy_pair(QueueOrder::LongestPrefix, &[1; 64]);
        let start = tokio::time::Instant::now();
        let queued = enqueue(&state, (0..64).collect(), Vec::new()).await;
        let Err(err) = queued.await.unwrap() else {
            panic!("routed while every worker was busy");
        };
        assert!(matches!(err, RouterError::Unavailable { .. }), "{err:?}");
        assert_eq!(start.elapsed(), Duration::from_secs(60));
        assert_eq!(state.queue.len(), 0);
    }
}
