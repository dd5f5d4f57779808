//! Every input that ever crashed a fuzz target (`fuzz/regressions/<target>/`, copied there by
//! `cargo xtask fuzz`), and the targets' seeds, run through the same checks as the targets
//! (`fuzz/fuzz_targets/`), in the normal test suite: no panic, and the targets' assertions.

use std::path::{Path, PathBuf};

use observer_model::marks::MarkDictionary;
use observer_rules::{Ipsets, Routes, Simulator, parse_packet_spec, parse_save};

#[path = "../../fuzz/oracles/line_reader.rs"]
mod line_reader;
#[path = "../../fuzz/oracles/nft.rs"]
mod nft;
#[path = "../../fuzz/oracles/recording.rs"]
mod recording;

fn fuzz_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../fuzz")
}

/// The inputs of `target`: its regressions and its seeds.
fn inputs(target: &str, seeds: &str) -> Vec<(PathBuf, Vec<u8>)> {
    let mut v = Vec::new();
    for dir in [
        fuzz_dir().join("regressions").join(target),
        fuzz_dir().join(seeds),
    ] {
        let Ok(rd) = std::fs::read_dir(&dir) else {
            continue;
        };
        for e in rd {
            let p = e.unwrap().path();
            let data = std::fs::read(&p).unwrap();
            v.push((p, data));
        }
    }
    v.sort();
    assert!(!v.is_empty(), "no seeds for {target} in fuzz/{seeds}");
    v
}

fn text(data: &[u8]) -> Option<&str> {
    std::str::from_utf8(data).ok()
}

#[test]
fn parse_iptables_save() {
    for (path, data) in inputs("parse_iptables_save", "seeds") {
        let Some(Ok(file)) = text(&data).map(parse_save) else {
            continue;
        };
        let printed = file.to_text(true);
        let again = parse_save(&printed)
            .unwrap_or_else(|e| panic!("{}: printed form does not parse: {e}", path.display()));
        assert_eq!(
            again,
            file,
            "{}: round trip changed the model",
            path.display()
        );
        let empty = Default::default();
        let (ipsets, routes) = (Ipsets::default(), Routes::default());
        let sim = Simulator::new(&file, &empty, &ipsets, &routes);
        for spec in [
            "tcp 10.0.0.1:1000 -> 10.0.0.2:22 in eth0 out eth1",
            "udp 10.0.0.1:53 -> 10.0.0.2:53 out eth0",
            "icmp 10.0.0.1 -> 10.0.0.2 in eth0 local state established",
        ] {
            let _ = sim.simulate(&parse_packet_spec(spec).unwrap());
        }
    }
}

#[test]
fn parse_nft_json_target() {
    for (_, data) in inputs("parse_nft_json", "seeds-nft") {
        nft::check(&data);
    }
}

#[test]
fn filter_parser() {
    for (path, data) in inputs("filter_parser", "seeds-filter") {
        let Some(t) = text(&data) else { continue };
        match observer::filter::compile(t, &|name| (name.len() < 16).then_some(7)) {
            Ok(p) => assert!(p.n_terms as usize <= observer_common::filter::MAX_TERMS),
            Err(e) => assert!(e.pos <= t.len(), "{}: {e:?}", path.display()),
        }
    }
}

#[test]
fn recording_decoder() {
    let replayed: usize = inputs("recording_decoder", "seeds-recording")
        .iter()
        .map(|(_, data)| recording::replays(data))
        .sum();
    assert!(replayed > 0, "the seed (the golden recording) replays");
}

#[test]
fn routes_and_marks() {
    for (_, data) in inputs("routes_and_marks", "seeds-routes") {
        let Some(t) = text(&data) else { continue };
        if let Ok(routes) = Routes::parse_json(&[t]) {
            for dst in [
                "10.0.0.2",
                "0.0.0.0",
                "255.255.255.255",
                "2001:db8::1",
                "::1",
            ] {
                let _ = routes.lookup(dst.parse().unwrap());
            }
        }
        let mut marks = MarkDictionary::default();
        if marks.apply_toml(t).is_ok() {
            let _ = marks.entries();
        }
    }
}

#[test]
fn agent_line_reader() {
    for (path, data) in inputs("agent_line_reader", "seeds-lines") {
        line_reader::check(&data, &path.display().to_string());
    }
}
