//! The probes' packet parser, shared by the TC and the netfilter programs and unit-tested
//! on the host: the IP header, IPv6 extension headers, the transport ports (or ICMP id and
//! type) and TCP flags, and the packet an ICMP error quotes. Each program says how to read
//! bytes of its packet ([`PacketReader`]); everything else is here, once.
//!
//! Runs inside eBPF programs: constant loop bounds, checked indices, no panics, every
//! function `#[inline(always)]`.

use crate::{PacketEvent, flags};

/// Reads bytes of one packet, at offsets from its network header.
pub trait PacketReader {
    /// `N` bytes at `off`, if the packet has them.
    fn bytes<const N: usize>(&self, off: usize) -> Option<[u8; N]>;
}

/// The IP header at `off`: 20 bytes for IPv4 (zero-padded to 40), 40 for IPv6. Read 20 first:
/// a read past the end of a short packet fails.
#[inline(always)]
pub fn ip_header_at<P: PacketReader>(p: &P, off: usize) -> Option<[u8; 40]> {
    let v4: [u8; 20] = p.bytes(off)?;
    match v4[0] >> 4 {
        4 => {
            let mut hdr = [0u8; 40];
            let mut i = 0;
            while i < 20 {
                hdr[i] = v4[i];
                i += 1;
            }
            Some(hdr)
        }
        6 => p.bytes(off),
        _ => None,
    }
}

/// Parses the packet whose network header starts with `hdr` (as [`ip_header_at`] gives it)
/// into `ev`: addresses, protocol, ports or ICMP id/type/code, TCP flags, fragment flags, and
/// the quoted packet of an ICMP error. `None` when the extension headers cannot be read.
#[inline(always)]
pub fn parse_headers<P: PacketReader>(p: &P, hdr: &[u8; 40], ev: &mut PacketEvent) -> Option<()> {
    let Some(ihl) = parse_l3(hdr, ev) else {
        return Some(());
    };
    let ihl = if ev.packet.ip_version == 6 {
        skip_ipv6_ext(ev, ihl, |at| p.bytes::<4>(at))?
    } else {
        ihl
    };
    if ev.header.flags & flags::NO_L4 != 0 {
        return Some(());
    }
    // 16 bytes reach TCP's flags; other transports need 8 (and a short datagram may not
    // have 16).
    let l4 = if ev.packet.l4proto == 6 {
        p.bytes::<16>(ihl)
    } else {
        p.bytes::<8>(ihl).map(|b| {
            let mut l4 = [0u8; 16];
            let mut i = 0;
            while i < 8 {
                l4[i] = b[i];
                i += 1;
            }
            l4
        })
    };
    match l4 {
        Some(l4) => parse_l4(&l4, ev),
        None => ev.header.flags |= flags::NO_L4,
    }
    // Where a packet inside this one starts: the quoted packet after the 8-byte ICMP header,
    // or the encapsulated one after VXLAN's UDP (8), VXLAN (8) and inner Ethernet (14)
    // headers. One parse for both keeps the programs small.
    let vxlan = is_vxlan(ev);
    let at = if vxlan {
        match p.bytes::<8>(ihl + 8) {
            // The I flag: the VNI is valid (RFC 7348); anything else is not VXLAN.
            Some(v) if v[0] & 0x08 != 0 => {
                ev.inner.vni = [v[4], v[5], v[6]];
                Some(ihl + 30)
            }
            _ => None,
        }
    } else if is_icmp_error(ev) {
        Some(ihl + 8)
    } else {
        None
    };
    if let Some(at) = at
        && let Some(inner) = ip_header_at(p, at)
        && let Some(inner_ihl) = parse_inner(&inner, ev)
    {
        if vxlan {
            ev.header.flags |= flags::ENCAP;
        }
        if let Some(ports) = p.bytes::<4>(at + inner_ihl) {
            parse_inner_ports(&ports, ev);
        }
    }
    Some(())
}

