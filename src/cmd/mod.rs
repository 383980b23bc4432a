//! One module per subcommand: argument definitions and the code that runs it.

pub mod bridge;
pub mod demo;
pub mod hash;
pub mod serve;
pub mod sim;
