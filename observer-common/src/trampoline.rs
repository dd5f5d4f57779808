//! The fentry/fexit capture backend's map (`FENTRY_POINTS`): which probe program a call of a
//! table's function stands for. Userspace fills it from each hook's plan; the trampolines
//! look up the call they see (its family, hook, the function, entry or exit, and for an
//! nftables base chain its priority) and observe as that program, or return at once when
//! the call is not in it.

/// The functions the trampolines sit on (`func` of a [`key`]).
pub mod func {
    /// `nft_do_chain`: every nftables base chain but those of type nat (iptables-nft too).
    pub const NFT: u8 = 1;
    /// The nat table's hook functions (`nf_nat_ipv4_pre_routing`, `nf_nat_ipv4_out`, ...,
    /// `nf_nat_ipv6_in`, ...): every nat chain of the hook runs inside, and the packet is
    /// rewritten there after them (an ICMP error related to a connection too, which
    /// `nf_nat_inet_fn` inside them never sees).
    pub const NAT: u8 = 2;
    /// `nf_nat_ipv6_fn`: IPv6 LOCAL_IN's nat hook function, also called inside the other
    /// IPv6 ones (so keyed at LOCAL_IN only).
    pub const NAT6_FN: u8 = 6;
    /// `nf_conntrack_in`: conntrack (-200).
    pub const CONNTRACK: u8 = 3;
    /// `ipt_do_table`: a legacy x_tables IPv4 table (by its priority).
    pub const IPT: u8 = 4;
    /// `ip6t_do_table`: a legacy x_tables IPv6 table (by its priority).
    pub const IP6T: u8 = 5;
    /// `ip_vs_out_hook`: IPVS's reply translation (keyed at FORWARD, priority 100, where
    /// masquerade replies get the virtual service's address back; its other hooks are not
    /// keyed).
    pub const IPVS_OUT: u8 = 7;
}

/// Where a call is: at the function's entry (the point before its table) or exit (after).
pub const ENTRY: u8 = 0;
pub const EXIT: u8 = 1;

/// The key of one call: family (`NFPROTO_*`), hook (`NF_INET_*`), function ([`func`]),
/// entry or exit, and the priority (an nftables base chain's or a legacy table's; 0 for
/// the others, which run at one priority each).
#[inline(always)]
pub const fn key(pf: u8, hook: u8, func: u8, exit: u8, priority: i32) -> u64 {
    (pf as u64)
        | ((hook as u64) << 8)
        | ((func as u64) << 16)
        | ((exit as u64) << 24)
        | ((priority as u32 as u64) << 32)
}

/// The key under which userspace leaves the offset from an `nft_chain` to its base chain's
/// `ops.priority` (an i32 as u32): no call has function 0.
pub const CHAIN_PRIORITY_OFFSET: u64 = 0;

/// The key under which userspace leaves the offset of `priority` in `struct xt_table` (a
/// legacy table's, the third argument of `ipt_do_table`).
pub const XT_TABLE_PRIORITY_OFFSET: u64 = 1;

/// Entries the map holds: each hook's points of both families, with room to spare.
pub const MAX_ENTRIES: u32 = 512;

/// `NF_ACCEPT`, and the mask of the verdict in what a hook function returns: a trampoline
/// after the function observes only a packet it let through.
pub const NF_ACCEPT: u32 = 1;
pub const NF_VERDICT_MASK: u32 = 0xff;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_keep_every_part_apart() {
        let k = key(2, 0, func::NFT, EXIT, -150);
        assert_eq!(k & 0xff, 2);
        assert_eq!((k >> 8) & 0xff, 0);
        assert_eq!((k >> 16) & 0xff, u64::from(func::NFT));
        assert_eq!((k >> 24) & 0xff, u64::from(EXIT));
        assert_eq!((k >> 32) as u32 as i32, -150);
        assert_ne!(key(10, 0, func::NFT, EXIT, -150), k);
        assert_ne!(key(2, 0, func::NFT, ENTRY, -150), k);
        assert_ne!(key(2, 0, func::NFT, EXIT, i32::MIN), CHAIN_PRIORITY_OFFSET);
    }
}
