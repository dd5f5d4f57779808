//! The third seed's node: kube-proxy in IPVS mode with Calico, CNI portmap and Docker (the
//! IPVS lab's own files, `lab/node-ipvs.*`), explained from `iptables-save`, `ipset save`,
//! `ipvsadm -Sn` and the node's routes: IPVS's step at LOCAL_IN 99 (or LOCAL_OUT -98), the
//! destination rewritten there, the request sent through OUTPUT and POSTROUTING (never
//! FORWARD), every candidate real server listed with the scheduler named.

use observer_model::{FateKind, Hook, NatSource, Traversal, Verdict};
use observer_rules::{ExplainRequest, LiveTexts, explain};

const RULES: &str = include_str!("../../lab/node-ipvs.rules");
const RULES6: &str = include_str!("../../lab/node6-ipvs.rules");
const IPSETS: &str = include_str!("../../lab/node-ipvs.ipsets");
const IPVSADM: &str = include_str!("../../lab/node-ipvs.ipvsadm");

/// The lab node's routes (`ip -j -4 route show table all`), kube-ipvs0 holding the
/// ClusterIPs, node2's pod network behind ext (203.0.113.10).
const ROUTES4: &str = r#"[
 {"dst":"default","gateway":"203.0.113.10","dev":"eth1","flags":[]},
 {"dst":"198.51.100.0/24","dev":"eth0","protocol":"kernel","scope":"link","prefsrc":"198.51.100.1","flags":[]},
 {"dst":"203.0.113.0/24","dev":"eth1","protocol":"kernel","scope":"link","prefsrc":"203.0.113.1","flags":[]},
 {"dst":"10.244.2.0/24","gateway":"203.0.113.10","dev":"eth1","flags":[]},
 {"dst":"172.17.0.5","dev":"cali1a2b","scope":"link","flags":[]},
 {"dst":"192.170.1.5","dev":"cali2c3d","scope":"link","flags":[]},
 {"type":"local","dst":"198.51.100.1","dev":"eth0","table":"local","prefsrc":"198.51.100.1","flags":[]},
 {"type":"local","dst":"203.0.113.1","dev":"eth1","table":"local","prefsrc":"203.0.113.1","flags":[]},
 {"type":"local","dst":"169.254.1.1","dev":"cali1a2b","table":"local","prefsrc":"169.254.1.1","flags":[]},
 {"type":"local","dst":"10.10.10.2","dev":"kube-ipvs0","table":"local","prefsrc":"10.10.10.2","flags":[]},
 {"type":"local","dst":"10.10.10.3","dev":"kube-ipvs0","table":"local","prefsrc":"10.10.10.3","flags":[]},
 {"type":"local","dst":"10.10.10.4","dev":"kube-ipvs0","table":"local","prefsrc":"10.10.10.4","flags":[]},
 {"type":"local","dst":"10.10.10.10","dev":"kube-ipvs0","table":"local","prefsrc":"10.10.10.10","flags":[]},
 {"type":"local","dst":"127.0.0.0/8","dev":"lo","table":"local","prefsrc":"127.0.0.1","flags":[]}
]"#;

const ROUTES6: &str = r#"[
 {"dst":"2001:db8:1::/64","dev":"eth0","protocol":"kernel","flags":[]},
 {"dst":"2001:db8:2::/64","dev":"cali1a2b","protocol":"kernel","flags":[]},
 {"type":"local","dst":"2001:db8:1::1","dev":"eth0","table":"local","flags":[]},
 {"type":"local","dst":"2001:db8:2::1","dev":"cali1a2b","table":"local","flags":[]},
 {"type":"local","dst":"fd00:10::2","dev":"kube-ipvs0","table":"local","flags":[]}
]"#;

const ADDRS: &str = r#"[
 {"ifname":"eth0","addr_info":[{"family":"inet","local":"198.51.100.1","prefixlen":24},{"family":"inet6","local":"2001:db8:1::1","prefixlen":64}]},
 {"ifname":"eth1","addr_info":[{"family":"inet","local":"203.0.113.1","prefixlen":24}]},
 {"ifname":"cali1a2b","addr_info":[{"family":"inet","local":"169.254.1.1","prefixlen":32},{"family":"inet6","local":"2001:db8:2::1","prefixlen":64}]},
 {"ifname":"cali2c3d","addr_info":[{"family":"inet","local":"169.254.1.1","prefixlen":32}]},
 {"ifname":"kube-ipvs0","addr_info":[{"family":"inet","local":"10.10.10.2","prefixlen":32},{"family":"inet6","local":"fd00:10::2","prefixlen":128}]}
]"#;

