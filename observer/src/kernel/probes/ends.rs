//! The end probes: the `kfree_skb`/`consume_skb` tracepoints and the cgroup/skb socket probe,
//! where traversals end besides TC egress (`observer-ebpf/src/bin/tc/ends.rs`).

use std::path::PathBuf;

use anyhow::{Context, Result};
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

/// Loads (when not loaded) and attaches one of the end tracepoints.
pub(super) fn attach_tracepoint(ebpf: &mut Ebpf, btf: &Btf, prog: &str, tp: &str) -> Result<()> {
    let p: &mut BtfTracePoint = ebpf
        .program_mut(prog)
        .with_context(|| format!("probe object has no program {prog}"))?
        .try_into()?;
    if p.fd().is_err() {
        p.load(tp, btf)
            .with_context(|| format!("loading the {tp} tracepoint program"))?;
    }
    p.attach()
        .with_context(|| format!("attaching to the {tp} tracepoint"))?;
    Ok(())
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
