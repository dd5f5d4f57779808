//! The br_netfilter path in `explain`: a flannel-style node (bridge `cni0`, pods on veth
//! ports, hairpin on, kube-proxy's ClusterIP with an endpoint on the same bridge, FORWARD
//! rules with `-m physdev`), each flow's route (bridged or routed), devices and rules.

use observer_rules::{BridgeTexts, ExplainRequest, LiveTexts, Verdict, explain};

/// The route's name, as the tests state it.
fn route_name(b: &observer_rules::Branch) -> &'static str {
    b.route.map_or("", |r| r.name())
}

/// An iptables rule's position (`CHAIN#N`).
fn rule_index(r: &observer_model::Rule) -> usize {
    match &r.id {
        observer_model::RuleId::Iptables { index, .. } => *index,
        other => panic!("an iptables rule: {other:?}"),
    }
}

const RULES: &str = "*nat
:PREROUTING ACCEPT [0:0]
:INPUT ACCEPT [0:0]
:OUTPUT ACCEPT [0:0]
:POSTROUTING ACCEPT [0:0]
:KUBE-MARK-MASQ - [0:0]
:KUBE-POST - [0:0]
:KUBE-SVC-A - [0:0]
:KUBE-SEP-B - [0:0]
-A PREROUTING -j KUBE-SVC-A
-A POSTROUTING -j KUBE-POST
-A KUBE-POST -i cni0 -j RETURN
-A POSTROUTING -m mark --mark 0x4000/0x4000 -j MASQUERADE
-A KUBE-MARK-MASQ -j MARK --set-xmark 0x4000/0x4000
-A KUBE-SVC-A -d 10.96.0.10/32 -p udp -m udp --dport 80 -j KUBE-SEP-B
-A KUBE-SEP-B -s 10.244.0.3/32 -j KUBE-MARK-MASQ
-A KUBE-SEP-B -p udp -j DNAT --to-destination 10.244.0.3:8080
COMMIT
*filter
:INPUT ACCEPT [0:0]
:FORWARD ACCEPT [0:0]
:OUTPUT ACCEPT [0:0]
-A INPUT -m physdev --physdev-is-in --physdev-in veth+
-A FORWARD -m physdev --physdev-is-bridged --physdev-out vethb -p udp -m udp --dport 9999 -j DROP
-A FORWARD -m physdev --physdev-is-bridged --physdev-in vetha --physdev-out vethb
-A FORWARD -m physdev ! --physdev-is-bridged --physdev-is-in
-A FORWARD -m physdev --physdev-is-out
-A FORWARD -i cni0 -o cni0
-A FORWARD -m physdev ! --physdev-in vetha
COMMIT
";

const ROUTES: &str = r#"[
 {"type":"local","dst":"10.244.0.1","dev":"cni0","table":"local","prefsrc":"10.244.0.1"},
 {"type":"local","dst":"192.168.0.10","dev":"eth0","table":"local","prefsrc":"192.168.0.10"},
 {"dst":"10.244.0.0/24","dev":"cni0","prefsrc":"10.244.0.1"},
 {"dst":"default","gateway":"192.168.0.1","dev":"eth0"}]"#;

const LINKS: &str = r#"[{"ifname":"vetha","master":"cni0","hairpin":true},{"ifname":"vethb","master":"cni0","hairpin":true}]"#;
const NEIGH: &str = r#"[{"dst":"10.244.0.2","dev":"cni0","lladdr":"02:00:00:00:00:02","state":["REACHABLE"]},
 {"dst":"10.244.0.3","dev":"cni0","lladdr":"02:00:00:00:00:03","state":["REACHABLE"]}]"#;
const FDB: &str = r#"[{"mac":"02:00:00:00:00:02","ifname":"vetha","master":"cni0"},{"mac":"02:00:00:00:00:03","ifname":"vethb","master":"cni0"}]"#;

fn req(packet: &str) -> ExplainRequest {
    ExplainRequest {
        texts: LiveTexts {
            iptables: Some(RULES.into()),
            routes: vec![ROUTES.into()],
            bridge: Box::new(BridgeTexts {
                bridge_links: Some(LINKS.into()),
                neigh: Some(NEIGH.into()),
                fdb: Some(FDB.into()),
                bridge_nf_call: [Some(true), Some(true)],
                ..Default::default()
            }),
            ..Default::default()
        },
        packet: packet.into(),
    }
}

