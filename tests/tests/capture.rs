//! Privileged end-to-end tests of `observer tail` on the built-in lab: each test builds its
//! own lab (unique namespace prefix), attaches the observer to the lab's node, sends traffic
//! between the lab's namespaces only, and removes everything, even when an assertion fails.

use std::net::UdpSocket;
use std::time::Duration;

use observer_tests::lab::{
    Lab, TIMEOUT, Tail, first_dst, mark, stage, tcp_client, tcp_echo, traced_roundtrip,
};
use observer_tests::{privileged, run};

#[test]
fn clusterip_is_dnatted_marked_forwarded_and_masqueraded() {
    if !privileged("clusterip_is_dnatted_marked_forwarded_and_masqueraded") {
        return;
    }
    let lab = Lab::up("cip");
    let (reports, stderr) =
        traced_roundtrip(&lab, "pod", "172.17.0.5:22", "client", "10.10.10.2:22");
    let syn = reports
        .iter()
        .find(|r| {
            first_dst(r) == "10.10.10.2:22"
                && stage(r, "PREROUTING", "nat").is_some_and(|s| s["ct"]["state"] == "new")
        })
        .unwrap_or_else(|| panic!("no first packet to the ClusterIP in {reports:#?}\n{stderr}"));
    assert_eq!(syn["schema"], 3);
    assert_eq!(syn["source"], "observed");
    assert_eq!(syn["family"], "ipv4");
    assert_eq!(syn["proto"], "tcp");
    // Which packet: to the ClusterIP as it came, to the pod as it left.
    let packet = &syn["packet"];
    assert_eq!(
        (&packet["family"], &packet["proto"]),
        (&"ipv4".into(), &"tcp".into())
    );
    assert_eq!(
        (&packet["dst"], &packet["dport"]),
        (&"10.10.10.2".into(), &22.into())
    );
    assert_eq!(packet["last"]["dst"], "172.17.0.5", "{packet}");
    assert_eq!(packet["last"]["dport"], 22);
    assert_eq!(syn["ingress"]["iface"], "eth0");
    assert_eq!(
        syn["egress"]["iface"], "cali1a2b",
        "leaves through the pod's interface"
    );
    let nat = stage(syn, "PREROUTING", "nat").unwrap();
    assert_eq!(nat["before"]["dst"], "10.10.10.2:22");
    assert_eq!(
        nat["after"]["dst"], "172.17.0.5:22",
        "DNAT to the pod at PREROUTING/nat"
    );
    assert_eq!(mark(&nat["before"]) & 0x4000, 0);
    assert_eq!(
        mark(&nat["after"]) & 0x4000,
        0x4000,
        "KUBE-MARK-MASQ at PREROUTING/nat"
    );
    assert!(
        stage(syn, "FORWARD", "filter").is_some(),
        "forwarded, not delivered"
    );
    assert!(stage(syn, "INPUT", "filter").is_none());
    let snat = stage(syn, "POSTROUTING", "nat").unwrap();
    assert_eq!(snat["before"]["src"], syn["stages"][0]["before"]["src"]);
    assert_ne!(
        snat["after"]["src"], snat["before"]["src"],
        "MASQUERADE rewrote the source"
    );
    assert!(
        snat["after"]["src"]
            .as_str()
            .unwrap()
            .starts_with("169.254.1.1:")
    );
    assert!(
        syn["stages"]
            .as_array()
            .unwrap()
            .iter()
            .all(|s| s["verdict"] == "accept")
    );
    assert_eq!(syn["lost"], 0);
    assert!(
        stderr.contains("0 lost"),
        "summary reports no loss: {stderr}"
    );
}

