//! TC (tcx) probes: the packet as on the wire, at ingress before netfilter (where most
//! traversals start) and at egress after (where forwarded and sent ones end). Loaded by Aya;
//! this object owns the maps that the netfilter object shares, and the end events (`ends`).
#![no_std]
#![no_main]

use aya_ebpf::{macros::classifier, programs::TcContext};
use observer_common::parse::ip_header_at;
use observer_common::traversal::{
    TraversalRecord, add_reading, continues_into_bridge, decision, end, leave_unchanged, missing,
};
use observer_common::{PacketEvent, config, counter, family, flags, hook, kind};
use observer_ebpf::inflight::{
    Found, Logged, Place, begin, close_stale, find, find_left_out, finish, leave_out, opaque,
};
use observer_ebpf::{
    Decide, PKT_WINDOW_BYTES, PacketReader, Windows, cfg, count, counts, decide, direct_reads,
    filter_nets, glance, packet_words, parse_headers, read_ct, read_word, scratch, window_bytes,
    windows,
};

/// The end events: drops, frees and sockets.
#[path = "tc/ends.rs"]
mod ends;

/// `TCX_NEXT` / `TC_ACT_UNSPEC`: hand the packet on unchanged, to the next tcx program if any.
const TC_NEXT: i32 = -1;

#[classifier]
pub fn observer_tc_ingress(ctx: TcContext) -> i32 {
    observe::<false>(&ctx, hook::TC_INGRESS);
    TC_NEXT
}

#[classifier]
pub fn observer_tc_egress(ctx: TcContext) -> i32 {
    observe::<false>(&ctx, hook::TC_EGRESS);
    TC_NEXT
}

/// TC ingress of a bridge device (attached instead of [`observer_tc_ingress`] there): a
/// frame a port passed up to the bridge (to be routed or delivered) is the packet that
/// entered through that port, whose traversal goes on.
#[classifier]
pub fn observer_tc_bridge_ingress(ctx: TcContext) -> i32 {
    observe::<true>(&ctx, hook::TC_INGRESS);
    TC_NEXT
}

/// TC egress of a bridge device: the bridge's transmit (`br_dev_xmit`) hands the same skb
/// on to a port (a packet the node sends to a pod, or one br_netfilter sent through the
/// neighbour's output after a DNAT to the same bridge), so the traversal does not end here
/// but where it leaves through that port, or where it is dropped or freed.
#[classifier]
pub fn observer_tc_bridge_egress(ctx: TcContext) -> i32 {
    observe::<true>(&ctx, hook::TC_EGRESS);
    TC_NEXT
}

/// One TC point; `BRIDGE` for a bridge device, where nothing ends and a packet passed up
/// from a port goes on.
#[inline(always)]
fn observe<const BRIDGE: bool>(ctx: &TcContext, at: u8) {
    // The floor, or counting only: tcx links are being released.
    if cfg(config::FLOOR).is_some_and(|f| f != 0) || counts::count_only() {
        return;
    }
    if cfg(config::READY).is_none() {
        count(counter::NOT_CONFIGURED);
        return;
    }
    // A plain number, not the context pointer: kernels before 6.18 refuse arithmetic on a
    // context pointer, which the compiler may otherwise do on this value (a read at
    // `skb + offset`).
    let skb = opaque(ctx.skb.skb as usize) as u64;
    if BRIDGE {
        // Left out where it entered (a port, or the bridge's own output): left out still,
        // until it ends where it leaves.
        if find_left_out(skb).is_some() {
            return;
        }
        if let Some(f) = find(skb)
            && (at == hook::TC_EGRESS || continues_into_bridge(f.rec))
        {
            // The same traversal, a new visit: nothing ends at a bridge device.
            if f.rec.decision == decision::KEEP
                && !(at == hook::TC_EGRESS && leaves_unchanged(ctx, f.rec))
                && let Some(ev) = scratch()
                && read_packet(ctx, ev, at).is_some()
            {
                add_reading(f.rec, ev, 0);
            }
            return;
        }
    }
    if at == hook::TC_INGRESS && left_out_at_entry(ctx, skb) {
        return;
    }
    if at == hook::TC_EGRESS && !BRIDGE {
        // Left out by the filter: counted, not read.
        if let Some(lo) = find_left_out(skb) {
            lo.end();
            return;
        }
        if let Some(f) = find(skb) {
            if f.rec.decision != decision::KEEP || leaves_unchanged(ctx, f.rec) {
                finish(f, end::EGRESS);
                return;
            }
        }
    }
    let Some(ev) = scratch() else {
        return;
    };
    if read_packet(ctx, ev, at).is_none() {
        // Not IP (ARP, LLDP, ...): nothing netfilter sees.
        return;
    }
    // Decided before the in-flight bookkeeping, and passed on as a value the verifier does
    // not follow: otherwise every path through the filter multiplies every path after it.
    let verdict = opaque(decide(ev, Decide::Entry) as usize) as u8;
    let mut found = find(skb);
    if at == hook::TC_INGRESS {
        // Nothing arrives twice: a record under this address belongs to a packet that was
        // freed unseen.
        close_stale_at_entry(skb, found.take());
        if verdict != decision::KEEP {
            leave_out(skb, verdict);
            return;
        }
    }
    let f = match found {
        Some(f) => f,
        None => {
            let Some(rec) = begin::<Logged>(skb) else {
                return;
            };
            if at == hook::TC_EGRESS {
                rec.incomplete |= missing::START;
                count(counter::NO_START);
            }
            rec.decision = verdict;
            Found {
                rec,
                place: Place::Slot,
            }
        }
    };
    if f.rec.decision == decision::KEEP {
        add_reading(f.rec, ev, 0);
    }
    if at == hook::TC_EGRESS && !BRIDGE {
        finish(f, end::EGRESS);
    }
}

