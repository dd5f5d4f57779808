//! `observer replay FILE`: the reports of a `tail --record` run, printed again from the
//! recording through the same pipeline as tail (no root, no eBPF, any machine).

use std::cell::RefCell;
use std::collections::HashMap;
use std::io::Write;
use std::path::PathBuf;
use std::rc::Rc;

use anyhow::{Context as _, Result};
use serde::Serialize;

use crate::kernel::btf::TupleLayout;
use crate::kernel::session::{Consumer, Next, Replan, Stop, Tick};
use crate::output::recording::{Frame, Meta, Reader};
use crate::pipeline::decode::decode;
use crate::pipeline::rulenames::RuleNamer;
use crate::pipeline::{
    Context, NameSource, Outcome, Output, Pipeline, RecordedNames, Report, Reports, Sink,
};
use observer_model::marks::MarkDictionary;

#[derive(Clone, Debug)]
pub struct ReplayOptions {
    pub file: PathBuf,
    pub output: Output,
    /// Stop after printing N traversals.
    pub count: Option<u64>,
    /// Print only traversals this `--filter` expression keeps (docs/filter.md).
    pub filter: Option<String>,
}

/// What a replay printed, in records.
#[derive(Debug, Default, Serialize, PartialEq, Eq)]
pub struct ReplaySummary {
    pub records: u64,
    pub printed: u64,
    pub incomplete: u64,
    /// Records that decode or expand to no report (tail counted them as not printed too).
    pub unusable: u64,
    /// Context frames of a kind this observer does not know, skipped.
    pub skipped_context: u64,
    /// The file ended without its end marker (the recorder was killed, or the file was
    /// cut at a frame boundary): reports may be missing at the end.
    pub unended: bool,
    /// Records left out by `--filter` (or its `--sample`).
    pub filtered: u64,
    #[serde(skip)]
    pub recorded_by: String,
    #[serde(skip)]
    pub netns: String,
}

impl std::fmt::Display for ReplaySummary {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "observer: replayed {} records of `{}` (recorded by observer {}): {} traversals \
             printed ({} incomplete), {} unusable",
            self.records,
            self.netns,
            self.recorded_by,
            self.printed,
            self.incomplete,
            self.unusable
        )?;
        if self.filtered > 0 {
            write!(f, ", {} left out by --filter", self.filtered)?;
        }
        if self.skipped_context > 0 {
            write!(
                f,
                "; {} context frames of a later observer skipped",
                self.skipped_context
            )?;
        }
        if self.unended {
            write!(
                f,
                "; the recording has no end marker (the recorder was killed or the file was \
                 cut short): records after its last frame are missing"
            )?;
        }
        Ok(())
    }
}

/// The recording's names, shared between the pipeline and the reader that updates them.
struct Shared(Rc<RefCell<RecordedNames>>);

impl NameSource for Shared {
    fn ifname(&self, index: u32) -> String {
        self.0.borrow().ifname(index)
    }
    fn symbol(&self, addr: u64) -> String {
        self.0.borrow().symbol(addr)
    }
    fn overlay(&self, vni: u32, port: u16) -> Option<String> {
        self.0.borrow().overlay(vni, port)
    }
}

/// Prints the recording's reports to `out`.
pub fn run(opts: &ReplayOptions, out: &mut dyn Write) -> Result<ReplaySummary> {
    let reader = Reader::open(&opts.file)?;
    let ifindexes = recorded_ifindexes_for(opts)?;
    replay(reader, &ifindexes, opts, out)
}

/// Hands each of the recording's records (as `opts` keeps them) and their reports to
/// `sink`, as the tail handed them to its own.
pub fn each(opts: &ReplayOptions, sink: &mut dyn Sink) -> Result<ReplaySummary> {
    let reader = Reader::open(&opts.file)?;
    let ifindexes = recorded_ifindexes_for(opts)?;
    replay_each(reader, &ifindexes, opts, sink)
}

/// Interface names in the filter are the recording's (the last name an index had),
/// gathered in one pass over the file before the records are read.
fn recorded_ifindexes_for(opts: &ReplayOptions) -> Result<HashMap<String, u32>> {
    match &opts.filter {
        Some(_) => recorded_ifindexes(&opts.file),
        None => Ok(HashMap::new()),
    }
}

/// Prints the reports of an open recording to `out` (`opts.file` names it in messages);
/// `ifindexes` resolves `iface NAME` in the filter.
pub fn replay<R: std::io::Read>(
    reader: Reader<R>,
    ifindexes: &HashMap<String, u32>,
    opts: &ReplayOptions,
    out: &mut dyn Write,
) -> Result<ReplaySummary> {
    let mut printer = Reports(|report: &Report| out.write_all(&report.render(opts.output)));
    let summary = replay_each(reader, ifindexes, opts, &mut printer)?;
    out.flush().context("writing the reports to stdout")?;
    Ok(summary)
}

