//! TC (tcx) probes: the packet as on the wire, at ingress before netfilter and at egress after.
//! Loaded by Aya; this object owns the maps that the netfilter object shares.
#![no_std]
#![no_main]

use aya_ebpf::{macros::classifier, programs::TcContext};
use observer_common::{family, hook, kind};
use observer_ebpf::{emit, now, parse_l3, parse_l4, scratch};

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
        // Ethernet-framed devices put the IP header after 14 bytes; L3 devices at 0.
        // Fixed-size loads only: the verifier refuses a length that might be zero.
        let mut l3 = 14usize;
        let mut hdr: [u8; 40] = ctx.load(l3).unwrap_or([0; 40]);
        if hdr[0] >> 4 != 4 && hdr[0] >> 4 != 6 {
            l3 = 0;
            hdr = ctx.load(l3).unwrap_or([0; 40]);
        }
        if let Some(ihl) = parse_l3(&hdr, ev) {
            match ctx.load::<[u8; 16]>(l3 + ihl) {
                Ok(l4) => parse_l4(&l4, ev),
                Err(_) => ev.header.flags |= observer_common::flags::NO_L4,
            }
        }
    } else {
        // Not IP (ARP, LLDP, ...): nothing netfilter will see; do not spend a record on it.
        return;
    }
    emit(ev);
}

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    loop {}
}

#[unsafe(link_section = "license")]
#[unsafe(no_mangle)]
static LICENSE: [u8; 4] = *b"GPL\0";
