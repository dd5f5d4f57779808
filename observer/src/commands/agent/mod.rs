//! `observer agent`: the always-on node agent. Attaches the probes once (as `tail` does,
//! through [`crate::upkeep`]) and keeps them right through rule and interface churn; every
//! record goes through the one [`Pipeline`] and then to the metrics, the flight recorder of
//! recent drops, and the streaming API's subscribers ([`hub`]).
//!
//! Endpoints: `/metrics`, `/healthz`, `/readyz` on `--metrics-addr`; `/v1/traces` and
//! `/v1/drops` (NDJSON) on the unix socket `--socket` (mode 0600: traces carry addresses)
//! and on `--listen` when given. SIGTERM or SIGINT: detach, close the streams, exit 0.

pub mod client;
pub mod http;
pub mod hub;
pub mod kcounts;
mod memory;
pub mod metrics;
mod names_only;
pub mod tier0;
pub mod tier1;

use std::os::unix::fs::PermissionsExt;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use log::{info, warn};
use tokio::io::unix::AsyncFd;
use tokio::signal::unix::{SignalKind, signal};

use crate::btf::KernelLayout;
use crate::decode::{decode, encode_record};
use crate::pipeline::{Context as PipelineContext, LiveNames, Outcome, Output, Pipeline};
use crate::probes::Probes;
use crate::rulenames::RuleNamer;
use crate::upkeep::{
    RulesetReader, SOCKET_GRACE, attach_brackets, attach_counting, attach_drops_only,
    attach_probes, housekeeping, legacy_tables, mark_dictionary, now_ns, read_live, replan,
    watch_ruleset,
};
use hub::{FlightRecorder, Held, Hub, Rendered};
use kcounts::{KernelCounts, Naming};
use metrics::{Health, Metrics, ReportView};
use observer_common::filter::FilterProgram;
use observer_common::traversal::{TraversalRecord, end};

/// The agent's default unix socket.
pub const DEFAULT_SOCKET: &str = "/run/observer/agent.sock";

#[derive(Clone, Debug)]
pub struct AgentOptions {
    pub netns: Option<String>,
    /// Metrics and health (HTTP).
    pub metrics_addr: String,
    /// The streaming API's unix socket.
    pub socket: PathBuf,
    /// The streaming API on TCP too.
    pub listen: Option<String>,
    pub marks_file: Option<PathBuf>,
    /// Dropped traversals the flight recorder holds at most.
    pub flight_recorder: usize,
    /// Memory the flight recorder may use at most, bytes.
    pub flight_recorder_bytes: usize,
    /// The `node` label (NODE_NAME, else the host name).
    pub node: String,
    pub idle: Duration,
    pub ready_file: Option<PathBuf>,
    pub mode: AgentMode,
    /// Benchmarks only: the probes return at once.
    pub floor: bool,
    /// How often tier 0 reads the rules' and conntrack's counters.
    pub rules_interval: Duration,
    /// Series the rule counters may make at most (`observer_rule_series_left_out` counts
    /// the rest).
    pub rule_series_cap: usize,
    /// Tier 1: the least time between two samples of dropped packets on one CPU (`None`:
    /// no samples).
    pub drop_sample_gap: Option<Duration>,
    /// Tier 1: drop reasons the kernel neither counts by key nor samples.
    pub drop_reasons_ignored: Vec<String>,
}

/// What the probes do while no streaming client wants traces.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum AgentMode {
    /// The default: no program that runs for every packet. Tier 0 reads what the kernel
    /// already counts (every rule's counter, conntrack's statistics) each
    /// --rules-interval; tier 1 counts drops by reason from the one `kfree_skb` tracepoint
    /// program (it runs only when a packet is dropped). The per-table probes are attached
    /// only while a streaming client is connected.
    Kernel,
    /// Per-table brackets, always: the probes keep counters in the kernel (per family,
    /// hook and table: packets, mark bits set and cleared, NAT by kind and source, drops by
    /// reason and place) and record each dropped packet as it died, for the flight
    /// recorder. Costs every packet a probe at each table. Whole traversals are recorded
    /// only while a streaming client is connected (tcx and the socket probes are attached
    /// for that time).
    #[value(alias = "counters")]
    Brackets,
    /// Record every traversal, all the time (the metrics are taken from them, as `tail`
    /// sees them; costs what `tail` costs).
    Trace,
}

