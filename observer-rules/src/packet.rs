//! The packet a user asks about, written the way people say it:
//! `tcp 198.51.100.10:40000 -> 10.10.10.2:22 in eth0 [out IFACE] [mark 0x0] [state new]`.

use std::net::IpAddr;

use thiserror::Error;

use crate::net::parse_u32;

/// Conntrack states are the model's, shared with the live tracer.
pub use observer_model::CtState;

/// A packet to explain. `in_iface` absent means the packet is sent by this host (OUTPUT).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct PacketSpec {
    pub proto: u8,
    pub src: IpAddr,
    pub dst: IpAddr,
    pub sport: Option<u16>,
    pub dport: Option<u16>,
    pub in_iface: Option<String>,
    pub out_iface: Option<String>,
    pub mark: u32,
    pub ct_state: CtState,
    pub ct_mark: Option<u32>,
    /// TCP flags (FIN=1, SYN=2, RST=4, PSH=8, ACK=16, URG=32); defaults follow the state.
    pub tcp_flags: Option<u8>,
    /// ICMP type and code; defaults to echo request.
    pub icmp: Option<(u8, u8)>,
    /// Forces local delivery (INPUT) when no routes are given.
    pub local: bool,
}

impl PacketSpec {
    /// A new connection's first packet from `src` to `dst`, arriving from nowhere in
    /// particular, no mark: what `parse` starts from before its options.
    pub fn new(
        proto: u8,
        src: IpAddr,
        sport: Option<u16>,
        dst: IpAddr,
        dport: Option<u16>,
    ) -> Self {
        PacketSpec {
            proto,
            src,
            dst,
            sport,
            dport,
            in_iface: None,
            out_iface: None,
            mark: 0,
            ct_state: CtState::New,
            ct_mark: None,
            tcp_flags: None,
            icmp: None,
            local: false,
        }
    }

    pub fn is_v6(&self) -> bool {
        self.src.is_ipv6()
    }

    pub fn has_ports(&self) -> bool {
        matches!(self.proto, 6 | 17 | 132 | 136)
    }

    pub fn tcp_flags(&self) -> u8 {
        self.tcp_flags.unwrap_or(match self.ct_state {
            CtState::New => TCP_SYN,
            _ => TCP_ACK,
        })
    }
}

pub const TCP_FIN: u8 = 1;
pub const TCP_SYN: u8 = 2;
pub const TCP_RST: u8 = 4;
pub const TCP_PSH: u8 = 8;
pub const TCP_ACK: u8 = 16;
pub const TCP_URG: u8 = 32;

// Conntrack state bits as the kernel's matches test them (`NF_CT_STATE_BIT`: nft's `ct state`,
// xt_conntrack's `--ctstate` and xt_state), with xt_conntrack's two virtual states.
pub const CT_INVALID: u16 = 1;
pub const CT_ESTABLISHED: u16 = 2;
pub const CT_RELATED: u16 = 4;
pub const CT_NEW: u16 = 8;
pub const CT_UNTRACKED: u16 = 64;
pub const CT_SNAT: u16 = 256;
pub const CT_DNAT: u16 = 512;

#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[error(
    "packet spec, word {word}: {message} (expected e.g. `tcp 198.51.100.10:40000 -> 10.10.10.2:22 in eth0 [out IFACE] [mark 0x0] [state new]`)"
)]
pub struct PacketSpecError {
    /// 1-based word index where reading stopped.
    pub word: usize,
    pub message: String,
}

