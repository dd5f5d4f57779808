//! What a packet is, as values: its protocol, its endpoints (an address, or the address an
//! interface would have, and a port), its conntrack state, and its identity (the headers
//! as first seen and, when NAT changed them, as last seen). Text is only made by
//! `Display` and the renderers; nothing here is parsed back.

use std::borrow::Cow;
use std::fmt;
use std::io::{self, Write};
use std::net::IpAddr;
use std::sync::Arc;

use serde::ser::SerializeMap;
use serde::{Serialize, Serializer};

use crate::vocab::Family;

/// An IP protocol: the ones reports name, any other by its number.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Protocol {
    Hopopt,
    Icmp,
    Igmp,
    Tcp,
    Udp,
    Gre,
    Esp,
    Ah,
    Icmpv6,
    Sctp,
    Udplite,
    Other(u8),
}

impl Protocol {
    pub fn from_number(p: u8) -> Self {
        match p {
            0 => Protocol::Hopopt,
            1 => Protocol::Icmp,
            2 => Protocol::Igmp,
            6 => Protocol::Tcp,
            17 => Protocol::Udp,
            47 => Protocol::Gre,
            50 => Protocol::Esp,
            51 => Protocol::Ah,
            58 => Protocol::Icmpv6,
            132 => Protocol::Sctp,
            136 => Protocol::Udplite,
            n => Protocol::Other(n),
        }
    }

    /// The IANA number.
    pub fn number(self) -> u8 {
        match self {
            Protocol::Hopopt => 0,
            Protocol::Icmp => 1,
            Protocol::Igmp => 2,
            Protocol::Tcp => 6,
            Protocol::Udp => 17,
            Protocol::Gre => 47,
            Protocol::Esp => 50,
            Protocol::Ah => 51,
            Protocol::Icmpv6 => 58,
            Protocol::Sctp => 132,
            Protocol::Udplite => 136,
            Protocol::Other(n) => n,
        }
    }

    /// The IANA name as reports print it, or the number.
    pub fn name(self) -> Cow<'static, str> {
        Cow::Borrowed(match self {
            Protocol::Hopopt => "hopopt",
            Protocol::Icmp => "icmp",
            Protocol::Igmp => "igmp",
            Protocol::Tcp => "tcp",
            Protocol::Udp => "udp",
            Protocol::Gre => "gre",
            Protocol::Esp => "esp",
            Protocol::Ah => "ah",
            Protocol::Icmpv6 => "icmpv6",
            Protocol::Sctp => "sctp",
            Protocol::Udplite => "udplite",
            Protocol::Other(n) => return Cow::Owned(n.to_string()),
        })
    }

    /// Whether its packets carry ports (tcp, udp, sctp, udplite).
    pub fn has_ports(self) -> bool {
        matches!(
            self,
            Protocol::Tcp | Protocol::Udp | Protocol::Sctp | Protocol::Udplite
        )
    }

    pub fn is_icmp(self) -> bool {
        matches!(self, Protocol::Icmp | Protocol::Icmpv6)
    }
}

impl fmt::Display for Protocol {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.name())
    }
}

impl Serialize for Protocol {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.name())
    }
}

/// A conntrack state, as iptables' `--ctstate` spells it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum CtState {
    New,
    Established,
    Related,
    /// Predicted only: a packet conntrack cannot place.
    Invalid,
    /// Set by `CT --notrack` / `NOTRACK` in raw.
    Untracked,
}

impl CtState {
    pub fn name(self) -> &'static str {
        match self {
            CtState::New => "new",
            CtState::Established => "established",
            CtState::Related => "related",
            CtState::Invalid => "invalid",
            CtState::Untracked => "untracked",
        }
    }
}

impl fmt::Display for CtState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Where an endpoint is: an address, or (predicted) the address an interface has, which
/// the rules name (MASQUERADE, REDIRECT) but the dumps given did not say.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Host {
    Ip(IpAddr),
    AddressOf(Arc<str>),
}

impl Host {
    pub fn ip(&self) -> Option<IpAddr> {
        match self {
            Host::Ip(a) => Some(*a),
            Host::AddressOf(_) => None,
        }
    }

    /// Writes the address (`<address of IFACE>` for an unknown one), as text.
    pub fn write_text<W: Write>(&self, out: &mut W) -> io::Result<()> {
        match self {
            Host::Ip(IpAddr::V4(a)) => {
                let mut buf = [0u8; 15];
                let mut n = 0;
                for (i, o) in a.octets().into_iter().enumerate() {
                    if i > 0 {
                        buf[n] = b'.';
                        n += 1;
                    }
                    n += decimal(&mut buf[n..], o.into());
                }
                out.write_all(&buf[..n])
            }
            Host::Ip(IpAddr::V6(a)) => write!(out, "{a}"),
            Host::AddressOf(i) => write!(out, "<address of {i}>"),
        }
    }
}

impl From<IpAddr> for Host {
    fn from(a: IpAddr) -> Self {
        Host::Ip(a)
    }
}

/// `Display`, and `Serialize` as that string, through the type's `write_text`: the bytes the
/// JSON writer writes, so an address reads the same however it is printed.
macro_rules! text_impls {
    ($t:ty) => {
        impl fmt::Display for $t {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                let mut buf = Vec::with_capacity(48);
                self.write_text(&mut buf).map_err(|_| fmt::Error)?;
                f.write_str(std::str::from_utf8(&buf).map_err(|_| fmt::Error)?)
            }
        }

        impl Serialize for $t {
            fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                s.collect_str(self)
            }
        }
    };
}

text_impls!(Host);

