//! Wire records shared by the probes (`observer-ebpf`) and the collector (`observer`).
//!
//! Everything here is `#[repr(C)]`, free of `bool` and of implicit padding, and has its size
//! asserted at compile time, so both sides agree byte for byte. The `user` feature adds
//! `aya::Pod` so userspace can put these types into maps.
#![no_std]

/// Pseudo hook numbers for TC records; netfilter hooks use the kernel's `NF_INET_*` (0..=4).
pub mod hook {
    pub const PRE_ROUTING: u8 = 0;
    pub const LOCAL_IN: u8 = 1;
    pub const FORWARD: u8 = 2;
    pub const LOCAL_OUT: u8 = 3;
    pub const POST_ROUTING: u8 = 4;
    pub const TC_INGRESS: u8 = 16;
    pub const TC_EGRESS: u8 = 17;
}

/// `NFPROTO_*` values, which are also what `nf_hook_state.pf` holds.
pub mod family {
    pub const IPV4: u8 = 2;
    pub const IPV6: u8 = 10;
}

/// What kind of record follows the header.
pub mod kind {
    /// A packet seen at a netfilter probe or a TC hook: [`super::PacketEvent`].
    pub const PACKET: u8 = 1;
    /// A whole traversal, assembled in the kernel: [`super::traversal::TraversalRecord`].
    pub const TRAVERSAL: u8 = 3;
    /// A packet's first bytes, in the `PACKETS` ring buffer: [`super::packet_bytes::PacketBytes`].
    pub const PACKET_BYTES: u8 = 4;
}

pub mod packet_bytes;

/// Bits of [`EventHeader::flags`].
pub mod flags {
    /// The packet headers could not be read (not IP, or truncated); addresses are zero.
    pub const NO_L3: u8 = 1;
    /// A conntrack entry was attached to the skb; `ct` is valid.
    pub const CT: u8 = 2;
    /// L4 ports could not be read (fragment or unknown protocol).
    pub const NO_L4: u8 = 4;
    /// An IPv4 fragment (more-fragments set or a non-zero offset).
    pub const FRAGMENT: u8 = 8;
    /// An ICMP error: `PacketEvent::inner` holds the header it quotes. Also set, with
    /// [`ENCAP`], for a VXLAN packet: `inner` then holds the encapsulated packet's headers.
    pub const INNER: u8 = 16;
    /// A VXLAN packet (UDP to [`crate::parse::VXLAN_PORTS`], the VXLAN header's I flag set,
    /// an IP packet inside): `PacketEvent::inner` holds the inner packet's addresses, ports
    /// and protocol, and `inner.vni` its VXLAN network identifier.
    pub const ENCAP: u8 = 32;
}

/// Words of the `PENDING_COUNT` array: how many records the fallback map may hold is
/// `PUT - TAKEN - COLLECTED` (the probes skip its hash lookup at zero).
pub mod pending_count {
    /// Records the probes are putting in (counted before the insert).
    pub const PUT: u32 = 0;
    /// Records the probes took out (or failed to put in).
    pub const TAKEN: u32 = 1;
    /// Records the collector took out: written by userspace only.
    pub const COLLECTED: u32 = 2;
    pub const WORDS: u32 = 3;
}

