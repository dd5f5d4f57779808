//! The words both sides use: address families, netfilter hooks, the tables each hook runs
//! (conntrack included) with the kernel's priorities, and protocol names (the packet's own values are in [`crate::packet`]).

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

/// A mark as the reports print it.
pub fn hex(v: u32) -> String {
    format!("{v:#x}")
}

#[cfg(test)]
mod tests {
    use super::*;

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
