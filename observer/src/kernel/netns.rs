//! Network namespaces by `ip netns` name: entering one for the whole observer (probes attach
//! in the caller's namespace) and running short jobs on threads inside one.

use std::fs::File;
use std::os::fd::AsRawFd;
use std::path::PathBuf;

use anyhow::{Context, Result, bail};

pub fn path(name: &str) -> PathBuf {
    PathBuf::from("/run/netns").join(name)
}

/// Moves the calling thread into namespace `name`. Call before starting other threads when
/// the whole process should live there.
pub fn enter(name: &str) -> Result<()> {
    let p = path(name);
    let f = File::open(&p).with_context(|| {
        format!(
            "no network namespace `{name}` ({} missing; see `ip netns list`)",
            p.display()
        )
    })?;
    // SAFETY: setns on a namespace fd we own; it changes only this thread's namespace.
    if unsafe { libc::setns(f.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
        bail!(
            "cannot enter network namespace `{name}`: {} (run as root)",
            std::io::Error::last_os_error()
        );
    }
    Ok(())
}

/// Runs `f` on a new thread inside namespace `name`.
pub fn spawn_in<F, R>(name: &str, f: F) -> std::thread::JoinHandle<Result<R>>
where
    F: FnOnce() -> Result<R> + Send + 'static,
    R: Send + 'static,
{
    let name = name.to_string();
    std::thread::spawn(move || {
        enter(&name)?;
        f()
    })
}
