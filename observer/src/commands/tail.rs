//! `observer tail`: attach, then stream one report per packet traversal until told to stop.
//! Data flows one way: ring buffer -> decode -> correlate -> report -> stdout.
//!
//! Bounded and responsive at any load: the ring buffer is drained in batches that give the
//! event loop its turn (signals and `--timeout` act within a batch), no per-packet state is
//! kept in userspace (the probes assemble traversals), and every packet the probes saw is
//! accounted for in the summary: printed, lost, left out, or still in flight.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use log::{info, warn};
use serde::Serialize;
use tokio::io::unix::AsyncFd;
use tokio::signal::unix::{SignalKind, signal};

use crate::kernel::btf::KernelLayout;
use crate::kernel::probes::{KernelCounters, Probes};
use crate::kernel::upkeep::{
    RulesetReader, SOCKET_GRACE, attach_probes, legacy_tables, mark_dictionary, now_ns, read_live,
    watch_ruleset,
};
use crate::output::Writer;
use crate::output::pcapng::{PacketStore, PcapngStats, PcapngWriter, monotonic_to_unix};
use crate::output::recording::{Header, Recorder};
pub use crate::pipeline::Output;
use crate::pipeline::decode::encode_record;
use crate::pipeline::rulenames::RuleNamer;
use crate::pipeline::{Context as PipelineContext, LiveNames, Outcome, PacketInfo, Pipeline};
use observer_common::filter::FilterProgram;
use observer_common::traversal::{TraversalRecord, end};
use observer_rules::LiveNode;

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
    /// A traversal waiting in the probes' fallback map this long is reported as incomplete.
    pub idle: Duration,
    /// Where to write the summary as JSON at exit.
    pub stats_file: Option<PathBuf>,
    /// Benchmarks: probes attached but returning at once.
    pub floor: bool,
    /// Save every record with its context here, for `observer replay`.
    pub record: Option<PathBuf>,
    /// Write each printed traversal's packet here (pcap-ng, its report line as comment).
    pub pcapng: Option<PathBuf>,
    /// Name the rules of each stage from the live ruleset (and check them against the
    /// kernel).
    pub rules: bool,
}

/// Records handled before the event loop looks at signals and timers again: at about
/// 10 us per printed traversal, a batch is a few tens of milliseconds.
const BATCH: usize = 2048;
/// At exit, how long the remaining records are still printed; the rest are counted. With
/// the other bounded waits of the exit (the probes' last runs, stdout's reader) it keeps
/// SIGINT-to-exit well inside 200 ms under a flood.
const FINAL_DRAIN: Duration = Duration::from_millis(50);

/// What a tail run saw, in packets; printed on exit and written by `--stats`.
#[derive(Debug, Default, Serialize)]
pub struct Summary {
    /// Packets that entered the observed namespace's hooks.
    pub seen: u64,
    /// Traversals printed (complete or flagged incomplete).
    pub printed: u64,
    /// Packets the probes could not record (the ring buffer was full).
    pub lost: u64,
    /// Of `printed`, those flagged incomplete.
    pub incomplete: u64,
    /// Packets left out by `--filter`.
    pub filtered: u64,
    /// Packets left out by `--sample`.
    pub sampled: u64,
    /// Packets still followed by the probes at exit (kept by the filter).
    pub in_flight: u64,
    /// Packets still followed at exit that the filter or sampling had left out.
    pub in_flight_left_out: u64,
    /// Traversals recorded but not printed: beyond `--count`, past the exit drain, or
    /// undecodable.
    pub not_printed: u64,
    /// Probe attachments that failed (interfaces left without tcx probes).
    pub attach_failures: u64,
    /// Of `printed`, traversals where some stage's rules disagree with what the kernel did.
    pub rules_disagree: u64,
    /// Of `printed`, traversals where some stage's rules could not be decided.
    pub rules_undecidable: u64,
    /// Why the tail stopped.
    pub stopped_by: &'static str,
    /// With `--record`: what the recording holds.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub record: Option<RecordStats>,
    /// With `--pcapng`: what the file holds.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pcapng: Option<PcapngStats>,
    #[serde(skip)]
    pub kernel: KernelCounters,
}

