//! Routes from `ip -j route show table all` (and `ip -j -6 route ...`): enough of the kernel's
//! lookup to decide INPUT versus FORWARD and the out interface, and to answer `addrtype`.

use std::net::IpAddr;

use crate::error::ParseError;
use crate::net::Net;
use crate::sysctl::Sysctls;

#[derive(Debug, Clone, PartialEq)]
pub struct Route {
    pub dst: Net,
    /// `unicast`, `local`, `broadcast`, `multicast`, `blackhole`, `unreachable`, `prohibit`...
    pub kind: String,
    pub table: String,
    pub dev: Option<String>,
    pub gateway: Option<IpAddr>,
    pub prefsrc: Option<IpAddr>,
    pub metric: u64,
}

#[derive(Debug, Clone, PartialEq, Default)]
pub struct Routes {
    pub routes: Vec<Route>,
    /// The sysctls routing consults (`route_localnet`): read, given, or the kernel's
    /// defaults assumed.
    pub sysctls: Sysctls,
}

/// Where the routing decision sends a packet.
#[derive(Debug, Clone, PartialEq)]
pub enum RouteDecision {
    /// Delivered to this host (INPUT); `dev` is the interface owning the address.
    Local { dev: Option<String> },
    /// Delivered to this host (INPUT) on a condition the inputs cannot say and the kernel
    /// decides at the socket layer (a multicast group a socket joined); otherwise dropped
    /// by routing. The path up to that condition is decided.
    LocalIf { condition: String },
    /// Sent out `dev` (FORWARD or OUTPUT), with the source MASQUERADE would pick.
    Out {
        dev: String,
        prefsrc: Option<IpAddr>,
        gateway: Option<IpAddr>,
    },
    /// A blackhole/unreachable/prohibit route, no route at all, or a martian address.
    Unroutable(String),
    /// The inputs cannot say (multicast group membership, a sysctl not given): why.
    Unknown(String),
}

/// How the kernel treats an address before any route: `ipv4_is_*` / `ipv6_addr_*` tests.
fn v4_class(a: std::net::Ipv4Addr) -> (bool, bool, bool, bool) {
    let o = a.octets();
    (
        a.is_multicast(),
        a.is_broadcast(),
        o[0] == 0,   // ipv4_is_zeronet: 0.0.0.0/8
        o[0] == 127, // ipv4_is_loopback
    )
}

impl Routes {
    /// Parses one or more `ip -j route` JSON arrays, typed (no generic tree of the input).
    /// Every entry must be an object with a valid `dst` (a prefix or `default`); an entry
    /// that is not is an error naming it, never skipped (a skipped route would change where
    /// packets go).
    pub fn parse_json(texts: &[&str]) -> Result<Routes, ParseError> {
        let mut routes = Vec::new();
        for text in texts {
            let entries: Vec<RouteJ> = serde_json::from_str(text).map_err(|e| {
                ParseError::new(
                    e.line(),
                    e.column(),
                    format!("route JSON: {e} (`ip -j route show table all` output expected)"),
                )
            })?;
            for (i, r) in entries.into_iter().enumerate() {
                routes.push(parse_route(i, r)?);
            }
        }
        Ok(Routes {
            routes,
            sysctls: Sysctls::default(),
        })
    }

    pub fn is_empty(&self) -> bool {
        self.routes.is_empty()
    }

    fn best_in(&self, table: &str, addr: IpAddr) -> Option<&Route> {
        self.routes
            .iter()
            .filter(|r| r.table == table && r.dst.contains(addr))
            .min_by_key(|r| (std::cmp::Reverse(r.dst.len), r.metric))
    }

    /// The kernel's default policy-routing order: the local table, then main, then default.
    pub fn lookup(&self, dst: IpAddr) -> RouteDecision {
        // Without the local table, a route's preferred source is still known to be one of
        // the node's addresses (the kernel accepts no other as prefsrc).
        if !self.has_local_table(dst.is_ipv6())
            && let Some(r) = self.routes.iter().find(|r| r.prefsrc == Some(dst))
        {
            return RouteDecision::Local { dev: r.dev.clone() };
        }
        for table in ["local", "main", "default"] {
            if let Some(r) = self.best_in(table, dst) {
                return match r.kind.as_str() {
                    "local" | "broadcast" | "anycast" | "multicast" if table == "local" => {
                        RouteDecision::Local { dev: r.dev.clone() }
                    }
                    "unicast" => match &r.dev {
                        Some(dev) => RouteDecision::Out {
                            dev: dev.clone(),
                            prefsrc: r.prefsrc.or_else(|| self.source_for(dev, dst)),
                            gateway: r.gateway,
                        },
                        None => RouteDecision::Unroutable("route without a device".into()),
                    },
                    other => RouteDecision::Unroutable(format!("{other} route to {}", r.dst)),
                };
            }
        }
        RouteDecision::Unroutable(format!("no route to {dst}"))
    }

