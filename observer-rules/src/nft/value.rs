//! Typed values of nft expressions and set elements: what a JSON literal means depends on the
//! expression it is compared with (`"tcp"` is 6 for `meta l4proto`, `"new"` a bit for `ct
//! state`), so literals are read against a [`Ty`]. Sets keep exact keys in a hash map (kube-proxy's
//! 5,000-entry verdict maps are looked up, never scanned) and intervals, prefixes and interface
//! wildcards in a list.

use std::collections::HashMap;
use std::net::IpAddr;

use serde_json::Value;

use crate::packet::{CT_ESTABLISHED, CT_INVALID, CT_NEW, CT_RELATED, CT_UNTRACKED};

/// The type of an expression, which decides how a literal is read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ty {
    Ipv4,
    Ipv6,
    Proto,
    Port,
    Int,
    Iface,
    CtState,
    CtStatus,
    CtDir,
    FibType,
    NfProto,
    EtherType,
    IcmpType,
    TcpFlags,
    Other,
}

impl Ty {
    /// A named set's key type as `nft` prints it.
    pub fn from_nft(name: &str) -> Ty {
        match name {
            "ipv4_addr" => Ty::Ipv4,
            "ipv6_addr" => Ty::Ipv6,
            "inet_proto" => Ty::Proto,
            "inet_service" => Ty::Port,
            "mark" | "integer" => Ty::Int,
            "ifname" | "iface_index" => Ty::Iface,
            "ct_state" => Ty::CtState,
            "ct_status" => Ty::CtStatus,
            "ct_dir" => Ty::CtDir,
            "fib_addrtype" => Ty::FibType,
            "nf_proto" => Ty::NfProto,
            "ether_type" => Ty::EtherType,
            "icmp_type" | "icmpv6_type" => Ty::IcmpType,
            "tcp_flag" => Ty::TcpFlags,
            _ => Ty::Other,
        }
    }
}

/// A value: numbers (addresses, ports, marks, bit sets) or interface names.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Atom {
    N(u128),
    S(String),
}

impl Atom {
    pub fn num(&self) -> Option<u128> {
        match self {
            Atom::N(n) => Some(*n),
            Atom::S(_) => None,
        }
    }
}

/// One component of a set element or a literal on the right of a match.
#[derive(Debug, Clone, PartialEq)]
pub enum Pat {
    Eq(Atom),
    /// Inclusive numeric interval: prefixes and ranges.
    Range(u128, u128),
    /// `"cali*"`: an interface name prefix.
    Wild(String),
}

impl Pat {
    pub fn matches(&self, a: &Atom) -> bool {
        match (self, a) {
            (Pat::Eq(x), a) => x == a,
            (Pat::Range(lo, hi), Atom::N(n)) => lo <= n && n <= hi,
            (Pat::Wild(p), Atom::S(s)) => s.starts_with(p.as_str()),
            _ => false,
        }
    }
}

pub const STATUS_EXPECTED: u128 = 1;
pub const STATUS_SEEN_REPLY: u128 = 2;
pub const STATUS_ASSURED: u128 = 4;
pub const STATUS_CONFIRMED: u128 = 8;
pub const STATUS_SNAT: u128 = 16;
pub const STATUS_DNAT: u128 = 32;

