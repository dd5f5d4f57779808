//! What a probe does at one point between the netfilter tables: the per-point logic of the
//! netfilter programs (`bin/nf.rs`), written against the hook's state and the skb rather
//! than a program's context, so that a program of another type that has both (a trampoline
//! on the function a table runs: `pkt->state`, `pkt->skb`) observes the same way. Every
//! function is `#[inline(always)]`: observer's netfilter loader supports no BPF-to-BPF
//! calls.

use observer_common::counts::{IPS_DST_NAT, IPS_SRC_NAT};
use observer_common::traversal::{
    add_reading, copy_words, decision, end, enter_unchanged, last_hook, missing, note_port,
    pass_unchanged, resent_from_input, reuse_headers,
};
use observer_common::{config, counter, flags, hook, kind};

use crate::inflight::{Quiet, begin, close_stale, find, find_left_out, finish, opaque, park};
use crate::{
    Decide, cfg, conntrack_addresses_may_match, conntrack_may_match, count, decide, direct,
    entry_of, filter_nets, filtering, glance, read_ct, read_l3, read_window, scratch, windows,
};
use crate::{counts, ctl};

/// Observes the packet at the point where program `program` runs. `pointers` gives the
/// hook's state (`struct nf_hook_state *`) and the skb (`struct sk_buff *`), both typed
/// kernel pointers the program may load fields from (`direct`): a netfilter program reads
/// them from its context, a trampoline from the function's arguments; they are taken only
/// once the probe is on and configured. `program` should be a constant at each call: only
/// programs 0 and 2 carry the filter's code.
#[inline(always)]
pub fn observe(pointers: impl FnOnce() -> (*const u8, *const u8), program: u8) {
    if cfg(config::FLOOR).is_some_and(|f| f != 0) {
        return;
    }
    if cfg(config::READY).is_none() {
        count(counter::NOT_CONFIGURED);
        return;
    }
    // The fields the probe needs are loaded from the pointers directly (`direct`, offsets
    // from BTF put in by the loader). The skb address also passes through map memory, which
    // makes it a plain number: the key of the in-flight record, and a base for reads at
    // offsets known only at run time.
    let (state_p, skb_p) = pointers();
    let skb = opaque(skb_p as usize) as u64;
    if counts::counting() {
        counts::at_point(state_p, skb_p, skb, program);
        if counts::count_only() {
            return;
        }
    }
    // A packet the filter left out where it entered (TC ingress): at most probes, this
    // comparison is all it costs.
    if let Some(mut lo) = find_left_out(skb) {
        match program {
            0 if lo.enters() => return,
            // An entry point again: looped back as the same skb, another traversal.
            0 => lo.end(),
            2 => {}
            _ => return,
        }
    }
    if program != 0 && program != 2 && glance_settles(state_p, skb_p, skb, program) {
        return;
    }
    let _ = try_observe(state_p, skb_p, skb, program);
}