#[test]
fn packets_from_cali_interfaces_get_the_raw_mark() {
    if !privileged("packets_from_cali_interfaces_get_the_raw_mark") {
        return;
    }
    let lab = Lab::up("raw");
    let tail = Tail::start(&lab);
    lab.run_in("pod2", || {
        let s = UdpSocket::bind("0.0.0.0:0").unwrap();
        s.send_to(b"hello", "203.0.113.10:9999").unwrap();
    });
    let (reports, stderr) = tail.stop();
    let r = reports
        .iter()
        .find(|r| {
            r["stages"][0]["before"]["src"]
                .as_str()
                .is_some_and(|s| s.starts_with("192.170.1.5:"))
        })
        .unwrap_or_else(|| panic!("no packet from pod2 in {reports:#?}\n{stderr}"));
    assert_eq!(r["ingress"]["iface"], "cali2c3d");
    let raw = stage(r, "PREROUTING", "raw").expect("raw stage");
    assert_eq!(mark(&raw["before"]) & 0x40000, 0);
    assert_eq!(
        mark(&raw["after"]) & 0x40000,
        0x40000,
        "cali-PREROUTING marks cali+ traffic"
    );
    let snat = stage(r, "POSTROUTING", "nat").expect("nat stage");
    assert!(
        snat["after"]["src"]
            .as_str()
            .unwrap()
            .starts_with("203.0.113.1:"),
        "cali-nat-outgoing masquerades to the node's address: {snat}"
    );
    assert_eq!(r["egress"]["iface"], "eth1");
}

struct Outcome {
    answers: Vec<Vec<u8>>,
    /// Every table's counters after the UDP phase (its packet count is deterministic).
    counters_after_udp: Vec<String>,
    conns: Vec<Result<Vec<u8>, String>>,
    /// nat counters after the TCP phase (nat counts connections, which is deterministic;
    /// TCP's packet count is not, so other tables are not compared after it).
    nat_after_tcp: Vec<String>,
}

/// UDP request/response through the kube-dns ClusterIP (2 packets each, a new conntrack
/// entry each), then TCP connections through the registry ClusterIP.
fn workload(lab: &Lab) -> Outcome {
    let dns = lab.serve("pod", |ready| {
        let s = UdpSocket::bind("172.17.0.5:53").unwrap();
        s.set_read_timeout(Some(TIMEOUT)).unwrap();
        ready.send(()).unwrap();
        let mut buf = [0u8; 64];
        for _ in 0..20 {
            let (n, from) = s.recv_from(&mut buf).unwrap();
            s.send_to(&buf[..n], from).unwrap();
        }
    });
    let answers = lab.run_in("client", || {
        (0..20)
            .map(|i| {
                // A port of its own for each query: an ephemeral port picked twice would make
                // one query part of an earlier connection (ESTABLISHED, not a new DNAT).
                let s = UdpSocket::bind(format!("0.0.0.0:{}", 41000 + i)).unwrap();
                s.set_read_timeout(Some(TIMEOUT)).unwrap();
                s.send_to(format!("query {i}").as_bytes(), "10.10.10.10:53")
                    .unwrap();
                let mut buf = [0u8; 64];
                let n = s.recv(&mut buf).unwrap();
                buf[..n].to_vec()
            })
            .collect::<Vec<_>>()
    });
    dns.join().unwrap();
    let counters_after_udp = lab.iptables_counters(None);
    let tcp = tcp_echo(lab, "pod", "172.17.0.5:22", 3);
    let conns = (0..3)
        .map(|_| tcp_client(lab, "client", "10.10.10.2:22"))
        .collect();
    tcp.join().unwrap();
    Outcome {
        answers,
        counters_after_udp,
        conns,
        nat_after_tcp: lab.iptables_counters(Some("nat")),
    }
}

#[test]
fn observing_changes_no_counter_and_no_result() {
    if !privileged("observing_changes_no_counter_and_no_result") {
        return;
    }
    let lab = Lab::up("same");
    lab.reset_counters();
    let without = workload(&lab);
    lab.reset_counters();
    let tail = Tail::start(&lab);
    let with = workload(&lab);
    let (reports, stderr) = tail.stop();

    assert_eq!(with.answers, without.answers);
    assert_eq!(with.answers.len(), 20);
    assert_eq!(with.conns, without.conns);
    assert!(with.conns.iter().all(|c| c.as_deref() == Ok(&b"ping"[..])));
    assert_eq!(
        with.counters_after_udp, without.counters_after_udp,
        "rule counters differ with the observer attached"
    );
    assert_eq!(with.nat_after_tcp, without.nat_after_tcp);
    assert!(
        with.counters_after_udp
            .iter()
            .any(|l| l.starts_with("[20:") && l.contains("KUBE-SEP-IT2ZTR26TO4XFPTO -p udp")),
        "the DNAT rule counted each of the 20 queries: {:#?}",
        with.counters_after_udp
    );
    let queries = reports
        .iter()
        .filter(|r| r["proto"] == "udp" && first_dst(r) == "10.10.10.10:53")
        .count();
    assert_eq!(queries, 20, "the observer saw every query: {stderr}");
}

