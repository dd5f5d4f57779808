//! The agent's Prometheus metrics, kept in the official client's types
//! (`prometheus-client`) and written by it: OpenMetrics 1.0 when the scraper asks for it
//! (Prometheus does), the text format 0.0.4 otherwise ([`Format`]). Every series carries the
//! registry's `node` label. Labels are bounded: hook, table, family, reason, kind, source,
//! node, and `mark` (a mark bit's name: at most 32 values). No label holds an address.
//!
//! Where a series comes from decides the one place it is declared:
//! - counts the agent adds itself, tier 2's probe counters ([`Counter`]): a
//!   `Family<Labels, Counter>` each, registered in [`Metrics::new`]. [`Metrics::observe`]
//!   reads the fields of the pipeline's typed traversal (never its JSON); the always-on
//!   counting mode calls [`Metrics::add`] with what the probes' maps gained. Each holds at
//!   most [`MAX_SERIES`] series; a count that would open one more is added to
//!   `observer_metrics_overflow_total` instead;
//! - the agent's own state as the event loop sees it on each tick ([`Health`]): one row per
//!   series in [`Health::series`];
//! - what tier 0 and tier 1 read from the kernel on their own schedule: [`Snapshot`]s
//!   handed over whole ([`Metrics::set_tier0`], [`Metrics::set_tier1`]) and written when
//!   scraped by the registry's collector ([`Scraped`]).

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::{ConstCounter, Counter as PromCounter};
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::{ConstGauge, Gauge};
use prometheus_client::metrics::info::Info;
use prometheus_client::registry::{Registry, Unit};

use observer_model::{FateKind, NatKind, Traversal};

/// Series per metric at most (label sets are bounded by design; this is the backstop).
pub const MAX_SERIES: usize = 4096;

/// A series' labels, in order (`node` comes first, from the registry).
pub type Labels = Vec<(&'static str, String)>;

/// One counter metric: its name, help and label names.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Counter {
    /// Packets that passed a table (per family, hook, table).
    Packets,
    /// Traversals by how they ended (per family, kind).
    Traversals,
    /// Mark bits set or cleared (per family, hook, table, kind, mark).
    Marks,
    /// Address translations (per family, hook, table, kind, source).
    Nat,
    /// Dropped packets (per family, hook, table, reason).
    Drops,
}

impl Counter {
    const ALL: [Self; 5] = [
        Self::Packets,
        Self::Traversals,
        Self::Marks,
        Self::Nat,
        Self::Drops,
    ];

    /// The series' name as scraped (the family's name and `_total`).
    fn name(self) -> &'static str {
        match self {
            Self::Packets => "observer_packets_total",
            Self::Traversals => "observer_traversals_total",
            Self::Marks => "observer_mark_changes_total",
            Self::Nat => "observer_nat_total",
            Self::Drops => "observer_drops_total",
        }
    }

    fn help(self) -> &'static str {
        match self {
            Self::Packets => {
                "Packets that went into a netfilter table (reached the probe just before it; \
                 those it dropped included)."
            }
            Self::Traversals => {
                "Packet traversals by how they ended (forwarded, delivered, sent, dropped, \
                 consumed, looped, reassembled, incomplete)."
            }
            Self::Marks => {
                "skb mark bits set or cleared (kind), by the table that did it; mark is the \
                 bit's name from the mark dictionary, or its hex value."
            }
            Self::Nat => {
                "Address translations by kind (dnat, snat) and source (rules: the nat chains \
                 ran; conntrack: the stored translation)."
            }
            Self::Drops => {
                "Packets the kernel dropped, by the kernel's drop reason and place: hook, and \
                 table when it dropped them inside one (none: after the hook's tables)."
            }
        }
    }

    fn labels(self) -> &'static [&'static str] {
        match self {
            Self::Packets => &["family", "hook", "table"],
            Self::Traversals => &["family", "kind"],
            Self::Marks => &["family", "hook", "table", "kind", "mark"],
            Self::Nat => &["family", "hook", "table", "kind", "source"],
            Self::Drops => &["family", "hook", "table", "reason"],
        }
    }
}

/// The two formats the agent writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    /// OpenMetrics 1.0: a counter's family is named without `_total`, its samples with it;
    /// ends with `# EOF`.
    OpenMetrics,
    /// The Prometheus text format 0.0.4, which `promtool check metrics` lints.
    Text,
}

