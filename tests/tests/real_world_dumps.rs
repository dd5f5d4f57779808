//! The real-world corpus (`observer-rules/tests/corpus/`) judged by iptables-restore itself:
//! each dump is fed to `iptables-restore --test` (`ip6tables-restore` for `.v6` files), nft
//! and legacy back ends, in a namespace this test creates and that holds the corpus's ipsets.
//! The verdict must be the one `expected.txt` records (the unprivileged test
//! `observer-rules/tests/corpus.rs` holds the parser to the same file), and the parser's
//! must equal it. "Rejected" means rejected by either back end, as in `broken_dumps.rs`.

use std::path::PathBuf;
use std::process::Command;

use observer_rules::{Family, parse_save_family};
use observer_tests::{Netns, in_ci, privileged, unique_prefix};

fn corpus() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../observer-rules/tests/corpus")
}

/// Runs `cmd` in the namespace with `input` on stdin: Ok, or Err with its first stderr line.
fn run_in(ns: &Netns, cmd: &[&str], input: &str) -> Result<(), String> {
    observer_tests::run_in_with_stdin(ns, cmd, input)
        .map_err(|e| e.lines().next().unwrap_or("failed").to_string())
}

/// The restore tools compared with; missing ones fail under CI, skip loudly elsewhere.
fn tools_present() -> bool {
    let tools = [
        "iptables-restore",
        "iptables-legacy-restore",
        "ip6tables-restore",
        "ip6tables-legacy-restore",
        "ipset",
    ];
    let missing: Vec<&str> = tools
        .into_iter()
        .filter(|t| Command::new(t).arg("--version").output().is_err())
        .collect();
    if missing.is_empty() {
        return true;
    }
    let msg = format!(
        "real_world_dumps: needs {} (apt-get install -y iptables ipset)",
        missing.join(", ")
    );
    if in_ci() {
        panic!("{msg}; CI=true, so this privileged test fails instead of skipping");
    }
    eprintln!("\n!!!!!!!! SKIPPED {msg} !!!!!!!!\n");
    false
}

#[test]
fn iptables_restore_agrees_with_the_recorded_verdicts_and_the_parser() {
    if !privileged("real_world_dumps") || !tools_present() {
        return;
    }
    let dir = corpus();
    let read = |name: &str| {
        std::fs::read_to_string(dir.join(name))
            .unwrap_or_else(|e| panic!("cannot read {name}: {e}"))
    };
    let ns = Netns::new(&unique_prefix("orwd"));
    for e in std::fs::read_dir(&dir).unwrap() {
        let name = e.unwrap().file_name().to_string_lossy().into_owned();
        if name.ends_with(".ipsets") {
            run_in(&ns, &["ipset", "restore"], &read(&name))
                .unwrap_or_else(|e| panic!("{name}: ipset restore: {e}"));
        }
    }
    let mut checked = 0;
    let mut wrong = Vec::new();
    for line in read("expected.txt").lines() {
        let line = line.split('#').next().unwrap_or("").trim();
        let mut words = line.split_whitespace();
        let (Some(file), Some(verdict)) = (words.next(), words.next()) else {
            continue;
        };
        let (family, nft, legacy) = if file.ends_with(".v6.rules") {
            (
                Family::Ipv6,
                "ip6tables-restore",
                "ip6tables-legacy-restore",
            )
        } else {
            (Family::Ipv4, "iptables-restore", "iptables-legacy-restore")
        };
        let text = read(file);
        let by_nft = run_in(&ns, &[nft, "-w", "--test"], &text);
        let by_legacy = run_in(&ns, &[legacy, "-w", "--test"], &text);
        let restore = if by_nft.is_ok() && by_legacy.is_ok() {
            "accept"
        } else {
            "reject"
        };
        let ours = match parse_save_family(&text, family) {
            Ok(_) => "accept",
            Err(_) => "reject",
        };
        checked += 1;
        if restore != verdict || ours != verdict {
            wrong.push(format!(
                "{file}: recorded {verdict}, iptables-restore {restore} (nft: {}; legacy: {}), parser {ours}",
                by_nft.err().unwrap_or_else(|| "ok".into()),
                by_legacy.err().unwrap_or_else(|| "ok".into()),
            ));
        }
    }
    eprintln!("{checked} real-world dumps checked against iptables-restore");
    assert!(checked >= 20, "only {checked} dumps listed in expected.txt");
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}
