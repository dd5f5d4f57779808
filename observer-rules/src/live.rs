//! The live node, read by one module: rules (`iptables-save -c`, `ip6tables-save -c`),
//! native nftables (`nft -j list ruleset`), ipsets (`ipset save`), routes (`ip -j route`),
//! interface addresses (`ip -j addr`) and the mark bits kube-proxy really uses, read once
//! per change and shared by `observer tail` (rule naming, custom base-chain priorities, the
//! mark dictionary) and `observer explain --live`.
//!
//! Every read that fails is kept in [`LiveNode::failures`] with what to do about it: the
//! callers report each one (tail warns, explain adds a note), none is dropped silently.
//! What a failed read leaves is empty (no rules of that kind, no sets, no routes), which
//! makes the matches that needed it undecidable rather than guessed.

use std::collections::HashMap;
use std::net::IpAddr;
use std::process::Command;

use observer_model::MarkDictionary;
use serde_json::Value;
use thiserror::Error;

use crate::bridge::Bridges;
use crate::error::ParseError;
use crate::ipset::{Ipsets, parse_ipsets};
use crate::iptables::SaveFile;
use crate::iptables::parse_save_family;
use crate::ipvs::{IpvsTable, parse_ipvsadm_save};
use crate::nft::{NftRuleset, parse_nft_json};
use crate::route::Routes;
use crate::sim::Simulator;
use crate::sysctl::Sysctls;
use observer_model::Family;

/// The rules of both families (and nft, if given).
#[derive(Debug, Clone, Default)]
pub struct Ruleset {
    pub ipv4: SaveFile,
    pub ipv6: SaveFile,
    pub nft: Option<NftRuleset>,
}

/// One read of the node that did not give us what we need.
#[derive(Debug, Error)]
pub enum LiveError {
    // `error`, not `source`: the message already says it, and a source would print twice.
    #[error("cannot run `{cmd}`: {error} (install {package}; `cargo xtask setup` does)")]
    Spawn {
        cmd: String,
        package: &'static str,
        error: std::io::Error,
    },
    #[error("`{cmd}` failed: {stderr} (run as root, in the namespace to read)")]
    Failed { cmd: String, stderr: String },
    #[error("`{cmd}` printed what we cannot read: {message} (please report it with the output)")]
    Unreadable { cmd: String, message: String },
}

impl LiveError {
    /// The command that failed.
    pub fn cmd(&self) -> &str {
        match self {
            LiveError::Spawn { cmd, .. }
            | LiveError::Failed { cmd, .. }
            | LiveError::Unreadable { cmd, .. } => cmd,
        }
    }
}

/// What the commands printed, raw: [`LiveNode::parse`] makes a node of it, and a recording
/// keeps it so that `observer replay` names the rules as the tail did.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct LiveTexts {
    pub iptables: Option<String>,
    pub ip6tables: Option<String>,
    pub nft: Option<String>,
    pub ipset: Option<String>,
    /// `ip -j -4` and `-6 route show table all`, those read.
    pub routes: Vec<String>,
    pub addrs: Option<String>,
    /// Bridge ports, neighbours, fdb and br_netfilter's switches (boxed: recordings carry
    /// these texts in a frame that stays small).
    #[serde(default)]
    pub bridge: Box<BridgeTexts>,
    /// `ipvsadm -Sn`: IPVS's virtual services and real servers (absent: no IPVS, or not
    /// read).
    #[serde(default)]
    pub ipvs: Option<String>,
    /// `net.ipv4.vs.conntrack` (absent: IPVS not loaded, or not read).
    #[serde(default)]
    pub ipvs_conntrack: Option<bool>,
    /// The sysctls routing consults, as `KEY=VALUE` lines (`Sysctls::read_text` on the
    /// node, or `--sysctl`); None: the kernel's defaults are assumed, and said to be.
    #[serde(default)]
    pub sysctls: Option<String>,
}

