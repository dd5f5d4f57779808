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
