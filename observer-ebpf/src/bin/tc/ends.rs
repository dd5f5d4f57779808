//! Where traversals end besides TC egress: the kernel frees the packet (as dropped, with a
//! reason, or consumed), or a socket takes it. These programs fire for every packet of the
//! machine; a packet without an in-flight record costs one slot scan and one map lookup.
//!
//! Delivered means a socket took the packet (see [`observer_sock_ingress`]). The last INPUT
//! probe is not the end: a packet can still die after it (no socket, full receive buffer,
//! TCP checks), and the drop tracepoint says where. (fentry/fexit on the socket functions
//! would say it sooner; they are refused on the kernels this was built on.)

use aya_ebpf::{
    EbpfContext,
    macros::{btf_tracepoint, cgroup_skb},
    programs::{BtfTracePointContext, SkBuffContext},
};
use observer_common::traversal::{add_reading, decision, end, missing, status};
use observer_common::{config, flags, kind};
use observer_ebpf::inflight::{
    Found, Logged, Place, begin, find, find_left_out, finish, opaque, socket_took,
};
use observer_ebpf::{
    cfg, counts, direct, field, nfct_of, read, read_ct, read_l3, read_skb_window, scratch, windows,
};

/// The kernel freed a packet as dropped: `kfree_skb(skb, location, reason, rx_sk)`.
/// Written out rather than with `#[btf_tracepoint]`, whose body becomes a function of its own
/// in `.text`: the loader puts BTF offsets into this program's section only
/// (`nf_link::TC_DIRECT_SECTIONS`), so its direct loads must stay in it.
#[unsafe(no_mangle)]
#[unsafe(link_section = "tp_btf/kfree_skb")]
pub extern "C" fn observer_kfree_skb(ctx: *mut core::ffi::c_void) -> u32 {
    kfree_skb(BtfTracePointContext::new(ctx)) as u32
}

#[inline(always)]
fn kfree_skb(ctx: BtfTracePointContext) -> i32 {
    if floor() {
        return 0;
    }
    // SAFETY: a tracing program's context is its arguments; the first is the skb, a typed
    // kernel pointer to the verifier, from which `direct` loads fields.
    let skb_p = unsafe { core::ptr::read_volatile(ctx.as_ptr() as *const *const u8) };
    let (skb, location, reason) = (
        arg(ctx.as_ptr(), 0),
        arg(ctx.as_ptr(), 1),
        arg(ctx.as_ptr(), 2),
    );
    // Counted only when the packet is known to be in the observed namespace: the counting
    // state outlives a packet that left it (a veth hands the same skb to its peer).
    if counts::counting() && observed_netns_direct(skb_p, skb) == Some(true) {
        let last = counts::last_point_of(skb);
        // Tier 1 (no netfilter probe attached): counted by key instead of by place.
        if last.is_none() && counts::count_only() && counts::keyed() {
            counts::drop_keyed(skb_p, skb, location, reason);
            return 0;
        }
        counts::drop_at(
            last.map_or(observer_common::counts::UNKNOWN_PLACE, |p| p as usize),
            reason,
        );
        if counts::count_only() {
            if let Some(p) = last {
                let _ = record_drop(skb, p, location, reason);
            }
            return 0;
        }
    }
    // Counting only (the agent's default mode while nobody streams): no traversal is
    // followed, so a drop elsewhere (another namespace's socket under a flood) ends here,
    // without the slot scan and the fallback map's lookup below.
    if counts::count_only() {
        return 0;
    }
    let left_out = if let Some(lo) = find_left_out(skb) {
        lo.end();
        true
    } else if let Some(f) = ours(skb) {
        let left_out = f.rec.decision != decision::KEEP;
        f.rec.reason = reason as u32;
        f.rec.location = location;
        finish(f, end::DROPPED);
        left_out
    } else {
        false
    };
    // The agent records every drop for its flight recorder, also while the filter serves
    // its streaming clients: one the filter left out is written as it died.
    if left_out
        && counts::counting()
        && observed_netns(skb) == Some(true)
        && let Some(p) = counts::last_point_of(skb)
    {
        let _ = record_drop(skb, p, location, reason);
    }
    0
}

