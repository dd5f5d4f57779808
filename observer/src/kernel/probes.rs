//! Kernel side: loads both probe objects, hands them the BTF offsets, and attaches them.
//! Aya loads the TC object (which owns the maps); [`crate::nf_link`] loads the netfilter
//! object onto those same maps. Everything attaches in the calling thread's network namespace
//! and detaches when [`Probes`] is dropped (or the process dies: links are fd-owned).

use std::collections::{HashMap, HashSet};
use std::os::fd::{AsFd, AsRawFd, RawFd};

use anyhow::{Context, Result, bail};
use aya::maps::{Array, HashMap as BpfHashMap, Map, MapData, PerCpuArray, RingBuf};
use aya::programs::tc::SchedClassifierLinkId;
use aya::programs::{
    BtfTracePoint, CgroupAttachMode, CgroupSkb, CgroupSkbAttachType, SchedClassifier, TcAttachType,
};
use aya::{Btf, Ebpf, EbpfLoader};
use log::{debug, info};
use observer_common::filter::{FilterNets, FilterProgram};
use observer_common::traversal::{Slots, TraversalRecord, decision, end, status};
use observer_common::{config, counter, counts, pending_count};
use std::path::PathBuf;

use crate::btf::KernelLayout;
use crate::nf_link::{NfError, NfFamily, NfHook, NfLink, NfObject, patch_object_calls};
use crate::plan::HookPlan;

static TC_OBJECT: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/observer-tc"));
static NF_OBJECT: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/observer-nf"));

/// Maps the netfilter object uses; they are the TC object's, shared.
const MAPS: [&str; 19] = [
    "EVENTS",
    "CTL",
    "INDEX",
    "CONFIG",
    "COUNTERS",
    "SCRATCH",
    "FILTER",
    "FILTER_NETS",
    "FILTER_INPUTS",
    "WINDOWS",
    "SLOTS",
    "PENDING",
    "PENDING_COUNT",
    "OUT",
    "PACKETS",
    "PACKETS_LOST",
    "COUNTS",
    "COUNT_LAST",
    "DROP_COUNTS",
];
/// Size of the packet-bytes ring buffer with `--pcapng` (about 26,000 packets of 160 bytes).
const PACKETS_BYTES: u32 = 4 * 1024 * 1024;
/// Its size without: the smallest a ring buffer can be, one page.
fn min_ring_bytes() -> u32 {
    // SAFETY: sysconf has no preconditions.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    u32::try_from(page).unwrap_or(4096)
}
/// Where traversals end besides TC egress (`observer-ebpf/src/bin/tc/ends.rs`):
/// tracepoints, then socket-receive functions entered and returned from.
const END_TRACEPOINTS: [(&str, &str); 2] = [
    ("observer_kfree_skb", "kfree_skb"),
    ("observer_consume_skb", "consume_skb"),
];
const TC_PROGRAMS: [(&str, TcAttachType); 2] = [
    ("observer_tc_ingress", TcAttachType::Ingress),
    ("observer_tc_egress", TcAttachType::Egress),
];

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

/// Kernel counters, summed over CPUs. All but `read_failed` count packets.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct KernelCounters {
    pub seen: u64,
    pub emitted: u64,
    pub ringbuf_full: u64,
    pub read_failed: u64,
    pub not_configured: u64,
    pub filtered: u64,
    pub sampled_out: u64,
    pub to_fallback: u64,
    pub reclaimed: u64,
    pub no_start: u64,
    pub fallback_failed: u64,
}

/// Traversals still held by the probes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct InFlight {
    /// Kept by the filter: they would be printed once they end.
    pub kept: u64,
    /// Left out by the filter or sampling: counted as such once they end.
    pub left_out: u64,
}

