//! Writers and readers on several threads: no deadlock, and every answer is one
//! that some serial order of the events could give.
//!
//! Each writer owns a worker whose chain shares its first two blocks with every
//! other writer (so all chains meet in the same shard) and then grows or shrinks
//! by whole five-block segments, one event each. A chain segment below the first
//! two blocks is applied atomically, so a reader must only ever see a writer at
//! depth 2, 7, 12 or 17 on its own path, and at depth 2 on another writer's path.

mod model;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, mpsc};
use std::thread;
use std::time::Duration;

use kvroute_index::{EventKind, IndexConfig, KvEvent, KvIndex, WorkerKey};
use model::stored;

const WRITERS: u64 = 4;
const READERS: usize = 2;
const STEPS: usize = 2000;
const SEGMENT: u64 = 5;
const MAX_SEGMENTS: u64 = 3;

fn engine(writer: u64, depth: u64) -> u64 {
    writer << 32 | depth
}

fn tokens(writer: u64, depth: u64) -> u64 {
    match depth {
        0 => 1,
        1 => 2,
        d => 1000 * (writer + 1) + d,
    }
}

fn path(writer: u64) -> Vec<u64> {
    (0..2 + SEGMENT * MAX_SEGMENTS)
        .map(|d| tokens(writer, d))
        .collect()
}

/// The writer's first event: the two blocks every chain shares, in two shards.
fn start(index: &KvIndex, writer: u64) {
    let kind = stored(None, &[(engine(writer, 0), 1), (engine(writer, 1), 2)]);
    index.apply(WorkerKey::new(writer, 0), &KvEvent { event_id: 1, kind });
}

/// Runs one writer after [`start`]; returns its final depth.
fn write(index: &KvIndex, writer: u64) -> u64 {
    let worker = WorkerKey::new(writer, 0);
    let mut event_id = 2;
    let mut apply = |kind: EventKind| {
        index.apply(worker, &KvEvent { event_id, kind });
        event_id += 1;
    };
    let (mut segments, mut rng) = (0u64, writer + 1);
    for _ in 0..STEPS {
        rng = rng
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        let grow = segments == 0 || (segments < MAX_SEGMENTS && rng >> 63 == 0);
        let top = 2 + SEGMENT * segments;
        if grow {
            let blocks: Vec<(u64, u64)> = (top..top + SEGMENT)
                .map(|d| (engine(writer, d), tokens(writer, d)))
                .collect();
            apply(stored(Some(engine(writer, top - 1)), &blocks));
            segments += 1;
        } else {
            let block_hashes = (top - SEGMENT..top)
                .rev()
                .map(|d| engine(writer, d))
                .collect();
            apply(EventKind::Removed { block_hashes });
            segments -= 1;
        }
    }
    2 + SEGMENT * segments
}

fn read(index: &KvIndex, done: &AtomicBool) -> usize {
    let mut checked = 0;
    // At least a few rounds even if the writers finish first.
    while !done.load(Ordering::Acquire) || checked < 100 {
        for writer in 0..WRITERS {
            for m in index.find_matches(&path(writer)) {
                if m.worker.worker_id == writer {
                    assert!(
                        m.depth >= 2 && (m.depth - 2) % SEGMENT as u32 == 0,
                        "writer {writer} seen at depth {}",
                        m.depth
                    );
                } else if m.worker.worker_id < WRITERS {
                    assert_eq!(
                        m.depth, 2,
                        "writer {} on writer {writer}'s path",
                        m.worker.worker_id
                    );
                } else {
                    // The churned worker stores two blocks in two shards.
                    assert!(m.depth <= 2);
                }
                checked += 1;
            }
        }
    }
    checked
}

/// A worker that keeps being added and removed while the others run.
fn churn_worker(index: &KvIndex, done: &AtomicBool) {
    let worker = WorkerKey::new(99, 0);
    while !done.load(Ordering::Acquire) {
        index.apply(
            worker,
            &KvEvent {
                event_id: 1,
                kind: stored(None, &[(1, 1), (2, 2)]),
            },
        );
        index.remove_worker(worker);
    }
}

#[test]
fn concurrent_writers_and_readers_see_only_serial_states() {
    let (tx, rx) = mpsc::channel();
    thread::spawn(move || {
        let index = Arc::new(KvIndex::new(IndexConfig::default()));
        let done = Arc::new(AtomicBool::new(false));
        for writer in 0..WRITERS {
            start(&index, writer);
        }
        let finals = thread::scope(|scope| {
            let readers: Vec<_> = (0..READERS)
                .map(|_| scope.spawn(|| read(&index, &done)))
                .collect();
            let churn = scope.spawn(|| churn_worker(&index, &done));
            let writers: Vec<_> = (0..WRITERS)
                .map(|w| {
                    let index = &index;
                    scope.spawn(move || write(index, w))
                })
                .collect();
            let finals: Vec<u64> = writers.into_iter().map(|h| h.join().unwrap()).collect();
            done.store(true, Ordering::Release);
            churn.join().unwrap();
            for r in readers {
                r.join().unwrap();
            }
            finals
        });
        for (writer, &expected) in finals.iter().enumerate() {
            let writer = writer as u64;
            let depth = index
                .find_matches(&path(writer))
                .into_iter()
                .find(|m| m.worker.worker_id == writer)
                .map(|m| u64::from(m.depth));
            assert_eq!(depth, Some(expected));
            assert_eq!(index.worker_blocks(WorkerKey::new(writer, 0)), expected);
        }
        tx.send(()).unwrap();
    });
    match rx.recv_timeout(Duration::from_secs(60)) {
        Ok(()) => {}
        Err(mpsc::RecvTimeoutError::Timeout) => {
            panic!("deadlock: the threads did not finish in 60 s")
        }
        Err(mpsc::RecvTimeoutError::Disconnected) => panic!("a thread of the test panicked"),
    }
}

