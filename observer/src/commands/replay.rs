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
use crate::output::recording::{Frame, Meta, Reader};
use crate::pipeline::decode::decode;
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
/// (a [`Sink`] of the pipeline, as the tail's recording and pcap-ng are).
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
    let mut pipeline = Pipeline::new(
        Context {
            output: opts.output,
            netns: h.netns.clone(),
            tuple: (&h.tuple).into(),
            drop_reasons: h.drop_reasons.clone(),
            marks: MarkDictionary::from_entries(&h.marks),
            // A recording holds no ruleset yet: rules are not named on replay.
            namer: None,
        },
        Box::new(Shared(names.clone())),
    );
    let mut summary = ReplaySummary {
        recorded_by: h.observer_version.clone(),
        netns: h.netns.clone(),
        ..Default::default()
    };
    let filter = match &opts.filter {
        Some(expr) => Some(crate::filter::compile(expr, &|name| {
            ifindexes.get(name).copied()
        })?),
        None => None,
    };
    let tuple: TupleLayout = (&h.tuple).into();
    while let Some(frame) = reader.next_frame()? {
        match frame {
            Frame::Meta(Meta::Plans { generation, plans }) => {
                let plans = plans
                    .iter()
                    .map(|p| {
                        p.to_plan().with_context(|| {
                            format!(
                                "{}: a probe plan names an unknown family or hook ({}, {}); \
                                 the file is damaged or from another observer",
                                opts.file.display(),
                                p.family,
                                p.hook
                            )
                        })
                    })
                    .collect::<Result<Vec<_>>>()?;
                pipeline.add_plans(generation, &plans);
                sink.plans(generation, &plans);
            }
            Frame::Meta(Meta::Replan { from, to }) => {
                pipeline.replanned(from, to);
                sink.replanned(from, to);
            }
            Frame::Meta(Meta::Ruleset {
                generation,
                texts,
                marks,
            }) => {
                sink.ruleset(generation, &texts, &marks);
                // Rules named as the tail named them, from the ruleset it read.
                let live = observer_rules::LiveNode::parse(*texts);
                for f in &live.failures {
                    log::warn!(
                        "{}: the recorded ruleset of generation {generation} is partly \
                         unreadable ({}); rules from it are not named",
                        opts.file.display(),
                        crate::output::recording::short(&f)
                    );
                }
                pipeline.ruleset_changed(
                    Some(MarkDictionary::from_entries(&marks)),
                    Some(crate::pipeline::rulenames::RuleNamer::new(
                        &live, generation,
                    )),
                );
            }
            Frame::Meta(Meta::Names { ifnames, symbols }) => {
                let mut n = names.borrow_mut();
                let renamed = ifnames
                    .iter()
                    .any(|(i, name)| n.ifnames.get(i).is_some_and(|old| old != name));
                n.ifnames.extend(ifnames);
                n.symbols.extend(symbols);
                drop(n);
                if renamed {
                    pipeline.forget_names();
                }
            }
            Frame::UnknownMeta(name) => {
                log::warn!(
                    "skipping context `{name}`, which this observer does not know (recorded \
                     by observer {})",
                    h.observer_version
                );
                summary.skipped_context += 1;
            }
            Frame::Record { lost_now, bytes } => {
                summary.records += 1;
                if let (Some(prog), Ok(rec)) = (&filter, decode(&bytes))
                    && !crate::filter::eval::keeps(prog, &rec, &tuple)
                {
                    summary.filtered += 1;
                    continue;
                }
                let outcome = pipeline
                    .handle_to(&bytes, lost_now, [&mut *sink])
                    .context("writing the reports")?;
                match outcome {
                    Outcome::Report { incomplete, .. } => {
                        summary.printed += 1;
                        summary.incomplete += u64::from(incomplete);
                        // Stop at once: not after reading one more frame.
                        if opts.count.is_some_and(|n| summary.printed >= n) {
                            break;
                        }
                    }
                    other => {
                        crate::pipeline::warn_unusable(&other);
                        summary.unusable += 1;
                    }
                }
            }
        }
    }
    let stopped_early = opts.count.is_some_and(|n| summary.printed >= n);
    summary.unended = !stopped_early
        && reader.format != crate::output::recording::FORMAT_V1
        && !reader.complete();
    Ok(summary)
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
