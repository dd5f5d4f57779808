//! The record -> report pipeline, shared by `tail` (records from the probes) and `replay`
//! (records from a `--record` file): decode, expand through the probe plan of the record's
//! generation, build the report, render it. Everything a report depends on besides the
//! record (plans, kernel layout, names, mark dictionary) lives here, so that the same
//! records with the same context print the same bytes live and replayed.
//!
//! What else is made of a record goes to [`Sink`]s the caller owns and hands to
//! [`Pipeline::handle_to`]: the recording (`output::recording::Recorder`, every record with
//! the context it needed, docs/recording.md), pcap-ng (tail's packet writer), replay's
//! printer. The pipeline holds none of them.

pub mod annotate;
pub mod correlate;
pub mod decode;
pub mod keys;
pub mod render_cache;
pub mod report;
pub mod rulenames;
pub mod snapshots;
pub mod subscription;

use std::collections::HashMap;
use std::io::Write;
use std::sync::{Arc, OnceLock};

use log::warn;

use crate::kernel::btf::TupleLayout;
use crate::kernel::kallsyms::Symbols;
use crate::kernel::plan::HookPlan;
use crate::pipeline::annotate::Names;
use crate::pipeline::correlate::{Plans, Traversal, assemble, index_plans};
use crate::pipeline::decode::{DecodeError, decode};
use crate::pipeline::render_cache::{RenderCache, SummaryFlags};
use crate::pipeline::rulenames::RuleNamer;
use observer_common::traversal::{TraversalRecord, missing};
use observer_model::marks::MarkDictionary;
use observer_model::{Endpoint, EndpointName, NameKind, Protocol};

/// How each traversal is printed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
#[repr(usize)]
pub enum Output {
    /// A header line and one line per table, with what it changed and why.
    Tree,
    /// One JSON object per line (schema 3, docs/json-schema.md).
    Json,
    /// One line per packet, for busy nodes.
    Line,
}

/// `--output` and its shorthand `--json`, for every command that prints traversals.
#[derive(Clone, Copy, Debug, clap::Args)]
pub struct OutputArgs {
    /// How to print each traversal.
    #[arg(long, value_enum, default_value = "tree")]
    pub output: Output,
    /// Same as --output json: one JSON object per line (schema 3, see docs/json-schema.md).
    #[arg(long, conflicts_with = "output")]
    pub json: bool,
}

impl Output {
    /// The word `--output` and the agent's `output=` take.
    pub fn name(self) -> &'static str {
        match self {
            Output::Tree => "tree",
            Output::Json => "json",
            Output::Line => "line",
        }
    }
}

impl OutputArgs {
    /// The format asked for.
    pub fn format(self) -> Output {
        if self.json { Output::Json } else { self.output }
    }
}

/// Interface names and kernel symbols, from the running system or from a recording.
pub trait NameSource {
    /// The interface's name (`-` for 0, `if<N>` when unknown).
    fn ifname(&self, index: u32) -> String;
    /// `function+0xoffset` for a kernel code address (hex when unknown).
    fn symbol(&self, addr: u64) -> String;
    /// Forgets cached names (interfaces were renamed or removed).
    fn forget(&self) {}
    /// The name of this namespace's VXLAN device with this VNI and UDP port, if known.
    fn overlay(&self, _vni: u32, _port: u16) -> Option<String> {
        None
    }
    /// Whether [`NameSource::k8s`] may name anything: reports look up their endpoints only
    /// then (tail and replay know no Kubernetes names, and skip the work).
    fn knows_k8s(&self) -> bool {
        false
    }
    /// What Kubernetes calls an address (and port, for `proto`): `(Service,
    /// "namespace/name:port")` or `(Pod, "namespace/name")`. None by default.
    fn k8s(
        &self,
        _addr: std::net::IpAddr,
        _proto: u8,
        _port: Option<u16>,
    ) -> Option<(NameKind, String)> {
        None
    }
}

/// Names from this host: `if_indextoname` (cached) and `/proc/kallsyms`.
pub struct LiveNames {
    names: std::cell::RefCell<HashMap<u32, String>>,
    /// Loaded on first use: a drop location is named only in a report (about 9 MiB).
    symbols: std::cell::OnceCell<Symbols>,
    /// Kubernetes names (the agent's), when known.
    k8s: Option<std::sync::Arc<crate::k8s::Names>>,
    /// VXLAN devices by (VNI, port), asked once each.
    overlays: std::cell::RefCell<HashMap<(u32, u16), Option<String>>>,
}

impl LiveNames {
    /// With Kubernetes names (the agent's).
    pub fn with_k8s(mut self, names: std::sync::Arc<crate::k8s::Names>) -> Self {
        self.k8s = Some(names);
        self
    }

    pub fn load() -> Self {
        Self {
            names: Default::default(),
            symbols: std::cell::OnceCell::new(),
            k8s: None,
            overlays: Default::default(),
        }
    }
}

impl NameSource for LiveNames {
    fn ifname(&self, index: u32) -> String {
        self.names
            .borrow_mut()
            .entry(index)
            .or_insert_with(|| crate::kernel::netns::ifname(index))
            .clone()
    }
    fn symbol(&self, addr: u64) -> String {
        self.symbols.get_or_init(Symbols::load).name(addr)
    }
    fn knows_k8s(&self) -> bool {
        self.k8s.is_some()
    }
    fn k8s(
        &self,
        addr: std::net::IpAddr,
        proto: u8,
        port: Option<u16>,
    ) -> Option<(NameKind, String)> {
        self.k8s.as_ref()?.name_of(addr, proto, port)
    }
    fn forget(&self) {
        self.names.borrow_mut().clear();
        self.overlays.borrow_mut().clear();
    }
    fn overlay(&self, vni: u32, port: u16) -> Option<String> {
        self.overlays
            .borrow_mut()
            .entry((vni, port))
            .or_insert_with(|| crate::kernel::netns::vxlan_device(vni, port))
            .clone()
    }
}

