//! Fuzzes the recording reader and `observer replay`'s pipeline over what it reads: any
//! bytes must replay to reports or stop with an error, never a panic. The checksums turn
//! away nearly every random input, so the target also reads the input as frames without
//! them (format 1), where the header, context and records reach the decoder unchecked.

#![no_main]

use libfuzzer_sys::fuzz_target;

#[path = "../oracles/recording.rs"]
mod recording;

fuzz_target!(|data: &[u8]| {
    recording::replays(data);
});
