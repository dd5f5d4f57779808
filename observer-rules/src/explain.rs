//! `observer explain`: turns dumps (or the live node) plus a packet description into an
//! [`Explanation`], and that into the model's predicted [`Traversal`] (JSON schema 3: the
//! live tracer's shape, printed by the same renderers).

use std::collections::HashMap;
use std::net::IpAddr;

use std::sync::Arc;

use observer_model::{
    self as model, ConntrackView, CtState, Endpoint, Fate, FateKind, Headers, Icmp, Iface,
    MarkDictionary, Packet, Protocol, Traversal, TupleView,
};
use serde_json::Value;
use thiserror::Error;

use crate::bridge::Bridges;
use crate::error::ParseError;
use crate::ipset::Ipsets;
pub use crate::live::Ruleset;
use crate::live::{LiveTexts, Text};
use crate::nft::NftRuleset;
use crate::packet::{PacketSpec, PacketSpecError, parse_packet_spec};
use crate::route::Routes;
pub use crate::sim::meaning::model_rule;
use crate::sim::{Branch, Simulator, StoredNat, Verdict, verdict_of};

/// Everything `explain` needs, as text, so the CLI only reads files or runs commands.
#[derive(Debug, Clone, Default)]
pub struct ExplainRequest {
    /// The node's texts, as `--live` reads them: `iptables-save [-c]` / `ip6tables-save [-c]`
    /// output, `nft -j list ruleset` (native tables are simulated with the iptables tables),
    /// `ipset save` (or `ipset list`; sets not given are unknown), one or more `ip -j route
    /// show table all` outputs, `ip -j addr show` (interface addresses for
    /// MASQUERADE/REDIRECT when routes do not name them), and the bridge ports, neighbours,
    /// fdb and br_netfilter's switches (a switch not given assumes the kernel's 1).
    pub texts: LiveTexts,
    /// e.g. `tcp 198.51.100.10:40000 -> 10.10.10.2:22 in eth0 [out IFACE] [mark 0x0] [state new]`.
    pub packet: String,
}

#[derive(Debug, Error)]
pub enum ExplainError {
    #[error("iptables-save input, {0}")]
    Iptables(ParseError),
    #[error("ip6tables-save input, {0}")]
    Ip6tables(ParseError),
    #[error("nft JSON input, {0}")]
    Nft(ParseError),
    #[error("ipset input, {0}")]
    Ipset(ParseError),
    #[error("route input, {0}")]
    Routes(ParseError),
    #[error("address input, {0}")]
    Addrs(ParseError),
    #[error("bridge/link input, {0}")]
    Bridges(ParseError),
    #[error("ipvsadm input (pass `ipvsadm -Sn` output), {0}")]
    Ipvs(ParseError),
    #[error("--sysctl, {0}")]
    Sysctls(ParseError),
    #[error(transparent)]
    Packet(#[from] PacketSpecError),
    #[error(
        "no ruleset for {0}: pass iptables-save (or ip6tables-save for IPv6) output, or use --live"
    )]
    NoRuleset(&'static str),
    #[error("--pick {pick}: the packet has {count} random outcome(s); pick 1 to {count}")]
    Pick { pick: usize, count: usize },
    #[error(
        "the {0} ruleset holds no tables (empty file, or only comments): nothing to explain. \
         Check the file; on a node using the other back end, dump with iptables-legacy-save \
         or iptables-nft-save"
    )]
    EmptyRuleset(&'static str),
}

/// The answer: one branch per random outcome (just one when nothing is random).
#[derive(Debug, Clone)]
pub struct Explanation {
    pub packet: PacketSpec,
    pub branches: Vec<Branch>,
    pub notes: Vec<String>,
}

impl ExplainError {
    /// The error of a text that did not parse.
    fn unparsed((text, e): (Text, ParseError)) -> Self {
        match text {
            Text::Iptables => ExplainError::Iptables(e),
            Text::Ip6tables => ExplainError::Ip6tables(e),
            Text::Nft => ExplainError::Nft(e),
            Text::Ipset => ExplainError::Ipset(e),
            Text::Routes => ExplainError::Routes(e),
            Text::Addrs => ExplainError::Addrs(e),
            Text::Bridge(_) => ExplainError::Bridges(e),
            Text::Ipvs => ExplainError::Ipvs(e),
            Text::Sysctls => ExplainError::Sysctls(e),
        }
    }
}

