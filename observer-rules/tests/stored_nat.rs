//! A packet of a known connection: its nat chains are not walked, conntrack applies the
//! translation stored for the connection (`Simulator::simulate_connection`, what `observer
//! whatif` holds recorded established packets to), and later tables and routing see it.

use observer_model::{NatKind, NatSource};
use observer_rules::{LiveTexts, StoredNat, explain_connection, parse_packet_spec, prepare};

const RULES: &str = "*nat\n:PREROUTING ACCEPT [0:0]\n:POSTROUTING ACCEPT [0:0]\n\
    -A PREROUTING -p tcp -d 10.10.10.2 -j DNAT --to-destination 172.17.0.9:22\nCOMMIT\n\
    *filter\n:FORWARD ACCEPT [0:0]\n-A FORWARD -d 172.17.0.5 -j DROP\nCOMMIT\n";

const ROUTES: &str = r#"[
 {"dst":"default","gateway":"192.0.2.1","dev":"eth1","flags":[]},
 {"dst":"172.17.0.5","dev":"cali1","scope":"link","flags":[]},
 {"dst":"172.17.0.9","dev":"cali9","scope":"link","flags":[]}
]"#;

#[test]
fn an_established_packet_takes_its_stored_translation_not_the_rules() {
    let texts = LiveTexts {
        iptables: Some(RULES.into()),
        routes: vec![ROUTES.into()],
        ..Default::default()
    };
    let p = texts.parse();
    assert!(p.unparsed.is_empty());
    let sim = prepare(&p.ruleset, &p.ipsets, &p.routes, &p.bridges, &p.iface_addrs);
    let explain = |packet: &str, stored: &StoredNat| {
        let spec = parse_packet_spec(packet).unwrap();
        explain_connection(&sim, &p.ruleset, &p.ipsets, &p.bridges, &spec, stored)
    };
    let stored = StoredNat {
        dst: Some(("172.17.0.5".parse().unwrap(), Some(22))),
        src: None,
    };
    // The connection was set up to 172.17.0.5 (before the rules moved it): its packets go
    // there, and the FORWARD rule for that address sees them.
    let e = explain(
        "tcp 198.51.100.10:40000 -> 10.10.10.2:22 in eth0 state established",
        &stored,
    );
    let t = e.to_model(&Default::default(), None);
    assert_eq!(
        t.fate.kind,
        observer_model::FateKind::Dropped,
        "{}",
        t.render_tree()
    );
    assert_eq!(t.nat.len(), 1);
    assert_eq!(t.nat[0].kind, NatKind::Dnat);
    assert_eq!(t.nat[0].source, NatSource::Conntrack);
    assert_eq!(t.nat[0].to.to_string(), "172.17.0.5:22");
    // A new connection takes the rules' translation, whatever is passed as stored.
    let e = explain("tcp 198.51.100.10:40001 -> 10.10.10.2:22 in eth0", &stored);
    let t = e.to_model(&Default::default(), None);
    assert_eq!(
        t.egress.as_ref().unwrap().iface,
        "cali9",
        "{}",
        t.render_tree()
    );
    assert_eq!(t.nat[0].source, NatSource::Rules);
    assert_eq!(t.nat[0].to.to_string(), "172.17.0.9:22");
    // Without a stored translation an established packet is not translated at all.
    let e = explain(
        "tcp 198.51.100.10:40000 -> 10.10.10.2:22 in eth0 state established",
        &StoredNat::default(),
    );
    let t = e.to_model(&Default::default(), None);
    assert!(t.nat.is_empty());
    assert_eq!(t.egress.as_ref().unwrap().iface, "eth1");
}