/// What the bridge commands printed, raw.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct BridgeTexts {
    /// `bridge -j -d link show`: bridge ports and their hairpin mode.
    #[serde(default)]
    pub bridge_links: Option<String>,
    /// `ip -j -d link show`: bridges' own `nf_call_iptables` options.
    #[serde(default)]
    pub links: Option<String>,
    /// `ip -j neigh show` and `bridge -j fdb show`: where a frame to an address leaves a
    /// bridge.
    #[serde(default)]
    pub neigh: Option<String>,
    #[serde(default)]
    pub fdb: Option<String>,
    /// `net.bridge.bridge-nf-call-iptables` / `-ip6tables` (false when br_netfilter is not
    /// loaded: the files are absent).
    #[serde(default)]
    pub bridge_nf_call: [Option<bool>; 2],
}

impl BridgeTexts {
    /// The bridge facts of the texts given; a text that does not parse adds nothing and is
    /// listed with the command that printed it, in the order they are read.
    pub fn parse(&self) -> (Bridges, Vec<(&'static str, crate::ParseError)>) {
        let mut bridges = Bridges::default();
        let mut unparsed = Vec::new();
        type Add = fn(&mut Bridges, &str) -> Result<(), crate::ParseError>;
        let inputs: [(&Option<String>, &str, Add); 4] = [
            (&self.links, "ip -j -d link show", Bridges::add_ip_link_json),
            (
                &self.bridge_links,
                "bridge -j -d link show",
                Bridges::add_bridge_link_json,
            ),
            (&self.neigh, "ip -j neigh show", Bridges::add_neigh_json),
            (&self.fdb, "bridge -j fdb show", Bridges::add_fdb_json),
        ];
        for (text, cmd, add) in inputs {
            if let Some(t) = text
                && let Err(e) = add(&mut bridges, t)
            {
                unparsed.push((cmd, e));
            }
        }
        bridges.call_tables = self.bridge_nf_call;
        (bridges, unparsed)
    }
}

/// Which of [`LiveTexts`]' texts did not parse, in the order they are parsed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Text {
    Iptables,
    Ip6tables,
    Nft,
    Ipset,
    Routes,
    Addrs,
    /// One of the bridge texts, by the command that printed it.
    Bridge(&'static str),
    Ipvs,
    Sysctls,
}

impl Text {
    /// The command that prints this text.
    pub fn cmd(self) -> &'static str {
        match self {
            Text::Iptables => "iptables-save -c",
            Text::Ip6tables => "ip6tables-save -c",
            Text::Nft => "nft -j list ruleset",
            Text::Ipset => "ipset save",
            Text::Routes => "ip -j route show table all",
            Text::Addrs => "ip -j addr show",
            Text::Bridge(cmd) => cmd,
            Text::Ipvs => "ipvsadm -Sn",
            Text::Sysctls => "route_localnet sysctls (/proc/sys/net/ipv4/conf, --sysctl)",
        }
    }
}

/// [`LiveTexts`] parsed: what a [`LiveNode`] and `explain` simulate on. A text not given,
/// or that does not parse, leaves its part empty.
#[derive(Debug, Default)]
pub struct Parsed {
    pub ruleset: Ruleset,
    pub ipsets: Ipsets,
    pub routes: Routes,
    pub iface_addrs: HashMap<String, Vec<IpAddr>>,
    pub bridges: Bridges,
    pub ipvs: IpvsTable,
    /// Each text that did not parse, in [`Text`]'s order.
    pub unparsed: Vec<(Text, ParseError)>,
}

/// `parse` of `text` if given; an error is kept in `unparsed` under `which`.
fn parse_text<T>(
    text: Option<&str>,
    which: Text,
    parse: impl FnOnce(&str) -> Result<T, ParseError>,
    unparsed: &mut Vec<(Text, ParseError)>,
) -> Option<T> {
    parse(text?).map_err(|e| unparsed.push((which, e))).ok()
}

