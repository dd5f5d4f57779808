//! Values the verifier must not follow: a number passed through map memory comes back
//! unknown, so the paths before it do not multiply the paths after it.

use aya_ebpf::{macros::map, maps::PerCpuArray};

/// Per-CPU scratch word through which values pass, see [`opaque`].
#[map]
static INDEX: PerCpuArray<u64> = PerCpuArray::with_max_entries(1, 0);

/// `i`, as a value the verifier does not know: stored to and read back from map memory.
/// A slot chosen by an unrolled loop is otherwise a different constant on every path, so
/// each of them makes its own copy of everything that follows (and the verifier gives up);
/// a typed kernel pointer becomes a plain number.
#[inline(always)]
pub fn opaque(i: usize) -> usize {
    match INDEX.get_ptr_mut(0) {
        // SAFETY: per-CPU word, used by one program run at a time on this CPU.
        Some(p) => unsafe {
            core::ptr::write_volatile(p, i as u64);
            core::ptr::read_volatile(p) as usize
        },
        // Never taken (index 0 of a one-entry array), but kernels before 6.18 verify this
        // path too: `i` here would keep a context pointer a pointer, and arithmetic on it
        // is refused ("math between ctx pointer and register").
        None => 0,
    }
}
