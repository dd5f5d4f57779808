//! Routes from `ip -j route show table all` (and `ip -j -6 route ...`): enough of the kernel's
//! lookup to decide INPUT versus FORWARD and the out interface, and to answer `addrtype`.

use std::net::IpAddr;

use serde_json::Value;

use crate::error::ParseError;
use crate::net::Net;

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
}

/// Where the routing decision sends a packet.
#[derive(Debug, Clone, PartialEq)]
pub enum RouteDecision {
    /// Delivered to this host (INPUT); `dev` is the interface owning the address.
    Local { dev: Option<String> },
    /// Sent out `dev` (FORWARD or OUTPUT), with the source MASQUERADE would pick.
    Out {
        dev: String,
        prefsrc: Option<IpAddr>,
        gateway: Option<IpAddr>,
    },
    /// A blackhole/unreachable/prohibit route, or no route at all.
    Unroutable(String),
}

impl Routes {
    /// Parses one or more `ip -j route` JSON arrays.
    pub fn parse_json(texts: &[&str]) -> Result<Routes, ParseError> {
        let mut routes = Vec::new();
        for text in texts {
            let v: Value = serde_json::from_str(text)
                .map_err(|e| ParseError::new(e.line(), e.column(), format!("route JSON: {e}")))?;
            let arr = v.as_array().ok_or_else(|| {
                ParseError::new(1, 1, "route JSON: expected an array (`ip -j route`)")
            })?;
            for r in arr {
                let Some(dst) = r.get("dst").and_then(Value::as_str) else {
                    continue;
                };
                let net = if dst == "default" {
                    // The family of a default route shows in its gateway or later entries; an
                    // unknown family default is assumed IPv4 unless the gateway says otherwise.
                    let v6 = r
                        .get("gateway")
                        .and_then(Value::as_str)
                        .is_some_and(|g| g.contains(':'));
                    Net {
                        addr: if v6 {
                            "::".parse().expect("valid")
                        } else {
                            "0.0.0.0".parse().expect("valid")
                        },
                        len: 0,
                    }
                } else {
                    match Net::parse(dst) {
                        Some(n) => n,
                        // Routes like `unreachable fe80::/64` parse; anything else is ignored.
                        None => continue,
                    }
                };
                let s = |k: &str| r.get(k).and_then(Value::as_str).map(str::to_string);
                routes.push(Route {
                    dst: net,
                    kind: s("type").unwrap_or_else(|| "unicast".into()),
                    table: s("table").unwrap_or_else(|| "main".into()),
                    dev: s("dev"),
                    gateway: s("gateway").and_then(|g| g.parse().ok()),
                    prefsrc: s("prefsrc").and_then(|g| g.parse().ok()),
                    metric: r.get("metric").and_then(Value::as_u64).unwrap_or(0),
                });
            }
        }
        Ok(Routes { routes })
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

    /// The address a route on `dev` would use as source: the prefsrc of a link route.
    fn source_for(&self, dev: &str, dst: IpAddr) -> Option<IpAddr> {
        self.routes
            .iter()
            .filter(|r| r.dev.as_deref() == Some(dev) && r.dst.addr.is_ipv4() == dst.is_ipv4())
            .find_map(|r| r.prefsrc)
    }

    /// `addrtype` classification of an address, optionally limited to one interface.
    /// `None` when the routes say nothing about this family.
    pub fn addr_type(&self, addr: IpAddr, dev: Option<&str>) -> Option<&'static str> {
        if !self
            .routes
            .iter()
            .any(|r| r.dst.addr.is_ipv4() == addr.is_ipv4())
        {
            return None;
        }
        if addr.is_multicast() {
            return Some("MULTICAST");
        }
        let r = self
            .routes
            .iter()
            .filter(|r| r.table == "local" && r.dst.contains(addr))
            .filter(|r| dev.is_none() || r.dev.as_deref() == dev)
            .max_by_key(|r| r.dst.len);
        match r.map(|r| r.kind.as_str()) {
            Some("local") => Some("LOCAL"),
            Some("broadcast") => Some("BROADCAST"),
            Some("anycast") => Some("ANYCAST"),
            _ => match self.lookup(addr) {
                RouteDecision::Unroutable(why) if why.starts_with("blackhole") => Some("BLACKHOLE"),
                RouteDecision::Unroutable(why) if why.starts_with("prohibit") => Some("PROHIBIT"),
                RouteDecision::Unroutable(_) => Some("UNREACHABLE"),
                _ => Some("UNICAST"),
            },
        }
    }
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
        assert_eq!(r.addr_type(ip("192.0.2.2"), None), Some("LOCAL"));
        assert_eq!(r.addr_type(ip("192.0.2.2"), Some("lo")), Some("UNICAST"));
        assert_eq!(r.addr_type(ip("192.0.2.255"), None), Some("BROADCAST"));
        assert_eq!(r.addr_type(ip("8.8.8.8"), None), Some("UNICAST"));
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
}
