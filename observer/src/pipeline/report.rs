//! Reports: an assembled traversal -> the model's observed [`observer_model::Traversal`],
//! one stage per table, with the rules of each stage named when a [`RuleNamer`] is given.
//! Pure: interface names come through a lookup the caller provides; the renderers (tree,
//! line, JSON) are the model's, shared with `observer explain`.
//!
//! [`RuleNamer`]: crate::pipeline::rulenames::RuleNamer

use observer_model::{
    FateKind, Iface, Protocol, SCHEMA, Source, Stage, Traversal as Report, Verdict,
};

use crate::pipeline::annotate::{self, EndedAt, Names, ObservedStage};
use crate::pipeline::correlate::{Closed, Plans, Traversal, missing_text};
use crate::pipeline::decode::Point;
use observer_common::NF_SLOTS;
use observer_model::marks::MarkDictionary;
use observer_model::{Family as NfFamily, Hook as NfHook};

pub use crate::pipeline::correlate::index_plans;

pub use crate::pipeline::snapshots::SnapshotCache;
use crate::pipeline::snapshots::Snapshots;

/// IPVS's `ip_vs_in_hook` on LOCAL_IN (NF_IP_PRI_NAT_SRC - 1, net/netfilter/ipvs/ip_vs_core.c).
const IPVS_LOCAL_IN: i32 = 99;

/// What building a report needs besides the traversal.
pub struct Context<'a> {
    /// Snapshots shared across reports.
    pub snapshots: &'a SnapshotCache,
    pub plans: &'a Plans,
    pub netns: &'a str,
    pub marks: &'a MarkDictionary,
    pub names: Names<'a>,
    pub ifname: &'a dyn Fn(u32) -> String,
    /// Names the rules of each stage from the live ruleset, when rule naming is on.
    pub rules: Option<&'a crate::pipeline::rulenames::RuleNamer>,
}

pub use crate::pipeline::annotate::endpoint;

/// Builds the report of one traversal.
pub fn build(t: &Traversal, ctx: &Context, lost: u64) -> Report {
    let first_l3 = t.records.iter().position(|r| r.src.is_some());
    let family = t.records.iter().find_map(|r| r.family);
    let ifname = ctx.ifname;
    let ingress = t
        .records
        .iter()
        .find(|r| r.point == Point::TcIngress)
        .map(|r| Iface {
            iface: ifname(r.ifindex_in),
        });
    let egress = t
        .records
        .iter()
        .rev()
        .find(|r| r.point == Point::TcEgress)
        .map(|r| Iface {
            iface: ifname(r.ifindex_out),
        });

    // Netfilter records (by index) grouped by hook, hooks in the order the packet met them.
    let mut hooks: Vec<(NfHook, [Option<u16>; NF_SLOTS])> = Vec::with_capacity(4);
    for (i, r) in t.records.iter().enumerate() {
        if let Point::Netfilter(h, slot) = r.point {
            if hooks.last().map(|(lh, _)| *lh) != Some(h) {
                hooks.push((h, [None; NF_SLOTS]));
            }
            let seen = &mut hooks.last_mut().expect("pushed").1;
            if let Some(s @ None) = seen.get_mut(slot) {
                *s = u16::try_from(i).ok();
            }
        }
    }
    let ports = annotate::bridge_ports(t);
    let flooded = ports.is_some_and(|p| annotate::flooded_copy(t, &p));
    let entered = annotate::entered_without_port(t);
    let mut snapshots = Snapshots::new(t, ctx.snapshots);
    // A fragment merged by defragmentation never reached a table: no stages, no drop.
    if annotate::reassembled(t) {
        hooks.clear();
    }
    // Conntrack is a stage only where it runs: some record of the packet has an entry.
    let first_ct = t.records.iter().find_map(|r| r.ct);
    let tracked = first_ct.is_some();
    // The observations before and after each stage.
    let mut observed = Vec::with_capacity(16);
    let mut stages = Vec::with_capacity(16);
    'hooks: for (i, (hook, seen)) in hooks.iter().enumerate() {
        let Some(plan) = family.and_then(|f| ctx.plans.get(&(f, *hook))) else {
            continue;
        };
        let later_hooks = i + 1 < hooks.len();
        for table in &plan.tables {
            if &*table.name == "conntrack" && !tracked {
                continue;
            }
            let (b, a) = plan.bracket(table);
            let Some(bi) = b.and_then(|s| seen.get(s).copied().flatten()) else {
                continue;
            };
            let ai = a.and_then(|s| seen.get(s).copied().flatten());
            // Taken in INPUT and sent on as the same skb (the probes joined its visits):
            // IPVS, at LOCAL_IN 99 after filter and security and before nat (100), rewrote
            // it there; the tables after it never ran, and its work shows at OUTPUT's first
            // point.
            if ai.is_none()
                && *hook == NfHook::LocalIn
                && table.priority > IPVS_LOCAL_IN
                && let Some(next) = hooks
                    .get(i + 1)
                    .filter(|(h, _)| *h == NfHook::LocalOut)
                    .and_then(|(_, seen)| seen.iter().flatten().next().copied())
            {
                let (before, after) = (&t.records[bi as usize], &t.records[next as usize]);
                let (b_snap, a_snap) = (snapshots.of(bi.into()), snapshots.of(next.into()));
                let proto = first_l3.map_or(0, |i| t.records[i].proto);
                let step = ctx
                    .rules
                    .zip(b_snap.as_deref().zip(a_snap.as_deref()))
                    .and_then(|(n, (b, a))| n.ipvs_step(proto, b, a));
                stages.push(Stage {
                    hook: NfHook::LocalIn,
                    table: "ipvs".into(),
                    priority: IPVS_LOCAL_IN,
                    chain: None,
                    before: b_snap,
                    after: a_snap,
                    ct: after.ct.map(|c| snapshots.ct(&c)),
                    verdict: Verdict::Accept,
                    rules: Default::default(),
                    policy: None,
                    note: Some(match &step {
                        Some(_) => "IPVS took the packet here and sent it on through OUTPUT: the INPUT tables after it did not run".into(),
                        None => "taken here and sent on through OUTPUT as the same packet (IPVS's hook at this priority); no virtual service of the node's IPVS state matches it".into(),
                    }),
                    ipvs: step,
                    check: None,
                });
                observed.push((before, Some(after)));
                continue 'hooks;
            }
            let (before, after) = (&t.records[bi as usize], ai.map(|i| &t.records[i as usize]));
            // IPVS's reply hook, bracketed where the node has virtual services.
            let ipvs_reply = *hook == NfHook::Forward
                && table.priority == crate::kernel::upkeep::IPVS_FORWARD
                && ctx.rules.is_some_and(|n| n.has_ipvs());
            let seen_later =
                later_hooks || a.is_some_and(|a| seen.iter().skip(a + 1).any(Option::is_some));
            // The packet's last table: what ended it there decides the verdict.
            let ended_here = after.is_none() && !seen_later;
            let verdict = match (ended_here, t.closed) {
                (false, _) => Verdict::Accept,
                (true, Closed::Dropped) => Verdict::Drop,
                (true, Closed::Consumed) => Verdict::Stolen,
                (true, _) => Verdict::Unknown,
            };
            let ct_src = after.unwrap_or(before);
            let (b_snap, a_snap) = (
                snapshots.of(bi.into()),
                ai.and_then(|i| snapshots.of(i.into())),
            );
            let reply_step = ipvs_reply
                .then(|| {
                    let proto = first_l3.map_or(0, |i| t.records[i].proto);
                    ctx.rules
                        .zip(b_snap.as_deref().zip(a_snap.as_deref()))
                        .and_then(|(n, (b, a))| n.ipvs_reply_step(proto, b, a))
                })
                .flatten();
            stages.push(Stage {
                hook: *hook,
                table: if ipvs_reply {
                    "ipvs".into()
                } else {
                    table.name.clone()
                },
                priority: table.priority,
                chain: None,
                before: b_snap,
                after: a_snap,
                ct: ct_src.ct.map(|c| snapshots.ct(&c)),
                verdict,
                rules: Default::default(),
                policy: None,
                note: (ipvs_reply && reply_step.is_none()).then(|| {
                    "no translation seen between the probes around IPVS's reply hook: not a reply of a virtual service's masquerade connection".into()
                }),
                ipvs: reply_step,
                check: None,
            });
            if let (Some(namer), Some(b), false) = (ctx.rules, b, ipvs_reply) {
                let stage = stages.last_mut().expect("pushed");
                let window = (
                    plan.points[b],
                    a.map_or(crate::kernel::plan::LAST, |a| plan.points[a]),
                );
                let named = namer.name(
                    &crate::pipeline::rulenames::StageToName {
                        hook: *hook,
                        window,
                        before,
                        after,
                        stage,
                        first_ct,
                        ports: stage_ports(ports, entered, flooded, *hook),
                    },
                    ifname,
                );
                stage.rules = named.rules.clone();
                stage.check = named.check.clone();
            }
            observed.push((before, after));
            if ended_here {
                break 'hooks;
            }
        }
    }
    let observed: Vec<ObservedStage> = stages
        .iter()
        .zip(observed)
        .map(|(stage, (before, after))| ObservedStage {
            stage,
            before,
            after,
        })
        .collect();
    let (marks, nat) = (
        annotate::marks(&observed, ctx.marks),
        annotate::nat(&observed),
    );
    drop(observed);
    let route = match annotate::route(t) {
        Some(observer_model::Route::Forward) if ports.is_some_and(|p| p.bridged) => {
            Some(observer_model::Route::Bridged)
        }
        r => r,
    };
    let bridge = ports.map(|p| observer_model::BridgeCrossing {
        name: ifname(p.bridge),
        physdev_in: p.physdev_in.map(ifname),
        physdev_out: p.physdev_out.map(ifname),
        flooded,
    });
    let fate = annotate::fate(t, end_point(t, family, ctx.plans), route, &ctx.names);
    let mut reasons: Vec<&str> = missing_text(t.missing);
    let flood_reason;
    if let Some(p) = ports.filter(|_| flooded) {
        // Not "first seen after its start": where its start is, and which port it took.
        flood_reason = format!(
            "a copy {} made flooding the frame to several ports (unknown destination, \
             broadcast or multicast), first seen at its FORWARD: where the frame entered is \
             the original's report",
            ifname(p.bridge)
        );
        reasons.retain(|r| *r != missing_text(observer_common::traversal::missing::START)[0]);
        reasons.insert(0, &flood_reason);
    }
    if fate.kind == FateKind::Incomplete {
        reasons.insert(0, fate.reason.as_deref().unwrap_or("end not seen"));
    }
    Report {
        schema: SCHEMA,
        source: Source::Observed,
        netns: Some(ctx.netns.to_string()),
        family,
        proto: first_l3.map(|i| Protocol::from_number(t.records[i].proto)),
        packet: annotate::packet(t),
        ingress,
        egress,
        route,
        bridge,
        encap: encapsulation(t, route),
        incomplete: !reasons.is_empty(),
        incomplete_reason: (!reasons.is_empty()).then(|| reasons.join("; ")),
        fate,
        marks,
        nat,
        conntrack: ctx.snapshots.conntrack(t),
        names: Vec::new(),
        stages,
        branches: Vec::new(),
        notes: bridge_notes(t, ports, ifname),
        lost,
    }
}

