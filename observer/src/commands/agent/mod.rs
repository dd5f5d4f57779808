//! `observer agent`: the always-on node agent. Attaches the probes once (as `tail` does,
//! through [`crate::kernel::upkeep`]) and keeps them right through rule and interface churn; every
//! record goes through the one [`Pipeline`] and then to the metrics, the flight recorder of
//! recent drops, and the streaming API's subscribers ([`hub`]).
//!
//! Endpoints: `/metrics`, `/healthz`, `/readyz` on `--metrics-addr`; `/v1/traces` and
//! `/v1/drops` (NDJSON) on the unix socket `--socket` (mode 0600: traces carry addresses)
//! and on `--listen` when given. SIGTERM or SIGINT: detach, close the streams, exit 0.

pub mod client;
mod drop_rules;
pub mod http;
pub mod hub;
pub mod kcounts;
mod memory;
pub mod metrics;
mod names_only;
pub mod peer;
pub mod tier0;
mod tier0_ipvs;
pub mod tier1;
pub mod tier2;
pub mod window;

use std::os::unix::fs::PermissionsExt;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use log::{info, warn};

use crate::kernel::btf::KernelLayout;
use crate::kernel::probes::Probes;
use crate::kernel::session::{Consumer, Next, Replan, Session, SessionOptions, Stop, Tick};
use crate::kernel::upkeep::{
    attach_brackets, attach_counting, attach_drops_only, attach_probes, mark_dictionary, read_live,
};
use crate::pipeline::rulenames::RuleNamer;
use crate::pipeline::{
    Context as PipelineContext, Handled, LiveNames, Outcome, Output, Pipeline, Sink,
};
use hub::{FlightRecorder, Held, Hub, Rendered};
use kcounts::{KernelCounts, Naming};
use metrics::{Health, Metrics};
use observer_common::filter::FilterProgram;

/// The agent's default unix socket.
pub const DEFAULT_SOCKET: &str = "/run/observer/agent.sock";

