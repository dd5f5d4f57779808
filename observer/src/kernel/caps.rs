//! Giving up `CAP_SYS_ADMIN` for good once it has served. The agent needs it for one system
//! call: `setns` into the node's network namespace at start (`agent --node-netns`), after its
//! listeners are bound in the pod's own. Then it is dropped from the permitted, effective and
//! inheritable sets, and `no_new_privs` keeps an `execve` (iptables-save, nft, ip) from
//! getting it back from the bounding set as root. Capabilities are per thread: this runs
//! while the process has one thread, so every thread started later inherits the result.

use std::io;

/// `CAP_SYS_ADMIN` (linux/capability.h).
const CAP_SYS_ADMIN: u32 = 21;
/// `_LINUX_CAPABILITY_VERSION_3`: two 32-bit words per set.
const CAPABILITY_VERSION_3: u32 = 0x2008_0522;

#[repr(C)]
struct Header {
    version: u32,
    pid: libc::c_int,
}

#[repr(C)]
#[derive(Clone, Copy, Default)]
struct Data {
    effective: u32,
    permitted: u32,
    inheritable: u32,
}

#[derive(Debug, thiserror::Error)]
pub enum CapsError {
    #[error(
        "the process has {0} threads: CAP_SYS_ADMIN would stay with the others (a bug: \
         drop it before the runtime starts)"
    )]
    Threads(usize),
    #[error("reading the capabilities (capget): {0}")]
    Get(io::Error),
    #[error("dropping CAP_SYS_ADMIN (capset): {0}")]
    Set(io::Error),
    #[error("setting no_new_privs (prctl): {0}")]
    NoNewPrivs(io::Error),
}

/// The threads of this process (`/proc/self/task`).
pub fn threads() -> usize {
    std::fs::read_dir("/proc/self/task").map_or(0, Iterator::count)
}

/// Drops `CAP_SYS_ADMIN` from every set of the (only) thread and sets `no_new_privs`.
/// Returns whether it was held.
pub fn drop_sys_admin() -> Result<bool, CapsError> {
    let n = threads();
    if n != 1 {
        return Err(CapsError::Threads(n));
    }
    let mut h = Header {
        version: CAPABILITY_VERSION_3,
        pid: 0,
    };
    let mut d = [Data::default(); 2];
    // SAFETY: capget writes two `Data` words for version 3 into `d`, which holds two.
    if unsafe { libc::syscall(libc::SYS_capget, &raw mut h, d.as_mut_ptr()) } != 0 {
        return Err(CapsError::Get(io::Error::last_os_error()));
    }
    let bit = 1u32 << CAP_SYS_ADMIN;
    let held = d[0].permitted & bit != 0;
    d[0].effective &= !bit;
    d[0].permitted &= !bit;
    d[0].inheritable &= !bit;
    // SAFETY: capset reads the header and two `Data` words; only lowers this thread's sets.
    if unsafe { libc::syscall(libc::SYS_capset, &raw mut h, d.as_ptr()) } != 0 {
        return Err(CapsError::Set(io::Error::last_os_error()));
    }
    // SAFETY: prctl with integer arguments only.
    if unsafe { libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) } != 0 {
        return Err(CapsError::NoNewPrivs(io::Error::last_os_error()));
    }
    Ok(held)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nothing_is_dropped_while_other_threads_would_keep_it() {
        // The test harness runs this on a thread of its own: the process has several.
        let t = std::thread::spawn(|| std::thread::sleep(std::time::Duration::from_millis(200)));
        match drop_sys_admin() {
            Err(CapsError::Threads(n)) => assert!(n > 1, "{n}"),
            other => panic!("{other:?}"),
        }
        t.join().unwrap();
    }
}
