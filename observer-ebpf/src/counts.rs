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
    self, DROP_KEYS, DropKey, DropKeyCache, DropSample, LAST_POINTS, LastPoint, MARK_CLEARED,
    MARK_SET, PACKETS, REASONS, ROW, SAMPLE_BYTES, SAMPLE_CT, SAMPLE_HEADER, UNATTRIBUTED,
    drop_stats,
};

use crate::{
    cfg, direct, direct_reads, entry_of, load_u64_untrusted, now, read, read_into, read_word,
};

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
/// not known (the agent's default mode attaches no netfilter probe). The value is, on each
/// CPU, the index + 1 of the key's counter in `DROP_KEYED_COUNTS` ([`DropKeyCache`]).
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
/// writes a sample of it. Never touches the packet. `skb_p` is the tracepoint's typed skb
/// pointer (see `direct`), `skb` its address as a number. Per drop: a few direct loads
/// (no helper call where the kernel allows direct reads), and the hash map's lookup only
/// when the key differs from this CPU's last one ([`DropKeyCache`]).
#[inline(always)]
pub fn drop_keyed(skb_p: *const u8, skb: u64, location: u64, reason: u64) {
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
    let head = direct::<u64, { config::SKB_HEAD }>(skb_p);
    let nh = direct::<u16, { config::SKB_NETWORK_HEADER }>(skb_p);
    let l3 = (head != 0 && nh != u16::MAX).then(|| head + u64::from(nh));
    let mut key = DropKey {
        location,
        reason: reason as u32,
        family: 0,
        protocol: 0,
        pad: 0,
    };
    if let Some(l3) = l3
        && let Some((version, v4_proto, v6_next)) = l3_first(l3)
    {
        match version >> 4 {
            4 => {
                key.family = 4;
                key.protocol = v4_proto;
            }
            6 => {
                key.family = 6;
                key.protocol = v6_next;
            }
            _ => {}
        }
    }
    count_key(&key);
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

/// Tier 1's counters, one per key on each CPU (`DROP_KEYED` holds the index + 1).
#[map]
pub static DROP_KEYED_COUNTS: PerCpuArray<u64> = PerCpuArray::with_max_entries(DROP_KEYS, 0);

/// This CPU's last key ([`DropKeyCache`]).
#[map]
static DROP_KEY_CACHE: PerCpuArray<DropKeyCache> = PerCpuArray::with_max_entries(1, 0);

/// The first byte of the network header at `l3` and the bytes where IPv4 keeps its
/// protocol (9) and IPv6 its first next header (6): two loads where the kernel allows
/// direct reads, one `bpf_probe_read_kernel` elsewhere.
#[inline(always)]
fn l3_first(l3: u64) -> Option<(u8, u8, u8)> {
    if direct_reads() {
        let a = load_u64_untrusted(l3).to_le_bytes();
        let b = load_u64_untrusted(l3 + 8).to_le_bytes();
        return Some((a[0], b[1], a[6]));
    }
    let first = read::<[u8; 10]>(l3, 0).ok()?;
    Some((first[0], first[9], first[6]))
}

/// Adds one drop of `key`: to this CPU's last key's counter when it is the same key, else
/// through the hash map (taking a counter for a key new on this CPU).
#[inline(always)]
fn count_key(key: &DropKey) {
    let Some(cache) = DROP_KEY_CACHE.get_ptr_mut(0) else {
        return;
    };
    // SAFETY: per-CPU entry, used by one program run at a time on this CPU.
    let cache = unsafe { &mut *cache };
    if cache.slot != 0 && cache.key == *key {
        bump(cache.slot - 1);
        return;
    }
    let slot = if let Some(v) = DROP_KEYED.get_ptr_mut(key) {
        // SAFETY: per-CPU value, as above.
        let v = unsafe { &mut *v };
        if *v == 0 {
            let Some(s) = take_slot(cache) else {
                return;
            };
            *v = u64::from(s);
        }
        *v as u32
    } else {
        let Some(s) = take_slot(cache) else {
            return;
        };
        if DROP_KEYED
            .insert(key, &u64::from(s), u64::from(BPF_NOEXIST))
            .is_err()
        {
            // Another CPU added the key meanwhile (then ours is 0 there: set it), or the
            // map is full.
            match DROP_KEYED.get_ptr_mut(key) {
                // SAFETY: as above.
                Some(v) => unsafe { *v = u64::from(s) },
                None => {
                    cache.next -= 1;
                    stat(drop_stats::KEYS_FULL);
                    return;
                }
            }
        }
        s
    };
    cache.key = *key;
    cache.slot = slot;
    bump(slot.wrapping_sub(1));
}

/// A new counter index + 1 on this CPU, or `None` (counted) when all are taken.
#[inline(always)]
fn take_slot(cache: &mut DropKeyCache) -> Option<u32> {
    if cache.next >= DROP_KEYS {
        stat(drop_stats::KEYS_FULL);
        return None;
    }
    cache.next += 1;
    Some(cache.next)
}

#[inline(always)]
fn bump(i: u32) {
    if let Some(c) = DROP_KEYED_COUNTS.get_ptr_mut(i) {
        // SAFETY: per-CPU counter, one program run at a time on this CPU.
        unsafe { *c += 1 };
    }
}
