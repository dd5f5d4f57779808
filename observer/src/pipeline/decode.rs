//! Decoding: ring-buffer bytes -> traversal records, and the typed observations they expand
//! to (see [`crate::pipeline::correlate`]). Pure; tested from hand-built bytes.

use observer_common::traversal::{RECORD_HEAD_BYTES, STEP_BYTES, TraversalRecord};
use observer_common::{EventHeader, PacketEvent, flags, kind};

use crate::tuple::addr;
pub use crate::tuple::{Endpoint, Tuple};
use observer_model::{Family as NfFamily, Hook as NfHook};

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum DecodeError {
    #[error("record of {0} bytes is shorter than its header")]
    Short(usize),
    #[error("record of unknown kind {0}")]
    UnknownKind(u8),
    #[error("record of {got} bytes, expected {want}")]
    Size { got: usize, want: usize },
    #[error("record with unknown hook {0}")]
    UnknownHook(u8),
    #[error("traversal record of {got} bytes holds {steps} steps")]
    Steps { got: usize, steps: u8 },
}

/// Where a record was taken.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Point {
    TcIngress,
    TcEgress,
    /// A netfilter probe: hook and slot (index into that hook's plan).
    Netfilter(NfHook, usize),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Conntrack {
    /// `enum ip_conntrack_info`.
    pub info: u32,
    pub mark: u32,
    pub status: u64,
    pub original: Tuple,
    pub reply: Tuple,
}

impl Conntrack {
    /// The state the ctinfo says, as iptables' `--ctstate` names it.
    pub fn state(&self) -> observer_model::CtState {
        use observer_model::CtState;
        match self.info {
            0 | 3 => CtState::Established,
            1 | 4 => CtState::Related,
            2 => CtState::New,
            _ => CtState::Untracked,
        }
    }

    pub fn is_reply(&self) -> bool {
        self.info >= 3 && self.info <= 4
    }
}

/// One packet seen at one point.
#[derive(Clone, Debug, PartialEq)]
pub struct Observation {
    pub point: Point,
    pub family: Option<NfFamily>,
    pub ts_ns: u64,
    pub skb: u64,
    pub ifindex_in: u32,
    pub ifindex_out: u32,
    /// None when the headers could not be read.
    pub src: Option<Endpoint>,
    pub dst: Option<Endpoint>,
    pub proto: u8,
    pub has_ports: bool,
    pub tcp_flags: u8,
    pub len: u32,
    pub mark: u32,
    pub ct: Option<Conntrack>,
    /// For ICMP errors: the packet they quote (source, destination, protocol).
    pub inner: Option<(Endpoint, Endpoint, u8)>,
    /// For VXLAN packets: the VNI and the packet carried (source, destination, protocol,
    /// its IPv4 identification when recorded).
    pub encap: Option<(u32, Endpoint, Endpoint, u8, Option<u16>)>,
    /// An IPv4 fragment.
    pub fragment: bool,
    /// ICMP and ICMPv6: the message's type and code (the probes read them where ports are).
    pub icmp: Option<(u8, u8)>,
    /// An ICMP(v6) echo request or reply: its identifier.
    pub icmp_id: Option<u16>,
    /// The IPv4 identification field, when recorded (never for IPv6).
    pub ip_id: Option<u16>,
}

/// An `ip_id` as the probes keep it ([`observer_common::IP_ID_READ`] set when read).
pub(crate) fn ip_id_of(raw: u32) -> Option<u16> {
    (raw & observer_common::IP_ID_READ != 0).then_some(raw as u16)
}

/// Type and code of an ICMP(v6) message, which the probes keep where ports are.
pub(crate) fn icmp_of(proto: u8, dport: u16) -> Option<(u8, u8)> {
    matches!(proto, 1 | 58).then(|| ((dport >> 8) as u8, dport as u8))
}

/// The identifier of an ICMP(v6) echo request or reply, which the probes keep where the
/// source port is.
pub(crate) fn icmp_id_of(proto: u8, sport: u16, dport: u16) -> Option<u16> {
    let (kind, _) = icmp_of(proto, dport)?;
    let proto = observer_model::Protocol::from_number(proto);
    observer_model::Icmp::is_echo(proto, kind).then_some(sport)
}

