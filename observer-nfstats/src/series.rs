//! Rule counters into metric series: each read's counters become increments (a rule the
//! kernel re-created starts again from zero and is counted from there, never backwards),
//! added to bounded families of series. No label holds an address except a service's
//! endpoint, which kube-proxy's own rules name.
//!
//! The families ([`Family`]) carry their name, help and kind; the caller writes them (the
//! agent, through the `prometheus-client` crate).

use std::collections::{BTreeMap, HashMap};

use crate::conntrack;
use crate::ctevents;
use crate::rules::Service;
use crate::rules::{Action, Rule};

/// Series the rule families may hold together, by default.
pub const DEFAULT_CAP: usize = 10_000;

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Family {
    RuleDrops,
    ServiceConnections,
    MarkSets,
    Nat,
    Uncounted,
    LeftOut,
    LeftOutPackets,
    ConntrackEntries,
    ConntrackLimit,
    Conntrack,
    CtConnections,
    CtMarks,
    CtOverruns,
    CtEndpointsLeftOut,
    IpvsConnections,
    IpvsPackets,
    IpvsBytes,
    IpvsRealServers,
    IpvsServerConnections,
    IpvsServerPackets,
    IpvsServerBytes,
    IpvsServerEntries,
    IpvsServerWeight,
    IpvsLeftOut,
}

impl Family {
    pub fn name(self) -> &'static str {
        match self {
            Self::RuleDrops => "observer_rule_drops_total",
            Self::ServiceConnections => "observer_service_connections_total",
            Self::MarkSets => "observer_rule_mark_sets_total",
            Self::Nat => "observer_rule_nat_total",
            Self::Uncounted => "observer_rule_uncounted",
            Self::LeftOut => "observer_rule_series_left_out",
            Self::LeftOutPackets => "observer_rule_series_left_out_packets_total",
            Self::ConntrackEntries => "observer_conntrack_entries",
            Self::ConntrackLimit => "observer_conntrack_limit",
            Self::Conntrack => "observer_conntrack_events_total",
            Self::CtConnections => "observer_conntrack_connections_total",
            Self::CtMarks => "observer_conntrack_marked_connections_total",
            Self::CtOverruns => "observer_conntrack_event_overruns_total",
            Self::CtEndpointsLeftOut => "observer_conntrack_endpoints_left_out_total",
            Self::IpvsConnections => "observer_ipvs_connections_total",
            Self::IpvsPackets => "observer_ipvs_packets_total",
            Self::IpvsBytes => "observer_ipvs_bytes_total",
            Self::IpvsRealServers => "observer_ipvs_real_servers",
            Self::IpvsServerConnections => "observer_ipvs_real_server_connections_total",
            Self::IpvsServerPackets => "observer_ipvs_real_server_packets_total",
            Self::IpvsServerBytes => "observer_ipvs_real_server_bytes_total",
            Self::IpvsServerEntries => "observer_ipvs_real_server_connection_entries",
            Self::IpvsServerWeight => "observer_ipvs_real_server_weight",
            Self::IpvsLeftOut => "observer_ipvs_series_left_out",
        }
    }

    pub fn counter(self) -> bool {
        !matches!(
            self,
            Self::Uncounted
                | Self::LeftOut
                | Self::ConntrackEntries
                | Self::ConntrackLimit
                | Self::IpvsRealServers
                | Self::IpvsServerEntries
                | Self::IpvsServerWeight
                | Self::IpvsLeftOut
        )
    }

    pub fn help(self) -> &'static str {
        match self {
            Self::RuleDrops => {
                "Packets dropped or rejected by a rule, from the rule's own kernel counter \
                 (tier 0: no probe). rule is CHAIN#N as iptables numbers it, CHAIN handle H \
                 for native nftables, or CHAIN policy."
            }
            Self::ServiceConnections => {
                "New connections per Kubernetes service and endpoint, from kube-proxy's DNAT \
                 rules' kernel counters (the nat table sees a connection's first packet only)."
            }
            Self::MarkSets => {
                "Packets a MARK rule (or nftables meta mark set) set a mark bit on, per table \
                 and chain; mark is the bit's name from the mark dictionary, or its hex value."
            }
            Self::Nat => {
                "Connections translated by a rule, per table, chain and kind (dnat, snat, masquerade)."
            }
            Self::Uncounted => {
                "1 for each rule with an action but no counter (an nftables rule without a \
                 counter expression): its packets are not in any rule series."
            }
            Self::LeftOut => {
                "Rules with an action that made no series at the last read because of --rule-series-cap."
            }
            Self::LeftOutPackets => "Packets counted by rules that the series cap left out.",
            Self::ConntrackEntries => "Connections in the conntrack table now.",
            Self::ConntrackLimit => "The conntrack table's limit (nf_conntrack_max).",
            Self::Conntrack => {
                "Conntrack's own statistics summed over CPUs (event: found, invalid, insert, \
                 insert_failed, drop, early_drop, search_restart)."
            }
            Self::CtConnections => {
                "Connections from conntrack's events since the agent started (kind: new, \
                 dnat, snat, destroyed)."
            }
            Self::CtMarks => "New connections by ctmark bit set (conntrack events).",
            Self::CtOverruns => {
                "Times the conntrack event queue overflowed: events were lost there, so the \
                 conntrack-event series undercount."
            }
            Self::CtEndpointsLeftOut => {
                "New DNAT'd connections whose endpoint the series cap left out."
            }
            Self::IpvsConnections => {
                "Connections IPVS scheduled per virtual service, from IPVS's own statistics \
                 (ipvsadm -Ln --stats)."
            }
            Self::IpvsPackets => {
                "Packets of a virtual service's connections per direction (in: client to \
                 real server, out: the replies), from IPVS's own statistics."
            }
            Self::IpvsBytes => "Bytes of a virtual service's connections per direction.",
            Self::IpvsRealServers => {
                "Real servers of a virtual service now, with its scheduler (0: IPVS has \
                 nowhere to send a new connection)."
            }
            Self::IpvsServerConnections => {
                "Connections IPVS scheduled to a real server (endpoint) of a virtual service."
            }
            Self::IpvsServerPackets => {
                "Packets of a real server's connections per direction, from IPVS's own \
                 statistics."
            }
            Self::IpvsServerBytes => "Bytes of a real server's connections per direction.",
            Self::IpvsServerEntries => {
                "IPVS connection entries of a real server now (state: active, inactive, \
                 as ipvsadm -Ln's ActiveConn and InActConn)."
            }
            Self::IpvsServerWeight => {
                "A real server's weight now, with its forwarding method (Masq, Route, \
                 Tunnel, Local)."
            }
            Self::IpvsLeftOut => {
                "Virtual services and real servers that made no series at the last read \
                 because of the series cap."
            }
        }
    }
}

