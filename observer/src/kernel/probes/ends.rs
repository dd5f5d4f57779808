//! The end probes: the `kfree_skb`/`consume_skb` tracepoints and the cgroup/skb socket probe,
//! where traversals end besides TC egress (`observer-ebpf/src/bin/tc/ends.rs`).

use std::path::PathBuf;

use anyhow::{Context, Result};
use aya::programs::tp_btf::BtfTracePointLinkId;
use aya::programs::{BtfTracePoint, CgroupAttachMode, CgroupSkb, CgroupSkbAttachType};
use aya::{Btf, Ebpf};

use super::*;

/// Where traversals end besides TC egress (`observer-ebpf/src/bin/tc/ends.rs`):
/// tracepoints, then socket-receive functions entered and returned from.
pub(super) const END_TRACEPOINTS: [(&str, &str); 2] = [
    ("observer_kfree_skb", "kfree_skb"),
    ("observer_consume_skb", "consume_skb"),
];

impl Probes {
    pub(super) fn unload_program(&mut self, name: &str) {
        if let Some(p) = self.ebpf.program_mut(name) {
            let r = match p {
                aya::programs::Program::BtfTracePoint(p) => p.unload(),
                aya::programs::Program::CgroupSkb(p) => p.unload(),
                _ => Ok(()),
            };
            if let Err(e) = r {
                log::warn!("releasing probe {name}: {e}");
            }
        }
    }
}

/// Loads one of the end tracepoints' programs, when not loaded yet. `btf` is the kernel's,
/// read on first need only: the read and parse of vmlinux's BTF cost several MiB for a
/// moment (issue 33: they made the agent's peaks at each start of tracing).
pub(super) fn load_tracepoint(
    ebpf: &mut Ebpf,
    btf: &mut Option<Btf>,
    prog: &str,
    tp: &str,
) -> Result<()> {
    let p: &mut BtfTracePoint = ebpf
        .program_mut(prog)
        .with_context(|| format!("probe object has no program {prog}"))?
        .try_into()?;
    if p.fd().is_err() {
        let btf = match btf {
            Some(b) => b,
            None => btf.insert(
                Btf::from_sys_fs().context("reading kernel BTF for the end-of-traversal probes")?,
            ),
        };
        p.load(tp, btf)
            .with_context(|| format!("loading the {tp} tracepoint program"))?;
    }
    Ok(())
}

/// Loads (when not loaded) and attaches one of the end tracepoints; the link is the
/// program's until [`detach_tracepoint`] (or the program's unload at exit).
pub(super) fn attach_tracepoint(
    ebpf: &mut Ebpf,
    btf: &mut Option<Btf>,
    prog: &str,
    tp: &str,
) -> Result<BtfTracePointLinkId> {
    load_tracepoint(ebpf, btf, prog, tp)?;
    let p: &mut BtfTracePoint = ebpf
        .program_mut(prog)
        .with_context(|| format!("probe object has no program {prog}"))?
        .try_into()?;
    p.attach()
        .with_context(|| format!("attaching to the {tp} tracepoint"))
}

/// Detaches one end tracepoint's link and keeps its program loaded, so that attaching it
/// again needs no BTF.
pub(super) fn detach_tracepoint(ebpf: &mut Ebpf, prog: &str, link: BtfTracePointLinkId) {
    let detached = ebpf
        .program_mut(prog)
        .and_then(|p| <&mut BtfTracePoint>::try_from(p).ok())
        .map(|p| p.detach(link));
    if let Some(Err(e)) = detached {
        log::warn!("detaching probe {prog}: {e}");
    }
}

/// cgroup/skb ingress at the root of the cgroup v2 hierarchy: where a socket takes a packet
/// (`observer-ebpf/src/bin/tc/ends.rs`). Allows every packet.
pub(super) fn attach_socket_probe(ebpf: &mut Ebpf) -> Result<()> {
    let root = cgroup2_root()
        .context("no cgroup v2 hierarchy is mounted (mount -t cgroup2 none /sys/fs/cgroup)")?;
    let cgroup =
        std::fs::File::open(&root).with_context(|| format!("opening cgroup {}", root.display()))?;
    let p: &mut CgroupSkb = ebpf
        .program_mut("observer_sock_ingress")
        .context("probe object has no program observer_sock_ingress")?
        .try_into()?;
    if p.fd().is_err() {
        p.load().context("loading the cgroup/skb socket probe")?;
    }
    // As a BPF link, which coexists with other programs there; `Single` only means that
    // no attach flags are passed, which links refuse.
    p.attach(
        cgroup,
        CgroupSkbAttachType::Ingress,
        CgroupAttachMode::Single,
    )
    .with_context(|| format!("attaching cgroup/skb ingress at {}", root.display()))?;
    Ok(())
}

/// Where the cgroup v2 hierarchy is mounted (unified, or hybrid under `unified`).
fn cgroup2_root() -> Option<PathBuf> {
    let mounts = std::fs::read_to_string("/proc/self/mounts").ok()?;
    mounts
        .lines()
        .map(|l| l.split_whitespace().collect::<Vec<_>>())
        .find(|w| w.len() > 2 && w[2] == "cgroup2")
        .map(|w| PathBuf::from(w[1]))
}