/// An interface with tcx probes.
struct Attached {
    name: String,
    links: Vec<(&'static str, SchedClassifierLinkId)>,
}

/// What changed among the namespace's interfaces since the last scan.
#[derive(Debug, Default)]
pub struct InterfaceChanges {
    pub added: Vec<String>,
    pub removed: Vec<String>,
    /// (old name, new name).
    pub renamed: Vec<(String, String)>,
    /// (interface, error): the probes could not attach there.
    pub failed: Vec<(String, String)>,
}

pub struct Probes {
    ebpf: Ebpf,
    nf: NfObject,
    links: Vec<NfLink>,
    tc: HashMap<u32, Attached>,
    /// Interfaces where attaching failed, so the failure is reported once per interface.
    tc_failed: HashSet<u32>,
    /// Attach failures since start (tcx and netfilter), for the summary.
    pub attach_failures: u64,
    /// The plan as attached (priorities may have moved off EBUSY ones).
    pub plans: Vec<HookPlan>,
    generation: u8,
    /// Records the collector took out of the fallback map (`pending_count::COLLECTED`).
    collected: u64,
    /// Whether traversals are recorded (else the probes only count: [`Probes::load_counting`]):
    /// the tcx, consume_skb and socket probes are attached only then.
    tracing: bool,
}

/// Whether the netfilter probes load conntrack entries and packets directly (the kernel's
/// `bpf_rdonly_cast` id, see `observer_common::kfunc`), unless `OBSERVER_DIRECT_READS=0`
/// keeps them on `bpf_probe_read_kernel` as on kernels before 6.16 (tests run both).
fn direct_reads(layout: &KernelLayout) -> Option<u32> {
    match std::env::var("OBSERVER_DIRECT_READS").as_deref() {
        Ok("0") => None,
        _ => layout.rdonly_cast,
    }
}

fn map_fd(ebpf: &Ebpf, name: &str) -> Result<RawFd> {
    let data: &MapData = match ebpf.map(name) {
        Some(Map::Array(m) | Map::PerCpuArray(m) | Map::RingBuf(m) | Map::HashMap(m)) => m,
        Some(_) => bail!("map {name} has an unexpected type"),
        None => bail!("probe object has no map {name}"),
    };
    Ok(data.fd().as_fd().as_raw_fd())
}

impl Probes {
    /// Loads both objects and configures them with `layout` and the packet `filter`, to
    /// record traversals. The end probes (tracepoints, sockets) are attached; netfilter
    /// and tcx are attached by [`Probes::attach_netfilter`] and [`Probes::sync_interfaces`].
    pub fn load(layout: &KernelLayout, filter: &FilterProgram) -> Result<Self> {
        Self::load_as(layout, filter, true, None)
    }

    /// Loads both objects to keep the always-on counters only (`observer agent`): the
    /// netfilter probes count and the drop tracepoint counts drops (and records what it
    /// knows of each dropped packet); nothing else is attached until
    /// [`Probes::start_tracing`].
    pub fn load_counting(layout: &KernelLayout) -> Result<Self> {
        Self::load_counting_with_ring(layout, None)
    }

    /// As [`Probes::load_counting`], with a traversal ring of `events_bytes` (a power of
    /// two of pages) instead of the object's 16 MiB: the agent's default mode uses it only
    /// while a client streams, and a mapped ring is resident memory all the time.
    pub fn load_counting_with_ring(
        layout: &KernelLayout,
        events_bytes: Option<u32>,
    ) -> Result<Self> {
        let mut probes = Self::load_as(layout, &FilterProgram::KEEP_ALL, false, events_bytes)?;
        let mut config: Array<_, u64> =
            Array::try_from(probes.ebpf.map_mut("CONFIG").context("no CONFIG map")?)?;
        config.set(config::COUNTING, 1, 0)?;
        config.set(config::COUNT_ONLY, 1, 0)?;
        Ok(probes)
    }