impl Format {
    /// What a scrape's `Accept` header asks for: OpenMetrics when it names
    /// `application/openmetrics-text` with a weight above 0 and no lower than the text
    /// format's (`text/plain`, `*/*`); the text format otherwise, and without the header.
    pub fn negotiate(accept: Option<&str>) -> Self {
        let (mut open, mut text) = (0.0f32, 0.0f32);
        for range in accept.unwrap_or("").split(',') {
            let mut parts = range.split(';');
            let media = parts.next().unwrap_or("").trim().to_ascii_lowercase();
            let q = parts
                .find_map(|p| p.trim().strip_prefix("q="))
                .map_or(Some(1.0), |q| q.trim().parse::<f32>().ok())
                .unwrap_or(0.0);
            match media.as_str() {
                "application/openmetrics-text" => open = open.max(q),
                "text/plain" | "text/*" | "*/*" => text = text.max(q),
                _ => {}
            }
        }
        if open > 0.0 && open >= text {
            Self::OpenMetrics
        } else {
            Self::Text
        }
    }

    pub fn content_type(self) -> &'static str {
        match self {
            Self::OpenMetrics => "application/openmetrics-text; version=1.0.0; charset=utf-8",
            Self::Text => prometheus_client::encoding::prometheus_text::CONTENT_TYPE,
        }
    }
}

/// Counter or gauge (the only kinds the agent's read series have).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Counter,
    Gauge,
}

/// One family of series read elsewhere (the kernel's counters), handed over whole and
/// written as it is when scraped.
#[derive(Clone, Debug, PartialEq)]
pub struct Snapshot {
    /// As scraped: a counter's ends in `_total`.
    pub name: &'static str,
    pub help: &'static str,
    pub kind: Kind,
    pub series: Vec<(Labels, u64)>,
}

impl Snapshot {
    /// One series without labels of its own.
    pub fn one(name: &'static str, kind: Kind, help: &'static str, value: u64) -> Self {
        Self::labelled(name, kind, help, Vec::new(), value)
    }

    pub fn labelled(
        name: &'static str,
        kind: Kind,
        help: &'static str,
        labels: Labels,
        value: u64,
    ) -> Self {
        Self {
            name,
            help,
            kind,
            series: vec![(labels, value)],
        }
    }

    /// Writes the family: its HELP and TYPE (a counter's named without `_total`, which the
    /// encoder adds where the format wants it), then each series; nothing without series
    /// (as the crate does with an empty `Family`).
    fn encode(&self, encoder: &mut DescriptorEncoder) -> Result<(), std::fmt::Error> {
        debug_assert!(
            self.kind == Kind::Gauge || self.name.ends_with("_total"),
            "{}: a counter's series are named ..._total",
            self.name
        );
        if self.series.is_empty() {
            return Ok(());
        }
        let (name, kind) = match self.kind {
            Kind::Counter => (
                self.name.strip_suffix("_total").unwrap_or(self.name),
                MetricType::Counter,
            ),
            Kind::Gauge => (self.name, MetricType::Gauge),
        };
        let mut family = encoder.encode_descriptor(name, self.help, None, kind)?;
        for (labels, v) in &self.series {
            let series = family.encode_family(labels)?;
            match self.kind {
                Kind::Counter => ConstCounter::new(*v).encode(series)?,
                Kind::Gauge => ConstGauge::new(*v).encode(series)?,
            }
        }
        Ok(())
    }
}

/// Groups `series` (family, labels, value, in any order) into one [`Snapshot`] per family
/// (OpenMetrics wants a family's series together), families in the order first seen.
pub fn group<F: Copy + Ord>(
    series: impl IntoIterator<Item = (F, Labels, u64)>,
    describe: impl Fn(F) -> (&'static str, &'static str, Kind),
) -> Vec<Snapshot> {
    let mut order = Vec::new();
    let mut by: BTreeMap<F, Vec<(Labels, u64)>> = BTreeMap::new();
    for (f, labels, v) in series {
        by.entry(f)
            .or_insert_with(|| {
                order.push(f);
                Vec::new()
            })
            .push((labels, v));
    }
    order
        .into_iter()
        .map(|f| {
            let (name, help, kind) = describe(f);
            Snapshot {
                name,
                help,
                kind,
                series: by.remove(&f).unwrap_or_default(),
            }
        })
        .collect()
}