/// Indices into the `COUNTERS` per-CPU array. Userspace sums the CPUs and reports every one.
/// Everything but `READ_FAILED` and `NOT_CONFIGURED` counts packets (traversals).
pub mod counter {
    /// Traversals written to the ring buffer.
    pub const EMITTED: u32 = 0;
    /// Traversals lost: the ring buffer was full when they ended.
    pub const RINGBUF_FULL: u32 = 1;
    /// Kernel reads (`bpf_probe_read_kernel`) that failed; the traversal is flagged.
    pub const READ_FAILED: u32 = 2;
    /// Probe runs before userspace configured the probes; nothing was recorded.
    pub const NOT_CONFIGURED: u32 = 3;
    /// Traversals that ended without being written: the packet did not match `--filter`.
    pub const FILTERED: u32 = 4;
    /// Traversals that ended without being written: `--sample` left the flow out.
    pub const SAMPLED_OUT: u32 = 5;
    /// Internal: a per-CPU record sequence, to check the ring buffer's fill now and then.
    pub const EMIT_SEQ: u32 = 6;
    /// Traversals started: packets that entered the observed namespace's hooks.
    pub const SEEN: u32 = 7;
    /// Traversals moved from a per-CPU slot to the fallback map (waiting or changing CPU).
    pub const TO_FALLBACK: u32 = 8;
    /// Traversals written early, as partial, because neither a slot nor the fallback map
    /// had room.
    pub const RECLAIMED: u32 = 9;
    /// Traversals first seen after their start (their entry point was not observed).
    pub const NO_START: u32 = 10;
    /// Moves to the fallback map that failed (map full, or busy on this CPU): the
    /// traversal stayed in its slot (a socket's) or was written as partial.
    pub const FALLBACK_FAILED: u32 = 11;
    pub const COUNT: u32 = 16;
}

/// Indices into the `CONFIG` array: kernel struct offsets resolved by userspace from BTF.
/// A value of [`config::UNSET`] means "not present on this kernel".
pub mod config {
    pub const UNSET: u64 = u64::MAX;
    /// Non-zero once userspace has filled the map.
    pub const READY: u32 = 0;
    pub const SKB_MARK: u32 = 1;
    pub const SKB_LEN: u32 = 2;
    pub const SKB_HEAD: u32 = 3;
    pub const SKB_NETWORK_HEADER: u32 = 4;
    pub const SKB_NFCT: u32 = 5;
    pub const STATE_HOOK: u32 = 6;
    pub const STATE_PF: u32 = 7;
    pub const STATE_IN: u32 = 8;
    pub const STATE_OUT: u32 = 9;
    pub const NETDEV_IFINDEX: u32 = 10;
    pub const CT_MARK: u32 = 11;
    pub const CT_STATUS: u32 = 12;
    pub const CT_TUPLE_ORIG: u32 = 13;
    pub const CT_TUPLE_REPLY: u32 = 14;
    /// `sk_buff.dev`, `net_device.nd_net.net`, `net.ns.inum`: to keep only the drops of
    /// the observed namespace.
    pub const SKB_DEV: u32 = 15;
    pub const NETDEV_NET: u32 = 16;
    pub const NET_INUM: u32 = 17;
    /// Inode number of the observed network namespace.
    pub const OBSERVED_NETNS: u32 = 18;
    /// `sk_buff.sk` and `sock.__sk_common.skc_net.net`, for drops of skbs without a device.
    pub const SKB_SK: u32 = 19;
    pub const SOCK_NET: u32 = 20;
    /// Layout of the raw conntrack tuples, so the filter can match a connection's
    /// original and reply addresses (a NATed packet still matches its ClusterIP).
    pub const TUPLE_SRC_ADDR: u32 = 21;
    pub const TUPLE_SRC_PORT: u32 = 22;
    pub const TUPLE_DST_ADDR: u32 = 23;
    pub const TUPLE_DST_PORT: u32 = 24;
    /// Start of the window of `sk_buff` (mark, len, head, network_header, _nfct) and of
    /// `nf_conn` (tuples, status, mark) that a probe reads in one go.
    pub const SKB_WINDOW: u32 = 25;
    pub const CT_WINDOW: u32 = 26;
    /// Generation of the probe plan; a record carries the one it entered with.
    pub const PLAN_GEN: u32 = 27;
    /// Non-zero: every probe returns at once (the benchmark's floor: the hooks' own cost).
    pub const FLOOR: u32 = 28;
    /// Offset of the protocol number in a raw conntrack tuple (a packet decided from its
    /// connection's tuples alone takes its protocol from there).
    pub const TUPLE_PROTO: u32 = 29;
    /// Non-zero: where a traversal starts, its packet's first bytes go to the `PACKETS`
    /// ring buffer (`tail --pcapng`).
    pub const CAPTURE_BYTES: u32 = 30;
    /// `sk_buff.tail` (an offset from `head` on 64-bit kernels): the end of the linear data.
    pub const SKB_TAIL: u32 = 31;
    /// Per hook (`READ_HEADERS + hook`), a bitmask of the probe programs that must read the
    /// packet's headers: those right after a table that may rewrite addresses (nat, a
    /// custom base chain). The others take them from the record's last step, unless they
    /// open a hook's visit. The same bits shifted by [`NAT_ONLY_SHIFT`] mark the programs
    /// among them that follow nat alone: there a connection without NAT (its status has
    /// neither `IPS_SRC_NAT` nor `IPS_DST_NAT`) keeps its headers.
    pub const READ_HEADERS: u32 = 32;
    pub const NAT_ONLY_SHIFT: u32 = 32;
    /// Non-zero: the netfilter probes and the drop tracepoint keep the always-on counters
    /// ([`super::counts`]).
    pub const COUNTING: u32 = 37;
    /// Non-zero: counting only; the probes assemble no traversal and the drop tracepoint
    /// writes what it knows of a dropped packet (`observer agent`'s always-on mode).
    pub const COUNT_ONLY: u32 = 38;
    /// Per hook (`NAT_AFTER + hook`), a bitmask of the probe programs right after the nat
    /// table: where the counters look at the connection's NAT status.
    pub const NAT_AFTER: u32 = 40;
    /// Non-zero: the drop tracepoint counts drops whose last point is not known by
    /// [`super::counts::DropKey`] (tier 1, the agent's default mode).
    pub const DROP_KEYED: u32 = 39;
    /// Tier 1 samples: the least time between two samples on one CPU, in nanoseconds
    /// (unset: no samples).
    pub const DROP_SAMPLE_GAP_NS: u32 = 45;
    /// Tier 1: drop reasons 0..64 and 64..128 (one bit each) that are not counted by key
    /// nor sampled.
    pub const DROP_REASONS_IGNORED: u32 = 46;
    pub const DROP_REASONS_IGNORED_HIGH: u32 = 47;
    pub const COUNT: u32 = 48;
}