/// The short way between tables ([`pass_unchanged`]): within a hook's visit, where no table
/// since the record's last step could rewrite the headers, a packet whose mark, length and
/// conntrack state are as that step has them only adds this point; at a hook's first point
/// ([`enter_unchanged`]) the headers' first words and the devices are read too, and the
/// hook's visit is opened. True when that settles it; false when the long way must read
/// (also where the conntrack state would cost a helper call: kernels before 6.16).
#[inline(always)]
fn glance_settles(state_p: *const u8, skb_p: *const u8, skb: u64, program: u8) -> bool {
    let Some(f) = find(skb) else {
        return false;
    };
    if f.rec.decision != decision::KEEP {
        return false;
    }
    let hook_no: u8 = direct::<u8, { config::STATE_HOOK }>(state_p);
    let readers = header_readers(hook_no);
    let reads = (readers >> program) & 1 != 0;
    // After a custom chain, the long way reads; after nat alone, unless the connection has
    // no NAT (below).
    if reads && (readers >> (config::NAT_ONLY_SHIFT + u32::from(program))) & 1 == 0 {
        return false;
    }
    let Some(g) = glance(
        hook_no,
        direct::<u32, { config::SKB_MARK }>(skb_p),
        direct::<u32, { config::SKB_LEN }>(skb_p),
        direct::<u64, { config::SKB_NFCT }>(skb_p),
    ) else {
        return false;
    };
    if reads && u64::from(g.ct_status) & (IPS_SRC_NAT | IPS_DST_NAT) != 0 {
        return false;
    }
    if last_hook(f.rec) == Some(hook_no) {
        return pass_unchanged(f.rec, &g, program);
    }
    // A hook's first point, where the long way reads the devices and the headers: the
    // devices, and the headers' first words, to compare with the record's last step.
    let Some(w) = windows() else {
        return false;
    };
    if read_window(network_header(skb_p), 0, &mut w.pkt[..FIRST_WORDS]).is_err() {
        return false;
    }
    let (dev_in, dev_out) = devices_of(state_p);
    if !enter_unchanged(f.rec, &g, dev_in, dev_out, &w.pkt, program) {
        return false;
    }
    if hook_no == hook::FORWARD {
        note_port(f.rec, skb_dev(skb_p));
    }
    true
}

/// The ifindex of the device the skb is on (`skb->dev`; 0: none). At a bridged frame's
/// FORWARD it is the port the bridge chose ([`note_port`]).
#[inline(always)]
fn skb_dev(skb_p: *const u8) -> u32 {
    let dev = direct::<*const u8, { config::SKB_DEV }>(skb_p);
    if dev.is_null() {
        0
    } else {
        direct::<u32, { config::NETDEV_IFINDEX }>(dev)
    }
}

/// Bytes from the network header that a hook's first point reads for the short way: an
/// IPv4 header without options and the ports after it.
const FIRST_WORDS: usize = 24;

/// The input and output devices' ifindexes the hook has (0: none).
#[inline(always)]
fn devices_of(state_p: *const u8) -> (u32, u32) {
    let dev_in = direct::<*const u8, { config::STATE_IN }>(state_p);
    let dev_out = direct::<*const u8, { config::STATE_OUT }>(state_p);
    let ifindex = |dev: *const u8| {
        if dev.is_null() {
            0
        } else {
            direct::<u32, { config::NETDEV_IFINDEX }>(dev)
        }
    };
    (ifindex(dev_in), ifindex(dev_out))
}

