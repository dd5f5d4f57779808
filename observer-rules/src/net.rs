//! Address and prefix helpers shared by the rule, ipset and route models.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

/// An address prefix such as `10.0.0.0/8` or `2001:db8::/32`; a bare address is a full-length
/// prefix. iptables also accepts dotted masks (`10.0.0.0/255.0.0.0`), which we convert.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Net {
    pub addr: IpAddr,
    pub len: u8,
}

impl Net {
    pub fn parse(s: &str) -> Option<Net> {
        let (a, l) = match s.split_once('/') {
            Some((a, l)) => (a, Some(l)),
            None => (s, None),
        };
        let addr: IpAddr = a.parse().ok()?;
        let max = if addr.is_ipv4() { 32 } else { 128 };
        let len = match l {
            None => max,
            Some(l) => match l.parse::<u8>() {
                Ok(n) if n <= max => n,
                Ok(_) => return None,
                Err(_) => mask_len(l.parse().ok()?)?,
            },
        };
        Some(Net { addr, len })
    }

    pub fn contains(&self, ip: IpAddr) -> bool {
        match (self.addr, ip) {
            (IpAddr::V4(n), IpAddr::V4(a)) => {
                let m = prefix_mask_u32(self.len);
                u32::from(n) & m == u32::from(a) & m
            }
            (IpAddr::V6(n), IpAddr::V6(a)) => {
                let m = prefix_mask_u128(self.len);
                u128::from(n) & m == u128::from(a) & m
            }
            _ => false,
        }
    }

    pub fn is_default(&self) -> bool {
        self.len == 0
    }
}

impl std::fmt::Display for Net {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.addr, self.len)
    }
}

fn mask_len(mask: IpAddr) -> Option<u8> {
    let (bits, ones) = match mask {
        IpAddr::V4(m) => (32, u32::from(m).leading_ones()),
        IpAddr::V6(m) => (128, u128::from(m).leading_ones()),
    };
    // A non-contiguous mask cannot be expressed as a prefix length; iptables rejects it too.
    let back = Net {
        addr: mask,
        len: ones as u8,
    };
    let full = match mask {
        IpAddr::V4(_) => IpAddr::V4(Ipv4Addr::from(prefix_mask_u32(ones as u8))),
        IpAddr::V6(_) => IpAddr::V6(Ipv6Addr::from(prefix_mask_u128(ones as u8))),
    };
    (ones <= bits && back.addr == full).then_some(ones as u8)
}

pub fn prefix_mask_u32(len: u8) -> u32 {
    if len == 0 {
        0
    } else {
        u32::MAX << (32 - u32::from(len))
    }
}

pub fn prefix_mask_u128(len: u8) -> u128 {
    if len == 0 {
        0
    } else {
        u128::MAX << (128 - u32::from(len))
    }
}

/// Parses `0x1f`, `31` or `017`-less decimal numbers as iptables prints marks.
pub fn parse_u32(s: &str) -> Option<u32> {
    if let Some(h) = s.strip_prefix("0x").or_else(|| s.strip_prefix("0X")) {
        u32::from_str_radix(h, 16).ok()
    } else {
        s.parse().ok()
    }
}

/// Parses `value[/mask]`; a missing mask means all bits.
pub fn parse_mark_mask(s: &str) -> Option<(u32, u32)> {
    match s.split_once('/') {
        Some((v, m)) => Some((parse_u32(v)?, parse_u32(m)?)),
        None => Some((parse_u32(s)?, u32::MAX)),
    }
}

/// An IPv6 address's scope as RFC 6724 / `ipv6_addr_scope` ranks it: interface-local 1
/// (loopback), link-local 2, site-local 5, global 14 (unique-local addresses are global
/// scope); a multicast address carries its own.
pub fn v6_scope(a: Ipv6Addr) -> u8 {
    let o = a.octets();
    if a.is_multicast() {
        o[1] & 0x0f
    } else if a.is_loopback() {
        1
    } else if o[0] == 0xfe && o[1] & 0xc0 == 0x80 {
        2
    } else if o[0] == 0xfe && o[1] & 0xc0 == 0xc0 {
        5
    } else {
        14
    }
}

/// RFC 6724's default policy table label of an IPv6 address (section 2.1).
pub fn v6_label(a: Ipv6Addr) -> u8 {
    let n = u128::from(a);
    let within = |p: &str| Net::parse(p).is_some_and(|net| net.contains(IpAddr::V6(a)));
    if n == 1 {
        0
    } else if within("::ffff:0:0/96") {
        4
    } else if within("2002::/16") {
        2
    } else if within("2001::/32") {
        5
    } else if within("fc00::/7") {
        13
    } else if within("::/96") {
        3
    } else if within("fec0::/10") {
        11
    } else if within("3ffe::/16") {
        12
    } else {
        1
    }
}

/// Endpoint text is the model's, shared with the live tracer.
pub use observer_model::endpoint_text as fmt_endpoint;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefixes_and_masks() {
        let n = Net::parse("10.0.0.0/255.0.0.0").unwrap();
        assert_eq!(n.len, 8);
        assert!(n.contains("10.9.9.9".parse().unwrap()));
        assert!(!n.contains("11.0.0.1".parse().unwrap()));
        assert!(Net::parse("10.0.0.0/255.0.255.0").is_none());
        assert!(Net::parse("10.0.0.0/33").is_none());
        let v6 = Net::parse("2001:db8::/32").unwrap();
        assert!(v6.contains("2001:db8::1".parse().unwrap()));
        assert!(!v6.contains("10.0.0.1".parse().unwrap()));
        assert_eq!(parse_mark_mask("0x4000/0x4000"), Some((0x4000, 0x4000)));
        assert_eq!(parse_mark_mask("5"), Some((5, u32::MAX)));
    }
}
