//! `observer tail`: attach, then stream one report per packet traversal until told to stop.
//! Data flows one way: ring buffer -> decode -> correlate -> report -> stdout.

use std::collections::HashMap;
use std::io::Write;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use log::{info, warn};
use tokio::io::unix::AsyncFd;
use tokio::signal::unix::{SignalKind, signal};

use crate::btf::KernelLayout;
use crate::correlate::{Closed, Correlator, Traversal};
use crate::decode::{Point, Record, decode};
use crate::marks::MarkDictionary;
use crate::nf_link::NfHook;
use crate::plan::{custom_priorities, full_plan};
use crate::probes::{KernelCounters, Probes, ifname};
use crate::report::{self, Plans};
use observer_common::filter::FilterProgram;

#[derive(Clone, Debug)]
pub struct TailOptions {
    pub netns: Option<String>,
    pub output: Output,
    /// TOML mark dictionary applied over the defaults and what the live ruleset shows.
    pub marks_file: Option<PathBuf>,
    /// pcap-subset expression evaluated by the probes (docs/filter.md).
    pub filter: Option<String>,
    /// Keep one flow in N (0 or 1: all).
    pub sample: u32,
    pub count: Option<u64>,
    pub ready_file: Option<PathBuf>,
    pub timeout: Option<Duration>,
    pub max_inflight: usize,
    pub idle: Duration,
}

/// How each traversal is printed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Output {
    /// A header line and one line per table, with what it changed and why.
    Tree,
    /// One JSON object per line (schema 1, docs/json-schema.md).
    Json,
    /// One line per packet, for busy nodes.
    Line,
}

/// The mark dictionary for this run: defaults, then the bits the live ruleset shows
/// (KUBE-MARK-MASQ / KUBE-MARK-DROP), then the user's file.
fn mark_dictionary(file: Option<&PathBuf>) -> Result<MarkDictionary> {
    let mut d = MarkDictionary::default();
    if let Ok(out) = std::process::Command::new("iptables-save")
        .args(["-t", "nat"])
        .output()
    {
        for (bit, name) in d.learn_from_iptables_save(&String::from_utf8_lossy(&out.stdout)) {
            info!("live ruleset: {name} is {bit:#x}");
        }
    }
    if let Some(f) = file {
        let text = std::fs::read_to_string(f)
            .with_context(|| format!("reading marks file {}", f.display()))?;
        d.apply_toml(&text)
            .with_context(|| format!("in marks file {}", f.display()))?;
    }
    Ok(d)
}

/// What a tail run saw; printed as the summary line on exit.
#[derive(Debug, Default)]
pub struct Summary {
    pub printed: u64,
    pub kernel: KernelCounters,
    pub evicted: u64,
    pub incomplete_at_exit: u64,
    pub decode_errors: u64,
}

impl std::fmt::Display for Summary {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "observer: {} traversals printed; kernel: {} records written, {} lost (ring buffer \
             full), {} failed reads, {} filtered out, {} sampled out; collector: {} evicted \
             (too many in flight), {} incomplete at exit, {} undecodable",
            self.printed,
            self.kernel.emitted,
            self.kernel.ringbuf_full,
            self.kernel.read_failed,
            self.kernel.filtered,
            self.kernel.sampled_out,
            self.evicted,
            self.incomplete_at_exit,
            self.decode_errors
        )
    }
}

/// Runs the tail. Must be called before any other thread exists: it moves the process's
/// (single) thread into the target namespace, where every probe then attaches.
pub fn run(opts: TailOptions) -> Result<Summary> {
    if let Some(ns) = &opts.netns {
        crate::netns::enter(ns)?;
    }
    let layout = KernelLayout::from_kernel()?;
    let marks = mark_dictionary(opts.marks_file.as_ref())?;
    // Interface names in the filter are those of the observed namespace, entered above.
    let mut program = match &opts.filter {
        Some(expr) => crate::filter::compile(expr, &|name| crate::probes::ifindex(name))?,
        None => FilterProgram::KEEP_ALL,
    };
    program.sample = opts.sample;
    let mut probes = Probes::load(&layout, &program)?;
    let custom = std::process::Command::new("nft")
        .args(["-j", "list", "ruleset"])
        .output()
        .map(|o| custom_priorities(&String::from_utf8_lossy(&o.stdout)))
        .unwrap_or_default();
    if !custom.is_empty() {
        info!("bracketing custom nftables base-chain priorities: {custom:?}");
    }
    probes.attach_netfilter(full_plan(&custom))?;
    let ifaces = probes.attach_tc_new_interfaces()?;
    info!(
        "attached {} netfilter probes and tcx on {}",
        probes.netfilter_links(),
        ifaces.join(", ")
    );
    let ring = probes.take_ring()?;
    if let Some(path) = &opts.ready_file {
        std::fs::write(path, format!("{}\n", std::process::id()))
            .with_context(|| format!("writing ready file {}", path.display()))?;
    }
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    rt.block_on(event_loop(opts, probes, ring, layout, marks))
}