impl LiveTexts {
    /// What the commands print on the node (the calling thread's network namespace), not
    /// parsed, with every read that failed: what a cluster plugin fetches from an agent to
    /// simulate on (`GET /v1/ruleset`).
    pub fn read() -> (Self, Vec<LiveError>) {
        Self::read_with(&|t| t, &|| {
            Some(run("nft", &["-j", "list", "ruleset"], "nftables"))
        })
    }

    /// As [`LiveTexts::read`], `save` rewriting each `iptables-save` text, `nft` reading
    /// nftables' listing (see [`LiveNode::read_with`]).
    pub fn read_with(
        save: &dyn Fn(String) -> String,
        nft: &dyn Fn() -> Option<Result<String, LiveError>>,
    ) -> (Self, Vec<LiveError>) {
        let mut failures = Vec::new();
        let mut keep = |r: Result<String, LiveError>| match r {
            Ok(t) => Some(t),
            Err(e) => {
                failures.push(e);
                None
            }
        };
        let texts = LiveTexts {
            iptables: keep(run("iptables-save", &["-c"], "iptables")).map(save),
            ip6tables: keep(run("ip6tables-save", &["-c"], "iptables")).map(save),
            nft: nft().and_then(&mut keep),
            ipset: keep(run("ipset", &["save"], "ipset")),
            routes: ["-4", "-6"]
                .iter()
                .filter_map(|v| {
                    keep(run(
                        "ip",
                        &["-j", v, "route", "show", "table", "all"],
                        "iproute2",
                    ))
                })
                .collect(),
            addrs: keep(run("ip", &["-j", "addr", "show"], "iproute2")),
            bridge: Box::new(BridgeTexts {
                bridge_links: keep(run("bridge", &["-j", "-d", "link", "show"], "iproute2")),
                links: keep(run("ip", &["-j", "-d", "link", "show"], "iproute2")),
                neigh: keep(run("ip", &["-j", "neigh", "show"], "iproute2")),
                fdb: keep(run("bridge", &["-j", "fdb", "show"], "iproute2")),
                bridge_nf_call: ["iptables", "ip6tables"].map(|f| {
                    // /proc/sys/net is the reading thread's namespace; absent: no br_netfilter.
                    let path = format!("/proc/sys/net/bridge/bridge-nf-call-{f}");
                    match std::fs::read_to_string(&path) {
                        Ok(v) => Some(v.trim() != "0"),
                        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Some(false),
                        Err(_) => None,
                    }
                }),
            }),
            ipvs: read_ipvs().and_then(&mut keep),
            ipvs_conntrack: std::fs::read_to_string("/proc/sys/net/ipv4/vs/conntrack")
                .ok()
                .map(|v| v.trim() != "0"),
            sysctls: keep(Sysctls::read_text().map_err(|e| LiveError::Failed {
                cmd: "read /proc/sys/net/ipv4/conf/*/route_localnet".into(),
                stderr: e.to_string(),
            })),
        };
        (texts, failures)
    }

