//! Crafted probe packets for the kernel-judged tests: one IPv4/IPv6 packet (UDP datagram, TCP
//! SYN or ICMP echo request, checksums filled so conntrack accepts it) sent with a raw socket
//! from the calling thread's namespace, so every probe is exactly one packet with a chosen
//! source port.

use std::net::IpAddr;

/// What to send. For ICMP, `sport` is the echo id and `dport` is unused.
#[derive(Clone, Copy, Debug)]
pub struct RawProbe {
    /// 17 (UDP), 6 (TCP SYN), 1 or 58 (ICMP echo request).
    pub proto: u8,
    pub src: IpAddr,
    pub dst: IpAddr,
    pub sport: u16,
    pub dport: u16,
}

fn csum(data: &[u8], mut sum: u32) -> u16 {
    for c in data.chunks(2) {
        let w = if c.len() == 2 {
            u16::from_be_bytes([c[0], c[1]])
        } else {
            u16::from(c[0]) << 8
        };
        sum += u32::from(w);
    }
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    !(sum as u16)
}

/// An IPv4 or IPv6 packet with a UDP datagram, a TCP SYN or an ICMP echo request, checksums
/// filled so conntrack accepts it.
pub fn build(p: &RawProbe) -> Vec<u8> {
    let (src, dst): (Vec<u8>, Vec<u8>) = match (p.src, p.dst) {
        (IpAddr::V4(s), IpAddr::V4(d)) => (s.octets().into(), d.octets().into()),
        (IpAddr::V6(s), IpAddr::V6(d)) => (s.octets().into(), d.octets().into()),
        _ => panic!("mixed families"),
    };
    let v6 = p.src.is_ipv6();
    let mut l4: Vec<u8> = match p.proto {
        1 | 58 => {
            let mut e = vec![if v6 { 128u8 } else { 8 }, 0, 0, 0];
            e.extend_from_slice(&p.sport.to_be_bytes());
            e.extend_from_slice(&1u16.to_be_bytes());
            e.extend_from_slice(b"obsv");
            e
        }
        17 => {
            let mut u = vec![0u8; 8 + 4];
            u[0..2].copy_from_slice(&p.sport.to_be_bytes());
            u[2..4].copy_from_slice(&p.dport.to_be_bytes());
            u[4..6].copy_from_slice(&12u16.to_be_bytes());
            u[8..12].copy_from_slice(b"obsv");
            u
        }
        _ => {
            let mut t = vec![0u8; 20];
            t[0..2].copy_from_slice(&p.sport.to_be_bytes());
            t[2..4].copy_from_slice(&p.dport.to_be_bytes());
            t[4..8].copy_from_slice(&1u32.to_be_bytes());
            t[12] = 5 << 4;
            t[13] = 0x02; // SYN
            t[14..16].copy_from_slice(&64240u16.to_be_bytes());
            t
        }
    };
    // ICMPv4 has no pseudo header; UDP, TCP and ICMPv6 do.
    let at = match p.proto {
        1 | 58 => 2,
        17 => 6,
        _ => 16,
    };
    let c = if p.proto == 1 {
        csum(&l4, 0)
    } else {
        let mut pseudo = Vec::new();
        pseudo.extend_from_slice(&src);
        pseudo.extend_from_slice(&dst);
        if v6 {
            pseudo.extend_from_slice(&(l4.len() as u32).to_be_bytes());
            pseudo.extend_from_slice(&[0, 0, 0, p.proto]);
        } else {
            pseudo.extend_from_slice(&[0, p.proto]);
            pseudo.extend_from_slice(&(l4.len() as u16).to_be_bytes());
        }
        pseudo.extend_from_slice(&l4);
        csum(&pseudo, 0)
    };
    l4[at..at + 2].copy_from_slice(&c.to_be_bytes());
    let mut ip = if v6 {
        let mut h = vec![0u8; 40];
        h[0] = 0x60;
        h[4..6].copy_from_slice(&(l4.len() as u16).to_be_bytes());
        h[6] = p.proto;
        h[7] = 64;
        h[8..24].copy_from_slice(&src);
        h[24..40].copy_from_slice(&dst);
        h
    } else {
        let mut h = vec![0u8; 20];
        h[0] = 0x45;
        h[2..4].copy_from_slice(&((20 + l4.len()) as u16).to_be_bytes());
        h[6] = 0x40; // DF
        h[8] = 64;
        h[9] = p.proto;
        h[12..16].copy_from_slice(&src);
        h[16..20].copy_from_slice(&dst);
        let hc = csum(&h, 0);
        h[10..12].copy_from_slice(&hc.to_be_bytes());
        h
    };
    ip.extend_from_slice(&l4);
    ip
}

/// Sends one crafted packet from the calling thread's namespace with a raw socket.
pub fn send_raw(p: &RawProbe) {
    let pkt = build(p);
    // SAFETY: plain socket syscalls on a fd we own; the sockaddrs are fully initialised.
    // IPPROTO_RAW sockets send the header we built (IP_HDRINCL / IPV6_HDRINCL implied).
    unsafe {
        let (n, err) = match p.dst {
            IpAddr::V4(d) => {
                let fd = libc::socket(libc::AF_INET, libc::SOCK_RAW, libc::IPPROTO_RAW);
                assert!(fd >= 0, "raw socket: {}", std::io::Error::last_os_error());
                let mut sa: libc::sockaddr_in = std::mem::zeroed();
                sa.sin_family = libc::AF_INET as libc::sa_family_t;
                sa.sin_addr.s_addr = u32::from(d).to_be();
                let n = libc::sendto(
                    fd,
                    pkt.as_ptr().cast(),
                    pkt.len(),
                    0,
                    (&raw const sa).cast(),
                    std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t,
                );
                let err = std::io::Error::last_os_error();
                libc::close(fd);
                (n, err)
            }
            IpAddr::V6(d) => {
                let fd = libc::socket(libc::AF_INET6, libc::SOCK_RAW, libc::IPPROTO_RAW);
                assert!(fd >= 0, "raw socket: {}", std::io::Error::last_os_error());
                let mut sa: libc::sockaddr_in6 = std::mem::zeroed();
                sa.sin6_family = libc::AF_INET6 as libc::sa_family_t;
                sa.sin6_addr.s6_addr = d.octets();
                let n = libc::sendto(
                    fd,
                    pkt.as_ptr().cast(),
                    pkt.len(),
                    0,
                    (&raw const sa).cast(),
                    std::mem::size_of::<libc::sockaddr_in6>() as libc::socklen_t,
                );
                let err = std::io::Error::last_os_error();
                libc::close(fd);
                (n, err)
            }
        };
        // EPERM is a local OUTPUT drop by the ruleset under test, which is a valid outcome.
        assert!(
            n == pkt.len() as isize || err.raw_os_error() == Some(libc::EPERM),
            "sendto: {err}"
        );
    }
}
