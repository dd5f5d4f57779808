//! What the kernel put on the wire: VXLAN frames captured with a packet socket (the kernel's
//! own view, as tcpdump's) on an interface of a namespace, outer and inner headers read.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use serde_json::Value;

/// One VXLAN frame: outer addresses, UDP ports and IPv4 ID, the VNI, and the inner
/// packet's protocol, addresses, ports and IPv4 ID.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VxlanFrame {
    pub outer_src: String,
    pub outer_dst: String,
    pub outer_ip_id: u16,
    pub vni: u32,
    pub inner_proto: &'static str,
    pub inner_src: String,
    pub inner_dst: String,
    pub inner_ip_id: u16,
}

impl VxlanFrame {
    /// The frame a tunnel carrier's report (`encap` set) says it was: the report's packet
    /// is the outer one, its IPv4 IDs as the report carries them (`--ip-ids`, or an agent's
    /// `ip_id=1`).
    pub fn of_carrier(r: &Value) -> Self {
        let e = &r["encap"];
        let s = |v: &Value| {
            v.as_str()
                .unwrap_or_else(|| panic!("not a carrier's report: {r:#}"))
                .to_string()
        };
        let id = |v: &Value| {
            u16::try_from(v.as_u64().unwrap_or_else(|| panic!("no IPv4 ID: {r:#}"))).unwrap()
        };
        VxlanFrame {
            outer_src: s(&e["outer_src"]),
            outer_dst: s(&e["outer_dst"]),
            outer_ip_id: id(&r["packet"]["ip_id"]),
            vni: e["vni"].as_u64().unwrap() as u32,
            inner_proto: match e["inner"]["proto"].as_str() {
                Some("tcp") => "tcp",
                Some("udp") => "udp",
                _ => "other",
            },
            inner_src: s(&e["inner"]["src"]),
            inner_dst: s(&e["inner"]["dst"]),
            inner_ip_id: id(&e["inner_ip_id"]),
        }
    }
}

/// Reads an Ethernet frame as VXLAN over IPv4/UDP port 4789 carrying IPv4; `None` for
/// anything else.
pub fn parse_vxlan(f: &[u8]) -> Option<VxlanFrame> {
    // Ethernet (14), IPv4 (ihl), UDP (8), VXLAN (8), inner Ethernet (14), inner IPv4.
    if f.len() < 14 + 20 || f[12..14] != [0x08, 0x00] {
        return None;
    }
    let ip = &f[14..];
    let ihl = usize::from(ip[0] & 0x0f) * 4;
    if ip[9] != 17 || ip.len() < ihl + 8 + 8 + 14 + 24 {
        return None;
    }
    let udp = &ip[ihl..];
    if u16::from_be_bytes([udp[2], udp[3]]) != 4789 {
        return None;
    }
    let vx = &udp[8..];
    let inner = &vx[8 + 14..];
    if inner[0] >> 4 != 4 {
        return None;
    }
    let iihl = usize::from(inner[0] & 0x0f) * 4;
    let addr = |b: &[u8]| format!("{}.{}.{}.{}", b[0], b[1], b[2], b[3]);
    let port = |b: &[u8], at: usize| u16::from_be_bytes([b[at], b[at + 1]]);
    let l4 = inner.get(iihl..iihl + 4)?;
    Some(VxlanFrame {
        outer_src: format!("{}:{}", addr(&ip[12..16]), port(udp, 0)),
        outer_dst: format!("{}:{}", addr(&ip[16..20]), port(udp, 2)),
        outer_ip_id: port(ip, 4),
        vni: (u32::from(vx[4]) << 16) | (u32::from(vx[5]) << 8) | u32::from(vx[6]),
        inner_proto: match inner[9] {
            6 => "tcp",
            17 => "udp",
            _ => "other",
        },
        inner_src: format!("{}:{}", addr(&inner[12..16]), port(l4, 0)),
        inner_dst: format!("{}:{}", addr(&inner[16..20]), port(l4, 2)),
        inner_ip_id: port(inner, 4),
    })
}

