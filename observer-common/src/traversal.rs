//! One record per packet traversal, assembled in the kernel (docs/wire-format.md).
//!
//! Each probe reads the packet into a [`Reading`] (scratch, never written out) and adds it
//! to the packet's in-flight [`TraversalRecord`] with [`add_reading`]: the point is marked as
//! passed in the current [`Visit`], and a [`Step`] is appended only where the packet's state
//! (tuple, mark, length, conntrack) differs from the previous step. When the traversal ends
//! (it leaves through TC egress, a socket takes it, the kernel frees it, or its slot is
//! needed) the record is written to the ring buffer once, cut after its last step.
//!
//! The functions here run inside eBPF programs and in host unit tests alike: constant loop
//! bounds, checked indices, no panics, no calls (`#[inline(always)]`), no struct copies that
//! could become `memcpy` calls.

use crate::{CT_TUPLE_BYTES, PacketEvent, flags};

/// Hooks (and TC points) one record can list, in the order the packet met them.
pub const MAX_VISITS: usize = 8;
/// State changes one record can hold.
pub const MAX_STEPS: usize = 12;
/// In-flight traversals one CPU holds at once: more than one because traversals nest (a
/// REJECT or an ICMP error sends a new packet from inside the hook handling the first).
pub const SLOTS_PER_CPU: usize = 4;

/// The probes' scratch reading of one packet at one point.
pub type Reading = PacketEvent;

/// How a traversal ended: [`TraversalRecord::end`].
pub mod end {
    /// Still in flight (never written with this value).
    pub const NONE: u8 = 0;
    /// Seen at TC egress: it left through an interface.
    pub const EGRESS: u8 = 1;
    /// A socket took it (UDP/raw queue, TCP receive path).
    pub const DELIVERED: u8 = 2;
    /// The kernel freed it without calling it a drop (`consume_skb`): e.g. an ICMP echo
    /// answered by the kernel, or a packet merged by defragmentation.
    pub const CONSUMED: u8 = 3;
    /// The kernel freed it as dropped (`kfree_skb`), with `reason` and `location`.
    pub const DROPPED: u8 = 4;
    /// Its per-CPU slot was needed for another packet and the fallback map was full.
    pub const RECLAIMED: u8 = 5;
    /// Its skb address started a new traversal before this one was seen to end.
    pub const REUSED: u8 = 6;
    /// Not heard of for the idle time (swept by the collector from the fallback map).
    pub const IDLE: u8 = 7;
    /// Still in flight when the collector stopped (read from the maps at exit).
    pub const IN_FLIGHT: u8 = 8;
    /// Sent back to this host without leaving through an interface: after POSTROUTING it
    /// entered PREROUTING again as the same skb (multicast/broadcast loopback,
    /// `dev_loopback_xmit`), which starts a new traversal.
    pub const LOOPED: u8 = 9;
}

/// Bits of [`TraversalRecord::incomplete`]: what is missing from a written record.
pub mod missing {
    /// More state changes than [`super::MAX_STEPS`]: later ones are not recorded.
    pub const STEPS: u8 = 1;
    /// More hooks than [`super::MAX_VISITS`]: later points are not recorded.
    pub const VISITS: u8 = 2;
    /// A probe could not read the packet or its connection at some point.
    pub const READ: u8 = 4;
    /// First seen after the point where it entered (its start was not recorded).
    pub const START: u8 = 8;
    /// The probes were re-planned (new brackets attached) while it was in flight.
    pub const REPLANNED: u8 = 16;
    /// A point between two it passed at one hook saw nothing (a capture backend's blind
    /// spot: a table's function that does not run for this packet). Set by userspace.
    pub const POINT: u8 = 32;
}

/// Bits of [`TraversalRecord::status`].
pub mod status {
    /// A socket-receive function has the packet (set on entry, before it returns).
    pub const SOCKET: u8 = 1;
    /// Written from the fallback map (it waited, or changed CPU).
    pub const FALLBACK: u8 = 2;
}

/// [`TraversalRecord::decision`]: the filter's verdict, taken where the packet entered.
pub mod decision {
    pub const FILTERED_OUT: u8 = 0;
    pub const KEEP: u8 = 1;
    pub const SAMPLED_OUT: u8 = 2;
}

/// Bits of [`Step::flags`] beyond the reading's [`crate::flags`] (which it keeps).
pub mod step {
    /// This step holds the quoted packet of an ICMP error (addresses, ports, protocol) as it
    /// is from this point on; the outer state is unchanged. With [`crate::flags::ENCAP`]
    /// also set, it holds the packet a VXLAN packet carries, and `mark` its VNI.
    pub const INNER_STATE: u8 = 128;
}

/// One hook (or TC point) the packet passed.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Visit {
    /// One of [`crate::hook`].
    pub hook: u8,
    /// At a FORWARD visit, the ifindex (24 bits, little-endian) of the device the skb was
    /// on (`skb->dev`) where it was neither of the hook's devices: a bridged frame's out
    /// port, br_netfilter's `physoutdev`, known there before the frame leaves (or a rule
    /// drops it). Zero elsewhere, and for an ifindex that does not fit 24 bits.
    pub port: [u8; 3],
    /// Bit `p` set: netfilter probe program `p` saw the packet in this visit (bit 0 for TC).
    pub programs: u32,
    pub ifindex_in: u32,
    pub ifindex_out: u32,
}

/// The packet as one probe read it, recorded where it differs from the previous step.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Step {
    /// Index into [`TraversalRecord::visits`].
    pub visit: u8,
    /// Probe program within that visit (0 for TC).
    pub program: u8,
    /// The reading's [`crate::flags`], plus [`step::INNER_STATE`].
    pub flags: u8,
    /// `enum ip_conntrack_info` when `flags::CT` is set.
    pub ctinfo: u8,
    pub l4proto: u8,
    pub ip_version: u8,
    pub tcp_flags: u8,
    pub _pad: u8,
    pub sport: u16,
    pub dport: u16,
    pub mark: u32,
    pub len: u32,
    pub ct_mark: u32,
    /// Low 32 bits of `nf_conn.status`.
    pub ct_status: u32,
    /// The IPv4 identification (of the packet, or of the carried/quoted one in an
    /// [`step::INNER_STATE`] step) | [`crate::IP_ID_READ`]; 0 when not read (IPv6, no IP
    /// header, or a recording made before this field: it was padding, always zero).
    pub ip_id: u32,
    pub saddr: [u8; 16],
    pub daddr: [u8; 16],
}

/// One traversal, as written to the ring buffer: everything up to `steps[nsteps]`.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TraversalRecord {
    /// [`crate::kind::TRAVERSAL`].
    pub kind: u8,
    /// One of [`crate::family`].
    pub family: u8,
    /// One of [`end`].
    pub end: u8,
    pub nvisits: u8,
    pub nsteps: u8,
    /// Bits of [`missing`]; non-zero means the record is partial.
    pub incomplete: u8,
    /// One of [`decision`].
    pub decision: u8,
    /// Bits of [`status`].
    pub status: u8,
    /// `enum skb_drop_reason` for [`end::DROPPED`].
    pub reason: u32,
    /// Probe plan generation when it entered (`config::PLAN_GEN`, modulo 256).
    pub generation: u8,
    /// Index of the current (last) visit, when `nvisits > 0`: kept rather than computed as
    /// `nvisits - 1`, whose bound the verifier cannot follow through the compiler's rewrite.
    pub cur_visit: u8,
    /// Index of the last step of the packet's own state, and of the last step holding an
    /// ICMP error's quoted packet: what the next reading is compared with.
    pub last_outer: u8,
    pub last_inner: u8,
    /// Kernel address of the `sk_buff`.
    pub skb: u64,
    pub ts_first: u64,
    pub ts_last: u64,
    /// Address in the kernel function that freed it ([`end::DROPPED`], [`end::CONSUMED`]).
    pub location: u64,
    /// The connection's tuples, raw, as of the last step that had one.
    pub ct_orig: [u8; CT_TUPLE_BYTES],
    pub ct_reply: [u8; CT_TUPLE_BYTES],
    pub visits: [Visit; MAX_VISITS],
    pub steps: [Step; MAX_STEPS],
}