/// Always-on mode: a dropped packet's record, with what is known at its end: the packet as
/// it died (read now), the last point it passed, the reason and place. Its earlier path was
/// not recorded (the probes only counted), which the record says.
#[inline(always)]
fn record_drop(skb: u64, point: u32, location: u64, reason: u64) -> Result<(), ()> {
    let (family, hook, program) = observer_common::counts::point_parts(point as usize);
    let ev = scratch().ok_or(())?;
    let w = windows().ok_or(())?;
    ev.header.kind = kind::PACKET;
    ev.header.family = if family == 0 {
        observer_common::family::IPV4
    } else {
        observer_common::family::IPV6
    };
    ev.header.hook = hook as u8;
    ev.header.skb = skb;
    ev.header.ts_ns = 0;
    let start = read_skb_window(skb, w)?;
    let word = |slot: u32| cfg(slot).ok_or(());
    ev.packet.mark = u32::from_ne_bytes(field(&w.skb, word(config::SKB_MARK)?, start)?);
    ev.packet.len = u32::from_ne_bytes(field(&w.skb, word(config::SKB_LEN)?, start)?);
    let head = u64::from_ne_bytes(field(&w.skb, word(config::SKB_HEAD)?, start)?);
    let nh = u16::from_ne_bytes(field(&w.skb, word(config::SKB_NETWORK_HEADER)?, start)?);
    let nfct = nfct_of(w, start)?;
    let read_ok = read_l3(head + u64::from(nh), w, ev).is_ok();
    if read_ct(nfct, &mut ev.ct, w, true) == Ok(true) {
        ev.header.flags |= flags::CT;
    }
    let rec = begin::<Logged>(skb).ok_or(())?;
    rec.incomplete |= missing::START;
    if !read_ok {
        rec.incomplete |= missing::READ;
    }
    add_reading(rec, ev, program as u8);
    rec.reason = reason as u32;
    rec.location = location;
    finish(
        Found {
            rec,
            place: Place::Slot,
        },
        end::DROPPED,
    );
    Ok(())
}

/// The kernel freed a packet without calling it a drop: `consume_skb(skb, location)`
/// (`location` since Linux 6.3: see [`CONSUME_SKB_LOCATION`]).
/// A fragment merged by defragmentation is freed this way too, on whatever CPU frees the
/// datagram it became part of: its record waits in the fallback map for that.
#[btf_tracepoint(function = "consume_skb")]
pub fn observer_consume_skb(ctx: BtfTracePointContext) -> i32 {
    if floor() || counts::count_only() {
        return 0;
    }
    let skb = arg(ctx.as_ptr(), 0);
    if let Some(lo) = find_left_out(skb) {
        lo.end();
        return 0;
    }
    if let Some(f) = ours(skb) {
        // SAFETY: a read-only global, set at load (the verifier knows its value and skips
        // the read on a kernel whose tracepoint has no second argument).
        let location = if unsafe { core::ptr::read_volatile(&CONSUME_SKB_LOCATION) } != 0 {
            arg(ctx.as_ptr(), 1)
        } else {
            0
        };
        f.rec.location = location;
        let how = if f.rec.status & status::SOCKET != 0 {
            end::DELIVERED
        } else {
            end::CONSUMED
        };
        finish(f, how);
    }
    0
}

/// Non-zero where the kernel's `consume_skb` tracepoint passes `location` (Linux 6.3+),
/// set by the loader from the tracepoint's BTF prototype.
#[unsafe(no_mangle)]
static CONSUME_SKB_LOCATION: u8 = 1;

/// The benchmark's floor: every probe returns at once.
#[inline(always)]
fn floor() -> bool {
    cfg(config::FLOOR).is_some_and(|f| f != 0)
}

