//! Agent sessions kept on the worker rank that holds their cache (`[sessions]`).
//!
//! A request names its session in a header (`sessions.header`). Once a worker
//! answered it, the session is bound to that rank until `ttl_s` after its
//! last request. The routing entry point (`crate::state`) looks the binding
//! up, and the scheduler ([`super`]) sends the request to the bound rank while that rank
//! can take it and its load, with the request, is at most `max_load_ratio`
//! times the least loaded eligible rank's; otherwise the request is routed
//! as any other, away from the bound rank, and the binding follows it
//! ([`Outcome::Moved`]).
//!
//! While a binding lives, the path of its last request is pinned in the
//! index (the blocks of it the index held when the worker answered), so that
//! `index.max_blocks` eviction does not forget the session's cached prefix
//! between two turns.
//!
//! With `[cluster]`, each binding made here goes to the other replicas
//! through [`Sessions::share`] (a JetStream KV bucket in `kvroute-cluster`)
//! and theirs come back through [`Sessions::bind_shared`]; the last binding
//! written wins. This module knows nothing of NATS.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use http::{HeaderMap, HeaderName};
use kvroute_index::{KvIndex, OwnedPinnedPath, WorkerKey};
use serde::{Deserialize, Serialize};
use tokio::sync::mpsc;
use tokio::time::Instant;

use crate::config::Config;
use crate::error::RouterError;
use crate::limits;
use crate::metrics;

/// What routing did with a request naming a session.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// To the rank the session was bound to.
    Bound,
    /// Elsewhere: the bound rank was over `max_load_ratio`, or could not take it.
    Moved,
    /// The session had no binding.
    New,
}

impl Outcome {
    pub const ALL: [Outcome; 3] = [Outcome::Bound, Outcome::Moved, Outcome::New];

    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::Bound => "bound",
            Outcome::Moved => "moved",
            Outcome::New => "new",
        }
    }

    /// The outcome of routing to `chosen` a session bound to `bound`.
    pub fn of(bound: Option<WorkerKey>, chosen: WorkerKey) -> Self {
        match bound {
            None => Outcome::New,
            Some(bound) if bound == chosen => Outcome::Bound,
            Some(_) => Outcome::Moved,
        }
    }
}

/// A routed request's session: its binding when routed, and the outcome.
#[derive(Clone, Copy, Debug)]
pub struct SessionRoute {
    pub bound: Option<WorkerKey>,
    pub outcome: Outcome,
}

/// A binding made on this replica, for the others to make too.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SharedBinding {
    pub session: String,
    pub worker_id: u64,
    pub dp_rank: u32,
    /// The path to pin: the last request's block hashes (a prefix of them).
    pub local_hashes: Vec<u64>,
}

struct Binding {
    rank: WorkerKey,
    expires: Instant,
    /// Unpins when the binding goes or is replaced.
    _pinned: OwnedPinnedPath,
}

/// Bindings waiting to go to the other replicas; past this, new ones are not
/// shared (the session's next request shares its binding again).
const SHARED_QUEUE: usize = 4096;

pub struct Sessions {
    header: Option<HeaderName>,
    ttl: Duration,
    max_bindings: usize,
    max_id_bytes: usize,
    /// Blocks of a path pinned (and shared): `limits.max_predicted_blocks_per_request`.
    max_pinned_blocks: usize,
    index: Arc<KvIndex>,
    table: Mutex<HashMap<String, Binding>>,
    /// Set once at start with `[cluster]`: where bindings made here go for the others.
    shared: OnceLock<mpsc::Sender<SharedBinding>>,
}

impl Sessions {
    /// Sessions per `config` (validated), pinning in `index`.
    pub fn new(config: &Config, index: Arc<KvIndex>) -> Result<Self, RouterError> {
        // Zeros from the start, for dashboards and alerts.
        for outcome in Outcome::ALL {
            let _ = ::metrics::counter!(metrics::SESSION_ROUTES, "outcome" => outcome.as_str());
        }
        Ok(Self {
            header: config.sessions.header()?,
            ttl: Duration::from_secs(config.sessions.ttl_s),
            max_bindings: config.limits.max_session_bindings,
            max_id_bytes: config.limits.max_session_id_bytes,
            max_pinned_blocks: config.limits.max_predicted_blocks_per_request,
            index,
            table: Mutex::new(HashMap::new()),
            shared: OnceLock::new(),
        })
    }

    /// From now on, sends every binding made here to the receiver, for the
    /// other replicas (`[cluster]`); `None` if something already takes them.
    pub fn share(&self) -> Option<mpsc::Receiver<SharedBinding>> {
        let (sender, receiver) = mpsc::channel(SHARED_QUEUE);
        self.shared.set(sender).ok().map(|()| receiver)
    }

    /// How long a binding lives after its last request.
    pub fn ttl(&self) -> Duration {
        self.ttl
    }

