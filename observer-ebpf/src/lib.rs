//! Maps and helpers shared by the two probe objects.
//!
//! Both objects (`observer-tc`, loaded by Aya, and `observer-nf`, loaded by observer's own
//! netfilter loader) declare the same maps by name. Only the TC object's maps are created; the
//! netfilter object's map references are pointed at those same maps when it is loaded, so every
//! probe writes into one ring buffer and one set of counters.
//!
//! [`point`] is what a netfilter probe does at one point, callable from any program type
//! that has the hook's state and the skb.
#![no_std]
// `atomic_xadd`: the BPF target has no atomic read-modify-write types, but LLVM emits BPF's
// atomic add for the intrinsic (the toolchain is a pinned nightly).
#![feature(core_intrinsics)]
// `asm!`: the direct loads of untrusted kernel memory (`read_window`) must be exactly one
// 8-byte load each, whatever the address's alignment.
#![feature(asm_experimental_arch)]
#![allow(internal_features)]

use aya_ebpf::{
    helpers::{bpf_ktime_get_ns, bpf_probe_read_kernel, bpf_probe_read_kernel_buf},
    macros::map,
    maps::{Array, PerCpuArray, RingBuf},
};
use observer_common::filter::{self, FilterInput, FilterNets, FilterProgram};
use observer_common::traversal::{Glance, copy_words, decision};
use observer_common::{
    CT_TUPLE_BYTES, CT_WINDOW_BYTES, CtInfo, PacketEvent, SKB_WINDOW_BYTES, STATE_WINDOW_BYTES,
    config, counter, flags,
};

pub mod counts;
pub mod inflight;
pub mod packet_bytes;
pub mod point;
pub mod verifier;

/// A probe's control values, kept in per-CPU map memory instead of registers.
///
/// The verifier explores every path through a program and prunes one only when its state
/// matches an explored one. A flag held in a register is a known constant on each path, so
/// every flag doubles the paths through all code after it (the filter and the in-flight
/// bookkeeping are long), and the verifier gives up. Written here and read back with
/// volatile accesses, a flag is an unknown value at each use: the paths split there and
/// merge again right after.
pub mod ctl {
    use aya_ebpf::{macros::map, maps::PerCpuArray};

    pub const MODE: usize = 0;
    pub const CONTINUES: usize = 1;
    pub const REDECIDE: usize = 2;
    pub const ENTRY: usize = 3;
    pub const READ_OK: usize = 4;
    pub const VERDICT: usize = 5;
    /// The hook of the record's current visit (255: none), and whether this probe took
    /// the headers from the record instead of reading them.
    pub const LAST_HOOK: usize = 6;
    pub const REUSE: usize = 7;
    /// Whether this probe copied the connection's tuples (else they come from the record).
    pub const TUPLES: usize = 8;
    /// Program 2 kept a packet it decided without reading its headers: read them now.
    pub const LATE: usize = 9;
    /// The filter leaves the packet's own input out (see `Decide::WithConntrack`).
    pub const SKIP_PACKET: usize = 10;
    const WORDS: usize = 16;

    #[map]
    static CTL: PerCpuArray<[u32; WORDS]> = PerCpuArray::with_max_entries(1, 0);

    #[inline(always)]
    pub fn set(i: usize, v: u32) {
        if let Some(p) = CTL.get_ptr_mut(0) {
            // SAFETY: per-CPU value, used by one program run at a time on this CPU.
            unsafe { core::ptr::write_volatile((p as *mut u32).add(i & (WORDS - 1)), v) };
        }
    }

    #[inline(always)]
    pub fn get(i: usize) -> u32 {
        match CTL.get_ptr_mut(0) {
            // SAFETY: as above.
            Some(p) => unsafe { core::ptr::read_volatile((p as *mut u32).add(i & (WORDS - 1))) },
            None => 0,
        }
    }
}

/// Probes cannot unwind; nothing in them panics (every index is checked), and the verifier
/// would reject the loop below if a path to it remained.
#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    loop {}
}

