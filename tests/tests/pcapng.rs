//! Privileged: `tail --pcapng` on the lab's demo flows, read back with `tshark`: one packet
//! per printed traversal, each with its bytes and its one-line report as comment, on the
//! interface it entered, and the bytes are that traversal's packet (the addresses tshark
//! decodes from them are the ones the comment names).

use std::process::Command;

use observer_tests::lab::{Lab, Tail, observer_bin};
use observer_tests::{in_ci, privileged};

/// One packet as tshark decodes it.
#[derive(Debug)]
struct Packet {
    iface: String,
    len: u32,
    cap_len: u32,
    comment: String,
    /// `src -> dst` as the observer writes endpoints (ports only for TCP and UDP: those
    /// of an ICMP error are the quoted packet's).
    flow: String,
}

fn first(field: &str) -> &str {
    field.split(',').next().unwrap_or("")
}

fn tshark(file: &std::path::Path) -> Vec<Packet> {
    let out = Command::new("tshark")
        .arg("-r")
        .arg(file)
        .args(["-T", "fields", "-E", "separator=/t", "-E", "occurrence=f"])
        .args([
            "-e",
            "frame.interface_name",
            "-e",
            "frame.len",
            "-e",
            "frame.cap_len",
            "-e",
            "ip.src",
            "-e",
            "ip.dst",
            "-e",
            "ipv6.src",
            "-e",
            "ipv6.dst",
            "-e",
            "tcp.srcport",
            "-e",
            "tcp.dstport",
            "-e",
            "udp.srcport",
            "-e",
            "udp.dstport",
            "-e",
            "frame.comment",
        ])
        .output()
        .expect("run tshark");
    assert!(
        out.status.success(),
        "tshark cannot read the file: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| {
            let f: Vec<&str> = l.split('\t').collect();
            assert_eq!(f.len(), 12, "tshark line {l:?}");
            let v6 = f[3].is_empty();
            let (src, dst) = if v6 { (f[5], f[6]) } else { (f[3], f[4]) };
            let comment = f[11];
            let icmp = matches!(comment.split(' ').nth(1), Some("icmp" | "icmpv6"));
            let (sport, dport) = if icmp {
                ("", "")
            } else if !f[7].is_empty() {
                (f[7], f[8])
            } else {
                (f[9], f[10])
            };
            let ep = |a: &str, p: &str| match (v6, p.is_empty()) {
                (_, true) => first(a).to_string(),
                (false, false) => format!("{}:{}", first(a), first(p)),
                (true, false) => format!("[{}]:{}", first(a), first(p)),
            };
            Packet {
                iface: f[0].to_string(),
                len: f[1].parse().unwrap(),
                cap_len: f[2].parse().unwrap(),
                flow: format!("{} -> {}", ep(src, sport), ep(dst, dport)),
                comment: comment.to_string(),
            }
        })
        .collect()
}

#[test]
fn pcapng_holds_every_printed_packet_with_its_report() {
    if !privileged("pcapng_holds_every_printed_packet_with_its_report") {
        return;
    }
    if Command::new("tshark").arg("--version").output().is_err() {
        let msg = "pcapng_holds_every_printed_packet_with_its_report: needs tshark \
                   (`cargo xtask setup` installs it)";
        assert!(
            !in_ci(),
            "{msg}; CI=true, so this test fails instead of skipping"
        );
        eprintln!("\n!!!!!!!! SKIPPED {msg} !!!!!!!!\n");
        return;
    }
    let lab = Lab::up("pc");
    let dir = std::env::temp_dir().join(format!("{}-pcap", lab.prefix));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("lab.pcapng");
    let tail = Tail::start_with(&lab, &["--pcapng", file.to_str().unwrap()]);
    let sent = Command::new(observer_bin())
        .args(["lab", "traffic", "--prefix", &lab.prefix])
        .output()
        .expect("lab traffic");
    assert!(sent.status.success());
    let (reports, stderr) = tail.stop();
    let packets = tshark(&file);
    let _ = std::fs::remove_dir_all(&dir);

    assert!(reports.len() >= 5, "{reports:#?}");
    assert_eq!(
        packets.len(),
        reports.len(),
        "one packet per printed traversal: {packets:#?}"
    );
    assert!(
        stderr.contains(&format!("{} packets in the pcap-ng file", reports.len())),
        "{stderr}"
    );
    assert!(
        !stderr.contains("without their bytes") && !stderr.contains("bytes lost"),
        "at this rate no packet's bytes are lost: {stderr}"
    );
    for p in &packets {
        assert!(
            p.cap_len > 0 && p.cap_len <= 128 && p.cap_len <= p.len,
            "{p:?}"
        );
        // The comment is the traversal's line: it starts with the packet as first seen,
        // which is what the bytes (taken there) say.
        assert!(
            p.comment.starts_with("ipv4 ") || p.comment.starts_with("ipv6 "),
            "{p:?}"
        );
        assert!(
            p.comment.contains(&format!("{} [", p.flow)),
            "the bytes are the traversal's packet: {p:?}"
        );
        // On the interface it entered by (or left by, for packets this host sent).
        let entered = p.comment.split(" [").nth(1).unwrap_or("");
        let (inp, out) = entered.split_once(" -> ").unwrap_or(("", ""));
        let out = out.split(']').next().unwrap_or("");
        if inp != "-" {
            assert_eq!(p.iface, inp, "{p:?}");
        } else if out != "-" && p.comment.contains("] output") {
            assert_eq!(p.iface, out, "{p:?}");
        }
    }
    // Every report has its packet: the flows of the reports and of the comments agree.
    for r in &reports {
        let Some(before) = r["stages"][0]["before"].as_object() else {
            continue;
        };
        let flow = format!(
            "{} -> {}",
            before["src"].as_str().unwrap(),
            before["dst"].as_str().unwrap()
        );
        assert!(
            packets.iter().any(|p| p.comment.contains(&flow)),
            "no packet for the report of {flow}"
        );
    }
    // The lab's demo flows are in it: the ClusterIP connection and the external one.
    assert!(packets.iter().any(|p| p.flow.ends_with("-> 10.10.10.2:22")));
    assert!(packets.iter().any(|p| p.iface == "eth0"));
}

