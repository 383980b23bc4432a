//! The fleet's groups (the routable ranks serving one model or adapter name),
//! found by name and by a number.
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

/// The routable ranks serving one model or adapter name.
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

/// Every group, by name and by number.
#[derive(Default)]
pub struct Groups {
    by_name: FxHashMap<String, GroupId>,
    /// Indexed by number; a removed group's slot is empty and listed in `free`.
    slots: Vec<Group>,
    free: Vec<GroupId>,
}

impl Groups {
    pub fn get(&self, name: &str) -> Option<&Group> {
        self.by_name.get(name).map(|&id| &self.slots[id.0 as usize])
    }

    /// The group of `name`, added empty if there is none.
    pub fn id_or_insert(&mut self, name: &str) -> GroupId {
        if let Some(&id) = self.by_name.get(name) {
            return id;
        }
        let id = self.free.pop().unwrap_or_else(|| {
            self.slots.push(Group::default());
            GroupId((self.slots.len() - 1) as u32)
        });
        self.by_name.insert(name.to_owned(), id);
        id
    }

    pub fn id(&self, name: &str) -> Option<GroupId> {
        self.by_name.get(name).copied()
    }

    /// Forgets the group of `name`; its number goes to the next new name.
    pub fn remove(&mut self, name: &str) {
        if let Some(id) = self.by_name.remove(name) {
            self.slots[id.0 as usize] = Group::default();
            self.free.push(id);
        }
    }

    pub fn iter(&self) -> impl Iterator<Item = (&str, &Group)> {
        self.by_name
            .iter()
            .map(|(name, id)| (name.as_str(), &self.slots[id.0 as usize]))
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
        let m = groups.id_or_insert("m");
        let n = groups.id_or_insert("n");
        assert_ne!(m, n);
        assert_eq!(groups.id_or_insert("m"), m);
        groups[m].members.push(WorkerKey::new(1, 0));
        groups.remove("m");
        assert!(groups.get("m").is_none());
        let o = groups.id_or_insert("o");
        assert_eq!(o, m);
        assert!(groups[o].members.is_empty());
        assert_eq!(groups.iter().count(), 2);
    }
}