    /// Parses every text given (the one path from texts to rules, sets, routes, addresses
    /// and bridges): [`LiveNode::parse`] and `explain` both read the node through it.
    pub fn parse(&self) -> Parsed {
        let mut unparsed = Vec::new();
        let ipv4 = parse_text(
            self.iptables.as_deref(),
            Text::Iptables,
            |t| parse_save_family(t, Family::Ipv4),
            &mut unparsed,
        );
        let ipv6 = parse_text(
            self.ip6tables.as_deref(),
            Text::Ip6tables,
            |t| parse_save_family(t, Family::Ipv6),
            &mut unparsed,
        );
        let nft = parse_text(
            self.nft.as_deref(),
            Text::Nft,
            parse_nft_json,
            &mut unparsed,
        );
        let ipsets = parse_text(
            self.ipset.as_deref(),
            Text::Ipset,
            parse_ipsets,
            &mut unparsed,
        );
        let routes: Vec<&str> = self.routes.iter().map(String::as_str).collect();
        let mut routes = Routes::parse_json(&routes).unwrap_or_else(|e| {
            unparsed.push((Text::Routes, e));
            Routes::default()
        });
        let iface_addrs = parse_text(
            self.addrs.as_deref(),
            Text::Addrs,
            parse_addrs,
            &mut unparsed,
        );
        let (bridges, bad) = self.bridge.parse();
        unparsed.extend(bad.into_iter().map(|(cmd, e)| (Text::Bridge(cmd), e)));
        let mut ipvs = parse_text(
            self.ipvs.as_deref(),
            Text::Ipvs,
            parse_ipvsadm_save,
            &mut unparsed,
        )
        .unwrap_or_default();
        ipvs.conntrack = self.ipvs_conntrack;
        if let Some(s) = parse_text(
            self.sysctls.as_deref(),
            Text::Sysctls,
            Sysctls::parse,
            &mut unparsed,
        ) {
            routes.sysctls = s;
        }
        Parsed {
            ruleset: Ruleset {
                ipv4: ipv4.unwrap_or_default(),
                ipv6: ipv6.unwrap_or_default(),
                nft,
            },
            ipsets: ipsets.unwrap_or_default(),
            routes,
            iface_addrs: iface_addrs.unwrap_or_default(),
            bridges,
            ipvs,
            unparsed,
        }
    }

