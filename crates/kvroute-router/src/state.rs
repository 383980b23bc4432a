//! The router's shared state, and the one routing entry point that the HTTP API,
//! the proxy and the `Route` RPC all use, so that a dry run and a proxied request
//! decide the same way.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant;

use kvroute_index::{
    BlockHasher, ExtraKeys, IndexConfig, KvIndex, PredictedConfig, PredictedIndex, TieredIndex,
};

use crate::auth::Credentials;
use crate::booking::Booking;
use crate::config::{Config, Policy};
use crate::error::RouterError;
use crate::metrics;
use crate::registry::{Limits, NameKind, Registration, Registry, Source};
use crate::replica::Replica;
use crate::scheduler::{Decision, NoWorker, RouteQuery, Scheduler};
use crate::series::Renderer;
use crate::shared_load::SharedPrediction;
use crate::tokenize::RouterTokenizer;
use crate::upstream::Upstream;
use crate::writers::Writers;

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
    /// predictions go for the others ([`crate::shared_load`]).
    pub shared_predictions: std::sync::OnceLock<tokio::sync::mpsc::Sender<SharedPrediction>>,
    /// Requests currently waiting for a non-busy worker.
    queued: AtomicUsize,
    /// A test hook: while a test holds it for writing, event batches and dumps
    /// wait in their queues instead of being applied, so that a full queue
    /// is reached without racing the index. Nothing else takes it for writing.
    pub ingest_gate: tokio::sync::RwLock<()>,
    /// The test-only hook that corrupts the index on purpose (`index.test_faults`).
    pub faults: crate::faults::Faults,
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
}

impl AppState {
    /// Loads the configured tokenizer (an error if it does not load).
    pub fn new(config: Config, metrics: Option<Renderer>) -> Result<Arc<Self>, RouterError> {
        let tokenizer = RouterTokenizer::new(
            &config.tokenizer,
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
        };
        let upstream = Upstream::new(&config.upstream)?;
        let faults = crate::faults::Faults::new(config.index.test_faults);
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
            queued: AtomicUsize::new(0),
            ingest_gate: tokio::sync::RwLock::new(()),
            faults,
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
            Instant::now(),
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
        exclude: &[u64],
    ) -> Result<Result<Routed, NoWorker>, RouterError> {
        self.try_route(name, input, pin, exclude, |query| {
            self.scheduler.choose(query).map(|d| (d, ()))
        })
    }