/// Kernel struct fields the netfilter probes load with one instruction from the typed
/// pointers their context gives (`nf_hook_state`, `sk_buff`, and the devices the state
/// points to). They are compiled with a placeholder offset naming the field's `config`
/// slot, which observer's netfilter loader replaces with the offset BTF gives, as libbpf's
/// CO-RE relocations do; the verifier then checks each load against BTF.
pub mod direct {
    /// Placeholder of config slot `c`: `BASE + STRIDE * c`, far above any offset in these
    /// structs, and spaced so that no two placeholders sit next to each other.
    pub const BASE: usize = 0x4000;
    pub const STRIDE: usize = 0x40;
    pub const END: usize = BASE + STRIDE * super::config::COUNT as usize;

    #[inline(always)]
    pub const fn placeholder(slot: u32) -> usize {
        BASE + STRIDE * slot as usize
    }

    /// The config slot a load offset stands for, if it is a placeholder.
    pub const fn slot_of(off: usize) -> Option<u32> {
        if off >= BASE && off < END && (off - BASE).is_multiple_of(STRIDE) {
            Some(((off - BASE) / STRIDE) as u32)
        } else {
            None
        }
    }

    /// The slots the probes load directly (the loader refuses any other placeholder).
    pub const SLOTS: [u32; 13] = [
        super::config::STATE_HOOK,
        super::config::STATE_PF,
        super::config::STATE_IN,
        super::config::STATE_OUT,
        super::config::NETDEV_IFINDEX,
        super::config::SKB_MARK,
        super::config::SKB_LEN,
        super::config::SKB_HEAD,
        super::config::SKB_NETWORK_HEADER,
        super::config::SKB_NFCT,
        super::config::SKB_DEV,
        super::config::NETDEV_NET,
        super::config::NET_INUM,
    ];
}