/// The filter's look at a packet entering, the short way: a packet whose addresses both
/// lie outside the filter's networks ([`observer_common::filter::FilterNets`]) cannot
/// pass, so for an IP packet whose header sits in the linear data after an Ethernet
/// header (where the long way reads it too) the addresses are all that is read, straight
/// from the packet (no helper calls, no reading zeroed and filled). When that leaves it
/// out, its record is started as the long way starts it for such a packet and true is
/// returned; false when the long way must look.
#[inline(always)]
fn left_out_at_entry(ctx: &TcContext, skb: u64) -> bool {
    let Some(nets) = filter_nets() else {
        return false;
    };
    // SAFETY: a ctx field of __sk_buff, rewritten by the verifier into a safe load.
    let proto = u16::from_be(unsafe { (*ctx.skb.skb).protocol } as u16);
    let (data, data_end) = (ctx.data(), ctx.data_end());
    // The IP header after 14 bytes of Ethernet, which the long way tries first.
    let ip = data + 14;
    if ip + 40 > data_end && (proto != 0x0800 || ip + 20 > data_end) {
        return false;
    }
    // SAFETY: inside the packet's linear data: bytes below 20, or below 40 for IPv6,
    // checked above (and by the verifier).
    let b = |i: usize| unsafe { *((ip + i) as *const u8) };
    let word = |i: usize| u32::from_ne_bytes([b(i), b(i + 1), b(i + 2), b(i + 3)]);
    let any = match (proto, b(0) >> 4) {
        (0x0800, 4) => nets.holds(&[word(12), 0, 0, 0]) || nets.holds(&[word(16), 0, 0, 0]),
        // Without extension headers (which the long way may fail to read, and then
        // starts no record).
        (0x86dd, 6) if ip + 40 <= data_end && !matches!(b(6), 0 | 43 | 44 | 60) => {
            nets.holds(&[word(8), word(12), word(16), word(20)])
                || nets.holds(&[word(24), word(28), word(32), word(36)])
        }
        _ => return false,
    };
    if opaque(usize::from(any)) != 0 {
        return false;
    }
    // Left out: followed as `observe` follows such a packet.
    close_stale_at_entry(skb, find(skb));
    leave_out(skb, decision::FILTERED_OUT);
    true
}

/// The short way out ([`leave_unchanged`]): an IPv4 packet whose first [`LINEAR_BYTES`]
/// after an Ethernet header lie in the linear data, seen by the glance (mark, length,
/// conntrack state: loads) and those bytes, gets its egress visit and step without the long
/// way's parse and conntrack read when only its length changed since the record's last step.
/// False, the record untouched, where the long way must read (also where the conntrack
/// state would cost helper calls: kernels before 6.16).
#[inline(always)]
fn leaves_unchanged(ctx: &TcContext, rec: &mut TraversalRecord) -> bool {
    let skb = ctx.skb.skb;
    // SAFETY: ctx fields of __sk_buff are rewritten by the verifier into safe loads.
    let (ifindex, mark, len, proto) =
        unsafe { ((*skb).ifindex, (*skb).mark, (*skb).len, (*skb).protocol) };
    if u16::from_be(proto as u16) != 0x0800 || !direct_reads() {
        return false;
    }
    let Some(off) = cfg(config::SKB_NFCT) else {
        return false;
    };
    // The record's copy of the skb's address: a number (the context pointer itself is
    // not one the verifier lets a program add to).
    let Ok(nfct) = read_word(rec.skb, off) else {
        return false;
    };
    let Some(g) = glance(hook::TC_EGRESS, mark, len, nfct) else {
        return false;
    };
    let Some(w) = windows() else {
        return false;
    };
    linear_words(ctx, w) && leave_unchanged(rec, &g, ifindex, &w.pkt)
}

