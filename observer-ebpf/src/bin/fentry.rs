//! Trampoline probes (BPF_PROG_TYPE_TRACING, fentry/fexit), the fentry capture backend's: for
//! kernels without BPF netfilter links (before 6.4, e.g. Debian 12's 6.1). They sit on the
//! functions the tables run and observe exactly as the netfilter programs do
//! ([`point::observe`]): the entry of a hook's first table is the point before it, the exit
//! of each table the point after it. Which point (program) a call stands for is userspace's
//! to say, from the plan, through `FENTRY_POINTS`, keyed by family, hook, function, entry
//! or exit and (nftables base chains, legacy tables) priority
//! (`observer_common::trampoline`); a call not in it returns at once. An exit observes only
//! a packet the function let through (NF_ACCEPT). Every program returns 0 and never
//! changes the packet.
//!
//! Loaded by observer's own loader (`nf_link`, with the attach target's BTF id and, for a
//! function of a module, that module's BTF), which relocates the map references onto the
//! TC object's maps and `FENTRY_POINTS` onto the backend's. Keep every helper
//! `#[inline(always)]`: that loader supports no BPF-to-BPF calls.
#![no_std]
#![no_main]

use aya_ebpf::helpers::bpf_probe_read_kernel;
use aya_ebpf::macros::map;
use aya_ebpf::maps::HashMap;
use observer_common::config;
use observer_common::trampoline::{
    CHAIN_PRIORITY_OFFSET, ENTRY, EXIT, MAX_ENTRIES, NF_ACCEPT, NF_VERDICT_MASK,
    XT_TABLE_PRIORITY_OFFSET, func, key,
};
use observer_ebpf::{cfg, direct, point};

/// (family, hook, function, entry or exit, priority) -> program, from the plan.
#[map]
static FENTRY_POINTS: HashMap<u64, u32> = HashMap::with_max_entries(MAX_ENTRIES, 0);

/// Argument `i` of the traced function (its return value at `i` = the argument count, in
/// an fexit program). A pointer to a struct is a typed kernel pointer to the verifier.
#[inline(always)]
fn arg(ctx: *const u64, i: usize) -> u64 {
    // SAFETY: the context of a tracing program is the array of the function's arguments.
    unsafe { *ctx.add(i) }
}

/// The program the plan puts at this call, if any, and only in the observed namespace: a
/// trampoline runs for every namespace's hooks (a netfilter link, for its own only).
#[inline(always)]
fn program_at(state: *const u8, func: u8, exit: u8, priority: i32) -> Option<u32> {
    let pf = direct::<u8, { config::STATE_PF }>(state);
    let hook = direct::<u8, { config::STATE_HOOK }>(state);
    // SAFETY: a plain lookup; the value is copied out.
    let program = unsafe { FENTRY_POINTS.get(&key(pf, hook, func, exit, priority)) }.copied()?;
    in_observed_netns(state).then_some(program)
}

/// Whether the hook runs in the observed namespace: its input device's (else its output
/// device's) namespace, in direct loads (offsets from BTF, put in by the loader). No
/// device: not known to be this namespace's, left out.
#[inline(always)]
fn in_observed_netns(state: *const u8) -> bool {
    let Some(want) = cfg(config::OBSERVED_NETNS) else {
        return false;
    };
    let mut dev = direct::<*const u8, { config::STATE_IN }>(state);
    if dev.is_null() {
        dev = direct::<*const u8, { config::STATE_OUT }>(state);
    }
    if dev.is_null() {
        return false;
    }
    let net = direct::<*const u8, { config::NETDEV_NET }>(dev);
    if net.is_null() {
        return false;
    }
    u64::from(direct::<u32, { config::NET_INUM }>(net)) == want
}

/// An i32 at `base + off` (`off` left in the map at `at` by userspace), if it can be read.
#[inline(always)]
fn priority_at(base: u64, at: u64) -> Option<i32> {
    // SAFETY: a lookup, copied out.
    let off = unsafe { FENTRY_POINTS.get(&at) }.copied()? as i32;
    // SAFETY: bpf_probe_read_kernel checks the address.
    unsafe { bpf_probe_read_kernel((base as i64 + i64::from(off)) as *const i32) }.ok()
}