impl AgentMode {
    pub fn name(self) -> &'static str {
        match self {
            Self::Kernel => "kernel",
            Self::Brackets => "brackets",
            Self::Trace => "trace",
        }
    }
}

/// How long the always-on mode keeps recording traversals after the last streaming client
/// left (a client that reconnects does not pay the attach again).
const TRACING_LINGER: Duration = Duration::from_secs(5);

/// Records handled before the event loop looks at signals, timers and clients again.
const BATCH: usize = 1024;

/// Runs the agent until SIGTERM/SIGINT. Must be called before any other thread exists: it
/// moves the process into the target namespace, where the probes attach and the TCP
/// listeners bind.
pub fn run(opts: AgentOptions) -> Result<&'static str> {
    if let Some(ns) = &opts.netns {
        crate::netns::enter(ns)?;
    }
    let layout = KernelLayout::from_kernel()?;
    // The default mode reads only what names need (super::names_only): the whole model
    // of a large ruleset is half a gigabyte.
    let live = if opts.mode == AgentMode::Kernel {
        names_only::read()
    } else {
        read_live()
    };
    let marks = mark_dictionary(&live, opts.marks_file.as_ref())?;
    let netns = opts.netns.clone().unwrap_or_else(|| "current".into());
    let ctx = |output| PipelineContext {
        output,
        netns: netns.clone(),
        tuple: layout.tuple,
        drop_reasons: layout.drop_reasons.clone(),
        marks: marks.clone(),
        // The streams' reports name the rules of every stage, as tail's do.
        // The default mode names rules only while someone streams (super::memory).
        namer: (opts.mode != AgentMode::Kernel).then(|| RuleNamer::new(&live, 0)),
    };
    // Kubernetes names: served at /v1/names and shown in the reports.
    let names = Arc::new(crate::k8s::Names::default());
    names.refresh_services_from(&live);
    let live_names = || Box::new(LiveNames::load().with_k8s(names.clone()));
    let pipelines = Pipelines {
        json: Pipeline::new(ctx(Output::Json), live_names()),
        tree: Pipeline::new(ctx(Output::Tree), live_names()),
        line: Pipeline::new(ctx(Output::Line), live_names()),
    };
    // The default mode keeps no copy of the ruleset (super::memory).
    let live = (opts.mode != AgentMode::Kernel).then_some(live);
    memory::release();
    let metrics = Arc::new(Metrics::new(&opts.node));
    metrics.set_mode(
        opts.mode.name(),
        match opts.mode {
            AgentMode::Kernel => "0,1",
            AgentMode::Brackets | AgentMode::Trace => "0,2",
        },
    );
    // Tier 1 confirms its samples' rules with tier 0's counters.
    let drop_counters = tier1::LastRead::default();
    // Tier 0 in every mode: it costs the datapath nothing.
    tier0::spawn(
        tier0::Tier0Options {
            interval: opts.rules_interval,
            cap: opts.rule_series_cap,
            node: opts.node.clone(),
            marks: marks.clone(),
            drop_counters: (opts.mode == AgentMode::Kernel).then(|| drop_counters.clone()),
        },
        metrics.clone(),
    )
    .context("reading the rules' counters (run as root, or with CAP_NET_ADMIN and CAP_NET_RAW)")?;
    let hub = Arc::new(Hub::new(
        layout.tuple,
        FlightRecorder::new(opts.flight_recorder, opts.flight_recorder_bytes),
    ));
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    rt.block_on(async {
        // Listening first: connections made while the probes attach wait in the backlog and
        // are answered once they are (the runtime has one thread); /readyz then says ready.
        serve(&opts, metrics.clone(), hub.clone(), names.clone()).await?;
        names.watch_pods(opts.node.clone());
        let mut probes = match opts.mode {
            AgentMode::Trace => attach_probes(
                &layout,
                &FilterProgram::KEEP_ALL,
                live.as_ref().context("the live ruleset")?,
                opts.floor,
            )?,
            AgentMode::Brackets => attach_counting(
                &layout,
                live.as_ref().context("the live ruleset")?,
                opts.floor,
            )?,
            AgentMode::Kernel => attach_drops_only(&layout, opts.floor)?,
        };
        // Loading the probes parsed the kernel's BTF: handed back.
        memory::release();
        let tier1 = if opts.mode == AgentMode::Kernel {
            Some(tier1::Tier1::start(
                &mut probes,
                opts.drop_sample_gap,
                &opts.drop_reasons_ignored,
                layout.drop_reasons.clone(),
                &opts.node,
                hub.clone(),
                drop_counters,
            )?)
        } else {
            None
        };
        let ring = probes.take_ring()?;
        let naming = (marks, layout.drop_reasons.clone());
        event_loop(
            &opts, probes, ring, pipelines, metrics, hub, &names, naming, tier1,
        )
        .await
    })
}

