//! Privileged tests in the two-node lab (`observer lab up --nodes 2`): one observer per node,
//! a packet DNATed on the source node, carried by VXLAN and delivered on the other node, and
//! one dropped there by the policy. Judged by the kernel: each node's rule counters, and the
//! VXLAN frames captured on the destination node's underlay interface (outer and inner
//! headers), against the reports and the journey stitched from them.

use std::time::{Duration, Instant};

use observer_model::stitch::{LegRole, NodeReport, Wanted, stitch};
use observer_tests::lab::{Lab, TIMEOUT, Tail, tcp_client, tcp_echo};
use observer_tests::privileged;
use observer_tests::rules::{Counts, lab_counters};
use serde_json::Value;

const POD: &str = "10.244.0.5";
const POD2: &str = "10.244.1.5";
const SERVICE: &str = "10.96.0.30";

fn increment(before: &Counts, after: &Counts, table: &str, chain: &str, index: usize) -> u64 {
    let k = (table.to_string(), chain.to_string(), index);
    after.get(&k).copied().unwrap_or(0) - before.get(&k).copied().unwrap_or(0)
}

/// One VXLAN frame as the kernel handed it to a packet socket: outer addresses and UDP
/// ports, the VNI, and the inner packet's protocol, addresses and ports.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Frame {
    outer_src: String,
    outer_dst: String,
    vni: u32,
    inner_proto: &'static str,
    inner_src: String,
    inner_dst: String,
}

fn parse_frame(f: &[u8]) -> Option<Frame> {
    // Ethernet (14), IPv4 (ihl), UDP (8), VXLAN (8), inner Ethernet (14), inner IPv4.
    if f.len() < 14 + 20 || f[12..14] != [0x08, 0x00] {
        return None;
    }
    let ip = &f[14..];
    let ihl = usize::from(ip[0] & 0x0f) * 4;
    if ip[9] != 17 || ip.len() < ihl + 8 + 8 + 14 + 24 {
        return None;
    }
    let udp = &ip[ihl..];
    if u16::from_be_bytes([udp[2], udp[3]]) != 4789 {
        return None;
    }
    let vx = &udp[8..];
    let inner = &vx[8 + 14..];
    let iihl = usize::from(inner[0] & 0x0f) * 4;
    let addr = |b: &[u8]| format!("{}.{}.{}.{}", b[0], b[1], b[2], b[3]);
    let port = |b: &[u8], at: usize| u16::from_be_bytes([b[at], b[at + 1]]);
    let l4 = &inner[iihl..];
    Some(Frame {
        outer_src: format!("{}:{}", addr(&ip[12..16]), port(udp, 0)),
        outer_dst: format!("{}:{}", addr(&ip[16..20]), port(udp, 2)),
        vni: (u32::from(vx[4]) << 16) | (u32::from(vx[5]) << 8) | u32::from(vx[6]),
        inner_proto: match inner[9] {
            6 => "tcp",
            17 => "udp",
            _ => "other",
        },
        inner_src: format!("{}:{}", addr(&inner[12..16]), port(l4, 0)),
        inner_dst: format!("{}:{}", addr(&inner[16..20]), port(l4, 2)),
    })
}

/// Captures, on `eth0` of the lab namespace `role`, every VXLAN frame until `stop` is set
/// or [`TIMEOUT`] passes: a packet socket (the kernel's own view, like tcpdump's).
fn capture(
    lab: &Lab,
    role: &str,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
) -> std::thread::JoinHandle<Vec<Frame>> {
    let (tx, rx) = std::sync::mpsc::channel();
    let path = lab.ns_path(role);
    let h = std::thread::spawn(move || {
        observer_tests::enter_netns(&path);
        // SAFETY: plain socket calls on a descriptor this thread owns and closes.
        unsafe {
            let proto = (libc::ETH_P_ALL as u16).to_be();
            let fd = libc::socket(libc::AF_PACKET, libc::SOCK_RAW, i32::from(proto));
            assert!(
                fd >= 0,
                "packet socket: {}",
                std::io::Error::last_os_error()
            );
            let name = std::ffi::CString::new("eth0").unwrap();
            let mut sll: libc::sockaddr_ll = std::mem::zeroed();
            sll.sll_family = libc::AF_PACKET as u16;
            sll.sll_protocol = proto;
            sll.sll_ifindex = libc::if_nametoindex(name.as_ptr()) as i32;
            let bound = libc::bind(
                fd,
                (&raw const sll).cast(),
                std::mem::size_of::<libc::sockaddr_ll>() as u32,
            );
            assert_eq!(bound, 0, "bind: {}", std::io::Error::last_os_error());
            let tv = libc::timeval {
                tv_sec: 0,
                tv_usec: 100_000,
            };
            libc::setsockopt(
                fd,
                libc::SOL_SOCKET,
                libc::SO_RCVTIMEO,
                (&raw const tv).cast(),
                std::mem::size_of::<libc::timeval>() as u32,
            );
            tx.send(()).unwrap();
            let deadline = Instant::now() + TIMEOUT;
            let mut frames = Vec::new();
            let mut buf = [0u8; 2048];
            while !stop.load(std::sync::atomic::Ordering::Relaxed) && Instant::now() < deadline {
                let n = libc::recv(fd, buf.as_mut_ptr().cast(), buf.len(), 0);
                if n > 0
                    && let Some(f) = parse_frame(&buf[..n as usize])
                {
                    frames.push(f);
                }
            }
            libc::close(fd);
            frames
        }
    });
    rx.recv_timeout(TIMEOUT).expect("capture started");
    h
}

fn encap_frame(r: &Value) -> Frame {
    let e = &r["encap"];
    let s = |v: &Value| v.as_str().unwrap().to_string();
    Frame {
        outer_src: s(&e["outer_src"]),
        outer_dst: s(&e["outer_dst"]),
        vni: e["vni"].as_u64().unwrap() as u32,
        inner_proto: match e["inner"]["proto"].as_str().unwrap() {
            "tcp" => "tcp",
            "udp" => "udp",
            _ => "other",
        },
        inner_src: s(&e["inner"]["src"]),
        inner_dst: s(&e["inner"]["dst"]),
    }
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
        Tail::start_on(&lab, "node", &[], &[]),
        Tail::start_on(
            &lab,
            "node2",
            &["--record", recording.to_str().unwrap()],
            &[],
        ),
    ];
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let frames = capture(&lab, "node2", stop.clone());

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
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let frames = frames.join().unwrap();
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
            .map(|r| r["encap"].clone())
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

    // The kernel's counters on both nodes: DNAT on node only (node2 sees pod2's address
    // already), the policy's DROP on node2 only.
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
        let seen = encap_frame(got);
        assert_eq!(encap_frame(sent), seen);
        assert_eq!(seen.inner_dst, endpoint);
        assert_eq!(seen.outer_dst, "192.168.60.2:4789");
        assert!(
            frames.contains(&seen),
            "{proto}/{port}: {seen:?} not among the frames captured on node2's eth0: {frames:#?}"
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