/// Parses every input of `req` and simulates its packet.
pub fn explain(req: &ExplainRequest) -> Result<Explanation, ExplainError> {
    let packet = parse_packet_spec(&req.packet)?;
    let t = &req.texts;
    let parsed = t.parse();
    // The first text that did not parse, if it comes no later than `upto` (the checks
    // below sit between the texts they need).
    let unparsed = |upto: Text| match parsed.unparsed.first() {
        Some(u) if u.0 <= upto => Err(ExplainError::unparsed(u.clone())),
        _ => Ok(()),
    };
    unparsed(Text::Ip6tables)?;
    let have = if packet.is_v6() {
        t.ip6tables.is_some()
    } else {
        t.iptables.is_some()
    };
    let fam = if packet.is_v6() { "IPv6" } else { "IPv4" };
    if !have && t.nft.is_none() {
        return Err(ExplainError::NoRuleset(fam));
    }
    unparsed(Text::Nft)?;
    let rs = &parsed.ruleset;
    // iptables-restore accepts an empty file, but a verdict from it would be "accept
    // everywhere" built on nothing: usually the wrong file or the other back end's save.
    let file = if packet.is_v6() { &rs.ipv6 } else { &rs.ipv4 };
    if have && file.tables.is_empty() && !nft_has_tables(rs.nft.as_ref(), packet.is_v6()) {
        return Err(ExplainError::EmptyRuleset(fam));
    }
    if let Some(u) = parsed.unparsed.first() {
        return Err(ExplainError::unparsed(u.clone()));
    }
    let mut sim = prepare(
        rs,
        &parsed.ipsets,
        &parsed.routes,
        &parsed.bridges,
        &parsed.iface_addrs,
    );
    sim.ipvs = parsed.ipvs.clone();
    Ok(explain_on(
        &sim,
        rs,
        &parsed.ipsets,
        &parsed.bridges,
        &packet,
    ))
}

/// Simulates `packet` against already-loaded inputs, without bridge facts.
pub fn explain_with(
    rs: &Ruleset,
    ipsets: &Ipsets,
    routes: &Routes,
    packet: &PacketSpec,
    iface_addrs: &HashMap<String, Vec<IpAddr>>,
) -> Explanation {
    explain_with_bridges(rs, ipsets, routes, &Bridges::default(), packet, iface_addrs)
}

/// Simulates `packet` against already-loaded inputs (the `--live` path); a packet entering
/// a port of one of `bridges` walks br_netfilter's path.
pub fn explain_with_bridges(
    rs: &Ruleset,
    ipsets: &Ipsets,
    routes: &Routes,
    bridges: &Bridges,
    packet: &PacketSpec,
    iface_addrs: &HashMap<String, Vec<IpAddr>>,
) -> Explanation {
    let sim = prepare(rs, ipsets, routes, bridges, iface_addrs);
    explain_on(&sim, rs, ipsets, bridges, packet)
}

/// A simulator of these inputs, rules compiled once: for many packets against one node
/// ([`explain_on`], `observer whatif`).
pub fn prepare<'a>(
    rs: &'a Ruleset,
    ipsets: &'a Ipsets,
    routes: &'a Routes,
    bridges: &Bridges,
    iface_addrs: &HashMap<String, Vec<IpAddr>>,
) -> Simulator<'a> {
    let mut sim = Simulator::new(&rs.ipv4, &rs.ipv6, ipsets, routes);
    if let Some(nft) = &rs.nft {
        sim = sim.with_nft(nft);
    }
    sim.iface_addrs = iface_addrs.clone();
    sim.bridges = bridges.clone();
    sim
}

/// [`explain_with_bridges`] on a simulator [`prepare`]d from the same inputs.
pub fn explain_on(
    sim: &Simulator<'_>,
    rs: &Ruleset,
    ipsets: &Ipsets,
    bridges: &Bridges,
    packet: &PacketSpec,
) -> Explanation {
    explain_connection(sim, rs, ipsets, bridges, packet, &StoredNat::default())
}

/// [`explain_on`] for a packet of a known connection whose translation conntrack stored
/// (`observer whatif`: a recorded packet of an established connection).
pub fn explain_connection(
    sim: &Simulator<'_>,
    rs: &Ruleset,
    ipsets: &Ipsets,
    bridges: &Bridges,
    packet: &PacketSpec,
    stored: &StoredNat,
) -> Explanation {
    Explanation {
        packet: packet.clone(),
        branches: sim.simulate_connection(packet, stored),
        notes: input_notes(rs, ipsets, bridges, packet.is_v6()),
    }
}

