//! Bridged flows judged by the kernel: a flannel/kubeadm-style node (bridge `cni0`, pods on
//! the veth ports `va` and `vb` with hairpin on, br_netfilter on for both families, an
//! outside peer behind `eth0`) holds kube-proxy-shaped nat rules (a ClusterIP whose endpoint
//! is on the same bridge, one whose endpoint is outside, the masquerade bit) and `-m physdev`
//! rules of every option, negated and not, in mangle, nat and filter. Each flow (pod to pod,
//! to a service on the same bridge, hairpin, the first packet while the node resolves the
//! endpoint, a drop by a FORWARD physdev rule, to the node, to the outside, node to pod) is
//! sent once and the per-rule counter deltas must equal the rules `explain` names, with the
//! bridge facts read from the node as `--live` reads them. Every rule matches only UDP, so
//! neighbour discovery and multicast reports never move a counter.

use std::net::IpAddr;
use std::time::Duration;

use observer_rules::{LiveNode, PacketSpec, Verdict};
use observer_tests::{Netns, privileged, unique_prefix};

use super::{Counts, Rng, quiet_veth};
use observer_tests::rules::increments;

/// Rulesets per family: the fixed rules plus this many seeded sets of random physdev rules.
const RANDOM_RULESETS: usize = 3;

/// One random `-m physdev` counting rule: options of every kind, `!` on any of them, names
/// exact, wildcard, or of no port.
fn gen_physdev(r: &mut Rng) -> String {
    const NAMES: &[&str] = &["va", "vb", "v+", "eth0", "cni0", "x+"];
    let neg = |r: &mut Rng| if r.chance(35) { "! " } else { "" };
    let mut opts = Vec::new();
    while opts.is_empty() {
        if r.chance(35) {
            opts.push(format!("{}--physdev-is-in", neg(r)));
        }
        if r.chance(35) {
            opts.push(format!("{}--physdev-is-out", neg(r)));
        }
        if r.chance(35) {
            opts.push(format!("{}--physdev-is-bridged", neg(r)));
        }
        if r.chance(45) {
            opts.push(format!("{}--physdev-in {}", neg(r), r.pick(NAMES)));
        }
        if r.chance(45) {
            opts.push(format!("{}--physdev-out {}", neg(r), r.pick(NAMES)));
        }
    }
    format!("-p udp -m physdev {}", opts.join(" "))
}

/// `rules` with a chain of random physdev rules called first from mangle PREROUTING,
/// FORWARD and POSTROUTING and from filter INPUT and FORWARD.
fn with_random(rules: &str, r: &mut Rng) -> String {
    let mut out = String::new();
    let mut table = "";
    for line in rules.lines() {
        if let Some(t) = line.strip_prefix('*') {
            table = if t == "mangle" || t == "filter" {
                t
            } else {
                ""
            };
        }
        if line == "COMMIT" && !table.is_empty() {
            let hooks: &[&str] = if table == "mangle" {
                &["PREROUTING", "FORWARD", "POSTROUTING"]
            } else {
                &["INPUT", "FORWARD"]
            };
            for h in hooks {
                for _ in 0..4 {
                    out.push_str(&format!("-A RND-{h} {}\n", gen_physdev(r)));
                }
            }
        }
        out.push_str(line);
        out.push('\n');
        if let Some(chain) = line
            .strip_prefix(':')
            .and_then(|l| l.split_whitespace().next())
            && !table.is_empty()
            && matches!(
                (table, chain),
                ("mangle", "PREROUTING" | "FORWARD" | "POSTROUTING")
                    | ("filter", "INPUT" | "FORWARD")
            )
        {
            out.push_str(&format!(":RND-{chain} - [0:0]\n"));
        }
    }
    // The jumps go first in their chains, after the declarations.
    let mut lines: Vec<String> = out.lines().map(str::to_string).collect();
    for (t, chains) in [
        ("mangle", &["PREROUTING", "FORWARD", "POSTROUTING"][..]),
        ("filter", &["INPUT", "FORWARD"][..]),
    ] {
        let start = lines
            .iter()
            .position(|l| l == &format!("*{t}"))
            .expect("table");
        let first_rule = start
            + lines[start..]
                .iter()
                .position(|l| l.starts_with("-A") || l == "COMMIT")
                .expect("rules");
        for c in chains.iter().rev() {
            lines.insert(first_rule, format!("-A {c} -j RND-{c}"));
        }
    }
    lines.join("\n") + "\n"
}

