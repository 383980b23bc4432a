//! Small traces per policy with the expected results worked out by hand.

use kvroute_cache::{
    Access, ArcCache, Belady, BlockCache, Fifo, Infinite, Lfu, Lru, PolicyKind, PreparedTrace,
    ReplayReport, S3Fifo, S3FifoParams, replay,
};
use kvroute_trace::TraceRequest;

use Access::{Hit, Miss};

fn request(input_length: u64, hash_ids: &[u64]) -> TraceRequest {
    TraceRequest {
        timestamp_ms: 0,
        input_length,
        output_length: 1,
        hash_ids: hash_ids.to_vec(),
    }
}

/// Accesses `blocks` in order; per access, what it found and what it evicted.
fn accesses(cache: &mut dyn BlockCache, blocks: &[u64]) -> Vec<(Access, Vec<u64>)> {
    blocks
        .iter()
        .map(|&block| {
            let mut evicted = Vec::new();
            let access = cache.access(block, &mut evicted);
            (access, evicted)
        })
        .collect()
}

fn hits(report: &ReplayReport) -> Vec<u64> {
    report.per_request.iter().map(|r| r.hit_tokens).collect()
}

/// Block size 4; capacity 3. Exercises a partial last block, a hit after a gap
/// and a resident block behind a missing one. Ids are numbered in order of
/// first use, so the replay's dense relabelling leaves them as they are.
fn gap_trace() -> PreparedTrace {
    PreparedTrace::new(&[
        request(10, &[0, 1, 2]), // r1
        request(4, &[3]),        // r2
        request(7, &[1, 2]),     // r3
        request(8, &[4, 5]),     // r4
        request(12, &[2, 4, 6]), // r5
        request(8, &[7, 2]),     // r6
    ])
}

#[test]
fn lru_replay_partial_block_gap_and_prefix_stop() {
    // LRU order, oldest first:
    // r1 [0,1,2] all miss, k=0                                 -> [0,1,2]
    // r2 [3] miss, evicts 0                                    -> [1,2,3]
    // r3 [1,2] both resident: k=2, 2*4=8 > 7 so hit = 7 (partial last block)
    //    hits move them to most recent                         -> [3,1,2]
    // r4 [4,5] miss, evict 3 then 1                            -> [2,4,5]
    // r5 [2,4,6]: 2 and 4 resident (2 after a gap of one request), 6 not: k=2, hit 8
    //    2 hit -> [4,5,2]; 4 hit -> [5,2,4]; 6 evicts 5        -> [2,4,6]
    // r6 [7,2]: 7 missing, so k=0 although 2 is resident; hit 0
    //    7 evicts 2 -> [4,6,7]; 2 evicts 4                     -> [6,7,2]
    let mut cache = Lru::new(3).unwrap();
    let report = replay(&mut cache, &gap_trace(), 4, || {});
    assert_eq!(hits(&report), [0, 0, 7, 0, 8, 0]);
    assert_eq!(report.total_prompt_tokens, 49);
    assert_eq!(report.total_hit_tokens, 15);
    assert_eq!(report.final_cache_blocks, 3);
    assert_eq!(report.evictions, 6);
    assert_eq!(report.block_hits, 4, "1 and 2 in r3, 2 and 4 in r5");
    // Evicted 0, 3, 1, 5, 2, 4: only 2 is requested again later (right after
    // its eviction, in r6).
    assert_eq!(report.re_prefilled_evictions, 1);
    for block in [6, 7, 2] {
        assert!(cache.contains(block), "{block}");
    }
    assert!((report.overall_hit_rate() - 15.0 / 49.0).abs() < 1e-12);
}

