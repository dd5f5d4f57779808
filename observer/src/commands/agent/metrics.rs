//! The agent's Prometheus metrics: counters per family, hook and table, kept from the
//! traversals the pipeline reports, plus the agent's own health, written in the text
//! exposition format.
//!
//! The input is swappable: [`Metrics::observe`] reads the fields of the pipeline's typed
//! traversal (never its JSON); the always-on mode instead calls [`Metrics::add`] with
//! counts it read from the probes' maps. Labels are bounded: hook,
//! table, family, reason, kind, source, node, and `mark` (a mark bit's name: at most 32
//! values). No label holds an address. Each metric holds at most [`MAX_SERIES`] series; a
//! count that would open one more is added to `observer_metrics_overflow_total` instead.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::Mutex;

use observer_model::{FateKind, NatKind, NatSource, Traversal};

/// Series per metric at most (label sets are bounded by design; this is the backstop).
pub const MAX_SERIES: usize = 4096;

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

type Labels = Vec<String>;

#[derive(Default)]
struct Counters {
    series: BTreeMap<Counter, BTreeMap<Labels, u64>>,
    overflow: u64,
}

/// Tier 0's last read (`super::tier0`): its series, rendered, and how the read went.
#[derive(Clone, Debug, Default)]
pub struct Tier0 {
    pub text: String,
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

/// Counters shared between the event loop (writer) and the HTTP server (reader).
pub struct Metrics {
    node: String,
    counters: Mutex<Counters>,
    health: Mutex<Health>,
    tier0: Mutex<Tier0State>,
    /// Tier 1's series, rendered (`super::tier1`).
    tier1: Mutex<String>,
    /// `--mode` and the tiers it runs, for `observer_agent_mode`.
    mode: Mutex<(&'static str, &'static str)>,
    /// Tier 2's series (arming), rendered by `super::tier2` alone: kept apart.
    tier2: Mutex<String>,
}

impl Metrics {
    /// `node`: the value of the `node` label on every series (NODE_NAME in Kubernetes).
    pub fn new(node: &str) -> Self {
        Self {
            node: node.to_string(),
            counters: Mutex::default(),
            health: Mutex::default(),
            tier0: Mutex::default(),
            tier1: Mutex::default(),
            mode: Mutex::new(("", "")),
            tier2: Mutex::default(),
        }
    }

    /// Tier 2's series (`super::tier2::Tier2::render`), replacing the previous ones.
    pub fn set_tier2(&self, text: String) {
        *self.tier2.lock().unwrap_or_else(|e| e.into_inner()) = text;
    }

    /// Says which mode the agent runs and which tiers make its series.
    pub fn set_mode(&self, mode: &'static str, tiers: &'static str) {
        *self.mode.lock().unwrap_or_else(|e| e.into_inner()) = (mode, tiers);
    }

    /// Tier 1's series as last read (replaces the previous ones).
    pub fn set_tier1(&self, text: String) {
        *self.tier1.lock().unwrap_or_else(|e| e.into_inner()) = text;
    }

    /// Tier 0's series as last read (replaces the previous read's).
    pub fn set_tier0(&self, t: Tier0) {
        let mut s = self.tier0.lock().unwrap_or_else(|e| e.into_inner());
        s.errors_total += t.errors;
        s.reads_total += 1;
        s.last = t;
    }

