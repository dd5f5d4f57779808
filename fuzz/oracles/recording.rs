//! The recording reader and `observer replay`'s pipeline over any bytes, one for the fuzz
//! target (`fuzz_targets/recording_decoder.rs`) and its regression test
//! (`observer/tests/fuzz_regressions.rs`, over the corpus).

use std::collections::HashMap;
use std::path::PathBuf;

use observer::commands::replay::{ReplayOptions, replay};
use observer::output::recording::Reader;
use observer::pipeline::Output;

/// Replays `data` as the body of a recording of format 1 (no checksums: the header, context
/// and records reach the decoder unchecked) and of format 2; any bytes replay to reports or
/// stop with an error, never a panic. Returns how many of the two replayed whole.
pub fn replays(data: &[u8]) -> usize {
    let mut replayed = 0;
    for (format, output) in [(1u32, Output::Json), (2, Output::Tree)] {
        let mut file = b"OBSVREC\n".to_vec();
        file.extend_from_slice(&format.to_le_bytes());
        file.extend_from_slice(data);
        let Ok(reader) = Reader::new("fuzz", &file[..]) else {
            continue;
        };
        let opts = ReplayOptions {
            file: PathBuf::from("fuzz"),
            output,
            count: None,
            filter: None,
        };
        if replay(reader, &HashMap::new(), &opts, &mut std::io::sink()).is_ok() {
            replayed += 1;
        }
    }
    replayed
}