/// The `log` target of the probes' diagnostics (`aya-log`): `RUST_LOG=observer=debug`
/// shows them; when it is off, userspace loads the probes with `AYA_LOG_LEVEL` 0 and the
/// verifier drops every logging branch (a read-only global).
pub const LOG_TARGET: &str = "observer::probes";

/// All records, in one ring buffer so userspace sees one ordered stream per CPU.
#[map]
pub static EVENTS: RingBuf = RingBuf::with_byte_size(16 * 1024 * 1024, 0);

/// Kernel struct offsets, resolved from BTF by userspace ([`observer_common::config`]).
#[map]
pub static CONFIG: Array<u64> = Array::with_max_entries(config::COUNT, 0);

/// Per-CPU counters ([`observer_common::counter`]).
#[map]
pub static COUNTERS: PerCpuArray<u64> = PerCpuArray::with_max_entries(counter::COUNT, 0);

/// The compiled `--filter`/`--sample` program (one entry; all zero keeps everything).
#[map]
pub static FILTER: Array<FilterProgram> = Array::with_max_entries(1, 0);

#[map]
static FILTER_INPUTS: PerCpuArray<[FilterInput; 3]> = PerCpuArray::with_max_entries(1, 0);

/// What a probe does with the filter.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Decide {
    /// The packet enters here (TC ingress, first probe of PREROUTING or OUTPUT): decide
    /// from its addresses.
    Entry,
    /// Just after conntrack: a packet not kept yet is decided again with its connection's
    /// original and reply tuples too, so replies and NATed packets of a matching flow are
    /// kept.
    WithConntrack,
}

/// Fills `dst` with what the filter looks at in `ev`, field by field (a struct assignment
/// would become a `memcpy`/`memset` call, which the netfilter loader cannot take).
#[inline(always)]
fn fill_input(dst: &mut FilterInput, ev: &PacketEvent) {
    let p = &ev.packet;
    copy_words(&mut dst.saddr, &p.saddr);
    copy_words(&mut dst.daddr, &p.daddr);
    dst.ifindex_in = ev.header.ifindex_in;
    dst.ifindex_out = ev.header.ifindex_out;
    dst.mark = p.mark;
    dst.sport = p.sport;
    dst.dport = p.dport;
    dst.ip_version = p.ip_version;
    dst.l4proto = p.l4proto;
    dst.has_ports = u8::from(
        ev.header.flags & (flags::NO_L3 | flags::NO_L4) == 0 && matches!(p.l4proto, 6 | 17 | 132),
    );
    // SAFETY: a plain field (volatile: see above).
    unsafe {
        core::ptr::write_volatile(&mut dst._pad, 0);
        core::ptr::write_volatile(&mut dst._pad2, 0);
    }
}

/// The filter program, when `--filter` or `--sample` is in force.
#[inline(always)]
fn active_filter() -> Option<&'static FilterProgram> {
    FILTER
        .get(0)
        .filter(|prog| prog.enabled != 0 || prog.sample > 1)
}

/// Whether `--filter` or `--sample` is in force.
#[inline(always)]
pub fn filtering() -> bool {
    active_filter().is_some()
}

