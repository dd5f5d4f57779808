//! observer's library, by layer (docs/architecture.md):
//! - [`kernel`]: BTF offsets, the probe plan, loading and attaching the probes, keeping them
//!   attached;
//! - [`pipeline`]: ring-buffer bytes -> decode -> correlate -> report (annotate, name the
//!   rules) -> rendered, one record at a time;
//! - [`output`]: stdout's writer, recordings, pcap-ng;
//! - [`commands`]: tail, replay, explain, lab, agent; [`k8s`]: names for the agent.
//!
//! The traversal type and its renderers are `observer-model`'s; the live node's rules are
//! read by `observer-rules`' `live` module. The flat paths below (`observer::tail`,
//! `observer::report`, ...) name the same modules.

pub mod commands;
pub mod k8s;
pub mod kernel;
pub mod output;
pub mod pipeline;

pub use commands::{agent, explain, lab, replay, tail, traffic};
pub use kernel::{btf, filter, kallsyms, netns, nf_link, nftwatch, plan, probes, upkeep};
/// Mark names live in the model, shared with explain.
pub use observer_model::marks;
pub use output::{pcapng, recording};
pub use pipeline::{annotate, correlate, decode, render_cache, report, rulenames};
