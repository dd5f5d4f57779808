//! IPVS's table of virtual services and real servers, read from `ipvsadm -Sn` (the form
//! `ipvsadm-restore` reads back), and the kernel's lookup of the virtual service a packet
//! reaches (`ip_vs_service_find` in net/netfilter/ipvs/ip_vs_ctl.c): the fwmark services
//! first, by the packet's whole mark; then protocol, address and port; then, for persistent
//! services, port 0 (the catch-all). Names follow `ipvsadm -Ln`: `TCP  10.96.0.10:53 rr`,
//! forwarding methods `Masq`, `Route`, `Tunnel`, `Local`.

use std::fmt;
use std::net::IpAddr;

use crate::error::ParseError;

/// How IPVS addresses a virtual service.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum ServiceKey {
    /// `-t`, `-u` or `--sctp-service` ADDR:PORT (port 0: every port, persistent services).
    Addr { proto: u8, addr: IpAddr, port: u16 },
    /// `-f MARK` (`-6` for IPv6): packets whose mark equals it, whatever their address.
    Fwmark { mark: u32, v6: bool },
}

/// A real server's forwarding method (`-m`, `-g`, `-i`), as `ipvsadm -Ln` names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Forward {
    /// Masquerading (NAT): the destination is rewritten and IPVS sends the packet itself.
    Masq,
    /// Direct routing (gatewaying): the packet goes unchanged to the real server's link address.
    Route,
    /// IP-in-IP tunnelling: the packet goes encapsulated to the real server.
    Tunnel,
}

impl Forward {
    pub fn name(self) -> &'static str {
        match self {
            Forward::Masq => "Masq",
            Forward::Route => "Route",
            Forward::Tunnel => "Tunnel",
        }
    }
}

/// One `-a` line: a real server of a virtual service.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct RealServer {
    pub addr: IpAddr,
    /// None for fwmark services whose real server was given without a port (the packet's own
    /// port is kept).
    pub port: Option<u16>,
    pub forward: Forward,
    /// 0 is quiescent: no new connections are scheduled to it.
    pub weight: u32,
}

impl RealServer {
    /// `172.17.0.5:22`, `[fd00::5]:80`, as `ipvsadm -Ln` writes the address.
    pub fn endpoint(&self) -> String {
        fmt_addr_port(self.addr, self.port.unwrap_or(0))
    }
}

/// One `-A` line with its real servers.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct VirtualService {
    pub key: ServiceKey,
    /// `-s`: rr, wrr, lc, wlc, lblc, lblcr, dh, sh, sed, nq, fo, ovf, mh, twos.
    pub scheduler: String,
    /// `-p`: persistence timeout in seconds.
    pub persistent: Option<u32>,
    /// `-M`: the persistence netmask (prefix length for IPv6), as given.
    pub netmask: Option<String>,
    /// `-b`: scheduler flags, as given.
    pub sched_flags: Option<String>,
    /// `-o`: one-packet scheduling (UDP).
    pub one_packet: bool,
    pub real_servers: Vec<RealServer>,
}

impl VirtualService {
    /// `TCP  10.96.0.10:53 rr` (`persistent 10800` when persistent), as `ipvsadm -Ln`.
    pub fn name(&self) -> String {
        let mut s = match &self.key {
            ServiceKey::Addr { proto, addr, port } => {
                format!("{}  {}", proto_name(*proto), fmt_addr_port(*addr, *port))
            }
            ServiceKey::Fwmark { mark, v6 } => {
                format!("FWM  {mark}{}", if *v6 { " IPv6" } else { "" })
            }
        };
        s.push(' ');
        s.push_str(&self.scheduler);
        if let Some(p) = self.persistent {
            s.push_str(&format!(" persistent {p}"));
        }
        if let Some(m) = &self.netmask {
            s.push_str(&format!(" mask {m}"));
        }
        s
    }

    /// The real servers a new connection can be scheduled to (weight above 0).
    pub fn candidates(&self) -> impl Iterator<Item = &RealServer> {
        self.real_servers.iter().filter(|r| r.weight > 0)
    }
}

impl fmt::Display for VirtualService {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.name())
    }
}

/// The node's IPVS table.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
pub struct IpvsTable {
    pub services: Vec<VirtualService>,
    /// `net.ipv4.vs.conntrack` (None: not read; kube-proxy sets it to 1).
    pub conntrack: Option<bool>,
}

impl IpvsTable {
    pub fn is_empty(&self) -> bool {
        self.services.is_empty()
    }

