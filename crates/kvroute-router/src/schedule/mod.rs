//! Choosing a worker rank for a request.
//!
//! The default policy `kv` weighs each rank's prefix overlap against its load,
//! lowest cost wins. Its units are `scheduler.cost`:
//!
//! ```text
//! blocks (Dynamo's cost, the default):
//!   cost           = overlap_weight × prefill_blocks + decode_blocks
//!   prefill_blocks = (rank's prefill tokens in flight + prompt tokens not covered by its overlap) / block size
//!   decode_blocks  = rank's active blocks + this request's blocks
//! seconds:
//!   cost = (rank's prefill tokens in flight + uncovered prompt tokens) × rank's seconds per token
//!        + decode_seconds_per_block × decode_blocks
//! ```
//!
//! Why seconds: a block of prefill, a queued token and a decoding block are
//! not worth the same on every rank. A rank's seconds per token is measured
//! from its streams as time to first token over the tokens it had to prefill up
//! to it (those in flight when the request was booked, and its own), so a rank
//! slowed by decoding or by a slower GPU is charged for it; until measured, the
//! configured `prefill_seconds_per_token` stands in.
//!
//! `overlap_slack` makes the choice two-tier: ranks within `overlap_slack` of
//! the cheapest (in the cost's units) count as equally loaded, and the deepest
//! overlap among them wins. A few milliseconds of queue then no longer send a
//! conversation away from the rank that holds its history, which would both
//! recompute it and duplicate it in a second cache.
//!
//! `overlap_decay_blocks` (off by default) is the opposite lever: the overlap a
//! rank holds counts as saved prefill in full while the rank is idle and less
//! as its prefill queue grows, so that a busy holder pulls less.
//!
//! The overlap is max(event-fed depth, predicted depth) and the load is the
//! router's own bookings blended (max) with what the rank reports. A rank
//! demoted for claims its responses contradict ([`crate::fleet::claims`]) has no
//! overlap of any kind: it is costed on its load alone.
//!
//! Storage-tier credit: blocks past that (device) prefix that the rank holds in
//! its offload tier (host memory, disk; kvroute-index's `tiers`) can be loaded
//! instead of prefilled, which costs far less but not nothing. The overlap
//! scored is `device + offload_weight × (reach − device)`, where `reach` is how
//! deep the device and offload tiers together cover the prompt: each tier's
//! index holds only chains whose parents it holds, so the union of the two
//! prefixes is the longer one, and `reach = max(device, offload depth)`. Ties go to the
//! rank with fewer indexed blocks, then at random; `temperature > 0` samples a
//! softmax over costs normalised by the largest.
//!
//! A rank whose circuit breaker is due a probe gets the next request whatever
//! its cost, so that a worker that recovered gets back into routing.
//!
//! Only ranks that matched the prompt and the first few ranks of the group's load
//! order are costed: an unmatched rank's cost differs from another unmatched
//! rank's only by its load, so the cheapest unmatched ranks are the least loaded
//! ones (see [`crate::fleet`]; the load order is the `blocks` cost's, which
//! the `seconds` cost follows wherever ranks prefill at the same rate). Under
//! the `blocks` cost, at temperature 0, the walk down the load order stops
//! after the least loaded unmatched rank once no unmatched rank can cost as
//! little as the cheapest matched one: each costed rank was a cold read or
//! two, and 33 of them (32 tied idle ranks) were a routing decision's tail.

pub mod queue;

use std::cell::RefCell;
use std::sync::Arc;

use tokio::time::Instant;

use kvroute_index::{KvIndex, PredictedIndex, WorkerKey};
use rustc_hash::FxHashMap;
use serde::Serialize;

use crate::config::{Cost, Policy};
use crate::fleet::booking::Booking;
use crate::fleet::{Fleet, Limits, Rank, Registry};
use crate::metrics;

/// Unmatched ranks costed per decision (more if they tie on load).
const UNMATCHED_CANDIDATES: usize = 8;
/// Most tied unmatched ranks considered, so that a fleet of idle ranks is not walked whole.
const MAX_TIED: usize = 32;

pub struct RouteQuery<'a> {
    /// The model or adapter name the request asks for.
    pub name: &'a str,
    pub prompt_tokens: usize,
    pub local_hashes: &'a [u64],
    /// Only this worker's ranks (the `x-kvroute-worker` header).
    pub pin: Option<u64>,
    /// Worker ids already tried for this request.
    pub exclude: &'a [u64],
}

#[derive(Clone, Debug, Serialize)]
pub struct Score {
    pub worker_id: u64,
    pub dp_rank: u32,
    /// Device-tier overlap: max(event-fed, predicted). Every overlap of a
    /// demoted rank ([`crate::fleet::claims`]) is 0.
    pub overlap_blocks: u32,
    pub event_overlap_blocks: u32,
    pub predicted_overlap_blocks: u32,
    /// How deep the device and offload tiers together cover the prompt.
    pub offload_overlap_blocks: u32,
    /// The overlap the cost counts: the device overlap plus `offload_weight`
    /// of the blocks only the offload tier adds.
    pub scored_overlap_blocks: f64,
    pub prefill_blocks: f64,
    pub decode_blocks: f64,
    pub cost: f64,
}