async fn serve(
    opts: &AgentOptions,
    metrics: Arc<Metrics>,
    hub: Arc<Hub>,
    names: Arc<crate::k8s::Names>,
) -> Result<()> {
    let m = tokio::net::TcpListener::bind(&opts.metrics_addr)
        .await
        .with_context(|| {
            format!(
                "listening on --metrics-addr {}: is another agent running, or give another \
                 address",
                opts.metrics_addr
            )
        })?;
    tokio::spawn(async move {
        if let Err(e) = axum::serve(m, http::metrics_router(metrics)).await {
            warn!("metrics server stopped: {e}");
        }
    });
    if let Some(dir) = opts.socket.parent() {
        std::fs::create_dir_all(dir)
            .with_context(|| format!("creating {} for the agent's socket", dir.display()))?;
    }
    // A socket left by an agent that was killed: nobody answers on it any more.
    if std::os::unix::net::UnixStream::connect(&opts.socket).is_err() {
        let _ = std::fs::remove_file(&opts.socket);
    }
    let u = tokio::net::UnixListener::bind(&opts.socket).with_context(|| {
        format!(
            "listening on --socket {}: is another agent running? (stop it, or give another path)",
            opts.socket.display()
        )
    })?;
    std::fs::set_permissions(&opts.socket, std::fs::Permissions::from_mode(0o600))
        .with_context(|| format!("making {} root-only", opts.socket.display()))?;
    let api = http::api_router(hub, names);
    let api2 = api.clone();
    tokio::spawn(async move {
        if let Err(e) = axum::serve(u, api2).await {
            warn!("streaming API (unix socket) stopped: {e}");
        }
    });
    if let Some(addr) = &opts.listen {
        let t = tokio::net::TcpListener::bind(addr)
            .await
            .with_context(|| format!("listening on --listen {addr}"))?;
        tokio::spawn(async move {
            if let Err(e) = axum::serve(t, api).await {
                warn!("streaming API (TCP) stopped: {e}");
            }
        });
    }
    Ok(())
}

/// One pipeline per output mode (tree and line render only what someone wants).
struct Pipelines {
    json: Pipeline,
    tree: Pipeline,
    line: Pipeline,
}

impl Pipelines {
    fn all(&mut self) -> [&mut Pipeline; 3] {
        [&mut self.json, &mut self.tree, &mut self.line]
    }
}

/// Turns records into reports and hands them on.
struct Agent {
    pipelines: Pipelines,
    metrics: Arc<Metrics>,
    hub: Arc<Hub>,
    lost_now: u64,
    unusable: u64,
    /// Interfaces in the namespace, as last counted.
    interfaces: u64,
    mode: AgentMode,
    /// The always-on mode's counters, as last read.
    kernel: KernelCounts,
    marks: crate::marks::MarkDictionary,
    reasons: std::collections::HashMap<u32, String>,
}

impl Agent {
    fn handle(&mut self, raw: &[u8]) {
        let rec = match decode(raw) {
            Ok(r) => r,
            Err(e) => {
                warn!("undecodable record: {e}");
                self.unusable += 1;
                return;
            }
        };
        let json = match self.pipelines.json.handle(raw, self.lost_now) {
            Outcome::Report { bytes, .. } => bytes,
            other => {
                crate::pipeline::warn_unusable(&other);
                self.unusable += 1;
                return;
            }
        };
        let dropped = match ReportView::from_json(&json) {
            Ok(v) => {
                // In the always-on mode the kernel counts every packet itself.
                if self.mode == AgentMode::Trace {
                    self.metrics.observe(&v);
                }
                v.is_drop()
            }
            Err(e) => {
                warn!("a report the metrics cannot read: {e}");
                false
            }
        };
        let (mut tree, mut line) = self.hub.wanted(&rec);
        tree |= dropped;
        line |= dropped;
        let render = |p: &mut Pipeline| match p.handle(raw, self.lost_now) {
            Outcome::Report { bytes, .. } => Some(bytes),
            _ => None,
        };
        let rendered = Rendered {
            json,
            tree: tree.then(|| render(&mut self.pipelines.tree)).flatten(),
            line: line.then(|| render(&mut self.pipelines.line)).flatten(),
        };
        self.hub.dispatch(&rec, &rendered);
        if dropped {
            self.hub
                .flight
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .push(Held { rec, rendered });
        }
    }

