//! Privileged tests in the two-node lab (`observer lab up --nodes 2`): one observer per node,
//! a packet DNATed on the source node, carried by VXLAN and delivered on the other node, and
//! one dropped there by the policy. Judged by the kernel: each node's rule counters (every
//! rule's increment equals the rules its reports name), and the VXLAN frames captured on
//! both nodes' underlay interfaces (outer and inner headers and IPv4 IDs), against the
//! reports and the journey stitched from them.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::Duration;

use observer_model::stitch::{LegRole, NodeReport, Wanted, stitch};
use observer_tests::lab::{Lab, TIMEOUT, Tail, tcp_client, tcp_echo};
use observer_tests::privileged;
use observer_tests::rules::{Counts, diff, increments, lab_counters, named};
use observer_tests::wire::{VxlanFrame, capture_vxlan};
use serde_json::Value;

const POD: &str = "10.244.0.5";
const POD2: &str = "10.244.1.5";
const SERVICE: &str = "10.96.0.30";

fn increment(before: &Counts, after: &Counts, table: &str, chain: &str, index: usize) -> u64 {
    let k = (table.to_string(), chain.to_string(), index);
    after.get(&k).copied().unwrap_or(0) - before.get(&k).copied().unwrap_or(0)
}

/// The packet socket's capture on `eth0` of the lab namespace `role`, until `stop`.
fn capture(lab: &Lab, role: &str, stop: Arc<AtomicBool>) -> JoinHandle<Vec<VxlanFrame>> {
    capture_vxlan(lab.ns_path(role), "eth0", stop, TIMEOUT)
}

fn rules_of<'a>(r: &'a Value, hook: &str, table: &str) -> Vec<&'a str> {
    r["stages"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|s| s["hook"] == hook && s["table"] == table)
        .flat_map(|s| s["rules"].as_array().into_iter().flatten())
        .filter_map(|r| r["text"].as_str())
        .collect()
}

