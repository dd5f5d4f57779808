//! `observer explain`: turns dumps (or the live node) plus a packet description into an
//! [`Explanation`], rendered as schema-1 JSON (the live tracer's shape) or as a readable tree.

use std::collections::HashMap;
use std::fmt::Write as _;
use std::net::IpAddr;
use std::process::Command;

use serde_json::{Value, json};
use thiserror::Error;

use crate::check::Family;
use crate::error::ParseError;
use crate::ipset::{Ipsets, parse_ipsets};
use crate::iptables::{SaveFile, parse_save_family};
use crate::nft::{NftRuleset, parse_nft_json};
use crate::packet::{PacketSpec, PacketSpecError, parse_packet_spec, proto_name};
use crate::route::Routes;
use crate::sim::{Branch, MatchedRule, Simulator, Snapshot, Stage, Verdict};

/// Everything `explain` needs, as text, so the CLI only reads files or runs commands.
#[derive(Debug, Clone, Default)]
pub struct ExplainRequest {
    /// `iptables-save [-c]` output.
    pub iptables_save: Option<String>,
    /// `ip6tables-save [-c]` output.
    pub ip6tables_save: Option<String>,
    /// `nft -j list ruleset` output: native tables are simulated with the iptables tables.
    pub nft_json: Option<String>,
    /// `ipset save` (or `ipset list`) output; sets not given are unknown.
    pub ipset_save: Option<String>,
    /// One or more `ip -j route show table all` / `ip -j -6 route show table all` outputs.
    pub routes_json: Vec<String>,
    /// e.g. `tcp 198.51.100.10:40000 -> 10.10.10.2:22 in eth0 [out IFACE] [mark 0x0] [state new]`.
    pub packet: String,
    /// Interface addresses for MASQUERADE/REDIRECT when routes do not name them.
    pub iface_addrs: HashMap<String, Vec<IpAddr>>,
}

/// The rules of both families (and nft, if given).
#[derive(Debug, Clone, Default)]
pub struct Ruleset {
    pub ipv4: SaveFile,
    pub ipv6: SaveFile,
    pub nft: Option<NftRuleset>,
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
    #[error("`{cmd}` failed: {msg} (run as root on the node; needs iptables, ipset and iproute2)")]
    Live { cmd: String, msg: String },
}

/// The answer: one branch per random outcome (just one when nothing is random).
#[derive(Debug, Clone)]
pub struct Explanation {
    pub packet: PacketSpec,
    pub branches: Vec<Branch>,
    pub notes: Vec<String>,
}

/// Parses every input of `req` and simulates its packet.
pub fn explain(req: &ExplainRequest) -> Result<Explanation, ExplainError> {
    let packet = parse_packet_spec(&req.packet)?;
    let ipv4 = match &req.iptables_save {
        Some(t) => parse_save_family(t, Family::V4).map_err(ExplainError::Iptables)?,
        None => SaveFile::default(),
    };
    let ipv6 = match &req.ip6tables_save {
        Some(t) => parse_save_family(t, Family::V6).map_err(ExplainError::Ip6tables)?,
        None => SaveFile::default(),
    };
    let have = if packet.is_v6() {
        req.ip6tables_save.is_some()
    } else {
        req.iptables_save.is_some()
    };
    let fam = if packet.is_v6() { "IPv6" } else { "IPv4" };
    if !have && req.nft_json.is_none() {
        return Err(ExplainError::NoRuleset(fam));
    }
    let nft = req
        .nft_json
        .as_deref()
        .map(parse_nft_json)
        .transpose()
        .map_err(ExplainError::Nft)?;
    // iptables-restore accepts an empty file, but a verdict from it would be "accept
    // everywhere" built on nothing: usually the wrong file or the other back end's save.
    let file = if packet.is_v6() { &ipv6 } else { &ipv4 };
    if have && file.tables.is_empty() && !nft_has_tables(nft.as_ref(), packet.is_v6()) {
        return Err(ExplainError::EmptyRuleset(fam));
    }
    let ipsets = match &req.ipset_save {
        Some(t) => parse_ipsets(t).map_err(ExplainError::Ipset)?,
        None => Ipsets::default(),
    };
    let texts: Vec<&str> = req.routes_json.iter().map(String::as_str).collect();
    let routes = Routes::parse_json(&texts).map_err(ExplainError::Routes)?;
    let rs = Ruleset { ipv4, ipv6, nft };
    Ok(explain_with(
        &rs,
        &ipsets,
        &routes,
        &packet,
        &req.iface_addrs,
    ))
}

