//! The fleet's groups (the routable ranks of one role serving one model or
//! adapter name), found by role and name and by a number.
//!
//! A name served by a disaggregated fleet has a group of prefill ranks and one
//! of decode ranks (see [`crate::config::Role`]); aggregated ranks keep
//! theirs, so a request of today's path never meets a prefill rank.
//!
//! The scheduler finds a request's group by its name, once. A booking and its
//! release re-key the booked rank in each of its worker's groups; a rank keeps
//! those groups' numbers (set when its worker's routability or names change), so
//! the re-keys index a vector instead of hashing every name twice a request.
//!
//! A group's number stays its own while the group exists; a removed group's
//! number is reused by the next new name. So only the ranks of routable workers
//! keep numbers: a routable rank is a member of each of its groups, and a group
//! with a member is never removed.

use std::collections::BTreeSet;
use std::sync::atomic::AtomicUsize;

use kvroute_index::WorkerKey;
use rustc_hash::FxHashMap;

use crate::config::Role;

/// The routable ranks of one role serving one model or adapter name.
#[derive(Default)]
pub struct Group {
    /// (load key, rank), cheapest first.
    pub by_load: BTreeSet<(u64, WorkerKey)>,
    /// Sorted, for round robin and random picks.
    pub members: Vec<WorkerKey>,
    /// Round-robin position.
    pub next: AtomicUsize,
}

/// A group's number in [`Groups`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GroupId(u32);

/// Every group, by role and name and by number.
#[derive(Default)]
pub struct Groups {
    /// Indexed by [`Role`] in [`Role::ALL`]'s order.
    by_name: [FxHashMap<String, GroupId>; 3],
    /// Indexed by number; a removed group's slot is empty and listed in `free`.
    slots: Vec<Group>,
    free: Vec<GroupId>,
}

fn slot(role: Role) -> usize {
    match role {
        Role::Aggregated => 0,
        Role::Prefill => 1,
        Role::Decode => 2,
    }
}

impl Groups {
    pub fn get(&self, role: Role, name: &str) -> Option<&Group> {
        self.id(role, name).map(|id| &self.slots[id.0 as usize])
    }

    /// The group of `role` ranks serving `name`, added empty if there is none.
    pub fn id_or_insert(&mut self, role: Role, name: &str) -> GroupId {
        if let Some(id) = self.id(role, name) {
            return id;
        }
        let id = self.free.pop().unwrap_or_else(|| {
            self.slots.push(Group::default());
            GroupId((self.slots.len() - 1) as u32)
        });
        self.by_name[slot(role)].insert(name.to_owned(), id);
        id
    }

    pub fn id(&self, role: Role, name: &str) -> Option<GroupId> {
        self.by_name[slot(role)].get(name).copied()
    }

    /// Forgets the group of `role` ranks serving `name`; its number goes to
    /// the next new group.
    pub fn remove(&mut self, role: Role, name: &str) {
        if let Some(id) = self.by_name[slot(role)].remove(name) {
            self.slots[id.0 as usize] = Group::default();
            self.free.push(id);
        }
    }

    pub fn iter(&self) -> impl Iterator<Item = (Role, &str, &Group)> {
        Role::ALL.into_iter().flat_map(move |role| {
            self.by_name[slot(role)]
                .iter()
                .map(move |(name, id)| (role, name.as_str(), &self.slots[id.0 as usize]))
        })
    }
}

impl std::ops::Index<GroupId> for Groups {
    type Output = Group;

    fn index(&self, id: GroupId) -> &Group {
        &self.slots[id.0 as usize]
    }
}

impl std::ops::IndexMut<GroupId> for Groups {
    fn index_mut(&mut self, id: GroupId) -> &mut Group {
        &mut self.slots[id.0 as usize]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_removed_groups_number_goes_to_the_next_name_and_starts_empty() {
        let mut groups = Groups::default();
        let m = groups.id_or_insert(Role::Aggregated, "m");
        let n = groups.id_or_insert(Role::Aggregated, "n");
        assert_ne!(m, n);
        assert_eq!(groups.id_or_insert(Role::Aggregated, "m"), m);
        let decode_m = groups.id_or_insert(Role::Decode, "m");
        assert_ne!(decode_m, m, "each role has its own group of a name");
        groups[m].members.push(WorkerKey::new(1, 0));
        groups.remove(Role::Aggregated, "m");
        assert!(groups.get(Role::Aggregated, "m").is_none());
        assert!(groups.get(Role::Decode, "m").is_some());
        let o = groups.id_or_insert(Role::Prefill, "o");
        assert_eq!(o, m);
        assert!(groups[o].members.is_empty());
        assert_eq!(groups.iter().count(), 3);
    }
}
