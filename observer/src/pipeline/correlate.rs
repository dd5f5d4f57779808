//! Correlation: one traversal record, assembled by the probes, -> the packet's observations
//! point by point, in the order it passed them.
//!
//! The probes follow a packet by its `sk_buff` address and write one record when its
//! traversal ends (docs/wire-format.md). A record lists the hooks it visited, the probe
//! programs that saw it in each, and a step wherever its state changed; here each program
//! becomes its point (through the probe plan the record was made under) and every point gets
//! the state of the latest step at or before it.

use observer_common::traversal::{
    MAX_STEPS, MAX_VISITS, Step, TraversalRecord, end, missing, step,
};
use observer_common::{flags, hook};

use crate::kernel::btf::TupleLayout;
use crate::kernel::plan::HookPlan;
use crate::pipeline::decode::{
    Conntrack, Observation, Point, Tuple, endpoint, headers_read, quoted_ports,
};
use crate::tuple::tuple;
use observer_model::{Family as NfFamily, Hook as NfHook};

/// Why a traversal ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Closed {
    /// Seen at TC egress: left the namespace's interface.
    Egress,
    /// A socket took it.
    Delivered,
    /// The kernel freed it without calling it a drop.
    Consumed,
    /// The kernel freed it as dropped (`kfree_skb`); the reason is in `Traversal::drop`.
    Dropped,
    /// Written early: no room was left to follow it.
    Reclaimed,
    /// Its skb address started another packet before its end was seen.
    Reused,
    /// Not heard of for the idle time.
    Idle,
    /// Still in flight when the observer stopped.
    InFlight,
    /// Looped back to this host after POSTROUTING, without leaving through an interface.
    Looped,
}

impl Closed {
    fn from_raw(end: u8) -> Option<Self> {
        Some(match end {
            end::EGRESS => Self::Egress,
            end::DELIVERED => Self::Delivered,
            end::CONSUMED => Self::Consumed,
            end::DROPPED => Self::Dropped,
            end::RECLAIMED => Self::Reclaimed,
            end::REUSED => Self::Reused,
            end::IDLE => Self::Idle,
            end::IN_FLIGHT => Self::InFlight,
            end::LOOPED => Self::Looped,
            _ => return None,
        })
    }

    /// Whether the end of the traversal was observed (rather than inferred or cut short).
    pub fn is_observed_end(self) -> bool {
        matches!(
            self,
            Self::Egress | Self::Delivered | Self::Consumed | Self::Dropped | Self::Looped
        )
    }
}

/// What freed the packet: the drop reason (for drops) and where.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Drop {
    /// `enum skb_drop_reason` value; see [`crate::kernel::btf::KernelLayout::drop_reasons`].
    pub reason: u32,
    /// Address inside the kernel function that freed it.
    pub location: u64,
}

#[derive(Clone, Debug)]
pub struct Traversal {
    pub skb: u64,
    pub records: Vec<Observation>,
    pub closed: Closed,
    /// For `Dropped`: the reason and place; for `Consumed`: the place (reason 0).
    pub drop: Option<Drop>,
    /// Bits of [`observer_common::traversal::missing`]: what the record could not hold.
    pub missing: u8,
    /// The device the skb was on at FORWARD where it was neither of the hook's devices: a
    /// bridged frame's out port (br_netfilter's `physoutdev`), known even when a FORWARD
    /// rule drops it ([`observer_common::traversal::Visit::port`]).
    pub forward_port: Option<u32>,
}

/// Probe plans by (family, hook), for one plan generation: an array, since every record's
/// every point looks one up.
#[derive(Clone, Debug, Default)]
pub struct Plans {
    by: [[Option<HookPlan>; 5]; 2],
}

impl Plans {
    pub fn get(&self, key: &(NfFamily, NfHook)) -> Option<&HookPlan> {
        self.by[family_index(key.0)][key.1 as usize].as_ref()
    }
}