/// The filter's verdict on `ev` (one of [`decision`]), deciding as `how` says. Counted
/// when the traversal ends, so the counters speak of packets.
#[inline(always)]
pub fn decide(ev: &PacketEvent, how: Decide) -> u8 {
    let Some(prog) = active_filter() else {
        return decision::KEEP;
    };
    // The inputs do not fit the stack beside the caller's: per-CPU scratch.
    let Some(inputs) = FILTER_INPUTS.get_ptr_mut(0) else {
        return decision::FILTERED_OUT;
    };
    // SAFETY: per-CPU value, used by one program run at a time on this CPU.
    let inputs = unsafe { &mut *inputs };
    match how {
        Decide::Entry => {
            fill_input(&mut inputs[0], ev);
            let input = &inputs[0];
            verdict_of(
                filter::eval(prog, input),
                filter::sample_keep(prog, filter::flow_hash(input)),
            )
        }
        Decide::WithConntrack => {
            fill_input(&mut inputs[0], ev);
            fill_input(&mut inputs[1], ev);
            fill_input(&mut inputs[2], ev);
            let mut n = 1;
            if ev.header.flags & flags::CT != 0 {
                tuple_into(&ev.ct.orig, &mut inputs[1]);
                tuple_into(&ev.ct.reply, &mut inputs[2]);
                n = 3;
            }
            // Sample by the original tuple: a connection's packets, both ways and before
            // and after NAT, are kept or left out together.
            // A packet decided at entry and not read again (`ctl::SKIP_PACKET`): from its
            // connection's tuples alone; there, before any NAT, its addresses are one of them.
            let first = (ctl::get(ctl::SKIP_PACKET) & 1) as usize;
            if first == 1 {
                // Its headers were not read: protocol and IP version from the connection.
                let proto = cfg(config::TUPLE_PROTO).map_or(0, |o| (o as usize).min(47));
                let l4proto = ev.ct.orig.get(proto).copied().unwrap_or(0);
                let version = match ev.header.family {
                    observer_common::family::IPV4 => 4,
                    observer_common::family::IPV6 => 6,
                    _ => 0,
                };
                let mut k = 1;
                while k < 3 {
                    inputs[k].l4proto = l4proto;
                    inputs[k].ip_version = version;
                    inputs[k].has_ports = u8::from(matches!(l4proto, 6 | 17 | 132));
                    k += 1;
                }
            }
            let hashed = if n == 3 { &inputs[1] } else { &inputs[0] };
            verdict_of(
                filter::eval_any_from(prog, inputs, first, n),
                filter::sample_keep(prog, filter::flow_hash(hashed)),
            )
        }
    }
}

/// Networks outside which `--filter` matches nothing ([`FilterNets`]), written beside it.
#[map]
pub static FILTER_NETS: Array<FilterNets> = Array::with_max_entries(1, 0);

/// The filter's networks, when there is such a list (a filter is in force and every term
/// needs an address in one of them).
#[inline(always)]
pub fn filter_nets() -> Option<&'static FilterNets> {
    FILTER_NETS.get(0).filter(|nets| nets.n != 0)
}

/// Whether the connection in the conntrack window `win` (read at struct offset `start`)
/// has an address in one of `nets` in either tuple: if not, no tuple of it can pass the
/// filter, and a packet decided again from them alone ([`Decide::WithConntrack`] without
/// its headers) stays left out. `None` when the tuples' layout is not one this takes
/// (the caller then decides the long way).
#[inline(always)]
pub fn conntrack_may_match(
    nets: &FilterNets,
    win: &[u8; CT_WINDOW_BYTES],
    start: u64,
) -> Option<bool> {
    let at = |slot| cfg(slot).map(|v| v as usize);
    let start = start as usize;
    let orig = at(config::CT_TUPLE_ORIG)?.checked_sub(start)?;
    let reply = at(config::CT_TUPLE_REPLY)?.checked_sub(start)?;
    let (sa, da) = (at(config::TUPLE_SRC_ADDR)?, at(config::TUPLE_DST_ADDR)?);
    // What `read_ct` copies whole, and aligned address words.
    if orig + CT_TUPLE_BYTES > CT_WINDOW_BYTES
        || reply + CT_TUPLE_BYTES > CT_WINDOW_BYTES
        || sa > CT_TUPLE_BYTES - 16
        || da > CT_TUPLE_BYTES - 16
        || (orig | reply | sa | da) & 3 != 0
    {
        return None;
    }
    let addr = |off: usize| {
        [
            win_word(win, off),
            win_word(win, off + 4),
            win_word(win, off + 8),
            win_word(win, off + 12),
        ]
    };
    let any = nets.holds(&addr(orig + sa))
        || nets.holds(&addr(orig + da))
        || nets.holds(&addr(reply + sa))
        || nets.holds(&addr(reply + da));
    Some(any)
}

