//! The `nft -j list ruleset` reader and the native nftables simulator over any input, one
//! for the fuzz target (`fuzz_targets/parse_nft_json.rs`) and its regression test
//! (`observer/tests/fuzz_regressions.rs`, over the corpus).

use observer_rules::{Ipsets, Routes, Simulator, parse_nft_json, parse_packet_spec};

/// Any input gives a model or an error naming the place, never a panic; whatever parses
/// must compile and simulate without a panic for a few packet shapes. True when the input
/// parsed (and was simulated).
pub fn check(data: &[u8]) -> bool {
    let Ok(text) = std::str::from_utf8(data) else {
        return false;
    };
    let Ok(nft) = parse_nft_json(text) else {
        return false;
    };
    let empty = Default::default();
    let ipsets = Ipsets::default();
    let routes = Routes::parse_json(&[
        r#"[{"dst":"default","gateway":"10.0.0.254","dev":"eth1","flags":[]},
            {"type":"local","dst":"10.0.0.2","dev":"eth0","table":"local","flags":[]}]"#,
    ])
    .expect("valid routes");
    let sim = Simulator::new(&empty, &empty, &ipsets, &routes).with_nft(&nft);
    for spec in [
        "tcp 10.0.0.1:1000 -> 10.0.0.2:22 in eth0",
        "udp 10.0.0.1:53 -> 10.9.0.2:53 in eth0",
        "tcp 10.0.0.2:40000 -> 10.9.0.2:80",
        "icmp 10.0.0.1 -> 10.0.0.2 in eth0 local state established",
        "udp [2001:db8::1]:1 -> [2001:db8::2]:2 in eth0 out eth1",
    ] {
        let _ = sim.simulate(&parse_packet_spec(spec).expect("valid spec"));
    }
    true
}
