//! Privileged tests of what a report explains, one per kind of flow on a Kubernetes node:
//! route, fate (with the kernel's drop reason), named mark changes, NAT and whether the nat
//! rules or conntrack did it. Each test builds its own lab and removes it.

use std::net::UdpSocket;

use observer_tests::lab::{
    Lab, TIMEOUT, Tail, drop_udp_port, first_dst, tcp_client, tcp_echo, traced_roundtrip, udp_sink,
};
use observer_tests::{privileged, run};
use serde_json::Value;

fn find<'a>(reports: &'a [Value], what: &str, f: impl Fn(&Value) -> bool) -> &'a Value {
    reports
        .iter()
        .find(|r| f(r))
        .unwrap_or_else(|| panic!("no report of {what} among {reports:#?}"))
}

fn first_src(r: &Value) -> &str {
    r["stages"][0]["before"]["src"].as_str().unwrap_or("")
}

fn has_mark(r: &Value, list: &str, bit: &str, name: &str, hook: &str, table: &str) -> bool {
    r["marks"][list].as_array().is_some_and(|v| {
        v.iter().any(|c| {
            c["bit"] == bit && c["name"] == name && c["hook"] == hook && c["table"] == table
        })
    })
}

fn nat<'a>(r: &'a Value, kind: &str, hook: &str) -> Option<&'a Value> {
    r["nat"]
        .as_array()?
        .iter()
        .find(|n| n["kind"] == kind && n["hook"] == hook)
}

#[test]
fn client_to_clusterip_is_explained() {
    if !privileged("client_to_clusterip_is_explained") {
        return;
    }
    let lab = Lab::up("f1");
    let (reports, _) = traced_roundtrip(&lab, "pod", "172.17.0.5:22", "client", "10.10.10.2:22");
    let syn = find(&reports, "the first packet to the ClusterIP", |r| {
        first_dst(r) == "10.10.10.2:22" && r["conntrack"]["state"] == "new"
    });
    assert_eq!(syn["route"], "forward");
    let dnat = nat(syn, "dnat", "PREROUTING").expect("DNAT at PREROUTING");
    assert_eq!(dnat["table"], "nat");
    assert_eq!(dnat["from"], "10.10.10.2:22");
    assert_eq!(dnat["to"], "172.17.0.5:22");
    assert_eq!(
        dnat["source"], "rules",
        "the first packet walks the nat chains"
    );
    assert!(
        has_mark(
            syn,
            "set",
            "0x4000",
            "kube-proxy:masquerade",
            "PREROUTING",
            "nat"
        ),
        "0x4000 set by nat PREROUTING: {}",
        syn["marks"]
    );
    let snat = nat(syn, "snat", "POSTROUTING").expect("masqueraded");
    assert_eq!(snat["source"], "rules");
    assert!(snat["to"].as_str().unwrap().starts_with("169.254.1.1:"));
    assert_eq!(syn["fate"]["kind"], "forwarded");
    assert_eq!(syn["egress"]["iface"], "cali1a2b");
    assert_eq!(syn["conntrack"]["original"]["dst"], "10.10.10.2:22");
    assert_eq!(syn["conntrack"]["reply"]["src"], "172.17.0.5:22");
    assert_eq!(syn["incomplete"], false);
}

#[test]
fn pod_in_the_pool_to_external_host_is_masqueraded_by_calico() {
    if !privileged("pod_in_the_pool_to_external_host_is_masqueraded_by_calico") {
        return;
    }
    let lab = Lab::up("f2");
    let tail = Tail::start(&lab);
    lab.run_in("pod2", || {
        let s = UdpSocket::bind("0.0.0.0:0").unwrap();
        s.send_to(b"out", "203.0.113.10:4000").unwrap();
    });
    let (reports, _) = tail.stop();
    let r = find(&reports, "pod2 -> external", |r| {
        first_src(r).starts_with("192.170.1.5:")
    });
    assert!(
        has_mark(r, "set", "0x40000", "calico:scratch0", "PREROUTING", "raw"),
        "0x40000 set at raw for cali+ traffic: {}",
        r["marks"]
    );
    let snat = nat(r, "snat", "POSTROUTING").expect("cali-nat-outgoing MASQUERADE");
    assert!(
        snat["to"].as_str().unwrap().starts_with("203.0.113.1:"),
        "{snat}"
    );
    assert_eq!(snat["source"], "rules");
    assert_eq!(r["fate"]["kind"], "forwarded");
    assert_eq!(r["egress"]["iface"], "eth1");
}

