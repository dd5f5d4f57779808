//! The always-on counters (`observer agent`'s default mode): kept by the netfilter probes
//! and the drop tracepoint in per-CPU arrays, summed by userspace, without assembling any
//! traversal. docs/wire-format.md describes them.
//!
//! A *point* is one netfilter probe: (family, hook, program). Each has a row of
//! [`ROW`] counters for what happened between the packet's previous point and this one (on
//! the plan, that is the table just before this point): packets that reached it, mark bits
//! set and cleared, NAT applied. Drops have their own rows, by the last point the packet
//! passed and the kernel's drop reason.

use crate::NF_SLOTS;

/// Families counted: IPv4 (0) and IPv6 (1).
pub const FAMILIES: usize = 2;
/// Netfilter hooks 0..=4.
pub const HOOKS: usize = 5;
/// Rows of [`ROW`] counters: one per (family, hook, program).
pub const POINTS: usize = FAMILIES * HOOKS * NF_SLOTS;

/// Index in a point's row: packets that reached the point.
pub const PACKETS: usize = 0;
/// Mark bit `b` set since the packet's previous point: `MARK_SET + b`.
pub const MARK_SET: usize = 1;
/// Mark bit `b` cleared since the packet's previous point: `MARK_CLEARED + b`.
pub const MARK_CLEARED: usize = 33;
/// NAT the kernel applied to the packet before this point (a point right after the nat
/// table): destination or source, by the nat chains (the connection's first packet) or
/// by conntrack's stored translation.
pub const DNAT_RULES: usize = 65;
pub const DNAT_CONNTRACK: usize = 66;
pub const SNAT_RULES: usize = 67;
pub const SNAT_CONNTRACK: usize = 68;
/// Packets whose previous point on this CPU was not known (they waited in a queue or
/// changed CPU, or another packet took their place): mark changes before this point were
/// not counted for them.
pub const UNATTRIBUTED: usize = 69;
pub const ROW: usize = 72;

/// Drop places: every point (the last one the packet passed), and one more for dropped
/// packets of the observed namespace whose last point is not known.
pub const DROP_PLACES: usize = POINTS + 1;
pub const UNKNOWN_PLACE: usize = POINTS;
/// Drop reasons counted one by one; higher ones count in the last.
pub const REASONS: usize = 128;

/// The family's index, for `nf_hook_state.pf`.
#[inline(always)]
pub fn family_index(pf: u8) -> Option<usize> {
    match pf {
        crate::family::IPV4 => Some(0),
        crate::family::IPV6 => Some(1),
        _ => None,
    }
}

/// The row of a point.
#[inline(always)]
pub fn point(family: usize, hook: usize, program: usize) -> usize {
    (family * HOOKS + hook) * NF_SLOTS + program
}

/// The (family index, hook, program) of a row: the inverse of [`point`].
pub fn point_parts(row: usize) -> (usize, usize, usize) {
    (
        row / (HOOKS * NF_SLOTS),
        (row / NF_SLOTS) % HOOKS,
        row % NF_SLOTS,
    )
}

/// What the counting probes remember of a packet between its points, per CPU.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LastPoint {
    /// Kernel address of the `sk_buff` (0: free).
    pub skb: u64,
    pub mark: u32,
    /// Its last point ([`point`]).
    pub point: u32,
}

/// Packets remembered per CPU: one being handled, and one that a nested one interrupted.
pub const LAST_POINTS: usize = 2;

/// `IPS_*` bits of `nf_conn.status` the NAT counters use.
pub const IPS_CONFIRMED: u64 = 1 << 3;
pub const IPS_SRC_NAT: u64 = 1 << 4;
pub const IPS_DST_NAT: u64 = 1 << 5;
/// `IP_CT_IS_REPLY`: ctinfo values from here on are replies.
pub const IP_CT_IS_REPLY: u64 = 3;

/// The NAT counter a packet at a point right after the nat table adds to, if the kernel
/// translated it there: PREROUTING and OUTPUT rewrite destinations, INPUT and POSTROUTING
/// sources; a reply gets the other direction's translation undone (as `nf_nat_packet`
/// does). The nat chains ran when the connection was not confirmed yet.
#[inline(always)]
pub fn nat_counter(hook: usize, ctinfo: u64, status: u64) -> Option<usize> {
    let dst_manip =
        hook == crate::hook::PRE_ROUTING as usize || hook == crate::hook::LOCAL_OUT as usize;
    let reply = ctinfo >= IP_CT_IS_REPLY;
    let bit = if dst_manip != reply {
        IPS_DST_NAT
    } else {
        IPS_SRC_NAT
    };
    if status & bit == 0 {
        return None;
    }
    let rules = status & IPS_CONFIRMED == 0;
    Some(match (dst_manip, rules) {
        (true, true) => DNAT_RULES,
        (true, false) => DNAT_CONNTRACK,
        (false, true) => SNAT_RULES,
        (false, false) => SNAT_CONNTRACK,
    })
}

/// Tier 1 (the agent's default mode, no netfilter probe attached): a drop keyed by what
/// the `kfree_skb` tracepoint knows alone. `location` is the kernel address that dropped
/// it (userspace names the function from `/proc/kallsyms`), `reason` the kernel's
/// `skb_drop_reason`, `family` 4 or 6 (0: the packet had no IP header yet), `protocol`
/// the IP protocol (IPv6: the first next-header).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct DropKey {
    pub location: u64,
    pub reason: u32,
    pub family: u8,
    pub protocol: u8,
    pub pad: u16,
}

