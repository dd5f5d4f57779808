//! `observer tail`: attach, then stream one report per packet traversal until told to stop.
//! Data flows one way: ring buffer -> decode -> correlate -> report -> stdout.
//!
//! Bounded and responsive at any load: the ring buffer is drained in batches that give the
//! event loop its turn (signals and `--timeout` act within a batch), no per-packet state is
//! kept in userspace (the probes assemble traversals), and every packet the probes saw is
//! accounted for in the summary: printed, lost, left out, or still in flight.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, Result};
use log::{info, warn};
use serde::Serialize;

use crate::kernel::btf::KernelLayout;
use crate::kernel::probes::KernelCounters;
use crate::kernel::session::{Consumer, Next, Replan, Session, SessionOptions, Stop, Tick};
use crate::kernel::upkeep::{attach_probes, mark_dictionary, read_live};
use crate::output::Writer;
use crate::output::pcapng::{PacketStore, PcapngStats, PcapngWriter, monotonic_to_unix};
use crate::output::recording::{Header, Recorder};
pub use crate::pipeline::Output;
use crate::pipeline::rulenames::RuleNamer;
use crate::pipeline::subscription::Subscription;
use crate::pipeline::{
    Context as PipelineContext, Handled, LiveNames, Outcome, PacketInfo, Pipeline, Sink,
};

#[derive(Clone, Debug)]
pub struct TailOptions {
    pub netns: Option<String>,
    /// What to print, which traversals (the filter runs in the probes), until when.
    pub wants: Subscription,
    /// TOML mark dictionary applied over the defaults and what the live ruleset shows.
    pub marks_file: Option<PathBuf>,
    pub ready_file: Option<PathBuf>,
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
    /// Observe the nft bridge family's chains through nf_tables' trace (a table of
    /// observer's own, removed by the kernel when observer exits) instead of simulating them.
    pub trace_bridge_chains: bool,
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
    /// Of `incomplete`, copies a bridge made of a frame it flooded to several ports: each
    /// reported from the bridge's FORWARD with the port it left by.
    pub flooded_copies: u64,
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
    /// With `--trace-bridge-chains`: what nf_tables' trace showed of the bridge family's
    /// chains.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bridge_trace: Option<crate::kernel::bridgetrace::TraceCounts>,
    /// How the per-table probes were attached (the capture backend, by its `--backend`
    /// name).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub capture_backend: Option<crate::kernel::capture::BackendKind>,
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
             printed; {} attach failures; {}stopped by {}",
            self.seen,
            self.printed,
            self.incomplete,
            self.lost,
            self.filtered,
            self.sampled,
            self.in_flight + self.in_flight_left_out,
            self.not_printed,
            self.attach_failures,
            self.capture_backend
                .map(|k| format!("captured through {k}; "))
                .unwrap_or_default(),
            self.stopped_by,
        )?;
        if self.rules_disagree + self.rules_undecidable > 0 {
            write!(
                f,
                "; rules named: {} traversals where they disagree with the kernel, {} undecidable",
                self.rules_disagree, self.rules_undecidable
            )?;
        }
        if self.flooded_copies > 0 {
            write!(
                f,
                "; {} of the incomplete are copies of flooded frames (reported from the \
                 bridge's FORWARD, with the port each left by)",
                self.flooded_copies
            )?;
        }
        if let Some(b) = &self.bridge_trace {
            write!(
                f,
                "; bridge-family chains observed for {} bridged reports ({} dropped there), {} \
                 bridged reports no trace event matched (simulated instead)",
                b.observed, b.dropped, b.unmatched
            )?;
            if b.overruns > 0 {
                write!(f, ", trace events lost {} times (queue full)", b.overruns)?;
            }
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
    // Read now, where the node has bridge tables: its first counter read is the "before"
    // of the first bridged frames.
    let bridge_chains = (opts.rules
        && live
            .ruleset
            .nft
            .as_ref()
            .is_some_and(|n| n.tables.iter().any(|t| t.id.family == "bridge")))
    .then(|| crate::kernel::bridgechains::BridgeChains::from_live(&live));
    // Before the probes: a node that cannot have the table says so before anything attaches.
    let bridge_trace = if opts.trace_bridge_chains {
        Some(crate::kernel::bridgetrace::BridgeTrace::open(&live)?)
    } else {
        None
    };
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
            output: opts.wants.output,
            netns,
            tuple: layout.tuple,
            drop_reasons: layout.drop_reasons.clone(),
            marks,
            namer: opts.rules.then(|| RuleNamer::new(&live, 0)),
        },
        Box::new(LiveNames::load()),
    );
    let mut recorder = recorder;
    if let Some(r) = &mut recorder {
        pipeline.learn_names = true;
        pipeline.ruleset_to(&live.texts, [r as &mut dyn Sink]);
    }
    pipeline.packet_info = pcapng.is_some();
    pipeline.set_ip_ids(opts.wants.ip_ids);
    // Interface names in the filter are those of the observed namespace, entered above.
    let program = opts.wants.program()?;
    let mut probes = attach_probes(&layout, &program, &live, opts.floor)?;
    let pcap = match pcapng {
        Some(writer) => Some(Pcap {
            writer,
            ring: probes.take_packets()?,
            store: PacketStore::new(PACKETS_HELD),
            clock: monotonic_to_unix(),
        }),
        None => None,
    };
    pipeline.add_plans(probes.generation(), &probes.plans);
    if let Some(r) = &mut recorder {
        r.plans(probes.generation(), &probes.plans);
    }
    let mut printer = Printer {
        opts: &opts,
        pipeline,
        recorder,
        pcap,
        out: Writer::new(raw_stdout()?),
        bridge_chains,
        bridge_trace,
        formatted: 0,
        summary: Summary::default(),
    };
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    rt.block_on(async {
        let session = Session::new(
            probes,
            SessionOptions {
                netns: opts.netns.clone(),
                ready_file: opts.ready_file.clone(),
                timeout: opts.wants.timeout,
                idle: opts.idle,
                batch: BATCH,
                final_drain: FINAL_DRAIN,
            },
        )?;
        session.run(&mut printer).await
    })?;
    let summary = printer.summary;
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

