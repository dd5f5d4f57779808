//! Privileged tests in the bridge lab (`observer lab up --mode bridge`): pods on the bridge
//! cni0 with br_netfilter on. Every flow there is observed whole, in order, with the bridge
//! and its ports, and judged by the kernel: the rules tail names equal the rule counters'
//! increments, the interfaces are the ones the packets used, and `--stats` accounts for
//! every packet seen.

use std::collections::BTreeMap;
use std::net::UdpSocket;
use std::time::Duration;

use observer_tests::agent::{Agent, Client, wait_until_tracing};
use observer_tests::lab::{Lab, Tail, tcp_client, tcp_echo, udp_sink};
use observer_tests::rules::{Counts, diff, increments, lab_counters, named};
use observer_tests::{privileged, run, time_scale};
use serde_json::Value;

const POD: &str = "10.244.0.5";
const POD_PORT: &str = "veth1a2b3c4d";
const POD2_PORT: &str = "veth2c3d4e5f";

fn src(r: &Value) -> &str {
    r["stages"][0]["before"]["src"].as_str().unwrap_or("")
}

fn dst(r: &Value) -> &str {
    r["stages"][0]["before"]["dst"].as_str().unwrap_or("")
}

/// The first packet (conntrack new) of the flow `from -> to`.
fn first<'a>(reports: &'a [Value], from: &str, to: &str) -> &'a Value {
    reports
        .iter()
        .find(|r| src(r).starts_with(from) && dst(r) == to && r["conntrack"]["state"] == "new")
        .unwrap_or_else(|| {
            panic!(
                "no first packet {from} -> {to} among:\n{}",
                summary(reports)
            )
        })
}

fn summary(reports: &[Value]) -> String {
    reports
        .iter()
        .map(|r| {
            format!(
                "{} {} -> {} route {} bridge {} fate {} incomplete {}",
                r["proto"],
                src(r),
                dst(r),
                r["route"],
                r["bridge"],
                r["fate"]["kind"],
                r["incomplete_reason"]
            )
        })
        .collect::<Vec<_>>()
        .join("\n")
}

fn bridge(r: &Value) -> (&str, &str, &str) {
    let b = &r["bridge"];
    (
        b["name"].as_str().unwrap_or("-"),
        b["physdev_in"].as_str().unwrap_or("-"),
        b["physdev_out"].as_str().unwrap_or("-"),
    )
}

fn nat<'a>(r: &'a Value, kind: &str) -> Option<&'a Value> {
    r["nat"].as_array()?.iter().find(|n| n["kind"] == kind)
}

fn hooks(r: &Value) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for s in r["stages"].as_array().into_iter().flatten() {
        let h = s["hook"].as_str().unwrap().to_string();
        if out.last() != Some(&h) {
            out.push(h);
        }
    }
    out
}

/// Each stage check that is not an agreement.
fn not_agreeing(reports: &[Value]) -> Vec<String> {
    let mut out = Vec::new();
    for r in reports {
        for s in r["stages"].as_array().into_iter().flatten() {
            if !s["check"].is_null() && s["check"]["result"] != "agrees" {
                out.push(format!(
                    "{} -> {} at {}/{}: {}",
                    src(r),
                    dst(r),
                    s["hook"],
                    s["table"],
                    s["check"]
                ));
            }
        }
    }
    out
}

fn udp_send(lab: &Lab, role: &str, to: &'static str) {
    lab.run_in(role, move || {
        let bind = if to.starts_with('[') {
            "[::]:0"
        } else {
            "0.0.0.0:0"
        };
        let s = UdpSocket::bind(bind).unwrap();
        s.send_to(b"bridge lab", to).unwrap();
    });
}

/// The bridge learns both pods' MACs (a flood would send clones, other packets, back out
/// of the hairpin ports), then the node forgets its neighbours and connections: the first
/// packet to a pod is sent while the node resolves it.
fn prime(lab: &Lab, gw: &'static str) {
    udp_send(lab, "pod", gw);
    udp_send(lab, "pod2", gw);
    std::thread::sleep(Duration::from_millis(200));
    let node = lab.ns("node");
    run(&["ip", "netns", "exec", &node, "ip", "neigh", "flush", "all"]);
    run(&["ip", "netns", "exec", &node, "conntrack", "-F"]);
}

/// The MAC address of `role`'s eth0.
fn mac_of(lab: &Lab, role: &str) -> String {
    let out = run(&[
        "ip",
        "netns",
        "exec",
        &lab.ns(role),
        "ip",
        "-j",
        "link",
        "show",
        "eth0",
    ]);
    let links: Value = serde_json::from_slice(&out.stdout).expect("ip -j link");
    links[0]["address"].as_str().expect("a MAC").to_string()
}

/// The bridge port cni0's forwarding database has `mac` behind (learned, not local).
fn fdb_port_of(lab: &Lab, mac: &str) -> String {
    let out = run(&[
        "ip",
        "netns",
        "exec",
        &lab.ns("node"),
        "bridge",
        "-j",
        "fdb",
        "show",
        "br",
        "cni0",
    ]);
    let fdb: Value = serde_json::from_slice(&out.stdout).expect("bridge -j fdb");
    fdb.as_array()
        .into_iter()
        .flatten()
        .find(|e| e["mac"] == mac && e["state"] != "permanent")
        .and_then(|e| e["ifname"].as_str())
        .unwrap_or_else(|| panic!("{mac} not in cni0's fdb: {fdb}"))
        .to_string()
}

fn stats(path: &std::path::Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(path).expect("--stats written")).unwrap()
}

fn assert_accounted(s: &Value) {
    let n = |k: &str| s[k].as_u64().unwrap();
    assert_eq!(
        n("seen"),
        n("printed")
            + n("lost")
            + n("filtered")
            + n("sampled")
            + n("in_flight")
            + n("in_flight_left_out")
            + n("not_printed"),
        "every packet seen is accounted for: {s}"
    );
}

