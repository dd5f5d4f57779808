//! Bridges and their ports, for the br_netfilter path: which interfaces are ports of which
//! bridge (`bridge -j link`, `ip -j [-d] link`), whether a port has hairpin mode, whether
//! bridged frames are handed to the IPv4/IPv6 hooks (`net.bridge.bridge-nf-call-iptables`,
//! `-ip6tables`, or the bridge's own `nf_call_iptables`), and where a frame to an address
//! leaves the bridge (`ip -j neigh` for its MAC, `bridge -j fdb` for the port that learnt it).
//!
//! Facts not given stay unknown: the simulator then answers `physdev` "undecidable" rather
//! than guessing.

use std::collections::{BTreeMap, HashMap};
use std::net::IpAddr;

use serde_json::Value;

use crate::error::ParseError;

/// One bridge port.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Port {
    pub bridge: String,
    /// `hairpin on`: frames may leave by the port they came in on. None when the input did
    /// not say (`bridge -j link` without `-d`, `ip -j link` without `-d`).
    pub hairpin: Option<bool>,
}

/// A neighbour entry: the MAC an address resolves to on a device, and whether it is usable
/// now (REACHABLE, STALE, DELAY, PROBE, PERMANENT, NOARP) or must be resolved first.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Neigh {
    pub dev: String,
    pub mac: Option<String>,
    pub usable: bool,
}

/// Everything known about the node's bridges.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Bridges {
    /// Port name -> its bridge.
    pub ports: BTreeMap<String, Port>,
    /// Bridge devices -> their own `nf_call_iptables` / `nf_call_ip6tables` options, when
    /// `ip -j -d link` said.
    pub bridges: BTreeMap<String, [Option<bool>; 2]>,
    /// `net.bridge.bridge-nf-call-iptables` / `-ip6tables` (IPv4, IPv6); None: not given,
    /// the kernel's default (on) is assumed and said.
    pub call_tables: [Option<bool>; 2],
    /// Address -> neighbour entry (`ip -j neigh`).
    pub neigh: HashMap<IpAddr, Neigh>,
    /// (bridge, MAC) -> the port that learnt it (`bridge -j fdb`).
    pub fdb: HashMap<(String, String), String>,
    /// Whether neighbour and fdb tables were given (an address missing from them is then
    /// known to be unresolved, not merely unknown).
    pub have_neigh: bool,
    pub have_fdb: bool,
}

/// The entries of `text`, a JSON array (`what` names it in errors).
pub(crate) fn entries(text: &str, what: &str) -> Result<Vec<Value>, ParseError> {
    match serde_json::from_str(text)
        .map_err(|e| ParseError::new(e.line(), e.column(), format!("{what}: {e}")))?
    {
        Value::Array(a) => Ok(a),
        _ => Err(ParseError::new(
            1,
            1,
            format!("{what}: expected a JSON array"),
        )),
    }
}

fn s<'a>(v: &'a Value, k: &str) -> Option<&'a str> {
    v.get(k).and_then(Value::as_str)
}

/// `nf_call_iptables` and friends print as 0/1 numbers (or booleans in other iproute2s).
fn flag(v: Option<&Value>) -> Option<bool> {
    v.and_then(|v| v.as_bool().or_else(|| v.as_u64().map(|n| n != 0)))
}

impl Bridges {
    /// Whether anything about bridges was given (without it `physdev` is undecidable).
    pub fn is_known(&self) -> bool {
        !self.ports.is_empty() || !self.bridges.is_empty()
    }

    /// Reads `bridge -j [-d] link` output: every entry is a port with its `master`.
    pub fn add_bridge_link_json(&mut self, text: &str) -> Result<(), ParseError> {
        for e in &entries(text, "`bridge -j link` JSON")? {
            let (Some(name), Some(master)) = (s(e, "ifname"), s(e, "master")) else {
                continue;
            };
            self.bridges.entry(master.to_string()).or_default();
            let hairpin = e.get("hairpin").and_then(Value::as_bool);
            let p = self.ports.entry(name.to_string()).or_insert(Port {
                bridge: master.to_string(),
                hairpin,
            });
            p.bridge = master.to_string();
            p.hairpin = hairpin.or(p.hairpin);
        }
        Ok(())
    }