fn texts() -> LiveTexts {
    LiveTexts {
        iptables: Some(RULES.into()),
        ip6tables: Some(RULES6.into()),
        ipset: Some(IPSETS.into()),
        routes: vec![ROUTES4.into(), ROUTES6.into()],
        addrs: Some(ADDRS.into()),
        ipvs: Some(IPVSADM.into()),
        ..Default::default()
    }
}

fn predict(packet: &str) -> (Traversal, String) {
    let e = explain(&ExplainRequest {
        texts: texts(),
        packet: packet.into(),
    })
    .unwrap_or_else(|e| panic!("{packet}: {e}"));
    let t = e.to_model(&Default::default(), None);
    let tree = t.render_tree();
    (t, tree)
}

fn hooks(t: &Traversal) -> Vec<(Hook, String)> {
    t.stages
        .iter()
        .map(|s| (s.hook, s.table.to_string()))
        .collect()
}

fn ipvs_stage(t: &Traversal) -> &observer_model::Stage {
    t.stages
        .iter()
        .find(|s| &*s.table == "ipvs")
        .expect("an ipvs stage")
}

#[test]
fn cluster_ip_to_a_local_pod_is_sent_by_ipvs_not_forwarded() {
    let (t, tree) = predict("tcp 198.51.100.10:40000 -> 10.10.10.2:22 in eth0");
    assert_eq!(t.fate.kind, FateKind::Forwarded, "{tree}");
    assert_eq!(t.egress.as_ref().unwrap().iface, "cali1a2b", "{tree}");
    let h = hooks(&t);
    assert!(h.iter().all(|(hook, _)| *hook != Hook::Forward), "{tree}");
    // INPUT's tables before IPVS, IPVS at 99, no nat INPUT (IPVS took the packet), then
    // OUTPUT and POSTROUTING.
    let at = |hook, table: &str| h.iter().position(|(k, t)| *k == hook && t == table);
    let ipvs = at(Hook::LocalIn, "ipvs").expect(&tree);
    assert!(at(Hook::LocalIn, "filter").expect(&tree) < ipvs);
    assert!(at(Hook::LocalIn, "nat").is_none(), "{tree}");
    assert!(at(Hook::LocalOut, "filter").expect(&tree) > ipvs);
    assert!(at(Hook::PostRouting, "nat").expect(&tree) > ipvs);
    let s = ipvs_stage(&t);
    assert_eq!(s.priority, 99);
    let step = s.ipvs.as_ref().unwrap();
    assert_eq!(step.service, "TCP  10.10.10.2:22 rr");
    assert_eq!(step.real_server.as_deref(), Some("172.17.0.5:22"));
    assert_eq!(step.forward.as_deref(), Some("Masq"));
    assert_eq!(step.chosen_by, "only");
    // The DNAT is IPVS's, at INPUT; kube-proxy's masquerade bit set in nat PREROUTING is
    // honoured by KUBE-POSTROUTING (and cleared there).
    let dnat: Vec<_> = t
        .nat
        .iter()
        .filter(|n| n.kind == observer_model::NatKind::Dnat)
        .collect();
    assert_eq!(dnat.len(), 1, "{tree}");
    assert_eq!(dnat[0].source, NatSource::Ipvs);
    assert_eq!(dnat[0].hook, Hook::LocalIn);
    assert_eq!(dnat[0].to.to_string(), "172.17.0.5:22");
    let snat = t
        .nat
        .iter()
        .find(|n| n.kind == observer_model::NatKind::Snat)
        .expect(&tree);
    assert_eq!(snat.to.to_string(), "169.254.1.1:40000", "{tree}");
    assert!(tree.contains("KUBE-MARK-MASQ"), "{tree}");
    assert!(
        tree.contains("ipvs: TCP  10.10.10.2:22 rr  -> 172.17.0.5:22 Masq weight 1"),
        "{tree}"
    );
    // The nat OUTPUT chains are not walked for IPVS's packet: its destination was bound.
    let out_nat = t
        .stages
        .iter()
        .find(|s| s.hook == Hook::LocalOut && &*s.table == "nat")
        .expect(&tree);
    assert!(out_nat.rules.is_empty(), "{tree}");
    // conntrack: original to the ClusterIP, reply from the pod.
    let ct = t.conntrack.as_ref().expect(&tree);
    assert_eq!(ct.original.dst.to_string(), "10.10.10.2:22");
    assert_eq!(ct.reply.src.to_string(), "172.17.0.5:22");
}

