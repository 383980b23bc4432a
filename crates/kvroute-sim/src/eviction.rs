//! What each eviction policy cost an engine while it ran, for
//! `GET /admin/eviction` and `kvroute-lab sim stats`, and the optional eviction log.
//!
//! Every figure is kept per policy and counts only while that policy was the
//! engine's (a policy switched in at run time starts its own column, or
//! resumes its old one). The definitions, also in docs/measurements/cache-policy.md:
//!
//! - **evictions**: cached blocks the policy dropped.
//! - **decision time**: wall time of one eviction decision (the policy choosing
//!   and dropping its victim), mean and p99. Goal < 100 µs.
//! - **re-prefill rate**: of the blocks the policy evicted, the share that a
//!   later request had to prefill again (blocks are remembered for the last
//!   [`REMEMBERED_PER_BLOCK`] × pool-size evictions). Goal < 20%.
//! - **Jain fairness across requests**: each request scores the share of its
//!   full prompt blocks it did *not* have to prefill again because of an
//!   eviction; Jain's index `(Σx)² / (n·Σx²)` over requests at first admission
//!   (1: evictions hurt every request alike or none). Goal ≥ 0.8.
//! - **memory utilisation**: the share of KV slots holding a block (running or
//!   cached), averaged over engine iterations weighted by their simulated
//!   time. Goal ≥ 90%.
//! - **throughput lost against an infinite cache**: the simulated prefill time
//!   of re-prefilled blocks over all simulated busy time. An infinite cache
//!   never evicts, so it would have hit exactly those blocks and done the same
//!   work in that much less time. Goal < 5%.

use std::collections::{HashSet, VecDeque};
use std::time::Duration;

use hdrhistogram::Histogram;
use kvroute_cache::PolicyKind;
use serde::{Deserialize, Serialize};

/// Evicted blocks remembered (to recognise re-prefills), per pool slot.
pub const REMEMBERED_PER_BLOCK: usize = 8;

/// Why a block was evicted.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Reason {
    /// A request being admitted needed a slot for a prompt block.
    Prefill,
    /// A running request needed a slot for its partial block or new tokens.
    Decode,
    /// The policy dropped a block when one was handed back to it (S3FIFO's
    /// small queue overflowing), not because a slot was needed.
    Admission,
}

impl Reason {
    pub fn as_str(self) -> &'static str {
        match self {
            Reason::Prefill => "a prompt block needed a slot",
            Reason::Decode => "a running request needed a slot",
            Reason::Admission => "the policy dropped it on admission",
        }
    }
}

/// One eviction decision, for `--log-evictions`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EvictionRecord {
    pub policy: PolicyKind,
    pub blocks_freed: usize,
    pub reason: Reason,
}

/// One policy's running totals.
#[derive(Clone, Debug)]
struct Totals {
    policy: PolicyKind,
    evictions: u64,
    decision_ns: Histogram<u64>,
    re_prefills: u64,
    requests: u64,
    fairness_sum: f64,
    fairness_squares: f64,
    utilisation_weighted: f64,
    busy_s: f64,
    lost_s: f64,
}

impl Totals {
    fn new(policy: PolicyKind) -> Self {
        Totals {
            policy,
            evictions: 0,
            // `saturating_record` never grows a histogram, so bound it explicitly.
            decision_ns: Histogram::new_with_bounds(1, 3_600_000_000_000, 3)
                .expect("1 ns to 1 h at 3 significant figures is a valid range"),
            re_prefills: 0,
            requests: 0,
            fairness_sum: 0.0,
            fairness_squares: 0.0,
            utilisation_weighted: 0.0,
            busy_s: 0.0,
            lost_s: 0.0,
        }
    }
}

/// One policy's figures, as served and printed.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PolicyFigures {
    pub policy: String,
    pub evictions: u64,
    pub decision_mean_us: f64,
    pub decision_p99_us: f64,
    pub re_prefilled_blocks: u64,
    pub re_prefill_rate: f64,
    pub requests: u64,
    pub jain_fairness: f64,
    pub memory_utilisation: f64,
    pub busy_s: f64,
    pub throughput_lost: f64,
}

impl PolicyFigures {
    /// One policy's figures over several engines: counts add up, rates are
    /// taken over the sums (utilisation and throughput lost weighted by busy
    /// time, the mean decision time by evictions), and the p99 decision time
    /// and Jain's index are the worst engine's. `None` for no figures.
    pub fn combine(figures: &[PolicyFigures]) -> Option<PolicyFigures> {
        let first = figures.first()?;
        let sum = |f: &dyn Fn(&PolicyFigures) -> f64| figures.iter().map(f).sum::<f64>();
        let ratio = |a: f64, b: f64| if b == 0.0 { 0.0 } else { a / b };
        let evictions = figures.iter().map(|f| f.evictions).sum::<u64>();
        let re_prefilled = figures.iter().map(|f| f.re_prefilled_blocks).sum::<u64>();
        let busy = sum(&|f| f.busy_s);
        Some(PolicyFigures {
            policy: first.policy.clone(),
            evictions,
            decision_mean_us: ratio(
                sum(&|f| f.decision_mean_us * f.evictions as f64),
                evictions as f64,
            ),
            decision_p99_us: figures
                .iter()
                .map(|f| f.decision_p99_us)
                .fold(0.0, f64::max),
            re_prefilled_blocks: re_prefilled,
            re_prefill_rate: ratio(re_prefilled as f64, evictions as f64),
            requests: figures.iter().map(|f| f.requests).sum(),
            jain_fairness: figures.iter().map(|f| f.jain_fairness).fold(1.0, f64::min),
            memory_utilisation: ratio(sum(&|f| f.memory_utilisation * f.busy_s), busy),
            busy_s: busy,
            throughput_lost: ratio(sum(&|f| f.throughput_lost * f.busy_s), busy),
        })
    }
}

