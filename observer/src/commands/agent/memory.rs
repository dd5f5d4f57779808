//! The default mode's memory (issue 20: RSS < 64 MiB on a 40,000-rule node): the live
//! ruleset and the streams' rule namer (a compiled copy of it) are what a large
//! ruleset costs, so the default mode keeps neither while nobody streams. They are built
//! when a client first streams and dropped when tracing stops; freed memory is handed back
//! to the system (glibc keeps it otherwise: tens of thousands of small allocations).

use crate::pipeline::Pipeline;

/// Returns freed heap memory to the system.
pub fn release() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only walks the allocator's own free lists.
    unsafe {
        libc::malloc_trim(0);
    }
}

/// Drops the streams' rule namer (their reports name no rule until the next one).
pub fn drop_namer(p: &mut Pipeline) {
    p.ruleset_changed(None, None);
    p.ctx.namer = None;
    release();
}
