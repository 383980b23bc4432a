//! A test-only hook that corrupts this replica's index on purpose.
//!
//! End-to-end tests must show that a wrong index is caught by the workers'
//! digests, counted and healed, on a real process. Nothing else makes an index
//! wrong on demand without also making a gap (which is healed by another
//! path), so this hook drops the *content* of a worker's next events while
//! keeping their ids: the index believes it is current and is not.
//!
//! Off unless `index.test_faults` is set; `POST /workers/{id}/drop-events`
//! refuses (403) otherwise, and applying events then costs one branch.

use std::collections::HashMap;
use std::sync::Mutex;

use kvroute_index::{EventKind, KvEvent, WorkerKey};

pub struct Faults {
    enabled: bool,
    /// Rank → events still to be dropped, and whether whole (ids too).
    drops: Mutex<HashMap<WorkerKey, (u64, bool)>>,
}

impl Faults {
    pub fn new(enabled: bool) -> Self {
        Self {
            enabled,
            drops: Mutex::default(),
        }
    }

    pub fn enabled(&self) -> bool {
        self.enabled
    }

    /// Arms the hook: the next `count` events of `key` applied here lose their
    /// content (ids kept), or with `whole`, are not applied at all (a gap,
    /// which only the worker's holder can ask to fill). `false` when the hook is off.
    pub fn drop_events(&self, key: WorkerKey, count: u64, whole: bool) -> bool {
        if self.enabled && count > 0 {
            self.drops.lock().unwrap().insert(key, (count, whole));
        }
        self.enabled
    }

    /// `event`; while a drop is armed for `key`, an empty removal under the
    /// same id (so no gap tells), or nothing.
    pub(crate) fn pass(&self, key: WorkerKey, event: KvEvent) -> Option<KvEvent> {
        if !self.enabled {
            return Some(event);
        }
        let mut drops = self.drops.lock().unwrap();
        let Some((left, whole)) = drops.get_mut(&key) else {
            return Some(event);
        };
        let whole = *whole;
        *left -= 1;
        if *left == 0 {
            drops.remove(&key);
        }
        (!whole).then(|| KvEvent {
            event_id: event.event_id,
            kind: EventKind::Removed {
                block_hashes: Vec::new(),
            },
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cleared(event_id: u64) -> KvEvent {
        KvEvent {
            event_id,
            kind: EventKind::Cleared,
        }
    }

    #[test]
    fn an_armed_drop_takes_that_many_events_of_that_rank_only_and_only_when_enabled() {
        let key = WorkerKey::new(1, 0);
        let off = Faults::new(false);
        assert!(!off.drop_events(key, 2, false));
        assert_eq!(off.pass(key, cleared(1)), Some(cleared(1)));

        let on = Faults::new(true);
        assert!(on.drop_events(key, 2, false));
        let other = WorkerKey::new(2, 0);
        assert_eq!(on.pass(other, cleared(1)), Some(cleared(1)));
        let empty = |event_id| {
            Some(KvEvent {
                event_id,
                kind: EventKind::Removed {
                    block_hashes: Vec::new(),
                },
            })
        };
        assert_eq!(on.pass(key, cleared(1)), empty(1));
        assert_eq!(on.pass(key, cleared(2)), empty(2));
        assert_eq!(on.pass(key, cleared(3)), Some(cleared(3)));
        // Whole: not even the id is applied.
        assert!(on.drop_events(key, 1, true));
        assert_eq!(on.pass(key, cleared(4)), None);
        assert_eq!(on.pass(key, cleared(5)), Some(cleared(5)));
    }
}
