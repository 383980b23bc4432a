//! The per-worker circuit breaker: a worker whose requests keep failing is taken
//! out of routing for a cool-down, then let back in by a probe.
//!
//! It lives beside the fleet (its state is a field of [`crate::registry::Worker`], guarded by the
//! one fleet lock) because the scheduler must see it in the same consistent
//! picture as the load order: a breaker that opened must not be chosen, and the
//! few workers with a tripped breaker are tracked so a due probe costs O(tripped).

use std::time::{Duration, Instant};

use crate::registry::Registry;

/// Per-worker circuit breaker: open after consecutive failures; after a
/// cool-down one probe request (or health check) may close it again.
#[derive(Clone, Copy, Debug)]
pub enum Breaker {
    Closed { failures: u32 },
    Open { until: Instant },
    HalfOpen { since: Instant },
}

impl Breaker {
    pub(crate) fn available(&self, now: Instant, cooldown: Duration) -> bool {
        match *self {
            Breaker::Closed { .. } => true,
            Breaker::Open { until } => now >= until,
            // A probe that never reported back must not block the worker forever.
            Breaker::HalfOpen { since } => now >= since + cooldown,
        }
    }

    pub(crate) fn gauge_value(&self) -> f64 {
        match self {
            Breaker::Closed { .. } => 0.0,
            Breaker::HalfOpen { .. } => 1.0,
            Breaker::Open { .. } => 2.0,
        }
    }

    pub fn name(&self) -> &'static str {
        match self {
            Breaker::Closed { .. } => "closed",
            Breaker::HalfOpen { .. } => "half_open",
            Breaker::Open { .. } => "open",
        }
    }
}

impl Registry {
    /// Feeds a request's or health check's outcome into the worker's breaker.
    pub fn record_outcome(&self, worker_id: u64, ok: bool) {
        let mut fleet = self.lock();
        let Some(worker) = fleet.workers.get_mut(&worker_id) else {
            return;
        };
        let now = Instant::now();
        worker.breaker = match (ok, worker.breaker) {
            (true, _) => Breaker::Closed { failures: 0 },
            (false, Breaker::Closed { failures })
                if failures + 1 < self.limits.breaker_failures =>
            {
                Breaker::Closed {
                    failures: failures + 1,
                }
            }
            (false, _) => Breaker::Open {
                until: now + self.limits.breaker_cooldown,
            },
        };
        worker.breaker_gauge.set(worker.breaker.gauge_value());
        if matches!(worker.breaker, Breaker::Closed { .. }) {
            fleet.tripped.remove(&worker_id);
        } else {
            fleet.tripped.insert(worker_id);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::Instant;

    use kvroute_index::WorkerKey;

    use crate::registry::tests::{limits, reg};
    use crate::registry::{Registry, Source};

    #[test]
    fn breaker_opens_after_consecutive_failures_and_closes_on_success() {
        let registry = Arc::new(Registry::new(limits()));
        registry.register(reg(1, &["m"]), Source::Stream).unwrap();
        let key = WorkerKey::new(1, 0);
        let now = Instant::now();
        for _ in 0..registry.limits.breaker_failures {
            assert!(registry.lock().available(key, &registry.limits, now));
            registry.record_outcome(1, false);
        }
        assert!(
            !registry
                .lock()
                .available(key, &registry.limits, Instant::now())
        );
        registry.record_outcome(1, true);
        assert!(
            registry
                .lock()
                .available(key, &registry.limits, Instant::now())
        );
    }
}