/// What the inputs leave out, said with every prediction for a packet of this family (an
/// empty ruleset, `physdev` without bridge ports, sets without `ipset save`): the same for
/// every packet, so a caller predicting many ([`prepare`]) says them once.
pub fn input_notes(rs: &Ruleset, ipsets: &Ipsets, bridges: &Bridges, v6: bool) -> Vec<String> {
    let mut notes = Vec::new();
    if let Some(nft) = &rs.nft {
        let file = if v6 { &rs.ipv6 } else { &rs.ipv4 };
        let fam = if v6 { "ip6" } else { "ip" };
        if file.tables.is_empty()
            && nft
                .tables
                .iter()
                .any(|t| t.is_iptables() && t.id.family == fam)
        {
            notes.push(format!(
                "the nft ruleset holds iptables-nft tables ({fam}), simulated from the nft dump where their rules use no `xt` extension; pass {} output to simulate them fully",
                if v6 { "ip6tables-save" } else { "iptables-save" }
            ));
        }
    }
    let file = if v6 { &rs.ipv6 } else { &rs.ipv4 };
    if file.tables.is_empty() && !nft_has_tables(rs.nft.as_ref(), v6) {
        notes.push(format!(
            "the {} ruleset is empty: no table to walk, every hook accepts",
            if v6 { "IPv6" } else { "IPv4" }
        ));
    }
    if !bridges.is_known() && mentions_physdev(rs) {
        notes.push(
            "rules use `-m physdev` but no bridge ports were given (--bridge-links / --links): physdev matches are undecidable".into(),
        );
    }
    if ipsets.sets.is_empty() && mentions_sets(rs) {
        notes.push(
            "rules use ipsets but no `ipset save` was given: set matches are undecidable".into(),
        );
    }
    notes
}

/// Whether an nft ruleset holds tables that can see packets of this family.
fn nft_has_tables(nft: Option<&NftRuleset>, v6: bool) -> bool {
    let fam = if v6 { "ip6" } else { "ip" };
    nft.is_some_and(|n| {
        n.tables
            .iter()
            .any(|t| t.id.family == fam || t.id.family == "inet")
    })
}

fn mentions_module(rs: &Ruleset, module: &str) -> bool {
    [&rs.ipv4, &rs.ipv6]
        .iter()
        .flat_map(|f| &f.tables)
        .flat_map(|t| &t.chains)
        .flat_map(|c| &c.rules)
        .any(|r| {
            r.items
                .iter()
                .any(|i| matches!(i, crate::iptables::Item::Module { name, .. } if name == module))
        })
}

fn mentions_physdev(rs: &Ruleset) -> bool {
    mentions_module(rs, "physdev")
}

fn mentions_sets(rs: &Ruleset) -> bool {
    mentions_module(rs, "set")
}

/// The connection the prediction implies: the original tuple as the packet came, the reply
/// tuple the reverse of what left the last table.
fn predicted_conntrack(p: &PacketSpec, stages: &[model::Stage]) -> Option<Arc<ConntrackView>> {
    let ct = stages.iter().rev().find_map(|s| s.ct.clone())?;
    if matches!(ct.state, CtState::Untracked | CtState::Invalid) {
        return None;
    }
    let (first, last) = (
        stages.first()?.before.as_ref()?,
        stages.last()?.after.as_ref()?,
    );
    let proto = Protocol::from_number(p.proto);
    Some(Arc::new(ConntrackView {
        state: (ct.state, false),
        mark: ct.mark,
        original: TupleView {
            src: first.src.clone(),
            dst: first.dst.clone(),
            proto,
        },
        reply: TupleView {
            src: last.dst.clone(),
            dst: last.src.clone(),
            proto,
        },
    }))
}