#[derive(Clone, Debug)]
pub struct AgentOptions {
    /// Where the agent lives, listeners included (`ip netns` name or path).
    pub netns: Option<String>,
    /// The namespace to observe while the listeners stay in the one the agent started in
    /// (the pod's): entered once they are bound, and `CAP_SYS_ADMIN` dropped then.
    pub node_netns: Option<String>,
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
    /// Tier 2: when the brackets are armed without a streaming client.
    pub tier2: tier2::Tier2Options,
    /// Observe the nft bridge family's chains through nf_tables' trace
    /// (`kernel::bridgetrace`) instead of simulating them.
    pub trace_bridge_chains: bool,
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
/// moves the process into the target namespace, where the probes attach. The TCP listeners
/// bind there too with `--netns`; with `--node-netns` they bind first, in the namespace the
/// agent started in (sockets keep the namespace they were made in).
pub fn run(opts: AgentOptions) -> Result<&'static str> {
    if let Some(ns) = &opts.netns {
        crate::kernel::netns::enter(ns)?;
    }
    let listeners = Listeners::bind(&opts)?;
    if let Some(ns) = &opts.node_netns {
        crate::kernel::netns::enter(ns).context(
            "entering --node-netns (the DaemonSet gives the agent CAP_SYS_ADMIN for this and \
             mounts the node's namespace file)",
        )?;
        // Served its purpose: nothing after this needs it (super::caps).
        let held = crate::kernel::caps::drop_sys_admin()?;
        info!(
            "observing network namespace {ns}; the listeners stay in the one the agent \
             started in{}",
            if held { "; CAP_SYS_ADMIN dropped" } else { "" }
        );
    }
    let layout = KernelLayout::from_kernel()?;
    tier2_flags_fit(&opts, &layout)?;
    // The default mode reads only what names need (super::names_only): the whole model
    // of a large ruleset is half a gigabyte.
    let live = if opts.mode == AgentMode::Kernel {
        names_only::read()
    } else {
        read_live()
    };
    let marks = mark_dictionary(&live, opts.marks_file.as_ref())?;
    // Before the probes: a node that cannot have the table says so before anything attaches.
    let bridge_trace = if opts.trace_bridge_chains {
        Some(crate::kernel::bridgetrace::BridgeTrace::open(&live)?)
    } else {
        None
    };
    let netns = opts
        .node_netns
        .clone()
        .or_else(|| opts.netns.clone())
        .unwrap_or_else(|| "current".into());
    let ctx = PipelineContext {
        // The streams' JSON is the one rendering every record gets (the flight recorder
        // and most subscribers want it); trees and lines only where someone wants them.
        output: Output::Json,
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
    names.set_services(&live);
    let pipeline = Pipeline::new(ctx, Box::new(LiveNames::load().with_k8s(names.clone())));
    // The default mode keeps no copy of the ruleset (super::memory).
    let live = (opts.mode != AgentMode::Kernel).then_some(live);
    memory::release();
    let metrics = Arc::new(Metrics::new(&opts.node));
    metrics.set_mode(
        opts.mode.name(),
        match opts.mode {
            AgentMode::Kernel => "0,1,2",
            AgentMode::Brackets | AgentMode::Trace => "0,2",
        },
    );
    // Tier 1 confirms its samples' rules with tier 0's counters.
    let drop_counters = tier1::LastRead::default();
    let hub = Arc::new(Hub::new(
        layout.tuple,
        FlightRecorder::new(opts.flight_recorder, opts.flight_recorder_bytes),
    ));
    // The event loop runs on this thread (`block_on`); the HTTP servers and the streams run
    // on a worker of their own, so that a scrape is answered while the loop attaches or
    // detaches probes (blocking system calls that take seconds on a loaded node).
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .thread_name("observer-http")
        .enable_all()
        .build()?;
    let arming = Arc::new(tier2::Arming::default());
    rt.block_on(async {
        // Listening first: /readyz says "not ready" until the probes are attached.
        serve(
            &opts,
            listeners,
            metrics.clone(),
            hub.clone(),
            names.clone(),
            arming.clone(),
        )
        .await?;
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
        metrics.set_capture_backend(
            probes.capture_backend().label(),
            probes.capture_ready(),
            probes.tracing_refused(),
        );
        if let Some(why) = probes.tracing_refused() {
            warn!(
                "{why}: the per-table probes cannot be attached; streams of traversals end at \
                 once; tier 0 and tier 1 work"
            );
        } else if opts.mode == AgentMode::Kernel {
            // Verified now, once: a client's brackets then attach in milliseconds instead of
            // missing the traffic of the seconds the verifier takes.
            let t = Instant::now();
            // Every standard table's plan (the node's own is read when a client comes; a
            // chain at another priority loads its program then).
            match probes.preload_points(&crate::kernel::plan::full_plan(None)) {
                Ok(n) => info!(
                    "{n} per-table programs loaded ahead of the first client in {:.2} s",
                    t.elapsed().as_secs_f64()
                ),
                Err(e) => warn!("loading the per-table programs ahead of time: {e:#}"),
            }
        }
        // Loading the probes parsed the kernel's BTF: handed back.
        drop(live);
        memory::release();
        // Tier 0 in every mode: it costs the datapath nothing. Started once the probes are
        // loaded: its first read of a large ruleset and the parse of the kernel's BTF would
        // otherwise hold their memory at the same time (the agent's peak).
        tier0::spawn(
            tier0::Tier0Options {
                interval: opts.rules_interval,
                cap: opts.rule_series_cap,
                marks: marks.clone(),
                drop_counters: (opts.mode == AgentMode::Kernel).then(|| drop_counters.clone()),
                names: Some(names.clone()),
            },
            metrics.clone(),
        )
        .context(
            "reading the rules' counters (run as root, or with CAP_NET_ADMIN and CAP_NET_RAW)",
        )?;
        let tier1 = if opts.mode == AgentMode::Kernel {
            Some(tier1::Tier1::start(
                &mut probes,
                opts.drop_sample_gap,
                &opts.drop_reasons_ignored,
                layout.drop_reasons.clone(),
                hub.clone(),
                drop_counters,
            )?)
        } else {
            None
        };
        let naming = (marks, layout.drop_reasons.clone());
        event_loop(
            &opts,
            probes,
            pipeline,
            metrics,
            hub,
            names.clone(),
            naming,
            tier1,
            tier2::Tier2::new(opts.tier2.clone(), arming),
            bridge_trace,
        )
        .await
    })
}

/// `--arm-drop-rate` reads tier 1's counts (the default mode), by this kernel's reasons.
fn tier2_flags_fit(opts: &AgentOptions, layout: &KernelLayout) -> Result<()> {
    if !opts.tier2.drop_rates.is_empty() && opts.mode != AgentMode::Kernel {
        anyhow::bail!(
            "--arm-drop-rate needs the default mode (--mode kernel): it reads tier 1's drop \
             counts, which --mode {} does not keep",
            opts.mode.name()
        );
    }
    for r in &opts.tier2.drop_rates {
        if let Some(name) = &r.reason
            && !layout.drop_reasons.values().any(|n| n == name)
        {
            anyhow::bail!(
                "--arm-drop-rate {name}=...: this kernel has no such drop reason (names are \
                 enum skb_drop_reason's without SKB_DROP_REASON_, e.g. NETFILTER_DROP)"
            );
        }
    }
    Ok(())
}

/// The agent's TCP listeners, bound in the namespace the agent is in when [`Listeners::bind`]
/// runs, whichever namespace it observes afterwards.
struct Listeners {
    metrics: std::net::TcpListener,
    /// `--listen`, and the TCP tables of its namespace (who connects: `peer`).
    api: Option<(std::net::TcpListener, peer::TcpTables)>,
}

impl Listeners {
    fn bind(opts: &AgentOptions) -> Result<Self> {
        let bind = |addr: &str| -> std::io::Result<std::net::TcpListener> {
            let l = std::net::TcpListener::bind(addr)?;
            // Served by tokio.
            l.set_nonblocking(true)?;
            Ok(l)
        };
        let metrics = bind(&opts.metrics_addr).with_context(|| {
            format!(
                "listening on --metrics-addr {}: is another agent running, or give another \
                 address",
                opts.metrics_addr
            )
        })?;
        let api = match &opts.listen {
            Some(addr) => Some((
                bind(addr).with_context(|| format!("listening on --listen {addr}"))?,
                peer::TcpTables::open()
                    .context("opening /proc/thread-self/net/tcp (who connects to --listen)")?,
            )),
            None => None,
        };
        Ok(Self { metrics, api })
    }
}

async fn serve(
    opts: &AgentOptions,
    listeners: Listeners,
    metrics: Arc<Metrics>,
    hub: Arc<Hub>,
    names: Arc<crate::k8s::Names>,
    arming: Arc<tier2::Arming>,
) -> Result<()> {
    let m = tokio::net::TcpListener::from_std(listeners.metrics)?;
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
    let api = http::api_router(hub, names, arming);
    let api2 = api.clone();
    tokio::spawn(async move {
        if let Err(e) = axum::serve(u, api2).await {
            warn!("streaming API (unix socket) stopped: {e}");
        }
    });
    if let Some((t, tables)) = listeners.api {
        let t = tokio::net::TcpListener::from_std(t)?;
        let ours = t.local_addr()?;
        // Root only: see `peer`.
        let api = api
            .layer(axum::middleware::from_fn(move |c, r, n| {
                peer::root_only(tables.clone(), ours, c, r, n)
            }))
            .into_make_service_with_connect_info::<std::net::SocketAddr>();
        tokio::spawn(async move {
            if let Err(e) = axum::serve(t, api).await {
                warn!("streaming API (TCP) stopped: {e}");
            }
        });
    }
    Ok(())
}

/// Turns each record into one typed traversal and hands it to the sinks: metrics, the
/// flight recorder, the subscribers (each rendering made once, for whoever wants it).
struct Agent {
    pipeline: Pipeline,
    metrics: Arc<Metrics>,
    hub: Arc<Hub>,
    lost_now: u64,
    unusable: u64,
    /// Interfaces in the namespace, as last counted.
    interfaces: u64,
    mode: AgentMode,
    /// The always-on mode's counters, as last read.
    kernel: KernelCounts,
    marks: observer_model::marks::MarkDictionary,
    reasons: std::collections::HashMap<u32, String>,
    marks_file: Option<PathBuf>,
    /// Service names, from the node as the session reads it after each ruleset change.
    names: Arc<crate::k8s::Names>,
    /// Always-on mode: when a streaming client was last connected.
    last_client: Option<Instant>,
    /// The probes' filter while recording for subscribers (None: every packet).
    kernel_filter: Option<String>,
    /// The default mode's tier 1 (drops by key and their samples).
    tier1: Option<tier1::Tier1>,
    /// A node read only for names was let go: freed memory to hand back (super::memory).
    release_pending: bool,
    /// Tier 2: the brackets armed for a bounded time (super::tier2).
    tier2: tier2::Tier2,
    /// Bridged reports' notes on the nft bridge family's chains (simulated, confirmed by
    /// counters; `kernel::bridgechains`): made on the first bridged report.
    bridge_chains: Option<crate::kernel::bridgechains::BridgeChains>,
    /// `--trace-bridge-chains`: the trace table and the frames its events describe.
    bridge_trace: Option<crate::kernel::bridgetrace::BridgeTrace>,
}

impl Agent {
    /// One record through the pipeline, its traversal to the metrics and the hub.
    fn handle(&mut self, raw: &[u8]) {
        let mut metrics = MetricsSink {
            metrics: &self.metrics,
            // In the always-on modes the kernel counts every packet itself.
            on: self.mode == AgentMode::Trace,
        };
        let mut hub = HubSink {
            hub: &self.hub,
            tier2: &mut self.tier2,
            tuple: self.pipeline.ctx.tuple,
            bridge_chains: &mut self.bridge_chains,
            bridge_trace: self.bridge_trace.as_mut(),
        };
        let sinks: [&mut dyn Sink; 2] = [&mut metrics, &mut hub];
        self.pipeline.set_ip_ids(self.hub.wants_ip_ids());
        // Neither sink fails: what a subscriber cannot take is skipped and counted there.
        match self.pipeline.handle_to(raw, self.lost_now, sinks) {
            Ok(Outcome::Report { .. }) => {}
            Ok(other) => {
                crate::pipeline::warn_unusable(&other);
                self.unusable += 1;
            }
            Err(e) => {
                warn!("handing a traversal to the agent's sinks: {e}");
                self.unusable += 1;
            }
        }
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
        let p = &mut self.pipeline;
        // The default mode builds its namer only while someone streams (super::memory).
        if self.mode == AgentMode::Kernel && !tracing {
            p.ruleset_changed(marks, None);
            return;
        }
        let generation = p.ctx.namer.as_ref().map_or(0, |n| n.generation) + 1;
        p.ruleset_changed(marks, Some(RuleNamer::new(live, generation)));
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
        self.pipeline.add_plans(probes.generation(), &probes.plans);
    }
}

/// The traversal metrics (`--mode trace`: the kernel counts in the other modes), as a
/// sink of the pipeline: they read the typed traversal's fields.
struct MetricsSink<'a> {
    metrics: &'a Metrics,
    on: bool,
}