    /// The virtual service a packet reaches, in the kernel's order (`ip_vs_service_find`):
    /// an fwmark service equal to the packet's mark, then protocol/address/port, then the
    /// port-0 service of that address. Only TCP, UDP and SCTP are scheduled.
    pub fn lookup(
        &self,
        proto: u8,
        dst: IpAddr,
        dport: Option<u16>,
        mark: u32,
    ) -> Option<&VirtualService> {
        if !matches!(proto, 6 | 17 | 132) {
            return None;
        }
        let v6 = dst.is_ipv6();
        if mark != 0
            && let Some(s) = self
                .services
                .iter()
                .find(|s| s.key == ServiceKey::Fwmark { mark, v6 })
        {
            return Some(s);
        }
        let port = dport?;
        let by = |port: u16| {
            self.services.iter().find(|s| {
                s.key
                    == ServiceKey::Addr {
                        proto,
                        addr: dst,
                        port,
                    }
            })
        };
        by(port).or_else(|| by(0))
    }

    /// Whether `addr` is a virtual service's address (`kube-ipvs0`'s addresses, usually).
    pub fn is_virtual_addr(&self, addr: IpAddr) -> bool {
        self.services
            .iter()
            .any(|s| matches!(s.key, ServiceKey::Addr { addr: a, .. } if a == addr))
    }
}

pub fn proto_name(proto: u8) -> &'static str {
    match proto {
        6 => "TCP",
        17 => "UDP",
        132 => "SCTP",
        _ => "?",
    }
}

fn fmt_addr_port(addr: IpAddr, port: u16) -> String {
    match addr {
        IpAddr::V4(a) => format!("{a}:{port}"),
        IpAddr::V6(a) => format!("[{a}]:{port}"),
    }
}

/// `ADDR:PORT` or `[ADDR6]:PORT` (`ADDR` alone when `port_optional`).
fn parse_addr_port(s: &str, port_optional: bool) -> Result<(IpAddr, Option<u16>), String> {
    let numeric = "run `ipvsadm -Sn` (numeric: names are not resolved here)";
    let (host, port) = if let Some(rest) = s.strip_prefix('[') {
        let (h, after) = rest
            .split_once(']')
            .ok_or_else(|| format!("`{s}`: `[` without `]`"))?;
        (h, after.strip_prefix(':'))
    } else if s.matches(':').count() > 1 {
        // A bare IPv6 address: ipvsadm brackets it when it has a port.
        (s, None)
    } else {
        match s.split_once(':') {
            Some((h, p)) => (h, Some(p)),
            None => (s, None),
        }
    };
    let addr: IpAddr = host
        .parse()
        .map_err(|_| format!("`{host}` is not an IP address; {numeric}"))?;
    let port = match port {
        Some(p) => Some(
            p.parse::<u16>()
                .map_err(|_| format!("`{p}` is not a port number; {numeric}"))?,
        ),
        None if port_optional => None,
        None => return Err(format!("`{s}` has no port")),
    };
    Ok((addr, port))
}

/// Reads `ipvsadm -Sn` (`-S` alone prints names, which are refused with what to run
/// instead). Real servers belong to the virtual service their `-a` names, which must have
/// been added by an earlier `-A`.
pub fn parse_ipvsadm_save(text: &str) -> Result<IpvsTable, ParseError> {
    let mut table = IpvsTable::default();
    for (n, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let err = |m: String| ParseError::new(n + 1, 1, m);
        let words: Vec<&str> = line.split_whitespace().collect();
        match words[0] {
            "-A" | "--add-service" => {
                let svc = parse_service(&words[1..]).map_err(err)?;
                if table.services.iter().any(|s| s.key == svc.key) {
                    return Err(err(format!("virtual service {} added twice", svc.name())));
                }
                table.services.push(svc);
            }
            "-a" | "--add-server" => {
                let (key, rs) = parse_server(&words[1..]).map_err(err)?;
                let svc = table
                    .services
                    .iter_mut()
                    .find(|s| s.key == key)
                    .ok_or_else(|| {
                        err(
                            "real server of a virtual service not added before (`-A` line missing)"
                                .into(),
                        )
                    })?;
                svc.real_servers.push(rs);
            }
            w => {
                return Err(err(format!(
                    "`{w}`: expected `-A` (virtual service) or `-a` (real server), as `ipvsadm -Sn` prints"
                )));
            }
        }
    }
    Ok(table)
}