/// One family's addresses.
struct Addrs {
    v6: bool,
    pod_a: &'static str,
    pod_b: &'static str,
    gw: &'static str,
    net: &'static str,
    outside: &'static str,
    /// ClusterIP with its endpoint on the bridge (pod B), and one with it outside.
    svc_same: &'static str,
    svc_out: &'static str,
}

const V4: Addrs = Addrs {
    v6: false,
    pod_a: "10.244.0.2",
    pod_b: "10.244.0.3",
    gw: "10.244.0.1",
    net: "10.244.0.0/16",
    outside: "192.168.50.2",
    svc_same: "10.96.0.10",
    svc_out: "10.96.0.11",
};

const V6: Addrs = Addrs {
    v6: true,
    pod_a: "fd00:244::2",
    pod_b: "fd00:244::3",
    gw: "fd00:244::1",
    net: "fd00:244::/48",
    outside: "fd00:50::2",
    svc_same: "fd00:96::10",
    svc_out: "fd00:96::11",
};

impl Addrs {
    fn ep(&self, a: &str, port: u16) -> String {
        if self.v6 {
            format!("[{a}]:{port}")
        } else {
            format!("{a}:{port}")
        }
    }
    fn plen(&self) -> &str {
        if self.v6 { "128" } else { "32" }
    }
}

/// kube-proxy (iptables mode) and flannel shaped rules plus physdev counting rules.
fn ruleset(a: &Addrs) -> String {
    let p = a.plen();
    format!(
        "*mangle
:PREROUTING ACCEPT [0:0]
:INPUT ACCEPT [0:0]
:FORWARD ACCEPT [0:0]
:OUTPUT ACCEPT [0:0]
:POSTROUTING ACCEPT [0:0]
-A PREROUTING -p udp -m physdev --physdev-is-in
-A PREROUTING -p udp -m physdev --physdev-is-bridged
-A PREROUTING -p udp -m physdev ! --physdev-is-bridged
-A PREROUTING -p udp -m physdev --physdev-in va
-A PREROUTING -p udp -m physdev ! --physdev-in v+
-A PREROUTING -p udp -i cni0
-A FORWARD -p udp -m physdev --physdev-is-out
-A FORWARD -p udp -m physdev ! --physdev-is-out
-A POSTROUTING -p udp -m physdev --physdev-is-bridged --physdev-out vb
-A POSTROUTING -p udp -m physdev ! --physdev-is-out
-A POSTROUTING -p udp -o cni0
COMMIT
*nat
:PREROUTING ACCEPT [0:0]
:INPUT ACCEPT [0:0]
:OUTPUT ACCEPT [0:0]
:POSTROUTING ACCEPT [0:0]
:KUBE-SERVICES - [0:0]
:KUBE-MARK-MASQ - [0:0]
:KUBE-POSTROUTING - [0:0]
:KUBE-SVC-SAME - [0:0]
:KUBE-SEP-SAME - [0:0]
:KUBE-SVC-OUT - [0:0]
:KUBE-SEP-OUT - [0:0]
:PHYS - [0:0]
-A PREROUTING -j KUBE-SERVICES
-A OUTPUT -j KUBE-SERVICES
-A POSTROUTING -j PHYS
-A POSTROUTING -j KUBE-POSTROUTING
-A POSTROUTING -s {net} ! -d {net} -j MASQUERADE
-A PHYS -p udp -i cni0
-A PHYS -p udp -m physdev --physdev-is-bridged
-A PHYS -p udp -m physdev --physdev-in vb
-A KUBE-SERVICES -d {svc_same}/{p} -p udp -m udp --dport 80 -j KUBE-SVC-SAME
-A KUBE-SERVICES -d {svc_out}/{p} -p udp -m udp --dport 80 -j KUBE-SVC-OUT
-A KUBE-SVC-SAME -j KUBE-SEP-SAME
-A KUBE-SEP-SAME -s {pod_b}/{p} -j KUBE-MARK-MASQ
-A KUBE-SEP-SAME -p udp -m udp -j DNAT --to-destination {ep_same}
-A KUBE-SVC-OUT -j KUBE-SEP-OUT
-A KUBE-SEP-OUT -p udp -m udp -j DNAT --to-destination {ep_out}
-A KUBE-MARK-MASQ -j MARK --set-xmark 0x4000/0x4000
-A KUBE-POSTROUTING -m mark ! --mark 0x4000/0x4000 -j RETURN
-A KUBE-POSTROUTING -j MARK --set-xmark 0x4000/0x0
-A KUBE-POSTROUTING -j MASQUERADE
COMMIT
*filter
:INPUT ACCEPT [0:0]
:FORWARD ACCEPT [0:0]
:OUTPUT ACCEPT [0:0]
-A INPUT -p udp -m physdev --physdev-is-in --physdev-in v+
-A INPUT -p udp -m physdev --physdev-is-bridged
-A INPUT -p udp -m physdev ! --physdev-in va
-A FORWARD -p udp -m physdev --physdev-is-bridged --physdev-in va --physdev-out vb -m udp --dport 9999 -j DROP
-A FORWARD -p udp -m physdev --physdev-is-bridged
-A FORWARD -p udp -m physdev ! --physdev-is-bridged --physdev-is-in
-A FORWARD -p udp -m physdev --physdev-out vb
-A FORWARD -p udp -m physdev ! --physdev-out vb
-A FORWARD -p udp -m physdev --physdev-in vb ! --physdev-out vb
-A FORWARD -p udp -m physdev --physdev-in vb --physdev-out vb
-A FORWARD -p udp -m physdev ! --physdev-is-in
-A FORWARD -p udp -i cni0 -o cni0
-A FORWARD -p udp -i cni0 -o eth0
-A FORWARD -s {net} -j ACCEPT
-A FORWARD -d {net} -j ACCEPT
-A OUTPUT -p udp -m physdev ! --physdev-is-in
COMMIT
",
        net = a.net,
        svc_same = a.svc_same,
        svc_out = a.svc_out,
        pod_b = a.pod_b,
        ep_same = a.ep(a.pod_b, 8080),
        ep_out = a.ep(a.outside, 8080),
    )
}

