//! Where reports go besides the renderers: stdout through its own writer thread
//! (backpressure, never blocking signals), recordings for `observer replay`, and pcap-ng.

pub mod pcapng;
pub mod recording;
mod writer;

pub use writer::*;

/// Text from outside (a file, a peer) for a message on the terminal: at most `max`
/// characters, then `...`; control characters escaped (`\u{1b}`, `\n`), so that what a
/// file or a peer holds can neither move the cursor nor forge lines.
pub fn for_terminal(text: &str, max: usize) -> String {
    let mut out = String::new();
    for (i, c) in text.chars().enumerate() {
        if i == max {
            out.push_str("...");
            break;
        }
        if c.is_control() {
            out.extend(c.escape_default());
        } else {
            out.push(c);
        }
    }
    out
}