#[derive(Clone, Debug)]
pub struct Decision {
    pub worker: WorkerKey,
    pub base_url: Arc<str>,
    /// Whether the chosen worker publishes KV events (see [`crate::state::AppState::record_prediction`]).
    pub publishes_events: bool,
    pub overlap_blocks: u32,
    /// The chosen rank's event-fed overlap: what its worker claims to hold,
    /// judged against its response ([`crate::fleet::claims`]).
    pub claimed_blocks: u32,
    pub request_blocks: u64,
    /// Prompt tokens the chosen rank must prefill.
    pub new_prefill_tokens: u64,
    /// The ranks costed, cheapest first.
    pub scores: Vec<Score>,
}

#[derive(Debug, PartialEq, Eq)]
pub enum NoWorker {
    /// Every routable rank for the name is over its busy thresholds or has its
    /// breaker open; `probe_at`: when the first of those breakers' cool-down ends.
    AllBusy { probe_at: Option<Instant> },
    /// No rank serving the name is routable (or the pinned worker is not).
    NoneRoutable,
}

pub struct Scheduler {
    pub registry: Arc<Registry>,
    /// The device tier's index.
    pub index: Arc<KvIndex>,
    /// The offload tier's index.
    pub offload: Arc<KvIndex>,
    /// `scheduler.offload_weight`.
    pub offload_weight: f64,
    pub predicted: Arc<PredictedIndex>,
    pub policy: Policy,
    pub temperature: f64,
}

/// Overlap found for one rank: (event-fed depth, predicted depth, offload
/// tier's depth, indexed blocks).
type Overlaps = FxHashMap<WorkerKey, (u32, u32, u32, u64)>;

thread_local! {
    /// The thread's overlap map, cleared for each decision rather than made
    /// anew: a fresh one was an allocation per routed request.
    static OVERLAPS: RefCell<Overlaps> = RefCell::default();
}

/// Runs `f` with the thread's overlap map, empty (a map of its own if the
/// thread's is in use).
fn with_overlaps<R>(f: impl FnOnce(&mut Overlaps) -> R) -> R {
    OVERLAPS.with(|kept| match kept.try_borrow_mut() {
        Ok(mut overlaps) => {
            overlaps.clear();
            f(&mut overlaps)
        }
        Err(_) => f(&mut Overlaps::default()),
    })
}

impl Scheduler {
    /// Chooses a rank as of `now`; books nothing and records nothing (a dry run).
    pub fn choose(&self, query: &RouteQuery<'_>, now: Instant) -> Result<Decision, NoWorker> {
        with_overlaps(|overlaps| {
            let started = self.timed_overlaps(query, now, overlaps);
            let fleet = self.registry.lock();
            let decision = self.choose_locked(&fleet, query, overlaps, now);
            drop(fleet);
            metrics::observe_phase(metrics::Phase::Schedule, started);
            decision
        })
    }

    /// Chooses a rank and books the request on it in one step under the fleet
    /// lock, so that concurrent requests each see the others' bookings (and
    /// only one of them becomes a due breaker probe). `now`: the caller's
    /// reading of the clock, one for the whole decision and its booking.
    pub fn choose_and_book(
        &self,
        query: &RouteQuery<'_>,
        now: Instant,
    ) -> Result<(Decision, Booking), NoWorker> {
        with_overlaps(|overlaps| {
            let started = self.timed_overlaps(query, now, overlaps);
            let mut fleet = self.registry.lock();
            let chosen = self.choose_locked(&fleet, query, overlaps, now).map(|d| {
                let booking = self.registry.book_locked(
                    &mut fleet,
                    d.worker,
                    d.new_prefill_tokens,
                    d.request_blocks,
                    now,
                );
                (d, booking)
            });
            drop(fleet);
            metrics::observe_phase(metrics::Phase::Schedule, started);
            chosen
        })
    }

    /// The deepest cached prefix (in blocks, capped at the prompt's) the query
    /// has on a rank that could take it now: what the wait queue's
    /// `longest_prefix` order ranks waiters by (see [`crate::schedule::queue`]).
    pub fn overlap_now(&self, query: &RouteQuery<'_>) -> u32 {
        let now = Instant::now();
        with_overlaps(|overlaps| self.overlap_now_in(query, now, overlaps))
    }

    fn overlap_now_in(&self, query: &RouteQuery<'_>, now: Instant, overlaps: &mut Overlaps) -> u32 {
        self.overlaps(query.local_hashes, now.into_std(), overlaps);
        if overlaps.is_empty() {
            return 0;
        }
        let limits = &self.registry.limits;
        let request_blocks = (query.prompt_tokens as u64).div_ceil(limits.block_size as u64);
        let fleet = self.registry.lock();
        let Some(group) = fleet.groups.get(query.name) else {
            return 0;
        };
        overlaps
            .iter()
            .filter(|&(&key, _)| {
                group.members.binary_search(&key).is_ok()
                    && query.pin.is_none_or(|pin| pin == key.worker_id)
                    && !query.exclude.contains(&key.worker_id)
                    && fleet.available(key, limits, now)
                    && fleet.ranks.get(&key).is_some_and(|r| !r.claims.demoted())
            })
            .map(|(_, &(event, predicted, _, _))| event.max(predicted))
            .max()
            .unwrap_or(0)
            .min(request_blocks.min(u32::MAX as u64) as u32)
    }