fn named(ty: Ty, s: &str) -> Option<u128> {
    Some(match (ty, s) {
        (Ty::Proto, _) => u128::from(crate::packet::proto_number(s)?),
        (Ty::CtState, "invalid") => u128::from(CT_INVALID),
        (Ty::CtState, "established") => u128::from(CT_ESTABLISHED),
        (Ty::CtState, "related") => u128::from(CT_RELATED),
        (Ty::CtState, "new") => u128::from(CT_NEW),
        (Ty::CtState, "untracked") => u128::from(CT_UNTRACKED),
        (Ty::CtStatus, "expected") => STATUS_EXPECTED,
        (Ty::CtStatus, "seen-reply") => STATUS_SEEN_REPLY,
        (Ty::CtStatus, "assured") => STATUS_ASSURED,
        (Ty::CtStatus, "confirmed") => STATUS_CONFIRMED,
        (Ty::CtStatus, "snat") => STATUS_SNAT,
        (Ty::CtStatus, "dnat") => STATUS_DNAT,
        (Ty::CtStatus, "dying") => 512,
        (Ty::CtDir, "original") => 0,
        (Ty::CtDir, "reply") => 1,
        (Ty::FibType, _) => match s {
            "unspec" => 0,
            "unicast" => 1,
            "local" => 2,
            "broadcast" => 3,
            "anycast" => 4,
            "multicast" => 5,
            "blackhole" => 6,
            "unreachable" => 7,
            "prohibit" => 8,
            _ => return None,
        },
        (Ty::NfProto, "ipv4") => 2,
        (Ty::NfProto, "ipv6") => 10,
        (Ty::EtherType, "ip") => 0x0800,
        (Ty::EtherType, "ip6") => 0x86dd,
        (Ty::EtherType, "arp") => 0x0806,
        (Ty::Port, _) => u128::from(match s {
            "ssh" => 22u16,
            "domain" => 53,
            "http" => 80,
            "https" => 443,
            _ => s.parse().ok()?,
        }),
        (Ty::IcmpType, _) => match s {
            "echo-reply" => 0,
            "destination-unreachable" => 3,
            "echo-request" => 8,
            "time-exceeded" => 11,
            _ => s.parse().ok()?,
        },
        (Ty::TcpFlags, _) => match s {
            "ecn" => 64,
            "cwr" => 128,
            _ => u128::from(crate::packet::tcp_flag(s)?),
        },
        _ => s.parse().ok()?,
    })
}

fn addr(ty: Ty, s: &str) -> Option<u128> {
    match (ty, s.parse::<IpAddr>().ok()?) {
        (Ty::Ipv4, IpAddr::V4(a)) => Some(u128::from(u32::from(a))),
        (Ty::Ipv6, IpAddr::V6(a)) => Some(u128::from(a)),
        _ => None,
    }
}

/// Reads one literal (not a prefix or range) of type `ty`.
pub fn atom(v: &Value, ty: Ty) -> Result<Atom, String> {
    match v {
        // `fib ... oif missing` / `oif 0`: no interface.
        Value::Number(n) if ty == Ty::Iface && n.as_u64() == Some(0) => Ok(Atom::S(String::new())),
        Value::String(s) if ty == Ty::Iface && (s == "missing" || s == "0") => {
            Ok(Atom::S(String::new()))
        }
        Value::Number(n) => n
            .as_u64()
            .map(|n| Atom::N(u128::from(n)))
            .ok_or_else(|| format!("number {n} out of range")),
        Value::String(s) => match ty {
            Ty::Ipv4 | Ty::Ipv6 => addr(ty, s)
                .map(Atom::N)
                .ok_or_else(|| format!("`{s}` is not an address of this family")),
            Ty::Iface => Ok(Atom::S(s.clone())),
            Ty::Int | Ty::Other if s.starts_with("0x") => u128::from_str_radix(&s[2..], 16)
                .map(Atom::N)
                .map_err(|_| format!("bad number `{s}`")),
            _ => named(ty, s)
                .map(Atom::N)
                .ok_or_else(|| format!("`{s}` is not a known value here")),
        },
        // Bit sets are written as lists (`ct state established,related`).
        Value::Array(a) if matches!(ty, Ty::CtState | Ty::CtStatus | Ty::TcpFlags) => {
            let mut bits = 0;
            for x in a {
                bits |= atom(x, ty)?.num().unwrap_or(0);
            }
            Ok(Atom::N(bits))
        }
        Value::Object(o) if o.contains_key("|") => {
            let mut bits = 0;
            for x in o["|"].as_array().into_iter().flatten() {
                bits |= atom(x, ty)?.num().ok_or("`|` of names")?;
            }
            Ok(Atom::N(bits))
        }
        other => Err(format!("unexpected literal {other}")),
    }
}

