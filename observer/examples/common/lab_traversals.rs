//! The bench's inputs, shared by `collector_bench` and the golden test that holds its JSON
//! (`observer/tests/collector_golden.rs`): forwarded packets of the lab's ClusterIP flow as
//! the probes' own assembly code records them, and a rule namer over the lab node's rules.

use observer::kernel::btf::TupleLayout;
use observer::pipeline::rulenames::RuleNamer;
use observer_common::traversal::{TraversalRecord, add_reading, end, start};
use observer_common::{PacketEvent, family, flags, hook, kind};

pub const LAYOUT: TupleLayout = TupleLayout {
    src_addr: 0,
    src_port: 16,
    dst_addr: 20,
    dst_port: 36,
    protonum: 38,
    size: 40,
};

type Ep = ([u8; 4], u16);
const VIP: Ep = ([10, 10, 10, 2], 22);
const POD: Ep = ([172, 17, 0, 5], 22);

fn event(at: u8, src: Ep, dst: Ep, mark: u32, ctinfo: Option<u32>, port: u16) -> PacketEvent {
    let (client, node): (Ep, Ep) = (([198, 51, 100, 10], port), ([169, 254, 1, 1], port));
    let mut ev = PacketEvent::default();
    ev.header.kind = kind::PACKET;
    ev.header.family = family::IPV4;
    ev.header.hook = at;
    ev.packet.ip_version = 4;
    ev.packet.l4proto = 6;
    ev.packet.saddr[..4].copy_from_slice(&src.0);
    ev.packet.daddr[..4].copy_from_slice(&dst.0);
    ev.packet.sport = src.1;
    ev.packet.dport = dst.1;
    ev.packet.mark = mark;
    ev.packet.len = 60;
    if let Some(info) = ctinfo {
        ev.header.flags = flags::CT;
        ev.ct.ctinfo = info;
        for (raw, (s, d)) in [
            (&mut ev.ct.orig, (client, VIP)),
            (&mut ev.ct.reply, (POD, node)),
        ] {
            raw[0..4].copy_from_slice(&s.0);
            raw[16..18].copy_from_slice(&s.1.to_be_bytes());
            raw[20..24].copy_from_slice(&d.0);
            raw[36..38].copy_from_slice(&d.1.to_be_bytes());
            raw[38] = 6;
        }
        ev.ct.status = if info == 2 { 0 } else { 1 << 3 };
    }
    ev
}

/// One forwarded packet of the lab's ClusterIP flow, as the probes would record it:
/// `kind` 0 is a connection's first packet (DNAT and masquerade by the nat rules), 1 a later
/// packet, 2 a reply (translated back by conntrack).
pub fn record(kind_of: usize, skb: u64, port: u16) -> TraversalRecord {
    let (client, node): (Ep, Ep) = (([198, 51, 100, 10], port), ([169, 254, 1, 1], port));
    // SAFETY: all-zero is a valid record.
    let mut rec: TraversalRecord = unsafe { std::mem::zeroed() };
    start(&mut rec, skb, 1, 0);
    let info = match kind_of {
        0 => 2,
        1 => 0,
        _ => 3,
    };
    let (src, pre_dst, post_dst, post_src) = match kind_of {
        2 => (POD, node, client, VIP),
        _ => (client, VIP, POD, node),
    };
    let mut add = |program: u8, e: PacketEvent| add_reading(&mut rec, &e, program);
    let mut ing = event(hook::TC_INGRESS, src, pre_dst, 0, None, port);
    ing.header.ifindex_in = 2;
    add(0, ing);
    for p in 0..6u8 {
        let (dst, mark) = if p >= 4 {
            (post_dst, 0x4000)
        } else {
            (pre_dst, 0)
        };
        add(
            p,
            event(
                hook::PRE_ROUTING,
                src,
                dst,
                mark,
                (p >= 2).then_some(info),
                port,
            ),
        );
    }
    for p in 0..5u8 {
        let mark = if p >= 2 { 0x14000 } else { 0x4000 };
        let mut e = event(hook::FORWARD, src, post_dst, mark, Some(info), port);
        e.header.ifindex_in = 2;
        e.header.ifindex_out = 5;
        add(p, e);
    }
    for p in 0..4u8 {
        let s = if p >= 2 { post_src } else { src };
        let mut e = event(hook::POST_ROUTING, s, post_dst, 0x14000, Some(info), port);
        e.header.ifindex_out = 5;
        add(p, e);
    }
    let mut eg = event(
        hook::TC_EGRESS,
        post_src,
        post_dst,
        0x14000,
        Some(info),
        port,
    );
    eg.header.ifindex_out = 5;
    add(0, eg);
    rec.end = end::EGRESS;
    rec
}

/// A rule namer over the lab node's iptables rules and ipsets, with cali1a2b's address for
/// MASQUERADE.
pub fn lab_rule_namer() -> RuleNamer {
    let rules = include_str!("../../../lab/node.rules");
    let sets = include_str!("../../../lab/node.ipsets");
    let v4 = observer_rules::parse_save(rules).expect("the lab's rules parse");
    let ipsets = observer_rules::parse_ipsets(sets).expect("the lab's ipsets parse");
    let mut sim =
        observer_rules::Simulator::owned(v4, Default::default(), ipsets, Default::default());
    sim.iface_addrs.insert(
        "cali1a2b".into(),
        vec!["169.254.1.1".parse().expect("address")],
    );
    RuleNamer::with_simulator(sim, 0)
}