    /// Whether the local table (the node's own addresses, broadcast routes) is among the
    /// routes for this family: `ip -j route show table all` has it, `ip -j route` does not.
    pub fn has_local_table(&self, v6: bool) -> bool {
        self.routes
            .iter()
            .any(|r| r.table == "local" && r.dst.addr.is_ipv6() == v6)
    }

    /// What the local table's absence leaves unknown, said where an answer needed it.
    pub fn missing_local_table(v6: bool) -> String {
        format!(
            "the local table is missing from the {} routes (`ip -j route` prints only main): \
             which addresses are the node's own is not known; pass `ip -j{} route show table all`",
            if v6 { "IPv6" } else { "IPv4" },
            if v6 { " -6" } else { "" }
        )
    }

    /// Drops `ip6_rcv_core` makes before PREROUTING (RFC 4291): a multicast source, the
    /// loopback address from a real interface, a multicast destination of scope 0 or 1.
    pub fn ipv6_receive_drop(src: IpAddr, dst: IpAddr, in_dev: &str) -> Option<String> {
        let (IpAddr::V6(s), IpAddr::V6(d)) = (src, dst) else {
            return None;
        };
        let scope = d.octets()[1] & 0x0f;
        let why = if s.is_multicast() {
            format!("multicast source {s}")
        } else if in_dev != "lo" && (s.is_loopback() || d.is_loopback()) {
            "the loopback address from a real interface".to_string()
        } else if d.is_multicast() && scope == 0 {
            format!("multicast destination {d} of reserved scope 0")
        } else if d.is_multicast() && scope == 1 && in_dev != "lo" {
            format!("interface-local multicast destination {d} from another node")
        } else {
            return None;
        };
        Some(format!(
            "ip6_rcv drops the packet before PREROUTING: {why} (RFC 4291)"
        ))
    }