#[test]
fn packet_dropped_by_a_filter_forward_rule_names_table_and_reason() {
    if !privileged("packet_dropped_by_a_filter_forward_rule_names_table_and_reason") {
        return;
    }
    let lab = Lab::up("f3");
    drop_udp_port(&lab, 7777);
    let tail = Tail::start(&lab);
    lab.run_in("client", || {
        let s = UdpSocket::bind("0.0.0.0:0").unwrap();
        s.send_to(b"drop me", "172.17.0.5:7777").unwrap();
    });
    let (reports, _) = tail.stop();
    let r = find(&reports, "the dropped packet", |r| {
        first_dst(r) == "172.17.0.5:7777"
    });
    assert_eq!(r["fate"]["kind"], "dropped");
    assert_eq!(r["fate"]["hook"], "FORWARD");
    assert_eq!(r["fate"]["table"], "filter");
    assert_eq!(r["fate"]["reason"], "NETFILTER_DROP");
    let last = r["stages"].as_array().unwrap().last().unwrap();
    assert_eq!(
        (last["hook"].as_str(), last["table"].as_str()),
        (Some("FORWARD"), Some("filter"))
    );
    assert_eq!(last["verdict"], "drop");
    assert!(last["after"].is_null());
    assert!(r["egress"].is_null());
}

#[test]
fn node_local_process_to_clusterip_is_dnatted_at_output() {
    if !privileged("node_local_process_to_clusterip_is_dnatted_at_output") {
        return;
    }
    let lab = Lab::up("f4");
    let (reports, _) = traced_roundtrip(&lab, "pod", "172.17.0.5:22", "node", "10.10.10.2:22");
    let r = find(&reports, "node -> ClusterIP", |r| {
        first_dst(r) == "10.10.10.2:22" && r["route"] == "output"
    });
    assert_eq!(r["stages"][0]["hook"], "OUTPUT");
    let dnat = nat(r, "dnat", "OUTPUT").expect("DNAT at OUTPUT/nat");
    assert_eq!(dnat["table"], "nat");
    assert_eq!(dnat["to"], "172.17.0.5:22");
    assert!(r["ingress"].is_null(), "locally generated");
    assert_eq!(r["fate"]["kind"], "sent");
    assert_eq!(r["egress"]["iface"], "cali1a2b");
}

#[test]
fn later_packets_and_replies_use_conntrack_not_the_nat_rules() {
    if !privileged("later_packets_and_replies_use_conntrack_not_the_nat_rules") {
        return;
    }
    let lab = Lab::up("f5");
    let (reports, _) = traced_roundtrip(&lab, "pod", "172.17.0.5:22", "client", "10.10.10.2:22");
    let later = find(&reports, "a later packet of the connection", |r| {
        first_dst(r) == "10.10.10.2:22" && r["conntrack"]["state"] == "established"
    });
    let dnat = nat(later, "dnat", "PREROUTING").expect("stored DNAT applied");
    assert_eq!(dnat["source"], "conntrack");
    assert_eq!(dnat["to"], "172.17.0.5:22");
    assert_eq!(
        nat(later, "snat", "POSTROUTING").unwrap()["source"],
        "conntrack"
    );
    let reply = find(&reports, "a reply from the pod", |r| {
        first_src(r) == "172.17.0.5:22"
    });
    assert_eq!(reply["conntrack"]["state"], "established reply");
    let back = nat(reply, "dnat", "PREROUTING").expect("reply destination translated back");
    assert!(
        back["to"].as_str().unwrap().starts_with("198.51.100.10:"),
        "{back}"
    );
    assert_eq!(back["source"], "conntrack");
    let unsnat = nat(reply, "snat", "POSTROUTING").expect("reply source translated back");
    assert_eq!(unsnat["to"], "10.10.10.2:22");
    assert_eq!(reply["egress"]["iface"], "eth0");
}

