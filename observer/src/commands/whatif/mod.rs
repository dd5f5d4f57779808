//! `observer whatif`: a node's recorded traffic held against a changed ruleset, before the
//! change is made. Every distinct flow of a `tail --record` file or of an agent's capture
//! window ([`window`]) (the packet as it entered,
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
    CtState, FateKind, Hook, Host, MarkDictionary, NatKind, NatSource, Route, Stage, Traversal,
};
use observer_rules::{LiveTexts, PacketSpec, StoredNat};
use serde::Serialize;

use super::rulefiles::{LiveArgs, RuleFiles};
use crate::pipeline::{Handled, Outcome, Sink};

pub mod observed;
pub mod window;

#[derive(clap::Args, Debug)]
#[command(after_help = "Examples:\n  \
    # the ruleset the recording carries (tail --record reads it) against an edited one:\n  \
    iptables-save > new.rules; $EDITOR new.rules\n  \
    observer whatif --recording node.obsrec --ruleset new.rules\n\n  \
    # a capture window from a running agent (its ruleset read through the agent), or one\n  \
    # per node through the API server, or the agent's flight recorder:\n  \
    observer tail --agent /run/observer/agent.sock --record node.window --timeout 60\n  \
    kubectl observer record --all-nodes --seconds 60 --dir windows/\n  \
    observer drops --agent /run/observer/agent.sock --record drops.window\n  \
    observer whatif --recording windows/worker-1.window --ruleset new.rules\n\n  \
    # a recording made without its ruleset (--no-rules, or an older observer): say what it was\n  \
    observer whatif --recording node.obsrec --old node.rules --ipsets node.ipsets \\\n      \
    --routes routes.json --ruleset new.rules\n\n  \
    # kube-proxy iptables mode -> nftables mode: only outcomes count, not rule names\n  \
    observer whatif --recording node.obsrec --compare outcome --ruleset calico-only.rules \\\n      \
    --nft kube-proxy.nft.json\n\n  \
    # in a pipeline that applies rules: 0 nothing changes, 1 something does (or cannot be\n  \
    # decided), 2 the question could not be answered\n  \
    observer whatif --recording node.obsrec --ruleset new.rules --json > changes.ndjson \\\n      \
    && iptables-restore < new.rules\n\n  \
    # the node itself as the new side, after an edit (on a copy of the node, or before\n  \
    # traffic reaches it); as root\n  \
    observer whatif --recording node.obsrec --live --netns obs-node\n\n  \
    # check a prediction against the kernel: apply the change, send the same traffic,\n  \
    # record it again; the flows whose observed path changed, grouped the same way\n  \
    observer whatif --recording node.obsrec --observed after.obsrec\n\n\
The new node is the recorded one with what you give replaced: --ruleset/--ruleset6/--nft \
replace the rules (all three together: give each the new node has), --ipsets, --routes and the \
bridge inputs each replace their own part. Without a recorded ruleset, --old (and --old6, \
--old-nft) give the old rules and the other inputs you give serve both sides.")]
pub struct WhatifArgs {
    /// A recording made by `observer tail --record FILE` (docs/recording.md), or a capture
    /// window of an agent's reports with the node's ruleset (`observer tail --agent ADDR
    /// --record FILE`, `observer drops --agent ADDR --record FILE`, `kubectl observer
    /// record`; docs/whatif.md): a report that does not hold what its flow needs (a drop
    /// sample seen only where it died) is listed as undecidable.
    #[arg(long, value_name = "FILE")]
    pub recording: PathBuf,
    /// The changed node (the new side): what is not given is the recorded node's.
    #[command(flatten)]
    pub new: RuleFiles,
    /// The `iptables-save` output the recording was made under, when the recording does
    /// not carry its ruleset (or to hold the traffic against another one).
    #[arg(long, value_name = "FILE")]
    pub old: Option<PathBuf>,
    /// The old `ip6tables-save` output (the old rules are --old, --old6 and --old-nft
    /// together, as the new ones are).
    #[arg(long, value_name = "FILE")]
    pub old6: Option<PathBuf>,
    /// The old `nft -j list ruleset` output.
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
    /// Hold only the recorded traversals this pcap-filter subset keeps (docs/filter.md;
    /// interface names are the recording's).
    #[arg(long, value_name = "EXPR")]
    pub filter: Option<String>,
    /// Check a prediction against the kernel: a second recording, made after the change was
    /// applied with the same traffic sent again. Each flow's after is then what the kernel
    /// did to it there (matched by the packet as it entered), not a simulation; flows not
    /// seen again are counted, never unchanged.
    #[arg(long, value_name = "FILE", conflicts_with_all = ["ruleset", "ruleset6", "nft", "ipsets", "routes", "old", "old6", "old_nft", "live"])]
    pub observed: Option<PathBuf>,
    /// `--live`: the new side is the running node as it is now, read as `explain --live`
    /// reads it: edit the rules on a copy of the node (or in place before traffic reaches
    /// it) and ask what the recorded traffic would meet.
    #[command(flatten)]
    pub node: LiveArgs,
}

fn parse_mask(s: &str) -> Result<u32, String> {
    observer_rules::net::parse_u32(s)
        .ok_or_else(|| format!("`{s}` is not a mask (0x... or decimal)"))
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
    /// The translation conntrack applied to it (a packet of a known connection): the rules
    /// of either side do not translate it again.
    pub stored: StoredNat,
    /// Index of the recorded ruleset in force when it was recorded.
    pub ruleset: usize,
}

/// The translation conntrack applied to an observed packet, from its report's NAT.
fn stored_nat(t: &Traversal) -> StoredNat {
    let mut s = StoredNat::default();
    for n in t.nat.iter().filter(|n| n.source == NatSource::Conntrack) {
        let Host::Ip(a) = n.to.host else { continue };
        let to = Some((a, n.to.port));
        match (n.kind, n.hook) {
            (NatKind::Dnat, Hook::PreRouting | Hook::LocalOut) => s.dst = s.dst.or(to),
            (NatKind::Snat, Hook::PostRouting | Hook::LocalIn) => s.src = s.src.or(to),
            _ => {}
        }
    }
    s
}

