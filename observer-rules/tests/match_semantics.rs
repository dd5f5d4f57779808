//! Matches found undecided on the real-world corpus, each decided the way the kernel decides
//! it: protocol and service names, conntrack's tuple options for a new connection, and the
//! stateful or input-less matches (`recent`, `hashlimit`, `mac`, `pkttype`) answered under
//! the assumption the branch's notes state.

use observer_rules::{Branch, Family};
use observer_rules::{
    Ipsets, Routes, SaveFile, Simulator, Verdict, parse_packet_spec, parse_save_family,
};

const ROUTES4: &str = include_str!("corpus/node-routes.v4.json");
const ROUTES6: &str = include_str!("corpus/node-routes.v6.json");

/// Simulates `packet` against a dump of the given family; one branch (nothing random here).
fn run(family: Family, rules: &str, packet: &str) -> Branch {
    let file = parse_save_family(rules, family).unwrap_or_else(|e| panic!("{e}\n{rules}"));
    let routes = Routes::parse_json(&[ROUTES4, ROUTES6]).unwrap();
    let (ipsets, empty) = (Ipsets::default(), SaveFile::default());
    let sim = match family {
        Family::Ipv4 => Simulator::new(&file, &empty, &ipsets, &routes),
        Family::Ipv6 => Simulator::new(&empty, &file, &ipsets, &routes),
    };
    let spec = parse_packet_spec(packet).unwrap();
    let mut branches = sim.simulate(&spec);
    assert_eq!(branches.len(), 1, "{packet}");
    branches.remove(0)
}

/// An INPUT chain with policy DROP and the given rules.
fn input(rules: &str) -> String {
    format!(
        "*filter\n:INPUT DROP [0:0]\n:FORWARD DROP [0:0]\n:OUTPUT ACCEPT [0:0]\n{rules}\nCOMMIT\n"
    )
}

fn assumed(b: &Branch) -> Vec<&str> {
    b.notes
        .iter()
        .filter(|n| n.starts_with("assumed"))
        .map(String::as_str)
        .collect()
}

/// The verdict of a branch, and the position of an iptables rule, in the tests' words.
trait Said {
    fn verdict(&self) -> Verdict;
}

impl Said for Branch {
    fn verdict(&self) -> Verdict {
        observer_rules::sim::verdict_of(self)
    }
}

trait Position {
    fn index(&self) -> usize;
}

impl Position for observer_model::Rule {
    fn index(&self) -> usize {
        match &self.id {
            observer_model::RuleId::Iptables { index, .. } => *index,
            other => panic!("an iptables rule: {other:?}"),
        }
    }
}

const TO_NODE: &str = "203.0.113.77";

#[test]
fn protocol_names_from_etc_protocols() {
    let rules = input("-A INPUT -p igmp -j ACCEPT\n-A INPUT -p vrrp -j ACCEPT");
    let v = |p: &str| run(Family::Ipv4, &rules, p).verdict();
    assert_eq!(
        v(&format!("tcp {TO_NODE}:4000 -> 203.0.113.5:22 in eth0")),
        Verdict::Drop
    );
    assert_eq!(
        v(&format!("igmp {TO_NODE} -> 203.0.113.5 in eth0")),
        Verdict::Accept
    );
    assert_eq!(
        v(&format!("112 {TO_NODE} -> 203.0.113.5 in eth0")),
        Verdict::Accept
    );
    assert_eq!(
        v(&format!("gre {TO_NODE} -> 203.0.113.5 in eth0")),
        Verdict::Drop
    );
}

#[test]
fn service_names_are_ports() {
    let rules = input(
        "-A INPUT -p tcp --dport http -j ACCEPT\n-A INPUT -p udp -m multiport --dports domain,ntp -j ACCEPT",
    );
    let v = |p: &str| run(Family::Ipv4, &rules, p).verdict();
    assert_eq!(
        v(&format!("tcp {TO_NODE}:4000 -> 203.0.113.5:80 in eth0")),
        Verdict::Accept
    );
    assert_eq!(
        v(&format!("tcp {TO_NODE}:4000 -> 203.0.113.5:81 in eth0")),
        Verdict::Drop
    );
    assert_eq!(
        v(&format!("udp {TO_NODE}:4000 -> 203.0.113.5:123 in eth0")),
        Verdict::Accept
    );
}