/// `HOOK table CHAIN#N` of every matched rule, in order.
fn rules(e: &observer_rules::Explanation) -> Vec<String> {
    e.branches[0]
        .stages
        .iter()
        .flat_map(|s| {
            s.rules.iter().map(move |r| {
                format!(
                    "{} {} {}#{}",
                    s.hook.name(),
                    r.id.table(),
                    r.id.chain(),
                    rule_index(r)
                )
            })
        })
        .collect()
}

#[test]
fn pod_to_pod_on_the_bridge_is_bridged_with_both_ports() {
    let e = explain(&req("udp 10.244.0.2:5000 -> 10.244.0.3:7000 in vetha")).unwrap();
    let b = &e.branches[0];
    assert_eq!(route_name(b), "bridged");
    assert_eq!(b.egress.as_ref().map(|i| i.iface.as_str()), Some("vethb"));
    assert_eq!(e.verdict(), Verdict::Accept);
    assert_eq!(
        rules(&e),
        [
            "PREROUTING nat PREROUTING#1",
            // physdev-in vetha and out vethb; `-i cni0 -o cni0`; not `! --physdev-is-bridged`.
            "FORWARD filter FORWARD#2",
            "FORWARD filter FORWARD#4",
            "FORWARD filter FORWARD#5",
            // POSTROUTING of a bridged frame has no input device: `-i cni0` does not match.
            "POSTROUTING nat POSTROUTING#1",
        ]
    );
    assert!(e.notes.is_empty(), "{:?}", e.notes);
    assert!(
        b.notes
            .iter()
            .any(|n| n.contains("in port vetha, out port vethb"))
    );
    let j = e.to_json();
    assert_eq!(j["route"], "bridged");
    assert_eq!(j["egress"]["iface"], "vethb");
    assert_eq!(j["fate"]["kind"], "forwarded");
    assert_eq!(j["bridge"]["name"], "cni0");
    assert_eq!(j["bridge"]["physdev_in"], "vetha");
    assert_eq!(j["bridge"]["physdev_out"], "vethb");
}

#[test]
fn a_forward_physdev_rule_drops_a_bridged_frame() {
    let e = explain(&req("udp 10.244.0.2:5000 -> 10.244.0.3:9999 in vetha")).unwrap();
    assert_eq!(e.verdict(), Verdict::Drop);
    assert_eq!(
        rules(&e),
        ["PREROUTING nat PREROUTING#1", "FORWARD filter FORWARD#1"]
    );
}

#[test]
fn clusterip_with_an_endpoint_on_the_same_bridge_is_bridged_after_dnat() {
    let e = explain(&req("udp 10.244.0.2:5000 -> 10.96.0.10:80 in vetha")).unwrap();
    let b = &e.branches[0];
    assert_eq!(route_name(b), "bridged");
    assert_eq!(b.egress.as_ref().map(|i| i.iface.as_str()), Some("vethb"));
    assert!(
        b.notes
            .iter()
            .any(|n| n.contains("br_nf_pre_routing_finish_bridge")),
        "{:?}",
        b.notes
    );
    let pre = &b.stages[0];
    assert_eq!(
        pre.after.as_ref().unwrap().dst.to_string(),
        "10.244.0.3:8080"
    );
    assert!(rules(&e).contains(&"FORWARD filter FORWARD#2".to_string()));
    // Without a usable neighbour entry the first packet leaves through cni0's own transmit.
    let mut r = req("udp 10.244.0.2:5000 -> 10.96.0.10:80 in vetha");
    r.texts.bridge.neigh = Some(
        r#"[{"dst":"10.244.0.3","dev":"cni0","lladdr":"02:00:00:00:00:03","state":["FAILED"]}]"#
            .into(),
    );
    let e = explain(&r).unwrap();
    assert_eq!(
        e.branches[0].egress.as_ref().map(|i| i.iface.as_str()),
        Some("vethb")
    );
    assert!(
        e.branches[0]
            .notes
            .iter()
            .any(|n| n.contains("not resolved") && n.contains("cni0's own transmit")),
        "{:?}",
        e.branches[0].notes
    );
}

