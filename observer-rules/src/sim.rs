//! The simulator: walks a packet through the hooks and tables in the kernel's order and records
//! exactly the rules whose counters the kernel would increment, every mark and NAT change, and
//! the verdict, as the model's stages ([`observer_model::Stage`]). Statistic matches and
//! `numgen` fork the walk; each fork is one of the model's [`Branch`]es with its probability,
//! its route, its fate and its address translations. Native nftables base chains (`nft_walk`) run interleaved with the iptables
//! tables by priority, in the kernel's order.

mod bridged;
mod ipvs;
mod matches;
pub mod meaning;
mod nft_walk;

use std::borrow::Cow;
use std::cell::RefCell;
use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::Arc;

use observer_model::{
    self as model, ChainRef, CtView, Endpoint, Fate, FateKind, Host, Iface, Nat, NatKind,
    NatSource, Route,
};

use crate::bridge::Bridges;
use crate::compile::{Action, Compiled, Cond, compile};
use crate::ipset::{Ipsets, Lookup};
use crate::iptables::{Rule, SaveFile};
use crate::ipvs::IpvsTable;
use crate::nft::NftRuleset;
use crate::nft::compile::compile as compile_nft;
use crate::nft::program::{Program, Scheduled, nat_core_priority};
use crate::packet::{
    CT_DNAT, CT_ESTABLISHED, CT_INVALID, CT_NEW, CT_RELATED, CT_UNTRACKED, CtState, PacketSpec,
};
use crate::route::{RouteDecision, Routes};
use matches::{ct_tuple, pkt_type, recent};

/// Stop forking after this many branches; the explanation says when it was cut.
const MAX_BRANCHES: usize = 256;
/// The kernel limits jump depth too; a loop in a hand-written ruleset must not hang us.
const MAX_DEPTH: usize = 64;
/// Rules one walk may evaluate, at least: a `goto` loop never deepens the stack, so the
/// depth guard cannot see it; this bound can (4 evaluations per rule of the ruleset, when more).
const MIN_WALK_STEPS: usize = 10_000;
/// Rules a stage lists when its walk ran out of steps.
const LISTED_ON_LOOP: usize = 32;

/// Hooks, verdicts and branches are the model's (`observer-model`), shared with the live tracer.
pub use observer_model::{Branch, Hook, Verdict};

/// A rule whose counters the kernel increments for this packet.
#[derive(Debug, Clone, PartialEq)]
pub struct MatchedRule {
    pub table: String,
    pub chain: String,
    /// 1-based, as `iptables -L --line-numbers` counts.
    pub index: usize,
    pub text: String,
    /// What the rule did: `jump KUBE-SVC-...`, `accept`, `mark 0x0 -> 0x4000`, `DNAT 172.17.0.5:22`...
    pub action: String,
    /// Set when the rule could not be decided; the walk stops there.
    pub undecidable: Option<String>,
    pub comments: Vec<String>,
    /// Packet mark before and after, for rules that set it (MARK, CONNMARK --restore-mark).
    pub mark: Option<(u32, u32)>,
    /// The nf_tables rule: a native rule, or the iptables-nft rule an iptables rule is.
    pub nft: Option<NftRuleRef>,
}

/// Names an nf_tables rule as `nft -a list ruleset` and `nft monitor trace` do.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NftRuleRef {
    pub family: String,
    pub handle: u64,
    /// False for an iptables-nft rule simulated from iptables-save.
    pub native: bool,
}

/// One table (or native base chain) as the walk fills it in; it becomes the model's stage
/// when the table is done ([`Stage::into_model`]).
#[derive(Debug, Clone)]
pub(crate) struct Stage {
    hook: Hook,
    table: String,
    priority: i32,
    before: model::Snapshot,
    after: model::Snapshot,
    verdict: Verdict,
    pub(crate) rules: Vec<MatchedRule>,
    /// Built-in chain whose policy decided (its policy counter increments).
    pub(crate) policy: Option<String>,
    /// A NAT rule translated here.
    nat: Option<NatKind>,
    note: Option<String>,
    /// The conntrack entry after the table: state and ct mark (None when unknown);
    /// None before conntrack ran (raw) or when the packet is invalid.
    ct: Option<(CtState, Option<u32>)>,
    /// For a native nft base chain: its family and name (`table` is the nft table).
    nft_chain: Option<(String, String)>,
    /// IPVS's stage: the virtual service and real server.
    ipvs: Option<Arc<model::IpvsStep>>,
}

impl Stage {
    /// A table (or base chain) about to run, the packet as it enters it.
    fn open(
        hook: Hook,
        table: String,
        priority: i32,
        pkt: &Pkt,
        nft_chain: Option<(String, String)>,
    ) -> Self {
        let before = pkt.snapshot();
        Stage {
            hook,
            table,
            priority,
            before: before.clone(),
            after: before,
            verdict: Verdict::Accept,
            rules: Vec::new(),
            policy: None,
            nat: None,
            note: None,
            ct: None,
            nft_chain,
            ipvs: None,
        }
    }

    /// The table is done with `res`: the packet as it leaves, the verdict (an undecidable
    /// result noted), the conntrack entry after it.
    fn close(&mut self, res: TableResult, pkt: &Pkt) -> Verdict {
        self.after = pkt.snapshot();
        self.verdict = match res {
            TableResult::Verdict(v) => v,
            TableResult::Undecidable(why) => {
                self.note = Some(why);
                Verdict::Undecidable
            }
        };
        self.ct = pkt.ct_view();
        self.verdict
    }

    fn into_model(self) -> model::Stage {
        model::Stage {
            hook: self.hook,
            table: self.table.into(),
            priority: self.priority,
            chain: self
                .nft_chain
                .map(|(family, name)| ChainRef { family, name }),
            before: Some(Arc::new(self.before)),
            after: Some(Arc::new(self.after)),
            ct: self
                .ct
                .map(|(state, mark)| Arc::new(CtView { state, mark })),
            verdict: self.verdict,
            rules: self.rules.iter().map(meaning::model_rule).collect(),
            policy: self.policy,
            note: self.note,
            ipvs: self.ipvs,
            check: None,
        }
    }
}

/// One observed stage to simulate: the packet as the probe before it saw it, and the
/// priorities of that probe and the next (the chains between them are the stage).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct StageInput {
    pub hook: Hook,
    /// Exclusive bounds: chains running at a priority strictly between them.
    pub window: (i32, i32),
    /// The packet; its `ct_mark` is taken as given (None: not known), and `local` is not
    /// read (the stage's hook says where the packet goes).
    pub packet: PacketSpec,
    /// The connection's destination / source was translated (`--ctstate DNAT/SNAT`).
    pub dnat_done: bool,
    pub snat_done: bool,
    /// br_netfilter's record of the packet, as observed where it was (tail): the bridge
    /// ports decide `physdev` without the node's bridge facts.
    pub ports: SeenPorts,
}

/// What an observer saw of the bridge ports a packet passed ([`StageInput::ports`]).
#[derive(Debug, Clone, PartialEq, Eq, Hash, Default)]
pub enum SeenPorts {
    /// Not known: `physdev` is decided from the simulator's bridge facts, or undecidable.
    #[default]
    Unknown,
    /// It did not enter through a bridge port (br_netfilter has no record of it).
    NoBridge,
    /// It entered through port `physin`; `physout` as br_netfilter has it at this stage.
    Port { physin: String, physout: PhysOut },
    /// A copy the bridge made flooding a frame: bridged (to `physout` at this stage), the
    /// port it came in by not known (`--physdev-in` is undecidable, the rest is decided).
    FloodedCopy { physout: PhysOut },
}

/// One walk as it goes: the model's stages so far, the routing decision, how it ended.
struct Walk {
    route: Option<Route>,
    egress: Option<String>,
    stages: Vec<model::Stage>,
    verdict: Verdict,
    notes: Vec<String>,
    /// The bridge the packet crossed: (bridge, port in, port out), ports None where it
    /// passed none (routed in from elsewhere, or routed out of another device).
    bridge: Option<(String, Option<String>, Option<String>)>,
    /// Stages where conntrack applied a stored translation ([`StoredNat`]).
    ct_nat: Vec<usize>,
    /// IPVS sent the packet (its fate's reason).
    ipvs_sent: Option<String>,
}