/// Simulates `packet` against already-loaded inputs (the `--live` path).
pub fn explain_with(
    rs: &Ruleset,
    ipsets: &Ipsets,
    routes: &Routes,
    packet: &PacketSpec,
    iface_addrs: &HashMap<String, Vec<IpAddr>>,
) -> Explanation {
    let mut sim = Simulator::new(&rs.ipv4, &rs.ipv6, ipsets, routes);
    if let Some(nft) = &rs.nft {
        sim = sim.with_nft(nft);
    }
    sim.iface_addrs = iface_addrs.clone();
    let branches = sim.simulate(packet);
    let mut notes = Vec::new();
    if let Some(nft) = &rs.nft {
        let file = if packet.is_v6() { &rs.ipv6 } else { &rs.ipv4 };
        let fam = if packet.is_v6() { "ip6" } else { "ip" };
        if file.tables.is_empty()
            && nft
                .tables
                .iter()
                .any(|t| t.is_iptables() && t.family == fam)
        {
            notes.push(format!(
                "the nft ruleset holds iptables-nft tables ({fam}), simulated from the nft dump where their rules use no `xt` extension; pass {} output to simulate them fully",
                if packet.is_v6() { "ip6tables-save" } else { "iptables-save" }
            ));
        }
    }
    let file = if packet.is_v6() { &rs.ipv6 } else { &rs.ipv4 };
    if file.tables.is_empty() && !nft_has_tables(rs.nft.as_ref(), packet.is_v6()) {
        notes.push(format!(
            "the {} ruleset is empty: no table to walk, every hook accepts",
            if packet.is_v6() { "IPv6" } else { "IPv4" }
        ));
    }
    if ipsets.sets.is_empty() && mentions_sets(rs) {
        notes.push(
            "rules use ipsets but no `ipset save` was given: set matches are undecidable".into(),
        );
    }
    Explanation {
        packet: packet.clone(),
        branches,
        notes,
    }
}

/// Whether an nft ruleset holds tables that can see packets of this family.
fn nft_has_tables(nft: Option<&NftRuleset>, v6: bool) -> bool {
    let fam = if v6 { "ip6" } else { "ip" };
    nft.is_some_and(|n| {
        n.tables
            .iter()
            .any(|t| t.family == fam || t.family == "inet")
    })
}

fn mentions_sets(rs: &Ruleset) -> bool {
    [&rs.ipv4, &rs.ipv6]
        .iter()
        .flat_map(|f| &f.tables)
        .flat_map(|t| &t.chains)
        .flat_map(|c| &c.rules)
        .any(|r| {
            r.items
                .iter()
                .any(|i| matches!(i, crate::iptables::Item::Module { name, .. } if name == "set"))
        })
}

fn run(cmd: &str, args: &[&str]) -> Result<String, ExplainError> {
    let full = format!("{cmd} {}", args.join(" "));
    let out = Command::new(cmd)
        .args(args)
        .output()
        .map_err(|e| ExplainError::Live {
            cmd: full.clone(),
            msg: e.to_string(),
        })?;
    if !out.status.success() {
        return Err(ExplainError::Live {
            cmd: full,
            msg: String::from_utf8_lossy(&out.stderr).trim().to_string(),
        });
    }
    String::from_utf8(out.stdout).map_err(|e| ExplainError::Live {
        cmd: full,
        msg: e.to_string(),
    })
}

/// Reads this node's rules, sets and routes (`--live`). ip6tables and ipset are optional:
/// without them IPv6 has no rules and set matches are undecidable.
pub fn load_live() -> Result<(Ruleset, Ipsets, Routes), ExplainError> {
    let ipv4 = parse_save_family(&run("iptables-save", &["-c"])?, Family::V4)
        .map_err(ExplainError::Iptables)?;
    let ipv6 = match run("ip6tables-save", &["-c"]) {
        Ok(t) => parse_save_family(&t, Family::V6).map_err(ExplainError::Ip6tables)?,
        Err(_) => SaveFile::default(),
    };
    let ipsets = match run("ipset", &["save"]) {
        Ok(t) => parse_ipsets(&t).map_err(ExplainError::Ipset)?,
        Err(_) => Ipsets::default(),
    };
    let r4 = run("ip", &["-j", "-4", "route", "show", "table", "all"])?;
    let r6 =
        run("ip", &["-j", "-6", "route", "show", "table", "all"]).unwrap_or_else(|_| "[]".into());
    let routes = Routes::parse_json(&[&r4, &r6]).map_err(ExplainError::Routes)?;
    // A node without nft (or with JSON we cannot read) is explained from iptables alone.
    let nft = run("nft", &["-j", "list", "ruleset"])
        .ok()
        .and_then(|t| parse_nft_json(&t).ok());
    Ok((Ruleset { ipv4, ipv6, nft }, ipsets, routes))
}