#[inline(always)]
fn try_observe(state_p: *const u8, skb_p: *const u8, skb: u64, program: u8) -> Result<(), ()> {
    let w = windows().ok_or(())?;
    // Before anything else, so that every way out of it meets the long way in one state.
    if program == 2 && still_left_out(state_p, skb_p, skb, program, w) {
        return Ok(());
    }
    // Program 0 is where a packet enters PREROUTING or OUTPUT, program 2 is just after
    // conntrack there; the plan attaches them nowhere else (see observer's plan), so the
    // program says it all, and a packet the filter left out costs a probe the lookup below.
    let decides = program == 0 || program == 2;
    let entry = program == 0;
    let with_ct = program == 2;
    {
        let found = find(skb);
        // The record found is this packet's: anywhere but an entry point, and there only
        // after TC ingress, or at OUTPUT for a packet IPVS took in INPUT and sends on.
        let continues = match &found {
            Some(f) => {
                !entry
                    || (f.rec.nvisits == 1 && last_hook(f.rec) == Some(hook::TC_INGRESS))
                    || resent_from_input(f.rec, direct::<u8, { config::STATE_HOOK }>(state_p))
            }
            None => false,
        };
        let kept = found
            .as_ref()
            .is_some_and(|f| f.rec.decision == decision::KEEP);
        let last = match &found {
            Some(f) if continues => last_hook(f.rec).unwrap_or(255),
            _ => 255,
        };
        ctl::set(ctl::LAST_HOOK, u32::from(last));
        if continues && !kept && !with_ct {
            // Left out by the filter: this lookup is all it costs here.
            return Ok(());
        }
        // A packet is decided where it enters, and again after conntrack while not kept. One
        // first seen elsewhere (its start unobserved) is left out whenever a filter is active.
        let mode = if entry && !continues {
            MODE_ENTRY
        } else if with_ct && !(continues && kept) {
            MODE_CONNTRACK
        } else if !continues {
            MODE_ORPHAN
        } else {
            MODE_KEEP
        };
        // What the rest needs, kept in map memory rather than registers (see `ctl`).
        ctl::set(ctl::MODE, mode);
        ctl::set(ctl::CONTINUES, u32::from(continues));
        ctl::set(ctl::REDECIDE, u32::from(with_ct && continues && !kept));
        ctl::set(ctl::ENTRY, u32::from(entry));
    }
    let hook_no: u8 = direct::<u8, { config::STATE_HOOK }>(state_p);
    let ev = scratch().ok_or(())?;
    ev.header.kind = kind::PACKET;
    ev.header.hook = hook_no;
    ev.header.skb = skb;
    // Within a hook's visit the devices are known, and the headers only change where a
    // table may rewrite them (userspace marks those probes); the filter's probes always read.
    let same_visit = ctl::get(ctl::LAST_HOOK) == u32::from(hook_no);
    // No clock here: a record's times are read where it starts, waits and ends (`begin`).
    ev.header.ts_ns = 0;
    let must_read = (header_readers(hook_no) >> program) & 1 != 0;
    // A packet the filter left out where it entered is decided again after conntrack from
    // its connection's tuples alone: there, before any NAT, its addresses are one of them
    // (and were decided at entry). Its headers are read only if it is kept then.
    let nfct = direct::<u64, { config::SKB_NFCT }>(skb_p);
    let has_ct = entry_of(nfct).is_some();
    let lazy = with_ct && has_ct && ctl::get(ctl::REDECIDE) != 0;
    let headers = ((decides || !same_visit) && !lazy) || must_read;
    ctl::set(ctl::REUSE, u32::from(!headers));
    // The connection's tuples change only where conntrack or NAT (or an unknown chain) ran:
    // elsewhere, as at the start of the next hook, they are the record's.
    let tuples = decides || must_read || ctl::get(ctl::CONTINUES) == 0;
    ctl::set(ctl::TUPLES, u32::from(tuples));
    let read_ok = read_packet(ev, state_p, skb_p, w, !same_visit, headers, tuples).is_ok();
    ctl::set(ctl::READ_OK, u32::from(read_ok));
    // `program` is a constant: only programs 0 and 2 carry the filter's code.
    let verdict = match ctl::get(ctl::MODE) {
        MODE_ENTRY if program == 0 => decide(ev, Decide::Entry),
        MODE_CONNTRACK if program == 2 => {
            ctl::set(ctl::SKIP_PACKET, ctl::get(ctl::REUSE));
            decide(ev, Decide::WithConntrack)
        }
        MODE_ORPHAN if filtering() => decision::FILTERED_OUT,
        _ => decision::KEEP,
    };
    ctl::set(ctl::VERDICT, u32::from(verdict));
    if program == 2 {
        ctl::set(
            ctl::LATE,
            u32::from(verdict == decision::KEEP && ctl::get(ctl::REUSE) != 0),
        );
        if ctl::get(ctl::LATE) != 0 {
            // Kept from here on: its first step needs the headers after all.
            read_into_event(ev, skb_p, w);
        }
    }
    let found = find(skb);
    let rec = match found {
        Some(f) if ctl::get(ctl::CONTINUES) != 0 && f.rec.skb == skb => {
            if ctl::get(ctl::REDECIDE) != 0 {
                f.rec.decision = ctl::get(ctl::VERDICT) as u8;
            }
            f.rec
        }
        stale => {
            // The skb address starts another traversal: the one recorded under it ended unseen,
            // or (after POSTROUTING) was looped back to this host as the same skb.
            if let Some(f) = stale {
                if last_hook(f.rec) == Some(hook::POST_ROUTING) {
                    finish(f, end::LOOPED);
                } else {
                    close_stale(f);
                }
            }
            let rec = begin::<Quiet>(skb).ok_or(())?;
            if ctl::get(ctl::ENTRY) == 0 {
                rec.incomplete |= missing::START;
                count(counter::NO_START);
            }
            rec.decision = ctl::get(ctl::VERDICT) as u8;
            rec
        }
    };
    if ctl::get(ctl::READ_OK) == 0 {
        rec.incomplete |= missing::READ;
    }
    if ctl::get(ctl::REUSE) != 0 {
        reuse_headers(rec, ev);
    }
    if ctl::get(ctl::TUPLES) == 0 {
        copy_words(&mut ev.ct.orig, &rec.ct_orig);
        copy_words(&mut ev.ct.reply, &rec.ct_reply);
    }
    if rec.decision == decision::KEEP {
        add_reading(rec, ev, program);
        if hook_no == hook::FORWARD {
            note_port(rec, skb_dev(skb_p));
        }
        // A fragment at the first PREROUTING probe is about to be held by defragmentation
        // (-400), to be freed on whatever CPU frees the datagram it completes.
        if program == 0 && hook_no == hook::PRE_ROUTING && ev.header.flags & flags::FRAGMENT != 0 {
            park::<Quiet>(rec);
        }
    }
    Ok(())
}