/// The service options every line starts with: `-t|-u|--sctp-service ADDR:PORT` or
/// `-f MARK [-6]`; returns the key and the words it did not use.
fn parse_key<'w>(words: &'w [&'w str]) -> Result<(ServiceKey, Vec<&'w str>), String> {
    let mut key = None;
    let mut v6 = false;
    let mut rest = Vec::new();
    let mut it = words.iter().copied();
    while let Some(w) = it.next() {
        let proto = match w {
            "-t" | "--tcp-service" => Some(6),
            "-u" | "--udp-service" => Some(17),
            "--sctp-service" => Some(132),
            "-f" | "--fwmark-service" => None,
            "-6" | "--ipv6" => {
                v6 = true;
                continue;
            }
            _ => {
                rest.push(w);
                continue;
            }
        };
        let v = it.next().ok_or_else(|| format!("`{w}` without a value"))?;
        key = Some(match proto {
            Some(proto) => {
                let (addr, port) = parse_addr_port(v, false)?;
                ServiceKey::Addr {
                    proto,
                    addr,
                    port: port.unwrap_or(0),
                }
            }
            None => ServiceKey::Fwmark {
                mark: crate::net::parse_u32(v)
                    .ok_or_else(|| format!("`{v}` is not a firewall mark"))?,
                v6: false,
            },
        });
    }
    let mut key = key.ok_or("no virtual service (`-t`, `-u`, `--sctp-service` or `-f`)")?;
    if let ServiceKey::Fwmark { v6: f, .. } = &mut key {
        *f = v6;
    }
    Ok((key, rest))
}

fn parse_service(words: &[&str]) -> Result<VirtualService, String> {
    let (key, rest) = parse_key(words)?;
    let mut svc = VirtualService {
        key,
        scheduler: "wlc".into(), // ipvsadm's default
        persistent: None,
        netmask: None,
        sched_flags: None,
        one_packet: false,
        real_servers: Vec::new(),
    };
    let mut it = rest.into_iter().peekable();
    while let Some(w) = it.next() {
        match w {
            "-s" | "--scheduler" => {
                svc.scheduler = it.next().ok_or("`-s` without a scheduler")?.to_string();
            }
            "-p" | "--persistent" => {
                // The timeout is optional (ipvsadm's default is 300 s).
                let t = it.next_if(|v| v.bytes().all(|b| b.is_ascii_digit()));
                svc.persistent = Some(match t {
                    Some(t) => t.parse().map_err(|_| format!("`{t}`: bad timeout"))?,
                    None => 300,
                });
            }
            "-M" | "--netmask" => {
                svc.netmask = Some(it.next().ok_or("`-M` without a netmask")?.to_string());
            }
            "-b" | "--sched-flags" => {
                svc.sched_flags = Some(it.next().ok_or("`-b` without flags")?.to_string());
            }
            "-o" | "--ops" => svc.one_packet = true,
            "--pe" => {
                it.next();
            }
            w => return Err(format!("`{w}`: not a virtual service option")),
        }
    }
    Ok(svc)
}

