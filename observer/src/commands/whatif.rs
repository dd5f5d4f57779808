//! `observer whatif`: a node's recorded traffic held against a changed ruleset, before the
//! change is made. Every distinct flow of a `tail --record` file (the packet as it entered,
//! its interfaces, mark and conntrack state; repeats folded and counted) is simulated under
//! the ruleset it was recorded with and under the new one; the flows whose path changes are
//! printed, grouped by what changed (docs/whatif.md).
//!
//! The pure parts (the flow key and folding, the comparison and grouping, the rendering)
//! take model traversals and need no root and no recording; [`run`] wires them to files.

use std::collections::{BTreeMap, HashMap};
use std::fmt::Write as _;
use std::io::Write;
use std::net::IpAddr;
use std::path::PathBuf;

use anyhow::{Context as _, Result, bail};
use observer_model::{
    CtState, FateKind, Host, MarkDictionary, NatKind, NatSource, Route, Stage, Traversal,
};
use observer_rules::{LiveTexts, PacketSpec};
use serde::Serialize;

use super::explain::{RuleFiles, read_capped};
use crate::pipeline::{Handled, Outcome, Sink};

#[derive(clap::Args, Debug)]
#[command(after_help = "Examples:\n  \
    # the ruleset the recording carries (tail --record reads it) against an edited one:\n  \
    iptables-save > new.rules; $EDITOR new.rules\n  \
    observer whatif --recording node.obsrec --ruleset new.rules\n\n  \
    # a recording made without its ruleset (--no-rules, or an older observer): say what it was\n  \
    observer whatif --recording node.obsrec --old node.rules --ipsets node.ipsets \\\n      \
    --routes routes.json --ruleset new.rules\n\n  \
    # kube-proxy iptables mode -> nftables mode: only outcomes count, not rule names\n  \
    observer whatif --recording node.obsrec --compare outcome --ruleset calico-only.rules \\\n      \
    --nft kube-proxy.nft.json\n\n  \
    # in a pipeline that applies rules: 0 nothing changes, 1 something does (or cannot be\n  \
    # decided), 2 the question could not be answered\n  \
    observer whatif --recording node.obsrec --ruleset new.rules --json > changes.ndjson \\\n      \
    && iptables-restore < new.rules\n\n\
The new node is the recorded one with what you give replaced: --ruleset/--ruleset6/--nft \
replace the rules (all three together: give each the new node has), --ipsets, --routes and the \
bridge inputs each replace their own part. Without a recorded ruleset, --old (and --old6, \
--old-nft) give the old rules and the other inputs you give serve both sides.")]
pub struct WhatifArgs {
    /// A recording made by `observer tail --record FILE` (docs/recording.md).
    #[arg(long, value_name = "FILE")]
    pub recording: PathBuf,
    /// The changed node (the new side): what is not given is the recorded node's.
    #[command(flatten)]
    pub new: RuleFiles,
    /// The `iptables-save` output the recording was made under, when the recording does
    /// not carry its ruleset (or to hold the traffic against another one).
    #[arg(long, value_name = "FILE")]
    pub old: Option<PathBuf>,
    /// The old `ip6tables-save` output (with --old).
    #[arg(long, value_name = "FILE")]
    pub old6: Option<PathBuf>,
    /// The old `nft -j list ruleset` output (with --old).
    #[arg(long, value_name = "FILE")]
    pub old_nft: Option<PathBuf>,
    /// `path`: any change of fate, NAT, marks or of the rules that match; `outcome`: fate,
    /// egress, NAT targets (masquerade included) and the mark bits that matter downstream
    /// only, for a migration (kube-proxy iptables -> nftables) whose rules differ everywhere.
    #[arg(long, value_enum, default_value = "path")]
    pub compare: Compare,
    /// With `--compare outcome`: the mark bits compared (default: all but kube-proxy's,
    /// which it consumes on the node).
    #[arg(long, value_name = "MASK", value_parser = parse_mask)]
    pub mark_mask: Option<u32>,
    /// One JSON object per changed (or undecidable) flow: `change`, `count`, `packet`
    /// (schema 3), `before` and `after` (schema 3 traversals, as `explain --json` prints).
    #[arg(long)]
    pub json: bool,
    /// TOML file naming mark bits, as for `observer tail --marks`.
    #[arg(long, value_name = "FILE")]
    pub marks: Option<PathBuf>,
}