    /// Reads `ip -j [-d] link` output. With `-d` the kinds tell bridges from bonds and VRFs;
    /// without it every master is taken for a bridge (pass `bridge -j link` to be sure).
    pub fn add_ip_link_json(&mut self, text: &str) -> Result<(), ParseError> {
        for e in &entries(text, "`ip -j link` JSON")? {
            let Some(name) = s(e, "ifname") else { continue };
            let info = e.get("linkinfo");
            let kind = info.and_then(|i| s(i, "info_kind"));
            if kind == Some("bridge") {
                let data = info.and_then(|i| i.get("info_data"));
                let call = [
                    flag(data.and_then(|d| d.get("nf_call_iptables"))),
                    flag(data.and_then(|d| d.get("nf_call_ip6tables"))),
                ];
                let b = self.bridges.entry(name.to_string()).or_default();
                for (slot, c) in b.iter_mut().zip(call) {
                    *slot = c.or(*slot);
                }
            }
            let Some(master) = s(e, "master") else {
                continue;
            };
            let slave_kind = info.and_then(|i| s(i, "info_slave_kind"));
            if slave_kind.is_some_and(|k| k != "bridge") {
                continue;
            }
            let hairpin = info
                .and_then(|i| i.get("info_slave_data"))
                .and_then(|d| d.get("hairpin"))
                .and_then(Value::as_bool);
            self.bridges.entry(master.to_string()).or_default();
            let p = self.ports.entry(name.to_string()).or_insert(Port {
                bridge: master.to_string(),
                hairpin,
            });
            p.hairpin = hairpin.or(p.hairpin);
        }
        Ok(())
    }

    /// Reads `ip -j neigh show` output (both families may be concatenated as two arrays).
    pub fn add_neigh_json(&mut self, text: &str) -> Result<(), ParseError> {
        let list = entries(text, "`ip -j neigh` JSON")?;
        self.have_neigh = true;
        for e in &list {
            let (Some(dst), Some(dev)) = (s(e, "dst"), s(e, "dev")) else {
                continue;
            };
            let Ok(addr) = dst.parse::<IpAddr>() else {
                continue;
            };
            let states: Vec<&str> = e
                .get("state")
                .and_then(Value::as_array)
                .map(|a| a.iter().filter_map(Value::as_str).collect())
                .unwrap_or_default();
            let usable = states.iter().any(|st| {
                matches!(
                    *st,
                    "REACHABLE" | "STALE" | "DELAY" | "PROBE" | "PERMANENT" | "NOARP"
                )
            });
            self.neigh.insert(
                addr,
                Neigh {
                    dev: dev.to_string(),
                    mac: s(e, "lladdr").map(str::to_ascii_lowercase),
                    usable,
                },
            );
        }
        Ok(())
    }

    /// Reads `bridge -j fdb show` output: learnt and static entries of bridge ports.
    pub fn add_fdb_json(&mut self, text: &str) -> Result<(), ParseError> {
        let list = entries(text, "`bridge -j fdb` JSON")?;
        self.have_fdb = true;
        for e in &list {
            let (Some(mac), Some(port), Some(master)) =
                (s(e, "mac"), s(e, "ifname"), s(e, "master"))
            else {
                continue;
            };
            // `self` entries are the port's own address list, not forwarding entries.
            let own = e
                .get("flags")
                .and_then(Value::as_array)
                .is_some_and(|f| f.iter().any(|x| x.as_str() == Some("self")));
            if own {
                continue;
            }
            self.fdb.insert(
                (master.to_string(), mac.to_ascii_lowercase()),
                port.to_string(),
            );
        }
        Ok(())
    }

