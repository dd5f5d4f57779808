//! Annotation: what the stages of one traversal mean. The routing decision taken, the
//! packet's fate (and the kernel's drop reason), every mark bit set or cleared and by which
//! table (named from the mark dictionary), every address translation and whether the nat
//! rules or conntrack's stored translation did it, and the connection it belongs to.

use std::collections::HashMap;
use std::sync::Arc;

use observer_model::{
    ConntrackView, Fate, FateKind, Headers, Icmp, MarkChange, MarkDictionary, Marks, Nat, NatKind,
    NatSource, Packet, Protocol, Route, Stage, TupleView,
};

use crate::pipeline::correlate::{Closed, Traversal};
use crate::pipeline::decode::{Conntrack, Endpoint, Observation, Point, Tuple};
use observer_model::Hook as NfHook;

/// The model's endpoint: the address, and the port for protocols with ports.
pub fn endpoint(e: &Endpoint, has_port: bool) -> observer_model::Endpoint {
    observer_model::Endpoint::new(e.addr, has_port.then_some(e.port))
}

/// `IPS_CONFIRMED`: the entry is in the conntrack table; nat rules are no longer consulted.
const IPS_CONFIRMED: u64 = 1 << 3;

/// One stage as observed: the records just before and after a table, and the stage as the
/// report shows it.
pub struct ObservedStage<'a> {
    pub stage: &'a Stage,
    pub before: &'a Observation,
    pub after: Option<&'a Observation>,
}

/// The routing decision: `input`, `forward` or `output` (None if no hook after it was seen).
pub fn route(t: &Traversal) -> Option<Route> {
    let hooks = || {
        t.records.iter().filter_map(|r| match r.point {
            Point::Netfilter(h, _) => Some(h),
            _ => None,
        })
    };
    if hooks().any(|h| h == NfHook::LocalIn) {
        Some(Route::Input)
    } else if hooks().any(|h| h == NfHook::Forward) {
        Some(Route::Forward)
    } else if hooks().next() == Some(NfHook::LocalOut) {
        Some(Route::Output)
    } else {
        None
    }
}

/// The bridge a packet crossed, by interface index: a port it entered through and one it
/// left through. br_netfilter hands the IP hooks the bridge as device, where TC saw the
/// port: a TC ingress device that is not the netfilter hooks' input device is a port of
/// that bridge, and a last TC egress device that is not their last output device likewise.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BridgePorts {
    pub bridge: u32,
    pub physdev_in: Option<u32>,
    pub physdev_out: Option<u32>,
    /// Forwarded by the bridge from port to port (IP FORWARD with the bridge as both
    /// devices), not routed.
    pub bridged: bool,
}

pub fn bridge_ports(t: &Traversal) -> Option<BridgePorts> {
    let nf = || {
        t.records
            .iter()
            .filter(|r| matches!(r.point, Point::Netfilter(..)))
    };
    let tc_in = t
        .records
        .iter()
        .find(|r| r.point == Point::TcIngress)
        .map(|r| r.ifindex_in);
    let nf_in = nf().find(|r| r.ifindex_in != 0).map(|r| r.ifindex_in);
    let tc_out = t
        .records
        .iter()
        .rev()
        .find(|r| r.point == Point::TcEgress)
        .map(|r| r.ifindex_out);
    let nf_out = nf()
        .rev()
        .find(|r| r.ifindex_out != 0)
        .map(|r| r.ifindex_out);
    let port = |tc: Option<u32>, nf: Option<u32>| match (tc, nf) {
        (Some(p), Some(b)) if p != 0 && p != b => Some((p, b)),
        _ => None,
    };
    let (pin, pout) = (port(tc_in, nf_in), port(tc_out, nf_out));
    // FORWARD with one device as both: a bridge forwarding a frame from port to port, whose
    // out port the probes read there (`skb->dev`, br_netfilter's `physoutdev`), before the
    // frame leaves or a rule drops it.
    let forwarding_bridge = nf()
        .find(|r| {
            matches!(r.point, Point::Netfilter(NfHook::Forward, _))
                && r.ifindex_in != 0
                && r.ifindex_in == r.ifindex_out
        })
        .map(|r| r.ifindex_in);
    let fport = t.forward_port.zip(forwarding_bridge);
    let bridge = pin.or(pout).or(fport)?.1;
    let (physdev_in, physdev_out) = (
        pin.filter(|p| p.1 == bridge).map(|p| p.0),
        pout.or(fport).filter(|p| p.1 == bridge).map(|p| p.0),
    );
    let bridged = (physdev_in.is_some() || fport.is_some()) && forwarding_bridge == Some(bridge);
    Some(BridgePorts {
        bridge,
        physdev_in,
        physdev_out,
        bridged,
    })
}

