//! Annotation: what the stages of one traversal mean. The routing decision taken, the
//! packet's fate (and the kernel's drop reason), every mark bit set or cleared and by which
//! table (named from the mark dictionary), every address translation and whether the nat
//! rules or conntrack's stored translation did it, and the connection it belongs to.

use std::collections::HashMap;
use std::sync::Arc;

use observer_model::{
    ConntrackView, Fate, FateKind, MarkChange, MarkDictionary, Marks, Nat, NatKind, NatSource,
    Route, Snapshot, Stage, TupleView,
};

use crate::pipeline::correlate::{Closed, Traversal};
use crate::pipeline::decode::{Conntrack, Endpoint, Observation, Point, Tuple};
use observer_model::Hook as NfHook;

/// `a.b.c.d:port`, `[v6]:port`, or the bare address for protocols without ports.
pub fn endpoint(e: &Endpoint, has_port: bool) -> String {
    observer_model::endpoint(e.addr, has_port.then_some(e.port))
}

/// `IPS_CONFIRMED`: the entry is in the conntrack table; nat rules are no longer consulted.
const IPS_CONFIRMED: u64 = 1 << 3;

/// One stage as observed: the records just before and after a table, and the stage as the
/// report shows it (its snapshots' endpoint text is what a NAT entry shows too).
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
pub struct EndPoint {
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
    }
}

/// How the traversal ended. Takes the end point's text rather than copying it.
pub fn fate(t: &Traversal, at: EndPoint, route: Option<Route>, names: &Names) -> Fate {
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
            Some(ct) if ct.status & IPS_CONFIRMED == 0 => NatSource::Rules,
            Some(_) => NatSource::Conntrack,
            None => NatSource::Rules,
        };
        let ports = after.has_ports;
        // The snapshots' text where the report shows them (the same endpoints, formatted
        // alike: the ports are the same on both sides).
        let text = |e: &Endpoint, shown: Option<&Arc<Snapshot>>, dst: bool| match shown {
            Some(s) if dst => s.dst.clone(),
            Some(s) => s.src.clone(),
            None => endpoint(e, ports).into(),
        };
        let (b, a) = (s.stage.before.as_ref(), s.stage.after.as_ref());
        for (kind, from, to, dst) in [
            (NatKind::Dnat, bd, ad, true),
            (NatKind::Snat, bs, a_s, false),
        ] {
            if from != to {
                out.push(Nat {
                    kind,
                    hook: s.stage.hook,
                    table: s.stage.table.clone(),
                    from: text(from, b, dst),
                    to: text(to, a, dst),
                    source,
                });
            }
        }
    }
    out
}

fn tuple_view(t: &Tuple) -> TupleView {
    let ports = observer_model::has_ports(t.proto);
    TupleView {
        src: endpoint(&t.src, ports),
        dst: endpoint(&t.dst, ports),
        proto: observer_model::proto_name(t.proto),
    }
}

/// The connection as last seen.
pub fn conntrack(t: &Traversal) -> Option<ConntrackView> {
    let ct: &Conntrack = t.records.iter().rev().find_map(|r| r.ct.as_ref())?;
    Some(ConntrackView {
        state: if ct.is_reply() {
            format!("{} reply", ct.state())
        } else {
            ct.state().to_string()
        },
        mark: Some(ct.mark),
        original: tuple_view(&ct.original),
        reply: tuple_view(&ct.reply),
    })
}