impl Sink for MetricsSink<'_> {
    fn handled(&mut self, h: &Handled<'_>) -> std::io::Result<()> {
        if let (true, Some(report)) = (self.on, h.report()) {
            self.metrics.observe(report.traversal());
        }
        Ok(())
    }
}

/// The subscribers and the flight recorder, as a sink of the pipeline: each subscriber's
/// filter decides from the decoded record, each rendering is made once for all who want
/// it, and a dropped traversal (or one an arm of tier 2 keeps) is kept in all three forms
/// for later `drops` requests.
struct HubSink<'a> {
    hub: &'a Hub,
    tier2: &'a mut tier2::Tier2,
    tuple: crate::kernel::btf::TupleLayout,
    /// Bridged reports' notes on the node's bridge-family chains (made on the first).
    bridge_chains: &'a mut Option<crate::kernel::bridgechains::BridgeChains>,
    bridge_trace: Option<&'a mut crate::kernel::bridgetrace::BridgeTrace>,
}

impl Sink for HubSink<'_> {
    fn handled(&mut self, h: &Handled<'_>) -> std::io::Result<()> {
        let (Some(report), Some(rec), Outcome::Report { bytes: json, .. }) =
            (h.report(), h.record, h.outcome)
        else {
            return Ok(());
        };
        // What the node's bridge-family chains did to a bridged frame (simulated, confirmed
        // by counters), as tail says it: the report with those notes, made apart from the
        // cached one.
        let annotated = report.traversal().bridge.as_ref().and_then(|_| {
            crate::kernel::bridgetrace::bridged_notes(
                self.bridge_trace.as_deref_mut(),
                Some(self.bridge_chains),
                report.traversal(),
                (rec.ts_first, rec.ts_last),
            )
            .map(|notes| {
                let mut t = (**report.traversal()).clone();
                t.notes.extend(notes);
                crate::pipeline::Report::new(t)
            })
        });
        let (report, json) = match &annotated {
            Some(r) => (r, r.render(Output::Json)),
            None => (report, json.clone()),
        };
        let dropped = report.traversal().fate.kind == observer_model::FateKind::Dropped;
        // Renderings of the cached report are counted in the cache's bound; an annotated
        // one is not kept there.
        let render = |o| match annotated {
            Some(_) => report.render(o),
            None => h.render(report, o),
        };
        // The flight recorder keeps a dropped one in every mode.
        let rendered = self.hub.dispatch(rec, |tree, line| Rendered {
            json,
            tree: (tree || dropped).then(|| render(Output::Tree)),
            line: (line || dropped).then(|| render(Output::Line)),
        });
        // Armed: the arm's flows go to the flight recorder whole, dropped or not.
        if dropped || self.tier2.captures(rec, &self.tuple) {
            self.hub
                .flight
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .push(Held {
                    rec: *rec,
                    rendered,
                });
        }
        Ok(())
    }
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
        netfilter_probes: probes.attachments() as u64,
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
        name_read_failures: agent
            .names
            .read_failures
            .load(std::sync::atomic::Ordering::Relaxed),
    });
}