#[test]
fn bridged_ipv4_flows_are_whole_with_their_ports_and_the_kernels_rules() {
    if !privileged("bridged_ipv4_flows_are_whole_with_their_ports_and_the_kernels_rules") {
        return;
    }
    let lab = Lab::up_with_mode("br4", "bridge");
    prime(&lab, "10.244.0.1:9");
    let neigh = run(&[
        "ip",
        "netns",
        "exec",
        &lab.ns("node"),
        "ip",
        "neigh",
        "show",
        POD,
    ]);
    assert!(
        !String::from_utf8_lossy(&neigh.stdout).contains("lladdr"),
        "the node does not know the pod's MAC before the first packet"
    );
    let stats_file = std::env::temp_dir().join(format!("{}-stats.json", lab.prefix));
    let tail = Tail::start_with(&lab, &["--stats", stats_file.to_str().unwrap()]);
    // Read once the probes are attached: the node's own packets before (an IGMP report
    // as its bridge comes up) are counted by the kernel but were never the observer's.
    let before = lab_counters(&lab, "node", "iptables-save");
    // The ClusterIP first, the node's neighbour entry for the pod still unresolved.
    let echo = tcp_echo(&lab, "pod", "10.244.0.5:22", 4);
    assert_eq!(tcp_client(&lab, "pod2", "10.96.0.2:22").unwrap(), b"ping");
    assert_eq!(tcp_client(&lab, "pod", "10.96.0.2:22").unwrap(), b"ping");
    assert_eq!(tcp_client(&lab, "pod2", "10.244.0.5:22").unwrap(), b"ping");
    assert_eq!(tcp_client(&lab, "node", "10.244.0.5:22").unwrap(), b"ping");
    echo.join().unwrap();
    let remote = tcp_echo(&lab, "node2", "10.244.1.5:80", 1);
    assert_eq!(tcp_client(&lab, "pod2", "10.96.0.20:80").unwrap(), b"ping");
    remote.join().unwrap();
    let ext = tcp_echo(&lab, "ext", "203.0.113.10:8080", 1);
    assert_eq!(
        tcp_client(&lab, "pod", "203.0.113.10:8080").unwrap(),
        b"ping"
    );
    ext.join().unwrap();
    let sink = udp_sink(&lab, "node", "10.244.0.1:5353");
    udp_send(&lab, "pod", "10.244.0.1:5353");
    sink.join().unwrap();
    std::thread::sleep(Duration::from_millis(1500));
    let after = lab_counters(&lab, "node", "iptables-save");
    let (reports, stderr) = tail.stop();
    let neigh = run(&[
        "ip",
        "netns",
        "exec",
        &lab.ns("node"),
        "ip",
        "neigh",
        "show",
        POD,
    ]);
    assert!(
        String::from_utf8_lossy(&neigh.stdout).contains("lladdr"),
        "the first packet made the node resolve the pod"
    );
    let all = summary(&reports);
    let incomplete: Vec<&Value> = reports.iter().filter(|r| r["incomplete"] == true).collect();
    assert!(
        incomplete.is_empty(),
        "every traversal whole:\n{all}\n{stderr}"
    );

    // pod2 -> ClusterIP, DNAT to a pod on the same bridge: the first packet, sent through
    // cni0's own transmit while the node resolved the pod, then bridged to the pod's port.
    let svc = first(&reports, "10.244.0.6", "10.96.0.2:22");
    assert_eq!(svc["route"], "bridged", "{svc:#}");
    assert_eq!(bridge(svc), ("cni0", POD2_PORT, POD_PORT), "{svc:#}");
    assert_eq!(svc["ingress"]["iface"], POD2_PORT);
    assert_eq!(svc["egress"]["iface"], POD_PORT);
    assert_eq!(
        hooks(svc),
        ["PREROUTING", "FORWARD", "POSTROUTING"],
        "{svc:#}"
    );
    assert_eq!(nat(svc, "dnat").expect("DNAT")["to"], "10.244.0.5:22");
    assert_eq!(svc["fate"]["kind"], "forwarded");
    assert!(
        svc["notes"].as_array().is_some_and(|n| n.iter().any(|n| n
            .as_str()
            .unwrap()
            .starts_with("sent through cni0's own transmit"))),
        "the path through the bridge's own transmit is shown: {svc:#}"
    );
    // Its later packets, the neighbour known, are bridged straight away.
    let later = reports
        .iter()
        .find(|r| {
            src(r).starts_with("10.244.0.6")
                && dst(r) == "10.96.0.2:22"
                && r["conntrack"]["state"] == "established"
        })
        .expect("a later packet to the ClusterIP");
    assert_eq!(bridge(later), ("cni0", POD2_PORT, POD_PORT));
    assert!(later["notes"].is_null(), "{later:#}");

    // Hairpin: the pod to a service that picks itself, masqueraded to the bridge's address.
    let hairpin = first(&reports, "10.244.0.5", "10.96.0.2:22");
    assert_eq!(hairpin["route"], "bridged");
    assert_eq!(bridge(hairpin), ("cni0", POD_PORT, POD_PORT), "{hairpin:#}");
    assert_eq!(nat(hairpin, "dnat").expect("DNAT")["to"], "10.244.0.5:22");
    let snat = nat(hairpin, "masquerade")
        .or_else(|| nat(hairpin, "snat"))
        .expect("masqueraded");
    assert!(
        snat["to"].as_str().unwrap().starts_with("10.244.0.1:"),
        "{hairpin:#}"
    );

    // Pod to pod on the bridge.
    let p2p = first(&reports, "10.244.0.6", "10.244.0.5:22");
    assert_eq!(p2p["route"], "bridged");
    assert_eq!(bridge(p2p), ("cni0", POD2_PORT, POD_PORT));
    assert!(p2p["nat"].as_array().unwrap().is_empty());

    // Node to pod: sent by the node through cni0, out of the pod's port.
    let n2p = first(&reports, "10.244.0.1", "10.244.0.5:22");
    assert_eq!(n2p["route"], "output");
    assert_eq!(bridge(n2p), ("cni0", "-", POD_PORT), "{n2p:#}");
    assert_eq!(n2p["egress"]["iface"], POD_PORT);
    assert_eq!(n2p["fate"]["kind"], "sent");

    // Pod to node: in by the pod's port, up to the bridge, delivered.
    let p2n = first(&reports, "10.244.0.5", "10.244.0.1:5353");
    assert_eq!(p2n["route"], "input");
    assert_eq!(bridge(p2n), ("cni0", POD_PORT, "-"), "{p2n:#}");
    assert_eq!(p2n["fate"]["kind"], "delivered");

    // To an endpoint on the other node: DNAT, then routed out of eth2.
    let remote = first(&reports, "10.244.0.6", "10.96.0.20:80");
    assert_eq!(remote["route"], "forward");
    assert_eq!(bridge(remote), ("cni0", POD2_PORT, "-"));
    assert_eq!(remote["egress"]["iface"], "eth2");
    assert_eq!(nat(remote, "dnat").expect("DNAT")["to"], "10.244.1.5:80");
    // Its reply comes back by eth2 and leaves by the pod's port (cni0's transmit on the way).
    let reply = reports
        .iter()
        .find(|r| src(r) == "10.244.1.5:80")
        .expect("a reply from the other node");
    assert_eq!(bridge(reply), ("cni0", "-", POD2_PORT), "{reply:#}");
    assert_eq!(reply["egress"]["iface"], POD2_PORT);

    // To the outside: flannel's masquerade.
    let out = first(&reports, "10.244.0.5", "203.0.113.10:8080");
    assert_eq!(out["egress"]["iface"], "eth1");
    let m = nat(out, "masquerade")
        .or_else(|| nat(out, "snat"))
        .expect("masqueraded");
    assert!(
        m["to"].as_str().unwrap().starts_with("203.0.113.1:"),
        "{out:#}"
    );

    // The kernel is the judge: every rule named, counted, equals its counter's increment,
    // and every stage agrees with what the kernel did.
    let kernel = increments(&before, &after);
    let d = diff(&kernel, &named(&reports, "ipv4"));
    assert!(
        d.is_empty(),
        "rules named by tail differ from the kernel's counters:\n{}\n{all}\n{stderr}",
        d.join("\n")
    );
    let bad = not_agreeing(&reports);
    assert!(bad.is_empty(), "stages not agreeing:\n{}", bad.join("\n"));
    let physdev = kernel.keys().any(|(_, c, i)| c == "FORWARD" && *i == 1);
    assert!(
        physdev,
        "the physdev rule counted bridged frames: {kernel:?}"
    );

    let s = stats(&stats_file);
    let _ = std::fs::remove_file(&stats_file);
    assert_accounted(&s);
    assert_eq!(s["incomplete"], 0, "{s}");
    assert_eq!(s["printed"].as_u64(), Some(reports.len() as u64), "{s}");
}