    /// Adds `n` to a counter. `labels` are the values of [`Counter::labels`], in order.
    pub fn add(&self, counter: Counter, labels: &[&str], n: u64) {
        debug_assert_eq!(labels.len(), counter.labels().len());
        let mut c = self.counters.lock().unwrap_or_else(|e| e.into_inner());
        let series = c.series.entry(counter).or_default();
        let key: Labels = labels.iter().map(|s| s.to_string()).collect();
        if let Some(v) = series.get_mut(&key) {
            *v += n;
        } else if series.len() < MAX_SERIES {
            series.insert(key, n);
        } else {
            c.overflow += n;
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
            let source = match n.source {
                NatSource::Rules => "rules",
                NatSource::Conntrack => "conntrack",
            };
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
        let c = self.counters.lock().unwrap_or_else(|e| e.into_inner());
        let key: Labels = labels.iter().map(|s| s.to_string()).collect();
        c.series
            .get(&counter)
            .and_then(|s| s.get(&key))
            .copied()
            .unwrap_or(0)
    }

    pub fn set_health(&self, h: Health) {
        *self.health.lock().unwrap_or_else(|e| e.into_inner()) = h;
    }

    pub fn health(&self) -> Health {
        self.health
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Everything, in the Prometheus text exposition format (version 0.0.4).
    pub fn render(&self) -> String {
        let mut out = String::with_capacity(8192);
        let node = escape(&self.node);
        let c = self.counters.lock().unwrap_or_else(|e| e.into_inner());
        for counter in Counter::ALL {
            let name = counter.name();
            let _ = writeln!(out, "# HELP {name} {}", counter.help());
            let _ = writeln!(out, "# TYPE {name} counter");
            for (labels, v) in c.series.get(&counter).into_iter().flatten() {
                let _ = write!(out, "{name}{{node=\"{node}\"");
                for (k, l) in counter.labels().iter().zip(labels) {
                    let _ = write!(out, ",{k}=\"{}\"", escape(l));
                }
                let _ = writeln!(out, "}} {v}");
            }
        }
        let overflow = c.overflow;
        drop(c);
        let h = self.health();
        let mut one = |name: &str, kind: &str, help: &str, v: u64| {
            let _ = writeln!(out, "# HELP {name} {help}");
            let _ = writeln!(out, "# TYPE {name} {kind}");
            let _ = writeln!(out, "{name}{{node=\"{node}\"}} {v}");
        };
        one(
            "observer_metrics_overflow_total",
            "counter",
            "Counts not kept because a metric already had its maximum number of series.",
            overflow,
        );
        one(
            "observer_records_lost_total",
            "counter",
            "Packets the probes could not record because the ring buffer was full: their \
             traversals are missing from every metric above and from the streams.",
            h.records_lost,
        );
        one(
            "observer_packets_seen_total",
            "counter",
            "Packets that entered the observed namespace's hooks.",
            h.packets_seen,
        );
        one(
            "observer_unusable_records_total",
            "counter",
            "Records the agent could not turn into a report (logged).",
            h.unusable_records,
        );
        one(
            "observer_attach_failures_total",
            "counter",
            "Probe attachments that failed (interfaces left without tcx probes, failed re-plans).",
            h.attach_failures,
        );
        one(
            "observer_subscriber_skipped_total",
            "counter",
            "Traversals a streaming client did not receive because it read too slowly (its \
             stream says how many).",
            h.subscriber_skipped,
        );
        one(
            "observer_name_read_failures_total",
            "counter",
            "Reads that Kubernetes names come from that failed (the node's rules for services, \
             the API server's watch for pods; each logged): names may be missing or stale.",
            h.name_read_failures,
        );
        one(
            "observer_probes_attached",
            "gauge",
            "Netfilter probes attached.",
            h.netfilter_probes,
        );
        one(
            "observer_interfaces",
            "gauge",
            "Interfaces in the namespace (each with tcx probes while traversals are recorded).",
            h.interfaces,
        );
        one(
            "observer_ruleset_generation",
            "gauge",
            "Probe plan generation: grows when a ruleset change re-plans the probes.",
            h.ruleset_generation,
        );
        one(
            "observer_subscribers",
            "gauge",
            "Streaming clients connected.",
            h.subscribers,
        );
        one(
            "observer_flight_recorder_drops",
            "gauge",
            "Dropped traversals held by the flight recorder.",
            h.flight_recorder_held,
        );
        one(
            "observer_flight_recorder_capacity",
            "gauge",
            "How many dropped traversals the flight recorder holds at most.",
            h.flight_recorder_capacity,
        );
        one(
            "observer_mark_changes_unattributed_total",
            "counter",
            "Packets whose mark changes before some probe point could not be attributed to a              table (they waited in a queue or changed CPU between two probes): those changes              are missing from observer_mark_changes_total.",
            h.unattributed,
        );
        one(
            "observer_tracing",
            "gauge",
            "1 while whole traversals are recorded (--mode trace, or a streaming client is              connected); 0 while the probes only count.",
            u64::from(h.tracing),
        );
        one(
            "observer_ready",
            "gauge",
            "1 once the probes are attached.",
            u64::from(h.ready),
        );
        let (mode, tiers) = *self.mode.lock().unwrap_or_else(|e| e.into_inner());
        if !mode.is_empty() {
            let _ = writeln!(
                out,
                "# HELP observer_agent_mode The agent's --mode and the tiers that make its \
                 series (0: the kernel's own rule and conntrack counters; 1: drops at \
                 kfree_skb; 2: per-table brackets).\n# TYPE observer_agent_mode gauge\n\
                 observer_agent_mode{{node=\"{node}\",mode=\"{mode}\",tiers=\"{tiers}\"}} 1"
            );
        }
        out.push_str(&self.tier1.lock().unwrap_or_else(|e| e.into_inner()));
        out.push_str(&self.tier2.lock().unwrap_or_else(|e| e.into_inner()));
        {
            let t = self.tier0.lock().unwrap_or_else(|e| e.into_inner());
            if t.reads_total > 0 {
                out.push_str(&t.last.text);
                let _ = writeln!(
                    out,
                    "# HELP observer_tier0_read_seconds How long the last read of every rule \
                     counter and conntrack's statistics took.\n# TYPE observer_tier0_read_seconds \
                     gauge\nobserver_tier0_read_seconds{{node=\"{node}\"}} {}",
                    t.last.read_seconds
                );
                let _ = writeln!(
                    out,
                    "# HELP observer_tier0_read_errors_total Reads of rule counters or conntrack \
                     statistics that failed (logged; their series keep the last values).\n\
                     # TYPE observer_tier0_read_errors_total counter\n\
                     observer_tier0_read_errors_total{{node=\"{node}\"}} {}",
                    t.errors_total
                );
            }
        }
        let _ = writeln!(
            out,
            "# HELP observer_build_info The observer's version.\n# TYPE observer_build_info \
             gauge\nobserver_build_info{{node=\"{node}\",version=\"{}\"}} 1",
            env!("CARGO_PKG_VERSION")
        );
        out
    }
}

/// A label value, escaped as the exposition format says.
fn escape(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
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

    #[test]
    fn label_values_are_escaped() {
        assert_eq!(escape("a\"b\\c\nd"), "a\\\"b\\\\c\\nd");
    }
}