/// What a report says of a packet's path, without what differs between two runs of the
/// same traffic (ports the client picks, times, packet ids).
fn path_of(r: &Value) -> String {
    let stages: Vec<String> = r["stages"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| {
            format!(
                "{} {} mark {}->{} len {}->{} ct {} {} {}",
                s["hook"],
                s["table"],
                s["before"]["mark"],
                s["after"]["mark"],
                s["before"]["len"],
                s["after"]["len"],
                s["ct"]["state"],
                s["ct"]["mark"],
                s["verdict"]
            )
        })
        .collect();
    let nat: Vec<String> = r["nat"]
        .as_array()
        .unwrap()
        .iter()
        .map(|n| format!("{} {} {} {}", n["kind"], n["hook"], n["table"], n["source"]))
        .collect();
    format!(
        "{} | {} | {} | {} | marks {} | nat {} | stages {} | incomplete {}",
        r["route"],
        r["fate"]["kind"],
        r["fate"]["hook"],
        r["conntrack"]["state"],
        r["marks"],
        nat.join("; "),
        stages.join("; "),
        r["incomplete"]
    )
}

/// The probes read conntrack entries and packets with plain loads where the kernel allows
/// it (Linux 6.16+) and take short ways between tables with what those loads give; with
/// `OBSERVER_DIRECT_READS=0` they read as on older kernels (`bpf_probe_read_kernel`, the
/// long way everywhere). Both must tell the same story of the same traffic: the seeds'
/// ClusterIP connection (DNAT, mark, masquerade; later packets and replies by conntrack),
/// also through a filter that only its translated address matches.
#[test]
fn direct_and_helper_reads_report_the_same_paths() {
    if !privileged("direct_and_helper_reads_report_the_same_paths") {
        return;
    }
    let lab = Lab::up("f9");
    let run = |extra: &[&str], env: &[(&str, &str)]| {
        let echo = tcp_echo(&lab, "pod", "172.17.0.5:22", 1);
        let tail = Tail::start_with_env(&lab, extra, env);
        assert_eq!(
            tcp_client(&lab, "client", "10.10.10.2:22").unwrap(),
            b"ping"
        );
        echo.join().unwrap();
        let (reports, _) = tail.stop();
        let mut paths: Vec<String> = reports
            .iter()
            .filter(|r| r["conntrack"]["original"]["dst"] == "10.10.10.2:22")
            .map(path_of)
            .collect();
        // Which side's last ACK closes the connection varies between runs: each kind of
        // path once.
        paths.sort();
        paths.dedup();
        paths
    };
    let helper_reads = [("OBSERVER_DIRECT_READS", "0")];
    let direct = run(&[], &[]);
    let helper = run(&[], &helper_reads);
    assert!(
        direct.len() >= 4,
        "a connection's packets both ways: {direct:#?}"
    );
    assert!(
        direct.iter().any(|p| p.contains("\"rules\""))
            && direct.iter().any(|p| p.contains("\"conntrack\"")),
        "the first packet by the nat rules, later ones by conntrack: {direct:#?}"
    );
    assert_eq!(direct, helper);
    // A filter on the pod's address: the client's packets to the ClusterIP are decided
    // again after conntrack (from the connection's tuples, loaded directly or not) and
    // kept, the same way both ways. (Not the first: at conntrack its entry holds no pod
    // address yet, the nat table picks one after.)
    let filter = ["--filter", "host 172.17.0.5"];
    let direct = run(&filter, &[]);
    assert!(
        direct.iter().any(|p| p.contains("| \"established\" |"))
            && direct
                .iter()
                .any(|p| p.contains("| \"established reply\" |")),
        "the filter keeps the connection's later packets both ways: {direct:#?}"
    );
    assert_eq!(direct, run(&filter, &helper_reads));
}