/// The agent's own state, as gauges and counters (read when scraped).
#[derive(Clone, Debug, Default)]
pub struct Health {
    /// Packets the probes could not record (ring buffer full), since start.
    pub records_lost: u64,
    /// Packets that entered the observed namespace's hooks, since start.
    pub packets_seen: u64,
    pub netfilter_probes: u64,
    pub interfaces: u64,
    pub ruleset_generation: u64,
    pub attach_failures: u64,
    /// Records the pipeline could not turn into a report.
    pub unusable_records: u64,
    pub subscribers: u64,
    /// Traversals a subscriber did not receive because it read too slowly (flagged in its
    /// stream).
    pub subscriber_skipped: u64,
    pub flight_recorder_held: u64,
    pub flight_recorder_capacity: u64,
    pub ready: bool,
    /// Always-on mode: packets whose earlier mark changes could not be attributed to a
    /// table (they waited or changed CPU between two probes).
    pub unattributed: u64,
    /// Whether traversals are being recorded (always in `--mode trace`; in the always-on
    /// mode while a streaming client is connected).
    pub tracing: bool,
    /// Reads of the node's rules or of the API server's pods that failed, for names.
    pub name_read_failures: u64,
}

impl Health {
    /// Every series the agent's state makes: one row each.
    pub fn series(&self) -> [Snapshot; 15] {
        use Kind::{Counter as C, Gauge as G};
        let one = Snapshot::one;
        [
            one(
                "observer_records_lost_total",
                C,
                "Packets the probes could not record because the ring buffer was full: their \
                 traversals are missing from every metric above and from the streams.",
                self.records_lost,
            ),
            one(
                "observer_packets_seen_total",
                C,
                "Packets that entered the observed namespace's hooks.",
                self.packets_seen,
            ),
            one(
                "observer_unusable_records_total",
                C,
                "Records the agent could not turn into a report (logged).",
                self.unusable_records,
            ),
            one(
                "observer_attach_failures_total",
                C,
                "Probe attachments that failed (interfaces left without tcx probes, failed \
                 re-plans).",
                self.attach_failures,
            ),
            one(
                "observer_subscriber_skipped_total",
                C,
                "Traversals a streaming client did not receive because it read too slowly \
                 (its stream says how many).",
                self.subscriber_skipped,
            ),
            one(
                "observer_name_read_failures_total",
                C,
                "Reads that Kubernetes names come from that failed (the node's rules for \
                 services, the API server's watch for pods; each logged): names may be \
                 missing or stale.",
                self.name_read_failures,
            ),
            one(
                "observer_mark_changes_unattributed_total",
                C,
                "Packets whose mark changes before some probe point could not be attributed \
                 to a table (they waited in a queue or changed CPU between two probes): \
                 those changes are missing from observer_mark_changes_total.",
                self.unattributed,
            ),
            one(
                "observer_probes_attached",
                G,
                "Netfilter probes attached.",
                self.netfilter_probes,
            ),
            one(
                "observer_interfaces",
                G,
                "Interfaces in the namespace (each with tcx probes while traversals are \
                 recorded).",
                self.interfaces,
            ),
            one(
                "observer_ruleset_generation",
                G,
                "Probe plan generation: grows when a ruleset change re-plans the probes.",
                self.ruleset_generation,
            ),
            one(
                "observer_subscribers",
                G,
                "Streaming clients connected.",
                self.subscribers,
            ),
            one(
                "observer_flight_recorder_drops",
                G,
                "Dropped traversals held by the flight recorder.",
                self.flight_recorder_held,
            ),
            one(
                "observer_flight_recorder_capacity",
                G,
                "How many dropped traversals the flight recorder holds at most.",
                self.flight_recorder_capacity,
            ),
            one(
                "observer_tracing",
                G,
                "1 while whole traversals are recorded (--mode trace, or a streaming client \
                 is connected); 0 while the probes only count.",
                u64::from(self.tracing),
            ),
            one(
                "observer_ready",
                G,
                "1 once the probes are attached.",
                u64::from(self.ready),
            ),
        ]
    }
}

/// Tier 0's last read (`super::tier0`): its series, and how the read went.
#[derive(Clone, Debug, Default)]
pub struct Tier0 {
    pub series: Vec<Snapshot>,
    pub read_seconds: f64,
    /// Reads that failed in this round (each is logged).
    pub errors: u64,
}

#[derive(Default)]
struct Tier0State {
    last: Tier0,
    errors_total: u64,
    reads_total: u64,
}