/// Whether `t` is a copy the bridge made of a frame it flooded to several ports (unknown
/// destination, broadcast, multicast: `br_flood` clones the skb for every port but the
/// last): first seen at the bridge's FORWARD (its start, TC ingress and PREROUTING, was the
/// original skb's), bridged there to the port read at FORWARD.
pub fn flooded_copy(t: &Traversal, p: &BridgePorts) -> bool {
    p.bridged
        && p.physdev_in.is_none()
        && t.forward_port.is_some()
        && t.missing & observer_common::traversal::missing::START != 0
        && t.records
            .first()
            .is_some_and(|r| matches!(r.point, Point::Netfilter(NfHook::Forward, _)))
}

/// Whether the packet entered where no bridge port was involved: at TC ingress of the device
/// the IP hooks saw it come in by, or from a local socket (OUTPUT first). False where its
/// start was not seen.
pub fn entered_without_port(t: &Traversal) -> bool {
    let first_nf = t
        .records
        .iter()
        .find(|r| matches!(r.point, Point::Netfilter(..)));
    match t.records.first().map(|r| r.point) {
        Some(Point::TcIngress) => {
            first_nf.is_none_or(|n| n.ifindex_in == 0 || n.ifindex_in == t.records[0].ifindex_in)
        }
        Some(Point::Netfilter(NfHook::LocalOut, _)) => true,
        _ => false,
    }
}

/// A fragment that conntrack's defragmentation (priority -400, before raw) merged into the
/// fragment that completed the packet: it is seen by the first PREROUTING probe only, and
/// the kernel consumes it (or it waits until its record is reused or idle).
pub fn reassembled(t: &Traversal) -> bool {
    matches!(
        t.closed,
        Closed::Consumed | Closed::Idle | Closed::Reused | Closed::InFlight
    ) && t.records.iter().any(|r| r.fragment)
        && t.records.iter().all(|r| {
            matches!(
                r.point,
                Point::TcIngress | Point::Netfilter(NfHook::PreRouting, 0)
            )
        })
        && t.records
            .iter()
            .any(|r| r.point == Point::Netfilter(NfHook::PreRouting, 0))
}

/// Where a packet ended, as the report names it.
pub struct EndedAt {
    /// Hook of the last point seen (netfilter only).
    pub hook: Option<NfHook>,
    /// The table between whose probes it ended, if any.
    pub table: Option<Arc<str>>,
    pub after: Option<String>,
    pub before: Option<String>,
}

/// Names for the kernel's drop reasons and code addresses.
pub struct Names<'a> {
    pub drop_reasons: &'a HashMap<u32, String>,
    pub symbol: &'a dyn Fn(u64) -> String,
}

/// Ended at a known place on its path, not inside a table.
fn passed(kind: FateKind, hook: NfHook, after: Option<String>) -> Fate {
    Fate {
        kind,
        hook: Some(hook),
        table: None,
        reason: None,
        location: None,
        after,
        before: None,
        rule: None,
    }
}

