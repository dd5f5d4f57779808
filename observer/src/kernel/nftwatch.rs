//! Notifications of nf_tables changes in the current network namespace: the kernel's
//! NFNLGRP_NFTABLES netlink group, which also carries the changes iptables-nft makes. The
//! tail re-reads base-chain priorities when told, instead of polling `nft`.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

const NETLINK_NETFILTER: libc::c_int = 12;
const NFNLGRP_NFTABLES: u32 = 7;

pub struct NftWatch {
    fd: OwnedFd,
}

impl NftWatch {
    /// Subscribes to nf_tables changes (needs CAP_NET_ADMIN, as the probes do).
    pub fn open() -> io::Result<Self> {
        // SAFETY: plain socket(2); the fd is owned below.
        let fd = unsafe {
            libc::socket(
                libc::AF_NETLINK,
                libc::SOCK_RAW | libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC,
                NETLINK_NETFILTER,
            )
        };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: a fresh fd we own.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        // SAFETY: all-zero is a valid sockaddr_nl; the fields set are the ones bind reads.
        let mut addr: libc::sockaddr_nl = unsafe { std::mem::zeroed() };
        addr.nl_family = libc::AF_NETLINK as libc::sa_family_t;
        addr.nl_groups = 1 << (NFNLGRP_NFTABLES - 1);
        // SAFETY: addr is a valid sockaddr_nl of the given length.
        let rc = unsafe {
            libc::bind(
                fd.as_raw_fd(),
                (&addr as *const libc::sockaddr_nl).cast(),
                size_of::<libc::sockaddr_nl>() as libc::socklen_t,
            )
        };
        if rc < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(Self { fd })
    }

    /// Reads every pending notification; true if there was any (or some were lost, which
    /// means a change too).
    pub fn drain(&self) -> bool {
        let mut buf = [0u8; 16 * 1024];
        let mut any = false;
        loop {
            // SAFETY: buf is writable for its length.
            let n = unsafe {
                libc::recv(
                    self.fd.as_raw_fd(),
                    buf.as_mut_ptr().cast(),
                    buf.len(),
                    libc::MSG_DONTWAIT,
                )
            };
            if n > 0 {
                any = true;
                continue;
            }
            if n < 0 && io::Error::last_os_error().raw_os_error() == Some(libc::ENOBUFS) {
                any = true;
                continue;
            }
            return any;
        }
    }
}

impl AsRawFd for NftWatch {
    fn as_raw_fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }
}