fn parse_mask(s: &str) -> Result<u32, String> {
    observer_rules::net::parse_u32(s).ok_or_else(|| format!("`{s}` is not a mask (0x... or decimal)"))
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Compare {
    /// Any change of the path: fate, NAT, marks, the rules that match.
    Path,
    /// Outcomes only: fate, egress, NAT targets, masquerade, downstream mark bits.
    Outcome,
}

// ---------------------------------------------------------------------------------------
// The flow key and folding.

/// A flow: the packet as it entered (first seen), its interfaces, mark and conntrack state,
/// and which of the recording's rulesets was in force. Packets with equal keys walk the
/// same path under any ruleset, so each key is simulated once.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct FlowKey {
    pub proto: u8,
    pub src: IpAddr,
    pub sport: Option<u16>,
    pub dst: IpAddr,
    pub dport: Option<u16>,
    /// ICMP type and code.
    pub icmp: Option<(u8, u8)>,
    pub ingress: Option<String>,
    /// Where it left, as observed (none: dropped, or delivered).
    pub egress: Option<String>,
    /// The observed routing decision (`input`, `forward`, `output`, ...).
    pub route: Option<&'static str>,
    /// The mark as it entered the first table.
    pub mark: u32,
    pub state: CtState,
    /// A reply of its connection.
    pub reply: bool,
    /// The connection's mark (not new connections: theirs is 0).
    pub ct_mark: Option<u32>,
    /// Index of the recorded ruleset in force when it was recorded.
    pub ruleset: usize,
}

/// Why a traversal cannot be made a flow.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Unusable {
    /// No IP header was read.
    NoHeader,
}

impl FlowKey {
    /// The flow of an observed traversal, recorded under ruleset `ruleset`.
    pub fn of(t: &Traversal, ruleset: usize) -> Result<FlowKey, Unusable> {
        let p = t.packet.as_ref().ok_or(Unusable::NoHeader)?;
        let (Host::Ip(src), Host::Ip(dst)) = (&p.first.src.host, &p.first.dst.host) else {
            return Err(Unusable::NoHeader);
        };
        let ct = t.stages.iter().find_map(|s| s.ct.as_ref());
        let state = match ct.map(|c| c.state) {
            // Untracked by a raw rule, which the simulation meets again.
            None | Some(CtState::Untracked) => CtState::New,
            Some(s) => s,
        };
        Ok(FlowKey {
            proto: p.proto.number(),
            src: *src,
            sport: p.first.src.port,
            dst: *dst,
            dport: p.first.dst.port,
            icmp: p.first.icmp.map(|i| (i.kind, i.code)),
            ingress: t.ingress.as_ref().map(|i| i.iface.clone()),
            egress: t.egress.as_ref().map(|i| i.iface.clone()),
            route: t.route.map(Route::name),
            mark: t
                .stages
                .first()
                .and_then(|s| s.before.as_ref())
                .map_or(0, |b| b.mark),
            state,
            reply: t.conntrack.as_ref().is_some_and(|c| c.state.1),
            ct_mark: if state == CtState::New {
                None
            } else {
                ct.and_then(|c| c.mark)
            },
            ruleset,
        })
    }

    /// The packet to simulate. A new connection's route is left to the routes when there
    /// are any (a changed DNAT target may route it elsewhere); a packet of a known
    /// connection keeps its observed way out, since conntrack's stored translation, not the
    /// rules, decided it.
    pub fn spec(&self, routes_known: bool) -> PacketSpec {
        let mut p = PacketSpec::new(self.proto, self.src, self.sport, self.dst, self.dport);
        p.in_iface = self.ingress.clone();
        p.mark = self.mark;
        p.ct_state = self.state;
        p.ct_mark = self.ct_mark;
        p.icmp = self.icmp;
        if !(routes_known && self.state == CtState::New) {
            if self.route == Some("input") || (self.ingress.is_none() && self.egress.is_none())
            {
                p.local = self.route.is_some();
            } else {
                p.out_iface = self.egress.clone();
            }
        }
        p
    }