impl Walk {
    fn new(egress: Option<String>) -> Self {
        Self {
            route: None,
            egress,
            stages: Vec::new(),
            verdict: Verdict::Accept,
            notes: Vec::new(),
            bridge: None,
            ct_nat: Vec::new(),
            ipvs_sent: None,
        }
    }

    /// The model's branch: its fate and address translations from the stages; mark bits
    /// named from the default dictionary (`explain` names them from the one it is given).
    fn finish(self) -> Branch {
        let fate = predicted_fate(&self);
        Branch {
            probability: 1.0,
            route: self.route,
            egress: self.egress.map(|iface| Iface { iface }),
            marks: model::mark_changes(&self.stages, &model::MarkDictionary::default()),
            nat: {
                let mut nat = predicted_nat_at(&self.stages);
                for (at, n) in &mut nat {
                    if self.ct_nat.contains(at) {
                        n.source = NatSource::Conntrack;
                    } else if &*n.table == "ipvs" {
                        n.source = NatSource::Ipvs;
                    }
                }
                nat.into_iter().map(|(_, n)| n).collect()
            },
            fate,
            stages: self.stages,
            notes: self.notes,
            bridge: self
                .bridge
                .map(|(name, physdev_in, physdev_out)| model::BridgeCrossing {
                    name,
                    physdev_in,
                    physdev_out,
                    flooded: false,
                }),
        }
    }
}

/// Where and why a predicted path ends.
fn predicted_fate(w: &Walk) -> Fate {
    let last = w.stages.last();
    let mut f = Fate::new(match (w.verdict, w.route) {
        (Verdict::Accept, Some(Route::Input)) if w.ipvs_sent.is_some() => FateKind::Forwarded,
        (Verdict::Accept, Some(Route::Input)) => FateKind::Delivered,
        (Verdict::Accept, Some(Route::Output)) => FateKind::Sent,
        (Verdict::Accept, _) => FateKind::Forwarded,
        (Verdict::Reject, _) => FateKind::Rejected,
        (Verdict::Undecidable, _) => FateKind::Undecidable,
        _ => FateKind::Dropped,
    });
    f.hook = last.map(|s| s.hook);
    if let Some(s) = last.filter(|s| s.verdict != Verdict::Accept) {
        f.table = Some(s.table.clone());
        f.reason = match (&s.policy, s.rules.last()) {
            _ if s.verdict == Verdict::Undecidable => s.note.clone(),
            (Some(p), _) => Some(format!("policy {p} of {}", s.hook.name())),
            (None, Some(r)) => Some(format!("rule {}", r.id.place())),
            (None, None) => None,
        };
    } else if let (Verdict::Accept, Some(why)) = (w.verdict, &w.ipvs_sent) {
        f.reason = Some(why.clone());
    } else if w.verdict != Verdict::Accept {
        // Routing ended it (or had nothing to decide with).
        f.reason = w.notes.last().cloned();
    }
    f
}

/// Address translations between a stage's before and after.
pub fn predicted_nat(stages: &[model::Stage]) -> Vec<Nat> {
    predicted_nat_at(stages)
        .into_iter()
        .map(|(_, n)| n)
        .collect()
}

/// [`predicted_nat`], each with the index of its stage.
fn predicted_nat_at(stages: &[model::Stage]) -> Vec<(usize, Nat)> {
    let mut out = Vec::new();
    for (at, s) in stages.iter().enumerate() {
        let (Some(b), Some(a)) = (&s.before, &s.after) else {
            continue;
        };
        for (kind, from, to) in [
            (NatKind::Dnat, &b.dst, &a.dst),
            (NatKind::Snat, &b.src, &a.src),
        ] {
            if from != to {
                out.push((
                    at,
                    Nat {
                        kind,
                        hook: s.hook,
                        table: s.table.clone(),
                        from: from.clone(),
                        to: to.clone(),
                        source: NatSource::Rules,
                    },
                ));
            }
        }
    }
    out
}

/// What a predicted branch did with the packet, from its fate.
pub fn verdict_of(b: &Branch) -> Verdict {
    match b.fate.kind {
        FateKind::Delivered | FateKind::Forwarded | FateKind::Sent => Verdict::Accept,
        FateKind::Rejected => Verdict::Reject,
        FateKind::Undecidable | FateKind::Incomplete => Verdict::Undecidable,
        FateKind::Dropped | FateKind::Consumed | FateKind::Looped | FateKind::Reassembled => {
            Verdict::Drop
        }
    }
}

struct PTable {
    index: HashMap<String, usize>,
    compiled: Vec<Vec<Compiled>>,
}

/// The translation conntrack stored for a connection, as a packet of it meets it: the
/// destination its nat PREROUTING/OUTPUT gives it, the source its POSTROUTING/INPUT gives
/// (the address, and the port when it changes). A recorded traversal shows both.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
pub struct StoredNat {
    pub dst: Option<(IpAddr, Option<u16>)>,
    pub src: Option<(IpAddr, Option<u16>)>,
}

/// A ruleset prepared for repeated simulation (rules compiled once).
pub struct Simulator<'a> {
    files: [Cow<'a, SaveFile>; 2],
    tables: [Vec<PTable>; 2],
    ipsets: Cow<'a, Ipsets>,
    routes: Cow<'a, Routes>,
    /// Addresses per interface, for MASQUERADE/REDIRECT when routes do not say.
    pub iface_addrs: HashMap<String, Vec<IpAddr>>,
    /// Native nftables, compiled once.
    nft: Option<Program>,
    /// Per family: iptables-nft tables come from iptables-save, so nft leaves them out.
    nft_skip_iptables: [bool; 2],
    /// Rules one walk may evaluate (see [`MIN_WALK_STEPS`]).
    step_limit: usize,
    /// (family, table, chain, 1-based index) of an iptables rule -> its iptables-nft handle.
    ipt_handles: HashMap<(usize, String, String, usize), u64>,
    /// Bridge ports and br_netfilter's switches; empty when not given (`physdev` is then
    /// undecidable and a frame entering a port is walked as if routed).
    pub bridges: Bridges,
    /// IPVS's virtual services (empty: no IPVS step).
    pub ipvs: IpvsTable,
}

/// The walk budget: a valid ruleset's walk evaluates each rule about once (a chain jumped to
/// from several places, a few times); [`MIN_WALK_STEPS`] covers small rulesets.
fn step_limit(v4: &SaveFile, v6: &SaveFile, nft: Option<&NftRuleset>) -> usize {
    let ipt: usize = [v4, v6]
        .iter()
        .flat_map(|f| &f.tables)
        .flat_map(|t| &t.chains)
        .map(|c| c.rules.len())
        .sum();
    let nft: usize = nft.map_or(0, |n| {
        n.tables
            .iter()
            .flat_map(|t| &t.chains)
            .map(|c| c.rules.len())
            .sum()
    });
    MIN_WALK_STEPS.max((ipt + nft).saturating_mul(4))
}

fn prepare(file: &SaveFile, v6: bool) -> Vec<PTable> {
    file.tables
        .iter()
        .map(|t| {
            let index: HashMap<String, usize> = t
                .chains
                .iter()
                .enumerate()
                .map(|(i, c)| (c.name.clone(), i))
                .collect();
            let is_chain = |n: &str| index.contains_key(n);
            let compiled = t
                .chains
                .iter()
                .map(|c| c.rules.iter().map(|r| compile(r, v6, &is_chain)).collect())
                .collect();
            PTable { index, compiled }
        })
        .collect()
}

/// The port a bridged frame leaves by, as br_netfilter records it (`physoutdev`).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum PhysOut {
    /// Not set (before bridge FORWARD, or the frame was routed).
    None,
    Port(String),
    /// Bridged, but the inputs do not say to which port (why).
    Unknown(String),
}

/// br_netfilter's record of a frame that entered through a bridge port (`nf_bridge_info`).
#[derive(Debug, Clone, PartialEq)]
struct NfBridge {
    /// None: not known (a flooded copy seen from the bridge's FORWARD on).
    physin: Option<String>,
    physout: PhysOut,
}

