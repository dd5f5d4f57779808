//! The commands: `tail`, `replay`, `explain`, `whatif`, `lab` (and its traffic), `agent`, and
//! `kubectl observer` ([`kubectl`]: the same binary as a kubectl plugin).

pub mod agent;
pub mod explain;
pub mod kubectl;
pub mod lab;
pub mod replay;
pub mod rulefiles;
pub mod tail;
pub mod traffic;
pub mod whatif;

pub use crate::pipeline::subscription::parse_seconds;