#[test]
fn hairpin_goes_back_out_of_its_port_masqueraded_or_is_dropped_without_hairpin() {
    let e = explain(&req("udp 10.244.0.3:5000 -> 10.96.0.10:80 in vethb")).unwrap();
    let b = &e.branches[0];
    assert_eq!(route_name(b), "bridged");
    assert_eq!(b.egress.as_ref().map(|i| i.iface.as_str()), Some("vethb"));
    let post = b.stages.last().unwrap();
    assert_eq!(&*post.table, "nat");
    // MASQUERADE picks the bridge's address: IP POSTROUTING's out device is cni0.
    assert_eq!(
        post.after.as_ref().unwrap().src.to_string(),
        "10.244.0.1:5000"
    );
    assert!(rules(&e).contains(&"POSTROUTING nat POSTROUTING#2".to_string()));
    let mut r = req("udp 10.244.0.3:5000 -> 10.96.0.10:80 in vethb");
    r.texts.bridge.bridge_links = Some(
        r#"[{"ifname":"vetha","master":"cni0","hairpin":true},{"ifname":"vethb","master":"cni0","hairpin":false}]"#.into(),
    );
    let e = explain(&r).unwrap();
    assert_eq!(e.verdict(), Verdict::Drop);
    assert!(
        e.branches[0]
            .notes
            .iter()
            .any(|n| n.contains("hairpin mode off")),
        "{:?}",
        e.branches[0].notes
    );
    // Hairpin mode not given (`bridge -j link` without -d): undecidable, not guessed.
    r.texts.bridge.bridge_links = Some(r#"[{"ifname":"vethb","master":"cni0"}]"#.into());
    let e = explain(&r).unwrap();
    assert_eq!(e.verdict(), Verdict::Undecidable);
}

#[test]
fn pod_to_outside_and_to_the_node_are_routed_with_the_in_port_known() {
    let e = explain(&req("udp 10.244.0.2:5000 -> 8.8.8.8:53 in vetha")).unwrap();
    let b = &e.branches[0];
    assert_eq!(route_name(b), "forward");
    assert_eq!(b.egress.as_ref().map(|i| i.iface.as_str()), Some("eth0"));
    assert_eq!(
        rules(&e),
        [
            "PREROUTING nat PREROUTING#1",
            // `! --physdev-is-bridged --physdev-is-in`; not is-out; not `! --physdev-in vetha`.
            "FORWARD filter FORWARD#3",
            // A routed packet keeps its input device (cni0) at POSTROUTING.
            "POSTROUTING nat POSTROUTING#1",
            "POSTROUTING nat KUBE-POST#1",
        ]
    );
    let j = e.to_json();
    assert_eq!(j["bridge"]["physdev_in"], "vetha");
    assert!(j["bridge"]["physdev_out"].is_null());
    // Sent by the node through the bridge: out port from the neighbour and fdb.
    let e = explain(&req("udp 10.244.0.1:5000 -> 10.244.0.3:53")).unwrap();
    assert_eq!(route_name(&e.branches[0]), "output");
    let j = e.to_json();
    assert!(j["bridge"]["physdev_in"].is_null());
    assert_eq!(j["bridge"]["physdev_out"], "vethb");
    let e = explain(&req("udp 10.244.0.2:5000 -> 10.244.0.1:53 in vetha")).unwrap();
    assert_eq!(route_name(&e.branches[0]), "input");
    assert!(rules(&e).contains(&"INPUT filter INPUT#1".to_string()));
}

#[test]
fn physdev_without_bridge_ports_stays_undecidable() {
    let mut r = req("udp 10.244.0.2:5000 -> 10.244.0.3:7000 in vetha");
    r.texts.bridge.bridge_links = None;
    let e = explain(&r).unwrap();
    assert_eq!(e.verdict(), Verdict::Undecidable);
    assert!(
        e.notes.iter().any(|n| n.contains("physdev")),
        "{:?}",
        e.notes
    );
    // A packet that never met a bridge, with the ports known: no nf_bridge, only inverted
    // options match (`! --physdev-in vetha`).
    let e = explain(&req("udp 192.168.0.7:5000 -> 8.8.4.4:53 in eth0")).unwrap();
    assert_eq!(route_name(&e.branches[0]), "forward");
    assert_eq!(
        rules(&e),
        [
            "PREROUTING nat PREROUTING#1",
            "FORWARD filter FORWARD#6",
            "POSTROUTING nat POSTROUTING#1",
        ]
    );
}

#[test]
fn the_out_port_unknown_makes_physdev_out_undecidable() {
    let mut r = req("udp 10.244.0.2:5000 -> 10.244.0.3:7000 in vetha");
    r.texts.bridge.fdb = None;
    let e = explain(&r).unwrap();
    assert_eq!(route_name(&e.branches[0]), "bridged");
    assert_eq!(e.verdict(), Verdict::Undecidable);
    // `--physdev-is-bridged` needs only that there is an out port, not its name: FORWARD#1
    // fails on its port (9999) whatever the out port, FORWARD#2 stops at its out name.
    let fwd = e.branches[0].stages.last().unwrap();
    let named: Vec<(usize, bool)> = fwd
        .rules
        .iter()
        .map(|r| (rule_index(r), r.undecidable.is_some()))
        .collect();
    assert_eq!(named, [(2, true)], "{:?}", fwd.rules);
    assert!(
        fwd.rules[0]
            .undecidable
            .as_deref()
            .is_some_and(|w| w.contains("--fdb")),
        "{:?}",
        fwd.rules[0]
    );
    let only_bridged = "*filter\n:INPUT ACCEPT [0:0]\n:FORWARD ACCEPT [0:0]\n:OUTPUT ACCEPT [0:0]\n-A FORWARD -m physdev --physdev-is-bridged --physdev-is-out -j DROP\nCOMMIT\n";
    let mut r2 = r.clone();
    r2.texts.iptables = Some(only_bridged.into());
    assert_eq!(explain(&r2).unwrap().verdict(), Verdict::Drop);
    // Named in the packet, the port decides.
    r.packet = "udp 10.244.0.2:5000 -> 10.244.0.3:7000 in vetha out vethb".into();
    assert_eq!(explain(&r).unwrap().verdict(), Verdict::Accept);
}

#[test]
fn bridge_nf_call_off_skips_the_ip_hooks_for_bridged_frames() {
    let mut r = req("udp 10.244.0.2:5000 -> 10.244.0.3:9999 in vetha");
    r.texts.bridge.bridge_nf_call = [Some(false), Some(false)];
    let e = explain(&r).unwrap();
    assert_eq!(route_name(&e.branches[0]), "bridged");
    assert_eq!(e.verdict(), Verdict::Accept);
    assert!(rules(&e).is_empty(), "{:?}", rules(&e));
}

#[test]
fn nft_bridge_tables_run_around_br_netfilter() {
    let nft = r#"{"nftables":[
      {"table":{"family":"bridge","name":"f","handle":1}},
      {"chain":{"family":"bridge","table":"f","name":"pre","handle":1,"type":"filter","hook":"prerouting","prio":-300,"policy":"accept"}},
      {"chain":{"family":"bridge","table":"f","name":"fwd","handle":2,"type":"filter","hook":"forward","prio":-200,"policy":"accept"}},
      {"chain":{"family":"bridge","table":"f","name":"fwd0","handle":3,"type":"filter","hook":"forward","prio":0,"policy":"accept"}},
      {"chain":{"family":"bridge","table":"f","name":"fwd9","handle":6,"type":"filter","hook":"forward","prio":9,"policy":"accept"}},
      {"rule":{"family":"bridge","table":"f","chain":"pre","handle":4,"expr":[{"match":{"op":"==","left":{"meta":{"key":"iifname"}},"right":"vetha"}},{"match":{"op":"==","left":{"payload":{"protocol":"ether","field":"type"}},"right":"ip"}},{"match":{"op":"==","left":{"meta":{"key":"ibrname"}},"right":"cni0"}},{"counter":{"packets":0,"bytes":0}}]}},
      {"rule":{"family":"bridge","table":"f","chain":"fwd","handle":5,"expr":[{"match":{"op":"==","left":{"meta":{"key":"oifname"}},"right":"vethb"}},{"match":{"op":"==","left":{"payload":{"protocol":"udp","field":"dport"}},"right":9998}},{"drop":null}]}}
    ]}"#;
    let mut r = req("udp 10.244.0.2:5000 -> 10.244.0.3:7000 in vetha");
    r.texts.nft = Some(nft.into());
    let e = explain(&r).unwrap();
    let b = &e.branches[0];
    assert_eq!(e.verdict(), Verdict::Accept, "{:?}", b.notes);
    let chains: Vec<String> = b
        .stages
        .iter()
        .map(|s| match &s.chain {
            Some(c) => format!("{} {} {}", s.hook.name(), c.family, c.name),
            None => format!("{} {}", s.hook.name(), s.table),
        })
        .collect();
    // Bridge chains up to br_netfilter's priority (0) run before the IP hook, later ones after.
    assert_eq!(
        chains,
        [
            "PREROUTING bridge pre",
            "PREROUTING nat",
            "FORWARD bridge fwd",
            "FORWARD bridge fwd0",
            "FORWARD filter",
            "FORWARD bridge fwd9",
            "POSTROUTING nat",
        ]
    );
    assert_eq!(
        b.stages[0].rules.len(),
        1,
        "iifname vetha and ibrname cni0 match"
    );
    r.packet = "udp 10.244.0.2:5000 -> 10.244.0.3:9998 in vetha".into();
    let e = explain(&r).unwrap();
    assert_eq!(e.verdict(), Verdict::Drop);
    assert_eq!(&*e.branches[0].stages.last().unwrap().table, "f");
    // The out port not known (no fdb): a bridge chain's `oifname` is undecidable there,
    // not a miss (the frame may well leave by vethb and be dropped).
    r.texts.bridge.fdb = None;
    let e = explain(&r).unwrap();
    assert_eq!(
        e.verdict(),
        Verdict::Undecidable,
        "{:?}",
        e.branches[0].notes
    );
    let fwd = e.branches[0]
        .stages
        .iter()
        .find(|s| s.chain.as_ref().is_some_and(|c| c.name == "fwd"))
        .expect("the bridge forward chain ran");
    assert!(
        fwd.rules.iter().any(|r| r
            .undecidable
            .as_deref()
            .is_some_and(|w| w.contains("oifname"))),
        "{:?}",
        fwd.rules
    );
}