/// Names as a recording saved them.
#[derive(Default)]
pub struct RecordedNames {
    pub ifnames: HashMap<u32, String>,
    pub symbols: HashMap<u64, String>,
    /// The recorded `ip -j -d link show` (the ruleset frame's texts): the VXLAN devices.
    pub links: Option<String>,
}

impl NameSource for RecordedNames {
    fn ifname(&self, index: u32) -> String {
        match self.ifnames.get(&index) {
            Some(n) => n.clone(),
            None if index == 0 => "-".into(),
            None => format!("if{index}"),
        }
    }
    fn overlay(&self, vni: u32, port: u16) -> Option<String> {
        crate::kernel::netns::vxlan_device_in(self.links.as_deref()?, vni, port)
    }
    fn symbol(&self, addr: u64) -> String {
        self.symbols
            .get(&addr)
            .cloned()
            .unwrap_or_else(|| format!("{addr:#x}"))
    }
}

/// What the pipeline made of one record.
#[derive(Debug, PartialEq)]
pub enum Outcome {
    /// The traversal, modelled once ([`Report`]), its rendering in the pipeline's own output
    /// mode, and whether it is flagged incomplete; with [`Pipeline::packet_info`], what
    /// `--pcapng` needs of the traversal.
    Report {
        /// Shared with the cache when it comes from it (no copy).
        report: Report,
        /// `report` rendered as [`Context::output`] says.
        bytes: bytes::Bytes,
        incomplete: bool,
        /// Some stage's named rules disagree with the kernel / could not be decided.
        rules_disagree: bool,
        rules_undecidable: bool,
        packet: Option<PacketInfo>,
    },
    /// The bytes are no traversal record.
    Undecodable(DecodeError),
    /// A record the plans cannot expand (unknown end or hook).
    Unusable(String),
}

/// One traversal, modelled once and shared by every sink (renderers, metrics, the agent's
/// subscribers); each rendering is made the first time a sink asks for it and kept with
/// it, so that records the cache finds again are neither modelled nor rendered again.
#[derive(Clone)]
pub struct Report(Arc<Modelled>);

struct Modelled {
    traversal: Arc<observer_model::Traversal>,
    /// Tree, JSON, line.
    renders: [OnceLock<bytes::Bytes>; 3],
}

impl Report {
    pub fn new(t: observer_model::Traversal) -> Self {
        Self(Arc::new(Modelled {
            traversal: Arc::new(t),
            renders: Default::default(),
        }))
    }

    /// The typed traversal.
    pub fn traversal(&self) -> &Arc<observer_model::Traversal> {
        &self.0.traversal
    }

    /// Its rendering in `output`, made now if no sink asked for it before.
    pub fn render(&self, output: Output) -> bytes::Bytes {
        self.render_new(output).0
    }

    /// The rendering, and whether it was made by this call.
    fn render_new(&self, output: Output) -> (bytes::Bytes, bool) {
        let slot = &self.0.renders[output as usize];
        let mut made = false;
        let b = slot.get_or_init(|| {
            made = true;
            write(&self.0.traversal, output).into()
        });
        (b.clone(), made)
    }
}

impl std::fmt::Debug for Report {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("Report")
            .field(&self.0.traversal.flow())
            .finish()
    }
}

impl PartialEq for Report {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.0, &other.0) || self.0.traversal == other.0.traversal
    }
}

impl render_cache::Weight for Option<Report> {
    /// Renderings count when they are made ([`Pipeline::render`]).
    fn weight(&self) -> usize {
        0
    }
}

/// A printed traversal, as `--pcapng` writes it.
#[derive(Debug, PartialEq, Eq)]
pub struct PacketInfo {
    /// Its identity (skb address, start time: `CLOCK_MONOTONIC` ns).
    pub skb: u64,
    pub ts_first: u64,
    /// The interface where it entered (where it left for a packet sent by this host;
    /// `local` when neither was seen).
    pub iface: String,
    /// Its one-line report.
    pub line: String,
}

/// The interface a traversal entered on, else the one it left by (0: none seen).
fn entry_ifindex(rec: &TraversalRecord) -> u32 {
    let visits = &rec.visits[..usize::from(rec.nvisits).min(rec.visits.len())];
    visits
        .iter()
        .map(|v| v.ifindex_in)
        .find(|&i| i != 0)
        .or_else(|| visits.iter().map(|v| v.ifindex_out).find(|&i| i != 0))
        .unwrap_or(0)
}

/// The context every report needs besides its record.
pub struct Context {
    pub output: Output,
    pub netns: String,
    pub tuple: TupleLayout,
    /// `enum skb_drop_reason` value -> name.
    pub drop_reasons: HashMap<u32, String>,
    pub marks: MarkDictionary,
    /// Names the rules of each stage (tail with the live ruleset; none in replay: a
    /// recording holds no ruleset yet).
    pub namer: Option<RuleNamer>,
}