/// Hands each record of an open recording, its report and the recorded context to `sink`
/// (a [`Sink`] of the pipeline, as the tail's recording and pcap-ng are): a recorded
/// session ([`crate::output::recording::replay`]) drives the [`Replayer`], a consumer like tail's and the
/// agent's.
pub fn replay_each<R: std::io::Read>(
    mut reader: Reader<R>,
    ifindexes: &HashMap<String, u32>,
    opts: &ReplayOptions,
    sink: &mut dyn Sink,
) -> Result<ReplaySummary> {
    if reader.format == crate::output::recording::FORMAT_V1 {
        log::warn!(
            "{} is a recording of format 1, which has no checksums and no end marker: damage \
             to it may go unnoticed (record it again with this observer to get both)",
            opts.file.display()
        );
    }
    let h = reader.header.clone();
    let names = Rc::new(RefCell::new(RecordedNames::default()));
    let pipeline = Pipeline::new(
        Context {
            output: opts.output,
            netns: h.netns.clone(),
            tuple: h.tuple,
            drop_reasons: h.drop_reasons.clone(),
            marks: MarkDictionary::from_entries(&h.marks),
            // Rules are named once the recording's ruleset frame is read.
            namer: None,
        },
        Box::new(Shared(names.clone())),
    );
    let filter = match &opts.filter {
        Some(expr) => Some(crate::filter::compile(expr, &|name| {
            ifindexes.get(name).copied()
        })?),
        None => None,
    };
    let mut replayer = Replayer {
        pipeline,
        names,
        sink,
        filter,
        tuple: h.tuple,
        opts,
        summary: ReplaySummary {
            recorded_by: h.observer_version.clone(),
            netns: h.netns.clone(),
            ..Default::default()
        },
        failed: None,
    };
    let (why, unknown) = crate::output::recording::replay(&mut reader, &opts.file, &mut replayer)?;
    if let Some(e) = replayer.failed.take() {
        return Err(e).context("writing the reports");
    }
    let mut summary = replayer.summary;
    summary.skipped_context = unknown.len() as u64;
    summary.unended = why != "--count"
        && reader.format != crate::output::recording::FORMAT_V1
        && !reader.complete();
    Ok(summary)
}

/// Replay's consumer of a recorded session: the recording's records through the pipeline
/// to `sink`, as `opts` keeps them, named as the tail named them.
struct Replayer<'a> {
    pipeline: Pipeline,
    /// The recording's names, which the pipeline reads through [`Shared`].
    names: Rc<RefCell<RecordedNames>>,
    sink: &'a mut dyn Sink,
    filter: Option<observer_common::filter::FilterProgram>,
    tuple: TupleLayout,
    opts: &'a ReplayOptions,
    summary: ReplaySummary,
    /// The sink's error, which stopped the replay.
    failed: Option<std::io::Error>,
}

impl Consumer for Replayer<'_> {
    fn on_record(&mut self, raw: &[u8], lost_now: u64) -> Next {
        let summary = &mut self.summary;
        summary.records += 1;
        let decoded = decode(raw);
        if let (Some(prog), Ok(rec)) = (&self.filter, &decoded)
            && !crate::filter::eval::keeps(prog, rec, &self.tuple)
        {
            summary.filtered += 1;
            return Next::More;
        }
        match self
            .pipeline
            .handle_decoded_to(raw, decoded, lost_now, [&mut *self.sink])
        {
            Ok(Outcome::Report { incomplete, .. }) => {
                summary.printed += 1;
                summary.incomplete += u64::from(incomplete);
                // Stop at once: not after reading one more frame.
                if self.opts.count.is_some_and(|n| summary.printed >= n) {
                    return Next::Stop("--count");
                }
            }
            Ok(other) => {
                crate::pipeline::warn_unusable(&other);
                summary.unusable += 1;
            }
            Err(e) => {
                self.failed = Some(e);
                return Next::Stop("the reports could not be written");
            }
        }
        Next::More
    }

    fn on_tick(&mut self, _tick: Tick<'_>) -> Option<&'static str> {
        // A recorded session has no clock of its own: it never ticks.
        None
    }

    fn on_replan(&mut self, replan: Replan<'_>) {
        match replan {
            Replan::Plans {
                generation, plans, ..
            } => {
                self.pipeline.add_plans(generation, plans);
                self.sink.plans(generation, plans);
            }
            Replan::Replanned { from, to } => {
                self.pipeline.replanned(from, to);
                self.sink.replanned(from, to);
            }
            Replan::Ruleset { live, recorded, .. } => {
                let (generation, marks) = recorded.unwrap_or((0, &[]));
                self.sink.ruleset(generation, &live.texts, marks);
                // The overlay devices as the tail saw them (`encap.overlay`).
                let links = live.texts.bridge.links.clone();
                if links != self.names.borrow().links {
                    self.names.borrow_mut().links = links;
                    self.pipeline.forget_names();
                }
                // Rules named as the tail named them, from the ruleset it read.
                for f in &live.failures {
                    log::warn!(
                        "{}: the recorded ruleset of generation {generation} is partly \
                         unreadable ({}); rules from it are not named",
                        self.opts.file.display(),
                        crate::output::recording::short(&f)
                    );
                }
                self.pipeline.ruleset_changed(
                    Some(MarkDictionary::from_entries(marks)),
                    Some(RuleNamer::new(live, generation)),
                );
            }
            Replan::Names { ifnames, symbols } => {
                let mut n = self.names.borrow_mut();
                let renamed = ifnames
                    .iter()
                    .any(|(i, name)| n.ifnames.get(i).is_some_and(|old| old != name));
                n.ifnames.extend(ifnames.iter().cloned());
                n.symbols.extend(symbols.iter().cloned());
                drop(n);
                if renamed {
                    self.pipeline.forget_names();
                }
            }
        }
    }

    fn on_stop(&mut self, _stop: Stop<'_>) {}
}

/// The interface index each name had in the recording at `file` (its last), for `--filter`.
/// Damage stops the pass: the replay that follows reports it where it is.
fn recorded_ifindexes(file: &std::path::Path) -> Result<HashMap<String, u32>> {
    let mut r = Reader::open(file)?;
    let mut found = HashMap::new();
    while let Ok(Some(f)) = r.next_frame() {
        if let Frame::Meta(Meta::Names { ifnames, .. }) = f {
            for (i, n) in ifnames {
                found.insert(n, i);
            }
        }
    }
    Ok(found)
}