/// Writes `n` in decimal at the start of `buf`; returns the digits written.
fn decimal(buf: &mut [u8], n: u32) -> usize {
    let mut digits = [0u8; 10];
    let (mut i, mut n) = (digits.len(), n);
    loop {
        i -= 1;
        digits[i] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 {
            break;
        }
    }
    let len = digits.len() - i;
    buf[..len].copy_from_slice(&digits[i..]);
    len
}

/// An address and, for protocols with ports, a port.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Endpoint {
    pub host: Host,
    pub port: Option<u16>,
}

impl Endpoint {
    pub fn new(addr: IpAddr, port: Option<u16>) -> Self {
        Self {
            host: Host::Ip(addr),
            port,
        }
    }

    /// Writes `a.b.c.d:port`, `[v6]:port`, or the bare address without a port. An unknown
    /// address (`<address of IFACE>`) is never bracketed.
    pub fn write_text<W: Write>(&self, out: &mut W) -> io::Result<()> {
        let bracket = self.port.is_some() && matches!(self.host, Host::Ip(IpAddr::V6(_)));
        if bracket {
            out.write_all(b"[")?;
        }
        self.host.write_text(out)?;
        if bracket {
            out.write_all(b"]")?;
        }
        if let Some(p) = self.port {
            let mut buf = [b':'; 6];
            let n = decimal(&mut buf[1..], p.into());
            out.write_all(&buf[..=n])?;
        }
        Ok(())
    }

    /// Whether the text needs escaping in JSON (only an interface name can).
    pub(crate) fn plain(&self) -> bool {
        match &self.host {
            Host::Ip(_) => true,
            Host::AddressOf(i) => i.bytes().all(|b| b >= 0x20 && b != b'"' && b != b'\\'),
        }
    }
}

text_impls!(Endpoint);

/// The ICMP(v6) message a packet is: its type and code, and the echo identifier of an echo
/// request or reply (None for other messages, and when a prediction does not know it).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
pub struct Icmp {
    #[serde(rename = "type")]
    pub kind: u8,
    pub code: u8,
    pub id: Option<u16>,
}

impl Icmp {
    /// Whether `kind` is an echo request or reply, whose header carries an identifier.
    pub fn is_echo(proto: Protocol, kind: u8) -> bool {
        match proto {
            Protocol::Icmp => matches!(kind, 0 | 8),
            Protocol::Icmpv6 => matches!(kind, 128 | 129),
            _ => false,
        }
    }
}

/// A packet's addresses at one point: the endpoints (with ports where its protocol has
/// them) and, for ICMP, the message.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Headers {
    pub src: Endpoint,
    pub dst: Endpoint,
    pub icmp: Option<Icmp>,
}

impl Serialize for Headers {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut m = s.serialize_map(Some(5))?;
        m.serialize_entry("src", &self.src.host)?;
        m.serialize_entry("dst", &self.dst.host)?;
        m.serialize_entry("sport", &self.src.port)?;
        m.serialize_entry("dport", &self.dst.port)?;
        m.serialize_entry("icmp", &self.icmp)?;
        m.end()
    }
}

/// Which packet a traversal is about: family, protocol and headers as first seen, and as
/// last seen when NAT changed them (None when they left as they came).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Packet {
    pub family: Family,
    pub proto: Protocol,
    pub first: Headers,
    pub last: Option<Headers>,
    /// IPv4's identification field, when recorded: NAT keeps it, so it names the packet on
    /// the next node too. None for IPv6 (no such field outside fragments), for predictions,
    /// and where reports were not asked to carry it (it makes every packet's report
    /// different, which the renderings' cache would otherwise share).
    pub ip_id: Option<u16>,
}

impl Packet {
    /// `src -> dst` as first seen, for the tree's header and the line.
    pub fn flow(&self) -> String {
        format!("{} -> {}", self.first.src, self.first.dst)
    }
}

impl Serialize for Packet {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let h = &self.first;
        let mut m = s.serialize_map(Some(8 + usize::from(self.ip_id.is_some())))?;
        m.serialize_entry("family", &self.family)?;
        m.serialize_entry("proto", &self.proto)?;
        m.serialize_entry("src", &h.src.host)?;
        m.serialize_entry("dst", &h.dst.host)?;
        m.serialize_entry("sport", &h.src.port)?;
        m.serialize_entry("dport", &h.dst.port)?;
        m.serialize_entry("icmp", &h.icmp)?;
        m.serialize_entry("last", &self.last)?;
        if let Some(id) = self.ip_id {
            m.serialize_entry("ip_id", &id)?;
        }
        m.end()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints_print_by_family_and_port() {
        let v6: IpAddr = "2001:db8::1".parse().unwrap();
        assert_eq!(Endpoint::new(v6, Some(80)).to_string(), "[2001:db8::1]:80");
        assert_eq!(Endpoint::new(v6, None).to_string(), "2001:db8::1");
        let v4: IpAddr = "10.0.0.1".parse().unwrap();
        assert_eq!(Endpoint::new(v4, Some(0)).to_string(), "10.0.0.1:0");
        assert_eq!(
            Endpoint::new("255.255.255.255".parse().unwrap(), Some(65535)).to_string(),
            "255.255.255.255:65535"
        );
        let of = Endpoint {
            host: Host::AddressOf("eth0".into()),
            port: Some(5),
        };
        assert_eq!(of.to_string(), "<address of eth0>:5");
    }

    #[test]
    fn protocols_round_trip_their_numbers() {
        for n in 0..=255u8 {
            assert_eq!(Protocol::from_number(n).number(), n);
        }
        assert_eq!(Protocol::from_number(136).name(), "udplite");
        assert_eq!(Protocol::from_number(250).name(), "250");
        assert!(Protocol::Udplite.has_ports() && !Protocol::Icmp.has_ports());
    }
}