    fn load_as(
        layout: &KernelLayout,
        filter: &FilterProgram,
        tracing: bool,
        events_bytes: Option<u32>,
    ) -> Result<Self> {
        if TC_OBJECT.is_empty() || NF_OBJECT.is_empty() {
            bail!(
                "this observer binary was built without its probes (OBSERVER_SKIP_EBPF=1); \
                 rebuild with `cargo xtask build`"
            );
        }
        // The packet-bytes ring buffer (`tail --pcapng`) takes memory only when used.
        let capture = layout
            .config
            .get(config::CAPTURE_BYTES as usize)
            .is_some_and(|&v| v != config::UNSET && v != 0);
        // Both objects' placeholder calls are rewritten for this kernel (see
        // `observer_common::kfunc`).
        let rdonly_cast = direct_reads(layout);
        let tc_object = patch_object_calls(TC_OBJECT, rdonly_cast)?;
        let mut loader = EbpfLoader::new();
        if let Some(b) = events_bytes {
            loader.map_max_entries("EVENTS", b);
        }
        let mut ebpf = loader
            .map_max_entries(
                "PACKETS",
                if capture {
                    PACKETS_BYTES
                } else {
                    min_ring_bytes()
                },
            )
            .load(tc_object.bytes())
            .context(
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
            let mut nets: Array<_, FilterNets> = Array::try_from(
                ebpf.map_mut("FILTER_NETS")
                    .context("probe object has no FILTER_NETS map")?,
            )?;
            nets.set(0, FilterNets::of(filter), 0)?;
        }
        for (name, _) in TC_PROGRAMS {
            let prog: &mut SchedClassifier = ebpf
                .program_mut(name)
                .with_context(|| format!("probe object has no program {name}"))?
                .try_into()?;
            prog.load()
                .with_context(|| format!("loading TC program {name}"))?;
        }
        let btf =
            Btf::from_sys_fs().context("reading kernel BTF for the end-of-traversal probes")?;
        for (prog, tp) in END_TRACEPOINTS {
            // Counting needs the drops only.
            if tracing || tp == "kfree_skb" {
                attach_tracepoint(&mut ebpf, &btf, prog, tp)?;
            }
        }
        if tracing {
            attach_socket_probe(&mut ebpf)?;
        }
        let fds: HashMap<String, RawFd> = MAPS
            .iter()
            .map(|m| Ok((m.to_string(), map_fd(&ebpf, m)?)))
            .collect::<Result<_>>()?;
        let nf = NfObject::parse(NF_OBJECT, &fds, &layout.config, rdonly_cast)?;
        Ok(Self {
            ebpf,
            nf,
            links: Vec::new(),
            tc: HashMap::new(),
            tc_failed: HashSet::new(),
            attach_failures: 0,
            plans: Vec::new(),
            generation: 0,
            collected: 0,
            tracing,
        })
    }

    /// Whether traversals are being recorded (see [`Probes::start_tracing`]).
    pub fn tracing(&self) -> bool {
        self.tracing
    }

    /// From counting only to recording traversals too (a subscriber wants them): attaches
    /// the end probes, then lets the probes record; tcx follows at the next
    /// [`Probes::sync_interfaces`] (called here). Whatever an earlier tracing period left in
    /// the in-flight maps is cleared first: nobody was listening when it ended.
    pub fn start_tracing(&mut self, filter: &FilterProgram) -> Result<()> {
        if self.tracing {
            return Ok(());
        }
        self.clear_in_flight()?;
        self.set_filter(filter)?;
        let btf = Btf::from_sys_fs().context("reading kernel BTF")?;
        let (prog, tp) = END_TRACEPOINTS[1];
        attach_tracepoint(&mut self.ebpf, &btf, prog, tp)?;
        attach_socket_probe(&mut self.ebpf)?;
        self.tracing = true;
        let changes = self.sync_interfaces()?;
        for (name, e) in &changes.failed {
            log::warn!("no probes on interface {name}: {e}");
        }
        let mut config: Array<_, u64> =
            Array::try_from(self.ebpf.map_mut("CONFIG").context("no CONFIG map")?)?;
        config.set(config::COUNT_ONLY, 0, 0)?;
        info!("recording traversals: tcx on {}", changes.added.join(", "));
        Ok(())
    }

    /// Replaces the probes' filter (packets already decided keep their decision).
    pub fn set_filter(&mut self, filter: &FilterProgram) -> Result<()> {
        // The networks' shortcut is cleared first (none: nothing skipped), so that no probe
        // skips by the old filter's networks a packet the new one keeps.
        let set_nets = |ebpf: &mut Ebpf, nets: FilterNets| -> Result<()> {
            let mut map: Array<_, FilterNets> =
                Array::try_from(ebpf.map_mut("FILTER_NETS").context("no FILTER_NETS map")?)?;
            map.set(0, nets, 0)?;
            Ok(())
        };
        set_nets(&mut self.ebpf, FilterNets::of(&FilterProgram::KEEP_ALL))?;
        {
            let mut map: Array<_, FilterProgram> =
                Array::try_from(self.ebpf.map_mut("FILTER").context("no FILTER map")?)?;
            map.set(0, filter, 0)?;
        }
        set_nets(&mut self.ebpf, FilterNets::of(filter))
    }

    /// Back to counting only: the probes stop recording at once; the tcx, consume_skb and
    /// socket probes are released (tcx in the background: each detach waits for RCU).
    pub fn stop_tracing(&mut self) -> Result<()> {
        if !self.tracing {
            return Ok(());
        }
        {
            let mut config: Array<_, u64> =
                Array::try_from(self.ebpf.map_mut("CONFIG").context("no CONFIG map")?)?;
            config.set(config::COUNT_ONLY, 1, 0)?;
        }
        self.tracing = false;
        let taken = self.take_tc_links();
        std::thread::spawn(move || drop(taken));
        self.unload_program(END_TRACEPOINTS[1].0);
        self.unload_program("observer_sock_ingress");
        info!("counting only: traversals are no longer recorded");
        Ok(())
    }