async fn event_loop(
    opts: TailOptions,
    mut probes: Probes,
    ring: aya::maps::RingBuf<aya::maps::MapData>,
    layout: KernelLayout,
    marks: MarkDictionary,
) -> Result<Summary> {
    let plans: Plans = report::index_plans(&probes.plans);
    let last_slot = probes
        .plans
        .iter()
        .map(|p| ((p.family, p.hook), p.points.len() - 1))
        .filter(|((_, h), _)| *h == NfHook::LocalIn)
        .collect::<HashMap<_, _>>();
    let mut correlator = Correlator::new(opts.max_inflight, opts.idle.as_nanos() as u64, last_slot);
    let netns = opts.netns.clone().unwrap_or_else(|| "current".into());
    // Interface names by index: a syscall each, so asked once per index.
    let names = std::cell::RefCell::new(HashMap::new());
    let ctx = report::Context {
        plans: &plans,
        netns: &netns,
        marks: &marks,
        drop_reasons: &layout.drop_reasons,
        ifname: &|i| cached_ifname(&names, i),
    };
    // SAFETY: the ring buffer owns its fd and outlives the registration (both live here).
    let mut ring = unsafe { AsyncFd::register(ring) }
        .map_err(|e| anyhow::anyhow!("polling the ring buffer: {e}"))?;
    let mut sigint = signal(SignalKind::interrupt())?;
    let mut sigterm = signal(SignalKind::terminate())?;
    let mut tick = tokio::time::interval(Duration::from_millis(100));
    // The probes wake us only when the ring buffer fills; otherwise we drain it on this timer.
    let mut drain_tick = tokio::time::interval(Duration::from_millis(10));
    let mut lost_now = 0u64;
    let deadline = opts.timeout.map(|t| Instant::now() + t);
    let mut summary = Summary::default();
    let mut reported_lost = 0u64;
    let mut last_iface_scan = Instant::now();
    let mut done: Vec<Traversal> = Vec::new();
    let stdout = std::io::stdout();

    let mut emit =
        |done: &mut Vec<Traversal>, summary: &mut Summary, lost_now: u64| -> Result<bool> {
            let mut out = stdout.lock();
            for t in done.drain(..) {
                if t.closed == Closed::Shutdown {
                    summary.incomplete_at_exit += 1;
                    continue;
                }
                if opts.count.is_some_and(|n| summary.printed >= n) {
                    continue;
                }
                let lost = lost_now - reported_lost;
                reported_lost = lost_now;
                let r = report::build(&t, &ctx, lost);
                match opts.output {
                    Output::Json => writeln!(out, "{}", r.to_json_line())?,
                    Output::Tree => writeln!(out, "{}", r.render_tree())?,
                    Output::Line => writeln!(out, "{}", r.render_line())?,
                }
                summary.printed += 1;
            }
            out.flush()?;
            Ok(opts.count.is_some_and(|n| summary.printed >= n))
        };

    loop {
        tokio::select! {
            guard = ring.readable_mut() => {
                let mut guard = guard?;
                drain_ring(guard.get_inner_mut(), &layout, &plans, &mut correlator, &mut done, &mut summary);
                guard.clear_ready();
            }
            _ = drain_tick.tick() => {
                drain_ring(ring.get_mut(), &layout, &plans, &mut correlator, &mut done, &mut summary);
            }
            _ = tick.tick() => {
                lost_now = probes.counters().map(|c| c.ringbuf_full).unwrap_or(lost_now);
                correlator.expire(now_ns(), &mut done);
                if last_iface_scan.elapsed() >= Duration::from_secs(1) {
                    last_iface_scan = Instant::now();
                    match probes.attach_tc_new_interfaces() {
                        Ok(new) if !new.is_empty() => info!("tcx attached on new interfaces {}", new.join(", ")),
                        Ok(_) => {}
                        Err(e) => warn!("{e:#}"),
                    }
                }
                if deadline.is_some_and(|d| Instant::now() >= d) {
                    break;
                }
            }
            _ = sigint.recv() => break,
            _ = sigterm.recv() => break,
        }
        if !done.is_empty() && emit(&mut done, &mut summary, lost_now)? {
            break;
        }
    }
    // What the probes wrote before we stopped is still owed to the user.
    drain_ring(
        ring.get_mut(),
        &layout,
        &plans,
        &mut correlator,
        &mut done,
        &mut summary,
    );
    correlator.drain(&mut done);
    summary.kernel = probes.counters()?;
    let lost_now = summary.kernel.ringbuf_full;
    emit(&mut done, &mut summary, lost_now)?;
    summary.evicted = correlator.stats.evicted;
    Ok(summary)
}

fn cached_ifname(names: &std::cell::RefCell<HashMap<u32, String>>, index: u32) -> String {
    names
        .borrow_mut()
        .entry(index)
        .or_insert_with(|| ifname(index))
        .clone()
}

fn drain_ring(
    rb: &mut aya::maps::RingBuf<aya::maps::MapData>,
    layout: &KernelLayout,
    plans: &Plans,
    correlator: &mut Correlator,
    done: &mut Vec<Traversal>,
    summary: &mut Summary,
) {
    while let Some(item) = rb.next() {
        match decode(&item, &layout.tuple) {
            Ok(Record::Packet(mut o)) => {
                // Records name the probe program; everything downstream uses the point.
                if let (Point::Netfilter(hook, program), Some(family)) = (o.point, o.family)
                    && let Some(at) = plans.get(&(family, hook)).and_then(|p| p.point_of(program))
                {
                    o.point = Point::Netfilter(hook, at);
                }
                log::trace!("record {:?} skb {:#x} mark {:#x}", o.point, o.skb, o.mark);
                correlator.push(o, done)
            }
            Ok(Record::Drop(d)) => correlator.push_drop(d, done),
            Err(e) => {
                summary.decode_errors += 1;
                warn!("undecodable record: {e}");
            }
        }
    }
}

/// CLOCK_MONOTONIC in ns, the clock `bpf_ktime_get_ns` reads.
fn now_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: ts is a valid timespec.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}