fn width(ty: Ty) -> u32 {
    if ty == Ty::Ipv6 { 128 } else { 32 }
}

/// Reads one component of an element: a literal, a prefix, a range or an interface wildcard.
pub fn pat(v: &Value, ty: Ty) -> Result<Pat, String> {
    if let Some(p) = v.get("prefix") {
        // nft writes `meta mark & 0xffff0000 == 0` as the prefix 0/16 of the 32-bit mark.
        let a = match p.get("addr") {
            Some(Value::Number(n)) if !matches!(ty, Ty::Ipv4 | Ty::Ipv6) => {
                u128::from(n.as_u64().ok_or("prefix with a bad number")?)
            }
            a => a
                .and_then(Value::as_str)
                .and_then(|s| addr(ty, s))
                .ok_or("prefix without an address of this family")?,
        };
        let len = p
            .get("len")
            .and_then(Value::as_u64)
            .filter(|&l| l <= u64::from(width(ty)))
            .ok_or("prefix without a valid `len`")? as u32;
        let host_bits = width(ty) - len;
        let span = if host_bits == 128 {
            u128::MAX
        } else {
            (1u128 << host_bits) - 1
        };
        let lo = a & !span;
        return Ok(Pat::Range(lo, lo | span));
    }
    if let Some(r) = v.get("range") {
        let r = r
            .as_array()
            .filter(|r| r.len() == 2)
            .ok_or("range is not [lo, hi]")?;
        let lo = atom(&r[0], ty)?.num().ok_or("range of names")?;
        let hi = atom(&r[1], ty)?.num().ok_or("range of names")?;
        return Ok(Pat::Range(lo, hi));
    }
    if ty == Ty::Iface
        && let Some(p) = v.as_str().and_then(|s| s.strip_suffix('*'))
        && !p.ends_with('\\')
    {
        return Ok(Pat::Wild(p.to_string()));
    }
    atom(v, ty).map(Pat::Eq)
}

/// Reads a whole element (`{"elem": {"val": ...}}` wrappers and concatenations unwrapped)
/// against the key types.
pub fn element(v: &Value, key: &[Ty]) -> Result<Vec<Pat>, String> {
    let v = v.get("elem").and_then(|e| e.get("val")).unwrap_or(v);
    match v.get("concat").and_then(Value::as_array) {
        Some(parts) => {
            if parts.len() != key.len() {
                return Err(format!(
                    "element has {} fields, the key {}",
                    parts.len(),
                    key.len()
                ));
            }
            parts.iter().zip(key).map(|(p, &t)| pat(p, t)).collect()
        }
        None if key.len() == 1 => Ok(vec![pat(v, key[0])?]),
        None => Err(format!(
            "element is not a concatenation of {} fields",
            key.len()
        )),
    }
}

/// Set contents: exact keys hashed, the rest (intervals, wildcards) scanned in order.
#[derive(Debug, Clone, Default)]
pub struct SetData {
    exact: HashMap<Vec<Atom>, usize>,
    ranged: Vec<(Vec<Pat>, usize)>,
    len: usize,
}

/// A lookup's answer: the element's index, a miss, or why it cannot be told.
#[derive(Debug, Clone, PartialEq)]
pub enum Look {
    Hit(usize),
    Miss,
    Unknown(String),
}