#[test]
fn a_forward_rule_drops_a_bridged_frame_and_the_report_says_where() {
    if !privileged("a_forward_rule_drops_a_bridged_frame_and_the_report_says_where") {
        return;
    }
    let lab = Lab::up_with_mode("brd", "bridge");
    prime(&lab, "10.244.0.1:9");
    let stats_file = std::env::temp_dir().join(format!("{}-stats.json", lab.prefix));
    let tail = Tail::start_with(&lab, &["--stats", stats_file.to_str().unwrap()]);
    let before = lab_counters(&lab, "node", "iptables-save");
    udp_send(&lab, "pod", "10.244.0.6:9");
    std::thread::sleep(Duration::from_millis(1500));
    let after = lab_counters(&lab, "node", "iptables-save");
    // The port the bridge would have sent the frame out of: where its FDB has pod2's MAC.
    let fdb_port = fdb_port_of(&lab, &mac_of(&lab, "pod2"));
    let (reports, stderr) = tail.stop();
    let drop = first(&reports, "10.244.0.5", "10.244.0.6:9");
    assert_eq!(drop["incomplete"], false, "{drop:#}\n{stderr}");
    assert_eq!(drop["fate"]["kind"], "dropped", "{drop:#}");
    assert_eq!(drop["fate"]["hook"], "FORWARD");
    assert_eq!(drop["fate"]["table"], "filter");
    assert_eq!(drop["route"], "bridged");
    // In by the pod's port, to leave by pod2's (read at FORWARD before the rule dropped
    // it), the port the bridge's FDB has for pod2's MAC.
    assert_eq!(bridge(drop), ("cni0", POD_PORT, POD2_PORT), "{drop:#}");
    assert_eq!(
        fdb_port, POD2_PORT,
        "the bridge learned pod2 behind its port"
    );
    assert!(drop["egress"].is_null(), "it never left: {drop:#}");
    // The kernel counted the policy's DROP rule once, for this frame.
    let kernel = increments(&before, &after);
    assert_eq!(
        kernel.get(&("filter".into(), "POD-POLICY".into(), 1)),
        Some(&1),
        "{kernel:?}"
    );
    // With the out port known, the rule matching `--physdev-out` is decided: tail names
    // the rules the kernel counted, and the FORWARD stage agrees with the drop.
    let fwd = drop["stages"]
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["hook"] == "FORWARD")
        .expect("a FORWARD stage");
    assert_eq!(fwd["check"]["result"], "agrees", "{fwd:#}");
    let d = diff(&kernel, &named(&reports, "ipv4"));
    assert!(
        d.is_empty(),
        "rules named by tail differ from the kernel's counters:\n{}\n{}",
        d.join("\n"),
        summary(&reports)
    );
    let s = stats(&stats_file);
    let _ = std::fs::remove_file(&stats_file);
    assert_accounted(&s);
}

