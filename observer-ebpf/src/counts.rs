//! The always-on counters (observer_common::counts): what a netfilter probe adds at its
//! point, and what the drop tracepoint adds for a dropped packet. No traversal is assembled:
//! a probe loads a few fields directly, compares the mark with the packet's previous point
//! on this CPU, and adds to per-CPU rows.

use aya_ebpf::{
    bindings::BPF_NOEXIST,
    macros::map,
    maps::{PerCpuArray, PerCpuHashMap, RingBuf},
};
use observer_common::config;
use observer_common::counts::{
    self, DROP_KEYS, DropKey, DropSample, LAST_POINTS, LastPoint, MARK_CLEARED, MARK_SET, PACKETS,
    REASONS, ROW, SAMPLE_BYTES, SAMPLE_CT, SAMPLE_HEADER, UNATTRIBUTED, drop_stats,
};

use crate::{cfg, direct, entry_of, now, read, read_into, read_word};

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

/// Tier 1: drops by (location, reason, family, protocol), for drops whose last point is
/// not known (the agent's default mode attaches no netfilter probe).
#[map]
pub static DROP_KEYED: PerCpuHashMap<DropKey, u64> = PerCpuHashMap::with_max_entries(DROP_KEYS, 0);

/// Tier 1's own counters ([`drop_stats`]).
#[map]
pub static DROP_STATS: PerCpuArray<u64> = PerCpuArray::with_max_entries(drop_stats::COUNT, 0);

/// When this CPU last took a sample.
#[map]
static SAMPLE_LAST: PerCpuArray<u64> = PerCpuArray::with_max_entries(1, 0);

/// Rate-limited samples of dropped packets, for the agent's flight recorder.
#[map]
pub static DROP_SAMPLES: RingBuf = RingBuf::with_byte_size(64 * 1024, 0);

#[inline(always)]
fn stat(i: u32) {
    if let Some(c) = DROP_STATS.get_ptr_mut(i) {
        // SAFETY: per-CPU slot, one program run at a time on this CPU.
        unsafe { *c += 1 };
    }
}

/// Whether tier 1 counts drops by key.
#[inline(always)]
pub fn keyed() -> bool {
    cfg(config::DROP_KEYED).is_some_and(|v| v != 0)
}

/// Tier 1: counts a drop of the observed namespace by key and, within the rate limit,
/// writes a sample of it. Never touches the packet.
#[inline(always)]
pub fn drop_keyed(skb: u64, location: u64, reason: u64) {
    let (word, bit) = if reason < 64 {
        (config::DROP_REASONS_IGNORED, reason)
    } else {
        (config::DROP_REASONS_IGNORED_HIGH, reason & 63)
    };
    if reason < 128 && cfg(word).is_some_and(|m| (m >> bit) & 1 != 0) {
        stat(drop_stats::REASON_FILTERED);
        return;
    }
    // The network header: its first bytes say the family and protocol.
    let l3 = match (cfg(config::SKB_HEAD), cfg(config::SKB_NETWORK_HEADER)) {
        (Some(h), Some(n)) => match (read::<u64>(skb, h), read::<u16>(skb, n)) {
            (Ok(head), Ok(nh)) if head != 0 && nh != u16::MAX => Some(head + u64::from(nh)),
            _ => None,
        },
        _ => None,
    };
    let mut key = DropKey {
        location,
        reason: reason as u32,
        family: 0,
        protocol: 0,
        pad: 0,
    };
    if let Some(l3) = l3
        && let Ok(first) = read::<[u8; 10]>(l3, 0)
    {
        match first[0] >> 4 {
            4 => {
                key.family = 4;
                key.protocol = first[9];
            }
            6 => {
                key.family = 6;
                key.protocol = first[6];
            }
            _ => {}
        }
    }
    if let Some(c) = DROP_KEYED.get_ptr_mut(&key) {
        // SAFETY: per-CPU value, one program run at a time on this CPU.
        unsafe { *c += 1 };
    } else if DROP_KEYED.insert(&key, &1, u64::from(BPF_NOEXIST)).is_err() {
        stat(drop_stats::KEYS_FULL);
    }
    let Some(gap) = cfg(config::DROP_SAMPLE_GAP_NS) else {
        return;
    };
    let Some(last) = SAMPLE_LAST.get_ptr_mut(0) else {
        return;
    };
    let t = now();
    // SAFETY: as above.
    let last = unsafe { &mut *last };
    if *last != 0 && t.wrapping_sub(*last) < gap {
        stat(drop_stats::SAMPLES_LIMITED);
        return;
    }
    *last = t;
    let Some(mut entry) = DROP_SAMPLES.reserve::<DropSample>(0) else {
        stat(drop_stats::SAMPLES_LOST);
        return;
    };
    let s = entry.write(DropSample::ZERO);
    s.ts_ns = t;
    s.location = location;
    s.reason = reason as u32;
    s.family = key.family;
    s.protocol = key.protocol;
    if let Some(off) = cfg(config::SKB_MARK) {
        s.mark = read::<u32>(skb, off).unwrap_or(0);
    }
    if let Some(off) = cfg(config::SKB_LEN) {
        s.len = read::<u32>(skb, off).unwrap_or(0);
    }
    if let (Some(dev_off), Some(idx_off)) = (cfg(config::SKB_DEV), cfg(config::NETDEV_IFINDEX))
        && let Ok(dev) = read::<u64>(skb, dev_off)
        && dev != 0
    {
        s.ifindex = read::<u32>(dev, idx_off).unwrap_or(0);
    }
    if let Some(off) = cfg(config::SKB_NFCT)
        && let Ok(nfct) = read::<u64>(skb, off)
        && let Some(conn) = entry_of(nfct)
    {
        s.ctinfo = (nfct & 7) as u8;
        s.flags |= SAMPLE_CT;
        if let Some(o) = cfg(config::CT_STATUS) {
            s.ct_status = read::<u64>(conn, o).unwrap_or(0) as u32;
        }
        if let Some(o) = cfg(config::CT_MARK) {
            s.ct_mark = read::<u32>(conn, o).unwrap_or(0);
        }
    }
    if key.family != 0
        && let Some(l3) = l3
        && read_into(l3, 0, &mut s.header[..SAMPLE_BYTES]).is_ok()
    {
        s.flags |= SAMPLE_HEADER;
    }
    entry.submit(0);
    stat(drop_stats::SAMPLES);
}