/// Observes as program `program` (from the map): a constant at each call of
/// `point::observe`, so that only programs 0 and 2 carry the filter's code. At an entry
/// the plan puts only a hook's first point (program 0 at PREROUTING and OUTPUT, 1
/// elsewhere).
#[inline(always)]
fn observe_entry(pointers: impl FnOnce() -> (*const u8, *const u8), program: u32) {
    match program {
        0 => point::observe(pointers, 0),
        1 => point::observe(pointers, 1),
        _ => {}
    }
}

/// As [`observe_entry`], after a table other than conntrack: any program but 0 and 2
/// (program 2 is the point after conntrack, see [`observe_after_conntrack`]).
#[inline(always)]
fn observe_exit(pointers: impl FnOnce() -> (*const u8, *const u8), program: u32) {
    if program == 1 {
        return point::observe(pointers, 1);
    }
    // 3..=23, bounded on the register the call uses, so that the verifier leaves out the
    // filter's code (programs 0 and 2) on this way.
    let m = program.wrapping_sub(3);
    if m > 20 {
        return;
    }
    point::observe(pointers, (m + 3) as u8)
}

/// After conntrack: program 2 (1 where conntrack is the hook's only table).
#[inline(always)]
fn observe_after_conntrack(pointers: impl FnOnce() -> (*const u8, *const u8), program: u32) {
    match program {
        2 => point::observe(pointers, 2),
        1 => point::observe(pointers, 1),
        _ => {}
    }
}

/// Whether a hook function's return value lets the packet through.
#[inline(always)]
fn accepted(ret: u64) -> bool {
    ret as u32 & NF_VERDICT_MASK == NF_ACCEPT
}

// nft_do_chain(struct nft_pktinfo *pkt, void *priv): pkt->skb at 0, pkt->state at 8
// (userspace checks both against BTF); priv is the base chain's `struct nft_chain`.

/// `pkt->skb`, `pkt->state`: typed pointers loaded from a typed pointer.
#[inline(always)]
fn pktinfo(pkt: *const u8) -> (*const u8, *const u8) {
    // SAFETY: the verifier checks both loads against nft_pktinfo's BTF.
    unsafe {
        (
            core::ptr::read_volatile(pkt as *const *const u8),
            core::ptr::read_volatile(pkt.wrapping_add(8) as *const *const u8),
        )
    }
}

#[inline(always)]
fn nft(ctx: *const u64, exit: u8) {
    let pkt = arg(ctx, 0) as *const u8;
    if exit == EXIT && !accepted(arg(ctx, 2)) {
        return;
    }
    let (_, state) = pktinfo(pkt);
    let Some(prio) = priority_at(arg(ctx, 1), CHAIN_PRIORITY_OFFSET) else {
        return;
    };
    let Some(program) = program_at(state, func::NFT, exit, prio) else {
        return;
    };
    if exit == EXIT {
        observe_exit(|| pktinfo(pkt).swap(), program);
    } else {
        observe_entry(|| pktinfo(pkt).swap(), program);
    }
}

/// (state, skb) from (skb, state).
trait Swap {
    fn swap(self) -> Self;
}
impl Swap for (*const u8, *const u8) {
    #[inline(always)]
    fn swap(self) -> Self {
        (self.1, self.0)
    }
}

#[unsafe(no_mangle)]
#[unsafe(link_section = "fentry/nft_do_chain")]
pub extern "C" fn obs_nft_in(ctx: *const u64) -> i32 {
    nft(ctx, ENTRY);
    0
}

#[unsafe(no_mangle)]
#[unsafe(link_section = "fexit/nft_do_chain")]
pub extern "C" fn obs_nft_out(ctx: *const u64) -> i32 {
    nft(ctx, EXIT);
    0
}

/// A function of (.., skb at `skb_i`, state at `skb_i + 1`, ..) with `nargs` arguments, at
/// one priority (`prio`), or at the one read through its argument `prio_arg` (a legacy
/// table's).
#[inline(always)]
fn plain(ctx: *const u64, f: u8, exit: u8, skb_i: usize, nargs: usize, prio_arg: Option<usize>) {
    if exit == EXIT && !accepted(arg(ctx, nargs)) {
        return;
    }
    let state = arg(ctx, skb_i + 1) as *const u8;
    let prio = match prio_arg {
        Some(i) => match priority_at(arg(ctx, i), XT_TABLE_PRIORITY_OFFSET) {
            Some(p) => p,
            None => return,
        },
        None => 0,
    };
    let Some(program) = program_at(state, f, exit, prio) else {
        return;
    };
    let pointers = || {
        (
            arg(ctx, skb_i + 1) as *const u8,
            arg(ctx, skb_i) as *const u8,
        )
    };
    if exit == ENTRY {
        observe_entry(pointers, program);
    } else if f == func::CONNTRACK {
        observe_after_conntrack(pointers, program);
    } else {
        observe_exit(pointers, program);
    }
}

