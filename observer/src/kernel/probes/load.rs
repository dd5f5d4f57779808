//! Loading: both objects, configured with the BTF offsets and the filter, and the switch
//! between counting only (`observer agent` at rest) and recording traversals.

use std::collections::{HashMap, HashSet};
use std::os::fd::{AsFd, AsRawFd, RawFd};

use anyhow::{Context, Result, bail};
use aya::maps::{Array, Map, MapData};
use aya::programs::SchedClassifier;
use aya::{Ebpf, EbpfLoader};
use log::info;
use observer_common::config;
use observer_common::filter::{FilterNets, FilterProgram};

use super::ends::{
    END_TRACEPOINTS, attach_socket_probe, attach_tracepoint, detach_tracepoint, load_tracepoint,
};
use super::tc::{TC_BRIDGE_PROGRAMS, TC_PROGRAMS};
use super::*;

/// Maps the netfilter object uses; they are the TC object's, shared.
pub(super) const MAPS: [&str; 19] = [
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
pub(super) const PACKETS_BYTES: u32 = 4 * 1024 * 1024;
/// Its size without: the smallest a ring buffer can be, one page.
fn min_ring_bytes() -> u32 {
    // SAFETY: sysconf has no preconditions.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    u32::try_from(page).unwrap_or(4096)
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

/// The level the probes' diagnostics (`aya-log`, target `observer::probes`) are loaded with:
/// the most verbose one the user's log lets through (`RUST_LOG=observer=debug`), else 0,
/// off. It is a read-only global of both objects, so with 0 the verifier removes every
/// logging branch: off costs nothing (docs/architecture.md, "Probe diagnostics").
pub(super) fn probe_log_level() -> u8 {
    use aya_log::Level as Probe;
    use log::Level;
    let enabled = |l: Level| log::log_enabled!(target: "observer::probes", l);
    [
        (Level::Trace, Probe::Trace),
        (Level::Debug, Probe::Debug),
        (Level::Info, Probe::Info),
        (Level::Warn, Probe::Warn),
        (Level::Error, Probe::Error),
    ]
    .into_iter()
    .find(|&(l, _)| enabled(l))
    .map_or(0, |(_, p)| p as u8)
}

/// The kernel layout the probes expected but did not find, said once at load (in the
/// user's log at debug level, like the probes' own diagnostics): the netfilter probes'
/// filter shortcut reads a conntrack entry's tuples from a window of it
/// (`observer_ebpf::conntrack_may_match`), and where they do not fit it, every recheck
/// takes the long way. The same test as the probes', on the same configuration, so the
/// programs need no logging code for it. `None`: the layout is as expected.
pub(super) fn unexpected_layout(config: &[u64]) -> Option<String> {
    use observer_common::{CT_TUPLE_BYTES, CT_WINDOW_BYTES};
    let at = |slot: u32| {
        config
            .get(slot as usize)
            .copied()
            .filter(|&v| v != config::UNSET)
            .map(|v| v as usize)
    };
    let fits = (|| {
        let start = at(config::CT_WINDOW)?;
        let orig = at(config::CT_TUPLE_ORIG)?.checked_sub(start)?;
        let reply = at(config::CT_TUPLE_REPLY)?.checked_sub(start)?;
        let (sa, da) = (at(config::TUPLE_SRC_ADDR)?, at(config::TUPLE_DST_ADDR)?);
        (orig + CT_TUPLE_BYTES <= CT_WINDOW_BYTES
            && reply + CT_TUPLE_BYTES <= CT_WINDOW_BYTES
            && sa <= CT_TUPLE_BYTES - 16
            && da <= CT_TUPLE_BYTES - 16
            && (orig | reply | sa | da) & 3 == 0)
            .then_some(())
    })();
    fits.is_none().then(|| {
        format!(
            "unexpected kernel layout: conntrack tuples (original at {:?}, reply at {:?}, \
             addresses at {:?}/{:?}) do not fit the probes' {CT_WINDOW_BYTES}-byte window \
             from {:?}; packets the filter left out are decided again the long way",
            at(config::CT_TUPLE_ORIG),
            at(config::CT_TUPLE_REPLY),
            at(config::TUPLE_SRC_ADDR),
            at(config::TUPLE_DST_ADDR),
            at(config::CT_WINDOW),
        )
    })
}

/// Loads the TC programs (once: a loaded one is left as it is).
fn load_tc_programs(ebpf: &mut Ebpf) -> Result<()> {
    for (name, _) in TC_PROGRAMS.into_iter().chain(TC_BRIDGE_PROGRAMS) {
        let prog: &mut SchedClassifier = ebpf
            .program_mut(name)
            .with_context(|| format!("probe object has no program {name}"))?
            .try_into()?;
        if prog.fd().is_err() {
            prog.load()
                .with_context(|| format!("loading TC program {name}"))?;
        }
    }
    Ok(())
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
    /// and tcx are attached by [`Probes::attach_points`] and [`Probes::sync_interfaces`].
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
        if TC_OBJECT.is_empty()
            || NF_OBJECT.is_empty()
            || crate::kernel::capture::fentry::FENTRY_OBJECT.is_empty()
        {
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
        let tc_object = patch_object_calls(TC_OBJECT, rdonly_cast, &layout.config)?;
        let log_level = probe_log_level();
        if let Some(what) = unexpected_layout(&layout.config) {
            log::debug!(target: "observer::probes", "{what}");
        }
        // The loader holds its own parse of the kernel's BTF (tens of MiB) until dropped:
        // gone before the tracepoints' parse below, so the two never peak together.
        let mut ebpf = {
            let mut loader = EbpfLoader::new();
            if let Some(b) = events_bytes {
                loader.map_max_entries("EVENTS", b);
            }
            // For tests only: a fallback map this small makes the probes meet what they must
            // report when it is full (records written early, diagnostics in the log).
            if let Some(n) = std::env::var("OBSERVER_TEST_FALLBACK_ENTRIES")
                .ok()
                .and_then(|v| v.parse::<u32>().ok())
                .filter(|&n| n > 0)
            {
                log::warn!(
                    "OBSERVER_TEST_FALLBACK_ENTRIES: the probes' fallback map holds {n} traversals"
                );
                loader.map_max_entries("PENDING", n);
            }
            loader
                .override_global(aya_log::LEVEL, &log_level, false)
                // Where the kernel's consume_skb tracepoint has no `location`, the probe
                // must not read it: the verifier refuses a load past the last argument.
                .override_global(
                    "CONSUME_SKB_LOCATION",
                    &u8::from(layout.consume_skb_location),
                    true,
                )
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
                )?
        };
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
        // Loaded now (the verifier takes seconds on them), so that tracing starts at once
        // when a client comes. Counting needs none: where the kernel refuses them, the agent
        // still counts, and says why it cannot trace (`Probes::tracing_refused`).
        let tc_refused = match load_tc_programs(&mut ebpf) {
            Ok(()) => None,
            Err(e) if !tracing => {
                log::warn!("{e:#}: traversals cannot be recorded on this kernel");
                Some(format!("{e:#}"))
            }
            Err(e) => return Err(e),
        };
        let mut btf = None;
        let mut consume_link = None;
        for (prog, tp) in END_TRACEPOINTS {
            // Counting needs the drops only; the other is loaded now all the same (while
            // the BTF is at hand), so that tracing, when it starts, reads no BTF.
            if tracing || tp == "kfree_skb" {
                let link = attach_tracepoint(&mut ebpf, &mut btf, prog, tp)?;
                if tp != "kfree_skb" {
                    consume_link = Some(link);
                }
            } else if let Err(e) = load_tracepoint(&mut ebpf, &mut btf, prog, tp) {
                // Tried again when tracing starts, which says what went wrong.
                log::debug!("{e:#}");
            }
        }
        drop(btf);
        if tracing {
            attach_socket_probe(&mut ebpf)?;
        }
        let fds: HashMap<String, RawFd> = MAPS
            .iter()
            .map(|m| Ok((m.to_string(), map_fd(&ebpf, m)?)))
            .collect::<Result<_>>()?;
        let shared = capture::Shared {
            maps: &fds,
            fields: &layout.config,
            rdonly_cast,
        };
        let capture = capture::choose(None, layout, &shared)?;
        if let Chosen::Refused(why) = &capture {
            info!("no per-table probes can be attached: {why}");
        }
        // The diagnostics' reader exists only when they are on.
        let log = if log_level == 0 {
            None
        } else {
            Some(
                aya_log::EbpfLogger::init(&mut ebpf)
                    .context("reading the probes' diagnostics (aya-log's AYA_LOGS map)")?,
            )
        };
        Ok(Self {
            ebpf,
            capture,
            log,
            tc: HashMap::new(),
            tc_failed: HashSet::new(),
            tc_guard: Default::default(),
            attach_failures: 0,
            plans: Vec::new(),
            generation: 0,
            collected: 0,
            tracing,
            tc_refused,
            consume_link,
        })
    }

    /// Hands the probes' diagnostics written since the last call to the user's log
    /// (nothing to do when they are off).
    pub fn flush_log(&mut self) {
        if let Some(l) = &mut self.log {
            l.flush();
        }
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
        if let Some(why) = &self.tc_refused {
            anyhow::bail!("{why}");
        }
        self.clear_in_flight()?;
        self.set_filter(filter)?;
        let (prog, tp) = END_TRACEPOINTS[1];
        // Loaded at start: no BTF read here (unless that load failed).
        self.consume_link = Some(attach_tracepoint(&mut self.ebpf, &mut None, prog, tp)?);
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
        if let Some(link) = self.consume_link.take() {
            detach_tracepoint(&mut self.ebpf, END_TRACEPOINTS[1].0, link);
        }
        self.unload_program("observer_sock_ingress");
        info!("counting only: traversals are no longer recorded");
        Ok(())
    }
}