    fn handle_record(&mut self, rec: &TraversalRecord) {
        self.handle(&encode_record(rec));
    }

    /// After a ruleset change: rules and mark bits are named from the node as read again.
    fn rules_changed(
        &mut self,
        live: &observer_rules::LiveNode,
        marks_file: Option<&PathBuf>,
        tracing: bool,
    ) {
        let marks = match mark_dictionary(live, marks_file) {
            Ok(m) => {
                self.marks = m.clone();
                Some(m)
            }
            Err(e) => {
                warn!("mark names not updated after the ruleset change: {e:#}");
                None
            }
        };
        for p in self.pipelines.all() {
            // The default mode builds namers only while someone streams (super::memory).
            if self.mode == AgentMode::Kernel && !tracing {
                p.ruleset_changed(marks.clone(), None);
                continue;
            }
            let generation = p.ctx.namer.as_ref().map_or(0, |n| n.generation) + 1;
            p.ruleset_changed(marks.clone(), Some(RuleNamer::new(live, generation)));
        }
    }

    /// Always-on mode: adds what the kernel's counters gained to the metrics.
    fn read_counts(&mut self, probes: &Probes) {
        if self.mode == AgentMode::Trace {
            return;
        }
        let points = KernelCounts::points(&probes.plans);
        let read = probes
            .point_counts(&points)
            .and_then(|rows| Ok((rows, probes.drop_counts(&points)?)));
        match read {
            Ok((rows, drops)) => {
                let names = Naming {
                    marks: &self.marks,
                    reasons: &self.reasons,
                };
                self.kernel
                    .apply(&probes.plans, &rows, &drops, &names, &self.metrics);
            }
            Err(e) => warn!("reading the probes' counters: {e:#}"),
        }
    }

    fn add_plans(&mut self, probes: &Probes) {
        for p in self.pipelines.all() {
            p.add_plans(probes.generation(), &probes.plans);
        }
    }
}

fn drain(
    ring: &mut aya::maps::RingBuf<aya::maps::MapData>,
    agent: &mut Agent,
    max: usize,
) -> usize {
    let mut n = 0;
    while n < max {
        let Some(item) = ring.next() else { break };
        n += 1;
        agent.handle(&item);
    }
    n
}

fn update_health(probes: &Probes, agent: &Agent, ready: bool) {
    // Interfaces are counted once a second (housekeeping), not on every tick.
    let k = probes.counters().unwrap_or_default();
    let flight = agent.hub.flight.lock().unwrap_or_else(|e| e.into_inner());
    agent.metrics.set_health(Health {
        records_lost: k.ringbuf_full,
        packets_seen: if agent.mode == AgentMode::Brackets {
            agent.kernel.seen
        } else {
            k.seen
        },
        netfilter_probes: probes.netfilter_links() as u64,
        interfaces: agent.interfaces,
        ruleset_generation: u64::from(probes.generation()),
        attach_failures: probes.attach_failures,
        unusable_records: agent.unusable,
        subscribers: agent.hub.subscribers() as u64,
        subscriber_skipped: agent.hub.skipped_total(),
        flight_recorder_held: flight.len() as u64,
        flight_recorder_capacity: flight.capacity as u64,
        ready,
        unattributed: agent.kernel.unattributed,
        tracing: probes.tracing(),
    });
}