/// UDP ports VXLAN is received on: IANA's 4789 (Calico, Cilium, flannel's `Port` set to
/// it) and 8472 (the Linux kernel's historical default, flannel's default).
pub const VXLAN_PORTS: [u16; 2] = [4789, 8472];

/// Whether `ev` is UDP to a VXLAN port (its VXLAN header is checked by the caller).
#[inline(always)]
pub fn is_vxlan(ev: &PacketEvent) -> bool {
    ev.packet.l4proto == 17
        && ev.header.flags & flags::NO_L4 == 0
        && (ev.packet.dport == VXLAN_PORTS[0] || ev.packet.dport == VXLAN_PORTS[1])
}

/// The VNI `parse_headers` kept in `ev.inner.vni`.
#[inline(always)]
pub fn vni_of(vni: [u8; 3]) -> u32 {
    (u32::from(vni[0]) << 16) | (u32::from(vni[1]) << 8) | u32::from(vni[2])
}

/// Reads an IPv4 or IPv6 header: fills `saddr`/`daddr` (IPv4 in the first 4 bytes) and
/// returns (version, protocol, header length). Shared by the packet and the packet an ICMP
/// error quotes.
#[inline(always)]
fn ip_header(
    hdr: &[u8; 40],
    saddr: &mut [u8; 16],
    daddr: &mut [u8; 16],
) -> Option<(u8, u8, usize)> {
    match hdr[0] >> 4 {
        4 => {
            saddr[..4].copy_from_slice(&hdr[12..16]);
            daddr[..4].copy_from_slice(&hdr[16..20]);
            Some((4, hdr[9], ((hdr[0] & 0x0f) as usize) * 4))
        }
        6 => {
            saddr.copy_from_slice(&hdr[8..24]);
            // daddr spans bytes 24..40.
            let mut i = 0;
            while i < 16 {
                daddr[i] = hdr[24 + i];
                i += 1;
            }
            Some((6, hdr[6], 40))
        }
        _ => None,
    }
}

/// An IPv4 header's identification | [`crate::IP_ID_READ`]; 0 for IPv6 (no such field
/// outside its fragment header).
#[inline(always)]
fn ip_id(version: u8, hdr: &[u8; 40]) -> u32 {
    if version == 4 {
        u32::from(u16::from_be_bytes([hdr[4], hdr[5]])) | crate::IP_ID_READ
    } else {
        0
    }
}

/// Parses an IPv4 or IPv6 header from `hdr` (at least 40 bytes of the network header) into
/// `ev`; returns the header length.
#[inline(always)]
pub fn parse_l3(hdr: &[u8; 40], ev: &mut PacketEvent) -> Option<usize> {
    let p = &mut ev.packet;
    let Some((version, proto, ihl)) = ip_header(hdr, &mut p.saddr, &mut p.daddr) else {
        ev.header.flags |= flags::NO_L3;
        return None;
    };
    p.ip_version = version;
    p.l4proto = proto;
    p.ip_id = ip_id(version, hdr);
    if version == 4 {
        let frag = u16::from_be_bytes([hdr[6], hdr[7]]);
        // Non-first fragments carry no L4 header.
        if frag & 0x1fff != 0 {
            ev.header.flags |= flags::NO_L4;
        }
        if frag & 0x3fff != 0 {
            ev.header.flags |= flags::FRAGMENT;
        }
    }
    Some(ihl)
}

/// Walks IPv6 extension headers (hop-by-hop, routing, destination options, fragment; at
/// most four) from `off`, the end of the fixed header, so that `l4proto` and the returned
/// L4 offset are the transport's. `read4(off)` returns 4 bytes of the packet at `off`.
#[inline(always)]
pub fn skip_ipv6_ext(
    ev: &mut PacketEvent,
    mut off: usize,
    read4: impl Fn(usize) -> Option<[u8; 4]>,
) -> Option<usize> {
    let mut i = 0;
    while i < 4 {
        match ev.packet.l4proto {
            0 | 43 | 60 => {
                let h = read4(off)?;
                ev.packet.l4proto = h[0];
                off += (h[1] as usize + 1) * 8;
            }
            44 => {
                let h = read4(off)?;
                ev.packet.l4proto = h[0];
                ev.header.flags |= flags::FRAGMENT;
                // A non-zero fragment offset: no transport header in this fragment.
                if u16::from_be_bytes([h[2], h[3]]) & 0xfff8 != 0 {
                    ev.header.flags |= flags::NO_L4;
                }
                off += 8;
            }
            _ => return Some(off),
        }
        i += 1;
    }
    Some(off)
}