/// [`conntrack_may_match`] where the kernel lets the probes load the entry `conn` directly
/// ([`direct_reads`]): its four addresses, two loads each, and no
/// window. `None` elsewhere (or without the offsets): the caller reads the window.
#[inline(always)]
pub fn conntrack_addresses_may_match(nets: &FilterNets, conn: u64) -> Option<bool> {
    if !direct_reads() {
        return None;
    }
    let (orig, reply) = (cfg(config::CT_TUPLE_ORIG)?, cfg(config::CT_TUPLE_REPLY)?);
    let (sa, da) = (cfg(config::TUPLE_SRC_ADDR)?, cfg(config::TUPLE_DST_ADDR)?);
    let addr = |off: u64| {
        let p = untrusted(conn + off);
        let (lo, hi) = (load_u64(p), load_u64(p + 8));
        // The address's bytes as native-endian words (little-endian: low half first).
        [lo as u32, (lo >> 32) as u32, hi as u32, (hi >> 32) as u32]
    };
    Some(
        nets.holds(&addr(orig + sa))
            || nets.holds(&addr(orig + da))
            || nets.holds(&addr(reply + sa))
            || nets.holds(&addr(reply + da)),
    )
}

/// The aligned word at `at` (a multiple of 4) of a window, in one load.
#[inline(always)]
fn win_word(win: &[u8; CT_WINDOW_BYTES], at: usize) -> u32 {
    // Hidden from the compiler, so that it keeps the clamp (see `window_bytes`).
    let at = core::hint::black_box(at);
    let at = at.min(CT_WINDOW_BYTES - 4) & !3;
    // SAFETY: inside the window (clamped above); `Windows` is 8-byte aligned and the
    // conntrack window starts at a multiple of 8 in it, so the word is aligned.
    unsafe { (win.as_ptr().add(at) as *const u32).read() }
}

#[inline(always)]
fn verdict_of(matched: bool, sampled: bool) -> u8 {
    match (matched, sampled) {
        (false, _) => decision::FILTERED_OUT,
        (true, true) => decision::KEEP,
        (true, false) => decision::SAMPLED_OUT,
    }
}

/// Overwrites addresses and ports of `input` with a raw conntrack tuple's.
#[inline(always)]
fn tuple_into(raw: &[u8; CT_TUPLE_BYTES], input: &mut FilterInput) -> bool {
    let (Some(sa), Some(sp), Some(da), Some(dp)) = (
        cfg(config::TUPLE_SRC_ADDR),
        cfg(config::TUPLE_SRC_PORT),
        cfg(config::TUPLE_DST_ADDR),
        cfg(config::TUPLE_DST_PORT),
    ) else {
        return false;
    };
    // Clamped so that every access stays inside the tuple; `get` keeps panics out.
    let (sa, sp, da, dp) = (
        (sa as usize).min(32),
        (sp as usize).min(46),
        (da as usize).min(32),
        (dp as usize).min(46),
    );
    let byte = |i: usize| raw.get(i).copied().unwrap_or(0);
    let mut i = 0;
    while i < 16 {
        input.saddr[i] = byte(sa + i);
        input.daddr[i] = byte(da + i);
        i += 1;
    }
    input.sport = u16::from_be_bytes([byte(sp), byte(sp + 1)]);
    input.dport = u16::from_be_bytes([byte(dp), byte(dp + 1)]);
    true
}

/// Per-CPU scratch record: a `PacketEvent` does not fit the 512-byte BPF stack next to the
/// buffers used to fill it.
#[map]
pub static SCRATCH: PerCpuArray<PacketEvent> = PerCpuArray::with_max_entries(1, 0);

/// The zeroed scratch record of this CPU.
#[inline(always)]
pub fn scratch() -> Option<&'static mut PacketEvent> {
    let ev = SCRATCH.get_ptr_mut(0)?;
    // Zero word by word with volatile stores: a plain assignment becomes a `memset` call,
    // and the netfilter loader supports no BPF-to-BPF calls.
    let words = ev as *mut u64;
    let mut i = 0;
    while i < core::mem::size_of::<PacketEvent>() / 8 {
        // SAFETY: PacketEvent is 8-byte aligned and a multiple of 8 bytes long.
        unsafe { core::ptr::write_volatile(words.add(i), 0) };
        i += 1;
    }
    // SAFETY: per-CPU slot, used by one program run at a time on this CPU.
    Some(unsafe { &mut *ev })
}

