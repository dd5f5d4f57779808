//! Routing as the kernel does it, through `explain`: broadcast, multicast and martian
//! addresses are not routed as unicast; IPv6 MASQUERADE picks its source as RFC 6724 ranks
//! it; `addrtype` answers from the local table and says when only main was given.

use observer_rules::{ExplainRequest, Explanation, Hook, LiveTexts, Verdict, explain};

const ALL: &str = r#"[
 {"dst":"default","gateway":"192.0.2.1","dev":"eth0","flags":[]},
 {"dst":"192.0.2.0/24","dev":"eth0","scope":"link","prefsrc":"192.0.2.2","flags":[]},
 {"dst":"10.244.1.5","dev":"cali1","scope":"link","flags":[]},
 {"type":"local","dst":"192.0.2.2","dev":"eth0","table":"local","prefsrc":"192.0.2.2","flags":[]},
 {"type":"broadcast","dst":"192.0.2.255","dev":"eth0","table":"local","prefsrc":"192.0.2.2","flags":[]},
 {"type":"local","dst":"127.0.0.0/8","dev":"lo","table":"local","prefsrc":"127.0.0.1","flags":[]},
 {"dst":"2001:db8::/64","dev":"eth0","metric":256,"flags":[]},
 {"dst":"default","gateway":"2001:db8::1","dev":"eth0","metric":1024,"flags":[]},
 {"dst":"fd00:10::5","dev":"cali1","metric":1024,"flags":[]},
 {"type":"local","dst":"2001:db8::10","dev":"eth0","table":"local","flags":[]},
 {"type":"local","dst":"fe80::2","dev":"eth0","table":"local","flags":[]},
 {"type":"local","dst":"fe80::1","dev":"cali1","table":"local","flags":[]},
 {"type":"multicast","dst":"ff00::/8","dev":"eth0","table":"local","flags":[]}
]"#;

const MAIN_ONLY: &str = r#"[
 {"dst":"default","gateway":"192.0.2.1","dev":"eth0","flags":[]},
 {"dst":"192.0.2.0/24","dev":"eth0","scope":"link","prefsrc":"192.0.2.2","flags":[]}
]"#;

/// Accepts everything, and counts what reaches INPUT and FORWARD.
const OPEN: &str = "*filter\n:INPUT ACCEPT [0:0]\n:FORWARD ACCEPT [0:0]\n:OUTPUT ACCEPT [0:0]\n\
                    -A INPUT -j ACCEPT\n-A FORWARD -j ACCEPT\nCOMMIT\n";

fn run(rules: &str, routes: &str, packet: &str) -> Explanation {
    explain(&ExplainRequest {
        texts: LiveTexts {
            iptables: Some(rules.into()),
            ip6tables: Some(rules.into()),
            routes: vec![routes.into()],
            ..Default::default()
        },
        packet: packet.into(),
    })
    .unwrap()
}

fn route_and_verdict(e: &Explanation) -> (String, Verdict) {
    let b = &e.branches[0];
    (
        b.route.map_or("", |r| r.name()).to_string(),
        observer_rules::sim::verdict_of(b),
    )
}

/// The source a stage left the packet with (MASQUERADE's choice).
fn source_after(s: &observer_model::Stage) -> String {
    s.after
        .as_ref()
        .expect("a stage's after snapshot")
        .src
        .to_string()
}

#[test]
fn broadcast_is_delivered_not_forwarded() {
    for dst in ["255.255.255.255:67", "192.0.2.255:137"] {
        let e = run(OPEN, ALL, &format!("udp 192.0.2.7:68 -> {dst} in eth0"));
        assert_eq!(
            route_and_verdict(&e),
            ("input".into(), Verdict::Accept),
            "{dst}"
        );
    }
    // DHCP's discover: from 0.0.0.0 to the limited broadcast.
    let e = run(OPEN, ALL, "udp 0.0.0.0:68 -> 255.255.255.255:67 in eth0");
    assert_eq!(route_and_verdict(&e), ("input".into(), Verdict::Accept));
}

#[test]
fn multicast_is_delivered_to_joined_groups_and_never_forwarded() {
    // A group the inputs cannot say was joined: walked to INPUT, with the condition the
    // socket layer decides said first; never forwarded.
    let conditional = |spec: &str| {
        let e = run(OPEN, ALL, spec);
        assert_eq!(
            route_and_verdict(&e),
            ("input".into(), Verdict::Accept),
            "{spec}"
        );
        assert!(e.branches[0].egress.is_none(), "{spec}");
        assert!(
            e.branches[0]
                .notes
                .iter()
                .any(|n| n.starts_with("condition: multicast destination")
                    && n.contains("joined the group on eth0")
                    && n.contains("routing drops it before INPUT")),
            "{spec}: {:?}",
            e.branches[0].notes
        );
        assert!(
            !e.branches[0]
                .stages
                .iter()
                .any(|s| matches!(s.hook, Hook::Forward)),
            "{spec}"
        );
        assert!(
            e.branches[0]
                .stages
                .iter()
                .any(|s| matches!(s.hook, Hook::LocalIn)),
            "{spec}"
        );
    };
    conditional("udp 192.0.2.7:5353 -> 224.0.0.251:5353 in eth0");
    // All-hosts is joined by every interface: no condition.
    let e = run(OPEN, ALL, "2 192.0.2.7 -> 224.0.0.1 in eth0");
    assert_eq!(route_and_verdict(&e), ("input".into(), Verdict::Accept));
    assert!(
        !e.branches[0]
            .notes
            .iter()
            .any(|n| n.starts_with("condition:"))
    );
    // IPv6: all-nodes is joined everywhere; another group on the same condition.
    let e = run(
        OPEN,
        ALL,
        "udp [2001:db8::7]:5353 -> [ff02::1]:5353 in eth0",
    );
    assert_eq!(route_and_verdict(&e), ("input".into(), Verdict::Accept));
    conditional("udp [2001:db8::7]:5353 -> [ff02::fb]:5353 in eth0");
}