struct Node {
    node: Netns,
    pod_a: Netns,
    pod_b: Netns,
    _ext: Netns,
}

fn mac(ns: &Netns, i: &str) -> String {
    ns.sh(&format!("cat /sys/class/net/{i}/address"))
        .trim()
        .to_string()
}

/// The node, two pods on its bridge and a peer outside; static neighbours and fdb entries
/// so nothing but our probes crosses the chains (the first-packet flow deletes one).
fn node() -> Node {
    let p = unique_prefix("rb");
    let node = Netns::new(&format!("{p}n"));
    let pod_a = Netns::new(&format!("{p}a"));
    let pod_b = Netns::new(&format!("{p}b"));
    let ext = Netns::new(&format!("{p}x"));
    node.sh(
        "ip link add cni0 type bridge
         for k in accept_dad=0 router_solicitations=0 addr_gen_mode=1; do sysctl -qw net.ipv6.conf.cni0.$k; done
         ip link set cni0 up
         sysctl -qw net.bridge.bridge-nf-call-iptables=1 net.bridge.bridge-nf-call-ip6tables=1
         sysctl -qw net.ipv4.ip_forward=1 net.ipv6.conf.all.forwarding=1
         for i in all default; do sysctl -qw net.ipv4.conf.$i.rp_filter=0; done
         sysctl -qw net.ipv4.conf.all.send_redirects=0",
    );
    quiet_veth(&pod_a, "eth0", &node, "va");
    quiet_veth(&pod_b, "eth0", &node, "vb");
    quiet_veth(&node, "eth0", &ext, "eth0");
    let (ma, mb) = (mac(&pod_a, "eth0"), mac(&pod_b, "eth0"));
    let (mn, mx) = (mac(&node, "eth0"), mac(&ext, "eth0"));
    node.sh(
        "for v in va vb; do ip link set $v master cni0; bridge link set dev $v hairpin on; done",
    );
    // The bridge takes a port's MAC when the first one joins: read it after.
    let mbr = mac(&node, "cni0");
    node.sh(&format!(
        "bridge fdb add {ma} dev va master static; bridge fdb add {mb} dev vb master static
         ip addr add 10.244.0.1/24 dev cni0; ip -6 addr add fd00:244::1/64 dev cni0 nodad
         ip addr add 192.168.50.1/24 dev eth0; ip -6 addr add fd00:50::1/64 dev eth0 nodad
         ip route add default via 192.168.50.2; ip -6 route add default via fd00:50::2
         ip neigh add 10.244.0.2 lladdr {ma} dev cni0 nud permanent
         ip neigh add 10.244.0.3 lladdr {mb} dev cni0 nud permanent
         ip neigh add fd00:244::2 lladdr {ma} dev cni0 nud permanent
         ip neigh add fd00:244::3 lladdr {mb} dev cni0 nud permanent
         ip neigh add 192.168.50.2 lladdr {mx} dev eth0 nud permanent
         ip neigh add fd00:50::2 lladdr {mx} dev eth0 nud permanent"
    ));
    for (pod, me, other, other_mac) in [(&pod_a, "2", "3", &mb), (&pod_b, "3", "2", &ma)] {
        pod.sh(&format!(
            "ip addr add 10.244.0.{me}/24 dev eth0; ip route add default via 10.244.0.1
             ip -6 addr add fd00:244::{me}/64 dev eth0 nodad; ip -6 route add default via fd00:244::1
             ip neigh add 10.244.0.1 lladdr {mbr} dev eth0 nud permanent
             ip neigh add 10.244.0.{other} lladdr {other_mac} dev eth0 nud permanent
             ip -6 neigh add fd00:244::1 lladdr {mbr} dev eth0 nud permanent
             ip -6 neigh add fd00:244::{other} lladdr {other_mac} dev eth0 nud permanent
             iptables -t raw -A PREROUTING -j DROP; ip6tables -t raw -A PREROUTING -j DROP"
        ));
    }
    ext.sh(&format!(
        "ip addr add 192.168.50.2/24 dev eth0; ip -6 addr add fd00:50::2/64 dev eth0 nodad
         ip neigh add 192.168.50.1 lladdr {mn} dev eth0 nud permanent
         ip -6 neigh add fd00:50::1 lladdr {mn} dev eth0 nud permanent
         iptables -t raw -A PREROUTING -j DROP; ip6tables -t raw -A PREROUTING -j DROP"
    ));
    // A bridge-family table around br_netfilter's hooks: before and after it on prerouting,
    // before it on forward (priority 0 is skipped for IP frames by br_nf_hook_thresh), on
    // input, output and postrouting. Every rule counts UDP only.
    let path = std::env::temp_dir().join(format!("{}.nft", node.name));
    std::fs::write(&path, BRIDGE_NFT).unwrap();
    node.sh(&format!("nft -f {}", path.display()));
    let _ = std::fs::remove_file(&path);
    // ebtables (ebtables-nft: `bridge filter` / `bridge nat` tables). IPv4 only: without
    // `--ip6-proto` (an `xt` match, undecidable) an IPv6 rule would count neighbour discovery.
    node.sh("ebtables -t filter -A FORWARD -p IPv4 -i va -o vb
         ebtables -t filter -A FORWARD -p IPv4 -o va
         ebtables -t filter -A INPUT -p IPv4 -i va
         ebtables -t filter -A OUTPUT -p IPv4 -o vb
         ebtables -t nat -A PREROUTING -p IPv4 -i vb
         ebtables -t nat -A POSTROUTING -p IPv4 -o vb");
    // The node answers nothing: a socket on every port we send to it.
    node.run(|| {
        let s = std::net::UdpSocket::bind(("::", 53)).expect("bind udp");
        std::mem::forget(s);
    });
    // Multicast listener reports for the new addresses are sent for a second or two.
    std::thread::sleep(Duration::from_millis(2500));
    Node {
        node,
        pod_a,
        pod_b,
        _ext: ext,
    }
}

const BRIDGE_NFT: &str = r#"table bridge obsb {
  chain pre {
    type filter hook prerouting priority -300; policy accept;
    meta l4proto udp iifname "va" counter
    meta l4proto udp iifname "v*" counter
    meta l4proto udp iifname "vb" udp dport 7001 counter
  }
  chain pre2 {
    type filter hook prerouting priority 100; policy accept;
    meta l4proto udp iifname "va" counter
  }
  chain forw {
    type filter hook forward priority -200; policy accept;
    meta l4proto udp oifname "vb" counter
    meta l4proto udp oifname != "va" iifname "va" counter
    meta l4proto udp udp dport 9998 counter drop
  }
  chain forw0 {
    type filter hook forward priority 0; policy accept;
    meta l4proto udp counter
    meta l4proto udp udp dport 9997 counter drop
  }
  chain forw1 {
    type filter hook forward priority 10; policy accept;
    meta l4proto udp oifname "va" counter
  }
  chain inp {
    type filter hook input priority -200; policy accept;
    meta l4proto udp iifname "va" counter
  }
  chain outp {
    type filter hook output priority 100; policy accept;
    meta l4proto udp oifname "vb" counter
  }
  chain post {
    type filter hook postrouting priority 100; policy accept;
    meta l4proto udp oifname "vb" counter
    meta l4proto udp iifname != "va" counter
  }
}
"#;