#[test]
fn across_the_overlay_a_delivered_and_a_dropped_packet_are_stitched_and_judged_by_the_kernel() {
    if !privileged("overlay") {
        return;
    }
    let lab = Lab::up_two_nodes("ov");
    let before = (
        lab_counters(&lab, "node", "iptables-save"),
        lab_counters(&lab, "node2", "iptables-save"),
    );
    let echo = tcp_echo(&lab, "pod2", "10.244.1.5:8080", 1);
    // node2's tail also records: its replay names the overlay device as the tail did.
    let recording = std::env::temp_dir().join(format!("{}-node2.rec", lab.prefix));
    let _ = std::fs::remove_file(&recording);
    let tails = [
        Tail::start_on(&lab, "node", &["--ip-ids"], &[]),
        Tail::start_on(
            &lab,
            "node2",
            &["--ip-ids", "--record", recording.to_str().unwrap()],
            &[],
        ),
    ];
    // The underlay of both nodes, as the kernel put the frames on it.
    let stop = Arc::new(AtomicBool::new(false));
    let captures = [
        capture(&lab, "node", stop.clone()),
        capture(&lab, "node2", stop.clone()),
    ];

    // Delivered: pod -> ClusterIP tcp/80, DNAT on node to pod2's 8080, through the overlay.
    assert_eq!(
        tcp_client(&lab, "pod", "10.96.0.30:80").unwrap(),
        b"ping",
        "the service answers across the overlay"
    );
    echo.join().unwrap();
    // Dropped: pod -> ClusterIP udp/9, DNAT on node, dropped by node2's policy.
    lab.run_in("pod", || {
        let s = std::net::UdpSocket::bind("10.244.0.5:39009").unwrap();
        s.send_to(b"denied", "10.96.0.30:9").unwrap();
    });
    std::thread::sleep(Duration::from_millis(300));
    stop.store(true, Ordering::Relaxed);
    let [on_node, on_node2] = captures.map(|c| c.join().unwrap());
    let [a, b] = tails;
    let (node_reports, _) = a.stop();
    let (node2_reports, _) = b.stop();
    let after = (
        lab_counters(&lab, "node", "iptables-save"),
        lab_counters(&lab, "node2", "iptables-save"),
    );
    let replay = std::process::Command::new(observer_tests::lab::observer_bin())
        .args(["replay", "--json"])
        .arg(&recording)
        .output()
        .unwrap();
    let _ = std::fs::remove_file(&recording);
    assert!(replay.status.success(), "{replay:?}");
    let replayed: Vec<Value> = String::from_utf8_lossy(&replay.stdout)
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect();
    let carriers = |rs: &[Value]| -> Vec<Value> {
        rs.iter()
            .filter(|r| r["encap"]["direction"] == "decapsulated")
            .map(|r| {
                // The live tail was asked for IPv4 IDs (--ip-ids), the replay not.
                let mut e = r["encap"].clone();
                e.as_object_mut().unwrap().remove("inner_ip_id");
                e
            })
            .collect()
    };
    // Live and replayed: the same carriers, the overlay named (not null) in both.
    assert!(!carriers(&node2_reports).is_empty());
    assert_eq!(carriers(&replayed), carriers(&node2_reports));
    assert!(
        carriers(&replayed)
            .iter()
            .all(|e| e["overlay"] == "flannel.1"),
        "{:#?}",
        carriers(&replayed)
    );

    // The kernel's counters on each node, rule by rule, equal the rules its reports name
    // (every packet of both flows, both ways, the carriers included).
    for (node, (b, a), reports) in [
        ("node", (&before.0, &after.0), &node_reports),
        ("node2", (&before.1, &after.1), &node2_reports),
    ] {
        let d = diff(&increments(b, a), &named(reports, "ipv4"));
        assert!(
            d.is_empty(),
            "{node}: rules whose counter and naming differ (rule: kernel, reports):\n{}",
            d.join("\n")
        );
    }
    // Among them: DNAT on node only (node2 sees pod2's address already), the policy's DROP
    // on node2 only.
    assert_eq!(
        increment(&before.0, &after.0, "nat", "KUBE-SEP-5BNLXWQSTB4SOWFG", 2),
        1
    );
    assert_eq!(
        increment(&before.0, &after.0, "nat", "KUBE-SEP-IT2ZTR26TO4XFPTO", 2),
        1
    );
    assert_eq!(
        increment(&before.1, &after.1, "nat", "KUBE-SEP-5BNLXWQSTB4SOWFG", 2),
        0
    );
    assert_eq!(
        increment(&before.1, &after.1, "filter", "cali-tw-cali3c4d", 1),
        1
    );

    let tagged: Vec<NodeReport> = node_reports
        .iter()
        .map(|r| ("node", r))
        .chain(node2_reports.iter().map(|r| ("node2", r)))
        .map(|(n, r)| NodeReport {
            node: n.into(),
            report: r.clone(),
        })
        .collect();
    for (proto, port, endpoint, delivered) in [
        ("tcp", 80, "10.244.1.5:8080", true),
        ("udp", 9, "10.244.1.5:9", false),
    ] {
        let want = Wanted {
            src: POD.into(),
            dst: vec![SERVICE.into()],
            port: Some(port),
            proto: Some(proto.into()),
        };
        let j = stitch(&want, &tagged)
            .unwrap_or_else(|| panic!("{proto}/{port}: no journey in {node_reports:#?}"));
        assert!(j.complete, "{proto}/{port}: {:?}", j.missing);
        let roles: Vec<(&str, LegRole)> =
            j.legs.iter().map(|l| (l.node.as_str(), l.role)).collect();
        assert_eq!(
            roles,
            [
                ("node", LegRole::Source),
                ("node", LegRole::Carrier),
                ("node2", LegRole::Carrier),
                ("node2", LegRole::Destination)
            ],
            "{proto}/{port}"
        );
        // Source: DNAT by the service's rule, out through the overlay device.
        let src = &j.legs[0].report;
        assert!(
            rules_of(src, "PREROUTING", "nat")
                .iter()
                .any(|t| t.contains(&format!("DNAT --to-destination {endpoint}"))),
            "{src:#}"
        );
        assert_eq!(src["egress"]["iface"], "flannel.1");
        assert_eq!(src["packet"]["last"]["dst"], POD2);
        // The carrier on both nodes: the same outer header, VNI 1, the packet after DNAT,
        // exactly as the kernel put it on node2's underlay.
        let (sent, got) = (&j.legs[1].report, &j.legs[2].report);
        assert_eq!(sent["encap"]["direction"], "encapsulated");
        assert_eq!(got["encap"]["direction"], "decapsulated");
        assert_eq!(sent["egress"]["iface"], "eth0");
        assert_eq!(got["ingress"]["iface"], "eth0");
        for c in [sent, got] {
            assert_eq!(c["encap"]["overlay"], "flannel.1");
            assert_eq!(c["encap"]["vni"], 1);
        }
        let seen = VxlanFrame::of_carrier(got);
        assert_eq!(VxlanFrame::of_carrier(sent), seen);
        assert_eq!(seen.inner_dst, endpoint);
        assert_eq!(seen.outer_dst, "192.168.60.2:4789");
        // The same frame, by its outer and inner IPv4 IDs and headers, left node's underlay
        // and reached node2's; the inner ID is the source's packet's (NAT keeps it).
        for (on, frames) in [("node", &on_node), ("node2", &on_node2)] {
            assert_eq!(
                frames.iter().filter(|f| **f == seen).count(),
                1,
                "{proto}/{port}: {seen:?} once among the frames captured on {on}'s eth0: {frames:#?}"
            );
        }
        assert_eq!(
            u64::from(seen.inner_ip_id),
            src["packet"]["ip_id"].as_u64().unwrap(),
            "{src:#}"
        );
        assert_eq!(
            j.legs[3].report["packet"]["ip_id"].as_u64(),
            Some(u64::from(seen.inner_ip_id))
        );
        // Destination: in through the overlay device; delivered to pod2, or dropped by the
        // policy's rule in FORWARD's filter table.
        let dst = &j.legs[3].report;
        assert_eq!(dst["ingress"]["iface"], "flannel.1");
        let end = j.end.as_ref().unwrap();
        assert_eq!(end.node, "node2");
        if delivered {
            assert_eq!(dst["egress"]["iface"], "cali3c4d");
            assert_eq!(end.kind, "forwarded");
        } else {
            assert_eq!(
                (end.kind.as_str(), end.hook.as_deref(), end.table.as_deref()),
                ("dropped", Some("FORWARD"), Some("filter"))
            );
            assert_eq!(
                end.rule.as_deref(),
                Some(
                    "-A cali-tw-cali3c4d -p udp -m udp --dport 9 -m comment --comment \"default/pod2: deny udp/9\" -j DROP"
                )
            );
            assert_eq!(dst["fate"]["reason"], "NETFILTER_DROP");
        }
    }
}
