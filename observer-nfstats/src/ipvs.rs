//! IPVS's virtual services and real servers with their own statistics, read through IPVS's
//! generic netlink family (`"IPVS"`, `include/uapi/linux/ip_vs.h`) as `ipvsadm -Ln --stats`
//! reads them: the family's id from `nlctrl` (`CTRL_CMD_GETFAMILY`), an
//! `IPVS_CMD_GET_SERVICE` dump, then an `IPVS_CMD_GET_DEST` dump per virtual service.
//!
//! Where the kernel has no IPVS (`CONFIG_IP_VS` unset, or `ip_vs` not loaded) the family
//! does not exist and [`Reader::open`] says so with `None`: nothing to count, not an error.
//! Parsing is pure and unit-tested from bytes; only [`Reader`] touches the kernel.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use crate::Error;
use crate::netlink::{self, Attrs, encode_attr, encode_nest, genl_message};

/// What a missing family means, for the caller's log line.
pub const ABSENT: &str = "no IPVS in this kernel (no \"IPVS\" generic netlink family: \
                          CONFIG_IP_VS is not set, or the ip_vs module is not loaded)";

const GENL_HDRLEN: usize = 4;
const GENL_ID_CTRL: u16 = 0x10;
const CTRL_CMD_GETFAMILY: u8 = 3;
const CTRL_VERSION: u8 = 2;
const CTRL_ATTR_FAMILY_ID: u16 = 1;
const CTRL_ATTR_FAMILY_NAME: u16 = 2;

const IPVS_GENL_NAME: &str = "IPVS";
const IPVS_GENL_VERSION: u8 = 1;
const IPVS_CMD_GET_SERVICE: u8 = 4;
const IPVS_CMD_GET_DEST: u8 = 8;
const IPVS_CMD_ATTR_SERVICE: u16 = 1;
const IPVS_CMD_ATTR_DEST: u16 = 2;

const SVC_AF: u16 = 1;
const SVC_PROTOCOL: u16 = 2;
const SVC_ADDR: u16 = 3;
const SVC_PORT: u16 = 4;
const SVC_FWMARK: u16 = 5;
const SVC_SCHED_NAME: u16 = 6;
const SVC_FLAGS: u16 = 7;
const SVC_TIMEOUT: u16 = 8;
const SVC_STATS: u16 = 10;
const SVC_PE_NAME: u16 = 11;
const SVC_STATS64: u16 = 12;

const DEST_ADDR: u16 = 1;
const DEST_PORT: u16 = 2;
const DEST_FWD_METHOD: u16 = 3;
const DEST_WEIGHT: u16 = 4;
const DEST_ACTIVE_CONNS: u16 = 7;
const DEST_INACT_CONNS: u16 = 8;
const DEST_PERSIST_CONNS: u16 = 9;
const DEST_STATS: u16 = 10;
const DEST_ADDR_FAMILY: u16 = 11;
const DEST_STATS64: u16 = 12;

const STATS_CONNS: u16 = 1;
const STATS_INPKTS: u16 = 2;
const STATS_OUTPKTS: u16 = 3;
const STATS_INBYTES: u16 = 4;
const STATS_OUTBYTES: u16 = 5;

const AF_INET: u16 = libc::AF_INET as u16;
const AF_INET6: u16 = libc::AF_INET6 as u16;
/// `IP_VS_SVC_F_PERSISTENT`.
const F_PERSISTENT: u32 = 1;

/// How a virtual service is found: by protocol, address and port, or by firewall mark.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum VirtualKey {
    Addr { proto: u8, addr: IpAddr, port: u16 },
    Fwmark { v6: bool, mark: u32 },
}

impl VirtualKey {
    /// `tcp`, `udp`, `sctp` (or the number); `fwmark` for a firewall-mark service.
    pub fn protocol(&self) -> String {
        match self {
            Self::Addr { proto, .. } => proto_name(*proto),
            Self::Fwmark { .. } => "fwmark".into(),
        }
    }

    /// `10.96.0.10:53`, `[fd00::1]:443`, or `fwmark 0x5` (`ipvsadm -Ln`'s `FWM  5`).
    pub fn address(&self) -> String {
        match self {
            Self::Addr { addr, port, .. } => endpoint(*addr, *port),
            Self::Fwmark { mark, .. } => format!("fwmark {mark:#x}"),
        }
    }
}