const RULES6: &str = "*filter
:INPUT ACCEPT [0:0]
:FORWARD ACCEPT [0:0]
:OUTPUT ACCEPT [0:0]
-A FORWARD -m physdev --physdev-is-bridged --physdev-in vetha --physdev-out vethb -p udp -m udp --dport 9999 -j DROP
-A FORWARD -m physdev --physdev-is-bridged
COMMIT
";

#[test]
fn ipv6_frames_walk_ip6tables_through_br_netfilter() {
    let routes6 = r#"[{"type":"local","dst":"fd00:244::1","dev":"cni0","table":"local"},
      {"dst":"fd00:244::/64","dev":"cni0"}]"#;
    let r = ExplainRequest {
        texts: LiveTexts {
            ip6tables: Some(RULES6.into()),
            routes: vec![routes6.into()],
            bridge: Box::new(BridgeTexts {
                bridge_links: Some(LINKS.into()),
                ..Default::default()
            }),
            ..Default::default()
        },
        packet: "udp [fd00:244::2]:5000 -> [fd00:244::3]:9999 in vetha out vethb".into(),
    };
    let e = explain(&r).unwrap();
    assert_eq!(route_name(&e.branches[0]), "bridged");
    assert_eq!(e.verdict(), Verdict::Drop);
    assert!(
        e.branches[0]
            .notes
            .iter()
            .any(|n| n.contains("bridge-nf-call-ip6tables not given")),
        "{:?}",
        e.branches[0].notes
    );
    let e = explain(&ExplainRequest {
        packet: "udp [fd00:244::2]:5000 -> [fd00:244::3]:7000 in vetha out vethb".into(),
        ..r
    })
    .unwrap();
    assert_eq!(e.verdict(), Verdict::Accept);
    assert_eq!(e.branches[0].stages[0].rules.len(), 1);
}