/// Bytes of a record before its steps: what every written record holds.
pub const RECORD_HEAD_BYTES: usize =
    core::mem::size_of::<TraversalRecord>() - MAX_STEPS * STEP_BYTES;
pub const STEP_BYTES: usize = core::mem::size_of::<Step>();

const _: () = assert!(core::mem::size_of::<Visit>() == 16);
const _: () = assert!(core::mem::size_of::<Step>() == 64);
const _: () = assert!(RECORD_HEAD_BYTES == 48 + 2 * CT_TUPLE_BYTES + 16 * MAX_VISITS);
const _: () = assert!(core::mem::offset_of!(Step, saddr) % 8 == 0);
const _: () = assert!(core::mem::offset_of!(TraversalRecord, ct_orig) % 8 == 0);
const _: () = assert!(core::mem::offset_of!(TraversalRecord, steps) % 8 == 0);
const _: () = assert!(core::mem::size_of::<TraversalRecord>() == 272 + 64 * MAX_STEPS);
const _: () = assert!(core::mem::align_of::<TraversalRecord>() == 8);

/// Index `i` of an `N`-element array, which the caller has checked to be below `N`, made
/// provably so where it is used: clamped to `N - 1` (which changes nothing), with the value
/// hidden from the compiler first so that it cannot drop the clamp as redundant. Old
/// verifiers (Linux 6.1) lose the caller's check when the compiler reloads a spilled index
/// for the access; the clamp is on the very register the access uses.
#[inline(always)]
pub fn below<const N: usize>(i: usize) -> usize {
    core::hint::black_box(i).min(N - 1)
}

/// `a.get(i)`, its index bounded where it is used (see [`below`]).
#[inline(always)]
pub fn get<T, const N: usize>(a: &[T; N], i: usize) -> Option<&T> {
    if i < N { a.get(below::<N>(i)) } else { None }
}

/// `a.get_mut(i)`, its index bounded where it is used (see [`below`]).
#[inline(always)]
pub fn get_mut<T, const N: usize>(a: &mut [T; N], i: usize) -> Option<&mut T> {
    if i < N {
        a.get_mut(below::<N>(i))
    } else {
        None
    }
}

/// Packets the filter left out where they entered (TC ingress) that one CPU follows at once.
pub const LEFT_OUT_PER_CPU: usize = 4;

/// This CPU's packets the filter left out at TC ingress: no record, only what ends them
/// (counted as [`decision`] says) and what the probe after conntrack needs to decide again.
/// Their addresses share one cache line: the first thing every later probe compares.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LeftOut {
    /// skb addresses (0: free). No clock is read for them (it costs a left-out packet
    /// more than all its comparisons): one kept after all starts its record then.
    pub skb: [u64; LEFT_OUT_PER_CPU],
    /// [`decision::FILTERED_OUT`] or [`decision::SAMPLED_OUT`], plus [`left_out::ENTERED`].
    pub flags: [u8; LEFT_OUT_PER_CPU],
    /// The entry the next one goes to: entries are taken in turn, so the one there is the
    /// oldest (or free).
    pub next: u8,
    pub _pad: [u8; 3],
}

impl LeftOut {
    /// Where `skb` is, or [`LEFT_OUT_PER_CPU`] when it is not.
    #[inline(always)]
    pub fn position(&self, skb: u64) -> usize {
        let mut i = 0;
        while i < LEFT_OUT_PER_CPU {
            if self.skb[i] == skb {
                break;
            }
            i += 1;
        }
        i
    }

    /// Follows `skb` with decision `how`, in the next entry in turn: returns the flags of
    /// the packet it displaced, if any (left out whatever happens to it later).
    #[inline(always)]
    pub fn put(&mut self, skb: u64, how: u8) -> Option<u8> {
        let i = usize::from(self.next) % LEFT_OUT_PER_CPU;
        let displaced = self.take(i);
        if i < LEFT_OUT_PER_CPU {
            let i = below::<LEFT_OUT_PER_CPU>(i);
            self.skb[i] = skb;
            self.flags[i] = how & left_out::DECISION;
        }
        self.next = ((i + 1) % LEFT_OUT_PER_CPU) as u8;
        displaced
    }

    /// Forgets entry `i`: its flags, if it held a packet.
    #[inline(always)]
    pub fn take(&mut self, i: usize) -> Option<u8> {
        if i >= LEFT_OUT_PER_CPU {
            return None;
        }
        let i = below::<LEFT_OUT_PER_CPU>(i);
        if self.skb[i] == 0 {
            return None;
        }
        self.skb[i] = 0;
        Some(self.flags[i])
    }

    /// Entry `i` passes an entry point (program 0): true the first time, false when it meets
    /// one again (looped back as the same skb: another traversal).
    #[inline(always)]
    pub fn enter(&mut self, i: usize) -> bool {
        if i >= LEFT_OUT_PER_CPU {
            return false;
        }
        let i = below::<LEFT_OUT_PER_CPU>(i);
        let first = self.flags[i] & left_out::ENTERED == 0;
        self.flags[i] |= left_out::ENTERED;
        first
    }

    /// Entry `i` is left out by the filter whatever its own decision was (sampled out, say).
    #[inline(always)]
    pub fn filter_out(&mut self, i: usize) {
        if i < LEFT_OUT_PER_CPU {
            let i = below::<LEFT_OUT_PER_CPU>(i);
            self.flags[i] = (self.flags[i] & !left_out::DECISION) | decision::FILTERED_OUT;
        }
    }
}

/// [`LeftOut::flags`] bits above the decision.
pub mod left_out {
    /// The decision's bits.
    pub const DECISION: u8 = 3;
    /// It passed an entry point (program 0, the first PREROUTING probe): meeting one again,
    /// it is another traversal (looped back as the same skb).
    pub const ENTERED: u8 = 4;
}

/// What each CPU holds of its packets in flight (the `SLOTS` map's one value).
#[repr(C)]
#[derive(Clone, Copy)]
pub struct Slots {
    pub left_out: LeftOut,
    pub recs: [TraversalRecord; SLOTS_PER_CPU],
}

const _: () = assert!(core::mem::size_of::<LeftOut>() == 40);
const _: () = assert!(core::mem::offset_of!(Slots, recs) % 8 == 0);
const _: () = assert!(decision::SAMPLED_OUT & left_out::DECISION == decision::SAMPLED_OUT);
const _: () = assert!(decision::KEEP & left_out::DECISION == decision::KEEP);

impl TraversalRecord {
    /// Bytes to write: the head and the steps in use.
    #[inline(always)]
    pub fn written_len(&self) -> usize {
        let n = if (self.nsteps as usize) < MAX_STEPS {
            self.nsteps as usize
        } else {
            MAX_STEPS
        };
        RECORD_HEAD_BYTES + n * STEP_BYTES
    }

    /// The bytes the probes write for this record: its first [`Self::written_len`].
    pub fn written_bytes(&self) -> &[u8] {
        // SAFETY: TraversalRecord is repr(C) plain data; its written length is within its
        // size.
        unsafe {
            core::slice::from_raw_parts((self as *const Self).cast::<u8>(), self.written_len())
        }
    }
}

/// Clears `rec` word by word (a plain assignment could become a `memset` call) and starts
/// a traversal of `skb`.
#[inline(always)]
pub fn start(rec: &mut TraversalRecord, skb: u64, ts: u64, generation: u8) {
    let words = rec as *mut TraversalRecord as *mut u64;
    let mut i = 0;
    while i < RECORD_HEAD_BYTES / 8 {
        // SAFETY: the record is 8-byte aligned and longer than its head.
        unsafe { core::ptr::write_volatile(words.add(i), 0) };
        i += 1;
    }
    rec.kind = crate::kind::TRAVERSAL;
    rec.skb = skb;
    rec.ts_first = ts;
    rec.ts_last = ts;
    rec.generation = generation;
    rec.decision = decision::KEEP;
}

