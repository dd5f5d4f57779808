//! In-flight traversals: where a packet's record lives between the probe that saw it enter
//! and the event that ends it (docs/wire-format.md).
//!
//! A forwarded or received packet runs every hook in one softirq on one CPU, so its record
//! sits in a per-CPU slot found by comparing a few skb addresses: no hashing on the hot path.
//! A packet the filter left out at TC ingress has no record, only an entry in one cache line
//! ([`LeftOut`]), which is all it costs later probes. A packet that
//! waits (a queue, a neighbour lookup) or whose slot is needed moves to the bounded
//! [`PENDING`] map, which later probes and the end events also consult. Nothing is dropped
//! silently: a record that finds no room is written as partial and counted.

use aya_ebpf::{
    helpers::bpf_probe_read_kernel_buf,
    macros::map,
    maps::{Array, HashMap, PerCpuArray},
};
use observer_common::traversal::{
    LEFT_OUT_PER_CPU, LeftOut, SLOTS_PER_CPU, Slots, TraversalRecord, below, decision, end,
    left_out, start, status,
};
use observer_common::{config, counter, hook, pending_count};

// Re-exported: the programs take it with the in-flight calls it serves.
pub use crate::verifier::opaque;
use crate::{EVENTS, cfg, count, wakeup_flags};

#[map]
pub static SLOTS: PerCpuArray<Slots> = PerCpuArray::with_max_entries(1, 0);

/// Traversals that left their CPU's slot, by skb address.
#[map]
pub static PENDING: HashMap<u64, TraversalRecord> = HashMap::with_max_entries(4096, 0);

/// How many records [`PENDING`] may hold, as words [`pending_count`] names: records put in,
/// taken out by the probes, and taken out by the collector (which writes its own word). An
/// overestimate costs a lookup; it never undercounts, because a record is counted before it
/// is put in and uncounted after it is taken out.
#[map]
pub static PENDING_COUNT: Array<u64> = Array::with_max_entries(pending_count::WORDS, 0);

/// Adds one to word `i` of [`PENDING_COUNT`], atomically (all CPUs share it).
#[inline(always)]
fn pending_add(i: u32) {
    use core::intrinsics::{AtomicOrdering, atomic_xadd};
    if let Some(p) = PENDING_COUNT.get_ptr_mut(i) {
        // SAFETY: an 8-byte aligned u64 in map memory, only ever updated atomically.
        unsafe { atomic_xadd::<u64, u64, { AtomicOrdering::Relaxed }>(p, 1) };
    }
}

#[inline(always)]
fn pending_in() {
    pending_add(pending_count::PUT);
}

#[inline(always)]
fn pending_out() {
    pending_add(pending_count::TAKEN);
}

/// Whether [`PENDING`] may hold a record: most packets end on the CPU they started on, and
/// then the fallback map is empty and a miss costs no hash lookup.
#[inline(always)]
fn pending_maybe() -> bool {
    let word = |i| match PENDING_COUNT.get(i) {
        // SAFETY: read once; a torn view only overestimates (see PENDING_COUNT).
        Some(v) => unsafe { core::ptr::read_volatile(v) },
        None => 0,
    };
    let taken = word(pending_count::TAKEN).wrapping_add(word(pending_count::COLLECTED));
    word(pending_count::PUT) != taken
}

/// Where the in-flight code tells the user's log what it could not do as it should
/// (`aya-log`, see [`Logged`]). A parameter rather than a call, so that a program that
/// takes [`Quiet`] holds no logging code at all: the netfilter programs, whose largest is
/// near the verifier's bound of a million instructions with any extra branch.
pub trait Diag {
    /// The record of `skb` was written before its end: its slot was needed and the
    /// fallback map had no room.
    fn written_early(skb: u64);
    /// The fallback map refused the record of `skb` (full, or its bucket busy).
    fn fallback_refused(skb: u64);
}

/// No diagnostics (what the events still count is all there is).
pub struct Quiet;

impl Diag for Quiet {
    #[inline(always)]
    fn written_early(_: u64) {}
    #[inline(always)]
    fn fallback_refused(_: u64) {}
}

/// Diagnostics through `aya-log` at debug level (target [`crate::LOG_TARGET`]); with the
/// level off, userspace loads `AYA_LOG_LEVEL` 0 and the verifier removes them.
pub struct Logged;