/// Probe plan generations a pipeline keeps (a record of an older one is read through the
/// current plan).
pub const PLAN_GENERATIONS_KEPT: u8 = 16;

pub struct Pipeline {
    pub ctx: Context,
    /// Probe plans by generation: records made under an earlier one expand through it.
    plans: HashMap<u8, Plans>,
    generation: u8,
    /// Times (ns) from a ruleset change to the probes' re-plan: a traversal in flight then
    /// may have met a chain its probes did not bracket yet.
    replans: Vec<(u64, u64)>,
    names: Box<dyn NameSource>,
    /// Traversals already modelled (and their renderings), by record content; `None` for a
    /// record that could not be modelled.
    cache: RenderCache<Option<Report>>,
    /// Reports carry the IPv4 identification the probes record ([`Pipeline::set_ip_ids`]).
    ip_ids: bool,
    /// Whether reports come with their [`PacketInfo`] (`--pcapng`).
    pub packet_info: bool,
    /// Whether the names each report looked up are noted for the sinks (the recording
    /// saves them: [`Handled::learned`]).
    pub learn_names: bool,
    /// Those of the last record handled.
    learned: Option<Learned>,
    snapshots: report::SnapshotCache,
    /// Packets lost as of the last report.
    reported_lost: u64,
}

/// One record as the pipeline's sinks see it.
pub struct Handled<'a> {
    /// The ring-buffer bytes it was decoded from (the recording saves them).
    pub raw: &'a [u8],
    /// The kernel's count of lost packets when it was read.
    pub lost_now: u64,
    /// What the pipeline made of it: the [`Report`] (the typed traversal), or why none.
    pub outcome: &'a Outcome,
    /// The record as decoded (once, for every sink), as the pipeline left it (a traversal
    /// that crossed a re-plan flagged); None when the bytes are no record.
    pub record: Option<&'a TraversalRecord>,
    /// With [`Pipeline::learn_names`], the names its report looked up.
    pub learned: Option<&'a Learned>,
    /// Bytes of renderings the sinks made (kept with the cached report: the cache's
    /// memory bound counts them).
    rendered: std::cell::Cell<usize>,
}

impl Handled<'_> {
    /// The report, if the record made one.
    pub fn report(&self) -> Option<&Report> {
        match self.outcome {
            Outcome::Report { report, .. } => Some(report),
            _ => None,
        }
    }

    /// `report` rendered as `output` (made once per report, whoever asks first; what a sink
    /// makes is counted in the pipeline's cache like its own renderings).
    pub fn render(&self, report: &Report, output: Output) -> bytes::Bytes {
        let (b, made) = report.render_new(output);
        if made {
            self.rendered.set(self.rendered.get() + b.len());
        }
        b
    }
}

/// Where reports go: the recording, pcap-ng, replay's printer, the agent's metrics and
/// its subscribers with the flight recorder (`commands::agent`). Each sees every record handled and the context changes its caller passes on
/// (plans, re-plans, the ruleset), in the order they happened.
pub trait Sink {
    fn handled(&mut self, h: &Handled<'_>) -> std::io::Result<()>;
    /// The probe plan of `generation`, now the current one.
    fn plans(&mut self, _generation: u8, _plans: &[HookPlan]) {}
    /// The ruleset changed at `from`, the probes were re-planned at `to` (ns).
    fn replanned(&mut self, _from: u64, _to: u64) {}
    /// Rules are now named from `texts` (rule namer `generation`), marks from `marks`.
    fn ruleset(
        &mut self,
        _generation: u64,
        _texts: &observer_rules::LiveTexts,
        _marks: &[(u32, String)],
    ) {
    }
}

/// A sink of reports only (the agent's metrics test, replay to a writer).
pub struct Reports<F>(pub F);

impl<F: FnMut(&Report) -> std::io::Result<()>> Sink for Reports<F> {
    fn handled(&mut self, h: &Handled<'_>) -> std::io::Result<()> {
        match h.outcome {
            Outcome::Report { report, .. } => (self.0)(report),
            _ => Ok(()),
        }
    }
}

impl Pipeline {
    pub fn new(ctx: Context, names: Box<dyn NameSource>) -> Self {
        Self {
            ctx,
            plans: HashMap::new(),
            generation: 0,
            replans: Vec::new(),
            names,
            cache: RenderCache::default(),
            ip_ids: false,
            packet_info: false,
            learn_names: false,
            learned: None,
            snapshots: report::SnapshotCache::default(),
            reported_lost: 0,
        }
    }

    /// The probe plan of `generation`, now the current one.
    pub fn add_plans(&mut self, generation: u8, plans: &[HookPlan]) {
        self.generation = generation;
        self.clear_caches();
        self.plans.insert(generation, index_plans(plans));
        // Only the last few generations can still have records on their way (a record
        // waits seconds at most); older ones would be kept until the generation wraps, 256
        // of them (issue 33: the agent's default mode moves it at every stream).
        self.plans
            .retain(|g, _| generation.wrapping_sub(*g) < PLAN_GENERATIONS_KEPT);
    }

    /// The ruleset changed at `from` and the probes were re-planned at `to` (ns).
    pub fn replanned(&mut self, from: u64, to: u64) {
        self.replans.push((from, to));
        if self.replans.len() > 16 {
            self.replans.remove(0);
        }
    }

    /// Forgets cached interface names and renderings (after renames or removals).
    pub fn forget_names(&mut self) {
        self.names.forget();
        self.clear_caches();
    }

