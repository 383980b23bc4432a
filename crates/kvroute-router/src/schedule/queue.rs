//! The router's own wait queue: requests that found every worker busy wait
//! here, and when capacity comes back they try again one at a time, in the
//! queue's order, instead of all at once in whatever order the runtime wakes
//! them.
//!
//! A *sweep* starts when load is released or a breaker's probe falls due: the
//! waiters get the turn one after another, best first; each tries to route and
//! passes the turn on whether or not it was served. The first one that can
//! use the freed capacity takes it, and a waiter that cannot (it excludes that
//! worker after a failed attempt, or asks for another model) holds nobody up.
//! A request arriving during a sweep joins the queue and gets its turn in that
//! sweep, in order, rather than jumping it. Waiters of one *class* (requests for
//! the same model that neither pin nor exclude a worker) all get the answer the
//! first of them got, so when one finds every worker busy the rest of its class
//! are not asked again in that sweep: a sweep costs a try per class, not per
//! waiter. Only one waiter, the oldest, the *watcher*, listens for releases
//! and starts the sweep; the rest sleep until their turn, so that a release
//! wakes one task rather than the whole queue.
//!
//! The order (`scheduler.queue_order`):
//! - `fifo`: arrival order.
//! - `longest_prefix`: the deepest cached prefix first, as SGLang orders its
//!   waiting requests, so that a busy fleet serves first what it can serve
//!   cheaply. The depth is measured when the sweep starts, on the ranks that
//!   can take the waiter *then* (in practice the rank that just freed a slot),
//!   not anywhere in the fleet: a prefix cached on a rank that is still busy
//!   saves nothing, since the waiter will be sent elsewhere and recompute it.
//!   Ties go in arrival order.
//!
//! Starvation is bounded by `scheduler.queue_max_bypass`: a waiter is
//! *bypassed* when a later arrival is served while it was still waiting for its
//! turn in the same sweep (had it had the turn and failed, the capacity was of no
//! use to it). A waiter bypassed `queue_max_bypass` times goes first in every
//! sweep from then on (the oldest such first), so no waiter is ever bypassed
//! more than `queue_max_bypass` times. A count, not an age: it bounds exactly
//! how much later work overtakes a request, whatever the load, and 0 makes the
//! order plain FIFO.

use std::sync::{Arc, Mutex, MutexGuard};

use tokio::sync::Notify;

use crate::config::QueueOrder;
use crate::metrics;

/// Ranks a waiting item: the cached prefix (in blocks) it has now on a rank
/// that could take it.
pub type Key<'a, T> = &'a (dyn Fn(&T) -> u32 + Sync);

pub struct WaitQueue<T> {
    order: QueueOrder,
    max_queued: usize,
    max_bypass: u32,
    inner: Mutex<Inner<T>>,
}

struct Inner<T> {
    next_seq: u64,
    /// In arrival order.
    waiters: Vec<Waiter<T>>,
    sweeping: bool,
    /// Capacity came back during the sweep: sweep again when it ends.
    again: bool,
    /// The waiter whose turn it is; always one while sweeping.
    turn: Option<u64>,
    /// The waiter that listens for releases: the oldest.
    watcher: Option<u64>,
}

struct Waiter<T> {
    seq: u64,
    item: T,
    /// Its key when the sweep started (or when it joined the sweep).
    overlap: u32,
    bypassed: u32,
    /// Had its turn in this sweep and was not served, or one of its class did.
    tried: bool,
    class: Option<String>,
    wake: Arc<Notify>,
}

impl<T> WaitQueue<T> {
    pub fn new(order: QueueOrder, max_queued: usize, max_bypass: u32) -> Self {
        Self {
            order,
            max_queued,
            max_bypass,
            inner: Mutex::new(Inner {
                next_seq: 0,
                waiters: Vec::new(),
                sweeping: false,
                again: false,
                turn: None,
                watcher: None,
            }),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Inner<T>> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Whether waiters are being offered capacity now; a new request should
    /// then wait its turn instead of trying first.
    pub fn sweeping(&self) -> bool {
        self.lock().sweeping
    }

    /// Joins the queue; `None` when it holds `max_queued` waiters already.
    /// `key` ranks every waiter whenever this one starts or ends a sweep.
    /// Waiters of one `class` (`None`: a class of its own) get the same
    /// answer from the scheduler. With `sweep`, a sweep starts if none is
    /// under way, so that the new waiter gets a turn at once (in order).
    pub fn join<'a>(
        &'a self,
        item: T,
        class: Option<String>,
        key: Key<'a, T>,
        sweep: bool,
    ) -> Option<Ticket<'a, T>> {
        let mut inner = self.lock();
        if inner.waiters.len() >= self.max_queued {
            return None;
        }
        let seq = inner.next_seq;
        inner.next_seq += 1;
        let overlap = if inner.sweeping {
            self.key(key, &item)
        } else {
            0
        };
        let wake = Arc::new(Notify::new());
        inner.waiters.push(Waiter {
            seq,
            item,
            overlap,
            bypassed: 0,
            tried: false,
            class,
            wake: Arc::clone(&wake),
        });
        ::metrics::gauge!(metrics::QUEUED).increment(1.0);
        ::metrics::counter!(metrics::QUEUE_WAITS).increment(1);
        inner.watcher.get_or_insert(seq);
        if sweep && !inner.sweeping {
            self.start(&mut inner, key);
        }
        Some(Ticket {
            queue: self,
            seq,
            wake,
            key,
            served: false,
        })
    }