/// How the traversal ended. Takes the end point's text rather than copying it.
pub fn fate(t: &Traversal, at: EndedAt, route: Option<Route>, names: &Names) -> Fate {
    let location = t
        .drop
        .filter(|d| d.location != 0)
        .map(|d| (names.symbol)(d.location));
    if reassembled(t) {
        return Fate {
            table: Some("defrag".into()),
            location,
            ..passed(FateKind::Reassembled, NfHook::PreRouting, at.after)
        };
    }
    let (kind, reason) = match t.closed {
        Closed::Delivered => return passed(FateKind::Delivered, NfHook::LocalIn, at.after),
        Closed::Egress => {
            let kind = if route == Some(Route::Output) {
                FateKind::Sent
            } else {
                FateKind::Forwarded
            };
            return passed(kind, NfHook::PostRouting, at.after);
        }
        Closed::Looped => return passed(FateKind::Looped, NfHook::PostRouting, at.after),
        Closed::Dropped => {
            let reason = t.drop.map(|d| {
                names
                    .drop_reasons
                    .get(&d.reason)
                    .cloned()
                    .unwrap_or_else(|| format!("reason {}", d.reason))
            });
            (FateKind::Dropped, reason)
        }
        Closed::Consumed => (FateKind::Consumed, None),
        Closed::Reclaimed | Closed::Reused | Closed::Idle | Closed::InFlight => (
            FateKind::Incomplete,
            Some(
                match t.closed {
                    Closed::Reused => "its skb started another packet before its end was seen",
                    Closed::Reclaimed => "no room left to follow it (slots and fallback map full)",
                    Closed::Idle => "no end seen within the idle time",
                    _ => "still in flight when the observer stopped",
                }
                .into(),
            ),
        ),
    };
    // It ended at the end point: inside the table there, if any, or between its probes.
    Fate {
        kind,
        hook: at.hook,
        table: at.table,
        reason,
        location,
        after: at.after,
        before: at.before,
        rule: None,
    }
}

pub fn marks(stages: &[ObservedStage], dict: &MarkDictionary) -> Marks {
    let mut out = Marks::default();
    for s in stages {
        let Some(after) = s.after else { continue };
        let (b, a) = (s.before.mark, after.mark);
        // The changed bits, lowest first.
        let mut changed = a ^ b;
        while changed != 0 {
            let bit = changed & changed.wrapping_neg();
            changed &= !bit;
            let change = MarkChange {
                bit,
                name: dict.shared_name(bit),
                hook: s.stage.hook,
                table: s.stage.table.clone(),
            };
            if a & bit != 0 {
                out.set.push(change);
            } else {
                out.cleared.push(change);
            }
        }
    }
    out
}

pub fn nat(stages: &[ObservedStage]) -> Vec<Nat> {
    let mut out = Vec::new();
    for s in stages {
        let Some(after) = s.after else { continue };
        // A fragment completed by defragmentation gains its ports here: that is no NAT.
        if s.before.fragment != after.fragment || s.before.has_ports != after.has_ports {
            continue;
        }
        let (Some(bs), Some(bd), Some(a_s), Some(ad)) =
            (&s.before.src, &s.before.dst, &after.src, &after.dst)
        else {
            continue;
        };
        // First packet of a connection: the entry is not confirmed yet, so the nat chains ran.
        let source = match s.before.ct {
            // IPVS rewrites every packet of its connections itself, at its hook.
            _ if &*s.stage.table == "ipvs" => NatSource::Ipvs,
            Some(ct) if ct.status & IPS_CONFIRMED == 0 => NatSource::Rules,
            Some(_) => NatSource::Conntrack,
            None => NatSource::Rules,
        };
        let ports = after.has_ports;
        for (kind, from, to) in [(NatKind::Dnat, bd, ad), (NatKind::Snat, bs, a_s)] {
            if from != to {
                out.push(Nat {
                    kind,
                    hook: s.stage.hook,
                    table: s.stage.table.clone(),
                    from: endpoint(from, ports),
                    to: endpoint(to, ports),
                    source,
                });
            }
        }
    }
    out
}

