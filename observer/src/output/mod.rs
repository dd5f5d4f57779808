//! Where reports go besides the renderers: stdout through its own writer thread
//! (backpressure, never blocking signals), recordings for `observer replay`, and pcap-ng.

pub mod pcapng;
pub mod recording;
mod writer;

pub use writer::*;