fn parse_server(words: &[&str]) -> Result<(ServiceKey, RealServer), String> {
    let (key, rest) = parse_key(words)?;
    let mut server = None;
    let mut forward = Forward::Route; // ipvsadm's default (-g)
    let mut weight = 1;
    let mut it = rest.into_iter();
    while let Some(w) = it.next() {
        match w {
            "-r" | "--real-server" => {
                let v = it.next().ok_or("`-r` without an address")?;
                server = Some(parse_addr_port(v, true)?);
            }
            "-m" | "--masquerading" => forward = Forward::Masq,
            "-g" | "--gatewaying" => forward = Forward::Route,
            "-i" | "--ipip" => forward = Forward::Tunnel,
            "-w" | "--weight" => {
                let v = it.next().ok_or("`-w` without a weight")?;
                weight = v.parse().map_err(|_| format!("`{v}`: bad weight"))?;
            }
            "-x" | "--u-threshold" | "-y" | "--l-threshold" | "--tun-type" | "--tun-port" => {
                it.next();
            }
            "--tun-nocsum" | "--tun-csum" | "--tun-remcsum" => {}
            w => return Err(format!("`{w}`: not a real server option")),
        }
    }
    let (addr, port) = server.ok_or("real server line without `-r`")?;
    // A real server of an address service without a port takes the service's port.
    let port = port.or(match &key {
        ServiceKey::Addr { port, .. } => Some(*port),
        ServiceKey::Fwmark { .. } => None,
    });
    Ok((
        key,
        RealServer {
            addr,
            port,
            forward,
            weight,
        },
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    const KUBE: &str = "\
-A -t 10.96.0.1:443 -s rr
-a -t 10.96.0.1:443 -r 172.18.0.2:6443 -m -w 1
-A -u 10.96.0.10:53 -s rr
-a -u 10.96.0.10:53 -r 10.244.0.3:53 -m -w 1
-a -u 10.96.0.10:53 -r 10.244.1.4:53 -m -w 0
-A -t 10.10.10.2:22 -s sh -p 10800
-a -t 10.10.10.2:22 -r 172.17.0.5:22 -m -w 1
-a -t 10.10.10.2:22 -r 172.17.1.7:22 -m -w 2
-A -f 7 -s wrr
-a -f 7 -r 192.168.5.1 -g -w 3
-A -f 8 -6 -s rr
-A -t [fd00:10::2]:80 -s rr
-a -t [fd00:10::2]:80 -r [fd00:20::5]:8080 -i -w 1
-A --sctp-service 10.96.0.30:9999 -s lc -o
";

    #[test]
    fn reads_kube_proxy_save() {
        let t = parse_ipvsadm_save(KUBE).unwrap();
        assert_eq!(t.services.len(), 7);
        let dns = &t.services[1];
        assert_eq!(dns.name(), "UDP  10.96.0.10:53 rr");
        assert_eq!(dns.real_servers.len(), 2);
        assert_eq!(dns.candidates().count(), 1, "weight 0 is quiescent");
        let ssh = &t.services[2];
        assert_eq!(ssh.name(), "TCP  10.10.10.2:22 sh persistent 10800");
        assert_eq!(ssh.real_servers[1].weight, 2);
        assert_eq!(ssh.real_servers[1].forward, Forward::Masq);
        let fw = &t.services[3];
        assert_eq!(fw.key, ServiceKey::Fwmark { mark: 7, v6: false });
        assert_eq!(fw.real_servers[0].port, None);
        assert_eq!(fw.real_servers[0].forward, Forward::Route);
        assert_eq!(t.services[4].key, ServiceKey::Fwmark { mark: 8, v6: true });
        assert_eq!(t.services[4].name(), "FWM  8 IPv6 rr");
        let v6 = &t.services[5];
        assert_eq!(v6.name(), "TCP  [fd00:10::2]:80 rr");
        assert_eq!(v6.real_servers[0].endpoint(), "[fd00:20::5]:8080");
        assert_eq!(v6.real_servers[0].forward, Forward::Tunnel);
        assert!(t.services[6].one_packet);
        assert_eq!(t.services[6].name(), "SCTP  10.96.0.30:9999 lc");
    }

    #[test]
    fn looks_up_in_the_kernels_order() {
        let t = parse_ipvsadm_save(KUBE).unwrap();
        let a = |s: &str| s.parse::<IpAddr>().unwrap();
        let tcp22 = t.lookup(6, a("10.10.10.2"), Some(22), 0).unwrap();
        assert_eq!(tcp22.scheduler, "sh");
        // The protocol is part of the key.
        assert!(t.lookup(17, a("10.10.10.2"), Some(22), 0).is_none());
        assert!(t.lookup(6, a("10.10.10.2"), Some(23), 0).is_none());
        // An fwmark service wins over the address, by the whole mark.
        assert_eq!(
            t.lookup(6, a("10.10.10.2"), Some(22), 7).unwrap().key,
            ServiceKey::Fwmark { mark: 7, v6: false }
        );
        assert_eq!(
            t.lookup(6, a("10.10.10.2"), Some(22), 0x4007)
                .unwrap()
                .scheduler,
            "sh"
        );
        // ICMP is not scheduled.
        assert!(t.lookup(1, a("10.10.10.2"), None, 7).is_none());
        // IPv6 marks reach only the IPv6 fwmark service.
        assert_eq!(
            t.lookup(17, a("fd00::9"), Some(53), 8).unwrap().key,
            ServiceKey::Fwmark { mark: 8, v6: true }
        );
        assert!(t.lookup(17, a("fd00::9"), Some(53), 7).is_none());
    }

    #[test]
    fn port_zero_is_the_catch_all() {
        let t = parse_ipvsadm_save(
            "-A -t 10.0.0.1:0 -s rr -p\n-a -t 10.0.0.1:0 -r 10.1.0.1:0 -g -w 1\n",
        )
        .unwrap();
        let s = t
            .lookup(6, "10.0.0.1".parse().unwrap(), Some(8080), 0)
            .unwrap();
        assert_eq!(s.persistent, Some(300));
    }

    #[test]
    fn errors_say_what_to_do() {
        let e = parse_ipvsadm_save("-A -t kube-dns.local:53 -s rr\n").unwrap_err();
        assert_eq!(e.line, 1);
        assert!(e.message.contains("ipvsadm -Sn"), "{e}");
        let e = parse_ipvsadm_save("-a -t 10.0.0.1:80 -r 10.1.0.1:80 -m\n").unwrap_err();
        assert!(e.message.contains("`-A` line missing"), "{e}");
        let e = parse_ipvsadm_save("TCP  10.0.0.1:80 rr\n").unwrap_err();
        assert!(e.message.contains("ipvsadm -Sn"), "{e}");
        let e = parse_ipvsadm_save("-A -t 10.0.0.1:80 -s rr -z\n").unwrap_err();
        assert!(e.message.contains("-z"), "{e}");
    }
}