/// What `--record` wrote, in traversal records.
#[derive(Debug, Default, Serialize)]
pub struct RecordStats {
    /// Records written to the recording.
    pub records: u64,
    /// Records handled but not written (the file could not be written).
    pub failed: u64,
}

impl std::fmt::Display for Summary {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "observer: {} packets seen: {} traversals printed ({} incomplete), {} lost (ring \
             buffer full), {} filtered out, {} sampled out, {} in flight at exit, {} not \
             printed; {} attach failures; stopped by {}",
            self.seen,
            self.printed,
            self.incomplete,
            self.lost,
            self.filtered,
            self.sampled,
            self.in_flight + self.in_flight_left_out,
            self.not_printed,
            self.attach_failures,
            self.stopped_by,
        )?;
        if self.rules_disagree + self.rules_undecidable > 0 {
            write!(
                f,
                "; rules named: {} traversals where they disagree with the kernel, {} undecidable",
                self.rules_disagree, self.rules_undecidable
            )?;
        }
        if let Some(r) = &self.record {
            write!(f, "; {} records recorded", r.records)?;
            if r.failed > 0 {
                write!(f, " ({} could not be written to the recording)", r.failed)?;
            }
        }
        if let Some(p) = &self.pcapng {
            write!(f, "; {} packets in the pcap-ng file", p.packets)?;
            if p.without_bytes > 0 {
                write!(f, " ({} without their bytes)", p.without_bytes)?;
            }
            if p.bytes_lost > 0 {
                write!(
                    f,
                    ", {} packets' bytes lost (packet ring buffer full)",
                    p.bytes_lost
                )?;
            }
            if p.failed > 0 {
                write!(f, ", {} not written (file error)", p.failed)?;
            }
        }
        if self.kernel.fallback_failed > 0 {
            write!(
                f,
                " ({} moves to the fallback map failed)",
                self.kernel.fallback_failed
            )?;
        }
        Ok(())
    }
}

/// Runs the tail. Must be called before any other thread exists: it moves the process's
/// (single) thread into the target namespace, where every probe then attaches.
pub fn run(opts: TailOptions) -> Result<Summary> {
    if let Some(ns) = &opts.netns {
        crate::kernel::netns::enter(ns)?;
    }
    let mut layout = KernelLayout::from_kernel()?;
    let pcapng = match &opts.pcapng {
        Some(path) => {
            layout.config[observer_common::config::CAPTURE_BYTES as usize] = 1;
            Some(PcapngWriter::create(path)?)
        }
        None => None,
    };
    let live = read_live();
    let marks = mark_dictionary(&live, opts.marks_file.as_ref())?;
    let netns = opts.netns.clone().unwrap_or_else(|| "current".into());
    let recorder = match &opts.record {
        Some(path) => Some(Recorder::create(
            path,
            &Header::new(&netns, &layout.tuple, &layout.drop_reasons, &marks),
        )?),
        None => None,
    };
    let mut pipeline = Pipeline::new(
        PipelineContext {
            output: opts.output,
            netns,
            tuple: layout.tuple,
            drop_reasons: layout.drop_reasons.clone(),
            marks,
            namer: opts.rules.then(|| RuleNamer::new(&live, 0)),
        },
        Box::new(LiveNames::load()),
    );
    if let Some(r) = recorder {
        pipeline.record_to(r);
        pipeline.record_ruleset(&live.texts);
    }
    pipeline.packet_info = pcapng.is_some();
    // Interface names in the filter are those of the observed namespace, entered above.
    let mut program = match &opts.filter {
        Some(expr) => crate::filter::compile(expr, &|name| crate::kernel::netns::ifindex(name))?,
        None => FilterProgram::KEEP_ALL,
    };
    program.sample = opts.sample;
    let mut probes = attach_probes(&layout, &program, &live, opts.floor)?;
    let ring = probes.take_ring()?;
    let pcap = match pcapng {
        Some(writer) => Some(Pcap {
            writer,
            ring: probes.take_packets()?,
            store: PacketStore::new(PACKETS_HELD),
            clock: monotonic_to_unix(),
        }),
        None => None,
    };
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let summary = rt.block_on(event_loop(&opts, probes, ring, pipeline, pcap))?;
    if let Some(path) = &opts.stats_file {
        std::fs::write(path, serde_json::to_string(&summary)? + "\n")
            .with_context(|| format!("writing stats file {}", path.display()))?;
    }
    Ok(summary)
}

