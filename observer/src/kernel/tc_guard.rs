//! Netlink TC filters outlive observer; a guard process removes them.
//!
//! Before 6.6 there is no tcx: the TC probes attach as `bpf` filters on a clsact qdisc
//! through netlink, and the kernel keeps such a filter (and its program) until someone
//! deletes it. tcx links, netfilter links, trampolines and tracepoints are owned by a file
//! descriptor and go when observer dies; these would not. So observer starts a guard with
//! the first such filter: a process of its own (`observer tc-filter-guard`, hidden), told of
//! every filter added and released through a pipe. When observer's end of the pipe closes,
//! however observer ended (exit, a panic, SIGKILL), the guard deletes the filters still
//! listed, in observer's network namespace (it inherits it), and exits.
//!
//! The guard ignores the signals a terminal or a service manager sends to a whole group
//! (SIGINT, SIGTERM, SIGHUP): observer handles those and releases its filters itself; the
//! guard outlives it by the moments the deletions take. What it cannot survive is being
//! killed itself (a container's whole cgroup killed at once): the filters then stay until the
//! interface goes, each always passing the packet on.

use std::io::{BufRead, Write};
use std::process::{Child, ChildStdin, Command, Stdio};

use aya::programs::TcAttachType;
use aya::programs::tc::{SchedClassifierLink, TcHandle};
use log::{debug, warn};

/// The hidden subcommand the guard runs as.
pub const SUBCOMMAND: &str = "tc-filter-guard";

/// One netlink TC filter: what netlink deletes it by.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NetlinkFilter {
    pub ifindex: u32,
    pub attach: TcAttachType,
    pub priority: u16,
    pub handle: u32,
}

impl NetlinkFilter {
    /// The filter behind an attached TC link, or None for a tcx link (fd-owned).
    pub fn of(ifindex: u32, link: &SchedClassifierLink) -> Option<Self> {
        Some(Self {
            ifindex,
            attach: link.attach_type().ok()?,
            priority: link.priority().ok()?,
            handle: link.handle().ok()?.into(),
        })
    }

    /// One line of the guard's protocol: `+` (watch) or `-` (forget), then the filter.
    fn line(&self, sign: char) -> String {
        let at = match self.attach {
            TcAttachType::Ingress => "ingress",
            TcAttachType::Egress => "egress",
            TcAttachType::Custom(p) => {
                return format!(
                    "{sign} {} {p} {} {}\n",
                    self.ifindex, self.priority, self.handle
                );
            }
        };
        format!(
            "{sign} {} {at} {} {}\n",
            self.ifindex, self.priority, self.handle
        )
    }

    fn parse(line: &str) -> Option<(char, Self)> {
        let mut w = line.split_whitespace();
        let sign = w
            .next()?
            .chars()
            .next()
            .filter(|c| *c == '+' || *c == '-')?;
        let ifindex = w.next()?.parse().ok()?;
        let attach = match w.next()? {
            "ingress" => TcAttachType::Ingress,
            "egress" => TcAttachType::Egress,
            p => TcAttachType::Custom(p.parse().ok()?),
        };
        let priority = w.next()?.parse().ok()?;
        let handle = w.next()?.parse().ok()?;
        if w.next().is_some() {
            return None;
        }
        Some((
            sign,
            Self {
                ifindex,
                attach,
                priority,
                handle,
            },
        ))
    }
}

/// Observer's side: the guard process, started with the first filter it is told of.
#[derive(Default)]
pub struct TcGuard {
    guard: Option<(Child, ChildStdin)>,
    /// Why no guard runs (said once): filters then outlive a SIGKILL.
    failed: bool,
}

impl TcGuard {
    /// Tells the guard of a filter just attached (starting the guard first if needed).
    pub fn watch(&mut self, f: &NetlinkFilter) {
        if self.guard.is_none() && !self.failed {
            match spawn() {
                Ok(g) => self.guard = Some(g),
                Err(e) => {
                    self.failed = true;
                    warn!(
                        "the TC probes attach as netlink filters here (no tcx before Linux 6.6) \
                         and no guard process could be started to remove them if observer is \
                         killed ({e}): after a SIGKILL, remove them with `tc filter del dev IFACE \
                         ingress|egress pref N` (they pass every packet on meanwhile)"
                    );
                }
            }
        }
        self.send(&f.line('+'));
    }

    /// Tells the guard a filter is being released by observer itself: said before the
    /// deletion, so that the guard never deletes a filter someone else attached at the same
    /// priority and handle afterwards.
    pub fn forget(&mut self, f: &NetlinkFilter) {
        self.send(&f.line('-'));
    }

    fn send(&mut self, line: &str) {
        if let Some((_, stdin)) = &mut self.guard
            && let Err(e) = stdin.write_all(line.as_bytes()).and_then(|_| stdin.flush())
        {
            warn!("the TC filter guard stopped listening ({e}): filters may outlive a SIGKILL");
            self.guard = None;
            self.failed = true;
        }
    }
}