    /// The flow in `explain --packet` words (what `spec` simulates can be asked again).
    pub fn describe(&self, routes_known: bool) -> String {
        let s = self.spec(routes_known);
        let ep = |a: IpAddr, port: Option<u16>| match (a, port) {
            (IpAddr::V6(a), Some(p)) => format!("[{a}]:{p}"),
            (a, Some(p)) => format!("{a}:{p}"),
            (a, None) => a.to_string(),
        };
        let mut out = format!(
            "{} {} -> {}",
            observer_model::Protocol::from_number(s.proto),
            ep(s.src, s.sport),
            ep(s.dst, s.dport)
        );
        if let Some(i) = &s.in_iface {
            let _ = write!(out, " in {i}");
        }
        if let Some(o) = &s.out_iface {
            let _ = write!(out, " out {o}");
        }
        if s.local {
            out.push_str(" local");
        }
        if s.mark != 0 {
            let _ = write!(out, " mark {:#x}", s.mark);
        }
        let _ = write!(out, " state {}", s.ct_state);
        if let Some(m) = s.ct_mark.filter(|m| *m != 0) {
            let _ = write!(out, " ctmark {m:#x}");
        }
        if let Some((t, c)) = s.icmp {
            let _ = write!(out, " type {t}/{c}");
        }
        if self.reply {
            out.push_str(" (reply)");
        }
        out
    }
}

/// Distinct flows in the order first seen, each with its packet count and the first
/// traversal of it (its `packet` is what JSON prints).
#[derive(Default)]
pub struct Folded {
    pub flows: Vec<(FlowKey, u64, std::sync::Arc<Traversal>)>,
    index: HashMap<FlowKey, usize>,
    /// Traversals seen, and those no flow could be made of.
    pub traversals: u64,
    pub unusable: u64,
}

impl Folded {
    pub fn add(&mut self, t: &std::sync::Arc<Traversal>, ruleset: usize) {
        self.traversals += 1;
        let Ok(k) = FlowKey::of(t, ruleset) else {
            self.unusable += 1;
            return;
        };
        match self.index.get(&k) {
            Some(&i) => self.flows[i].1 += 1,
            None => {
                self.index.insert(k.clone(), self.flows.len());
                self.flows.push((k, 1, t.clone()));
            }
        }
    }
}

// ---------------------------------------------------------------------------------------
// The comparison and grouping.

/// What changed for a flow, in the order groups are printed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Change {
    AcceptedToDropped,
    DroppedToAccepted,
    /// Either side could not be decided: listed, never counted as unchanged.
    Undecidable,
    DnatChanged,
    SnatChanged,
    MarksChanged,
    /// Another end (dropped -> rejected, another egress, delivered -> forwarded).
    FateChanged,
    /// The same outcome through other rules (`--compare path` only).
    RulesChanged,
}

impl Change {
    pub fn title(self) -> &'static str {
        match self {
            Change::AcceptedToDropped => "accepted -> dropped",
            Change::DroppedToAccepted => "dropped -> accepted",
            Change::Undecidable => "undecidable (the simulator cannot tell)",
            Change::DnatChanged => "DNAT target changed",
            Change::SnatChanged => "SNAT changed",
            Change::MarksChanged => "marks changed",
            Change::FateChanged => "fate changed",
            Change::RulesChanged => "deciding rules changed",
        }
    }
}

/// How a traversal ended, coarsely.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Pass {
    Through,
    Stopped,
    Unknown,
}

fn pass(k: FateKind) -> Pass {
    match k {
        FateKind::Delivered | FateKind::Forwarded | FateKind::Sent | FateKind::Looped => {
            Pass::Through
        }
        FateKind::Undecidable | FateKind::Incomplete => Pass::Unknown,
        _ => Pass::Stopped,
    }
}

/// One outcome of a traversal (the traversal itself, or each random branch).
struct View<'a> {
    probability: f64,
    stages: &'a [Stage],
    fate: FateKind,
    egress: Option<&'a str>,
    nat: &'a [observer_model::Nat],
}