    /// Reports name rules and mark bits from the ruleset: after it changed, what was
    /// rendered is stale.
    pub fn ruleset_changed(&mut self, marks: Option<MarkDictionary>, namer: Option<RuleNamer>) {
        if let Some(m) = marks {
            self.ctx.marks = m;
        }
        if namer.is_some() {
            self.ctx.namer = namer;
        }
        self.clear_caches();
    }

    /// Tells `sinks` the ruleset rules are now named from (when they are named at all).
    pub fn ruleset_to<'s, 'o: 's>(
        &self,
        texts: &observer_rules::LiveTexts,
        sinks: impl IntoIterator<Item = &'s mut (dyn Sink + 'o)>,
    ) {
        let Some(namer) = &self.ctx.namer else {
            return;
        };
        let marks = self.ctx.marks.entries();
        for s in sinks {
            s.ruleset(namer.generation, texts, &marks);
        }
    }

    /// Whether reports carry each packet's IPv4 identification (`packet.ip_id`,
    /// `encap.inner_ip_id`): what names one packet across nodes (`kubectl observer trace`).
    /// Off by default: it makes every packet's record, and so its report, different, and
    /// the cache of renderings, which gives a flow's packets one shared report, misses.
    pub fn set_ip_ids(&mut self, on: bool) {
        self.ip_ids = on;
    }

    fn clear_caches(&mut self) {
        self.cache.clear();
    }

    /// `report` rendered as `output` says (made once per report, counted against the
    /// cache's bound).
    pub fn render(&mut self, report: &Report, output: Output) -> bytes::Bytes {
        let (b, made) = report.render_new(output);
        if made {
            self.cache.add_weight(b.len());
        }
        b
    }

    /// One ring-buffer record -> its report. `lost_now` is the kernel's count of lost
    /// packets so far; the report says how many were lost since the previous one.
    pub fn handle(&mut self, raw: &[u8], lost_now: u64) -> Outcome {
        match decode(raw) {
            Ok(mut rec) => self.render_record(&mut rec, lost_now),
            Err(e) => Outcome::Undecodable(e),
        }
    }

    /// [`Pipeline::handle`], then each of `sinks` is handed the record and its outcome
    /// (the first sink's error stops the others).
    pub fn handle_to<'s, 'o: 's>(
        &mut self,
        raw: &[u8],
        lost_now: u64,
        sinks: impl IntoIterator<Item = &'s mut (dyn Sink + 'o)>,
    ) -> std::io::Result<Outcome> {
        self.handle_decoded_to(raw, decode(raw), lost_now, sinks)
    }

    /// [`Pipeline::handle_to`] for a record its caller decoded already (`decoded` is
    /// `decode(raw)`), to look at it first.
    pub fn handle_decoded_to<'s, 'o: 's>(
        &mut self,
        raw: &[u8],
        decoded: Result<TraversalRecord, DecodeError>,
        lost_now: u64,
        sinks: impl IntoIterator<Item = &'s mut (dyn Sink + 'o)>,
    ) -> std::io::Result<Outcome> {
        self.learned = None;
        let (rec, outcome) = match decoded {
            Ok(mut rec) => {
                let outcome = self.render_record(&mut rec, lost_now);
                (Some(rec), outcome)
            }
            Err(e) => (None, Outcome::Undecodable(e)),
        };
        let h = Handled {
            raw,
            lost_now,
            outcome: &outcome,
            record: rec.as_ref(),
            learned: self.learned.as_ref(),
            rendered: Default::default(),
        };
        let mut result = Ok(());
        for s in sinks {
            result = s.handled(&h);
            if result.is_err() {
                break;
            }
        }
        self.cache.add_weight(h.rendered.get());
        result.map(|()| outcome)
    }

    fn render_record(&mut self, rec: &mut TraversalRecord, lost_now: u64) -> Outcome {
        let Some(plans) = self
            .plans
            .get(&rec.generation)
            .or_else(|| self.plans.get(&self.generation))
        else {
            return Outcome::Unusable("no probe plan is known".into());
        };
        if self
            .replans
            .iter()
            .any(|&(from, to)| rec.ts_first <= to && rec.ts_last >= from)
        {
            rec.incomplete |= missing::REPLANNED;
        }
        if !self.ip_ids {
            // Not asked for: forgotten before the record is keyed (see `set_ip_ids`).
            let n = usize::from(rec.nsteps).min(rec.steps.len());
            for s in &mut rec.steps[..n] {
                s.ip_id = 0;
            }
        }
        let lost = lost_now.saturating_sub(self.reported_lost);
        self.reported_lost = self.reported_lost.max(lost_now);
        // A report is a function of the record (and names and plans, which clear the
        // cache when they change); `lost` is not, so only lines without it are shared.
        let names = Logged {
            inner: &*self.names,
            log: self.learn_names.then(Default::default),
        };
        let result = if lost == 0 {
            let mut failed = None;
            let r = self.cache.get_or_render(rec, || {
                match model(rec, plans, &self.ctx, &self.snapshots, &names, 0) {
                    Ok(t) => {
                        let counts = SummaryFlags::of(&t);
                        (Some(Report::new(t)), counts)
                    }
                    Err(e) => {
                        failed = Some(e);
                        (None, SummaryFlags::default())
                    }
                }
            });
            match (failed, &r.value) {
                (Some(e), _) => Err(e),
                (None, Some(report)) => Ok((report.clone(), r.outcome)),
                (None, None) => Err("a record like it could not be modelled".into()),
            }
        } else {
            model(rec, plans, &self.ctx, &self.snapshots, &names, lost).map(|t| {
                let counts = SummaryFlags::of(&t);
                (Report::new(t), counts)
            })
        };
        self.learned = names.log.map(std::cell::RefCell::into_inner);
        let (report, counts) = match result {
            Ok(r) => r,
            Err(e) => {
                // A cached failure would be skipped silently; forget it so it is reported
                // again.
                self.cache.clear();
                return Outcome::Unusable(e);
            }
        };
        let bytes = self.render(&report, self.ctx.output);
        if bytes.is_empty() {
            return Outcome::Unusable("empty report".into());
        }
        let packet = self.packet_info.then(|| {
            let line = self.render(&report, Output::Line);
            let iface = match entry_ifindex(rec) {
                0 => "local".to_string(),
                i => self.names.ifname(i),
            };
            PacketInfo {
                skb: rec.skb,
                ts_first: rec.ts_first,
                iface,
                line: String::from_utf8_lossy(&line).trim_end().to_string(),
            }
        });
        Outcome::Report {
            report,
            bytes,
            incomplete: counts.incomplete,
            rules_disagree: counts.rules_disagree,
            rules_undecidable: counts.rules_undecidable,
            packet,
        }
    }
}