    /// The routing decision for a packet received on `in_dev`, as `ip_route_input_rcu` /
    /// `ip_route_input_slow` make it for IPv4 (martian sources and destinations, limited
    /// broadcast, multicast) and `ip6_route_input` for IPv6 multicast; then the FIB.
    /// Multicast is delivered only to groups the interface joined, which the inputs do not
    /// list (except all-hosts / all-nodes, joined by every interface): the path to INPUT
    /// is given on that condition ([`RouteDecision::LocalIf`]); multicast routing is not
    /// modelled. 127.0.0.0/8 from `in_dev` follows `route_localnet` ([`Sysctls`]).
    pub fn input(&self, src: IpAddr, dst: IpAddr, proto: u8, in_dev: &str) -> RouteDecision {
        let martian_src =
            |why: &str| RouteDecision::Unroutable(format!("martian source {src}: {why}"));
        let joined = |all: &str| RouteDecision::LocalIf {
            condition: format!(
                "condition: multicast destination {dst} is delivered (INPUT, the path \
                 below) only if a socket on this node joined the group on {in_dev}; if none \
                 did, routing drops it before INPUT (group memberships are not among the \
                 inputs; only {all} is joined by every interface; multicast routing is not \
                 modelled)"
            ),
        };
        let localnet = self.sysctls.route_localnet(in_dev);
        let setting = format!(
            "net.ipv4.conf.{{all,{in_dev}}}.route_localnet is {}, {}",
            u8::from(localnet),
            self.sysctls.provenance()
        );
        match (src, dst) {
            (IpAddr::V4(s), IpAddr::V4(d)) => {
                let (s_mc, s_bc, s_zero, s_lo) = v4_class(s);
                let (d_mc, d_bc, d_zero, d_lo) = v4_class(d);
                if s_mc || s_bc {
                    return martian_src("a multicast or broadcast source is never valid");
                }
                if d_mc {
                    // ip_route_input_mc -> ip_mc_validate_source.
                    if s_lo && !localnet {
                        return martian_src(&format!("a loopback source from outside; {setting}"));
                    }
                    let local_mc = d.octets()[..3] == [224, 0, 0];
                    if s_zero && !local_mc && proto != 2 {
                        return martian_src(
                            "0.0.0.0 is valid only towards 224.0.0.0/24 or for IGMP",
                        );
                    }
                    return if d == std::net::Ipv4Addr::new(224, 0, 0, 1) {
                        RouteDecision::Local { dev: None }
                    } else {
                        joined("224.0.0.1")
                    };
                }
                // Limited broadcast (and 0.0.0.0 -> 0.0.0.0) is delivered locally, whatever
                // the routes say.
                if d_bc || (s.is_unspecified() && d.is_unspecified()) {
                    return RouteDecision::Local { dev: None };
                }
                if s_zero {
                    return martian_src("a 0.0.0.0/8 source is valid only towards 255.255.255.255");
                }
                if d_zero {
                    return RouteDecision::Unroutable(format!(
                        "martian destination {dst}: 0.0.0.0/8"
                    ));
                }
                // ip_route_input_slow: 127/8 from outside only with route_localnet.
                if d_lo {
                    if !localnet {
                        return RouteDecision::Unroutable(format!(
                            "martian destination {dst}: a loopback destination arriving on \
                             {in_dev}; {setting}"
                        ));
                    }
                    return self.lookup(dst);
                }
                if s_lo {
                    return martian_src(&format!(
                        "a loopback source from outside; {setting} (with it on, a node \
                         address still fails the source check)"
                    ));
                }
                self.lookup(dst)
            }
            (IpAddr::V6(_), IpAddr::V6(d)) if d.is_multicast() => {
                if d == std::net::Ipv6Addr::new(0xff02, 0, 0, 0, 0, 0, 0, 1) {
                    RouteDecision::Local { dev: None }
                } else {
                    joined("ff02::1")
                }
            }
            _ => self.lookup(dst),
        }
    }

    /// The address a route on `dev` would use as source: the prefsrc of a link route.
    fn source_for(&self, dev: &str, dst: IpAddr) -> Option<IpAddr> {
        self.routes
            .iter()
            .filter(|r| r.dev.as_deref() == Some(dev) && r.dst.addr.is_ipv4() == dst.is_ipv4())
            .find_map(|r| r.prefsrc)
    }

    /// `addrtype` classification of an address, optionally limited to one interface, as
    /// `inet_dev_addr_type` gives it: 0.0.0.0/8 and 255.255.255.255 are BROADCAST, 224/4
    /// MULTICAST, anything else the type of its longest match in the local table (when that
    /// route is on `dev`, if one is given), else UNICAST. `None` when the routes say nothing
    /// about this family; an error (the reason) when the local table is missing.
    pub fn addr_type(
        &self,
        addr: IpAddr,
        dev: Option<&str>,
    ) -> Option<Result<&'static str, String>> {
        let v6 = addr.is_ipv6();
        if !self.routes.iter().any(|r| r.dst.addr.is_ipv6() == v6) {
            return None;
        }
        if let IpAddr::V4(a) = addr {
            let (mc, bc, zero, _) = v4_class(a);
            if zero || bc {
                return Some(Ok("BROADCAST"));
            }
            if mc {
                return Some(Ok("MULTICAST"));
            }
        } else if addr.is_multicast() {
            return Some(Ok("MULTICAST"));
        }
        if !self.has_local_table(v6) {
            return Some(Err(Self::missing_local_table(v6)));
        }
        let r = self.best_in("local", addr);
        Some(Ok(match r {
            Some(r) if dev.is_none() || r.dev.as_deref() == dev => match r.kind.as_str() {
                "local" => "LOCAL",
                "broadcast" => "BROADCAST",
                "anycast" => "ANYCAST",
                "multicast" => "MULTICAST",
                "blackhole" => "BLACKHOLE",
                "unreachable" => "UNREACHABLE",
                "prohibit" => "PROHIBIT",
                _ => "UNICAST",
            },
            _ => "UNICAST",
        }))
    }
}

