//! Ruleset model, simulator and rule attribution (see issue "Rules").
//!
//! The crate answers "which rule did this?" without root: it parses `iptables-save` /
//! `ip6tables-save` output, `nft -j list ruleset`, `ipset save` and `ip -j route`, then walks a
//! packet through the netfilter hooks in kernel order, naming every rule whose counters the
//! kernel would increment. Matches it does not model make the answer "undecidable" rather than
//! a guess. `explain` is the entry point the CLI wires up.

pub mod bridge;
pub mod check;
pub mod compile;
pub mod error;
pub mod explain;
pub mod ipset;
pub mod iptables;
pub mod ipvs;
pub mod journey;
pub mod live;
pub mod net;
pub mod nft;
pub mod packet;
pub mod route;
pub mod savefile;
pub mod sim;
pub mod sysctl;

pub use bridge::Bridges;
pub use error::ParseError;
pub use explain::{
    ExplainError, ExplainRequest, Explanation, Ruleset, explain, explain_connection, explain_on,
    explain_with, explain_with_bridges, input_notes, prepare,
};
pub use ipset::{Ipsets, parse_ipsets};
pub use iptables::{SaveFile, parse_fragment, parse_save, parse_save_family};
pub use live::{BridgeTexts, LiveError, LiveNode, LiveTexts};
pub use nft::{NftRuleset, parse_nft_json};
pub use observer_model::Family;
pub use packet::{CtState, PacketSpec, PacketSpecError, parse_packet_spec};
pub use route::{RouteDecision, Routes};
pub use sim::{
    Branch, Hook, MatchedRule, PhysOut, SeenPorts, Simulator, StageInput, StoredNat, Verdict,
};
pub use sysctl::Sysctls;