fn views(t: &Traversal) -> Vec<View<'_>> {
    if t.branches.is_empty() {
        return vec![View {
            probability: 1.0,
            stages: &t.stages,
            fate: t.fate.kind,
            egress: t.egress.as_ref().map(|e| e.iface.as_str()),
            nat: &t.nat,
        }];
    }
    t.branches
        .iter()
        .map(|b| View {
            probability: b.probability,
            stages: &b.stages,
            fate: b.fate.kind,
            egress: b.egress.as_ref().map(|e| e.iface.as_str()),
            nat: &b.nat,
        })
        .collect()
}

/// The translations of kind `kind` the rules made, per outcome, with its probability.
fn nat_targets(t: &Traversal, kind: NatKind) -> Vec<(String, String)> {
    let mut v: Vec<(String, String)> = views(t)
        .iter()
        .map(|b| {
            let to: Vec<String> = b
                .nat
                .iter()
                .filter(|n| n.kind == kind && n.source == NatSource::Rules)
                .map(|n| n.to.to_string())
                .collect();
            (format!("{:.6}", b.probability), to.join(","))
        })
        .collect();
    v.sort();
    v
}

/// The mark as it left the last table, per outcome, masked.
fn final_marks(t: &Traversal, mask: u32) -> Vec<u32> {
    let mut v: Vec<u32> = views(t)
        .iter()
        .map(|b| {
            b.stages
                .iter()
                .rev()
                .find_map(|s| s.after.as_ref().or(s.before.as_ref()))
                .map_or(0, |s| s.mark)
                & mask
        })
        .collect();
    v.sort_unstable();
    v
}

fn ends(t: &Traversal) -> Vec<(String, FateKind, Option<String>)> {
    views(t)
        .iter()
        .map(|b| {
            (
                format!("{:.6}", b.probability),
                b.fate,
                b.egress.map(str::to_string),
            )
        })
        .collect()
}

/// A matched rule as whatif tells rules apart: where it is and what it says, not its index
/// (an insertion above it renumbers it without changing it).
fn rule_ids(t: &Traversal) -> Vec<String> {
    let mut v: Vec<String> = views(t)
        .iter()
        .flat_map(|b| b.stages.iter())
        .flat_map(|s| {
            s.rules
                .iter()
                .map(move |r| format!("{}/{} {}", s.hook.name(), s.table, r.text))
                .chain(
                    s.policy
                        .iter()
                        .map(move |p| format!("{}/{} policy {p}", s.hook.name(), s.table)),
                )
        })
        .collect();
    v.sort();
    v.dedup();
    v
}

/// Marks that kube-proxy consumes on the node (masquerade, drop): not compared in outcome
/// mode unless `--mark-mask` says so.
pub fn default_mark_mask(marks: &MarkDictionary) -> u32 {
    let mut mask = u32::MAX;
    for bit in 0..32 {
        let b = 1u32 << bit;
        if marks.name(b).is_some_and(|n| n.starts_with("kube-proxy:")) {
            mask &= !b;
        }
    }
    mask
}

/// What changed between the path `before` and the path `after` (None: nothing that
/// `mode` compares). `mask`: the mark bits compared in outcome mode.
pub fn classify(before: &Traversal, after: &Traversal, mode: Compare, mask: u32) -> Option<Change> {
    let (b, a) = (pass(before.fate.kind), pass(after.fate.kind));
    if b == Pass::Unknown || a == Pass::Unknown {
        return Some(Change::Undecidable);
    }
    match (b, a) {
        (Pass::Through, Pass::Stopped) => return Some(Change::AcceptedToDropped),
        (Pass::Stopped, Pass::Through) => return Some(Change::DroppedToAccepted),
        _ => {}
    }
    if nat_targets(before, NatKind::Dnat) != nat_targets(after, NatKind::Dnat) {
        return Some(Change::DnatChanged);
    }
    if nat_targets(before, NatKind::Snat) != nat_targets(after, NatKind::Snat) {
        return Some(Change::SnatChanged);
    }
    let mask = if mode == Compare::Path { u32::MAX } else { mask };
    if final_marks(before, mask) != final_marks(after, mask) {
        return Some(Change::MarksChanged);
    }
    if ends(before) != ends(after) {
        return Some(Change::FateChanged);
    }
    if mode == Compare::Path && rule_ids(before) != rule_ids(after) {
        return Some(Change::RulesChanged);
    }
    None
}