    fn unload_program(&mut self, name: &str) {
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

    /// Empties the per-CPU slots and the fallback map (no probe may be using them).
    fn clear_in_flight(&mut self) -> Result<()> {
        {
            let mut slots: PerCpuArray<_, Slots> =
                PerCpuArray::try_from(self.ebpf.map_mut("SLOTS").context("no SLOTS map")?)?;
            let cpus = aya::util::nr_cpus().map_err(|(_, e)| e)?;
            // SAFETY: Slots is plain data; all zero is every slot and entry free.
            let empty: Slots = unsafe { std::mem::zeroed() };
            slots.set(0, aya::maps::PerCpuValues::try_from(vec![empty; cpus])?, 0)?;
        }
        let mut map: BpfHashMap<_, u64, TraversalRecord> =
            BpfHashMap::try_from(self.ebpf.map_mut("PENDING").context("no PENDING map")?)?;
        let keys: Vec<u64> = map.keys().filter_map(Result::ok).collect();
        let mut removed = 0;
        for k in keys {
            if map.remove(&k).is_ok() {
                removed += 1;
            }
        }
        self.collected_from_pending(removed)
    }

    /// Adds `n` records taken out of the fallback map to the probes' count of them (after
    /// the removals: the count may only overestimate what the map holds).
    fn collected_from_pending(&mut self, n: u64) -> Result<()> {
        if n == 0 {
            return Ok(());
        }
        self.collected += n;
        let mut count: Array<_, u64> = Array::try_from(
            self.ebpf
                .map_mut("PENDING_COUNT")
                .context("no PENDING_COUNT map")?,
        )?;
        count.set(pending_count::COLLECTED, self.collected, 0)?;
        Ok(())
    }

    /// The always-on counters of the points in `points` (rows of
    /// [`observer_common::counts`]), summed over CPUs.
    pub fn point_counts(&self, points: &[usize]) -> Result<Vec<(usize, [u64; counts::ROW])>> {
        self.summed_rows("COUNTS", points.iter().copied())
    }

    /// Drops by place (points in `places`, and [`counts::UNKNOWN_PLACE`]) and reason,
    /// summed over CPUs.
    pub fn drop_counts(&self, places: &[usize]) -> Result<Vec<(usize, [u64; counts::REASONS])>> {
        let places = places.iter().copied().chain([counts::UNKNOWN_PLACE]);
        self.summed_rows("DROP_COUNTS", places)
    }

    /// Rows `rows` of the per-CPU array `name`, each summed over CPUs.
    fn summed_rows<const N: usize>(
        &self,
        name: &str,
        rows: impl Iterator<Item = usize>,
    ) -> Result<Vec<(usize, [u64; N])>> {
        let arr: PerCpuArray<_, [u64; N]> = PerCpuArray::try_from(
            self.ebpf
                .map(name)
                .with_context(|| format!("no {name} map"))?,
        )?;
        let mut out = Vec::new();
        for row in rows {
            let mut sum = [0u64; N];
            for cpu in arr.get(&(row as u32), 0)?.iter() {
                for (s, v) in sum.iter_mut().zip(cpu) {
                    *s += v;
                }
            }
            out.push((row, sum));
        }
        Ok(out)
    }

    /// Attaches a netfilter probe at every point of every plan. A point whose priority is
    /// taken (EBUSY) moves to the nearest free priority between the same two tables.
    pub fn attach_netfilter(&mut self, plans: Vec<HookPlan>) -> Result<()> {
        let mut attached = Vec::with_capacity(plans.len());
        for plan in plans {
            attached.push(self.attach_plan(plan)?);
        }
        debug!("attached {} netfilter links", self.links.len());
        self.plans = attached;
        self.set_header_readers()
    }

    /// Tells the probes which of them read the headers again (see
    /// [`HookPlan::header_readers`], and which of them for nat alone); both families'
    /// programs share one mask per hook.
    fn set_header_readers(&mut self) -> Result<()> {
        let mut masks = [0u64; 5];
        // Readers for a reason other than nat in either family.
        let mut not_nat_only = [0u64; 5];
        let mut nat = [0u64; 5];
        for p in &self.plans {
            let h = p.hook as usize;
            masks[h] |= p.header_readers();
            not_nat_only[h] |= p.header_readers() & !p.nat_only_readers();
            nat[h] |= p.after_nat();
        }
        let mut config: Array<_, u64> =
            Array::try_from(self.ebpf.map_mut("CONFIG").context("no CONFIG map")?)?;
        for (hook, mask) in masks.into_iter().enumerate() {
            let nat_only = mask & !not_nat_only[hook];
            config.set(
                config::READ_HEADERS + hook as u32,
                mask | nat_only << config::NAT_ONLY_SHIFT,
                0,
            )?;
            config.set(config::NAT_AFTER + hook as u32, nat[hook], 0)?;
        }
        Ok(())
    }

    /// Brings the probes in line with `plans` (new base-chain priorities appeared or went):
    /// the hooks whose tables changed get their probes detached and attached anew; then the
    /// plan generation moves on, so that records say which layout they were made under.
    /// Returns the hooks re-planned.
    pub fn replan(&mut self, plans: Vec<HookPlan>) -> Result<Vec<(NfFamily, NfHook)>> {
        let mut changed = Vec::new();
        let mut next = Vec::with_capacity(plans.len());
        for plan in plans {
            let old = self
                .plans
                .iter()
                .find(|p| p.family == plan.family && p.hook == plan.hook);
            match old {
                Some(old) if old.tables == plan.tables => next.push(old.clone()),
                _ => {
                    let (f, h) = (plan.family, plan.hook);
                    self.links.retain(|l| !(l.family == f && l.hook == h));
                    next.push(self.attach_plan(plan)?);
                    changed.push((f, h));
                }
            }
        }
        self.plans = next;
        if !changed.is_empty() {
            self.set_header_readers()?;
            self.generation = self.generation.wrapping_add(1);
            let mut config: Array<_, u64> =
                Array::try_from(self.ebpf.map_mut("CONFIG").context("no CONFIG map")?)?;
            config.set(config::PLAN_GEN, u64::from(self.generation), 0)?;
        }
        Ok(changed)
    }

    /// Detaches every netfilter probe (released in the background: each detach waits for
    /// RCU); the plan generation moves on, so that a later plan is told apart.
    pub fn detach_netfilter(&mut self) -> Result<()> {
        let taken = std::mem::take(&mut self.links);
        std::thread::spawn(move || drop(taken));
        self.plans.clear();
        self.generation = self.generation.wrapping_add(1);
        let mut config: Array<_, u64> =
            Array::try_from(self.ebpf.map_mut("CONFIG").context("no CONFIG map")?)?;
        config.set(config::PLAN_GEN, u64::from(self.generation), 0)?;
        info!("netfilter probes detached");
        Ok(())
    }

    /// Plan generation in force (records carry it, modulo 256).
    pub fn generation(&self) -> u8 {
        self.generation
    }

    /// Attaches the probes of one hook; returns the plan as attached.
    fn attach_plan(&mut self, mut plan: HookPlan) -> Result<HookPlan> {
        {
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
        }
        Ok(plan)
    }

    /// Brings the tcx probes in line with the namespace's interfaces: attaches to new ones,
    /// releases the links of those that are gone, and notes renames. An interface where
    /// attaching fails is reported (once) and counted, never skipped silently.
    pub fn sync_interfaces(&mut self) -> Result<InterfaceChanges> {
        if !self.tracing {
            // Counting only: no tcx (see `start_tracing`).
            return Ok(InterfaceChanges::default());
        }
        let now: HashMap<u32, String> = interfaces().into_iter().collect();
        let mut changes = InterfaceChanges::default();
        let gone: Vec<u32> = self
            .tc
            .keys()
            .filter(|i| !now.contains_key(i))
            .copied()
            .collect();
        for index in gone {
            let a = self.tc.remove(&index).expect("listed");
            for (prog, id) in a.links {
                let p: &mut SchedClassifier = self
                    .ebpf
                    .program_mut(prog)
                    .expect("loaded in Probes::load")
                    .try_into()?;
                // The kernel detached it with the device; this releases our link and fd.
                let _ = p.detach(id);
            }
            changes.removed.push(a.name);
        }
        self.tc_failed.retain(|i| now.contains_key(i));
        for (&index, name) in &now {
            if let Some(a) = self.tc.get_mut(&index) {
                if &a.name != name {
                    changes
                        .renamed
                        .push((std::mem::replace(&mut a.name, name.clone()), name.clone()));
                }
                continue;
            }
            if self.tc_failed.contains(&index) {
                continue;
            }
            let mut links = Vec::new();
            let mut failed = None;
            for (prog, at) in TC_PROGRAMS {
                let p: &mut SchedClassifier = self
                    .ebpf
                    .program_mut(prog)
                    .expect("loaded in Probes::load")
                    .try_into()?;
                match p.attach(name, at) {
                    Ok(id) => links.push((prog, id)),
                    Err(e) => {
                        failed = Some(format!("tcx {at:?}: {e} (kernel 6.6+ needed)"));
                        break;
                    }
                }
            }
            if let Some(e) = failed {
                // Undo a half attachment: an interface is either fully probed or reported.
                for (prog, id) in links {
                    if let Ok(p) = <&mut SchedClassifier>::try_from(
                        self.ebpf.program_mut(prog).expect("loaded"),
                    ) {
                        let _ = p.detach(id);
                    }
                }
                // One that vanished between listing and attaching is no failure.
                if interfaces().iter().any(|(i, _)| *i == index) {
                    self.attach_failures += 1;
                    self.tc_failed.insert(index);
                    changes.failed.push((name.clone(), e));
                }
                continue;
            }
            self.tc.insert(
                index,
                Attached {
                    name: name.clone(),
                    links,
                },
            );
            changes.added.push(name.clone());
        }
        changes.added.sort();
        Ok(changes)
    }

    /// Takes the fallback-map traversals whose end will not be seen: those a socket has
    /// had since before `socket_before_ns` (queued to it, or freed by TCP without an event:
    /// delivered), and any other not heard of since `idle_before_ns` (incomplete). A
    /// traversal the probes end meanwhile is theirs: whoever deletes it first writes it.
    pub fn sweep(
        &mut self,
        socket_before_ns: u64,
        idle_before_ns: u64,
        idle_end: u8,
    ) -> Result<Vec<TraversalRecord>> {
        let mut map: BpfHashMap<_, u64, TraversalRecord> =
            BpfHashMap::try_from(self.ebpf.map_mut("PENDING").context("no PENDING map")?)?;
        // Only kept traversals wait there (the probes move no other).
        let stale: Vec<(u64, TraversalRecord)> = map
            .iter()
            .filter_map(Result::ok)
            .filter(|(_, r)| {
                let socket = r.status & status::SOCKET != 0;
                r.decision == decision::KEEP
                    && r.ts_last
                        < if socket {
                            socket_before_ns
                        } else {
                            idle_before_ns
                        }
            })
            .collect();
        let mut out = Vec::new();
        for (skb, mut rec) in stale {
            if map.remove(&skb).is_ok() {
                rec.end = if rec.status & status::SOCKET != 0 {
                    end::DELIVERED
                } else {
                    idle_end
                };
                out.push(rec);
            }
        }
        self.collected_from_pending(out.len() as u64)?;
        Ok(out)
    }

    /// Detaches every probe (netfilter links, tcx, tracepoints, cgroup) while keeping the
    /// maps: at exit, so that nothing more arrives while the last records are read and the
    /// counters add up exactly.
    pub fn detach(&mut self) -> std::thread::JoinHandle<()> {
        let t = std::time::Instant::now();
        self.links.clear();
        // Each tcx detach waits for an RCU grace period under the RTNL lock (~10 ms, more
        // under load, one after another): see `release_in_background`.
        let taken = self.take_tc_links();
        debug!("detach: netfilter links released after {:?}", t.elapsed());
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

    /// The tcx links, taken out of the programs so that whoever drops them detaches them.
    fn take_tc_links(&mut self) -> Vec<aya::programs::tc::SchedClassifierLink> {
        let mut taken = Vec::new();
        for (_, a) in self.tc.drain() {
            for (prog, id) in a.links {
                if let Some(Ok(p)) = self
                    .ebpf
                    .program_mut(prog)
                    .map(<&mut SchedClassifier>::try_from)
                    && let Ok(link) = p.take_link(id)
                {
                    taken.push(link);
                }
            }
        }
        taken
    }

    /// Traversals the probes still hold (per-CPU slots and the fallback map).
    pub fn in_flight(&self) -> Result<InFlight> {
        let mut n = InFlight::default();
        let mut add = |r: &TraversalRecord| {
            if r.skb == 0 {
                return;
            }
            debug!(
                "in flight at exit: skb {:#x} status {:#x} decision {} visits {} steps {} last hook {:?}",
                r.skb,
                r.status,
                r.decision,
                r.nvisits,
                r.nsteps,
                observer_common::traversal::last_hook(r)
            );
            if r.decision == decision::KEEP {
                n.kept += 1;
            } else {
                n.left_out += 1;
            }
        };
        let slots: PerCpuArray<_, Slots> =
            PerCpuArray::try_from(self.ebpf.map("SLOTS").context("no SLOTS map")?)?;
        // Packets left out at TC ingress, followed without a record.
        let mut entries = 0;
        for cpu in slots.get(&0, 0)?.iter() {
            cpu.recs.iter().for_each(&mut add);
            entries += cpu.left_out.skb.iter().filter(|&&skb| skb != 0).count() as u64;
        }
        let pending: BpfHashMap<_, u64, TraversalRecord> =
            BpfHashMap::try_from(self.ebpf.map("PENDING").context("no PENDING map")?)?;
        for (_, r) in pending.iter().filter_map(Result::ok) {
            add(&r);
        }
        n.left_out += entries;
        Ok(n)
    }

    /// The benchmark's floor: every probe returns at once (`true`), or records again.
    pub fn set_floor(&mut self, floor: bool) -> Result<()> {
        let mut config: Array<_, u64> =
            Array::try_from(self.ebpf.map_mut("CONFIG").context("no CONFIG map")?)?;
        config.set(config::FLOOR, u64::from(floor), 0)?;
        Ok(())
    }

    /// The packet-bytes ring buffer (`tail --pcapng`).
    pub fn take_packets(&mut self) -> Result<RingBuf<MapData>> {
        let map = self
            .ebpf
            .take_map("PACKETS")
            .context("probe object has no PACKETS map")?;
        Ok(RingBuf::try_from(map)?)
    }

    /// Packets whose first bytes the probes could not write (ring buffer full, unreadable).
    pub fn packets_lost(&self) -> Result<u64> {
        let arr: PerCpuArray<_, u64> = PerCpuArray::try_from(
            self.ebpf
                .map("PACKETS_LOST")
                .context("no PACKETS_LOST map")?,
        )?;
        Ok(arr.get(&0, 0)?.iter().sum())
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
            seen: sum(counter::SEEN)?,
            emitted: sum(counter::EMITTED)?,
            ringbuf_full: sum(counter::RINGBUF_FULL)?,
            read_failed: sum(counter::READ_FAILED)?,
            not_configured: sum(counter::NOT_CONFIGURED)?,
            filtered: sum(counter::FILTERED)?,
            sampled_out: sum(counter::SAMPLED_OUT)?,
            to_fallback: sum(counter::TO_FALLBACK)?,
            reclaimed: sum(counter::RECLAIMED)?,
            no_start: sum(counter::NO_START)?,
            fallback_failed: sum(counter::FALLBACK_FAILED)?,
        })
    }