    /// Fills `overlaps` and times it as the `find_matches` phase; returns
    /// the clock reading that ended it, which starts the `schedule` phase (one
    /// read for both).
    fn timed_overlaps(
        &self,
        query: &RouteQuery<'_>,
        now: Instant,
        overlaps: &mut Overlaps,
    ) -> std::time::Instant {
        let started = std::time::Instant::now();
        self.overlaps(query.local_hashes, now.into_std(), overlaps);
        let ended = std::time::Instant::now();
        metrics::record_phase(metrics::Phase::FindMatches, ended - started);
        ended
    }

    /// Fills `overlaps` (empty) for `local_hashes`.
    fn overlaps(&self, local_hashes: &[u64], now: std::time::Instant, overlaps: &mut Overlaps) {
        if local_hashes.is_empty() {
            return;
        }
        let uses_events = matches!(self.policy, Policy::Kv);
        let uses_predictions = matches!(self.policy, Policy::Kv | Policy::Approx);
        if uses_events {
            for m in self.index.find_matches(local_hashes) {
                overlaps.insert(m.worker, (m.depth, 0, 0, m.total_blocks));
            }
            if self.offload_weight > 0.0 {
                for m in self.offload.find_matches(local_hashes) {
                    let entry = overlaps
                        .entry(m.worker)
                        .or_insert_with(|| (0, 0, 0, self.index.worker_blocks(m.worker)));
                    entry.2 = m.depth;
                }
            }
        }
        if uses_predictions {
            self.predicted.for_each_match(local_hashes, now, |m| {
                let entry = overlaps
                    .entry(m.worker)
                    .or_insert((0, 0, 0, m.total_blocks));
                entry.1 = m.depth;
            });
        }
    }

    fn choose_locked(
        &self,
        fleet: &Fleet,
        query: &RouteQuery<'_>,
        overlaps: &Overlaps,
        now: Instant,
    ) -> Result<Decision, NoWorker> {
        let limits = &self.registry.limits;
        let group = fleet
            .groups
            .get(query.name)
            .filter(|g| !g.members.is_empty())
            .ok_or(NoWorker::NoneRoutable)?;
        let usable = |key: WorkerKey| {
            !query.exclude.contains(&key.worker_id) && fleet.available(key, limits, now)
        };

        let block_size = limits.block_size as u64;
        let request_blocks = (query.prompt_tokens as u64).div_ceil(block_size);
        let score = |key: WorkerKey| {
            let rank = fleet.ranks.get(&key)?;
            let (event, predicted, offload, _) = if rank.claims.demoted() {
                Default::default()
            } else {
                overlaps.get(&key).copied().unwrap_or_default()
            };
            let overlap = event.max(predicted).min(request_blocks as u32);
            let reach = offload.min(request_blocks as u32).max(overlap);
            let scored = scored_overlap(overlap, reach, self.offload_weight);
            let overlap_tokens = covered_tokens(query.prompt_tokens, scored, block_size);
            let new_tokens = query.prompt_tokens as u64 - overlap_tokens;
            let load = RankLoad::of(rank);
            Some(Score {
                worker_id: key.worker_id,
                dp_rank: key.dp_rank,
                overlap_blocks: overlap,
                event_overlap_blocks: event,
                predicted_overlap_blocks: predicted,
                offload_overlap_blocks: reach,
                scored_overlap_blocks: scored,
                prefill_blocks: (load.prefill_tokens + new_tokens) as f64 / block_size as f64,
                decode_blocks: (load.active_blocks + request_blocks) as f64,
                cost: cost(limits, &load, new_tokens, overlap_tokens, request_blocks),
            })
        };

        let mut scores = Vec::new();
        if let Some(pin) = query.pin {
            // A pinned request skips busy and breaker checks: the caller asked for it.
            scores.extend(
                group
                    .members
                    .iter()
                    .copied()
                    .filter(|k| k.worker_id == pin)
                    .filter_map(score),
            );
            if scores.is_empty() {
                return Err(NoWorker::NoneRoutable);
            }
        } else if let Some(probe) = fleet.probe_due(group, now, usable) {
            scores.extend(score(probe));
        } else {
            match self.policy {
                Policy::Kv | Policy::Approx => {
                    // The ranks that matched, then the least loaded of the rest.
                    scores.extend(
                        overlaps
                            .keys()
                            .copied()
                            .filter(|&k| group.members.binary_search(&k).is_ok() && usable(k))
                            .filter_map(score),
                    );
                    let cheapest = scores.iter().map(|s| s.cost).fold(f64::INFINITY, f64::min);
                    let floor = self.unmatched_floor(limits, query.prompt_tokens, request_blocks);
                    let mut taken = 0;
                    let mut last_load = None;
                    for &(load, key) in &group.by_load {
                        if taken >= MAX_TIED
                            || (taken >= UNMATCHED_CANDIDATES && last_load != Some(load))
                            || (taken >= 1 && floor.as_ref().is_some_and(|f| f(load) > cheapest))
                        {
                            break;
                        }
                        if overlaps.contains_key(&key) || !usable(key) {
                            continue;
                        }
                        scores.extend(score(key));
                        taken += 1;
                        last_load = Some(load);
                    }
                }
                Policy::LeastLoaded => scores.extend(
                    group
                        .by_load
                        .iter()
                        .map(|&(_, k)| k)
                        .find(|&k| usable(k))
                        .and_then(score),
                ),
                Policy::RoundRobin => scores.extend(
                    first_usable(&group.members, group.next_round_robin(), usable).and_then(score),
                ),
                Policy::Random => {
                    let start = rand::random_range(0..group.members.len());
                    scores.extend(first_usable(&group.members, start, usable).and_then(score));
                }
                Policy::PowerOfTwo => {
                    let n = group.members.len();
                    // Two distinct starting ranks: drawing the same one twice would
                    // send the request there whatever its load.
                    let first = rand::random_range(0..n);
                    let second = (first + rand::random_range(1..n.max(2))) % n;
                    let a = first_usable(&group.members, first, usable);
                    let b = first_usable(&group.members, second, usable);
                    let chosen = match (a, b) {
                        (Some(a), Some(b)) => {
                            let load = |k: &WorkerKey| fleet.ranks.get(k).map_or(0, |r| r.load_key);
                            Some(if load(&b) < load(&a) { b } else { a })
                        }
                        (a, b) => a.or(b),
                    };
                    scores.extend(chosen.and_then(score));
                }
            }
        }
        if scores.is_empty() {
            return Err(NoWorker::AllBusy {
                probe_at: fleet.next_probe_at(group, query.exclude, now),
            });
        }
        scores.sort_by(|a, b| a.cost.total_cmp(&b.cost));
        let chosen = self.pick(&scores, overlaps, limits.overlap_slack);
        let score = &scores[chosen];
        let worker = WorkerKey::new(score.worker_id, score.dp_rank);
        let chosen = &fleet.workers[&worker.worker_id];
        Ok(Decision {
            worker,
            base_url: Arc::clone(&chosen.base_url),
            publishes_events: chosen.source == crate::fleet::Source::Stream,
            overlap_blocks: score.overlap_blocks,
            claimed_blocks: score.event_overlap_blocks.min(score.overlap_blocks),
            request_blocks,
            new_prefill_tokens: query.prompt_tokens as u64
                - covered_tokens(query.prompt_tokens, score.scored_overlap_blocks, block_size),
            scores,
        })
    }

