//! What every kernel of the matrix must do, whatever it lacks: `cargo xtask test` runs this
//! file on the host and in each guest of the kernel matrix (`xtask/src/matrix.rs`), with
//! `OBSERVER_KERNEL_CAPTURE` naming what that kernel is declared to support: `links` (BPF
//! netfilter links, 6.4+), `fentry` (no netfilter links: fentry/fexit trampolines, chosen
//! by themselves) or `none` (no capture backend runs there). The expectation is
//! the matrix's declaration, never read back from observer's own detection: a detection
//! that is wrong fails here.
//!
//! Where the per-table probes can attach, `capture.rs` and `fates.rs` say what they show;
//! here: that observer starts, says what is missing and what still works, and never
//! crash-loops.

use std::process::Command;
use std::time::{Duration, Instant};

use observer_tests::agent::{Agent, METRICS, baseline, http_get, sample, scrape, try_sample};
use observer_tests::lab::{Lab, observer_bin};
use observer_tests::privileged;

/// What the kernel is declared to support (the host: netfilter links).
fn capture() -> &'static str {
    match std::env::var("OBSERVER_KERNEL_CAPTURE").as_deref() {
        Ok("none") => "none",
        Ok("fentry") => "fentry",
        Ok("links") | Err(_) => "links",
        Ok(other) => panic!("OBSERVER_KERNEL_CAPTURE={other}: give links, fentry or none"),
    }
}

#[test]
fn tail_attaches_or_says_which_feature_the_kernel_lacks() {
    if !privileged("tail_attaches_or_says_which_feature_the_kernel_lacks") {
        return;
    }
    let lab = Lab::up("kt");
    let t0 = Instant::now();
    let out = Command::new(observer_bin())
        .args(["tail", "--netns", &lab.ns("node"), "--count", "0"])
        .output()
        .expect("run observer tail");
    let stderr = String::from_utf8_lossy(&out.stderr);
    match capture() {
        "links" => {
            assert!(out.status.success(), "tail attaches: {stderr}");
            assert!(
                stderr.contains("captured through netfilter links"),
                "the summary names the backend: {stderr}"
            );
        }
        "fentry" => {
            assert!(out.status.success(), "tail attaches: {stderr}");
            assert!(
                stderr.contains("captured through fentry trampolines"),
                "the summary names the backend: {stderr}"
            );
            // Netfilter links, asked for, say why they cannot run.
            let out = Command::new(observer_bin())
                .args(["tail", "--netns", &lab.ns("node"), "--count", "0"])
                .args(["--backend", "links"])
                .output()
                .expect("run observer tail --backend links");
            let stderr = String::from_utf8_lossy(&out.stderr);
            assert!(!out.status.success(), "links cannot capture here: {stderr}");
            assert!(
                stderr.contains("BPF netfilter links need Linux 6.4+"),
                "says which feature is missing: {stderr}"
            );
        }
        _ => {
            assert!(!out.status.success(), "nothing can be captured: {stderr}");
            assert!(
                stderr.contains("BPF netfilter links need Linux 6.4+"),
                "says which feature is missing: {stderr}"
            );
            assert!(
                t0.elapsed() < Duration::from_secs(300),
                "says it at start, took {:?}",
                t0.elapsed()
            );
        }
    }
}

#[test]
fn the_agent_gets_ready_counts_drops_and_says_what_it_cannot_do() {
    if !privileged("the_agent_gets_ready_counts_drops_and_says_what_it_cannot_do") {
        return;
    }
    let lab = Lab::up("ka");
    // A rule that drops what the test sends: tier 1 counts it by reason.
    lab.run_in("node", || {
        observer_tests::run(&[
            "iptables", "-I", "FORWARD", "-p", "udp", "--dport", "7799", "-j", "DROP",
        ])
    });
    // The default mode: no per-packet program.
    let agent = Agent::start_with(&lab, &["--rules-interval", "0.5"]);
    let (status, ready) = http_get(&lab, METRICS, "/readyz");
    assert_eq!(status, 200, "{ready}");
    let text = scrape(&lab);
    assert!(
        text.contains("observer_capture_backend{"),
        "the backend's series is there: {text}"
    );
    let label = if capture() == "none" {
        "links"
    } else {
        capture()
    };
    let backend = sample(&text, "observer_capture_backend", &[("backend", label)]);
    let reason = [
        ("tier", "1"),
        ("reason", "NETFILTER_DROP"),
        ("family", "ipv4"),
        ("protocol", "udp"),
    ];
    let before = baseline(&text, "observer_kernel_drops_total", &reason);
    const N: usize = 5;
    lab.run_in("client", || {
        let s = std::net::UdpSocket::bind("0.0.0.0:0").unwrap();
        for _ in 0..N {
            s.send_to(b"drop me", "172.17.0.5:7799").unwrap();
        }
    });
    observer_tests::wait_for("tier 1 to count the drops", Duration::from_secs(30), || {
        try_sample(&scrape(&lab), "observer_kernel_drops_total", &reason)
            .is_some_and(|v| v >= before + N as f64)
    });
    std::thread::sleep(Duration::from_millis(1500));
    let text = scrape(&lab);
    assert_eq!(
        sample(&text, "observer_kernel_drops_total", &reason),
        before + N as f64,
        "exactly the drops sent: {text}"
    );
    match capture() {
        "links" | "fentry" => {
            assert_eq!(backend, 1.0, "{text}");
            assert!(!ready.contains("degraded"), "{ready}");
        }
        _ => {
            assert_eq!(backend, 0.0, "the kernel refuses netfilter links: {text}");
            assert!(
                ready.contains("degraded: traversals unavailable")
                    && ready.contains("tier 1 (drops by reason) work"),
                "/readyz says what is missing and what works: {ready}"
            );
            // A stream of traversals is told why it cannot be served, at once.
            let out = Command::new(observer_bin())
                .arg("tail")
                .arg("--agent")
                .arg(&agent.socket)
                .args(["--count", "1", "--timeout", "60"])
                .output()
                .expect("run observer tail --agent");
            let stderr = String::from_utf8_lossy(&out.stderr);
            assert!(!out.status.success(), "{stderr}");
            assert!(
                stderr.contains("could not serve this stream")
                    && stderr.contains("BPF netfilter links need Linux 6.4+"),
                "{stderr}"
            );
        }
    }
    let (status, stderr, _) = agent.stop("TERM");
    assert!(status.success(), "the agent stops cleanly: {stderr}");
}