#[test]
fn bridged_ipv6_flows_are_whole_with_their_ports() {
    if !privileged("bridged_ipv6_flows_are_whole_with_their_ports") {
        return;
    }
    let lab = Lab::up_with_mode("br6", "bridge");
    prime(&lab, "[fd00:10:244::1]:9");
    let stats_file = std::env::temp_dir().join(format!("{}-stats.json", lab.prefix));
    let tail = Tail::start_with(
        &lab,
        &["--stats", stats_file.to_str().unwrap(), "--filter", "tcp"],
    );
    let before = lab_counters(&lab, "node", "ip6tables-save");
    let echo = tcp_echo(&lab, "pod", "[fd00:10:244::5]:22", 3);
    assert_eq!(
        tcp_client(&lab, "pod2", "[fd00:96::2]:22").unwrap(),
        b"ping"
    );
    assert_eq!(tcp_client(&lab, "pod", "[fd00:96::2]:22").unwrap(), b"ping");
    assert_eq!(
        tcp_client(&lab, "pod2", "[fd00:10:244::5]:22").unwrap(),
        b"ping"
    );
    echo.join().unwrap();
    std::thread::sleep(Duration::from_millis(1500));
    let after = lab_counters(&lab, "node", "ip6tables-save");
    let (reports, stderr) = tail.stop();
    let all = summary(&reports);
    assert!(
        !reports.iter().any(|r| r["incomplete"] == true),
        "every traversal whole:\n{all}\n{stderr}"
    );
    let svc = first(&reports, "[fd00:10:244::6]", "[fd00:96::2]:22");
    assert_eq!(svc["route"], "bridged", "{svc:#}");
    assert_eq!(bridge(svc), ("cni0", POD2_PORT, POD_PORT));
    assert_eq!(nat(svc, "dnat").expect("DNAT")["to"], "[fd00:10:244::5]:22");
    assert!(
        svc["notes"].as_array().is_some_and(|n| n.iter().any(|n| n
            .as_str()
            .unwrap()
            .starts_with("sent through cni0's own transmit"))),
        "the first packet, the node's neighbour flushed, goes through cni0's transmit: {svc:#}"
    );
    let hairpin = first(&reports, "[fd00:10:244::5]", "[fd00:96::2]:22");
    assert_eq!(bridge(hairpin), ("cni0", POD_PORT, POD_PORT));
    assert!(
        nat(hairpin, "masquerade")
            .or_else(|| nat(hairpin, "snat"))
            .is_some()
    );
    let p2p = first(&reports, "[fd00:10:244::6]", "[fd00:10:244::5]:22");
    assert_eq!(bridge(p2p), ("cni0", POD2_PORT, POD_PORT));
    // The tcp flows' rules, as the kernel counted them (neighbour discovery walks the
    // FORWARD chain too, and is left out by the filter: compared on the nat table, which
    // only connections' first packets walk).
    let kernel: Counts = increments(&before, &after)
        .into_iter()
        .filter(|(k, _)| k.0 == "nat")
        .collect();
    let tail_named: Counts = named(&reports, "ipv6")
        .into_iter()
        .filter(|(k, _)| k.0 == "nat")
        .collect();
    let d = diff(&kernel, &tail_named);
    assert!(d.is_empty(), "{}\n{all}", d.join("\n"));
    assert!(!kernel.is_empty());
    let bad = not_agreeing(&reports);
    assert!(bad.is_empty(), "stages not agreeing:\n{}", bad.join("\n"));
    let s = stats(&stats_file);
    let _ = std::fs::remove_file(&stats_file);
    assert_accounted(&s);
}

#[test]
fn a_flooded_frames_copies_say_which_port_each_left_by() {
    if !privileged("a_flooded_frames_copies_say_which_port_each_left_by") {
        return;
    }
    let lab = Lab::up_with_mode("brf", "bridge");
    prime(&lab, "10.244.0.1:9");
    // pod2 learns the pod's MAC (its neighbour entry stays reachable for the send below).
    let sink = udp_sink(&lab, "pod", "10.244.0.5:7000");
    udp_send(&lab, "pod2", "10.244.0.5:7000");
    sink.join().unwrap();
    let stats_file = std::env::temp_dir().join(format!("{}-stats.json", lab.prefix));
    let tail = Tail::start_with(&lab, &["--stats", stats_file.to_str().unwrap()]);
    let node = lab.ns("node");
    // The bridge forgets where the MACs are: the next frame to the pod is unknown unicast,
    // flooded to every port (hairpin on: the port it came in by too).
    run(&[
        "ip", "netns", "exec", &node, "bridge", "fdb", "flush", "dev", "cni0",
    ]);
    let pod_mac = mac_of(&lab, "pod");
    let fdb = run(&[
        "ip", "netns", "exec", &node, "bridge", "fdb", "show", "br", "cni0",
    ]);
    assert!(
        !String::from_utf8_lossy(&fdb.stdout).contains(&pod_mac),
        "cni0 does not know the pod's MAC before the frame"
    );
    let before = lab_counters(&lab, "node", "iptables-save");
    let sink = udp_sink(&lab, "pod", "10.244.0.5:7001");
    udp_send(&lab, "pod2", "10.244.0.5:7001");
    sink.join().unwrap();
    std::thread::sleep(Duration::from_millis(500));
    let after = lab_counters(&lab, "node", "iptables-save");
    let (reports, stderr) = tail.stop();
    let all = summary(&reports);
    let flow: Vec<&Value> = reports
        .iter()
        .filter(|r| dst(r) == "10.244.0.5:7001" || r["bridge"]["flooded"] == true)
        .collect();
    // The kernel's count of bridged frames at FORWARD (the physdev rule matches every
    // one): one per port the frame was flooded to.
    let kernel = increments(&before, &after);
    let copies = kernel
        .get(&("filter".into(), "FORWARD".into(), 1))
        .copied()
        .unwrap_or(0);
    assert_eq!(copies, 2, "flooded to both ports: {kernel:?}\n{all}");
    assert_eq!(flow.len(), 2, "one report per copy:\n{all}\n{stderr}");
    // The original: whole, in by pod2's port; the copy: flagged, counted, its port named.
    let original: Vec<&&Value> = flow
        .iter()
        .filter(|r| r["bridge"]["flooded"] == false)
        .collect();
    let copy: Vec<&&Value> = flow
        .iter()
        .filter(|r| r["bridge"]["flooded"] == true)
        .collect();
    assert_eq!((original.len(), copy.len()), (1, 1), "{all}");
    let (original, copy) = (original[0], copy[0]);
    assert_eq!(original["incomplete"], false, "{original:#}");
    assert_eq!(original["route"], "bridged");
    assert_eq!(bridge(original).1, POD2_PORT);
    assert_eq!(copy["incomplete"], true, "{copy:#}");
    assert!(
        copy["incomplete_reason"]
            .as_str()
            .unwrap()
            .starts_with("a copy cni0 made flooding the frame to several ports"),
        "{copy:#}"
    );
    assert_eq!(copy["route"], "bridged");
    assert_eq!(hooks(copy), ["FORWARD", "POSTROUTING"], "{copy:#}");
    assert_eq!(copy["fate"]["kind"], "forwarded", "{copy:#}");
    // Each left by its own port, the two ports of the bridge, as TC egress saw them.
    let mut outs = [bridge(original).2.to_string(), bridge(copy).2.to_string()];
    outs.sort();
    assert_eq!(outs, [POD_PORT, POD2_PORT], "{all}");
    for r in [original, copy] {
        assert_eq!(r["egress"]["iface"], bridge(r).2, "{r:#}");
    }
    // The copy's rules are named too (bridged, its out port known; only a rule matching
    // `--physdev-in` would wait for its in port): every rule named equals the kernel's
    // counters, every stage agrees. The nat table is counted once: the kernel consults it
    // for whichever copy reaches POSTROUTING first, then the connection's source
    // manipulation is set up (IPS_SRC_NAT_DONE) and the other copy walks no nat rule.
    let d = diff(&kernel, &named(&reports, "ipv4"));
    assert!(
        d.is_empty(),
        "rules named by tail differ from the kernel's counters:\n{}\n{all}",
        d.join("\n")
    );
    let bad = not_agreeing(&reports);
    assert!(bad.is_empty(), "stages not agreeing:\n{}", bad.join("\n"));
    let s = stats(&stats_file);
    let _ = std::fs::remove_file(&stats_file);
    assert_accounted(&s);
    assert_eq!(s["flooded_copies"], 1, "{s}");
}