/// Protocol names `getprotobyname` knows from netbase's `/etc/protocols` (Debian 12), names
/// and aliases, lower-cased, plus the ones iptables adds itself (`icmpv6`, `mh`).
const PROTOCOLS: &[(&str, u8)] = &[
    ("ip", 0),
    ("hopopt", 0),
    ("icmp", 1),
    ("igmp", 2),
    ("ggp", 3),
    ("ipencap", 4),
    ("ip-encap", 4),
    ("st", 5),
    ("tcp", 6),
    ("egp", 8),
    ("igp", 9),
    ("pup", 12),
    ("udp", 17),
    ("hmp", 20),
    ("xns-idp", 22),
    ("rdp", 27),
    ("iso-tp4", 29),
    ("dccp", 33),
    ("xtp", 36),
    ("ddp", 37),
    ("idpr-cmtp", 38),
    ("ipv6", 41),
    ("ipv6-route", 43),
    ("ipv6-frag", 44),
    ("idrp", 45),
    ("rsvp", 46),
    ("gre", 47),
    ("esp", 50),
    ("ipsec-esp", 50),
    ("ah", 51),
    ("ipsec-ah", 51),
    ("skip", 57),
    ("ipv6-icmp", 58),
    ("ipv6-nonxt", 59),
    ("ipv6-opts", 60),
    ("rspf", 73),
    ("cphb", 73),
    ("vmtp", 81),
    ("eigrp", 88),
    ("ospf", 89),
    ("ospfigp", 89),
    ("ax.25", 93),
    ("ipip", 94),
    ("etherip", 97),
    ("encap", 98),
    ("pim", 103),
    ("ipcomp", 108),
    ("vrrp", 112),
    ("l2tp", 115),
    ("isis", 124),
    ("sctp", 132),
    ("fc", 133),
    ("mobility-header", 135),
    ("udplite", 136),
    ("mpls-in-ip", 137),
    ("manet", 138),
    ("hip", 139),
    ("shim6", 140),
    ("wesp", 141),
    ("rohc", 142),
    ("ethernet", 143),
    ("icmpv6", 58),
    ("icmp6", 58),
    ("ipv6-mh", 135),
    ("mh", 135),
];

/// Protocol names as iptables accepts them (any case: iptables lower-cases `-p`), or numbers,
/// to IANA numbers. `ip` and `hopopt` are 0, which iptables reads as "all".
pub fn proto_number(name: &str) -> Option<u8> {
    let lower = name.to_ascii_lowercase();
    if let Some(&(_, n)) = PROTOCOLS.iter().find(|(p, _)| *p == lower) {
        return Some(n);
    }
    crate::check::strtoul0(name, 255).map(|n| n as u8)
}

fn parse_endpoint(s: &str) -> Option<(IpAddr, Option<u16>)> {
    if let Some(rest) = s.strip_prefix('[') {
        let (a, tail) = rest.split_once(']')?;
        let port = match tail.strip_prefix(':') {
            Some(p) => Some(p.parse().ok()?),
            None if tail.is_empty() => None,
            None => return None,
        };
        return Some((a.parse().ok()?, port));
    }
    if let Ok(a) = s.parse::<IpAddr>() {
        return Some((a, None));
    }
    let (a, p) = s.rsplit_once(':')?;
    Some((
        a.parse::<std::net::Ipv4Addr>().ok()?.into(),
        Some(p.parse().ok()?),
    ))
}

/// A TCP flag's bit by its name as nft and packet specs write it (iptables writes the
/// names upper-case).
pub fn tcp_flag(name: &str) -> Option<u8> {
    Some(match name {
        "fin" => TCP_FIN,
        "syn" => TCP_SYN,
        "rst" => TCP_RST,
        "psh" => TCP_PSH,
        "ack" => TCP_ACK,
        "urg" => TCP_URG,
        _ => return None,
    })
}

fn parse_flags(s: &str) -> Option<u8> {
    let mut f = 0;
    for name in s.split(',') {
        f |= match name.to_ascii_lowercase().as_str() {
            "none" => 0,
            n => tcp_flag(n)?,
        };
    }
    Some(f)
}