/// Packet bytes waiting for their traversal (`--pcapng`): at most this many (160 bytes each).
const PACKETS_HELD: usize = 65536;

/// `--pcapng`: the probes' packet bytes, paired with the traversals printed.
struct Pcap {
    writer: PcapngWriter,
    ring: aya::maps::RingBuf<aya::maps::MapData>,
    store: PacketStore,
    /// `CLOCK_MONOTONIC` -> Unix time, ns.
    clock: u64,
}

impl Pcap {
    fn drain(&mut self) {
        while let Some(item) = self.ring.next() {
            match crate::output::pcapng::decode(&item) {
                Ok(p) => self.store.insert(p),
                Err(e) => warn!("undecodable packet bytes: {e}"),
            }
        }
    }

    /// Writes a printed traversal's packet. Its bytes were written when it started, so
    /// before its record; if they were not read yet, they are now.
    fn write(&mut self, t: &PacketInfo) {
        let mut bytes = self.store.take(t.skb, t.ts_first);
        if bytes.is_none() {
            self.drain();
            bytes = self.store.take(t.skb, t.ts_first);
        }
        self.writer
            .write(&t.iface, t.ts_first + self.clock, bytes.as_ref(), &t.line);
    }
}

/// The pipeline and where its reports go.
struct Printer<'a> {
    opts: &'a TailOptions,
    pipeline: Pipeline,
    pcap: Option<Pcap>,
    out: Writer,
    /// Traversals formatted for output (the writer thread says how many reached stdout).
    formatted: u64,
    /// The kernel's count of lost packets, as last read.
    lost_now: u64,
}

impl Printer<'_> {
    fn count_reached(&self) -> bool {
        self.opts.count.is_some_and(|n| self.formatted >= n)
    }

    /// Prints one record (ring-buffer bytes); returns whether `--count` is reached.
    fn print(&mut self, raw: &[u8], summary: &mut Summary) -> bool {
        if self.out.closed() || self.count_reached() {
            summary.not_printed += 1;
            return true;
        }
        match self.pipeline.handle(raw, self.lost_now) {
            Outcome::Report {
                bytes,
                incomplete,
                rules_disagree,
                rules_undecidable,
                packet,
            } => {
                if let (Some(pcap), Some(packet)) = (&mut self.pcap, &packet) {
                    pcap.write(packet);
                }
                self.out.put(bytes);
                self.formatted += 1;
                summary.incomplete += u64::from(incomplete);
                summary.rules_disagree += u64::from(rules_disagree);
                summary.rules_undecidable += u64::from(rules_undecidable);
            }
            other => {
                crate::pipeline::warn_unusable(&other);
                summary.not_printed += 1;
            }
        }
        self.count_reached()
    }

    /// Prints a record taken from the probes' maps.
    fn print_record(&mut self, rec: &TraversalRecord, summary: &mut Summary) -> bool {
        self.print(&encode_record(rec), summary)
    }

    /// The recording and the pcap-ng file, up to date on disk every tick.
    fn flush_files(&mut self) {
        if let Some(r) = self.pipeline.recorder_mut() {
            r.flush();
        }
        if let Some(p) = &mut self.pcap {
            p.writer.flush();
        }
    }

    /// Hands the formatted reports to the writer thread; false while it is behind.
    fn flush(&mut self) -> bool {
        self.out.push()
    }
}

