//! Annotation and rendering: a traversal -> the per-table report (JSON schema 1 and the
//! human tree). Pure: interface names come through a lookup the caller provides.

use std::fmt::Write as _;
use std::sync::Arc;

use serde::Serialize;

use crate::annotate::{
    self, ConntrackView, EndPoint, Fate, MarkChange, Marks, Names, Nat, ObservedStage,
};
use crate::correlate::{Closed, Plans, Traversal, missing_text};
use crate::decode::{Endpoint, Observation, Point};
use crate::marks::MarkDictionary;
use crate::nf_link::{NfFamily, NfHook};
use observer_common::NF_SLOTS;

pub use crate::correlate::index_plans;

pub const SCHEMA: u32 = 1;

#[derive(Serialize, Debug, Clone, PartialEq)]
pub struct Report {
    pub schema: u32,
    pub netns: String,
    pub family: Option<&'static str>,
    pub proto: String,
    pub ingress: Option<Iface>,
    pub egress: Option<Iface>,
    /// The routing decision: `input`, `forward` or `output`.
    pub route: Option<&'static str>,
    pub stages: Vec<Stage>,
    pub fate: Fate,
    pub marks: Marks,
    pub nat: Vec<Nat>,
    pub conntrack: Option<Arc<ConntrackView>>,
    /// Packets the kernel could not record (ring buffer full) since the previous report.
    pub lost: u64,
    /// Part of the traversal is missing: its end was not seen, or the record could not hold
    /// all of it. Never printed as complete.
    pub incomplete: bool,
    /// Why, when `incomplete`.
    pub incomplete_reason: Option<String>,
    /// `src -> dst` as first seen, for the tree's header (also when no stage was passed).
    #[serde(skip)]
    pub flow: String,
}

/// Snapshots made for earlier traversals, by what they show: a flow's packets show the same
/// few, and formatting them is most of a report's cost. Bounded; starts over when full.
#[derive(Default)]
pub struct SnapshotCache {
    map: std::cell::RefCell<
        std::collections::HashMap<SnapKey, Arc<Snapshot>, crate::render_cache::Fnv>,
    >,
    cts: std::cell::RefCell<
        std::collections::HashMap<CtKey, Arc<ConntrackView>, crate::render_cache::Fnv>,
    >,
}

type CtKey = (u32, u32, crate::decode::Tuple, crate::decode::Tuple);

type SnapKey = (
    Option<Endpoint>,
    Option<Endpoint>,
    bool,
    u32,
    u32,
    Option<(Endpoint, Endpoint, u8)>,
);

impl SnapshotCache {
    const ENTRIES: usize = 65536;

    /// The connection view of `t`, shared with earlier reports of the same connection state.
    fn conntrack(&self, t: &Traversal) -> Option<Arc<ConntrackView>> {
        let ct = *t.records.iter().rev().find_map(|r| r.ct.as_ref())?;
        let key = (ct.info, ct.mark, ct.original, ct.reply);
        if let Some(v) = self.cts.borrow().get(&key) {
            return Some(v.clone());
        }
        let v = Arc::new(annotate::conntrack(t)?);
        let mut map = self.cts.borrow_mut();
        if map.len() >= Self::ENTRIES {
            map.clear();
        }
        map.insert(key, v.clone());
        Some(v)
    }

    fn get(&self, o: &Observation) -> Option<Arc<Snapshot>> {
        let key = (o.src, o.dst, o.has_ports, o.mark, o.len, o.inner);
        if let Some(s) = self.map.borrow().get(&key) {
            return Some(s.clone());
        }
        let s = Arc::new(snapshot(o)?);
        let mut map = self.map.borrow_mut();
        if map.len() >= Self::ENTRIES {
            map.clear();
        }
        map.insert(key, s.clone());
        Some(s)
    }
}