#[test]
fn fifo_replay_hits_do_not_refresh() {
    // FIFO order, oldest first:
    // r1 [0,1,2] miss                        -> [0,1,2]
    // r2 [3] evicts 0                        -> [1,2,3]
    // r3 [1,2] k=2, hit min(8,7)=7, no moves -> [1,2,3]
    // r4 [4,5] evict 1, 2                    -> [3,4,5]
    // r5 [2,4,6] 2 missing: k=0. 2 evicts 3 -> [4,5,2]; 4 hit; 6 evicts 4 -> [5,2,6]
    // r6 [7,2] k=0. 7 evicts 5 -> [2,6,7]; 2 hit
    let mut cache = Fifo::new(3).unwrap();
    let report = replay(&mut cache, &gap_trace(), 4, || {});
    assert_eq!(hits(&report), [0, 0, 7, 0, 0, 0]);
    assert_eq!(report.total_hit_tokens, 7);
    assert_eq!(report.evictions, 6);
    assert_eq!(report.final_cache_blocks, 3);
    for block in [2, 6, 7] {
        assert!(cache.contains(block), "{block}");
    }
}

#[test]
fn lfu_ties_go_to_the_oldest_insertion_and_counts_are_forgotten() {
    let mut cache = Lfu::new(2).unwrap();
    // 1, 2 inserted with count 1; 2 and 1 hit: both count 2, 1 used last.
    // 3: tie at count 2, the oldest insertion (1) goes, although 2 is less
    //    recently used: hits do not refresh insertion order. 3 has count 1.
    // 4: 3 has the lowest count, so the newest block goes.
    // 1: its count was forgotten, so it is a miss; 4 (count 1) < 2 (count 2).
    let got = accesses(&mut cache, &[1, 2, 2, 1, 3, 4, 1]);
    let want = [
        (Miss, vec![]),
        (Miss, vec![]),
        (Hit, vec![]),
        (Hit, vec![]),
        (Miss, vec![1]),
        (Miss, vec![3]),
        (Miss, vec![4]),
    ];
    assert_eq!(got, want);
    assert!(cache.contains(2) && cache.contains(1));
}

#[test]
fn s3fifo_queue_sizes_round_half_to_even() {
    let caps = |capacity, small_ratio| {
        let params = S3FifoParams {
            small_ratio,
            max_freq: 3,
        };
        S3Fifo::new(capacity, params).unwrap().queue_capacities()
    };
    assert_eq!(caps(25, 0.1), (2, 23, 23), "2.5 rounds to 2");
    assert_eq!(caps(35, 0.1), (4, 31, 31), "3.5 rounds to 4");
    assert_eq!(caps(5, 0.1), (1, 4, 4), "0.5 rounds to 0, raised to 1");
    assert_eq!(caps(16384, 0.1), (1638, 14746, 14746));
    assert!(
        S3Fifo::new(1, S3FifoParams::default()).is_err(),
        "no main queue"
    );
    let bad_ratio = S3FifoParams {
        small_ratio: 1.0,
        max_freq: 3,
    };
    assert!(S3Fifo::new(10, bad_ratio).is_err());
}

#[test]
fn s3fifo_promotion_second_chance_and_ghost_readmission() {
    // Capacity 4, small_ratio 0.25: |S| ≤ 1, |M| ≤ 3, |G| ≤ 3. Counts in ().
    let params = S3FifoParams {
        small_ratio: 0.25,
        max_freq: 3,
    };
    let mut cache = S3Fifo::new(4, params).unwrap();
    let sequence = [
        1, // miss: S=[1(0)]
        1, // hit: 1(1)
        2, // miss: S full, head 1 has count 1 -> promoted to M=[1(1)]; S=[2(0)]
        3, // miss: head 2 has count 0 -> ghost G=[2], evicted; S=[3(0)]
        2, // ghost hit: out of G, admitted to M with count 0: M=[1(1),2(0)]; a miss
        4, // miss: 3 -> G=[3], evicted; S=[4(0)]
        4, // hit: 4(1)
        5, // miss: 4 promoted, M=[1(1),2(0),4(1)]; S=[5(0)]
        1, // hit in M: 1(2)
        6, // miss: 5 -> G=[3,5], evicted; S=[6(0)]
        6, // hit: 6(1)
        7, // miss: 6 promoted into a full M: head 1(2) gets a second chance (count 1,
        //    to the tail), head 2(0) goes to G=[3,5,2], evicted; M=[4(1),1(1),6(1)]; S=[7(0)]
        8, // miss: 7 -> G full, drops 3: G=[5,2,7], evicted 7; S=[8(0)]
        3, // 3 left G, so a plain miss: 8 -> G=[2,7,8] (drops 5), evicted 8; S=[3(0)]
    ];
    let got = accesses(&mut cache, &sequence);
    let want = [
        (Miss, vec![]),
        (Hit, vec![]),
        (Miss, vec![]),
        (Miss, vec![2]),
        (Miss, vec![]),
        (Miss, vec![3]),
        (Hit, vec![]),
        (Miss, vec![]),
        (Hit, vec![]),
        (Miss, vec![5]),
        (Hit, vec![]),
        (Miss, vec![2]),
        (Miss, vec![7]),
        (Miss, vec![8]),
    ];
    assert_eq!(got, want);
    assert_eq!(cache.len(), 4);
    for block in [3, 4, 1, 6] {
        assert!(cache.contains(block), "{block} resident");
    }
    for ghost in [2, 7, 8] {
        assert!(!cache.contains(ghost), "ghost {ghost} is not resident");
    }
    // 2 is still a ghost: re-admitted straight to M, whose head 4(1) gets a
    // second chance and 1(1) too, then 6(1), then 4(0) goes.
    assert_eq!(accesses(&mut cache, &[2]), [(Miss, vec![4])]);
}

