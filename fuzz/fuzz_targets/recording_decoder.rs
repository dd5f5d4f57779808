//! Fuzzes the recording reader and `observer replay`'s pipeline over what it reads: any
//! bytes must replay to reports or stop with an error, never a panic. The checksums turn
//! away nearly every random input, so the target also reads the input as frames without
//! them (format 1), where the header, context and records reach the decoder unchecked.

#![no_main]

use std::collections::HashMap;
use std::path::PathBuf;

use libfuzzer_sys::fuzz_target;
use observer::commands::replay::{ReplayOptions, replay};
use observer::output::recording::Reader;
use observer::pipeline::Output;

fuzz_target!(|data: &[u8]| {
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
        let _ = replay(reader, &HashMap::new(), &opts, &mut std::io::sink());
    }
});