impl std::ops::Index<&(NfFamily, NfHook)> for Plans {
    type Output = HookPlan;
    fn index(&self, key: &(NfFamily, NfHook)) -> &HookPlan {
        self.get(key).expect("a plan for every family and hook")
    }
}

fn family_index(f: NfFamily) -> usize {
    match f {
        NfFamily::Ipv4 => 0,
        NfFamily::Ipv6 => 1,
    }
}

pub fn index_plans(plans: &[HookPlan]) -> Plans {
    let mut out = Plans::default();
    for p in plans {
        out.by[family_index(p.family)][p.hook as usize] = Some(p.clone());
    }
    out
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum CorrelateError {
    #[error("traversal record with unknown end {0}")]
    UnknownEnd(u8),
    #[error("traversal record with unknown hook {0}")]
    UnknownHook(u8),
}

/// The point of program `program` in a visit of `hook`, as a sortable position.
fn point_of(hook_no: u8, program: u8, family: Option<NfFamily>, plans: &Plans) -> Option<Point> {
    match hook_no {
        hook::TC_INGRESS => Some(Point::TcIngress),
        hook::TC_EGRESS => Some(Point::TcEgress),
        n => {
            let h = NfHook::from_raw(n)?;
            let at = family
                .and_then(|f| plans.get(&(f, h)))
                .and_then(|p| p.point_of(program as usize))
                .unwrap_or(program as usize);
            Some(Point::Netfilter(h, at))
        }
    }
}

fn position(p: Point) -> usize {
    match p {
        Point::TcIngress | Point::TcEgress => 0,
        Point::Netfilter(_, at) => at,
    }
}

/// The packet's state as a step recorded it.
#[derive(Clone, Copy)]
struct State {
    outer: Step,
    inner: Option<Step>,
}

/// The record's connection tuples (original, reply), decoded once per address family a
/// step reads them with: every point after conntrack shows the same entry.
struct CtTuples<'a> {
    rec: &'a TraversalRecord,
    layout: &'a TupleLayout,
    /// By `v4`: [IPv6, IPv4].
    decoded: [Option<(Tuple, Tuple)>; 2],
}

impl CtTuples<'_> {
    fn get(&mut self, v4: bool) -> (Tuple, Tuple) {
        let (rec, layout) = (self.rec, self.layout);
        *self.decoded[usize::from(v4)].get_or_insert_with(|| {
            (
                tuple(&rec.ct_orig, layout, v4),
                tuple(&rec.ct_reply, layout, v4),
            )
        })
    }
}

fn observation(
    s: &State,
    point: Point,
    rec: &TraversalRecord,
    family: Option<NfFamily>,
    ifindex: (u32, u32),
    tuples: &mut CtTuples,
) -> Observation {
    let o = &s.outer;
    let v4 = o.ip_version == 4;
    let (has_l3, has_ports) = headers_read(o.flags, o.ip_version, o.l4proto);
    let ct_v4 = family != Some(NfFamily::Ipv6) && v4;
    let ct = (o.flags & flags::CT != 0).then(|| {
        let (original, reply) = tuples.get(ct_v4);
        Conntrack {
            info: u32::from(o.ctinfo),
            mark: o.ct_mark,
            status: u64::from(o.ct_status),
            original,
            reply,
        }
    });
    // The packet inside: an ICMP error's quote, or what a VXLAN packet carries (the same
    // family as the outer header: the step does not say another).
    let carried = s.inner.filter(|_| o.flags & flags::INNER != 0).map(|i| {
        let ports = quoted_ports(i.l4proto);
        let (src, dst) = (
            endpoint(&i.saddr, i.sport, v4, ports),
            endpoint(&i.daddr, i.dport, v4, ports),
        );
        (i, (src, dst, i.l4proto))
    });
    Observation {
        point,
        family,
        ts_ns: rec.ts_first,
        skb: rec.skb,
        ifindex_in: ifindex.0,
        ifindex_out: ifindex.1,
        src: has_l3.then(|| endpoint(&o.saddr, o.sport, v4, has_ports)),
        dst: has_l3.then(|| endpoint(&o.daddr, o.dport, v4, has_ports)),
        proto: o.l4proto,
        has_ports,
        tcp_flags: o.tcp_flags,
        len: o.len,
        mark: o.mark,
        ct,
        inner: carried
            .filter(|(i, _)| i.flags & flags::ENCAP == 0)
            .map(|(_, t)| t),
        // A VXLAN packet's inner step keeps its VNI where a step's mark is.
        encap: carried
            .filter(|(i, _)| i.flags & flags::ENCAP != 0)
            .map(|(i, (s, d, p))| (i.mark, s, d, p, crate::pipeline::decode::ip_id_of(i.ip_id))),
        fragment: o.flags & flags::FRAGMENT != 0,
        icmp: crate::pipeline::decode::icmp_of(o.l4proto, o.dport),
        icmp_id: crate::pipeline::decode::icmp_id_of(o.l4proto, o.sport, o.dport),
        ip_id: crate::pipeline::decode::ip_id_of(o.ip_id),
    }
}

