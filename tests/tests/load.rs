//! The observer under load and at its edges (each test in a lab of its own): a bounded UDP
//! flood through the node where every packet is accounted for and every printed traversal
//! is whole or flagged, SIGINT answered promptly with the summary, memory bounded; and the
//! command line's edge values.

use std::io::Read;
use std::net::UdpSocket;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use observer_tests::lab::{Lab, observer_bin};
use observer_tests::{privileged, run};
use serde_json::Value;

/// `rx_packets` of `iface` in namespace `ns`.
fn rx_packets(ns: &str, iface: &str) -> u64 {
    let out = run(&[
        "ip",
        "netns",
        "exec",
        ns,
        "cat",
        &format!("/sys/class/net/{iface}/statistics/rx_packets"),
    ]);
    String::from_utf8_lossy(&out.stdout).trim().parse().unwrap()
}

/// Starts `observer tail` with `args` on the lab's node; returns it once ready, with a
/// thread collecting its stdout.
fn start(lab: &Lab, args: &[&str]) -> (std::process::Child, std::thread::JoinHandle<Vec<u8>>) {
    let ready = std::env::temp_dir().join(format!("{}-load-ready", lab.prefix));
    let _ = std::fs::remove_file(&ready);
    let mut child = Command::new(observer_bin())
        .args(["tail", "--netns", &lab.ns("node"), "--ready-file"])
        .arg(&ready)
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut out = child.stdout.take().unwrap();
    let reader = std::thread::spawn(move || {
        let mut buf = Vec::new();
        let _ = out.read_to_end(&mut buf);
        buf
    });
    let t0 = Instant::now();
    while !ready.exists() {
        assert!(child.try_wait().unwrap().is_none(), "observer exited early");
        assert!(t0.elapsed() < Duration::from_secs(60), "observer not ready");
        std::thread::sleep(Duration::from_millis(20));
    }
    (child, reader)
}

/// Peak resident memory of `pid` in KiB (`VmHWM`).
fn peak_rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .unwrap()
}

#[test]
fn a_flood_is_accounted_for_in_packets_and_sigint_is_prompt() {
    if !privileged("a_flood_is_accounted_for_in_packets_and_sigint_is_prompt") {
        return;
    }
    let lab = Lab::up("ld");
    let stats = std::env::temp_dir().join(format!("{}-stats.json", lab.prefix));
    let (child, reader) = start(&lab, &["--json", "--stats", stats.to_str().unwrap()]);
    let rx_before = rx_packets(&lab.ns("node"), "eth0");
    let rx_before_all: u64 = ["eth0", "eth1", "cali1a2b", "cali2c3d"]
        .iter()
        .map(|i| rx_packets(&lab.ns("node"), i))
        .sum();
    // A bounded flood: 64-byte datagrams client -> pod (forwarded by the node) for 2 s,
    // then SIGINT while it still runs.
    let stop = Arc::new(AtomicBool::new(false));
    let flood = {
        let stop = stop.clone();
        let path = lab.ns_path("client");
        std::thread::spawn(move || {
            observer_tests::enter_netns(&path);
            let s = UdpSocket::bind("0.0.0.0:0").unwrap();
            let t0 = Instant::now();
            let mut sent = 0u64;
            while !stop.load(Ordering::Relaxed) && t0.elapsed() < Duration::from_secs(8) {
                if s.send_to(&[0u8; 64], "172.17.0.5:9999").is_ok() {
                    sent += 1;
                }
            }
            sent
        })
    };
    std::thread::sleep(Duration::from_secs(2));
    let rss_kib = peak_rss_kib(child.id());
    let t_int = Instant::now();
    run(&["kill", "-INT", &child.id().to_string()]);
    let out = child.wait_with_output().unwrap();
    let exit_after = t_int.elapsed();
    stop.store(true, Ordering::Relaxed);
    let sent = flood.join().unwrap();
    // Packets that reached the node after the observer stopped are not its to count.
    let rx = rx_packets(&lab.ns("node"), "eth0") - rx_before;
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    eprintln!(
        "flood: SIGINT to exit {exit_after:?}, peak RSS {rss_kib} KiB, sent {sent}, node eth0 received {rx}"
    );
    assert!(out.status.success(), "{stderr}");
    // A bound that holds on a loaded 2-core machine; the tight figure (target 200 ms, on
    // a quiet one) is `cargo xtask bench`'s.
    assert!(
        exit_after < Duration::from_secs(1),
        "SIGINT during the flood took {exit_after:?}: {stderr}"
    );
    assert!(
        stderr.contains("stopped by SIGINT"),
        "summary printed: {stderr}"
    );
    assert!(rss_kib < 128 * 1024, "peak RSS {rss_kib} KiB");
    let s: Value = serde_json::from_str(&std::fs::read_to_string(&stats).unwrap()).unwrap();
    let n = |k: &str| s[k].as_u64().unwrap();
    let seen = n("seen");
    assert!(seen > 1000, "a flood was seen: {s} (sent {sent})");
    assert_eq!(
        seen,
        n("printed")
            + n("lost")
            + n("filtered")
            + n("sampled")
            + n("in_flight")
            + n("in_flight_left_out")
            + n("not_printed"),
        "every packet seen is accounted for: {s}"
    );
    // Every IP packet the node received before SIGINT entered the probes: never more than
    // arrived on its interfaces (the pod's few rate-limited ICMP errors come in on cali1a2b;
    // the node's own IPv6 announcements are a handful), and most of what arrived on eth0
    // (ARP and the packets after the stop are the difference).
    let all_rx: u64 = ["eth0", "eth1", "cali1a2b", "cali2c3d"]
        .iter()
        .map(|i| rx_packets(&lab.ns("node"), i))
        .sum::<u64>()
        - rx_before_all;
    assert!(
        seen <= all_rx + 20,
        "seen {seen} <= received {all_rx} (+20 of its own): {s}"
    );
    assert!(
        rx.saturating_sub(seen) < rx / 2 + 100,
        "most of what arrived was seen: {rx} vs {s}"
    );
    // Every printed traversal is whole, or says it is not.
    let text = String::from_utf8(reader.join().unwrap()).unwrap();
    let mut printed = 0u64;
    for line in text.lines() {
        let r: Value = serde_json::from_str(line).unwrap_or_else(|e| panic!("{e}: {line}"));
        printed += 1;
        if r["incomplete"] == true {
            assert!(r["incomplete_reason"].is_string(), "{r}");
            continue;
        }
        match r["fate"]["kind"].as_str().unwrap() {
            "forwarded" => {
                let stages = r["stages"].as_array().unwrap();
                for (hook, table) in [
                    ("PREROUTING", "raw"),
                    ("FORWARD", "filter"),
                    ("POSTROUTING", "nat"),
                ] {
                    assert!(
                        stages
                            .iter()
                            .any(|s| s["hook"] == hook && s["table"] == table),
                        "a complete forwarded traversal passed {hook}/{table}: {r}"
                    );
                }
                assert!(r["egress"]["iface"].is_string(), "{r}");
            }
            "dropped" => assert!(r["fate"]["reason"].is_string(), "{r}"),
            _ => {}
        }
    }
    assert_eq!(printed, n("printed") - count_after_eof(&stderr), "{s}");
}