/// The agent streams bridged reports with their bridge: in its default mode (nothing per
/// packet until a client streams, then the tables bracketed) and in `--mode brackets`,
/// with what the node's bridge-family chains did (simulated, confirmed by counters).
#[test]
fn the_agent_streams_bridged_reports_with_their_bridge_in_both_modes() {
    if !privileged("the_agent_streams_bridged_reports_with_their_bridge_in_both_modes") {
        return;
    }
    let lab = Lab::up_with_args("bra", "bridge", &["--bridge-chains"]);
    prime(&lab, "10.244.0.1:9");
    for mode in [&[][..], &["--mode", "brackets"][..]] {
        let agent = Agent::start_with(&lab, mode);
        let sock = agent.socket.to_str().unwrap().to_string();
        let tail = Client::start(&[
            "tail",
            "--agent",
            &sock,
            "--json",
            "--filter",
            "port 22 or udp port 9 or udp port 7002",
            "--timeout",
            "15",
        ]);
        wait_until_tracing(&lab, &format!("{mode:?}"));
        let echo = tcp_echo(&lab, "pod", "10.244.0.5:22", 1);
        assert_eq!(tcp_client(&lab, "pod2", "10.244.0.5:22").unwrap(), b"ping");
        echo.join().unwrap();
        udp_send(&lab, "pod", "10.244.0.6:9");
        // Once this frame's report is out, the agent has read the bridge family's counters
        // after it: the next frame is judged against a read that ended before it began.
        let reported = |to: &str| {
            let to = to.to_string();
            move |l: &str| {
                serde_json::from_str::<Value>(l)
                    .is_ok_and(|r| src(&r).starts_with("10.244.0.5") && dst(&r) == to)
            }
        };
        let within = Duration::from_secs(10 * u64::from(time_scale()));
        tail.wait_for(
            "the udp/9 frame's report",
            within,
            1,
            reported("10.244.0.6:9"),
        );
        let l2_before = l2_counters(&lab);
        // Two frames, each sent once the one before it is reported: each has a counter
        // read before it and one after it, so each is confirmed.
        for i in 0..2 {
            let sink = udp_sink(&lab, "pod2", "10.244.0.6:7002");
            udp_send(&lab, "pod", "10.244.0.6:7002");
            sink.join().unwrap();
            tail.wait_for(
                &format!("udp/7002 frame {i}'s report"),
                within,
                i + 1,
                reported("10.244.0.6:7002"),
            );
        }
        let (lines, err) = tail.finish(Duration::from_secs(40));
        let reports: Vec<Value> = lines
            .iter()
            .filter_map(|l| serde_json::from_str(l).ok())
            .collect();
        let all = summary(&reports);
        let p2p = first(&reports, "10.244.0.6", "10.244.0.5:22");
        assert_eq!(p2p["route"], "bridged", "{mode:?}: {p2p:#}");
        assert_eq!(
            bridge(p2p),
            ("cni0", POD2_PORT, POD_PORT),
            "{mode:?}: {p2p:#}"
        );
        assert_eq!(p2p["ingress"]["iface"], POD2_PORT);
        assert_eq!(p2p["egress"]["iface"], POD_PORT);
        assert_eq!(p2p["incomplete"], false, "{mode:?}: {p2p:#}\n{err}");
        let dropped = first(&reports, "10.244.0.5", "10.244.0.6:9");
        assert_eq!(dropped["fate"]["kind"], "dropped", "{mode:?}: {all}");
        assert_eq!(
            bridge(dropped),
            ("cni0", POD_PORT, POD2_PORT),
            "{mode:?}: {dropped:#}"
        );
        let l2_after = l2_counters(&lab);
        assert_eq!(
            l2_after.get(&4).copied().unwrap_or(0) - l2_before.get(&4).copied().unwrap_or(0),
            2,
            "the bridge forward chain counted both frames"
        );
        let counted: Vec<&Value> = reports
            .iter()
            .filter(|r| {
                src(r).starts_with("10.244.0.5")
                    && dst(r) == "10.244.0.6:7002"
                    && r["conntrack"]["state"] == "new"
            })
            .collect();
        assert_eq!(counted.len(), 2, "{mode:?}: {all}");
        // Each frame had a counter read before it and after it: its rule is confirmed.
        let judged = |r: &Value, how: &str| {
            notes(r)
                .iter()
                .any(|l| l.contains("bridge obs-l2 forward handle 4 ") && l.contains(how))
        };
        for r in &counted {
            assert!(
                judged(r, "(confirmed: its counter advanced by 1 across the frame)"),
                "{mode:?}: {:#?}",
                notes(r)
            );
        }
        drop(agent);
    }
}

/// Packet counters of the rules of the node's nft table `bridge obs-l2`, by handle.
fn l2_counters(lab: &Lab) -> BTreeMap<u64, u64> {
    let out = run(&[
        "ip",
        "netns",
        "exec",
        &lab.ns("node"),
        "nft",
        "-j",
        "list",
        "table",
        "bridge",
        "obs-l2",
    ]);
    let v: Value = serde_json::from_slice(&out.stdout).expect("nft -j");
    let mut counts = BTreeMap::new();
    for item in v["nftables"].as_array().into_iter().flatten() {
        let r = &item["rule"];
        let Some(handle) = r["handle"].as_u64() else {
            continue;
        };
        for e in r["expr"].as_array().into_iter().flatten() {
            if let Some(p) = e["counter"]["packets"].as_u64() {
                counts.insert(handle, p);
            }
        }
    }
    counts
}