/// Expands a traversal record into its observations, one per point passed.
pub fn assemble(
    rec: &TraversalRecord,
    plans: &Plans,
    layout: &TupleLayout,
) -> Result<Traversal, CorrelateError> {
    let closed = Closed::from_raw(rec.end).ok_or(CorrelateError::UnknownEnd(rec.end))?;
    let family = match rec.family {
        observer_common::family::IPV4 => Some(NfFamily::Ipv4),
        observer_common::family::IPV6 => Some(NfFamily::Ipv6),
        _ => None,
    };
    let nsteps = (rec.nsteps as usize).min(MAX_STEPS);
    let steps = &rec.steps[..nsteps];
    // Each step's point as (visit, position), to merge with the points in order: found once
    // per step, not again for every point it is compared with.
    let mut step_at = [None; MAX_STEPS];
    for (s, at) in steps.iter().zip(&mut step_at) {
        *at = rec.visits.get(s.visit as usize).and_then(|v| {
            Some((
                s.visit as usize,
                position(point_of(v.hook, s.program, family, plans)?),
            ))
        });
    }
    let visits = &rec.visits[..(rec.nvisits as usize).min(MAX_VISITS)];
    let mut records = Vec::with_capacity(
        visits
            .iter()
            .map(|v| v.programs.count_ones() as usize)
            .sum(),
    );
    let mut tuples = CtTuples {
        rec,
        layout,
        decoded: [None, None],
    };
    let mut state: Option<State> = None;
    // The observation of the current state, made again only where a step changes it: most
    // points see the packet as the point before did, and differ from it only in where they are.
    let mut seen: Option<Observation> = None;
    let mut next = 0;
    let mut missing = rec.incomplete;
    for (vi, v) in visits.iter().enumerate() {
        if v.programs == 0 {
            continue;
        }
        // The visit's points in the order the packet passed them (at most one per program).
        let at_point = VisitPoints::of(v.hook, family, plans)?;
        let mut positions = [0usize; 32];
        let mut n = 0;
        let mut programs = v.programs;
        while programs != 0 {
            positions[n] = at_point.position(programs.trailing_zeros() as usize);
            programs &= programs - 1;
            n += 1;
        }
        let positions = &mut positions[..n];
        positions.sort_unstable();
        // Every point between the first and the last passed at a hook runs for the packet
        // (a hook calls its entries in order): one that saw nothing is a blind spot.
        if positions.windows(2).any(|w| w[1] > w[0] + 1) {
            missing |= observer_common::traversal::missing::POINT;
        }
        for &at in &*positions {
            let point = at_point.point(at);
            let here = (vi, position(point));
            while let Some(s) = steps.get(next) {
                if step_at[next].is_some_and(|at| at > here) {
                    break;
                }
                let st = state.get_or_insert(State {
                    outer: *s,
                    inner: None,
                });
                if s.flags & step::INNER_STATE != 0 {
                    st.inner = Some(*s);
                } else {
                    st.outer = *s;
                }
                seen = None;
                next += 1;
            }
            // A point before any step: nothing was recorded for it (the record is partial).
            let Some(st) = &state else { continue };
            let ifindex = (v.ifindex_in, v.ifindex_out);
            let o = seen
                .get_or_insert_with(|| observation(st, point, rec, family, ifindex, &mut tuples));
            o.point = point;
            (o.ifindex_in, o.ifindex_out) = ifindex;
            records.push(o.clone());
        }
    }
    let drop = match closed {
        Closed::Dropped | Closed::Consumed => Some(Drop {
            reason: rec.reason,
            location: rec.location,
        }),
        _ => None,
    };
    Ok(Traversal {
        skb: rec.skb,
        records,
        closed,
        drop,
        missing,
        forward_port: visits
            .iter()
            .filter(|v| v.hook == hook::FORWARD)
            .find_map(observer_common::traversal::Visit::port),
    })
}