/// Argument `n` of a tracing program, as a plain number: loaded from the context (one
/// instruction; the verifier checks `n` against the tracepoint's prototype), then passed
/// through map memory, since a pointer argument is a typed kernel pointer on which the
/// verifier forbids the arithmetic that BTF offsets need.
#[inline(always)]
fn arg(ctx: *mut core::ffi::c_void, n: usize) -> u64 {
    // SAFETY: a tracing program's context is its arguments, one u64 each.
    let v = unsafe { core::ptr::read_volatile((ctx as *const u64).wrapping_add(n)) };
    opaque(v as usize) as u64
}

/// The record of `skb`, unless the skb now lives in another namespace (its address was
/// reused after our packet was freed unseen).
#[inline(always)]
fn ours(skb: u64) -> Option<Found> {
    let f = find(skb)?;
    in_observed_netns(skb).then_some(f)
}

/// A socket is about to take the packet: cgroup/skb ingress runs in `sk_filter_trim_cap`,
/// after the socket lookup (TCP, UDP, raw), for every socket below the cgroup v2 root this is
/// attached to. The packet may still be dropped (full receive buffer, TCP checks), so its
/// record moves to the fallback map, marked, and ends there: freed as dropped, consumed
/// (delivered), its address reused (delivered), or claimed by the collector once the
/// socket has had it for a moment (delivered: queued, or freed by TCP without an event).
/// Always returns 1: the packet is allowed, as it would be without us.
#[cgroup_skb]
pub fn observer_sock_ingress(ctx: SkBuffContext) -> i32 {
    if floor() || counts::count_only() {
        return 1;
    }
    // A plain number (see the TC probes' `observe`).
    let skb = opaque(ctx.skb.skb as usize) as u64;
    // A packet left out has nothing to mark.
    if find_left_out(skb).is_none()
        && let Some(f) = find(skb)
    {
        socket_took::<Logged>(f);
    }
    1
}

/// True unless the skb's device (or socket) is known to live in another namespace.
#[inline(always)]
fn in_observed_netns(skb: u64) -> bool {
    observed_netns(skb) != Some(false)
}

/// As [`observed_netns`], from the tracepoint's typed skb pointer `skb_p`: the device's
/// namespace in three direct loads (offsets from BTF, put in by the loader; a fault reads
/// zero), no helper call. Without a device, as [`observed_netns`] (the socket's).
#[inline(always)]
fn observed_netns_direct(skb_p: *const u8, skb: u64) -> Option<bool> {
    let want = cfg(config::OBSERVED_NETNS)?;
    let dev_p = direct::<*const u8, { config::SKB_DEV }>(skb_p);
    if dev_p.is_null() {
        return observed_netns(skb);
    }
    let net_p = direct::<*const u8, { config::NETDEV_NET }>(dev_p);
    if net_p.is_null() {
        return None;
    }
    let inum = direct::<u32, { config::NET_INUM }>(net_p);
    Some(u64::from(inum) == want)
}

/// Whether the skb's device (or, without one, its socket) lives in the observed namespace;
/// `None` when neither says.
#[inline(always)]
fn observed_netns(skb: u64) -> Option<bool> {
    let (Some(want), Some(dev_off), Some(net_off), Some(inum_off)) = (
        cfg(config::OBSERVED_NETNS),
        cfg(config::SKB_DEV),
        cfg(config::NETDEV_NET),
        cfg(config::NET_INUM),
    ) else {
        return None;
    };
    let Ok(dev) = read::<u64>(skb, dev_off) else {
        return None;
    };
    // Without a device (some locally generated packets), the socket names the namespace.
    let net = if dev != 0 {
        read::<u64>(dev, net_off)
    } else {
        match (cfg(config::SKB_SK), cfg(config::SOCK_NET)) {
            (Some(sk_off), Some(sknet_off)) => match read::<u64>(skb, sk_off) {
                Ok(sk) if sk != 0 => read::<u64>(sk, sknet_off),
                _ => return None,
            },
            _ => return None,
        }
    };
    net.and_then(|net| read::<u32>(net, inum_off))
        .ok()
        .map(|inum| u64::from(inum) == want)
}
