//! observer's library, by layer (docs/architecture.md); modules are imported by their path
//! (`crate::kernel::probes`, `crate::pipeline::report`), so each import shows which layer
//! reaches into which:
//! - [`kernel`]: BTF offsets, the probe plan, loading and attaching the probes, keeping them
//!   attached, interfaces and namespaces;
//! - [`tuple`]: conntrack tuples as recorded, read with the kernel's layout;
//! - [`filter`]: the `--filter` compiler (pure) and its evaluation on recorded traversals;
//! - [`pipeline`]: ring-buffer bytes -> decode -> correlate -> report (annotate, name the
//!   rules) -> rendered, one record at a time;
//! - [`output`]: stdout's writer, recordings, pcap-ng;
//! - [`commands`]: tail, replay, explain, lab, agent; [`k8s`]: names for the agent.
//!
//! The traversal type and its renderers are `observer-model`'s; the live node's rules are
//! read by `observer-rules`' `live` module.

pub mod commands;
pub mod filter;
pub mod k8s;
pub mod kernel;
pub mod output;
pub mod pipeline;
pub mod tuple;
