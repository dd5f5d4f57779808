//! Conntrack tuples and endpoints as the probes record them, read with the kernel's layout:
//! shared by the filter's evaluation and the pipeline's decoding (below both).

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use observer_common::CT_TUPLE_BYTES;

use crate::kernel::btf::TupleLayout;

/// Address + port (port 0 and `has_port == false` for protocols without ports).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Endpoint {
    pub addr: IpAddr,
    pub port: u16,
}

/// A conntrack tuple (one direction).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Tuple {
    pub src: Endpoint,
    pub dst: Endpoint,
    pub proto: u8,
}

pub(crate) fn addr(bytes: &[u8], v4: bool) -> IpAddr {
    if v4 {
        IpAddr::V4(Ipv4Addr::new(bytes[0], bytes[1], bytes[2], bytes[3]))
    } else {
        let mut a = [0u8; 16];
        a.copy_from_slice(&bytes[..16]);
        IpAddr::V6(Ipv6Addr::from(a))
    }
}

pub(crate) fn tuple(raw: &[u8; CT_TUPLE_BYTES], l: &TupleLayout, v4: bool) -> Tuple {
    let port = |at: usize| u16::from_be_bytes([raw[at], raw[at + 1]]);
    Tuple {
        src: Endpoint {
            addr: addr(&raw[l.src_addr..l.src_addr + 16], v4),
            port: port(l.src_port),
        },
        dst: Endpoint {
            addr: addr(&raw[l.dst_addr..l.dst_addr + 16], v4),
            port: port(l.dst_port),
        },
        proto: raw[l.protonum],
    }
}