/// Whether the ICMP(v6) message `ev` carries quotes a packet (an error message).
#[inline(always)]
pub fn is_icmp_error(ev: &PacketEvent) -> bool {
    let t = (ev.packet.dport >> 8) as u8;
    match ev.packet.l4proto {
        1 => matches!(t, 3 | 4 | 5 | 11 | 12),
        58 => matches!(t, 1..=4),
        _ => false,
    }
}

/// Fills `ev.inner` from the quoted IP header (`hdr`, at least 20/40 bytes of it) and the
/// first 4 bytes after it (`ports`, read by the caller at the returned offset).
#[inline(always)]
pub fn parse_inner(hdr: &[u8; 40], ev: &mut PacketEvent) -> Option<usize> {
    let i = &mut ev.inner;
    let (version, proto, ihl) = ip_header(hdr, &mut i.saddr, &mut i.daddr)?;
    i.l4proto = proto;
    i.ip_id = ip_id(version, hdr);
    ev.header.flags |= flags::INNER;
    Some(ihl)
}

/// Fills the quoted packet's ports from the 4 bytes after its IP header.
#[inline(always)]
pub fn parse_inner_ports(ports: &[u8; 4], ev: &mut PacketEvent) {
    if matches!(ev.inner.l4proto, 6 | 17 | 132) {
        ev.inner.sport = u16::from_be_bytes([ports[0], ports[1]]);
        ev.inner.dport = u16::from_be_bytes([ports[2], ports[3]]);
    }
}

/// Fills ports (or ICMP id/type/code) and TCP flags from the first 16 bytes of L4.
#[inline(always)]
pub fn parse_l4(l4: &[u8; 16], ev: &mut PacketEvent) {
    let p = &mut ev.packet;
    match p.l4proto {
        6 => {
            p.sport = u16::from_be_bytes([l4[0], l4[1]]);
            p.dport = u16::from_be_bytes([l4[2], l4[3]]);
            p.tcp_flags = l4[13];
        }
        17 | 132 | 136 => {
            p.sport = u16::from_be_bytes([l4[0], l4[1]]);
            p.dport = u16::from_be_bytes([l4[2], l4[3]]);
        }
        1 | 58 => {
            p.dport = u16::from_be_bytes([l4[0], l4[1]]);
            p.sport = u16::from_be_bytes([l4[4], l4[5]]);
        }
        _ => ev.header.flags |= flags::NO_L4,
    }
}

#[cfg(test)]
mod tests {
    extern crate std;
    use std::vec::Vec;

    use super::*;

    struct Bytes(Vec<u8>);

    impl PacketReader for Bytes {
        fn bytes<const N: usize>(&self, off: usize) -> Option<[u8; N]> {
            self.0.get(off..off + N)?.try_into().ok()
        }
    }

    fn ipv4(proto: u8, src: [u8; 4], dst: [u8; 4], payload: &[u8]) -> Vec<u8> {
        let mut p = std::vec![0x45, 0, 0, 0, 0, 0, 0, 0, 64, proto, 0, 0];
        p.extend(src);
        p.extend(dst);
        p.extend(payload);
        p
    }

    fn parse(p: &[u8]) -> (PacketEvent, Option<()>) {
        let b = Bytes(p.to_vec());
        let mut ev = PacketEvent::default();
        let r = match ip_header_at(&b, 0) {
            Some(hdr) => parse_headers(&b, &hdr, &mut ev),
            None => None,
        };
        (ev, r)
    }

