//! Which event stream may write a worker's index entries.
//!
//! A worker's state in the index must come from exactly one stream: the one of
//! its latest registration. Otherwise an operator's `DELETE /workers/{id}` is
//! undone by the next event of a stream still open, and a worker that
//! registered again shares its entries with its old, stale stream. So each
//! registration claims the worker's slot here with its generation; a newer
//! claim (or an operator's removal) *fences* the previous stream: its applier
//! stops before applying anything more, and its reader ends the call with a
//! clear status. Whoever fenced it waits for that applier to stop before
//! touching the index, so nothing the old stream had under way lands after.
//!
//! The slot also remembers the worker's instance id (a process's life, see
//! `Register.instance_id`) after its stream ends, until the worker is purged or
//! removed: a reconnect of the same instance keeps its state, a new instance
//! means everything held for the old one is gone.

use dashmap::DashMap;
use dashmap::mapref::entry::Entry;
use kvroute_index::WorkerKey;
use tokio::sync::{oneshot, watch};

/// Why a stream may no longer write.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fenced {
    /// The worker registered again on another stream.
    Superseded,
    /// An operator removed the worker.
    Removed,
}

impl Fenced {
    /// The status the fenced stream ends with.
    pub fn status(self, worker_id: u64) -> tonic::Status {
        match self {
            Fenced::Superseded => tonic::Status::aborted(format!(
                "worker {worker_id} registered again on another stream; this one is closed"
            )),
            Fenced::Removed => tonic::Status::aborted(format!(
                "worker {worker_id} was removed by an operator; this stream is closed"
            )),
        }
    }
}

/// A stream's side of its claim: watched by its reader and applier.
pub type Fence = watch::Receiver<Option<Fenced>>;

/// Resolves once the stream is fenced, with why. (The guard `wait_for` returns
/// is not `Send`, so it must not live across the caller's awaits.)
pub async fn fenced(fence: &mut Fence) -> Fenced {
    match fence.wait_for(Option::is_some).await {
        Ok(why) => why.unwrap_or(Fenced::Superseded),
        // The slot is gone: nobody may write any more.
        Err(_) => Fenced::Superseded,
    }
}

/// Dropped when the stream's applier has stopped for good.
pub type ApplierAlive = oneshot::Sender<()>;

struct Slot {
    generation: u64,
    instance_id: u64,
    dp_ranks: Vec<u32>,
    fence: watch::Sender<Option<Fenced>>,
    applier_stopped: oneshot::Receiver<()>,
}

impl Slot {
    /// Fences the slot's stream and waits until its applier has stopped; returns
    /// the ranks the stream wrote.
    async fn fence(self, worker_id: u64, why: Fenced) -> Vec<WorkerKey> {
        self.fence.send_replace(Some(why));
        // Resolves (with an error) once the applier drops its sender.
        let _ = self.applier_stopped.await;
        self.dp_ranks
            .iter()
            .map(|&r| WorkerKey::new(worker_id, r))
            .collect()
    }
}

/// What a new registration's stream gets.
pub struct Claim {
    pub fence: Fence,
    pub applier_alive: ApplierAlive,
    /// Ranks whose state belongs to another instance of the worker and must be
    /// cleared (index and predicted entries) before the stream applies anything.
    pub stale_ranks: Vec<WorkerKey>,
}

#[derive(Default)]
pub struct Writers {
    slots: DashMap<u64, Slot>,
}

impl Writers {
    /// Claims `worker_id` for a registration; fences and waits out the previous
    /// stream. `None` if a newer registration claimed it meanwhile.
    pub async fn claim(
        &self,
        worker_id: u64,
        generation: u64,
        instance_id: u64,
        dp_ranks: &[u32],
    ) -> Option<Claim> {
        let (fence_tx, fence) = watch::channel(None);
        let (applier_alive, applier_stopped) = oneshot::channel();
        let slot = Slot {
            generation,
            instance_id,
            dp_ranks: dp_ranks.to_vec(),
            fence: fence_tx,
            applier_stopped,
        };
        // The entry's shard lock is let go before any await.
        let previous = match self.slots.entry(worker_id) {
            Entry::Occupied(held) if held.get().generation > generation => return None,
            Entry::Occupied(mut held) => Some(held.insert(slot)),
            Entry::Vacant(free) => {
                free.insert(slot);
                None
            }
        };
        let mut stale_ranks = Vec::new();
        if let Some(previous) = previous {
            let restarted = previous.instance_id != instance_id;
            let written = previous.fence(worker_id, Fenced::Superseded).await;
            if restarted {
                stale_ranks = written;
                for &r in dp_ranks {
                    let key = WorkerKey::new(worker_id, r);
                    if !stale_ranks.contains(&key) {
                        stale_ranks.push(key);
                    }
                }
            }
        }
        Some(Claim {
            fence,
            applier_alive,
            stale_ranks,
        })
    }

    /// An operator removed the worker: fences its stream, waits for its applier
    /// to stop, and forgets it. The caller then clears its entries.
    pub async fn remove(&self, worker_id: u64) {
        if let Some((_, slot)) = self.slots.remove(&worker_id) {
            slot.fence(worker_id, Fenced::Removed).await;
        }
    }

    /// The worker was purged after its stream ended: forgets its instance, unless
    /// a newer registration owns the slot.
    pub fn forget(&self, worker_id: u64, generation: u64) {
        self.slots
            .remove_if(&worker_id, |_, s| s.generation == generation);
    }
}