/// What building a report needs besides the traversal.
pub struct Context<'a> {
    /// Snapshots shared across reports.
    pub snapshots: &'a SnapshotCache,
    pub plans: &'a Plans,
    pub netns: &'a str,
    pub marks: &'a MarkDictionary,
    pub names: Names<'a>,
    pub ifname: &'a dyn Fn(u32) -> String,
}

#[derive(Serialize, Debug, Clone, PartialEq)]
pub struct Iface {
    pub iface: String,
}

#[derive(Serialize, Debug, Clone, PartialEq)]
pub struct Stage {
    pub hook: &'static str,
    pub table: Arc<str>,
    pub priority: i32,
    pub before: Option<Arc<Snapshot>>,
    pub after: Option<Arc<Snapshot>>,
    pub ct: Option<Arc<CtView>>,
    pub verdict: &'static str,
}

/// The packet just before or after a table. Serialized from a JSON rendering made once
/// and shared by every stage showing the same snapshot: most stages of a packet show the
/// same few, and escaping their strings again for each was most of the collector's work.
#[derive(Debug, Clone)]
pub struct Snapshot {
    pub src: String,
    pub dst: String,
    pub mark: String,
    /// `skb->len`: a GSO/GRO aggregate is one packet of many MTUs; a reassembled packet
    /// grows at defragmentation.
    pub len: u32,
    /// ICMP errors only: the packet the error quotes, which conntrack translates too.
    pub inner: Option<Quoted>,
    json: Box<serde_json::value::RawValue>,
}

#[derive(Serialize)]
struct SnapshotJson<'a> {
    src: &'a str,
    dst: &'a str,
    mark: &'a str,
    len: u32,
    #[serde(skip_serializing_if = "Option::is_none")]
    inner: Option<&'a Quoted>,
}

impl Snapshot {
    pub fn new(src: String, dst: String, mark: String, len: u32, inner: Option<Quoted>) -> Self {
        // Rendered without a parse back (`from_string` would validate what we just wrote).
        let json = serde_json::value::to_raw_value(&SnapshotJson {
            src: &src,
            dst: &dst,
            mark: &mark,
            len,
            inner: inner.as_ref(),
        })
        .expect("a snapshot serialises");
        Self {
            src,
            dst,
            mark,
            len,
            inner,
            json,
        }
    }
}

impl PartialEq for Snapshot {
    fn eq(&self, o: &Self) -> bool {
        self.src == o.src
            && self.dst == o.dst
            && self.mark == o.mark
            && self.len == o.len
            && self.inner == o.inner
    }
}

impl Eq for Snapshot {}

impl Serialize for Snapshot {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        self.json.serialize(s)
    }
}

#[derive(Serialize, Debug, Clone, PartialEq, Eq)]
pub struct Quoted {
    pub src: String,
    pub dst: String,
    pub proto: String,
}

#[derive(Serialize, Debug, Clone, PartialEq, Eq)]
pub struct CtView {
    pub state: String,
    pub mark: String,
}

pub fn proto_name(p: u8) -> String {
    match p {
        0 => "hopopt".into(),
        1 => "icmp".into(),
        6 => "tcp".into(),
        17 => "udp".into(),
        58 => "icmpv6".into(),
        132 => "sctp".into(),
        n => n.to_string(),
    }
}

/// `a.b.c.d:port`, `[v6]:port`, or the bare address for protocols without ports. Written
/// by hand for IPv4: `Ipv4Addr`'s `Display` (it supports padding) was the collector's
/// largest cost.
pub fn endpoint(e: &Endpoint, has_port: bool) -> String {
    let mut s = String::with_capacity(24);
    match e.addr {
        std::net::IpAddr::V4(a) => {
            for (i, o) in a.octets().into_iter().enumerate() {
                if i > 0 {
                    s.push('.');
                }
                push_decimal(&mut s, o.into());
            }
        }
        std::net::IpAddr::V6(a) if has_port => {
            let _ = write!(s, "[{a}]");
        }
        std::net::IpAddr::V6(a) => {
            let _ = write!(s, "{a}");
        }
    }
    if has_port {
        s.push(':');
        push_decimal(&mut s, e.port.into());
    }
    s
}