#[test]
fn traffic_to_the_node_itself_is_delivered() {
    if !privileged("traffic_to_the_node_itself_is_delivered") {
        return;
    }
    let lab = Lab::up("f6");
    let listener = udp_sink(&lab, "node", "198.51.100.1:5353");
    let tail = Tail::start(&lab);
    lab.run_in("client", || {
        let s = UdpSocket::bind("0.0.0.0:0").unwrap();
        s.send_to(b"hi node", "198.51.100.1:5353").unwrap();
    });
    listener.join().unwrap();
    let (reports, _) = tail.stop();
    let r = find(&reports, "client -> node", |r| {
        first_dst(r) == "198.51.100.1:5353"
    });
    assert_eq!(r["route"], "input");
    assert_eq!(r["fate"]["kind"], "delivered");
    assert_eq!(r["ingress"]["iface"], "eth0");
    assert!(
        r["stages"]
            .as_array()
            .unwrap()
            .iter()
            .any(|s| s["hook"] == "INPUT" && s["table"] == "filter")
    );
}

#[test]
fn ipv6_flow_through_ip6tables_rules() {
    if !privileged("ipv6_flow_through_ip6tables_rules") {
        return;
    }
    let lab = Lab::up("f7");
    let (reports, _) = traced_roundtrip(
        &lab,
        "pod",
        "[2001:db8:2::5]:22",
        "client",
        "[fd00:10::2]:22",
    );
    let syn = find(&reports, "the first IPv6 packet to the ClusterIP", |r| {
        first_dst(r) == "[fd00:10::2]:22" && r["conntrack"]["state"] == "new"
    });
    assert_eq!(syn["family"], "ipv6");
    let dnat = nat(syn, "dnat", "PREROUTING").expect("ip6tables DNAT");
    assert_eq!(dnat["to"], "[2001:db8:2::5]:22");
    assert_eq!(dnat["source"], "rules");
    assert!(has_mark(
        syn,
        "set",
        "0x4000",
        "kube-proxy:masquerade",
        "PREROUTING",
        "nat"
    ));
    assert_eq!(
        nat(syn, "snat", "POSTROUTING").expect("MASQUERADE")["to"]
            .as_str()
            .unwrap()
            .split("]:")
            .next(),
        Some("[2001:db8:2::1")
    );
    assert_eq!(syn["fate"]["kind"], "forwarded");
    assert_eq!(syn["egress"]["iface"], "cali1a2b");
}

/// `observer: N packets seen: P traversals printed (I incomplete), L lost ..., F filtered out, ...`
fn summary_number(stderr: &str, after_word: &str) -> u64 {
    let line = stderr
        .lines()
        .find(|l| l.starts_with("observer: "))
        .unwrap_or_else(|| panic!("no summary line in {stderr}"));
    let words: Vec<&str> = line.split_whitespace().collect();
    let i = words
        .windows(2)
        .position(|w| w[1].trim_end_matches(',') == after_word)
        .unwrap_or_else(|| panic!("no `{after_word}` in {line}"));
    words[i]
        .parse()
        .unwrap_or_else(|_| panic!("no number before `{after_word}` in {line}"))
}

#[test]
fn a_kernel_filter_leaves_other_flows_unrecorded() {
    if !privileged("a_kernel_filter_leaves_other_flows_unrecorded") {
        return;
    }
    let lab = Lab::up("f8");
    let server = tcp_echo(&lab, "pod", "172.17.0.5:22", 1);
    let tail = Tail::start_with(&lab, &["--filter", "udp and dst port 5353"]);
    // Bound once the probes are attached: its receive timeout must not run out while they
    // load (then the kernel rightly drops the datagram, NO_SOCKET).
    let listener = udp_sink(&lab, "node", "198.51.100.1:5353");
    // Excluded: a whole TCP connection through the ClusterIP.
    assert_eq!(
        tcp_client(&lab, "client", "10.10.10.2:22").unwrap(),
        b"ping"
    );
    server.join().unwrap();
    // Matching: one datagram to the node.
    lab.run_in("client", || {
        let s = UdpSocket::bind("0.0.0.0:0").unwrap();
        s.send_to(b"traced", "198.51.100.1:5353").unwrap();
    });
    listener.join().unwrap();
    let (reports, stderr) = tail.stop();
    assert!(
        reports.iter().all(|r| r["proto"] == "udp"),
        "only the matching flow is reported: {reports:#?}"
    );
    let traced = find(&reports, "the matching datagram", |r| {
        first_dst(r) == "198.51.100.1:5353"
    });
    assert_eq!(traced["fate"]["kind"], "delivered", "{traced}\n{stderr}");
    assert_eq!(
        traced["ingress"]["iface"], "eth0",
        "kept from its first probe on"
    );
    // The probes' own counters, in packets: the TCP connection's packets (handshake, data
    // both ways, teardown) were left out in the kernel, never written.
    let filtered = summary_number(&stderr, "filtered");
    let printed = summary_number(&stderr, "traversals");
    let seen = summary_number(&stderr, "packets");
    assert!(
        filtered >= 8,
        "the TCP flow was left out in the kernel: {stderr}"
    );
    assert!(
        printed < filtered,
        "fewer traversals printed than left out: {stderr}"
    );
    assert!(seen >= printed + filtered, "{stderr}");
}