    /// Capacity may be free: starts a sweep, or another one after the current.
    pub fn sweep(&self, key: Key<'_, T>) {
        let mut inner = self.lock();
        if inner.sweeping {
            inner.again = true;
        } else {
            self.start(&mut inner, key);
        }
    }

    fn key(&self, key: Key<'_, T>, item: &T) -> u32 {
        match self.order {
            QueueOrder::Fifo => 0,
            QueueOrder::LongestPrefix => key(item),
        }
    }

    fn start(&self, inner: &mut Inner<T>, key: Key<'_, T>) {
        inner.sweeping = true;
        inner.again = false;
        for w in &mut inner.waiters {
            w.tried = false;
            w.overlap = self.key(key, &w.item);
        }
        self.advance(inner, key);
    }

    /// Gives the turn to the best waiter not yet tried in this sweep, or ends it.
    fn advance(&self, inner: &mut Inner<T>, key: Key<'_, T>) {
        debug_assert!(inner.turn.is_none());
        let starving = |w: &Waiter<T>| w.bypassed >= self.max_bypass;
        let next = inner.waiters.iter().filter(|w| !w.tried).min_by(|a, b| {
            // Starving first, oldest first among them; then the deepest prefix; then the oldest.
            starving(b)
                .cmp(&starving(a))
                .then_with(|| match starving(a) && starving(b) {
                    true => std::cmp::Ordering::Equal,
                    false => b.overlap.cmp(&a.overlap),
                })
                .then_with(|| a.seq.cmp(&b.seq))
        });
        match next {
            Some(w) => {
                inner.turn = Some(w.seq);
                w.wake.notify_one();
            }
            None => {
                inner.sweeping = false;
                if inner.again {
                    self.start(inner, key);
                }
            }
        }
    }

    /// The waiter `seq` had its turn and could not be served.
    fn pass(&self, seq: u64, key: Key<'_, T>) {
        let mut inner = self.lock();
        if inner.turn != Some(seq) {
            return;
        }
        let class = inner
            .waiters
            .iter_mut()
            .find(|w| w.seq == seq)
            .and_then(|w| {
                w.tried = true;
                w.class.clone()
            });
        if let Some(class) = class {
            for w in &mut inner.waiters {
                w.tried |= w.class.as_ref() == Some(&class);
            }
        }
        inner.turn = None;
        self.advance(&mut inner, key);
    }

    fn leave(&self, seq: u64, served: bool, key: Key<'_, T>) {
        let mut inner = self.lock();
        let Some(at) = inner.waiters.iter().position(|w| w.seq == seq) else {
            return;
        };
        inner.waiters.remove(at);
        ::metrics::gauge!(metrics::QUEUED).decrement(1.0);
        if served {
            // Everyone earlier still waiting for a turn was passed over.
            for w in inner.waiters[..at].iter_mut().filter(|w| !w.tried) {
                w.bypassed += 1;
            }
        }
        if inner.watcher == Some(seq) {
            // The next oldest watches from now on: wake it to start listening.
            inner.watcher = inner.waiters.first().map(|w| {
                w.wake.notify_one();
                w.seq
            });
        }
        if inner.turn == Some(seq) {
            inner.turn = None;
            self.advance(&mut inner, key);
        }
    }

    /// Whose turn it is, for tests.
    #[cfg(test)]
    fn turn(&self) -> Option<u64> {
        self.lock().turn
    }

    /// How many wait, for tests.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.lock().waiters.len()
    }
}

