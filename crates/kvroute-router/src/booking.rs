//! Bookings: the load a routed request puts on its rank, as the router itself
//! counts it (requests in flight, prompt tokens waiting for prefill, KV blocks),
//! until the worker's own reports catch up.
//!
//! A [`Booking`] is an RAII guard: whatever is still booked is released when it
//! drops, so a request that fails, is cancelled or panics cannot leak load that
//! would keep its rank looking busy forever. Every change re-keys the rank in the
//! load order and wakes requests queued for a free rank.

use std::sync::Arc;
use std::time::Instant;

use kvroute_index::WorkerKey;

use crate::breaker::Breaker;
use crate::registry::Registry;

impl Registry {
    /// Books a routed request on `key`: its new prefill tokens and its blocks.
    pub fn book(self: &Arc<Self>, key: WorkerKey, prefill_tokens: u64, blocks: u64) -> Booking {
        let mut fleet = self.lock();
        if let Some(rank) = fleet.ranks.get_mut(&key) {
            rank.booked_requests += 1;
            rank.booked_prefill_tokens += prefill_tokens;
            rank.booked_blocks += blocks;
            rank.routed.increment(1);
            fleet.rekey(key, &self.limits);
        }
        if let Some(worker) = fleet.workers.get_mut(&key.worker_id) {
            worker.last_request = Instant::now();
            if worker
                .breaker
                .available(Instant::now(), self.limits.breaker_cooldown)
                && matches!(worker.breaker, Breaker::Open { .. })
            {
                // The cool-down is over and this request is the probe.
                worker.breaker = Breaker::HalfOpen {
                    since: Instant::now(),
                };
                worker.breaker_gauge.set(1.0);
            }
        }
        Booking {
            registry: Arc::clone(self),
            key,
            prefill_tokens,
            blocks,
        }
    }

    fn unbook(&self, key: WorkerKey, prefill_tokens: u64, blocks: u64, request: bool) {
        let mut fleet = self.lock();
        if let Some(rank) = fleet.ranks.get_mut(&key) {
            rank.booked_prefill_tokens = rank.booked_prefill_tokens.saturating_sub(prefill_tokens);
            rank.booked_blocks = rank.booked_blocks.saturating_sub(blocks);
            if request {
                rank.booked_requests = rank.booked_requests.saturating_sub(1);
            }
            fleet.rekey(key, &self.limits);
        }
        drop(fleet);
        self.released.notify_waiters();
    }
}

/// A request's load on a rank; dropping it releases whatever is still booked.
pub struct Booking {
    registry: Arc<Registry>,
    key: WorkerKey,
    prefill_tokens: u64,
    blocks: u64,
}

impl Booking {
    pub fn key(&self) -> WorkerKey {
        self.key
    }

    /// The worker failed this request after its response started (it went
    /// silent): a failure for its breaker, as a timeout before the first byte is.
    pub fn record_failure(&self) {
        self.registry.record_outcome(self.key.worker_id, false);
    }

    /// The first token arrived: the prompt is no longer waiting for prefill.
    pub fn release_prefill(&mut self) {
        let tokens = std::mem::take(&mut self.prefill_tokens);
        if tokens > 0 {
            self.registry.unbook(self.key, tokens, 0, false);
        }
    }
}

impl Drop for Booking {
    fn drop(&mut self) {
        self.registry
            .unbook(self.key, self.prefill_tokens, self.blocks, true);
    }
}
