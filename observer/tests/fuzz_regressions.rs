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

/// Each fuzz target (`fuzz/Cargo.toml`'s `[[bin]]`s) and its seed directory (the same pairs
/// as `xtask`'s `FUZZ_TARGETS`).
const TARGETS: &[(&str, &str)] = &[
    ("parse_iptables_save", "seeds"),
    ("parse_nft_json", "seeds-nft"),
    ("filter_parser", "seeds-filter"),
    ("recording_decoder", "seeds-recording"),
    ("routes_and_marks", "seeds-routes"),
    ("agent_line_reader", "seeds-lines"),
];

fn files(dir: &Path) -> Vec<(PathBuf, Vec<u8>)> {
    let mut v: Vec<_> = std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| {
            let p = e.unwrap().path();
            let data = std::fs::read(&p).unwrap();
            (p, data)
        })
        .collect();
    v.sort();
    v
}

/// The seeds of `target`: its seed directory must exist and hold at least one file.
fn seeds(target: &str) -> Vec<(PathBuf, Vec<u8>)> {
    let (_, dir) = TARGETS
        .iter()
        .find(|(t, _)| *t == target)
        .unwrap_or_else(|| panic!("{target} is not in TARGETS"));
    let dir = fuzz_dir().join(dir);
    assert!(
        dir.is_dir(),
        "{target}'s seed directory {} is missing: restore it (git checkout fuzz/)",
        dir.display()
    );
    let v = files(&dir);
    assert!(!v.is_empty(), "no seeds for {target} in {}", dir.display());
    v
}

/// The inputs that ever crashed `target` (`cargo xtask fuzz` copies them there); none
/// when it never crashed.
fn regressions(target: &str) -> Vec<(PathBuf, Vec<u8>)> {
    let dir = fuzz_dir().join("regressions").join(target);
    if dir.exists() {
        files(&dir)
    } else {
        Vec::new()
    }
}

/// Runs `check` (the target's oracle; true when the input got past the parser) over the
/// target's regressions and seeds: every seed must get past the parser (a seed that does
/// not is a fuzz run that starts from nothing: replace it), and so the target's own
/// checks run on at least one input.
fn run_target(target: &str, mut check: impl FnMut(&Path, &[u8]) -> bool) {
    for (path, data) in regressions(target) {
        check(&path, &data);
    }
    let seeds = seeds(target);
    let refused: Vec<String> = seeds
        .iter()
        .filter(|(path, data)| !check(path, data))
        .map(|(path, _)| path.display().to_string())
        .collect();
    assert!(
        refused.is_empty(),
        "{target}: these seeds do not parse, so the target's checks never ran on them; \
         fix or replace them: {refused:?}"
    );
}

#[test]
fn every_fuzz_target_has_its_seeds_checked_here() {
    let manifest = std::fs::read_to_string(fuzz_dir().join("Cargo.toml")).unwrap();
    let bins: Vec<&str> = manifest
        .split("[[bin]]")
        .skip(1)
        .filter_map(|b| {
            b.lines()
                .find_map(|l| l.trim().strip_prefix("name = "))
                .map(|n| n.trim_matches('"'))
        })
        .collect();
    let ours: Vec<&str> = TARGETS.iter().map(|(t, _)| *t).collect();
    assert_eq!(
        bins, ours,
        "fuzz/Cargo.toml's targets and this file's TARGETS differ: give every target its \
         seeds and a test here"
    );
    for (t, _) in TARGETS {
        assert!(!seeds(t).is_empty());
    }
}

fn text(data: &[u8]) -> Option<&str> {
    std::str::from_utf8(data).ok()
}

#[test]
fn parse_iptables_save() {
    run_target("parse_iptables_save", |path, data| {
        let Some(Ok(file)) = text(data).map(parse_save) else {
            return false;
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
        true
    });
}

#[test]
fn parse_nft_json_target() {
    run_target("parse_nft_json", |_, data| nft::check(data));
}

#[test]
fn filter_parser() {
    run_target("filter_parser", |path, data| {
        let Some(t) = text(data) else { return false };
        match observer::filter::compile(t, &|name| (name.len() < 16).then_some(7)) {
            Ok(p) => {
                assert!(p.n_terms as usize <= observer_common::filter::MAX_TERMS);
                true
            }
            Err(e) => {
                assert!(e.pos <= t.len(), "{}: {e:?}", path.display());
                false
            }
        }
    });
}

#[test]
fn recording_decoder() {
    run_target("recording_decoder", |_, data| recording::replays(data) > 0);
}

#[test]
fn routes_and_marks() {
    run_target("routes_and_marks", |_, data| {
        let Some(t) = text(data) else { return false };
        let mut parsed = false;
        if let Ok(routes) = Routes::parse_json(&[t]) {
            parsed = true;
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
            parsed = true;
            let _ = marks.entries();
        }
        parsed
    });
}

#[test]
fn agent_line_reader() {
    run_target("agent_line_reader", |path, data| {
        line_reader::check(data, &path.display().to_string()) > 0
    });
}