/// Increments a per-CPU counter and returns its new value (0 if the map is unavailable).
#[inline(always)]
pub fn bump(index: u32) -> u64 {
    match COUNTERS.get_ptr_mut(index) {
        Some(c) => {
            // SAFETY: per-CPU slot, no concurrent writer on this CPU while the program runs.
            unsafe {
                *c += 1;
                *c
            }
        }
        None => 0,
    }
}

#[inline(always)]
pub fn count(index: u32) {
    if let Some(c) = COUNTERS.get_ptr_mut(index) {
        // SAFETY: per-CPU slot, no concurrent writer on this CPU while the program runs.
        unsafe { *c += 1 };
    }
}

/// Reads one config slot; `None` when unset.
#[inline(always)]
pub fn cfg(index: u32) -> Option<u64> {
    match CONFIG.get(index) {
        Some(&v) if v != config::UNSET => Some(v),
        _ => None,
    }
}

/// Loads field `SLOT` (a [`config`] slot, see [`observer_common::direct`]) of the kernel
/// struct `base` points to, with one instruction. `base` must be a typed kernel pointer the
/// verifier knows (a netfilter context's state or skb, or a device pointer loaded from the
/// state): the loader puts the BTF offset in place of the placeholder, and the verifier
/// checks the load against BTF (a fault, such as a null device, reads zero).
#[inline(always)]
pub fn direct<T: Copy, const SLOT: u32>(base: *const u8) -> T {
    // SAFETY: volatile, so that the compiler keeps one load at exactly this offset (the
    // loader rewrites it); the kernel checks and guards the access.
    unsafe {
        core::ptr::read_volatile(
            base.wrapping_add(observer_common::direct::placeholder(SLOT)) as *const T,
        )
    }
}

/// Reads a `T` at `base + off` from kernel memory.
#[inline(always)]
pub fn read<T>(base: u64, off: u64) -> Result<T, ()> {
    // SAFETY: bpf_probe_read_kernel validates the address; failure is returned, not faulted.
    unsafe { bpf_probe_read_kernel((base + off) as *const T) }.map_err(|_| {
        count(counter::READ_FAILED);
    })
}

/// The 8-byte word at `base + off` of kernel memory: one load where [`direct_reads`], else
/// [`read`].
#[inline(always)]
pub fn read_word(base: u64, off: u64) -> Result<u64, ()> {
    if !direct_reads() {
        return read::<u64>(base, off);
    }
    Ok(load_u64(untrusted(base + off)))
}

/// Copies `dst.len()` bytes at `base + off` from kernel memory into `dst`.
#[inline(always)]
pub fn read_into(base: u64, off: u64, dst: &mut [u8]) -> Result<(), ()> {
    // SAFETY: as for `read`.
    unsafe { bpf_probe_read_kernel_buf((base + off) as *const u8, dst) }.map_err(|_| {
        count(counter::READ_FAILED);
    })
}

/// Whether the running kernel lets this program load kernel memory directly (see
/// [`observer_common::kfunc`]): the call is a placeholder that observer rewrites in both
/// objects before they are loaded.
#[inline(always)]
pub fn direct_reads() -> bool {
    // SAFETY: the loader turns this call into `r0 = 0` or `r0 = 1`.
    unsafe {
        let f: unsafe extern "C" fn() -> u64 =
            core::mem::transmute(observer_common::kfunc::DIRECT_READS as usize);
        f() != 0
    }
}

/// Copies `dst.len()` bytes (a multiple of 8) at `base + off` from kernel memory into `dst`
/// (8-byte aligned): with one load per word where the kernel allows it
/// ([`observer_common::kfunc`]), else with `bpf_probe_read_kernel`.
/// A direct load the kernel cannot complete reads zero; these windows are parts of a
/// conntrack entry or of the packet an skb holds, which stay valid while a probe runs.
#[inline(always)]
pub fn read_window(base: u64, off: u64, dst: &mut [u8]) -> Result<(), ()> {
    if !direct_reads() {
        return read_into(base, off, dst);
    }
    // Memory the verifier lets the program load from (faults are caught by the kernel
    // and read zero).
    load_words(untrusted(base + off), dst);
    Ok(())
}