#[test]
fn interfaces_that_appear_later_are_observed_at_tc() {
    if !privileged("interfaces_that_appear_later_are_observed_at_tc") {
        return;
    }
    let lab = Lab::up("late");
    let tail = Tail::start(&lab);
    let late = observer_tests::Netns::new(&lab.ns("late"));
    run(&[
        "ip",
        "link",
        "add",
        "late0",
        "netns",
        &lab.ns("node"),
        "type",
        "veth",
        "peer",
        "name",
        "eth0",
        "netns",
        &late.name,
    ]);
    run(&[
        "ip",
        "-n",
        &lab.ns("node"),
        "addr",
        "add",
        "192.0.2.1/24",
        "dev",
        "late0",
    ]);
    run(&["ip", "-n", &lab.ns("node"), "link", "set", "late0", "up"]);
    late.sh("ip addr add 192.0.2.2/24 dev eth0; ip link set eth0 up");
    // The observer looks for new interfaces every second.
    std::thread::sleep(Duration::from_millis(2500));
    late.run(|| {
        let s = UdpSocket::bind("192.0.2.2:0").unwrap();
        s.send_to(b"late", "192.0.2.1:9").unwrap();
    });
    let (reports, stderr) = tail.stop();
    let r = reports
        .iter()
        .find(|r| r["stages"][0]["before"]["dst"] == "192.0.2.1:9")
        .unwrap_or_else(|| panic!("no packet from the late interface: {reports:#?}\n{stderr}"));
    assert_eq!(
        r["ingress"]["iface"], "late0",
        "tcx attached to the new interface"
    );
    assert!(stage(r, "INPUT", "filter").is_some(), "delivered locally");
    assert!(stage(r, "FORWARD", "filter").is_none());
}

#[test]
fn count_and_timeout_end_the_tail_by_themselves() {
    if !privileged("count_and_timeout_end_the_tail_by_themselves") {
        return;
    }
    use std::process::{Command, Stdio};
    use std::time::Instant;
    let lab = Lab::up("cnt");
    let bin = observer_tests::lab::observer_bin();
    let ready = std::env::temp_dir().join(format!("{}-count-ready", lab.prefix));
    let _ = std::fs::remove_file(&ready);
    let child = Command::new(&bin)
        .args([
            "tail",
            "--json",
            "--count",
            "2",
            "--filter",
            "udp and dst port 9999",
        ])
        .args(["--netns", &lab.ns("node"), "--ready-file"])
        .arg(&ready)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let t0 = Instant::now();
    let scale = observer_tests::time_scale();
    while !ready.exists() {
        assert!(t0.elapsed() < Duration::from_secs(30) * scale, "not ready");
        std::thread::sleep(Duration::from_millis(20));
    }
    lab.run_in("client", || {
        for _ in 0..5 {
            let s = UdpSocket::bind("0.0.0.0:0").unwrap();
            s.send_to(b"count me", "198.51.100.1:9999").unwrap();
        }
    });
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let lines = String::from_utf8_lossy(&out.stdout).lines().count();
    assert_eq!(lines, 2, "--count 2 prints two traversals and exits");

    let t0 = Instant::now();
    let out = Command::new(&bin)
        .args(["tail", "--timeout", "1", "--netns", &lab.ns("node")])
        .output()
        .unwrap();
    assert!(out.status.success());
    assert!(
        t0.elapsed() < Duration::from_secs(20) * scale,
        "--timeout ends the run"
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("traversals printed"),
        "summary line on exit: {stderr}"
    );
}
