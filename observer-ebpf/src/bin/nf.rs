//! Netfilter probes (BPF_PROG_TYPE_NETFILTER). Each slot program is attached by userspace at
//! one or more (family, hook, priority) points between the netfilter tables; what it records
//! there is the packet as the previous table left it. They always return NF_ACCEPT.
//!
//! Aya cannot load this object (it rejects `netfilter` sections), so observer's own loader
//! relocates the map references onto the TC object's maps. Keep every helper
//! `#[inline(always)]`: the loader supports no BPF-to-BPF calls.
#![no_std]
#![no_main]

use observer_common::{config, counter, flags, hook, kind};
use observer_ebpf::{
    Decide, cfg, count, emit, field, follows_keep, is_icmp_error, keep, nfct_of, now, parse_inner,
    parse_inner_ports, parse_l3, parse_l4, read, read_ct, read_into, read_skb_window, scratch,
    skip_ipv6_ext, windows,
};

/// `struct bpf_nf_ctx`: the program's context.
#[repr(C)]
pub struct BpfNfCtx {
    pub state: u64,
    pub skb: u64,
}

const NF_ACCEPT: i32 = 1;

macro_rules! slots {
    ($($name:ident = $slot:expr),* $(,)?) => {$(
        #[unsafe(no_mangle)]
        #[unsafe(link_section = concat!("netfilter/", stringify!($name)))]
        pub extern "C" fn $name(ctx: *const BpfNfCtx) -> i32 {
            observe(ctx, $slot);
            NF_ACCEPT
        }
    )*};
}

slots!(
    nf_slot_0 = 0,
    nf_slot_1 = 1,
    nf_slot_2 = 2,
    nf_slot_3 = 3,
    nf_slot_4 = 4,
    nf_slot_5 = 5,
    nf_slot_6 = 6,
    nf_slot_7 = 7,
    nf_slot_8 = 8,
    nf_slot_9 = 9,
    nf_slot_10 = 10,
    nf_slot_11 = 11,
    nf_slot_12 = 12,
    nf_slot_13 = 13,
    nf_slot_14 = 14,
    nf_slot_15 = 15,
    nf_slot_16 = 16,
    nf_slot_17 = 17,
    nf_slot_18 = 18,
    nf_slot_19 = 19,
    nf_slot_20 = 20,
    nf_slot_21 = 21,
    nf_slot_22 = 22,
    nf_slot_23 = 23,
);
const _: () = assert!(observer_common::NF_SLOTS == 24);

#[inline(always)]
fn observe(ctx: *const BpfNfCtx, slot: u32) {
    if cfg(config::READY).is_none() {
        count(counter::NOT_CONFIGURED);
        return;
    }
    // Read the context through bpf_probe_read_kernel: a direct load would give the verifier
    // a trusted BTF pointer, on which it forbids the variable offsets that BTF gives us.
    let base = ctx as u64;
    let (Ok(state), Ok(skb)) = (read::<u64>(base, 0), read::<u64>(base, 8)) else {
        return;
    };
    let _ = try_observe(state, skb, slot);
}

#[inline(always)]
fn try_observe(state: u64, skb: u64, slot: u32) -> Result<(), ()> {
    let Some(ev) = scratch() else {
        return Err(());
    };
    ev.header.kind = kind::PACKET;
    ev.header.slot = slot;
    ev.header.ts_ns = now();
    ev.header.skb = skb;
    let off = |i| cfg(i).ok_or(());
    // One read per struct: the calls, not the bytes, are what a probe pays for.
    let w = windows().ok_or(())?;
    read_into(state, 0, &mut w.state)?;
    let st = &w.state;
    ev.header.hook = field::<1>(st, off(config::STATE_HOOK)?, 0)?[0];
    // Slot 0 is where a packet enters PREROUTING or OUTPUT, slot 2 is just after conntrack
    // there (see observer's plan); elsewhere the decision taken upstream is reused, and a
    // packet left out costs this probe one lookup, before any other read.
    let entry_hook = ev.header.hook == hook::PRE_ROUTING || ev.header.hook == hook::LOCAL_OUT;
    let how = match slot {
        0 if entry_hook => Decide::Entry,
        2 if entry_hook => Decide::WithConntrack,
        _ => Decide::Follow,
    };
    if how == Decide::Follow && !follows_keep(skb) {
        return Ok(());
    }
    ev.header.family = field::<1>(st, off(config::STATE_PF)?, 0)?[0];
    let ifindex_off = off(config::NETDEV_IFINDEX)?;
    let dev_in = u64::from_ne_bytes(field(st, off(config::STATE_IN)?, 0)?);
    if dev_in != 0 {
        ev.header.ifindex_in = read::<u32>(dev_in, ifindex_off)?;
    }
    let dev_out = u64::from_ne_bytes(field(st, off(config::STATE_OUT)?, 0)?);
    if dev_out != 0 {
        ev.header.ifindex_out = read::<u32>(dev_out, ifindex_off)?;
    }
    let start = read_skb_window(skb, w)?;
    ev.packet.mark = u32::from_ne_bytes(field(&w.skb, off(config::SKB_MARK)?, start)?);
    ev.packet.len = u32::from_ne_bytes(field(&w.skb, off(config::SKB_LEN)?, start)?);
    let head = u64::from_ne_bytes(field(&w.skb, off(config::SKB_HEAD)?, start)?);
    let nh = u16::from_ne_bytes(field(&w.skb, off(config::SKB_NETWORK_HEADER)?, start)?);
    let l3 = head + nh as u64;
    // The IP header and the first 16 bytes after a 20/40-byte header, in one read.
    read_into(l3, 0, &mut w.pkt)?;
    let hdr: &[u8; 40] = w.pkt[..40].try_into().map_err(|_| ())?;
    if let Some(ihl) = parse_l3(hdr, ev) {
        let ihl = if ev.packet.ip_version == 6 {
            skip_ipv6_ext(ev, ihl, |at| read::<[u8; 4]>(l3, at as u64).ok()).ok_or(())?
        } else {
            ihl
        };
        if ev.header.flags & flags::NO_L4 == 0 {
            let l4 = match field::<16>(&w.pkt, ihl as u64, 0) {
                Ok(l4) => Ok(l4),
                // IPv4 options push L4 beyond the first read.
                Err(()) => read::<[u8; 16]>(l3, ihl as u64),
            };
            match l4 {
                Ok(l4) => parse_l4(&l4, ev),
                Err(()) => ev.header.flags |= flags::NO_L4,
            }
            if is_icmp_error(ev) {
                // The quoted packet starts after the 8-byte ICMP header.
                let at = l3 + ihl as u64 + 8;
                if let Ok(inner) = read::<[u8; 40]>(at, 0) {
                    if let Some(inner_ihl) = parse_inner(&inner, ev) {
                        if let Ok(ports) = read::<[u8; 4]>(at, inner_ihl as u64) {
                            parse_inner_ports(&ports, ev);
                        }
                    }
                }
            }
        }
    }
    if read_ct(nfct_of(w, start)?, &mut ev.ct, w)? {
        ev.header.flags |= flags::CT;
    }
    if how == Decide::Follow || keep(ev, how) {
        emit(ev);
    }
    Ok(())
}

#[unsafe(link_section = "license")]
#[unsafe(no_mangle)]
static LICENSE: [u8; 4] = *b"GPL\0";