/// A name source that notes what it answered, for the recording.
struct Logged<'a> {
    inner: &'a dyn NameSource,
    log: Option<std::cell::RefCell<Learned>>,
}

/// Names a report used: (ifindex, name) and (address, symbol).
#[derive(Clone, Default)]
pub struct Learned {
    pub ifnames: Vec<(u32, String)>,
    pub symbols: Vec<(u64, String)>,
}

impl Logged<'_> {
    fn ifname(&self, index: u32) -> String {
        let n = self.inner.ifname(index);
        if let Some(l) = &self.log {
            l.borrow_mut().ifnames.push((index, n.clone()));
        }
        n
    }
    fn symbol(&self, addr: u64) -> String {
        let s = self.inner.symbol(addr);
        if let Some(l) = &self.log {
            l.borrow_mut().symbols.push((addr, s.clone()));
        }
        s
    }
}

/// The record as the model's traversal: stages, fate, marks, NAT, rules, endpoint names.
fn model(
    rec: &TraversalRecord,
    plans: &Plans,
    ctx: &Context,
    snapshots: &report::SnapshotCache,
    names: &Logged,
    lost: u64,
) -> Result<observer_model::Traversal, String> {
    let t: Traversal = assemble(rec, plans, &ctx.tuple).map_err(|e| e.to_string())?;
    let symbol = |a: u64| names.symbol(a);
    let ifname = |i: u32| names.ifname(i);
    let rctx = report::Context {
        snapshots,
        plans,
        netns: &ctx.netns,
        marks: &ctx.marks,
        names: Names {
            drop_reasons: &ctx.drop_reasons,
            symbol: &symbol,
        },
        ifname: &ifname,
        rules: ctx.namer.as_ref(),
    };
    let mut r = report::build(&t, &rctx, lost);
    if let Some(e) = &mut r.encap {
        e.overlay = names.inner.overlay(e.vni, e.outer_dst.port.unwrap_or(0));
        // Decapsulated, the same skb goes on as the inner packet: the probes see a new
        // packet start under its address, and this traversal's end is not seen.
        if e.direction == Some("decapsulated") && rec.end == observer_common::traversal::end::REUSED
        {
            r.notes.push(format!(
                "decapsulated (VXLAN vni {}): the kernel went on with this skb as the packet it \
                 carried, {} {} -> {}, reported as its own traversal entering by {}",
                e.vni,
                e.inner.proto.name(),
                e.inner.src,
                e.inner.dst,
                e.overlay.as_deref().unwrap_or("the overlay device"),
            ));
        }
    }
    r.names = endpoint_names(&r, names.inner);
    Ok(r)
}

/// The renderers: one traversal as the output mode says (a JSON line, a tree, a line).
pub fn write(r: &observer_model::Traversal, output: Output) -> Vec<u8> {
    let mut buf = Vec::with_capacity(4096);
    // Writing into a Vec cannot fail.
    let _ = match output {
        Output::Json => r.write_json(&mut buf).and_then(|()| buf.write_all(b"\n")),
        Output::Tree => writeln!(buf, "{}", r.render_tree()),
        Output::Line => writeln!(buf, "{}", r.render_line()),
    };
    buf
}

/// The Kubernetes names of the endpoints a report shows (its stages' and its
/// connection's), each once, in the order they first appear.
fn endpoint_names(r: &observer_model::Traversal, names: &dyn NameSource) -> Vec<EndpointName> {
    if !names.knows_k8s() {
        return Vec::new();
    }
    let proto = match r.proto {
        Some(p @ (Protocol::Tcp | Protocol::Udp | Protocol::Sctp)) => p.number(),
        _ => 0,
    };
    let mut shown: Vec<&Endpoint> = Vec::new();
    for s in &r.stages {
        for snap in [&s.before, &s.after].into_iter().flatten() {
            shown.push(&snap.src);
            shown.push(&snap.dst);
        }
    }
    if let Some(ct) = &r.conntrack {
        for t in [&ct.original, &ct.reply] {
            shown.push(&t.src);
            shown.push(&t.dst);
        }
    }
    let mut out: Vec<EndpointName> = Vec::new();
    for e in shown {
        if out.iter().any(|n| n.endpoint == *e) {
            continue;
        }
        let Some(addr) = e.host.ip() else {
            continue;
        };
        if let Some((kind, name)) = names.k8s(addr, proto, e.port) {
            out.push(EndpointName {
                endpoint: e.clone(),
                kind,
                name,
            });
        }
    }
    out
}