    #[test]
    fn the_ipv4_identification_is_read_and_said_read_even_when_zero() {
        let udp = [0x9c, 0x40, 0x14, 0xe9, 0, 8, 0, 0];
        let mut p = ipv4(17, [1, 1, 1, 1], [2, 2, 2, 2], &udp);
        p[4..6].copy_from_slice(&0xbeefu16.to_be_bytes());
        let (ev, _) = parse(&p);
        assert_eq!(ev.packet.ip_id, 0xbeef | crate::IP_ID_READ);
        p[4..6].copy_from_slice(&[0, 0]);
        assert_eq!(parse(&p).0.packet.ip_id, crate::IP_ID_READ);
        // IPv6: none.
        let mut v6 = std::vec![0x60, 0, 0, 0, 0, 8, 17, 64];
        v6.extend([0u8; 32]);
        v6.extend(udp);
        let (ev, _) = parse(&v6);
        assert_eq!((ev.packet.ip_version, ev.packet.ip_id), (6, 0));
    }

    #[test]
    fn tcp_ports_and_flags() {
        let mut tcp = std::vec![0u8; 20];
        tcp[0..2].copy_from_slice(&40000u16.to_be_bytes());
        tcp[2..4].copy_from_slice(&22u16.to_be_bytes());
        tcp[13] = 0x02;
        let (ev, r) = parse(&ipv4(6, [10, 0, 0, 1], [10, 0, 0, 2], &tcp));
        assert!(r.is_some());
        assert_eq!(
            (ev.packet.sport, ev.packet.dport, ev.packet.tcp_flags),
            (40000, 22, 2)
        );
        assert_eq!(&ev.packet.daddr[..4], &[10, 0, 0, 2]);
        assert_eq!(ev.header.flags & (flags::NO_L3 | flags::NO_L4), 0);
    }

    #[test]
    fn a_short_udp_datagram_is_read_with_eight_bytes() {
        // 20 + 8 bytes: a 16-byte read past the end would fail.
        let udp = [0x9c, 0x40, 0x14, 0xe9, 0, 8, 0, 0];
        let (ev, _) = parse(&ipv4(17, [1, 1, 1, 1], [2, 2, 2, 2], &udp));
        assert_eq!((ev.packet.sport, ev.packet.dport), (40000, 5353));
        assert_eq!(ev.header.flags & flags::NO_L4, 0);
    }

    #[test]
    fn ipv6_hop_by_hop_is_walked_to_udp() {
        let mut p = std::vec![0x60, 0, 0, 0, 0, 16, 0, 64];
        p.extend([0x20, 0x01, 0x0d, 0xb8].iter().chain(&[0; 12]));
        p.extend([0x20, 0x01, 0x0d, 0xb8].iter().chain(&[0; 11]).chain(&[1]));
        // Hop-by-hop (8 bytes, next: UDP), then UDP.
        p.extend([17, 0, 1, 4, 0, 0, 0, 0]);
        p.extend([0x9c, 0x40, 0x14, 0xe9, 0, 8, 0, 0]);
        let (ev, r) = parse(&p);
        assert!(r.is_some());
        assert_eq!(ev.packet.ip_version, 6);
        assert_eq!(ev.packet.l4proto, 17);
        assert_eq!((ev.packet.sport, ev.packet.dport), (40000, 5353));
    }