/// Copies `dst.len() / 8` words of a packet's linear data at `p` into `dst` (8-byte
/// aligned), one load each: `p` is a packet pointer of a TC program whose caller checked
/// `dst.len()` bytes from it against the data's end (the verifier holds it to that, and on
/// machines with efficient unaligned loads takes any alignment). No helper call.
#[inline(always)]
pub fn packet_words(p: usize, dst: &mut [u8]) {
    load_words(p as u64, dst);
}

/// Loads `dst.len() / 8` words from `p` ([`untrusted`] memory) into `dst` (8-byte aligned).
#[inline(always)]
fn load_words(p: u64, dst: &mut [u8]) {
    debug_assert!((dst.as_ptr() as usize).is_multiple_of(8));
    let words = dst.as_mut_ptr() as *mut u64;
    let mut i = 0;
    while i < dst.len() / 8 {
        let v = load_u64(p + 8 * i as u64);
        // SAFETY: in bounds (i < len / 8); `dst` is 8-byte aligned (the callers' are).
        unsafe { words.add(i).write_volatile(v) };
        i += 1;
    }
}

/// Memory at `addr` as the verifier lets a program load from it (see [`read_window`]).
#[inline(always)]
fn untrusted(addr: u64) -> u64 {
    // SAFETY: observer rewrites this call into the kfunc `bpf_rdonly_cast(addr, 0)`.
    unsafe {
        let f: unsafe extern "C" fn(u64, u32) -> u64 =
            core::mem::transmute(observer_common::kfunc::UNTRUSTED as usize);
        f(addr, 0)
    }
}

/// A load of one `$t` from `p`, memory [`untrusted`] returned: exactly one instruction
/// (`asm!`, whatever the address's alignment), which the verifier checks and the kernel
/// guards (a fault reads zero).
macro_rules! one_load {
    ($name:ident, $t:ty, $insn:literal) => {
        #[inline(always)]
        fn $name(p: u64) -> $t {
            let v: $t;
            // SAFETY: as above; nothing is written.
            unsafe {
                core::arch::asm!(
                    $insn,
                    out(reg) v,
                    in(reg) p,
                    options(nostack, readonly, preserves_flags)
                );
            }
            v
        }
    };
}

one_load!(load_u64, u64, "{0} = *(u64 *)({1} + 0)");
one_load!(load_u32, u32, "{0} = *(u32 *)({1} + 0)");

/// One 8-byte load from kernel memory at `p` (the caller checked [`direct_reads`]; a
/// fault reads zero).
#[inline(always)]
pub fn load_u64_untrusted(p: u64) -> u64 {
    load_u64(untrusted(p))
}

/// A conntrack entry's mark and the low word of its status, loaded directly where
/// [`direct_reads`] (`None` elsewhere, or without the offsets).
#[inline(always)]
pub fn ct_state(conn: u64) -> Option<(u32, u32)> {
    if !direct_reads() {
        return None;
    }
    let (mark, status) = load_ct_state(conn)?;
    Some((mark, status as u32))
}

/// A packet at `hook` as the short ways glance at it: its mark and length, and the state of
/// its conntrack entry (`nfct`, the skb's `_nfct`: pointer and ctinfo) loaded directly.
/// `None` where the entry's state would cost helper calls (kernels before 6.16) or its
/// offsets are unknown.
#[inline(always)]
pub fn glance(hook: u8, mark: u32, len: u32, nfct: u64) -> Option<Glance> {
    let entry = entry_of(nfct);
    let (ct_mark, ct_status) = match entry {
        Some(conn) => ct_state(conn)?,
        None => (0, 0),
    };
    let ct = entry.is_some();
    Some(Glance {
        hook,
        mark,
        len,
        ct,
        ctinfo: if ct { (nfct & 7) as u8 } else { 0 },
        ct_mark,
        ct_status,
    })
}

/// A conntrack entry's mark and whole status, two loads (the caller checked
/// [`direct_reads`]); `None` without the offsets.
#[inline(always)]
fn load_ct_state(conn: u64) -> Option<(u32, u64)> {
    let (mark_off, status_off) = (cfg(config::CT_MARK)?, cfg(config::CT_STATUS)?);
    Some((
        load_u32(untrusted(conn + mark_off)),
        load_u64(untrusted(conn + status_off)),
    ))
}

