//! Kernel side: loads both probe objects, hands them the BTF offsets, and attaches them.
//! Aya loads the TC object (which owns the maps); [`crate::nf_link`] loads the netfilter
//! object onto those same maps. Everything attaches in the calling thread's network namespace
//! and detaches when [`Probes`] is dropped (or the process dies: links are fd-owned).

use std::collections::{HashMap, HashSet};
use std::os::fd::{AsFd, AsRawFd, RawFd};

use anyhow::{Context, Result, bail};
use aya::maps::{Array, Map, MapData, PerCpuArray, RingBuf};
use aya::programs::{BtfTracePoint, SchedClassifier, TcAttachType};
use aya::{Btf, Ebpf, EbpfLoader};
use log::{debug, info};
use observer_common::filter::FilterProgram;
use observer_common::{config, counter};

use crate::btf::KernelLayout;
use crate::nf_link::{NfError, NfLink, NfObject};
use crate::plan::HookPlan;

static TC_OBJECT: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/observer-tc"));
static NF_OBJECT: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/observer-nf"));

const MAPS: [&str; 7] = [
    "EVENTS", "CONFIG", "COUNTERS", "SCRATCH", "FILTER", "DECISION", "WINDOWS",
];
const TC_PROGRAMS: [(&str, TcAttachType); 2] = [
    ("observer_tc_ingress", TcAttachType::Ingress),
    ("observer_tc_egress", TcAttachType::Egress),
];

/// Kernel counters, summed over CPUs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct KernelCounters {
    pub emitted: u64,
    pub ringbuf_full: u64,
    pub read_failed: u64,
    pub not_configured: u64,
    pub filtered: u64,
    pub sampled_out: u64,
}

pub struct Probes {
    ebpf: Ebpf,
    nf: NfObject,
    links: Vec<NfLink>,
    tc_attached: HashSet<u32>,
    /// The plan as attached (priorities may have moved off EBUSY ones).
    pub plans: Vec<HookPlan>,
}

fn map_fd(ebpf: &Ebpf, name: &str) -> Result<RawFd> {
    let data: &MapData = match ebpf.map(name) {
        Some(Map::Array(m) | Map::PerCpuArray(m) | Map::RingBuf(m) | Map::LruHashMap(m)) => m,
        Some(_) => bail!("map {name} has an unexpected type"),
        None => bail!("probe object has no map {name}"),
    };
    Ok(data.fd().as_fd().as_raw_fd())
}

impl Probes {
    /// Loads both objects and configures them with `layout` and the packet `filter`.
    /// Only the kfree_skb tracepoint is attached yet.
    pub fn load(layout: &KernelLayout, filter: &FilterProgram) -> Result<Self> {
        if TC_OBJECT.is_empty() || NF_OBJECT.is_empty() {
            bail!(
                "this observer binary was built without its probes (OBSERVER_SKIP_EBPF=1); \
                 rebuild with `cargo xtask build`"
            );
        }
        let mut ebpf = EbpfLoader::new().load(TC_OBJECT).context(
            "loading the TC probe object (are you root? is /sys/kernel/btf/vmlinux present?)",
        )?;
        {
            let mut config: Array<_, u64> = Array::try_from(
                ebpf.map_mut("CONFIG")
                    .context("probe object has no CONFIG map")?,
            )?;
            for (i, v) in layout.config.iter().enumerate() {
                config.set(i as u32, v, 0)?;
            }
            config.set(config::OBSERVED_NETNS, current_netns_inode()?, 0)?;
        }
        {
            let mut map: Array<_, FilterProgram> = Array::try_from(
                ebpf.map_mut("FILTER")
                    .context("probe object has no FILTER map")?,
            )?;
            map.set(0, filter, 0)?;
        }
        for (name, _) in TC_PROGRAMS {
            let prog: &mut SchedClassifier = ebpf
                .program_mut(name)
                .with_context(|| format!("probe object has no program {name}"))?
                .try_into()?;
            prog.load()
                .with_context(|| format!("loading TC program {name}"))?;
        }
        let btf = Btf::from_sys_fs().context("reading kernel BTF for the kfree_skb tracepoint")?;
        let drops: &mut BtfTracePoint = ebpf
            .program_mut("observer_kfree_skb")
            .context("probe object has no kfree_skb program")?
            .try_into()?;
        drops
            .load("kfree_skb", &btf)
            .context("loading the kfree_skb tracepoint program")?;
        drops
            .attach()
            .context("attaching to the kfree_skb tracepoint (drop reasons)")?;
        let fds: HashMap<String, RawFd> = MAPS
            .iter()
            .map(|m| Ok((m.to_string(), map_fd(&ebpf, m)?)))
            .collect::<Result<_>>()?;
        let nf = NfObject::parse(NF_OBJECT, &fds)?;
        Ok(Self {
            ebpf,
            nf,
            links: Vec::new(),
            tc_attached: HashSet::new(),
            plans: Vec::new(),
        })
    }