/// Per-rule packet counters of the iptables tables and of the bridge tables (keyed
/// `bridge TABLE`, chain, handle).
fn counters(node: &Netns, v6: bool) -> Counts {
    let mut out = ipt_counters(node, v6);
    let text = node.sh("nft -j list ruleset bridge");
    let v: serde_json::Value = serde_json::from_str(&text).expect("nft JSON");
    for o in v["nftables"].as_array().expect("nftables array") {
        let Some(r) = o.get("rule") else { continue };
        let packets = r["expr"]
            .as_array()
            .expect("expr")
            .iter()
            .find_map(|e| e.get("counter").and_then(|c| c["packets"].as_u64()));
        if let Some(p) = packets {
            let chain = r["chain"].as_str().expect("chain").to_string();
            let handle = r["handle"].as_u64().expect("handle") as usize;
            let table = r["table"].as_str().expect("table");
            out.insert((format!("bridge {table}"), chain, handle), p);
        }
    }
    out
}

fn ipt_counters(node: &Netns, v6: bool) -> Counts {
    let text = node.sh(if v6 {
        "ip6tables-save -c"
    } else {
        "iptables-save -c"
    });
    let file = observer_rules::iptables::parse_save(&text)
        .unwrap_or_else(|e| panic!("our parser rejects the save: {e}\n{text}"));
    observer_tests::rules::rule_counters(&file)
}

