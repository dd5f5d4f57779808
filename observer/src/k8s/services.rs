//! Service names for ClusterIPs (and external/load-balancer IPs), read from kube-proxy's own
//! rules in both of its modes: the `--comment "ns/name:port cluster IP"` of its KUBE-SERVICES
//! rules (iptables mode), and the chain names its `service-ips` verdict map jumps to
//! (`service-<hash>-ns/name/proto/port`, nftables mode). Parsed with observer-rules. In
//! IPVS mode kube-proxy's rules match ipsets and name no service; an entry of its
//! `KUBE-CLUSTER-IP`-like sets that carries a `comment "ns/name:port"` names one
//! ([`ServiceNames::from_ipset_save`]), and a `KUBE-NODE-PORT-*` entry with a comment names a
//! node port.

use std::collections::HashMap;
use std::net::IpAddr;

use observer_rules::iptables::{Basic, Item, SaveFile};
use observer_rules::nft::NftRuleset;

/// (address, IP protocol number, port) -> `namespace/name:port-name`.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct ServiceNames {
    by: HashMap<(IpAddr, u8, u16), String>,
    /// Node ports (IP protocol number, port) from kube-proxy's `KUBE-NODE-PORT-*` ipsets'
    /// comments: the service behind the port on any of the node's addresses.
    node_ports: HashMap<(u8, u16), String>,
}

/// kube-proxy's IPVS-mode sets of (address, protocol:port) entries, IPv4 and IPv6.
const ADDR_PORT_SETS: [&str; 5] = [
    "CLUSTER-IP",
    "EXTERNAL-IP",
    "EXTERNAL-IP-LOCAL",
    "LOAD-BALANCER",
    "LOAD-BALANCER-LOCAL",
];

fn proto_number(p: &str) -> Option<u8> {
    match p {
        "tcp" => Some(6),
        "udp" => Some(17),
        "sctp" => Some(132),
        n => n.parse().ok(),
    }
}

impl ServiceNames {
    pub fn lookup(&self, addr: IpAddr, proto: u8, port: u16) -> Option<&str> {
        self.by.get(&(addr, proto, port)).map(String::as_str)
    }

    /// The service of a node port, from kube-proxy's ipsets' comments.
    pub fn node_port(&self, proto: u8, port: u16) -> Option<&str> {
        self.node_ports.get(&(proto, port)).map(String::as_str)
    }

    pub fn len(&self) -> usize {
        self.by.len()
    }

    pub fn is_empty(&self) -> bool {
        self.by.is_empty()
    }

    /// Every entry: (address, protocol number, port, name), sorted.
    pub fn entries(&self) -> Vec<(IpAddr, u8, u16, &str)> {
        let mut v: Vec<_> = self
            .by
            .iter()
            .map(|(&(a, p, port), n)| (a, p, port, n.as_str()))
            .collect();
        v.sort();
        v
    }

    /// Adds what another source knows (iptables and nftables mode can both be present
    /// during a migration).
    pub fn extend(&mut self, other: ServiceNames) {
        self.by.extend(other.by);
        self.node_ports.extend(other.node_ports);
    }