#[test]
fn conntrack_tuple_options_for_a_new_connection() {
    let rules = input(
        "-A INPUT -m conntrack --ctstate NEW --ctproto 6 --ctorigdstport 80 -j ACCEPT\n\
         -A INPUT -m conntrack --ctorigsrc 198.51.100.0/24 --ctreplsrcport 443 -j ACCEPT",
    );
    let v = |p: &str| run(Family::Ipv4, &rules, p);
    assert_eq!(
        v(&format!("tcp {TO_NODE}:4000 -> 203.0.113.5:80 in eth0")).verdict(),
        Verdict::Accept
    );
    // Wrong protocol, wrong port: neither rule matches.
    assert_eq!(
        v(&format!("udp {TO_NODE}:4000 -> 203.0.113.5:80 in eth0")).verdict(),
        Verdict::Drop
    );
    assert_eq!(
        v(&format!("tcp {TO_NODE}:4000 -> 203.0.113.5:81 in eth0")).verdict(),
        Verdict::Drop
    );
    // The reply tuple's source port is the packet's destination port.
    assert_eq!(
        v("tcp 198.51.100.9:4000 -> 203.0.113.5:443 in eth0").verdict(),
        Verdict::Accept
    );
    assert_eq!(
        v("tcp 198.51.100.9:443 -> 203.0.113.5:4000 in eth0").verdict(),
        Verdict::Drop
    );
    // An established connection's tuples are not known: the first rule fails on its state,
    // the second cannot be decided.
    let est = v("tcp 198.51.100.9:4000 -> 203.0.113.5:443 in eth0 state established");
    assert_eq!(est.verdict(), Verdict::Undecidable);
}

#[test]
fn conntrack_without_an_entry() {
    // In raw no entry is attached yet: a tuple option alone is false; with --ctstate the
    // match answers as the state did (xt_conntrack returns before the tuple options), so
    // `--ctproto 17` does not stop a TCP packet there.
    let rules = "*raw\n:PREROUTING ACCEPT [0:0]\n:OUTPUT ACCEPT [0:0]\n\
                 -A PREROUTING -m conntrack --ctproto 6 -j DROP\n\
                 -A PREROUTING -m conntrack --ctstate INVALID --ctproto 17 -j DROP\nCOMMIT\n";
    let b = run(
        Family::Ipv4,
        rules,
        &format!("tcp {TO_NODE}:4000 -> 203.0.113.5:80 in eth0"),
    );
    assert_eq!(b.verdict(), Verdict::Drop);
    let matched: Vec<usize> = b.stages[0].rules.iter().map(|r| r.index()).collect();
    assert_eq!(matched, [2]);
}

#[test]
fn conntrack_original_tuple_survives_dnat() {
    let rules = "*nat\n:PREROUTING ACCEPT [0:0]\n:INPUT ACCEPT [0:0]\n:OUTPUT ACCEPT [0:0]\n:POSTROUTING ACCEPT [0:0]\n\
                 -A PREROUTING -i eth0 -p tcp -m tcp --dport 8080 -j DNAT --to-destination 172.17.0.2:80\nCOMMIT\n\
                 *filter\n:INPUT ACCEPT [0:0]\n:FORWARD DROP [0:0]\n:OUTPUT ACCEPT [0:0]\n\
                 -A FORWARD -m conntrack --ctstate NEW --ctorigdstport 8080 --ctorigdst 203.0.113.5 --ctrepldstport 4000 -j ACCEPT\nCOMMIT\n";
    let b = run(
        Family::Ipv4,
        rules,
        &format!("tcp {TO_NODE}:4000 -> 203.0.113.5:8080 in eth0"),
    );
    assert_eq!(b.verdict(), Verdict::Accept, "{b:#?}");
    assert_eq!(b.egress.as_ref().map(|i| i.iface.as_str()), Some("docker0"));
}

#[test]
fn recent_is_answered_under_a_stated_assumption() {
    // The SSH brute-force guard (ufw limit, Shorewall, hand-written): set, then update with
    // a hit count. The first packet is not over the count.
    let rules = input(
        ":GUARD - [0:0]\n\
         -A INPUT -m recent --rcheck --seconds 3600 --name portscan --rsource -j DROP\n\
         -A INPUT -p tcp --dport 22 -j GUARD\n\
         -A GUARD -m recent --set --name SSH --rsource\n\
         -A GUARD -m recent --update --seconds 60 --hitcount 4 --name SSH --rsource -j DROP\n\
         -A GUARD -m recent --rcheck --seconds 60 --name SSH --rsource -j ACCEPT",
    );
    let b = run(
        Family::Ipv4,
        &rules,
        &format!("tcp {TO_NODE}:4000 -> 203.0.113.5:22 in eth0"),
    );
    assert_eq!(b.verdict(), Verdict::Accept);
    let a = assumed(&b);
    assert_eq!(a.len(), 2, "{a:?}");
    assert!(
        a[0].contains("recent `portscan`") && a[0].contains("INPUT#1"),
        "{a:?}"
    );
    assert!(
        a[1].contains("fewer than 4 hits") && a[1].contains("GUARD#2"),
        "{a:?}"
    );
    // The last rule needs no assumption: this walk put the source on the list.
    let matched: Vec<usize> = b
        .stages
        .iter()
        .flat_map(|s| s.rules.iter())
        .map(|r| r.index())
        .collect();
    assert_eq!(matched, [2, 1, 3]);
    // `! --rcheck` inverts the assumed answer.
    let rules = input("-A INPUT -m recent ! --rcheck --name x -j ACCEPT");
    let b = run(
        Family::Ipv4,
        &rules,
        &format!("udp {TO_NODE}:4000 -> 203.0.113.5:53 in eth0"),
    );
    assert_eq!(b.verdict(), Verdict::Accept);
    assert_eq!(assumed(&b).len(), 1);
}