#[derive(Debug, Clone)]
struct Pkt {
    v6: bool,
    proto: u8,
    src: IpAddr,
    dst: IpAddr,
    sport: Option<u16>,
    dport: Option<u16>,
    /// The interface whose address a MASQUERADE / REDIRECT took, when no dump said it.
    src_label: Option<String>,
    dst_label: Option<String>,
    in_iface: Option<String>,
    out_iface: Option<String>,
    mark: u32,
    ct_mark: Option<u32>,
    state: CtState,
    dnat_done: bool,
    snat_done: bool,
    /// False in raw: conntrack runs after it (priority -200), so no entry is attached yet.
    ct_attached: bool,
    tcp_flags: u8,
    icmp: (u8, u8),
    /// Set for a frame br_netfilter handed to the IP hooks; None for routed-only packets.
    nf_bridge: Option<NfBridge>,
    /// A bridged frame's IP POSTROUTING runs without an input device (`br_nf_post_routing`).
    bridged: bool,
    /// While a bridge-family chain runs: the bridge of the ports (`meta ibrname/obrname`).
    bridge_family: Option<String>,
    /// A bridged frame whose out port is not known: why (bridge chains matching the
    /// output device are then undecidable, not a miss).
    out_port_unknown: Option<String>,
    /// False when simulating one observed stage: whether br_netfilter holds the packet is
    /// not part of what the probes hand us, so `physdev` stays undecidable there.
    nf_bridge_known: bool,
    /// `nf_bridge` was observed (tail), not derived from bridge facts.
    nf_bridge_observed: bool,
    /// The connection's original tuple (src, dst, sport, dport) when the packet is the first
    /// of its connection and no NAT happened before the walk; `--ctorig*` read it.
    orig: Option<(IpAddr, IpAddr, Option<u16>, Option<u16>)>,
    /// `-m recent --set` lists this walk has added the packet to: (name, rdest).
    recent_set: Vec<(String, bool)>,
    /// The translation conntrack stored for the packet's connection (not a new one).
    stored: StoredNat,
    /// The nat core has bound the connection's destination (a nat hook ran at PREROUTING
    /// or OUTPUT): nat OUTPUT chains are not walked again for it (IPVS's re-sent packet).
    dst_nat_bound: bool,
    /// The real server of the packet's IPVS connection (a stored destination of a packet
    /// to a virtual service: IPVS, not the nat core, rewrites every packet of it).
    ipvs_stored: Option<(IpAddr, Option<u16>)>,
    /// Assumptions stateful matches were answered under, for the branch's notes.
    assumed: Vec<String>,
    /// Filled while one rule's matches are evaluated (which reads the packet only), then
    /// taken by the walk.
    fx: RefCell<Effects>,
}

/// Where a walk through one table (or native base chain) is: (chain, next rule) frames,
/// the chains jumped to on top; the bottom frame's end means the base chain's policy.
struct Frames(Vec<(usize, usize)>);

impl Frames {
    fn new(base: usize) -> Self {
        Frames(vec![(base, 0)])
    }

    /// The next rule to evaluate, (chain, rule), past the chains whose rules are all done
    /// (`rules` counts a chain's rules); None when the base chain is done too.
    fn next(&mut self, rules: impl Fn(usize) -> usize) -> Option<(usize, usize)> {
        loop {
            let (ci, pos) = self.0.last_mut()?;
            if *pos < rules(*ci) {
                *pos += 1;
                return Some((*ci, *pos - 1));
            }
            self.0.pop();
        }
    }

    /// `return`: back to the rule after the jump.
    fn ret(&mut self) {
        self.0.pop();
    }

    /// `jump`: the chain runs, then the rule after this one; an error past [`MAX_DEPTH`].
    fn jump(&mut self, chain: usize) -> Result<(), String> {
        if self.0.len() >= MAX_DEPTH {
            return Err(format!("jump depth over {MAX_DEPTH} (loop?)"));
        }
        self.0.push((chain, 0));
        Ok(())
    }

    /// `goto`: the chain takes the current one's place (from the base chain, the goto'd
    /// chain's end is the policy).
    fn goto(&mut self, chain: usize) {
        if let Some(top) = self.0.last_mut() {
            *top = (chain, 0);
        }
    }
}

/// What evaluating one rule's matches did besides answering (`recent --set`, assumptions).
#[derive(Debug, Clone, Default)]
struct Effects {
    recent_set: Vec<(String, bool)>,
    assumed: Vec<String>,
}

impl Pkt {
    /// The packet `spec` describes, before any rule ran, from no bridge; `dnat_done` and
    /// `snat_done` say which translations its connection already has.
    fn new(spec: &PacketSpec, dnat_done: bool, snat_done: bool) -> Self {
        Pkt {
            v6: spec.is_v6(),
            proto: spec.proto,
            src: spec.src,
            dst: spec.dst,
            sport: spec.sport,
            dport: spec.dport,
            src_label: None,
            dst_label: None,
            in_iface: spec.in_iface.clone(),
            out_iface: spec.out_iface.clone(),
            mark: spec.mark,
            ct_mark: spec.ct_mark,
            state: spec.ct_state,
            dnat_done,
            snat_done,
            ct_attached: false,
            tcp_flags: spec.tcp_flags(),
            icmp: spec
                .icmp
                .unwrap_or(if spec.is_v6() { (128, 0) } else { (8, 0) }),
            nf_bridge: None,
            bridged: false,
            bridge_family: None,
            out_port_unknown: None,
            nf_bridge_known: true,
            nf_bridge_observed: false,
            orig: (spec.ct_state == CtState::New && !dnat_done && !snat_done)
                .then_some((spec.src, spec.dst, spec.sport, spec.dport)),
            recent_set: Vec::new(),
            assumed: Vec::new(),
            fx: RefCell::default(),
            stored: StoredNat::default(),
            dst_nat_bound: false,
            ipvs_stored: None,
        }
    }

    /// Conntrack's stored translation at a nat hook (not walked for a packet of a known
    /// connection): the destination at PREROUTING/OUTPUT, the source at POSTROUTING/INPUT,
    /// once per packet. Whether it changed the packet.
    fn apply_stored(&mut self, hook: Hook) -> bool {
        match hook {
            Hook::PreRouting | Hook::LocalOut if !self.dnat_done => {
                let Some((a, p)) = self.stored.dst else {
                    return false;
                };
                self.dst = a;
                self.dport = p.or(self.dport);
                self.dnat_done = true;
                true
            }
            Hook::PostRouting | Hook::LocalIn if !self.snat_done => {
                let Some((a, p)) = self.stored.src else {
                    return false;
                };
                self.src = a;
                self.sport = p.or(self.sport);
                self.snat_done = true;
                true
            }
            _ => false,
        }
    }

    fn ct_view(&self) -> Option<(CtState, Option<u32>)> {
        match self.state {
            CtState::Untracked => Some((CtState::Untracked, None)),
            CtState::Invalid => None,
            s if self.ct_attached => Some((s, self.ct_mark)),
            _ => None,
        }
    }

    /// The state's bit as the kernel's matches read it (`ct state`, `--ctstate`): before
    /// conntrack (raw) every packet reads as invalid, an untracked one as untracked.
    fn ct_state_bit(&self) -> u16 {
        match self.state {
            CtState::Untracked => CT_UNTRACKED,
            _ if !self.ct_attached => CT_INVALID,
            CtState::New => CT_NEW,
            CtState::Established => CT_ESTABLISHED,
            CtState::Related => CT_RELATED,
            CtState::Invalid => CT_INVALID,
        }
    }

    /// Whether a conntrack entry is attached (CONNMARK and connmark need one).
    fn has_ct(&self) -> bool {
        self.ct_attached && !matches!(self.state, CtState::Untracked | CtState::Invalid)
    }

    fn snapshot(&self) -> model::Snapshot {
        let host = |label: &Option<String>, addr: IpAddr| match label {
            Some(iface) => Host::AddressOf(iface.as_str().into()),
            None => Host::Ip(addr),
        };
        model::Snapshot::new(
            Endpoint {
                host: host(&self.src_label, self.src),
                port: self.sport,
            },
            Endpoint {
                host: host(&self.dst_label, self.dst),
                port: self.dport,
            },
            self.mark,
            None,
            None,
        )
    }
}

enum Tri {
    Yes,
    No,
    Unknown(String),
}

fn tri(b: bool, neg: bool) -> Tri {
    if b != neg { Tri::Yes } else { Tri::No }
}

fn iface_match(pattern: &str, name: Option<&str>) -> bool {
    let name = name.unwrap_or("");
    match pattern.strip_suffix('+') {
        Some(prefix) => name.starts_with(prefix),
        None => name == pattern,
    }
}