/// Why a traversal cannot be made a flow.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Unusable {
    /// No IP header was read.
    NoHeader,
    /// The input does not hold what the flow needs (why): listed as undecidable.
    Undecidable(&'static str),
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
            stored: if state == CtState::New {
                StoredNat::default()
            } else {
                stored_nat(t)
            },
            ruleset,
        })
    }

    /// The packet as it entered, without what the rules decided for it (its way out, the
    /// translation conntrack stored) or the ruleset in force: the same packet sent again
    /// under other rules has the same entry.
    pub fn entry(&self) -> FlowKey {
        FlowKey {
            egress: None,
            route: None,
            stored: StoredNat::default(),
            ruleset: 0,
            ..self.clone()
        }
    }

    /// The packet to simulate. Its route is left to the routes when there are any (a
    /// changed DNAT target may route it elsewhere); without them it keeps its observed way
    /// out (or in).
    pub fn spec(&self, routes_known: bool) -> PacketSpec {
        let mut p = PacketSpec::new(self.proto, self.src, self.sport, self.dst, self.dport);
        p.in_iface = self.ingress.clone();
        p.mark = self.mark;
        p.ct_state = self.state;
        p.ct_mark = self.ct_mark;
        p.icmp = self.icmp;
        if !routes_known {
            if self.route == Some("input") || (self.ingress.is_none() && self.egress.is_none()) {
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
        if let Some(m) = s.ct_mark {
            let _ = write!(out, " ctmark {m:#x}");
        }
        if let Some((t, c)) = s.icmp {
            let _ = write!(out, " type {t}/{c}");
        }
        let mut also = Vec::new();
        if self.reply {
            also.push("reply".to_string());
        }
        for (what, t) in [("dst", self.stored.dst), ("src", self.stored.src)] {
            if let Some((a, p)) = t {
                also.push(format!("conntrack {what} {}", ep(a, p)));
            }
        }
        if !also.is_empty() {
            let _ = write!(out, " ({})", also.join(", "));
        }
        out
    }
}

/// The first traversal of a flow as the input holds it: a recording's traversal, or a
/// capture window's report (JSON).
#[derive(Clone, Debug)]
pub enum Seen {
    Recorded(std::sync::Arc<Traversal>),
    Reported(std::sync::Arc<serde_json::Value>),
}

impl Seen {
    /// The traversal, when the input is a recording.
    pub fn traversal(&self) -> Option<&std::sync::Arc<Traversal>> {
        match self {
            Seen::Recorded(t) => Some(t),
            Seen::Reported(_) => None,
        }
    }

    /// Its `packet`, as JSON (schema 3).
    pub fn packet_json(&self) -> String {
        match self {
            Seen::Recorded(t) => serde_json::to_string(&t.packet).expect("a packet serialises"),
            Seen::Reported(v) => v["packet"].to_string(),
        }
    }
}

/// Flows the input cannot decide (a drop sample seen only where it died), folded by the
/// packet and why: listed, never counted as unchanged.
#[derive(Clone, Debug)]
pub struct Undecided {
    /// The packet in `explain --packet` words, as far as the input says.
    pub flow: String,
    pub why: &'static str,
    pub count: u64,
    /// Its `packet` as JSON.
    pub packet: String,
}

/// Distinct flows in the order first seen, each with its packet count and the first
/// traversal of it (its `packet` is what JSON prints).
#[derive(Default)]
pub struct Folded {
    pub flows: Vec<(FlowKey, u64, Seen)>,
    index: HashMap<FlowKey, usize>,
    /// Traversals seen, and those no flow could be made of.
    pub traversals: u64,
    pub unusable: u64,
    /// Flows the input cannot decide.
    pub undecided: Vec<Undecided>,
    undecided_index: HashMap<(String, &'static str), usize>,
}

impl Folded {
    pub fn add(&mut self, t: &std::sync::Arc<Traversal>, ruleset: usize) {
        self.traversals += 1;
        let Ok(k) = FlowKey::of(t, ruleset) else {
            self.unusable += 1;
            return;
        };
        self.fold(k, || Seen::Recorded(t.clone()));
    }

    /// A capture window's report (schema-3 JSON).
    pub fn add_json(&mut self, v: serde_json::Value, ruleset: usize) {
        self.traversals += 1;
        match FlowKey::of_json(&v, ruleset) {
            Ok(k) => self.fold(k, || Seen::Reported(std::sync::Arc::new(v))),
            Err(Unusable::NoHeader) => self.unusable += 1,
            Err(Unusable::Undecidable(why)) => {
                let flow = window::describe(&v);
                match self.undecided_index.get(&(flow.clone(), why)) {
                    Some(&i) => self.undecided[i].count += 1,
                    None => {
                        self.undecided_index
                            .insert((flow.clone(), why), self.undecided.len());
                        self.undecided.push(Undecided {
                            flow,
                            why,
                            count: 1,
                            packet: v["packet"].to_string(),
                        });
                    }
                }
            }
        }
    }

    fn fold(&mut self, k: FlowKey, seen: impl FnOnce() -> Seen) {
        match self.index.get(&k) {
            Some(&i) => self.flows[i].1 += 1,
            None => {
                self.index.insert(k.clone(), self.flows.len());
                self.flows.push((k, 1, seen()));
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

/// The translations of kind `kind` the rules made, per outcome, with its probability;
/// without `ports`, their addresses only.
fn nat_targets(t: &Traversal, kind: NatKind, ports: bool) -> Vec<(String, String)> {
    let mut v: Vec<(String, String)> = views(t)
        .iter()
        .map(|b| {
            let to: Vec<String> = b
                .nat
                .iter()
                .filter(|n| n.kind == kind && n.source == NatSource::Rules)
                .map(|n| {
                    let mut to = n.to.clone();
                    if !ports {
                        to.port = None;
                    }
                    to.to_string()
                })
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
    if nat_targets(before, NatKind::Dnat, true) != nat_targets(after, NatKind::Dnat, true) {
        return Some(Change::DnatChanged);
    }
    // A source translation's port is conntrack's choice (kept unless it clashes, random
    // with --random-fully, as kube-proxy's nftables mode masquerades): outcomes compare
    // the address it leaves with.
    let ports = mode == Compare::Path;
    if nat_targets(before, NatKind::Snat, ports) != nat_targets(after, NatKind::Snat, ports) {
        return Some(Change::SnatChanged);
    }
    let mask = if mode == Compare::Path {
        u32::MAX
    } else {
        mask
    };
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
    pub observed: Seen,
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
    /// `--observed`: flows of the first recording the second does not hold (not sent
    /// again, or not seen: never counted as unchanged), and flows only the second holds.
    pub unseen_flows: u64,
    pub unseen_packets: u64,
    pub new_flows: u64,
    pub new_packets: u64,
    /// Flows the input cannot decide (undecidable, never unchanged).
    pub undecided: Vec<Undecided>,
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

    /// Whether some flow changes or cannot be decided (the exit status is then 1); with
    /// `--observed`, also when a flow was not seen again.
    pub fn any(&self) -> bool {
        !self.groups.is_empty() || self.unseen_flows > 0 || !self.undecided.is_empty()
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
        let und_flows = und.map_or(0, |v| v.len() as u64) + self.undecided.len() as u64;
        let und_packets = und.map_or(0, |v| v.iter().map(|c| c.count).sum::<u64>())
            + self.undecided.iter().map(|u| u.count).sum::<u64>();
        let flows = cf + und_flows + self.unchanged_flows + self.unseen_flows;
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
        if und_flows > 0 {
            let _ = write!(
                s,
                ", {und_flows} undecidable ({und_packets} packet{})",
                plural(und_packets)
            );
        }
        let _ = write!(
            s,
            ", {} unchanged ({} packet{})",
            self.unchanged_flows,
            self.unchanged_packets,
            plural(self.unchanged_packets)
        );
        if self.unseen_flows > 0 {
            let _ = write!(
                s,
                ", {} not seen again ({} packet{})",
                self.unseen_flows,
                self.unseen_packets,
                plural(self.unseen_packets)
            );
        }
        if self.new_flows > 0 {
            let _ = write!(
                s,
                ", {} seen only after ({} packet{})",
                self.new_flows,
                self.new_packets,
                plural(self.new_packets)
            );
        }
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

/// Where two paths part: the first table whose matched rules differ, and on each side the
/// first rule that differs there and the rule (or policy) that ended the table.
pub struct Parting {
    /// `HOOK/table`.
    pub at: String,
    pub before: Vec<String>,
    pub after: Vec<String>,
}

fn rule_line(r: &observer_model::Rule) -> String {
    format!(
        "{}: {}",
        r.id.place(),
        observer_model::render::escape_controls(&r.text)
    )
}

/// The first differing rule of stage `s` from `i` on, and what ended the stage.
fn side_lines(s: Option<&Stage>, i: usize) -> Vec<String> {
    let Some(s) = s else {
        return vec!["(not reached)".into()];
    };
    let mut v = Vec::new();
    match s.rules.get(i) {
        Some(r) => v.push(rule_line(r)),
        None => v.push("(no further rule matches)".into()),
    }
    let last = s.rules.len().checked_sub(1);
    if let Some(l) = last.filter(|l| *l > i) {
        v.push(format!("then {}", rule_line(&s.rules[l])));
    }
    if let Some(p) = &s.policy {
        v.push(format!("then the {} policy {p}", s.hook.name()));
    }
    v
}

pub fn parting(before: &Traversal, after: &Traversal) -> Option<Parting> {
    let key = |s: &Stage| (s.hook, s.table.clone());
    let texts = |s: &Stage| {
        s.rules
            .iter()
            .map(|r| r.text.clone())
            .chain(s.policy.clone())
            .collect::<Vec<_>>()
    };
    for b in &before.stages {
        let a = after.stages.iter().find(|a| key(a) == key(b));
        let (tb, ta) = (texts(b), a.map(texts).unwrap_or_default());
        if a.is_some_and(|a| tb == ta && b.verdict == a.verdict) {
            continue;
        }
        let first = tb.iter().zip(&ta).take_while(|(x, y)| x == y).count();
        return Some(Parting {
            at: format!("{}/{}", b.hook.name(), b.table),
            before: side_lines(Some(b), first),
            after: side_lines(a, first),
        });
    }
    // Tables only the new path reaches.
    let extra = after.stages.iter().find(|a| {
        !before.stages.iter().any(|b| key(b) == key(a))
            && (!a.rules.is_empty() || a.policy.is_some())
    })?;
    Some(Parting {
        at: format!("{}/{}", extra.hook.name(), extra.table),
        before: side_lines(None, 0),
        after: side_lines(Some(extra), 0),
    })
}

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
            if let Some(p) = parting(&c.before, &c.after) {
                let _ = writeln!(out, "     rules: the paths part at {}", p.at);
                for (sign, lines) in [("-", &p.before), ("+", &p.after)] {
                    for l in lines {
                        let _ = writeln!(out, "       {sign} {l}");
                    }
                }
            }
        }
        out.push('\n');
    }
    if !f.undecided.is_empty() {
        let packets: u64 = f.undecided.iter().map(|u| u.count).sum();
        let _ = writeln!(
            out,
            "undecidable (the input does not hold what the flow needs): {} flow{}, {packets} \
             packet{}",
            f.undecided.len(),
            plural(f.undecided.len() as u64),
            plural(packets)
        );
        for u in &f.undecided {
            let _ = writeln!(out, "  {}x {}", u.count, u.flow);
            let _ = writeln!(out, "     why: {}", u.why);
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
            let packet = c.observed.packet_json();
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
    for u in &f.undecided {
        let _ = writeln!(
            out,
            "{{\"change\":\"undecidable\",\"count\":{},\"flow\":{},\"packet\":{},\"why\":{},\
             \"before\":null,\"after\":null}}",
            u.count,
            serde_json::to_string(&u.flow).expect("serialises"),
            u.packet,
            serde_json::to_string(u.why).expect("serialises"),
        );
    }
    out
}

// ---------------------------------------------------------------------------------------
// The recording and the two sides.

/// A side's node, parsed, with what to say about it.
pub struct Side {
    pub texts: LiveTexts,
    parsed: observer_rules::live::Parsed,
    /// What the inputs leave out, per family (IPv4, IPv6): the same for every flow, so
    /// found once (a scan of every rule).
    notes: [Vec<String>; 2],
}

impl Side {
    /// The node of `texts`; `what` names it in errors, `hint` ends them.
    pub fn new(what: &str, texts: LiveTexts, hint: &str) -> Result<Self> {
        let parsed = texts.parse();
        if let Some((text, e)) = parsed.unparsed.first() {
            bail!(
                "the {what} node's `{}` text does not parse: {e}{hint}",
                text.cmd()
            );
        }
        if texts.iptables.is_none() && texts.ip6tables.is_none() && texts.nft.is_none() {
            bail!("the {what} node has no rules (iptables-save, ip6tables-save or nft -j){hint}");
        }
        let p = &parsed;
        let notes = [false, true]
            .map(|v6| observer_rules::input_notes(&p.ruleset, &p.ipsets, &p.bridges, v6));
        Ok(Self {
            texts,
            parsed,
            notes,
        })
    }

    fn routes_known(&self) -> bool {
        !self.parsed.routes.is_empty()
    }

    /// The prediction for `spec`.
    fn simulator(&self) -> observer_rules::Simulator<'_> {
        let p = &self.parsed;
        let mut sim =
            observer_rules::prepare(&p.ruleset, &p.ipsets, &p.routes, &p.bridges, &p.iface_addrs);
        sim.ipvs = p.ipvs.clone();
        sim
    }

    fn explain(
        &self,
        sim: &observer_rules::Simulator<'_>,
        spec: &PacketSpec,
        stored: &StoredNat,
        marks: &MarkDictionary,
    ) -> Traversal {
        observer_rules::Explanation {
            packet: spec.clone(),
            branches: sim.simulate_connection(spec, stored),
            notes: self.notes[usize::from(spec.is_v6())].clone(),
        }
        .to_model(marks, None)
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
        undecided: folded.undecided.clone(),
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
        let before = old[i].explain(&old_sims[i], &spec, &key.stored, marks);
        let after = new.explain(&new_sim, &spec, &key.stored, marks);
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
    /// A capture window (JSON reports), not a recording.
    window: bool,
    /// A window during which the node's rules changed.
    ruleset_changed: bool,
    /// What the input says about itself (a window's source, what it missed).
    notes: Vec<String>,
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
    if given.ipvs.is_some() {
        t.ipvs = given.ipvs;
    }
    if given.ipvs_conntrack.is_some() {
        t.ipvs_conntrack = given.ipvs_conntrack;
    }
    if given.sysctls.is_some() {
        t.sysctls = given.sysctls;
    }
    t
}

/// Runs `observer whatif`, printing to `out`; Ok(true) when some flow changes or cannot be
/// decided.
pub fn run(a: &WhatifArgs, out: &mut dyn Write) -> Result<bool> {
    if let Some(after) = &a.observed {
        return run_observed(a, after, out);
    }
    // The inputs first: a mistake in them is said before a long recording is read.
    let live = a.node.read()?.map(|node| {
        for f in &node.failures {
            log::warn!("reading the node: {f} (what it leaves out is undecidable)");
        }
        node.texts
    });
    let given = a.new.texts()?;
    let read = |p: &Option<PathBuf>| a.new.read(p.as_deref());
    if live.is_none()
        && !a.new.has_rules()
        && given.ipset.is_none()
        && given.routes.is_empty()
        && !a.new.has_bridge()
    {
        bail!(
            "nothing changed to hold the recording against: give the new ruleset with \
             --ruleset FILE (iptables-save), --ruleset6 or --nft (and --ipsets, --routes if \
             they change), or edit the node and give --live; to check a prediction against \
             the kernel, give the recording made after the change with --observed FILE"
        );
    }
    let old_rules = [read(&a.old)?, read(&a.old6)?, read(&a.old_nft)?];
    let collect = collect(&a.recording, a.filter.as_ref())?;
    let old_given = old_rules.iter().any(Option::is_some);
    if collect.ruleset_changed && !old_given {
        bail!(
            "the node's rules changed while the capture window {} was open: its reports met \
             two rulesets and it carries only the first; record the window again, or give the \
             rules it was recorded under with --old FILE",
            a.recording.display()
        );
    }
    let (old, base) = if old_given {
        // The recorded node (if any) with the old rules given; without one, the inputs
        // given for the new node (or the live node's) serve the old one too: they are the
        // node's, not the change.
        let mut t = collect
            .rulesets
            .first()
            .cloned()
            .unwrap_or_else(|| LiveTexts {
                iptables: None,
                ip6tables: None,
                nft: None,
                ..live.clone().unwrap_or_else(|| given.clone())
            });
        [t.iptables, t.ip6tables, t.nft] = old_rules;
        (vec![Side::new("old (--old)", t.clone(), "")?], t)
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
            .map(|(i, t)| {
                Side::new(
                    &format!("recorded (ruleset {})", i + 1),
                    t.clone(),
                    "; give the ruleset it was recorded under with --old FILE",
                )
            })
            .collect::<Result<Vec<_>>>()?;
        let last = collect.rulesets.last().cloned().expect("not empty");
        (sides, last)
    };
    let new = match live {
        Some(texts) => Side::new("live", texts, "")?,
        None => Side::new("new", overlay(&base, given, &a.new), "")?,
    };
    let texts = old.iter().chain(std::iter::once(&new)).map(|s| &s.texts);
    let marks = mark_names(a, &collect, texts)?;
    let mask = a.mark_mask.unwrap_or_else(|| default_mark_mask(&marks));
    let mut findings = judge(&collect.folded, &old, &new, &marks, a.compare, mask);
    findings.notes.extend(collect.notes.iter().cloned());
    if old.len() > 1 {
        findings.notes.push(format!(
            "the ruleset changed {} times during the recording: each flow's before is the \
             ruleset in force when it was recorded",
            old.len() - 1
        ));
    }
    print(a, &findings, out)
}

/// `--observed AFTER`: both sides as the kernel walked them, from two recordings.
fn run_observed(a: &WhatifArgs, after: &std::path::Path, out: &mut dyn Write) -> Result<bool> {
    let before = collect(&a.recording, a.filter.as_ref())?;
    let after_c = collect(after, a.filter.as_ref())?;
    if before.window || after_c.window {
        bail!(
            "--observed compares two `tail --record` recordings (the traversals the kernel \
             walked); a capture window holds the agent's reports: record both sides with \
             `observer tail --record` on the node"
        );
    }
    let texts = before.rulesets.iter().chain(&after_c.rulesets);
    let marks = mark_names(a, &before, texts)?;
    let mask = a.mark_mask.unwrap_or_else(|| default_mark_mask(&marks));
    let findings = observed::judge(&before.folded, &after_c.folded, a.compare, mask);
    print(a, &findings, out)
}

/// A capture window's flows and ruleset (docs/whatif.md): the agent's reports, the node's
/// rules read when it opened.
fn collect_window(file: &std::path::Path, filter: Option<&String>) -> Result<Collect> {
    if let Some(f) = filter {
        bail!(
            "--filter {f:?} applies to `tail --record` recordings; {} is a capture window, \
             filtered by the agent when it was recorded (record it again with --filter)",
            file.display()
        );
    }
    let mut collect = Collect {
        window: true,
        ..Default::default()
    };
    let (header, end) = crate::output::window::read(file, |v| collect.folded.add_json(v, 0))
        .with_context(|| format!("reading the capture window {}", file.display()))?;
    collect.rulesets.push(header.ruleset);
    for f in &header.ruleset_failures {
        collect.notes.push(format!(
            "the agent could not read {f} when the window opened: what it leaves out is \
             undecidable"
        ));
    }
    let node = header
        .node
        .as_deref()
        .map_or(String::new(), |n| format!(" of node {n}"));
    if header.source == "drops" {
        collect.notes.push(format!(
            "a flight recorder{node}: its drops are held against the rules read when they \
             were fetched, which a drop recorded before a rules change did not meet"
        ));
    }
    match end {
        None => log::warn!(
            "{}: the capture window has no end line (cut short): reports after its last line \
             are missing",
            file.display()
        ),
        Some(e) => {
            collect.ruleset_changed = e.ruleset_changed;
            let lost = e
                .agent_end
                .as_ref()
                .and_then(|a| a["lost"].as_u64())
                .unwrap_or(0);
            if e.skipped > 0 || lost > 0 {
                collect.notes.push(format!(
                    "the window{node} misses traversals: {} the agent skipped (the client read \
                     too slowly), {lost} packets its probes could not record",
                    e.skipped
                ));
            }
        }
    }
    Ok(collect)
}

/// The recording's flows and rulesets, as `filter` keeps them.
fn collect(file: &std::path::Path, filter: Option<&String>) -> Result<Collect> {
    if crate::output::window::is_window(file)? {
        return collect_window(file, filter);
    }
    let mut collect = Collect::default();
    let opts = super::replay::ReplayOptions {
        file: file.into(),
        output: crate::pipeline::Output::Line,
        count: None,
        filter: filter.cloned(),
    };
    let summary = super::replay::each(&opts, &mut collect)
        .with_context(|| format!("reading the recording {}", file.display()))?;
    if summary.unended {
        log::warn!(
            "{}: the recording has no end marker: flows after its last frame are missing",
            file.display()
        );
    }
    Ok(collect)
}

/// Mark bits named as the tail named them (from its last ruleset, else the recording's
/// header), what the rules' KUBE-MARK-* say, then `--marks`.
fn mark_names<'a>(
    a: &WhatifArgs,
    collect: &Collect,
    texts: impl Iterator<Item = &'a LiveTexts>,
) -> Result<MarkDictionary> {
    let named = if collect.window {
        Vec::new()
    } else if collect.marks.is_empty() {
        crate::output::recording::Reader::open(&a.recording)?
            .header
            .marks
    } else {
        collect.marks.clone()
    };
    let mut marks = MarkDictionary::from_entries(&named);
    for t in texts {
        if let Some(t) = &t.iptables {
            marks.learn_from_iptables_save(t);
        }
    }
    if let Some(f) = &a.marks {
        a.new.apply_marks_file(&mut marks, f)?;
    }
    Ok(marks)
}

/// Writes the findings as `--json` asks; Ok(true) when some flow changes.
fn print(a: &WhatifArgs, findings: &Findings, out: &mut dyn Write) -> Result<bool> {
    let text = if a.json {
        for n in &findings.notes {
            eprintln!("note: {n}");
        }
        eprintln!("{}", findings.summary());
        render_json(findings)
    } else {
        render_text(findings)
    };
    // A reader that stopped early (`| head`) ends the output, not the answer.
    match out.write_all(text.as_bytes()).and_then(|()| out.flush()) {
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => {}
        r => r.context("writing the report")?,
    }
    Ok(findings.any())
}

/// What the tests of whatif's parts share.
#[cfg(test)]
pub(crate) mod tests_support {
    use super::*;

    /// The golden lab recording's IPv4 flows, folded (as whatif folds them), to count
    /// independently of whatif's report.
    pub fn recorded_flows() -> Folded {
        let file = format!(
            "{}/../observer/tests/golden/lab-flows.obsrec",
            env!("CARGO_MANIFEST_DIR")
        );
        collect(std::path::Path::new(&file), Some(&"ip".to_string()))
            .unwrap()
            .folded
    }
}

#[cfg(test)]
mod tests {
    use super::tests_support::recorded_flows;
    use super::*;
    use crate::commands::rulefiles::Temp;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        a: WhatifArgs,
    }

    const DIR: &str = env!("CARGO_MANIFEST_DIR");

    fn path(rel: &str) -> String {
        format!("{DIR}/../{rel}")
    }

    fn lab_rules() -> String {
        std::fs::read_to_string(path("lab/node.rules")).unwrap()
    }

    /// whatif of the golden lab recording (it carries no ruleset: the lab's is given as
    /// --old), IPv4 flows only unless `extra` says otherwise; (changed?, output).
    fn whatif(extra: &[&str]) -> Result<(bool, String)> {
        let mut argv = vec![
            "whatif".to_string(),
            "--recording".into(),
            path("observer/tests/golden/lab-flows.obsrec"),
            "--old".into(),
            path("lab/node.rules"),
            "--old6".into(),
            path("lab/node6.rules"),
            "--ipsets".into(),
            path("lab/node.ipsets"),
            "--routes".into(),
            path("lab/rules/lab-routes.json"),
        ];
        argv.extend(extra.iter().map(|s| s.to_string()));
        let a = Cli::try_parse_from(argv)?.a;
        let mut out = Vec::new();
        let changed = run(&a, &mut out)?;
        Ok((changed, String::from_utf8(out)?))
    }

    fn json_lines(out: &str) -> Vec<serde_json::Value> {
        out.lines()
            .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")))
            .collect()
    }

    #[test]
    fn the_recorded_ruleset_against_itself_changes_nothing() {
        let (changed, out) =
            whatif(&["--ruleset", &path("lab/node.rules"), "--filter", "ip"]).unwrap();
        assert!(!changed, "{out}");
        let flows = recorded_flows();
        assert_eq!(
            out.trim(),
            format!(
                "whatif: {} traversals in {} flows: 0 flows (0 packets) change, {} unchanged ({} packets)",
                flows.traversals,
                flows.flows.len(),
                flows.flows.len(),
                flows.traversals
            )
        );
    }

    /// The golden recording's IPv4 traversals as a capture window (the JSON reports an
    /// agent streams, the lab's node as its ruleset), plus `extra` report lines.
    fn golden_window(name: &str, extra: &[serde_json::Value]) -> Temp {
        use crate::pipeline::{Handled, Outcome, Sink};
        struct Lines(String);
        impl Sink for Lines {
            fn handled(&mut self, h: &Handled<'_>) -> std::io::Result<()> {
                if let Outcome::Report { report, .. } = h.outcome {
                    self.0
                        .push_str(report.traversal().to_json_line().trim_end());
                    self.0.push('\n');
                }
                Ok(())
            }
        }
        let opts = crate::commands::replay::ReplayOptions {
            file: path("observer/tests/golden/lab-flows.obsrec").into(),
            output: crate::pipeline::Output::Line,
            count: None,
            filter: Some("ip".into()),
        };
        let mut lines = Lines(String::new());
        crate::commands::replay::each(&opts, &mut lines).unwrap();
        let read = |p: &str| std::fs::read_to_string(path(p)).unwrap();
        let header = crate::output::window::Header {
            format: crate::output::window::FORMAT,
            observer: "test".into(),
            source: "traces".into(),
            agent: "test".into(),
            node: Some("lab-node".into()),
            filter: None,
            opened: 0,
            ruleset: LiveTexts {
                iptables: Some(read("lab/node.rules")),
                ip6tables: Some(read("lab/node6.rules")),
                ipset: Some(read("lab/node.ipsets")),
                routes: vec![read("lab/rules/lab-routes.json")],
                ..Default::default()
            },
            ruleset_failures: vec![],
        };
        let mut text = serde_json::json!({ "observer_window": header }).to_string();
        text.push('\n');
        text.push_str(&lines.0);
        for e in extra {
            text.push_str(&e.to_string());
            text.push('\n');
        }
        text.push_str("{\"observer_window_end\":{\"closed\":0,\"reports\":0,\"skipped\":0,\"agent_end\":null,\"stopped_by\":\"the agent\"}}\n");
        Temp::new(name, text)
    }

    /// A window of the same traffic as a recording, with the node's ruleset in it: whatif
    /// needs no --old and finds exactly the changes the recording gives; a drop sample seen
    /// only where it died is listed as undecidable, never unchanged.
    #[test]
    fn a_capture_window_is_judged_as_its_recording_is() {
        let rules = lab_rules().replace(
            "-A FORWARD -m comment --comment \"cali:wUHhoiAYhphO9Mso\" -j cali-FORWARD\n",
            "-A FORWARD -p tcp -m tcp --dport 22 -j DROP\n-A FORWARD -m comment --comment \"cali:wUHhoiAYhphO9Mso\" -j cali-FORWARD\n",
        );
        let f = Temp::new("window-drop22.rules", &rules);
        let (rchanged, rout) =
            whatif(&["--ruleset", f.path(), "--filter", "ip", "--json"]).unwrap();
        let sample = serde_json::json!({
            "schema": 3, "source": "observed", "netns": "current", "family": "ipv4",
            "proto": "udp",
            "packet": {"family": "ipv4", "proto": "udp", "src": "198.51.100.10",
                       "dst": "172.17.0.5", "sport": 40000, "dport": 7777, "icmp": null,
                       "last": null},
            "ingress": {"iface": "eth0"}, "egress": null, "route": null, "stages": [],
            "fate": {"kind": "dropped", "reason": "NETFILTER_DROP"},
            "incomplete": true, "incomplete_reason": "seen only where it was dropped"
        });
        let w = golden_window("golden.window", &[sample.clone(), sample]);
        let run_window = |extra: &[&str]| {
            let mut argv = vec!["whatif", "--recording", w.path()];
            argv.extend(extra);
            let a = Cli::try_parse_from(argv).unwrap().a;
            let mut out = Vec::new();
            let changed = run(&a, &mut out).unwrap();
            (changed, String::from_utf8(out).unwrap())
        };
        let (wchanged, wout) = run_window(&["--ruleset", f.path(), "--json"]);
        assert!(rchanged && wchanged);
        let pick = |out: &str| -> Vec<(String, u64, String)> {
            json_lines(out)
                .iter()
                .map(|v| {
                    (
                        v["flow"].as_str().unwrap().to_string(),
                        v["count"].as_u64().unwrap(),
                        v["change"].as_str().unwrap().to_string(),
                    )
                })
                .collect()
        };
        let mut want = pick(&rout);
        assert!(want.len() >= 2, "{rout}");
        want.push((
            "udp 198.51.100.10:40000 -> 172.17.0.5:7777 in eth0 (dropped)".into(),
            2,
            "undecidable".into(),
        ));
        assert_eq!(pick(&wout), want);
        let (_, text) = run_window(&["--ruleset", f.path()]);
        assert!(
            text.contains(
                "undecidable (the input does not hold what the flow needs): 1 flow, 2 packets"
            ),
            "{text}"
        );
        assert!(text.contains(", 1 undecidable (2 packets)"), "{text}");
        // Its own ruleset against itself: nothing changes but what cannot be decided.
        let same = Temp::new("window-same.rules", lab_rules());
        let (changed, text) = run_window(&["--ruleset", same.path()]);
        assert!(changed, "an undecidable flow is never unchanged: {text}");
        assert!(
            text.contains("0 flows (0 packets) change, 1 undecidable"),
            "{text}"
        );
        // What a window cannot do is said.
        let a = Cli::try_parse_from([
            "whatif",
            "--recording",
            w.path(),
            "--ruleset",
            f.path(),
            "--filter",
            "udp",
        ])
        .unwrap()
        .a;
        let e = run(&a, &mut Vec::new()).unwrap_err().to_string();
        assert!(e.contains("filtered by the agent"), "{e}");
    }

    #[test]
    fn a_rule_dropping_one_port_changes_exactly_the_flows_to_it() {
        let rules = lab_rules().replace(
            "-A FORWARD -m comment --comment \"cali:wUHhoiAYhphO9Mso\" -j cali-FORWARD\n",
            "-A FORWARD -p tcp -m tcp --dport 22 -j DROP\n-A FORWARD -m comment --comment \"cali:wUHhoiAYhphO9Mso\" -j cali-FORWARD\n",
        );
        let f = Temp::new("drop22.rules", &rules);
        let (changed, out) = whatif(&["--ruleset", f.path(), "--filter", "ip", "--json"]).unwrap();
        assert!(changed);
        let got: Vec<(String, u64)> = json_lines(&out)
            .iter()
            .map(|v| {
                assert_eq!(v["change"], "accepted_to_dropped", "{v}");
                assert_eq!(v["before"]["schema"], 3);
                assert_eq!(v["after"]["fate"]["kind"], "dropped", "{v}");
                assert_eq!(v["after"]["source"], "predicted");
                (
                    v["flow"].as_str().unwrap().to_string(),
                    v["count"].as_u64().unwrap(),
                )
            })
            .collect();
        // Every recorded flow to tcp port 22 (new and established), with its count; no other.
        let want: Vec<(String, u64)> = recorded_flows()
            .flows
            .iter()
            .filter(|(k, _, _)| k.proto == 6 && k.dport == Some(22))
            .map(|(k, n, _)| (k.describe(true), *n))
            .collect();
        assert!(want.len() >= 2, "{want:?}");
        assert_eq!(got, want);
        // The text names the rule responsible on each side.
        let (_, text) = whatif(&["--ruleset", f.path(), "--filter", "ip"]).unwrap();
        assert!(text.starts_with("accepted -> dropped: "), "{text}");
        assert!(
            text.contains("+ FORWARD#1: -A FORWARD -p tcp -m tcp --dport 22 -j DROP"),
            "{text}"
        );
        assert!(text.contains("- FORWARD#1: -A FORWARD -m comment --comment \"cali:wUHhoiAYhphO9Mso\" -j cali-FORWARD"), "{text}");
        let packets: u64 = want.iter().map(|(_, n)| n).sum();
        assert!(
            text.contains(&format!(
                "{} flows ({packets} packets) change ({} accepted -> dropped)",
                want.len(),
                want.len()
            )),
            "{text}"
        );
    }

    #[test]
    fn established_packets_are_judged_as_conntrack_translated_them() {
        // A rule on the pod's address: the client's later packets reach FORWARD translated
        // to it by conntrack, so they change with the connection's first packet.
        let rules = lab_rules().replace(
            "-A FORWARD -m comment --comment \"cali:wUHhoiAYhphO9Mso\" -j cali-FORWARD\n",
            "-A FORWARD -d 172.17.0.5/32 -p tcp -m tcp --dport 22 -j DROP\n-A FORWARD -m comment --comment \"cali:wUHhoiAYhphO9Mso\" -j cali-FORWARD\n",
        );
        let f = Temp::new("droppod.rules", &rules);
        let (changed, out) = whatif(&["--ruleset", f.path(), "--filter", "ip", "--json"]).unwrap();
        assert!(changed);
        let lines = json_lines(&out);
        let states: Vec<&str> = lines
            .iter()
            .map(|v| {
                v["after"]["stages"][0]["ct"]["state"]
                    .as_str()
                    .unwrap_or("?")
            })
            .collect();
        let flows = recorded_flows();
        let to_pod: Vec<_> = flows
            .flows
            .iter()
            .filter(|(k, _, _)| k.dport == Some(22) && k.ingress.as_deref() == Some("eth0"))
            .collect();
        assert_eq!(lines.len(), to_pod.len(), "{out}");
        assert!(
            to_pod
                .iter()
                .any(|(k, _, _)| k.state == CtState::Established),
            "{states:?}"
        );
        for v in &lines {
            assert_eq!(v["change"], "accepted_to_dropped", "{v}");
        }
    }

    #[test]
    fn reordering_independent_rules_changes_nothing() {
        let a = "-A cali-from-wl-dispatch -i cali1a2b -m comment --comment \"cali:zTj6P0TIgYvgz-md\" -g cali-fw-cali1a2b\n";
        let b = "-A cali-from-wl-dispatch -i cali2c3d -m comment --comment \"cali:Yy6q2l0TtdHKKnVo\" -g cali-fw-cali2c3d\n";
        let rules = lab_rules();
        assert!(rules.contains(&format!("{a}{b}")));
        let swapped = rules.replace(&format!("{a}{b}"), &format!("{b}{a}"));
        let f = Temp::new("swapped.rules", &swapped);
        let (changed, out) = whatif(&["--ruleset", f.path(), "--filter", "ip"]).unwrap();
        assert!(!changed, "{out}");
        assert!(out.contains(" 0 flows (0 packets) change"), "{out}");
    }

    #[test]
    fn a_moved_endpoint_changes_the_dnat_of_new_connections_only() {
        let rules = lab_rules().replace(
            "--to-destination 172.17.0.5:22",
            "--to-destination 172.17.0.6:22",
        );
        let f = Temp::new("moved.rules", &rules);
        let (changed, out) = whatif(&["--ruleset", f.path(), "--filter", "ip", "--json"]).unwrap();
        assert!(changed);
        let lines = json_lines(&out);
        assert_eq!(lines.len(), 1, "{out}");
        let v = &lines[0];
        assert_eq!(v["change"], "dnat_changed");
        assert_eq!(v["packet"]["dport"], 22);
        assert_eq!(v["before"]["nat"][0]["to"], "172.17.0.5:22");
        assert_eq!(v["after"]["nat"][0]["to"], "172.17.0.6:22");
        // Conntrack, not the rules, translates the connection's later packets.
        assert!(v["flow"].as_str().unwrap().ends_with("state new"), "{v}");
    }

    #[test]
    fn kube_proxy_iptables_to_nftables_keeps_every_outcome() {
        let calico_only = crate::commands::lab::without_kube_proxy(&lab_rules());
        let f = Temp::new("calico.rules", &calico_only);
        let nft = path("observer/tests/whatif/node-kube-proxy.nft.json");
        let args = ["--ruleset", f.path(), "--nft", &nft, "--filter", "ip"];
        let (changed, out) = whatif(&[&args[..], &["--compare", "outcome"]].concat()).unwrap();
        assert!(!changed, "{out}");
        // Compared by path, the rules differ (and kube-proxy's masquerade bit is not set by
        // the nft tables): the same migration is all change.
        let (changed, out) = whatif(&args).unwrap();
        assert!(changed);
        assert!(out.contains("deciding rules changed"), "{out}");
        // A migration that loses a service is caught in outcome mode.
        let text = std::fs::read_to_string(&nft)
            .unwrap()
            .replace("172.17.0.5", "172.17.0.9");
        let broken = Temp::new("broken.nft.json", &text);
        let (changed, out) = whatif(&[
            "--ruleset",
            f.path(),
            "--nft",
            broken.path(),
            "--filter",
            "ip",
            "--compare",
            "outcome",
        ])
        .unwrap();
        assert!(changed);
        assert!(out.starts_with("DNAT target changed: "), "{out}");
    }

    #[test]
    fn undecidable_flows_are_listed_never_unchanged() {
        // The golden recording's IPv6 multicast listener report (ff02::16) is decided up to
        // the socket condition: the same rules change nothing.
        let (changed, out) = whatif(&[
            "--ruleset",
            &path("lab/node.rules"),
            "--ruleset6",
            &path("lab/node6.rules"),
        ])
        .unwrap();
        assert!(!changed, "{out}");
        // A match the simulator does not model (the time of day) before the first FORWARD
        // rule: the forwarded flows cannot be told, and are listed as such.
        let rules = lab_rules();
        let at = rules.find("\n-A FORWARD ").expect("a FORWARD rule");
        let timed = format!(
            "{}\n-A FORWARD -m time --timestart 22:00 -j ACCEPT{}",
            &rules[..at],
            &rules[at..]
        );
        let f = Temp::new("timed.rules", &timed);
        let (changed, out) = whatif(&["--ruleset", f.path()]).unwrap();
        assert!(changed, "{out}");
        assert!(
            out.starts_with("undecidable (the simulator cannot tell): "),
            "{out}"
        );
        assert!(out.contains("time --timestart 22:00"), "{out}");
        assert!(out.contains(" undecidable ("), "{out}");
    }

    #[test]
    fn errors_say_what_to_do() {
        let rec = path("observer/tests/golden/lab-flows.obsrec");
        let run_args = |argv: &[&str]| {
            let a = Cli::try_parse_from(std::iter::once("whatif").chain(argv.iter().copied()))
                .unwrap()
                .a;
            run(&a, &mut Vec::new()).map_err(|e| format!("{e:#}"))
        };
        let e = run_args(&["--recording", &rec, "--ruleset", &path("lab/node.rules")]).unwrap_err();
        assert!(
            e.contains("carries no ruleset") && e.contains("--old FILE"),
            "{e}"
        );
        let e = run_args(&["--recording", &rec, "--old", &path("lab/node.rules")]).unwrap_err();
        assert!(
            e.contains("nothing changed") && e.contains("--ruleset FILE"),
            "{e}"
        );
        let bad = Temp::new("bad.rules", "*filter\n-A NOPE -j ACCEPT\n");
        let e = run_args(&[
            "--recording",
            &rec,
            "--old",
            &path("lab/node.rules"),
            "--ruleset",
            bad.path(),
        ])
        .unwrap_err();
        assert!(
            e.contains("the new node's `iptables-save -c` text does not parse"),
            "{e}"
        );
        let e = run_args(&[
            "--recording",
            "/nonexistent.obsrec",
            "--old",
            &path("lab/node.rules"),
            "--ruleset",
            &path("lab/node.rules"),
        ])
        .unwrap_err();
        assert!(e.contains("/nonexistent.obsrec"), "{e}");
        // The inputs are read before the recording: their mistakes are said first.
        let e = run_args(&[
            "--recording",
            "/nonexistent.obsrec",
            "--ruleset",
            "/nonexistent.rules",
        ])
        .unwrap_err();
        assert!(e.contains("/nonexistent.rules"), "{e}");
        let e = run_args(&["--recording", &rec, "--netns", "obs-node"]).unwrap_err();
        assert!(e.contains("--netns") && e.contains("without --live"), "{e}");
        // --observed takes the second recording as the new side: no rules with it.
        let e = Cli::try_parse_from([
            "whatif",
            "--recording",
            &rec,
            "--observed",
            &rec,
            "--ruleset",
            "x",
        ])
        .err()
        .expect("refused")
        .to_string();
        assert!(e.contains("--observed") && e.contains("--ruleset"), "{e}");
    }

    #[test]
    fn observed_against_the_same_recording_changes_nothing() {
        let rec = path("observer/tests/golden/lab-flows.obsrec");
        let a = Cli::try_parse_from([
            "whatif",
            "--recording",
            &rec,
            "--observed",
            &rec,
            "--filter",
            "ip",
        ])
        .unwrap()
        .a;
        let mut out = Vec::new();
        assert!(!run(&a, &mut out).unwrap());
        let out = String::from_utf8(out).unwrap();
        let flows = recorded_flows();
        assert!(
            out.ends_with(&format!(
                "whatif: {} traversals in {} flows: 0 flows (0 packets) change, {} unchanged ({} packets)\n",
                flows.traversals,
                flows.flows.len(),
                flows.flows.len(),
                flows.traversals
            )),
            "{out}"
        );
    }

    /// A prediction of `packet` under `rules` (iptables-save text).
    fn predict(rules: &str, packet: &str) -> Traversal {
        let req = observer_rules::ExplainRequest {
            texts: LiveTexts {
                iptables: Some(rules.into()),
                ..Default::default()
            },
            packet: packet.into(),
        };
        observer_rules::explain(&req)
            .unwrap()
            .to_model(&MarkDictionary::default(), None)
    }

    #[test]
    fn classify_names_each_kind_of_change() {
        const P: &str = "tcp 198.51.100.7:40000 -> 10.0.0.2:80 in eth0 out eth1";
        let t = |filter: &str, nat: &str, mangle: &str| {
            predict(
                &format!(
                    "*mangle\n:PREROUTING ACCEPT [0:0]\n{mangle}COMMIT\n*nat\n:PREROUTING ACCEPT [0:0]\n:POSTROUTING ACCEPT [0:0]\n{nat}COMMIT\n*filter\n:FORWARD ACCEPT [0:0]\n{filter}COMMIT\n"
                ),
                P,
            )
        };
        let base = t("-A FORWARD -p tcp -j ACCEPT\n", "", "");
        let c = |a: &Traversal, b: &Traversal, m| classify(a, b, m, u32::MAX);
        assert_eq!(c(&base, &base, Compare::Path), None);
        let drop = t("-A FORWARD -p tcp -j DROP\n", "", "");
        assert_eq!(
            c(&base, &drop, Compare::Path),
            Some(Change::AcceptedToDropped)
        );
        assert_eq!(
            c(&drop, &base, Compare::Outcome),
            Some(Change::DroppedToAccepted)
        );
        let reject = t("-A FORWARD -p tcp -j REJECT\n", "", "");
        assert_eq!(
            c(&drop, &reject, Compare::Outcome),
            Some(Change::FateChanged)
        );
        let dnat = t(
            "",
            "-A PREROUTING -p tcp -j DNAT --to-destination 10.0.0.3:80\n",
            "",
        );
        let dnat2 = t(
            "",
            "-A PREROUTING -p tcp -j DNAT --to-destination 10.0.0.4:80\n",
            "",
        );
        assert_eq!(
            c(&dnat, &dnat2, Compare::Outcome),
            Some(Change::DnatChanged)
        );
        let snat = t("", "-A POSTROUTING -j SNAT --to-source 192.0.2.1\n", "");
        assert_eq!(c(&base, &snat, Compare::Outcome), Some(Change::SnatChanged));
        // A source translation's port is conntrack's choice: outcomes compare its address.
        let port = |p: u16| {
            t(
                "",
                &format!("-A POSTROUTING -p tcp -j SNAT --to-source 192.0.2.1:{p}\n"),
                "",
            )
        };
        assert_eq!(
            c(&port(1000), &port(2000), Compare::Path),
            Some(Change::SnatChanged)
        );
        assert_eq!(c(&port(1000), &port(2000), Compare::Outcome), None);
        let other = t(
            "",
            "-A POSTROUTING -p tcp -j SNAT --to-source 192.0.2.9:1000\n",
            "",
        );
        assert_eq!(
            c(&port(1000), &other, Compare::Outcome),
            Some(Change::SnatChanged)
        );
        let mark = t("", "", "-A PREROUTING -j MARK --set-xmark 0x4000/0x4000\n");
        assert_eq!(c(&base, &mark, Compare::Path), Some(Change::MarksChanged));
        // Outcome mode compares only the bits given.
        assert_eq!(classify(&base, &mark, Compare::Outcome, !0x4000), None);
        // Other rules, same outcome: a change of path, not of outcome.
        let other = t("-A FORWARD -p tcp -d 10.0.0.2 -j ACCEPT\n", "", "");
        assert_eq!(c(&base, &other, Compare::Path), Some(Change::RulesChanged));
        assert_eq!(c(&base, &other, Compare::Outcome), None);
        // Undecidable on either side is listed.
        let unsure = t("-A FORWARD -m set --match-set nope src -j DROP\n", "", "");
        assert_eq!(
            c(&base, &unsure, Compare::Outcome),
            Some(Change::Undecidable)
        );
    }

    #[test]
    fn default_mask_leaves_out_kube_proxys_bits() {
        let m = MarkDictionary::default();
        let mask = default_mark_mask(&m);
        assert_eq!(mask & 0x4000, 0);
        assert_eq!(mask & 0x8000, 0);
        assert_eq!(mask & 0x10000, 0x10000);
    }

    #[test]
    fn flows_fold_by_key_and_count() {
        let f = recorded_flows();
        let total: u64 = f.flows.iter().map(|(_, n, _)| n).sum();
        assert_eq!(total + f.unusable, f.traversals);
        // Keys are distinct, and a repeated packet (the client's established segments) is
        // one flow with its count.
        let keys: std::collections::HashSet<_> = f.flows.iter().map(|(k, _, _)| k).collect();
        assert_eq!(keys.len(), f.flows.len());
        assert!(
            f.flows
                .iter()
                .any(|(k, n, _)| k.state == CtState::Established && *n > 1)
        );
        // A flow's description is a packet `explain --packet` reads back.
        for (k, _, _) in &f.flows {
            let d = k.describe(true);
            let d = d.split(" (").next().unwrap();
            assert_eq!(
                observer_rules::parse_packet_spec(d).unwrap(),
                k.spec(true),
                "{d}"
            );
        }
    }
}