/// Program 2's second look at a packet the filter left out, the short way: the long way
/// decides again from its connection's tuples alone (`Decide::WithConntrack` without the
/// packet's headers), and no tuple can pass when none of its addresses lies in the
/// filter's networks ([`observer_common::filter::FilterNets`]). True when that settles it
/// (left out, as the long way leaves it); false when the long way must decide, from a
/// record (a packet followed without one gets it now).
#[inline(always)]
fn still_left_out(
    state_p: *const u8,
    skb_p: *const u8,
    skb: u64,
    program: u8,
    w: &mut crate::Windows,
) -> bool {
    // Left out where it entered (program 2 is no entry point): followed without a record
    // (TC ingress), or with one (the first PREROUTING or OUTPUT probe).
    let mut entry = find_left_out(skb);
    let rec = match entry {
        Some(_) => None,
        None => match find(skb) {
            Some(f) if f.rec.decision != decision::KEEP => Some(f.rec),
            _ => return false,
        },
    };
    match recheck(state_p, skb_p, program, w) {
        Recheck::LongWay => {
            // The long way decides from a record: the entry becomes one.
            if let Some(lo) = entry {
                return lo.into_record().is_none();
            }
            false
        }
        how => {
            if let Some(lo) = &mut entry {
                lo.filtered_out();
            }
            if let Some(rec) = rec {
                if how == Recheck::Unread {
                    rec.incomplete |= missing::READ;
                }
                rec.decision = decision::FILTERED_OUT;
            }
            true
        }
    }
}

/// What program 2's short look at a left-out packet's connection says.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Recheck {
    /// No tuple of the connection can pass.
    LeftOut,
    /// The connection could not be read: the long way would have none to match.
    Unread,
    /// The long way must decide.
    LongWay,
}

