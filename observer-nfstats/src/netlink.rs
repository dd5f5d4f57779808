//! The smallest netlink client the readers need: one `NETLINK_NETFILTER` (or, for IPVS,
//! `NETLINK_GENERIC`) socket in the calling thread's namespace, a dump request, the
//! multipart answer split into messages, and netlink attributes (TLVs) walked from bytes.
//!
//! The attribute walk is pure and unit-tested from bytes; only [`dump`] touches the kernel.

use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd};

use crate::Error;

const NLMSG_HDRLEN: usize = 16;
const NLMSG_ERROR: u16 = 2;
const NLMSG_DONE: u16 = 3;
const NLM_F_REQUEST: u16 = 1;
const NLM_F_DUMP: u16 = 0x300;
/// The kernel's set changed during the dump: what it sent may be inconsistent.
const NLM_F_DUMP_INTR: u16 = 0x10;
/// Attribute type bits that are flags, not part of the type.
const NLA_TYPE_MASK: u16 = 0x3fff;
const NLA_F_NESTED: u16 = 0x8000;
/// Bound on the messages of one dump (40,000 rules is a large node; this is ten times that).
const MAX_MESSAGES: usize = 400_000;

/// One netlink attribute: its type (flags masked off) and value.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Attr<'a> {
    pub kind: u16,
    pub value: &'a [u8],
}

impl<'a> Attr<'a> {
    /// The nested attributes inside this one.
    pub fn nested(&self) -> Attrs<'a> {
        Attrs(self.value)
    }

    pub fn be32(&self) -> Option<u32> {
        Some(u32::from_be_bytes(self.value.get(..4)?.try_into().ok()?))
    }

    pub fn be64(&self) -> Option<u64> {
        Some(u64::from_be_bytes(self.value.get(..8)?.try_into().ok()?))
    }

    pub fn be16(&self) -> Option<u16> {
        Some(u16::from_be_bytes(self.value.get(..2)?.try_into().ok()?))
    }

    /// A host-order integer (`nla_put_u16/u32/u64`, as generic netlink families send
    /// them), read by the attribute's length: 1, 2, 4 or 8 bytes.
    pub fn uint(&self) -> Option<u64> {
        let v = self.value;
        Some(match v.len() {
            1 => u64::from(v[0]),
            2 => u64::from(u16::from_ne_bytes(v.try_into().ok()?)),
            4 => u64::from(u32::from_ne_bytes(v.try_into().ok()?)),
            8 => u64::from_ne_bytes(v.try_into().ok()?),
            _ => return None,
        })
    }

    /// A NUL-terminated string attribute (the NUL and anything after it left out).
    pub fn str(&self) -> String {
        cstr(self.value)
    }
}

/// The text of a fixed-size, NUL-padded C string.
pub fn cstr(bytes: &[u8]) -> String {
    let end = bytes.iter().position(|&b| b == 0).unwrap_or(bytes.len());
    String::from_utf8_lossy(&bytes[..end]).into_owned()
}

/// Iterator over the attributes in a buffer; stops at the first malformed one.
#[derive(Clone, Copy, Debug)]
pub struct Attrs<'a>(pub &'a [u8]);

impl<'a> Attrs<'a> {
    /// The first attribute of type `kind`.
    pub fn get(self, kind: u16) -> Option<Attr<'a>> {
        self.into_iter().find(|a| a.kind == kind)
    }
}

impl<'a> IntoIterator for Attrs<'a> {
    type Item = Attr<'a>;
    type IntoIter = AttrIter<'a>;
    fn into_iter(self) -> AttrIter<'a> {
        AttrIter(self.0)
    }
}

pub struct AttrIter<'a>(&'a [u8]);

impl<'a> Iterator for AttrIter<'a> {
    type Item = Attr<'a>;
    fn next(&mut self) -> Option<Attr<'a>> {
        let b = self.0;
        if b.len() < 4 {
            return None;
        }
        let len = u16::from_ne_bytes([b[0], b[1]]) as usize;
        let kind = u16::from_ne_bytes([b[2], b[3]]) & NLA_TYPE_MASK;
        if len < 4 || len > b.len() {
            self.0 = &[];
            return None;
        }
        let value = &b[4..len];
        self.0 = &b[align4(len).min(b.len())..];
        Some(Attr { kind, value })
    }
}

fn align4(n: usize) -> usize {
    (n + 3) & !3
}