/// Appends `n` in decimal.
fn push_decimal(s: &mut String, mut n: u32) {
    let mut buf = [0u8; 10];
    let mut i = buf.len();
    loop {
        i -= 1;
        buf[i] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 {
            break;
        }
    }
    // The digits are ASCII.
    s.push_str(std::str::from_utf8(&buf[i..]).unwrap_or("?"));
}

fn snapshot(o: &Observation) -> Option<Snapshot> {
    Some(Snapshot::new(
        endpoint(&o.src?, o.has_ports),
        endpoint(&o.dst?, o.has_ports),
        format!("{:#x}", o.mark),
        o.len,
        o.inner.map(|(s, d, p)| {
            let ports = matches!(p, 6 | 17 | 132);
            Quoted {
                src: endpoint(&s, ports),
                dst: endpoint(&d, ports),
                proto: proto_name(p),
            }
        }),
    ))
}

/// Snapshots already made for this traversal: most records of a packet look alike, and
/// formatting addresses is the costly part of a report.
struct Snapshots<'a> {
    made: Vec<(&'a Observation, Arc<Snapshot>)>,
    cts: Vec<(u32, u32, Arc<CtView>)>,
    shared: &'a SnapshotCache,
}

impl<'a> Snapshots<'a> {
    /// The conntrack view of `c`, shared between the stages that show the same one.
    fn ct(&mut self, c: &crate::decode::Conntrack) -> Arc<CtView> {
        if let Some((_, _, v)) = self
            .cts
            .iter()
            .find(|(i, m, _)| *i == c.info && *m == c.mark)
        {
            return v.clone();
        }
        let v = Arc::new(CtView {
            state: c.state().to_string(),
            mark: format!("{:#x}", c.mark),
        });
        self.cts.push((c.info, c.mark, v.clone()));
        v
    }

    fn of(&mut self, o: &'a Observation) -> Option<Arc<Snapshot>> {
        let same = |a: &Observation| {
            a.src == o.src
                && a.dst == o.dst
                && a.has_ports == o.has_ports
                && a.mark == o.mark
                && a.len == o.len
                && a.inner == o.inner
        };
        if let Some((_, s)) = self.made.iter().find(|(a, _)| same(a)) {
            return Some(s.clone());
        }
        let s = self.shared.get(o)?;
        self.made.push((o, s.clone()));
        Some(s)
    }
}