/// The packet of each traversal printed, as the pipeline's sink.
impl Sink for Pcap {
    fn handled(&mut self, h: &Handled<'_>) -> std::io::Result<()> {
        if let Outcome::Report {
            packet: Some(p), ..
        } = h.outcome
        {
            self.write(p);
        }
        Ok(())
    }
}

/// The pipeline and where its reports go: tail's consumer of the session.
struct Printer<'a> {
    opts: &'a TailOptions,
    pipeline: Pipeline,
    /// The pipeline's sinks besides stdout: `--record`, `--pcapng`.
    recorder: Option<Recorder>,
    pcap: Option<Pcap>,
    out: Writer,
    /// Bridged reports' notes on the nft bridge family's chains (simulated, confirmed by
    /// counters): made on the first bridged report.
    bridge_chains: Option<crate::kernel::bridgechains::BridgeChains>,
    /// `--trace-bridge-chains`: the trace table and the frames its events describe.
    bridge_trace: Option<crate::kernel::bridgetrace::BridgeTrace>,
    /// Traversals formatted for output (the writer thread says how many reached stdout).
    formatted: u64,
    summary: Summary,
}

impl Printer<'_> {
    fn count_reached(&self) -> bool {
        self.opts.wants.count.is_some_and(|n| self.formatted >= n)
    }

    /// Notes on what the node's bridge-family chains did to a bridged frame (simulated on
    /// the live ruleset, each rule confirmed by its counter), `None` for other reports.
    fn bridge_chain_notes(
        &mut self,
        raw: &[u8],
        report: &crate::pipeline::Report,
    ) -> Option<Vec<String>> {
        let t = report.traversal();
        t.bridge.as_ref()?;
        let rec = crate::pipeline::decode::decode(raw).ok()?;
        crate::kernel::bridgetrace::bridged_notes(
            self.bridge_trace.as_mut(),
            self.opts.rules.then_some(&mut self.bridge_chains),
            t,
            (rec.ts_first, rec.ts_last),
        )
    }

    /// The pipeline's sinks besides stdout, and the pipeline.
    fn split(&mut self) -> (&mut Pipeline, impl Iterator<Item = &mut dyn Sink>) {
        let sinks = (self.recorder.iter_mut().map(|r| r as &mut dyn Sink))
            .chain(self.pcap.iter_mut().map(|p| p as &mut dyn Sink));
        (&mut self.pipeline, sinks)
    }

    /// The recording and the pcap-ng file, up to date on disk every tick.
    fn flush_files(&mut self) {
        if let Some(r) = &mut self.recorder {
            r.flush();
        }
        if let Some(p) = &mut self.pcap {
            p.writer.flush();
        }
    }
}

