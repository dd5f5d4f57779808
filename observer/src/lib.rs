//! observer's library: everything the binary does, one module per stage of the data flow
//! (probes -> ring buffer -> decode -> correlate -> report) plus the lab and its traffic.

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
pub mod marks;
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
pub mod tail;
pub mod traffic;
pub mod upkeep;