impl Diag for Logged {
    #[inline(always)]
    fn written_early(skb: u64) {
        aya_log_ebpf::debug!(
            &(),
            target: crate::LOG_TARGET,
            "record of skb {:x} written early: its slot was needed and the fallback map had no room",
            skb
        );
    }
    #[inline(always)]
    fn fallback_refused(skb: u64) {
        aya_log_ebpf::debug!(
            &(),
            target: crate::LOG_TARGET,
            "fallback map refused the record of skb {:x} (full or busy): it waits in its slot",
            skb
        );
    }
}

/// Per-CPU copy of a record taken out of [`PENDING`], written from here once it is claimed.
#[map]
pub static OUT: PerCpuArray<TraversalRecord> = PerCpuArray::with_max_entries(1, 0);

/// Where a record was found.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Place {
    Slot,
    Pending,
}

pub struct Found {
    pub rec: &'static mut TraversalRecord,
    pub place: Place,
}

/// The in-flight record of `skb`, if any.
#[inline(always)]
pub fn find(skb: u64) -> Option<Found> {
    find_slot(skb).or_else(|| find_pending(skb))
}

/// This CPU's packets left out at TC ingress (see [`LeftOut`]).
#[inline(always)]
fn left_out_entries() -> Option<&'static mut LeftOut> {
    let slots = SLOTS.get_ptr_mut(0)?;
    // SAFETY: as in `find_slot`.
    Some(unsafe { &mut (*slots).left_out })
}

/// A packet the filter left out where it entered: entry `i` of this CPU's [`LeftOut`].
pub struct LeftOutPacket {
    entries: &'static mut LeftOut,
    i: usize,
}

/// Whether `skb` is a packet this CPU follows as left out: one cache line compared, the
/// whole cost of such a packet at most probes.
#[inline(always)]
pub fn find_left_out(skb: u64) -> Option<LeftOutPacket> {
    let entries = left_out_entries()?;
    let i = opaque(entries.position(skb));
    (i < LEFT_OUT_PER_CPU).then_some(LeftOutPacket { entries, i })
}

/// Follows `skb`, left out by the filter (`how`: its decision) where it entered: counted
/// as seen now and as `how` when it ends. The oldest entry makes room (counted as ended:
/// it was left out whatever happens to it later).
#[inline(always)]
pub fn leave_out(skb: u64, how: u8) {
    let Some(entries) = left_out_entries() else {
        return;
    };
    if let Some(flags) = entries.put(skb, how) {
        count_left_out(flags);
    }
    count(counter::SEEN);
}

#[inline(always)]
fn count_left_out(flags: u8) {
    if flags & left_out::DECISION == decision::SAMPLED_OUT {
        count(counter::SAMPLED_OUT);
    } else {
        count(counter::FILTERED);
    }
}

impl LeftOutPacket {
    /// Its traversal ended (or its address came back as another packet's): counted as
    /// left out, and forgotten.
    #[inline(always)]
    pub fn end(self) {
        if let Some(flags) = self.entries.take(self.i) {
            count_left_out(flags);
        }
    }

    /// At an entry point (program 0): true the first time (the packet goes on), false when
    /// it meets one again (looped back as the same skb: another traversal, which `end`
    /// closes).
    #[inline(always)]
    pub fn enters(&mut self) -> bool {
        self.entries.enter(self.i)
    }

    /// Left out by the filter whatever the packet's own decision was (sampled out, say):
    /// no tuple of its connection can pass.
    #[inline(always)]
    pub fn filtered_out(&mut self) {
        self.entries.filter_out(self.i);
    }

    /// Its record after all (the probe after conntrack must decide again, which needs
    /// one): started now, as TC ingress would have started it, left out for now; `None`
    /// when no slot could be had (it is then counted as left out).
    #[inline(always)]
    pub fn into_record(self) -> Option<&'static mut TraversalRecord> {
        let i = self.i;
        if i >= LEFT_OUT_PER_CPU {
            return None;
        }
        let skb = self.entries.skb[below::<LEFT_OUT_PER_CPU>(i)];
        let how = self.entries.take(i)? & left_out::DECISION;
        let ts = crate::now();
        let Some(rec) = claim_slot::<Quiet>(skb, ts) else {
            count_left_out(how);
            return None;
        };
        crate::packet_bytes::capture(skb, ts);
        rec.decision = how;
        rec.nvisits = 1;
        rec.cur_visit = 0;
        rec.visits[0].hook = hook::TC_INGRESS;
        Some(rec)
    }
}

