//! Where reports go besides the renderers: stdout through its own writer thread
//! (backpressure, never blocking signals), recordings for `observer replay`, and pcap-ng.

pub mod pcapng;
pub mod recording;
pub mod window;
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

/// A file written through a buffer, that stops at its first failed write (`None` from then
/// on): the recording and the pcap-ng file.
type StoppingFile = Option<std::io::BufWriter<Box<dyn std::io::Write + Send>>>;

/// Hands what `out` buffered to the file; a write that fails stops it (`what` and `path`
/// name it in the warning).
fn flush_or_stop(out: &mut StoppingFile, what: &str, path: &std::path::Path) {
    use std::io::Write as _;
    if let Some(Err(e)) = out.as_mut().map(|o| o.flush()) {
        log::warn!(
            "writing {what} {} failed ({e}); it stops here",
            path.display()
        );
        *out = None;
    }
}

/// Flushes and closes `out`; false if what it buffered last could not be written.
fn finish_file(out: &mut StoppingFile, what: &str, path: &std::path::Path) -> bool {
    use std::io::Write as _;
    match out.take().map(|mut o| o.flush()) {
        Some(Err(e)) => {
            log::warn!("writing {what} {}: {e}", path.display());
            false
        }
        _ => true,
    }
}