/// Records statistic decisions so every combination can be replayed.
struct Chooser {
    prefix: Vec<bool>,
    log: Vec<(f64, bool)>,
    /// Rules evaluated so far in this walk, and the most it may evaluate.
    steps: usize,
    limit: usize,
}

impl Chooser {
    fn new(prefix: Vec<bool>, limit: usize) -> Self {
        Self {
            prefix,
            log: Vec::new(),
            steps: 0,
            limit,
        }
    }

    /// Counts one rule evaluation; false once the walk has used its budget.
    fn step(&mut self) -> bool {
        self.steps += 1;
        self.steps <= self.limit
    }

    fn exceeded(&self) -> bool {
        self.steps > self.limit
    }

    fn exceeded_why(&self) -> String {
        format!("rule walk exceeded {} steps (loop?)", self.limit)
    }

    /// Ends a table walk that ran out of steps: the stage keeps the first rules it matched
    /// (a loop repeats the same few thousands of times) and says how many there were.
    fn out_of_steps(&self, stage: &mut Stage) -> TableResult {
        let total = stage.rules.len();
        let mut why = self.exceeded_why();
        if total > LISTED_ON_LOOP {
            stage.rules.truncate(LISTED_ON_LOOP);
            why.push_str(&format!(
                "; the first {LISTED_ON_LOOP} of the {total} rules it matched are listed"
            ));
        }
        TableResult::Undecidable(why)
    }

    fn choose(&mut self, p_true: f64) -> bool {
        let c = match self.prefix.get(self.log.len()) {
            Some(&c) => c,
            None => p_true > 0.0,
        };
        self.log.push((p_true, c));
        c
    }
}

/// How a hook left the walk ([`Simulator::run_hook_with_ipvs`]).
enum Hooked {
    Go,
    Stop,
    /// IPVS sent the packet: OUTPUT and POSTROUTING have run.
    SentByIpvs,
}

enum TableResult {
    Verdict(Verdict),
    Undecidable(String),
}

impl<'a> Simulator<'a> {
    pub fn new(v4: &'a SaveFile, v6: &'a SaveFile, ipsets: &'a Ipsets, routes: &'a Routes) -> Self {
        Self::of(
            [Cow::Borrowed(v4), Cow::Borrowed(v6)],
            Cow::Borrowed(ipsets),
            Cow::Borrowed(routes),
        )
    }

