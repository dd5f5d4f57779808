//! Fuzzes the `iptables-save` parser: it must never panic, and whatever it accepts must print
//! back to text that parses to the same model; the simulator must not panic on it either.

#![no_main]

use libfuzzer_sys::fuzz_target;
use observer_rules::{Ipsets, Routes, Simulator, parse_packet_spec, parse_save};

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let Ok(file) = parse_save(text) else {
        return;
    };
    let printed = file.to_text(true);
    let again = parse_save(&printed).unwrap_or_else(|e| panic!("printed form does not parse: {e}\n{printed}"));
    assert_eq!(again, file, "round trip changed the model:\n{printed}");
    let empty = Default::default();
    let ipsets = Ipsets::default();
    let routes = Routes::default();
    let sim = Simulator::new(&file, &empty, &ipsets, &routes);
    for spec in [
        "tcp 10.0.0.1:1000 -> 10.0.0.2:22 in eth0 out eth1",
        "udp 10.0.0.1:53 -> 10.0.0.2:53 out eth0",
        "icmp 10.0.0.1 -> 10.0.0.2 in eth0 local state established",
    ] {
        let _ = sim.simulate(&parse_packet_spec(spec).expect("valid spec"));
    }
});