/// Always-on mode: records traversals while a streaming client is connected, and goes back
/// to counting only [`TRACING_LINGER`] after the last one left.
fn follow_subscribers(
    probes: &mut Probes,
    agent: &mut Agent,
    unwatched_since: &mut Option<Instant>,
    kernel_filter: &mut Option<String>,
    marks_file: Option<&PathBuf>,
) {
    let watched = agent.hub.subscribers() > 0;
    if watched {
        *unwatched_since = None;
        // The probes keep what any subscriber wants; the hub then gives each its own.
        let wanted = agent.hub.kernel_filter();
        let changed = !probes.tracing() || wanted != *kernel_filter;
        let program = match &wanted {
            Some(expr) if changed => crate::filter::compile(expr, &|name| {
                crate::probes::ifindex(name)
            })
            .unwrap_or_else(|e| {
                // Each filter compiled alone; together they may be too complex.
                info!(
                    "the subscribers' filters together do not compile ({e}): keeping every packet"
                );
                FilterProgram::KEEP_ALL
            }),
            _ => FilterProgram::KEEP_ALL,
        };
        if !probes.tracing() {
            // The default mode brackets the tables only for as long as someone streams.
            if agent.mode == AgentMode::Kernel {
                let live = match attach_brackets(probes) {
                    Ok(live) => live,
                    Err(e) => {
                        warn!("attaching the per-table probes for a streaming client: {e:#}");
                        return;
                    }
                };
                agent.add_plans(probes);
                // The streams name rules from the ruleset as read now.
                agent.rules_changed(&live, marks_file, true);
            }
            if let Err(e) = probes.start_tracing(&program) {
                warn!("recording traversals for a streaming client: {e:#}");
                return;
            }
        } else if changed && let Err(e) = probes.set_filter(&program) {
            warn!("setting the probes' filter for the streaming clients: {e:#}");
            return;
        }
        *kernel_filter = wanted;
    } else if probes.tracing() {
        let since = *unwatched_since.get_or_insert_with(Instant::now);
        if since.elapsed() >= TRACING_LINGER {
            *unwatched_since = None;
            if let Err(e) = probes.stop_tracing() {
                warn!("back to counting only: {e:#}");
            }
            if agent.mode == AgentMode::Kernel {
                if let Err(e) = probes.detach_netfilter() {
                    warn!("detaching the per-table probes: {e:#}");
                }
                memory::drop_namers(&mut agent.pipelines);
            }
        }
    }
}