#[test]
fn sampling_keeps_about_one_flow_in_n() {
    if !privileged("sampling_keeps_about_one_flow_in_n") {
        return;
    }
    let lab = Lab::up("f9");
    let tail = Tail::start_with(
        &lab,
        &["--filter", "udp and dst port 5353", "--sample", "4"],
    );
    // 64 flows (distinct source ports), one datagram each, to a closed port on the node.
    lab.run_in("client", || {
        for _ in 0..64 {
            let s = UdpSocket::bind("0.0.0.0:0").unwrap();
            s.send_to(b"sample me", "198.51.100.1:5353").unwrap();
        }
    });
    let (reports, stderr) = tail.stop();
    let kept = reports
        .iter()
        .filter(|r| first_dst(r) == "198.51.100.1:5353")
        .count();
    // Binomial(64, 1/4): mean 16; [4, 32] holds with probability > 0.9999.
    assert!(
        (4..=32).contains(&kept),
        "kept {kept} of 64 flows with --sample 4"
    );
    assert!(summary_number(&stderr, "sampled") > 0, "{stderr}");
    assert!(
        reports
            .iter()
            .filter(|r| first_dst(r) == "198.51.100.1:5353")
            .all(|r| r["ingress"]["iface"] == "eth0"),
        "kept flows are complete"
    );
}

#[test]
fn icmp_errors_show_the_quoted_packet_translated_back() {
    if !privileged("icmp_errors_show_the_quoted_packet_translated_back") {
        return;
    }
    let lab = Lab::up("fa");
    let tail = Tail::start(&lab);
    // Nothing listens on the pod's port 53: the pod answers port unreachable, quoting the
    // masqueraded and DNATed datagram; the node translates outer and quoted headers back.
    lab.run_in("client", || {
        let s = UdpSocket::bind("0.0.0.0:0").unwrap();
        s.send_to(b"anyone?", "10.10.10.10:53").unwrap();
    });
    let (reports, _) = tail.stop();
    let err = find(&reports, "the ICMP error", |r| {
        r["proto"] == "icmp" && first_src(r) == "172.17.0.5"
    });
    assert_eq!(err["conntrack"]["state"], "related reply");
    let nat_stage = err["stages"]
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["hook"] == "PREROUTING" && s["table"] == "nat")
        .expect("nat stage");
    assert!(
        nat_stage["before"]["inner"]["src"]
            .as_str()
            .unwrap()
            .starts_with("169.254.1.1:")
    );
    assert!(
        nat_stage["after"]["inner"]["src"]
            .as_str()
            .unwrap()
            .starts_with("198.51.100.10:")
    );
    let post = err["stages"]
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["hook"] == "POSTROUTING" && s["table"] == "nat")
        .expect("POSTROUTING nat stage");
    assert_eq!(post["before"]["inner"]["dst"], "172.17.0.5:53");
    assert_eq!(
        post["after"]["inner"]["dst"], "10.10.10.10:53",
        "quoted ClusterIP restored"
    );
    assert_eq!(
        post["after"]["src"], "10.10.10.10",
        "outer source restored too"
    );
    assert_eq!(err["fate"]["kind"], "forwarded");
    assert_eq!(err["egress"]["iface"], "eth0");
}