/// The packet asked about, and as it leaves the last stage when NAT changed it.
fn predicted_packet(p: &PacketSpec, stages: &[model::Stage]) -> Packet {
    let proto = Protocol::from_number(p.proto);
    let icmp = proto.is_icmp().then(|| {
        let (kind, code) = p.icmp.unwrap_or(if p.is_v6() { (128, 0) } else { (8, 0) });
        Icmp {
            kind,
            code,
            id: None,
        }
    });
    let first = Headers {
        src: Endpoint::new(p.src, p.sport),
        dst: Endpoint::new(p.dst, p.dport),
        icmp,
    };
    let last = stages
        .last()
        .and_then(|s| s.after.as_ref())
        .map(|a| Headers {
            src: a.src.clone(),
            dst: a.dst.clone(),
            icmp,
        })
        .filter(|l| *l != first);
    Packet {
        family: if p.is_v6() {
            model::Family::Ipv6
        } else {
            model::Family::Ipv4
        },
        proto,
        first,
        last,
        ip_id: None,
    }
}

impl Explanation {
    /// Keeps only random outcome `n` (1-based, in the order listed), for `--pick`: the walk as
    /// if every `numgen`/statistic draw had gone that branch's way.
    pub fn pick(mut self, n: usize) -> Result<Explanation, ExplainError> {
        let count = self.branches.len();
        if n == 0 || n > count {
            return Err(ExplainError::Pick { pick: n, count });
        }
        let b = self.branches.swap_remove(n - 1);
        self.notes.push(format!(
            "picked outcome {n} of {count} (probability {:.4})",
            b.probability
        ));
        self.branches = vec![b];
        Ok(self)
    }

    /// The verdict all branches agree on; `undecidable` when they differ or any is undecidable.
    pub fn verdict(&self) -> Verdict {
        let mut it = self.branches.iter().map(verdict_of);
        let first = it.next().unwrap_or(Verdict::Undecidable);
        if it.all(|v| v == first) {
            first
        } else {
            Verdict::Undecidable
        }
    }

    /// The prediction as the model's traversal (the live tracer's type), mark bits named
    /// from `marks`; `netns` is the namespace read (`--live --netns`), if any.
    pub fn to_model(&self, marks: &MarkDictionary, netns: Option<&str>) -> Traversal {
        let p = &self.packet;
        let branches: Vec<model::Branch> = self
            .branches
            .iter()
            .map(|b| model::Branch {
                marks: model::mark_changes(&b.stages, marks),
                ..b.clone()
            })
            .collect();
        let main = branches.first();
        let mut notes = self.notes.clone();
        if let Some(b) = main {
            notes.extend(b.notes.iter().cloned());
        }
        let stages = main.map(|b| b.stages.clone()).unwrap_or_default();
        let mut fate = main.map_or_else(|| Fate::new(FateKind::Undecidable), |b| b.fate.clone());
        if self.branches.len() > 1 && self.verdict() == Verdict::Undecidable {
            fate = Fate::new(FateKind::Undecidable);
            fate.reason = Some("the random outcomes end differently: see `branches`".into());
        }
        Traversal {
            schema: model::SCHEMA,
            source: model::Source::Predicted,
            netns: netns.map(str::to_string),
            family: Some(if p.is_v6() {
                model::Family::Ipv6
            } else {
                model::Family::Ipv4
            }),
            proto: Some(Protocol::from_number(p.proto)),
            packet: Some(predicted_packet(p, &stages)),
            ingress: p.in_iface.as_ref().map(|i| Iface { iface: i.clone() }),
            egress: main.and_then(|b| b.egress.clone()),
            route: main.and_then(|b| b.route),
            bridge: main.and_then(|b| b.bridge.clone()),
            encap: None,
            conntrack: predicted_conntrack(p, &stages),
            names: Vec::new(),
            marks: main.map(|b| b.marks.clone()).unwrap_or_default(),
            nat: main.map(|b| b.nat.clone()).unwrap_or_default(),
            stages,
            fate,
            branches: if branches.len() > 1 {
                branches
            } else {
                Vec::new()
            },
            notes,
            lost: 0,
            incomplete: false,
            incomplete_reason: None,
        }
    }

    /// Schema-3 JSON: the live tracer's shape (`source` `predicted`), mark bits named from
    /// the default dictionary.
    pub fn to_json(&self) -> Value {
        serde_json::to_value(self.to_model(&MarkDictionary::default(), None))
            .expect("a traversal serialises")
    }

    /// The model's tree: one line per hook/table with what changed, matched rules beneath.
    pub fn render_tree(&self) -> String {
        self.to_model(&MarkDictionary::default(), None)
            .render_tree()
    }
}