/// One message of a dump: its type and payload (after the netlink header).
#[derive(Debug, PartialEq, Eq)]
pub struct Message<'a> {
    pub kind: u16,
    pub payload: &'a [u8],
}

/// What one received buffer held: messages, and whether the dump ended in it.
pub fn split(buf: &[u8]) -> Result<(Vec<Message<'_>>, bool), Error> {
    let mut out = Vec::new();
    let mut rest = buf;
    while rest.len() >= NLMSG_HDRLEN {
        let len = u32::from_ne_bytes(rest[0..4].try_into().expect("4 bytes")) as usize;
        let kind = u16::from_ne_bytes([rest[4], rest[5]]);
        let flags = u16::from_ne_bytes([rest[6], rest[7]]);
        if flags & NLM_F_DUMP_INTR != 0 {
            return Err(Error::Interrupted);
        }
        if len < NLMSG_HDRLEN || len > rest.len() {
            return Err(Error::Malformed("netlink message length"));
        }
        let payload = &rest[NLMSG_HDRLEN..len];
        match kind {
            NLMSG_DONE => return Ok((out, true)),
            NLMSG_ERROR => {
                let errno = payload
                    .get(..4)
                    .map(|e| i32::from_ne_bytes(e.try_into().expect("4 bytes")))
                    .unwrap_or(0);
                if errno != 0 {
                    return Err(Error::Kernel(std::io::Error::from_raw_os_error(-errno)));
                }
            }
            _ => out.push(Message { kind, payload }),
        }
        rest = &rest[align4(len).min(rest.len())..];
    }
    Ok((out, false))
}

/// A dump request message: header, the 4-byte `nfgenmsg` (family, version 0, resource 0),
/// then `attrs` (already encoded, e.g. by [`encode_attr`]).
pub fn dump_request(kind: u16, family: u8, seq: u32, attrs: &[u8]) -> Vec<u8> {
    request(kind, NLM_F_REQUEST | NLM_F_DUMP, family, seq, attrs)
}

fn request(kind: u16, flags: u16, family: u8, seq: u32, attrs: &[u8]) -> Vec<u8> {
    nfnl_message(kind, flags, family, 0, seq, attrs)
}

/// One nfnetlink message: header, `nfgenmsg` (family, version 0, `res_id` big-endian),
/// then `attrs` (already encoded).
pub fn nfnl_message(
    kind: u16,
    flags: u16,
    family: u8,
    res_id: u16,
    seq: u32,
    attrs: &[u8],
) -> Vec<u8> {
    let [r0, r1] = res_id.to_be_bytes();
    message(kind, flags, seq, [family, 0, r0, r1], attrs)
}

/// A netlink message whose family header is four bytes (`nfgenmsg`, `genlmsghdr`): the
/// header, `sub`, then `attrs` (already encoded).
fn message(kind: u16, flags: u16, seq: u32, sub: [u8; 4], attrs: &[u8]) -> Vec<u8> {
    let len = (NLMSG_HDRLEN + sub.len() + attrs.len()) as u32;
    let mut m = Vec::with_capacity(len as usize);
    m.extend_from_slice(&len.to_ne_bytes());
    m.extend_from_slice(&kind.to_ne_bytes());
    m.extend_from_slice(&flags.to_ne_bytes());
    m.extend_from_slice(&seq.to_ne_bytes());
    m.extend_from_slice(&0u32.to_ne_bytes());
    m.extend_from_slice(&sub);
    m.extend_from_slice(attrs);
    m
}

/// One attribute, padded to 4 bytes.
pub fn encode_attr(kind: u16, value: &[u8]) -> Vec<u8> {
    let len = 4 + value.len();
    let mut v = Vec::with_capacity(align4(len));
    v.extend_from_slice(&(len as u16).to_ne_bytes());
    v.extend_from_slice(&kind.to_ne_bytes());
    v.extend_from_slice(value);
    v.resize(align4(len), 0);
    v
}

/// A nested attribute holding `inner` (each already encoded).
pub fn encode_nest(kind: u16, inner: &[Vec<u8>]) -> Vec<u8> {
    encode_attr(kind | NLA_F_NESTED, &inner.concat())
}

/// A generic netlink message: header (`kind` is the family's id), `genlmsghdr` (`cmd`,
/// `version`, reserved), then `attrs` (already encoded).
pub fn genl_message(
    kind: u16,
    flags: u16,
    cmd: u8,
    version: u8,
    seq: u32,
    attrs: &[u8],
) -> Vec<u8> {
    message(kind, flags, seq, [cmd, version, 0, 0], attrs)
}