/// Captures every VXLAN frame on `iface` of the namespace at `netns` (a path such as
/// `/var/run/netns/NAME`) until `stop` is set or `within` passes; returns once the socket
/// is bound, so that nothing sent after it is missed.
pub fn capture_vxlan(
    netns: PathBuf,
    iface: &str,
    stop: Arc<AtomicBool>,
    within: Duration,
) -> JoinHandle<Vec<VxlanFrame>> {
    let (tx, rx) = std::sync::mpsc::channel();
    let iface = iface.to_string();
    let h = std::thread::spawn(move || {
        crate::enter_netns(&netns);
        // SAFETY: plain socket calls on a descriptor this thread owns and closes.
        unsafe {
            let proto = (libc::ETH_P_ALL as u16).to_be();
            let fd = libc::socket(libc::AF_PACKET, libc::SOCK_RAW, i32::from(proto));
            assert!(
                fd >= 0,
                "packet socket: {}",
                std::io::Error::last_os_error()
            );
            let name = std::ffi::CString::new(iface).unwrap();
            let mut sll: libc::sockaddr_ll = std::mem::zeroed();
            sll.sll_family = libc::AF_PACKET as u16;
            sll.sll_protocol = proto;
            sll.sll_ifindex = libc::if_nametoindex(name.as_ptr()) as i32;
            let bound = libc::bind(
                fd,
                (&raw const sll).cast(),
                std::mem::size_of::<libc::sockaddr_ll>() as u32,
            );
            assert_eq!(bound, 0, "bind: {}", std::io::Error::last_os_error());
            let tv = libc::timeval {
                tv_sec: 0,
                tv_usec: 100_000,
            };
            libc::setsockopt(
                fd,
                libc::SOL_SOCKET,
                libc::SO_RCVTIMEO,
                (&raw const tv).cast(),
                std::mem::size_of::<libc::timeval>() as u32,
            );
            tx.send(()).unwrap();
            let deadline = Instant::now() + within;
            let mut frames = Vec::new();
            let mut buf = [0u8; 2048];
            while !stop.load(Ordering::Relaxed) && Instant::now() < deadline {
                let n = libc::recv(fd, buf.as_mut_ptr().cast(), buf.len(), 0);
                if n > 0
                    && let Some(f) = parse_vxlan(&buf[..n as usize])
                {
                    frames.push(f);
                }
            }
            libc::close(fd);
            frames
        }
    });
    rx.recv_timeout(within).expect("capture started");
    h
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A VXLAN frame as the two-node lab's node puts it on its underlay: every field read
    /// from its place.
    #[test]
    fn a_vxlan_frame_is_read_outer_and_inner() {
        let mut f = vec![0u8; 12];
        f.extend([0x08, 0x00]);
        // Outer IPv4: id 0x1234, UDP, 192.168.60.1 -> 192.168.60.2.
        f.extend([0x45, 0, 0, 0, 0x12, 0x34, 0, 0, 64, 17, 0, 0]);
        f.extend([192, 168, 60, 1, 192, 168, 60, 2]);
        // UDP 40000 -> 4789, then VXLAN with VNI 1.
        f.extend([0x9c, 0x40, 0x12, 0xb5, 0, 0, 0, 0]);
        f.extend([0x08, 0, 0, 0, 0, 0, 1, 0]);
        f.extend([0u8; 12]);
        f.extend([0x08, 0x00]);
        // Inner IPv4: id 0xbeef, UDP, 10.244.0.5:39009 -> 10.244.1.5:9.
        f.extend([0x45, 0, 0, 0, 0xbe, 0xef, 0, 0, 63, 17, 0, 0]);
        f.extend([10, 244, 0, 5, 10, 244, 1, 5]);
        f.extend([0x98, 0x61, 0, 9, 0, 8, 0, 0]);
        let v = parse_vxlan(&f).unwrap();
        assert_eq!(
            v,
            VxlanFrame {
                outer_src: "192.168.60.1:40000".into(),
                outer_dst: "192.168.60.2:4789".into(),
                outer_ip_id: 0x1234,
                vni: 1,
                inner_proto: "udp",
                inner_src: "10.244.0.5:39009".into(),
                inner_dst: "10.244.1.5:9".into(),
                inner_ip_id: 0xbeef,
            }
        );
        // Another UDP port is not VXLAN.
        let mut other = f.clone();
        other[14 + 20 + 3] = 0xb6;
        assert_eq!(parse_vxlan(&other), None);
    }
}