    /// Attaches a netfilter probe at every point of every plan. A point whose priority is
    /// taken (EBUSY) moves to the nearest free priority between the same two tables.
    pub fn attach_netfilter(&mut self, plans: Vec<HookPlan>) -> Result<()> {
        let mut attached = Vec::with_capacity(plans.len());
        for mut plan in plans {
            debug!(
                "{}/{}: tables {:?} probes at {:?}",
                plan.family.name(),
                plan.hook.name(),
                plan.tables
                    .iter()
                    .map(|t| (&t.name, t.priority))
                    .collect::<Vec<_>>(),
                plan.points
            );
            for slot in 0..plan.points.len() {
                let prog = self
                    .nf
                    .program_mut(&format!("nf_slot_{}", plan.programs[slot]))?;
                prog.load()?;
                let mut candidates = vec![plan.points[slot]];
                candidates.extend(plan.fallbacks(slot));
                let mut last_err = None;
                for prio in candidates {
                    match prog.attach(plan.family, plan.hook, prio) {
                        Ok(link) => {
                            if prio != plan.points[slot] {
                                // ipv6 conntrack confirms at INPUT INT_MAX-1, for one.
                                info!(
                                    "{}/{} priority {} is taken; probing at {prio} instead",
                                    plan.family.name(),
                                    plan.hook.name(),
                                    plan.points[slot]
                                );
                                plan.points[slot] = prio;
                            }
                            self.links.push(link);
                            last_err = None;
                            break;
                        }
                        Err(e @ NfError::Attach { .. }) if is_busy(&e) => last_err = Some(e),
                        Err(e) => return Err(e.into()),
                    }
                }
                if let Some(e) = last_err {
                    return Err(e.into());
                }
            }
            attached.push(plan);
        }
        debug!("attached {} netfilter links", self.links.len());
        self.plans = attached;
        Ok(())
    }

    /// Attaches the TC probes (tcx ingress and egress) to every interface not yet covered.
    /// Returns the names newly attached. Called again to pick up interfaces that appear later.
    pub fn attach_tc_new_interfaces(&mut self) -> Result<Vec<String>> {
        let mut added = Vec::new();
        for (index, name) in interfaces() {
            if self.tc_attached.contains(&index) {
                continue;
            }
            for (prog, at) in TC_PROGRAMS {
                let p: &mut SchedClassifier = self
                    .ebpf
                    .program_mut(prog)
                    .expect("loaded in Probes::load")
                    .try_into()?;
                if let Err(e) = p.attach(&name, at) {
                    // An interface that vanished between listing and attaching is not an error.
                    if interfaces().iter().any(|(i, _)| *i == index) {
                        return Err(anyhow::Error::new(e).context(format!(
                            "attaching tcx {at:?} on {name} (kernel 6.6+ needed)"
                        )));
                    }
                }
            }
            self.tc_attached.insert(index);
            added.push(name);
        }
        Ok(added)
    }

    pub fn take_ring(&mut self) -> Result<RingBuf<MapData>> {
        let map = self
            .ebpf
            .take_map("EVENTS")
            .context("probe object has no EVENTS map")?;
        Ok(RingBuf::try_from(map)?)
    }