    /// A VXLAN datagram to `port` (UDP, the VXLAN header with `flags`, VNI 0x123456, an
    /// Ethernet header) carrying a TCP segment 10.244.0.5:40000 -> 10.244.1.5:8080.
    fn vxlan(port: u16, flags: u8) -> Vec<u8> {
        let mut tcp = std::vec![0u8; 20];
        tcp[0..2].copy_from_slice(&40000u16.to_be_bytes());
        tcp[2..4].copy_from_slice(&8080u16.to_be_bytes());
        let inner = ipv4(6, [10, 244, 0, 5], [10, 244, 1, 5], &tcp);
        let mut udp = std::vec![0xc2, 0x6e];
        udp.extend(port.to_be_bytes());
        udp.extend([0, 0, 0, 0]);
        udp.extend([flags, 0, 0, 0, 0x12, 0x34, 0x56, 0]);
        udp.extend([
            0x0a, 0x58, 0x0a, 0xf4, 1, 0, 0x0a, 0x58, 0x0a, 0xf4, 0, 0, 0x08, 0,
        ]);
        udp.extend(inner);
        ipv4(17, [192, 168, 60, 1], [192, 168, 60, 2], &udp)
    }

    #[test]
    fn a_vxlan_packet_carries_its_inner_packet_and_vni() {
        for port in VXLAN_PORTS {
            let (ev, r) = parse(&vxlan(port, 0x08));
            assert!(r.is_some());
            assert_eq!(
                ev.header.flags & (flags::INNER | flags::ENCAP),
                flags::INNER | flags::ENCAP
            );
            assert_eq!((ev.packet.sport, ev.packet.dport), (0xc26e, port));
            assert_eq!(&ev.packet.daddr[..4], &[192, 168, 60, 2]);
            let i = &ev.inner;
            assert_eq!(
                (&i.saddr[..4], &i.daddr[..4]),
                (&[10, 244, 0, 5][..], &[10, 244, 1, 5][..])
            );
            assert_eq!((i.l4proto, i.sport, i.dport), (6, 40000, 8080));
            assert_eq!(vni_of(i.vni), 0x123456);
        }
    }

    #[test]
    fn udp_to_a_vxlan_port_without_the_i_flag_or_elsewhere_is_not_vxlan() {
        let (ev, _) = parse(&vxlan(4789, 0));
        assert_eq!(ev.header.flags & (flags::INNER | flags::ENCAP), 0);
        let (ev, _) = parse(&vxlan(4790, 0x08));
        assert_eq!(ev.header.flags & (flags::INNER | flags::ENCAP), 0);
        // Cut inside the inner IP header: the VXLAN header alone says nothing inside.
        let mut short = vxlan(4789, 0x08);
        short.truncate(20 + 8 + 8 + 14 + 10);
        let (ev, _) = parse(&short);
        assert_eq!(ev.header.flags & (flags::INNER | flags::ENCAP), 0);
    }

    #[test]
    fn an_icmp_error_quotes_its_packet() {
        let quoted = ipv4(
            17,
            [10, 0, 0, 2],
            [10, 0, 0, 1],
            &[0x9c, 0x40, 0, 9, 0, 8, 0, 0],
        );
        let mut icmp = std::vec![3, 3, 0, 0, 0, 0, 0, 0];
        icmp.extend(&quoted);
        let (ev, _) = parse(&ipv4(1, [10, 0, 0, 1], [10, 0, 0, 2], &icmp));
        assert!(is_icmp_error(&ev));
        assert_ne!(ev.header.flags & flags::INNER, 0);
        assert_eq!(ev.inner.l4proto, 17);
        assert_eq!((ev.inner.sport, ev.inner.dport), (40000, 9));
        assert_eq!(&ev.inner.saddr[..4], &[10, 0, 0, 2]);
    }

    #[test]
    fn a_later_fragment_has_no_transport_header() {
        let mut p = ipv4(17, [1, 1, 1, 1], [2, 2, 2, 2], &[0; 8]);
        p[6..8].copy_from_slice(&185u16.to_be_bytes());
        let (ev, _) = parse(&p);
        assert_ne!(ev.header.flags & flags::FRAGMENT, 0);
        assert_ne!(ev.header.flags & flags::NO_L4, 0);
        assert_eq!(ev.packet.sport, 0);
    }

    #[test]
    fn not_ip_is_refused() {
        assert!(parse(&[0u8; 40]).1.is_none());
        assert!(parse(&[0x45, 0, 0]).1.is_none());
    }
}
