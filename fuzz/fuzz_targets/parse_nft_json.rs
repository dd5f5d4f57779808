//! Fuzzes the `nft -j list ruleset` reader and the native nftables simulator: any input must
//! give a model or an error naming the place, never a panic; whatever parses must compile and
//! simulate without a panic for a few packet shapes.

#![no_main]

use libfuzzer_sys::fuzz_target;

#[path = "../oracles/nft.rs"]
mod nft;

fuzz_target!(|data: &[u8]| {
    nft::check(data);
});