/// Parses a packet description; see [`PacketSpec`].
pub fn parse_packet_spec(s: &str) -> Result<PacketSpec, PacketSpecError> {
    let words: Vec<&str> = s.split_whitespace().collect();
    let err = |word: usize, m: &str| PacketSpecError {
        word: word + 1,
        message: m.to_string(),
    };
    let proto = words.first().and_then(|w| proto_number(w)).ok_or_else(|| {
        err(
            0,
            "expected a protocol (tcp, udp, icmp, icmpv6 or a number)",
        )
    })?;
    let (src, sport) = words
        .get(1)
        .and_then(|w| parse_endpoint(w))
        .ok_or_else(|| {
            err(
                1,
                "expected a source address (a.b.c.d[:port] or [v6][:port])",
            )
        })?;
    if words.get(2) != Some(&"->") {
        return Err(err(2, "expected `->`"));
    }
    let (dst, dport) = words
        .get(3)
        .and_then(|w| parse_endpoint(w))
        .ok_or_else(|| err(3, "expected a destination address"))?;
    if src.is_ipv4() != dst.is_ipv4() {
        return Err(err(3, "source and destination are of different families"));
    }
    let mut p = PacketSpec::new(proto, src, sport, dst, dport);
    if p.has_ports() && (sport.is_none() || dport.is_none()) {
        return Err(err(
            if sport.is_none() { 1 } else { 3 },
            "tcp/udp/sctp need ports (addr:port)",
        ));
    }
    if !p.has_ports() && (sport.is_some() || dport.is_some()) {
        return Err(err(1, "this protocol has no ports"));
    }
    let mut i = 4;
    while i < words.len() {
        let key = words[i];
        if key == "local" {
            p.local = true;
            i += 1;
            continue;
        }
        let val = *words
            .get(i + 1)
            .ok_or_else(|| err(i, &format!("`{key}` needs a value")))?;
        match key {
            "in" | "iif" => p.in_iface = Some(val.to_string()),
            "out" | "oif" => p.out_iface = Some(val.to_string()),
            "mark" => {
                p.mark = parse_u32(val).ok_or_else(|| err(i + 1, "bad mark (0x... or decimal)"))?
            }
            "ctmark" => p.ct_mark = Some(parse_u32(val).ok_or_else(|| err(i + 1, "bad ctmark"))?),
            "state" => {
                p.ct_state = match val.to_ascii_lowercase().as_str() {
                    "new" => CtState::New,
                    "established" | "est" => CtState::Established,
                    "related" => CtState::Related,
                    "invalid" => CtState::Invalid,
                    _ => return Err(err(i + 1, "state is new, established, related or invalid")),
                }
            }
            "flags" => {
                p.tcp_flags =
                    Some(parse_flags(val).ok_or_else(|| err(i + 1, "flags like syn,ack"))?)
            }
            "type" => {
                let (t, c) = val.split_once('/').unwrap_or((val, "0"));
                p.icmp = Some((
                    t.parse().map_err(|_| err(i + 1, "icmp type is a number"))?,
                    c.parse().map_err(|_| err(i + 1, "icmp code is a number"))?,
                ));
            }
            _ => return Err(err(i, &format!("unknown word `{key}`"))),
        }
        i += 2;
    }
    Ok(p)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn full_spec() {
        let p = parse_packet_spec("tcp 198.51.100.10:40000 -> 10.10.10.2:22 in eth0 out cali1 mark 0x4000 state established").unwrap();
        assert_eq!(p.proto, 6);
        assert_eq!(p.sport, Some(40000));
        assert_eq!(p.dport, Some(22));
        assert_eq!(p.in_iface.as_deref(), Some("eth0"));
        assert_eq!(p.out_iface.as_deref(), Some("cali1"));
        assert_eq!(p.mark, 0x4000);
        assert_eq!(p.ct_state, CtState::Established);
        assert_eq!(p.tcp_flags(), TCP_ACK);
    }

    #[test]
    fn ipv6_and_icmp() {
        let p = parse_packet_spec("udp [2001:db8::1]:53 -> [2001:db8::2]:80").unwrap();
        assert!(p.is_v6());
        assert_eq!(p.dport, Some(80));
        let p = parse_packet_spec("icmp 10.0.0.1 -> 10.0.0.2 in eth0 type 0").unwrap();
        assert_eq!(p.icmp, Some((0, 0)));
        assert_eq!(p.sport, None);
    }

    #[test]
    fn errors_name_the_word() {
        assert_eq!(
            parse_packet_spec("tcp 1.2.3.4:1 => 1.2.3.5:2")
                .unwrap_err()
                .word,
            3
        );
        assert_eq!(
            parse_packet_spec("tcp 1.2.3.4 -> 1.2.3.5:2")
                .unwrap_err()
                .word,
            2
        );
        assert_eq!(
            parse_packet_spec("icmp 1.2.3.4:5 -> 1.2.3.5")
                .unwrap_err()
                .word,
            2
        );
        assert_eq!(
            parse_packet_spec("udp 1.2.3.4:1 -> 1.2.3.5:2 in")
                .unwrap_err()
                .word,
            5
        );
        assert_eq!(
            parse_packet_spec("udp 1.2.3.4:1 -> [::1]:2")
                .unwrap_err()
                .word,
            4
        );
        assert_eq!(parse_packet_spec("bogus").unwrap_err().word, 1);
        assert_eq!(parse_packet_spec("").unwrap_err().word, 1);
    }
}