// nf_nat_inet_fn(void *priv, struct sk_buff *skb, const struct nf_hook_state *state)
// The nat table: the hook functions nf_nat registers (`nf_nat_ipv4_ops`, `nf_nat_ipv6_ops`),
// not `nf_nat_inet_fn` inside them, which they skip for an ICMP error related to a
// connection (translated by `nf_nat_icmp_reply_translation` instead): every call of the nat
// table's hook is seen. `nf_nat_ipv6_fn` is IPv6 LOCAL_IN's hook and also called by the
// other IPv6 ones; its calls count at LOCAL_IN only (userspace keys it there alone).
#[unsafe(no_mangle)]
#[unsafe(link_section = "fentry/nf_nat_ipv4_pre_routing")]
pub extern "C" fn obs_nat4_pre_entry(ctx: *const u64) -> i32 {
    plain(ctx, func::NAT, ENTRY, 1, 3, None);
    0
}

#[unsafe(no_mangle)]
#[unsafe(link_section = "fexit/nf_nat_ipv4_pre_routing")]
pub extern "C" fn obs_nat4_pre_exit(ctx: *const u64) -> i32 {
    plain(ctx, func::NAT, EXIT, 1, 3, None);
    0
}

#[unsafe(no_mangle)]
#[unsafe(link_section = "fentry/nf_nat_ipv4_local_in")]
pub extern "C" fn obs_nat4_in_entry(ctx: *const u64) -> i32 {
    plain(ctx, func::NAT, ENTRY, 1, 3, None);
    0
}

#[unsafe(no_mangle)]
#[unsafe(link_section = "fexit/nf_nat_ipv4_local_in")]
pub extern "C" fn obs_nat4_in_exit(ctx: *const u64) -> i32 {
    plain(ctx, func::NAT, EXIT, 1, 3, None);
    0
}

#[unsafe(no_mangle)]
#[unsafe(link_section = "fentry/nf_nat_ipv4_local_fn")]
pub extern "C" fn obs_nat4_local_entry(ctx: *const u64) -> i32 {
    plain(ctx, func::NAT, ENTRY, 1, 3, None);
    0
}

#[unsafe(no_mangle)]
#[unsafe(link_section = "fexit/nf_nat_ipv4_local_fn")]
pub extern "C" fn obs_nat4_local_exit(ctx: *const u64) -> i32 {
    plain(ctx, func::NAT, EXIT, 1, 3, None);
    0
}

#[unsafe(no_mangle)]
#[unsafe(link_section = "fentry/nf_nat_ipv4_out")]
pub extern "C" fn obs_nat4_out_entry(ctx: *const u64) -> i32 {
    plain(ctx, func::NAT, ENTRY, 1, 3, None);
    0
}

#[unsafe(no_mangle)]
#[unsafe(link_section = "fexit/nf_nat_ipv4_out")]
pub extern "C" fn obs_nat4_out_exit(ctx: *const u64) -> i32 {
    plain(ctx, func::NAT, EXIT, 1, 3, None);
    0
}

#[unsafe(no_mangle)]
#[unsafe(link_section = "fentry/nf_nat_ipv6_in")]
pub extern "C" fn obs_nat6_pre_entry(ctx: *const u64) -> i32 {
    plain(ctx, func::NAT, ENTRY, 1, 3, None);
    0
}

#[unsafe(no_mangle)]
#[unsafe(link_section = "fexit/nf_nat_ipv6_in")]
pub extern "C" fn obs_nat6_pre_exit(ctx: *const u64) -> i32 {
    plain(ctx, func::NAT, EXIT, 1, 3, None);
    0
}

#[unsafe(no_mangle)]
#[unsafe(link_section = "fentry/nf_nat_ipv6_fn")]
pub extern "C" fn obs_nat6_in_entry(ctx: *const u64) -> i32 {
    plain(ctx, func::NAT6_FN, ENTRY, 1, 3, None);
    0
}