    /// From `ipset save`: the entries of kube-proxy's IPVS-mode sets that carry a comment
    /// `ns/name:port` (`add KUBE-CLUSTER-IP 10.96.0.10,udp:53 comment "kube-system/kube-dns:dns"`;
    /// `add KUBE-NODE-PORT-TCP 30022 comment "default/registry:ssh"`). Entries without one
    /// name nothing.
    pub fn from_ipset_save(text: &str) -> Self {
        let mut out = Self::default();
        for line in text.lines() {
            let mut w = line.split_whitespace();
            let (Some("add"), Some(set), Some(elem)) = (w.next(), w.next(), w.next()) else {
                continue;
            };
            let Some(comment) = line
                .split_once(" comment \"")
                .and_then(|(_, c)| c.split_once('"'))
                .map(|(c, _)| c)
                .filter(|c| c.contains('/'))
            else {
                continue;
            };
            let set = set.strip_prefix("KUBE-").unwrap_or("");
            let set = set.strip_prefix("6-").unwrap_or(set);
            if ADDR_PORT_SETS.contains(&set) {
                // `10.96.0.10,udp:53`; IPv6 addresses have no brackets here.
                let Some((addr, pp)) = elem.split_once(',') else {
                    continue;
                };
                let Some((proto, port)) = pp.split_once(':') else {
                    continue;
                };
                if let (Ok(a), Some(p), Ok(port)) =
                    (addr.parse(), proto_number(proto), port.parse())
                {
                    out.by.insert((a, p, port), comment.to_string());
                }
            } else if let Some(proto) = set
                .strip_prefix("NODE-PORT-")
                .map(|p| p.strip_prefix("LOCAL-").unwrap_or(p))
                .and_then(|p| proto_number(&p.to_ascii_lowercase()))
                && let Ok(port) = elem.parse()
            {
                out.node_ports.insert((proto, port), comment.to_string());
            }
        }
        out
    }

    /// From an `iptables-save` dump: the nat table's KUBE-SERVICES rules.
    pub fn from_iptables(save: &SaveFile) -> Self {
        let mut out = Self::default();
        let Some(nat) = save.table("nat") else {
            return out;
        };
        for chain in nat.chains.iter().filter(|c| c.name == "KUBE-SERVICES") {
            for rule in &chain.rules {
                let Some(comment) = rule.comments().into_iter().find_map(|c| {
                    ["cluster IP", "external IP", "loadbalancer IP"]
                        .iter()
                        .find_map(|kind| c.strip_suffix(kind))
                        .map(str::trim)
                }) else {
                    continue;
                };
                let mut dst = None;
                let mut proto = None;
                let mut dport = None;
                for item in &rule.items {
                    match item {
                        Item::Basic {
                            neg: false,
                            kind: Basic::Dst,
                            value,
                        } => dst = value.split('/').next().and_then(|a| a.parse().ok()),
                        Item::Basic {
                            neg: false,
                            kind: Basic::Proto,
                            value,
                        } => proto = proto_number(value),
                        Item::Module { opts, .. } => {
                            for o in opts.iter().filter(|o| !o.neg && o.name == "dport") {
                                dport = o.args.first().and_then(|p| p.parse().ok());
                            }
                        }
                        _ => {}
                    }
                }
                if let (Some(a), Some(p), Some(port)) = (dst, proto, dport) {
                    out.by.insert((a, p, port), comment.to_string());
                }
            }
        }
        out
    }

    /// From `nft -j list ruleset`: kube-proxy's `service-ips` verdict maps.
    pub fn from_nft(rules: &NftRuleset) -> Self {
        let mut out = Self::default();
        for t in rules.tables.iter().filter(|t| t.id.name == "kube-proxy") {
            for set in t.sets.iter().filter(|s| s.name == "service-ips") {
                let elems = set.elems.as_ref().map(|e| e.value());
                let Some(elems) = elems.as_ref().and_then(|e| e.as_array()) else {
                    continue;
                };
                for e in elems {
                    let key = &e[0]["concat"];
                    let target = e[1]["goto"]["target"]
                        .as_str()
                        .or_else(|| e[1]["jump"]["target"].as_str());
                    let (Some(addr), Some(proto), Some(port), Some(target)) = (
                        key[0].as_str().and_then(|a| a.parse().ok()),
                        key[1].as_str().and_then(proto_number),
                        key[2].as_u64().and_then(|p| u16::try_from(p).ok()),
                        target,
                    ) else {
                        continue;
                    };
                    if let Some(name) = service_of_chain(target) {
                        out.by.insert((addr, proto, port), name);
                    }
                }
            }
        }
        out
    }
}