/// One flow whose path changes (or that cannot be decided).
pub struct Changed {
    pub key: FlowKey,
    pub count: u64,
    pub change: Change,
    pub observed: std::sync::Arc<Traversal>,
    pub before: Traversal,
    pub after: Traversal,
}

/// What a whatif found.
#[derive(Default)]
pub struct Findings {
    /// By change kind, flows in the recording's order.
    pub groups: BTreeMap<Change, Vec<Changed>>,
    pub unchanged_flows: u64,
    pub unchanged_packets: u64,
    pub traversals: u64,
    pub unusable: u64,
    pub routes_known: bool,
    pub notes: Vec<String>,
}

impl Findings {
    pub fn add(&mut self, c: Option<Changed>, count: u64) {
        match c {
            Some(c) => self.groups.entry(c.change).or_default().push(c),
            None => {
                self.unchanged_flows += 1;
                self.unchanged_packets += count;
            }
        }
    }

    /// Whether some flow changes or cannot be decided (the exit status is then 1).
    pub fn any(&self) -> bool {
        !self.groups.is_empty()
    }

    fn changed(&self) -> (u64, u64) {
        let flows = self
            .groups
            .iter()
            .filter(|(k, _)| **k != Change::Undecidable)
            .flat_map(|(_, v)| v);
        flows.fold((0, 0), |(f, p), c| (f + 1, p + c.count))
    }

    /// The summary line.
    pub fn summary(&self) -> String {
        let (cf, cp) = self.changed();
        let und = self.groups.get(&Change::Undecidable);
        let flows = cf + und.map_or(0, |v| v.len() as u64) + self.unchanged_flows;
        let mut s = format!(
            "whatif: {} traversals in {flows} flows: {cf} flow{} ({cp} packet{}) change",
            self.traversals,
            plural(cf),
            plural(cp),
        );
        let kinds: Vec<String> = self
            .groups
            .iter()
            .filter(|(k, _)| **k != Change::Undecidable)
            .map(|(k, v)| format!("{} {}", v.len(), k.title()))
            .collect();
        if !kinds.is_empty() {
            let _ = write!(s, " ({})", kinds.join(", "));
        }
        if let Some(u) = und {
            let p: u64 = u.iter().map(|c| c.count).sum();
            let _ = write!(s, ", {} undecidable ({p} packet{})", u.len(), plural(p));
        }
        let _ = write!(
            s,
            ", {} unchanged ({} packet{})",
            self.unchanged_flows,
            self.unchanged_packets,
            plural(self.unchanged_packets)
        );
        if self.unusable > 0 {
            let _ = write!(
                s,
                "; {} traversal{} without an IP header left out",
                self.unusable,
                plural(self.unusable)
            );
        }
        s
    }
}

fn plural(n: u64) -> &'static str {
    if n == 1 { "" } else { "s" }
}

// ---------------------------------------------------------------------------------------
// The rendering.

fn side_text(t: &Traversal) -> String {
    let mut s = t.fate_text();
    for n in &t.nat {
        if n.source == NatSource::Rules {
            let kind = match n.kind {
                NatKind::Dnat => "DNAT",
                NatKind::Snat => "SNAT",
            };
            let _ = write!(s, "; {kind} {} -> {}", n.from, n.to);
        }
    }
    if t.branches.len() > 1 {
        let _ = write!(s, " (first of {} random outcomes)", t.branches.len());
    }
    if let Some(m) = t
        .stages
        .iter()
        .rev()
        .find_map(|s| s.after.as_ref().or(s.before.as_ref()))
        .map(|s| s.mark)
        .filter(|m| *m != 0)
    {
        let _ = write!(s, "; mark {m:#x}");
    }
    s
}

