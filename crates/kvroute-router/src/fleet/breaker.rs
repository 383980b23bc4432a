//! The per-worker circuit breaker: a worker whose requests keep failing is taken
//! out of routing for a cool-down, then let back in by exactly one probe.
//!
//! It lives beside the fleet (its state is a field of [`crate::fleet::Worker`],
//! guarded by the one fleet lock) because the scheduler must see it in the same
//! consistent picture as the load order: a breaker that opened must not be
//! chosen, the probe is chosen and booked in one step (so two requests cannot
//! both become it), and the few workers with a tripped breaker are tracked so a
//! due probe costs O(tripped).
//!
//! Each request gets a [`Ticket`] when it is booked, and reports one outcome
//! when its response ends (or fails). A ticket carries the breaker's *epoch*,
//! bumped whenever the breaker opens, so an outcome from a request sent before
//! the breaker opened (a slow success arriving late) cannot close it: only the
//! probe, or a health check, speaks for the worker as it is now. A probe that
//! ends without an outcome (the client went away) makes the next request the
//! probe at once, so a half-open breaker is never stuck waiting.
//!
//! Time is tokio's clock, so tests can pause it and advance through a cool-down.

use std::time::Duration;

use tokio::time::Instant;

use crate::fleet::{Fleet, Registry};

/// Per-worker circuit breaker: open after consecutive failures; after a
/// cool-down one probe request (or a passing health check) may close it again.
#[derive(Clone, Copy, Debug)]
pub struct Breaker {
    state: State,
    /// Times the breaker opened: outcomes from older tickets are ignored.
    epoch: u64,
}

#[derive(Clone, Copy, Debug)]
enum State {
    Closed {
        failures: u32,
    },
    Open {
        until: Instant,
    },
    /// One probe is in flight; nothing else is let through.
    HalfOpen,
}

/// What a booked request holds from its worker's breaker.
#[derive(Clone, Copy, Debug)]
pub struct Ticket {
    epoch: u64,
    /// This request is the half-open breaker's one probe.
    probe: bool,
}

impl Default for Breaker {
    fn default() -> Self {
        Self {
            state: State::Closed { failures: 0 },
            epoch: 0,
        }
    }
}

impl Ticket {
    pub(crate) fn is_probe(&self) -> bool {
        self.probe
    }
}

impl Breaker {
    /// Whether a request may be sent to the worker now.
    pub(crate) fn available(&self, now: Instant) -> bool {
        match self.state {
            State::Closed { .. } => true,
            State::Open { until } => now >= until,
            State::HalfOpen => false,
        }
    }

    /// When an open breaker's cool-down ends, if it is still ahead.
    pub(crate) fn probe_at(&self, now: Instant) -> Option<Instant> {
        match self.state {
            State::Open { until } if until > now => Some(until),
            _ => None,
        }
    }

    /// A request is booked on the worker: if its cool-down is over, it is the probe.
    pub(crate) fn admit(&mut self, now: Instant) -> Ticket {
        let probe = matches!(self.state, State::Open { until } if now >= until);
        if probe {
            self.state = State::HalfOpen;
        }
        Ticket {
            epoch: self.epoch,
            probe,
        }
    }

    /// Applies an outcome: a request's (with its ticket) or a health check's (none).
    fn record(&mut self, ticket: Option<Ticket>, ok: bool, now: Instant, limits: (u32, Duration)) {
        if ticket.is_some_and(|t| t.epoch != self.epoch) {
            return;
        }
        let (max_failures, cooldown) = limits;
        self.state = match (ok, self.state) {
            (true, _) => State::Closed { failures: 0 },
            (false, State::Closed { failures }) if failures + 1 < max_failures => State::Closed {
                failures: failures + 1,
            },
            (false, _) => {
                self.epoch += 1;
                State::Open {
                    until: now + cooldown,
                }
            }
        };
    }

    /// The probe ended without an outcome: the next request may probe at once.
    fn abandon(&mut self, ticket: Ticket, now: Instant) {
        if ticket.probe && ticket.epoch == self.epoch && matches!(self.state, State::HalfOpen) {
            self.state = State::Open { until: now };
        }
    }

    pub(crate) fn is_closed(&self) -> bool {
        matches!(self.state, State::Closed { .. })
    }

    pub(crate) fn is_open(&self) -> bool {
        matches!(self.state, State::Open { .. })
    }

    pub(crate) fn gauge_value(&self) -> f64 {
        match self.state {
            State::Closed { .. } => 0.0,
            State::HalfOpen => 1.0,
            State::Open { .. } => 2.0,
        }
    }

    pub fn name(&self) -> &'static str {
        match self.state {
            State::Closed { .. } => "closed",
            State::HalfOpen => "half_open",
            State::Open { .. } => "open",
        }
    }
}

impl Registry {
    /// Feeds a health check's outcome into the worker's breaker.
    pub fn record_outcome(&self, worker_id: u64, ok: bool) {
        let mut fleet = self.lock();
        self.update_breaker(&mut fleet, worker_id, |b, now, limits| {
            b.record(None, ok, now, limits)
        });
    }

    /// Feeds a booked request's outcome into its worker's breaker.
    pub(crate) fn record_request_outcome(
        &self,
        fleet: &mut Fleet,
        worker_id: u64,
        ticket: Ticket,
        ok: bool,
    ) {
        self.update_breaker(fleet, worker_id, |b, now, limits| {
            b.record(Some(ticket), ok, now, limits)
        });
    }