/// The visit `r` belongs to, opening a new one where the packet moved on to another hook
/// (or met a program it had already passed: a loop). `None` when the visits are full.
#[inline(always)]
fn visit_for(rec: &mut TraversalRecord, r: &Reading, program: u8) -> Option<usize> {
    let bit = 1u32 << (program as u32 & 31);
    let n = rec.nvisits as usize;
    let cur = rec.cur_visit as usize;
    if n > 0 && cur < MAX_VISITS {
        let last = &mut rec.visits[below::<MAX_VISITS>(cur)];
        if last.hook == r.header.hook && last.programs & bit == 0 {
            last.programs |= bit;
            return Some(cur);
        }
    }
    if n >= MAX_VISITS {
        rec.incomplete |= missing::VISITS;
        return None;
    }
    open_visit(
        rec,
        r.header.hook,
        r.header.ifindex_in,
        r.header.ifindex_out,
        bit,
    );
    Some(n)
}

/// Opens the record's next visit (the caller checked there is room): `hook`, the devices,
/// and the program `bit`.
#[inline(always)]
fn open_visit(rec: &mut TraversalRecord, hook: u8, ifindex_in: u32, ifindex_out: u32, bit: u32) {
    let n = rec.nvisits as usize;
    let Some(v) = get_mut(&mut rec.visits, n) else {
        return;
    };
    v.hook = hook;
    // SAFETY: plain bytes of a live visit (volatile: a 3-byte fill becomes `memset`).
    unsafe {
        core::ptr::write_volatile(&mut v.port[0], 0);
        core::ptr::write_volatile(&mut v.port[1], 0);
        core::ptr::write_volatile(&mut v.port[2], 0);
    }
    v.programs = bit;
    v.ifindex_in = ifindex_in;
    v.ifindex_out = ifindex_out;
    rec.nvisits = (n + 1) as u8;
    rec.cur_visit = n as u8;
}

impl Visit {
    /// [`Visit::port`] as an ifindex (`None`: none recorded).
    pub fn port(&self) -> Option<u32> {
        let p =
            u32::from(self.port[0]) | u32::from(self.port[1]) << 8 | u32::from(self.port[2]) << 16;
        (p != 0).then_some(p)
    }
}

/// Ifindexes [`Visit::port`] can hold.
pub const PORT_LIMIT: u32 = 1 << 24;

/// Notes `dev` (the ifindex of `skb->dev`) as the port of the record's current visit if
/// that visit is a FORWARD one and `dev` is neither of its devices (at a bridged frame's
/// FORWARD, br_netfilter gives the hook the bridge as both devices while the skb is already
/// on the port it is to leave by). Branch-light: every value but a fitting port writes zero.
#[inline(always)]
pub fn note_port(rec: &mut TraversalRecord, dev: u32) {
    if rec.nvisits == 0 {
        return;
    }
    let Some(v) = get_mut(&mut rec.visits, rec.cur_visit as usize) else {
        return;
    };
    if v.hook != crate::hook::FORWARD {
        return;
    }
    let keep = dev < PORT_LIMIT && dev != v.ifindex_in && dev != v.ifindex_out;
    let p = if keep { dev } else { 0 };
    v.port = [p as u8, (p >> 8) as u8, (p >> 16) as u8];
}

/// XOR of two 16-byte fields folded into one word: zero when they are equal. Branch-free,
/// so that the verifier sees one path whatever the bytes.
#[inline(always)]
fn diff16(a: &[u8; 16], b: &[u8; 16]) -> u64 {
    let (a, b) = (aligned_words(a), aligned_words(b));
    // SAFETY: both are 16 readable, 8-byte aligned bytes (`aligned_words`).
    unsafe { (a.read() ^ b.read()) | (a.add(1).read() ^ b.add(1).read()) }
}

/// `bytes` as 8-byte words. Every address, port and tuple field the probes copy or compare
/// starts on an 8-byte boundary (asserted offsets, in 8-byte aligned records): read as
/// such, a word is one load, where an unaligned read is eight on the BPF target.
#[inline(always)]
fn aligned_words<const B: usize>(bytes: &[u8; B]) -> *const u64 {
    debug_assert!(
        (bytes.as_ptr() as usize).is_multiple_of(8),
        "an unaligned field"
    );
    bytes.as_ptr() as *const u64
}

/// Whether the outer state read in `r` differs from step `s` (conntrack fields count only
/// when `r` has an entry).
#[inline(always)]
fn differs(s: &Step, r: &Reading) -> bool {
    let p = &r.packet;
    let ct_mask = 0u64.wrapping_sub(u64::from(r.header.flags & flags::CT != 0));
    let ct = (u64::from(s.ctinfo) ^ u64::from(r.ct.ctinfo))
        | (u64::from(s.ct_mark ^ r.ct.mark) << 8)
        | (u64::from(s.ct_status ^ r.ct.status as u32) << 16);
    let d = u64::from((s.flags & !step::INNER_STATE) ^ r.header.flags)
        | u64::from(s.mark ^ p.mark)
        | u64::from(s.len ^ p.len)
        | u64::from(s.sport ^ p.sport)
        | u64::from(s.dport ^ p.dport)
        | u64::from(s.l4proto ^ p.l4proto)
        | diff16(&s.saddr, &p.saddr)
        | diff16(&s.daddr, &p.daddr)
        | (ct & ct_mask);
    d != 0
}

/// Whether the quoted packet in `r` differs from the quoted state of step `s`.
#[inline(always)]
fn inner_differs(s: &Step, r: &Reading) -> bool {
    let i = &r.inner;
    let d = diff16(&s.saddr, &i.saddr)
        | diff16(&s.daddr, &i.daddr)
        | u64::from(s.sport ^ i.sport)
        | u64::from(s.dport ^ i.dport)
        | u64::from(s.l4proto ^ i.l4proto)
        | u64::from((s.flags ^ r.header.flags) & flags::ENCAP);
    d != 0
}

/// The next free step, or `None` (and the record flagged) when they are used up.
#[inline(always)]
fn next_step(rec: &mut TraversalRecord, visit: usize, program: u8) -> Option<&mut Step> {
    let n = rec.nsteps as usize;
    if n >= MAX_STEPS {
        rec.incomplete |= missing::STEPS;
        return None;
    }
    rec.nsteps = (n + 1) as u8;
    let s = &mut rec.steps[below::<MAX_STEPS>(n)];
    s.visit = visit as u8;
    s.program = program;
    // SAFETY: plain fields of a live step (volatile: see `copy_words`).
    unsafe {
        core::ptr::write_volatile(&mut s._pad, 0);
    }
    Some(s)
}

/// Copies `N` 8-byte words with volatile stores, which the compiler cannot merge into a
/// `memcpy`/`memset` call (the netfilter loader supports none). Both are 8-byte aligned
/// (see [`aligned_words`]).
#[inline(always)]
pub fn copy_words<const B: usize>(dst: &mut [u8; B], src: &[u8; B]) {
    debug_assert!(
        (dst.as_ptr() as usize).is_multiple_of(8),
        "an unaligned field"
    );
    let (d, s) = (dst.as_mut_ptr() as *mut u64, aligned_words(src));
    let mut i = 0;
    while i < B / 8 {
        // SAFETY: both hold B bytes, 8-byte aligned.
        unsafe { core::ptr::write_volatile(d.add(i), s.add(i).read()) };
        i += 1;
    }
}

#[inline(always)]
fn copy16(dst: &mut [u8; 16], src: &[u8; 16]) {
    copy_words(dst, src);
}

#[inline(always)]
fn copy_tuple(dst: &mut [u8; CT_TUPLE_BYTES], src: &[u8; CT_TUPLE_BYTES]) {
    copy_words(dst, src);
}