/// What is read elsewhere and written when scraped: the agent's state, tier 0's and
/// tier 1's last reads. The registry's one [`Collector`].
#[derive(Default)]
pub struct Scraped {
    health: Mutex<Health>,
    tier0: Mutex<Tier0State>,
    tier1: Mutex<Vec<Snapshot>>,
    /// Tier 2's (`super::tier2`), from the event loop's last tick; None before it.
    tier2: Mutex<Option<Tier2Series>>,
}

/// Tier 2's series as the event loop last saw them, and the seconds it was armed (a
/// counter of fractional seconds, written apart from the whole-number snapshots).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Tier2Series {
    pub series: Vec<Snapshot>,
    pub armed_seconds: f64,
}

impl std::fmt::Debug for Scraped {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Scraped").finish_non_exhaustive()
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Collector for Scraped {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let health = lock(&self.health).series();
        for s in &health {
            s.encode(&mut encoder)?;
        }
        for s in lock(&self.tier1).iter() {
            s.encode(&mut encoder)?;
        }
        if let Some(t2) = lock(&self.tier2).as_ref() {
            for s in &t2.series {
                s.encode(&mut encoder)?;
            }
            let mut family = encoder.encode_descriptor(
                "observer_tier2_armed",
                "Seconds the per-table brackets were armed (streaming clients not counted).",
                Some(&Unit::Seconds),
                MetricType::Counter,
            )?;
            let labels: Labels = vec![("tier", "2".to_string())];
            ConstCounter::new(t2.armed_seconds).encode(family.encode_family(&labels)?)?;
        }
        let t = lock(&self.tier0);
        // Nothing until the first read ends (its time says it did).
        if t.reads_total > 0 {
            for s in &t.last.series {
                s.encode(&mut encoder)?;
            }
            let seconds = encoder.encode_descriptor(
                "observer_tier0_read",
                "How long the last read of every rule counter and conntrack's statistics took.",
                Some(&Unit::Seconds),
                MetricType::Gauge,
            )?;
            ConstGauge::new(t.last.read_seconds).encode(seconds)?;
            Snapshot::one(
                "observer_tier0_read_errors_total",
                Kind::Counter,
                "Reads of rule counters, conntrack or IPVS statistics that failed (logged; their \
                 series keep the last values).",
                t.errors_total,
            )
            .encode(&mut encoder)?;
        }
        Ok(())
    }
}

/// The registry and the handles of what the agent counts itself; shared between the event
/// loop and tier 0's thread (writers) and the HTTP server (reader).
pub struct Metrics {
    registry: Registry,
    /// Tier 2's counters, in [`Counter::ALL`]'s order.
    probes: [Family<Labels, PromCounter>; 5],
    /// Series each of them holds, counted as they are opened (under this lock), so that
    /// none passes [`MAX_SERIES`].
    opened: Mutex<[usize; 5]>,
    overflow: PromCounter,
    mode: Family<Labels, Gauge>,
    capture: Family<Labels, Gauge>,
    /// What this kernel cannot do and what still works, said by `/readyz` (empty: all).
    degraded: Mutex<Vec<String>>,
    scraped: Arc<Scraped>,
}

/// A help text as `Registry::register` takes it (it adds the full stop).
fn registered(help: &str) -> &str {
    help.strip_suffix('.').unwrap_or(help)
}

impl Metrics {
    /// `node`: the value of the `node` label on every series (NODE_NAME in Kubernetes).
    pub fn new(node: &str) -> Self {
        let mut registry = Registry::with_labels(std::iter::once((
            Cow::Borrowed("node"),
            Cow::Owned(node.to_string()),
        )));
        let probes: [Family<Labels, PromCounter>; 5] = Default::default();
        for (c, family) in Counter::ALL.iter().zip(&probes) {
            let name = c.name().strip_suffix("_total").unwrap_or(c.name());
            registry.register(name, registered(c.help()), family.clone());
        }
        let overflow = PromCounter::default();
        registry.register(
            "observer_metrics_overflow",
            "Counts not kept because a metric already had its maximum number of series",
            overflow.clone(),
        );
        let mode = Family::<Labels, Gauge>::default();
        registry.register(
            "observer_agent_mode",
            "The agent's --mode and the tiers that make its series (0: the kernel's own rule \
             and conntrack counters; 1: drops at kfree_skb; 2: per-table brackets)",
            mode.clone(),
        );
        let capture = Family::<Labels, Gauge>::default();
        registry.register(
            "observer_capture_backend",
            "How the per-table probes are attached (links: BPF netfilter links; fentry: \
             trampolines on the tables' functions): 1 when it can attach here, 0 when the \
             kernel refuses it",
            capture.clone(),
        );
        registry.register(
            "observer_build",
            "The observer's version",
            Info::new(vec![("version", env!("CARGO_PKG_VERSION"))]),
        );
        let scraped = Arc::new(Scraped::default());
        registry.register_collector(Box::new(scraped.clone()));
        Self {
            registry,
            probes,
            opened: Mutex::default(),
            overflow,
            mode,
            capture,
            degraded: Mutex::default(),
            scraped,
        }
    }

