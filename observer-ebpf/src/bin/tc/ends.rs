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
use observer_common::config;
use observer_common::traversal::{end, status};
use observer_ebpf::inflight::{Found, find, finish, socket_took};
use observer_ebpf::{cfg, read};

/// The kernel freed a packet as dropped: `kfree_skb(skb, location, reason, rx_sk)`.
#[btf_tracepoint(function = "kfree_skb")]
pub fn observer_kfree_skb(ctx: BtfTracePointContext) -> i32 {
    if floor() {
        return 0;
    }
    let (skb, location, reason) = (
        arg(ctx.as_ptr(), 0),
        arg(ctx.as_ptr(), 1),
        arg(ctx.as_ptr(), 2),
    );
    if let Some(f) = ours(skb) {
        f.rec.reason = reason as u32;
        f.rec.location = location;
        finish(f, end::DROPPED);
    }
    0
}

/// The kernel freed a packet without calling it a drop: `consume_skb(skb, location)`.
/// A fragment merged by defragmentation is freed this way too, on whatever CPU frees the
/// datagram it became part of: its record waits in the fallback map for that.
#[btf_tracepoint(function = "consume_skb")]
pub fn observer_consume_skb(ctx: BtfTracePointContext) -> i32 {
    if floor() {
        return 0;
    }
    let (skb, location) = (arg(ctx.as_ptr(), 0), arg(ctx.as_ptr(), 1));
    if let Some(f) = ours(skb) {
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

/// The benchmark's floor: every probe returns at once.
#[inline(always)]
fn floor() -> bool {
    cfg(config::FLOOR).is_some_and(|f| f != 0)
}

/// Argument `n` of a tracing program, read as a plain number: loaded directly, a pointer
/// argument is a typed kernel pointer on which the verifier forbids the arithmetic that BTF
/// offsets need.
#[inline(always)]
fn arg(ctx: *mut core::ffi::c_void, n: u64) -> u64 {
    read::<u64>(ctx as u64, n * 8).unwrap_or(0)
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
    if floor() {
        return 1;
    }
    let skb = ctx.skb.skb as u64;
    if let Some(f) = find(skb) {
        socket_took(f);
    }
    1
}

/// True unless the skb's device (or socket) is known to live in another namespace.
#[inline(always)]
fn in_observed_netns(skb: u64) -> bool {
    let (Some(want), Some(dev_off), Some(net_off), Some(inum_off)) = (
        cfg(config::OBSERVED_NETNS),
        cfg(config::SKB_DEV),
        cfg(config::NETDEV_NET),
        cfg(config::NET_INUM),
    ) else {
        return true;
    };
    let Ok(dev) = read::<u64>(skb, dev_off) else {
        return true;
    };
    // Without a device (some locally generated packets), the socket names the namespace.
    let net = if dev != 0 {
        read::<u64>(dev, net_off)
    } else {
        match (cfg(config::SKB_SK), cfg(config::SOCK_NET)) {
            (Some(sk_off), Some(sknet_off)) => match read::<u64>(skb, sk_off) {
                Ok(sk) if sk != 0 => read::<u64>(sk, sknet_off),
                _ => return true,
            },
            _ => return true,
        }
    };
    match net.and_then(|net| read::<u32>(net, inum_off)) {
        Ok(inum) => u64::from(inum) == want,
        Err(()) => true,
    }
}