/// The record of `skb` in this CPU's slots: where a packet being handled on this CPU is.
/// The end events that fire for every packet of the machine (a socket taking it, a free)
/// look only here, so that a packet not ours costs them no hash lookup.
#[inline(always)]
pub fn find_slot(skb: u64) -> Option<Found> {
    if let Some(slots) = SLOTS.get_ptr_mut(0) {
        // SAFETY: per-CPU value; one program runs at a time on a CPU (softirq and process
        // context exclude each other for these hooks' callers).
        let slots = unsafe { &mut *slots };
        let mut i = 0;
        while i < SLOTS_PER_CPU {
            if slots.recs[i].skb == skb {
                break;
            }
            i += 1;
        }
        let i = opaque(i);
        if i < SLOTS_PER_CPU {
            return Some(Found {
                rec: &mut slots.recs[below::<SLOTS_PER_CPU>(i)],
                place: Place::Slot,
            });
        }
    }
    None
}

#[inline(always)]
fn find_pending(skb: u64) -> Option<Found> {
    if !pending_maybe() {
        return None;
    }
    let rec = PENDING.get_ptr_mut(&skb)?;
    Some(Found {
        // SAFETY: a map value; concurrent users are resolved by who deletes it (see finish).
        rec: unsafe { &mut *rec },
        place: Place::Pending,
    })
}

/// Starts a record for `skb` in a free slot of this CPU; the oldest slot's traversal moves
/// to [`PENDING`] (or is written as partial when that is full) to make room. The clock is
/// read here, where the record moves to [`PENDING`], and where it is written: not at
/// every point (a read costs a probe more than its comparisons).
#[inline(always)]
pub fn begin<D: Diag>(skb: u64) -> Option<&'static mut TraversalRecord> {
    let ts = crate::now();
    let rec = claim_slot::<D>(skb, ts)?;
    count(counter::SEEN);
    crate::packet_bytes::capture(skb, ts);
    Some(rec)
}

/// A slot for a record of `skb`, started at `ts` (see [`begin`]).
#[inline(always)]
fn claim_slot<D: Diag>(skb: u64, ts: u64) -> Option<&'static mut TraversalRecord> {
    let slots = SLOTS.get_ptr_mut(0)?;
    // SAFETY: as in `find`.
    let slots = unsafe { &mut *slots };
    let mut pick = 0;
    let mut oldest = u64::MAX;
    let mut i = 0;
    while i < SLOTS_PER_CPU {
        let r = &slots.recs[i];
        if r.skb == 0 {
            pick = i;
            break;
        }
        if r.ts_last < oldest {
            oldest = r.ts_last;
            pick = i;
        }
        i += 1;
    }
    let rec = observer_common::traversal::get_mut(&mut slots.recs, opaque(pick))?;
    if rec.skb != 0 {
        evict::<D>(rec);
    }
    start(rec, skb, ts, cfg(config::PLAN_GEN).unwrap_or(0) as u8);
    Some(rec)
}

/// Moves a slot's traversal out of the way: to [`PENDING`], else written as partial.
#[inline(always)]
fn evict<D: Diag>(rec: &mut TraversalRecord) {
    if rec.status & status::SOCKET != 0 {
        // A socket had it; the map had no room to wait for its end.
        finish_slot(rec, end::DELIVERED);
        return;
    }
    if rec.decision == decision::KEEP {
        // BPF_NOEXIST: an older record of the same skb address in the map is stale; keep
        // it and write this one.
        if to_pending(rec, 1) {
            return;
        }
        count(counter::RECLAIMED);
        D::written_early(rec.skb);
        finish_slot(rec, end::RECLAIMED);
        return;
    }
    // A packet the filter left out needs no record; it is counted as such now.
    finish_slot(rec, end::NONE);
}

/// Ends the traversal of `f` with `how` (one of [`end`]): writes it if the filter kept it,
/// counts it either way, and frees its place.
#[inline(always)]
pub fn finish(f: Found, how: u8) {
    match f.place {
        Place::Slot => finish_slot(f.rec, how),
        Place::Pending => finish_pending(f.rec, how),
    }
}

#[inline(always)]
fn finish_slot(rec: &mut TraversalRecord, how: u8) {
    rec.end = how;
    write(rec);
    rec.skb = 0;
}