    /// The session a request names, if sessions are on and it names one; 400
    /// for a value that is not visible ASCII or is longer than the limit.
    pub fn id_of(&self, headers: &HeaderMap) -> Result<Option<String>, RouterError> {
        let Some(name) = &self.header else {
            return Ok(None);
        };
        let Some(value) = headers.get(name) else {
            return Ok(None);
        };
        if value.len() > self.max_id_bytes {
            limits::count(limits::SESSION_ID_BYTES);
            return Err(RouterError::BadRequest(format!(
                "{name} is {} bytes, longer than the limit of {} (limits.max_session_id_bytes)",
                value.len(),
                self.max_id_bytes
            )));
        }
        match value.to_str() {
            Ok(id) if !id.trim().is_empty() => Ok(Some(id.trim().to_string())),
            _ => Err(RouterError::BadRequest(format!(
                "{name} must be a non-empty string of visible ASCII characters"
            ))),
        }
    }

    /// Refuses a request naming a session this replica could not bind: a new
    /// one while `limits.max_session_bindings` bindings live.
    pub fn admit(&self, id: &str) -> Result<(), RouterError> {
        let table = self.lock();
        if table.len() < self.max_bindings || table.contains_key(id) {
            return Ok(());
        }
        drop(table);
        limits::count(limits::SESSION_BINDINGS);
        Err(RouterError::Unavailable {
            message: format!(
                "the router holds {} sessions already (limits.max_session_bindings): \
                 retry later, or send the request without a session",
                self.max_bindings
            ),
            retry_after_s: 1,
        })
    }

    /// The rank `id` is bound to, if its binding lives at `now`.
    pub fn bound(&self, id: &str, now: Instant) -> Option<WorkerKey> {
        self.lock()
            .get(id)
            .filter(|b| b.expires > now)
            .map(|b| b.rank)
    }

    /// Binds `id` to `rank`, which served a request with `local_hashes`
    /// routed as `route` says, until `ttl_s` from `now`; counts the route and
    /// shares the binding with the other replicas.
    pub fn bind(
        &self,
        id: &str,
        rank: WorkerKey,
        local_hashes: &[u64],
        route: SessionRoute,
        now: Instant,
    ) {
        ::metrics::counter!(metrics::SESSION_ROUTES, "outcome" => route.outcome.as_str())
            .increment(1);
        let path = &local_hashes[..local_hashes.len().min(self.max_pinned_blocks)];
        if !self.insert(id, rank, path, now + self.ttl) {
            return;
        }
        if let Some(shared) = self.shared.get() {
            // Full: the transport is behind; the session's next request shares it again.
            let _ = shared.try_send(SharedBinding {
                session: id.to_string(),
                worker_id: rank.worker_id,
                dp_rank: rank.dp_rank,
                local_hashes: path.to_vec(),
            });
        }
    }

    /// Makes a binding another replica made, `left` of its TTL to live.
    pub fn bind_shared(&self, binding: SharedBinding, left: Duration) {
        let rank = WorkerKey::new(binding.worker_id, binding.dp_rank);
        let path = &binding.local_hashes[..binding.local_hashes.len().min(self.max_pinned_blocks)];
        self.insert(&binding.session, rank, path, Instant::now() + left);
    }

    /// Puts or replaces a binding; false (counted) if it is a new one and the
    /// table is full.
    fn insert(&self, id: &str, rank: WorkerKey, path: &[u64], expires: Instant) -> bool {
        // Pinned before the old pin goes, so that the blocks both hold stay pinned.
        let pinned = self.index.pin_path_owned(path);
        let binding = Binding {
            rank,
            expires,
            _pinned: pinned,
        };
        let mut table = self.lock();
        if let Some(old) = table.get_mut(id) {
            let old = std::mem::replace(old, binding);
            drop(table);
            drop(old);
            return true;
        }
        if table.len() >= self.max_bindings {
            drop(table);
            limits::count(limits::SESSION_BINDINGS);
            return false;
        }
        table.insert(id.to_string(), binding);
        true
    }

    /// Drops the bindings expired at `now` (and their pins).
    pub fn expire(&self, now: Instant) {
        let mut table = self.lock();
        let gone: Vec<String> = table
            .iter()
            .filter(|(_, b)| b.expires <= now)
            .map(|(id, _)| id.clone())
            .collect();
        let expired: Vec<Binding> = gone.iter().filter_map(|id| table.remove(id)).collect();
        drop(table);
        // Unpinned once the lock is let go.
        drop(expired);
    }

