//! Conntrack events over ctnetlink (no BPF): each new connection once, with its NAT and
//! ctmark, and each connection's end. Where rules carry no counter (kube-proxy's nftables
//! mode), new connections per service come from here: a DNAT'd connection's reply source
//! is the endpoint kube-proxy's rule sent it to.
//!
//! The queue is the socket's receive buffer (bounded, 4 MiB asked); when it overflows the
//! kernel says so (ENOBUFS) and [`Counts::overruns`] counts it: events were lost there.
//! [`parse`] is pure and unit-tested from bytes.

use std::collections::HashMap;
use std::os::fd::{AsRawFd, OwnedFd};

use crate::Error;
use crate::netlink::{Attrs, split};
use crate::rules::endpoint;

const NFNL_SUBSYS_CTNETLINK: u16 = 1;
const IPCTNL_MSG_CT_NEW: u16 = 0;
const IPCTNL_MSG_CT_DELETE: u16 = 2;
/// Multicast groups NFNLGRP_CONNTRACK_NEW (1) and NFNLGRP_CONNTRACK_DESTROY (3), as bits.
const GROUPS: u32 = (1 << 0) | (1 << 2);
const CTA_TUPLE_REPLY: u16 = 2;
const CTA_STATUS: u16 = 3;
const CTA_MARK: u16 = 8;
const CTA_TUPLE_IP: u16 = 1;
const CTA_TUPLE_PROTO: u16 = 2;
const CTA_IP_V4_SRC: u16 = 1;
const CTA_IP_V6_SRC: u16 = 3;
const CTA_PROTO_SRC_PORT: u16 = 2;
const IPS_SRC_NAT: u32 = 1 << 4;
const IPS_DST_NAT: u32 = 1 << 5;
const RCVBUF: libc::c_int = 4 << 20;

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Event {
    /// A new connection (else: one that ended).
    pub new: bool,
    pub dnat: bool,
    pub snat: bool,
    pub mark: u32,
    /// Where a DNAT'd connection really goes: its reply's source (`ip:port`).
    pub dnat_to: Option<String>,
}

/// One ctnetlink message (type and payload after the netlink header) as an event.
pub fn parse(kind: u16, payload: &[u8]) -> Option<Event> {
    if kind >> 8 != NFNL_SUBSYS_CTNETLINK {
        return None;
    }
    let new = match kind & 0xff {
        IPCTNL_MSG_CT_NEW => true,
        IPCTNL_MSG_CT_DELETE => false,
        _ => return None,
    };
    let attrs = Attrs(payload.get(4..)?);
    let status = attrs.get(CTA_STATUS).and_then(|a| a.be32()).unwrap_or(0);
    let dnat = status & IPS_DST_NAT != 0;
    let dnat_to = dnat
        .then(|| {
            let reply = attrs.get(CTA_TUPLE_REPLY)?.nested();
            let ip = reply.get(CTA_TUPLE_IP)?.nested();
            let addr = ip.get(CTA_IP_V4_SRC).or_else(|| ip.get(CTA_IP_V6_SRC))?;
            let port = reply
                .get(CTA_TUPLE_PROTO)
                .and_then(|p| p.nested().get(CTA_PROTO_SRC_PORT))
                .and_then(|p| Some(u16::from_be_bytes(p.value.get(..2)?.try_into().ok()?)));
            endpoint(addr.value, port)
        })
        .flatten();
    Some(Event {
        new,
        dnat,
        snat: status & IPS_SRC_NAT != 0,
        mark: attrs.get(CTA_MARK).and_then(|a| a.be32()).unwrap_or(0),
        dnat_to,
    })
}

/// What the events added up to since the listener started.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Counts {
    pub new: u64,
    pub destroyed: u64,
    pub dnat: u64,
    pub snat: u64,
    /// New connections per ctmark bit set (bit -> count).
    pub marks: HashMap<u32, u64>,
    /// New DNAT'd connections per endpoint, at most `cap` endpoints.
    pub endpoints: HashMap<String, u64>,
    /// New DNAT'd connections whose endpoint the cap left out.
    pub endpoints_left_out: u64,
    /// Times the socket's queue overflowed (events lost there; the kernel cannot say how
    /// many).
    pub overruns: u64,
}