/// Calls the netfilter probes make to helper ids no helper has, which observer's netfilter
/// loader rewrites for the running kernel (as libbpf resolves `__ksym` externs): where the
/// kernel lets a program load untrusted kernel memory directly (Linux 6.16+,
/// `BPF_FEAT_RDONLY_CAST_TO_VOID`), a struct window costs a few loads instead of one
/// `bpf_probe_read_kernel` call. [`DIRECT_READS`] becomes `r0 = 1` there (`r0 = 0`
/// elsewhere), which the verifier follows as a constant, so it never checks the path the
/// kernel cannot take; [`UNTRUSTED`] becomes the kfunc `bpf_rdonly_cast(ptr, 0)`, which
/// the verifier inlines (`r0 = r1`) and whose result it lets the program load from.
pub mod kfunc {
    pub const DIRECT_READS: i32 = 0x7f0f_0001;
    pub const UNTRUSTED: i32 = 0x7f0f_0002;
}

/// Bytes of `nf_hook_state`, `sk_buff` and `nf_conn` a probe reads at once (from the
/// window starts in `config`); userspace checks that every field it needs lies inside.
pub const STATE_WINDOW_BYTES: usize = 32;
pub const SKB_WINDOW_BYTES: usize = 128;
pub const CT_WINDOW_BYTES: usize = 160;

/// Number of netfilter probe programs compiled into the netfilter object. Each one may be
/// attached at several (family, hook, priority) points; its index tells userspace which.
pub const NF_SLOTS: usize = 24;

/// Raw bytes copied from `struct nf_conntrack_tuple`; userspace decodes them with offsets
/// from BTF, so the probe never needs to know the layout.
pub const CT_TUPLE_BYTES: usize = 48;

/// Common envelope of a probe's reading.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct EventHeader {
    /// One of [`kind`].
    pub kind: u8,
    /// One of [`family`], from the netfilter state or the IP version; 0 when unknown.
    pub family: u8,
    /// One of [`hook`].
    pub hook: u8,
    /// Bits of [`flags`].
    pub flags: u8,
    /// Netfilter probe slot (index of the program), 0 for TC.
    pub slot: u32,
    /// `bpf_ktime_get_ns()`.
    pub ts_ns: u64,
    /// Kernel address of the `sk_buff`: the packet's identity across all stages in one netns.
    pub skb: u64,
    /// Input device ifindex (netfilter `state->in`, TC ingress device), 0 if none.
    pub ifindex_in: u32,
    /// Output device ifindex (netfilter `state->out`, TC egress device), 0 if none.
    pub ifindex_out: u32,
}

/// Addresses, ports and metadata of a packet as read at one probe.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PacketInfo {
    /// IPv4 addresses use the first 4 bytes.
    pub saddr: [u8; 16],
    pub daddr: [u8; 16],
    /// Host byte order. For ICMP: `sport` is the echo id, `dport` is `type << 8 | code`.
    pub sport: u16,
    pub dport: u16,
    /// IP protocol number (6 tcp, 17 udp, 1 icmp, 58 icmpv6).
    pub l4proto: u8,
    /// 4 or 6; 0 when no IP header was read.
    pub ip_version: u8,
    /// TCP flags byte (FIN=1, SYN=2, RST=4, PSH=8, ACK=16); 0 for other protocols.
    pub tcp_flags: u8,
    pub _pad: u8,
    /// `skb->len`.
    pub len: u32,
    /// `skb->mark`.
    pub mark: u32,
    /// IPv4's identification field (host order) | [`IP_ID_READ`]; 0 when not read (IPv6
    /// has no such field outside its fragment header, or no IP header was read).
    pub ip_id: u32,
    pub _pad2: u32,
}

/// Set in an `ip_id` (of [`PacketInfo`], [`InnerInfo`], [`traversal::Step`]) when the field
/// holds an IPv4 identification: 0 is a valid identification.
pub const IP_ID_READ: u32 = 1 << 16;

