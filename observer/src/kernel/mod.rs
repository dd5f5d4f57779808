//! Kernel-facing: struct offsets from BTF, where the probes go, loading and attaching them
//! (Aya for TC; for the per-table probes a capture backend, today netfilter links through
//! observer's own loader), keeping them attached while rules and interfaces change, and the
//! kernel's symbols and namespaces.

pub mod bridgechains;
pub mod bridgetrace;
pub mod btf;
pub mod btf_raw;
pub mod caps;
pub mod capture;
pub mod kallsyms;
pub mod netns;
pub mod nf_link;
pub mod nftwatch;
pub mod plan;
pub mod probes;
pub mod session;
pub mod tc_guard;
pub mod upkeep;