#[test]
fn s3fifo_final_size_below_capacity() {
    // Capacity 4 (S 1, M 3): blocks used once each pass through S into the
    // ghost queue, so M stays empty and the cache holds a single block.
    let trace: Vec<TraceRequest> = (0..4).map(|i| request(4, &[i])).collect();
    let trace = PreparedTrace::new(&trace);
    let params = S3FifoParams {
        small_ratio: 0.25,
        max_freq: 3,
    };
    let mut cache = S3Fifo::new(4, params).unwrap();
    let report = replay(&mut cache, &trace, 4, || {});
    assert_eq!(report.final_cache_blocks, 1);
    assert_eq!(report.evictions, 3);
    assert_eq!(report.total_hit_tokens, 0);
}

#[test]
fn arc_adapts_p_towards_the_list_that_ghost_hits_favour() {
    // Capacity 2. (T1 | T2 | B1 | B2), LRU first.
    let mut cache = ArcCache::new(2).unwrap();
    let steps: [(u64, Access, Vec<u64>, f64); 9] = [
        // IV, directory not full: T1=[1]
        (1, Miss, vec![], 0.0),
        // I: T2=[1]
        (1, Hit, vec![], 0.0),
        // IV: T1=[2], cache full
        (2, Miss, vec![], 0.0),
        // IV-B: REPLACE, |T1|=1 > p=0 -> 2 to B1. T1=[3] T2=[1] B1=[2]
        (3, Miss, vec![2], 0.0),
        // II: B1 hit, |B1| ≥ |B2| so p += 1 -> 1; REPLACE: |T1|=1 not > 1 -> 1 to B2.
        //     T1=[3] T2=[2] B2=[1]
        (2, Miss, vec![1], 1.0),
        // III: B2 hit, |B2| ≥ |B1| so p -= 1 -> 0; REPLACE: |T1|=1 > 0 -> 3 to B1.
        //      T2=[2,1] B1=[3]
        (1, Miss, vec![3], 0.0),
        // IV-B: REPLACE with T1 empty -> T2's LRU 2 to B2. T1=[4] T2=[1] B1=[3] B2=[2]
        (4, Miss, vec![2], 0.0),
        // II: |B1|=|B2| so p -> 1; REPLACE: |T1|=1 not > 1 -> 1 to B2.
        //     T1=[4] T2=[3] B2=[2,1]
        (3, Miss, vec![1], 1.0),
        // IV-B with the directory at 2c: drop B2's LRU 2; REPLACE -> 3 to B2.
        //      T1=[4,5] B2=[1,3]
        (5, Miss, vec![3], 1.0),
    ];
    for (i, (block, access, evicted, p)) in steps.into_iter().enumerate() {
        let mut got = Vec::new();
        assert_eq!(cache.access(block, &mut got), access, "step {}", i + 1);
        assert_eq!(got, evicted, "step {}", i + 1);
        assert_eq!(cache.target_t1(), p, "step {}", i + 1);
    }
    assert_eq!(cache.list_lens(), [2, 0, 0, 2]);
    assert!(cache.contains(4) && cache.contains(5) && !cache.contains(1));
}