/// A VXLAN packet's outer header, VNI and the packet it carries, as first read; its
/// direction from the route: sent by this node (its overlay device wrapped a pod's packet)
/// or received for it. The overlay device is named by the caller, who knows the node.
fn encapsulation(
    t: &Traversal,
    route: Option<observer_model::Route>,
) -> Option<observer_model::Encapsulation> {
    let r = t.records.iter().find(|r| r.encap.is_some())?;
    let (vni, src, dst, proto, inner_ip_id) = r.encap?;
    Some(observer_model::Encapsulation {
        kind: "vxlan",
        direction: match route {
            Some(observer_model::Route::Output) => Some("encapsulated"),
            Some(observer_model::Route::Input) => Some("decapsulated"),
            _ => None,
        },
        vni,
        outer_src: endpoint(&r.src?, r.has_ports),
        outer_dst: endpoint(&r.dst?, r.has_ports),
        inner: observer_model::Quoted {
            src: endpoint(&src, matches!(proto, 6 | 17 | 132)),
            dst: endpoint(&dst, matches!(proto, 6 | 17 | 132)),
            proto: Protocol::from_number(proto),
        },
        overlay: None,
        inner_ip_id,
    })
}

/// What the path through a bridge did that its stages do not show: a frame DNATed to a
/// pod on the same bridge before the node knew the pod's neighbour entry is sent through
/// the bridge device's own transmit (`br_nf_pre_routing_finish_bridge` hands it to the
/// neighbour's output, TC egress of the bridge sees it) and bridged from there.
fn bridge_notes(
    t: &Traversal,
    ports: Option<annotate::BridgePorts>,
    ifname: &dyn Fn(u32) -> String,
) -> Vec<String> {
    let Some(p) = ports.filter(|p| p.bridged) else {
        return Vec::new();
    };
    let through_bridge_xmit = t
        .records
        .iter()
        .position(|r| r.point == Point::TcEgress && r.ifindex_out == p.bridge);
    let forward = t
        .records
        .iter()
        .position(|r| matches!(r.point, Point::Netfilter(NfHook::Forward, _)));
    match (through_bridge_xmit, forward) {
        (Some(x), Some(f)) if x < f => vec![format!(
            "sent through {}'s own transmit while the node resolved the neighbour of its new \
             destination (DNAT to the same bridge), then bridged{}",
            ifname(p.bridge),
            p.physdev_out
                .map(|o| format!(" to {}", ifname(o)))
                .unwrap_or_default()
        )],
        _ => Vec::new(),
    }
}