pub use observer_common::parse::{
    PacketReader, is_icmp_error, parse_headers, parse_inner, parse_inner_ports, parse_l3, parse_l4,
    skip_ipv6_ext,
};

/// Per-CPU buffers for the struct windows a probe reads in one `bpf_probe_read_kernel`
/// each, instead of one call per field (the calls dominate a probe's cost). Aligned, so
/// that words of a window can be loaded whole.
#[repr(C, align(8))]
pub struct Windows {
    pub state: [u8; STATE_WINDOW_BYTES],
    pub skb: [u8; SKB_WINDOW_BYTES],
    pub ct: [u8; CT_WINDOW_BYTES],
    /// The IP header and what follows it.
    pub pkt: [u8; PKT_WINDOW_BYTES],
}

/// An IP header (20 or 40 bytes) and the first 16 bytes after it.
pub const PKT_WINDOW_BYTES: usize = 64;

/// A packet from its network header (`l3`, a kernel address): its first bytes as read
/// into `win`, the rest read when asked.
pub struct KernelWindow<'a> {
    pub l3: u64,
    pub win: &'a [u8; PKT_WINDOW_BYTES],
}

impl PacketReader for KernelWindow<'_> {
    #[inline(always)]
    fn bytes<const N: usize>(&self, off: usize) -> Option<[u8; N]> {
        if off + N > PKT_WINDOW_BYTES {
            // IPv4 options or extension headers push it beyond the first read.
            return read::<[u8; N]>(self.l3, off as u64).ok();
        }
        Some(window_bytes(self.win, off))
    }
}

/// `N` bytes at `off` of a packet window, for a caller that checked `off + N` fits it.
#[inline(always)]
pub fn window_bytes<const N: usize>(win: &[u8; PKT_WINDOW_BYTES], off: usize) -> [u8; N] {
    let mut out = [0u8; N];
    // Hidden from the compiler: it forgets the caller's check, so it keeps the mask below
    // (else it drops it, and verifiers before 6.13 cannot bound the index from that check
    // alone).
    let off = core::hint::black_box(off);
    let mut i = 0;
    while i < N {
        // Masked: an index the verifier can bound whatever the compiler did to the
        // caller's check (which keeps it inside the window).
        out[i] = win[(off + i) & (PKT_WINDOW_BYTES - 1)];
        i += 1;
    }
    out
}

const _: () = assert!(core::mem::offset_of!(Windows, ct) % 8 == 0);

/// Reads the IP and transport headers of the packet whose network header is at `l3` (a
/// kernel address) into `ev`: the header and the first 16 bytes after a 20/40-byte one in
/// one read, the rest (options, extension headers) read when the parser asks.
#[inline(always)]
pub fn read_l3(l3: u64, w: &mut Windows, ev: &mut PacketEvent) -> Result<(), ()> {
    read_window(l3, 0, &mut w.pkt)?;
    let hdr: &[u8; 40] = w.pkt[..40].try_into().map_err(|_| ())?;
    parse_headers(&KernelWindow { l3, win: &w.pkt }, hdr, ev).ok_or(())
}

#[map]
pub static WINDOWS: PerCpuArray<Windows> = PerCpuArray::with_max_entries(1, 0);

#[inline(always)]
pub fn windows() -> Option<&'static mut Windows> {
    // SAFETY: per-CPU slot, used by one program run at a time on this CPU.
    WINDOWS.get_ptr_mut(0).map(|w| unsafe { &mut *w })
}

/// `N` bytes of field `off` (a struct offset) from a window read at struct offset `start`.
#[inline(always)]
pub fn field<const N: usize>(win: &[u8], off: u64, start: u64) -> Result<[u8; N], ()> {
    let mut out = [0u8; N];
    copy_field(win, off, start, &mut out)?;
    Ok(out)
}

/// Like [`field`], copying straight into `dst` (no stack temporary).
#[inline(always)]
pub fn copy_field<const N: usize>(
    win: &[u8],
    off: u64,
    start: u64,
    dst: &mut [u8; N],
) -> Result<(), ()> {
    let rel = off.wrapping_sub(start) as usize;
    let bytes = win.get(rel..rel + N).ok_or(())?;
    let mut i = 0;
    while i < N {
        dst[i] = bytes[i];
        i += 1;
    }
    Ok(())
}

