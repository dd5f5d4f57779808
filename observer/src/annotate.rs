//! Annotation: what the stages of one traversal mean. The routing decision taken, the
//! packet's fate (and the kernel's drop reason), every mark bit set or cleared and by which
//! table (named from the mark dictionary), every address translation and whether the nat
//! rules or conntrack's stored translation did it, and the connection it belongs to.

use std::collections::HashMap;
use std::sync::Arc;

use serde::Serialize;

use crate::correlate::{Closed, Traversal};
use crate::decode::{Conntrack, Observation, Point, Tuple};
use crate::marks::MarkDictionary;
use crate::nf_link::NfHook;
use crate::report::endpoint;

/// `IPS_CONFIRMED`: the entry is in the conntrack table; nat rules are no longer consulted.
const IPS_CONFIRMED: u64 = 1 << 3;

/// One stage as observed: the records just before and after a table.
pub struct ObservedStage<'a> {
    pub hook: NfHook,
    pub table: Arc<str>,
    pub before: &'a Observation,
    pub after: Option<&'a Observation>,
}

#[derive(Serialize, Debug, Clone, PartialEq, Eq)]
pub struct Fate {
    /// `delivered` (a socket took it), `forwarded`, `sent`, `dropped` (the kernel freed it as
    /// dropped), `consumed` (freed without a drop: answered or absorbed by the kernel),
    /// `reassembled` (a fragment merged by defragmentation), or `incomplete` (its end was not
    /// observed: see `reason`).
    pub kind: &'static str,
    /// Where it ended: the hook, and the table only when it died between that table's two
    /// probes.
    pub hook: Option<&'static str>,
    pub table: Option<Arc<str>>,
    /// The kernel's drop reason, or why the traversal is incomplete.
    pub reason: Option<String>,
    /// The kernel function that freed it (`ip6_mc_input+0x15e`), for drops and consumed
    /// packets.
    pub location: Option<String>,
    /// The last observation point it passed (`PREROUTING/-99`, `TC ingress`), and the next
    /// one on its path when that is known: it ended between the two.
    pub after: Option<String>,
    pub before: Option<String>,
}

#[derive(Serialize, Debug, Clone, PartialEq, Eq)]
pub struct MarkChange {
    pub bit: String,
    pub name: Option<String>,
    pub hook: &'static str,
    pub table: Arc<str>,
}

#[derive(Serialize, Debug, Clone, PartialEq, Eq, Default)]
pub struct Marks {
    pub set: Vec<MarkChange>,
    pub cleared: Vec<MarkChange>,
}

#[derive(Serialize, Debug, Clone, PartialEq, Eq)]
pub struct Nat {
    /// `dnat` or `snat`.
    pub kind: &'static str,
    pub hook: &'static str,
    pub table: Arc<str>,
    pub from: String,
    pub to: String,
    /// `rules` when the nat chains were evaluated (first packet of a connection),
    /// `conntrack` when the stored translation was applied.
    pub source: &'static str,
}

#[derive(Serialize, Debug, Clone, PartialEq, Eq)]
pub struct TupleView {
    pub src: String,
    pub dst: String,
    pub proto: String,
}

#[derive(Serialize, Debug, Clone, PartialEq, Eq)]
pub struct ConntrackView {
    pub state: String,
    pub mark: String,
    pub original: TupleView,
    pub reply: TupleView,
}

/// The routing decision: `input`, `forward` or `output` (None if no hook after it was seen).
pub fn route(t: &Traversal) -> Option<&'static str> {
    let hooks = || {
        t.records.iter().filter_map(|r| match r.point {
            Point::Netfilter(h, _) => Some(h),
            _ => None,
        })
    };
    if hooks().any(|h| h == NfHook::LocalIn) {
        Some("input")
    } else if hooks().any(|h| h == NfHook::Forward) {
        Some("forward")
    } else if hooks().next() == Some(NfHook::LocalOut) {
        Some("output")
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

pub fn fate(t: &Traversal, at: &EndPoint, route: Option<&'static str>, names: &Names) -> Fate {
    let location = t
        .drop
        .filter(|d| d.location != 0)
        .map(|d| (names.symbol)(d.location));
    let here = |kind, reason: Option<String>| Fate {
        kind,
        hook: at.hook.map(NfHook::name),
        table: at.table.clone(),
        reason,
        location: location.clone(),
        after: at.after.clone(),
        before: at.before.clone(),
    };
    let left = |hook: NfHook| Fate {
        kind: if route == Some("output") {
            "sent"
        } else {
            "forwarded"
        },
        hook: Some(hook.name()),
        table: None,
        reason: None,
        location: None,
        after: at.after.clone(),
        before: None,
    };
    if reassembled(t) {
        return Fate {
            kind: "reassembled",
            hook: Some(NfHook::PreRouting.name()),
            table: Some("defrag".into()),
            reason: None,
            location,
            after: at.after.clone(),
            before: None,
        };
    }
    match t.closed {
        Closed::Delivered => Fate {
            kind: "delivered",
            hook: Some(NfHook::LocalIn.name()),
            table: None,
            reason: None,
            location: None,
            after: at.after.clone(),
            before: None,
        },
        Closed::Egress => left(NfHook::PostRouting),
        Closed::Looped => Fate {
            kind: "looped",
            hook: Some(NfHook::PostRouting.name()),
            table: None,
            reason: None,
            location: None,
            after: at.after.clone(),
            before: None,
        },
        Closed::Dropped => {
            let reason = t.drop.map(|d| {
                names
                    .drop_reasons
                    .get(&d.reason)
                    .cloned()
                    .unwrap_or_else(|| format!("reason {}", d.reason))
            });
            here("dropped", reason)
        }
        Closed::Consumed => here("consumed", None),
        Closed::Reclaimed | Closed::Reused | Closed::Idle | Closed::InFlight => here(
            "incomplete",
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
    }
}

pub fn marks(stages: &[ObservedStage], dict: &MarkDictionary) -> Marks {
    let mut out = Marks::default();
    for s in stages {
        let Some(after) = s.after else { continue };
        let (b, a) = (s.before.mark, after.mark);
        for bit in (0..32).map(|i| 1u32 << i).filter(|bit| (a ^ b) & bit != 0) {
            let change = MarkChange {
                bit: format!("{bit:#x}"),
                name: dict.name(bit).map(str::to_string),
                hook: s.hook.name(),
                table: s.table.clone(),
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
            (s.before.src, s.before.dst, after.src, after.dst)
        else {
            continue;
        };
        // First packet of a connection: the entry is not confirmed yet, so the nat chains ran.
        let source = match s.before.ct {
            Some(ct) if ct.status & IPS_CONFIRMED == 0 => "rules",
            Some(_) => "conntrack",
            None => "rules",
        };
        let ports = after.has_ports;
        for (kind, from, to) in [("dnat", bd, ad), ("snat", bs, a_s)] {
            if from != to {
                out.push(Nat {
                    kind,
                    hook: s.hook.name(),
                    table: s.table.clone(),
                    from: endpoint(&from, ports),
                    to: endpoint(&to, ports),
                    source,
                });
            }
        }
    }
    out
}

fn tuple_view(t: &Tuple) -> TupleView {
    let ports = matches!(t.proto, 6 | 17 | 132 | 136);
    TupleView {
        src: endpoint(&t.src, ports),
        dst: endpoint(&t.dst, ports),
        proto: crate::report::proto_name(t.proto),
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
        mark: format!("{:#x}", ct.mark),
        original: tuple_view(&ct.original),
        reply: tuple_view(&ct.reply),
    })
}