    /// Under the `blocks` cost and a deterministic pick, the least cost an
    /// unmatched rank can have, as a function of its load key
    /// ([`Fleet::load_from_key`]): its load plus the whole prompt to prefill. The
    /// load order ranks unmatched ranks by exactly that cost, so once it
    /// passes the cheapest matched rank's, no unmatched rank further on can
    /// be chosen, tie or not (the slack only ever moves the choice to a
    /// deeper overlap, which an unmatched rank does not have). Costing them
    /// anyway was one or two cold reads per rank, 33 ranks at an idle fleet.
    /// `None` where ranks' costs do not follow the load order (`seconds`) or
    /// every rank costed counts (`temperature`).
    fn unmatched_floor(
        &self,
        limits: &Limits,
        prompt_tokens: usize,
        request_blocks: u64,
    ) -> Option<impl Fn(u64) -> f64> {
        if !matches!(limits.cost, Cost::Blocks) || self.temperature > 0.0 {
            return None;
        }
        let prompt = limits.overlap_weight * prompt_tokens as f64 / limits.block_size as f64
            + request_blocks as f64;
        // A key is its load's cost scaled and truncated: one step lower covers
        // any rounding, and the margin keeps near-ties costed.
        Some(move |load_key: u64| {
            let floor = Fleet::load_from_key(load_key.saturating_sub(1)) + prompt;
            floor - 1e-6 * floor.max(1.0)
        })
    }

    /// Index into `scores` (sorted by cost) of the rank to use.
    fn pick(&self, scores: &[Score], overlaps: &Overlaps, slack: f64) -> usize {
        if scores.len() == 1 {
            return 0;
        }
        if slack > 0.0 && self.temperature == 0.0 {
            let deepest = deepest_within_slack(scores, slack);
            if scores[deepest].overlap_blocks > scores[0].overlap_blocks {
                return deepest;
            }
        }
        if self.temperature > 0.0 {
            let max = scores.iter().map(|s| s.cost).fold(0.0, f64::max);
            let norm = if max > 0.0 { max } else { 1.0 };
            let weights: Vec<f64> = scores
                .iter()
                .map(|s| (-(s.cost / norm) / self.temperature).exp())
                .collect();
            let mut target = rand::random::<f64>() * weights.iter().sum::<f64>();
            for (i, w) in weights.iter().enumerate() {
                target -= w;
                if target <= 0.0 {
                    return i;
                }
            }
            return scores.len() - 1;
        }
        let best = scores[0].cost;
        let tied = scores
            .iter()
            .take_while(|s| s.cost - best <= 1e-9 * best.abs().max(1.0))
            .count();
        if tied == 1 {
            return 0;
        }
        let indexed = |s: &Score| {
            let key = WorkerKey::new(s.worker_id, s.dp_rank);
            match overlaps.get(&key) {
                Some(&(_, _, _, blocks)) => blocks,
                None => self.index.worker_blocks(key),
            }
        };
        let sizes: Vec<u64> = scores[..tied].iter().map(indexed).collect();
        let fewest = *sizes.iter().min().expect("at least one tied score");
        let smallest: Vec<usize> = (0..tied).filter(|&i| sizes[i] == fewest).collect();
        smallest[rand::random_range(0..smallest.len())]
    }
}