/// `service-ZMVASYV5-default/registry/tcp/ssh` -> `default/registry:ssh`.
fn service_of_chain(chain: &str) -> Option<String> {
    let rest = chain.strip_prefix("service-")?;
    let (_, path) = rest.split_once('-')?;
    let mut parts = path.splitn(4, '/');
    let (ns, name, _proto, port) = (parts.next()?, parts.next()?, parts.next()?, parts.next());
    Some(match port {
        Some(p) if !p.is_empty() => format!("{ns}/{name}:{p}"),
        _ => format!("{ns}/{name}"),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const LAB_RULES: &str = include_str!("../../../lab/node.rules");

    #[test]
    fn names_from_the_lab_iptables_rules() {
        let save = observer_rules::iptables::parse_save(LAB_RULES).unwrap();
        let s = ServiceNames::from_iptables(&save);
        assert_eq!(
            s.lookup("10.10.10.2".parse().unwrap(), 6, 22),
            Some("default/registry:ssh")
        );
        assert_eq!(
            s.lookup("10.10.10.10".parse().unwrap(), 17, 53),
            Some("kube-system/kube-dns:dns")
        );
        assert_eq!(s.lookup("10.10.10.10".parse().unwrap(), 6, 53), None);
    }

    #[test]
    fn names_from_the_ipvs_labs_ipset_comments() {
        let s = ServiceNames::from_ipset_save(include_str!("../../../lab/node-ipvs.ipsets"));
        assert_eq!(
            s.lookup("10.10.10.2".parse().unwrap(), 6, 22),
            Some("default/registry:ssh")
        );
        assert_eq!(
            s.lookup("10.10.10.10".parse().unwrap(), 17, 53),
            Some("kube-system/kube-dns:dns")
        );
        assert_eq!(
            s.lookup("fd00:10::2".parse().unwrap(), 6, 22),
            Some("default/registry:ssh")
        );
        assert_eq!(s.node_port(6, 30022), Some("default/registry:ssh"));
        assert_eq!(s.node_port(17, 30022), None);
        // KUBE-LOOP-BACK (ip,port,ip) and KUBE-IPVS-IPS' set comments name nothing.
        assert_eq!(s.len(), 5);
        // Entries as kube-proxy itself adds them (no comment): nothing.
        let bare = ServiceNames::from_ipset_save("add KUBE-CLUSTER-IP 10.96.0.1,tcp:443\n");
        assert!(bare.is_empty());
    }

    #[test]
    fn names_from_kube_proxys_nftables_map() {
        let json = r#"{"nftables": [
          {"table": {"family": "ip", "name": "kube-proxy", "handle": 1}},
          {"map": {"family": "ip", "name": "service-ips", "table": "kube-proxy",
            "type": ["ipv4_addr", "inet_proto", "inet_service"], "handle": 20, "map": "verdict",
            "elem": [[{"concat": ["10.10.10.2", "tcp", 22]}, {"goto": {"target": "service-ZMVASYV5-default/registry/tcp/ssh"}}],
                     [{"concat": ["10.10.10.10", "udp", 53]}, {"goto": {"target": "service-TCOU7JCQ-kube-system/kube-dns/udp/dns"}}]]}},
          {"table": {"family": "ip6", "name": "kube-proxy", "handle": 2}},
          {"map": {"family": "ip6", "name": "service-ips", "table": "kube-proxy",
            "type": ["ipv6_addr", "inet_proto", "inet_service"], "handle": 9, "map": "verdict",
            "elem": [[{"concat": ["fd00:10::2", "tcp", 22]}, {"goto": {"target": "service-6ZMVASYV-default/registry/tcp/"}}]]}}
        ]}"#;
        let rules = observer_rules::nft::parse_nft_json(json).unwrap();
        let s = ServiceNames::from_nft(&rules);
        assert_eq!(
            s.lookup("10.10.10.10".parse().unwrap(), 17, 53),
            Some("kube-system/kube-dns:dns")
        );
        assert_eq!(
            s.lookup("fd00:10::2".parse().unwrap(), 6, 22),
            Some("default/registry")
        );
        assert_eq!(s.len(), 3);
    }
}