/// Builds the report of one traversal.
pub fn build(t: &Traversal, ctx: &Context, lost: u64) -> Report {
    let first_l3 = t.records.iter().find(|r| r.src.is_some());
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

    // Netfilter records grouped by hook, hooks in the order the packet met them.
    let mut hooks: Vec<(NfHook, [Option<&Observation>; NF_SLOTS])> = Vec::new();
    for r in &t.records {
        if let Point::Netfilter(h, slot) = r.point {
            if hooks.last().map(|(lh, _)| *lh) != Some(h) {
                hooks.push((h, [None; NF_SLOTS]));
            }
            let seen = &mut hooks.last_mut().expect("pushed").1;
            if let Some(s @ None) = seen.get_mut(slot) {
                *s = Some(r);
            }
        }
    }
    let mut snapshots = Snapshots {
        made: Vec::with_capacity(8),
        cts: Vec::new(),
        shared: ctx.snapshots,
    };
    // A fragment merged by defragmentation never reached a table: no stages, no drop.
    if annotate::reassembled(t) {
        hooks.clear();
    }
    // Conntrack is a stage only where it runs: some record of the packet has an entry.
    let tracked = t.records.iter().any(|r| r.ct.is_some());
    let mut observed: Vec<ObservedStage> = Vec::new();
    let mut stages = Vec::new();
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
            let Some(before) = b.and_then(|s| seen.get(s).copied().flatten()) else {
                continue;
            };
            let after = a.and_then(|s| seen.get(s).copied().flatten());
            let seen_later =
                later_hooks || a.is_some_and(|a| seen.iter().skip(a + 1).any(Option::is_some));
            // The packet's last table: what ended it there decides the verdict.
            let ended_here = after.is_none() && !seen_later;
            let verdict = match (ended_here, t.closed) {
                (false, _) => "accept",
                (true, Closed::Dropped) => "drop",
                (true, Closed::Consumed) => "stolen",
                (true, _) => "unknown",
            };
            let ct_src = after.unwrap_or(before);
            stages.push(Stage {
                hook: hook.name(),
                table: table.name.clone(),
                priority: table.priority,
                before: snapshots.of(before),
                after: after.and_then(|o| snapshots.of(o)),
                ct: ct_src.ct.map(|c| snapshots.ct(&c)),
                verdict,
            });
            observed.push(ObservedStage {
                hook: *hook,
                table: table.name.clone(),
                before,
                after,
            });
            if ended_here {
                break 'hooks;
            }
        }
    }
    let route = annotate::route(t);
    let fate = annotate::fate(t, &end_point(t, family, ctx.plans), route, &ctx.names);
    let mut reasons: Vec<&str> = missing_text(t.missing);
    if fate.kind == "incomplete" {
        reasons.insert(0, fate.reason.as_deref().unwrap_or("end not seen"));
    }
    Report {
        schema: SCHEMA,
        netns: ctx.netns.to_string(),
        family: family.map(NfFamily::name),
        proto: first_l3.map_or_else(|| "unknown".into(), |r| proto_name(r.proto)),
        ingress,
        egress,
        route,
        incomplete: !reasons.is_empty(),
        incomplete_reason: (!reasons.is_empty()).then(|| reasons.join("; ")),
        fate,
        marks: annotate::marks(&observed, ctx.marks),
        nat: annotate::nat(&observed),
        conntrack: ctx.snapshots.conntrack(t),
        stages,
        lost,
        flow: first_l3
            .and_then(|o| snapshots.of(o))
            .map_or_else(|| "?".into(), |s| format!("{} -> {}", s.src, s.dst)),
    }
}

/// `HOOK/priority` of point `at` in its plan.
fn point_name(hook: NfHook, at: usize, plan: Option<&crate::plan::HookPlan>) -> String {
    match plan.and_then(|p| p.points.get(at)) {
        Some(prio) => format!("{}/{prio}", hook.name()),
        None => format!("{}/point {at}", hook.name()),
    }
}

/// The last point the packet passed, the next one on its path, and the table between them.
fn end_point(t: &Traversal, family: Option<NfFamily>, plans: &Plans) -> EndPoint {
    let none = EndPoint {
        hook: None,
        table: None,
        after: None,
        before: None,
    };
    match t.records.last().map(|r| r.point) {
        Some(Point::TcIngress) => EndPoint {
            after: Some("TC ingress".into()),
            ..none
        },
        Some(Point::TcEgress) => EndPoint {
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
            EndPoint {
                hook: Some(hook),
                table: next.and_then(|(_, t)| t.map(|t| t.name.clone())),
                after: Some(point_name(hook, at, plan)),
                before: next.map(|(n, _)| point_name(hook, n, plan)),
            }
        }
        None => none,
    }
}

impl Report {
    pub fn to_json_line(&self) -> String {
        serde_json::to_string(self).expect("report serialises")
    }

    /// Writes the JSON line (no newline) straight into `out`, without an intermediate string.
    pub fn write_json<W: std::io::Write>(&self, out: W) -> std::io::Result<()> {
        serde_json::to_writer(out, self).map_err(std::io::Error::from)
    }

    fn flow(&self) -> String {
        self.flow.clone()
    }