#[unsafe(no_mangle)]
#[unsafe(link_section = "fexit/nf_nat_ipv6_fn")]
pub extern "C" fn obs_nat6_in_exit(ctx: *const u64) -> i32 {
    plain(ctx, func::NAT6_FN, EXIT, 1, 3, None);
    0
}

#[unsafe(no_mangle)]
#[unsafe(link_section = "fentry/nf_nat_ipv6_local_fn")]
pub extern "C" fn obs_nat6_local_entry(ctx: *const u64) -> i32 {
    plain(ctx, func::NAT, ENTRY, 1, 3, None);
    0
}

#[unsafe(no_mangle)]
#[unsafe(link_section = "fexit/nf_nat_ipv6_local_fn")]
pub extern "C" fn obs_nat6_local_exit(ctx: *const u64) -> i32 {
    plain(ctx, func::NAT, EXIT, 1, 3, None);
    0
}

#[unsafe(no_mangle)]
#[unsafe(link_section = "fentry/nf_nat_ipv6_out")]
pub extern "C" fn obs_nat6_out_entry(ctx: *const u64) -> i32 {
    plain(ctx, func::NAT, ENTRY, 1, 3, None);
    0
}

#[unsafe(no_mangle)]
#[unsafe(link_section = "fexit/nf_nat_ipv6_out")]
pub extern "C" fn obs_nat6_out_exit(ctx: *const u64) -> i32 {
    plain(ctx, func::NAT, EXIT, 1, 3, None);
    0
}

#[unsafe(no_mangle)]
#[unsafe(link_section = "fentry/nf_conntrack_in")]
pub extern "C" fn obs_ct_in(ctx: *const u64) -> i32 {
    plain(ctx, func::CONNTRACK, ENTRY, 0, 2, None);
    0
}

#[unsafe(no_mangle)]
#[unsafe(link_section = "fexit/nf_conntrack_in")]
pub extern "C" fn obs_ct_out(ctx: *const u64) -> i32 {
    plain(ctx, func::CONNTRACK, EXIT, 0, 2, None);
    0
}

// ipt_do_table(void *priv (the struct xt_table), struct sk_buff *skb, const struct nf_hook_state *state)
#[unsafe(no_mangle)]
#[unsafe(link_section = "fentry/ipt_do_table")]
pub extern "C" fn obs_ipt_in(ctx: *const u64) -> i32 {
    plain(ctx, func::IPT, ENTRY, 1, 3, Some(0));
    0
}

#[unsafe(no_mangle)]
#[unsafe(link_section = "fexit/ipt_do_table")]
pub extern "C" fn obs_ipt_out(ctx: *const u64) -> i32 {
    plain(ctx, func::IPT, EXIT, 1, 3, Some(0));
    0
}

// ip6t_do_table(void *priv (the struct xt_table), struct sk_buff *skb, const struct nf_hook_state *state)
#[unsafe(no_mangle)]
#[unsafe(link_section = "fentry/ip6t_do_table")]
pub extern "C" fn obs_ip6t_in(ctx: *const u64) -> i32 {
    plain(ctx, func::IP6T, ENTRY, 1, 3, Some(0));
    0
}

#[unsafe(no_mangle)]
#[unsafe(link_section = "fexit/ip6t_do_table")]
pub extern "C" fn obs_ip6t_out(ctx: *const u64) -> i32 {
    plain(ctx, func::IP6T, EXIT, 1, 3, Some(0));
    0
}

// ip_vs_out_hook(void *priv, struct sk_buff *skb, const struct nf_hook_state *state)
// IPVS's reply translation (FORWARD 100 for masquerade replies; keyed there only).
#[unsafe(no_mangle)]
#[unsafe(link_section = "fentry/ip_vs_out_hook")]
pub extern "C" fn obs_ipvs_out_entry(ctx: *const u64) -> i32 {
    plain(ctx, func::IPVS_OUT, ENTRY, 1, 3, None);
    0
}

#[unsafe(no_mangle)]
#[unsafe(link_section = "fexit/ip_vs_out_hook")]
pub extern "C" fn obs_ipvs_out_exit(ctx: *const u64) -> i32 {
    plain(ctx, func::IPVS_OUT, EXIT, 1, 3, None);
    0
}

#[unsafe(link_section = "license")]
#[unsafe(no_mangle)]
static LICENSE: [u8; 4] = *b"GPL\0";