/// The bridge ports `physdev` sees at `hook`: br_netfilter records the in port where the
/// frame enters the bridge and the out port at the bridge's FORWARD, before the IP FORWARD
/// hook, for a frame it bridges (not for one passed up to be routed or delivered).
fn stage_ports(
    ports: Option<annotate::BridgePorts>,
    entered_without_port: bool,
    flooded: bool,
    hook: NfHook,
) -> crate::pipeline::rulenames::StagePorts {
    use crate::pipeline::rulenames::{StageOut, StagePorts};
    let Some(p) = ports else {
        return if entered_without_port {
            StagePorts::NoBridge
        } else {
            StagePorts::Unknown
        };
    };
    let physout = match hook {
        NfHook::Forward | NfHook::PostRouting if p.bridged => {
            p.physdev_out.map_or(StageOut::Unseen, StageOut::Port)
        }
        _ => StageOut::None,
    };
    let Some(physin) = p.physdev_in else {
        // A flooded copy: bridged, its in port unknown. Sent by the node to a port:
        // br_netfilter keeps no record of it.
        return if flooded {
            StagePorts::FloodedCopy { physout }
        } else if entered_without_port {
            StagePorts::NoBridge
        } else {
            StagePorts::Unknown
        };
    };
    StagePorts::Port { physin, physout }
}

/// `HOOK/priority` of point `at` in its plan.
fn point_name(hook: NfHook, at: usize, plan: Option<&crate::kernel::plan::HookPlan>) -> String {
    match plan.and_then(|p| p.points.get(at)) {
        Some(prio) => format!("{}/{prio}", hook.name()),
        None => format!("{}/point {at}", hook.name()),
    }
}