/// Who sends a flow: a pod through its bridge port, or the node itself.
#[derive(Clone, Copy, PartialEq)]
enum From {
    A,
    B,
    Node,
}

struct Flow {
    name: &'static str,
    from: From,
    dst: String,
    dport: u16,
    /// The route `explain` must say.
    route: &'static str,
    verdict: Verdict,
    /// Delete the node's neighbour entry of pod B first (IPv4: ARP resolves it again).
    flush_b: bool,
    /// Hairpin mode off on `vb` for this flow (the bridge drops a frame back out of it).
    hairpin_off: bool,
    /// `bridge-nf-call-iptables` (`-ip6tables`) 0 for this flow: bridged frames skip the IP
    /// hooks.
    nf_call_off: bool,
}

fn flows(a: &Addrs) -> Vec<Flow> {
    let f = |name, from, dst: &str, dport, route, verdict| Flow {
        name,
        from,
        dst: dst.to_string(),
        dport,
        route,
        verdict,
        flush_b: false,
        hairpin_off: false,
        nf_call_off: false,
    };
    let mut v = vec![
        f(
            "pod to pod",
            From::A,
            a.pod_b,
            7000,
            "bridged",
            Verdict::Accept,
        ),
        f(
            "pod to pod, back",
            From::B,
            a.pod_a,
            7001,
            "bridged",
            Verdict::Accept,
        ),
        f(
            "FORWARD physdev drop",
            From::A,
            a.pod_b,
            9999,
            "bridged",
            Verdict::Drop,
        ),
        f(
            "bridge forward drop",
            From::A,
            a.pod_b,
            9998,
            "bridged",
            Verdict::Drop,
        ),
        // At br_netfilter's own priority: before the IP FORWARD hook, or its rules would count.
        f(
            "bridge forward drop at priority 0",
            From::A,
            a.pod_b,
            9997,
            "bridged",
            Verdict::Drop,
        ),
        f(
            "service on the same bridge",
            From::A,
            a.svc_same,
            80,
            "bridged",
            Verdict::Accept,
        ),
        f(
            "hairpin",
            From::B,
            a.svc_same,
            80,
            "bridged",
            Verdict::Accept,
        ),
        f(
            "service outside",
            From::A,
            a.svc_out,
            80,
            "forward",
            Verdict::Accept,
        ),
        f("pod to node", From::A, a.gw, 53, "input", Verdict::Accept),
        f(
            "pod to outside",
            From::A,
            a.outside,
            7002,
            "forward",
            Verdict::Accept,
        ),
        f(
            "node to pod",
            From::Node,
            a.pod_b,
            7003,
            "output",
            Verdict::Accept,
        ),
    ];
    v.push(Flow {
        hairpin_off: true,
        ..f(
            "hairpin with hairpin mode off",
            From::B,
            a.svc_same,
            80,
            "bridged",
            Verdict::Drop,
        )
    });
    v.push(Flow {
        nf_call_off: true,
        ..f(
            "pod to pod, br_netfilter off (the FORWARD drop does not apply)",
            From::A,
            a.pod_b,
            9999,
            "bridged",
            Verdict::Accept,
        )
    });
    v.push(Flow {
        nf_call_off: true,
        ..f(
            "pod to node, br_netfilter off (routed as the bridge's own packet)",
            From::A,
            a.gw,
            53,
            "input",
            Verdict::Accept,
        )
    });
    if !a.v6 {
        v.push(Flow {
            flush_b: true,
            ..f(
                "service on the same bridge, first packet",
                From::A,
                a.svc_same,
                80,
                "bridged",
                Verdict::Accept,
            )
        });
    }
    v
}

