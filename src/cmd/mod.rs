//! One module per subcommand: argument definitions and the code that runs it.

pub mod bench;
pub mod bridge;
pub mod demo;
pub mod hash;
pub mod replay;
pub mod serve;
pub mod sim;
pub mod sim_stats;
