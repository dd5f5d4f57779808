//! observer's library: everything the binary does, one module per stage of the data flow
//! (probes -> ring buffer -> decode -> correlate -> report, with rule naming) plus the lab
//! and its traffic. The traversal type and its renderers are `observer-model`'s; the live
//! node's rules are read by `observer-rules`' `live` module.

pub mod agent;
pub mod annotate;
pub mod btf;
pub mod correlate;
pub mod decode;
pub mod explain;
pub mod filter;
pub mod k8s;
pub mod kallsyms;
pub mod lab;
/// Mark names live in the model, shared with explain.
pub use observer_model::marks;
pub mod netns;
pub mod nf_link;
pub mod nftwatch;
pub mod output;
pub mod pcapng;
pub mod pipeline;
pub mod plan;
pub mod probes;
pub mod recording;
pub mod render_cache;
pub mod replay;
pub mod report;
pub mod rulenames;
pub mod tail;
pub mod traffic;
pub mod upkeep;
