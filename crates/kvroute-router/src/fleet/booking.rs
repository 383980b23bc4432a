//! Bookings: the load a routed request puts on its rank, as the router itself
//! counts it (requests in flight, prompt tokens waiting for prefill, KV blocks),
//! until the worker's own reports catch up.
//!
//! A [`Booking`] is an RAII guard: whatever is still booked is released when it
//! drops, so a request that fails, is cancelled or panics cannot leak load that
//! would keep its rank looking busy forever. Every change re-keys the rank in the
//! load order and wakes requests queued for a free rank. A booking also carries
//! the request's breaker [`Ticket`] and reports the request's one outcome.
//!
//! Booking happens under the same fleet lock as the choice
//! ([`crate::schedule::Scheduler::choose_and_book`]): between a choice and a
//! separate booking, concurrent requests would all see the same free rank and
//! overrun `busy_max_inflight`, and all take the same due probe.
//!
//! ## When prefill ends
//!
//! A request's new prompt tokens count as prefill load until its first token.
//! A stream shows that moment (its first data frame). A non-streaming response
//! shows nothing until generation is over, so holding its prefill until then
//! would charge a decoding request as if it were still prefilling, and skew `kv`
//! costs against its rank. Its prefill is released at an *estimate* of its
//! first token instead: the rank's recent time to first token per prefilled
//! token, measured on its streams, times the request's new tokens. An estimate,
//! not the worker's reported load, because the reports cannot say when one
//! request's prefill ended: vLLM reports no prefill tokens at all, only counts
//! of running and waiting requests, and a report may predate the request's
//! arrival. A rank with no stream measured yet keeps the booking until the
//! response, as before.

use std::sync::Arc;
use std::time::Duration;

use kvroute_index::WorkerKey;

use crate::fleet::breaker::Ticket;
use crate::fleet::{Fleet, Registry};

/// Weight of a new sample in a rank's prefill-time estimate.
const PREFILL_RATE_WEIGHT: f64 = 0.2;

impl Registry {
    /// Books a request on `key` (its new prefill tokens and its blocks) without
    /// choosing: for callers that already know the rank.
    pub fn book(self: &Arc<Self>, key: WorkerKey, prefill_tokens: u64, blocks: u64) -> Booking {
        let mut fleet = self.lock();
        self.book_locked(
            &mut fleet,
            key,
            prefill_tokens,
            blocks,
            tokio::time::Instant::now(),
        )
    }

    /// Books under a lock the caller holds since its choice, made at `now`.
    pub(crate) fn book_locked(
        self: &Arc<Self>,
        fleet: &mut Fleet,
        key: WorkerKey,
        prefill_tokens: u64,
        blocks: u64,
        now: tokio::time::Instant,
    ) -> Booking {
        let mut first_token_estimate = None;
        let mut tokens_ahead = 0;
        let booked = fleet.update_rank(key, &self.limits, |rank| {
            tokens_ahead = rank.prefill_tokens();
            rank.booked_requests += 1;
            rank.booked_prefill_tokens += prefill_tokens;
            rank.booked_blocks += blocks;
            rank.routed.increment(1);
            first_token_estimate = rank
                .prefill_seconds_per_token
                .map(|rate| Duration::from_secs_f64(rate * prefill_tokens as f64));
        });
        if booked.is_some() {
            self.note_booking(fleet, key);
        }
        let departures = Registry::departures(fleet, key.worker_id);
        let ticket = fleet.workers.get_mut(&key.worker_id).map(|worker| {
            worker.last_request = now;
            let ticket = worker.breaker.admit(now);
            if ticket.is_probe() {
                worker.breaker_gauge.set(worker.breaker.gauge_value());
            }
            ticket
        });
        Booking {
            registry: Arc::clone(self),
            key,
            prefill_tokens,
            tokens_ahead,
            blocks,
            ticket,
            first_token_estimate,
            departures,
        }
    }

    fn unbook(
        &self,
        fleet: &mut Fleet,
        key: WorkerKey,
        prefill_tokens: u64,
        blocks: u64,
        request: bool,
    ) {
        let released = fleet.update_rank(key, &self.limits, |rank| {
            rank.booked_prefill_tokens = rank.booked_prefill_tokens.saturating_sub(prefill_tokens);
            rank.booked_blocks = rank.booked_blocks.saturating_sub(blocks);
            if request {
                rank.booked_requests = rank.booked_requests.saturating_sub(1);
            }
        });
        if released.is_some() {
            self.note_booking(fleet, key);
        }
    }
}