/// Always-on mode: records traversals while a streaming client is connected or tier 2 is
/// armed, and goes back to counting only when the arm ends, or [`TRACING_LINGER`] after
/// the last client left.
fn follow_subscribers(probes: &mut Probes, agent: &mut Agent) {
    let clients = agent.hub.subscribers() > 0;
    let armed = agent.tier2.armed_filter();
    if clients {
        agent.last_client = Some(Instant::now());
    }
    let lingering = !clients
        && armed.is_none()
        && agent
            .last_client
            .is_some_and(|t| t.elapsed() < TRACING_LINGER);
    if clients || armed.is_some() {
        // The probes keep what any subscriber or the arm wants; the hub then gives each
        // subscriber its own.
        let wanted = tier2::union(clients.then(|| agent.hub.kernel_filter()), armed);
        let changed = !probes.tracing() || wanted != agent.kernel_filter;
        let program = match &wanted {
            Some(expr) if changed => crate::filter::compile(expr, &|name| {
                crate::kernel::netns::ifindex(name)
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
        if !probes.tracing()
            && let Some(why) = probes.tracing_refused()
        {
            // Said at start (and on /readyz); each stream is told why it ends.
            agent.hub.end_all("tracing unavailable", &why);
            return;
        }
        if !probes.tracing() {
            let attaching = Instant::now();
            // The default mode brackets the tables only for as long as someone streams or
            // tier 2 is armed.
            if agent.mode == AgentMode::Kernel {
                let live = match attach_brackets(probes) {
                    Ok(live) => live,
                    Err(e) => {
                        warn!("attaching the per-table probes: {e:#}");
                        return;
                    }
                };
                agent.add_plans(probes);
                // The streams name rules from the ruleset as read now.
                let file = agent.marks_file.clone();
                agent.rules_changed(&live, file.as_ref(), true);
            }
            if let Err(e) = probes.start_tracing(&program) {
                warn!("recording traversals: {e:#}");
                return;
            }
            info!(
                "per-table brackets recording after {:.2} s",
                attaching.elapsed().as_secs_f64()
            );
            agent.tier2.attached_after(attaching.elapsed());
        } else if changed && let Err(e) = probes.set_filter(&program) {
            warn!("setting the probes' filter for the streaming clients: {e:#}");
            return;
        }
        agent.kernel_filter = wanted;
        agent.hub.tell_tracing();
    } else if probes.tracing() && !lingering {
        agent.last_client = None;
        if let Err(e) = probes.stop_tracing() {
            warn!("back to counting only: {e:#}");
        }
        if agent.mode == AgentMode::Kernel {
            if let Err(e) = probes.detach_points() {
                warn!("detaching the per-table probes: {e:#}");
            }
            memory::drop_namer(&mut agent.pipeline);
        }
    }
}

impl Consumer for Agent {
    fn on_record(&mut self, raw: &[u8], lost_now: u64) -> Next {
        self.lost_now = lost_now;
        self.handle(raw);
        Next::More
    }

    fn on_tick(&mut self, tick: Tick<'_>) -> Option<&'static str> {
        self.lost_now = tick.lost_now;
        // Trace events wait in the socket's queue until read: read them while they are few.
        if let Some(t) = &mut self.bridge_trace {
            t.drain();
        }
        self.hub.set_lost(tick.lost_now);
        self.hub.tick();
        let probes = tick.probes;
        if self.release_pending {
            self.release_pending = false;
            memory::release();
        }
        let rates = self.tier1.as_mut().and_then(|t| {
            t.poll(probes, &self.hub, &self.metrics);
            t.take_rates()
        });
        let now = Instant::now();
        self.tier2.tick(rates.as_deref(), now);
        if self.mode != AgentMode::Trace {
            follow_subscribers(probes, self);
        } else {
            // Always tracing: a new subscriber is told at its first tick.
            self.hub.tell_tracing();
        }
        self.tier2.publish(probes.attachments() as u64, now);
        self.metrics.set_tier2(self.tier2.series());
        if tick.scanned {
            self.read_counts(probes);
            self.interfaces = crate::kernel::netns::interfaces().len() as u64;
        }
        if tick.names_changed {
            self.pipeline.forget_names();
        }
        update_health(probes, self, true);
        None
    }

    fn on_replan(&mut self, replan: Replan<'_>) {
        match replan {
            Replan::Ruleset {
                probes: Some(probes),
                live,
                light,
                ..
            } => {
                // kube-proxy's services change with its rules, plan or no plan: read from
                // the node the session read off the loop's thread.
                self.names.set_services(live);
                if let Some(t) = &mut self.bridge_trace
                    && !light
                {
                    t.names_from(live);
                }
                // Counted under the plan in force: labelled before it changes.
                self.read_counts(probes);
                let file = self.marks_file.clone();
                // A light read cannot name rules: the namer stays as it is.
                self.rules_changed(live, file.as_ref(), probes.tracing() && !light);
                // A node read only for names is dropped after this: memory handed back.
                if !self.replans(probes) || light {
                    self.release_pending = true;
                }
            }
            Replan::Plans {
                generation, plans, ..
            } => self.pipeline.add_plans(generation, plans),
            Replan::Replanned { from, to } => self.pipeline.replanned(from, to),
            // The agent's session is always live: it has its probes and looks names up.
            Replan::Ruleset { probes: None, .. } | Replan::Names { .. } => {}
        }
    }

    fn light_read(&self, probes: &Probes) -> Option<fn() -> observer_rules::LiveNode> {
        // The default mode reads only names while nobody streams (super::names_only).
        (self.mode == AgentMode::Kernel && !probes.tracing())
            .then_some(names_only::read as fn() -> observer_rules::LiveNode)
    }

    fn records_flow(&self, probes: &Probes) -> bool {
        // The default mode writes no record while no per-table probe is attached (its
        // drops go to tier 1's own ring).
        self.mode != AgentMode::Kernel || probes.tracing() || probes.attachments() > 0
    }

    fn replans(&self, probes: &Probes) -> bool {
        // The default mode has per-table probes only while someone streams.
        self.mode != AgentMode::Kernel || probes.tracing()
    }

    fn on_stop(&mut self, stop: Stop<'_>) {
        if let Some(probes) = stop.probes {
            self.read_counts(probes);
            update_health(probes, self, false);
        }
        self.hub.close_all();
    }
}

#[allow(clippy::too_many_arguments)]
async fn event_loop(
    opts: &AgentOptions,
    probes: Probes,
    pipeline: Pipeline,
    metrics: Arc<Metrics>,
    hub: Arc<Hub>,
    names: Arc<crate::k8s::Names>,
    naming: (
        observer_model::marks::MarkDictionary,
        std::collections::HashMap<u32, String>,
    ),
    tier1: Option<tier1::Tier1>,
    tier2: tier2::Tier2,
    bridge_trace: Option<crate::kernel::bridgetrace::BridgeTrace>,
) -> Result<&'static str> {
    let mut agent = Agent {
        pipeline,
        metrics,
        hub,
        lost_now: 0,
        unusable: 0,
        interfaces: crate::kernel::netns::interfaces().len() as u64,
        mode: opts.mode,
        kernel: KernelCounts::default(),
        marks: naming.0,
        reasons: naming.1,
        marks_file: opts.marks_file.clone(),
        names,
        last_client: None,
        kernel_filter: None,
        tier1,
        release_pending: false,
        tier2,
        bridge_chains: None,
        bridge_trace,
    };
    agent.add_plans(&probes);
    update_health(&probes, &agent, true);
    info!(
        "agent ready: {} per-table probes (capture: {}); metrics on {}, streaming API on {}{}",
        probes.attachments(),
        probes.capture_backend().name(),
        opts.metrics_addr,
        opts.socket.display(),
        opts.listen
            .as_ref()
            .map(|l| format!(" and {l}"))
            .unwrap_or_default()
    );
    let session = Session::new(
        probes,
        SessionOptions {
            netns: opts.node_netns.clone().or_else(|| opts.netns.clone()),
            ready_file: opts.ready_file.clone(),
            timeout: None,
            idle: opts.idle,
            batch: BATCH,
            // What the probes wrote before they stopped goes out still, within a bound.
            final_drain: Duration::from_millis(300),
        },
    )?;
    let stopped_by = session.run(&mut agent).await?;
    let _ = std::fs::remove_file(&opts.socket);
    // The streams' closing lines, written by the connections' tasks.
    tokio::time::sleep(Duration::from_millis(150)).await;
    info!("agent stopped by {stopped_by}");
    Ok(stopped_by)
}