    /// A booked request ended without an outcome.
    pub(crate) fn abandon_request(&self, fleet: &mut Fleet, worker_id: u64, ticket: Ticket) {
        self.update_breaker(fleet, worker_id, |b, now, _| b.abandon(ticket, now));
    }

    /// Changes a worker's breaker and keeps its gauge and the tripped set in step.
    /// A breaker that lets requests through again wakes the queued ones.
    fn update_breaker(
        &self,
        fleet: &mut Fleet,
        worker_id: u64,
        change: impl FnOnce(&mut Breaker, Instant, (u32, Duration)),
    ) {
        let Some(worker) = fleet.workers.get_mut(&worker_id) else {
            return;
        };
        let now = Instant::now();
        let was_available = worker.breaker.available(now);
        let was_open = worker.breaker.is_open();
        change(
            &mut worker.breaker,
            now,
            (self.limits.breaker_failures, self.limits.breaker_cooldown),
        );
        worker.breaker_gauge.set(worker.breaker.gauge_value());
        if worker.breaker.is_open() && !was_open {
            Registry::departed(worker);
        }
        let available = worker.breaker.available(now);
        if worker.breaker.is_closed() {
            fleet.tripped.remove(&worker_id);
        } else {
            fleet.tripped.insert(worker_id);
        }
        if available && !was_available {
            self.released.notify_waiters();
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::Duration;

    use kvroute_index::WorkerKey;
    use tokio::time::Instant;

    use crate::fleet::tests::{limits, reg};
    use crate::fleet::{Registry, Source};

    const KEY: WorkerKey = WorkerKey {
        worker_id: 1,
        dp_rank: 0,
    };
    const COOLDOWN: Duration = Duration::from_secs(10);

    /// A registry with worker 1, whose breaker opens at its first failure.
    fn registry() -> Arc<Registry> {
        let mut limits = limits();
        limits.breaker_failures = 1;
        limits.breaker_cooldown = COOLDOWN;
        let registry = Arc::new(Registry::new(limits));
        registry.register(reg(1, &["m"]), Source::Stream).unwrap();
        registry
    }

    fn available(registry: &Registry) -> bool {
        registry
            .lock()
            .available(KEY, &registry.limits, Instant::now())
    }

    fn state(registry: &Registry) -> &'static str {
        registry.lock().workers[&1].breaker.name()
    }

    #[test]
    fn breaker_opens_after_consecutive_failures_and_closes_on_success() {
        let registry = Arc::new(Registry::new(limits()));
        registry.register(reg(1, &["m"]), Source::Stream).unwrap();
        for _ in 0..registry.limits.breaker_failures {
            assert!(available(&registry));
            registry.record_outcome(1, false);
        }
        assert!(!available(&registry));
        registry.record_outcome(1, true);
        assert!(available(&registry));
    }

    #[tokio::test(start_paused = true)]
    async fn a_half_open_breaker_lets_exactly_one_probe_through() {
        let registry = registry();
        registry.record_outcome(1, false);
        assert!(!available(&registry));
        tokio::time::advance(COOLDOWN).await;
        assert!(available(&registry), "the cool-down is over");
        let mut probe = registry.book(KEY, 0, 0);
        assert_eq!(state(&registry), "half_open");
        // However long the probe takes, nothing else goes through meanwhile.
        tokio::time::advance(COOLDOWN * 100).await;
        assert!(!available(&registry));
        probe.record_outcome(true);
        assert_eq!(state(&registry), "closed");
        assert!(available(&registry));
    }

    #[tokio::test(start_paused = true)]
    async fn a_failed_probe_opens_the_breaker_for_another_cool_down() {
        let registry = registry();
        registry.record_outcome(1, false);
        tokio::time::advance(COOLDOWN).await;
        registry.book(KEY, 0, 0).record_outcome(false);
        assert_eq!(state(&registry), "open");
        tokio::time::advance(COOLDOWN - Duration::from_millis(1)).await;
        assert!(!available(&registry));
        tokio::time::advance(Duration::from_millis(1)).await;
        assert!(available(&registry));
    }

    #[tokio::test(start_paused = true)]
    async fn a_late_success_from_before_the_breaker_opened_does_not_close_it() {
        let registry = registry();
        let mut early = registry.book(KEY, 0, 0);
        registry.record_outcome(1, false);
        early.record_outcome(true);
        assert_eq!(state(&registry), "open");
        // Nor does one from before a probe failed and opened it again.
        tokio::time::advance(COOLDOWN).await;
        let mut probe = registry.book(KEY, 0, 0);
        let mut pinned = registry.book(KEY, 0, 0);
        probe.record_outcome(false);
        pinned.record_outcome(true);
        assert_eq!(state(&registry), "open");
    }

    #[tokio::test(start_paused = true)]
    async fn a_probe_that_ends_without_an_outcome_lets_the_next_request_probe() {
        let registry = registry();
        registry.record_outcome(1, false);
        tokio::time::advance(COOLDOWN).await;
        let probe = registry.book(KEY, 0, 0);
        assert!(!available(&registry));
        drop(probe);
        assert!(
            available(&registry),
            "no second cool-down for a cancelled probe"
        );
        assert_eq!(state(&registry), "open");
    }
}