/// Whether a probe read a packet's IP header (`bits`, its flags, without `NO_L3`, IP version 4 or 6),
/// and its ports (a protocol with ports, `NO_L4` not set).
pub(crate) fn headers_read(bits: u8, ip_version: u8, l4proto: u8) -> (bool, bool) {
    let l3 = bits & flags::NO_L3 == 0 && (ip_version == 4 || ip_version == 6);
    (
        l3,
        l3 && bits & flags::NO_L4 == 0 && matches!(l4proto, 6 | 17 | 132 | 136),
    )
}

/// Whether the packet an ICMP error quotes (or a VXLAN packet carries) has its ports read.
pub(crate) fn quoted_ports(l4proto: u8) -> bool {
    matches!(l4proto, 6 | 17 | 132)
}

/// An endpoint as a probe read it: the address of its family, the port if `ports`, else 0.
pub(crate) fn endpoint(a: &[u8; 16], port: u16, v4: bool, ports: bool) -> Endpoint {
    Endpoint {
        addr: addr(a, v4),
        port: if ports { port } else { 0 },
    }
}

/// Decodes one ring-buffer record: a traversal, written up to its last step.
pub fn decode(bytes: &[u8]) -> Result<TraversalRecord, DecodeError> {
    if bytes.len() < size_of::<EventHeader>() {
        return Err(DecodeError::Short(bytes.len()));
    }
    if bytes[0] != kind::TRAVERSAL {
        return Err(DecodeError::UnknownKind(bytes[0]));
    }
    if bytes.len() < RECORD_HEAD_BYTES || bytes.len() > size_of::<TraversalRecord>() {
        return Err(DecodeError::Size {
            got: bytes.len(),
            want: RECORD_HEAD_BYTES,
        });
    }
    // The written prefix copied, the rest zeroed: every byte set once.
    let mut rec = std::mem::MaybeUninit::<TraversalRecord>::uninit();
    let dst = rec.as_mut_ptr().cast::<u8>();
    // SAFETY: `bytes.len()` is within the record's size (checked above); all-zero bytes
    // and any bytes are valid for its plain integers, so it is initialized after both.
    let rec = unsafe {
        std::ptr::copy_nonoverlapping(bytes.as_ptr(), dst, bytes.len());
        std::ptr::write_bytes(
            dst.add(bytes.len()),
            0,
            size_of::<TraversalRecord>() - bytes.len(),
        );
        rec.assume_init()
    };
    if RECORD_HEAD_BYTES + rec.nsteps as usize * STEP_BYTES != bytes.len() {
        return Err(DecodeError::Steps {
            got: bytes.len(),
            steps: rec.nsteps,
        });
    }
    Ok(rec)
}

/// The bytes the probes write for `rec`.
pub fn encode_record(rec: &TraversalRecord) -> Vec<u8> {
    rec.written_bytes().to_vec()
}

/// Encodes an event to the bytes the ring buffer would carry (for tests and benchmarks).
pub fn encode(ev: &PacketEvent) -> Vec<u8> {
    // SAFETY: PacketEvent is repr(C) plain data without padding (asserted in observer-common).
    unsafe {
        std::slice::from_raw_parts(
            (ev as *const PacketEvent).cast::<u8>(),
            size_of::<PacketEvent>(),
        )
    }
    .to_vec()
}

#[cfg(test)]
pub mod tests {
    use super::*;
    use crate::kernel::btf::TupleLayout;
    use observer_common::{family, hook};

    pub const LAYOUT: TupleLayout = TupleLayout {
        src_addr: 0,
        src_port: 16,
        dst_addr: 20,
        dst_port: 36,
        protonum: 38,
        size: 40,
    };

    /// A TCP packet event at `hook`/`slot` with the given addresses and mark.
    pub fn tcp_event(
        hook_no: u8,
        slot: u32,
        skb: u64,
        src: ([u8; 4], u16),
        dst: ([u8; 4], u16),
        mark: u32,
    ) -> PacketEvent {
        let mut ev = PacketEvent::default();
        ev.header.kind = kind::PACKET;
        ev.header.family = family::IPV4;
        ev.header.hook = hook_no;
        ev.header.slot = slot;
        ev.header.skb = skb;
        ev.packet.ip_version = 4;
        ev.packet.l4proto = 6;
        ev.packet.saddr[..4].copy_from_slice(&src.0);
        ev.packet.daddr[..4].copy_from_slice(&dst.0);
        ev.packet.sport = src.1;
        ev.packet.dport = dst.1;
        ev.packet.mark = mark;
        ev
    }