/// The load a rank's cost is computed from.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct RankLoad {
    /// Prompt tokens waiting for prefill.
    pub prefill_tokens: u64,
    /// KV blocks held for running requests.
    pub active_blocks: u64,
    /// Measured seconds per prefilled token, if any.
    pub seconds_per_token: Option<f64>,
}

impl RankLoad {
    fn of(rank: &Rank) -> Self {
        Self {
            prefill_tokens: rank.prefill_tokens(),
            active_blocks: rank.active_blocks(),
            seconds_per_token: rank.queued_seconds_per_token,
        }
    }
}

/// A rank's `kv` cost for a request that leaves `new_tokens` uncached, finds
/// `overlap_tokens` cached and needs `request_blocks` blocks; see the module docs.
pub(crate) fn cost(
    limits: &Limits,
    load: &RankLoad,
    new_tokens: u64,
    overlap_tokens: u64,
    request_blocks: u64,
) -> f64 {
    let charged = new_tokens as f64 + overlap_tokens as f64 * (1.0 - overlap_credit(limits, load));
    let prefill_tokens = load.prefill_tokens as f64 + charged;
    let decode_blocks = (load.active_blocks + request_blocks) as f64;
    match limits.cost {
        Cost::Blocks => {
            limits.overlap_weight * prefill_tokens / limits.block_size as f64 + decode_blocks
        }
        Cost::Seconds => {
            let per_token = load
                .seconds_per_token
                .unwrap_or(limits.prefill_seconds_per_token);
            prefill_tokens * per_token + limits.decode_seconds_per_block * decode_blocks
        }
    }
}

/// The overlap the cost counts (see the module docs): `device` blocks cached
/// on the GPU, `reach` blocks covered by the GPU and offload tiers together.
pub(crate) fn scored_overlap(device: u32, reach: u32, offload_weight: f64) -> f64 {
    f64::from(device) + offload_weight * f64::from(reach.saturating_sub(device))
}

/// Prompt tokens a rank with `scored` blocks of overlap counts as cached.
fn covered_tokens(prompt_tokens: usize, scored: f64, block_size: u64) -> u64 {
    ((scored * block_size as f64).round() as u64).min(prompt_tokens as u64)
}

/// The share of a rank's cached overlap its cost counts as saved: all of it, or
/// with `overlap_decay_blocks` = D, D / (D + the rank's prefill blocks in flight),
/// so that a busy holder of a prefix pulls less.
fn overlap_credit(limits: &Limits, load: &RankLoad) -> f64 {
    let decay = limits.overlap_decay_blocks;
    if decay <= 0.0 {
        return 1.0;
    }
    let queued_blocks = load.prefill_tokens as f64 / limits.block_size as f64;
    decay / (decay + queued_blocks)
}

/// Among `scores` (sorted by cost) within `slack` of the cheapest, the one
/// with the deepest overlap; the cheaper on equal overlap.
fn deepest_within_slack(scores: &[Score], slack: f64) -> usize {
    let limit = scores[0].cost + slack;
    let mut best = 0;
    for (i, s) in scores.iter().enumerate().skip(1) {
        if s.cost > limit {
            break;
        }
        if s.overlap_blocks > scores[best].overlap_blocks {
            best = i;
        }
    }
    best
}

fn first_usable(
    members: &[WorkerKey],
    start: usize,
    usable: impl Fn(WorkerKey) -> bool,
) -> Option<WorkerKey> {
    let n = members.len();
    (0..n)
        .map(|i| members[(start + i) % n])
        .find(|&k| usable(k))
}

