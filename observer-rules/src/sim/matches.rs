//! Matches whose answer depends on more than the packet's headers: conntrack's tuples, the
//! `recent` lists (kept by the kernel across packets, answered under a stated assumption) and
//! the link-layer class `pkttype` reads.

use std::net::IpAddr;

use super::{Pkt, Tri, tri};
use crate::compile::{CtField, RecentCmd};
use crate::packet::CtState;
use crate::route::Routes;

/// `-m conntrack --ctproto/--ctorig*/--ctrepl*` as xt_conntrack answers them. Without a
/// conntrack entry (raw, untracked, invalid) the match is false, unless it also had
/// `--ctstate` (which then decided). The tuples are known for the first packet of a
/// connection: the original one is the packet as conntrack first saw it, the reply one the
/// packet's current addresses reversed (NAT rewrites it as it translates).
pub(super) fn ct_tuple(pkt: &Pkt, field: &CtField, neg: bool, with_state: bool) -> Tri {
    if !pkt.has_ct() {
        return if with_state { Tri::Yes } else { Tri::No };
    }
    if let CtField::Proto(p) = field {
        return tri(pkt.proto == *p, neg);
    }
    let unknown = |why: &str| Tri::Unknown(format!("conntrack tuple match: {why}"));
    if pkt.state != CtState::New {
        return unknown(&format!(
            "the tuples of an {} connection are not known (only a new connection's are)",
            pkt.state.name()
        ));
    }
    let reply_known = pkt.src_label.is_none() && pkt.dst_label.is_none();
    let tuple = match field {
        CtField::Addr { reply: false, .. } | CtField::Port { reply: false, .. } => pkt.orig,
        _ if reply_known => Some((pkt.dst, pkt.src, pkt.dport, pkt.sport)),
        _ => None,
    };
    let Some((src, dst, sport, dport)) = tuple else {
        return unknown("the connection's addresses before NAT are not known");
    };
    match field {
        CtField::Proto(_) => unreachable!("answered above"),
        CtField::Addr { src: s, net, .. } => tri(net.contains(if *s { src } else { dst }), neg),
        CtField::Port { src: s, lo, hi, .. } => {
            if !matches!(pkt.proto, 6 | 17 | 33 | 132 | 136) {
                return unknown("ports of a protocol without ports");
            }
            match if *s { sport } else { dport } {
                Some(p) => tri(*lo <= p && p <= *hi, neg),
                None => unknown("the packet's ports are not known"),
            }
        }
    }
}

/// The link-layer class xt_pkttype sees: `unicast` (PACKET_HOST), `broadcast` or
/// `multicast`. A received packet's is read off its IP destination, assuming the sender
/// addressed the frame the same way (stated); a locally sent unicast packet is
/// PACKET_HOST until it leaves.
pub(super) fn pkt_type(routes: &Routes, pkt: &Pkt) -> Option<(&'static str, Option<String>)> {
    let broadcast = match pkt.dst {
        IpAddr::V4(a) => {
            a.is_broadcast()
                || routes.routes.iter().any(|r| {
                    r.table == "local"
                        && r.kind == "broadcast"
                        && r.dst.len == 32
                        && r.dst.addr == pkt.dst
                })
        }
        IpAddr::V6(_) => false,
    };
    let ty = if pkt.dst.is_multicast() {
        "multicast"
    } else if broadcast {
        "broadcast"
    } else {
        "unicast"
    };
    if pkt.in_iface.is_none() {
        return (ty == "unicast").then_some((ty, None));
    }
    Some((
        ty,
        Some(format!(
            "pkttype: the frame was sent to a {ty} link-layer address, as its IP destination {} is",
            pkt.dst
        )),
    ))
}

/// `-m recent`: a `--set` in this walk puts the packet on the list (the match is true); a
/// check finds it there when this walk put it there and no more hits are asked for. Anything
/// else depends on earlier packets: answered as "not on the list" / "too few hits", stated.
pub(super) fn recent(
    pkt: &Pkt,
    cmd: RecentCmd,
    name: &str,
    rdest: bool,
    hitcount: Option<u32>,
    neg: bool,
) -> Tri {
    let mut fx = pkt.fx.borrow_mut();
    let on_list = pkt
        .recent_set
        .iter()
        .chain(&fx.recent_set)
        .any(|(n, d)| n == name && *d == rdest);
    let whose = if rdest { "destination" } else { "source" };
    let hit = match cmd {
        RecentCmd::Set => {
            fx.recent_set.push((name.to_string(), rdest));
            true
        }
        // Added by this walk: one packet on the list, seen just now.
        _ if on_list && hitcount.is_none_or(|h| h <= 1) => true,
        RecentCmd::Check | RecentCmd::Update if on_list => {
            fx.assumed.push(format!(
                "recent `{name}`: no earlier packet of this {whose} (fewer than {} hits)",
                hitcount.unwrap_or(0)
            ));
            false
        }
        _ => {
            fx.assumed.push(format!(
                "recent `{name}`: this {whose} is not on the list (no earlier packet put it there)"
            ));
            false
        }
    };
    tri(hit, neg)
}
