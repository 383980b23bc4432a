//! kvroute-proto: the gRPC protocol between workers and the router.
//!
//! Generated from `proto/kvroute.proto` at build time; see that file for what
//! each message means. Workers (the simulator, the engine bridges) use the
//! client, the router service the server.

#![allow(clippy::all)]

tonic::include_proto!("kvroute.v1");

/// HTTP/2 pings from a worker to the router, so that a router host gone without
/// closing the connection is noticed and the worker reconnects. Lenient: the
/// router's own pings (configurable there) are what take a dead worker out of
/// routing quickly, and a router applying a huge dump can be slow to answer.
pub const KEEPALIVE_INTERVAL: std::time::Duration = std::time::Duration::from_secs(30);
/// How long a ping may go unanswered before the connection is dropped.
pub const KEEPALIVE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(60);

/// `endpoint` with the workers' keepalive, pinging even with no call in flight.
pub fn with_keepalive(endpoint: tonic::transport::Endpoint) -> tonic::transport::Endpoint {
    endpoint
        .http2_keep_alive_interval(KEEPALIVE_INTERVAL)
        .keep_alive_timeout(KEEPALIVE_TIMEOUT)
        .keep_alive_while_idle(true)
}

/// Blocks per dump part: about 1.3 MB encoded at most (single-block chains with
/// a parent each), well under tonic's 4 MiB default message limit.
pub const DUMP_PART_BLOCKS: usize = 32 * 1024;

impl Dump {
    /// Splits the dump into parts of at most `max_blocks` blocks each, in order,
    /// all but the last marked `more`: the device chains first, then the
    /// offload chains. A chain longer than the room left in a part continues in
    /// the next one from its last block there, so parents still come before
    /// children.
    pub fn into_parts(self, max_blocks: usize) -> Vec<Dump> {
        let max_blocks = max_blocks.max(1);
        let (dp_rank, last_event_id) = (self.dp_rank, self.last_event_id);
        let mut parts = Vec::new();
        let mut current = Dump {
            dp_rank,
            last_event_id,
            ..Dump::default()
        };
        let mut blocks_in_part = 0;
        let tiers = [(false, self.chains), (true, self.offload_chains)];
        for (offload, tier_chains) in tiers {
            for mut chain in tier_chains {
                loop {
                    let room = max_blocks - blocks_in_part;
                    let fits = chain.blocks.len() <= room;
                    let tail = (!fits).then(|| chain.blocks.split_off(room));
                    let tail_parent = chain
                        .blocks
                        .last()
                        .map_or(chain.parent_hash, |b| Some(b.block_hash));
                    if !chain.blocks.is_empty() || fits {
                        blocks_in_part += chain.blocks.len();
                        if offload {
                            current.offload_chains.push(chain);
                        } else {
                            current.chains.push(chain);
                        }
                    }
                    let Some(tail) = tail else {
                        break;
                    };
                    let next = Dump {
                        dp_rank,
                        last_event_id,
                        ..Dump::default()
                    };
                    let mut full = std::mem::replace(&mut current, next);
                    full.more = true;
                    parts.push(full);
                    blocks_in_part = 0;
                    chain = Stored {
                        parent_hash: tail_parent,
                        blocks: tail,
                    };
                }
            }
        }
        parts.push(current);
        parts
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chain(parent: Option<u64>, hashes: std::ops::Range<u64>) -> Stored {
        Stored {
            parent_hash: parent,
            blocks: hashes
                .map(|h| StoredBlock {
                    block_hash: h,
                    tokens_hash: h + 1000,
                })
                .collect(),
        }
    }

    /// (offload tier, parent, block) in order: what applying the dump stores.
    fn links(dumps: &[Dump]) -> Vec<(bool, Option<u64>, u64)> {
        let mut links = Vec::new();
        for dump in dumps {
            let device = dump.chains.iter().map(|c| (false, c));
            let offload = dump.offload_chains.iter().map(|c| (true, c));
            for (tier, c) in device.chain(offload) {
                let mut parent = c.parent_hash;
                for b in &c.blocks {
                    links.push((tier, parent, b.block_hash));
                    parent = Some(b.block_hash);
                }
            }
        }
        links.sort_by_key(|&(tier, ..)| tier);
        links
    }

    #[test]
    fn parts_hold_at_most_the_limit_and_keep_every_link_of_both_tiers_in_order() {
        let dump = Dump {
            dp_rank: 3,
            last_event_id: 42,
            chains: vec![
                chain(None, 0..7),
                chain(Some(2), 10..12),
                chain(None, 20..29),
            ],
            more: false,
            offload_chains: vec![chain(None, 30..35), chain(Some(31), 40..43)],
        };
        for max in [1, 2, 3, 5, 7, 100] {
            let parts = dump.clone().into_parts(max);
            assert_eq!(
                links(&parts),
                links(std::slice::from_ref(&dump)),
                "max {max}"
            );
            for (i, p) in parts.iter().enumerate() {
                let blocks: usize = p
                    .chains
                    .iter()
                    .chain(&p.offload_chains)
                    .map(|c| c.blocks.len())
                    .sum();
                assert!(blocks <= max, "max {max}: part {i} has {blocks}");
                assert_eq!((p.dp_rank, p.last_event_id), (3, 42));
                assert_eq!(p.more, i + 1 < parts.len());
            }
        }
        let empty = Dump::default().into_parts(4);
        assert_eq!(empty.len(), 1);
        assert!(!empty[0].more);
    }
}