    fn mark_word(c: &MarkChange, sign: char) -> String {
        format!(
            "{sign}{} {}",
            c.bit,
            c.name.as_deref().unwrap_or("(unnamed)")
        )
    }

    /// The readable tree: a header line, one line per table with what it changed (NAT, mark
    /// bits by name, conntrack state), then the packet's fate and its connection.
    pub fn render_tree(&self) -> String {
        let mut out = String::new();
        let _ = write!(
            out,
            "{} {} {}",
            self.family.unwrap_or("?"),
            self.proto,
            self.flow()
        );
        if let Some(i) = &self.ingress {
            let _ = write!(out, "  in {}", i.iface);
        }
        if let Some(e) = &self.egress {
            let _ = write!(out, "  out {}", e.iface);
        }
        if let Some(r) = self.route {
            let _ = write!(out, "  route {r}");
        }
        if self.lost > 0 {
            let _ = write!(out, "  [{} packets lost in kernel]", self.lost);
        }
        if self.incomplete && self.fate.kind != "incomplete" {
            let _ = write!(
                out,
                "  [incomplete: {}]",
                self.incomplete_reason.as_deref().unwrap_or("?")
            );
        }
        out.push('\n');
        let mut last_ct: Option<&CtView> = None;
        for s in &self.stages {
            let here = |hook: &str, table: &str| hook == s.hook && table == &*s.table;
            let mut what = Vec::new();
            let mut note = None;
            for n in self.nat.iter().filter(|n| here(n.hook, &n.table)) {
                what.push(format!(
                    "{} {} -> {} ({})",
                    n.kind.to_uppercase(),
                    n.from,
                    n.to,
                    if n.source == "rules" {
                        "nat rules"
                    } else {
                        "conntrack"
                    }
                ));
                if n.source == "conntrack" {
                    note = Some(
                        "the nat table is not consulted for this packet because its connection \
                         is already established: conntrack applied the stored translation",
                    );
                }
            }
            for c in self.marks.set.iter().filter(|c| here(c.hook, &c.table)) {
                what.push(Self::mark_word(c, '+'));
            }
            for c in self.marks.cleared.iter().filter(|c| here(c.hook, &c.table)) {
                what.push(Self::mark_word(c, '-'));
            }
            if s.ct.as_deref() != last_ct {
                if let Some(ct) = &s.ct {
                    what.push(format!("ct {} (ctmark {})", ct.state, ct.mark));
                }
                last_ct = s.ct.as_deref();
            }
            if let (Some(b), Some(a)) = (
                s.before.as_ref().and_then(|b| b.inner.as_ref()),
                s.after.as_ref().and_then(|a| a.inner.as_ref()),
            ) && b != a
            {
                what.push(format!(
                    "quoted packet {} -> {} became {} -> {}",
                    b.src, b.dst, a.src, a.dst
                ));
            }
            match s.verdict {
                "drop" => what.push("dropped here".into()),
                "stolen" => what.push("taken here (stolen)".into()),
                "unknown" => what.push("not seen after this table".into()),
                _ => {}
            }
            if what.is_empty() {
                what.push("-".into());
            }
            let _ = writeln!(
                out,
                "  {:<12} {:<10} {:>6}  {}",
                s.hook,
                s.table,
                s.priority,
                what.join(", ")
            );
            if let Some(n) = note {
                let _ = writeln!(out, "  {:<31}  note: {n}", "");
            }
        }
        let _ = writeln!(out, "  => {}", self.fate_text());
        if let Some(ct) = &self.conntrack {
            let _ = writeln!(
                out,
                "  conntrack: {} (ctmark {}), original {} -> {}, reply {} -> {}",
                ct.state, ct.mark, ct.original.src, ct.original.dst, ct.reply.src, ct.reply.dst
            );
        }
        out
    }