/// Where the programs of one visit are: its hook, and for netfilter the plan that maps each
/// program to its point (looked up once per visit).
enum VisitPoints<'a> {
    TcIngress,
    TcEgress,
    Netfilter(NfHook, Option<&'a HookPlan>),
}

impl<'a> VisitPoints<'a> {
    fn of(hook_no: u8, family: Option<NfFamily>, plans: &'a Plans) -> Result<Self, CorrelateError> {
        Ok(match hook_no {
            hook::TC_INGRESS => Self::TcIngress,
            hook::TC_EGRESS => Self::TcEgress,
            n => {
                let h = NfHook::from_raw(n).ok_or(CorrelateError::UnknownHook(n))?;
                Self::Netfilter(h, family.and_then(|f| plans.get(&(f, h))))
            }
        })
    }

    /// The position of program `program`'s point (as [`point_of`] finds it).
    fn position(&self, program: usize) -> usize {
        match self {
            Self::TcIngress | Self::TcEgress => 0,
            Self::Netfilter(_, plan) => plan.and_then(|p| p.point_of(program)).unwrap_or(program),
        }
    }

    fn point(&self, position: usize) -> Point {
        match self {
            Self::TcIngress => Point::TcIngress,
            Self::TcEgress => Point::TcEgress,
            Self::Netfilter(h, _) => Point::Netfilter(*h, position),
        }
    }
}

/// Words for the bits of [`missing`], for the report.
pub fn missing_text(bits: u8) -> Vec<&'static str> {
    [
        (missing::STEPS, "more state changes than a record holds"),
        (missing::VISITS, "more hooks than a record holds"),
        (missing::READ, "a probe could not read the packet"),
        (missing::START, "first seen after its start"),
        (missing::REPLANNED, "probes re-planned while in flight"),
        (
            missing::POINT,
            "a point between two it passed saw nothing (the capture backend's blind spot)",
        ),
    ]
    .into_iter()
    .filter(|(b, _)| bits & b != 0)
    .map(|(_, t)| t)
    .collect()
}

#[cfg(test)]
pub mod tests {
    use super::*;
    use crate::kernel::plan::full_plan;
    use crate::pipeline::decode::tests::{LAYOUT, tcp_event};
    use observer_common::PacketEvent;
    use observer_common::traversal::{add_reading, start};

    /// Runs the probes' own assembly over `events` (slot = program) and ends the record
    /// with `how`: what the kernel would write for these readings.
    pub fn record_of(events: &[PacketEvent], how: u8) -> TraversalRecord {
        // SAFETY: all-zero is a valid record.
        let mut rec: TraversalRecord = unsafe { std::mem::zeroed() };
        start(&mut rec, events[0].header.skb, events[0].header.ts_ns, 0);
        for e in events {
            add_reading(&mut rec, e, e.header.slot as u8);
        }
        rec.end = how;
        rec
    }