/// The packet's headers at one observation, if they were read there.
fn headers(o: &Observation) -> Option<Headers> {
    let (src, dst) = (o.src?, o.dst?);
    let proto = Protocol::from_number(o.proto);
    let icmp = o.icmp.filter(|_| proto.is_icmp()).map(|(kind, code)| Icmp {
        kind,
        code,
        id: o.icmp_id,
    });
    Some(Headers {
        src: endpoint(&src, o.has_ports),
        dst: endpoint(&dst, o.has_ports),
        icmp,
    })
}

/// Which packet the traversal is about: its headers at the first observation that read
/// them, and at the last when they changed on the way (NAT). None when no observation read
/// an IP header.
pub fn packet(t: &Traversal) -> Option<Packet> {
    let read = |o: &&Observation| o.src.is_some() && o.dst.is_some();
    let first_seen = t.records.iter().find(read)?;
    let first = headers(first_seen)?;
    let last = t
        .records
        .iter()
        .rev()
        .find(read)
        .and_then(headers)
        .filter(|l| *l != first);
    let family = match first_seen.src.map(|e| e.addr) {
        Some(std::net::IpAddr::V6(_)) => observer_model::Family::Ipv6,
        _ => observer_model::Family::Ipv4,
    };
    Some(Packet {
        family,
        proto: Protocol::from_number(first_seen.proto),
        first,
        last,
        ip_id: t.records.iter().find_map(|o| o.ip_id),
    })
}

fn tuple_view(t: &Tuple) -> TupleView {
    let proto = Protocol::from_number(t.proto);
    TupleView {
        src: endpoint(&t.src, proto.has_ports()),
        dst: endpoint(&t.dst, proto.has_ports()),
        proto,
    }
}