/// Adds the reading `r`, taken by probe program `program` (0 for TC), to `rec`.
#[inline(always)]
pub fn add_reading(rec: &mut TraversalRecord, r: &Reading, program: u8) {
    // A reading without a time (a probe within the same visit) leaves it.
    if r.header.ts_ns != 0 {
        rec.ts_last = r.header.ts_ns;
    }
    if rec.family == 0 {
        rec.family = r.header.family;
    }
    let Some(visit) = visit_for(rec, r, program) else {
        return;
    };
    let outer_changed = rec.nsteps == 0
        || match get(&rec.steps, rec.last_outer as usize) {
            Some(s) => differs(s, r),
            None => true,
        };
    let ct = r.header.flags & flags::CT != 0;
    if outer_changed {
        let at = rec.nsteps;
        let Some(s) = next_step(rec, visit, program) else {
            return;
        };
        let p = &r.packet;
        // Conntrack fields are zero without an entry: masked, not branched on.
        let ct_mask = 0u32.wrapping_sub(u32::from(ct));
        s.flags = r.header.flags;
        s.l4proto = p.l4proto;
        s.ip_version = p.ip_version;
        s.tcp_flags = p.tcp_flags;
        s.sport = p.sport;
        s.dport = p.dport;
        s.mark = p.mark;
        s.len = p.len;
        s.ip_id = p.ip_id;
        copy16(&mut s.saddr, &p.saddr);
        copy16(&mut s.daddr, &p.daddr);
        s.ctinfo = (r.ct.ctinfo & ct_mask) as u8;
        s.ct_mark = r.ct.mark & ct_mask;
        s.ct_status = r.ct.status as u32 & ct_mask;
        rec.last_outer = at;
        // Tuples change only with the state (NAT set up, entry confirmed): copied here,
        // not at every probe.
        if ct {
            copy_tuple(&mut rec.ct_orig, &r.ct.orig);
            copy_tuple(&mut rec.ct_reply, &r.ct.reply);
        }
    }
    if r.header.flags & flags::INNER != 0 {
        let changed = match get(&rec.steps, rec.last_inner as usize) {
            Some(s) if s.flags & step::INNER_STATE != 0 => inner_differs(s, r),
            _ => true,
        };
        if changed {
            let at = rec.nsteps;
            let Some(s) = next_step(rec, visit, program) else {
                return;
            };
            let i = &r.inner;
            let encap = r.header.flags & flags::ENCAP;
            s.flags = step::INNER_STATE | encap;
            s.l4proto = i.l4proto;
            s.sport = i.sport;
            s.dport = i.dport;
            s.ip_id = i.ip_id;
            // Volatile: a run of zero stores otherwise becomes a `memset` call.
            // SAFETY: plain fields of a live step.
            unsafe {
                core::ptr::write_volatile(&mut s.ip_version, 0);
                core::ptr::write_volatile(&mut s.tcp_flags, 0);
                core::ptr::write_volatile(&mut s.ctinfo, 0);
                core::ptr::write_volatile(
                    &mut s.mark,
                    if encap != 0 {
                        crate::parse::vni_of(i.vni)
                    } else {
                        0
                    },
                );
                core::ptr::write_volatile(&mut s.len, 0);
                core::ptr::write_volatile(&mut s.ct_mark, 0);
                core::ptr::write_volatile(&mut s.ct_status, 0);
            }
            copy16(&mut s.saddr, &i.saddr);
            copy16(&mut s.daddr, &i.daddr);
            rec.last_inner = at;
        }
    }
}

/// Fills the headers of `r` (addresses, ports, protocol, TCP flags, the quoted packet of an
/// ICMP error) from the record's last steps: for a probe that did not read them because no
/// table since the last one that did could rewrite them.
#[inline(always)]
pub fn reuse_headers(rec: &TraversalRecord, r: &mut Reading) {
    if rec.nsteps == 0 {
        return;
    }
    let Some(s) = get(&rec.steps, rec.last_outer as usize) else {
        return;
    };
    const HEADER_FLAGS: u8 =
        flags::NO_L3 | flags::NO_L4 | flags::FRAGMENT | flags::INNER | flags::ENCAP;
    let p = &mut r.packet;
    copy16(&mut p.saddr, &s.saddr);
    copy16(&mut p.daddr, &s.daddr);
    p.sport = s.sport;
    p.dport = s.dport;
    p.l4proto = s.l4proto;
    p.ip_version = s.ip_version;
    p.tcp_flags = s.tcp_flags;
    p.ip_id = s.ip_id;
    r.header.flags = (r.header.flags & !HEADER_FLAGS) | (s.flags & HEADER_FLAGS);
    if s.flags & flags::INNER != 0
        && let Some(i) = get(&rec.steps, rec.last_inner as usize)
    {
        let q = &mut r.inner;
        copy16(&mut q.saddr, &i.saddr);
        copy16(&mut q.daddr, &i.daddr);
        q.sport = i.sport;
        q.dport = i.dport;
        q.l4proto = i.l4proto;
        q.ip_id = i.ip_id;
        let vni = i.mark.to_be_bytes();
        q.vni = [vni[1], vni[2], vni[3]];
    }
}

/// What a probe between two tables reads of a packet when it need not read its headers
/// (no table since the record's last step could rewrite them): the skb's mark and length
/// and its conntrack entry's state, each one load.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Glance {
    /// One of [`crate::hook`].
    pub hook: u8,
    pub mark: u32,
    pub len: u32,
    /// The skb has a conntrack entry (then the three fields below are its state).
    pub ct: bool,
    pub ctinfo: u8,
    pub ct_mark: u32,
    /// The low word of the entry's status, as a step keeps it.
    pub ct_status: u32,
}

/// The short way for a probe within its hook's visit (not the hook's first point), when the
/// glance shows the packet as the record's last step has it: the point is added to the
/// visit, which is all [`add_reading`] would do with the whole reading there (its headers
/// taken from the record by [`reuse_headers`]), and true is returned. False, with the record
/// untouched, whenever the long way must look: anything changed, another hook, this program
/// already in the visit, a record without steps, an ICMP error's quoted packet.
#[inline(always)]
pub fn pass_unchanged(rec: &mut TraversalRecord, g: &Glance, program: u8) -> bool {
    if rec.nsteps == 0 || rec.nvisits == 0 || rec.family == 0 {
        return false;
    }
    let bit = 1u32 << (program as u32 & 31);
    let cur = rec.cur_visit as usize;
    let Some(s) = get(&rec.steps, rec.last_outer as usize) else {
        return false;
    };
    // The long way's reading carries the step's header flags and CT when there is an entry:
    // the step must say the same, and nothing it records may differ.
    if s.flags & !(flags::NO_L3 | flags::NO_L4 | flags::FRAGMENT) != ct_flag(g) || !same_state(s, g)
    {
        return false;
    }
    let Some(v) = get_mut(&mut rec.visits, cur) else {
        return false;
    };
    if v.hook != g.hook || v.programs & bit != 0 {
        return false;
    }
    v.programs |= bit;
    true
}

/// The step flag a glance's conntrack entry stands for.
#[inline(always)]
fn ct_flag(g: &Glance) -> u8 {
    if g.ct { flags::CT } else { 0 }
}

/// Whether the glance shows the mark, length and conntrack state step `s` records.
#[inline(always)]
fn same_state(s: &Step, g: &Glance) -> bool {
    s.len == g.len && same_mark_and_ct(s, g)
}

/// Whether the glance shows the mark and conntrack state step `s` records.
#[inline(always)]
fn same_mark_and_ct(s: &Step, g: &Glance) -> bool {
    let ct_differs =
        g.ct && (s.ctinfo != g.ctinfo || s.ct_mark != g.ct_mark || s.ct_status != g.ct_status);
    s.mark == g.mark && !ct_differs
}

