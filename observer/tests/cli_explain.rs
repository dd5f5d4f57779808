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

/// A packet to 127.0.0.1 from outside: in file mode the kernel's default route_localnet (0)
/// is assumed and said, `--sysctl` overrides it, and a sysctl that is not modelled is
/// refused saying which is.
#[test]
fn a_loopback_destination_from_outside_follows_route_localnet() {
    let dir = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../observer-rules/tests/corpus"
    );
    let explain = |extra: &[&str]| {
        let out = Command::new(env!("CARGO_BIN_EXE_observer"))
            .args(["explain", "--ruleset", &format!("{dir}/ufw.v4.rules")])
            .args(["--routes", &format!("{dir}/node-routes.v4.json")])
            .args([
                "--packet",
                "tcp 198.51.100.12:40000 -> 127.0.0.1:22 in eth0",
            ])
            .args(extra)
            .output()
            .expect("observer runs");
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let (ok, out, err) = explain(&[]);
    assert!(ok, "{err}");
    assert!(
        out.contains("route unroutable")
            && out.contains("martian destination 127.0.0.1")
            && out.contains("the kernel's default, assumed")
            && out.contains("--sysctl net.ipv4.conf.all.route_localnet=1"),
        "{out}"
    );
    let (ok, out, err) = explain(&["--sysctl", "net.ipv4.conf.eth0.route_localnet=1"]);
    assert!(ok, "{err}");
    assert!(
        out.contains("route input") && !out.contains("martian"),
        "{out}"
    );
    let (ok, _, err) = explain(&["--sysctl", "net.ipv4.ip_forward=0"]);
    assert!(!ok);
    assert!(
        err.contains("net.ipv4.conf.<all|IFACE>.route_localnet"),
        "{err}"
    );
}