impl Drop for TcGuard {
    fn drop(&mut self) {
        // Closing the pipe ends the guard once it has deleted what is still listed (nothing,
        // when observer released its filters itself). Not waited for: the guard is reaped by
        // init if observer exits first.
        if let Some((child, stdin)) = self.guard.take() {
            drop(stdin);
            debug!("tc filter guard (process {}) told to finish", child.id());
        }
    }
}

fn spawn() -> std::io::Result<(Child, ChildStdin)> {
    use std::os::unix::process::CommandExt;
    let exe = std::env::current_exe()?;
    let mut cmd = Command::new(exe);
    cmd.arg(SUBCOMMAND)
        .stdin(Stdio::piped())
        // Not holding a reader of observer's stdout open.
        .stdout(Stdio::null())
        .stderr(Stdio::inherit());
    // SAFETY: only async-signal-safe calls between fork and exec. Ignored dispositions
    // survive exec: the guard ignores group-wide stop signals from its first instruction.
    unsafe {
        cmd.pre_exec(|| {
            for s in [libc::SIGINT, libc::SIGTERM, libc::SIGHUP, libc::SIGPIPE] {
                libc::signal(s, libc::SIG_IGN);
            }
            Ok(())
        });
    }
    let mut child = cmd.spawn()?;
    let stdin = child.stdin.take().expect("piped");
    debug!("tc filter guard started: process {}", child.id());
    Ok((child, stdin))
}

/// The guard's own body: reads the protocol from `input` until it ends, then deletes the
/// filters still listed. Returns how many it deleted and the failures, each named.
pub fn serve(input: impl BufRead) -> (usize, Vec<String>) {
    let mut listed: Vec<NetlinkFilter> = Vec::new();
    for line in input.lines() {
        let Ok(line) = line else { break };
        match NetlinkFilter::parse(&line) {
            Some(('+', f)) => listed.push(f),
            Some((_, f)) => listed.retain(|l| *l != f),
            None => {}
        }
    }
    let mut deleted = 0;
    let mut failures = Vec::new();
    for f in listed {
        // An interface that is gone took its filters with it.
        let Some(name) = if_name(f.ifindex) else {
            continue;
        };
        let link = match SchedClassifierLink::attached(
            &name,
            f.attach,
            f.priority,
            TcHandle::from(f.handle),
            None,
        ) {
            Ok(link) => link,
            Err(e) => {
                failures.push(format!("{name}: {e}"));
                continue;
            }
        };
        match aya::programs::Link::detach(link) {
            Ok(()) => deleted += 1,
            // Gone already (with its qdisc, or deleted by hand): nobody's loss.
            Err(e) if gone(&e) => {}
            Err(e) => failures.push(format!("{name} {:?} pref {}: {e}", f.attach, f.priority)),
        }
    }
    (deleted, failures)
}

/// Whether a deletion failed because the filter (or its qdisc) is not there.
fn gone(e: &aya::programs::ProgramError) -> bool {
    matches!(e, aya::programs::ProgramError::NetlinkError(n) if n.raw_os_error() == Some(libc::ENOENT))
}

fn if_name(ifindex: u32) -> Option<String> {
    let mut buf = [0 as libc::c_char; libc::IF_NAMESIZE];
    // SAFETY: a buffer of IF_NAMESIZE bytes, as if_indextoname(3) requires.
    let p = unsafe { libc::if_indextoname(ifindex, buf.as_mut_ptr()) };
    if p.is_null() {
        return None;
    }
    // SAFETY: if_indextoname wrote a NUL-terminated name into buf.
    let name = unsafe { std::ffi::CStr::from_ptr(buf.as_ptr()) };
    Some(name.to_string_lossy().into_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_protocol_reads_back_what_it_writes() {
        for attach in [
            TcAttachType::Ingress,
            TcAttachType::Egress,
            TcAttachType::Custom(7),
        ] {
            let f = NetlinkFilter {
                ifindex: 12,
                attach,
                priority: 49151,
                handle: 0x0001_0002,
            };
            for sign in ['+', '-'] {
                let line = f.line(sign);
                assert_eq!(
                    NetlinkFilter::parse(line.trim_end()),
                    Some((sign, f)),
                    "{line}"
                );
            }
        }
        assert_eq!(NetlinkFilter::parse("+ 12 ingress 1"), None);
        assert_eq!(NetlinkFilter::parse("* 12 ingress 1 2"), None);
        assert_eq!(NetlinkFilter::parse("+ 12 ingress 1 2 3"), None);
    }

    #[test]
    fn forgotten_filters_and_gone_interfaces_are_not_deleted() {
        // Index 0 is no interface: listed, but nothing to delete.
        let f = NetlinkFilter {
            ifindex: 0,
            attach: TcAttachType::Ingress,
            priority: 1,
            handle: 1,
        };
        let text = format!("{}{}", f.line('+'), f.line('-'));
        assert_eq!(serve(text.as_bytes()), (0, vec![]));
        // Listed, on no interface (index 0 is none): nothing to delete, no failure.
        let text = f.line('+');
        assert_eq!(serve(text.as_bytes()), (0, vec![]));
    }
}
