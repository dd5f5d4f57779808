//! TC (tcx) probes: the packet as on the wire, at ingress before netfilter and at egress after.
//! Loaded by Aya; this object owns the maps that the netfilter object shares.
#![no_std]
#![no_main]

use aya_ebpf::{
    EbpfContext,
    macros::{btf_tracepoint, classifier},
    programs::{BtfTracePointContext, TcContext},
};
use observer_common::{DropEvent, config, family, hook, kind};
use observer_ebpf::{
    Decide, EVENTS, cfg, count, emit, follows_keep, is_icmp_error, keep, nfct_of, now, parse_inner,
    parse_inner_ports, parse_l3, parse_l4, read, read_ct, read_skb_window, scratch, skip_ipv6_ext,
    windows,
};

/// `TCX_NEXT` / `TC_ACT_UNSPEC`: hand the packet on unchanged, to the next tcx program if any.
const TC_NEXT: i32 = -1;

#[classifier]
pub fn observer_tc_ingress(ctx: TcContext) -> i32 {
    observe(&ctx, hook::TC_INGRESS);
    TC_NEXT
}

#[classifier]
pub fn observer_tc_egress(ctx: TcContext) -> i32 {
    observe(&ctx, hook::TC_EGRESS);
    TC_NEXT
}

#[inline(always)]
fn observe(ctx: &TcContext, at: u8) {
    let skb = ctx.skb.skb;
    // At egress the decision was taken upstream: a packet left out costs one lookup.
    if at == hook::TC_EGRESS && !follows_keep(skb as u64) {
        return;
    }
    let Some(ev) = scratch() else {
        return;
    };
    ev.header.kind = kind::PACKET;
    ev.header.hook = at;
    ev.header.ts_ns = now();
    // Privileged programs may read their context pointer: it is the kernel's sk_buff address,
    // the same identity the netfilter probes report.
    ev.header.skb = skb as u64;
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
    let ethertype = u16::from_be(proto as u16);
    ev.header.family = match ethertype {
        0x0800 => family::IPV4,
        0x86dd => family::IPV6,
        _ => 0,
    };
    if ev.header.family != 0 {
        // Ethernet-framed devices put the IP header after 14 bytes; L3 devices at 0. Loads
        // are fixed-size (the verifier refuses a length that might be zero) and no longer
        // than the smallest packet of their kind, or they fail on short packets.
        let Some((l3, hdr)) = load_l3(ctx, 14).or_else(|| load_l3(ctx, 0)) else {
            return;
        };
        if let Some(ihl) = parse_l3(&hdr, ev) {
            let ihl = if ev.packet.ip_version == 6 {
                match skip_ipv6_ext(ev, ihl, |at| ctx.load::<[u8; 4]>(l3 + at).ok()) {
                    Some(ihl) => ihl,
                    None => return,
                }
            } else {
                ihl
            };
            let mut l4 = [0u8; 16];
            let loaded = if ev.packet.l4proto == 6 {
                ctx.load::<[u8; 16]>(l3 + ihl).map(|b| l4 = b)
            } else {
                ctx.load::<[u8; 8]>(l3 + ihl)
                    .map(|b| l4[..8].copy_from_slice(&b))
            };
            match loaded {
                Ok(()) => parse_l4(&l4, ev),
                Err(_) => ev.header.flags |= observer_common::flags::NO_L4,
            }
            if is_icmp_error(ev) {
                let at = l3 + ihl + 8;
                if let Some((_, inner)) = load_l3(ctx, at) {
                    if let Some(inner_ihl) = parse_inner(&inner, ev) {
                        if let Ok(ports) = ctx.load::<[u8; 4]>(at + inner_ihl) {
                            parse_inner_ports(&ports, ev);
                        }
                    }
                }
            }
        }
    } else {
        // Not IP (ARP, LLDP, ...): nothing netfilter will see; do not spend a record on it.
        return;
    }
    // The context pointer is the kernel's sk_buff: its conntrack entry (set at egress) lets
    // the filter follow NATed packets and shows the connection as it leaves.
    if let Some(w) = windows() {
        let ct = read_skb_window(ev.header.skb, w)
            .and_then(|start| nfct_of(w, start))
            .and_then(|nfct| read_ct(nfct, &mut ev.ct, w));
        if ct == Ok(true) {
            ev.header.flags |= observer_common::flags::CT;
        }
    }
    if at == hook::TC_EGRESS || keep(ev, Decide::Entry) {
        emit(ev);
    }
}

/// The IP header at `at`: 20 bytes for IPv4, 40 for IPv6 (zero-padded to 40).
#[inline(always)]
fn load_l3(ctx: &TcContext, at: usize) -> Option<(usize, [u8; 40])> {
    let v4: [u8; 20] = ctx.load(at).ok()?;
    let mut hdr = [0u8; 40];
    match v4[0] >> 4 {
        4 => {
            hdr[..20].copy_from_slice(&v4);
            Some((at, hdr))
        }
        6 => Some((at, ctx.load(at).ok()?)),
        _ => None,
    }
}

/// Every packet the kernel frees as dropped, with its reason. Only drops of the observed
/// namespace are written (when the skb still names its device); the collector matches them
/// to traversals by skb address and ignores the rest.
#[btf_tracepoint(function = "kfree_skb")]
pub fn observer_kfree_skb(ctx: BtfTracePointContext) -> i32 {
    // kfree_skb(struct sk_buff *skb, void *location, enum skb_drop_reason reason, ...).
    // Read the arguments through bpf_probe_read_kernel: a direct load gives the verifier a
    // trusted BTF pointer, which may not take the variable offsets that BTF gives us.
    let args = ctx.as_ptr() as u64;
    let (Ok(skb), Ok(location), Ok(reason)) = (
        read::<u64>(args, 0),
        read::<u64>(args, 8),
        read::<u64>(args, 16),
    ) else {
        return 0;
    };
    let reason = reason as u32;
    if !in_observed_netns(skb) {
        return 0;
    }
    let mut ev = DropEvent::default();
    ev.header.kind = kind::DROP;
    ev.header.ts_ns = now();
    ev.header.skb = skb;
    ev.reason = reason;
    ev.location = location;
    match EVENTS.output::<DropEvent>(&ev, 0) {
        Ok(()) => count(observer_common::counter::EMITTED),
        Err(_) => count(observer_common::counter::RINGBUF_FULL),
    }
    0
}

/// True unless the skb's device is known to live in another namespace.
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
                _ => return false,
            },
            _ => return true,
        }
    };
    match net.and_then(|net| read::<u32>(net, inum_off)) {
        Ok(inum) => u64::from(inum) == want,
        Err(()) => true,
    }
}

#[unsafe(link_section = "license")]
#[unsafe(no_mangle)]
static LICENSE: [u8; 4] = *b"GPL\0";
