//! The commands: `tail`, `replay`, `explain`, `lab` (and its traffic), `agent`, and
//! `kubectl observer` ([`kubectl`]: the same binary as a kubectl plugin).

pub mod agent;
pub mod explain;
pub mod kubectl;
pub mod lab;
pub mod replay;
pub mod tail;
pub mod traffic;