/// The rules that match on one side only: `(hook/table chain#index, text)`.
fn rules_only(a: &Traversal, b: &Traversal) -> Vec<String> {
    let other = rule_ids(b);
    let mut out = Vec::new();
    for v in views(a) {
        for s in v.stages {
            for r in s.rules.iter() {
                let id = format!("{}/{} {}", s.hook.name(), s.table, r.text);
                if other.binary_search(&id).is_err() {
                    let line = format!(
                        "{}/{} {}: {}",
                        s.hook.name(),
                        s.table,
                        r.id.place(),
                        observer_model::render::escape_controls(&r.text)
                    );
                    if !out.contains(&line) {
                        out.push(line);
                    }
                }
            }
            if let Some(p) = &s.policy {
                let id = format!("{}/{} policy {p}", s.hook.name(), s.table);
                if other.binary_search(&id).is_err() {
                    let line = format!("{}/{} policy {p}", s.hook.name(), s.table);
                    if !out.contains(&line) {
                        out.push(line);
                    }
                }
            }
        }
    }
    out
}

/// Rules listed per side at most.
const MAX_RULES_SHOWN: usize = 6;

/// The human report: a group per kind of change, each flow with its count, both sides'
/// ends and the rules only one side matches; the summary last.
pub fn render_text(f: &Findings) -> String {
    let mut out = String::new();
    for n in &f.notes {
        let _ = writeln!(out, "note: {n}");
    }
    if !f.notes.is_empty() {
        out.push('\n');
    }
    for (kind, flows) in &f.groups {
        let packets: u64 = flows.iter().map(|c| c.count).sum();
        let _ = writeln!(
            out,
            "{}: {} flow{}, {packets} packet{}",
            kind.title(),
            flows.len(),
            plural(flows.len() as u64),
            plural(packets)
        );
        for c in flows {
            let _ = writeln!(out, "  {}x {}", c.count, c.key.describe(f.routes_known));
            let _ = writeln!(out, "     before: {}", side_text(&c.before));
            let _ = writeln!(out, "     after:  {}", side_text(&c.after));
            if *kind == Change::Undecidable {
                for (side, t) in [("before", &c.before), ("after", &c.after)] {
                    if pass(t.fate.kind) == Pass::Unknown {
                        let why = t
                            .fate
                            .reason
                            .clone()
                            .or_else(|| t.notes.first().cloned())
                            .unwrap_or_else(|| "no reason given".into());
                        let _ = writeln!(out, "     {side} undecidable: {why}");
                    }
                }
            }
            for (sign, a, b) in [("-", &c.before, &c.after), ("+", &c.after, &c.before)] {
                let only = rules_only(a, b);
                for r in only.iter().take(MAX_RULES_SHOWN) {
                    let _ = writeln!(out, "     {sign} {r}");
                }
                if only.len() > MAX_RULES_SHOWN {
                    let _ = writeln!(
                        out,
                        "     {sign} ... {} more",
                        only.len() - MAX_RULES_SHOWN
                    );
                }
            }
        }
        out.push('\n');
    }
    out.push_str(&f.summary());
    out.push('\n');
    out
}

/// One JSON object per changed or undecidable flow.
pub fn render_json(f: &Findings) -> String {
    let mut out = String::new();
    for flows in f.groups.values() {
        for c in flows {
            let packet = serde_json::to_string(&c.observed.packet).expect("a packet serialises");
            let _ = writeln!(
                out,
                "{{\"change\":{},\"count\":{},\"flow\":{},\"packet\":{packet},\"ingress\":{},\
                 \"mark\":\"{:#x}\",\"state\":\"{}\",\"reply\":{},\"before\":{},\"after\":{}}}",
                serde_json::to_string(&c.change).expect("serialises"),
                c.count,
                serde_json::to_string(&c.key.describe(f.routes_known)).expect("serialises"),
                serde_json::to_string(&c.key.ingress).expect("serialises"),
                c.key.mark,
                c.key.state,
                c.key.reply,
                c.before.to_json_line().trim_end(),
                c.after.to_json_line().trim_end(),
            );
        }
    }
    out
}