/// The connection as last seen.
pub fn conntrack(t: &Traversal) -> Option<ConntrackView> {
    let ct: &Conntrack = t.records.iter().rev().find_map(|r| r.ct.as_ref())?;
    Some(ConntrackView {
        state: (ct.state(), ct.is_reply()),
        mark: Some(ct.mark),
        original: tuple_view(&ct.original),
        reply: tuple_view(&ct.reply),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use observer_model::Family as NfFamily;

    const PORT1: u32 = 7;
    const PORT2: u32 = 8;
    const BR: u32 = 5;
    const ETH2: u32 = 3;

    fn at(point: Point, ifindex_in: u32, ifindex_out: u32) -> Observation {
        Observation {
            point,
            family: Some(NfFamily::Ipv4),
            ts_ns: 0,
            skb: 1,
            ifindex_in,
            ifindex_out,
            src: None,
            dst: None,
            proto: 6,
            has_ports: true,
            tcp_flags: 0,
            len: 60,
            mark: 0,
            ct: None,
            inner: None,
            encap: None,
            fragment: false,
            icmp: None,
            icmp_id: None,
            ip_id: None,
        }
    }

    fn traversal(records: Vec<Observation>) -> Traversal {
        Traversal {
            skb: 1,
            records,
            closed: Closed::Egress,
            drop: None,
            missing: 0,
            forward_port: None,
        }
    }

    fn nf(h: NfHook, i: u32, o: u32) -> Observation {
        at(Point::Netfilter(h, 0), i, o)
    }

    #[test]
    fn a_frame_bridged_between_two_ports_names_both() {
        // The DNAT to the same bridge sent through the bridge's own transmit on its way.
        let t = traversal(vec![
            at(Point::TcIngress, PORT2, 0),
            nf(NfHook::PreRouting, BR, 0),
            at(Point::TcEgress, 0, BR),
            nf(NfHook::Forward, BR, BR),
            nf(NfHook::PostRouting, 0, BR),
            at(Point::TcEgress, 0, PORT1),
        ]);
        let p = bridge_ports(&t).expect("crossed a bridge");
        assert_eq!(
            p,
            BridgePorts {
                bridge: BR,
                physdev_in: Some(PORT2),
                physdev_out: Some(PORT1),
                bridged: true
            }
        );
        assert!(!entered_without_port(&t));
    }

    #[test]
    fn routed_out_of_another_device_and_sent_by_the_node() {
        // In by a port, up to the bridge, routed out of eth2: not bridged, no out port.
        let routed = traversal(vec![
            at(Point::TcIngress, PORT2, 0),
            nf(NfHook::PreRouting, BR, 0),
            at(Point::TcIngress, BR, 0),
            nf(NfHook::Forward, BR, ETH2),
            nf(NfHook::PostRouting, 0, ETH2),
            at(Point::TcEgress, 0, ETH2),
        ]);
        let p = bridge_ports(&routed).unwrap();
        assert_eq!(
            (p.physdev_in, p.physdev_out, p.bridged),
            (Some(PORT2), None, false)
        );
        // Sent by the node through the bridge to a port: br_netfilter keeps no record.
        let sent = traversal(vec![
            nf(NfHook::LocalOut, 0, BR),
            nf(NfHook::PostRouting, 0, BR),
            at(Point::TcEgress, 0, BR),
            at(Point::TcEgress, 0, PORT1),
        ]);
        let p = bridge_ports(&sent).unwrap();
        assert_eq!(
            (p.physdev_in, p.physdev_out, p.bridged),
            (None, Some(PORT1), false)
        );
        assert!(entered_without_port(&sent));
        // No bridge at all: the hooks saw the devices TC saw.
        let plain = traversal(vec![
            at(Point::TcIngress, ETH2, 0),
            nf(NfHook::PreRouting, ETH2, 0),
            nf(NfHook::Forward, ETH2, PORT1),
            at(Point::TcEgress, 0, PORT1),
        ]);
        assert_eq!(bridge_ports(&plain), None);
        assert!(entered_without_port(&plain));
    }

    #[test]
    fn the_out_port_read_at_forward_names_where_a_dropped_or_flooded_frame_went() {
        // Dropped by a FORWARD rule: no TC egress, the port read at FORWARD.
        let mut dropped = traversal(vec![
            at(Point::TcIngress, PORT1, 0),
            nf(NfHook::PreRouting, BR, 0),
            nf(NfHook::Forward, BR, BR),
        ]);
        dropped.closed = Closed::Dropped;
        assert_eq!(
            bridge_ports(&dropped).map(|p| (p.physdev_out, p.bridged)),
            Some((None, true)),
            "without the port, only that it was bridged"
        );
        dropped.forward_port = Some(PORT2);
        let p = bridge_ports(&dropped).unwrap();
        assert_eq!(
            (p.bridge, p.physdev_in, p.physdev_out, p.bridged),
            (BR, Some(PORT1), Some(PORT2), true)
        );
        // A copy the bridge flooded: first seen at FORWARD, its out port known there.
        let mut clone = traversal(vec![
            nf(NfHook::Forward, BR, BR),
            nf(NfHook::PostRouting, 0, BR),
            at(Point::TcEgress, 0, PORT2),
        ]);
        clone.forward_port = Some(PORT2);
        let p = bridge_ports(&clone).unwrap();
        assert_eq!(
            (p.bridge, p.physdev_in, p.physdev_out, p.bridged),
            (BR, None, Some(PORT2), true)
        );
        // Routed: skb->dev at FORWARD is the input device, never noted as a port.
        let routed = traversal(vec![
            at(Point::TcIngress, ETH2, 0),
            nf(NfHook::PreRouting, ETH2, 0),
            nf(NfHook::Forward, ETH2, ETH2),
            at(Point::TcEgress, 0, ETH2),
        ]);
        assert_eq!(bridge_ports(&routed), None);
    }
}
