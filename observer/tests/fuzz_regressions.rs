//! Every input that ever crashed a fuzz target (`fuzz/regressions/<target>/`, copied there by
//! `cargo xtask fuzz`), and the targets' seeds, run through the same checks as the targets
//! (`fuzz/fuzz_targets/`), in the normal test suite: no panic, and the targets' assertions.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use observer::commands::replay::{ReplayOptions, replay};
use observer::output::recording::Reader;
use observer::pipeline::Output;
use observer_model::marks::MarkDictionary;
use observer_rules::{Ipsets, Routes, Simulator, parse_nft_json, parse_packet_spec, parse_save};

#[path = "../../fuzz/oracles/line_reader.rs"]
mod line_reader;

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
        let Some(Ok(nft)) = text(&data).map(parse_nft_json) else {
            continue;
        };
        let empty = Default::default();
        let ipsets = Ipsets::default();
        let routes = Routes::parse_json(&[
            r#"[{"dst":"default","gateway":"10.0.0.254","dev":"eth1","flags":[]},
                {"type":"local","dst":"10.0.0.2","dev":"eth0","table":"local","flags":[]}]"#,
        ])
        .unwrap();
        let sim = Simulator::new(&empty, &empty, &ipsets, &routes).with_nft(&nft);
        for spec in [
            "tcp 10.0.0.1:1000 -> 10.0.0.2:22 in eth0",
            "udp 10.0.0.1:53 -> 10.9.0.2:53 in eth0",
            "tcp 10.0.0.2:40000 -> 10.9.0.2:80",
            "icmp 10.0.0.1 -> 10.0.0.2 in eth0 local state established",
            "udp [2001:db8::1]:1 -> [2001:db8::2]:2 in eth0 out eth1",
        ] {
            let _ = sim.simulate(&parse_packet_spec(spec).unwrap());
        }
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
    let mut replayed = 0;
    for (_, data) in inputs("recording_decoder", "seeds-recording") {
        for (format, output) in [(1u32, Output::Json), (2, Output::Tree)] {
            let mut file = b"OBSVREC\n".to_vec();
            file.extend_from_slice(&format.to_le_bytes());
            file.extend_from_slice(&data);
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
    }
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