impl Consumer for Printer<'_> {
    /// Backpressure: while stdout's reader is behind, records wait in the ring buffer.
    fn ready(&mut self) -> Next {
        if self.out.closed() {
            return Next::Stop("closed stdout");
        }
        if self.count_reached() {
            return Next::Stop("--count");
        }
        if !self.out.push() {
            return Next::Wait;
        }
        if let Some(p) = &mut self.pcap {
            p.drain();
        }
        Next::More
    }

    /// Prints one record (ring-buffer bytes).
    fn on_record(&mut self, raw: &[u8], lost_now: u64) -> Next {
        if self.out.closed() || self.count_reached() {
            self.summary.not_printed += 1;
            return Next::Stop(if self.out.closed() {
                "closed stdout"
            } else {
                "--count"
            });
        }
        let (pipeline, sinks) = self.split();
        // The recording and pcap-ng count their own failures: they never return one.
        let outcome = pipeline
            .handle_to(raw, lost_now, sinks)
            .unwrap_or_else(|e| Outcome::Unusable(e.to_string()));
        match outcome {
            Outcome::Report {
                report,
                bytes,
                incomplete,
                rules_disagree,
                rules_undecidable,
                ..
            } => {
                let bytes = match self.bridge_chain_notes(raw, &report) {
                    Some(notes) => {
                        let mut t = (**report.traversal()).clone();
                        t.notes.extend(notes);
                        crate::pipeline::Report::new(t).render(self.pipeline.ctx.output)
                    }
                    None => bytes,
                };
                self.out.put(bytes);
                self.formatted += 1;
                self.summary.incomplete += u64::from(incomplete);
                self.summary.flooded_copies += u64::from(
                    report
                        .traversal()
                        .bridge
                        .as_ref()
                        .is_some_and(|b| b.flooded),
                );
                self.summary.rules_disagree += u64::from(rules_disagree);
                self.summary.rules_undecidable += u64::from(rules_undecidable);
            }
            other => {
                crate::pipeline::warn_unusable(&other);
                self.summary.not_printed += 1;
            }
        }
        if self.count_reached() {
            Next::Stop("--count")
        } else if self.out.behind() {
            // As soon as stdout falls behind within a batch: a chunk then holds at most
            // one chunk's worth, whatever the length of the lines.
            Next::Wait
        } else {
            Next::More
        }
    }

    fn on_tick(&mut self, tick: Tick<'_>) -> Option<&'static str> {
        self.flush_files();
        // Events wait in the socket's queue until read: read them while they are few.
        if let Some(t) = &mut self.bridge_trace {
            t.drain();
        }
        self.out.push();
        if tick.names_changed {
            self.pipeline.forget_names();
        }
        None
    }

    /// Names rules and mark bits from the node as read again; records made under a new
    /// plan expand through it.
    fn on_replan(&mut self, replan: Replan<'_>) {
        match replan {
            Replan::Ruleset { live, .. } => {
                let marks = match mark_dictionary(live, self.opts.marks_file.as_ref()) {
                    Ok(m) => Some(m),
                    Err(e) => {
                        warn!("mark names not updated after the ruleset change: {e:#}");
                        None
                    }
                };
                let namer = self.pipeline.ctx.namer.as_ref().map(|n| {
                    let generation = n.generation + 1;
                    info!("ruleset changed: rules re-read (generation {generation})");
                    RuleNamer::new(live, generation)
                });
                self.pipeline.ruleset_changed(marks, namer);
                if let Some(t) = &mut self.bridge_trace {
                    t.names_from(live);
                }
                let (pipeline, sinks) = self.split();
                pipeline.ruleset_to(&live.texts, sinks);
            }
            Replan::Plans {
                generation, plans, ..
            } => {
                self.pipeline.add_plans(generation, plans);
                for s in self.split().1 {
                    s.plans(generation, plans);
                }
            }
            Replan::Replanned { from, to } => {
                self.pipeline.replanned(from, to);
                for s in self.split().1 {
                    s.replanned(from, to);
                }
            }
            // A live session looks names up itself.
            Replan::Names { .. } => {}
        }
    }

    fn on_stop(&mut self, stop: Stop<'_>) {
        let summary = &mut self.summary;
        summary.not_printed += stop.undrained;
        summary.bridge_trace = self.bridge_trace.as_ref().map(|t| t.counts);
        // Then a moment for stdout's reader (30 ms, and up to 20 more to end the report
        // being written); what it has not taken by then is counted.
        let (written, unwritten) = self.out.finish(Duration::from_millis(30));
        summary.printed = written;
        summary.not_printed += unwritten;
        let Some(probes) = stop.probes else {
            return;
        };
        let k = match probes.counters() {
            Ok(k) => k,
            Err(e) => {
                warn!("reading the probes' counters at exit: {e:#}");
                KernelCounters::default()
            }
        };
        let inflight = probes.in_flight().unwrap_or_default();
        summary.seen = k.seen;
        summary.lost = k.ringbuf_full;
        summary.filtered = k.filtered;
        summary.sampled = k.sampled_out;
        summary.in_flight = inflight.kept;
        summary.in_flight_left_out = inflight.left_out;
        summary.attach_failures = probes.attach_failures;
        summary.capture_backend = Some(probes.capture_backend());
        summary.stopped_by = stop.why;
        summary.kernel = k;
        if let Some(mut r) = self.recorder.take() {
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
        if let Some(mut p) = self.pcap.take() {
            p.writer.finish();
            let mut stats = p.writer.stats;
            stats.bytes_lost = probes.packets_lost().unwrap_or_else(|e| {
                warn!("reading the probes' count of lost packet bytes: {e:#}");
                0
            });
            summary.pcapng = Some(stats);
        }
        // A record written between the drain and the counters is neither printed nor in
        // flight.
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
    }
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