impl crate::fleet::groups::Group {
    /// The round-robin position for the next request. Interior mutability keeps
    /// `choose` on a shared borrow of the fleet.
    fn next_round_robin(&self) -> usize {
        self.next.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;
    use crate::fleet::{Registration, Source};
    use crate::state::{AppState, RouteInput};

    fn limits(cost: Cost) -> Limits {
        let mut config = Config::default();
        config.scheduler.cost = cost;
        Limits::from_config(&config)
    }

    fn score(worker_id: u64, overlap_blocks: u32, cost: f64) -> Score {
        Score {
            worker_id,
            dp_rank: 0,
            overlap_blocks,
            event_overlap_blocks: overlap_blocks,
            predicted_overlap_blocks: 0,
            offload_overlap_blocks: overlap_blocks,
            scored_overlap_blocks: f64::from(overlap_blocks),
            prefill_blocks: 0.0,
            decode_blocks: 0.0,
            cost,
        }
    }

    #[test]
    fn the_blocks_cost_is_dynamos_and_the_seconds_cost_a_time_to_first_token() {
        let load = RankLoad {
            prefill_tokens: 160,
            active_blocks: 6,
            seconds_per_token: None,
        };
        // 32 × (160 + 32) / 16 + (6 + 4)
        assert_eq!(cost(&limits(Cost::Blocks), &load, 32, 0, 4), 394.0);
        // (160 + 32) tokens at the prior 50 µs, and 0.8 ms for each of 10 blocks.
        let prior = cost(&limits(Cost::Seconds), &load, 32, 0, 4);
        assert!(
            (prior - (192.0 * 50e-6 + 10.0 * 0.8e-3)).abs() < 1e-12,
            "{prior}"
        );
        // A measured rate replaces the prior.
        let measured = RankLoad {
            seconds_per_token: Some(1e-3),
            ..load
        };
        let slow = cost(&limits(Cost::Seconds), &measured, 32, 0, 4);
        assert!(
            (slow - (192.0 * 1e-3 + 10.0 * 0.8e-3)).abs() < 1e-12,
            "{slow}"
        );
    }

    #[test]
    fn overlap_credit_decays_with_the_ranks_queued_prefill() {
        let mut limits = limits(Cost::Blocks);
        let idle = RankLoad::default();
        let busy = RankLoad {
            prefill_tokens: 64 * 16,
            ..RankLoad::default()
        };
        // Off: every cached token is saved, whatever the queue.
        for load in [idle, busy] {
            assert_eq!(
                cost(&limits, &load, 16, 48, 4),
                cost(&limits, &load, 16, 0, 4)
            );
        }
        // D = 64 blocks: an idle rank keeps the whole credit; one with 64 blocks
        // queued keeps half: 24 of its 48 cached tokens are charged.
        limits.overlap_decay_blocks = 64.0;
        assert_eq!(
            cost(&limits, &idle, 16, 48, 4),
            cost(&limits, &idle, 16, 0, 4)
        );
        assert_eq!(
            cost(&limits, &busy, 16, 48, 4),
            32.0 * (64.0 * 16.0 + 16.0 + 24.0) / 16.0 + 4.0
        );
        // So a deep overlap on a busy rank loses to the same overlap on an idle one by more.
        let spread = |l: &Limits| cost(l, &busy, 16, 48, 4) - cost(l, &idle, 16, 48, 4);
        let undecayed = Limits {
            overlap_decay_blocks: 0.0,
            ..limits.clone()
        };
        assert!(spread(&limits) > spread(&undecayed));
    }

    /// The reference: of the ranks at most `slack` dearer than the cheapest,
    /// the deepest overlap, then the cheapest, then the first listed.
    fn reference(scores: &[Score], slack: f64) -> usize {
        let cheapest = scores.iter().map(|s| s.cost).fold(f64::INFINITY, f64::min);
        let mut best: Option<usize> = None;
        for (i, s) in scores.iter().enumerate() {
            if s.cost > cheapest + slack {
                continue;
            }
            let better = match best {
                None => true,
                Some(b) => {
                    let b = &scores[b];
                    s.overlap_blocks > b.overlap_blocks
                        || (s.overlap_blocks == b.overlap_blocks && s.cost < b.cost)
                }
            };
            if better {
                best = Some(i);
            }
        }
        best.unwrap()
    }

    #[test]
    fn the_deepest_overlap_within_the_slack_wins_as_the_reference_says() {
        for round in 0..2_000 {
            let n = rand::random_range(1..10);
            let mut scores: Vec<Score> = (0..n)
                .map(|i| {
                    score(
                        i,
                        rand::random_range(0..6),
                        rand::random_range(0..40) as f64,
                    )
                })
                .collect();
            scores.sort_by(|a, b| a.cost.total_cmp(&b.cost));
            let slack = rand::random_range(0..15) as f64;
            let chosen = deepest_within_slack(&scores, slack);
            let expected = reference(&scores, slack);
            assert_eq!(
                (scores[chosen].overlap_blocks, scores[chosen].cost),
                (scores[expected].overlap_blocks, scores[expected].cost),
                "round {round}: slack {slack}, {scores:?}"
            );
        }
    }

    /// A router with workers 1 and 2 registered as event-publishing streams.
    fn two_stream_workers(config: Config) -> Arc<AppState> {
        let state = AppState::new(config, None).unwrap();
        for id in [1, 2] {
            state
                .registry
                .register(Registration::for_test(id), Source::Stream)
                .unwrap();
        }
        state
    }

    /// Worker 1 holds the whole 4-block prompt but has 80 tokens (5 blocks)
    /// waiting for prefill; worker 2 is idle. The old cost recomputes the
    /// prompt on worker 2; within the slack it stays on worker 1.
    fn chosen_with(cost: Cost, slack: f64) -> u64 {
        let mut config = Config::default();
        config.scheduler.cost = cost;
        config.scheduler.overlap_slack = slack;
        let state = two_stream_workers(config);
        let tokens: Vec<u32> = (0..64).collect();
        let input = RouteInput::Tokens(&tokens);
        let pinned = state.route_now("m", input, Some(1), &[]).unwrap().unwrap();
        state.record_prediction(&pinned);
        let _queue = state.registry.book(WorkerKey::new(1, 0), 80, 0);
        let routed = state.route_now("m", input, None, &[]).unwrap().unwrap();
        assert_eq!(routed.decision.scores.len(), 2);
        routed.decision.worker.worker_id
    }

    #[test]
    fn a_demoted_ranks_overlap_counts_neither_in_its_cost_nor_in_the_queue_order() {
        use kvroute_index::{EventKind, KvEvent, StoredBlock};
        let mut config = Config::default();
        config.trust.claim_window = 2;
        config.trust.max_failed_claims = 2;
        let state = two_stream_workers(config);
        let tokens: Vec<u32> = (0..64).collect();
        let locals =
            kvroute_index::BlockHasher::new(state.config.block_size as usize).local_hashes(&tokens);
        let key = WorkerKey::new(1, 0);
        let stored = KvEvent {
            event_id: 1,
            kind: EventKind::Stored {
                parent_hash: None,
                blocks: locals
                    .iter()
                    .map(|&local| StoredBlock {
                        block_hash: local,
                        tokens_hash: local,
                    })
                    .collect(),
            },
        };
        state.index.apply(key, &stored);
        state
            .predicted
            .record(key, &locals, std::time::Instant::now());
        let query = RouteQuery {
            name: "m",
            prompt_tokens: tokens.len(),
            local_hashes: &locals,
            pin: None,
            exclude: &[],
        };
        let chosen = state.scheduler.choose(&query, Instant::now()).unwrap();
        assert_eq!((chosen.worker, chosen.claimed_blocks), (key, 4));
        assert_eq!(state.scheduler.overlap_now(&query), 4);
        // Two responses of a 4-block claim that report nothing cached.
        for _ in 0..2 {
            state.registry.judge_claim(key, 64, 0);
        }
        let chosen = state.scheduler.choose(&query, Instant::now()).unwrap();
        let demoted = chosen.scores.iter().find(|s| s.worker_id == 1).unwrap();
        assert_eq!(
            (demoted.overlap_blocks, demoted.scored_overlap_blocks),
            (0, 0.0)
        );
        assert_eq!(state.scheduler.overlap_now(&query), 0);
        state.registry.restore_claims(key);
        assert_eq!(state.scheduler.overlap_now(&query), 4);
    }

    #[test]
    fn a_rank_within_the_slack_keeps_the_prefix_it_holds() {
        // 32 × 5 + 4 = 164 blocks against 32 × 4 + 4 = 132.
        assert_eq!(chosen_with(Cost::Blocks, 0.0), 2);
        // 80 × 50 µs + 3.2 ms = 7.2 ms against 64 × 50 µs + 3.2 ms = 6.4 ms.
        assert_eq!(chosen_with(Cost::Seconds, 0.0), 2);
        assert_eq!(chosen_with(Cost::Seconds, 1e-3), 1);
        assert_eq!(chosen_with(Cost::Blocks, 40.0), 1);
        // Beyond the slack, load wins again.
        assert_eq!(chosen_with(Cost::Seconds, 0.5e-3), 2);
    }

    #[test]
    fn a_ranks_rate_is_measured_over_the_tokens_it_prefilled_up_to_the_first_token() {
        let registry = Arc::new(Registry::new(limits(Cost::Seconds)));
        registry
            .register(Registration::for_test(1), Source::Stream)
            .unwrap();
        let key = WorkerKey::new(1, 0);
        let _ahead = registry.book(key, 100, 1);
        let mut second = registry.book(key, 200, 1);
        second.first_token(std::time::Duration::from_millis(300));
        let rank = &registry.lock().ranks[&key];
        // 300 ms over its own 200 tokens and the 100 ahead of it.
        assert!((rank.queued_seconds_per_token.unwrap() - 1e-3).abs() < 1e-12);
        assert!((rank.prefill_seconds_per_token.unwrap() - 1.5e-3).abs() < 1e-12);
    }

    #[test]
    fn the_scored_overlap_counts_offload_only_blocks_at_the_offload_weight() {
        // The reference, block by block: a GPU block counts 1, a block only
        // the offload tier adds counts the weight, an uncovered one 0.
        let reference = |device: u32, offload: u32, weight: f64| -> f64 {
            (0..device.max(offload))
                .map(|i| if i < device { 1.0 } else { weight })
                .sum()
        };
        for _ in 0..2_000 {
            let device = rand::random_range(0..40);
            let offload = rand::random_range(0..40);
            let weight = [0.0, 0.25, 0.5, 0.9, 1.0][rand::random_range(0..5)];
            let reach = offload.max(device);
            let scored = scored_overlap(device, reach, weight);
            let expected = reference(device, offload, weight);
            assert!(
                (scored - expected).abs() < 1e-9,
                "{device} {offload} {weight}: {scored} vs {expected}"
            );
        }
    }

    /// Against every rank costed from the module docs' formula: the chosen rank
    /// is one of the cheapest, over fleets with random loads and predicted
    /// prefixes, where the least loaded ranks tie (idle) or not and the deepest
    /// overlap is on a loaded rank or an idle one. Unmatched ranks past the
    /// cheapest matched one's cost are not costed; this shows none of them
    /// should have been.
    #[test]
    fn the_chosen_rank_is_the_cheapest_of_all() {
        const WORKERS: u64 = 40;
        let block = 16u64;
        for round in 0..150 {
            let state = AppState::new(Config::default(), None).unwrap();
            for id in 0..WORKERS {
                state
                    .registry
                    .register(Registration::for_test(id), Source::Stream)
                    .unwrap();
            }
            let tokens: Vec<u32> = (0..8 * block as u32).map(|t| t + round * 1000).collect();
            let locals = kvroute_index::BlockHasher::new(block as usize).local_hashes(&tokens);
            // (prefill tokens, active blocks, predicted depth) per worker.
            let mut loads = vec![(0u64, 0u64, 0u32); WORKERS as usize];
            let mut bookings = Vec::new();
            let idle = rand::random_range(0..WORKERS);
            for (id, load) in loads.iter_mut().enumerate().skip(idle as usize) {
                if rand::random_range(0..3) == 0 {
                    continue;
                }
                let (prefill, blocks) = (rand::random_range(0..400), rand::random_range(0..30));
                bookings.push(
                    state
                        .registry
                        .book(WorkerKey::new(id as u64, 0), prefill, blocks),
                );
                (load.0, load.1) = (prefill, blocks);
            }
            for _ in 0..rand::random_range(0..4) {
                let id = rand::random_range(0..WORKERS) as usize;
                let depth = rand::random_range(1..=locals.len());
                state.predicted.record(
                    WorkerKey::new(id as u64, 0),
                    &locals[..depth],
                    std::time::Instant::now(),
                );
                loads[id].2 = loads[id].2.max(depth as u32);
            }
            // An idle rank whose prefix is worth exactly its queue: it ties with
            // the idle ranks that hold nothing.
            if idle > 0 && rand::random_range(0..2) == 0 {
                let id = rand::random_range(0..idle) as usize;
                let depth = rand::random_range(1..=locals.len());
                let key = WorkerKey::new(id as u64, 0);
                state
                    .predicted
                    .record(key, &locals[..depth], std::time::Instant::now());
                let queued = if loads[id].2 > 0 {
                    0
                } else {
                    depth as u64 * block
                };
                bookings.push(state.registry.book(key, queued, 0));
                loads[id] = (queued, 0, loads[id].2.max(depth as u32));
            }
            let reference = |(prefill, active, depth): (u64, u64, u32)| {
                let uncovered = tokens.len() as u64 - u64::from(depth) * block;
                32.0 * (prefill + uncovered) as f64 / block as f64 + (active + 8) as f64
            };
            let cheapest = loads
                .iter()
                .map(|&l| reference(l))
                .fold(f64::INFINITY, f64::min);
            let routed = state
                .route_now("m", RouteInput::Tokens(&tokens), None, &[])
                .unwrap()
                .unwrap();
            let chosen = routed.decision.worker.worker_id as usize;
            assert_eq!(
                reference(loads[chosen]),
                cheapest,
                "round {round}: chose {chosen} of {loads:?}"
            );
            // Every tie was in the draw (up to `MAX_TIED` ranks that hold nothing).
            let tied = loads.iter().filter(|&&l| reference(l) == cheapest).count();
            let drawn = routed
                .decision
                .scores
                .iter()
                .filter(|s| s.cost == cheapest)
                .count();
            assert!(
                drawn >= tied.min(MAX_TIED),
                "round {round}: {drawn} of {tied} tied ranks costed"
            );
            drop(bookings);
        }
    }

    /// Worker 1 holds block 0 of a 4-block prompt on the GPU and all four in
    /// its offload tier; worker 2 holds blocks 0 and 1 on the GPU. Both idle.
    fn chosen_with_offload_weight(weight: f64) -> (u64, serde_json::Value) {
        use kvroute_index::{EventKind, KvEvent, StoredBlock, Tier};
        let mut config = Config::default();
        config.scheduler.offload_weight = weight;
        let state = two_stream_workers(config);
        let tokens: Vec<u32> = (0..64).collect();
        let locals =
            kvroute_index::BlockHasher::new(state.config.block_size as usize).local_hashes(&tokens);
        let chain = |event_id, worker: u64, n: usize| KvEvent {
            event_id,
            kind: EventKind::Stored {
                parent_hash: None,
                blocks: locals[..n]
                    .iter()
                    .enumerate()
                    .map(|(i, &local)| StoredBlock {
                        block_hash: worker * 100 + i as u64,
                        tokens_hash: local,
                    })
                    .collect(),
            },
        };
        let (w1, w2) = (WorkerKey::new(1, 0), WorkerKey::new(2, 0));
        state.tiers.apply(w1, Tier::Device, &chain(1, 1, 1));
        state.tiers.apply(w1, Tier::Offload, &chain(2, 1, 4));
        state.tiers.apply(w2, Tier::Device, &chain(1, 2, 2));
        let routed = state
            .route_now("m", RouteInput::Tokens(&tokens), None, &[])
            .unwrap()
            .unwrap();
        let scores = serde_json::to_value(&routed.decision.scores).unwrap();
        (routed.decision.worker.worker_id, scores)
    }

    #[test]
    fn offload_tier_blocks_past_the_gpu_prefix_count_at_the_offload_weight() {
        // Off: 2 GPU blocks beat 1.
        assert_eq!(chosen_with_offload_weight(0.0).0, 2);
        // 1 + 0.25 × 3 = 1.75 blocks still lose to 2; 1 + 0.9 × 3 = 3.7 win.
        assert_eq!(chosen_with_offload_weight(0.25).0, 2);
        let (chosen, scores) = chosen_with_offload_weight(0.9);
        assert_eq!(chosen, 1);
        let first = &scores[0];
        assert_eq!(first["worker_id"], 1);
        assert_eq!(first["overlap_blocks"], 1);
        assert_eq!(first["offload_overlap_blocks"], 4);
        assert!((first["scored_overlap_blocks"].as_f64().unwrap() - 3.7).abs() < 1e-9);
    }
}