    pub fn with_ct(
        mut ev: PacketEvent,
        info: u32,
        orig: (([u8; 4], u16), ([u8; 4], u16)),
        reply: (([u8; 4], u16), ([u8; 4], u16)),
    ) -> PacketEvent {
        ev.header.flags |= flags::CT;
        ev.ct.ctinfo = info;
        for (raw, (s, d)) in [(&mut ev.ct.orig, orig), (&mut ev.ct.reply, reply)] {
            raw[0..4].copy_from_slice(&s.0);
            raw[16..18].copy_from_slice(&s.1.to_be_bytes());
            raw[20..24].copy_from_slice(&d.0);
            raw[36..38].copy_from_slice(&d.1.to_be_bytes());
            raw[38] = 6;
        }
        ev
    }

    /// What the pipeline reads of one probe reading, recorded as the probes record it.
    fn observations(ev: PacketEvent) -> Vec<Observation> {
        use crate::kernel::plan::full_plan;
        use crate::pipeline::correlate::{assemble, index_plans, tests::record_of};
        let rec = record_of(&[ev], observer_common::traversal::end::EGRESS);
        assemble(&rec, &index_plans(&full_plan(None)), &LAYOUT)
            .unwrap()
            .records
    }

    #[test]
    fn decodes_packet_with_conntrack() {
        let ev = tcp_event(
            0,
            3,
            0xffff_8880_1234_0000,
            ([198, 51, 100, 10], 40000),
            ([10, 10, 10, 2], 22),
            0x4000,
        );
        let ev = with_ct(
            ev,
            2,
            (([198, 51, 100, 10], 40000), ([10, 10, 10, 2], 22)),
            (([172, 17, 0, 5], 22), ([198, 51, 100, 10], 40000)),
        );
        let o = &observations(ev)[0];
        assert_eq!(o.point, Point::Netfilter(NfHook::PreRouting, 3));
        assert_eq!(o.family, Some(NfFamily::Ipv4));
        assert_eq!(o.skb, 0xffff_8880_1234_0000);
        assert_eq!(o.src.unwrap().addr.to_string(), "198.51.100.10");
        assert_eq!(o.dst.unwrap().port, 22);
        assert_eq!(o.mark, 0x4000);
        let ct = o.ct.unwrap();
        assert_eq!(ct.state(), observer_model::CtState::New);
        assert_eq!(ct.reply.src.addr.to_string(), "172.17.0.5");
        assert_eq!(ct.reply.src.port, 22);
        assert_eq!(ct.original.proto, 6);
    }

    #[test]
    fn icmp_has_no_ports_and_tc_points_decode() {
        let mut ev = tcp_event(
            hook::TC_EGRESS,
            0,
            1,
            ([1, 2, 3, 4], 7),
            ([5, 6, 7, 8], 0x0800),
            0,
        );
        ev.packet.l4proto = 1;
        let o = &observations(ev)[0];
        assert_eq!(o.point, Point::TcEgress);
        assert!(!o.has_ports);
        assert_eq!(o.src.unwrap().port, 0);
        assert!(o.ct.is_none());
    }

    #[test]
    fn rejects_bad_records() {
        use crate::pipeline::correlate::tests::record_of;
        use observer_common::traversal::end;
        let ev = tcp_event(0, 0, 1, ([1; 4], 1), ([2; 4], 2), 0);
        let good = encode_record(&record_of(&[ev], end::EGRESS));
        assert_eq!(decode(&good).unwrap().nsteps, 1);
        assert_eq!(decode(&[1, 2, 3]), Err(DecodeError::Short(3)));
        assert_eq!(
            decode(&encode(&ev)),
            Err(DecodeError::UnknownKind(kind::PACKET))
        );
        let mut bytes = good.clone();
        bytes.truncate(RECORD_HEAD_BYTES - 8);
        assert!(matches!(decode(&bytes), Err(DecodeError::Size { .. })));
        // A step count that does not match the length written.
        let mut bytes = good;
        bytes.truncate(RECORD_HEAD_BYTES);
        assert_eq!(
            decode(&bytes),
            Err(DecodeError::Steps {
                got: RECORD_HEAD_BYTES,
                steps: 1
            })
        );
    }
}