pub fn proto_name(p: u8) -> String {
    match p {
        6 => "tcp".into(),
        17 => "udp".into(),
        132 => "sctp".into(),
        n => n.to_string(),
    }
}

/// `addr:port`, the address bracketed when it is IPv6.
pub fn endpoint(addr: IpAddr, port: u16) -> String {
    match addr {
        IpAddr::V4(a) => format!("{a}:{port}"),
        IpAddr::V6(a) => format!("[{a}]:{port}"),
    }
}

/// IPVS's counters of a virtual service or real server (`ipvsadm -Ln --stats --exact`),
/// since it was made.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Stats {
    /// Connections scheduled.
    pub conns: u64,
    pub in_packets: u64,
    pub out_packets: u64,
    pub in_bytes: u64,
    pub out_bytes: u64,
}

/// A real server's forwarding method, as `ipvsadm -Ln` names it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Forward {
    Masq,
    Local,
    Tunnel,
    Route,
    Bypass,
    Other(u32),
}

impl Forward {
    fn from_kernel(v: u64) -> Self {
        match v {
            0 => Self::Masq,
            1 => Self::Local,
            2 => Self::Tunnel,
            3 => Self::Route,
            4 => Self::Bypass,
            n => Self::Other(n as u32),
        }
    }

    pub fn name(self) -> String {
        match self {
            Self::Masq => "Masq".into(),
            Self::Local => "Local".into(),
            Self::Tunnel => "Tunnel".into(),
            Self::Route => "Route".into(),
            Self::Bypass => "Bypass".into(),
            Self::Other(n) => n.to_string(),
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RealServer {
    pub addr: IpAddr,
    pub port: u16,
    pub forward: Forward,
    pub weight: u32,
    /// Connection entries, as `ipvsadm -Ln`'s ActiveConn and InActConn.
    pub active: u32,
    pub inactive: u32,
    pub persistent: u32,
    pub stats: Stats,
}

impl RealServer {
    /// `172.17.0.5:22`, as `ipvsadm -Ln` writes it.
    pub fn endpoint(&self) -> String {
        endpoint(self.addr, self.port)
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VirtualService {
    pub key: VirtualKey,
    pub scheduler: String,
    /// The persistence engine (`sip`), if any.
    pub pe: Option<String>,
    /// `IP_VS_SVC_F_*`.
    pub flags: u32,
    /// Persistence timeout in seconds (0: not persistent).
    pub timeout: u32,
    pub stats: Stats,
    pub real_servers: Vec<RealServer>,
}

impl VirtualService {
    pub fn persistent(&self) -> bool {
        self.flags & F_PERSISTENT != 0
    }
}

/// The family id in `CTRL_CMD_GETFAMILY`'s answer (its payload: `genlmsghdr`, attributes).
pub fn parse_family_id(payload: &[u8]) -> Option<u16> {
    let id = Attrs(payload.get(GENL_HDRLEN..)?).get(CTRL_ATTR_FAMILY_ID)?;
    u16::try_from(id.uint()?).ok()
}

fn addr_of(af: u16, value: &[u8]) -> Option<IpAddr> {
    match af {
        AF_INET => Some(IpAddr::V4(Ipv4Addr::from(
            <[u8; 4]>::try_from(value.get(..4)?).ok()?,
        ))),
        AF_INET6 => Some(IpAddr::V6(Ipv6Addr::from(
            <[u8; 16]>::try_from(value.get(..16)?).ok()?,
        ))),
        _ => None,
    }
}

/// `IPVS_*_ATTR_STATS64` (every counter 64 bits) or, from kernels before it, `_STATS`
/// (packets and connections 32 bits): read by each attribute's length.
fn parse_stats(attrs: Attrs<'_>) -> Stats {
    let get = |k| attrs.get(k).and_then(|a| a.uint()).unwrap_or(0);
    Stats {
        conns: get(STATS_CONNS),
        in_packets: get(STATS_INPKTS),
        out_packets: get(STATS_OUTPKTS),
        in_bytes: get(STATS_INBYTES),
        out_bytes: get(STATS_OUTBYTES),
    }
}

fn stats_of(attrs: Attrs<'_>, stats64: u16, stats32: u16) -> Stats {
    attrs
        .get(stats64)
        .or_else(|| attrs.get(stats32))
        .map(|a| parse_stats(a.nested()))
        .unwrap_or_default()
}

/// One message of the `IPVS_CMD_GET_SERVICE` dump (its payload: `genlmsghdr`, then
/// `IPVS_CMD_ATTR_SERVICE`), without real servers. None for a service of an address
/// family this reader does not know.
pub fn parse_service(payload: &[u8]) -> Result<Option<VirtualService>, Error> {
    let attrs = Attrs(
        payload
            .get(GENL_HDRLEN..)
            .ok_or(Error::Malformed("IPVS service message"))?,
    );
    let svc = attrs
        .get(IPVS_CMD_ATTR_SERVICE)
        .ok_or(Error::Malformed(
            "IPVS service without IPVS_CMD_ATTR_SERVICE",
        ))?
        .nested();
    let af = svc
        .get(SVC_AF)
        .and_then(|a| a.uint())
        .ok_or(Error::Malformed("IPVS service without its address family"))? as u16;
    let key = if let Some(mark) = svc.get(SVC_FWMARK).and_then(|a| a.uint()) {
        VirtualKey::Fwmark {
            v6: af == AF_INET6,
            mark: mark as u32,
        }
    } else {
        let proto = svc
            .get(SVC_PROTOCOL)
            .and_then(|a| a.uint())
            .ok_or(Error::Malformed("IPVS service without its protocol"))?;
        let Some(addr) = svc.get(SVC_ADDR).and_then(|a| addr_of(af, a.value)) else {
            return Ok(None);
        };
        let port = svc
            .get(SVC_PORT)
            .and_then(|a| a.be16())
            .ok_or(Error::Malformed("IPVS service without its port"))?;
        VirtualKey::Addr {
            proto: proto as u8,
            addr,
            port,
        }
    };
    let flags = svc
        .get(SVC_FLAGS)
        // struct ip_vs_flags { flags, mask }: the flags first.
        .and_then(|a| Some(u32::from_ne_bytes(a.value.get(..4)?.try_into().ok()?)))
        .unwrap_or(0);
    Ok(Some(VirtualService {
        key,
        scheduler: svc.get(SVC_SCHED_NAME).map(|a| a.str()).unwrap_or_default(),
        pe: svc.get(SVC_PE_NAME).map(|a| a.str()),
        flags,
        timeout: svc.get(SVC_TIMEOUT).and_then(|a| a.uint()).unwrap_or(0) as u32,
        stats: stats_of(svc, SVC_STATS64, SVC_STATS),
        real_servers: Vec::new(),
    }))
}

/// One message of the `IPVS_CMD_GET_DEST` dump of a service whose addresses are IPv6 when
/// `v6` (a real server says its own family since Linux 4.8; before, the service's).
pub fn parse_dest(payload: &[u8], v6: bool) -> Result<Option<RealServer>, Error> {
    let attrs = Attrs(
        payload
            .get(GENL_HDRLEN..)
            .ok_or(Error::Malformed("IPVS real server message"))?,
    );
    let d = attrs
        .get(IPVS_CMD_ATTR_DEST)
        .ok_or(Error::Malformed(
            "IPVS real server without IPVS_CMD_ATTR_DEST",
        ))?
        .nested();
    let af = d
        .get(DEST_ADDR_FAMILY)
        .and_then(|a| a.uint())
        .map_or(if v6 { AF_INET6 } else { AF_INET }, |a| a as u16);
    let Some(addr) = d.get(DEST_ADDR).and_then(|a| addr_of(af, a.value)) else {
        return Ok(None);
    };
    let n = |k| d.get(k).and_then(|a| a.uint()).unwrap_or(0);
    Ok(Some(RealServer {
        addr,
        port: d
            .get(DEST_PORT)
            .and_then(|a| a.be16())
            .ok_or(Error::Malformed("IPVS real server without its port"))?,
        forward: Forward::from_kernel(n(DEST_FWD_METHOD)),
        weight: n(DEST_WEIGHT) as u32,
        active: n(DEST_ACTIVE_CONNS) as u32,
        inactive: n(DEST_INACT_CONNS) as u32,
        persistent: n(DEST_PERSIST_CONNS) as u32,
        stats: stats_of(d, DEST_STATS64, DEST_STATS),
    }))
}

/// The `IPVS_CMD_ATTR_SERVICE` that names `key` in a request (the kernel finds the service
/// by family and mark, or by family, protocol, address and port).
pub fn service_selector(key: &VirtualKey) -> Vec<u8> {
    let inner = match *key {
        VirtualKey::Fwmark { v6, mark } => vec![
            encode_attr(SVC_AF, &(if v6 { AF_INET6 } else { AF_INET }).to_ne_bytes()),
            encode_attr(SVC_FWMARK, &mark.to_ne_bytes()),
        ],
        VirtualKey::Addr { proto, addr, port } => {
            let (af, bytes) = match addr {
                IpAddr::V4(a) => {
                    let mut b = [0u8; 16];
                    b[..4].copy_from_slice(&a.octets());
                    (AF_INET, b)
                }
                IpAddr::V6(a) => (AF_INET6, a.octets()),
            };
            vec![
                encode_attr(SVC_AF, &af.to_ne_bytes()),
                encode_attr(SVC_PROTOCOL, &u16::from(proto).to_ne_bytes()),
                encode_attr(SVC_ADDR, &bytes),
                encode_attr(SVC_PORT, &port.to_be_bytes()),
            ]
        }
    };
    encode_nest(IPVS_CMD_ATTR_SERVICE, &inner)
}

/// Reads IPVS's table through its generic netlink family, in the calling thread's network
/// namespace (IPVS's services are per namespace).
pub struct Reader {
    sock: netlink::Socket,
    family: u16,
}

impl Reader {
    /// A reader where the kernel has IPVS; `Ok(None)` where it has none ([`ABSENT`]).
    pub fn open() -> Result<Option<Self>, Error> {
        let mut sock = netlink::Socket::generic()?;
        let name = encode_attr(
            CTRL_ATTR_FAMILY_NAME,
            format!("{IPVS_GENL_NAME}\0").as_bytes(),
        );
        let answer = sock.ask(|seq| {
            genl_message(
                GENL_ID_CTRL,
                netlink::REQUEST,
                CTRL_CMD_GETFAMILY,
                CTRL_VERSION,
                seq,
                &name,
            )
        });
        match answer {
            Ok(payload) => {
                let family = parse_family_id(&payload)
                    .ok_or(Error::Malformed("nlctrl's answer has no family id"))?;
                Ok(Some(Self { sock, family }))
            }
            Err(Error::Kernel(e)) if e.raw_os_error() == Some(libc::ENOENT) => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// Every virtual service of the namespace with its real servers. A service removed
    /// between the two dumps is given without real servers.
    pub fn read(&mut self) -> Result<Vec<VirtualService>, Error> {
        let family = self.family;
        let mut payloads = Vec::new();
        self.sock.dump_with(
            |seq| {
                genl_message(
                    family,
                    netlink::DUMP,
                    IPVS_CMD_GET_SERVICE,
                    IPVS_GENL_VERSION,
                    seq,
                    &[],
                )
            },
            |m| {
                if m.kind == family {
                    payloads.push(m.payload.to_vec());
                }
            },
        )?;
        let mut services = Vec::with_capacity(payloads.len());
        for p in payloads {
            if let Some(s) = parse_service(&p)? {
                services.push(s);
            }
        }
        for s in &mut services {
            let selector = service_selector(&s.key);
            let v6 = match s.key {
                VirtualKey::Addr { addr, .. } => addr.is_ipv6(),
                VirtualKey::Fwmark { v6, .. } => v6,
            };
            let mut dests = Vec::new();
            self.sock.dump_with(
                |seq| {
                    genl_message(
                        family,
                        netlink::DUMP,
                        IPVS_CMD_GET_DEST,
                        IPVS_GENL_VERSION,
                        seq,
                        &selector,
                    )
                },
                |m| {
                    if m.kind == family {
                        dests.push(m.payload.to_vec());
                    }
                },
            )?;
            for d in dests {
                if let Some(rs) = parse_dest(&d, v6)? {
                    s.real_servers.push(rs);
                }
            }
        }
        Ok(services)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::netlink::tests::{attr, nest};

    fn genl(cmd: u8, attrs: &[Vec<u8>]) -> Vec<u8> {
        let mut p = vec![cmd, 1, 0, 0];
        p.extend(attrs.concat());
        p
    }

    fn u16a(k: u16, v: u16) -> Vec<u8> {
        attr(k, &v.to_ne_bytes())
    }
    fn u32a(k: u16, v: u32) -> Vec<u8> {
        attr(k, &v.to_ne_bytes())
    }
    fn u64a(k: u16, v: u64) -> Vec<u8> {
        attr(k, &v.to_ne_bytes())
    }

    fn addr4(a: [u8; 4]) -> Vec<u8> {
        let mut b = vec![0; 16];
        b[..4].copy_from_slice(&a);
        b
    }

    /// Stats as the kernel nests them: 32-bit ones, then the 64-bit ones (with a pad
    /// attribute, as `nla_put_u64_64bit` may add).
    fn stats(conns: u64, inp: u64, outp: u64, inb: u64, outb: u64) -> [Vec<u8>; 2] {
        [
            nest(
                SVC_STATS,
                &[
                    u32a(1, conns as u32),
                    u32a(2, inp as u32),
                    u32a(3, outp as u32),
                    u64a(4, inb),
                    u64a(5, outb),
                    u32a(6, 9),
                ],
            ),
            nest(
                SVC_STATS64,
                &[
                    attr(11, &[]),
                    u64a(1, conns),
                    u64a(2, inp),
                    u64a(3, outp),
                    u64a(4, inb),
                    u64a(5, outb),
                    u64a(6, 9),
                ],
            ),
        ]
    }

    fn service_message() -> Vec<u8> {
        let [s32, s64] = stats(5_000_000_000, 12, 10, 900, 800);
        genl(
            1, // IPVS_CMD_NEW_SERVICE
            &[nest(
                IPVS_CMD_ATTR_SERVICE,
                &[
                    u16a(SVC_AF, AF_INET),
                    u16a(SVC_PROTOCOL, 6),
                    attr(SVC_ADDR, &addr4([10, 10, 10, 2])),
                    attr(SVC_PORT, &22u16.to_be_bytes()),
                    attr(SVC_SCHED_NAME, b"rr\0"),
                    attr(SVC_FLAGS, &[2, 0, 0, 0, 0xff, 0xff, 0xff, 0xff]),
                    u32a(SVC_TIMEOUT, 0),
                    attr(9, &[255, 255, 255, 255]),
                    s32,
                    s64,
                ],
            )],
        )
    }

    #[test]
    fn a_service_with_its_64_bit_stats() {
        let s = parse_service(&service_message()).unwrap().unwrap();
        assert_eq!(
            s.key,
            VirtualKey::Addr {
                proto: 6,
                addr: "10.10.10.2".parse().unwrap(),
                port: 22
            }
        );
        assert_eq!(
            (s.key.protocol(), s.key.address()),
            ("tcp".into(), "10.10.10.2:22".into())
        );
        assert_eq!(s.scheduler, "rr");
        assert!(!s.persistent());
        assert_eq!(
            s.stats,
            Stats {
                conns: 5_000_000_000,
                in_packets: 12,
                out_packets: 10,
                in_bytes: 900,
                out_bytes: 800
            },
            "STATS64 wins over the 32-bit STATS"
        );
    }

    #[test]
    fn older_kernels_stats_and_fwmark_services() {
        let p = genl(
            1,
            &[nest(
                IPVS_CMD_ATTR_SERVICE,
                &[
                    u16a(SVC_AF, AF_INET6),
                    u32a(SVC_FWMARK, 5),
                    attr(SVC_SCHED_NAME, b"wlc\0"),
                    attr(SVC_FLAGS, &[1, 0, 0, 0, 0xff, 0xff, 0xff, 0xff]),
                    u32a(SVC_TIMEOUT, 300),
                    stats(3, 4, 5, 6, 7)[0].clone(),
                ],
            )],
        );
        let s = parse_service(&p).unwrap().unwrap();
        assert_eq!(s.key, VirtualKey::Fwmark { v6: true, mark: 5 });
        assert_eq!(s.key.address(), "fwmark 0x5");
        assert!(s.persistent());
        assert_eq!(s.timeout, 300);
        assert_eq!(s.stats.conns, 3);
        assert_eq!(s.stats.out_bytes, 7);
    }

    #[test]
    fn a_real_server() {
        let [s32, s64] = stats(7, 21, 14, 1500, 1200);
        let p = genl(
            5, // IPVS_CMD_NEW_DEST
            &[nest(
                IPVS_CMD_ATTR_DEST,
                &[
                    attr(DEST_ADDR, &addr4([172, 17, 0, 5])),
                    attr(DEST_PORT, &22u16.to_be_bytes()),
                    u32a(DEST_FWD_METHOD, 0),
                    u32a(DEST_WEIGHT, 1),
                    attr(13, &[0]),
                    attr(14, &0u16.to_be_bytes()),
                    u16a(15, 0),
                    u32a(5, 0),
                    u32a(6, 0),
                    u32a(DEST_ACTIVE_CONNS, 2),
                    u32a(DEST_INACT_CONNS, 3),
                    u32a(DEST_PERSIST_CONNS, 0),
                    u16a(DEST_ADDR_FAMILY, AF_INET),
                    // STATS under DEST_STATS (10), STATS64 under DEST_STATS64 (12): the
                    // same numbers as the service's.
                    s32,
                    s64,
                ],
            )],
        );
        let rs = parse_dest(&p, false).unwrap().unwrap();
        assert_eq!(rs.endpoint(), "172.17.0.5:22");
        assert_eq!(rs.forward, Forward::Masq);
        assert_eq!(rs.forward.name(), "Masq");
        assert_eq!((rs.weight, rs.active, rs.inactive), (1, 2, 3));
        assert_eq!(rs.stats.conns, 7);
        assert_eq!(rs.stats.in_packets, 21);
        assert_eq!(rs.stats.out_bytes, 1200);
        // Without its own family (before Linux 4.8): the service's.
        let p6 = genl(
            5,
            &[nest(
                IPVS_CMD_ATTR_DEST,
                &[
                    attr(
                        DEST_ADDR,
                        &"2001:db8::5".parse::<Ipv6Addr>().unwrap().octets(),
                    ),
                    attr(DEST_PORT, &80u16.to_be_bytes()),
                    u32a(DEST_FWD_METHOD, 3),
                ],
            )],
        );
        let rs = parse_dest(&p6, true).unwrap().unwrap();
        assert_eq!(rs.endpoint(), "[2001:db8::5]:80");
        assert_eq!(rs.forward, Forward::Route);
    }

    #[test]
    fn malformed_messages_say_so() {
        assert!(matches!(
            parse_service(&genl(1, &[])),
            Err(Error::Malformed(_))
        ));
        assert!(matches!(
            parse_dest(&[1, 2], false),
            Err(Error::Malformed(_))
        ));
    }

    #[test]
    fn the_family_id_and_the_selector_the_kernel_reads() {
        let answer = genl(1, &[u16a(CTRL_ATTR_FAMILY_ID, 0x23), attr(2, b"IPVS\0")]);
        assert_eq!(parse_family_id(&answer), Some(0x23));
        // The selector holds what ip_vs_genl_parse_service needs: family, protocol,
        // a 16-byte address and the port in network order.
        let key = VirtualKey::Addr {
            proto: 17,
            addr: "10.10.10.10".parse().unwrap(),
            port: 53,
        };
        let sel = service_selector(&key);
        let outer: Vec<_> = Attrs(&sel).into_iter().collect();
        assert_eq!(outer.len(), 1);
        assert_eq!(outer[0].kind, IPVS_CMD_ATTR_SERVICE);
        let inner = outer[0].nested();
        assert_eq!(inner.get(SVC_AF).unwrap().uint(), Some(u64::from(AF_INET)));
        assert_eq!(inner.get(SVC_PROTOCOL).unwrap().uint(), Some(17));
        assert_eq!(
            inner.get(SVC_ADDR).unwrap().value,
            &addr4([10, 10, 10, 10])[..]
        );
        assert_eq!(inner.get(SVC_PORT).unwrap().be16(), Some(53));
        // A whole dump request, as split reads it back.
        let req = genl_message(0x23, netlink::DUMP, IPVS_CMD_GET_DEST, 1, 7, &sel);
        let (msgs, _) = netlink::split(&req).unwrap();
        assert_eq!(msgs[0].kind, 0x23);
        assert_eq!(msgs[0].payload[0], IPVS_CMD_GET_DEST);
    }
}