// ---------------------------------------------------------------------------------------
// The recording and the two sides.

/// A side's node, parsed, with what to say about it.
pub struct Side {
    pub texts: LiveTexts,
    parsed: observer_rules::live::Parsed,
}

impl Side {
    pub fn new(what: &str, texts: LiveTexts) -> Result<Self> {
        let parsed = texts.parse();
        if let Some((text, e)) = parsed.unparsed.first() {
            bail!("the {what} node's `{}` text does not parse: {e}", text.cmd());
        }
        if texts.iptables.is_none() && texts.ip6tables.is_none() && texts.nft.is_none() {
            bail!("the {what} node has no rules (iptables-save, ip6tables-save or nft -j)");
        }
        Ok(Self { texts, parsed })
    }

    fn routes_known(&self) -> bool {
        !self.parsed.routes.is_empty()
    }

    /// The prediction for `spec`.
    fn simulator(&self) -> observer_rules::Simulator<'_> {
        let p = &self.parsed;
        observer_rules::prepare(&p.ruleset, &p.ipsets, &p.routes, &p.bridges, &p.iface_addrs)
    }

    fn explain(
        &self,
        sim: &observer_rules::Simulator<'_>,
        spec: &PacketSpec,
        marks: &MarkDictionary,
    ) -> Traversal {
        let p = &self.parsed;
        observer_rules::explain_on(sim, &p.ruleset, &p.ipsets, &p.bridges, spec).to_model(marks, None)
    }
}

/// Holds every flow against `old` (one side per recorded ruleset, indexed by the flows'
/// `ruleset`) and `new`.
pub fn judge(
    folded: &Folded,
    old: &[Side],
    new: &Side,
    marks: &MarkDictionary,
    mode: Compare,
    mask: u32,
) -> Findings {
    let routes_known = old.iter().all(Side::routes_known) && new.routes_known();
    let old_sims: Vec<_> = old.iter().map(Side::simulator).collect();
    let new_sim = new.simulator();
    let mut f = Findings {
        traversals: folded.traversals,
        unusable: folded.unusable,
        routes_known,
        ..Default::default()
    };
    if !routes_known {
        f.notes.push(
            "no routes on both sides (--routes, or a recording that read them): every flow \
             keeps its observed way out, and a changed DNAT target does not move it"
                .into(),
        );
    }
    for (key, count, observed) in &folded.flows {
        let spec = key.spec(routes_known);
        let i = key.ruleset.min(old.len() - 1);
        let before = old[i].explain(&old_sims[i], &spec, marks);
        let after = new.explain(&new_sim, &spec, marks);
        let change = classify(&before, &after, mode, mask).map(|change| Changed {
            key: key.clone(),
            count: *count,
            change,
            observed: observed.clone(),
            before,
            after,
        });
        f.add(change, *count);
    }
    f
}

/// Collects the recording's flows and rulesets.
#[derive(Default)]
struct Collect {
    folded: Folded,
    rulesets: Vec<LiveTexts>,
    marks: Vec<(u32, String)>,
}

impl Sink for Collect {
    fn handled(&mut self, h: &Handled<'_>) -> std::io::Result<()> {
        if let Outcome::Report { report, .. } = h.outcome {
            let at = self.rulesets.len().saturating_sub(1);
            self.folded.add(report.traversal(), at);
        }
        Ok(())
    }
    fn ruleset(&mut self, _generation: u64, texts: &LiveTexts, marks: &[(u32, String)]) {
        self.rulesets.push(texts.clone());
        self.marks = marks.to_vec();
    }
}

/// `base` with what `files` gives replaced: the rules as a whole, each other part alone.
fn overlay(base: &LiveTexts, given: LiveTexts, files: &RuleFiles) -> LiveTexts {
    let mut t = base.clone();
    if files.has_rules() {
        t.iptables = given.iptables;
        t.ip6tables = given.ip6tables;
        t.nft = given.nft;
    }
    if given.ipset.is_some() {
        t.ipset = given.ipset;
    }
    if !given.routes.is_empty() {
        t.routes = given.routes;
    }
    if files.has_bridge() {
        t.bridge = given.bridge;
    }
    t
}