impl SetData {
    pub fn push(&mut self, pats: Vec<Pat>) -> usize {
        let i = self.len;
        self.len += 1;
        if pats.iter().all(|p| matches!(p, Pat::Eq(_))) {
            let key = pats
                .into_iter()
                .map(|p| match p {
                    Pat::Eq(a) => a,
                    _ => unreachable!("checked above"),
                })
                .collect();
            // The first element with a key wins, as nft rejects duplicates anyway.
            self.exact.entry(key).or_insert(i);
        } else {
            self.ranged.push((pats, i));
        }
        i
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Looks `key` up; a `None` component is a field whose value is unknown, which still
    /// answers a miss when no element matches the known fields.
    pub fn lookup(&self, key: &[Option<Atom>]) -> Look {
        if let Some(known) = key.iter().cloned().collect::<Option<Vec<Atom>>>() {
            if let Some(&i) = self.exact.get(&known) {
                return Look::Hit(i);
            }
            return self
                .ranged
                .iter()
                .find(|(p, _)| p.iter().zip(&known).all(|(p, a)| p.matches(a)))
                .map_or(Look::Miss, |&(_, i)| Look::Hit(i));
        }
        let fits = |pats: &[Pat]| {
            pats.iter()
                .zip(key)
                .all(|(p, a)| a.as_ref().is_none_or(|a| p.matches(a)))
        };
        let any = self
            .exact
            .keys()
            .any(|k| fits(&k.iter().cloned().map(Pat::Eq).collect::<Vec<_>>()))
            || self.ranged.iter().any(|(p, _)| fits(p));
        if any {
            Look::Unknown("a field of the lookup key is unknown".into())
        } else {
            Look::Miss
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn literals_follow_the_type() {
        assert_eq!(atom(&json!("tcp"), Ty::Proto), Ok(Atom::N(6)));
        assert_eq!(
            atom(&json!(["established", "related"]), Ty::CtState),
            Ok(Atom::N(u128::from(CT_ESTABLISHED | CT_RELATED)))
        );
        assert_eq!(atom(&json!("10.0.0.1"), Ty::Ipv4), Ok(Atom::N(0x0a00_0001)));
        assert!(atom(&json!("::1"), Ty::Ipv4).is_err());
        assert_eq!(
            pat(&json!({"prefix": {"addr": "10.0.0.0", "len": 8}}), Ty::Ipv4),
            Ok(Pat::Range(0x0a00_0000, 0x0aff_ffff))
        );
        assert_eq!(
            pat(&json!({"prefix": {"addr": "::", "len": 0}}), Ty::Ipv6),
            Ok(Pat::Range(0, u128::MAX))
        );
        assert_eq!(
            pat(&json!("cali*"), Ty::Iface),
            Ok(Pat::Wild("cali".into()))
        );
        assert!(pat(&json!({"prefix": {"addr": "10.0.0.0"}}), Ty::Ipv4).is_err());
        assert_eq!(
            pat(&json!({"prefix": {"addr": 0, "len": 16}}), Ty::Int),
            Ok(Pat::Range(0, 0xffff))
        );
        assert!(element(&json!({"concat": ["tcp"]}), &[Ty::Proto, Ty::Port]).is_err());
    }

    #[test]
    fn hashed_and_ranged_lookups() {
        let key = [Ty::Ipv4, Ty::Proto, Ty::Port];
        let mut d = SetData::default();
        d.push(element(&json!({"concat": ["10.0.0.1", "tcp", 80]}), &key).unwrap());
        d.push(
            element(
                &json!({"concat": ["10.0.0.2", "udp", {"range": [1000, 2000]}]}),
                &key,
            )
            .unwrap(),
        );
        let k = |a: u128, p: u128, port: Option<u128>| {
            vec![Some(Atom::N(a)), Some(Atom::N(p)), port.map(Atom::N)]
        };
        assert_eq!(d.lookup(&k(0x0a00_0001, 6, Some(80))), Look::Hit(0));
        assert_eq!(d.lookup(&k(0x0a00_0001, 6, Some(81))), Look::Miss);
        assert_eq!(d.lookup(&k(0x0a00_0002, 17, Some(1500))), Look::Hit(1));
        assert_eq!(d.lookup(&k(0x0a00_0003, 1, None)), Look::Miss);
        assert!(matches!(
            d.lookup(&k(0x0a00_0001, 6, None)),
            Look::Unknown(_)
        ));
    }
}