#[test]
fn under_a_flood_every_packet_is_in_the_file_or_counted() {
    if !privileged("under_a_flood_every_packet_is_in_the_file_or_counted") {
        return;
    }
    if Command::new("tshark").arg("--version").output().is_err() {
        assert!(!in_ci(), "tshark is missing; CI=true, so this test fails");
        eprintln!("\n!!!!!!!! SKIPPED under_a_flood...: needs tshark !!!!!!!!\n");
        return;
    }
    use std::io::Read;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::time::{Duration, Instant};

    let lab = Lab::up("pf");
    let dir = std::env::temp_dir().join(format!("{}-pcap", lab.prefix));
    std::fs::create_dir_all(&dir).unwrap();
    let (file, stats, ready) = (
        dir.join("flood.pcapng"),
        dir.join("stats.json"),
        dir.join("ready"),
    );
    let mut child = Command::new(observer_bin())
        .args(["tail", "--output", "line", "--netns", &lab.ns("node")])
        .arg("--pcapng")
        .arg(&file)
        .arg("--stats")
        .arg(&stats)
        .arg("--ready-file")
        .arg(&ready)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
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
    let stop = Arc::new(AtomicBool::new(false));
    let flood = {
        let stop = stop.clone();
        let path = lab.ns_path("client");
        std::thread::spawn(move || {
            observer_tests::enter_netns(&path);
            let s = std::net::UdpSocket::bind("0.0.0.0:0").unwrap();
            let t0 = Instant::now();
            while !stop.load(Ordering::Relaxed) && t0.elapsed() < Duration::from_secs(8) {
                let _ = s.send_to(&[0u8; 64], "172.17.0.5:9999");
            }
        })
    };
    std::thread::sleep(Duration::from_millis(1500));
    observer_tests::run(&["kill", "-INT", &child.id().to_string()]);
    let status = child.wait().unwrap();
    stop.store(true, Ordering::Relaxed);
    flood.join().unwrap();
    let lines = reader.join().unwrap();
    assert!(status.success());
    let s: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&stats).unwrap()).unwrap();
    let packets = tshark(&file);
    let _ = std::fs::remove_dir_all(&dir);
    let n = |k: &str| s[k].as_u64().unwrap();
    let p = |k: &str| s["pcapng"][k].as_u64().unwrap();
    eprintln!(
        "flood with --pcapng: {s}; {} packets in the file",
        packets.len()
    );
    assert!(n("printed") > 1000, "a flood was printed: {s}");
    assert_eq!(
        p("packets"),
        packets.len() as u64,
        "the file holds what it says"
    );
    assert_eq!(p("failed"), 0);
    // Every traversal formatted for stdout is in the file: those printed, and those
    // formatted but not taken by stdout's reader in time at exit (counted as not printed).
    assert!(
        p("packets") >= n("printed") && p("packets") <= n("printed") + n("not_printed"),
        "{s}"
    );
    assert!(String::from_utf8_lossy(&lines).lines().count() as u64 >= n("printed"));
    // A packet without its bytes is in the file all the same, flagged, and counted.
    let flagged = packets
        .iter()
        .filter(|p| p.comment.starts_with("[packet bytes lost"))
        .count() as u64;
    assert_eq!(flagged, p("without_bytes"), "{s}");
    assert!(
        packets
            .iter()
            .filter(|p| !p.comment.starts_with("[packet bytes lost"))
            .all(|p| p.cap_len > 0),
        "the others have their bytes"
    );
}