#[test]
fn martian_sources_are_dropped_by_routing() {
    for src in ["127.0.0.1", "0.0.0.0", "224.0.0.9", "255.255.255.255"] {
        let e = run(
            OPEN,
            ALL,
            &format!("udp {src}:5000 -> 192.0.2.2:53 in eth0"),
        );
        assert_eq!(
            route_and_verdict(&e),
            ("unroutable".into(), Verdict::Drop),
            "{src}"
        );
        let note = e.branches[0].notes.last().unwrap();
        assert!(note.contains("martian source"), "{src}: {note}");
        let t = e.to_model(&Default::default(), None);
        assert_eq!(t.fate.kind, observer_model::FateKind::Dropped, "{src}");
    }
    // IPv6: ip6_rcv drops a multicast or loopback source before PREROUTING.
    for src in ["[ff02::1]", "[::1]"] {
        let e = run(
            OPEN,
            ALL,
            &format!("udp {src}:5000 -> [2001:db8::10]:53 in eth0"),
        );
        assert_eq!(route_and_verdict(&e).1, Verdict::Drop, "{src}");
        assert!(e.branches[0].stages.is_empty(), "{src}: no hook sees it");
    }
}

#[test]
fn ipv6_masquerade_prefers_a_global_source_over_the_link_local_of_the_outgoing_interface() {
    let rules = "*nat\n:PREROUTING ACCEPT [0:0]\n:INPUT ACCEPT [0:0]\n:OUTPUT ACCEPT [0:0]\n\
                 :POSTROUTING ACCEPT [0:0]\n-A POSTROUTING -o cali1 -j MASQUERADE\nCOMMIT\n";
    let e = run(
        rules,
        ALL,
        "tcp [2001:db8:9::7]:40000 -> [fd00:10::5]:80 in eth0",
    );
    assert_eq!(
        e.branches[0].egress.as_ref().map(|i| i.iface.as_str()),
        Some("cali1")
    );
    let post = e.branches[0].stages.last().unwrap();
    assert_eq!(
        source_after(post),
        "[2001:db8::10]:40000",
        "{}",
        e.render_tree()
    );
    // Towards a link-local destination only the outgoing interface's addresses count.
    let e = run(
        rules,
        ALL,
        "tcp [2001:db8:9::7]:40000 -> [fe80::99]:80 in eth0 out cali1",
    );
    let post = e.branches[0].stages.last().unwrap();
    assert_eq!(source_after(post), "[fe80::1]:40000");
}

#[test]
fn addrtype_local_needs_the_local_table_and_says_so() {
    let rules = "*filter\n:INPUT DROP [0:0]\n:FORWARD DROP [0:0]\n:OUTPUT ACCEPT [0:0]\n\
                 -A INPUT -m addrtype --dst-type LOCAL -j ACCEPT\nCOMMIT\n";
    // With the local table: the node's address is LOCAL.
    let e = run(rules, ALL, "tcp 198.51.100.7:40000 -> 192.0.2.2:22 in eth0");
    assert_eq!(route_and_verdict(&e), ("input".into(), Verdict::Accept));
    // Main only: the prefsrc says the address is the node's (INPUT), but addrtype cannot
    // answer; it says why instead of answering false.
    let e = run(
        rules,
        MAIN_ONLY,
        "tcp 198.51.100.7:40000 -> 192.0.2.2:22 in eth0",
    );
    assert_eq!(
        route_and_verdict(&e),
        ("input".into(), Verdict::Undecidable)
    );
    let note = e.branches[0].stages.last().unwrap().note.clone().unwrap();
    assert!(note.contains("local table is missing"), "{note}");
    // A forwarded packet with main only carries the same caveat as a note.
    let e = run(
        OPEN,
        MAIN_ONLY,
        "tcp 198.51.100.7:40000 -> 8.8.8.8:53 in eth0",
    );
    assert_eq!(route_and_verdict(&e), ("forward".into(), Verdict::Accept));
    assert!(
        e.branches[0]
            .notes
            .iter()
            .any(|n| n.contains("local table is missing")),
        "{:?}",
        e.branches[0].notes
    );
}