/// Traversals the summary counts as printed but that went to a closed pipe: none here.
fn count_after_eof(_stderr: &str) -> u64 {
    0
}

#[test]
fn edge_values_on_the_command_line_are_errors_or_work() {
    if !privileged("edge_values_on_the_command_line_are_errors_or_work") {
        return;
    }
    for bad in ["-1", "NaN", "inf", "1e30", "soon"] {
        let out = Command::new(observer_bin())
            .args(["tail", &format!("--timeout={bad}")])
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "--timeout={bad}: {err}");
        assert!(err.contains("--timeout"), "names the flag: {err}");
        assert!(!err.contains("panicked"), "{err}");
    }
    let lab = Lab::up("cli");
    // --count 0: attach, then exit at once with the summary.
    let t0 = Instant::now();
    let out = Command::new(observer_bin())
        .args(["tail", "--netns", &lab.ns("node"), "--count", "0"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(err.contains("stopped by --count"), "{err}");
    assert!(t0.elapsed() < Duration::from_secs(30));
    // SIGHUP ends it cleanly, with the summary.
    let (child, _reader) = start(&lab, &["--json"]);
    run(&["kill", "-HUP", &child.id().to_string()]);
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(err.contains("stopped by SIGHUP"), "{err}");
    // A closed stdout (a pipe into `head -1`) ends it cleanly too, summary on stderr.
    let mut child = Command::new(observer_bin())
        .args([
            "tail",
            "--netns",
            &lab.ns("node"),
            "--output",
            "line",
            "--timeout",
            "30",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    drop(child.stdout.take());
    std::thread::sleep(Duration::from_secs(6));
    let path = lab.ns_path("client");
    std::thread::spawn(move || {
        observer_tests::enter_netns(&path);
        let s = UdpSocket::bind("0.0.0.0:0").unwrap();
        for _ in 0..20 {
            let _ = s.send_to(b"x", "198.51.100.1:9");
            std::thread::sleep(Duration::from_millis(50));
        }
    })
    .join()
    .unwrap();
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(err.contains("stopped by closed stdout"), "{err}");
    assert!(
        !err.contains("Broken pipe") && !err.contains("panicked"),
        "{err}"
    );
}