/// Runs every flow of one family; returns (flows compared, rule counter increments).
fn run_family(n: &Node, a: &Addrs, rules: &str, sport: &mut u16) -> (usize, u64) {
    let path = std::env::temp_dir().join(format!("{}-{}.rules", n.node.name, a.v6));
    std::fs::write(&path, rules).unwrap();
    n.node.sh(&format!(
        "{} -w < {}",
        if a.v6 {
            "ip6tables-restore"
        } else {
            "iptables-restore"
        },
        path.display()
    ));
    let _ = std::fs::remove_file(&path);
    let (mut compared, mut hits) = (0, 0);
    for flow in flows(a) {
        let sysctl = if a.v6 {
            "net.bridge.bridge-nf-call-ip6tables"
        } else {
            "net.bridge.bridge-nf-call-iptables"
        };
        if flow.flush_b {
            n.node.sh(&format!("ip neigh del {} dev cni0", a.pod_b));
        }
        if flow.hairpin_off {
            n.node.sh("bridge link set dev vb hairpin off");
        }
        if flow.nf_call_off {
            n.node.sh(&format!("sysctl -qw {sysctl}=0"));
        }
        // Read as `explain --live` does, after the change the flow depends on.
        let live = n.node.run(LiveNode::read);
        assert!(
            live.failures.is_empty(),
            "reading the node: {:?}",
            live.failures
        );
        let sim = live.simulator();
        *sport += 1;
        let (src, in_iface, sender) = match flow.from {
            From::A => (a.pod_a, Some("va"), &n.pod_a),
            From::B => (a.pod_b, Some("vb"), &n.pod_b),
            From::Node => (a.gw, None, &n.node),
        };
        let mut spec = PacketSpec {
            in_iface: in_iface.map(str::to_string),
            ..PacketSpec::new(
                17,
                src.parse().unwrap(),
                Some(*sport),
                flow.dst.parse().unwrap(),
                Some(flow.dport),
            )
        };
        if flow.flush_b {
            // Without a neighbour entry nothing says which port B is behind: undecidable,
            // until the user names the port (`out vb`).
            let b = &sim.simulate(&spec)[0];
            assert_eq!(
                observer_rules::sim::verdict_of(b),
                Verdict::Undecidable,
                "{:?}",
                b.notes
            );
            assert!(
                b.notes.iter().any(|n| n.contains("no neighbour entry")),
                "{:?}",
                b.notes
            );
            spec.out_iface = Some("vb".into());
        }
        let branches = sim.simulate(&spec);
        assert_eq!(branches.len(), 1);
        let b = &branches[0];
        let what = format!(
            "{} ({}): udp {} -> {}",
            flow.name,
            if a.v6 { "IPv6" } else { "IPv4" },
            a.ep(src, *sport),
            a.ep(&flow.dst, flow.dport)
        );
        let route = b.route.map_or("", |r| r.name());
        assert_eq!(route, flow.route, "{what}: route; notes {:?}", b.notes);
        assert_eq!(
            observer_rules::sim::verdict_of(b),
            flow.verdict,
            "{what}: verdict; notes {:?}",
            b.notes
        );
        if flow.flush_b {
            assert!(
                b.notes.iter().any(|n| n.contains("not resolved")),
                "{what}: the unresolved neighbour is said: {:?}",
                b.notes
            );
        }
        let mut want = Counts::new();
        for s in &b.stages {
            for r in s.rules.iter() {
                let key = match &r.id {
                    observer_model::RuleId::Nft {
                        family,
                        table,
                        chain,
                        handle,
                    } => (format!("{family} {table}"), chain.clone(), *handle as usize),
                    observer_model::RuleId::Iptables {
                        table,
                        chain,
                        index,
                    } => (table.clone(), chain.clone(), *index),
                };
                *want.entry(key).or_default() += 1;
            }
        }
        let before = counters(&n.node, a.v6);
        let probe = observer_tests::raw::RawProbe {
            proto: 17,
            src: src.parse::<IpAddr>().unwrap(),
            dst: flow.dst.parse().unwrap(),
            sport: *sport,
            dport: flow.dport,
        };
        sender.run(move || observer_tests::raw::send_raw(&probe));
        let mut got = increments(&before, &counters(&n.node, a.v6));
        // Softirq processing (and ARP resolution for the first packet) may lag the send.
        for _ in 0..20 {
            if got == want {
                break;
            }
            std::thread::sleep(Duration::from_millis(100));
            got = increments(&before, &counters(&n.node, a.v6));
        }
        if std::env::var_os("OBSERVER_DIFF_VERBOSE").is_some() {
            eprintln!(
                "{what}: route {route} notes {:?}\n  kernel {got:?}",
                b.notes
            );
        }
        assert_eq!(
            got, want,
            "{what}: kernel counters (left) and explain (right) disagree\nnotes: {:?}\nrules:\n{rules}",
            b.notes
        );
        if flow.hairpin_off {
            n.node.sh("bridge link set dev vb hairpin on");
        }
        if flow.nf_call_off {
            n.node.sh(&format!("sysctl -qw {sysctl}=1"));
        }
        compared += 1;
        hits += want.values().sum::<u64>();
    }
    (compared, hits)
}

