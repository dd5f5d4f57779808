//! One model of a packet's traversal through netfilter, shared by the live tracer
//! (`observer tail`, observed) and the rule simulator (`observer explain`, predicted).
//!
//! Why a crate of its own: `observer-rules` (no root, no eBPF) and `observer` (the
//! collector) both produce traversals, and `observer` depends on `observer-rules`; the type
//! both produce, the vocabulary both speak (families, hooks, the tables of each hook,
//! protocols, addresses, mark names) and the renderers cannot live in either
//! without the other importing its whole world. This crate holds only those: pure types
//! and functions, no I/O.
//!
//! - [`vocab`]: families, hooks and their tables.
//! - [`packet`]: protocols, endpoints, conntrack states and a packet's identity, as values.
//! - [`traversal`]: the [`Traversal`] type (JSON schema 3), with serde enums for every
//!   closed set of words (fate kind, verdict, NAT kind and source, route, check result).
//! - [`render`]: the tree and one-line renderers; [`json`]: the JSON line, written by hand.
//! - [`compare`]: observed against predicted.
//! - [`marks`]: mark bit names.

pub mod compare;
pub mod json;
pub mod kube;
pub mod marks;
pub mod packet;
pub mod render;
pub mod stitch;
pub mod traversal;
pub mod vocab;

pub use compare::{compare, compare_stage};
pub use marks::MarkDictionary;
pub use packet::{CtState, Endpoint, Headers, Host, Icmp, Packet, Protocol};
pub use traversal::*;
pub use vocab::{Family, Hook};

use std::sync::Arc;

/// Every mark bit the stages set or cleared, named from `dict`, with the table that did it.
pub fn mark_changes(stages: &[Stage], dict: &MarkDictionary) -> Marks {
    let mut out = Marks::default();
    for s in stages {
        let (Some(before), Some(after)) = (&s.before, &s.after) else {
            continue;
        };
        let (b, a) = (before.mark, after.mark);
        for bit in (0..32).map(|i| 1u32 << i).filter(|bit| (a ^ b) & bit != 0) {
            let change = MarkChange {
                bit,
                name: dict.shared_name(bit),
                hook: s.hook,
                table: Arc::clone(&s.table),
            };
            if a & bit != 0 {
                out.set.push(change);
            } else {
                out.cleared.push(change);
            }
        }
    }
    out
}