/// A place in the queue; leaving it (drop) passes the turn on if it held it.
pub struct Ticket<'a, T> {
    queue: &'a WaitQueue<T>,
    seq: u64,
    wake: Arc<Notify>,
    key: Key<'a, T>,
    served: bool,
}

impl<T> Ticket<'_, T> {
    /// Resolves when it is this waiter's turn to try, or when it has become
    /// the watcher (and may sometimes resolve for nothing): check which.
    pub async fn wake(&self) {
        self.wake.notified().await;
    }

    pub fn has_turn(&self) -> bool {
        self.queue.lock().turn == Some(self.seq)
    }

    /// Whether this waiter is the one listening for releases.
    pub fn watching(&self) -> bool {
        self.queue.lock().watcher == Some(self.seq)
    }

    /// Tried on its turn and found no worker: the next waiter's turn.
    pub fn pass(&self) {
        self.queue.pass(self.seq, self.key);
    }

    /// Tried on its turn and was served: leaves, and the sweep goes on (more
    /// capacity may be free).
    pub fn served(mut self) {
        self.served = true;
    }
}

impl<T> Drop for Ticket<'_, T> {
    fn drop(&mut self) {
        self.queue.leave(self.seq, self.served, self.key);
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;
    use std::time::Duration;

    use proptest::prelude::*;

    use super::*;

    const RANKS: usize = 3;

    /// A waiter in the tests' fleet: its cached prefix on each rank, and a rank it excludes.
    #[derive(Clone, Debug)]
    struct Request {
        overlap: [u32; RANKS],
        exclude: Option<usize>,
    }

    impl Request {
        /// Requests that exclude no rank get the same answer: one class.
        fn class(&self) -> Option<String> {
            self.exclude.is_none().then(|| "any".to_string())
        }

        fn usable(&self, rank: usize, free: &[u32; RANKS]) -> bool {
            free[rank] > 0 && self.exclude != Some(rank)
        }

        /// The key: deepest overlap on a rank that can take it now.
        fn overlap_now(&self, free: &[u32; RANKS]) -> u32 {
            (0..RANKS)
                .filter(|&r| self.usable(r, free))
                .map(|r| self.overlap[r])
                .max()
                .unwrap_or(0)
        }

        /// Routes: the free usable rank with the deepest overlap, lowest first on ties.
        fn route(&self, free: &mut [u32; RANKS]) -> bool {
            let best = (0..RANKS)
                .filter(|&r| self.usable(r, free))
                .max_by_key(|&r| (self.overlap[r], std::cmp::Reverse(r)));
            match best {
                Some(r) => {
                    free[r] -= 1;
                    true
                }
                None => false,
            }
        }
    }

    #[derive(Clone, Debug)]
    enum Op {
        /// A request joins; with `true` it did not try first (a sweep was
        /// under way when it arrived) and asks for a sweep if none is.
        Arrive(Request, bool),
        /// A slot on a rank is freed, and waiters are told.
        Release(usize),
        /// The waiter whose turn it is tries to route.
        Step,
        /// The n-th oldest waiter gives up (its queue timeout).
        Leave(usize),
    }

    fn op() -> impl Strategy<Value = Op> {
        let request = (
            proptest::array::uniform3(0u32..4),
            proptest::option::weighted(0.25, 0..RANKS),
        )
            .prop_map(|(overlap, exclude)| Request { overlap, exclude });
        prop_oneof![
            3 => (request, proptest::bool::weighted(0.3)).prop_map(|(r, s)| Op::Arrive(r, s)),
            2 => (0..RANKS).prop_map(Op::Release),
            4 => Just(Op::Step),
            1 => (0usize..8).prop_map(Op::Leave),
        ]
    }

    /// The rule, written out plainly. On each release, unless a round is under
    /// way (then another follows it), a round begins: each waiter's key is its
    /// deepest overlap on a rank with a free slot (0 under fifo), then the
    /// waiters each try once, in order: those bypassed `max_bypass` times first
    /// and oldest first, then by key, deepest first, then oldest first. A
    /// waiter arriving during a round takes part in it with its key at arrival;
    /// one that asks for a round when none is under way begins one.
    /// Serving a waiter bypasses every older one yet to try in that round. A
    /// waiter that excludes no rank and is not served spares the others that
    /// exclude none their try in that round (they would not be served either).
    struct Model {
        max_bypass: u32,
        longest: bool,
        free: [u32; RANKS],
        next: u64,
        /// seq -> (request, key, bypassed, tried this round)
        waiting: BTreeMap<u64, (Request, u32, u32, bool)>,
        round: bool,
        again: bool,
        /// Who tries next in this round.
        turn: Option<u64>,
        served: Vec<u64>,
        most_bypassed: u32,
    }

    impl Model {
        fn key(&self, r: &Request) -> u32 {
            if self.longest {
                r.overlap_now(&self.free)
            } else {
                0
            }
        }

        fn next_up(&self) -> Option<u64> {
            let mut order: Vec<(bool, u32, u64)> = self
                .waiting
                .iter()
                .filter(|(_, w)| !w.3)
                .map(|(&seq, w)| {
                    let starving = w.2 >= self.max_bypass;
                    (!starving, if starving { 0 } else { u32::MAX - w.1 }, seq)
                })
                .collect();
            order.sort();
            order.first().map(|o| o.2)
        }

        fn begin_round(&mut self) {
            self.round = true;
            self.again = false;
            let keys: Vec<(u64, u32)> = self
                .waiting
                .iter()
                .map(|(&s, w)| (s, self.key(&w.0)))
                .collect();
            for (s, k) in keys {
                let w = self.waiting.get_mut(&s).unwrap();
                w.1 = k;
                w.3 = false;
            }
            self.give_turn();
        }

        /// The next in order gets the turn once the last one's try is done.
        fn give_turn(&mut self) {
            self.turn = self.next_up();
            if self.turn.is_none() {
                self.round = false;
                if self.again {
                    self.begin_round();
                }
            }
        }

        fn apply(&mut self, op: &Op) {
            match op {
                Op::Arrive(r, sweep) => {
                    let key = if self.round { self.key(r) } else { 0 };
                    self.waiting.insert(self.next, (r.clone(), key, 0, false));
                    self.next += 1;
                    if *sweep && !self.round {
                        self.begin_round();
                    }
                }
                Op::Release(rank) => {
                    self.free[*rank] += 1;
                    if self.round {
                        self.again = true;
                    } else {
                        self.begin_round();
                    }
                }
                Op::Step => {
                    let Some(seq) = self.turn else {
                        return;
                    };
                    let request = self.waiting[&seq].0.clone();
                    if request.route(&mut self.free) {
                        self.waiting.remove(&seq);
                        self.served.push(seq);
                        for (_, w) in self.waiting.range_mut(..seq) {
                            if !w.3 {
                                w.2 += 1;
                                self.most_bypassed = self.most_bypassed.max(w.2);
                            }
                        }
                    } else {
                        let everyone = request.exclude.is_none();
                        for (&s, w) in self.waiting.iter_mut() {
                            w.3 |= s == seq || (everyone && w.0.exclude.is_none());
                        }
                    }
                    self.give_turn();
                }
                Op::Leave(n) => {
                    if let Some(&seq) = self.waiting.keys().nth(*n) {
                        self.waiting.remove(&seq);
                        if self.turn == Some(seq) {
                            self.give_turn();
                        }
                    }
                }
            }
        }
    }

    fn check(order: QueueOrder, max_bypass: u32, ops: &[Op]) -> Result<(), TestCaseError> {
        let queue = WaitQueue::<Request>::new(order, usize::MAX, max_bypass);
        // The fleet the queue's key reads; the model keeps its own copy.
        let free = std::sync::Mutex::new([0u32; RANKS]);
        let key = |r: &Request| r.overlap_now(&free.lock().unwrap());
        let mut tickets: BTreeMap<u64, Ticket<'_, Request>> = BTreeMap::new();
        let mut requests: BTreeMap<u64, Request> = BTreeMap::new();
        let mut served = Vec::new();
        let mut model = Model {
            max_bypass,
            longest: order == QueueOrder::LongestPrefix,
            free: [0; RANKS],
            next: 0,
            waiting: BTreeMap::new(),
            round: false,
            again: false,
            turn: None,
            served: Vec::new(),
            most_bypassed: 0,
        };
        let mut seq = 0;
        for op in ops {
            match op {
                Op::Arrive(r, sweep) => {
                    tickets.insert(seq, queue.join(r.clone(), r.class(), &key, *sweep).unwrap());
                    requests.insert(seq, r.clone());
                    seq += 1;
                }
                Op::Release(rank) => {
                    free.lock().unwrap()[*rank] += 1;
                    queue.sweep(&key);
                }
                Op::Step => {
                    if let Some(turn) = queue.turn() {
                        let routed = requests[&turn].route(&mut free.lock().unwrap());
                        if routed {
                            served.push(turn);
                            tickets.remove(&turn).unwrap().served();
                        } else {
                            tickets[&turn].pass();
                        }
                    }
                }
                Op::Leave(n) => {
                    if let Some(&s) = tickets.keys().nth(*n) {
                        tickets.remove(&s);
                    }
                }
            }
            model.apply(op);
            prop_assert_eq!(queue.turn(), model.turn);
        }
        prop_assert_eq!(&served, &model.served);
        prop_assert!(model.most_bypassed <= max_bypass);
        let bypassed = queue.lock().waiters.iter().map(|w| w.bypassed).max();
        prop_assert!(bypassed.unwrap_or(0) <= max_bypass);
        Ok(())
    }

    proptest! {
        #[test]
        fn longest_prefix_serves_as_the_rule_says(
            max_bypass in 0u32..4,
            ops in proptest::collection::vec(op(), 0..80),
        ) {
            check(QueueOrder::LongestPrefix, max_bypass, &ops)?;
        }

        #[test]
        fn fifo_serves_as_the_rule_says(ops in proptest::collection::vec(op(), 0..80)) {
            check(QueueOrder::Fifo, 0, &ops)?;
        }
    }

    fn request(overlap: [u32; RANKS]) -> Request {
        Request {
            overlap,
            exclude: None,
        }
    }

    /// Joins `requests` and frees one slot on rank 0; returns who is served.
    fn serve_one(order: QueueOrder, max_bypass: u32, requests: &[Request]) -> u64 {
        let queue = WaitQueue::new(order, 16, max_bypass);
        let free = std::sync::Mutex::new([0u32; RANKS]);
        let key = |r: &Request| r.overlap_now(&free.lock().unwrap());
        let tickets: Vec<_> = requests
            .iter()
            .map(|r| queue.join(r.clone(), r.class(), &key, false).unwrap())
            .collect();
        free.lock().unwrap()[0] = 1;
        queue.sweep(&key);
        let turn = queue.turn().unwrap();
        drop(tickets);
        turn
    }

    #[test]
    fn longest_prefix_offers_freed_capacity_to_the_deepest_prefix_on_it() {
        // Request 2's prefix is deepest but on rank 1, which is still busy.
        let requests = [request([0, 0, 0]), request([2, 0, 0]), request([1, 9, 0])];
        assert_eq!(serve_one(QueueOrder::LongestPrefix, 8, &requests), 1);
        assert_eq!(serve_one(QueueOrder::Fifo, 8, &requests), 0);
    }

    #[test]
    fn a_waiter_that_cannot_use_the_freed_rank_does_not_block_the_rest() {
        let queue = WaitQueue::new(QueueOrder::Fifo, 16, 0);
        let free = std::sync::Mutex::new([1u32, 0, 0]);
        let key = |r: &Request| r.overlap_now(&free.lock().unwrap());
        let first = Request {
            overlap: [0; RANKS],
            exclude: Some(0),
        };
        let a = queue.join(first, None, &key, false).unwrap();
        let b = queue.join(request([0; RANKS]), None, &key, false).unwrap();
        queue.sweep(&key);
        assert_eq!(queue.turn(), Some(a.seq));
        a.pass();
        assert_eq!(queue.turn(), Some(b.seq), "the next waiter's turn");
        b.served();
        assert_eq!(queue.turn(), None, "the sweep is over");
        assert!(!queue.sweeping());
    }

    #[test]
    fn the_queue_is_bounded() {
        let queue = WaitQueue::new(QueueOrder::Fifo, 2, 0);
        let key = |_: &u32| 0;
        let a = queue.join(1, None, &key, false).unwrap();
        let _b = queue.join(2, None, &key, false).unwrap();
        assert!(queue.join(3, None, &key, false).is_none());
        drop(a);
        assert!(queue.join(3, None, &key, false).is_some());
    }

    #[tokio::test(start_paused = true)]
    async fn a_waiter_that_leaves_on_its_turn_passes_it_on() {
        let queue = WaitQueue::new(QueueOrder::Fifo, 16, 0);
        let key = |_: &u32| 0;
        let a = queue.join(1, None, &key, false).unwrap();
        let b = queue.join(2, None, &key, false).unwrap();
        assert!(a.watching() && !b.watching(), "the oldest watches");
        queue.sweep(&key);
        a.wake().await;
        assert!(a.has_turn());
        // `a` gives up (its queue timeout) holding the turn.
        drop(a);
        tokio::time::timeout(Duration::from_millis(1), b.wake())
            .await
            .expect("b woken once a left");
        assert!(b.has_turn() && b.watching(), "b has the turn and watches");
    }
}
