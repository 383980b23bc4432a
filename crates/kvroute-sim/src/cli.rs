//! The engines' options as command-line flags, for the binaries that start
//! simulated engines: `kvroute sim` and `kvroute-lab bench e2e`.

use clap::Args;
use kvroute_cache::PolicyKind;

use crate::{CostModel, EngineConfig, EngineKind};

/// Engine options shared by `kvroute sim` and `kvroute-lab bench e2e`.
#[derive(Args, Clone, Debug)]
pub struct EngineArgs {
    /// KV blocks per engine.
    #[arg(long, default_value_t = 8192)]
    pub kv_blocks: usize,
    /// Tokens per KV block; must match the router's.
    #[arg(long, default_value_t = 16)]
    pub block_size: usize,
    /// Most requests in one engine's running batch.
    #[arg(long, default_value_t = 256)]
    pub max_num_seqs: usize,
    /// Most tokens (prefill chunks plus decodes) in one iteration.
    #[arg(long, default_value_t = 8192)]
    pub max_num_batched_tokens: usize,
    /// Eviction policy of the cached blocks: lru, lfu, fifo, s3fifo, arc,
    /// predictive or qos. `bench e2e` takes several, comma-separated, and runs each.
    #[arg(long, value_delimiter = ',', default_value = "lru")]
    pub eviction: Vec<PolicyKind>,
    /// Whose prefix cache the engines imitate: vllm (finished requests give
    /// their blocks back tail first, --eviction picks victims) or sglang (a
    /// radix tree: the least recently used unlocked leaf goes first; lru only).
    #[arg(long = "engine", default_value = "vllm")]
    pub engine_kind: EngineKind,
    /// Divides every simulated time (1: real time).
    #[arg(long, default_value_t = 1.0)]
    pub speedup: f64,
    /// Blocks of a per-engine host (CPU) tier, LRU: blocks the GPU pool evicts
    /// are copied there and loaded back instead of prefilled, announced to the
    /// router as the offload tier. 0: no host tier.
    #[arg(long, default_value_t = 0)]
    pub offload_blocks: usize,
}

impl EngineArgs {
    pub fn engine_config(&self) -> EngineConfig {
        EngineConfig {
            kv_blocks: self.kv_blocks,
            block_size: self.block_size,
            max_num_seqs: self.max_num_seqs,
            max_num_batched_tokens: self.max_num_batched_tokens,
            eviction: self.eviction.first().copied().unwrap_or(PolicyKind::Lru),
            kind: self.engine_kind,
            cost: CostModel {
                speedup: self.speedup,
                ..CostModel::default()
            },
            offload_blocks: self.offload_blocks,
        }
    }
}