pub type Labels = Vec<(&'static str, String)>;

/// One series: family, labels (in order), value.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Sample {
    pub family: Family,
    pub labels: Labels,
    pub value: u64,
}

/// What identifies a rule between reads (its place or handle, what it does, its comment).
type RuleKey = (
    &'static str,
    String,
    String,
    Option<u64>,
    u32,
    &'static str,
    Option<String>,
);

/// Rule counters and conntrack statistics kept as series across reads.
pub struct Series {
    cap: usize,
    /// Each rule's packets at the last read, and whether its series all exist (were added
    /// to): then a rule whose count has not moved has nothing to add, and its series are
    /// not built again (most of a large ruleset's rules, on most reads).
    last: HashMap<RuleKey, (u64, bool)>,
    totals: BTreeMap<(Family, Labels), u64>,
    uncounted: Vec<Labels>,
    left_out: u64,
    left_out_packets: u64,
    conntrack: Option<conntrack::Stats>,
    /// Endpoints of kube-proxy DNAT rules without a counter (nftables mode): counted from
    /// conntrack's events instead.
    uncounted_endpoints: BTreeMap<String, Service>,
    events: Option<ctevents::Counts>,
}

impl Series {
    pub fn new(cap: usize) -> Self {
        Self {
            cap,
            last: HashMap::new(),
            totals: BTreeMap::new(),
            uncounted: Vec::new(),
            left_out: 0,
            left_out_packets: 0,
            conntrack: None,
            uncounted_endpoints: BTreeMap::new(),
            events: None,
        }
    }