/// Keys the tier 1 map holds at most; drops of keys past it count in `KEYS_FULL`.
pub const DROP_KEYS: u32 = 4096;

/// The tier 1 program's per-CPU memory of the last key it counted: a drop of the same key
/// (a flood of one flow) adds to that key's counter without the hash map's lookup.
/// `DROP_KEYED` maps a key to its counter's index + 1 on each CPU (0: none yet on that
/// CPU); the counters are the per-CPU array `DROP_KEYED_COUNTS`, indexed on each CPU from
/// 0 up (`next`), so that a count never moves and the sum a reader sees never falls.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct DropKeyCache {
    pub key: DropKey,
    /// The key's counter index + 1 (0: the cache is empty).
    pub slot: u32,
    /// Counters this CPU has taken.
    pub next: u32,
}
/// Bytes of the network header a sample carries (IPv4 with options and ports, IPv6 and
/// ports).
pub const SAMPLE_BYTES: usize = 80;

/// Tier 1 counters (the `DROP_STATS` per-CPU array).
pub mod drop_stats {
    /// Drops not counted by key: the key map was full.
    pub const KEYS_FULL: u32 = 0;
    /// Samples not taken: the rate limit left them out (counted, by design).
    pub const SAMPLES_LIMITED: u32 = 1;
    /// Samples lost: the sample ring was full.
    pub const SAMPLES_LOST: u32 = 2;
    /// Samples written.
    pub const SAMPLES: u32 = 3;
    /// Drops left out by the reason filter (`--drop-reasons-ignored`).
    pub const REASON_FILTERED: u32 = 4;
    pub const COUNT: u32 = 8;
}

/// `DropSample.flags`: the skb had a conntrack entry (`ctinfo`, `ct_status`, `ct_mark`).
pub const SAMPLE_CT: u8 = 1;
/// `DropSample.flags`: `header` holds the network header.
pub const SAMPLE_HEADER: u8 = 2;

/// A rate-limited sample of one dropped packet (tier 1): what the kernel had on it when
/// it freed it.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct DropSample {
    /// `bpf_ktime_get_ns` (CLOCK_MONOTONIC) at the drop.
    pub ts_ns: u64,
    pub location: u64,
    pub reason: u32,
    pub mark: u32,
    /// `skb->dev`'s ifindex (0: none).
    pub ifindex: u32,
    pub len: u32,
    pub ct_status: u32,
    pub ct_mark: u32,
    /// `enum ip_conntrack_info` (the low bits of `_nfct`).
    pub ctinfo: u8,
    pub family: u8,
    pub protocol: u8,
    pub flags: u8,
    pub pad: u32,
    pub header: [u8; SAMPLE_BYTES],
}

impl DropSample {
    pub const ZERO: Self = Self {
        ts_ns: 0,
        location: 0,
        reason: 0,
        mark: 0,
        ifindex: 0,
        len: 0,
        ct_status: 0,
        ct_mark: 0,
        ctinfo: 0,
        family: 0,
        protocol: 0,
        flags: 0,
        pad: 0,
        header: [0; SAMPLE_BYTES],
    };
}

const _: () = assert!(core::mem::size_of::<DropKey>() == 16);
const _: () = assert!(core::mem::size_of::<DropSample>() == 48 + SAMPLE_BYTES);
const _: () = assert!(core::mem::size_of::<LastPoint>() == 16);
const _: () = assert!(UNATTRIBUTED < ROW);
const _: () = assert!(MARK_CLEARED + 32 <= DNAT_RULES);

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hook;

    #[test]
    fn points_round_trip() {
        for f in 0..FAMILIES {
            for h in 0..HOOKS {
                for p in 0..NF_SLOTS {
                    assert_eq!(point_parts(point(f, h, p)), (f, h, p));
                    assert!(point(f, h, p) < POINTS);
                }
            }
        }
    }

    #[test]
    fn nat_follows_the_kernels_manip_rules() {
        let pre = hook::PRE_ROUTING as usize;
        let post = hook::POST_ROUTING as usize;
        // First packet of a DNATed connection at PREROUTING: the rules did it.
        assert_eq!(nat_counter(pre, 2, IPS_DST_NAT), Some(DNAT_RULES));
        // Later packets: conntrack did.
        assert_eq!(
            nat_counter(pre, 0, IPS_DST_NAT | IPS_CONFIRMED),
            Some(DNAT_CONNTRACK)
        );
        // A DNATed connection's packets are not SNATed at POSTROUTING...
        assert_eq!(nat_counter(post, 0, IPS_DST_NAT | IPS_CONFIRMED), None);
        // ...but its replies get their source rewritten back there.
        assert_eq!(
            nat_counter(post, 3, IPS_DST_NAT | IPS_CONFIRMED),
            Some(SNAT_CONNTRACK)
        );
        // Masquerade: source at POSTROUTING, and the reply's destination at PREROUTING.
        assert_eq!(nat_counter(post, 2, IPS_SRC_NAT), Some(SNAT_RULES));
        assert_eq!(
            nat_counter(pre, 3, IPS_SRC_NAT | IPS_CONFIRMED),
            Some(DNAT_CONNTRACK)
        );
        assert_eq!(nat_counter(pre, 0, IPS_CONFIRMED), None);
    }
}