/// `NLM_F_REQUEST`, and `NLM_F_DUMP` with it, for [`genl_message`].
pub const REQUEST: u16 = NLM_F_REQUEST;
pub const DUMP: u16 = NLM_F_REQUEST | NLM_F_DUMP;

/// A new `NETLINK_NETFILTER` socket in the calling thread's network namespace.
pub(crate) fn netfilter_socket() -> Result<OwnedFd, Error> {
    netlink_socket(libc::NETLINK_NETFILTER)
}

/// A new netlink socket of `protocol` in the calling thread's network namespace.
fn netlink_socket(protocol: libc::c_int) -> Result<OwnedFd, Error> {
    // SAFETY: plain socket(2); the fd is owned below.
    let fd = unsafe {
        libc::socket(
            libc::AF_NETLINK,
            libc::SOCK_RAW | libc::SOCK_CLOEXEC,
            protocol,
        )
    };
    if fd < 0 {
        return Err(Error::Open(std::io::Error::last_os_error()));
    }
    // SAFETY: fd is a fresh, valid descriptor that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// A `NETLINK_NETFILTER` socket in the calling thread's network namespace.
pub struct Socket {
    fd: OwnedFd,
    buf: Vec<u8>,
    seq: u32,
    /// Times the socket's receive queue overflowed (`ENOBUFS`: multicast messages lost).
    pub overruns: u64,
}

impl Socket {
    pub fn open() -> Result<Self, Error> {
        Self::with_buffer(64 * 1024)
    }

    /// A socket that reads datagrams of up to `size` bytes.
    pub(crate) fn with_buffer(size: usize) -> Result<Self, Error> {
        Ok(Self {
            fd: netfilter_socket()?,
            buf: vec![0; size],
            seq: 0,
            overruns: 0,
        })
    }

    pub(crate) fn fd(&self) -> std::os::fd::BorrowedFd<'_> {
        self.fd.as_fd()
    }

    /// A `NETLINK_GENERIC` socket (generic netlink families: IPVS, ...).
    pub fn generic() -> Result<Self, Error> {
        Ok(Self {
            fd: netlink_socket(libc::NETLINK_GENERIC)?,
            buf: vec![0; 64 * 1024],
            seq: 0,
            overruns: 0,
        })
    }

    /// The first `n` bytes of the last datagram read.
    pub(crate) fn received(&self, n: usize) -> &[u8] {
        &self.buf[..n]
    }

    /// Sends a plain (not dump) request and returns the payload of the kernel's one answer.
    pub fn get(&mut self, kind: u16, family: u8) -> Result<Vec<u8>, Error> {
        self.ask(|seq| request(kind, NLM_F_REQUEST, family, seq, &[]))
    }

    /// Sends the plain request `build` makes with the next sequence number and returns the
    /// payload of the kernel's one answer.
    pub fn ask(&mut self, build: impl FnOnce(u32) -> Vec<u8>) -> Result<Vec<u8>, Error> {
        self.seq = self.seq.wrapping_add(1);
        self.send(&build(self.seq))?;
        let n = self.recv(0)?;
        let (msgs, _) = split(&self.buf[..n])?;
        msgs.first()
            .map(|m| m.payload.to_vec())
            .ok_or(Error::Malformed("no answer to a netlink request"))
    }

    pub(crate) fn send(&self, req: &[u8]) -> Result<(), Error> {
        // SAFETY: the buffer is valid for its length; the kernel is the destination (pid 0).
        let sent = unsafe {
            let mut to: libc::sockaddr_nl = std::mem::zeroed();
            to.nl_family = libc::AF_NETLINK as u16;
            libc::sendto(
                self.fd.as_raw_fd(),
                req.as_ptr().cast(),
                req.len(),
                0,
                (&raw const to).cast(),
                std::mem::size_of::<libc::sockaddr_nl>() as u32,
            )
        };
        if sent < 0 {
            return Err(Error::Kernel(std::io::Error::last_os_error()));
        }
        Ok(())
    }

    /// One datagram; `Ok(0)` when none waits (with `MSG_DONTWAIT`); an overflowed queue is
    /// counted in [`Socket::overruns`] and reading goes on.
    pub(crate) fn recv(&mut self, flags: libc::c_int) -> Result<usize, Error> {
        loop {
            // SAFETY: recv into our own buffer, at most its length.
            let n = unsafe {
                libc::recv(
                    self.fd.as_raw_fd(),
                    self.buf.as_mut_ptr().cast(),
                    self.buf.len(),
                    flags,
                )
            };
            if n >= 0 {
                return Ok(n as usize);
            }
            let e = std::io::Error::last_os_error();
            match e.raw_os_error() {
                Some(libc::EINTR) => {}
                Some(libc::EAGAIN) => return Ok(0),
                Some(libc::ENOBUFS) => self.overruns += 1,
                _ => return Err(Error::Kernel(e)),
            }
        }
    }

    /// Sends a dump request and hands each message of the answer to `each`, in order.
    pub fn dump(
        &mut self,
        kind: u16,
        family: u8,
        attrs: &[u8],
        each: impl FnMut(&Message<'_>),
    ) -> Result<(), Error> {
        self.dump_with(|seq| dump_request(kind, family, seq, attrs), each)
    }

    /// Sends the dump request `build` makes with the next sequence number and hands each
    /// message of the answer to `each`, in order.
    pub fn dump_with(
        &mut self,
        build: impl FnOnce(u32) -> Vec<u8>,
        mut each: impl FnMut(&Message<'_>),
    ) -> Result<(), Error> {
        self.seq = self.seq.wrapping_add(1);
        self.send(&build(self.seq))?;
        let mut messages = 0;
        loop {
            let n = self.recv(0)?;
            let (msgs, done) = split(&self.buf[..n])?;
            messages += msgs.len();
            msgs.iter().for_each(&mut each);
            if done {
                return Ok(());
            }
            if n == 0 || messages > MAX_MESSAGES {
                return Err(Error::Malformed("netlink dump did not end"));
            }
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// Encodes one attribute (tests build messages the way the kernel does).
    pub fn attr(kind: u16, value: &[u8]) -> Vec<u8> {
        encode_attr(kind, value)
    }

    pub fn nest(kind: u16, inner: &[Vec<u8>]) -> Vec<u8> {
        encode_nest(kind, inner)
    }

    pub fn message(kind: u16, payload: &[u8]) -> Vec<u8> {
        let len = NLMSG_HDRLEN + payload.len();
        let mut v = Vec::new();
        v.extend_from_slice(&(len as u32).to_ne_bytes());
        v.extend_from_slice(&kind.to_ne_bytes());
        v.extend_from_slice(&[0; 10]);
        v.extend_from_slice(payload);
        v.resize(align4(len), 0);
        v
    }

    #[test]
    fn attributes_nest_and_skip_padding() {
        let buf = [
            attr(1, b"filter\0"),
            nest(4, &[attr(1, b"counter\0"), attr(2, &7u64.to_be_bytes())]),
        ]
        .concat();
        let attrs: Vec<_> = Attrs(&buf).into_iter().collect();
        assert_eq!(attrs.len(), 2);
        assert_eq!(attrs[0].str(), "filter");
        assert_eq!(attrs[1].kind, 4, "NLA_F_NESTED is masked off");
        let inner = attrs[1].nested();
        assert_eq!(inner.get(1).unwrap().str(), "counter");
        assert_eq!(inner.get(2).unwrap().be64(), Some(7));
    }

    #[test]
    fn a_truncated_attribute_ends_the_walk() {
        let mut buf = attr(1, b"abc\0");
        buf.extend_from_slice(&[40, 0, 2, 0, 1]);
        assert_eq!(Attrs(&buf).into_iter().count(), 1);
    }

    #[test]
    fn split_stops_at_done_and_reports_errors() {
        let buf = [message(0xa06, &[2, 0, 0, 0]), message(NLMSG_DONE, &[0; 4])].concat();
        let (msgs, done) = split(&buf).unwrap();
        assert!(done);
        assert_eq!(msgs.len(), 1);
        assert_eq!(msgs[0].kind, 0xa06);
        let mut intr = message(0xa06, &[2, 0, 0, 0]);
        intr[6] = NLM_F_DUMP_INTR as u8;
        assert!(matches!(split(&intr), Err(Error::Interrupted)));
        let err = message(NLMSG_ERROR, &(-libc::EPERM).to_ne_bytes());
        assert!(matches!(split(&err), Err(Error::Kernel(_))));
        let ack = message(NLMSG_ERROR, &0i32.to_ne_bytes());
        assert_eq!(split(&ack).unwrap(), (vec![], false));
    }
}
