//! The words both sides use: address families, netfilter hooks, the tables each hook runs
//! (conntrack included) with the kernel's priorities, protocol names and endpoint text.

use std::fmt::Write as _;
use std::net::IpAddr;

use serde::Serialize;

/// An address family netfilter hooks run for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Family {
    Ipv4,
    Ipv6,
}

impl Family {
    pub const ALL: [Family; 2] = [Family::Ipv4, Family::Ipv6];

    /// `NFPROTO_IPV4` (2) / `NFPROTO_IPV6` (10).
    pub fn pf(self) -> u32 {
        match self {
            Family::Ipv4 => 2,
            Family::Ipv6 => 10,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Family::Ipv4 => "ipv4",
            Family::Ipv6 => "ipv6",
        }
    }

    /// The nftables family word (`ip`, `ip6`).
    pub fn nft(self) -> &'static str {
        match self {
            Family::Ipv4 => "ip",
            Family::Ipv6 => "ip6",
        }
    }
}

/// The five inet hooks, numbered as the kernel's `NF_INET_*`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Hook {
    PreRouting = 0,
    LocalIn = 1,
    Forward = 2,
    LocalOut = 3,
    PostRouting = 4,
}

impl Hook {
    pub const ALL: [Hook; 5] = [
        Hook::PreRouting,
        Hook::LocalIn,
        Hook::Forward,
        Hook::LocalOut,
        Hook::PostRouting,
    ];

    pub fn from_raw(v: u8) -> Option<Self> {
        Self::ALL.get(usize::from(v)).copied()
    }

    /// The chain name iptables uses for this hook.
    pub fn name(self) -> &'static str {
        match self {
            Hook::PreRouting => "PREROUTING",
            Hook::LocalIn => "INPUT",
            Hook::Forward => "FORWARD",
            Hook::LocalOut => "OUTPUT",
            Hook::PostRouting => "POSTROUTING",
        }
    }

    /// The nftables hook word (`prerouting`, ...).
    pub fn from_nft(word: &str) -> Option<Self> {
        Some(match word {
            "prerouting" => Hook::PreRouting,
            "input" => Hook::LocalIn,
            "forward" => Hook::Forward,
            "output" => Hook::LocalOut,
            "postrouting" => Hook::PostRouting,
            _ => return None,
        })
    }

    /// The tables the kernel runs on this hook, in priority order, with their priorities
    /// (IPv4 and IPv6 alike). `conntrack` is the connection tracker itself (-200, on the
    /// hooks where packets enter); the others are the x_tables tables.
    pub fn tables(self) -> &'static [(&'static str, i32)] {
        match self {
            Hook::PreRouting => &[
                ("raw", -300),
                ("conntrack", -200),
                ("mangle", -150),
                ("nat", -100),
            ],
            Hook::LocalIn => &[
                ("mangle", -150),
                ("filter", 0),
                ("security", 50),
                ("nat", 100),
            ],
            Hook::Forward => &[("mangle", -150), ("filter", 0), ("security", 50)],
            Hook::LocalOut => &[
                ("raw", -300),
                ("conntrack", -200),
                ("mangle", -150),
                ("nat", -100),
                ("filter", 0),
                ("security", 50),
            ],
            Hook::PostRouting => &[("mangle", -150), ("nat", 100)],
        }
    }
}

impl Serialize for Hook {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.name())
    }
}

/// IANA protocol name as the reports print it, or the number.
pub fn proto_name(p: u8) -> std::borrow::Cow<'static, str> {
    std::borrow::Cow::Borrowed(match p {
        0 => "hopopt",
        1 => "icmp",
        2 => "igmp",
        6 => "tcp",
        17 => "udp",
        47 => "gre",
        50 => "esp",
        51 => "ah",
        58 => "icmpv6",
        132 => "sctp",
        136 => "udplite",
        n => return std::borrow::Cow::Owned(n.to_string()),
    })
}

/// The protocols whose packets carry ports (tcp, udp, sctp, udplite).
pub fn has_ports(p: u8) -> bool {
    matches!(p, 6 | 17 | 132 | 136)
}

/// `a.b.c.d:port`, `[v6]:port`, or the bare address for protocols without ports. Written
/// by hand for IPv4: `Ipv4Addr`'s `Display` (it supports padding) was the collector's
/// largest cost.
pub fn endpoint(addr: IpAddr, port: Option<u16>) -> String {
    let mut s = String::with_capacity(24);
    match addr {
        IpAddr::V4(a) => {
            for (i, o) in a.octets().into_iter().enumerate() {
                if i > 0 {
                    s.push('.');
                }
                push_decimal(&mut s, o.into());
            }
        }
        IpAddr::V6(a) if port.is_some() => {
            let _ = write!(s, "[{a}]");
        }
        IpAddr::V6(a) => {
            let _ = write!(s, "{a}");
        }
    }
    if let Some(p) = port {
        s.push(':');
        push_decimal(&mut s, p.into());
    }
    s
}

/// Like [`endpoint`] for an address given as text (a symbolic one such as
/// `<address of cali1a2b>` included): `v6` brackets it when a port follows.
pub fn endpoint_text(addr: &str, v6: bool, port: Option<u16>) -> String {
    match (port, v6) {
        (Some(p), true) => format!("[{addr}]:{p}"),
        (Some(p), false) => format!("{addr}:{p}"),
        (None, _) => addr.to_string(),
    }
}

/// Appends `n` in decimal.
fn push_decimal(s: &mut String, mut n: u32) {
    let mut buf = [0u8; 10];
    let mut i = buf.len();
    loop {
        i -= 1;
        buf[i] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 {
            break;
        }
    }
    // The digits are ASCII.
    s.push_str(std::str::from_utf8(&buf[i..]).unwrap_or("?"));
}

/// A mark as the reports print it.
pub fn hex(v: u32) -> String {
    format!("{v:#x}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints_format_by_family_and_port() {
        let v6: IpAddr = "2001:db8::1".parse().unwrap();
        assert_eq!(endpoint(v6, Some(80)), "[2001:db8::1]:80");
        assert_eq!(endpoint(v6, None), "2001:db8::1");
        assert_eq!(endpoint("10.0.0.1".parse().unwrap(), Some(0)), "10.0.0.1:0");
        assert_eq!(
            endpoint_text("<address of eth0>", false, Some(5)),
            "<address of eth0>:5"
        );
        assert_eq!(endpoint_text("fd00::1", true, Some(5)), "[fd00::1]:5");
    }

    #[test]
    fn one_protocol_vocabulary() {
        assert_eq!(proto_name(0), "hopopt");
        assert_eq!(proto_name(136), "udplite");
        assert_eq!(proto_name(58), "icmpv6");
        assert_eq!(proto_name(250), "250");
        assert!(has_ports(136) && !has_ports(1));
    }

    #[test]
    fn hooks_and_tables() {
        assert_eq!(Hook::from_raw(3), Some(Hook::LocalOut));
        assert_eq!(Hook::from_nft("postrouting"), Some(Hook::PostRouting));
        assert_eq!(
            serde_json::to_string(&Hook::Forward).unwrap(),
            "\"FORWARD\""
        );
        assert_eq!(serde_json::to_string(&Family::Ipv6).unwrap(), "\"ipv6\"");
        for h in Hook::ALL {
            let t = h.tables();
            assert!(t.windows(2).all(|w| w[0].1 < w[1].1), "{h:?} in order");
        }
    }
}