    /// Says which capture backend puts the per-table probes in place (its `--backend`
    /// name) and, when the kernel refuses it, why (then `/readyz` says what is missing and
    /// what still works).
    pub fn set_capture_backend(&self, backend: &'static str, ready: bool, refused: Option<String>) {
        self.capture.clear();
        self.capture
            .get_or_create(&vec![("backend", backend.into())])
            .set(i64::from(ready));
        let mut degraded = lock(&self.degraded);
        degraded.clear();
        if let Some(why) = refused {
            degraded.push(format!(
                "traversals unavailable: {why}; no traversals (/v1/traces, tier 2's \
                 arms, --mode brackets and trace); tier 0 (rule and conntrack counters) and \
                 tier 1 (drops by reason) work"
            ));
        }
    }

    /// What this kernel cannot do, one line each (empty: everything works).
    pub fn degraded(&self) -> Vec<String> {
        lock(&self.degraded).clone()
    }

    /// Tier 2's series (`super::tier2::Tier2::series`), replacing the previous ones.
    pub fn set_tier2(&self, t: Tier2Series) {
        *lock(&self.scraped.tier2) = Some(t);
    }

    /// Says which mode the agent runs and which tiers make its series.
    pub fn set_mode(&self, mode: &'static str, tiers: &'static str) {
        self.mode.clear();
        self.mode
            .get_or_create(&vec![("mode", mode.into()), ("tiers", tiers.into())])
            .set(1);
    }

    /// Tier 1's series as last read (replaces the previous ones).
    pub fn set_tier1(&self, series: Vec<Snapshot>) {
        *lock(&self.scraped.tier1) = series;
    }

    /// Tier 0's series as last read (replaces the previous read's).
    pub fn set_tier0(&self, t: Tier0) {
        let mut s = lock(&self.scraped.tier0);
        s.errors_total += t.errors;
        s.reads_total += 1;
        s.last = t;
    }

    fn family(&self, counter: Counter) -> &Family<Labels, PromCounter> {
        &self.probes[counter as usize]
    }

    fn key(counter: Counter, labels: &[&str]) -> Labels {
        debug_assert_eq!(labels.len(), counter.labels().len());
        counter
            .labels()
            .iter()
            .zip(labels)
            .map(|(k, v)| (*k, v.to_string()))
            .collect()
    }

    /// Adds `n` to a counter. `labels` are the values of [`Counter::labels`], in order.
    pub fn add(&self, counter: Counter, labels: &[&str], n: u64) {
        let family = self.family(counter);
        let key = Self::key(counter, labels);
        if let Some(c) = family.get(&key) {
            c.inc_by(n);
            return;
        }
        let mut opened = lock(&self.opened);
        let opened = &mut opened[counter as usize];
        if let Some(c) = family.get(&key) {
            c.inc_by(n);
        } else if *opened < MAX_SERIES {
            *opened += 1;
            family.get_or_create(&key).inc_by(n);
        } else {
            self.overflow.inc_by(n);
        }
    }

    /// Counts one traversal (the only place the metrics read the model's fields).
    pub fn observe(&self, t: &Traversal) {
        let family = t.family.map_or("other", |f| f.name());
        for s in &t.stages {
            self.add(Counter::Packets, &[family, s.hook.name(), &s.table], 1);
        }
        self.add(Counter::Traversals, &[family, t.fate.kind.name()], 1);
        for (kind, list) in [("set", &t.marks.set), ("cleared", &t.marks.cleared)] {
            for b in list {
                let bit;
                let name = match &b.name {
                    Some(n) => &**n,
                    None => {
                        bit = format!("{:#x}", b.bit);
                        &bit
                    }
                };
                self.add(
                    Counter::Marks,
                    &[family, b.hook.name(), &b.table, kind, name],
                    1,
                );
            }
        }
        for n in &t.nat {
            let kind = match n.kind {
                NatKind::Dnat => "dnat",
                NatKind::Snat => "snat",
            };
            let source = n.source.name();
            self.add(
                Counter::Nat,
                &[family, n.hook.name(), &n.table, kind, source],
                1,
            );
        }
        if t.fate.kind == FateKind::Dropped {
            self.add(
                Counter::Drops,
                &[
                    family,
                    t.fate.hook.map_or("none", |h| h.name()),
                    t.fate.table.as_deref().unwrap_or("none"),
                    t.fate.reason.as_deref().unwrap_or("unknown"),
                ],
                1,
            );
        }
    }