/// A request's load on a rank; dropping it releases whatever is still booked.
pub struct Booking {
    registry: Arc<Registry>,
    key: WorkerKey,
    prefill_tokens: u64,
    /// Prompt tokens the rank had waiting for prefill when this one was booked.
    tokens_ahead: u64,
    blocks: u64,
    /// `None` once the request's outcome went to the breaker (or the worker was gone).
    ticket: Option<Ticket>,
    first_token_estimate: Option<Duration>,
    /// Changes when the worker leaves routing after the booking; `None` once
    /// taken ([`Self::departures`]), or if the worker was gone.
    departures: Option<tokio::sync::watch::Receiver<()>>,
}

impl Booking {
    pub fn key(&self) -> WorkerKey {
        self.key
    }

    /// The request's outcome for its worker's breaker; only the first one counts.
    pub fn record_outcome(&mut self, ok: bool) {
        if let Some(ticket) = self.ticket.take() {
            let mut fleet = self.registry.lock();
            self.registry
                .record_request_outcome(&mut fleet, self.key.worker_id, ticket, ok);
        }
    }

    /// Judges the claim of `claimed` tokens the request was routed on against
    /// the `reported` cached tokens of its response ([`crate::fleet::claims`]).
    pub fn judge_claim(&self, claimed: u64, reported: u64) {
        self.registry.judge_claim(self.key, claimed, reported);
    }

    /// What tells that the worker left routing since the booking (a change, or
    /// the channel's close); `None` the second time.
    pub fn departures(&mut self) -> Option<tokio::sync::watch::Receiver<()>> {
        self.departures.take()
    }

    /// When the first token is expected, from the rank's recent streams; see the module doc.
    pub fn first_token_estimate(&self) -> Option<Duration> {
        self.first_token_estimate
    }

    /// The prompt is no longer waiting for prefill (its first token is estimated to be out).
    pub fn release_prefill(&mut self) {
        let tokens = std::mem::take(&mut self.prefill_tokens);
        if tokens > 0 {
            let mut fleet = self.registry.lock();
            self.registry.unbook(&mut fleet, self.key, tokens, 0, false);
            drop(fleet);
            self.registry.released.notify_waiters();
        }
    }

    /// The first token arrived `ttft` after sending: releases the prefill and
    /// refines the rank's estimates of time to first token per prefilled token,
    /// its own and those it waited for (its measured rate, for the `seconds` cost).
    pub fn first_token(&mut self, ttft: Duration) {
        let tokens = std::mem::take(&mut self.prefill_tokens);
        if tokens == 0 {
            return;
        }
        let mut fleet = self.registry.lock();
        self.registry.unbook(&mut fleet, self.key, tokens, 0, false);
        // A prompt shorter than a block is mostly fixed overhead, not prefill.
        if tokens >= self.registry.limits.block_size as u64
            && let Some(rank) = fleet.ranks.get_mut(&self.key)
        {
            let ttft = ttft.as_secs_f64();
            let average = |estimate: Option<f64>, sample: f64| {
                Some(estimate.map_or(sample, |rate| rate + PREFILL_RATE_WEIGHT * (sample - rate)))
            };
            rank.prefill_seconds_per_token =
                average(rank.prefill_seconds_per_token, ttft / tokens as f64);
            rank.queued_seconds_per_token = average(
                rank.queued_seconds_per_token,
                ttft / (tokens + self.tokens_ahead) as f64,
            );
        }
        drop(fleet);
        self.registry.released.notify_waiters();
    }
}

impl Drop for Booking {
    fn drop(&mut self) {
        let mut fleet = self.registry.lock();
        self.registry
            .unbook(&mut fleet, self.key, self.prefill_tokens, self.blocks, true);
        if let Some(ticket) = self.ticket.take() {
            self.registry
                .abandon_request(&mut fleet, self.key.worker_id, ticket);
        }
        drop(fleet);
        self.registry.released.notify_waiters();
    }
}