#[test]
fn bridged_flows_kernel_counters_agree_with_explain() {
    if !privileged("rules_differential bridged") {
        return;
    }
    let seed = std::env::var("OBSERVER_DIFF_SEED")
        .ok()
        .and_then(|s| {
            s.strip_prefix("0x")
                .map_or_else(|| s.parse().ok(), |h| u64::from_str_radix(h, 16).ok())
        })
        .unwrap_or(super::DEFAULT_SEED);
    eprintln!("rules_differential bridged: seed {seed:#x} (set OBSERVER_DIFF_SEED to replay)");
    let mut rng = Rng::new(seed ^ 0xb41d);
    let n = node();
    let mut sport = 41000;
    let (mut c4, mut c6, mut hits) = (0, 0, 0);
    for round in 0..=RANDOM_RULESETS {
        for a in [&V4, &V6] {
            let fixed = ruleset(a);
            let rules = if round == 0 {
                fixed
            } else {
                with_random(&fixed, &mut rng)
            };
            let (c, h) = run_family(&n, a, &rules, &mut sport);
            if a.v6 {
                c6 += c;
            } else {
                c4 += c;
            }
            hits += h;
        }
    }
    eprintln!(
        "rules_differential bridged: {} flows agreed ({c4} IPv4, {c6} IPv6) over {} rulesets per family, {hits} counter increments",
        c4 + c6,
        RANDOM_RULESETS + 1
    );
    assert_eq!(
        c4 + c6,
        (RANDOM_RULESETS + 1) * (flows(&V4).len() + flows(&V6).len())
    );
    assert!(hits >= 5 * (c4 + c6) as u64, "too few rules matched");
}