/// Runs `observer whatif`, printing to `out`; Ok(true) when some flow changes or cannot be
/// decided.
pub fn run(a: &WhatifArgs, out: &mut dyn Write) -> Result<bool> {
    let mut collect = Collect::default();
    let opts = super::replay::ReplayOptions {
        file: a.recording.clone(),
        output: crate::pipeline::Output::Line,
        count: None,
        filter: None,
    };
    let summary = super::replay::each(&opts, &mut collect)
        .with_context(|| format!("reading the recording {}", a.recording.display()))?;
    if summary.unended {
        log::warn!(
            "{}: the recording has no end marker: flows after its last frame are missing",
            a.recording.display()
        );
    }
    let given = a.new.texts()?;
    let cap = a.new.max_input_mib;
    let read = |p: &Option<PathBuf>| p.as_deref().map(|p| read_capped(p, cap)).transpose();
    let old_given = a.old.is_some() || a.old6.is_some() || a.old_nft.is_some();
    if !a.new.has_rules()
        && given.ipset.is_none()
        && given.routes.is_empty()
        && !a.new.has_bridge()
    {
        bail!(
            "nothing changed to hold the recording against: give the new ruleset with \
             --ruleset FILE (iptables-save), --ruleset6 or --nft (and --ipsets, --routes if \
             they change)"
        );
    }
    let (old, base) = if old_given {
        // The recorded node (if any) with the old rules given; without one, the inputs
        // given for the new node serve the old one too (they are the node's, not the change).
        let recorded = collect.rulesets.first().cloned();
        let mut t = recorded.clone().unwrap_or_else(|| LiveTexts {
            iptables: None,
            ip6tables: None,
            nft: None,
            ..given.clone()
        });
        t.iptables = read(&a.old)?;
        t.ip6tables = read(&a.old6)?;
        t.nft = read(&a.old_nft)?;
        (vec![Side::new("old (--old)", t.clone())?], t)
    } else if collect.rulesets.is_empty() {
        bail!(
            "{} carries no ruleset (recorded with --no-rules, or its ruleset could not be \
             read): give the ruleset it was recorded under with --old FILE (iptables-save; \
             --old6, --old-nft for the others), and its ipsets and routes with --ipsets and \
             --routes",
            a.recording.display()
        );
    } else {
        let sides = collect
            .rulesets
            .iter()
            .enumerate()
            .map(|(i, t)| Side::new(&format!("recorded (ruleset {})", i + 1), t.clone()))
            .collect::<Result<Vec<_>>>()?;
        let last = collect.rulesets.last().cloned().expect("not empty");
        (sides, last)
    };
    let new = Side::new("new", overlay(&base, given, &a.new))?;
    let mut marks = MarkDictionary::from_entries(if collect.marks.is_empty() {
        &[]
    } else {
        &collect.marks
    });
    if collect.marks.is_empty() {
        let h = crate::output::recording::Reader::open(&a.recording)?.header;
        marks = MarkDictionary::from_entries(&h.marks);
    }
    for s in old.iter().chain(std::iter::once(&new)) {
        if let Some(t) = &s.texts.iptables {
            marks.learn_from_iptables_save(t);
        }
    }
    if let Some(f) = &a.marks {
        let text = read_capped(f, cap).context("reading the marks file")?;
        marks
            .apply_toml(&text)
            .with_context(|| format!("in marks file {}", f.display()))?;
    }
    let mask = a.mark_mask.unwrap_or_else(|| default_mark_mask(&marks));
    let mut findings = judge(&collect.folded, &old, &new, &marks, a.compare, mask);
    if old.len() > 1 {
        findings.notes.push(format!(
            "the ruleset changed {} times during the recording: each flow's before is the \
             ruleset in force when it was recorded",
            old.len() - 1
        ));
    }
    if a.json {
        out.write_all(render_json(&findings).as_bytes())?;
        eprintln!("{}", findings.summary());
    } else {
        out.write_all(render_text(&findings).as_bytes())?;
    }
    out.flush()?;
    Ok(findings.any())
}