    /// Hashes the prompt and routes it with `choose` (which may book).
    fn try_route<B>(
        &self,
        name: &str,
        input: RouteInput<'_>,
        pin: Option<u64>,
        exclude: &[u64],
        choose: impl FnOnce(&RouteQuery<'_>) -> Result<(Decision, B), NoWorker>,
    ) -> Result<Result<Routed<B>, NoWorker>, RouterError> {
        let kind = self
            .registry
            .name_kind(name)
            .ok_or_else(|| RouterError::UnknownModel(name.to_string()))?;
        let block_size = self.config.block_size as usize;
        let started = Instant::now();
        // An adapter's blocks hash with its seed, so base-model blocks never count for it.
        let hasher = match kind {
            NameKind::Lora => BlockHasher::with_lora(block_size, name),
            NameKind::Model => BlockHasher::new(block_size),
        };
        let (local_hashes, prompt_tokens) = match input {
            RouteInput::Tokens(tokens) => (hasher.local_hashes(tokens), tokens.len()),
            RouteInput::Prompt { tokens, extra } => {
                (hasher.local_hashes_with(tokens, extra), tokens.len())
            }
            RouteInput::LocalHashes(hashes) => (hashes.to_vec(), hashes.len() * block_size),
        };
        metrics::observe_phase("hash", started);
        let query = RouteQuery {
            name,
            prompt_tokens,
            local_hashes: &local_hashes,
            pin,
            exclude,
        };
        Ok(choose(&query).map(|(decision, booking)| Routed {
            decision,
            local_hashes,
            prompt_tokens,
            booking,
        }))
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
        self.route_queued(name, input, pin, exclude, |query| {
            self.scheduler.choose(query).map(|d| (d, ()))
        })
        .await
    }

    /// Like [`Self::route`], and books the request on the chosen rank in the
    /// same step as the choice (see [`Scheduler::choose_and_book`]).
    pub async fn route_and_book(
        &self,
        name: &str,
        input: RouteInput<'_>,
        pin: Option<u64>,
        exclude: &[u64],
    ) -> Result<Routed<Booking>, RouterError> {
        self.route_queued(name, input, pin, exclude, |query| {
            self.scheduler.choose_and_book(query)
        })
        .await
    }

    /// Routes with `choose`, waiting in the queue while every worker is busy:
    /// until load is released, a breaker's cool-down ends or the queue timeout.
    async fn route_queued<B>(
        &self,
        name: &str,
        input: RouteInput<'_>,
        pin: Option<u64>,
        exclude: &[u64],
        choose: impl Fn(&RouteQuery<'_>) -> Result<(Decision, B), NoWorker>,
    ) -> Result<Routed<B>, RouterError> {
        let deadline = tokio::time::Instant::now() + self.config.scheduler.queue_timeout();
        let mut waiting: Option<QueueSlot<'_>> = None;
        loop {
            // Register for the wake-up before looking, so a release in between is not missed.
            let released = self.registry.released.notified();
            let probe_at = match self.try_route(name, input, pin, exclude, &choose)? {
                Ok(routed) => return Ok(routed),
                Err(NoWorker::NoneRoutable) => {
                    return Err(self.unavailable(format!(
                        "no routable worker serves `{name}`{}",
                        pin.map_or(String::new(), |p| format!(" as worker {p}"))
                    )));
                }
                Err(NoWorker::AllBusy { probe_at }) => probe_at,
            };
            if waiting.is_none() {
                waiting = Some(QueueSlot::enter(self).ok_or_else(|| {
                    self.unavailable("every worker is busy and the queue is full".into())
                })?);
            }
            // A breaker's cool-down ending releases nothing: wake for it too.
            let wake = probe_at.map_or(deadline, |at| at.min(deadline));
            if tokio::time::timeout_at(wake, released).await.is_err()
                && tokio::time::Instant::now() >= deadline
            {
                return Err(self.unavailable(format!(
                    "every worker serving `{name}` stayed busy for {} ms",
                    self.config.scheduler.queue_timeout_ms
                )));
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
        ::metrics::counter!(metrics::INDEX_EVICTED).absolute(self.index.evicted_blocks());
        if let Some(replica) = self.replica.get() {
            let flag = |on: bool| f64::from(u8::from(on));
            ::metrics::gauge!(metrics::CLUSTER_CONNECTED).set(flag(replica.connected()));
            ::metrics::gauge!(metrics::CLUSTER_CAUGHT_UP).set(flag(replica.caught_up()));
            ::metrics::gauge!(metrics::CLUSTER_RECORDS_BEHIND).set(replica.behind() as f64);
        }
        for (state, count) in self.registry.state_counts() {
            ::metrics::gauge!(metrics::WORKERS, "state" => state).set(count as f64);
        }
        let cache = self
            .tokenizer
            .get()
            .map(|t| t.cache_stats())
            .unwrap_or_default();
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

/// A place in the bounded queue of requests waiting for a worker.
struct QueueSlot<'a> {
    state: &'a AppState,
}

impl<'a> QueueSlot<'a> {
    fn enter(state: &'a AppState) -> Option<Self> {
        let max = state.config.scheduler.max_queued;
        state
            .queued
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < max).then_some(n + 1)
            })
            .ok()?;
        ::metrics::gauge!(metrics::QUEUED).increment(1.0);
        Some(Self { state })
    }
}

impl Drop for QueueSlot<'_> {
    fn drop(&mut self) {
        self.state.queued.fetch_sub(1, Ordering::AcqRel);
        ::metrics::gauge!(metrics::QUEUED).decrement(1.0);
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    fn registration(worker_id: u64) -> Registration {
        Registration {
            worker_id,
            dp_ranks: vec![0],
            models: vec!["m".into()],
            lora_names: Vec::new(),
            base_url: format!("http://127.0.0.1:{}", 9000 + worker_id),
            total_kv_blocks: 1024,
        }
    }

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
            .register(registration(1), Source::Stream)
            .unwrap();
        state
            .registry
            .register(registration(2), Source::Static)
            .unwrap();
        let tokens: Vec<u32> = (0..64).collect();
        for pin in [1, 2] {
            let routed = state
                .route_now("m", RouteInput::Tokens(&tokens), Some(pin), &[])
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
            .try_route("m", RouteInput::Tokens(tokens), None, &[], |query| {
                state.scheduler.choose_and_book(query)
            })
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
                .register(registration(id), Source::Stream)
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
            .register(registration(1), Source::Stream)
            .unwrap();
        state.registry.record_outcome(1, false);
        let tokens: Vec<u32> = (0..64).collect();
        let queued = tokio::spawn({
            let state = Arc::clone(&state);
            async move {
                let routed = state
                    .route_and_book("m", RouteInput::Tokens(&tokens), None, &[])
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
}
