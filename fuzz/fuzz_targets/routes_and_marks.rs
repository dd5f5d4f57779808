//! Fuzzes the readers of `--routes` (`ip -j route` JSON) and `--marks` (TOML): any text must
//! give routes / names or an error, never a panic; routes that parse must answer lookups.

#![no_main]

use libfuzzer_sys::fuzz_target;
use observer_model::marks::MarkDictionary;
use observer_rules::Routes;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    if let Ok(routes) = Routes::parse_json(&[text]) {
        for dst in ["10.0.0.2", "0.0.0.0", "255.255.255.255", "2001:db8::1", "::1"] {
            let _ = routes.lookup(dst.parse().expect("valid"));
        }
    }
    let mut marks = MarkDictionary::default();
    if marks.apply_toml(text).is_ok() {
        let _ = marks.entries();
    }
});