/// A [`PENDING`] record may be ended by two CPUs at once (a socket on one, a free on the
/// other): each copies it, and only the one whose delete succeeds writes its copy.
#[inline(always)]
fn finish_pending(rec: &mut TraversalRecord, how: u8) {
    let skb = rec.skb;
    let Some(out) = OUT.get_ptr_mut(0) else {
        return;
    };
    // SAFETY: per-CPU scratch value of the same type and size.
    let out = unsafe { &mut *out };
    // One helper call copies the record; field by field would be hundreds of instructions.
    // SAFETY: both are valid map values of `size_of::<TraversalRecord>()` bytes.
    let copied = unsafe {
        let dst = core::slice::from_raw_parts_mut(
            out as *mut TraversalRecord as *mut u8,
            core::mem::size_of::<TraversalRecord>(),
        );
        bpf_probe_read_kernel_buf(rec as *const TraversalRecord as *const u8, dst)
    };
    if PENDING.remove(&skb).is_err() {
        // Another CPU (or the collector) ended it.
        return;
    }
    pending_out();
    if copied.is_err() {
        // Ours to write but unreadable: lost, and counted as such.
        count(counter::RINGBUF_FULL);
        return;
    }
    out.end = how;
    write(out);
}

/// Writes a finished record (or counts why it is not written), stamped with its end time.
#[inline(always)]
fn write(rec: &mut TraversalRecord) {
    match rec.decision {
        decision::KEEP => {}
        decision::SAMPLED_OUT => return count(counter::SAMPLED_OUT),
        _ => return count(counter::FILTERED),
    }
    if rec.end == end::NONE {
        return;
    }
    rec.ts_last = crate::now();
    let len = rec.written_len();
    if len > core::mem::size_of::<TraversalRecord>() {
        return;
    }
    // SAFETY: `len` bytes of the record, bounded by its size just above.
    let bytes =
        unsafe { core::slice::from_raw_parts(rec as *const TraversalRecord as *const u8, len) };
    match EVENTS.output::<[u8]>(bytes, wakeup_flags()) {
        Ok(()) => count(counter::EMITTED),
        Err(_) => count(counter::RINGBUF_FULL),
    }
}

/// A socket is taking the packet of `f`: marks it, and moves it to [`PENDING`] where its
/// end (a drop, a free, or the collector's claim) is awaited from any CPU.
#[inline(always)]
pub fn socket_took<D: Diag>(f: Found) {
    f.rec.status |= status::SOCKET;
    park::<D>(f.rec);
}

/// Moves a record from its slot to [`PENDING`], where its end is awaited from any CPU: a
/// socket has the packet, or defragmentation holds it. Records already there stay.
#[inline(always)]
pub fn park<D: Diag>(rec: &mut TraversalRecord) {
    if rec.status & status::FALLBACK != 0 || rec.decision != decision::KEEP {
        return;
    }
    // BPF_ANY: a record of the same address already there is older, hence stale (replaced,
    // it stays counted: an overestimate).
    if !to_pending(rec, 0) {
        // Busy (a program holding the same bucket on this CPU) or full: it waits in its
        // slot, where a reused address or a needed slot ends it.
        rec.status &= !status::FALLBACK;
        D::fallback_refused(rec.skb);
    }
}

/// Moves `rec` into [`PENDING`] with `flags` (`BPF_NOEXIST` 1, `BPF_ANY` 0), flagged and
/// idle from now on as far as the collector's sweep is concerned, its slot freed; false
/// (counted) when the map refused it.
#[inline(always)]
fn to_pending(rec: &mut TraversalRecord, flags: u64) -> bool {
    rec.status |= status::FALLBACK;
    rec.ts_last = crate::now();
    pending_in();
    if PENDING.insert(&rec.skb, &*rec, flags).is_ok() {
        count(counter::TO_FALLBACK);
        rec.skb = 0;
        return true;
    }
    pending_out();
    count(counter::FALLBACK_FAILED);
    false
}

/// Ends a record whose skb address has started another traversal: the old packet was
/// freed without an event we see. If a socket had it, it was delivered.
#[inline(always)]
pub fn close_stale(f: Found) {
    let how = if f.rec.status & status::SOCKET != 0 {
        end::DELIVERED
    } else {
        end::REUSED
    };
    finish(f, how);
}
