//! Release: detaching every probe at exit while the maps stay readable, tcx links handed
//! to a child process so that exit does not wait for the kernel.

use aya::programs::{BtfTracePoint, CgroupSkb};
use log::debug;

use super::ends::END_TRACEPOINTS;
use super::*;

impl Probes {
    /// Detaches every probe (the capture backend's, tcx, tracepoints, cgroup) while keeping the
    /// maps: at exit, so that nothing more arrives while the last records are read and the
    /// counters add up exactly.
    pub fn detach(&mut self) -> std::thread::JoinHandle<()> {
        let t = std::time::Instant::now();
        if let Ok(backend) = self.capture.backend() {
            drop(backend.take_all());
        }
        // Each tcx detach waits for an RCU grace period under the RTNL lock (~10 ms, more
        // under load, one after another): see `release_in_background`.
        let taken = self.take_tc_links();
        debug!(
            "detach: {} released after {:?}",
            self.capture.kind().name(),
            t.elapsed()
        );
        for (prog, _) in END_TRACEPOINTS {
            if let Some(Ok(p)) = self
                .ebpf
                .program_mut(prog)
                .map(<&mut BtfTracePoint>::try_from)
            {
                let _ = p.unload();
            }
        }
        if let Some(Ok(p)) = self
            .ebpf
            .program_mut("observer_sock_ingress")
            .map(<&mut CgroupSkb>::try_from)
        {
            let _ = p.unload();
        }
        release_in_background(taken)
    }
}

/// Releases `links` without making the caller wait for the kernel. A child process shares
/// their file descriptors and waits until this process has exited (its end of a pipe then
/// reads EOF); the last descriptor, and with it the detach, is then the child's. The probes
/// have stopped already (the floor flag), so nothing is observed meanwhile. Without fork,
/// a thread releases them and the returned handle waits for it.
fn release_in_background<L: Send + 'static>(links: Vec<L>) -> std::thread::JoinHandle<()> {
    let mut fds = [0; 2];
    // SAFETY: a two-int array for pipe(2).
    if !links.is_empty() && unsafe { libc::pipe(fds.as_mut_ptr()) } == 0 {
        let (read_end, write_end) = (fds[0], fds[1]);
        // SAFETY: the child only makes async-signal-safe calls (close, read, _exit).
        match unsafe { libc::fork() } {
            0 => unsafe {
                // Not holding the user's stdout/stderr open (a pipe reader would wait for it).
                for fd in [0, 1, 2, write_end] {
                    libc::close(fd);
                }
                let mut b = 0u8;
                while libc::read(read_end, (&mut b as *mut u8).cast(), 1) < 0 {}
                libc::_exit(0)
            },
            pid if pid > 0 => {
                // SAFETY: our copy of the read end; the write end stays open until exit.
                unsafe { libc::close(read_end) };
                debug!("detach: tcx links handed to process {pid}, released once we exit");
                drop(links);
                return std::thread::spawn(|| {});
            }
            _ => {
                // SAFETY: both ends are ours; fork failed.
                unsafe {
                    libc::close(read_end);
                    libc::close(write_end);
                }
            }
        }
    }
    std::thread::spawn(move || {
        let t = std::time::Instant::now();
        drop(links);
        debug!("detach: tcx links released after {:?}", t.elapsed());
    })
}