/// Whether an IPv4 TCP or UDP packet's first 24 bytes (`l3`: a 20-byte header without
/// options, not a fragment, and its ports) hold the addresses, protocol and ports of step
/// `s`, a step with no header flags (only the conntrack flag the glance `g` implies).
#[inline(always)]
fn same_headers<const N: usize>(s: &Step, g: &Glance, l3: &[u8; N]) -> bool {
    const { assert!(N >= 24) };
    if s.flags != ct_flag(g) || s.ip_version != 4 || !matches!(s.l4proto, 6 | 17) {
        return false;
    }
    if l3[0] != 0x45 || u16::from_be_bytes([l3[6], l3[7]]) & 0x3fff != 0 || l3[9] != s.l4proto {
        return false;
    }
    // The step's IPv4 addresses fill the first 4 bytes of 16, the rest zero.
    let word = |a: usize| u64::from_ne_bytes([l3[a], l3[a + 1], l3[a + 2], l3[a + 3], 0, 0, 0, 0]);
    let (sa, da) = (aligned_words(&s.saddr), aligned_words(&s.daddr));
    // SAFETY: 16 readable, 8-byte aligned bytes each (`aligned_words`).
    let addrs = unsafe {
        (sa.read() ^ word(12)) | sa.add(1).read() | (da.read() ^ word(16)) | da.add(1).read()
    };
    let ports = (u16::from_be_bytes([l3[20], l3[21]]) ^ s.sport)
        | (u16::from_be_bytes([l3[22], l3[23]]) ^ s.dport);
    addrs == 0 && ports == 0
}

/// The short way at a hook's first point, for an IPv4 TCP or UDP packet without options or
/// fragmentation: the glance, the devices the hook has, and the packet's first `N` (24 or
/// more) bytes from its network header (`l3`). When the record's last step has exactly the
/// state, addresses, protocol and ports those bytes hold, the hook's visit is opened with
/// this point, which is all [`add_reading`] would do with the whole reading there, and true
/// is returned. False, with the record untouched, whenever the long way must read: anything
/// differs, the same hook, no room for a visit, a step with header flags (fragment, no
/// transport, a quoted packet) or of another protocol.
#[inline(always)]
pub fn enter_unchanged<const N: usize>(
    rec: &mut TraversalRecord,
    g: &Glance,
    ifindex_in: u32,
    ifindex_out: u32,
    l3: &[u8; N],
    program: u8,
) -> bool {
    const { assert!(N >= 24) };
    if rec.nsteps == 0 || rec.family != crate::family::IPV4 {
        return false;
    }
    let n = rec.nvisits as usize;
    if n == 0 || n >= MAX_VISITS || last_hook(rec) == Some(g.hook) {
        return false;
    }
    let Some(s) = get(&rec.steps, rec.last_outer as usize) else {
        return false;
    };
    if !same_headers(s, g, l3) || !same_state(s, g) {
        return false;
    }
    open_visit(
        rec,
        g.hook,
        ifindex_in,
        ifindex_out,
        1u32 << (program as u32 & 31),
    );
    true
}

/// The short way at TC egress, for an IPv4 TCP or UDP packet without options or
/// fragmentation: the glance (mark, length as TC has it, conntrack state), the output
/// device, and the packet's first `N` (34 or more) bytes from its IP header (`l3`). There the
/// long way always appends a step, if only because TC's length counts the link-layer header.
/// When the record's last step has the glance's mark and conntrack state and the addresses,
/// protocol, ports and TCP flags those bytes hold, the egress visit is opened and a copy of
/// that step with the new length appended, exactly what [`add_reading`] makes of the whole
/// reading (the connection's tuples, unchanged with its state, stay), and true is returned.
/// False, with the record untouched, whenever the long way must read: anything else
/// differs, no room for a visit or a step, a step with header flags or of another protocol.
#[inline(always)]
pub fn leave_unchanged<const N: usize>(
    rec: &mut TraversalRecord,
    g: &Glance,
    ifindex_out: u32,
    l3: &[u8; N],
) -> bool {
    const { assert!(N >= 34) };
    if rec.nsteps == 0 || rec.family != crate::family::IPV4 {
        return false;
    }
    let (n, at, last) = (
        rec.nvisits as usize,
        rec.nsteps as usize,
        rec.last_outer as usize,
    );
    if n == 0 || n >= MAX_VISITS || at >= MAX_STEPS {
        return false;
    }
    if last_hook(rec) == Some(g.hook) {
        return false;
    }
    let Some(s) = get(&rec.steps, last) else {
        return false;
    };
    // The same length too: the long way adds no step then (a device without a link-layer
    // header), which is rare enough to leave to it.
    if s.len == g.len {
        return false;
    }
    // The long way reads TCP's flags from the packet; other transports have none.
    let tcp_flags = if s.l4proto == 6 { l3[33] } else { 0 };
    if !same_headers(s, g, l3) || s.tcp_flags != tcp_flags || !same_mark_and_ct(s, g) {
        return false;
    }
    open_visit(rec, g.hook, 0, ifindex_out, 1);
    // The last step, word by word (volatile: no `memcpy`), then what differs.
    let words = rec.steps.as_mut_ptr() as *mut u64;
    const W: usize = STEP_BYTES / 8;
    let (at, last) = (below::<MAX_STEPS>(at), below::<MAX_STEPS>(last));
    let mut i = 0;
    while i < W {
        // SAFETY: `last` and `at` are below MAX_STEPS (checked, and clamped where they are
        // used: a bound the verifier sees where `last < at` would not be), steps are 8-byte aligned
        // (asserted) and `W` words long.
        unsafe { core::ptr::write_volatile(words.add(at * W + i), words.add(last * W + i).read()) };
        i += 1;
    }
    if let Some(step) = get_mut(&mut rec.steps, at) {
        step.visit = n as u8;
        step.program = 0;
        step.len = g.len;
    }
    rec.nsteps = (at + 1) as u8;
    rec.last_outer = at as u8;
    true
}

/// The last hook the record lists (one of [`crate::hook`]), if any.
#[inline(always)]
pub fn last_hook(rec: &TraversalRecord) -> Option<u8> {
    if rec.nvisits == 0 {
        return None;
    }
    get(&rec.visits, rec.cur_visit as usize).map(|v| v.hook)
}

/// Whether a packet met at a bridge device's TC ingress under the address of `rec` is the
/// same packet going on: a frame that entered through a port of the bridge (TC ingress
/// there, then PREROUTING where br_netfilter walked it) and is now passed up to the bridge
/// device to be routed or delivered (`br_pass_frame_up`). A record that ended its last visit
/// anywhere else belongs to a packet freed unseen: stale.
#[inline(always)]
pub fn continues_into_bridge(rec: &TraversalRecord) -> bool {
    matches!(
        last_hook(rec),
        Some(crate::hook::TC_INGRESS | crate::hook::PRE_ROUTING)
    )
}

/// Whether a packet met at OUTPUT's first point under the address of `rec` is the same
/// packet going on: a hook function took it in INPUT and sends it out again as the same skb.
/// IPVS does (LOCAL_IN 99, `ip_vs_nat_send_or_cont`/`ip_vs_send_or_cont` run LOCAL_OUT
/// for it, then POSTROUTING). A packet a socket took is freed, its end seen, before its
/// address can start another packet; one whose visit to INPUT is still open was not.
#[inline(always)]
pub fn resent_from_input(rec: &TraversalRecord, hook_no: u8) -> bool {
    hook_no == crate::hook::LOCAL_OUT
        && last_hook(rec) == Some(crate::hook::LOCAL_IN)
        && rec.status & status::SOCKET == 0
}

#[cfg(test)]
mod tests {
    extern crate std;
    use super::*;
    use crate::{family, hook};
    use std::vec;

    /// The glance a probe would take of `r` (the reading the long way would make there).
    fn glance_of(r: &Reading) -> Glance {
        let ct = r.header.flags & flags::CT != 0;
        Glance {
            hook: r.header.hook,
            mark: r.packet.mark,
            len: r.packet.len,
            ct,
            ctinfo: r.ct.ctinfo as u8,
            ct_mark: r.ct.mark,
            ct_status: r.ct.status as u32,
        }
    }

    /// The long way at a probe that reads no headers: the reading's mark, length and
    /// conntrack state, the rest from the record.
    fn long_way(rec: &mut TraversalRecord, g: &Glance, program: u8) {
        let mut r = Reading::default();
        with_glance(&mut r, g);
        // Status bits above the low word, which a step does not keep.
        r.ct.status |= u64::from(g.ct) << 40;
        reuse_headers(rec, &mut r);
        add_reading(rec, &r, program);
    }

