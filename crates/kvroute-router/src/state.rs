//! The router's shared state, and the one routing entry point that the HTTP API,
//! the proxy and the `Route` RPC all use, so that a dry run and a proxied request
//! decide the same way.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant;

use kvroute_index::{BlockHasher, IndexConfig, KvIndex, PredictedConfig, PredictedIndex};
use metrics_exporter_prometheus::PrometheusHandle;

use crate::auth::Credentials;
use crate::config::{Config, Policy};
use crate::error::RouterError;
use crate::metrics;
use crate::registry::{Limits, NameKind, Registration, Registry, Source};
use crate::scheduler::{Decision, NoWorker, RouteQuery, Scheduler};
use crate::tokenize::Tokenizer;
use crate::upstream::Upstream;

pub struct AppState {
    pub config: Config,
    pub credentials: Credentials,
    pub registry: Arc<Registry>,
    pub index: Arc<KvIndex>,
    pub predicted: Arc<PredictedIndex>,
    pub scheduler: Scheduler,
    pub tokenizer: Option<Tokenizer>,
    pub upstream: Upstream,
    pub metrics: Option<PrometheusHandle>,
    /// Requests currently waiting for a non-busy worker.
    queued: AtomicUsize,
    /// A test hook: while a test holds it for writing, event batches and dumps
    /// wait in their queues instead of being applied, so that a full queue
    /// is reached without racing the index. Nothing else takes it for writing.
    pub ingest_gate: tokio::sync::RwLock<()>,
}

/// What to route: token ids, or block hashes computed elsewhere.
#[derive(Clone, Copy)]
pub enum RouteInput<'a> {
    Tokens(&'a [u32]),
    LocalHashes(&'a [u64]),
}

/// A routing decision with what the caller needs to book and record it.
pub struct Routed {
    pub decision: Decision,
    pub local_hashes: Vec<u64>,
    pub prompt_tokens: usize,
}

impl AppState {
    pub fn new(
        config: Config,
        tokenizer: Option<Tokenizer>,
        metrics: Option<PrometheusHandle>,
    ) -> Result<Arc<Self>, RouterError> {
        let registry = Arc::new(Registry::new(Limits::from_config(&config)));
        let index = Arc::new(KvIndex::new(IndexConfig::default()));
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
            predicted: Arc::clone(&predicted),
            policy: config.scheduler.policy,
            temperature: config.scheduler.temperature,
        };
        let upstream = Upstream::new(&config.upstream);
        Ok(Arc::new(Self {
            credentials: Credentials::new(&config),
            config,
            registry,
            index,
            predicted,
            scheduler,
            tokenizer,
            upstream,
            metrics,
            queued: AtomicUsize::new(0),
            ingest_gate: tokio::sync::RwLock::new(()),
        }))
    }

    /// Chooses a worker for `name` without waiting: 404 for a name nobody serves,
    /// [`NoWorker`] when nobody can take it now.
    /// Remembers that `routed` goes to its chosen worker. A worker that
    /// publishes events keeps the prediction only until its `Stored` events can
    /// have arrived (`predicted_bridge_ms`) under `kv`, which trusts events; the
    /// rest keep it for `predicted_ttl_ms`.
    pub fn record_prediction(&self, routed: &Routed) {
        let scheduler = &self.config.scheduler;
        let ttl_ms = if routed.decision.publishes_events && scheduler.policy == Policy::Kv {
            scheduler.predicted_bridge_ms
        } else {
            scheduler.predicted_ttl_ms
        };
        self.predicted.record_for(
            routed.decision.worker,
            &routed.local_hashes,
            Instant::now(),
            std::time::Duration::from_millis(ttl_ms),
        );
    }

    pub fn route_now(
        &self,
        name: &str,
        input: RouteInput<'_>,
        pin: Option<u64>,
        exclude: &[u64],
    ) -> Result<Result<Routed, NoWorker>, RouterError> {
        let kind = self
            .registry
            .name_kind(name)
            .ok_or_else(|| RouterError::UnknownModel(name.to_string()))?;
        let block_size = self.config.block_size as usize;
        let started = Instant::now();
        let (local_hashes, prompt_tokens) = match input {
            RouteInput::Tokens(tokens) => {
                // An adapter's blocks hash with its seed, so base-model blocks never count for it.
                let hasher = match kind {
                    NameKind::Lora => BlockHasher::with_lora(block_size, name),
                    NameKind::Model => BlockHasher::new(block_size),
                };
                (hasher.local_hashes(tokens), tokens.len())
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
        Ok(self.scheduler.choose(&query).map(|decision| Routed {
            decision,
            local_hashes,
            prompt_tokens,
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
        let deadline = tokio::time::Instant::now() + self.config.scheduler.queue_timeout();
        let mut waiting: Option<QueueSlot<'_>> = None;
        loop {
            // Register for the wake-up before looking, so a release in between is not missed.
            let released = self.registry.released.notified();
            match self.route_now(name, input, pin, exclude)? {
                Ok(routed) => return Ok(routed),
                Err(NoWorker::NoneRoutable) => {
                    return Err(self.unavailable(format!(
                        "no routable worker serves `{name}`{}",
                        pin.map_or(String::new(), |p| format!(" as worker {p}"))
                    )));
                }
                Err(NoWorker::AllBusy) => {}
            }
            if waiting.is_none() {
                waiting = Some(QueueSlot::enter(self).ok_or_else(|| {
                    self.unavailable("every worker is busy and the queue is full".into())
                })?);
            }
            if tokio::time::timeout_at(deadline, released).await.is_err() {
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
        for (state, count) in self.registry.state_counts() {
            ::metrics::gauge!(metrics::WORKERS, "state" => state).set(count as f64);
        }
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
        let state = AppState::new(config, None, None).unwrap();
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
}