    fn fate_text(&self) -> String {
        let f = &self.fate;
        let place = match (f.hook, &f.table) {
            (Some(h), Some(t)) => format!(" in {h}/{t}"),
            (Some(h), None) => format!(" after {h}"),
            (None, _) => f
                .after
                .as_deref()
                .map_or(String::new(), |a| format!(" after {a}")),
        };
        let func = |sep: &str| {
            f.location
                .as_deref()
                .map_or(String::new(), |l| format!("{sep}in {l}"))
        };
        match f.kind {
            "dropped" => format!(
                "DROPPED{place}{}: {}",
                func(", "),
                f.reason.as_deref().unwrap_or("no reason given")
            ),
            "consumed" => format!("consumed by the kernel{place}{}", func(", ")),
            "forwarded" | "sent" => match &self.egress {
                Some(e) => format!("{} out {}", f.kind, e.iface),
                None => f.kind.to_string(),
            },
            "delivered" => "delivered to a local socket".into(),
            "looped" => "looped back to this host (left POSTROUTING without an interface)".into(),
            "reassembled" => {
                "fragment merged by defragmentation (PREROUTING, priority -400)".into()
            }
            _ => format!(
                "INCOMPLETE{place}: {}",
                self.incomplete_reason.as_deref().unwrap_or("end not seen")
            ),
        }
    }