    #[test]
    fn the_short_way_between_tables_is_the_long_way_when_nothing_changed() {
        let mut first = reading(hook::PRE_ROUTING, 0, 80);
        first.packet.len = 60;
        first.header.flags |= flags::CT;
        first.ct.ctinfo = 2;
        first.ct.status = 8;
        let mut rec = fresh();
        add_reading(&mut rec, &first, 0);
        let same = glance_of(&first);
        let cases: [(&str, Glance, u8, bool); 8] = [
            ("unchanged", same, 1, true),
            (
                "mark set",
                Glance {
                    mark: 0x4000,
                    ..same
                },
                1,
                false,
            ),
            ("length changed", Glance { len: 61, ..same }, 1, false),
            (
                "conntrack mark set",
                Glance { ct_mark: 1, ..same },
                1,
                false,
            ),
            (
                "entry confirmed",
                Glance {
                    ct_status: 8 | 4,
                    ..same
                },
                1,
                false,
            ),
            (
                "entry gone",
                Glance {
                    ct: false,
                    ctinfo: 0,
                    ct_mark: 0,
                    ct_status: 0,
                    ..same
                },
                1,
                false,
            ),
            (
                "another hook",
                Glance {
                    hook: hook::FORWARD,
                    ..same
                },
                1,
                false,
            ),
            ("program already in the visit", same, 0, false),
        ];
        for (what, g, program, short) in cases {
            let mut by_glance = rec;
            let mut by_reading = rec;
            assert_eq!(pass_unchanged(&mut by_glance, &g, program), short, "{what}");
            if short {
                long_way(&mut by_reading, &g, program);
                assert_eq!(by_glance, by_reading, "{what}: the same record either way");
                assert_eq!(
                    by_glance.visits[0].programs, 0b11,
                    "{what}: the point is listed"
                );
            } else {
                assert_eq!(by_glance, rec, "{what}: untouched for the long way");
            }
        }
        // No entry yet (before conntrack), and an ICMP error: the long way.
        let mut plain = fresh();
        add_reading(&mut plain, &reading(hook::PRE_ROUTING, 0, 80), 0);
        let g = glance_of(&reading(hook::PRE_ROUTING, 0, 80));
        let mut by_reading = plain;
        assert!(pass_unchanged(&mut plain, &g, 1));
        long_way(&mut by_reading, &g, 1);
        assert_eq!(plain, by_reading);
        let mut icmp = reading(hook::PRE_ROUTING, 0, 0);
        icmp.header.flags |= flags::INNER;
        let mut quoted = fresh();
        add_reading(&mut quoted, &icmp, 0);
        assert!(!pass_unchanged(&mut quoted, &glance_of(&icmp), 1));
        assert!(!pass_unchanged(&mut fresh(), &g, 1), "no steps");
    }

    /// An IPv4 packet's first 40 bytes: header (`ihl` words, flags/fragment word `frag`),
    /// then the transport's ports 1234 -> `dport` and TCP's flags (SYN).
    fn ipv4_bytes(ihl: u8, frag: u16, proto: u8, daddr: [u8; 4], dport: u16) -> [u8; 40] {
        let mut b = [0u8; 40];
        b[0] = 0x40 | ihl;
        b[6..8].copy_from_slice(&frag.to_be_bytes());
        b[8] = 64;
        b[9] = proto;
        b[12..16].copy_from_slice(&[10, 0, 0, 1]);
        b[16..20].copy_from_slice(&daddr);
        let l4 = usize::from(ihl) * 4;
        b[l4..l4 + 2].copy_from_slice(&1234u16.to_be_bytes());
        b[l4 + 2..l4 + 4].copy_from_slice(&dport.to_be_bytes());
        b[l4 + 13] = 0x02;
        b
    }

    const POD: [u8; 4] = [172, 17, 0, 5];

    /// A record started by the long way at `hook_no` from a TCP packet to [`POD`]:80 of 60
    /// bytes with a conntrack entry (`ct_status`), from device 3 to `dev_out`; the packet's
    /// bytes and the glance that matches them.
    fn started(
        hook_no: u8,
        mark: u32,
        ct_status: u32,
        dev_out: u32,
    ) -> (TraversalRecord, [u8; 40], Glance) {
        let tcp = ipv4_bytes(5, 0x4000, 6, POD, 80);
        let g = Glance {
            hook: hook_no,
            mark,
            len: 60,
            ct: true,
            ctinfo: 2,
            ct_mark: 0,
            ct_status,
        };
        let mut rec = fresh();
        add_reading(&mut rec, &parsed(&tcp, &g, 3, dev_out), 0);
        (rec, tcp, g)
    }