#[test]
fn fragments_are_followed_through_reassembly() {
    if !privileged("fragments_are_followed_through_reassembly") {
        return;
    }
    let lab = Lab::up("fb");
    let listener = lab.serve("node", |ready| {
        let s = UdpSocket::bind("198.51.100.1:7000").unwrap();
        s.set_read_timeout(Some(TIMEOUT)).unwrap();
        ready.send(()).unwrap();
        let mut buf = [0u8; 4096];
        assert_eq!(
            s.recv(&mut buf).unwrap(),
            3000,
            "reassembled datagram delivered"
        );
    });
    // Resolve the node's MAC first, so the fragments do not wait in the neighbour queue.
    lab.run_in("client", || {
        let s = UdpSocket::bind("0.0.0.0:0").unwrap();
        s.send_to(b"warm-up", "198.51.100.1:9").unwrap();
    });
    std::thread::sleep(std::time::Duration::from_millis(200));
    let tail = Tail::start(&lab);
    lab.run_in("client", || {
        // 3000 bytes over a 1500-byte MTU: three fragments.
        let s = UdpSocket::bind("0.0.0.0:0").unwrap();
        s.send_to(&[7u8; 3000], "198.51.100.1:7000").unwrap();
    });
    listener.join().unwrap();
    let (reports, stderr) = tail.stop();
    let merged: Vec<&Value> = reports
        .iter()
        .filter(|r| r["fate"]["kind"] == "reassembled")
        .collect();
    assert_eq!(
        merged.len(),
        2,
        "two fragments merged into the third: {stderr}"
    );
    assert!(
        merged
            .iter()
            .all(|r| r["fate"]["table"] == "defrag" && r["stages"].as_array().unwrap().is_empty())
    );
    let whole = find(&reports, "the reassembled datagram", |r| {
        r["conntrack"]["original"]["dst"] == "198.51.100.1:7000"
    });
    assert_eq!(whole["fate"]["kind"], "delivered");
    assert_eq!(whole["route"], "input");
    assert!(
        whole["nat"].as_array().unwrap().is_empty(),
        "reassembly is not NAT: {}",
        whole["nat"]
    );
}

#[test]
fn gso_aggregates_are_followed_as_one_packet() {
    if !privileged("gso_aggregates_are_followed_as_one_packet") {
        return;
    }
    use std::io::{Read, Write};
    let lab = Lab::up("fc");
    let sink = lab.serve("pod", |ready| {
        let l = std::net::TcpListener::bind("172.17.0.5:22").unwrap();
        ready.send(()).unwrap();
        let (mut s, _) = l.accept().unwrap();
        s.set_read_timeout(Some(TIMEOUT)).unwrap();
        let mut total = 0usize;
        let mut buf = vec![0u8; 65536];
        loop {
            match s.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => total += n,
                Err(e) => panic!("read: {e}"),
            }
        }
        s.write_all(&(total as u64).to_be_bytes()).unwrap();
    });
    let tail = Tail::start(&lab);
    let got = lab.run_in("client", || {
        let mut s =
            std::net::TcpStream::connect_timeout(&"10.10.10.2:22".parse().unwrap(), TIMEOUT)
                .unwrap();
        s.set_read_timeout(Some(TIMEOUT)).unwrap();
        s.write_all(&vec![1u8; 1 << 20]).unwrap();
        s.shutdown(std::net::Shutdown::Write).unwrap();
        let mut n = [0u8; 8];
        s.read_exact(&mut n).unwrap();
        u64::from_be_bytes(n)
    });
    sink.join().unwrap();
    assert_eq!(got, 1 << 20);
    let (reports, stderr) = tail.stop();
    // veth passes TSO/GSO skbs through: several MTUs of payload travel as one packet.
    let big = reports
        .iter()
        .filter(|r| first_dst(r) == "10.10.10.2:22")
        .filter(|r| r["stages"][0]["before"]["len"].as_u64().unwrap_or(0) > 1500)
        .collect::<Vec<_>>();
    assert!(
        !big.is_empty(),
        "no aggregate larger than the MTU seen: {stderr}"
    );
    for r in big {
        assert_eq!(
            r["fate"]["kind"], "forwarded",
            "an aggregate is followed to the end: {r}"
        );
        assert_eq!(r["egress"]["iface"], "cali1a2b");
        let stages = r["stages"].as_array().unwrap();
        let passed: Vec<String> = stages
            .iter()
            .map(|s| {
                format!(
                    "{}/{}",
                    s["hook"].as_str().unwrap(),
                    s["table"].as_str().unwrap()
                )
            })
            .collect();
        // Every table the lab node has on the forward path, in order (no mangle or security
        // table there: not bracketed).
        assert_eq!(
            passed,
            [
                "PREROUTING/raw",
                "PREROUTING/conntrack",
                "PREROUTING/nat",
                "FORWARD/filter",
                "POSTROUTING/nat"
            ],
            "every table passed: {r}"
        );
        assert!(
            stages
                .iter()
                .all(|s| s["before"]["len"] == stages[0]["before"]["len"])
        );
    }
}