    pub fn netfilter_links(&self) -> usize {
        self.links.len()
    }
}

/// Loads (when not loaded) and attaches one of the end tracepoints.
fn attach_tracepoint(ebpf: &mut Ebpf, btf: &Btf, prog: &str, tp: &str) -> Result<()> {
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
fn attach_socket_probe(ebpf: &mut Ebpf) -> Result<()> {
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

/// Tier 1 (the agent's default mode, issue 20): drops counted by key and sampled by the
/// `kfree_skb` program alone (`observer_ebpf::counts::drop_keyed`).
impl Probes {
    /// Counts drops by key; samples at most one per `gap` per CPU (`None`: no samples);
    /// `ignored` are reasons (below 128) neither counted by key nor sampled.
    pub fn enable_tier1(
        &mut self,
        gap: Option<std::time::Duration>,
        ignored: &[u32],
    ) -> Result<()> {
        let mut config: Array<_, u64> =
            Array::try_from(self.ebpf.map_mut("CONFIG").context("no CONFIG map")?)?;
        let mut mask = [0u64; 2];
        for &r in ignored.iter().filter(|&&r| r < 128) {
            mask[(r / 64) as usize] |= 1 << (r % 64);
        }
        config.set(config::DROP_REASONS_IGNORED, mask[0], 0)?;
        config.set(config::DROP_REASONS_IGNORED_HIGH, mask[1], 0)?;
        let gap = gap.map_or(config::UNSET, |g| {
            g.as_nanos().min(u128::from(u64::MAX - 1)) as u64
        });
        config.set(config::DROP_SAMPLE_GAP_NS, gap, 0)?;
        config.set(config::DROP_KEYED, 1, 0)?;
        Ok(())
    }

    /// Drops by key, summed over CPUs.
    pub fn drop_keyed(&self) -> Result<std::collections::BTreeMap<counts::DropKey, u64>> {
        let map: aya::maps::PerCpuHashMap<_, counts::DropKey, u64> =
            aya::maps::PerCpuHashMap::try_from(
                self.ebpf.map("DROP_KEYED").context("no DROP_KEYED map")?,
            )?;
        let mut out = std::collections::BTreeMap::new();
        for kv in map.iter() {
            let (k, v) = kv?;
            out.insert(k, v.iter().sum());
        }
        Ok(out)
    }

    /// Tier 1's own counters (`counts::drop_stats`), summed over CPUs.
    pub fn drop_stats(&self) -> Result<Vec<u64>> {
        let arr: PerCpuArray<_, u64> =
            PerCpuArray::try_from(self.ebpf.map("DROP_STATS").context("no DROP_STATS map")?)?;
        (0..counts::drop_stats::COUNT)
            .map(|i| Ok(arr.get(&i, 0)?.iter().sum()))
            .collect()
    }

    /// The ring of drop samples.
    pub fn take_drop_samples(&mut self) -> Result<RingBuf<MapData>> {
        let map = self
            .ebpf
            .take_map("DROP_SAMPLES")
            .context("probe object has no DROP_SAMPLES map")?;
        Ok(RingBuf::try_from(map)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use observer_common::NF_SLOTS;

    /// True, loudly, when the probes were not built (`OBSERVER_SKIP_EBPF=1`), which CI never
    /// does: the test has nothing to check.
    fn built_without(object: &[u8]) -> bool {
        if !object.is_empty() {
            return false;
        }
        eprintln!("!!! SKIPPED: built with OBSERVER_SKIP_EBPF=1");
        assert!(!observer_tests_in_ci(), "CI builds the probes");
        true
    }

    /// The embedded netfilter object must hold every slot program, each relocatable with map
    /// references only (no BPF-to-BPF calls, no global data), which is all nf_link supports.
    #[test]
    fn embedded_netfilter_object_is_loadable_by_nf_link() {
        if built_without(NF_OBJECT) {
            return;
        }
        let fds: HashMap<String, RawFd> = MAPS.iter().map(|m| (m.to_string(), 1000)).collect();
        let layout = crate::btf::KernelLayout::from_kernel().expect("kernel BTF");
        let mut obj = NfObject::parse(NF_OBJECT, &fds, &layout.config, layout.rdonly_cast)
            .expect("netfilter object parses");
        for slot in 0..NF_SLOTS {
            obj.program_mut(&format!("nf_slot_{slot}"))
                .expect("slot program present");
        }
        assert!(obj.program_mut(&format!("nf_slot_{NF_SLOTS}")).is_err());
        // Without the shared maps the object cannot be relocated.
        assert!(matches!(
            NfObject::parse(NF_OBJECT, &HashMap::new(), &layout.config, None),
            Err(NfError::UnsupportedRelocation { .. })
        ));
    }

    /// The TC object's code calls the placeholders (`observer_common::kfunc`); patched, none
    /// is left, whether the kernel takes direct reads or not, and nothing else changed size.
    #[test]
    fn the_tc_objects_placeholder_calls_are_all_rewritten() {
        if built_without(TC_OBJECT) {
            return;
        }
        let placeholders = |bytes: &[u8]| {
            bytes
                .chunks_exact(8)
                .filter(|i| {
                    i[0] == 0x85
                        && [
                            observer_common::kfunc::DIRECT_READS,
                            observer_common::kfunc::UNTRUSTED,
                        ]
                        .contains(&i32::from_le_bytes([i[4], i[5], i[6], i[7]]))
                })
                .count()
        };
        assert!(
            placeholders(TC_OBJECT) > 0,
            "the TC probes read through them"
        );
        for cast in [Some(4242), None] {
            let patched = patch_object_calls(TC_OBJECT, cast).expect("patched");
            let bytes = patched.bytes();
            assert_eq!(placeholders(bytes), 0, "{cast:?}");
            assert!(object::File::parse(bytes).is_ok());
        }
    }

    fn observer_tests_in_ci() -> bool {
        std::env::var("CI").is_ok_and(|v| v == "true")
    }
}