    pub fn counters(&self) -> Result<KernelCounters> {
        let arr: PerCpuArray<_, u64> =
            PerCpuArray::try_from(self.ebpf.map("COUNTERS").context("no COUNTERS map")?)?;
        let sum = |i: u32| -> Result<u64> { Ok(arr.get(&i, 0)?.iter().sum()) };
        Ok(KernelCounters {
            emitted: sum(counter::EMITTED)?,
            ringbuf_full: sum(counter::RINGBUF_FULL)?,
            read_failed: sum(counter::READ_FAILED)?,
            not_configured: sum(counter::NOT_CONFIGURED)?,
            filtered: sum(counter::FILTERED)?,
            sampled_out: sum(counter::SAMPLED_OUT)?,
        })
    }

    pub fn netfilter_links(&self) -> usize {
        self.links.len()
    }
}

/// Inode of the calling thread's network namespace: what `net.ns.inum` holds in the kernel.
pub fn current_netns_inode() -> Result<u64> {
    use std::os::unix::fs::MetadataExt;
    Ok(std::fs::metadata("/proc/thread-self/ns/net")
        .context("reading /proc/thread-self/ns/net")?
        .ino())
}

fn is_busy(e: &NfError) -> bool {
    matches!(e, NfError::Attach { source, .. } if source.raw_os_error() == Some(libc::EBUSY))
}

/// Interfaces of the current network namespace (index, name).
pub fn interfaces() -> Vec<(u32, String)> {
    let mut out = Vec::new();
    // SAFETY: if_nameindex returns a list terminated by a zero entry, freed below.
    unsafe {
        let list = libc::if_nameindex();
        if list.is_null() {
            return out;
        }
        let mut p = list;
        while (*p).if_index != 0 {
            let name = std::ffi::CStr::from_ptr((*p).if_name)
                .to_string_lossy()
                .into_owned();
            out.push(((*p).if_index, name));
            p = p.add(1);
        }
        libc::if_freenameindex(list);
    }
    out
}

/// Index of interface `name` in the current namespace.
pub fn ifindex(name: &str) -> Option<u32> {
    let c = std::ffi::CString::new(name).ok()?;
    // SAFETY: c is a valid NUL-terminated string.
    let i = unsafe { libc::if_nametoindex(c.as_ptr()) };
    (i != 0).then_some(i)
}

/// Name of an interface in the current namespace, or `if<N>` if it is gone.
pub fn ifname(index: u32) -> String {
    if index == 0 {
        return "-".into();
    }
    let mut buf = [0 as libc::c_char; libc::IF_NAMESIZE];
    // SAFETY: buf has IF_NAMESIZE bytes as if_indextoname requires.
    let p = unsafe { libc::if_indextoname(index, buf.as_mut_ptr()) };
    if p.is_null() {
        return format!("if{index}");
    }
    // SAFETY: on success buf holds a NUL-terminated name.
    unsafe { std::ffi::CStr::from_ptr(buf.as_ptr()) }
        .to_string_lossy()
        .into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;
    use observer_common::NF_SLOTS;

    /// The embedded netfilter object must hold every slot program, each relocatable with map
    /// references only (no BPF-to-BPF calls, no global data), which is all nf_link supports.
    #[test]
    fn embedded_netfilter_object_is_loadable_by_nf_link() {
        if NF_OBJECT.is_empty() {
            eprintln!("!!! SKIPPED: built with OBSERVER_SKIP_EBPF=1");
            assert!(!observer_tests_in_ci(), "CI builds the probes");
            return;
        }
        let fds: HashMap<String, RawFd> = MAPS.iter().map(|m| (m.to_string(), 1000)).collect();
        let mut obj = NfObject::parse(NF_OBJECT, &fds).expect("netfilter object parses");
        for slot in 0..NF_SLOTS {
            obj.program_mut(&format!("nf_slot_{slot}"))
                .expect("slot program present");
        }
        assert!(obj.program_mut(&format!("nf_slot_{NF_SLOTS}")).is_err());
        // Without the shared maps the object cannot be relocated.
        assert!(matches!(
            NfObject::parse(NF_OBJECT, &HashMap::new()),
            Err(NfError::UnsupportedRelocation { .. })
        ));
    }

    fn observer_tests_in_ci() -> bool {
        std::env::var("CI").is_ok_and(|v| v == "true")
    }
}