#[test]
fn custom_nft_chains_are_bracketed_and_filters_still_follow_replies() {
    if !privileged("custom_nft_chains_are_bracketed_and_filters_still_follow_replies") {
        return;
    }
    let lab = Lab::up("fd");
    // A native nftables base chain between raw (-300) and conntrack (-200), setting a mark.
    run(&[
        "ip",
        "netns",
        "exec",
        &lab.ns("node"),
        "nft",
        "add table inet obstest; \
         add chain inet obstest pre { type filter hook prerouting priority -250; }; \
         add rule inet obstest pre tcp dport 22 meta mark set mark or 0x100",
    ]);
    let echo = tcp_echo(&lab, "pod", "172.17.0.5:22", 1);
    let tail = Tail::start_with(&lab, &["--filter", "host 10.10.10.2"]);
    assert_eq!(
        tcp_client(&lab, "client", "10.10.10.2:22").unwrap(),
        b"ping"
    );
    echo.join().unwrap();
    let (reports, stderr) = tail.stop();
    let syn = find(&reports, "the first packet", |r| {
        first_dst(r) == "10.10.10.2:22" && r["conntrack"]["state"] == "new"
    });
    let custom = syn["stages"]
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["table"] == "prio:-250")
        .unwrap_or_else(|| panic!("custom chain bracketed: {syn}"));
    assert_eq!(custom["priority"], -250);
    assert_eq!(custom["before"]["mark"], "0x0");
    assert_eq!(
        custom["after"]["mark"], "0x100",
        "the nft chain's mark is seen at its stage"
    );
    // Replies carry only the pod's address: kept through their conntrack entry, decided just
    // after conntrack even though the custom chain shifted the probe points.
    let reply = find(&reports, "a reply", |r| first_src(r) == "172.17.0.5:22");
    assert_eq!(reply["conntrack"]["state"], "established reply", "{stderr}");
}

#[test]
fn ipv6_extension_headers_are_walked_to_the_transport() {
    if !privileged("ipv6_extension_headers_are_walked_to_the_transport") {
        return;
    }
    use std::os::fd::AsRawFd;
    let lab = Lab::up("fe");
    let listener = udp_sink(&lab, "node", "[2001:db8:1::1]:5353");
    let tail = Tail::start(&lab);
    lab.run_in("client", || {
        let s = UdpSocket::bind("[::]:0").unwrap();
        // A hop-by-hop options header holding one PadN option: the transport header then
        // starts 8 bytes after the fixed IPv6 header.
        let hbh: [u8; 8] = [0, 0, 1, 4, 0, 0, 0, 0];
        // SAFETY: valid socket and option buffer of the given length.
        let rc = unsafe {
            libc::setsockopt(
                s.as_raw_fd(),
                libc::IPPROTO_IPV6,
                libc::IPV6_HOPOPTS,
                hbh.as_ptr().cast(),
                hbh.len() as libc::socklen_t,
            )
        };
        assert_eq!(rc, 0, "IPV6_HOPOPTS: {}", std::io::Error::last_os_error());
        s.send_to(b"with options", "[2001:db8:1::1]:5353").unwrap();
    });
    listener.join().unwrap();
    let (reports, stderr) = tail.stop();
    let r = find(&reports, "the datagram with a hop-by-hop header", |r| {
        first_dst(r) == "[2001:db8:1::1]:5353"
    });
    assert_eq!(r["proto"], "udp", "{stderr}");
    assert_eq!(r["fate"]["kind"], "delivered", "{r}");
}