fn notes(r: &Value) -> Vec<&str> {
    r["notes"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(Value::as_str)
        .collect()
}

/// The nft `bridge` family's chains cannot be bracketed (no BPF netfilter link for
/// NFPROTO_BRIDGE): tail says what they did, simulated on the live ruleset, each rule
/// confirmed by its own counter, and never calls it observed.
#[test]
fn bridge_family_chains_are_simulated_and_confirmed_by_their_counters() {
    if !privileged("bridge_family_chains_are_simulated_and_confirmed_by_their_counters") {
        return;
    }
    let lab = Lab::up_with_args("brn", "bridge", &["--bridge-chains"]);
    // The node learns pod2's MAC (its ARP request for the gateway) and the bridge learns
    // where pod2 is: tail reads both at start, which places a frame the bridge chains drop.
    udp_send(&lab, "pod2", "10.244.0.1:9");
    udp_send(&lab, "pod", "10.244.0.1:9");
    std::thread::sleep(Duration::from_millis(200));
    let stats_file = std::env::temp_dir().join(format!("{}-stats.json", lab.prefix));
    let tail = Tail::start_with(&lab, &["--stats", stats_file.to_str().unwrap()]);
    let before = l2_counters(&lab);
    // Each frame is sent once the one before it is reported: tail reads the bridge
    // family's counters after each report, so each frame has a read before it.
    let reported = |to: &'static str| {
        move |l: &str| {
            serde_json::from_str::<Value>(l)
                .is_ok_and(|r| src(&r).starts_with("10.244.0.5") && dst(&r) == to)
        }
    };
    let within = Duration::from_secs(10 * u64::from(time_scale()));
    let sink = udp_sink(&lab, "pod2", "10.244.0.6:7002");
    udp_send(&lab, "pod", "10.244.0.6:7002");
    sink.join().unwrap();
    tail.wait_for(
        "the udp/7002 frame's report",
        within,
        1,
        reported("10.244.0.6:7002"),
    );
    udp_send(&lab, "pod", "10.244.0.6:7003");
    tail.wait_for(
        "the udp/7003 frame's report",
        within,
        1,
        reported("10.244.0.6:7003"),
    );
    // A ClusterIP DNATed to a pod on the same bridge: the bridge forward chain sees the
    // pod's address (rule 6), on the first packet and on the later ones, whose DNAT is
    // conntrack's stored translation.
    let echo = tcp_echo(&lab, "pod", "10.244.0.5:22", 1);
    assert_eq!(tcp_client(&lab, "pod2", "10.96.0.2:22").unwrap(), b"ping");
    echo.join().unwrap();
    std::thread::sleep(Duration::from_millis(1000));
    let after = l2_counters(&lab);
    let (reports, stderr) = tail.stop();
    let all = summary(&reports);
    let advanced =
        |h: u64| after.get(&h).copied().unwrap_or(0) - before.get(&h).copied().unwrap_or(0);
    // The kernel: the prerouting rule (3) and the forward count (4) saw the udp/7002
    // frame, the forward drop (5) the udp/7003 one.
    assert_eq!(
        (advanced(3), advanced(4), advanced(5)),
        (1, 1, 1),
        "{before:?} {after:?}"
    );

    let counted = first(&reports, "10.244.0.5", "10.244.0.6:7002");
    assert_eq!(counted["route"], "bridged", "{counted:#}");
    let n = notes(counted);
    assert!(
        n.iter().any(|l| l.starts_with("bridge-family chain bridge obs-l2 prerouting (PREROUTING -300; simulated on the live ruleset, not observed")),
        "{n:#?}\n{stderr}"
    );
    assert!(
        n.iter().any(|l| l
            .starts_with("bridge-family chain bridge obs-l2 forward (FORWARD -200; simulated")
            && l.ends_with(": accept")),
        "{n:#?}"
    );
    for handle in [3, 4] {
        assert!(
            n.iter().any(|l| l.contains("obs-l2 ")
                && l.contains(&format!(" handle {handle} "))
                && l.ends_with("(confirmed: its counter advanced by 1 across the frame)")),
            "rule {handle} confirmed by its counter: {n:#?}"
        );
    }

    // Dropped by the bridge forward chain before br_netfilter's IP FORWARD: the probes saw
    // it die after PREROUTING; the simulation names the rule, its counter confirms it.
    let dropped = first(&reports, "10.244.0.5", "10.244.0.6:7003");
    assert_eq!(dropped["fate"]["kind"], "dropped", "{dropped:#}");
    assert_eq!(dropped["fate"]["reason"], "NETFILTER_DROP", "{dropped:#}");
    assert_eq!(hooks(dropped), ["PREROUTING"], "{dropped:#}");
    let n = notes(dropped);
    assert!(
        n.iter().any(|l| l
            .starts_with("bridge-family chain bridge obs-l2 forward (FORWARD -200; simulated")
            && l.ends_with(": drop")),
        "{n:#?}\n{all}"
    );
    assert!(
        n.iter().any(|l| l.contains(" handle 5 ")
            && l.contains("=> drop (confirmed: its counter advanced by 1 across the frame)")),
        "{n:#?}"
    );
    assert!(
        advanced(6) >= 3,
        "the tcp flow's frames to the pod: {after:?}"
    );
    let to_svc: Vec<&Value> = reports
        .iter()
        .filter(|r| src(r).starts_with("10.244.0.6") && dst(r) == "10.96.0.2:22")
        .collect();
    assert!(to_svc.len() >= 3, "{all}");
    for r in &to_svc {
        let n = notes(r);
        assert!(
            n.iter()
                .any(|l| l.contains(" handle 6 ip daddr 10.244.0.5 tcp dport 22 ")),
            "the forward chain matched the DNATed address: {n:#?}"
        );
    }
    // Each frame's rule 6 is judged by its counter: confirmed, or (counters are read at
    // most every 50 ms, so a frame right after a read may have none after it yet) said
    // unconfirmed for that reason; never anything else. The flow's frames are confirmed.
    let judged = |r: &Value, how: &str| {
        notes(r)
            .iter()
            .any(|l| l.contains(" handle 6 ") && l.contains(how))
    };
    for r in &to_svc {
        assert!(
            judged(r, "(confirmed: its counter advanced by")
                || judged(r, "(unconfirmed: no counter read after the frame yet"),
            "{:#?}",
            notes(r)
        );
    }
    assert!(
        to_svc
            .iter()
            .any(|r| judged(r, "(confirmed: its counter advanced by")),
        "{all}"
    );
    // Nothing calls a bridge chain observed, and the counter values read with the
    // ruleset are not shown as if current.
    for r in &reports {
        for l in notes(r) {
            assert!(!l.replace("not observed", "").contains("observed"), "{l}");
            assert!(!l.contains("counter packets"), "{l}");
        }
    }
    let s = stats(&stats_file);
    let _ = std::fs::remove_file(&stats_file);
    assert_accounted(&s);
}