#[inline(always)]
fn recheck(state_p: *const u8, skb_p: *const u8, program: u8, w: &mut crate::Windows) -> Recheck {
    let Some(nets) = filter_nets() else {
        return Recheck::LongWay;
    };
    let Some(conn) = entry_of(direct::<u64, { config::SKB_NFCT }>(skb_p)) else {
        return Recheck::LongWay;
    };
    let hook_no: u8 = direct::<u8, { config::STATE_HOOK }>(state_p);
    // Where a table before this probe may rewrite the headers, the long way reads them
    // and decides from them too.
    if (header_readers(hook_no) >> program) & 1 != 0 {
        return Recheck::LongWay;
    }
    // Where the kernel allows, its four addresses are loaded straight from the entry.
    let may = match conntrack_addresses_may_match(nets, conn) {
        Some(may) => Some(may),
        None => {
            let Some(start) = cfg(config::CT_WINDOW) else {
                return Recheck::LongWay;
            };
            if read_window(conn, start, &mut w.ct).is_err() {
                return Recheck::Unread;
            }
            conntrack_may_match(nets, &w.ct, start)
        }
    };
    if opaque(usize::from(may == Some(false))) == 0 {
        return Recheck::LongWay;
    }
    Recheck::LeftOut
}

/// The programs (bits) that read the headers again at hook `hook_no`, and above
/// [`config::NAT_ONLY_SHIFT`] those of them that follow nat alone (`config::READ_HEADERS`).
#[inline(always)]
fn header_readers(hook_no: u8) -> u64 {
    cfg(config::READ_HEADERS + u32::from(hook_no & 7)).unwrap_or(0)
}

/// How the filter decides at this probe.
const MODE_KEEP: u32 = 0;
const MODE_ENTRY: u32 = 1;
const MODE_CONNTRACK: u32 = 2;
const MODE_ORPHAN: u32 = 3;

/// Reads everything a step records: devices, mark, length, addresses, ports, conntrack.
#[inline(always)]
fn read_packet(
    ev: &mut observer_common::PacketEvent,
    state_p: *const u8,
    skb_p: *const u8,
    w: &mut crate::Windows,
    devices: bool,
    headers: bool,
    tuples: bool,
) -> Result<(), ()> {
    ev.header.family = direct::<u8, { config::STATE_PF }>(state_p);
    if devices {
        (ev.header.ifindex_in, ev.header.ifindex_out) = devices_of(state_p);
    }
    ev.packet.mark = direct::<u32, { config::SKB_MARK }>(skb_p);
    ev.packet.len = direct::<u32, { config::SKB_LEN }>(skb_p);
    let nfct = direct::<u64, { config::SKB_NFCT }>(skb_p);
    if !headers {
        return read_conntrack(ev, w, nfct, tuples);
    }
    if read_headers(ev, skb_p, w).is_err() {
        return Err(());
    }
    read_conntrack(ev, w, nfct, tuples)
}

/// Reads the headers after all (a probe that skipped them), flagging a failed read in the
/// control words like `read_packet`'s.
#[inline(always)]
fn read_into_event(
    ev: &mut observer_common::PacketEvent,
    skb_p: *const u8,
    w: &mut crate::Windows,
) {
    if read_headers(ev, skb_p, w).is_err() {
        ctl::set(ctl::READ_OK, 0);
    }
    ctl::set(ctl::REUSE, 0);
}

/// Reads the IP and transport headers (and an ICMP error's quoted packet) into `ev`.
#[inline(always)]
fn read_headers(
    ev: &mut observer_common::PacketEvent,
    skb_p: *const u8,
    w: &mut crate::Windows,
) -> Result<(), ()> {
    read_l3(network_header(skb_p), w, ev)
}

/// The kernel address of the skb's network header (`head + network_header`).
#[inline(always)]
fn network_header(skb_p: *const u8) -> u64 {
    let head = direct::<u64, { config::SKB_HEAD }>(skb_p);
    let nh = direct::<u16, { config::SKB_NETWORK_HEADER }>(skb_p);
    head + u64::from(nh)
}

#[inline(always)]
fn read_conntrack(
    ev: &mut observer_common::PacketEvent,
    w: &mut crate::Windows,
    nfct: u64,
    tuples: bool,
) -> Result<(), ()> {
    if read_ct(nfct, &mut ev.ct, w, tuples)? {
        ev.header.flags |= flags::CT;
    }
    Ok(())
}