    /// Bindings held, expired ones not dropped yet included.
    pub fn count(&self) -> usize {
        self.lock().len()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Binding>> {
        // A panic elsewhere cannot leave the table half-changed: each change is one call.
        self.table.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// Drops expired bindings every quarter of the TTL (at least every 10 s),
/// until `stopped`.
pub async fn expire_periodically(
    sessions: Arc<Sessions>,
    mut stopped: tokio::sync::watch::Receiver<bool>,
) {
    let every = (sessions.ttl / 4).clamp(Duration::from_millis(100), Duration::from_secs(10));
    let mut ticks = tokio::time::interval(every);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = ticks.tick() => sessions.expire(Instant::now()),
            _ = stopped.wait_for(|&s| s) => return,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fleet::{Registration, Source};
    use crate::state::{AppState, RouteInput};

    /// Two idle workers serving "m", with `max_load_ratio`.
    fn fleet(max_load_ratio: f64) -> Arc<AppState> {
        let mut config = Config::default();
        config.sessions.max_load_ratio = max_load_ratio;
        config.sessions.ttl_s = 60;
        let state = AppState::new(config, None).unwrap();
        for id in [1, 2] {
            state
                .registry
                .register(Registration::for_test(id), Source::Stream)
                .unwrap();
        }
        state
    }

    /// Routes a request of session "s" and binds it where it went, as the
    /// proxy does once the worker answered: (worker, outcome).
    fn serve(state: &AppState, tokens: &[u32]) -> (u64, Outcome) {
        let routed = state
            .route_now("m", RouteInput::Tokens(tokens), None, Some("s"), &[])
            .unwrap()
            .unwrap();
        let route = routed.session.unwrap();
        let worker = routed.decision.worker;
        let now = Instant::now();
        state
            .sessions
            .bind("s", worker, &routed.local_hashes, route, now);
        (worker.worker_id, route.outcome)
    }

    #[tokio::test(start_paused = true)]
    async fn a_session_stays_within_the_load_ratio_moves_past_it_and_expires() {
        let state = fleet(2.0);
        // Different prompts each time: only the binding keeps them together.
        let (first, outcome) = serve(&state, &[1; 64]);
        assert_eq!(outcome, Outcome::New);
        let other = 3 - first;
        let (worker, outcome) = serve(&state, &[2; 64]);
        assert_eq!((worker, outcome), (first, Outcome::Bound));

        // A request costs an idle rank 32 × 4 prefill blocks + 4 blocks = 132;
        // 100 blocks more on the bound rank: 232 ≤ 2 × 132.
        let key = |id| WorkerKey::new(id, 0);
        let held = state.registry.book(key(first), 0, 100);
        assert_eq!(serve(&state, &[3; 64]), (first, Outcome::Bound));
        // 40 more: 272 > 2 × 132, the session moves and its binding follows.
        let more = state.registry.book(key(first), 0, 40);
        assert_eq!(serve(&state, &[4; 64]), (other, Outcome::Moved));
        drop((held, more));
        assert_eq!(serve(&state, &[5; 64]), (other, Outcome::Bound));

        // The TTL after the last request, and the binding is gone.
        tokio::time::advance(Duration::from_secs(59)).await;
        assert_eq!(state.sessions.bound("s", Instant::now()), Some(key(other)));
        tokio::time::advance(Duration::from_secs(1)).await;
        state.sessions.expire(Instant::now());
        assert_eq!(state.sessions.count(), 0);
        assert_eq!(serve(&state, &[6; 64]).1, Outcome::New);
    }

    #[tokio::test(start_paused = true)]
    async fn a_session_whose_rank_cannot_take_it_moves() {
        let state = fleet(2.0);
        let (first, _) = serve(&state, &[1; 64]);
        state.registry.drain(first);
        assert_eq!(serve(&state, &[1; 64]), (3 - first, Outcome::Moved));
    }

    #[test]
    fn session_ids_and_new_sessions_past_the_table_are_refused() {
        let mut config = Config::default();
        config.limits.max_session_bindings = 1;
        config.limits.max_session_id_bytes = 8;
        let index = Arc::new(KvIndex::new(Default::default()));
        let sessions = Sessions::new(&config, index).unwrap();
        let headers = |value: &str| {
            let mut headers = HeaderMap::new();
            headers.insert("x-session-id", value.parse().unwrap());
            headers
        };
        assert_eq!(sessions.id_of(&HeaderMap::new()).unwrap(), None);
        assert_eq!(sessions.id_of(&headers("abc")).unwrap().unwrap(), "abc");
        assert!(sessions.id_of(&headers("123456789")).is_err());
        assert!(sessions.id_of(&headers(" ")).is_err());
        let route = SessionRoute {
            bound: None,
            outcome: Outcome::New,
        };
        let now = Instant::now();
        sessions.bind("a", WorkerKey::new(1, 0), &[], route, now);
        sessions.admit("a").unwrap();
        assert!(sessions.admit("b").is_err());
        sessions.bind("b", WorkerKey::new(1, 0), &[], route, now);
        assert_eq!(sessions.bound("b", now), None);
        assert_eq!(sessions.count(), 1);
    }
}