    /// What conntrack's events added up to (since they were first listened to).
    pub fn set_events(&mut self, counts: ctevents::Counts) {
        self.events = Some(counts);
    }

    /// Takes one read of every rule. `mark_name` names a mark bit as tail does.
    pub fn update(&mut self, rules: &[Rule], mark_name: &dyn Fn(u32) -> String) {
        let mut seen = HashMap::with_capacity(rules.len());
        self.uncounted.clear();
        self.uncounted_endpoints.clear();
        self.left_out = 0;
        for r in rules {
            let key: RuleKey = (
                r.family,
                r.table.clone(),
                r.chain.clone(),
                r.handle.filter(|_| !r.iptables),
                if r.iptables { r.position } else { 0 },
                r.action.name(),
                r.comment.clone(),
            );
            let Some(count) = r.count else {
                if let Some((svc, endpoint)) = r.service_endpoint() {
                    self.uncounted_endpoints.insert(endpoint, svc);
                }
                if self.uncounted.len() < self.cap {
                    self.uncounted.push(vec![
                        ("family", r.family.to_string()),
                        ("table", r.table.clone()),
                        ("chain", r.chain.clone()),
                        ("rule", r.name()),
                        ("action", r.action.name().to_string()),
                    ]);
                } else {
                    self.left_out += 1;
                }
                continue;
            };
            let (before, counted) = self.last.get(&key).copied().unwrap_or((0, false));
            // Fewer than last time: the rule was made again (counters start at zero).
            let delta = if count.packets >= before {
                count.packets - before
            } else {
                count.packets
            };
            // Its series exist (series are never removed) and nothing is to be added.
            if counted && delta == 0 {
                seen.insert(key, (count.packets, true));
                continue;
            }
            let targets = series_of(r, mark_name);
            let fits = targets
                .iter()
                .all(|t| self.totals.contains_key(t) || self.totals.len() < self.cap);
            seen.insert(key, (count.packets, fits));
            if !fits {
                self.left_out += 1;
                self.left_out_packets += delta;
                continue;
            }
            for t in targets {
                *self.totals.entry(t).or_default() += delta;
            }
        }
        self.last = seen;
    }

    pub fn set_conntrack(&mut self, stats: conntrack::Stats) {
        self.conntrack = Some(stats);
    }

    /// Every series, `extra` labels (node, tier) first on each.
    pub fn samples(&self, extra: &Labels) -> Vec<Sample> {
        let with = |family, labels: &Labels, value| Sample {
            family,
            labels: extra
                .iter()
                .cloned()
                .chain(labels.iter().cloned())
                .collect(),
            value,
        };
        let mut out: Vec<Sample> = self
            .totals
            .iter()
            .map(|((f, l), v)| with(*f, l, *v))
            .collect();
        out.extend(self.uncounted.iter().map(|l| with(Family::Uncounted, l, 1)));
        if let Some(ev) = &self.events {
            // Where kube-proxy's DNAT rules have no counter, conntrack's new connections
            // give the service counts (an endpoint a counted rule serves is counted there).
            for (endpoint, s) in &self.uncounted_endpoints {
                let labels = vec![
                    ("namespace", s.namespace.clone()),
                    ("service", s.name.clone()),
                    ("port", s.port.clone()),
                    ("endpoint", endpoint.clone()),
                ];
                if self
                    .totals
                    .contains_key(&(Family::ServiceConnections, labels.clone()))
                {
                    continue;
                }
                let n = ev.endpoints.get(endpoint).copied().unwrap_or(0);
                out.push(with(Family::ServiceConnections, &labels, n));
            }
            for (kind, n) in [
                ("new", ev.new),
                ("dnat", ev.dnat),
                ("snat", ev.snat),
                ("destroyed", ev.destroyed),
            ] {
                out.push(with(Family::CtConnections, &vec![("kind", kind.into())], n));
            }
            let marks: BTreeMap<_, _> = ev.marks.iter().collect();
            for (bit, n) in marks {
                out.push(with(
                    Family::CtMarks,
                    &vec![("mark", format!("{bit:#x}"))],
                    *n,
                ));
            }
            out.push(with(Family::CtOverruns, &vec![], ev.overruns));
            out.push(with(
                Family::CtEndpointsLeftOut,
                &vec![],
                ev.endpoints_left_out,
            ));
        }
        out.push(with(Family::LeftOut, &vec![], self.left_out));
        out.push(with(Family::LeftOutPackets, &vec![], self.left_out_packets));
        if let Some(ct) = &self.conntrack {
            out.push(with(Family::ConntrackEntries, &vec![], ct.entries));
            if let Some(l) = ct.limit {
                out.push(with(Family::ConntrackLimit, &vec![], l));
            }
            for (name, v) in conntrack::COLUMNS.iter().zip(ct.counters) {
                if let Some(v) = v {
                    out.push(with(
                        Family::Conntrack,
                        &vec![("event", name.to_string())],
                        v,
                    ));
                }
            }
        }
        out
    }
}