/// One entry of `ip -j route`, as read: what the simulator uses; other fields are skipped.
#[derive(serde::Deserialize)]
struct RouteJ {
    dst: Option<String>,
    #[serde(rename = "type")]
    kind: Option<String>,
    table: Option<String>,
    dev: Option<String>,
    gateway: Option<String>,
    prefsrc: Option<String>,
    metric: Option<u64>,
}

/// One entry of `ip -j route`; errors name the entry (1-based) and the field.
fn parse_route(i: usize, r: RouteJ) -> Result<Route, ParseError> {
    let err = |what: String| {
        ParseError::new(
            1,
            1,
            format!(
                "route JSON, entry {}: {what} (`ip -j route show table all` output expected)",
                i + 1
            ),
        )
    };
    let addr = |k: &str, v: &Option<String>| -> Result<Option<IpAddr>, ParseError> {
        v.as_deref()
            .map(|a| {
                a.parse::<IpAddr>()
                    .map_err(|_| err(format!("`{k}` {a:?} is not an address")))
            })
            .transpose()
    };
    let gateway = addr("gateway", &r.gateway)?;
    let prefsrc = addr("prefsrc", &r.prefsrc)?;
    let Some(dst) = r.dst.as_deref() else {
        return Err(err("no `dst`".into()));
    };
    let net = if dst == "default" {
        // The family of a default route shows in its gateway (or prefsrc); without either it
        // is taken as IPv4 (`ip -j -6 route` prints IPv6 defaults with a gateway).
        let v6 = gateway.or(prefsrc).is_some_and(|g| g.is_ipv6());
        Net {
            addr: if v6 {
                "::".parse().expect("valid")
            } else {
                "0.0.0.0".parse().expect("valid")
            },
            len: 0,
        }
    } else {
        Net::parse(dst).ok_or_else(|| err(format!("`dst` {dst:?} is not an address or prefix")))?
    };
    for (k, a) in [("gateway", gateway), ("prefsrc", prefsrc)] {
        if a.is_some_and(|a| a.is_ipv6() != net.addr.is_ipv6()) {
            return Err(err(format!("`{k}` is not of the family of `dst` {dst}")));
        }
    }
    Ok(Route {
        dst: net,
        kind: r.kind.unwrap_or_else(|| "unicast".into()),
        table: r.table.unwrap_or_else(|| "main".into()),
        dev: r.dev,
        gateway,
        prefsrc,
        metric: r.metric.unwrap_or(0),
    })
}

impl Routes {
    /// `addrtype` for IPv6, which is not a single type as for IPv4: xt_addrtype requires
    /// *every* listed MULTICAST/UNICAST/UNSPEC property and *any* of LOCAL/ANYCAST/UNREACHABLE
    /// (a local address is UNICAST too). `None` without IPv6 routes.
    pub fn addr_type6_matches(
        &self,
        addr: IpAddr,
        dev: Option<&str>,
        types: &[String],
    ) -> Option<Result<bool, String>> {
        if !self.routes.iter().any(|r| r.dst.addr.is_ipv6()) {
            return None;
        }
        let has = |t: &str| types.iter().any(|x| x == t);
        if let Some(t) = types.iter().find(|t| {
            !matches!(
                t.as_str(),
                "UNSPEC" | "UNICAST" | "LOCAL" | "ANYCAST" | "MULTICAST" | "UNREACHABLE"
            )
        }) {
            return Some(Err(format!("addrtype {t} does not exist for IPv6")));
        }
        let unspec = addr.is_unspecified();
        let multicast = addr.is_multicast();
        if (has("MULTICAST") && !multicast)
            || (has("UNICAST") && (multicast || unspec))
            || (has("UNSPEC") && !unspec)
        {
            return Some(Ok(false));
        }
        if !(has("LOCAL") || has("ANYCAST") || has("UNREACHABLE")) {
            return Some(Ok(true));
        }
        if !self.has_local_table(true) {
            return Some(Err(Self::missing_local_table(true)));
        }
        let local_on = |d: Option<&str>| {
            self.routes.iter().any(|r| {
                r.table == "local"
                    && r.kind == "local"
                    && r.dst.contains(addr)
                    && (d.is_none() || r.dev.as_deref() == d)
            })
        };
        let mut found = Vec::new();
        if dev.is_some() && has("LOCAL") && local_on(dev) {
            found.push("LOCAL");
        }
        match self.lookup(addr) {
            RouteDecision::Unroutable(_) => return Some(Ok(has("UNREACHABLE"))),
            RouteDecision::Local { .. } if dev.is_none() && local_on(None) => found.push("LOCAL"),
            _ => {}
        }
        let anycast = self
            .routes
            .iter()
            .any(|r| r.table == "local" && r.kind == "anycast" && r.dst.contains(addr));
        if anycast {
            found.push("ANYCAST");
        }
        Some(Ok(found.iter().any(|t| has(t))))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const JSON: &str = r#"[{"dst":"default","gateway":"192.0.2.1","dev":"eth0","flags":[]},
      {"dst":"192.0.2.0/24","dev":"eth0","protocol":"kernel","scope":"link","prefsrc":"192.0.2.2","flags":[]},
      {"dst":"172.17.0.5","dev":"cali1a2b","scope":"link","flags":[]},
      {"type":"blackhole","dst":"10.99.0.0/16","flags":[]},
      {"type":"local","dst":"192.0.2.2","dev":"eth0","table":"local","prefsrc":"192.0.2.2","flags":[]},
      {"type":"broadcast","dst":"192.0.2.255","dev":"eth0","table":"local","flags":[]},
      {"dst":"fd00::/64","dev":"eth0","metric":256,"flags":[]},
      {"type":"local","dst":"fd00::2","dev":"eth0","table":"local","flags":[]}]"#;