/// A worker's dumps, each of 40 events, replace its state while a reader looks.
/// The two dumps share their first half; the reader sees the dumping worker
/// holding all of one dump or all of the other, never part of one or neither.
#[test]
fn readers_never_see_a_half_applied_dump() {
    const EVENTS: u64 = 40;
    const PER_EVENT: u64 = 25;
    const DEPTH: u32 = (EVENTS * PER_EVENT) as u32;
    const SHARED: u32 = DEPTH / 2;
    let dumper = WorkerKey::new(7, 0);
    // Hash of dump `d`'s block at `depth` (from 0), engine and local alike.
    let hash = |d: u64, depth: u64| {
        if depth < u64::from(SHARED) {
            depth + 1
        } else {
            d << 32 | (depth + 1)
        }
    };
    let dump = move |d: u64| -> Vec<EventKind> {
        (0..EVENTS)
            .map(|e| {
                let first = e * PER_EVENT;
                let blocks: Vec<(u64, u64)> = (first..first + PER_EVENT)
                    .map(|depth| (hash(d, depth), hash(d, depth)))
                    .collect();
                stored(first.checked_sub(1).map(|p| hash(d, p)), &blocks)
            })
            .collect()
    };
    let paths: [Vec<u64>; 2] =
        [1, 2].map(|d| (0..u64::from(DEPTH)).map(|depth| hash(d, depth)).collect());
    let (tx, rx) = mpsc::channel();
    thread::spawn(move || {
        let index = KvIndex::new(IndexConfig {
            max_blocks: Some(1 << 20),
        });
        index.replace_worker(dumper, 0, &dump(1));
        let done = AtomicBool::new(false);
        thread::scope(|scope| {
            let reader = scope.spawn(|| {
                let mut lookups = 0;
                while !done.load(Ordering::Acquire) {
                    for path in &paths {
                        let depth = index
                            .find_matches(path)
                            .iter()
                            .find(|m| m.worker == dumper)
                            .map_or(0, |m| m.depth);
                        assert!(
                            depth == DEPTH || depth == SHARED,
                            "the dumping worker seen at depth {depth}"
                        );
                        lookups += 1;
                    }
                }
                lookups
            });
            for round in 1..=20 {
                index.replace_worker(dumper, round, &dump(1 + round % 2));
            }
            done.store(true, Ordering::Release);
            reader.join().unwrap();
        });
        assert_eq!(index.worker_blocks(dumper), u64::from(DEPTH));
        assert_eq!(index.stats().blocks, u64::from(DEPTH));
        tx.send(()).unwrap();
    });
    match rx.recv_timeout(Duration::from_secs(60)) {
        Ok(()) => {}
        Err(mpsc::RecvTimeoutError::Timeout) => {
            panic!("deadlock: the threads did not finish in 60 s")
        }
        Err(mpsc::RecvTimeoutError::Disconnected) => panic!("a thread of the test panicked"),
    }
}

/// Two workers take turns holding one interned index: each is added, stores its
/// own chain (`short` one block, `long` three, of which block 0 may show alone:
/// blocks 0 and 1 live in different shards) and is removed, so the next one
/// gets the index just freed. A reader must never see `short` at `long`'s
/// depth, which a lookup reading the index's owner after the hand-over would
/// report (lookups take no lock that adding a worker waits for). Workers
/// holding block 0 under the indices before theirs make the lookups' results
/// long, so the hand-over often falls between a walk and its result.
#[test]
fn a_freed_index_is_never_reported_under_its_next_worker() {
    const FILLERS: u64 = 2000;
    let (short, long) = (WorkerKey::new(1 << 40, 0), WorkerKey::new(1 << 41, 0));
    let path = [1, 2, 3];
    let (tx, rx) = mpsc::channel();
    thread::spawn(move || {
        let index = KvIndex::new(IndexConfig::default());
        for filler in 0..FILLERS {
            let kind = stored(None, &[(1, 1)]);
            index.apply(WorkerKey::new(filler, 0), &KvEvent { event_id: 1, kind });
        }
        let done = AtomicBool::new(false);
        let lookups = thread::scope(|scope| {
            let reader = scope.spawn(|| {
                let mut lookups = 0u64;
                while !done.load(Ordering::Acquire) {
                    for m in index.find_matches(&path) {
                        let expected: &[u32] = if m.worker == long { &[1, 3] } else { &[1] };
                        assert!(expected.contains(&m.depth), "{m:?}");
                        lookups += 1;
                    }
                }
                lookups
            });
            for _ in 0..20_000 {
                for (worker, len) in [(short, 1), (long, 3)] {
                    let blocks: Vec<(u64, u64)> = path[..len].iter().map(|&h| (h, h)).collect();
                    let kind = stored(None, &blocks);
                    index.apply(worker, &KvEvent { event_id: 1, kind });
                    index.remove_worker(worker);
                }
            }
            done.store(true, Ordering::Release);
            reader.join().unwrap()
        });
        assert!(lookups > 0);
        tx.send(()).unwrap();
    });
    match rx.recv_timeout(Duration::from_secs(60)) {
        Ok(()) => {}
        Err(mpsc::RecvTimeoutError::Timeout) => {
            panic!("deadlock: the threads did not finish in 60 s")
        }
        Err(mpsc::RecvTimeoutError::Disconnected) => panic!("a thread of the test panicked"),
    }
}