/// The series one rule adds its packets to.
fn series_of(r: &Rule, mark_name: &dyn Fn(u32) -> String) -> Vec<(Family, Labels)> {
    let place = || -> Labels {
        vec![
            ("family", r.family.to_string()),
            ("table", r.table.clone()),
            ("chain", r.chain.clone()),
        ]
    };
    match &r.action {
        Action::Drop | Action::Reject => {
            let mut l = place();
            let service = r.service();
            l.extend([
                ("rule", r.name()),
                ("action", r.action.name().to_string()),
                ("comment", r.comment.clone().unwrap_or_default()),
                ("calico_id", r.calico_id().unwrap_or_default().to_string()),
                (
                    "service",
                    service
                        .map(|s| format!("{}/{}:{}", s.namespace, s.name, s.port))
                        .unwrap_or_default(),
                ),
            ]);
            vec![(Family::RuleDrops, l)]
        }
        Action::Dnat { .. } | Action::Snat | Action::Masquerade => {
            // A kube-proxy endpoint's DNAT is counted per service and endpoint (one series
            // per endpoint chain would only repeat it); every other translation per chain.
            if let Some((s, endpoint)) = r.service_endpoint() {
                return vec![(
                    Family::ServiceConnections,
                    vec![
                        ("namespace", s.namespace),
                        ("service", s.name),
                        ("port", s.port),
                        ("endpoint", endpoint),
                    ],
                )];
            }
            let mut l = place();
            l.push(("kind", r.action.name().to_string()));
            vec![(Family::Nat, l)]
        }
        Action::Mark { set, .. } => (0..32)
            .filter(|b| set & (1 << b) != 0)
            .map(|b| {
                let mut l = place();
                l.push(("mark", mark_name(1 << b)));
                (Family::MarkSets, l)
            })
            .collect(),
        // Calico's accepts set its accept bit too (a MARK rule before them): counted there.
        Action::Accept => Vec::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rules::{Backend, Count};

    fn rule(chain: &str, position: u32, action: Action, packets: Option<u64>) -> Rule {
        Rule {
            backend: Backend::Legacy,
            family: "ipv4",
            table: "filter".into(),
            chain: chain.into(),
            position,
            handle: None,
            iptables: true,
            comment: None,
            action,
            count: packets.map(|packets| Count { packets, bytes: 0 }),
        }
    }

    fn value(s: &Series, family: Family, label: (&str, &str)) -> Option<u64> {
        s.samples(&vec![])
            .into_iter()
            .find(|x| {
                x.family == family && x.labels.iter().any(|(k, v)| *k == label.0 && v == label.1)
            })
            .map(|x| x.value)
    }

    const NAME: &dyn Fn(u32) -> String = &|b| format!("{b:#x}");

    #[test]
    fn deltas_add_up_and_a_recreated_rule_never_goes_backwards() {
        let mut s = Series::new(DEFAULT_CAP);
        s.update(&[rule("FORWARD", 1, Action::Drop, Some(5))], NAME);
        assert_eq!(value(&s, Family::RuleDrops, ("rule", "FORWARD#1")), Some(5));
        s.update(&[rule("FORWARD", 1, Action::Drop, Some(8))], NAME);
        assert_eq!(value(&s, Family::RuleDrops, ("rule", "FORWARD#1")), Some(8));
        // Re-created: its counter starts at 0 and is at 2 now.
        s.update(&[rule("FORWARD", 1, Action::Drop, Some(2))], NAME);
        assert_eq!(
            value(&s, Family::RuleDrops, ("rule", "FORWARD#1")),
            Some(10)
        );
    }

    #[test]
    fn the_cap_leaves_rules_out_and_counts_them() {
        let mut s = Series::new(2);
        let rules: Vec<Rule> = (1..=4)
            .map(|i| rule("FORWARD", i, Action::Drop, Some(10)))
            .collect();
        s.update(&rules, NAME);
        let drops = s
            .samples(&vec![])
            .iter()
            .filter(|x| x.family == Family::RuleDrops)
            .count();
        assert_eq!(drops, 2);
        let unlabelled = |family| {
            s.samples(&vec![])
                .iter()
                .find(|x| x.family == family)
                .map(|x| x.value)
        };
        assert_eq!(unlabelled(Family::LeftOut), Some(2));
        assert_eq!(unlabelled(Family::LeftOutPackets), Some(20));
    }

    /// A read where nothing moved changes no series (their series are not built again), and
    /// the rules the cap left out are still counted as left out at every read.
    #[test]
    fn a_read_where_nothing_moved_keeps_every_series_and_the_left_out() {
        let mut s = Series::new(2);
        let rules: Vec<Rule> = (1..=3)
            .map(|i| rule("FORWARD", i, Action::Drop, Some(u64::from(i) * 10)))
            .collect();
        s.update(&rules, NAME);
        let before = s.samples(&vec![]);
        s.update(&rules, NAME);
        assert_eq!(s.samples(&vec![]), before);
        let left_out = |s: &Series| {
            s.samples(&vec![])
                .iter()
                .find(|x| x.family == Family::LeftOut)
                .map(|x| x.value)
        };
        assert_eq!(left_out(&s), Some(1));
        // One rule moves, the others do not: only it adds.
        let mut moved = rules.clone();
        moved[1].count = Some(Count {
            packets: 25,
            bytes: 0,
        });
        s.update(&moved, NAME);
        assert_eq!(
            value(&s, Family::RuleDrops, ("rule", "FORWARD#1")),
            Some(10)
        );
        assert_eq!(
            value(&s, Family::RuleDrops, ("rule", "FORWARD#2")),
            Some(25)
        );
        assert_eq!(left_out(&s), Some(1));
    }

    #[test]
    fn services_marks_nat_and_uncounted() {
        let mut sep = rule(
            "KUBE-SEP-A",
            2,
            Action::Dnat {
                to: Some("10.0.0.5:80".into()),
            },
            Some(3),
        );
        sep.table = "nat".into();
        sep.comment = Some("default/web:http".into());
        let mark = rule(
            "KUBE-MARK-MASQ",
            1,
            Action::Mark {
                set: 0x4000,
                mask: 0x4000,
            },
            Some(4),
        );
        let mut native = rule("c", 1, Action::Drop, None);
        native.iptables = false;
        native.handle = Some(3);
        let mut s = Series::new(DEFAULT_CAP);
        s.update(&[sep, mark, native], NAME);
        assert_eq!(
            value(&s, Family::ServiceConnections, ("endpoint", "10.0.0.5:80")),
            Some(3)
        );
        assert_eq!(
            value(&s, Family::Nat, ("kind", "dnat")),
            None,
            "counted per service"
        );
        assert_eq!(value(&s, Family::MarkSets, ("mark", "0x4000")), Some(4));
        assert_eq!(
            value(&s, Family::Uncounted, ("rule", "c handle 3")),
            Some(1)
        );
        assert_eq!(
            value(&s, Family::RuleDrops, ("rule", "c handle 3")),
            None,
            "never invented"
        );
    }
}