/// The bridge-family tables of the lab's node (`nft list tables bridge`).
fn bridge_tables(lab: &Lab) -> String {
    let out = run(&[
        "ip",
        "netns",
        "exec",
        &lab.ns("node"),
        "nft",
        "list",
        "tables",
        "bridge",
    ]);
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Waits (2 s at most) until the trace table `name` is gone from the node.
fn gone(lab: &Lab, name: &str) -> bool {
    for _ in 0..40 {
        if !bridge_tables(lab).contains(name) {
            return true;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    false
}

/// The `obs-l2` rule events `nft -a monitor trace` printed, per handle: (count, verdicts).
fn monitor_rules(text: &str) -> BTreeMap<u64, (u64, Vec<String>)> {
    let mut out: BTreeMap<u64, (u64, Vec<String>)> = BTreeMap::new();
    for l in text.lines() {
        if !l.contains(" bridge obs-l2 ") || !l.contains(" rule ") {
            continue;
        }
        let Some(handle) = l
            .split("# handle ")
            .nth(1)
            .and_then(|h| h.split_whitespace().next())
            .and_then(|h| h.parse().ok())
        else {
            continue;
        };
        let verdict = l
            .split("(verdict ")
            .nth(1)
            .map(|v| v.trim_end_matches(')').to_string())
            .unwrap_or_default();
        let e = out.entry(handle).or_default();
        e.0 += 1;
        e.1.push(verdict);
    }
    out
}

/// `--trace-bridge-chains`: the nft `bridge` family's chains are OBSERVED through
/// nf_tables' trace. A frame accepted through them and one the bridge forward chain drops
/// are reported with the chains and rules that the kernel's own `nft monitor trace` shows
/// and that the rules' counters count; observer's trace table exists only while it runs
/// and is removed by the kernel when it exits, after SIGINT and after SIGKILL.
#[test]
fn bridge_family_chains_are_observed_through_the_nftables_trace() {
    if !privileged("bridge_family_chains_are_observed_through_the_nftables_trace") {
        return;
    }
    let lab = Lab::up_with_args("brt", "bridge", &["--bridge-chains"]);
    udp_send(&lab, "pod2", "10.244.0.1:9");
    udp_send(&lab, "pod", "10.244.0.1:9");
    std::thread::sleep(Duration::from_millis(200));
    let stats_file = std::env::temp_dir().join(format!("{}-stats.json", lab.prefix));
    let tail = Tail::start_with(
        &lab,
        &[
            "--trace-bridge-chains",
            "--stats",
            stats_file.to_str().unwrap(),
        ],
    );
    let table = format!("observer-trace-{}", tail.pid());
    assert!(
        bridge_tables(&lab).contains(&format!("table bridge {table}")),
        "the trace table while tail runs: {}",
        bridge_tables(&lab)
    );
    // The kernel's own view of the same frames: `nft monitor trace` reads the events
    // observer's table causes.
    let monitor = std::process::Command::new("ip")
        .args([
            "netns",
            "exec",
            &lab.ns("node"),
            "nft",
            "-a",
            "monitor",
            "trace",
        ])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("nft monitor trace");
    std::thread::sleep(Duration::from_millis(500));
    let before = l2_counters(&lab);
    let sink = udp_sink(&lab, "pod2", "10.244.0.6:7002");
    udp_send(&lab, "pod", "10.244.0.6:7002");
    sink.join().unwrap();
    std::thread::sleep(Duration::from_millis(300));
    udp_send(&lab, "pod", "10.244.0.6:7003");
    // A ClusterIP DNATed to a pod on the same bridge, its first packet sent while the node
    // resolves the pod (through cni0's own transmit): the bridge forward chain sees the
    // pod's address (rule 6) on every packet from the client.
    let node = lab.ns("node");
    run(&["ip", "netns", "exec", &node, "ip", "neigh", "flush", "all"]);
    run(&["ip", "netns", "exec", &node, "conntrack", "-F"]);
    let echo = tcp_echo(&lab, "pod", "10.244.0.5:22", 1);
    assert_eq!(tcp_client(&lab, "pod2", "10.96.0.2:22").unwrap(), b"ping");
    echo.join().unwrap();
    // A frame flooded (the bridge forgot where the pod is): each copy's report names the
    // port the frame came in by, which the probes cannot read for a copy, from the trace.
    let sink = udp_sink(&lab, "pod", "10.244.0.5:7000");
    run(&[
        "ip", "netns", "exec", &node, "bridge", "fdb", "flush", "dev", "cni0",
    ]);
    udp_send(&lab, "pod2", "10.244.0.5:7000");
    sink.join().unwrap();
    std::thread::sleep(Duration::from_millis(500));
    let after = l2_counters(&lab);
    // SIGTERM: a background shell may have left SIGINT ignored for its children.
    run(&["kill", "-TERM", &monitor.id().to_string()]);
    let monitor = monitor.wait_with_output().expect("nft monitor exits");
    let monitored = monitor_rules(&String::from_utf8_lossy(&monitor.stdout));
    let (reports, stderr) = tail.stop();
    let all = summary(&reports);
    assert!(
        gone(&lab, &table),
        "removed at exit: {}",
        bridge_tables(&lab)
    );
    let advanced =
        |h: u64| after.get(&h).copied().unwrap_or(0) - before.get(&h).copied().unwrap_or(0);
    assert_eq!(
        (advanced(3), advanced(4), advanced(5)),
        (1, 1, 1),
        "{before:?} {after:?}"
    );

    let counted = first(&reports, "10.244.0.5", "10.244.0.6:7002");
    assert_eq!(counted["route"], "bridged", "{counted:#}");
    let n = notes(counted);
    assert!(
        n.contains(&"bridge-family chain bridge obs-l2 prerouting (PREROUTING -300; observed by nf_tables trace): accept (policy)"),
        "{n:#?}\n{stderr}"
    );
    assert!(
        n.contains(&"bridge-family chain bridge obs-l2 forward (FORWARD -200; observed by nf_tables trace): accept (policy)"),
        "{n:#?}"
    );
    let dropped = first(&reports, "10.244.0.5", "10.244.0.6:7003");
    assert_eq!(dropped["fate"]["kind"], "dropped", "{dropped:#}");
    assert_eq!(hooks(dropped), ["PREROUTING"], "{dropped:#}");
    let d = notes(dropped);
    assert!(
        d.contains(&"bridge-family chain bridge obs-l2 forward (FORWARD -200; observed by nf_tables trace): drop by rule handle 5"),
        "{d:#?}\n{all}"
    );
    // Each rule the reports say the frames met, with its verdict, is one the kernel's
    // trace printed and its counter counted: as many times in each.
    let to_svc: Vec<&Value> = reports
        .iter()
        .filter(|r| src(r).starts_with("10.244.0.6") && dst(r) == "10.96.0.2:22")
        .collect();
    assert!(to_svc.len() >= 3, "{all}");
    assert!(
        notes(to_svc[0])
            .iter()
            .any(|l| l.starts_with("sent through cni0's own transmit")),
        "the first packet, sent while the node resolved the pod: {:#?}",
        notes(to_svc[0])
    );
    let copies: Vec<&Value> = reports
        .iter()
        .filter(|r| dst(r) == "10.244.0.5:7000" && r["bridge"]["flooded"] == true)
        .collect();
    assert!(!copies.is_empty(), "a flooded copy: {all}");
    for c in &copies {
        assert!(
            notes(c).iter().any(|l| l.starts_with(&format!(
                "the bridge port this flooded copy's frame came in by: {POD2_PORT} "
            ))),
            "{:#?}",
            notes(c)
        );
    }
    let mut reported: BTreeMap<u64, (u64, Vec<String>)> = BTreeMap::new();
    for r in [counted, dropped].into_iter().chain(to_svc.iter().copied()) {
        for l in notes(r) {
            assert!(!l.contains("simulated"), "observed, not simulated: {l}");
            assert!(!l.contains("observer-trace"), "never the trace table: {l}");
            let Some(rest) = l.strip_prefix("  bridge obs-l2 ") else {
                continue;
            };
            let handle: u64 = rest
                .split(" handle ")
                .nth(1)
                .and_then(|h| h.split(' ').next())
                .and_then(|h| h.parse().ok())
                .unwrap_or_else(|| panic!("a handle in {l}"));
            let verdict = l
                .rsplit(" => ")
                .next()
                .unwrap()
                .trim_end_matches(" (observed)")
                .to_string();
            let e = reported.entry(handle).or_default();
            e.0 += 1;
            e.1.push(verdict);
        }
    }
    assert_eq!(
        reported.keys().copied().collect::<Vec<_>>(),
        [3, 4, 5, 6],
        "{reported:?}"
    );
    for (handle, (n, verdicts)) in &reported {
        assert_eq!(*n, advanced(*handle), "rule {handle}: its counter");
        assert_eq!(
            monitored.get(handle),
            Some(&(*n, verdicts.clone())),
            "rule {handle}: nft monitor trace printed {monitored:?}"
        );
    }
    let s = stats(&stats_file);
    let _ = std::fs::remove_file(&stats_file);
    assert_accounted(&s);
    assert_eq!(s["bridge_trace"]["unmatched"], 0, "{s}");
    assert!(
        s["bridge_trace"]["observed"].as_u64().unwrap() >= 2
            && s["bridge_trace"]["dropped"].as_u64().unwrap() >= 1,
        "{s}"
    );

    // SIGKILL: nothing of observer runs at exit, and the kernel still removes the table.
    let tail = Tail::start_with(&lab, &["--trace-bridge-chains"]);
    let table = format!("observer-trace-{}", tail.pid());
    assert!(bridge_tables(&lab).contains(&table));
    run(&["kill", "-KILL", &tail.pid().to_string()]);
    assert!(
        gone(&lab, &table),
        "removed after SIGKILL: {}",
        bridge_tables(&lab)
    );
    drop(tail);
}

/// `observer agent --trace-bridge-chains`: a streamed report of a frame the bridge forward
/// chain drops names the rule, observed through nf_tables' trace; the agent's trace table
/// exists while it runs and is gone once it exits.
#[test]
fn the_agent_observes_bridge_family_chains_through_the_trace() {
    if !privileged("the_agent_observes_bridge_family_chains_through_the_trace") {
        return;
    }
    let lab = Lab::up_with_args("brg", "bridge", &["--bridge-chains"]);
    udp_send(&lab, "pod2", "10.244.0.1:9");
    udp_send(&lab, "pod", "10.244.0.1:9");
    std::thread::sleep(Duration::from_millis(200));
    let agent = Agent::start_with(&lab, &["--mode", "brackets", "--trace-bridge-chains"]);
    let table = format!("observer-trace-{}", agent.pid());
    assert!(
        bridge_tables(&lab).contains(&table),
        "{}",
        bridge_tables(&lab)
    );
    let sock = agent.socket.to_str().unwrap().to_string();
    let tail = Client::start(&[
        "tail",
        "--agent",
        &sock,
        "--json",
        "--filter",
        "udp port 7003",
        "--timeout",
        "10",
    ]);
    wait_until_tracing(&lab, "--trace-bridge-chains");
    let before = l2_counters(&lab);
    udp_send(&lab, "pod", "10.244.0.6:7003");
    let (lines, err) = tail.finish(Duration::from_secs(30));
    let after = l2_counters(&lab);
    assert_eq!(
        after.get(&5).copied().unwrap_or(0) - before.get(&5).copied().unwrap_or(0),
        1,
        "the bridge forward chain dropped the frame"
    );
    let reports: Vec<Value> = lines
        .iter()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect();
    let dropped = first(&reports, "10.244.0.5", "10.244.0.6:7003");
    assert_eq!(dropped["fate"]["kind"], "dropped", "{dropped:#}\n{err}");
    let n = notes(dropped);
    assert!(
        n.contains(
            &"bridge-family chain bridge obs-l2 forward (FORWARD -200; observed by nf_tables trace): drop by rule handle 5"
        ),
        "{n:#?}"
    );
    assert!(
        n.iter()
            .any(|l| l.starts_with("  bridge obs-l2 forward handle 5 ")
                && l.ends_with("=> drop (observed)")),
        "{n:#?}"
    );
    let (status, stderr, _) = agent.stop("TERM");
    assert!(status.success(), "{stderr}");
    assert!(
        gone(&lab, &table),
        "removed at exit: {}",
        bridge_tables(&lab)
    );
}