/// kube-proxy's nftables chains name the service: `service-HASH-ns/svc/tcp/p80`,
/// `endpoint-HASH-ns/svc/tcp/p80__10.180.0.1/80`, `external-`, `firewall-`, `endpoints-local-`.
fn k8s_nft_meaning(m: &MatchedRule) -> Option<Value> {
    if m.table != "kube-proxy" {
        return None;
    }
    let rest = [
        "service-",
        "endpoint-",
        "external-",
        "firewall-",
        "endpoints-local-",
    ]
    .iter()
    .find_map(|p| m.chain.strip_prefix(p))?;
    let (_hash, rest) = rest.split_once('-')?;
    let (svc, ep) = match rest.split_once("__") {
        Some((s, e)) => (s, Some(e)),
        None => (rest, None),
    };
    let parts: Vec<&str> = svc.split('/').collect();
    let [ns, name, _proto, port] = parts.as_slice() else {
        return None;
    };
    let mut v = json!({ "service": format!("{ns}/{name}:{port}") });
    if let Some((ip, port)) = ep.and_then(|e| e.rsplit_once('/')) {
        v["endpoint"] = json!(crate::net::fmt_endpoint(
            ip,
            ip.contains(':'),
            port.parse().ok()
        ));
    }
    Some(v)
}

/// Kubernetes meaning of a kube-proxy rule: the service from its comment, the endpoint of a DNAT.
fn k8s_meaning(m: &MatchedRule) -> Option<Value> {
    if m.nft.as_ref().is_some_and(|n| n.native) {
        return k8s_nft_meaning(m);
    }
    if !m.chain.starts_with("KUBE-") {
        return None;
    }
    let service = m
        .comments
        .iter()
        .find_map(|c| c.split_whitespace().next().filter(|w| w.contains('/')))?;
    let mut v = json!({ "service": service });
    if m.chain.starts_with("KUBE-SEP-")
        && let Some(ep) = m.action.strip_prefix("DNAT ")
    {
        v["endpoint"] = json!(ep);
    }
    Some(v)
}

fn calico_rule_id(m: &MatchedRule) -> Option<&str> {
    m.comments.iter().find_map(|c| c.strip_prefix("cali:"))
}

fn snap_json(s: &Snapshot) -> Value {
    json!({ "src": s.src, "dst": s.dst, "mark": format!("{:#x}", s.mark) })
}

fn rule_json(m: &MatchedRule) -> Value {
    let mut v = json!({
        "table": m.table, "chain": m.chain, "index": m.index, "text": m.text, "action": m.action,
    });
    if let Some(n) = &m.nft {
        v["family"] = json!(n.family);
        v["handle"] = json!(n.handle);
        if !n.native {
            v["iptables_nft"] = json!(true);
        }
    }
    if let Some(k) = k8s_meaning(m) {
        v["k8s"] = k;
    }
    if let Some(id) = calico_rule_id(m) {
        v["calico"] = json!({ "rule_id": id });
    }
    if let Some(u) = &m.undecidable {
        v["undecidable"] = json!(u);
    }
    if let Some((before, after)) = m.mark {
        v["mark"] = json!({ "before": format!("{before:#x}"), "after": format!("{after:#x}") });
    }
    v
}