    /// The current value of one series (tests, and the lead's in-kernel mode's checks).
    pub fn get(&self, counter: Counter, labels: &[&str]) -> u64 {
        self.family(counter)
            .get(&Self::key(counter, labels))
            .map_or(0, |c| c.get())
    }

    pub fn set_health(&self, h: Health) {
        *lock(&self.scraped.health) = h;
    }

    pub fn health(&self) -> Health {
        lock(&self.scraped.health).clone()
    }

    /// Everything, in `format`.
    pub fn encode(&self, format: Format) -> String {
        use prometheus_client::encoding::{prometheus_text, text};
        let mut out = String::with_capacity(8192);
        // Writing to a String cannot fail; the encoders only pass on the writer's errors.
        let _ = match format {
            Format::OpenMetrics => text::encode(&mut out, &self.registry),
            Format::Text => prometheus_text::encode(&mut out, &self.registry),
        };
        out
    }

    /// Everything in the text format 0.0.4 (what a scrape without `Accept` gets).
    pub fn render(&self) -> String {
        self.encode(Format::Text)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOLDEN: &str = include_str!("../../../tests/golden/lab-flows.json");

    #[test]
    fn counts_from_real_reports() {
        let m = Metrics::new("node-1");
        // The golden recording replayed: the typed traversals whose JSON is GOLDEN.
        let opts = crate::commands::replay::ReplayOptions {
            file: concat!(env!("CARGO_MANIFEST_DIR"), "/tests/golden/lab-flows.obsrec").into(),
            output: crate::pipeline::Output::Json,
            count: None,
            filter: None,
        };
        let mut n = 0;
        crate::commands::replay::each(
            &opts,
            &mut crate::pipeline::Reports(|report: &crate::pipeline::Report| {
                m.observe(report.traversal());
                n += 1;
                Ok(())
            }),
        )
        .unwrap();
        assert_eq!(n, GOLDEN.lines().count());
        let dropped = GOLDEN
            .lines()
            .filter(|l| l.contains("\"kind\":\"dropped\""))
            .count() as u64;
        let t = m.render();
        assert!(dropped > 0);
        assert_eq!(
            m.get(Counter::Drops, &["ipv4", "INPUT", "none", "NO_SOCKET"]),
            1,
            "{t}"
        );
        assert_eq!(
            m.get(
                Counter::Marks,
                &["ipv4", "PREROUTING", "nat", "set", "kube-proxy:masquerade"]
            ),
            1
        );
        assert!(m.get(Counter::Packets, &["ipv4", "FORWARD", "filter"]) > 0);
        assert!(
            m.get(
                Counter::Nat,
                &["ipv4", "PREROUTING", "nat", "dnat", "rules"]
            ) > 0,
            "{t}"
        );
        assert!(t.contains("observer_drops_total{node=\"node-1\",family=\"ipv4\",hook=\"INPUT\",table=\"none\",reason=\"NO_SOCKET\"} 1"), "{t}");
        // Bounded labels only: no address anywhere.
        for line in t.lines().filter(|l| !l.starts_with('#')) {
            assert!(!line.contains("198.51.100"), "{line}");
            assert!(
                !line.contains(':') || line.contains("kube-proxy:") || line.contains("calico:"),
                "{line}"
            );
        }
    }

    #[test]
    fn series_are_bounded() {
        let m = Metrics::new("n");
        for i in 0..MAX_SERIES + 10 {
            m.add(
                Counter::Drops,
                &["ipv4", "INPUT", "none", &format!("R{i}")],
                1,
            );
        }
        assert!(
            m.render()
                .contains("observer_metrics_overflow_total{node=\"n\"} 10")
        );
    }

    /// A small promtool: what `promtool check metrics` (2.42) and the text format 0.0.4 ask
    /// of `text`. Each sample's name has its own HELP and TYPE before it, given once;
    /// counters' names end in `_total`; a family's samples are together; no OpenMetrics line.
    fn lint_text(text: &str) -> Result<(), String> {
        let mut typed: BTreeMap<&str, &str> = BTreeMap::new();
        let mut helped = std::collections::BTreeSet::new();
        let mut done = std::collections::BTreeSet::new();
        let mut current = "";
        for l in text.lines() {
            if let Some(rest) = l.strip_prefix("# ") {
                let mut w = rest.splitn(3, ' ');
                let (what, name) = (w.next().unwrap_or(""), w.next().unwrap_or(""));
                match what {
                    "HELP" if !helped.insert(name) => return Err(format!("two HELP: {l}")),
                    "TYPE" => {
                        let kind = w.next().unwrap_or("");
                        if typed.insert(name, kind).is_some() {
                            return Err(format!("two TYPE: {l}"));
                        }
                        if kind == "counter" && !name.ends_with("_total") {
                            return Err(format!("counter without _total: {l}"));
                        }
                    }
                    "HELP" => {}
                    _ => return Err(format!("not the text format 0.0.4: {l}")),
                }
                continue;
            }
            let name = l.split(['{', ' ']).next().unwrap_or("");
            if !typed.contains_key(name) || !helped.contains(name) {
                return Err(format!("no help text or type for {name}: {l}"));
            }
            if name != current {
                if !done.insert(name) {
                    return Err(format!("{name}'s samples are not together"));
                }
                current = name;
            }
            l.rsplit(' ')
                .next()
                .and_then(|v| v.parse::<f64>().ok())
                .ok_or(format!("no value: {l}"))?;
        }
        Ok(())
    }

    /// Every kind of series the agent writes, one of each at least.
    fn full() -> Metrics {
        let m = Metrics::new("node-1");
        m.set_mode("kernel", "0,1");
        m.set_capture_backend("links", true, None);
        m.add(
            Counter::Drops,
            &["ipv4", "FORWARD", "filter", "NO_SOCKET"],
            3,
        );
        m.add(Counter::Packets, &["ipv4", "FORWARD", "filter"], 9);
        m.set_health(Health {
            ready: true,
            records_lost: 2,
            ..Health::default()
        });
        m.set_tier1(vec![
            Snapshot::labelled(
                "observer_kernel_drops_total",
                Kind::Counter,
                "Drops.",
                vec![("tier", "1".into()), ("reason", "NO_SOCKET".into())],
                4,
            ),
            Snapshot::one("observer_drop_samples_total", Kind::Counter, "Samples.", 1),
        ]);
        m.set_tier0(Tier0 {
            series: group(
                [
                    (
                        0,
                        vec![("tier", "0".into()), ("comment", "say \"hi\"\\\n".into())],
                        5,
                    ),
                    (1, vec![("tier", "0".into())], 7),
                    (0, vec![("tier", "0".into()), ("comment", "b".into())], 6),
                ],
                |f| match f {
                    0 => ("observer_rule_drops_total", "Rule drops.", Kind::Counter),
                    _ => ("observer_conntrack_entries", "Entries.", Kind::Gauge),
                },
            ),
            read_seconds: 0.25,
            errors: 1,
        });
        m
    }

    #[test]
    fn the_text_format_is_what_promtool_asks_for() {
        let t = full().encode(Format::Text);
        lint_text(&t).unwrap_or_else(|e| panic!("{e}\n{t}"));
        for line in [
            "# HELP observer_drops_total Packets the kernel dropped,",
            "# TYPE observer_drops_total counter",
            "observer_drops_total{node=\"node-1\",family=\"ipv4\",hook=\"FORWARD\",table=\"filter\",reason=\"NO_SOCKET\"} 3",
            "# TYPE observer_rule_drops_total counter",
            "observer_rule_drops_total{node=\"node-1\",tier=\"0\",comment=\"b\"} 6",
            "# TYPE observer_conntrack_entries gauge",
            "observer_conntrack_entries{node=\"node-1\",tier=\"0\"} 7",
            "observer_kernel_drops_total{node=\"node-1\",tier=\"1\",reason=\"NO_SOCKET\"} 4",
            "observer_records_lost_total{node=\"node-1\"} 2",
            "observer_ready{node=\"node-1\"} 1",
            "observer_agent_mode{node=\"node-1\",mode=\"kernel\",tiers=\"0,1\"} 1",
            "observer_capture_backend{node=\"node-1\",backend=\"links\"} 1",
            "# TYPE observer_build_info gauge",
            "observer_tier0_read_seconds{node=\"node-1\"} 0.25",
            "observer_tier0_read_errors_total{node=\"node-1\"} 1",
        ] {
            assert!(
                t.lines().any(|l| l.starts_with(line)),
                "no line {line}:\n{t}"
            );
        }
        assert!(
            t.contains(&format!(
                "observer_build_info{{node=\"node-1\",version=\"{}\"}} 1\n",
                env!("CARGO_PKG_VERSION")
            )),
            "{t}"
        );
        // Label values escaped as the format says; help texts end with one full stop.
        assert!(t.contains("comment=\"say \\\"hi\\\"\\\\\\n\"} 5"), "{t}");
        assert!(!t.contains(".."), "{t}");
        // The lint catches what the crate's OpenMetrics output would break.
        let open = full().encode(Format::OpenMetrics);
        assert!(lint_text(&open).is_err());
    }

    #[test]
    fn openmetrics_names_families_and_ends_with_eof() {
        let t = full().encode(Format::OpenMetrics);
        assert!(t.ends_with("# EOF\n"), "{t}");
        for line in [
            "# TYPE observer_drops counter",
            "observer_drops_total{node=\"node-1\",family=\"ipv4\",hook=\"FORWARD\",table=\"filter\",reason=\"NO_SOCKET\"} 3",
            "# TYPE observer_rule_drops counter",
            "# TYPE observer_build info",
            "# UNIT observer_tier0_read_seconds seconds",
            "observer_tier0_read_seconds{node=\"node-1\"} 0.25",
        ] {
            assert!(
                t.lines().any(|l| l.starts_with(line)),
                "no line {line}:\n{t}"
            );
        }
        // The same samples in both formats.
        let samples = |t: &str| {
            let mut v: Vec<String> = t
                .lines()
                .filter(|l| !l.starts_with('#'))
                .map(str::to_string)
                .collect();
            v.sort();
            v
        };
        assert_eq!(samples(&t), samples(&full().encode(Format::Text)));
    }

    #[test]
    fn a_family_without_series_is_not_written() {
        let m = Metrics::new("n");
        m.set_tier1(vec![Snapshot {
            name: "observer_kernel_drops_total",
            help: "Drops.",
            kind: Kind::Counter,
            series: Vec::new(),
        }]);
        let t = m.render();
        assert!(!t.contains("observer_kernel_drops"), "{t}");
        assert!(!t.contains("observer_drops_total"), "{t}");
        assert!(t.contains("observer_ready{node=\"n\"} 0"), "{t}");
    }

    #[test]
    fn tier0_waits_for_its_first_read() {
        let m = Metrics::new("n");
        assert!(!m.render().contains("observer_tier0_read_seconds"));
        m.set_tier0(Tier0::default());
        assert!(
            m.render()
                .contains("observer_tier0_read_seconds{node=\"n\"} 0")
        );
    }

    #[test]
    fn the_scrapers_accept_header_chooses_the_format() {
        for (accept, format) in [
            // Prometheus 2.42 (Debian's), and 3.x's default scrape protocols.
            (
                Some(
                    "application/openmetrics-text;version=1.0.0,application/openmetrics-text;\
                     version=0.0.1;q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1",
                ),
                Format::OpenMetrics,
            ),
            (
                Some(
                    "application/openmetrics-text;version=1.0.0;escaping=allow-utf-8;q=0.5,\
                     application/openmetrics-text;version=0.0.1;q=0.4,text/plain;\
                     version=1.0.0;escaping=allow-utf-8;q=0.3,text/plain;version=0.0.4;q=0.2,\
                     */*;q=0.1",
                ),
                Format::OpenMetrics,
            ),
            // A scraper set to the text format first, curl, a browser, none.
            (
                Some("text/plain;version=0.0.4;q=1,application/openmetrics-text;q=0.5"),
                Format::Text,
            ),
            (Some("*/*"), Format::Text),
            (
                Some("text/html,application/xhtml+xml,*/*;q=0.8"),
                Format::Text,
            ),
            (None, Format::Text),
            (Some("application/openmetrics-text;q=0"), Format::Text),
            (
                Some("Application/OpenMetrics-Text; q=0.9"),
                Format::OpenMetrics,
            ),
        ] {
            assert_eq!(Format::negotiate(accept), format, "{accept:?}");
        }
    }
}