impl Counts {
    pub fn add(&mut self, e: &Event, cap: usize) {
        if !e.new {
            self.destroyed += 1;
            return;
        }
        self.new += 1;
        self.dnat += u64::from(e.dnat);
        self.snat += u64::from(e.snat);
        for b in (0..32).filter(|b| e.mark & (1 << b) != 0) {
            *self.marks.entry(1 << b).or_default() += 1;
        }
        if let Some(to) = &e.dnat_to {
            if let Some(n) = self.endpoints.get_mut(to) {
                *n += 1;
            } else if self.endpoints.len() < cap {
                self.endpoints.insert(to.clone(), 1);
            } else {
                self.endpoints_left_out += 1;
            }
        }
    }
}

impl Counts {
    /// Adds `other` (a batch counted on its own) into these counts, at most `cap` endpoints.
    pub fn merge(&mut self, other: Counts, cap: usize) {
        self.new += other.new;
        self.destroyed += other.destroyed;
        self.dnat += other.dnat;
        self.snat += other.snat;
        self.overruns += other.overruns;
        self.endpoints_left_out += other.endpoints_left_out;
        for (bit, n) in other.marks {
            *self.marks.entry(bit).or_default() += n;
        }
        for (ep, n) in other.endpoints {
            if let Some(v) = self.endpoints.get_mut(&ep) {
                *v += n;
            } else if self.endpoints.len() < cap {
                self.endpoints.insert(ep, n);
            } else {
                self.endpoints_left_out += n;
            }
        }
    }
}

/// Sets the `SOL_SOCKET` option `name` of `fd` to `value`, best effort: a socket that
/// keeps its default still works.
fn socket_option<T>(fd: &OwnedFd, name: libc::c_int, value: &T) {
    // SAFETY: `value` is a valid `T` for the call, its size given with it; our own fd.
    let _ = unsafe {
        libc::setsockopt(
            fd.as_raw_fd(),
            libc::SOL_SOCKET,
            name,
            (value as *const T).cast(),
            std::mem::size_of::<T>() as u32,
        )
    };
}

/// A ctnetlink socket subscribed to new and destroyed connections, in the calling thread's
/// namespace.
pub struct Listener {
    fd: OwnedFd,
    buf: Vec<u8>,
}

impl Listener {
    pub fn open() -> Result<Self, Error> {
        let fd = crate::netlink::netfilter_socket()?;
        // A larger queue; without the privilege to force it, the default one.
        socket_option(&fd, libc::SO_RCVBUFFORCE, &RCVBUF);
        // Wakes the reader once a second without events (it may have to stop).
        let timeout = libc::timeval {
            tv_sec: 1,
            tv_usec: 0,
        };
        socket_option(&fd, libc::SO_RCVTIMEO, &timeout);
        // SAFETY: bind with a valid, sized address on our own fd.
        unsafe {
            let mut addr: libc::sockaddr_nl = std::mem::zeroed();
            addr.nl_family = libc::AF_NETLINK as u16;
            addr.nl_groups = GROUPS;
            if libc::bind(
                fd.as_raw_fd(),
                (&raw const addr).cast(),
                std::mem::size_of::<libc::sockaddr_nl>() as u32,
            ) < 0
            {
                return Err(Error::Open(std::io::Error::last_os_error()));
            }
        }
        Ok(Self {
            fd,
            buf: vec![0; 256 * 1024],
        })
    }