fn stage_json(s: &Stage) -> Value {
    let mut v = json!({
        "hook": s.hook.name(), "table": s.table, "priority": s.priority,
        "before": snap_json(&s.before), "after": snap_json(&s.after),
        "ct": s.ct.map(|(state, mark)| json!({
            "state": state.name(),
            "mark": mark.map(|m| format!("{m:#x}")),
        })),
        "verdict": s.verdict.name(),
        "rules": s.rules.iter().map(rule_json).collect::<Vec<_>>(),
    });
    if let Some(p) = &s.policy {
        v["policy"] = json!(p);
    }
    if let Some(n) = &s.nat {
        v["nat"] = json!(n);
    }
    if let Some(n) = &s.note {
        v["note"] = json!(n);
    }
    if let Some((family, chain)) = &s.nft_chain {
        v["family"] = json!(family);
        v["chain"] = json!(chain);
    }
    v
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
        let mut it = self.branches.iter().map(|b| b.verdict);
        let first = it.next().unwrap_or(Verdict::Undecidable);
        if it.all(|v| v == first) {
            first
        } else {
            Verdict::Undecidable
        }
    }

    fn main_branch(&self) -> Option<&Branch> {
        self.branches.first()
    }

    /// Schema-1 JSON, the same shape the live tracer emits per packet.
    pub fn to_json(&self) -> Value {
        let p = &self.packet;
        let b = self.main_branch();
        let mut v = json!({
            "schema": 1,
            "source": "explain",
            "family": if p.is_v6() { "ipv6" } else { "ipv4" },
            "proto": proto_name(p.proto),
            "ingress": p.in_iface.as_ref().map(|i| json!({ "iface": i })),
            "egress": b.and_then(|b| b.egress.as_ref()).map(|i| json!({ "iface": i })),
            "route": b.map(|b| b.route.clone()),
            "ct_state": p.ct_state.name(),
            "stages": b.map(|b| b.stages.iter().map(stage_json).collect::<Vec<_>>()).unwrap_or_default(),
            "verdict": self.verdict().name(),
        });
        if self.branches.len() > 1 {
            v["branches"] = self
                .branches
                .iter()
                .map(|b| {
                    json!({
                        "probability": b.probability,
                        "route": b.route,
                        "egress": b.egress.as_ref().map(|i| json!({ "iface": i })),
                        "stages": b.stages.iter().map(stage_json).collect::<Vec<_>>(),
                        "verdict": b.verdict.name(),
                        "notes": b.notes,
                    })
                })
                .collect();
        }
        let mut notes = self.notes.clone();
        if let Some(b) = b {
            notes.extend(b.notes.iter().cloned());
        }
        if !notes.is_empty() {
            v["notes"] = json!(notes);
        }
        v
    }

    /// A readable tree: one line per hook/table with what changed, matched rules beneath.
    pub fn render_tree(&self) -> String {
        let p = &self.packet;
        let mut out = String::new();
        let b0 = self.main_branch();
        let _ = writeln!(
            out,
            "{} {} -> {}{}  route {}{}  ct {}  verdict {}",
            proto_name(p.proto),
            b0.and_then(|b| b.stages.first())
                .map_or_else(|| p.src.to_string(), |s| s.before.src.clone()),
            b0.and_then(|b| b.stages.first())
                .map_or_else(|| p.dst.to_string(), |s| s.before.dst.clone()),
            p.in_iface
                .as_ref()
                .map_or(String::new(), |i| format!("  in {i}")),
            b0.map_or("?", |b| b.route.as_str()),
            b0.and_then(|b| b.egress.as_ref())
                .map_or(String::new(), |o| format!("  out {o}")),
            p.ct_state.name(),
            self.verdict().name(),
        );
        for n in &self.notes {
            let _ = writeln!(out, "  note: {n}");
        }
        let many = self.branches.len() > 1;
        for (i, b) in self.branches.iter().enumerate() {
            let indent = if many { "  " } else { "" };
            if many {
                let _ = writeln!(
                    out,
                    "branch {} of {} (probability {:.4}): verdict {}{}",
                    i + 1,
                    self.branches.len(),
                    b.probability,
                    b.verdict.name(),
                    b.egress
                        .as_ref()
                        .map_or(String::new(), |o| format!(", out {o}"))
                );
            }
            for s in &b.stages {
                let mut changes = Vec::new();
                if s.before.src != s.after.src {
                    changes.push(format!("src {} -> {}", s.before.src, s.after.src));
                }
                if s.before.dst != s.after.dst {
                    changes.push(format!("dst {} -> {}", s.before.dst, s.after.dst));
                }
                if s.before.mark != s.after.mark {
                    changes.push(format!("mark {:#x} -> {:#x}", s.before.mark, s.after.mark));
                }
                if let Some(pol) = &s.policy {
                    changes.push(format!("policy {pol}"));
                }
                let table = match &s.nft_chain {
                    Some((fam, chain)) => format!("{fam} {} {chain}", s.table),
                    None => s.table.clone(),
                };
                let _ = writeln!(
                    out,
                    "{indent}{:<11} {:<8} ({:>4})  {:<11} {}",
                    s.hook.name(),
                    table,
                    s.priority,
                    s.verdict.name(),
                    changes.join(", ")
                );
                if let Some(n) = &s.note {
                    let _ = writeln!(out, "{indent}    note: {n}");
                }
                for r in &s.rules {
                    let mut extra = String::new();
                    if let Some(k) = k8s_meaning(r) {
                        let _ = write!(extra, "  [k8s {}]", k["service"].as_str().unwrap_or(""));
                    }
                    if let Some(id) = calico_rule_id(r) {
                        let _ = write!(extra, "  [calico {id}]");
                    }
                    let place = match &r.nft {
                        Some(n) if n.native => format!("{} handle {}", r.chain, n.handle),
                        _ => format!("{}#{}", r.chain, r.index),
                    };
                    let _ = writeln!(
                        out,
                        "{indent}    {place} {}  => {}{extra}",
                        r.text, r.action
                    );
                    if let Some(u) = &r.undecidable {
                        let _ = writeln!(out, "{indent}      undecidable: {u}");
                    }
                }
            }
            for n in &b.notes {
                let _ = writeln!(out, "{indent}note: {n}");
            }
        }
        out
    }
}