    #[test]
    fn longest_prefix_and_local_table() {
        let r = Routes::parse_json(&[JSON]).unwrap();
        let ip = |s: &str| s.parse::<IpAddr>().unwrap();
        assert_eq!(
            r.lookup(ip("192.0.2.2")),
            RouteDecision::Local {
                dev: Some("eth0".into())
            }
        );
        assert_eq!(
            r.lookup(ip("172.17.0.5")),
            RouteDecision::Out {
                dev: "cali1a2b".into(),
                prefsrc: None,
                gateway: None
            }
        );
        assert_eq!(
            r.lookup(ip("8.8.8.8")),
            RouteDecision::Out {
                dev: "eth0".into(),
                prefsrc: Some(ip("192.0.2.2")),
                gateway: Some(ip("192.0.2.1"))
            }
        );
        assert!(matches!(
            r.lookup(ip("10.99.1.1")),
            RouteDecision::Unroutable(_)
        ));
        assert_eq!(
            r.lookup(ip("fd00::2")),
            RouteDecision::Local {
                dev: Some("eth0".into())
            }
        );
        assert!(matches!(
            r.lookup(ip("2001:db8::1")),
            RouteDecision::Unroutable(_)
        ));
        assert_eq!(r.addr_type(ip("192.0.2.2"), None), Some(Ok("LOCAL")));
        assert_eq!(
            r.addr_type(ip("192.0.2.2"), Some("lo")),
            Some(Ok("UNICAST"))
        );
        assert_eq!(r.addr_type(ip("192.0.2.255"), None), Some(Ok("BROADCAST")));
        assert_eq!(r.addr_type(ip("8.8.8.8"), None), Some(Ok("UNICAST")));
        assert!(Routes::parse_json(&["{"]).is_err());
        let t = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        // A local IPv6 address is UNICAST as well as LOCAL; an unknown one is neither LOCAL nor
        // UNREACHABLE while a route exists.
        assert_eq!(
            r.addr_type6_matches(ip("fd00::2"), None, &t(&["UNICAST"])),
            Some(Ok(true))
        );
        assert_eq!(
            r.addr_type6_matches(ip("fd00::2"), None, &t(&["LOCAL"])),
            Some(Ok(true))
        );
        assert_eq!(
            r.addr_type6_matches(ip("fd00::9"), None, &t(&["LOCAL"])),
            Some(Ok(false))
        );
        assert_eq!(
            r.addr_type6_matches(ip("2001:db8::1"), None, &t(&["UNREACHABLE"])),
            Some(Ok(true))
        );
        assert_eq!(
            r.addr_type6_matches(ip("ff02::1"), None, &t(&["UNICAST"])),
            Some(Ok(false))
        );
        assert!(matches!(
            r.addr_type6_matches(ip("fd00::2"), None, &t(&["BROADCAST"])),
            Some(Err(_))
        ));
    }

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    #[test]
    fn invalid_entries_are_errors_naming_the_entry_and_field() {
        for (json, says) in [
            (
                r#"[{"dst":"10.0.0.0/8","dev":"eth0"},{"dst":"10.0.0.300/8","dev":"eth0"}]"#,
                "entry 2: `dst` \"10.0.0.300/8\"",
            ),
            (r#"[{"dst":"10.0.0.0/33"}]"#, "entry 1: `dst`"),
            (r#"[{"dev":"eth0"}]"#, "entry 1: no `dst`"),
            (
                r#"[{"dst":42}]"#,
                "invalid type: integer `42`, expected a string",
            ),
            (r#"["10.0.0.0/8"]"#, "expected struct RouteJ"),
            (
                r#"[{"dst":"default","gateway":"10.0.0.256"}]"#,
                "`gateway` \"10.0.0.256\"",
            ),
            (
                r#"[{"dst":"10.0.0.0/8","prefsrc":"fd00::1"}]"#,
                "`prefsrc` is not of the family",
            ),
            (
                r#"[{"dst":"10.0.0.0/8","metric":"low"}]"#,
                "invalid type: string \"low\", expected u64",
            ),
            (r#"{"dst":"10.0.0.0/8"}"#, "expected a sequence"),
        ] {
            let e = Routes::parse_json(&[json]).unwrap_err().to_string();
            assert!(e.contains(says), "{json}: {e}");
        }
    }

    #[test]
    fn broadcast_multicast_and_martians_route_as_the_kernel_does() {
        let r = Routes::parse_json(&[JSON]).unwrap();
        let input = |s: &str, d: &str| r.input(ip(s), ip(d), 17, "eth0");
        let out = |d: &RouteDecision| matches!(d, RouteDecision::Out { .. });
        // Limited broadcast is delivered, even from 0.0.0.0 (DHCP); the subnet broadcast
        // from the local table too. Neither is forwarded out the default route.
        assert!(matches!(
            input("192.0.2.7", "255.255.255.255"),
            RouteDecision::Local { .. }
        ));
        assert!(matches!(
            input("0.0.0.0", "255.255.255.255"),
            RouteDecision::Local { .. }
        ));
        assert!(matches!(
            input("192.0.2.7", "192.0.2.255"),
            RouteDecision::Local { .. }
        ));
        // Multicast: all-hosts is joined by every interface; other groups depend on sockets.
        assert!(matches!(
            input("192.0.2.7", "224.0.0.1"),
            RouteDecision::Local { .. }
        ));
        let mdns = input("192.0.2.7", "224.0.0.251");
        assert!(
            matches!(&mdns, RouteDecision::LocalIf { condition } if condition.contains("joined the group on eth0")),
            "{mdns:?}"
        );
        assert!(!out(&mdns));
        assert!(matches!(
            input("192.0.2.7", "239.1.2.3"),
            RouteDecision::LocalIf { .. }
        ));
        // Martian sources are dropped by routing.
        for src in ["127.0.0.1", "0.0.0.0", "224.0.0.5", "255.255.255.255"] {
            let d = input(src, "192.0.2.2");
            assert!(
                matches!(&d, RouteDecision::Unroutable(w) if w.starts_with("martian source")),
                "{src}: {d:?}"
            );
        }
        // 0.0.0.0 may talk to local multicast, and IGMP to any group.
        assert!(matches!(
            input("0.0.0.0", "224.0.0.1"),
            RouteDecision::Local { .. }
        ));
        assert!(matches!(
            input("0.0.0.0", "239.1.2.3"),
            RouteDecision::Unroutable(_)
        ));
        assert!(matches!(
            r.input(ip("0.0.0.0"), ip("239.1.2.3"), 2, "eth0"),
            RouteDecision::LocalIf { .. }
        ));
        assert!(
            matches!(input("192.0.2.7", "0.1.2.3"), RouteDecision::Unroutable(w) if w.starts_with("martian destination"))
        );
        // 127/8 from outside: a martian destination under the kernel's default
        // route_localnet (said to be assumed), delivered with it on (all or the interface).
        let lo = input("192.0.2.7", "127.0.0.1");
        assert!(
            matches!(&lo, RouteDecision::Unroutable(w) if w.starts_with("martian destination")
                && w.contains("route_localnet is 0, the kernel's default, assumed")),
            "{lo:?}"
        );
        for set in [
            "net.ipv4.conf.all.route_localnet=1",
            "net.ipv4.conf.eth0.route_localnet=1",
        ] {
            // The local table's loopback route, as every node has it.
            let mut on = Routes::parse_json(&[
                JSON,
                r#"[{"type":"local","dst":"127.0.0.0/8","dev":"lo","table":"local","prefsrc":"127.0.0.1","flags":[]}]"#,
            ])
            .unwrap();
            on.sysctls = Sysctls::parse(set).unwrap();
            assert!(
                matches!(
                    on.input(ip("192.0.2.7"), ip("127.0.0.1"), 6, "eth0"),
                    RouteDecision::Local { .. }
                ),
                "{set}"
            );
            // A loopback source stays a martian (the source check fails on a local address).
            assert!(matches!(
                on.input(ip("127.0.0.1"), ip("192.0.2.2"), 6, "eth0"),
                RouteDecision::Unroutable(_)
            ));
        }
        let mut other = r.clone();
        other.sysctls = Sysctls::parse("net.ipv4.conf.eth1.route_localnet=1").unwrap();
        let given = other.input(ip("192.0.2.7"), ip("127.0.0.1"), 6, "eth0");
        assert!(
            matches!(&given, RouteDecision::Unroutable(w) if w.ends_with("is 0, as given")),
            "{given:?}"
        );
        // An ordinary packet still follows the FIB.
        assert!(out(&input("192.0.2.7", "8.8.8.8")));
        // IPv6: all-nodes is joined, other groups depend on sockets; ip6_rcv's drops.
        assert!(matches!(
            input("fd00::7", "ff02::1"),
            RouteDecision::Local { .. }
        ));
        assert!(matches!(
            input("fd00::7", "ff02::fb"),
            RouteDecision::LocalIf { .. }
        ));
        for (s, d) in [
            ("ff02::1", "fd00::2"),
            ("::1", "fd00::2"),
            ("fd00::7", "::1"),
            ("fd00::7", "ff01::1"),
            ("fd00::7", "ff00::1"),
        ] {
            assert!(
                Routes::ipv6_receive_drop(ip(s), ip(d), "eth0").is_some(),
                "{s} -> {d}"
            );
        }
        assert!(Routes::ipv6_receive_drop(ip("::"), ip("ff02::1:ff00:2"), "eth0").is_none());
        assert!(Routes::ipv6_receive_drop(ip("::1"), ip("::1"), "lo").is_none());
    }

    #[test]
    fn addrtype_comes_from_the_local_table_and_says_when_it_is_missing() {
        let all = Routes::parse_json(&[JSON]).unwrap();
        // inet_dev_addr_type: 0/8 and 255.255.255.255 are BROADCAST, 224/4 MULTICAST,
        // and a blackhole in main is UNICAST (only the local table gives types).
        assert_eq!(
            all.addr_type(ip("255.255.255.255"), None),
            Some(Ok("BROADCAST"))
        );
        assert_eq!(all.addr_type(ip("0.0.0.0"), None), Some(Ok("BROADCAST")));
        assert_eq!(
            all.addr_type(ip("224.0.0.251"), None),
            Some(Ok("MULTICAST"))
        );
        assert_eq!(all.addr_type(ip("10.99.1.1"), None), Some(Ok("UNICAST")));
        // Limited to an interface: the longest local match must be on it.
        assert_eq!(
            all.addr_type(ip("192.0.2.2"), Some("eth0")),
            Some(Ok("LOCAL"))
        );
        // Main table only (`ip -j route`): LOCAL cannot be told, and that is said.
        let main = Routes::parse_json(&[r#"[{"dst":"default","gateway":"192.0.2.1","dev":"eth0"},
            {"dst":"192.0.2.0/24","dev":"eth0","scope":"link","prefsrc":"192.0.2.2"}]"#])
        .unwrap();
        let why = main.addr_type(ip("192.0.2.9"), None).unwrap().unwrap_err();
        assert!(why.contains("local table is missing"), "{why}");
        assert_eq!(main.addr_type(ip("224.0.0.1"), None), Some(Ok("MULTICAST")));
        // A route's prefsrc is a node address even without the local table.
        assert!(matches!(
            main.lookup(ip("192.0.2.2")),
            RouteDecision::Local { .. }
        ));
        assert!(matches!(
            main.lookup(ip("192.0.2.9")),
            RouteDecision::Out { .. }
        ));
    }
}
