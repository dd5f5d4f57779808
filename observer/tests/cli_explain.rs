//! `observer explain` as a user runs it: its output piped into a reader that stops early.

use std::process::{Command, Stdio};

#[test]
fn explain_into_a_closed_pipe_ends_quietly() {
    let rules = concat!(env!("CARGO_MANIFEST_DIR"), "/../lab/node.rules");
    let mut child = Command::new(env!("CARGO_BIN_EXE_observer"))
        .args([
            "explain",
            "--ruleset",
            rules,
            "--packet",
            "tcp 198.51.100.10:40000 -> 10.10.10.2:22 in eth0",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("observer runs");
    // The reader goes away before observer writes (`observer explain ... | head -0`).
    drop(child.stdout.take());
    let out = child.wait_with_output().expect("observer ends");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{:?}: {stderr}", out.status);
    assert!(!stderr.contains("panicked"), "{stderr}");
}