    fn plans() -> Plans {
        index_plans(&full_plan(None))
    }

    #[test]
    fn a_forwarded_record_expands_to_every_point_passed() {
        let skb = 7;
        let mut evs = vec![tcp_event(
            hook::TC_INGRESS,
            0,
            skb,
            ([10, 0, 0, 1], 1),
            ([10, 0, 0, 2], 22),
            0,
        )];
        for p in 0..6 {
            let mark = if p >= 4 { 0x4000 } else { 0 };
            evs.push(tcp_event(
                0,
                p,
                skb,
                ([10, 0, 0, 1], 1),
                ([10, 0, 0, 2], 22),
                mark,
            ));
        }
        for p in 0..5 {
            evs.push(tcp_event(
                2,
                p,
                skb,
                ([10, 0, 0, 1], 1),
                ([10, 0, 0, 2], 22),
                0x4000,
            ));
        }
        evs.push(tcp_event(
            hook::TC_EGRESS,
            0,
            skb,
            ([10, 0, 0, 1], 1),
            ([10, 0, 0, 2], 22),
            0x4000,
        ));
        let rec = record_of(&evs, end::EGRESS);
        assert_eq!(rec.nsteps, 2);
        let t = assemble(&rec, &plans(), &LAYOUT).unwrap();
        assert_eq!(t.closed, Closed::Egress);
        assert_eq!(t.records.len(), evs.len());
        let marks: Vec<u32> = t.records.iter().map(|o| o.mark).collect();
        assert_eq!(
            marks,
            vec![
                0, 0, 0, 0, 0, 0x4000, 0x4000, 0x4000, 0x4000, 0x4000, 0x4000, 0x4000, 0x4000
            ]
        );
        assert_eq!(t.records[5].point, Point::Netfilter(NfHook::PreRouting, 4));
        assert_eq!(t.records.last().unwrap().point, Point::TcEgress);
    }

    #[test]
    fn programs_map_to_points_through_the_plan() {
        // A custom chain at -250 moves the after-conntrack point, not program 2.
        let plans = index_plans(&full_plan(Some(&[(
            NfFamily::Ipv4,
            NfHook::PreRouting,
            -250,
        )])));
        let plan = &plans[&(NfFamily::Ipv4, NfHook::PreRouting)];
        let evs: Vec<PacketEvent> = plan
            .programs
            .iter()
            .map(|&p| {
                tcp_event(
                    0,
                    p as u32,
                    9,
                    ([1, 1, 1, 1], 1),
                    ([2, 2, 2, 2], 2),
                    p as u32,
                )
            })
            .collect();
        let t = assemble(&record_of(&evs, end::DELIVERED), &plans, &LAYOUT).unwrap();
        for (i, o) in t.records.iter().enumerate() {
            assert_eq!(o.point, Point::Netfilter(NfHook::PreRouting, i));
            assert_eq!(
                o.mark, plan.programs[i] as u32,
                "point {i} has its program's state"
            );
        }
    }

    #[test]
    fn partial_and_interrupted_records_say_so() {
        let all = plans();
        let plan = &all[&(NfFamily::Ipv4, NfHook::Forward)];
        // The hook's first three points (FORWARD has no program 0 or 2).
        let evs: Vec<PacketEvent> = plan.programs[..3]
            .iter()
            .map(|&p| tcp_event(2, p as u32, 3, ([1, 1, 1, 1], 1), ([2, 2, 2, 2], 2), 0))
            .collect();
        let mut rec = record_of(&evs, end::REUSED);
        rec.incomplete |= missing::START;
        let t = assemble(&rec, &plans(), &LAYOUT).unwrap();
        assert_eq!(t.closed, Closed::Reused);
        assert!(!t.closed.is_observed_end());
        assert_eq!(missing_text(t.missing), vec!["first seen after its start"]);
        assert_eq!(t.records.len(), 3);
        rec.end = 99;
        assert_eq!(
            assemble(&rec, &plans(), &LAYOUT).unwrap_err(),
            CorrelateError::UnknownEnd(99)
        );
    }