    /// The bytes the texts hold (what a copy of them costs).
    pub fn len(&self) -> usize {
        let b = &self.bridge;
        [
            &self.iptables,
            &self.ip6tables,
            &self.nft,
            &self.ipset,
            &self.addrs,
            &self.ipvs,
            &self.sysctls,
        ]
        .into_iter()
        .chain([&b.bridge_links, &b.links, &b.neigh, &b.fdb])
        .map(|t| t.as_ref().map_or(0, String::len))
        .chain(self.routes.iter().map(String::len))
        .sum()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// The node as read at one moment.
#[derive(Debug, Default)]
pub struct LiveNode {
    /// What it was made of.
    pub texts: LiveTexts,
    pub ruleset: Ruleset,
    pub ipsets: Ipsets,
    pub routes: Routes,
    /// Addresses of each interface (MASQUERADE's source, REDIRECT's destination).
    pub iface_addrs: HashMap<String, Vec<IpAddr>>,
    /// Bridge ports, neighbours, fdb and br_netfilter's switches (`physdev`, bridged paths).
    pub bridges: Bridges,
    /// IPVS's virtual services and real servers.
    pub ipvs: IpvsTable,
    /// Every read that failed, with what to do.
    pub failures: Vec<LiveError>,
}

/// `ipvsadm -Sn` where IPVS is loaded (`ip_vs` exists in the reading thread's namespace:
/// `/proc/thread-self/net`, since `/proc/net` follows the process's first thread); None
/// where it is not: no virtual service can exist there.
fn read_ipvs() -> Option<Result<String, LiveError>> {
    std::path::Path::new("/proc/thread-self/net/ip_vs")
        .exists()
        .then(|| run("ipvsadm", &["-Sn"], "ipvsadm"))
}

fn run(cmd: &str, args: &[&str], package: &'static str) -> Result<String, LiveError> {
    let full = format!("{cmd} {}", args.join(" "));
    let out = Command::new(cmd)
        .args(args)
        .output()
        .map_err(|error| LiveError::Spawn {
            cmd: full.clone(),
            package,
            error,
        })?;
    if !out.status.success() {
        return Err(LiveError::Failed {
            cmd: full,
            stderr: String::from_utf8_lossy(&out.stderr).trim().to_string(),
        });
    }
    String::from_utf8(out.stdout).map_err(|e| LiveError::Unreadable {
        cmd: full,
        message: e.to_string(),
    })
}

impl LiveNode {
    /// Reads the node (the calling thread's network namespace). Never fails as a whole:
    /// see [`LiveNode::failures`].
    pub fn read() -> Self {
        Self::read_with(&|t| t, &|| {
            Some(run("nft", &["-j", "list", "ruleset"], "nftables"))
        })
    }

    /// As [`LiveNode::read`], but `save` rewrites each `iptables-save`/`ip6tables-save`
    /// text before it is parsed, and `nft` reads nftables' listing (None: nothing to read).
    /// What needs only part of the ruleset (naming a dropped packet's rule) reads less.
    pub fn read_with(
        save: &dyn Fn(String) -> String,
        nft: &dyn Fn() -> Option<Result<String, LiveError>>,
    ) -> Self {
        let (texts, mut failures) = LiveTexts::read_with(save, nft);
        let mut node = Self::parse(texts);
        failures.append(&mut node.failures);
        node.failures = failures;
        node
    }

    /// Makes a node of what the commands printed (`read`, or a recording's copy); what does
    /// not parse is in [`LiveNode::failures`].
    pub fn parse(texts: LiveTexts) -> Self {
        let parsed = texts.parse();
        let failures = parsed
            .unparsed
            .into_iter()
            .map(|(text, e)| LiveError::Unreadable {
                cmd: text.cmd().into(),
                message: e.to_string(),
            });
        LiveNode {
            texts,
            ruleset: parsed.ruleset,
            ipsets: parsed.ipsets,
            routes: parsed.routes,
            iface_addrs: parsed.iface_addrs,
            bridges: parsed.bridges,
            ipvs: parsed.ipvs,
            failures: failures.collect(),
        }
    }

    /// Whether the node has rules the kernel runs (iptables tables or nftables tables).
    pub fn has_rules(&self) -> bool {
        !self.ruleset.ipv4.tables.is_empty()
            || !self.ruleset.ipv6.tables.is_empty()
            || self
                .ruleset
                .nft
                .as_ref()
                .is_some_and(|n| !n.tables.is_empty())
    }

    /// A simulator over a copy of this state, kept for as long as the state is current.
    /// As [`LiveNode::simulator`], moving the ruleset instead of copying it (the node's
    /// texts are let go first): one copy of a large ruleset at a time.
    pub fn into_simulator(self) -> Simulator<'static> {
        let LiveNode {
            texts,
            ruleset,
            ipsets,
            routes,
            iface_addrs,
            bridges,
            ipvs,
            ..
        } = self;
        drop(texts);
        let mut sim = Simulator::owned(ruleset.ipv4, ruleset.ipv6, ipsets, routes);
        if let Some(n) = &ruleset.nft {
            sim = sim.with_nft(n);
        }
        sim.iface_addrs = iface_addrs;
        sim.bridges = bridges;
        sim.ipvs = ipvs;
        sim
    }

    pub fn simulator(&self) -> Simulator<'static> {
        let mut sim = Simulator::owned(
            self.ruleset.ipv4.clone(),
            self.ruleset.ipv6.clone(),
            self.ipsets.clone(),
            self.routes.clone(),
        );
        if let Some(n) = &self.ruleset.nft {
            sim = sim.with_nft(n);
        }
        sim.iface_addrs = self.iface_addrs.clone();
        sim.bridges = self.bridges.clone();
        sim.ipvs = self.ipvs.clone();
        sim
    }

    /// Names the mark bits this node's kube-proxy really uses (its `KUBE-MARK-MASQ` /
    /// `KUBE-MARK-DROP` rules, or the nftables mode's `mark-for-masquerade` chain).
    /// Returns what it learned.
    pub fn learn_marks(&self, dict: &mut MarkDictionary) -> Vec<(u32, &'static str)> {
        // kube-proxy's mark rules are named from the IPv4 `iptables-save` text.
        let mut learned =
            dict.learn_from_iptables_save(self.texts.iptables.as_deref().unwrap_or_default());
        if let Some(bit) = self.ruleset.nft.as_ref().and_then(nft_masquerade_bit) {
            dict.learn(bit, "kube-proxy:masquerade");
            learned.push((bit, "kube-proxy:masquerade"));
        }
        learned
    }
}