#[test]
fn hashlimit_is_answered_under_its_rate() {
    let rules = input(
        "-A INPUT -p tcp -m hashlimit --hashlimit-above 10/sec --hashlimit-name flood -j DROP\n\
         -A INPUT -p tcp -m hashlimit --hashlimit-upto 1/sec --hashlimit-burst 5 --hashlimit-mode srcip --hashlimit-name ssh -j ACCEPT",
    );
    let b = run(
        Family::Ipv4,
        &rules,
        &format!("tcp {TO_NODE}:4000 -> 203.0.113.5:22 in eth0"),
    );
    assert_eq!(b.verdict(), Verdict::Accept);
    let a = assumed(&b);
    assert_eq!(a.len(), 2, "{a:?}");
    assert!(a[0].contains("`flood` under its rate of 10/sec"), "{a:?}");
}

#[test]
fn mac_and_pkttype() {
    // In raw PREROUTING, before routing decides anything about these addresses.
    let rules = "*raw\n:PREROUTING ACCEPT [0:0]\n:OUTPUT ACCEPT [0:0]\n\
                 -A PREROUTING -m pkttype --pkt-type broadcast -j DROP\n\
                 -A PREROUTING -m pkttype --pkt-type multicast -j DROP\n\
                 -A PREROUTING -m mac --mac-source 14:56:e2:b5:a5:eb -j DROP\nCOMMIT\n";
    let first = |p: &str| {
        let b = run(Family::Ipv4, rules, p);
        (b.stages[0].rules.first().map(|r| r.index()), b)
    };
    assert_eq!(
        first("udp 203.0.113.77:68 -> 255.255.255.255:67 in eth0").0,
        Some(1)
    );
    // The subnet's broadcast address, from the local table.
    assert_eq!(
        first("udp 203.0.113.77:68 -> 203.0.113.255:67 in eth0").0,
        Some(1)
    );
    assert_eq!(
        first("udp 203.0.113.77:5353 -> 224.0.0.251:5353 in eth0").0,
        Some(2)
    );
    let (hit, b) = first(&format!("udp {TO_NODE}:68 -> 203.0.113.5:67 in eth0"));
    assert_eq!(hit, None);
    let a = assumed(&b);
    assert!(
        a.iter()
            .any(|n| n.contains("source MAC is not 14:56:e2:b5:a5:eb")),
        "{a:?}"
    );
    assert!(
        a.iter().any(|n| n.contains("unicast link-layer address")),
        "{a:?}"
    );
    // `! --mac-source` matches under the same assumption.
    let neg = rules.replace("-m mac --mac", "-m mac ! --mac");
    let b = run(
        Family::Ipv4,
        &neg,
        &format!("udp {TO_NODE}:68 -> 203.0.113.5:67 in eth0"),
    );
    assert_eq!(b.verdict(), Verdict::Drop);
}

#[test]
fn ipv6_extension_header_matches_on_a_plain_packet() {
    // ufw's `-m rt --rt-type 0 -j DROP`: no routing header, no match (negated or not).
    let rules = "*filter\n:INPUT ACCEPT [0:0]\n:FORWARD ACCEPT [0:0]\n:OUTPUT ACCEPT [0:0]\n\
                 -A INPUT -m rt --rt-type 0 -j DROP\n-A INPUT -m rt ! --rt-type 0 -j DROP\n\
                 -A INPUT -m frag --fragid 5 -j DROP\nCOMMIT\n";
    let b = run(
        Family::Ipv6,
        rules,
        "tcp [2001:db8:1::77]:4000 -> [2001:db8:1::5]:22 in eth0",
    );
    assert_eq!(b.verdict(), Verdict::Accept, "{b:#?}");
}