/// Conntrack entry attached to the skb (`skb->_nfct`), valid when `flags::CT` is set.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CtInfo {
    /// `enum ip_conntrack_info` (the low 3 bits of `_nfct`).
    pub ctinfo: u32,
    /// `nf_conn.mark`.
    pub mark: u32,
    /// `nf_conn.status` (`IPS_*` bits).
    pub status: u64,
    /// Original-direction tuple, raw.
    pub orig: [u8; CT_TUPLE_BYTES],
    /// Reply-direction tuple, raw.
    pub reply: [u8; CT_TUPLE_BYTES],
}

impl Default for CtInfo {
    fn default() -> Self {
        Self {
            ctinfo: 0,
            mark: 0,
            status: 0,
            orig: [0; CT_TUPLE_BYTES],
            reply: [0; CT_TUPLE_BYTES],
        }
    }
}

/// What one probe read of a packet ([`traversal::Reading`]): scratch in the probes, added
/// to the packet's traversal record; also the record of kind [`kind::PACKET`] in tests.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PacketEvent {
    pub header: EventHeader,
    pub packet: PacketInfo,
    pub ct: CtInfo,
    /// The packet quoted by an ICMP error, valid when `flags::INNER` is set.
    pub inner: InnerInfo,
}

/// Addresses and ports of the packet an ICMP error quotes (conntrack translates them too).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct InnerInfo {
    pub saddr: [u8; 16],
    pub daddr: [u8; 16],
    pub sport: u16,
    pub dport: u16,
    pub l4proto: u8,
    /// With `flags::ENCAP`: the VXLAN network identifier (24 bits, big-endian); otherwise
    /// unused.
    pub vni: [u8; 3],
    /// The carried (or quoted) IPv4 header's identification | [`IP_ID_READ`], as
    /// [`PacketInfo::ip_id`].
    pub ip_id: u32,
    pub _pad: u32,
}

const _: () = assert!(core::mem::size_of::<EventHeader>() == 32);
const _: () = assert!(core::mem::size_of::<PacketInfo>() == 56);
const _: () = assert!(core::mem::size_of::<CtInfo>() == 16 + 2 * CT_TUPLE_BYTES);
const _: () = assert!(core::mem::size_of::<InnerInfo>() == 48);
const _: () = assert!(core::mem::size_of::<PacketEvent>() == 32 + 56 + 112 + 48);
// The fields `traversal::copy_words` copies and compares as 8-byte words.
const _: () = {
    use core::mem::{align_of, offset_of};
    assert!(align_of::<PacketEvent>() == 8);
    assert!(offset_of!(PacketEvent, packet) % 8 == 0);
    assert!(offset_of!(PacketEvent, ct) % 8 == 0);
    assert!(offset_of!(PacketEvent, inner) % 8 == 0);
    assert!(offset_of!(PacketInfo, saddr) % 8 == 0 && offset_of!(PacketInfo, daddr) % 8 == 0);
    assert!(offset_of!(InnerInfo, saddr) % 8 == 0 && offset_of!(InnerInfo, daddr) % 8 == 0);
    assert!(offset_of!(CtInfo, orig) % 8 == 0 && offset_of!(CtInfo, reply) % 8 == 0);
};
const _: () = assert!(core::mem::align_of::<PacketEvent>() == 8);

#[cfg(feature = "user")]
mod pod {
    // SAFETY: plain-old-data, repr(C), no padding (sizes asserted above).
    unsafe impl aya::Pod for super::EventHeader {}
    unsafe impl aya::Pod for super::PacketInfo {}
    unsafe impl aya::Pod for super::CtInfo {}
    unsafe impl aya::Pod for super::PacketEvent {}
    unsafe impl aya::Pod for super::counts::DropKey {}
    unsafe impl aya::Pod for super::counts::DropSample {}
    unsafe impl aya::Pod for super::InnerInfo {}
    unsafe impl aya::Pod for super::traversal::TraversalRecord {}
    unsafe impl aya::Pod for super::traversal::Slots {}
}
pub mod counts;
pub mod filter;
pub mod parse;
pub mod trampoline;
pub mod traversal;
