//! `kvroute hash`: the block hashes of a token sequence, for operators debugging
//! "why is my hit rate zero" against an engine's own hashes.

use clap::Args;
use kvroute_index::{BlockHasher, sequence_hashes};

#[derive(Args)]
pub struct HashArgs {
    /// Tokens per block.
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..))]
    block_size: u32,
    /// LoRA adapter name; omitted: the base model.
    #[arg(long, default_value = "")]
    lora: String,
    /// Token ids, comma-separated (e.g. 0,1,2,3).
    #[arg(long, value_delimiter = ',', required = true)]
    tokens: Vec<u32>,
}

pub fn run(args: HashArgs) -> anyhow::Result<()> {
    let hasher = BlockHasher::with_lora(args.block_size as usize, &args.lora);
    let local = hasher.local_hashes(&args.tokens);
    let sequence = sequence_hashes(&local);
    println!(
        "{}",
        serde_json::json!({ "local": local, "sequence": sequence })
    );
    Ok(())
}