/// Loads the first [`LINEAR_BYTES`] after an Ethernet header into `w.pkt` when the packet's
/// linear data holds them (one load per word, no helper call); false when it does not.
#[inline(always)]
fn linear_words(ctx: &TcContext, w: &mut Windows) -> bool {
    let ip = ctx.data() + 14;
    if ip + LINEAR_BYTES > ctx.data_end() {
        return false;
    }
    packet_words(ip, &mut w.pkt[..LINEAR_BYTES]);
    true
}

/// A packet entering under `skb`'s address: whatever this CPU still follows under it
/// (`found`, or a packet left out) was freed unseen, and ends.
#[inline(always)]
fn close_stale_at_entry(skb: u64, found: Option<Found>) {
    if let Some(f) = found {
        close_stale(f);
    }
    if let Some(lo) = find_left_out(skb) {
        lo.end();
    }
}

/// Reads the packet as the TC hook has it. `None` for anything but IP.
#[inline(always)]
fn read_packet(ctx: &TcContext, ev: &mut PacketEvent, at: u8) -> Option<()> {
    let skb = ctx.skb.skb;
    ev.header.kind = kind::PACKET;
    ev.header.hook = at;
    // No clock here: a record's times are read where it starts, waits and ends (`begin`).
    ev.header.ts_ns = 0;
    // Privileged programs may read their context pointer: it is the kernel's sk_buff address,
    // the same identity the netfilter probes report.
    ev.header.skb = opaque(skb as usize) as u64;
    // SAFETY: ctx fields of __sk_buff are rewritten by the verifier into safe loads.
    let (ifindex, mark, len, proto) =
        unsafe { ((*skb).ifindex, (*skb).mark, (*skb).len, (*skb).protocol) };
    if at == hook::TC_INGRESS {
        ev.header.ifindex_in = ifindex;
    } else {
        ev.header.ifindex_out = ifindex;
    }
    ev.packet.mark = mark;
    ev.packet.len = len;
    // skb->protocol is big-endian ethertype.
    ev.header.family = match u16::from_be(proto as u16) {
        0x0800 => family::IPV4,
        0x86dd => family::IPV6,
        _ => return None,
    };
    // Ethernet-framed devices put the IP header after 14 bytes; L3 devices at 0. Loads
    // are fixed-size (the verifier refuses a length that might be zero) and no longer
    // than the smallest packet of their kind, or they fail on short packets. After an
    // Ethernet header, the first 40 bytes (an IPv4 header and 20 bytes after it, or an
    // IPv6 header) come straight from the linear data when it holds them.
    let w = windows()?;
    // Through map memory: otherwise the compiler tests the packet bounds again where the
    // window is used, and verifiers before 6.13 do not see that the two tests agree (they
    // follow the window's pointer where it is null).
    let linear = opaque(usize::from(linear_words(ctx, w))) != 0;
    let eth = At {
        ctx,
        base: 14,
        win: if linear { Some(&w.pkt) } else { None },
    };
    let raw = At {
        ctx,
        base: 0,
        win: None,
    };
    let (pkt, hdr) = match ip_header_at(&eth, 0) {
        Some(h) => (eth, h),
        None => (raw, ip_header_at(&raw, 0)?),
    };
    parse_headers(&pkt, &hdr, ev)?;
    // The context pointer is the kernel's sk_buff: its conntrack entry (set at egress) lets
    // the filter follow NATed packets and shows the connection as it leaves. At ingress a
    // packet has none yet (crossing into a namespace clears it), or, looped back on this
    // host, the one PREROUTING's first probe reads again: not read there.
    if at == hook::TC_EGRESS {
        // The entry pointer alone (8 bytes, not the skb's whole window).
        let ct = cfg(config::SKB_NFCT)
            .ok_or(())
            .and_then(|off| read_word(ev.header.skb, off))
            .and_then(|nfct| read_ct(nfct, &mut ev.ct, w, true));
        if ct == Ok(true) {
            ev.header.flags |= flags::CT;
        }
    }
    Some(())
}

/// Bytes from the IP header that [`read_packet`] loads from the linear data in words.
const LINEAR_BYTES: usize = 40;

/// The packet as the TC hook has it, from `base` (where its IP header starts), and its
/// first [`LINEAR_BYTES`] from there when they were loaded already (`win`).
#[derive(Clone, Copy)]
struct At<'a> {
    ctx: &'a TcContext,
    base: usize,
    win: Option<&'a [u8; PKT_WINDOW_BYTES]>,
}

impl PacketReader for At<'_> {
    #[inline(always)]
    fn bytes<const N: usize>(&self, off: usize) -> Option<[u8; N]> {
        if let Some(win) = self.win
            && off + N <= LINEAR_BYTES
        {
            return Some(window_bytes(win, off));
        }
        self.ctx.load::<[u8; N]>(self.base + off).ok()
    }
}

#[unsafe(link_section = "license")]
#[unsafe(no_mangle)]
static LICENSE: [u8; 4] = *b"GPL\0";