/// Drains up to `max` records; returns how many were read and whether `--count` is reached.
fn drain(
    ring: &mut aya::maps::RingBuf<aya::maps::MapData>,
    printer: &mut Printer,
    summary: &mut Summary,
    max: usize,
) -> (usize, bool) {
    let mut n = 0;
    let mut done = false;
    // Backpressure: while stdout's reader is behind, records wait in the ring buffer.
    if !printer.flush() {
        return (0, false);
    }
    if let Some(p) = &mut printer.pcap {
        p.drain();
    }
    // ... and as soon as it falls behind within the batch: a chunk then holds at most one
    // chunk's worth, whatever the length of the lines (rules make them longer).
    while n < max && !printer.out.behind() {
        let Some(item) = ring.next() else { break };
        n += 1;
        done |= printer.print(&item, summary);
    }
    (n, done)
}

/// Standard output without the standard library's line buffer in the way: the writer
/// hands whole reports to one `writev`, which a line-buffered `Stdout` would split.
fn raw_stdout() -> Result<std::fs::File> {
    use std::os::fd::AsFd;
    let fd = std::io::stdout()
        .as_fd()
        .try_clone_to_owned()
        .context("duplicating standard output")?;
    Ok(std::fs::File::from(fd))
}

async fn event_loop(
    opts: &TailOptions,
    mut probes: Probes,
    ring: aya::maps::RingBuf<aya::maps::MapData>,
    mut pipeline: Pipeline,
    pcap: Option<Pcap>,
) -> Result<Summary> {
    pipeline.add_plans(probes.generation(), &probes.plans);
    let mut printer = Printer {
        opts,
        pipeline,
        pcap,
        out: Writer::new(raw_stdout()?),
        formatted: 0,
        lost_now: 0,
    };
    // SAFETY: the ring buffer owns its fd and outlives the registration (both live here).
    let mut ring = unsafe { AsyncFd::register(ring) }
        .map_err(|e| anyhow::anyhow!("polling the ring buffer: {e}"))?;
    let mut sigint = signal(SignalKind::interrupt())?;
    let mut sigterm = signal(SignalKind::terminate())?;
    let mut sighup = signal(SignalKind::hangup())?;
    // Ready only once the signals are ours: a SIGHUP or SIGINT from now on ends the tail
    // with its summary.
    if let Some(path) = &opts.ready_file {
        std::fs::write(path, format!("{}\n", std::process::id()))
            .with_context(|| format!("writing ready file {}", path.display()))?;
    }
    let mut tick = tokio::time::interval(Duration::from_millis(100));
    // The probes wake us only when the ring buffer fills; otherwise we drain it on this timer.
    let mut drain_tick = tokio::time::interval(Duration::from_millis(10));
    drain_tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let deadline = opts.timeout.map(|t| Instant::now() + t);
    let netns_file = opts
        .netns
        .as_ref()
        .map(|n| PathBuf::from("/run/netns").join(n));
    let netns_inode = crate::kernel::netns::current_netns_inode()?;
    let mut legacy_names = legacy_tables().0;
    let mut summary = Summary::default();
    let mut last_scan = Instant::now();
    // nf_tables changes: new base chains are bracketed within a second of appearing.
    let watch = watch_ruleset();
    let mut ruleset = RulesetReader::default();
    let stopped_by: &'static str = loop {
        if opts.count == Some(0) {
            break "--count";
        }
        tokio::select! {
            biased;
            _ = sigint.recv() => break "SIGINT",
            _ = sigterm.recv() => break "SIGTERM",
            _ = sighup.recv() => break "SIGHUP",
            _ = tokio::time::sleep_until(deadline.map_or_else(
                || tokio::time::Instant::now() + Duration::from_secs(3600),
                tokio::time::Instant::from_std)), if deadline.is_some() => break "--timeout",
            guard = async { watch.as_ref().expect("guarded").readable().await }, if watch.is_some() => {
                let mut guard = guard?;
                if guard.get_inner().drain() {
                    ruleset.changed();
                }
                guard.clear_ready();
            }
            _ = tick.tick() => {
                printer.flush_files();
                if let Some((since, live)) = ruleset.poll() {
                    replan(&mut probes, &mut printer, since, &live);
                }
                printer.lost_now = probes.counters().map(|c| c.ringbuf_full).unwrap_or(printer.lost_now);
                sweep(&mut probes, &mut printer, &mut summary, opts);
                if last_scan.elapsed() >= Duration::from_secs(1) {
                    last_scan = Instant::now();
                    if let Some(why) = housekeeping(&mut probes, &mut printer, netns_file.as_deref(), netns_inode) {
                        break why;
                    }
                    // Legacy x_tables announce nothing: a table loaded since is seen here.
                    let legacy = legacy_tables().0;
                    if legacy != legacy_names {
                        legacy_names = legacy;
                        ruleset.changed();
                    }
                }
            }
            guard = ring.readable_mut() => {
                let mut guard = guard?;
                let (n, done) = drain(guard.get_inner_mut(), &mut printer, &mut summary, BATCH);
                if n < BATCH {
                    guard.clear_ready();
                }
                printer.flush();
                if printer.out.closed() { break "closed stdout"; }
                if done { break "--count"; }
            }
            _ = drain_tick.tick() => {
                let (_, done) = drain(ring.get_mut(), &mut printer, &mut summary, BATCH);
                printer.flush();
                if printer.out.closed() { break "closed stdout"; }
                if done { break "--count"; }
            }
        }
    };
    // Nothing more comes in from here: what the probes hold now is all there is to account.
    // Every probe is told at once to stop (the floor flag) before any is detached, so that
    // no traversal is written with some of its probes already gone; one still on its way
    // stays in its slot and is counted as in flight. (A probe already running on another
    // CPU when the flag is set finishes within microseconds; 10 ms covers a preempted one.)
    let stopping = Instant::now();
    if let Err(e) = probes.set_floor(true) {
        warn!("stopping the probes: {e:#}");
    }
    let releasing = probes.detach();
    log::debug!("exit: probes detached after {:?}", stopping.elapsed());
    std::thread::sleep(Duration::from_millis(10));
    // What the probes wrote before we stopped is still owed to the user, within a bound:
    // under a flood the ring buffer holds more than can be printed promptly. Traversals
    // waiting in the fallback map are printed too, as still in flight (a socket's as
    // delivered); only those in per-CPU slots, which the probes may still be writing, are
    // just counted.
    take_waiting(
        &mut probes,
        &mut printer,
        &mut summary,
        (u64::MAX, u64::MAX),
        end::IN_FLIGHT,
    );
    let until = Instant::now() + FINAL_DRAIN;
    while Instant::now() < until && !printer.out.closed() {
        let (n, _) = drain(ring.get_mut(), &mut printer, &mut summary, 256);
        if n == 0 && !printer.out.behind() {
            break;
        }
    }
    log::debug!("exit: ring buffer drained after {:?}", stopping.elapsed());
    // Counted, not printed (the probes are detached: the ring buffer only empties).
    let mut rest = 0;
    while ring.get_mut().next().is_some() {
        rest += 1;
    }
    summary.not_printed += rest;
    // Then a moment for stdout's reader (30 ms, and up to 20 more to end the report being
    // written); what it has not taken by then is counted.
    let (written, unwritten) = printer.out.finish(Duration::from_millis(30));
    summary.printed = written;
    summary.not_printed += unwritten;
    log::debug!("exit: output finished after {:?}", stopping.elapsed());
    let k = probes.counters()?;
    let inflight = probes.in_flight().unwrap_or_default();
    summary.seen = k.seen;
    summary.lost = k.ringbuf_full;
    summary.filtered = k.filtered;
    summary.sampled = k.sampled_out;
    summary.in_flight = inflight.kept;
    summary.in_flight_left_out = inflight.left_out;
    summary.attach_failures = probes.attach_failures;
    summary.stopped_by = stopped_by;
    let _ = releasing.join();
    log::debug!(
        "exit: counted, links released after {:?}",
        stopping.elapsed()
    );
    summary.kernel = k;
    if let Some(mut r) = printer.pipeline.take_recorder() {
        if !r.finish() {
            // What was buffered is lost; the file holds the records before it at least.
            warn!(
                "the end of the recording {} may be missing",
                r.path().display()
            );
        }
        summary.record = Some(RecordStats {
            records: r.records,
            failed: r.failed,
        });
    }
    if let Some(mut p) = printer.pcap.take() {
        p.writer.finish();
        let mut stats = p.writer.stats;
        stats.bytes_lost = probes.packets_lost().unwrap_or_else(|e| {
            warn!("reading the probes' count of lost packet bytes: {e:#}");
            0
        });
        summary.pcapng = Some(stats);
    }
    // A record written between the drain and the counters is neither printed nor in flight.
    let accounted = summary.printed
        + summary.lost
        + summary.filtered
        + summary.sampled
        + summary.in_flight
        + summary.in_flight_left_out
        + summary.not_printed;
    if accounted < summary.seen {
        summary.not_printed += summary.seen - accounted;
    }
    Ok(summary)
}