/// The last point the packet passed, the next one on its path, and the table between them.
fn end_point(t: &Traversal, family: Option<NfFamily>, plans: &Plans) -> EndedAt {
    let none = EndedAt {
        hook: None,
        table: None,
        after: None,
        before: None,
    };
    match t.records.last().map(|r| r.point) {
        Some(Point::TcIngress) => EndedAt {
            after: Some("TC ingress".into()),
            ..none
        },
        Some(Point::TcEgress) => EndedAt {
            after: Some("TC egress".into()),
            ..none
        },
        Some(Point::Netfilter(hook, at)) => {
            let plan = family.and_then(|f| plans.get(&(f, hook)));
            let next = plan.and_then(|p| {
                let (lo, hi) = (*p.points.get(at)?, *p.points.get(at + 1)?);
                Some((
                    at + 1,
                    p.tables.iter().find(|t| t.priority > lo && t.priority < hi),
                ))
            });
            EndedAt {
                hook: Some(hook),
                table: next.and_then(|(_, t)| t.map(|t| t.name.clone())),
                after: Some(point_name(hook, at, plan)),
                before: next.map(|(n, _)| point_name(hook, n, plan)),
            }
        }
        None => none,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernel::plan::full_plan;
    use crate::pipeline::correlate::assemble;
    use crate::pipeline::correlate::tests::record_of;
    use crate::pipeline::decode::tests::{LAYOUT, tcp_event, with_ct};
    use crate::pipeline::decode::{Endpoint, decode, encode_record};
    use observer_common::hook;
    use observer_common::traversal::end;
    use std::collections::HashMap;

    const CLIENT: ([u8; 4], u16) = ([198, 51, 100, 10], 40000);
    const VIP: ([u8; 4], u16) = ([10, 10, 10, 2], 22);
    const POD: ([u8; 4], u16) = ([172, 17, 0, 5], 22);
    const NODE: ([u8; 4], u16) = ([172, 17, 0, 1], 40000);

    /// A forwarded, DNATed and masqueraded TCP SYN as the probes would report it.
    fn forwarded() -> (Traversal, Plans) {
        let plans = index_plans(&full_plan(None));
        let skb = 0xffff_0000_0000_1000;
        let orig = (CLIENT, VIP);
        let reply = (POD, CLIENT);
        let mut evs = vec![tcp_event(hook::TC_INGRESS, 0, skb, CLIENT, VIP, 0)];
        evs[0].header.ifindex_in = 2;
        // PREROUTING points: FIRST, -299, -199, -149, LAST (after nat).
        for slot in 0..5u32 {
            // Raw clears a stale scratch bit (as Calico's --set-xmark 0x0/0xf0000 does),
            // nat sets kube-proxy's masquerade bit while it DNATs.
            let (dst, mark) = match slot {
                0 => (VIP, 0x40000),
                1..=3 => (VIP, 0),
                _ => (POD, 0x4000),
            };
            let mut e = tcp_event(0, slot, skb, CLIENT, dst, mark);
            e.header.ifindex_in = 2;
            if slot >= 2 {
                e = with_ct(e, 2, orig, reply);
            }
            evs.push(e);
        }
        // FORWARD: FIRST, -149, 1, LAST (after security), as the plan's programs.
        let programs = |h| plans[&(NfFamily::Ipv4, h)].programs.clone();
        for slot in programs(NfHook::Forward) {
            let mut e = tcp_event(2, slot as u32, skb, CLIENT, POD, 0x4000);
            (e.header.ifindex_in, e.header.ifindex_out) = (2, 5);
            evs.push(with_ct(e, 2, orig, reply));
        }
        // POSTROUTING: FIRST, -149, LAST; MASQUERADE at nat (100).
        for (at, slot) in programs(NfHook::PostRouting).into_iter().enumerate() {
            let src = if at >= 2 { NODE } else { CLIENT };
            let mut e = tcp_event(4, slot as u32, skb, src, POD, 0x4000);
            (e.header.ifindex_in, e.header.ifindex_out) = (2, 5);
            evs.push(with_ct(e, 2, orig, reply));
        }
        let mut eg = tcp_event(hook::TC_EGRESS, 0, skb, NODE, POD, 0x4000);
        eg.header.ifindex_out = 5;
        evs.push(eg);
        for (i, e) in evs.iter_mut().enumerate() {
            e.header.ts_ns = i as u64;
        }
        // Through the kernel's own assembly and the wire format, as the probes write it.
        let rec = decode(&encode_record(&record_of(&evs, end::EGRESS))).unwrap();
        (assemble(&rec, &plans, &LAYOUT).unwrap(), plans)
    }

    /// A ClusterIP SYN IPVS took at INPUT 99 and sent on through OUTPUT as the same skb
    /// (the probes join the visits): INPUT's points up to IPVS, none after nat (100), then
    /// OUTPUT's and POSTROUTING's with the real server as destination.
    fn ipvs_sent() -> (Traversal, Plans) {
        let plans = index_plans(&full_plan(None));
        let skb = 0xffff_0000_0000_2000;
        let orig = (CLIENT, VIP);
        let reply = (POD, NODE);
        let mut evs = vec![tcp_event(hook::TC_INGRESS, 0, skb, CLIENT, VIP, 0)];
        evs[0].header.ifindex_in = 2;
        let plan = |h| &plans[&(NfFamily::Ipv4, h)];
        for (hook_no, h) in [(0, NfHook::PreRouting), (1, NfHook::LocalIn)] {
            let p = plan(h);
            for (k, slot) in p.programs.iter().enumerate() {
                if h == NfHook::LocalIn && p.points[k] > IPVS_LOCAL_IN {
                    continue; // stolen by IPVS before nat INPUT
                }
                let mut e = tcp_event(hook_no, *slot as u32, skb, CLIENT, VIP, 0x4000);
                e.header.ifindex_in = 2;
                evs.push(with_ct(e, 2, orig, reply));
            }
        }
        for (hook_no, h) in [(3, NfHook::LocalOut), (4, NfHook::PostRouting)] {
            let p = plan(h);
            for (k, slot) in p.programs.iter().enumerate() {
                let last = h == NfHook::PostRouting && k + 1 == p.programs.len();
                let src = if last { NODE } else { CLIENT };
                let mut e = tcp_event(hook_no, *slot as u32, skb, src, POD, 0x4000);
                e.header.ifindex_out = 5;
                evs.push(with_ct(e, 2, orig, reply));
            }
        }
        let mut eg = tcp_event(hook::TC_EGRESS, 0, skb, NODE, POD, 0x4000);
        eg.header.ifindex_out = 5;
        evs.push(eg);
        for (i, e) in evs.iter_mut().enumerate() {
            e.header.ts_ns = i as u64;
        }
        let rec = decode(&encode_record(&record_of(&evs, end::EGRESS))).unwrap();
        (assemble(&rec, &plans, &LAYOUT).unwrap(), plans)
    }

    #[test]
    fn a_packet_ipvs_sends_on_is_one_report_with_ipvs_named_at_input() {
        let (t, plans) = ipvs_sent();
        let mut sim = observer_rules::Simulator::owned(
            Default::default(),
            Default::default(),
            Default::default(),
            Default::default(),
        );
        sim.ipvs = observer_rules::ipvs::parse_ipvsadm_save(
            "-A -t 10.10.10.2:22 -s rr\n-a -t 10.10.10.2:22 -r 172.17.0.5:22 -m -w 1\n-a -t 10.10.10.2:22 -r 172.17.0.6:22 -m -w 1\n",
        )
        .unwrap();
        let namer = crate::pipeline::rulenames::RuleNamer::with_simulator(sim, 0);
        let r = report_with(&t, &plans, 0, &HashMap::new(), Some(&namer));
        let tree = r.render_tree();
        let hooks: Vec<(NfHook, &str)> = r.stages.iter().map(|s| (s.hook, &*s.table)).collect();
        assert!(!hooks.contains(&(NfHook::LocalIn, "nat")), "{tree}");
        assert!(hooks.iter().all(|(h, _)| *h != NfHook::Forward), "{tree}");
        let at = hooks
            .iter()
            .position(|h| *h == (NfHook::LocalIn, "ipvs"))
            .expect(&tree);
        assert!(
            hooks[at + 1..].iter().any(|(h, _)| *h == NfHook::LocalOut),
            "{tree}"
        );
        let s = &r.stages[at];
        assert_eq!(s.priority, 99);
        let step = s.ipvs.as_ref().expect(&tree);
        assert_eq!(step.service, "TCP  10.10.10.2:22 rr");
        assert_eq!(step.real_server.as_deref(), Some("172.17.0.5:22"));
        assert_eq!(step.forward.as_deref(), Some("Masq"));
        assert_eq!((step.chosen_by.as_str(), step.candidates), ("observed", 2));
        let dnat = r
            .nat
            .iter()
            .find(|n| n.kind == observer_model::NatKind::Dnat)
            .expect(&tree);
        assert_eq!(
            (dnat.hook, &*dnat.table, dnat.source),
            (NfHook::LocalIn, "ipvs", observer_model::NatSource::Ipvs),
            "{tree}"
        );
        assert!(
            tree.contains("ipvs: TCP  10.10.10.2:22 rr  -> 172.17.0.5:22 Masq weight 1  (scheduled by rr among 2)"),
            "{tree}"
        );
        assert_eq!(r.fate.kind, FateKind::Forwarded, "{tree}");
    }

    /// A reply of an IPVS masquerade connection: from the pod, de-masqueraded by conntrack
    /// at PREROUTING, its source given back the virtual service's by IPVS at FORWARD 100
    /// (bracketed: the plan has IPVS's user there).
    #[test]
    fn a_reply_ipvs_translates_back_in_forward_is_an_ipvs_stage() {
        use crate::kernel::upkeep::IPVS_FORWARD;
        let users = [
            (NfFamily::Ipv4, NfHook::PreRouting, -100),
            (NfFamily::Ipv4, NfHook::Forward, 0),
            (NfFamily::Ipv4, NfHook::Forward, IPVS_FORWARD),
            (NfFamily::Ipv4, NfHook::PostRouting, 100),
        ];
        let plans = index_plans(&full_plan(Some(&users)));
        let skb = 0xffff_0000_0000_3000;
        let (orig, reply) = ((CLIENT, VIP), (POD, NODE));
        let mut evs = vec![tcp_event(hook::TC_INGRESS, 0, skb, POD, NODE, 0)];
        evs[0].header.ifindex_in = 5;
        let plan = |h| &plans[&(NfFamily::Ipv4, h)];
        let pre = plan(NfHook::PreRouting);
        for (k, slot) in pre.programs.iter().enumerate() {
            let dst = if k + 1 == pre.programs.len() {
                CLIENT
            } else {
                NODE
            };
            let mut e = tcp_event(0, *slot as u32, skb, POD, dst, 0);
            e.header.ifindex_in = 5;
            evs.push(with_ct(e, 2, orig, reply));
        }
        let fwd = plan(NfHook::Forward);
        assert_eq!(fwd.points.len(), 3, "{fwd:?}");
        for (k, slot) in fwd.programs.iter().enumerate() {
            let src = if k + 1 == fwd.programs.len() {
                VIP
            } else {
                POD
            };
            let mut e = tcp_event(2, *slot as u32, skb, src, CLIENT, 0);
            (e.header.ifindex_in, e.header.ifindex_out) = (5, 2);
            evs.push(with_ct(e, 2, orig, reply));
        }
        for slot in &plan(NfHook::PostRouting).programs {
            let mut e = tcp_event(4, *slot as u32, skb, VIP, CLIENT, 0);
            (e.header.ifindex_in, e.header.ifindex_out) = (5, 2);
            evs.push(with_ct(e, 2, orig, reply));
        }
        let mut eg = tcp_event(hook::TC_EGRESS, 0, skb, VIP, CLIENT, 0);
        eg.header.ifindex_out = 2;
        evs.push(eg);
        for (i, e) in evs.iter_mut().enumerate() {
            e.header.ts_ns = i as u64;
        }
        let rec = decode(&encode_record(&record_of(&evs, end::EGRESS))).unwrap();
        let t = assemble(&rec, &plans, &LAYOUT).unwrap();
        let mut sim = observer_rules::Simulator::owned(
            Default::default(),
            Default::default(),
            Default::default(),
            Default::default(),
        );
        sim.ipvs = observer_rules::ipvs::parse_ipvsadm_save(
            "-A -t 10.10.10.2:22 -s rr\n-a -t 10.10.10.2:22 -r 172.17.0.5:22 -m -w 1\n",
        )
        .unwrap();
        let namer = crate::pipeline::rulenames::RuleNamer::with_simulator(sim, 0);
        let r = report_with(&t, &plans, 0, &HashMap::new(), Some(&namer));
        let tree = r.render_tree();
        let s = r
            .stages
            .iter()
            .find(|s| s.hook == NfHook::Forward && &*s.table == "ipvs")
            .expect(&tree);
        assert_eq!(s.priority, IPVS_FORWARD);
        let step = s.ipvs.as_ref().expect(&tree);
        assert_eq!(step.chosen_by, "reply");
        assert_eq!(step.real_server.as_deref(), Some("172.17.0.5:22"));
        let snat = r
            .nat
            .iter()
            .find(|n| n.kind == observer_model::NatKind::Snat && n.hook == NfHook::Forward)
            .expect(&tree);
        assert_eq!(snat.source, observer_model::NatSource::Ipvs, "{tree}");
        assert_eq!(snat.to.to_string(), "10.10.10.2:22", "{tree}");
        // Without IPVS state the priority stays what it is: another user of the hook.
        let r = report_with(&t, &plans, 0, &HashMap::new(), None);
        assert!(
            r.stages.iter().any(|s| &*s.table == "prio:100"),
            "{}",
            r.render_tree()
        );
    }

    fn report(t: &Traversal, plans: &Plans, lost: u64) -> Report {
        let reasons: HashMap<u32, String> = [(12, "NETFILTER_DROP".to_string())].into();
        report_with(t, plans, lost, &reasons, None)
    }

    /// A report built with the test's names, `reasons` and rule namer.
    fn report_with(
        t: &Traversal,
        plans: &Plans,
        lost: u64,
        reasons: &HashMap<u32, String>,
        rules: Option<&crate::pipeline::rulenames::RuleNamer>,
    ) -> Report {
        let marks = MarkDictionary::default();
        let symbol = |a: u64| format!("fn+{a:#x}");
        let shared = SnapshotCache::default();
        let ctx = Context {
            snapshots: &shared,
            plans,
            netns: "node",
            marks: &marks,
            names: Names {
                drop_reasons: reasons,
                symbol: &symbol,
            },
            ifname: &names,
            rules,
        };
        build(t, &ctx, lost)
    }

    fn names(i: u32) -> String {
        match i {
            2 => "eth0".into(),
            5 => "cali1a2b".into(),
            n => format!("if{n}"),
        }
    }

    #[test]
    fn forwarded_dnat_masquerade_report() {
        let (t, plans) = forwarded();
        let r = report(&t, &plans, 0);
        assert_eq!(r.family, Some(NfFamily::Ipv4));
        assert_eq!(r.proto, Some(Protocol::Tcp));
        assert_eq!(
            r.ingress,
            Some(Iface {
                iface: "eth0".into()
            })
        );
        assert_eq!(
            r.egress,
            Some(Iface {
                iface: "cali1a2b".into()
            })
        );
        let hooks: Vec<_> = r
            .stages
            .iter()
            .map(|s| (s.hook.name(), &*s.table))
            .collect();
        assert_eq!(
            hooks,
            vec![
                ("PREROUTING", "raw"),
                ("PREROUTING", "conntrack"),
                ("PREROUTING", "mangle"),
                ("PREROUTING", "nat"),
                ("FORWARD", "mangle"),
                ("FORWARD", "filter"),
                ("FORWARD", "security"),
                ("POSTROUTING", "mangle"),
                ("POSTROUTING", "nat"),
            ]
        );
        let nat = &r.stages[3];
        assert_eq!(nat.priority, -100);
        let ep = |text: &str| {
            let sa: std::net::SocketAddr = text.parse().unwrap();
            observer_model::Endpoint::new(sa.ip(), Some(sa.port()))
        };
        assert_eq!(nat.before.as_ref().unwrap().dst, ep("10.10.10.2:22"));
        assert_eq!(nat.after.as_ref().unwrap().dst, ep("172.17.0.5:22"));
        assert_eq!(nat.after.as_ref().unwrap().mark, 0x4000);
        assert_eq!(nat.ct.as_ref().unwrap().state, observer_model::CtState::New);
        let snat = &r.stages[8];
        assert_eq!(snat.after.as_ref().unwrap().src, ep("172.17.0.1:40000"));
        assert!(r.stages.iter().all(|s| s.verdict == Verdict::Accept));
        // No conntrack entry before the conntrack table runs.
        assert!(r.stages[0].ct.is_none());
    }

    #[test]
    fn json_matches_schema_shape() {
        let (t, plans) = forwarded();
        let v: serde_json::Value =
            serde_json::from_str(&report(&t, &plans, 3).to_json_line()).unwrap();
        assert_eq!(v["schema"], 3);
        assert_eq!(v["netns"], "node");
        assert_eq!(v["lost"], 3);
        assert_eq!(v["egress"]["iface"], "cali1a2b");
        let s = &v["stages"][3];
        for key in [
            "hook", "table", "priority", "before", "after", "ct", "verdict",
        ] {
            assert!(s.get(key).is_some(), "stage has {key}");
        }
        assert_eq!(s["ct"]["mark"], "0x0");
    }

    /// Cuts the forwarded traversal after FORWARD's probe before filter, ending it `how`.
    fn cut_in_forward_filter(how: Closed) -> Report {
        let (mut t, plans) = forwarded();
        let cut = t
            .records
            .iter()
            .position(|r| r.point == Point::Netfilter(NfHook::Forward, 2))
            .unwrap();
        t.records.truncate(cut);
        t.closed = how;
        t.drop = (how == Closed::Dropped).then_some(crate::pipeline::correlate::Drop {
            reason: 12,
            location: 0x40,
        });
        report(&t, &plans, 0)
    }

    #[test]
    fn a_drop_between_a_tables_probes_is_pinned_on_it() {
        let r = cut_in_forward_filter(Closed::Dropped);
        let last = r.stages.last().unwrap();
        assert_eq!(
            (last.hook, &*last.table, last.verdict),
            (NfHook::Forward, "filter", Verdict::Drop)
        );
        assert!(last.after.is_none());
        assert_eq!(r.egress, None);
        assert_eq!(
            (r.fate.kind, r.fate.hook, r.fate.table.as_deref()),
            (FateKind::Dropped, Some(NfHook::Forward), Some("filter"))
        );
        assert_eq!(r.fate.location.as_deref(), Some("fn+0x40"));
        assert_eq!(r.fate.after.as_deref(), Some("FORWARD/-149"));
        assert_eq!(r.fate.before.as_deref(), Some("FORWARD/1"));
        assert!(!r.incomplete);
        assert!(
            r.render_tree()
                .contains("=> DROPPED in FORWARD/filter, in fn+0x40: NETFILTER_DROP"),
            "{}",
            r.render_tree()
        );
    }

    #[test]
    fn conntrack_is_a_stage_only_where_it_runs() {
        let (mut t, plans) = forwarded();
        assert!(
            report(&t, &plans, 0)
                .stages
                .iter()
                .any(|s| &*s.table == "conntrack")
        );
        // A namespace without conntrack: no record of the packet has an entry.
        for r in &mut t.records {
            r.ct = None;
        }
        let r = report(&t, &plans, 0);
        assert!(
            r.stages.iter().all(|s| &*s.table != "conntrack"),
            "no conntrack stage where conntrack never ran: {:?}",
            r.stages
        );
        assert!(r.stages.iter().any(|s| &*s.table == "raw"));
        assert!(r.conntrack.is_none());
    }

    #[test]
    fn a_packet_whose_end_was_not_seen_is_incomplete_not_dropped() {
        let r = cut_in_forward_filter(Closed::Idle);
        assert_eq!(r.fate.kind, FateKind::Incomplete);
        assert!(r.incomplete);
        assert_eq!(r.stages.last().unwrap().verdict, Verdict::Unknown);
        assert!(!r.render_tree().contains("DROPPED"));
        assert!(r.render_tree().contains("INCOMPLETE"));
    }

    #[test]
    fn a_drop_after_a_hooks_last_probe_is_not_pinned_on_a_table() {
        let (mut t, plans) = forwarded();
        // Keep TC ingress and every PREROUTING point: it died after PREROUTING (routing).
        t.records.retain(|r| {
            matches!(
                r.point,
                Point::TcIngress | Point::Netfilter(NfHook::PreRouting, _)
            )
        });
        t.closed = Closed::Dropped;
        t.drop = Some(crate::pipeline::correlate::Drop {
            reason: 12,
            location: 0x15e,
        });
        let r = report(&t, &plans, 0);
        assert_eq!(
            (r.fate.hook, r.fate.table.as_deref()),
            (Some(NfHook::PreRouting), None)
        );
        assert!(r.stages.iter().all(|s| s.verdict == Verdict::Accept));
        assert!(
            r.render_tree()
                .contains("=> DROPPED after PREROUTING, in fn+0x15e: NETFILTER_DROP")
        );
    }

    #[test]
    fn tree_names_changes() {
        let (t, plans) = forwarded();
        let tree = report(&t, &plans, 0).render_tree();
        assert!(
            tree.starts_with(
                "ipv4 tcp 198.51.100.10:40000 -> 10.10.10.2:22  in eth0  out cali1a2b  route forward"
            ),
            "{tree}"
        );
        for want in [
            "DNAT 10.10.10.2:22 -> 172.17.0.5:22 (nat rules)",
            "+0x4000 kube-proxy:masquerade",
            "-0x40000 calico:scratch0",
            "SNAT 198.51.100.10:40000 -> 172.17.0.1:40000 (nat rules)",
            "=> forwarded out cali1a2b",
            "conntrack: new (ctmark 0x0), original 198.51.100.10:40000 -> 10.10.10.2:22",
        ] {
            assert!(tree.contains(want), "missing {want:?} in\n{tree}");
        }
        let line = report(&t, &plans, 0).render_line();
        assert!(line.contains("[eth0 -> cali1a2b] forward"), "{line}");
        assert!(
            line.contains("DNAT 10.10.10.2:22->172.17.0.5:22@PREROUTING/nat(rules)"),
            "{line}"
        );
        assert!(line.ends_with("forwarded out cali1a2b"), "{line}");
        assert!(!line.contains('\n'));
    }

    /// Keys of every object in `v`, by path (arrays contribute all their elements).
    fn key_paths(v: &serde_json::Value, path: &str, out: &mut std::collections::BTreeSet<String>) {
        match v {
            serde_json::Value::Object(m) => {
                for (k, v) in m {
                    let p = format!("{path}.{k}");
                    out.insert(p.clone());
                    key_paths(v, &p, out);
                }
            }
            serde_json::Value::Array(a) => {
                for e in a {
                    key_paths(e, &format!("{path}[]"), out);
                }
            }
            _ => {}
        }
    }

    /// A rule namer over the lab node's rules and sets (cali1a2b masquerades to the
    /// synthetic traversal's node address).
    fn lab_namer() -> crate::pipeline::rulenames::RuleNamer {
        let v4 = observer_rules::parse_save(include_str!("../../../lab/node.rules")).unwrap();
        let sets = observer_rules::parse_ipsets(include_str!("../../../lab/node.ipsets")).unwrap();
        let mut sim =
            observer_rules::Simulator::owned(v4, Default::default(), sets, Default::default());
        sim.iface_addrs
            .insert("cali1a2b".into(), vec!["172.17.0.1".parse().unwrap()]);
        crate::pipeline::rulenames::RuleNamer::with_simulator(sim, 0)
    }

    fn named_report(
        t: &Traversal,
        plans: &Plans,
        namer: &crate::pipeline::rulenames::RuleNamer,
    ) -> Report {
        report_with(t, plans, 0, &HashMap::new(), Some(namer))
    }

    #[test]
    fn tail_names_the_rules_of_each_stage_and_flags_what_disagrees() {
        let (t, plans) = forwarded();
        let namer = lab_namer();
        let r = named_report(&t, &plans, &namer);
        let at = |hook: &str, table: &str| {
            r.stages
                .iter()
                .find(|s| s.hook.name() == hook && &*s.table == table)
                .unwrap()
        };
        // kube-proxy's DNAT and masquerade mark, named and in agreement with the kernel.
        let nat = at("PREROUTING", "nat");
        let chains: Vec<String> = nat.rules.iter().map(|r| r.id.place()).collect();
        assert!(
            chains.contains(&"KUBE-MARK-MASQ#1".to_string()),
            "{chains:?}"
        );
        assert!(
            chains.contains(&"KUBE-SEP-JJDDRQDQBMLIVXO7#2".to_string()),
            "{chains:?}"
        );
        let check = nat.check.as_ref().unwrap();
        assert_eq!(
            check.result,
            observer_model::CheckResult::Agrees,
            "{check:?}"
        );
        // The synthetic packet never got Calico's accept bit in filter FORWARD, which the
        // rules set: flagged with both sides, not hidden.
        let filter = at("FORWARD", "filter");
        let check = filter.check.as_ref().unwrap();
        assert_eq!(check.result, observer_model::CheckResult::Disagrees);
        assert_eq!(
            check.disagreements,
            ["rules predict mark 0x14000, the kernel set 0x4000"]
        );
        let tree = r.render_tree();
        assert!(
            tree.contains("!! rules predict mark 0x14000, the kernel set 0x4000"),
            "{tree}"
        );
        assert!(
            tree.contains("DISAGREE with the kernel at FORWARD/filter"),
            "{tree}"
        );
        // The exit summary counts it too.
        let outcome = crate::pipeline::render_cache::SummaryFlags::of(&r);
        assert!(outcome.rules_disagree && !outcome.rules_undecidable && !outcome.incomplete);
        assert!(
            tree.contains("KUBE-SEP-JJDDRQDQBMLIVXO7#2 -p tcp"),
            "{tree}"
        );
        // No chain runs at conntrack: nothing to name or check there.
        let ct = at("PREROUTING", "conntrack");
        assert!(ct.rules.is_empty() && ct.check.is_none());
        // The second report of the same flow comes from the cache.
        let misses = namer.misses.get();
        assert_eq!(named_report(&t, &plans, &namer), r);
        assert_eq!(namer.misses.get(), misses);
    }

    #[test]
    fn a_confirmed_connection_keeps_conntracks_translation_and_its_sentence() {
        let (mut t, plans) = forwarded();
        // Later packet of the connection: established and confirmed everywhere; the
        // masquerade bit is not set again (the nat chains that set it are not walked).
        for o in &mut t.records {
            o.mark &= !0x4000;
            if let Some(ct) = &mut o.ct {
                ct.info = 0;
                ct.status |= 1 << 3;
            }
        }
        let r = named_report(&t, &plans, &lab_namer());
        let nat = r
            .stages
            .iter()
            .find(|s| s.hook == NfHook::PreRouting && &*s.table == "nat")
            .unwrap();
        assert!(nat.rules.is_empty(), "the nat chains are not walked");
        assert_eq!(
            nat.check.as_ref().unwrap().result,
            observer_model::CheckResult::Agrees
        );
        let tree = r.render_tree();
        assert!(
            tree.contains("DNAT 10.10.10.2:22 -> 172.17.0.5:22 (conntrack)")
                && tree.contains("conntrack applied the stored translation"),
            "{tree}"
        );
    }

    /// Every ```json block of the schema doc that is a traversal.
    fn documented_traversals(doc: &str) -> Vec<serde_json::Value> {
        doc.split("```json")
            .skip(1)
            .map(|b| &b[..b.find("```").expect("closed block")])
            .map(|b| serde_json::from_str::<serde_json::Value>(b).expect("valid JSON"))
            .filter(|v| v.get("schema").is_some())
            .collect()
    }

    /// Predicted traversals covering every shape explain prints: iptables rules with
    /// Kubernetes and Calico meanings, an undecidable match, native nftables chains and
    /// rules with random branches, iptables-nft rules.
    fn predictions() -> Vec<serde_json::Value> {
        prediction_models()
            .iter()
            .map(|t| serde_json::to_value(t).unwrap())
            .collect()
    }

    fn prediction_models() -> Vec<Report> {
        let fixtures = |name: &str| {
            std::fs::read_to_string(
                std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
                    .join("../observer-rules/tests/fixtures")
                    .join(name),
            )
            .unwrap()
        };
        let lab = include_str!("../../../lab/node.rules");
        let routes = r#"[{"dst":"default","dev":"eth1","flags":[]},
            {"dst":"10.201.0.0/24","dev":"calir0","flags":[]}]"#;
        let reqs = [
            observer_rules::ExplainRequest {
                texts: observer_rules::LiveTexts {
                    iptables: Some(lab.into()),
                    ipset: Some(include_str!("../../../lab/node.ipsets").into()),
                    ..Default::default()
                },
                packet: "tcp 198.51.100.10:40000 -> 10.10.10.2:22 in eth0 out cali1a2b".into(),
            },
            observer_rules::ExplainRequest {
                texts: observer_rules::LiveTexts {
                    iptables: Some(lab.into()),
                    ..Default::default()
                },
                packet: "udp 172.17.0.6:5000 -> 192.0.2.50:53 in cali3c4d out eth0".into(),
            },
            observer_rules::ExplainRequest {
                texts: observer_rules::LiveTexts {
                    nft: Some(fixtures("kube-proxy.json")),
                    routes: vec![routes.into()],
                    ..Default::default()
                },
                packet: "tcp 10.201.0.7:40000 -> 172.30.0.41:80 in calir0".into(),
            },
            observer_rules::ExplainRequest {
                texts: observer_rules::LiveTexts {
                    iptables: Some(fixtures("mixed.rules")),
                    nft: Some(fixtures("mixed.json")),
                    routes: vec![routes.into()],
                    ..Default::default()
                },
                packet: "tcp 10.201.0.7:40000 -> 172.30.0.41:80 in calir0".into(),
            },
        ];
        reqs.iter()
            .map(|r| {
                let e = observer_rules::explain(r).unwrap();
                e.to_model(&MarkDictionary::default(), None)
            })
            .collect()
    }

    #[test]
    fn documented_schema_matches() {
        let doc = include_str!("../../../docs/json-schema.md");
        let documented = documented_traversals(doc);
        assert_eq!(documented.len(), 2, "an observed and a predicted example");
        let (t, plans) = forwarded();
        let observed: serde_json::Value =
            serde_json::from_str(&named_report(&t, &plans, &lab_namer()).to_json_line()).unwrap();
        let predicted = predictions();
        // One shape: both producers print schema 3, told apart by `source` only.
        assert_eq!(observed["schema"], 3);
        assert_eq!(observed["source"], "observed");
        for p in &predicted {
            assert_eq!(
                (&p["schema"], &p["source"]),
                (&observed["schema"], &"predicted".into())
            );
        }
        let (mut want, mut got) = (Default::default(), Default::default());
        for d in &documented {
            key_paths(d, "", &mut want);
        }
        for v in predicted.iter().chain([&observed]) {
            key_paths(v, "", &mut got);
        }
        assert_eq!(
            want, got,
            "docs/json-schema.md and the printed JSON disagree"
        );
        // Each example's own keys: an observed traversal and a predicted one, each as the
        // producers print it (stage keys are the same on both sides).
        let mut obs_keys = Default::default();
        key_paths(&observed, "", &mut obs_keys);
        let mut doc_obs = Default::default();
        key_paths(&documented[0], "", &mut doc_obs);
        assert!(
            doc_obs
                .iter()
                .all(|k| obs_keys.contains(k) || k.contains("rules[]")),
            "the observed example shows keys tail does not print: {:?}",
            doc_obs.difference(&obs_keys).collect::<Vec<_>>()
        );
        // Every key of the real output is explained in the doc's table too.
        for k in got {
            let leaf = k.rsplit('.').next().unwrap().trim_end_matches("[]");
            assert!(
                doc.contains(&format!("`{leaf}`")) || doc.contains(&format!(".{leaf}`")),
                "docs/json-schema.md does not explain `{leaf}`"
            );
        }
    }

    #[test]
    fn json_lines_are_what_serde_prints_for_both_producers() {
        let (t, plans) = forwarded();
        let mut all = prediction_models();
        all.push(report(&t, &plans, 3));
        all.push(named_report(&t, &plans, &lab_namer()));
        for r in all {
            assert_eq!(r.to_json_line(), serde_json::to_string(&r).unwrap());
        }
    }

    #[test]
    fn endpoints_keep_ports_only_for_protocols_with_ports() {
        let v6 = Endpoint {
            addr: "2001:db8::1".parse().unwrap(),
            port: 80,
        };
        assert_eq!(endpoint(&v6, true).to_string(), "[2001:db8::1]:80");
        assert_eq!(endpoint(&v6, false).port, None);
    }

    /// The packet object of a DNATed and masqueraded flow: as it came, and as it left.
    #[test]
    fn a_nated_flow_carries_its_first_and_last_headers() {
        let (t, plans) = forwarded();
        let v: serde_json::Value =
            serde_json::from_str(&report(&t, &plans, 0).to_json_line()).unwrap();
        assert_eq!(
            v["packet"],
            serde_json::json!({
                "family": "ipv4", "proto": "tcp",
                "src": "198.51.100.10", "dst": "10.10.10.2", "sport": 40000, "dport": 22,
                "icmp": null,
                "last": {"src": "172.17.0.1", "dst": "172.17.0.5", "sport": 40000,
                         "dport": 22, "icmp": null}
            })
        );
        // Without NAT the packet leaves as it came: no `last`.
        let (mut t, plans) = forwarded();
        let first = (t.records[0].src, t.records[0].dst);
        for r in &mut t.records {
            (r.src, r.dst) = first;
        }
        let r = report(&t, &plans, 0);
        assert!(r.nat.is_empty());
        let p = r.packet.as_ref().unwrap();
        assert_eq!(p.last, None);
        assert_eq!(p.flow(), "198.51.100.10:40000 -> 10.10.10.2:22");
    }

    /// An IPv6 event at TC ingress (link-local to a multicast group), of protocol `proto`.
    fn v6_ingress(proto: u8, sport: u16, dport: u16) -> observer_common::PacketEvent {
        let mut ev = tcp_event(
            hook::TC_INGRESS,
            0,
            0xffff_0000_0000_2000,
            ([0; 4], 0),
            ([0; 4], 0),
            0,
        );
        ev.header.family = observer_common::family::IPV6;
        ev.header.ifindex_in = 2;
        ev.packet.ip_version = 6;
        ev.packet.l4proto = proto;
        ev.packet.saddr = "fe80::1".parse::<std::net::Ipv6Addr>().unwrap().octets();
        ev.packet.daddr = "ff02::fb".parse::<std::net::Ipv6Addr>().unwrap().octets();
        (ev.packet.sport, ev.packet.dport) = (sport, dport);
        ev
    }

    /// A datagram the kernel drops before its first table (as an IPv6 multicast datagram
    /// freed in `ip6_mc_input` is, where no table runs before that): no stage shows it,
    /// and its JSON, tree and line still say which packet it was.
    #[test]
    fn a_packet_dropped_before_any_table_carries_its_addresses() {
        let plans = index_plans(&full_plan(None));
        let rec = decode(&encode_record(&record_of(
            &[v6_ingress(17, 5353, 5353)],
            end::DROPPED,
        )))
        .unwrap();
        let mut t = assemble(&rec, &plans, &LAYOUT).unwrap();
        t.drop = Some(crate::pipeline::correlate::Drop {
            reason: 12,
            location: 0x15e,
        });
        let r = report(&t, &plans, 0);
        assert!(r.stages.is_empty());
        assert_eq!(r.fate.kind, FateKind::Dropped);
        let v: serde_json::Value = serde_json::from_str(&r.to_json_line()).unwrap();
        assert_eq!(
            v["packet"],
            serde_json::json!({
                "family": "ipv6", "proto": "udp", "src": "fe80::1", "dst": "ff02::fb",
                "sport": 5353, "dport": 5353, "icmp": null, "last": null
            })
        );
        let flow = "ipv6 udp [fe80::1]:5353 -> [ff02::fb]:5353";
        let tree = r.render_tree();
        assert!(tree.starts_with(flow), "{tree}");
        assert!(tree.contains("DROPPED after TC ingress"), "{tree}");
        let line = r.render_line();
        assert!(line.starts_with(flow), "{line}");
    }

    /// An ICMPv6 echo request: its type, code and identifier (where the probes keep them:
    /// type and code in the destination port, the identifier in the source port).
    #[test]
    fn an_icmp_packet_carries_its_type_code_and_echo_id() {
        let plans = index_plans(&full_plan(None));
        let rec = decode(&encode_record(&record_of(
            &[v6_ingress(58, 0x1234, 128 << 8)],
            end::CONSUMED,
        )))
        .unwrap();
        let t = assemble(&rec, &plans, &LAYOUT).unwrap();
        let v: serde_json::Value =
            serde_json::from_str(&report(&t, &plans, 0).to_json_line()).unwrap();
        assert_eq!(v["packet"]["proto"], "icmpv6");
        assert_eq!(
            (&v["packet"]["sport"], &v["packet"]["dport"]),
            (&serde_json::Value::Null, &serde_json::Value::Null)
        );
        assert_eq!(
            v["packet"]["icmp"],
            serde_json::json!({"type": 128, "code": 0, "id": 0x1234})
        );
    }
}