    /// A TCP packet to [`POD`]:80 with one thing changed each: what the short ways must
    /// leave to the long way.
    fn header_changes() -> [(&'static str, [u8; 40]); 5] {
        [
            (
                "address rewritten",
                ipv4_bytes(5, 0x4000, 6, [10, 0, 0, 9], 80),
            ),
            ("port rewritten", ipv4_bytes(5, 0x4000, 6, POD, 8080)),
            ("options", ipv4_bytes(6, 0x4000, 6, POD, 80)),
            ("a fragment", ipv4_bytes(5, 0x2000, 6, POD, 80)),
            ("another protocol", ipv4_bytes(5, 0x4000, 17, POD, 80)),
        ]
    }

    /// The long way's whole reading at a hook: `bytes` parsed as the probes parse them, the
    /// devices, and the glance's mark, length and conntrack state.
    fn parsed(bytes: &[u8; 40], g: &Glance, dev_in: u32, dev_out: u32) -> Reading {
        struct Bytes<'a>(&'a [u8; 40]);
        impl crate::parse::PacketReader for Bytes<'_> {
            fn bytes<const M: usize>(&self, off: usize) -> Option<[u8; M]> {
                self.0.get(off..off + M)?.try_into().ok()
            }
        }
        let mut r = Reading::default();
        let hdr = crate::parse::ip_header_at(&Bytes(bytes), 0).expect("an IP header");
        crate::parse::parse_headers(&Bytes(bytes), &hdr, &mut r).expect("parsed");
        with_glance(&mut r, g);
        r.header.ifindex_in = dev_in;
        r.header.ifindex_out = dev_out;
        r
    }

    /// What the long way reads that a glance shows too: hook, mark, length, conntrack state.
    fn with_glance(r: &mut Reading, g: &Glance) {
        r.header.hook = g.hook;
        r.header.family = family::IPV4;
        r.packet.mark = g.mark;
        r.packet.len = g.len;
        if g.ct {
            r.header.flags |= flags::CT;
            r.ct.ctinfo = u32::from(g.ctinfo);
            r.ct.mark = g.ct_mark;
            r.ct.status = u64::from(g.ct_status);
        }
    }

    #[test]
    fn the_short_way_into_a_hook_is_the_long_way_when_nothing_changed() {
        let (rec, tcp, at_pre) = started(hook::PRE_ROUTING, 0, 0x18a, 0);
        let fwd = Glance {
            hook: hook::FORWARD,
            ..at_pre
        };
        let mut cases = vec![("unchanged", tcp, fwd, true)];
        cases.extend(header_changes().map(|(what, b)| (what, b, fwd, false)));
        cases.extend([
            (
                "mark set",
                tcp,
                Glance {
                    mark: 0x4000,
                    ..fwd
                },
                false,
            ),
            ("entry gone", tcp, Glance { ct: false, ..fwd }, false),
            ("the same hook", tcp, at_pre, false),
        ]);
        for (what, bytes, g, short) in cases {
            let mut by_glance = rec;
            assert_eq!(
                enter_unchanged(&mut by_glance, &g, 3, 4, &bytes, 1),
                short,
                "{what}"
            );
            if short {
                let mut by_reading = rec;
                add_reading(&mut by_reading, &parsed(&bytes, &g, 3, 4), 1);
                assert_eq!(by_glance, by_reading, "{what}: the same record either way");
                assert_eq!(by_glance.nvisits, 2, "{what}: the hook's visit is open");
                assert_eq!(
                    (
                        by_glance.visits[1].ifindex_in,
                        by_glance.visits[1].ifindex_out
                    ),
                    (3, 4)
                );
            } else {
                assert_eq!(by_glance, rec, "{what}: untouched for the long way");
            }
        }
        // UDP too; not ICMP (its "ports" are other fields), not a full record.
        let udp = ipv4_bytes(5, 0, 17, POD, 53);
        let mut plain = fresh();
        add_reading(&mut plain, &parsed(&udp, &at_pre, 3, 0), 0);
        let mut by_reading = plain;
        assert!(enter_unchanged(&mut plain, &fwd, 3, 4, &udp, 1));
        add_reading(&mut by_reading, &parsed(&udp, &fwd, 3, 4), 1);
        assert_eq!(plain, by_reading);
        let icmp = ipv4_bytes(5, 0, 1, POD, 0);
        let mut ping = fresh();
        add_reading(&mut ping, &parsed(&icmp, &at_pre, 3, 0), 0);
        assert!(!enter_unchanged(&mut ping, &fwd, 3, 4, &icmp, 1));
        let mut full = fresh();
        add_reading(&mut full, &parsed(&tcp, &at_pre, 3, 0), 0);
        full.nvisits = MAX_VISITS as u8;
        let before = full;
        assert!(!enter_unchanged(&mut full, &fwd, 3, 4, &tcp, 1), "no room");
        assert_eq!(full, before);
        assert!(
            !enter_unchanged(&mut fresh(), &fwd, 3, 4, &tcp, 1),
            "no steps"
        );
    }

    #[test]
    fn the_short_way_out_is_the_long_way_when_only_the_length_changed() {
        let (rec, tcp, at_post) = started(hook::POST_ROUTING, 0x4000, 0x1b2, 4);
        let out = Glance {
            hook: hook::TC_EGRESS,
            len: 74,
            ..at_post
        };
        let mut other_flags = tcp;
        other_flags[33] = 0x10;
        let mut cases = vec![("only the length", tcp, out, true)];
        cases.extend(header_changes().map(|(what, b)| (what, b, out, false)));
        cases.extend([
            ("other TCP flags", other_flags, out, false),
            ("mark changed", tcp, Glance { mark: 0, ..out }, false),
            (
                "conntrack status changed (confirmed)",
                tcp,
                Glance {
                    ct_status: 0x1b2 | 8,
                    ..out
                },
                false,
            ),
            ("entry gone", tcp, Glance { ct: false, ..out }, false),
            ("the same length", tcp, Glance { len: 60, ..out }, false),
            (
                "the same hook",
                tcp,
                Glance {
                    hook: hook::POST_ROUTING,
                    ..out
                },
                false,
            ),
        ]);
        for (what, bytes, g, short) in cases {
            let mut by_glance = rec;
            assert_eq!(
                leave_unchanged(&mut by_glance, &g, 4, &bytes),
                short,
                "{what}"
            );
            if short {
                let mut by_reading = rec;
                add_reading(&mut by_reading, &parsed(&bytes, &g, 0, 4), 0);
                assert_eq!(by_glance, by_reading, "{what}: the same record either way");
                assert_eq!((by_glance.nvisits, by_glance.nsteps), (2, 2), "{what}");
                assert_eq!(by_glance.steps[1].len, 74);
            } else {
                assert_eq!(by_glance, rec, "{what}: untouched for the long way");
            }
        }
        // After more steps (the last one the packet's state), UDP, without conntrack.
        let udp = ipv4_bytes(5, 0, 17, POD, 53);
        let bare = Glance {
            ct: false,
            ctinfo: 0,
            ct_status: 0,
            ..at_post
        };
        let mut plain = fresh();
        add_reading(
            &mut plain,
            &parsed(&udp, &Glance { mark: 0, ..bare }, 3, 0),
            0,
        );
        add_reading(&mut plain, &parsed(&udp, &bare, 3, 4), 1);
        let mut by_reading = plain;
        let udp_out = Glance {
            hook: hook::TC_EGRESS,
            len: 74,
            ..bare
        };
        assert!(leave_unchanged(&mut plain, &udp_out, 4, &udp));
        add_reading(&mut by_reading, &parsed(&udp, &udp_out, 0, 4), 0);
        assert_eq!(plain, by_reading);
        // Not ICMP, not without room for a visit or a step, not a record without steps.
        let icmp = ipv4_bytes(5, 0, 1, POD, 0);
        let mut ping = fresh();
        add_reading(&mut ping, &parsed(&icmp, &at_post, 3, 4), 0);
        assert!(!leave_unchanged(&mut ping, &out, 4, &icmp));
        for (what, full) in [("visits", true), ("steps", false)] {
            let mut rec = rec;
            if full {
                rec.nvisits = MAX_VISITS as u8;
            } else {
                rec.nsteps = MAX_STEPS as u8;
            }
            let before = rec;
            assert!(!leave_unchanged(&mut rec, &out, 4, &tcp), "no room: {what}");
            assert_eq!(rec, before);
        }
        assert!(!leave_unchanged(&mut fresh(), &out, 4, &tcp), "no steps");
    }

    fn reading(hook_no: u8, mark: u32, dport: u16) -> Reading {
        let mut r = Reading::default();
        r.header.hook = hook_no;
        r.header.family = family::IPV4;
        r.packet.ip_version = 4;
        r.packet.l4proto = 6;
        r.packet.saddr[..4].copy_from_slice(&[10, 0, 0, 1]);
        r.packet.daddr[..4].copy_from_slice(&[10, 0, 0, 2]);
        r.packet.dport = dport;
        r.packet.mark = mark;
        r
    }

    fn fresh() -> TraversalRecord {
        // SAFETY: all-zero is a valid TraversalRecord (plain integers and arrays).
        let mut rec: TraversalRecord = unsafe { core::mem::zeroed() };
        start(&mut rec, 0xffff_1000, 5, 1);
        rec
    }

    #[test]
    fn only_changes_become_steps() {
        let mut rec = fresh();
        add_reading(&mut rec, &reading(hook::TC_INGRESS, 0, 80), 0);
        for p in 0..6 {
            let mark = if p >= 4 { 0x4000 } else { 0 };
            add_reading(&mut rec, &reading(hook::PRE_ROUTING, mark, 80), p);
        }
        assert_eq!(rec.nvisits, 2);
        assert_eq!(rec.visits[1].programs, 0b111111);
        assert_eq!(rec.nsteps, 2, "the first reading and the mark change");
        assert_eq!((rec.steps[1].visit, rec.steps[1].program), (1, 4));
        assert_eq!(rec.steps[1].mark, 0x4000);
        assert_eq!(rec.written_len(), RECORD_HEAD_BYTES + 2 * STEP_BYTES);
        assert_eq!(rec.incomplete, 0);
    }

    #[test]
    fn a_program_seen_twice_in_a_hook_opens_a_visit() {
        let mut rec = fresh();
        add_reading(&mut rec, &reading(hook::LOCAL_OUT, 0, 80), 0);
        add_reading(&mut rec, &reading(hook::LOCAL_OUT, 0, 80), 1);
        add_reading(&mut rec, &reading(hook::LOCAL_OUT, 0, 80), 0);
        assert_eq!(rec.nvisits, 2);
        assert_eq!(rec.visits[0].programs, 0b11);
        assert_eq!(rec.visits[1].programs, 0b1);
    }

    #[test]
    fn overflow_is_flagged_not_written_past_the_end() {
        let mut rec = fresh();
        for i in 0..(MAX_STEPS as u32 + 5) {
            add_reading(&mut rec, &reading(hook::FORWARD, i, 80), (i % 20) as u8);
        }
        assert_eq!(rec.nsteps as usize, MAX_STEPS);
        assert_ne!(rec.incomplete & missing::STEPS, 0);
        let mut rec = fresh();
        for i in 0..(MAX_VISITS as u8 + 2) {
            let h = if i % 2 == 0 {
                hook::FORWARD
            } else {
                hook::POST_ROUTING
            };
            add_reading(&mut rec, &reading(h, 0, 80), 0);
        }
        assert_eq!(rec.nvisits as usize, MAX_VISITS);
        assert_ne!(rec.incomplete & missing::VISITS, 0);
    }

    #[test]
    fn headers_reused_from_the_last_step_add_no_step() {
        let mut rec = fresh();
        let mut r = reading(hook::FORWARD, 0x10, 443);
        r.header.flags |= flags::CT;
        r.ct.ctinfo = 2;
        add_reading(&mut rec, &r, 0);
        // A probe that read only the skb (mark changed) and took the headers from the record.
        let mut next = Reading::default();
        next.header.hook = hook::FORWARD;
        next.header.family = family::IPV4;
        next.header.flags = flags::CT;
        next.ct.ctinfo = 2;
        next.packet.mark = 0x30;
        reuse_headers(&rec, &mut next);
        add_reading(&mut rec, &next, 1);
        assert_eq!(rec.nsteps, 2);
        let s = rec.steps[1];
        assert_eq!(
            (s.dport, s.l4proto, s.ip_version, s.mark),
            (443, 6, 4, 0x30)
        );
        assert_eq!(s.daddr, r.packet.daddr);
    }

    #[test]
    fn quoted_packet_changes_are_their_own_steps() {
        let mut rec = fresh();
        let mut r = reading(hook::PRE_ROUTING, 0, 0);
        r.header.flags |= flags::INNER;
        r.inner.l4proto = 17;
        r.inner.dport = 53;
        add_reading(&mut rec, &r, 0);
        add_reading(&mut rec, &r, 1);
        r.inner.dport = 5353;
        add_reading(&mut rec, &r, 2);
        assert_eq!(rec.nsteps, 3, "outer, quoted, quoted again");
        assert_eq!(rec.steps[1].flags, step::INNER_STATE);
        assert_eq!((rec.steps[2].program, rec.steps[2].dport), (2, 5353));
    }
    #[test]
    fn an_encapsulated_packet_keeps_its_inner_packet_and_vni_in_one_step() {
        let mut rec = fresh();
        let mut r = reading(hook::TC_INGRESS, 0, 4789);
        r.header.flags |= flags::INNER | flags::ENCAP;
        r.inner.l4proto = 6;
        r.inner.dport = 8080;
        r.inner.vni = [0, 0, 1];
        add_reading(&mut rec, &r, 0);
        assert_eq!(rec.nsteps, 2, "outer, encapsulated");
        let inner = rec.steps[1];
        assert_eq!(inner.flags, step::INNER_STATE | flags::ENCAP);
        assert_eq!((inner.dport, inner.mark), (8080, 1));
        // A probe that took the headers from the record sees the same packet: no step.
        let mut next = Reading::default();
        next.header.hook = hook::PRE_ROUTING;
        next.header.family = family::IPV4;
        reuse_headers(&rec, &mut next);
        assert_eq!(next.inner.vni, [0, 0, 1]);
        add_reading(&mut rec, &next, 1);
        assert_eq!(rec.nsteps, 2);
    }

    #[test]
    fn left_out_entries_are_taken_in_turn_and_say_whom_they_displace() {
        let mut lo = LeftOut::default();
        assert_eq!(lo.position(0x100), LEFT_OUT_PER_CPU);
        for n in 0..LEFT_OUT_PER_CPU as u64 {
            let how = if n == 0 {
                decision::SAMPLED_OUT
            } else {
                decision::FILTERED_OUT
            };
            assert_eq!(lo.put(0x100 + n, how), None, "room for {n}");
        }
        assert_eq!(lo.position(0x102), 2);
        // Full: the oldest (sampled out) makes room, and says how it was left out.
        assert_eq!(
            lo.put(0x200, decision::FILTERED_OUT),
            Some(decision::SAMPLED_OUT)
        );
        assert_eq!(lo.position(0x100), LEFT_OUT_PER_CPU);
        assert_eq!(lo.position(0x200), 0);
        // An ended packet's entry is free, and is the one taken when its turn comes.
        assert_eq!(lo.take(lo.position(0x102)), Some(decision::FILTERED_OUT));
        assert_eq!(lo.take(2), None, "taken once");
        assert_eq!(
            lo.put(0x201, decision::FILTERED_OUT),
            Some(decision::FILTERED_OUT)
        );
        assert_eq!(lo.position(0x101), LEFT_OUT_PER_CPU);
        assert_eq!(
            lo.put(0x202, decision::FILTERED_OUT),
            None,
            "the freed entry"
        );
        assert_eq!(lo.position(0x202), 2);
    }

    #[test]
    fn a_left_out_packet_enters_once_and_the_filter_overrides_sampling() {
        let mut lo = LeftOut::default();
        lo.put(0x100, decision::SAMPLED_OUT);
        let i = lo.position(0x100);
        assert!(lo.enter(i), "first entry point");
        assert!(!lo.enter(i), "an entry point again is another traversal");
        lo.filter_out(i);
        assert_eq!(
            lo.take(i).map(|f| f & left_out::DECISION),
            Some(decision::FILTERED_OUT)
        );
        // Out-of-range positions (not found) change nothing.
        assert!(!lo.enter(LEFT_OUT_PER_CPU));
        assert_eq!(lo.take(LEFT_OUT_PER_CPU), None);
    }

    #[test]
    fn a_frame_passed_up_to_a_bridge_continues_only_after_its_entry() {
        let mut rec = fresh();
        assert!(!continues_into_bridge(&rec), "nothing seen yet");
        add_reading(&mut rec, &reading(hook::TC_INGRESS, 0, 60), 0);
        assert!(continues_into_bridge(&rec));
        add_reading(&mut rec, &reading(hook::PRE_ROUTING, 1, 60), 1);
        assert!(continues_into_bridge(&rec));
        add_reading(&mut rec, &reading(hook::FORWARD, 1, 60), 1);
        assert!(
            !continues_into_bridge(&rec),
            "a record past PREROUTING is stale"
        );
    }

    #[test]
    fn a_packet_ipvs_sends_on_continues_from_input_into_output() {
        let mut rec = fresh();
        add_reading(&mut rec, &reading(hook::TC_INGRESS, 0, 60), 0);
        add_reading(&mut rec, &reading(hook::PRE_ROUTING, 1, 60), 0);
        assert!(!resent_from_input(&rec, hook::LOCAL_OUT), "not in INPUT");
        add_reading(&mut rec, &reading(hook::LOCAL_IN, 1, 60), 0);
        assert!(resent_from_input(&rec, hook::LOCAL_OUT));
        assert!(!resent_from_input(&rec, hook::PRE_ROUTING), "only OUTPUT");
        rec.status |= status::SOCKET;
        assert!(
            !resent_from_input(&rec, hook::LOCAL_OUT),
            "a socket took it: another packet"
        );
    }

    #[test]
    fn a_bridged_frames_out_port_is_noted_at_forward_only() {
        let bridged = |dev: u32| {
            let mut rec = fresh();
            let mut r = reading(hook::PRE_ROUTING, 0, 80);
            (r.header.ifindex_in, r.header.ifindex_out) = (4, 0);
            add_reading(&mut rec, &r, 0);
            note_port(&mut rec, dev);
            assert_eq!(rec.visits[0].port(), None, "no port outside FORWARD");
            r.header.hook = hook::FORWARD;
            (r.header.ifindex_in, r.header.ifindex_out) = (4, 4);
            add_reading(&mut rec, &r, 1);
            note_port(&mut rec, dev);
            rec.visits[1].port()
        };
        assert_eq!(bridged(7), Some(7), "skb->dev is the out port");
        assert_eq!(bridged(0x00ab_cdef), Some(0x00ab_cdef));
        assert_eq!(bridged(4), None, "routed: skb->dev is a hook device");
        assert_eq!(bridged(PORT_LIMIT), None, "too large to hold: not claimed");
        // A visit opened later starts without a port.
        let mut rec = fresh();
        let mut r = reading(hook::FORWARD, 0, 80);
        (r.header.ifindex_in, r.header.ifindex_out) = (4, 4);
        add_reading(&mut rec, &r, 1);
        note_port(&mut rec, 9);
        r.header.hook = hook::POST_ROUTING;
        add_reading(&mut rec, &r, 1);
        assert_eq!(
            (rec.visits[0].port(), rec.visits[1].port()),
            (Some(9), None)
        );
    }
}