/// `ip -j addr show`: interface name -> its addresses.
fn parse_addrs(text: &str) -> Result<HashMap<String, Vec<IpAddr>>, ParseError> {
    let mut out = HashMap::new();
    for link in crate::bridge::entries(text, "address JSON")? {
        let Some(name) = link["ifname"].as_str() else {
            continue;
        };
        let addrs: Vec<IpAddr> = link["addr_info"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|a| a["local"].as_str()?.parse().ok())
            .collect();
        out.insert(name.to_string(), addrs);
    }
    Ok(out)
}

/// The bit kube-proxy's nftables mode ORs into the mark in `mark-for-masquerade`
/// (`mark set mark or 0x4000`).
fn nft_masquerade_bit(nft: &NftRuleset) -> Option<u32> {
    let chain = nft
        .tables
        .iter()
        .filter(|t| t.id.name == "kube-proxy")
        .flat_map(|t| &t.chains)
        .find(|c| c.name == "mark-for-masquerade")?;
    chain.rules.iter().find_map(|r| or_value(&r.expr.value()))
}

/// The number in a `{"|": [{"meta": {"key": "mark"}}, N]}` anywhere in `v`.
fn or_value(v: &Value) -> Option<u32> {
    match v {
        Value::Object(m) => {
            if let Some(Value::Array(a)) = m.get("|")
                && a.first().is_some_and(|x| x["meta"]["key"] == "mark")
            {
                return a.get(1)?.as_u64().and_then(|n| u32::try_from(n).ok());
            }
            m.values().find_map(or_value)
        }
        Value::Array(a) => a.iter().find_map(or_value),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn interface_addresses_from_ip_json() {
        let a = parse_addrs(
            r#"[{"ifindex":1,"ifname":"lo","addr_info":[{"family":"inet","local":"127.0.0.1"}]},
                {"ifindex":5,"ifname":"cali1a2b","addr_info":[{"family":"inet","local":"169.254.1.1"},{"family":"inet6","local":"fe80::1"}]},
                {"ifindex":6,"ifname":"down"}]"#,
        )
        .unwrap();
        assert_eq!(a["cali1a2b"].len(), 2);
        assert_eq!(a["cali1a2b"][0].to_string(), "169.254.1.1");
        assert!(a["down"].is_empty());
        assert!(parse_addrs("{}").is_err());
    }

    #[test]
    fn kube_proxy_nftables_masquerade_bit_is_learned() {
        let nft = parse_nft_json(
            r#"{"nftables":[{"table":{"family":"ip","name":"kube-proxy","handle":1}},
            {"chain":{"family":"ip","table":"kube-proxy","name":"mark-for-masquerade","handle":2}},
            {"rule":{"family":"ip","table":"kube-proxy","chain":"mark-for-masquerade","handle":3,
              "expr":[{"mangle":{"key":{"meta":{"key":"mark"}},"value":{"|":[{"meta":{"key":"mark"}},4096]}}}]}}]}"#,
        )
        .unwrap();
        let node = LiveNode {
            ruleset: Ruleset {
                nft: Some(nft),
                ..Default::default()
            },
            ..Default::default()
        };
        let mut d = MarkDictionary::default();
        assert_eq!(
            node.learn_marks(&mut d),
            [(0x1000, "kube-proxy:masquerade")]
        );
        assert_eq!(d.name(0x1000), Some("kube-proxy:masquerade"));
        assert_eq!(d.name(0x4000), None);
    }

    #[test]
    fn a_missing_command_is_a_failure_that_says_what_to_install() {
        let e = run("observer-no-such-command", &["x"], "iproute2").unwrap_err();
        assert!(e.to_string().contains("install iproute2"), "{e}");
        assert_eq!(e.cmd(), "observer-no-such-command x");
        let e = run("false", &[], "coreutils").unwrap_err();
        assert!(matches!(e, LiveError::Failed { .. }), "{e}");
    }
}
