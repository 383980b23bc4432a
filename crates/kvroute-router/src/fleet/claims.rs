//! Workers' claims against their own reports.
//!
//! A worker's KV events say which prompt blocks its rank holds, and the
//! scheduler credits the rank with that overlap: a worker that announces a
//! prompt's blocks without holding them would take every request for the
//! prompt. Its responses say what it really served from its cache
//! (`usage.prompt_tokens_details.cached_tokens`, read by
//! [`crate::cached_tokens`]), so each response that carries the count judges
//! the claim the request was routed on: the event-fed device overlap only, as
//! predicted entries are the router's own guesses and offload blocks are not
//! counted the same way by every engine.
//!
//! A claim fails when the worker reports fewer than `min_cached_share` of the
//! claimed tokens, less one block: engines recompute at least the prompt's last
//! token and count whole blocks, so an honest full hit reports a block less. A
//! claim too small for that margin is not judged, nor is a response without a
//! count: absence is not evidence (vLLM reports it only when non-zero, many
//! deployments not at all).
//!
//! Once `max_failed_claims` of a rank's last `claim_window` judged claims
//! failed, the rank is *demoted*: the scheduler counts none of its overlaps,
//! so it is routed on load alone, until a full dump replaces its index state
//! and restores it. A window of outcomes rather than a run of failures, so
//! that a worker cannot reset its count with an honest claim now and then, and
//! a share of it, so that the honest misses some requests make (blocks evicted
//! between routing and serving, requests that bypass the engine's cache) do
//! not demote an honest worker.

use kvroute_index::WorkerKey;

use crate::config::TrustConfig;
use crate::fleet::worker_label;
use crate::metrics;

/// The thresholds of [`Claims`], from `[trust]`.
#[derive(Clone, Debug)]
pub struct ClaimRules {
    /// At most 64: the window is a bit set.
    pub window: u32,
    pub max_failed: u32,
    pub min_cached_share: f64,
}

impl ClaimRules {
    pub fn from_config(trust: &TrustConfig) -> Self {
        Self {
            window: trust.claim_window,
            max_failed: trust.max_failed_claims,
            min_cached_share: trust.min_cached_share,
        }
    }

    /// Whether a response that reported `reported` cached tokens failed a
    /// claim of `claimed` tokens; `None` when the claim is too small to judge.
    pub fn failed(&self, claimed: u64, reported: u64, block_size: u64) -> Option<bool> {
        let required = claimed as f64 * self.min_cached_share - block_size as f64;
        (required > 0.0).then_some((reported as f64) < required)
    }
}

/// One rank's judged claims and whether it is demoted.
pub struct Claims {
    /// The last judged claims, the newest in bit 0; a set bit failed. Only the
    /// window's bits are kept.
    recent: u64,
    demoted: bool,
    failed_total: ::metrics::Counter,
    demoted_gauge: ::metrics::Gauge,
}

impl Claims {
    pub fn new(key: WorkerKey) -> Self {
        let label = worker_label(key);
        let demoted_gauge = ::metrics::gauge!(metrics::DEMOTED, "worker" => label.clone());
        demoted_gauge.set(0.0);
        Self {
            recent: 0,
            demoted: false,
            failed_total: ::metrics::counter!(metrics::CLAIMS_FAILED, "worker" => label),
            demoted_gauge,
        }
    }

    /// Whether the rank's overlaps are left out of routing.
    pub fn demoted(&self) -> bool {
        self.demoted
    }

    /// Records one judged claim; true when it demotes the rank.
    pub fn record(&mut self, failed: bool, rules: &ClaimRules) -> bool {
        let window = u64::MAX >> (64 - rules.window);
        self.recent = ((self.recent << 1) | u64::from(failed)) & window;
        if failed {
            self.failed_total.increment(1);
        }
        if self.demoted || self.recent.count_ones() < rules.max_failed {
            return false;
        }
        self.demoted = true;
        self.demoted_gauge.set(1.0);
        true
    }

    /// A full dump replaced the rank's state: its claims start afresh. True
    /// when the rank was demoted.
    pub fn restore(&mut self) -> bool {
        self.recent = 0;
        self.demoted_gauge.set(0.0);
        std::mem::take(&mut self.demoted)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rules(window: u32, max_failed: u32) -> ClaimRules {
        ClaimRules {
            window,
            max_failed,
            min_cached_share: 0.5,
        }
    }

    #[test]
    fn a_claim_fails_below_the_share_less_a_block_and_small_ones_are_not_judged() {
        let r = rules(32, 16);
        // 8 blocks claimed: at least 64 - 16 = 48 tokens must be reported.
        assert_eq!(r.failed(128, 0, 16), Some(true));
        assert_eq!(r.failed(128, 47, 16), Some(true));
        assert_eq!(r.failed(128, 48, 16), Some(false));
        // An honest full hit that recomputes the last block.
        assert_eq!(r.failed(128, 112, 16), Some(false));
        // Two blocks: half of them is within the one block's margin.
        assert_eq!(r.failed(32, 0, 16), None);
        assert_eq!(r.failed(0, 0, 16), None);
    }

    #[test]
    fn a_rank_is_demoted_by_failures_within_the_window_and_restored_by_a_dump() {
        let r = rules(4, 3);
        let mut claims = Claims::new(WorkerKey::new(1, 0));
        // Failures spread wider than the window never demote.
        for _ in 0..10 {
            for failed in [true, false, false] {
                assert!(!claims.record(failed, &r));
            }
        }
        assert!(!claims.demoted());
        // Honest claims in between do not reset the count.
        assert!(!claims.record(true, &r));
        assert!(!claims.record(false, &r));
        assert!(!claims.record(true, &r));
        assert!(claims.record(true, &r), "3 of the last 4 failed");
        assert!(claims.demoted());
        assert!(!claims.record(true, &r), "demoted once");
        assert!(claims.restore());
        assert!(!claims.demoted());
        assert!(!claims.record(true, &r), "the window starts afresh");
        assert!(!claims.restore());
    }

    #[test]
    fn a_window_of_64_keeps_every_bit() {
        let r = rules(64, 64);
        let mut claims = Claims::new(WorkerKey::new(1, 0));
        for _ in 0..63 {
            assert!(!claims.record(true, &r));
        }
        assert!(claims.record(true, &r));
    }
}