#[test]
fn cluster_ip_to_another_nodes_pod_leaves_by_the_route_to_it() {
    let (t, tree) = predict("tcp 198.51.100.10:40001 -> 10.10.10.3:80 in eth0");
    assert_eq!(t.fate.kind, FateKind::Forwarded, "{tree}");
    assert_eq!(t.egress.as_ref().unwrap().iface, "eth1", "{tree}");
    let step = ipvs_stage(&t).ipvs.clone().unwrap();
    assert_eq!(step.real_server.as_deref(), Some("10.244.2.7:80"));
    let last = t.packet.as_ref().unwrap().last.as_ref().expect(&tree);
    assert_eq!(last.src.to_string(), "203.0.113.1:40001", "{tree}");
    assert_eq!(last.dst.to_string(), "10.244.2.7:80", "{tree}");
}

#[test]
fn several_real_servers_are_each_listed_with_the_scheduler_never_one_guessed() {
    let e = explain(&ExplainRequest {
        texts: texts(),
        packet: "udp 198.51.100.10:5353 -> 10.10.10.10:53 in eth0".into(),
    })
    .unwrap();
    assert_eq!(e.branches.len(), 2);
    let mut servers: Vec<_> = e
        .branches
        .iter()
        .map(|b| {
            let s = b.stages.iter().find(|s| &*s.table == "ipvs").unwrap();
            let i = s.ipvs.as_ref().unwrap();
            assert_eq!(i.scheduler, "rr");
            assert_eq!(i.chosen_by, "scheduler");
            assert_eq!(i.candidates, 2);
            assert!((b.probability - 0.5).abs() < 1e-9);
            (
                i.real_server.clone().unwrap(),
                b.egress.as_ref().unwrap().iface.clone(),
            )
        })
        .collect();
    servers.sort();
    assert_eq!(
        servers,
        [
            ("172.17.0.5:53".to_string(), "cali1a2b".to_string()),
            ("192.170.1.5:53".to_string(), "cali2c3d".to_string())
        ]
    );
    let tree = e.render_tree();
    assert!(
        tree.contains("one of 2 candidates: the scheduler rr picks"),
        "{tree}"
    );
}

#[test]
fn node_port_is_an_ipvs_service_on_the_node_address() {
    let (t, tree) = predict("tcp 198.51.100.10:40002 -> 198.51.100.1:30022 in eth0");
    assert_eq!(t.fate.kind, FateKind::Forwarded, "{tree}");
    let step = ipvs_stage(&t).ipvs.clone().unwrap();
    assert_eq!(step.service, "TCP  198.51.100.1:30022 rr");
    assert!(tree.contains("KUBE-NODE-PORT-TCP"), "{tree}");
    assert_eq!(t.egress.as_ref().unwrap().iface, "cali1a2b");
}

#[test]
fn a_hostport_is_dnatted_by_portmap_and_forwarded_without_ipvs() {
    let (t, tree) = predict("tcp 198.51.100.10:40003 -> 198.51.100.1:8080 in eth0");
    assert_eq!(t.fate.kind, FateKind::Forwarded, "{tree}");
    assert!(t.stages.iter().all(|s| &*s.table != "ipvs"), "{tree}");
    assert!(t.stages.iter().any(|s| s.hook == Hook::Forward), "{tree}");
    assert_eq!(t.nat[0].source, NatSource::Rules);
    assert_eq!(t.nat[0].to.to_string(), "172.17.0.5:80");
    assert!(tree.contains("CNI-DN-1b4f0c9ad3a2e6f5d7c81"), "{tree}");
}

#[test]
fn a_policy_drops_what_ipvs_sends_in_output() {
    let (t, tree) = predict("tcp 198.51.100.10:40004 -> 10.10.10.4:23 in eth0");
    assert_eq!(t.fate.kind, FateKind::Dropped, "{tree}");
    assert_eq!(t.fate.hook, Some(Hook::LocalOut), "{tree}");
    assert_eq!(t.fate.table.as_deref(), Some("filter"), "{tree}");
    assert!(tree.contains("deny-telnet"), "{tree}");
}

#[test]
fn a_cluster_ip_port_without_a_service_is_rejected_by_kube_proxys_ipvs_filter() {
    let (t, tree) = predict("tcp 198.51.100.10:40005 -> 10.10.10.2:80 in eth0");
    assert_eq!(t.fate.kind, FateKind::Rejected, "{tree}");
    assert_eq!(t.fate.hook, Some(Hook::LocalIn));
    assert!(tree.contains("KUBE-IPVS-FILTER"), "{tree}");
    assert!(t.stages.iter().all(|s| &*s.table != "ipvs"), "{tree}");
}

