//! The always-on counters (observer_common::counts): what a netfilter probe adds at its
//! point, and what the drop tracepoint adds for a dropped packet. No traversal is assembled:
//! a probe loads a few fields directly, compares the mark with the packet's previous point
//! on this CPU, and adds to per-CPU rows.

use aya_ebpf::{macros::map, maps::PerCpuArray};
use observer_common::config;
use observer_common::counts::{
    self, LAST_POINTS, LastPoint, MARK_CLEARED, MARK_SET, PACKETS, REASONS, ROW, UNATTRIBUTED,
};

use crate::{cfg, direct, entry_of, read_word};

/// Counter rows, one per point ([`counts::point`]).
#[map]
pub static COUNTS: PerCpuArray<[u64; ROW]> =
    PerCpuArray::with_max_entries(counts::POINTS as u32, 0);

/// Drops, one row per place (the last point passed, or unknown) by reason.
#[map]
pub static DROP_COUNTS: PerCpuArray<[u64; REASONS]> =
    PerCpuArray::with_max_entries(counts::DROP_PLACES as u32, 0);

/// The packets this CPU counted last, and their last points.
#[map]
pub static COUNT_LAST: PerCpuArray<[LastPoint; LAST_POINTS]> = PerCpuArray::with_max_entries(1, 0);

/// Whether the counters are kept.
#[inline(always)]
pub fn counting() -> bool {
    cfg(config::COUNTING).is_some_and(|v| v != 0)
}

/// Whether the probes only count (no traversals).
#[inline(always)]
pub fn count_only() -> bool {
    cfg(config::COUNT_ONLY).is_some_and(|v| v != 0)
}

/// Counts a packet at netfilter program `program`. `state_p` and `skb_p` are the context's
/// typed pointers (see `direct`); `skb` the skb's address as a number.
#[inline(always)]
pub fn at_point(state_p: *const u8, skb_p: *const u8, skb: u64, program: u8) {
    let hook = direct::<u8, { config::STATE_HOOK }>(state_p) as usize;
    let pf = direct::<u8, { config::STATE_PF }>(state_p);
    let (Some(family), true) = (counts::family_index(pf), hook < counts::HOOKS) else {
        return;
    };
    let here = counts::point(family, hook, program as usize);
    let Some(row) = COUNTS.get_ptr_mut(here as u32) else {
        return;
    };
    // SAFETY: per-CPU row, used by one program run at a time on this CPU.
    let row = unsafe { &mut *row };
    row[PACKETS] += 1;
    let mark = direct::<u32, { config::SKB_MARK }>(skb_p);
    let Some(last) = COUNT_LAST.get_ptr_mut(0) else {
        return;
    };
    // SAFETY: as above.
    let last = unsafe { &mut *last };
    // Where a packet enters (program 0 of PREROUTING or OUTPUT) it starts afresh: an
    // older entry under its address was another packet's.
    let entry = program == 0
        && (hook == observer_common::hook::PRE_ROUTING as usize
            || hook == observer_common::hook::LOCAL_OUT as usize);
    let i = if last[0].skb == skb {
        0
    } else if last[1].skb == skb {
        1
    } else {
        2
    };
    if i < LAST_POINTS && !entry {
        let before = last[i].mark;
        let set = mark & !before;
        let cleared = before & !mark;
        if set | cleared != 0 {
            add_bits(row, set, MARK_SET);
            add_bits(row, cleared, MARK_CLEARED);
        }
        last[i].mark = mark;
        last[i].point = here as u32;
    } else {
        if !entry {
            row[UNATTRIBUTED] += 1;
        }
        // The newest packet goes first; the one it interrupted (if any) stays second.
        last[1] = last[0];
        last[0] = LastPoint {
            skb,
            mark,
            point: here as u32,
        };
    }
    if cfg(config::NAT_AFTER + hook as u32).is_some_and(|m| (m >> program) & 1 != 0) {
        count_nat(row, skb_p, hook);
    }
}

/// Adds one to `row[base + b]` for every bit `b` of `bits`.
#[inline(always)]
fn add_bits(row: &mut [u64; ROW], bits: u32, base: usize) {
    let mut b = 0;
    while b < 32 {
        if bits & (1 << b) != 0
            && let Some(c) = row.get_mut(base + b)
        {
            *c += 1;
        }
        b += 1;
    }
}

/// The NAT the kernel applied before this point (right after the nat table).
#[inline(always)]
fn count_nat(row: &mut [u64; ROW], skb_p: *const u8, hook: usize) {
    let nfct = direct::<u64, { config::SKB_NFCT }>(skb_p);
    let Some(conn) = entry_of(nfct) else {
        return;
    };
    let Some(off) = cfg(config::CT_STATUS) else {
        return;
    };
    let Ok(status) = read_word(conn, off) else {
        return;
    };
    if let Some(i) = counts::nat_counter(hook, nfct & 7, status) {
        row[i] += 1;
    }
}

/// The point `skb` last passed on this CPU, if it is remembered.
#[inline(always)]
pub fn last_point_of(skb: u64) -> Option<u32> {
    let last = COUNT_LAST.get(0)?;
    if last[0].skb == skb {
        Some(last[0].point)
    } else if last[1].skb == skb {
        Some(last[1].point)
    } else {
        None
    }
}

/// Counts a drop at `place` (a point, or [`counts::UNKNOWN_PLACE`]) for `reason`.
#[inline(always)]
pub fn drop_at(place: usize, reason: u64) {
    let place = if place < counts::DROP_PLACES {
        place
    } else {
        counts::UNKNOWN_PLACE
    };
    if let Some(row) = DROP_COUNTS.get_ptr_mut(place as u32) {
        let r = if (reason as usize) < REASONS {
            reason as usize
        } else {
            REASONS - 1
        };
        // SAFETY: per-CPU row, used by one program run at a time on this CPU.
        unsafe { (*row)[r] += 1 };
    }
}