    /// One line per packet: flow, interfaces, route, NAT, mark changes, fate.
    pub fn render_line(&self) -> String {
        let mut parts = vec![format!(
            "{} {} {} [{} -> {}] {}",
            self.family.unwrap_or("?"),
            self.proto,
            self.flow(),
            self.ingress.as_ref().map_or("-", |i| i.iface.as_str()),
            self.egress.as_ref().map_or("-", |i| i.iface.as_str()),
            self.route.unwrap_or("-"),
        )];
        let nat: Vec<String> = self
            .nat
            .iter()
            .map(|n| {
                format!(
                    "{} {}->{}@{}/{}({})",
                    n.kind.to_uppercase(),
                    n.from,
                    n.to,
                    n.hook,
                    n.table,
                    n.source
                )
            })
            .collect();
        if !nat.is_empty() {
            parts.push(nat.join(" "));
        }
        let marks: Vec<String> = self
            .marks
            .set
            .iter()
            .map(|c| (c, '+'))
            .chain(self.marks.cleared.iter().map(|c| (c, '-')))
            .map(|(c, sign)| format!("{}@{}/{}", Self::mark_word(c, sign), c.hook, c.table))
            .collect();
        if !marks.is_empty() {
            parts.push(marks.join(" "));
        }
        parts.push(self.fate_text());
        parts.join(" | ")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::correlate::assemble;
    use crate::correlate::tests::record_of;
    use crate::decode::tests::{LAYOUT, tcp_event, with_ct};
    use crate::decode::{decode, encode_record};
    use crate::plan::full_plan;
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
            if slot >= 2 {
                e = with_ct(e, 2, orig, reply);
            }
            evs.push(e);
        }
        // FORWARD: FIRST, -149, 1, LAST (after security), as the plan's programs.
        let programs = |h| plans[&(NfFamily::Ipv4, h)].programs.clone();
        for slot in programs(NfHook::Forward) {
            evs.push(with_ct(
                tcp_event(2, slot as u32, skb, CLIENT, POD, 0x4000),
                2,
                orig,
                reply,
            ));
        }
        // POSTROUTING: FIRST, -149, LAST; MASQUERADE at nat (100).
        for (at, slot) in programs(NfHook::PostRouting).into_iter().enumerate() {
            let src = if at >= 2 { NODE } else { CLIENT };
            evs.push(with_ct(
                tcp_event(4, slot as u32, skb, src, POD, 0x4000),
                2,
                orig,
                reply,
            ));
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

    fn report(t: &Traversal, plans: &Plans, lost: u64) -> Report {
        let marks = MarkDictionary::default();
        let reasons: HashMap<u32, String> = [(12, "NETFILTER_DROP".to_string())].into();
        let symbol = |a: u64| format!("fn+{a:#x}");
        let shared = SnapshotCache::default();
        let ctx = Context {
            snapshots: &shared,
            plans,
            netns: "node",
            marks: &marks,
            names: Names {
                drop_reasons: &reasons,
                symbol: &symbol,
            },
            ifname: &names,
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
        assert_eq!(r.family, Some("ipv4"));
        assert_eq!(r.proto, "tcp");
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
        let hooks: Vec<_> = r.stages.iter().map(|s| (s.hook, &*s.table)).collect();
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
        assert_eq!(nat.before.as_ref().unwrap().dst, "10.10.10.2:22");
        assert_eq!(nat.after.as_ref().unwrap().dst, "172.17.0.5:22");
        assert_eq!(nat.after.as_ref().unwrap().mark, "0x4000");
        assert_eq!(nat.ct.as_ref().unwrap().state, "new");
        let snat = &r.stages[8];
        assert_eq!(snat.after.as_ref().unwrap().src, "172.17.0.1:40000");
        assert!(r.stages.iter().all(|s| s.verdict == "accept"));
        // No conntrack entry before the conntrack table runs.
        assert!(r.stages[0].ct.is_none());
    }

    #[test]
    fn json_matches_schema_shape() {
        let (t, plans) = forwarded();
        let v: serde_json::Value =
            serde_json::from_str(&report(&t, &plans, 3).to_json_line()).unwrap();
        assert_eq!(v["schema"], 1);
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
        t.drop = (how == Closed::Dropped).then_some(crate::correlate::Drop {
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
            ("FORWARD", "filter", "drop")
        );
        assert!(last.after.is_none());
        assert_eq!(r.egress, None);
        assert_eq!(
            (r.fate.kind, r.fate.hook, r.fate.table.as_deref()),
            ("dropped", Some("FORWARD"), Some("filter"))
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
        assert_eq!(r.fate.kind, "incomplete");
        assert!(r.incomplete);
        assert_eq!(r.stages.last().unwrap().verdict, "unknown");
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
        t.drop = Some(crate::correlate::Drop {
            reason: 12,
            location: 0x15e,
        });
        let r = report(&t, &plans, 0);
        assert_eq!(
            (r.fate.hook, r.fate.table.as_deref()),
            (Some("PREROUTING"), None)
        );
        assert!(r.stages.iter().all(|s| s.verdict == "accept"));
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

    #[test]
    fn documented_schema_matches() {
        let doc = include_str!("../../docs/json-schema.md");
        let start = doc.find("```json").expect("json example in docs") + "```json".len();
        let end = start + doc[start..].find("```").expect("closed block");
        let documented: serde_json::Value = serde_json::from_str(&doc[start..end]).unwrap();
        let (t, plans) = forwarded();
        let real: serde_json::Value =
            serde_json::from_str(&report(&t, &plans, 0).to_json_line()).unwrap();
        let (mut want, mut got) = (Default::default(), Default::default());
        key_paths(&documented, "", &mut want);
        key_paths(&real, "", &mut got);
        assert_eq!(
            want, got,
            "docs/json-schema.md and the printed JSON disagree"
        );
        // Every key of the real output is explained in the doc's table too.
        for k in got {
            let leaf = k.rsplit('.').next().unwrap();
            assert!(
                doc.contains(&format!("`{leaf}`")) || doc.contains(&format!(".{leaf}`")),
                "docs/json-schema.md does not explain `{leaf}`"
            );
        }
    }

    #[test]
    fn endpoints_format_by_family_and_protocol() {
        let v6 = Endpoint {
            addr: "2001:db8::1".parse().unwrap(),
            port: 80,
        };
        assert_eq!(endpoint(&v6, true), "[2001:db8::1]:80");
        assert_eq!(endpoint(&v6, false), "2001:db8::1");
    }
}