#[allow(clippy::too_many_arguments)]
async fn event_loop(
    opts: &AgentOptions,
    mut probes: Probes,
    ring: aya::maps::RingBuf<aya::maps::MapData>,
    pipelines: Pipelines,
    metrics: Arc<Metrics>,
    hub: Arc<Hub>,
    names: &crate::k8s::Names,
    naming: (
        crate::marks::MarkDictionary,
        std::collections::HashMap<u32, String>,
    ),
    mut tier1: Option<tier1::Tier1>,
) -> Result<&'static str> {
    let mut agent = Agent {
        pipelines,
        metrics,
        hub,
        lost_now: 0,
        unusable: 0,
        interfaces: crate::probes::interfaces().len() as u64,
        mode: opts.mode,
        kernel: KernelCounts::default(),
        marks: naming.0,
        reasons: naming.1,
    };
    // Always-on mode: when the last streaming client left.
    let mut unwatched_since: Option<Instant> = None;
    // The probes' filter while recording for subscribers (None: every packet).
    let mut kernel_filter: Option<String> = None;
    agent.add_plans(&probes);
    // SAFETY: the ring buffer owns its fd and outlives the registration (both live here).
    let mut ring = unsafe { AsyncFd::register(ring) }
        .map_err(|e| anyhow::anyhow!("polling the ring buffer: {e}"))?;
    let mut sigint = signal(SignalKind::interrupt())?;
    let mut sigterm = signal(SignalKind::terminate())?;
    update_health(&probes, &agent, true);
    info!(
        "agent ready: {} netfilter probes; metrics on {}, streaming API on {}{}",
        probes.netfilter_links(),
        opts.metrics_addr,
        opts.socket.display(),
        opts.listen
            .as_ref()
            .map(|l| format!(" and {l}"))
            .unwrap_or_default()
    );
    if let Some(path) = &opts.ready_file {
        std::fs::write(path, format!("{}\n", std::process::id()))
            .with_context(|| format!("writing ready file {}", path.display()))?;
    }
    let mut tick = tokio::time::interval(Duration::from_millis(100));
    let mut drain_tick = tokio::time::interval(Duration::from_millis(10));
    drain_tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let netns_file = opts
        .netns
        .as_ref()
        .map(|n| PathBuf::from("/run/netns").join(n));
    let netns_inode = crate::probes::current_netns_inode()?;
    let mut legacy_names = legacy_tables().0;
    let mut last_scan = Instant::now();
    let watch = watch_ruleset();
    // The node is read again off the event loop: clients and the ring buffer keep going.
    let mut ruleset = RulesetReader::default();
    let stopped_by: &'static str = loop {
        tokio::select! {
            biased;
            _ = sigint.recv() => break "SIGINT",
            _ = sigterm.recv() => break "SIGTERM",
            guard = async { watch.as_ref().expect("guarded").readable().await }, if watch.is_some() => {
                let mut guard = guard?;
                if guard.get_inner().drain() {
                    ruleset.changed();
                }
                guard.clear_ready();
            }
            _ = tick.tick() => {
                // The default mode reads only names while nobody streams (super::names_only).
                let light = (opts.mode == AgentMode::Kernel && !probes.tracing())
                    .then_some(names_only::read as fn() -> observer_rules::LiveNode);
                if let Some((since, live, light)) = ruleset.poll_with(light) {
                    // Tracing began during a light read: a whole read follows for the plan
                    // and the namers.
                    if light && probes.tracing() {
                        ruleset.changed();
                    }
                    // kube-proxy's services change with its rules, plan or no plan.
                    names.refresh_services_from(&live);
                    // Counted under the plan in force: labelled before it changes.
                    agent.read_counts(&probes);
                    // A light read cannot name rules: the namers stay as they are.
                    agent.rules_changed(
                        &live,
                        opts.marks_file.as_ref(),
                        probes.tracing() && !light,
                    );
                    // The default mode has per-table probes only while someone streams.
                    let bracketed = !light && (opts.mode != AgentMode::Kernel || probes.tracing());
                    if bracketed && replan(&mut probes, &live) {
                        agent.add_plans(&probes);
                        let to = now_ns();
                        for p in agent.pipelines.all() {
                            p.replanned(since, to);
                        }
                    }
                    if !bracketed {
                        drop(live);
                        memory::release();
                    }
                }
                agent.lost_now = probes.counters().map(|c| c.ringbuf_full).unwrap_or(agent.lost_now);
                agent.hub.set_lost(agent.lost_now);
                let now = now_ns();
                match probes.sweep(
                    now.saturating_sub(SOCKET_GRACE.as_nanos() as u64),
                    now.saturating_sub(opts.idle.as_nanos() as u64),
                    end::IDLE,
                ) {
                    Ok(recs) => recs.iter().for_each(|r| agent.handle_record(r)),
                    Err(e) => warn!("reading the probes' fallback map: {e:#}"),
                }
                agent.hub.tick();
                if let Some(t) = tier1.as_mut() {
                    t.poll(&probes, &agent.hub, &agent.metrics);
                }
                if opts.mode != AgentMode::Trace {
                    follow_subscribers(&mut probes, &mut agent, &mut unwatched_since, &mut kernel_filter, opts.marks_file.as_ref());
                }
                update_health(&probes, &agent, true);
                if last_scan.elapsed() >= Duration::from_secs(1) {
                    last_scan = Instant::now();
                    agent.read_counts(&probes);
                    let h = housekeeping(&mut probes, netns_file.as_deref(), netns_inode);
                    agent.interfaces = crate::probes::interfaces().len() as u64;
                    if h.names_changed {
                        for p in agent.pipelines.all() {
                            p.forget_names();
                        }
                    }
                    if let Some(why) = h.stop {
                        break why;
                    }
                    let legacy = legacy_tables().0;
                    if legacy != legacy_names {
                        legacy_names = legacy;
                        ruleset.changed();
                    }
                }
            }
            guard = ring.readable_mut() => {
                let mut guard = guard?;
                if drain(guard.get_inner_mut(), &mut agent, BATCH) < BATCH {
                    guard.clear_ready();
                }
            }
            _ = drain_tick.tick() => {
                drain(ring.get_mut(), &mut agent, BATCH);
            }
        }
    };
    // As tail stops: every probe told at once, then detached (released in the background).
    let stopping = Instant::now();
    update_health(&probes, &agent, false);
    if let Err(e) = probes.set_floor(true) {
        warn!("stopping the probes: {e:#}");
    }
    let releasing = probes.detach();
    tokio::time::sleep(Duration::from_millis(30)).await;
    // What the probes wrote before they stopped goes out still, within a bound.
    let until = Instant::now() + Duration::from_millis(300);
    while Instant::now() < until && drain(ring.get_mut(), &mut agent, 256) > 0 {}
    agent.read_counts(&probes);
    update_health(&probes, &agent, false);
    agent.hub.close_all();
    let _ = std::fs::remove_file(&opts.socket);
    // The streams' closing lines, written by the connections' tasks.
    tokio::time::sleep(Duration::from_millis(150)).await;
    let _ = releasing.join();
    info!("agent stopped by {stopped_by} in {:?}", stopping.elapsed());
    Ok(stopped_by)
}