#[test]
fn ipv6_cluster_ip() {
    let (t, tree) = predict("tcp [2001:db8:1::10]:40006 -> [fd00:10::2]:22 in eth0");
    assert_eq!(t.fate.kind, FateKind::Forwarded, "{tree}");
    let step = ipvs_stage(&t).ipvs.clone().unwrap();
    assert_eq!(step.service, "TCP  [fd00:10::2]:22 rr");
    assert_eq!(step.real_server.as_deref(), Some("[2001:db8:2::5]:22"));
    assert_eq!(t.egress.as_ref().unwrap().iface, "cali1a2b");
    let last = t.packet.as_ref().unwrap().last.as_ref().expect(&tree);
    assert_eq!(last.src.to_string(), "[2001:db8:2::1]:40006", "{tree}");
}

#[test]
fn the_node_itself_reaches_a_cluster_ip_through_ipvs_at_local_out() {
    let (t, tree) = predict("tcp 198.51.100.1:40007 -> 10.10.10.3:80");
    assert_eq!(t.fate.kind, FateKind::Sent, "{tree}");
    let s = ipvs_stage(&t);
    assert_eq!((s.hook, s.priority), (Hook::LocalOut, -98));
    // OUTPUT up to nat before IPVS; all of OUTPUT again for the packet it sends.
    let h = hooks(&t);
    let ipvs = h.iter().position(|(_, t)| t == "ipvs").unwrap();
    assert!(
        h[..ipvs]
            .iter()
            .all(|(k, t)| *k == Hook::LocalOut && t != "filter"),
        "{tree}"
    );
    assert!(
        h[ipvs..]
            .iter()
            .any(|(k, t)| *k == Hook::LocalOut && t == "filter"),
        "{tree}"
    );
    assert_eq!(t.egress.as_ref().unwrap().iface, "eth1", "{tree}");
}

#[test]
fn a_service_without_real_servers_drops_with_icmp() {
    let mut texts = texts();
    texts.ipvs = Some("-A -t 10.10.10.2:22 -s rr\n".into());
    let e = explain(&ExplainRequest {
        texts,
        packet: "tcp 198.51.100.10:40008 -> 10.10.10.2:22 in eth0".into(),
    })
    .unwrap();
    let t = e.to_model(&Default::default(), None);
    assert_eq!(t.fate.kind, FateKind::Rejected, "{}", t.render_tree());
    let s = ipvs_stage(&t);
    assert_eq!(s.verdict, Verdict::Reject);
    assert!(s.note.as_deref().unwrap().contains("ICMP port unreachable"));
}

#[test]
fn an_established_packet_goes_to_its_connections_real_server() {
    use observer_rules::{StoredNat, explain_connection, parse_packet_spec, prepare};
    let texts = texts();
    let p = texts.parse();
    assert!(p.unparsed.is_empty(), "{:?}", p.unparsed);
    let mut sim = prepare(&p.ruleset, &p.ipsets, &p.routes, &p.bridges, &p.iface_addrs);
    sim.ipvs = p.ipvs.clone();
    let spec =
        parse_packet_spec("udp 198.51.100.10:5353 -> 10.10.10.10:53 in eth0 state established")
            .unwrap();
    let stored = StoredNat {
        dst: Some(("192.170.1.5".parse().unwrap(), Some(53))),
        src: None,
    };
    let e = explain_connection(&sim, &p.ruleset, &p.ipsets, &p.bridges, &spec, &stored);
    assert_eq!(e.branches.len(), 1);
    let s = e.branches[0]
        .stages
        .iter()
        .find(|s| &*s.table == "ipvs")
        .unwrap();
    let i = s.ipvs.as_ref().unwrap();
    assert_eq!(i.chosen_by, "connection");
    assert_eq!(i.real_server.as_deref(), Some("192.170.1.5:53"));
    // Without the connection's stored translation, both are listed.
    let e = explain_connection(
        &sim,
        &p.ruleset,
        &p.ipsets,
        &p.bridges,
        &spec,
        &StoredNat::default(),
    );
    assert_eq!(e.branches.len(), 2);
}

#[test]
fn a_tcp_packet_that_is_not_a_syn_is_not_scheduled() {
    let (t, tree) = predict("tcp 198.51.100.10:40009 -> 10.10.10.2:22 in eth0 flags ack");
    let s = ipvs_stage(&t);
    assert!(s.ipvs.is_none());
    assert!(s.note.as_deref().unwrap().contains("not a SYN"), "{tree}");
    assert_eq!(t.fate.kind, FateKind::Delivered, "{tree}");
}