    /// A point between two the packet passed at one hook that saw nothing (fentry's nat for
    /// an ICMP error of a connection, before it was keyed by nat's hook functions) makes the
    /// traversal incomplete, said why; every point passed: complete.
    #[test]
    fn a_hole_between_points_at_a_hook_is_a_blind_spot() {
        let all = plans();
        let plan = &all[&(NfFamily::Ipv4, NfHook::LocalOut)];
        let n = plan.programs.len();
        assert!(n >= 4, "{plan:?}");
        let at = |points: &[usize]| -> Vec<PacketEvent> {
            points
                .iter()
                .map(|&i| {
                    let p = plan.programs[i] as u32;
                    tcp_event(3, p, 7, ([1, 1, 1, 1], 1), ([2, 2, 2, 2], 2), 0)
                })
                .collect()
        };
        let whole = assemble(
            &record_of(&at(&(0..n).collect::<Vec<_>>()), end::EGRESS),
            &all,
            &LAYOUT,
        )
        .unwrap();
        assert_eq!(missing_text(whole.missing), Vec::<&str>::new());
        // The last points not reached (the packet ended there) are no hole.
        let ended = assemble(&record_of(&at(&[0, 1]), end::DROPPED), &all, &LAYOUT).unwrap();
        assert_eq!(missing_text(ended.missing), Vec::<&str>::new());
        let mut holed: Vec<usize> = (0..n).collect();
        holed.remove(2);
        let t = assemble(&record_of(&at(&holed), end::EGRESS), &all, &LAYOUT).unwrap();
        assert_eq!(
            missing_text(t.missing),
            vec!["a point between two it passed saw nothing (the capture backend's blind spot)"]
        );
    }

    #[test]
    fn interleaved_traversals_stay_apart() {
        // Two packets read alternately (a REJECT's reply inside the first packet's hook):
        // each record holds only its own readings.
        let a: Vec<PacketEvent> = (0..4)
            .map(|p| tcp_event(0, p, 0xa, ([1, 1, 1, 1], 1), ([2, 2, 2, 2], 2), 1))
            .collect();
        let b: Vec<PacketEvent> = (0..4)
            .map(|p| tcp_event(3, p, 0xb, ([2, 2, 2, 2], 2), ([1, 1, 1, 1], 1), 2))
            .collect();
        // SAFETY: all-zero is a valid record.
        let (mut ra, mut rb): (TraversalRecord, TraversalRecord) =
            unsafe { (std::mem::zeroed(), std::mem::zeroed()) };
        start(&mut ra, 0xa, 0, 0);
        start(&mut rb, 0xb, 0, 0);
        for (x, y) in a.iter().zip(&b) {
            add_reading(&mut ra, x, x.header.slot as u8);
            add_reading(&mut rb, y, y.header.slot as u8);
        }
        ra.end = end::DROPPED;
        rb.end = end::EGRESS;
        let ta = assemble(&ra, &plans(), &LAYOUT).unwrap();
        let tb = assemble(&rb, &plans(), &LAYOUT).unwrap();
        assert!(ta.records.iter().all(|o| o.mark == 1 && o.skb == 0xa));
        assert!(
            tb.records
                .iter()
                .all(|o| o.mark == 2 && matches!(o.point, Point::Netfilter(NfHook::LocalOut, _)))
        );
        assert_eq!(
            ta.drop,
            Some(Drop {
                reason: 0,
                location: 0
            })
        );
    }
}
