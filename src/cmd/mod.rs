//! One module per subcommand: argument definitions and the code that runs it.

pub mod hash;
pub mod replay;
pub mod serve;
