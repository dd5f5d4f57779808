//! The commands: `tail`, `replay`, `explain`, `lab` (and its traffic), `agent`.

pub mod agent;
pub mod explain;
pub mod lab;
pub mod replay;
pub mod tail;
pub mod traffic;