/// One goal of the issue, checked on a policy's figures.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Goal {
    pub figure: &'static str,
    pub goal: &'static str,
    pub value: String,
    pub met: bool,
}

impl PolicyFigures {
    /// The goals, each with this policy's value and whether it is met.
    pub fn goals(&self) -> Vec<Goal> {
        let pct = |x: f64| format!("{:.1}%", x * 100.0);
        let us = |x: f64| format!("{x:.2} µs");
        vec![
            Goal {
                figure: "decision time mean",
                goal: "< 100 µs",
                value: us(self.decision_mean_us),
                met: self.decision_mean_us < 100.0,
            },
            Goal {
                figure: "decision time p99",
                goal: "< 100 µs",
                value: us(self.decision_p99_us),
                met: self.decision_p99_us < 100.0,
            },
            Goal {
                figure: "re-prefill rate",
                goal: "< 20%",
                value: pct(self.re_prefill_rate),
                met: self.re_prefill_rate < 0.2,
            },
            Goal {
                figure: "Jain fairness (requests)",
                goal: ">= 0.8",
                value: format!("{:.3}", self.jain_fairness),
                met: self.jain_fairness >= 0.8,
            },
            Goal {
                figure: "memory utilisation",
                goal: ">= 90%",
                value: pct(self.memory_utilisation),
                met: self.memory_utilisation >= 0.9,
            },
            Goal {
                figure: "throughput lost vs infinite",
                goal: "< 5%",
                value: pct(self.throughput_lost),
                met: self.throughput_lost < 0.05,
            },
        ]
    }
}

/// Per-policy figures and the memory of recent victims.
#[derive(Debug)]
pub struct EvictionStats {
    totals: Vec<Totals>,
    current: usize,
    remembered: HashSet<u64>,
    order: VecDeque<u64>,
    remember: usize,
}

impl EvictionStats {
    pub fn new(policy: PolicyKind, pool_blocks: usize) -> Self {
        EvictionStats {
            totals: vec![Totals::new(policy)],
            current: 0,
            remembered: HashSet::new(),
            order: VecDeque::new(),
            remember: pool_blocks.saturating_mul(REMEMBERED_PER_BLOCK),
        }
    }

    /// From now on, figures count for `policy`.
    pub fn switch_to(&mut self, policy: PolicyKind) {
        self.current = match self.totals.iter().position(|t| t.policy == policy) {
            Some(at) => at,
            None => {
                self.totals.push(Totals::new(policy));
                self.totals.len() - 1
            }
        };
    }

    fn now(&mut self) -> &mut Totals {
        &mut self.totals[self.current]
    }

    /// One decision that took `elapsed` and evicted `victim`.
    pub fn evicted(&mut self, victim: u64, elapsed: Duration) {
        let totals = self.now();
        totals.evictions += 1;
        totals
            .decision_ns
            .saturating_record(elapsed.as_nanos() as u64);
        if self.remember == 0 {
            return;
        }
        if self.remembered.insert(victim) {
            self.order.push_back(victim);
        }
        while self.order.len() > self.remember {
            if let Some(old) = self.order.pop_front() {
                self.remembered.remove(&old);
            }
        }
    }

    /// Whether `hash` was evicted recently (and not prefilled again since).
    pub fn was_evicted(&self, hash: u64) -> bool {
        self.remembered.contains(&hash)
    }

    /// `hash` is being prefilled again after an eviction.
    pub fn re_prefilled(&mut self, hash: u64) {
        if self.remembered.remove(&hash) {
            self.now().re_prefills += 1;
        }
    }

    /// A request at its first admission: `lost` of its `blocks` full prompt
    /// blocks were evicted and are prefilled again.
    pub fn request(&mut self, lost: usize, blocks: usize) {
        if blocks == 0 {
            return;
        }
        let kept = 1.0 - lost as f64 / blocks as f64;
        let totals = self.now();
        totals.requests += 1;
        totals.fairness_sum += kept;
        totals.fairness_squares += kept * kept;
    }

    /// Simulated prefill time spent on re-prefilled blocks.
    pub fn lost(&mut self, time: Duration) {
        self.now().lost_s += time.as_secs_f64();
    }

    /// One engine iteration of `duration` with `utilisation` of the slots held.
    pub fn step(&mut self, duration: Duration, utilisation: f64) {
        let totals = self.now();
        let seconds = duration.as_secs_f64();
        totals.busy_s += seconds;
        totals.utilisation_weighted += utilisation * seconds;
    }

    pub fn figures(&self) -> Vec<PolicyFigures> {
        let ratio = |a: f64, b: f64| if b == 0.0 { 0.0 } else { a / b };
        self.totals
            .iter()
            .map(|t| PolicyFigures {
                policy: t.policy.to_string(),
                evictions: t.evictions,
                decision_mean_us: t.decision_ns.mean() / 1000.0,
                decision_p99_us: t.decision_ns.value_at_quantile(0.99) as f64 / 1000.0,
                re_prefilled_blocks: t.re_prefills,
                re_prefill_rate: ratio(t.re_prefills as f64, t.evictions as f64),
                requests: t.requests,
                jain_fairness: if t.fairness_squares == 0.0 {
                    1.0
                } else {
                    t.fairness_sum * t.fairness_sum / (t.requests as f64 * t.fairness_squares)
                },
                memory_utilisation: ratio(t.utilisation_weighted, t.busy_s),
                busy_s: t.busy_s,
                throughput_lost: ratio(t.lost_s, t.busy_s),
            })
            .collect()
    }
}
