//! One module per subcommand: argument definitions and the code that runs it.

pub mod bench;
pub mod replay;
pub mod sim_stats;