#[test]
fn belady_evicts_the_block_used_farthest_in_the_future() {
    // Capacity 2, sequence 1 2 3 1 2. At 3: 1 is next used at 3, 2 at 4, so 2
    // goes. 1 hits. At the last 2: 1 and 3 are never used again; 3 goes (ties
    // among never-again blocks go to the larger id). LRU would hit nothing.
    let sequence = [1, 2, 3, 1, 2];
    let mut cache = Belady::new(2, &sequence).unwrap();
    let got = accesses(&mut cache, &sequence);
    let want = [
        (Miss, vec![]),
        (Miss, vec![]),
        (Miss, vec![2]),
        (Hit, vec![]),
        (Miss, vec![3]),
    ];
    assert_eq!(got, want);
    let mut lru = Lru::new(2).unwrap();
    assert!(
        accesses(&mut lru, &sequence)
            .iter()
            .all(|(a, _)| *a == Miss)
    );
}

#[test]
fn infinite_never_evicts_and_bounds_every_policy() {
    let mut cache = Infinite::default();
    let report = replay(&mut cache, &gap_trace(), 4, || {});
    // r3 hits 7; r5: 2 and 4 resident, 6 new: 8; r6: 7 new: 0.
    assert_eq!(hits(&report), [0, 0, 7, 0, 8, 0]);
    assert_eq!(report.final_cache_blocks, 8);
    assert_eq!(report.evictions, 0);
    assert_eq!(report.mean_utilisation, None);
    assert_eq!(cache.evict_one(), None);
}

#[test]
fn worker_pool_use_pins_reused_blocks_and_frees_on_demand() {
    // Capacity = the worker's 4 blocks. Request A finishes: its blocks become
    // inactive cached blocks.
    for kind in [
        PolicyKind::Lru,
        PolicyKind::Fifo,
        PolicyKind::Lfu,
        PolicyKind::Arc,
    ] {
        let mut pool = kind.build(4, S3FifoParams::default(), &[]).unwrap();
        let mut freed = Vec::new();
        for block in [1, 2, 3] {
            assert_eq!(pool.access(block, &mut freed), Miss, "{kind}");
        }
        assert!(freed.is_empty());
        // Request B reuses 1 and 2: active again, so never victims.
        assert!(pool.remove(1) && pool.remove(2), "{kind}");
        assert!(!pool.remove(1), "{kind}: already active");
        assert!(!pool.contains(1) && pool.len() == 1, "{kind}");
        // The engine needs free blocks: only 3 is evictable.
        assert_eq!(pool.evict_one(), Some(3), "{kind}");
        assert_eq!(pool.evict_one(), None, "{kind}");
        // B finishes: 1 and 2 are cached again and can be reused.
        for block in [1, 2] {
            assert_eq!(pool.access(block, &mut freed), Miss, "{kind}");
        }
        assert!(
            pool.contains(1) && pool.contains(2) && freed.is_empty(),
            "{kind}"
        );
    }
}

#[test]
fn s3fifo_pool_eviction_follows_the_papers_order() {
    // Capacity 4 (S 1, M 3). 1 is used twice (count 1), then 2 arrives: 1 is
    // promoted to M, S=[2(0)]. Asked for a victim, S is at its share, so its
    // head 2 (count 0) goes. Then S is empty: M's 1 gets its second chance
    // (count 0, back to the tail) and then goes.
    let params = S3FifoParams {
        small_ratio: 0.25,
        max_freq: 3,
    };
    let mut pool = S3Fifo::new(4, params).unwrap();
    accesses(&mut pool, &[1, 1, 2]);
    assert_eq!(pool.evict_one(), Some(2));
    assert_eq!(pool.evict_one(), Some(1));
    assert_eq!(pool.evict_one(), None);
    assert!(pool.is_empty());
}