/// Reads the `sk_buff` window of `skb`: mark, len, head, network_header and _nfct.
#[inline(always)]
pub fn read_skb_window(skb: u64, w: &mut Windows) -> Result<u64, ()> {
    let start = cfg(config::SKB_WINDOW).ok_or(())?;
    read_window(skb, start, &mut w.skb)?;
    Ok(start)
}

/// The conntrack entry an skb's `_nfct` points to: `None` without one (a zero pointer: no
/// entry yet, before conntrack's hook) or with the untracked marker (info 7,
/// `IP_CT_UNTRACKED`). The low three bits are its `enum ip_conntrack_info`.
#[inline(always)]
pub fn entry_of(nfct: u64) -> Option<u64> {
    let conn = nfct & !7;
    (conn != 0 && nfct & 7 != 7).then_some(conn)
}

/// Copies the conntrack entry `nfct` (the skb's `_nfct`) into `ct`, its tuples only when
/// `tuples` (they change only where conntrack or NAT runs). Returns false when the skb
/// carries none (or the untracked marker).
#[inline(always)]
pub fn read_ct(nfct: u64, ct: &mut CtInfo, w: &mut Windows, tuples: bool) -> Result<bool, ()> {
    let Some(conn) = entry_of(nfct) else {
        return Ok(false);
    };
    ct.ctinfo = (nfct & 7) as u32;
    let off = |i| cfg(i).ok_or(());
    if direct_reads() {
        // Each field loaded where it lies: no window, no copying out of it.
        (ct.mark, ct.status) = load_ct_state(conn).ok_or(())?;
        if tuples {
            load_words(untrusted(conn + off(config::CT_TUPLE_ORIG)?), &mut ct.orig);
            load_words(
                untrusted(conn + off(config::CT_TUPLE_REPLY)?),
                &mut ct.reply,
            );
        }
        return Ok(true);
    }
    let start = cfg(config::CT_WINDOW).ok_or(())?;
    read_window(conn, start, &mut w.ct)?;
    ct.mark = u32::from_ne_bytes(field(&w.ct, off(config::CT_MARK)?, start)?);
    ct.status = u64::from_ne_bytes(field(&w.ct, off(config::CT_STATUS)?, start)?);
    if tuples {
        copy_field(&w.ct, off(config::CT_TUPLE_ORIG)?, start, &mut ct.orig)?;
        copy_field(&w.ct, off(config::CT_TUPLE_REPLY)?, start, &mut ct.reply)?;
    }
    Ok(true)
}

/// The skb's `_nfct` from its window.
#[inline(always)]
pub fn nfct_of(w: &Windows, start: u64) -> Result<u64, ()> {
    let off = cfg(config::SKB_NFCT).ok_or(())?;
    Ok(u64::from_ne_bytes(field(&w.skb, off, start)?))
}

const BPF_RB_NO_WAKEUP: u64 = 1;
const BPF_RB_FORCE_WAKEUP: u64 = 2;
const BPF_RB_AVAIL_DATA: u64 = 0;
/// An eighth of the ring buffer: wake the reader well before it overflows.
const WAKEUP_BYTES: u64 = 2 * 1024 * 1024;

/// Wake-up flags for the next ring-buffer write. Waking the reader for every record costs
/// more than the record itself at high packet rates, and so does reading the reader's
/// position (a cache line it writes): userspace drains on a short timer, and every 64th
/// record per CPU checks whether the buffer is filling up fast enough to wake it early.
#[inline(always)]
pub fn wakeup_flags() -> u64 {
    if bump(counter::EMIT_SEQ) & 63 == 0 && EVENTS.query(BPF_RB_AVAIL_DATA) > WAKEUP_BYTES {
        BPF_RB_FORCE_WAKEUP
    } else {
        BPF_RB_NO_WAKEUP
    }
}

#[inline(always)]
pub fn now() -> u64 {
    // SAFETY: no preconditions.
    unsafe { bpf_ktime_get_ns() }
}