/// Logs an unusable record the way tail always has.
pub fn warn_unusable(o: &Outcome) {
    match o {
        Outcome::Undecodable(e) => warn!("undecodable record: {e}"),
        Outcome::Unusable(e) => warn!("unusable traversal record: {e}"),
        Outcome::Report { .. } => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::commands::replay::{ReplayOptions, run};
    use crate::kernel::plan::full_plan;
    use crate::output::recording::{Header, Recorder};
    use crate::pipeline::correlate::tests::record_of;
    use crate::pipeline::decode::encode_record;
    use crate::pipeline::decode::tests::{LAYOUT, tcp_event, with_ct};
    use observer_common::hook;
    use observer_common::traversal::end;

    const CLIENT: ([u8; 4], u16) = ([198, 51, 100, 10], 40000);
    const VIP: ([u8; 4], u16) = ([10, 10, 10, 2], 22);
    const POD: ([u8; 4], u16) = ([172, 17, 0, 5], 22);

    /// Names as a live host would give them; counts lookups.
    struct Host;
    impl NameSource for Host {
        fn ifname(&self, index: u32) -> String {
            match index {
                0 => "-".into(),
                2 => "eth0".into(),
                5 => "cali1a2b".into(),
                i => format!("if{i}"),
            }
        }
        fn symbol(&self, addr: u64) -> String {
            format!("nf_hook_slow+{:#x}", addr & 0xfff)
        }
    }

    /// A DNATed packet forwarded to the pod, and one dropped in FORWARD/filter.
    fn records() -> Vec<Vec<u8>> {
        let mut out = Vec::new();
        for (n, dropped) in [(1u64, false), (2, true), (3, false)] {
            let skb = 0xffff_0000_0000_1000 + 0x100 * n;
            let orig = (CLIENT, VIP);
            let reply = (POD, CLIENT);
            let mut evs = vec![tcp_event(hook::TC_INGRESS, 0, skb, CLIENT, VIP, 0)];
            evs[0].header.ifindex_in = 2;
            // Every point of the plan's PREROUTING (DNAT after nat, its 5th), the first of
            // FORWARD's (the program of each point as the plan has it).
            let plans = full_plan(None);
            let programs = |hook: observer_model::Hook| {
                plans
                    .iter()
                    .find(|p| p.family == observer_model::Family::Ipv4 && p.hook == hook)
                    .expect("planned")
                    .programs
                    .clone()
            };
            for (at, &program) in programs(observer_model::Hook::PreRouting)
                .iter()
                .enumerate()
            {
                let (dst, mark) = if at >= 4 { (POD, 0x4000) } else { (VIP, 0) };
                let mut e = tcp_event(0, program as u32, skb, CLIENT, dst, mark);
                if at >= 2 {
                    e = with_ct(e, 2, orig, reply);
                }
                evs.push(e);
            }
            let forward = programs(observer_model::Hook::Forward);
            let forward_points = if dropped { 2 } else { forward.len() };
            for &program in &forward[..forward_points] {
                evs.push(with_ct(
                    tcp_event(2, program as u32, skb, CLIENT, POD, 0x4000),
                    2,
                    orig,
                    reply,
                ));
            }
            if !dropped {
                let mut eg = tcp_event(hook::TC_EGRESS, 0, skb, CLIENT, POD, 0x4000);
                eg.header.ifindex_out = 5;
                evs.push(eg);
            }
            for (i, e) in evs.iter_mut().enumerate() {
                e.header.ts_ns = n * 1000 + i as u64;
            }
            let mut rec = record_of(&evs, if dropped { end::DROPPED } else { end::EGRESS });
            if dropped {
                rec.reason = 12;
                rec.location = 0xffff_ffff_8100_009e;
            }
            out.push(encode_record(&rec));
        }
        out
    }

    fn context(output: Output) -> Context {
        Context {
            output,
            netns: "lab-node".into(),
            tuple: LAYOUT,
            drop_reasons: [(12, "NETFILTER_DROP".to_string())].into(),
            marks: MarkDictionary::default(),
            namer: None,
        }
    }

    /// A "live" pipeline and its recording sink, as tail holds them.
    struct Live {
        pipeline: Pipeline,
        rec: Recorder,
    }

    impl Live {
        fn handle(&mut self, raw: &[u8], lost_now: u64) -> Outcome {
            self.pipeline
                .handle_to(raw, lost_now, [&mut self.rec as &mut dyn Sink])
                .unwrap()
        }
        fn add_plans(&mut self, generation: u8, plans: &[HookPlan]) {
            self.pipeline.add_plans(generation, plans);
            self.rec.plans(generation, plans);
        }
        fn replanned(&mut self, from: u64, to: u64) {
            self.pipeline.replanned(from, to);
            self.rec.replanned(from, to);
        }
    }

    /// A "live" pipeline for `output` that records into a file of a fresh directory (the
    /// caller removes it): (directory, file, pipeline).
    fn recording(output: Output, tag: &str) -> (std::path::PathBuf, std::path::PathBuf, Live) {
        static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let dir = std::env::temp_dir().join(format!("observer-{tag}-{}-{n}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join(format!("{output:?}.rec"));
        let ctx = context(output);
        let header = Header::new(&ctx.netns, &ctx.tuple, &ctx.drop_reasons, &ctx.marks);
        let mut pipeline = Pipeline::new(ctx, Box::new(Host));
        pipeline.learn_names = true;
        let mut live = Live {
            pipeline,
            rec: Recorder::create(&file, &header).unwrap(),
        };
        live.add_plans(0, &full_plan(None));
        (dir, file, live)
    }

    /// Records every test record through a "live" pipeline; (directory, file).
    fn recorded_all(tag: &str) -> (std::path::PathBuf, std::path::PathBuf) {
        let (dir, file, mut live) = recording(Output::Line, tag);
        for r in records() {
            live.handle(&r, 0);
        }
        live.rec.finish();
        (dir, file)
    }

    /// Runs records through a "live" pipeline that records, then replays the file.
    fn live_and_replayed(
        output: Output,
    ) -> (Vec<u8>, Vec<u8>, crate::commands::replay::ReplaySummary) {
        let (dir, file, mut live) = recording(output, "pipeline");
        let mut printed = Vec::new();
        let recs = records();
        // Lost packets before the second report; then an undecodable record; then a
        // re-plan (the third record is in flight across it) and a rename.
        for (i, (raw, lost)) in [(&recs[0], 0), (&recs[1], 3), (&recs[0], 3)]
            .into_iter()
            .enumerate()
        {
            if let Outcome::Report { bytes, .. } = live.handle(raw, lost) {
                printed.extend(bytes);
            }
            if i == 1 {
                assert!(matches!(
                    live.handle(&[3, 0, 0], 3),
                    Outcome::Undecodable(_)
                ));
                live.add_plans(
                    1,
                    &full_plan(Some(&[(
                        observer_model::Family::Ipv4,
                        observer_model::Hook::Forward,
                        -10,
                    )])),
                );
                live.replanned(2990, 3010);
            }
        }
        if let Outcome::Report { bytes, .. } = live.handle(&recs[2], 3) {
            printed.extend(bytes);
        }
        let mut r = live.rec;
        assert!(r.finish());
        assert_eq!((r.records, r.failed), (5, 0));
        let mut replayed = Vec::new();
        let summary = run(
            &ReplayOptions {
                file: file.clone(),
                output,
                count: None,
                filter: None,
            },
            &mut replayed,
        )
        .unwrap();
        let _ = std::fs::remove_dir_all(&dir);
        (printed, replayed, summary)
    }

    /// The plans of the last [`PLAN_GENERATIONS_KEPT`] generations are kept, through the
    /// wrap of the generation's byte, and no more.
    #[test]
    fn only_the_last_plan_generations_are_kept() {
        let mut p = Pipeline::new(context(Output::Line), Box::new(Host));
        for i in 0..600u32 {
            p.add_plans((i % 256) as u8, &[]);
            assert!(p.plans.len() <= usize::from(PLAN_GENERATIONS_KEPT));
        }
        // 599 % 256 = 87: 72..=87 are kept.
        let mut kept: Vec<u8> = p.plans.keys().copied().collect();
        kept.sort_unstable();
        assert_eq!(kept, (72..=87).collect::<Vec<u8>>());
        // Across the byte's wrap: 250..=255 and 0..=9 are the last 16 before 10.
        for g in 240..=255u8 {
            p.add_plans(g, &[]);
        }
        for g in 0..=9u8 {
            p.add_plans(g, &[]);
        }
        let mut kept: Vec<u8> = p.plans.keys().copied().collect();
        kept.sort_unstable();
        let want: Vec<u8> = (0..=9).chain(250..=255).collect();
        assert_eq!(kept, want);
    }

    #[test]
    fn replay_prints_what_tail_printed_in_every_output() {
        for output in [Output::Json, Output::Tree, Output::Line] {
            let (live, replayed, summary) = live_and_replayed(output);
            let text = String::from_utf8(live.clone()).unwrap();
            assert!(text.contains("cali1a2b"), "{text}");
            assert!(text.contains("nf_hook_slow+0x9e"), "{text}");
            assert!(text.contains("NETFILTER_DROP"), "{text}");
            assert_eq!(
                String::from_utf8(replayed).unwrap(),
                text,
                "{output:?}: replay differs from the live output"
            );
            assert_eq!(summary.records, 5);
            assert_eq!(summary.printed, 4);
            assert_eq!(summary.unusable, 1);
        }
    }

    #[test]
    fn lost_packets_and_replans_reach_the_replayed_reports() {
        let (live, replayed, _) = live_and_replayed(Output::Json);
        assert_eq!(live, replayed);
        let reports: Vec<serde_json::Value> = String::from_utf8(replayed)
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        let lost: Vec<u64> = reports
            .iter()
            .map(|r| r["lost"].as_u64().unwrap())
            .collect();
        assert_eq!(lost, vec![0, 3, 0, 0]);
        // The third record (ts 1000..) does not overlap the re-plan window; the fourth
        // (ts 3000..) does, and is flagged.
        assert_eq!(reports[2]["incomplete"], false, "{}", reports[2]);
        assert_eq!(reports[3]["incomplete"], true, "{}", reports[3]);
    }

    #[test]
    fn replay_count_stops_early() {
        let (dir, file) = recorded_all("count");
        let mut out = Vec::new();
        let s = run(
            &ReplayOptions {
                file,
                output: Output::Line,
                count: Some(2),
                filter: None,
            },
            &mut out,
        )
        .unwrap();
        let _ = std::fs::remove_dir_all(&dir);
        assert_eq!(s.printed, 2);
        assert_eq!(String::from_utf8(out).unwrap().lines().count(), 2);
    }

    #[test]
    fn packet_info_carries_the_line_report_and_entry_interface() {
        let recs = records();
        let mut lines = Pipeline::new(context(Output::Line), Box::new(Host));
        lines.add_plans(0, &full_plan(None));
        let Outcome::Report { bytes: line, .. } = lines.handle(&recs[0], 0) else {
            panic!("a report");
        };
        for output in [Output::Tree, Output::Json, Output::Line] {
            let mut p = Pipeline::new(context(output), Box::new(Host));
            p.add_plans(0, &full_plan(None));
            p.packet_info = true;
            // Twice: the second comes from the caches.
            for _ in 0..2 {
                let Outcome::Report {
                    packet: Some(info), ..
                } = p.handle(&recs[0], 0)
                else {
                    panic!("a report with its packet");
                };
                assert_eq!(info.line, String::from_utf8_lossy(&line).trim_end());
                assert_eq!(info.iface, "eth0");
                let rec = decode(&recs[0]).unwrap();
                assert_eq!((info.skb, info.ts_first), (rec.skb, rec.ts_first));
            }
        }
        let mut p = Pipeline::new(context(Output::Json), Box::new(Host));
        p.add_plans(0, &full_plan(None));
        assert!(
            matches!(p.handle(&recs[0], 0), Outcome::Report { packet: None, .. }),
            "only asked for"
        );
    }

    #[test]
    fn replay_filters_as_the_probes_decide_after_conntrack() {
        let (dir, file) = recorded_all("filter");
        let printed = |filter: &str| {
            let mut out = Vec::new();
            let s = run(
                &ReplayOptions {
                    file: file.clone(),
                    output: Output::Line,
                    count: None,
                    filter: Some(filter.into()),
                },
                &mut out,
            )
            .unwrap();
            assert_eq!(s.printed + s.filtered, 3, "{filter}");
            s.printed
        };
        // The ClusterIP as it entered, the pod only in the connection's reply tuple.
        assert_eq!(printed("dst host 10.10.10.2 and tcp port 22"), 3);
        assert_eq!(printed("host 172.17.0.5"), 3);
        assert_eq!(printed("udp or port 23"), 0);
        // Interface names are the recording's.
        assert_eq!(printed("iface eth0"), 3);
        assert_eq!(printed("not iface eth0"), 0);
        let mut out = Vec::new();
        let err = run(
            &ReplayOptions {
                file: file.clone(),
                output: Output::Line,
                count: None,
                filter: Some("iface nosuch0".into()),
            },
            &mut out,
        );
        let _ = std::fs::remove_dir_all(&dir);
        assert!(
            err.is_err(),
            "an interface the recording never named is an error"
        );
    }

    struct K8sNames;
    impl NameSource for K8sNames {
        fn ifname(&self, index: u32) -> String {
            format!("if{index}")
        }
        fn symbol(&self, addr: u64) -> String {
            format!("{addr:#x}")
        }
        fn knows_k8s(&self) -> bool {
            true
        }
        fn k8s(
            &self,
            addr: std::net::IpAddr,
            proto: u8,
            port: Option<u16>,
        ) -> Option<(NameKind, String)> {
            match (addr.to_string().as_str(), proto, port) {
                ("10.10.10.2", 6, Some(22)) => {
                    Some((NameKind::Service, "default/registry:ssh".into()))
                }
                ("172.17.0.5", _, _) => Some((NameKind::Pod, "default/registry-0".into())),
                _ => None,
            }
        }
    }

    #[test]
    fn endpoints_are_named_once_each_in_order() {
        use observer_model::{ConntrackView, CtState, Fate, FateKind, Marks, Source, TupleView};
        let ep = |text: &str| {
            let sa: std::net::SocketAddr = text.parse().unwrap();
            Endpoint::new(sa.ip(), Some(sa.port()))
        };
        let tuple = |src: &str, dst: &str| TupleView {
            src: ep(src),
            dst: ep(dst),
            proto: Protocol::Tcp,
        };
        let mut t = observer_model::Traversal {
            schema: observer_model::SCHEMA,
            source: Source::Observed,
            netns: None,
            family: None,
            proto: Some(Protocol::Tcp),
            packet: None,
            ingress: None,
            egress: None,
            route: None,
            bridge: None,
            encap: None,
            stages: Vec::new(),
            fate: Fate::new(FateKind::Forwarded),
            marks: Marks::default(),
            nat: Vec::new(),
            conntrack: Some(std::sync::Arc::new(ConntrackView {
                state: (CtState::New, false),
                mark: None,
                original: tuple("198.51.100.10:40000", "10.10.10.2:22"),
                reply: tuple("172.17.0.5:22", "198.51.100.10:40000"),
            })),
            names: Vec::new(),
            branches: Vec::new(),
            notes: Vec::new(),
            lost: 0,
            incomplete: false,
            incomplete_reason: None,
        };
        t.names = endpoint_names(&t, &K8sNames);
        let got: Vec<(String, &str, &str)> = t
            .names
            .iter()
            .map(|n| (n.endpoint.to_string(), n.kind.name(), n.name.as_str()))
            .collect();
        assert_eq!(
            got,
            vec![
                ("10.10.10.2:22".into(), "service", "default/registry:ssh"),
                ("172.17.0.5:22".into(), "pod", "default/registry-0"),
            ]
        );
    }
}
