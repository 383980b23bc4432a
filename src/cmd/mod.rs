//! One module per subcommand: argument definitions and the code that runs it.

pub mod bench;
pub mod bench_router;
pub mod hash;
pub mod serve;