/// After a ruleset change (at `since`, ns) the node was read again (`live`): brackets the
/// tables it has now, and names rules and mark bits from it from now on.
fn replan(probes: &mut Probes, printer: &mut Printer, since: u64, live: &LiveNode) {
    let marks = match mark_dictionary(live, printer.opts.marks_file.as_ref()) {
        Ok(m) => Some(m),
        Err(e) => {
            warn!("mark names not updated after the ruleset change: {e:#}");
            None
        }
    };
    let namer = printer.pipeline.ctx.namer.as_ref().map(|n| {
        let generation = n.generation + 1;
        info!("ruleset changed: rules re-read (generation {generation})");
        RuleNamer::new(live, generation)
    });
    printer.pipeline.ruleset_changed(marks, namer);
    printer.pipeline.record_ruleset(&live.texts);
    if crate::kernel::upkeep::replan(probes, live) {
        printer
            .pipeline
            .add_plans(probes.generation(), &probes.plans);
        printer.pipeline.replanned(since, now_ns());
    }
}

/// Prints the traversals the probes hand over: delivered to a socket, or idle.
fn sweep(probes: &mut Probes, printer: &mut Printer, summary: &mut Summary, opts: &TailOptions) {
    let now = now_ns();
    let socket_before = now.saturating_sub(SOCKET_GRACE.as_nanos() as u64);
    let idle_before = now.saturating_sub(opts.idle.as_nanos() as u64);
    take_waiting(
        probes,
        printer,
        summary,
        (socket_before, idle_before),
        end::IDLE,
    );
}

/// Prints the fallback-map traversals the probes hand over: a socket's held since before
/// `before.0` as delivered, any other not heard of since `before.1` ending as `idle_end`.
fn take_waiting(
    probes: &mut Probes,
    printer: &mut Printer,
    summary: &mut Summary,
    before: (u64, u64),
    idle_end: u8,
) {
    match probes.sweep(before.0, before.1, idle_end) {
        Ok(recs) => {
            for r in &recs {
                printer.print_record(r, summary);
            }
            printer.flush();
        }
        Err(e) => warn!("reading the probes' fallback map: {e:#}"),
    }
}

/// Once a second: interfaces and the namespace. Returns why to stop, if so.
fn housekeeping(
    probes: &mut Probes,
    printer: &mut Printer,
    netns_file: Option<&std::path::Path>,
    netns_inode: u64,
) -> Option<&'static str> {
    let h = crate::kernel::upkeep::housekeeping(probes, netns_file, netns_inode);
    if h.names_changed {
        printer.pipeline.forget_names();
    }
    h.stop
}
