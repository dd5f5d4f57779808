//! Netfilter probes (BPF_PROG_TYPE_NETFILTER), the netfilter-link capture backend's. Each
//! slot program is attached by userspace at one or more (family, hook, priority) points
//! between the netfilter tables; what it adds to the packet's traversal record there is the
//! packet as the previous table left it ([`point::observe`], shared with any other program
//! type that has the hook's state and the skb). They always return NF_ACCEPT.
//!
//! Aya cannot load this object (it rejects `netfilter` sections), so observer's own loader
//! relocates the map references onto the TC object's maps. Keep every helper
//! `#[inline(always)]`: the loader supports no BPF-to-BPF calls.
#![no_std]
#![no_main]

use observer_ebpf::point;

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
            observe(ctx, $slot as u8);
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

/// The context's pointers are typed kernel pointers to the verifier: what the point reads
/// is loaded from them directly (`observer_ebpf::direct`).
#[inline(always)]
fn observe(ctx: *const BpfNfCtx, program: u8) {
    point::observe(
        // SAFETY: the netfilter context is `struct bpf_nf_ctx`, readable by the program.
        || unsafe { ((*ctx).state as *const u8, (*ctx).skb as *const u8) },
        program,
    );
}

#[unsafe(link_section = "license")]
#[unsafe(no_mangle)]
static LICENSE: [u8; 4] = *b"GPL\0";