    /// A simulator that owns its inputs, to keep for as long as they are current (the live
    /// tracer keeps one per ruleset generation).
    pub fn owned(v4: SaveFile, v6: SaveFile, ipsets: Ipsets, routes: Routes) -> Simulator<'static> {
        Simulator::of(
            [Cow::Owned(v4), Cow::Owned(v6)],
            Cow::Owned(ipsets),
            Cow::Owned(routes),
        )
    }

    fn of(files: [Cow<'a, SaveFile>; 2], ipsets: Cow<'a, Ipsets>, routes: Cow<'a, Routes>) -> Self {
        Self {
            step_limit: step_limit(&files[0], &files[1], None),
            tables: [prepare(&files[0], false), prepare(&files[1], true)],
            files,
            ipsets,
            routes,
            iface_addrs: HashMap::new(),
            nft: None,
            nft_skip_iptables: [false; 2],
            ipt_handles: HashMap::new(),
            bridges: Bridges::default(),
            ipvs: IpvsTable::default(),
        }
    }

    /// Adds native nftables from `nft -j list ruleset`. iptables-nft tables in it are simulated
    /// from iptables-save when that was given for the family (their rules then carry the nft
    /// handle); otherwise from the nft dump, where `xt` extensions are undecidable.
    pub fn with_nft(mut self, rs: &NftRuleset) -> Self {
        let prog = compile_nft(rs);
        for fam in 0..2 {
            self.nft_skip_iptables[fam] = !self.files[fam].tables.is_empty();
        }
        for t in rs.tables.iter().filter(|t| t.is_iptables()) {
            let fam = usize::from(t.id.family == "ip6");
            if !self.nft_skip_iptables[fam] {
                continue;
            }
            for c in &t.chains {
                for (i, r) in c.rules.iter().enumerate() {
                    self.ipt_handles
                        .insert((fam, t.id.name.clone(), c.name.clone(), i + 1), r.handle);
                }
            }
        }
        self.nft = Some(prog);
        self.step_limit = step_limit(&self.files[0], &self.files[1], Some(rs));
        self
    }

    /// The most rules one walk evaluates before it answers undecidable (a loop guard).
    pub fn step_limit(&self) -> usize {
        self.step_limit
    }

    /// The compiled native ruleset, if any.
    pub fn nft_program(&self) -> Option<&Program> {
        self.nft.as_ref()
    }

    /// Every outcome for `spec`, most likely first; a single branch when nothing is random.
    pub fn simulate(&self, spec: &PacketSpec) -> Vec<Branch> {
        self.simulate_connection(spec, &StoredNat::default())
    }

    /// [`Self::simulate`] for a packet of a known connection (state not new) whose
    /// translation conntrack stored: applied where the nat chains would run.
    pub fn simulate_connection(&self, spec: &PacketSpec, stored: &StoredNat) -> Vec<Branch> {
        self.every_outcome(|ch| self.walk(spec, stored, ch).finish())
    }

    /// Every outcome of one stage of an observed traversal: the chains that run between
    /// two probes (`input.window`), from the packet as the first probe saw it. One branch
    /// per random outcome (`statistic`, `numgen`), each with its probability.
    pub fn simulate_stage(&self, input: &StageInput) -> Vec<Branch> {
        self.every_outcome(|ch| {
            let mut pkt = Pkt::new(&input.packet, input.dnat_done, input.snat_done);
            pkt.nf_bridge = match &input.ports {
                SeenPorts::Port { physin, physout } => Some(NfBridge {
                    physin: Some(physin.clone()),
                    physout: physout.clone(),
                }),
                SeenPorts::FloodedCopy { physout } => Some(NfBridge {
                    physin: None,
                    physout: physout.clone(),
                }),
                SeenPorts::Unknown | SeenPorts::NoBridge => None,
            };
            pkt.bridged = matches!(
                &input.ports,
                SeenPorts::Port {
                    physout: PhysOut::Port(_) | PhysOut::Unknown(_),
                    ..
                } | SeenPorts::FloodedCopy {
                    physout: PhysOut::Port(_) | PhysOut::Unknown(_),
                }
            );
            pkt.nf_bridge_known = input.ports != SeenPorts::Unknown;
            pkt.nf_bridge_observed = input.ports != SeenPorts::Unknown;
            let mut b = Walk::new(input.packet.out_iface.clone());
            let fam = usize::from(pkt.v6);
            self.run_hook(fam, input.hook, &mut pkt, &mut b, ch, Some(input.window));
            b.finish()
        })
    }

    /// Runs `walk` once per combination of random choices, most likely first.
    fn every_outcome(&self, walk: impl Fn(&mut Chooser) -> Branch) -> Vec<Branch> {
        let mut out = Vec::new();
        let mut todo: Vec<Vec<bool>> = vec![Vec::new()];
        while let Some(prefix) = todo.pop() {
            if out.len() >= MAX_BRANCHES {
                if let Some(b) = out.first_mut() {
                    let b: &mut Branch = b;
                    b.notes.push(format!(
                        "more than {MAX_BRANCHES} random outcomes; the rest are not listed"
                    ));
                }
                break;
            }
            let plen = prefix.len();
            let mut ch = Chooser::new(prefix, self.step_limit);
            let mut branch = walk(&mut ch);
            if ch.exceeded() {
                // The other draws of a looping walk loop too: list no more outcomes, so a
                // loop costs one walk's budget, not one per random outcome.
                if !ch.log.is_empty() || !todo.is_empty() {
                    branch.notes.push(format!(
                        "{}: no further random outcome is listed",
                        ch.exceeded_why()
                    ));
                }
                branch.probability = ch
                    .log
                    .iter()
                    .map(|&(p, c)| if c { p } else { 1.0 - p })
                    .product();
                out.push(branch);
                break;
            }
            branch.probability = ch
                .log
                .iter()
                .map(|&(p, c)| if c { p } else { 1.0 - p })
                .product();
            for i in (plen..ch.log.len()).rev() {
                let (p, c) = ch.log[i];
                let alt = if c { 1.0 - p } else { p };
                if alt > 0.0 {
                    let mut np: Vec<bool> = ch.log[..i].iter().map(|&(_, c)| c).collect();
                    np.push(!c);
                    todo.push(np);
                }
            }
            out.push(branch);
            // Outcomes deeper in the stack than the branch budget are never walked: keep the
            // stack (and its prefixes) no larger than what is left, plus one to say so.
            let room = MAX_BRANCHES.saturating_sub(out.len()) + 1;
            if todo.len() > room {
                todo.drain(..todo.len() - room);
            }
        }
        out
    }

    fn walk(&self, spec: &PacketSpec, stored: &StoredNat, ch: &mut Chooser) -> Walk {
        let fam = usize::from(spec.is_v6());
        let mut pkt = Pkt::new(spec, false, false);
        if spec.ct_state != CtState::New {
            pkt.stored = stored.clone();
            // IPVS does not mark its connections DNAT in conntrack: it translates each
            // packet itself, at its hook.
            if self
                .ipvs
                .lookup(spec.proto, spec.dst, spec.dport, spec.mark)
                .is_some()
            {
                pkt.ipvs_stored = pkt.stored.dst.take();
            }
        }
        // Unless the spec says otherwise, a new connection's ct mark is 0.
        pkt.ct_mark = spec
            .ct_mark
            .or((spec.ct_state == CtState::New).then_some(0));
        let mut b = Walk::new(None);
        if let Some(dev) = &spec.in_iface
            && let Some(why) = Routes::ipv6_receive_drop(spec.src, spec.dst, dev)
        {
            b.route = Some(Route::Unroutable);
            b.verdict = Verdict::Drop;
            b.notes.push(why);
            return b;
        }
        if let Some(port) = spec.in_iface.as_deref()
            && let Some(bridge) = self.bridges.bridge_of(port)
        {
            let (port, bridge) = (port.to_string(), bridge.to_string());
            return self.walk_bridged(spec, pkt, b, ch, &port, &bridge);
        }
        let hooks: Vec<Hook> = if spec.in_iface.is_some() {
            vec![Hook::PreRouting]
        } else {
            // Locally generated: the route is chosen before OUTPUT.
            match self.route(spec, &mut pkt, &mut b) {
                Some(false) => vec![Hook::LocalOut],
                Some(true) => {
                    b.notes
                        .push("destination is local: the packet loops back through lo".into());
                    vec![Hook::LocalOut]
                }
                None => return b,
            }
        };
        for hook in hooks {
            match self.run_hook_with_ipvs(fam, hook, &mut pkt, &mut b, ch) {
                Hooked::Go => {}
                Hooked::Stop => return b,
                Hooked::SentByIpvs => {
                    self.leave_by_bridge(&mut pkt, &mut b, ch);
                    return b;
                }
            }
        }
        let next = if spec.in_iface.is_some() {
            match self.route(spec, &mut pkt, &mut b) {
                Some(true) => vec![Hook::LocalIn],
                Some(false) => vec![Hook::Forward, Hook::PostRouting],
                None => return b,
            }
        } else {
            if pkt.dnat_done && spec.out_iface.is_none() {
                // nat OUTPUT changed the destination: the kernel routes again.
                if self.route(spec, &mut pkt, &mut b).is_none() {
                    return b;
                }
            }
            vec![Hook::PostRouting]
        };
        for hook in next {
            match self.run_hook_with_ipvs(fam, hook, &mut pkt, &mut b, ch) {
                Hooked::Go => {}
                Hooked::Stop => return b,
                Hooked::SentByIpvs => break,
            }
        }
        self.leave_by_bridge(&mut pkt, &mut b, ch);
        b
    }

    /// [`Self::run_hook`] with IPVS's step where `ip_vs_in_hook` runs (LOCAL_IN 99,
    /// LOCAL_OUT -98), when the node has virtual services: the chains before it, IPVS, then
    /// the chains after it; or, for a packet IPVS sends, OUTPUT again and POSTROUTING.
    fn run_hook_with_ipvs(
        &self,
        fam: usize,
        hook: Hook,
        pkt: &mut Pkt,
        b: &mut Walk,
        ch: &mut Chooser,
    ) -> Hooked {
        let go = |ok: bool| if ok { Hooked::Go } else { Hooked::Stop };
        let at = match hook {
            _ if self.ipvs.is_empty() => None,
            Hook::LocalIn => Some(ipvs::IPVS_IN_LOCAL_IN),
            Hook::LocalOut => Some(ipvs::IPVS_IN_LOCAL_OUT),
            _ => None,
        };
        let Some(at) = at else {
            return go(self.run_hook(fam, hook, pkt, b, ch, None));
        };
        // Chains at IPVS's own priority are taken to run before it.
        if !self.run_hook(fam, hook, pkt, b, ch, Some((i32::MIN, at + 1))) {
            return Hooked::Stop;
        }
        match self.ipvs_in(hook, pkt, b, ch) {
            ipvs::After::Continue => go(self.run_hook(fam, hook, pkt, b, ch, Some((at, i32::MAX)))),
            ipvs::After::Stop => Hooked::Stop,
            ipvs::After::Sent => {
                for h in [Hook::LocalOut, Hook::PostRouting] {
                    if !self.run_hook(fam, h, pkt, b, ch, None) {
                        return Hooked::Stop;
                    }
                }
                Hooked::SentByIpvs
            }
        }
    }

    /// Routing decision: Some(true) for local delivery, Some(false) for out, None when the walk
    /// ends here (unroutable or undecidable).
    fn route(&self, spec: &PacketSpec, pkt: &mut Pkt, b: &mut Walk) -> Option<bool> {
        let local = if spec.local {
            true
        } else if let Some(out) = &spec.out_iface {
            pkt.out_iface = Some(out.clone());
            false
        } else if self.routes.is_empty() {
            b.route = Some(Route::Unknown);
            b.verdict = Verdict::Undecidable;
            b.notes
                .push("no routes given and no `out IFACE`: cannot tell INPUT from FORWARD".into());
            return None;
        } else {
            let decision = if spec.in_iface.is_some() {
                let in_dev = spec.in_iface.as_deref().unwrap_or_default();
                self.routes.input(pkt.src, pkt.dst, pkt.proto, in_dev)
            } else {
                self.routes.lookup(pkt.dst)
            };
            match decision {
                RouteDecision::Local { .. } => true,
                // The walk goes on to INPUT; the condition is said with it.
                RouteDecision::LocalIf { condition } => {
                    b.notes.push(condition);
                    true
                }
                RouteDecision::Out { dev, .. } => {
                    if !self.routes.has_local_table(pkt.v6) {
                        // Not a guess made silently: a node address would be taken as remote.
                        b.notes.push(Routes::missing_local_table(pkt.v6));
                    }
                    pkt.out_iface = Some(dev);
                    false
                }
                RouteDecision::Unroutable(why) => {
                    b.route = Some(Route::Unroutable);
                    b.verdict = Verdict::Drop;
                    b.notes.push(format!("routing drops the packet: {why}"));
                    return None;
                }
                RouteDecision::Unknown(why) => {
                    b.route = Some(Route::Unknown);
                    b.verdict = Verdict::Undecidable;
                    b.notes.push(why);
                    return None;
                }
            }
        };
        if local && spec.in_iface.is_some() {
            pkt.out_iface = None;
            b.route = Some(Route::Input);
        } else if spec.in_iface.is_some() {
            b.route = Some(Route::Forward);
        } else if local {
            // The node talking to itself leaves through loopback.
            pkt.out_iface = Some("lo".into());
            b.route = Some(Route::Output);
        } else {
            b.route = Some(Route::Output);
        }
        b.egress = pkt.out_iface.clone();
        Some(local)
    }

    /// Runs every table of `hook`, iptables tables and native nft base chains merged by the
    /// priority the kernel runs them at; false when the packet stopped (drop, reject,
    /// undecidable).
    fn run_hook(
        &self,
        fam: usize,
        hook: Hook,
        pkt: &mut Pkt,
        b: &mut Walk,
        ch: &mut Chooser,
        window: Option<(i32, i32)>,
    ) -> bool {
        enum Entry {
            Ipt {
                ti: usize,
                base: usize,
                name: &'static str,
            },
            Nft(Scheduled),
        }
        // (runs at, own priority, reversed creation order, entry); x_tables tables that are not
        // in the nft dump count as the oldest.
        type Key = (i32, i32, std::cmp::Reverse<(u64, u64)>);
        let mut entries: Vec<(Key, Entry)> = Vec::new();
        for &(tname, priority) in hook.tables() {
            let Some(ti) = self.files[fam].tables.iter().position(|t| t.name == tname) else {
                continue;
            };
            // A table without this built-in chain is not registered on the hook.
            let Some(&base) = self.tables[fam][ti].index.get(hook.name()) else {
                continue;
            };
            let at = if tname == "nat" {
                nat_core_priority(hook)
            } else {
                priority
            };
            let created = self
                .nft
                .as_ref()
                .and_then(|p| p.created(fam == 1, tname, hook.name()))
                .unwrap_or((0, 0));
            entries.push((
                (at, priority, std::cmp::Reverse(created)),
                Entry::Ipt {
                    ti,
                    base,
                    name: tname,
                },
            ));
        }
        if let Some(p) = &self.nft {
            for s in p.hook_chains(fam == 1, hook, self.nft_skip_iptables[fam]) {
                entries.push((
                    (s.at, s.priority, std::cmp::Reverse(s.created)),
                    Entry::Nft(s),
                ));
            }
        }
        // Only the chains between two probes, when simulating one observed stage.
        if let Some((lo, hi)) = window {
            entries.retain(|((at, _, _), _)| lo < *at && *at < hi);
        }
        // At equal priority the chain registered last runs first (nf_hook_entries_grow).
        entries.sort_by_key(|e| e.0);
        // The nat core stops calling nat chains once one of them translated (nf_nat_inet_fn).
        let mut nat_done = false;
        for ((at, priority, _), entry) in entries {
            let (table, nft_chain, is_nat) = match &entry {
                Entry::Ipt { name, .. } => (name.to_string(), None, *name == "nat"),
                Entry::Nft(s) => {
                    let p = self.nft.as_ref().expect("scheduled from the program");
                    let t = &p.tables[s.table];
                    let c = &t.chains[s.chain];
                    (
                        t.id.name.clone(),
                        Some((t.id.family.clone(), c.name.clone())),
                        c.base.as_ref().is_some_and(|b| b.nat),
                    )
                }
            };
            let mut stage = Stage::open(hook, table, priority, pkt, nft_chain);
            // Conntrack runs at -200 on PREROUTING and OUTPUT: earlier chains see no entry.
            pkt.ct_attached = !(matches!(hook, Hook::PreRouting | Hook::LocalOut) && at <= -200);
            if is_nat && pkt.state != CtState::New {
                stage.note = Some(match pkt.state {
                    CtState::Untracked => "untracked packet: nat is not applied".into(),
                    s => format!(
                        "{} packet: nat chains are not walked; conntrack applies the translation stored for the connection",
                        s.name()
                    ),
                });
                if pkt.state != CtState::Untracked && pkt.apply_stored(hook) {
                    stage.after = pkt.snapshot();
                    b.ct_nat.push(b.stages.len());
                }
                stage.ct = pkt.ct_view();
                b.stages.push(stage.into_model());
                continue;
            }
            if is_nat && hook == Hook::LocalOut && pkt.dst_nat_bound {
                stage.note = Some(
                    "IPVS's packet: the nat core bound its destination before IPVS, so the nat OUTPUT chains are not walked"
                        .into(),
                );
                stage.ct = pkt.ct_view();
                b.stages.push(stage.into_model());
                continue;
            }
            if is_nat && nat_done {
                stage.note = Some(
                    "an earlier nat chain on this hook translated: the nat core skips this one"
                        .into(),
                );
                stage.ct = pkt.ct_view();
                b.stages.push(stage.into_model());
                continue;
            }
            let res = match entry {
                Entry::Ipt { ti, base, .. } => {
                    self.run_table(fam, ti, base, hook, pkt, &mut stage, ch)
                }
                Entry::Nft(s) => self.run_nft_chain(s, hook, pkt, &mut stage, ch),
            };
            nat_done |= is_nat && stage.nat.is_some();
            let verdict = stage.close(res, pkt);
            b.stages.push(stage.into_model());
            b.notes.append(&mut pkt.assumed);
            if verdict != Verdict::Accept {
                b.verdict = verdict;
                return false;
            }
        }
        true
    }

    #[expect(
        clippy::too_many_arguments,
        reason = "the walk state is threaded explicitly, not hidden in a struct"
    )]
    fn run_table(
        &self,
        fam: usize,
        ti: usize,
        base: usize,
        hook: Hook,
        pkt: &mut Pkt,
        stage: &mut Stage,
        ch: &mut Chooser,
    ) -> TableResult {
        let table = &self.files[fam].tables[ti];
        let pt = &self.tables[fam][ti];
        let base_chain = &table.chains[base];
        let policy = || match base_chain.policy.as_deref() {
            Some("DROP") => Verdict::Drop,
            _ => Verdict::Accept,
        };
        let mut frames = Frames::new(base);
        loop {
            let Some((ci, ri)) = frames.next(|ci| table.chains[ci].rules.len()) else {
                stage.policy = Some(base_chain.policy.clone().unwrap_or_else(|| "ACCEPT".into()));
                return TableResult::Verdict(policy());
            };
            if !ch.step() {
                return ch.out_of_steps(stage);
            }
            let chain = &table.chains[ci];
            let rule = &chain.rules[ri];
            let comp = &pt.compiled[ci][ri];
            let tri = self.eval(&comp.conds, hook, pkt, ch);
            // What the matches left behind: `recent --set` lists, assumptions (named by rule).
            let fx = pkt.fx.take();
            pkt.recent_set.extend(fx.recent_set);
            pkt.assumed.extend(
                fx.assumed
                    .into_iter()
                    .map(|a| format!("assumed at {} {}#{}: {a}", table.name, chain.name, ri + 1)),
            );
            match tri {
                Tri::No => continue,
                Tri::Unknown(why) => {
                    let mut m = matched(table.name.as_str(), rule, ri, "undecidable".into());
                    m.undecidable = Some(why.clone());
                    stage.rules.push(m);
                    return TableResult::Undecidable(format!(
                        "{} rule {}: {why}",
                        chain.name,
                        ri + 1
                    ));
                }
                Tri::Yes => {}
            }
            let mark_before = pkt.mark;
            let (desc, next) = self.apply(&comp.action, hook, pkt, stage);
            let mut m = matched(table.name.as_str(), rule, ri, desc);
            m.nft = self
                .ipt_handles
                .get(&(fam, table.name.clone(), rule.chain.clone(), ri + 1))
                .map(|&handle| NftRuleRef {
                    family: if fam == 1 { "ip6" } else { "ip" }.into(),
                    handle,
                    native: false,
                });
            if matches!(
                comp.action,
                Action::Mark { .. } | Action::ConnMarkRestore { .. }
            ) {
                m.mark = Some((mark_before, pkt.mark));
            }
            stage.rules.push(m);
            match next {
                Flow::Continue => {}
                Flow::Stop(v) => return TableResult::Verdict(v),
                Flow::Return => frames.ret(),
                Flow::Jump(name, goto) => {
                    let Some(&target) = pt.index.get(name) else {
                        return TableResult::Undecidable(format!("jump to missing chain {name}"));
                    };
                    if goto {
                        frames.goto(target);
                    } else if let Err(why) = frames.jump(target) {
                        return TableResult::Undecidable(why);
                    }
                }
                Flow::Unknown(why) => {
                    if let Some(m) = stage.rules.last_mut() {
                        m.undecidable = Some(why.clone());
                    }
                    return TableResult::Undecidable(why);
                }
            }
        }
    }

    fn apply<'c>(
        &self,
        action: &'c Action,
        hook: Hook,
        pkt: &mut Pkt,
        stage: &mut Stage,
    ) -> (String, Flow<'c>) {
        match action {
            Action::None => ("count only".into(), Flow::Continue),
            Action::Accept => ("accept".into(), Flow::Stop(Verdict::Accept)),
            Action::Drop => ("drop".into(), Flow::Stop(Verdict::Drop)),
            Action::Reject => ("reject".into(), Flow::Stop(Verdict::Reject)),
            Action::Return => ("return".into(), Flow::Return),
            Action::Jump(c) => (format!("jump {c}"), Flow::Jump(c, false)),
            Action::Goto(c) => (format!("goto {c}"), Flow::Jump(c, true)),
            Action::Mark { value, mask } => {
                let old = pkt.mark;
                pkt.mark = (pkt.mark & !mask) ^ value;
                (format!("mark {old:#x} -> {:#x}", pkt.mark), Flow::Continue)
            }
            Action::ConnMarkSet { .. }
            | Action::ConnMarkSave { .. }
            | Action::ConnMarkRestore { .. }
                if !pkt.has_ct() =>
            {
                ("no conntrack entry: no effect".into(), Flow::Continue)
            }
            Action::ConnMarkSet { value, mask } => match pkt.ct_mark {
                Some(old) => {
                    let new = (old & !mask) ^ value;
                    pkt.ct_mark = Some(new);
                    (format!("ctmark {old:#x} -> {new:#x}"), Flow::Continue)
                }
                None => (
                    "ctmark unknown".into(),
                    Flow::Unknown(
                        "CONNMARK on a connection whose mark was not given (add `ctmark`)".into(),
                    ),
                ),
            },
            Action::ConnMarkSave { nfmask, ctmask } => match pkt.ct_mark {
                Some(old) => {
                    let new = (old & !ctmask) ^ (pkt.mark & nfmask);
                    pkt.ct_mark = Some(new);
                    (format!("ctmark {old:#x} -> {new:#x}"), Flow::Continue)
                }
                None => (
                    "ctmark unknown".into(),
                    Flow::Unknown("CONNMARK --save-mark with unknown ctmark (add `ctmark`)".into()),
                ),
            },
            Action::ConnMarkRestore { nfmask, ctmask } => match pkt.ct_mark {
                Some(ct) => {
                    let old = pkt.mark;
                    pkt.mark = (pkt.mark & !nfmask) ^ (ct & ctmask);
                    (
                        format!("mark {old:#x} -> {:#x} (restored)", pkt.mark),
                        Flow::Continue,
                    )
                }
                None => (
                    "mark unknown".into(),
                    Flow::Unknown(
                        "CONNMARK --restore-mark with unknown ctmark (add `ctmark`)".into(),
                    ),
                ),
            },
            Action::NoTrack => {
                pkt.state = CtState::Untracked;
                pkt.ct_mark = None;
                ("notrack".into(), Flow::Continue)
            }
            Action::Dnat { addr, port, text } => {
                let old = (pkt.dst, pkt.dport);
                if let Some(a) = addr {
                    pkt.dst = *a;
                    pkt.dst_label = None;
                }
                if port.is_some() && pkt.dport.is_some() {
                    pkt.dport = *port;
                }
                // The kernel marks the connection DNAT (and reroutes) only when the tuple changed.
                pkt.dnat_done |= old != (pkt.dst, pkt.dport);
                stage.nat = Some(NatKind::Dnat);
                (format!("DNAT {text}"), Flow::Stop(Verdict::Accept))
            }
            Action::Snat { addr, port, text } => {
                if let Some(a) = addr {
                    pkt.src = *a;
                    pkt.src_label = None;
                }
                if port.is_some() && pkt.sport.is_some() {
                    pkt.sport = *port;
                }
                pkt.snat_done = true;
                stage.nat = Some(NatKind::Snat);
                (format!("SNAT {text}"), Flow::Stop(Verdict::Accept))
            }
            Action::Masquerade { port } => {
                let dev = pkt.out_iface.clone().unwrap_or_default();
                match self.iface_addr(&dev, pkt.v6, true, pkt.dst) {
                    Some(a) => {
                        pkt.src = a;
                        pkt.src_label = None;
                    }
                    None => pkt.src_label = Some(dev),
                }
                if port.is_some() && pkt.sport.is_some() {
                    pkt.sport = *port;
                }
                pkt.snat_done = true;
                let to = pkt.snapshot().src;
                stage.nat = Some(NatKind::Snat);
                (format!("MASQUERADE {to}"), Flow::Stop(Verdict::Accept))
            }
            Action::Redirect { port } => {
                let old = (pkt.dst, pkt.dport);
                let a = if hook == Hook::LocalOut {
                    Some(if pkt.v6 {
                        "::1".parse().expect("valid")
                    } else {
                        "127.0.0.1".parse().expect("valid")
                    })
                } else {
                    let dev = pkt.in_iface.clone().unwrap_or_default();
                    self.iface_addr(&dev, pkt.v6, false, pkt.dst)
                };
                match a {
                    Some(a) => {
                        pkt.dst = a;
                        pkt.dst_label = None;
                    }
                    None => {
                        pkt.dst_label = Some(pkt.in_iface.clone().unwrap_or_else(|| "?".into()))
                    }
                }
                if port.is_some() && pkt.dport.is_some() {
                    pkt.dport = *port;
                }
                pkt.dnat_done |= old != (pkt.dst, pkt.dport) || pkt.dst_label.is_some();
                let to = pkt.snapshot().dst;
                stage.nat = Some(NatKind::Dnat);
                (format!("REDIRECT {to}"), Flow::Stop(Verdict::Accept))
            }
            Action::Continue(what) => (what.to_ascii_lowercase(), Flow::Continue),
            Action::Unknown(t) => (
                t.clone(),
                Flow::Unknown(format!("target not modelled: {t}")),
            ),
        }
    }

    fn iface_addr(&self, dev: &str, v6: bool, masq: bool, dst: IpAddr) -> Option<IpAddr> {
        if masq && let IpAddr::V6(d) = dst {
            return self.masquerade_source6(dev, d).map(IpAddr::V6);
        }
        if let Some(a) = self
            .iface_addrs
            .get(dev)
            .and_then(|v| v.iter().find(|a| a.is_ipv6() == v6))
        {
            return Some(*a);
        }
        if masq
            && let RouteDecision::Out {
                dev: d,
                prefsrc: Some(p),
                ..
            } = self.routes.lookup(dst)
            && d == dev
        {
            return Some(p);
        }
        self.routes
            .routes
            .iter()
            .find(|r| {
                r.table == "local"
                    && r.kind == "local"
                    && r.dev.as_deref() == Some(dev)
                    && r.dst.addr.is_ipv6() == v6
            })
            .map(|r| r.dst.addr)
    }

    /// The source IPv6 MASQUERADE picks: `ipv6_dev_get_saddr` over the node's addresses
    /// (those given per interface and the local table's), ranked as RFC 6724 section 5 does:
    /// appropriate scope first (a global address of another interface beats the outgoing
    /// interface's link-local towards a global destination), then the outgoing interface,
    /// matching label, longest common prefix. For a link-local or multicast destination only
    /// the outgoing interface's addresses are candidates.
    fn masquerade_source6(&self, dev: &str, dst: std::net::Ipv6Addr) -> Option<std::net::Ipv6Addr> {
        use crate::net::{v6_label, v6_scope};
        let mut cands: Vec<(&str, std::net::Ipv6Addr)> = Vec::new();
        for (d, addrs) in &self.iface_addrs {
            for a in addrs {
                if let IpAddr::V6(a) = a {
                    cands.push((d.as_str(), *a));
                }
            }
        }
        for r in &self.routes.routes {
            if let (IpAddr::V6(a), "local", "local", 128, Some(d)) = (
                r.dst.addr,
                r.table.as_str(),
                r.kind.as_str(),
                r.dst.len,
                r.dev.as_deref(),
            ) {
                cands.push((d, a));
            }
        }
        let dst_scope = v6_scope(dst);
        let own_link_only = dst.is_multicast() || dst_scope <= 2;
        cands.retain(|(d, a)| {
            !a.is_multicast() && !a.is_unspecified() && (!own_link_only || *d == dev)
        });
        let common = |a: std::net::Ipv6Addr| (u128::from(a) ^ u128::from(dst)).leading_zeros();
        // Rule 2 as a sort key: adequate scopes (>= the destination's) first, smallest of
        // them; then inadequate ones, largest first.
        let scope_rank = |a: std::net::Ipv6Addr| {
            let s = v6_scope(a);
            if s >= dst_scope {
                (0, s)
            } else {
                (1, u8::MAX - s)
            }
        };
        cands
            .iter()
            .min_by_key(|(d, a)| {
                (
                    *a != dst, // rule 1: the same address
                    scope_rank(*a),
                    *d != dev,                     // rule 5: the outgoing interface
                    v6_label(*a) != v6_label(dst), // rule 6: matching label
                    std::cmp::Reverse(common(*a)), // rule 8: longest matching prefix
                )
            })
            .map(|(_, a)| *a)
    }

    fn eval(&self, conds: &[Cond], hook: Hook, pkt: &Pkt, ch: &mut Chooser) -> Tri {
        // ip_output() hands the hook skb->dev as the input device, so a forwarded packet still
        // has its input interface at POSTROUTING (reachable from user chains).
        let in_if = match hook {
            Hook::LocalOut => None,
            Hook::PostRouting if pkt.bridged => None,
            _ => pkt.in_iface.as_deref(),
        };
        let out_if = match hook {
            Hook::Forward | Hook::LocalOut | Hook::PostRouting => pkt.out_iface.as_deref(),
            _ => None,
        };
        let mut unknown: Option<String> = None;
        // Statistic draws come last: the kernel evaluates matches in order and stops at the
        // first failure, so a random draw only happens when everything before it matched.
        for c in conds {
            let r = match c {
                Cond::Src(n, neg) => tri(n.contains(pkt.src) && pkt.src_label.is_none(), *neg),
                Cond::Dst(n, neg) => tri(n.contains(pkt.dst) && pkt.dst_label.is_none(), *neg),
                Cond::Proto(p, neg) => tri(p.is_none_or(|p| p == pkt.proto), *neg),
                Cond::InIface(p, neg) => tri(iface_match(p, in_if), *neg),
                Cond::OutIface(p, neg) => tri(iface_match(p, out_if), *neg),
                Cond::Fragment(neg) => tri(false, *neg),
                Cond::Mark { value, mask, neg } => tri(pkt.mark & mask == *value, *neg),
                // Without a conntrack entry xt_connmark answers false, even when negated.
                Cond::ConnMark { .. } if !pkt.has_ct() => Tri::No,
                Cond::ConnMark { value, mask, neg } => match pkt.ct_mark {
                    Some(m) => tri(m & mask == *value, *neg),
                    None => Tri::Unknown(
                        "connmark match, but the connection's mark is unknown (add `ctmark`)"
                            .into(),
                    ),
                },
                Cond::CtState { states, neg } => {
                    let mut s = pkt.ct_state_bit();
                    if pkt.dnat_done {
                        s |= CT_DNAT;
                    }
                    tri(s & states != 0, *neg)
                }
                Cond::Set { name, dirs, neg } => {
                    let l = Lookup {
                        src: pkt.src,
                        dst: pkt.dst,
                        proto: pkt.proto,
                        sport: pkt.sport,
                        dport: pkt.dport,
                        in_iface: in_if,
                        out_iface: out_if,
                    };
                    match self.ipsets.contains(name, dirs, &l) {
                        Some(b) => tri(b, *neg),
                        None => Tri::Unknown(format!("contents of ipset {name} not known")),
                    }
                }
                Cond::AddrType {
                    src,
                    types,
                    neg,
                    limit_in,
                    limit_out,
                } => {
                    let dev = if *limit_in {
                        in_if
                    } else if *limit_out {
                        out_if
                    } else {
                        None
                    };
                    let addr = if *src { pkt.src } else { pkt.dst };
                    let answer = if addr.is_ipv6() {
                        self.routes.addr_type6_matches(addr, dev, types)
                    } else {
                        self.routes
                            .addr_type(addr, dev)
                            .map(|t| t.map(|t| types.iter().any(|x| x == t)))
                    };
                    match answer {
                        Some(Ok(hit)) => tri(hit, *neg),
                        Some(Err(why)) => Tri::Unknown(why),
                        None => Tri::Unknown(
                            "addrtype needs routes (`ip -j route show table all`)".into(),
                        ),
                    }
                }
                Cond::Ports { which, ranges, neg } => {
                    let inr = |p: Option<u16>| {
                        p.is_some_and(|p| ranges.iter().any(|&(a, b)| a <= p && p <= b))
                    };
                    let hit = match which {
                        0 => inr(pkt.sport),
                        1 => inr(pkt.dport),
                        _ => inr(pkt.sport) || inr(pkt.dport),
                    };
                    tri(hit, *neg)
                }
                Cond::TcpFlags { mask, comp, neg } => {
                    tri(pkt.proto == 6 && pkt.tcp_flags & mask == *comp, *neg)
                }
                Cond::IcmpType { ty, codes, neg, .. } => {
                    let (t, code) = pkt.icmp;
                    tri(
                        ty.is_none_or(|x| x == t) && codes.0 <= code && code <= codes.1,
                        *neg,
                    )
                }
                Cond::Range { src, from, to, neg } => {
                    let a = if *src { pkt.src } else { pkt.dst };
                    let inside = match (a, from, to) {
                        (IpAddr::V4(a), IpAddr::V4(f), IpAddr::V4(t)) => *f <= a && a <= *t,
                        (IpAddr::V6(a), IpAddr::V6(f), IpAddr::V6(t)) => *f <= a && a <= *t,
                        _ => false,
                    };
                    tri(inside, *neg)
                }
                Cond::RpFilter {
                    loose,
                    accept_local,
                    invert,
                } => {
                    if self.routes.is_empty() {
                        Tri::Unknown("rpfilter needs routes (`ip -j route show table all`)".into())
                    } else {
                        // xt_rpfilter routes the source back: valid when that route leaves
                        // through the input interface (any interface with --loose).
                        let valid = match self.routes.lookup(pkt.src) {
                            RouteDecision::Out { dev, .. } => *loose || Some(dev.as_str()) == in_if,
                            RouteDecision::Local { .. } => *accept_local,
                            RouteDecision::LocalIf { .. }
                            | RouteDecision::Unroutable(_)
                            | RouteDecision::Unknown(_) => false,
                        };
                        tri(valid, *invert)
                    }
                }
                Cond::Physdev(p) => self.physdev(p, pkt),
                Cond::StatRandom { .. } | Cond::StatNth { .. } => continue,
                Cond::Always(_) => Tri::Yes,
                Cond::CtTuple {
                    field,
                    neg,
                    with_state,
                } => ct_tuple(pkt, field, *neg, *with_state),
                Cond::Recent {
                    cmd,
                    name,
                    rdest,
                    hitcount,
                    neg,
                } => recent(pkt, *cmd, name, *rdest, *hitcount, *neg),
                Cond::Assumed { answer, assumption } => {
                    pkt.fx.borrow_mut().assumed.push(assumption.clone());
                    tri(*answer, false)
                }
                Cond::NoHeader(_) => Tri::No,
                Cond::PktType(want, neg) => match pkt_type(&self.routes, pkt) {
                    Some((ty, assumption)) => {
                        if let Some(a) = assumption {
                            pkt.fx.borrow_mut().assumed.push(a);
                        }
                        let want = if want == "host" {
                            "unicast"
                        } else {
                            want.as_str()
                        };
                        tri(ty == want, *neg)
                    }
                    None => Tri::Unknown(
                        "pkttype of a locally sent multicast or broadcast packet".into(),
                    ),
                },
                Cond::Unknown(t) => Tri::Unknown(format!("match not modelled: {t}")),
            };
            match r {
                Tri::No => return Tri::No,
                Tri::Unknown(w) => {
                    unknown.get_or_insert(w);
                }
                Tri::Yes => {}
            }
        }
        if let Some(w) = unknown {
            return Tri::Unknown(w);
        }
        for c in conds {
            let hit = match c {
                Cond::StatRandom { p, neg } => ch.choose(if *neg { 1.0 - p } else { *p }),
                Cond::StatNth { every, neg } => {
                    let p = 1.0 / f64::from(*every);
                    ch.choose(if *neg { 1.0 - p } else { p })
                }
                _ => continue,
            };
            if !hit {
                return Tri::No;
            }
        }
        Tri::Yes
    }
}

enum Flow<'c> {
    Continue,
    Stop(Verdict),
    Return,
    Jump(&'c str, bool),
    Unknown(String),
}

fn matched(table: &str, rule: &Rule, ri: usize, action: String) -> MatchedRule {
    MatchedRule {
        table: table.to_string(),
        chain: rule.chain.clone(),
        index: ri + 1,
        text: rule.text(),
        action,
        undecidable: None,
        comments: rule.comments().into_iter().map(str::to_string).collect(),
        mark: None,
        nft: None,
    }
}