    /// Waits (a second at most) for events, and adds them to `counts`.
    pub fn next_batch(&mut self, counts: &mut Counts, cap: usize) -> Result<(), Error> {
        // SAFETY: recv into our own buffer, at most its length.
        let n = unsafe {
            libc::recv(
                self.fd.as_raw_fd(),
                self.buf.as_mut_ptr().cast(),
                self.buf.len(),
                0,
            )
        };
        if n < 0 {
            let e = std::io::Error::last_os_error();
            return match e.raw_os_error() {
                Some(libc::ENOBUFS) => {
                    counts.overruns += 1;
                    Ok(())
                }
                Some(libc::EINTR | libc::EAGAIN) => Ok(()),
                _ => Err(Error::Kernel(e)),
            };
        }
        let (msgs, _) = split(&self.buf[..n as usize])?;
        for m in &msgs {
            if let Some(e) = parse(m.kind, m.payload) {
                counts.add(&e, cap);
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::netlink::tests::{attr, nest};

    fn event(kind: u16, status: u32, reply_src: [u8; 4], port: u16, mark: u32) -> Vec<u8> {
        let mut v = vec![2, 0, 0, 0];
        v.extend(nest(
            1,
            &[nest(
                CTA_TUPLE_IP,
                &[attr(CTA_IP_V4_SRC, &[198, 51, 100, 10])],
            )],
        ));
        v.extend(nest(
            CTA_TUPLE_REPLY,
            &[
                nest(
                    CTA_TUPLE_IP,
                    &[
                        attr(CTA_IP_V4_SRC, &reply_src),
                        attr(2, &[198, 51, 100, 10]),
                    ],
                ),
                nest(
                    CTA_TUPLE_PROTO,
                    &[
                        attr(1, &[17]),
                        attr(CTA_PROTO_SRC_PORT, &port.to_be_bytes()),
                    ],
                ),
            ],
        ));
        v.extend(attr(CTA_STATUS, &status.to_be_bytes()));
        v.extend(attr(CTA_MARK, &mark.to_be_bytes()));
        let _ = kind;
        v
    }

    #[test]
    fn a_dnat_connection_names_its_endpoint() {
        let m = event(
            0x100,
            IPS_DST_NAT | IPS_SRC_NAT | 0x8,
            [172, 17, 0, 5],
            53,
            0x4000,
        );
        let e = parse(0x100, &m).unwrap();
        assert!(e.new && e.dnat && e.snat);
        assert_eq!(e.dnat_to.as_deref(), Some("172.17.0.5:53"));
        assert_eq!(e.mark, 0x4000);
        let mut c = Counts::default();
        c.add(&e, 10);
        c.add(&e, 10);
        assert_eq!(c.endpoints["172.17.0.5:53"], 2);
        assert_eq!(c.marks[&0x4000], 2);
        assert_eq!((c.new, c.dnat, c.snat), (2, 2, 2));
    }

    #[test]
    fn plain_connections_and_ends() {
        let m = event(0x100, 0x8, [10, 0, 0, 1], 80, 0);
        let e = parse(0x100, &m).unwrap();
        assert_eq!(e.dnat_to, None, "no DNAT: no endpoint");
        let end = parse(0x102, &m).unwrap();
        assert!(!end.new);
        let mut c = Counts::default();
        c.add(&e, 10);
        c.add(&end, 10);
        assert_eq!((c.new, c.destroyed, c.dnat), (1, 1, 0));
        assert_eq!(parse(0xa06, &m), None, "not ctnetlink");
    }

    #[test]
    fn the_endpoint_cap_counts_what_it_leaves_out() {
        let mut c = Counts::default();
        for last in 1..=3u8 {
            let m = event(0x100, IPS_DST_NAT, [10, 0, 0, last], 80, 0);
            c.add(&parse(0x100, &m).unwrap(), 2);
        }
        assert_eq!(c.endpoints.len(), 2);
        assert_eq!(c.endpoints_left_out, 1);
        // Merged batches keep the same bound.
        let mut total = Counts::default();
        total.merge(c.clone(), 1);
        assert_eq!((total.endpoints.len(), total.endpoints_left_out), (1, 2));
        total.merge(c, 1);
        assert_eq!(total.new, 6);
    }
}
