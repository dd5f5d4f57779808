//! `tail --pcapng`: where a traversal starts, its packet's first bytes (from the network
//! header) go to their own ring buffer, [`PACKETS`], identified as the traversal is (skb
//! address and start time). Nothing is done unless userspace sets
//! `config::CAPTURE_BYTES`: then a config lookup is the whole cost. Bytes that cannot be
//! written whole (ring buffer full, unreadable skb) are counted in [`PACKETS_LOST`], never
//! dropped silently. Everything is `#[inline(always)]`: the netfilter loader supports no
//! BPF-to-BPF calls.

use aya_ebpf::{
    helpers::bpf_probe_read_kernel_buf,
    macros::map,
    maps::{PerCpuArray, RingBuf},
};
use observer_common::config;
use observer_common::packet_bytes::PacketBytes;

use crate::{cfg, read};

/// Packet bytes, one [`PacketBytes`] per traversal started (160 bytes each).
#[map]
pub static PACKETS: RingBuf = RingBuf::with_byte_size(4 * 1024 * 1024, 0);

/// Per-CPU count of packets whose bytes were not written (ring buffer full or unreadable).
#[map]
pub static PACKETS_LOST: PerCpuArray<u64> = PerCpuArray::with_max_entries(1, 0);

#[inline(always)]
fn lost() {
    if let Some(c) = PACKETS_LOST.get_ptr_mut(0) {
        // SAFETY: per-CPU slot, no concurrent writer on this CPU while the program runs.
        unsafe { *c += 1 };
    }
}

/// Writes the first bytes of `skb`, whose traversal starts at `ts`, when asked to.
#[inline(always)]
pub fn capture(skb: u64, ts: u64) {
    if !cfg(config::CAPTURE_BYTES).is_some_and(|on| on != 0) {
        return;
    }
    let Some(mut entry) = PACKETS.reserve::<PacketBytes>(0) else {
        lost();
        return;
    };
    // At TC, `skb` is the program's context pointer (the kernel's sk_buff): as a plain
    // number the verifier lets it be read from at BTF offsets.
    let skb = crate::verifier::opaque(skb as usize) as u64;
    let p = entry.as_mut_ptr();
    // SAFETY: `p` is ring-buffer memory of `size_of::<PacketBytes>()` bytes, ours until
    // submitted; fields are written one by one (a struct store becomes a memcpy call).
    let ok = unsafe { fill(&mut *p, skb, ts) };
    if ok.is_ok() {
        entry.submit(0);
    } else {
        entry.discard(0);
        lost();
    }
}

/// Fills `out` from the skb: its length, the linear bytes from the network header on,
/// and the first [`PACKET_BYTES`] of them.
#[inline(always)]
fn fill(out: &mut PacketBytes, skb: u64, ts: u64) -> Result<(), ()> {
    let off = |i| cfg(i).ok_or(());
    // Typed reads, no stack buffers: zeroing one becomes a `memset` call, which the
    // netfilter loader cannot take. (The padding is left as the ring buffer has it.)
    let head = read::<u64>(skb, off(config::SKB_HEAD)?)?;
    let nh = read::<u16>(skb, off(config::SKB_NETWORK_HEADER)?)?;
    let tail = read::<u32>(skb, off(config::SKB_TAIL)?)?;
    out.skb_len = read::<u32>(skb, off(config::SKB_LEN)?)?;
    out.kind = observer_common::kind::PACKET_BYTES;
    out.linear = tail.wrapping_sub(u32::from(nh));
    out.skb = skb;
    out.ts_first = ts;
    // A fixed-size read (the verifier takes no length that might be zero): past the
    // linear data it reads the rest of the skb's buffer, which userspace leaves out.
    let at = head + u64::from(nh);
    // SAFETY: bpf_probe_read_kernel validates the address (failure is returned); `data`
    // is PACKET_BYTES bytes of ring-buffer memory.
    unsafe { bpf_probe_read_kernel_buf(at as *const u8, &mut out.data) }.map_err(|_| ())?;
    Ok(())
}
