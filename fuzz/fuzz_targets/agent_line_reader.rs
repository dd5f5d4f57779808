//! Fuzzes `tail --agent`'s line reader: the input, cut into pieces where its first bytes say,
//! must give exactly the lines of the whole input (none longer than the maximum, which is an
//! error instead), whatever the cuts.

#![no_main]

use libfuzzer_sys::fuzz_target;

#[path = "../oracles/line_reader.rs"]
mod line_reader;

fuzz_target!(|data: &[u8]| {
    line_reader::check(data, &format!("{data:?}"));
});