    /// The bridge `dev` is a port of.
    pub fn bridge_of(&self, dev: &str) -> Option<&str> {
        self.ports.get(dev).map(|p| p.bridge.as_str())
    }

    pub fn is_bridge(&self, dev: &str) -> bool {
        self.bridges.contains_key(dev)
    }

    /// Whether bridged frames of this family walk the IP hooks on `bridge`: the namespace's
    /// sysctl or the bridge's own option; `assumed` is true when the sysctl was not given and
    /// the kernel's default (1) stands in for it.
    pub fn calls_ip_hooks(&self, bridge: &str, v6: bool) -> (bool, bool) {
        let fam = usize::from(v6);
        let own = self
            .bridges
            .get(bridge)
            .and_then(|b| b[fam])
            .unwrap_or(false);
        match self.call_tables[fam] {
            Some(on) => (on || own, false),
            None => (true, true),
        }
    }

    /// Whether the node can send to `addr` on `bridge` now (a usable neighbour entry); None
    /// when no neighbour table was given.
    pub fn neigh_usable(&self, bridge: &str, addr: IpAddr) -> Option<bool> {
        self.have_neigh.then(|| {
            self.neigh
                .get(&addr)
                .is_some_and(|n| n.dev == bridge && n.usable)
        })
    }

    /// The port a frame to `addr` on `bridge` leaves by: the neighbour's MAC, then the fdb.
    /// `Err` says why it is not known; `Ok((port, resolved))` with `resolved` false when the
    /// neighbour entry is not usable yet (the first packet waits for resolution).
    pub fn port_for(&self, bridge: &str, addr: IpAddr) -> Result<(String, bool), String> {
        let n = match self.neigh.get(&addr) {
            Some(n) if n.dev == bridge => n,
            _ if !self.have_neigh => {
                return Err(format!(
                    "which port of {bridge} leads to {addr} is not known: pass `ip -j neigh` and `bridge -j fdb` output (--neigh, --fdb) or name it with `out PORT`"
                ));
            }
            _ => {
                return Err(format!(
                    "{addr} has no neighbour entry on {bridge}: the node must resolve it first, and the port it answers from is not known yet (name it with `out PORT`)"
                ));
            }
        };
        let Some(mac) = &n.mac else {
            return Err(format!(
                "the neighbour entry of {addr} on {bridge} has no MAC yet (name the port with `out PORT`)"
            ));
        };
        match self.fdb.get(&(bridge.to_string(), mac.clone())) {
            Some(port) => Ok((port.clone(), n.usable)),
            None if !self.have_fdb => Err(format!(
                "{addr} is at {mac}, but which port of {bridge} learnt it is not known: pass `bridge -j fdb` output (--fdb) or name it with `out PORT`"
            )),
            None => Err(format!(
                "no port of {bridge} has learnt {mac} ({addr}): the bridge would flood the frame (name the port with `out PORT`)"
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const BRIDGE_LINK: &str = r#"[{"ifindex":4,"link":"vb","ifname":"va","flags":["BROADCAST"],"mtu":1500,"master":"cni0","state":"forwarding","priority":32,"cost":2,"hairpin":true},
        {"ifindex":6,"ifname":"vc","master":"cni0","state":"forwarding"}]"#;
    const IP_LINK_D: &str = r#"[{"ifindex":2,"ifname":"cni0","linkinfo":{"info_kind":"bridge","info_data":{"stp_state":0,"nf_call_iptables":0,"nf_call_ip6tables":1}}},
        {"ifindex":4,"ifname":"va","master":"cni0","linkinfo":{"info_kind":"veth","info_slave_kind":"bridge","info_slave_data":{"hairpin":true}}},
        {"ifindex":6,"ifname":"vc","master":"cni0","linkinfo":{"info_kind":"veth","info_slave_kind":"bridge","info_slave_data":{"hairpin":false}}},
        {"ifindex":7,"ifname":"e1","master":"bond0","linkinfo":{"info_kind":"veth","info_slave_kind":"bond"}},
        {"ifindex":8,"ifname":"eth0"}]"#;

    #[test]
    fn bridge_link_names_ports_and_hairpin() {
        let mut b = Bridges::default();
        assert!(!b.is_known());
        b.add_bridge_link_json(BRIDGE_LINK).unwrap();
        assert!(b.is_known());
        assert_eq!(b.bridge_of("va"), Some("cni0"));
        assert_eq!(b.ports["va"].hairpin, Some(true));
        assert_eq!(b.ports["vc"].hairpin, None);
        assert!(b.is_bridge("cni0"));
        assert!(!b.is_bridge("va"));
        assert_eq!(b.bridge_of("eth0"), None);
    }

    #[test]
    fn ip_link_detail_tells_bridges_from_bonds_and_reads_options() {
        let mut b = Bridges::default();
        b.add_ip_link_json(IP_LINK_D).unwrap();
        assert_eq!(b.bridge_of("vc"), Some("cni0"));
        assert_eq!(b.ports["vc"].hairpin, Some(false));
        assert_eq!(b.bridge_of("e1"), None, "a bond slave is no bridge port");
        assert_eq!(b.bridges["cni0"], [Some(false), Some(true)]);
        // The sysctl not given: the kernel default (on) is assumed, and said to be.
        assert_eq!(b.calls_ip_hooks("cni0", false), (true, true));
        b.call_tables = [Some(false), Some(false)];
        assert_eq!(b.calls_ip_hooks("cni0", false), (false, false));
        // The bridge's own nf_call_ip6tables keeps IPv6 on when the sysctl is off.
        assert_eq!(b.calls_ip_hooks("cni0", true), (true, false));
    }

    #[test]
    fn neighbour_and_fdb_find_the_port() {
        let mut b = Bridges::default();
        b.add_bridge_link_json(BRIDGE_LINK).unwrap();
        let a: IpAddr = "10.244.0.5".parse().unwrap();
        assert!(b.port_for("cni0", a).unwrap_err().contains("--neigh"));
        b.add_neigh_json(r#"[{"dst":"10.244.0.5","dev":"cni0","lladdr":"AA:bb:cc:00:00:05","state":["REACHABLE"]},
            {"dst":"10.244.0.6","dev":"cni0","lladdr":"aa:bb:cc:00:00:06","state":["FAILED"]},
            {"dst":"10.244.0.7","dev":"cni0","state":["INCOMPLETE"]}]"#)
            .unwrap();
        assert!(b.port_for("cni0", a).unwrap_err().contains("--fdb"));
        b.add_fdb_json(
            r#"[{"mac":"aa:bb:cc:00:00:05","ifname":"vc","master":"cni0","state":""},
            {"mac":"aa:bb:cc:00:00:06","ifname":"va","master":"cni0","state":""},
            {"mac":"33:33:00:00:00:01","ifname":"va","flags":["self"],"state":"permanent"}]"#,
        )
        .unwrap();
        assert_eq!(b.port_for("cni0", a), Ok(("vc".into(), true)));
        assert_eq!(
            b.port_for("cni0", "10.244.0.6".parse().unwrap()),
            Ok(("va".into(), false))
        );
        assert!(
            b.port_for("cni0", "10.244.0.7".parse().unwrap())
                .unwrap_err()
                .contains("no MAC")
        );
        assert!(
            b.port_for("cni0", "10.244.0.9".parse().unwrap())
                .unwrap_err()
                .contains("no neighbour entry")
        );
    }

    #[test]
    fn malformed_input_names_line_and_column() {
        let mut b = Bridges::default();
        let e = b.add_bridge_link_json("[{\"ifname\": }]").unwrap_err();
        assert_eq!(e.line, 1);
        assert!(e.message.contains("bridge -j link"), "{e}");
        assert!(
            b.add_ip_link_json("{}")
                .unwrap_err()
                .message
                .contains("array")
        );
    }
}
