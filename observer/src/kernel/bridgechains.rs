//! What the nft `bridge` family's chains (and ebtables-nft's) did to a bridged frame, for
//! live tail. No probe can bracket them on this kernel: BPF netfilter links accept only
//! IPv4/IPv6 (`EAFNOSUPPORT` for `NFPROTO_BRIDGE`), and there are no kprobes or fentry.
//! So a bridged report is annotated with what the simulator (`observer-rules`' br_netfilter
//! model) decides those chains do with the observed frame on the live ruleset, each rule
//! confirmed only when its own counter advanced between a read that ended before the frame
//! and one that started after it (as tier 1 names drop rules). The notes say "simulated",
//! never "observed".
//!
//! The node is read here ([`BridgeChains`]); building the frame's description, walking the
//! simulation's bridge stages and judging the counters are pure functions, unit-tested.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use log::warn;
use observer_model::{CtState, RuleId, Traversal, Verdict};
use observer_rules::{PacketSpec, Simulator};

/// The compiled ruleset is read again after this long (a change read late can only make a
/// rule unconfirmed: the counters must agree).
const SIM_MAX_AGE: Duration = Duration::from_secs(10);
/// Counter reads kept: a frame is compared with the newest that ended before it began (at
/// most one read per drained batch: this covers frames that waited a second or so).
const READS_KEPT: usize = 64;

/// A bridge-family rule's identity: (table, chain, handle).
pub type RuleKey = (String, String, u64);

/// Bridge-family rule counters as one read saw them, and when the read began and ended
/// (CLOCK_MONOTONIC, the probes' clock).
#[derive(Clone, Debug, Default)]
pub struct CounterRead {
    pub started_ns: u64,
    pub ended_ns: u64,
    /// `None`: the rule has no counter.
    pub packets: HashMap<RuleKey, Option<u64>>,
}

/// One bridge-family chain the simulation ran for the frame.
#[derive(Clone, Debug, PartialEq)]
pub struct SimulatedChain {
    pub hook: observer_model::Hook,
    pub table: String,
    pub chain: String,
    pub priority: i32,
    pub verdict: Verdict,
    /// The rules the simulation says match, in order: (key, text, action, decided); a rule
    /// not decided (the walk stopped there) comes last, with `decided` false.
    pub rules: Vec<(RuleKey, String, String, bool)>,
    /// Why the chain could not be decided (the walk stopped there).
    pub undecidable: Option<String>,
}

/// Which headers a walk starts from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Headers {
    /// As the frame entered (what bridge `prerouting` chains see).
    Entry,
    /// After IP PREROUTING (DNAT, marks): what bridge `forward` and `postrouting` chains
    /// see. The simulator applies only the nat rules of a new connection, not conntrack's
    /// stored translation, so later packets of a DNATed connection are walked from here.
    AfterPrerouting,
}

/// The frame as the simulator takes it: its headers as `at` says, the bridge port it came
/// in by and the one it left by, its mark and its connection's state. `Err` says why it
/// cannot.
pub fn spec_of(t: &Traversal, at: Headers) -> Result<PacketSpec, String> {
    let b = t.bridge.as_ref().ok_or("not bridged")?;
    let port = b.physdev_in.clone().ok_or(
        "the bridge port it came in by is not known (a flooded copy, or sent by the node)",
    )?;
    let entry = || t.stages.iter().find_map(|s| s.before.as_ref());
    let first = match at {
        Headers::Entry => entry(),
        Headers::AfterPrerouting => t
            .stages
            .iter()
            .find(|s| s.hook != observer_model::Hook::PreRouting)
            .and_then(|s| s.before.as_ref())
            .or_else(|| {
                t.stages
                    .iter()
                    .rev()
                    .find_map(|s| s.after.as_ref().or(s.before.as_ref()))
            }),
    }
    .ok_or("no stage saw its headers")?;
    let proto = t.proto.ok_or("its protocol is not known")?.number();
    let ct_state = t
        .stages
        .iter()
        .find_map(|s| s.ct.as_ref())
        .map_or(CtState::New, |c| c.state);
    let has_ports = matches!(proto, 6 | 17 | 132 | 136);
    Ok(PacketSpec {
        proto,
        src: first
            .src
            .host
            .ip()
            .ok_or("its source address is not known")?,
        dst: first
            .dst
            .host
            .ip()
            .ok_or("its destination address is not known")?,
        sport: if has_ports { first.src.port } else { None },
        dport: if has_ports { first.dst.port } else { None },
        in_iface: Some(port),
        out_iface: b.physdev_out.clone(),
        mark: first.mark,
        ct_state,
        ct_mark: None,
        tcp_flags: None,
        icmp: None,
        local: false,
    })
}

/// The bridge-family chains of the simulation's most likely outcome for `spec`.
pub fn simulate(sim: &Simulator<'_>, spec: &PacketSpec) -> Vec<SimulatedChain> {
    let Some(branch) = sim.simulate(spec).into_iter().next() else {
        return Vec::new();
    };
    branch
        .stages
        .iter()
        .filter_map(|s| {
            let chain = s.chain.as_ref().filter(|c| c.family == "bridge")?;
            let rules = s
                .rules
                .iter()
                .filter_map(|r| match &r.id {
                    RuleId::Nft {
                        table,
                        chain,
                        handle,
                        ..
                    } => Some((
                        (table.clone(), chain.clone(), *handle),
                        r.text.clone(),
                        r.action.clone(),
                        r.undecidable.is_none(),
                    )),
                    RuleId::Iptables { .. } => None,
                })
                .collect();
            Some(SimulatedChain {
                hook: s.hook,
                table: s.table.to_string(),
                chain: chain.name.clone(),
                priority: s.priority,
                verdict: s.verdict,
                rules,
                undecidable: s
                    .rules
                    .iter()
                    .find_map(|r| r.undecidable.clone())
                    .or_else(|| (s.verdict == Verdict::Undecidable).then(|| s.note.clone())?),
            })
        })
        .collect()
}

/// How sure a simulated rule is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Confirmation {
    /// Its counter advanced (by this much) across the frame.
    Confirmed(u64),
    Unconfirmed(String),
}

/// Judges one simulated rule by its counter: confirmed only when the read before ended
/// before the frame began, the read after started after it ended, and the counter advanced.
pub fn confirm(
    key: &RuleKey,
    frame: (u64, u64),
    before: Option<&CounterRead>,
    after: &CounterRead,
) -> Confirmation {
    if after.started_ns <= frame.1 {
        return Confirmation::Unconfirmed(
            "no counter read after the frame yet (reading the bridge family's counters failed)"
                .into(),
        );
    }
    let Some(before) = before.filter(|b| b.ended_ns < frame.0) else {
        return Confirmation::Unconfirmed(
            "no counter read before the frame to compare with".into(),
        );
    };
    match (before.packets.get(key), after.packets.get(key)) {
        (Some(Some(b)), Some(Some(a))) if a > b => Confirmation::Confirmed(a - b),
        (Some(Some(_)), Some(Some(_))) => {
            Confirmation::Unconfirmed("its counter did not advance across the frame".into())
        }
        (_, Some(None)) => Confirmation::Unconfirmed("the rule has no counter".into()),
        _ => Confirmation::Unconfirmed("the rule is not in the counters read".into()),
    }
}

/// The report's notes for the simulated chains: one per chain, then one per rule.
pub fn notes(
    chains: &[SimulatedChain],
    frame: (u64, u64),
    before: Option<&CounterRead>,
    after: &CounterRead,
) -> Vec<String> {
    let mut out = Vec::new();
    // Chains that let the frame through without a rule matching: one line for all.
    if chains
        .iter()
        .all(|c| c.rules.is_empty() && c.undecidable.is_none() && c.verdict == Verdict::Accept)
    {
        let names: Vec<String> = chains
            .iter()
            .map(|c| format!("bridge {} {} ({})", c.table, c.chain, c.hook.name()))
            .collect();
        out.push(format!(
            "bridge-family chains {} (simulated on the live ruleset, not observed): accept, no rule matches",
            names.join(", ")
        ));
        return out;
    }
    for c in chains {
        let mut line = format!(
            "bridge-family chain bridge {} {} ({} {}; simulated on the live ruleset, not observed: no probe attaches to bridge hooks here): {}",
            c.table,
            c.chain,
            c.hook.name(),
            c.priority,
            match (&c.undecidable, c.verdict) {
                (Some(why), _) => format!("undecidable: {why}"),
                (None, v) => format!("{v:?}").to_lowercase(),
            }
        );
        if c.rules.is_empty() {
            line.push_str(", no rule matches (nothing to confirm)");
        }
        out.push(line);
        for (key, text, action, decided) in &c.rules {
            let judged = match (decided, confirm(key, frame, before, after)) {
                (true, Confirmation::Confirmed(n)) => {
                    format!("confirmed: its counter advanced by {n} across the frame")
                }
                (true, Confirmation::Unconfirmed(why)) => format!("unconfirmed: {why}"),
                // Nothing simulated to confirm: what the counter says, as a kernel fact.
                (false, Confirmation::Confirmed(n)) => format!(
                    "not decided by the simulation; the kernel counted {n} packet(s) on it across the frame"
                ),
                (false, Confirmation::Unconfirmed(why)) => {
                    format!("not decided by the simulation; its counter cannot say: {why}")
                }
            };
            out.push(format!(
                "  bridge {} {} handle {} {} => {action} ({judged})",
                key.0,
                key.1,
                key.2,
                without_counts(text)
            ));
        }
    }
    out
}

/// `NFPROTO_BRIDGE`.
const NFPROTO_BRIDGE: u8 = 7;

/// A rule's text without the counter values it had when the ruleset was read
/// (`counter packets 1 bytes 29` -> `counter`): the note judges the counter itself.
pub(crate) fn without_counts(text: &str) -> String {
    let words: Vec<&str> = text.split(' ').collect();
    let mut out = Vec::with_capacity(words.len());
    let mut i = 0;
    while i < words.len() {
        out.push(words[i]);
        if words[i] == "counter"
            && words.get(i + 1) == Some(&"packets")
            && words.get(i + 3) == Some(&"bytes")
        {
            i += 5;
        } else {
            i += 1;
        }
    }
    out.join(" ")
}

/// The bridge-family rules' counters of one read.
pub fn bridge_counters(rules: &[observer_nfstats::nft::Parsed]) -> HashMap<RuleKey, Option<u64>> {
    rules
        .iter()
        .filter(|r| r.chain.nfproto == NFPROTO_BRIDGE)
        .map(|r| {
            (
                (r.chain.table.clone(), r.chain.name.clone(), r.handle),
                r.count.map(|c| c.packets),
            )
        })
        .collect()
}

/// Whether the ruleset has a bridge-family base chain.
pub fn has_bridge_chains(sim: &Simulator<'_>) -> bool {
    use observer_model::Hook;
    sim.nft_program().is_some_and(|p| {
        [
            Hook::PreRouting,
            Hook::LocalIn,
            Hook::Forward,
            Hook::LocalOut,
            Hook::PostRouting,
        ]
        .into_iter()
        .any(|h| !p.bridge_chains(h).is_empty())
    })
}

/// The live side: the compiled ruleset (kept [`SIM_MAX_AGE`], and only where the node has
/// bridge-family chains: the cheap check is one netlink dump of that family) and the
/// counter reads. Must be used in the observed namespace.
pub struct BridgeChains {
    sim: Option<Simulator<'static>>,
    /// When the node was last checked for bridge-family chains.
    checked: Option<Instant>,
    /// Bridge-family chains, as last read.
    chains: usize,
    reader: Option<observer_nfstats::RuleReader>,
    reads: std::collections::VecDeque<CounterRead>,
}

impl BridgeChains {
    /// Reads the ruleset and a first set of counters (the "before" of the first frames).
    pub fn read() -> Self {
        Self::start(None)
    }

    /// As [`Self::read`], from the node as `live` read it.
    pub fn from_live(live: &observer_rules::LiveNode) -> Self {
        Self::start(Some(live))
    }

    fn start(live: Option<&observer_rules::LiveNode>) -> Self {
        let mut b = Self {
            sim: None,
            checked: None,
            chains: 0,
            reader: observer_nfstats::RuleReader::new()
                .map_err(|e| warn!("bridge-family chains: cannot read rule counters: {e}"))
                .ok(),
            reads: Default::default(),
        };
        // The first counter read: the "before" of the first frames.
        b.read_counters();
        b.checked = Some(Instant::now());
        if b.chains > 0 {
            b.sim = Some(match live {
                Some(l) => l.simulator(),
                None => crate::kernel::upkeep::read_live().simulator(),
            });
        }
        b
    }

    /// Checks again for bridge-family chains when the last check is old, and reads the
    /// ruleset again then where there are some; whether there are.
    fn refresh(&mut self) -> bool {
        if self.checked.is_none_or(|at| at.elapsed() > SIM_MAX_AGE) {
            self.checked = Some(Instant::now());
            self.read_counters();
            // The old one goes before the new one is built (never two at once).
            drop(self.sim.take());
            if self.chains > 0 {
                self.sim = Some(crate::kernel::upkeep::read_live().simulator());
            }
        }
        self.chains > 0 && self.sim.as_ref().is_some_and(has_bridge_chains)
    }

    fn read_counters(&mut self) {
        let Some(reader) = self.reader.as_mut() else {
            return;
        };
        let started_ns = crate::kernel::upkeep::now_ns();
        match reader.read_family(NFPROTO_BRIDGE) {
            Ok((chains, rules)) => {
                self.chains = chains;
                self.reads.push_back(CounterRead {
                    started_ns,
                    ended_ns: crate::kernel::upkeep::now_ns(),
                    packets: bridge_counters(&rules),
                });
                while self.reads.len() > READS_KEPT {
                    self.reads.pop_front();
                }
            }
            Err(e) => warn!("bridge-family chains: reading rule counters: {e}"),
        }
    }

    /// The notes for a report of a frame seen from `frame.0` to `frame.1` (ns), or `None`
    /// when it crossed no bridge or the node has no bridge-family chain. A read of the
    /// counters that started after the frame ended is made if none exists yet.
    pub fn annotate(&mut self, t: &Traversal, frame: (u64, u64)) -> Option<Vec<String>> {
        t.bridge.as_ref()?;
        if !self.refresh() {
            return None;
        }
        let (spec, later) = match (
            spec_of(t, Headers::Entry),
            spec_of(t, Headers::AfterPrerouting),
        ) {
            (Ok(s), Ok(l)) => (s, l),
            (Err(why), _) | (_, Err(why)) => {
                return Some(vec![format!("bridge-family chains: not simulated ({why})")]);
            }
        };
        let sim = self.sim.as_ref()?;
        // Bridge prerouting chains see the frame as it entered; the later ones see it as IP
        // PREROUTING left it (walked again from there: see `Headers`).
        let mut chains: Vec<SimulatedChain> = simulate(sim, &spec)
            .into_iter()
            .filter(|c| c.hook == observer_model::Hook::PreRouting)
            .collect();
        if chains
            .iter()
            .all(|c| c.verdict == Verdict::Accept && c.undecidable.is_none())
        {
            chains.extend(
                simulate(sim, &later)
                    .into_iter()
                    .filter(|c| c.hook != observer_model::Hook::PreRouting),
            );
        }
        if spec.out_iface.is_none() {
            // The simulator's reason speaks of the node resolving a neighbour (explain's
            // case); here the frame was bridged by its sender's choice of MAC.
            let unread = if t
                .stages
                .iter()
                .any(|s| s.hook == observer_model::Hook::Forward)
            {
                "the probes could not record it at IP FORWARD"
            } else {
                "the probes read it at IP FORWARD, which this frame did not reach"
            };
            for c in &mut chains {
                if c.undecidable
                    .as_deref()
                    .is_some_and(|w| w.starts_with("oifname:"))
                {
                    c.undecidable = Some(format!(
                        "oifname: the port it was to leave by is not known ({unread}, and the node's neighbour and fdb tables, read at most {} s ago, do not place {})",
                        SIM_MAX_AGE.as_secs(),
                        spec.dst
                    ));
                }
            }
        }
        if chains.is_empty() {
            return Some(vec![
                "bridge-family chains: none runs for this frame (simulated on the live ruleset)"
                    .into(),
            ]);
        }
        // A read after the frame, made now if the last one began before it ended: one read
        // covers every frame of the batch being handled (they all ended before it), so this
        // is at most one read per drained batch, and no frame goes unjudged for want of one.
        if self.reads.back().is_none_or(|r| r.started_ns <= frame.1) {
            self.read_counters();
        }
        let after = self.reads.back()?.clone();
        let before = self.reads.iter().rev().find(|r| r.ended_ns < frame.0);
        Some(notes(&chains, frame, before, &after))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read(at: (u64, u64), n: Option<u64>) -> CounterRead {
        CounterRead {
            started_ns: at.0,
            ended_ns: at.1,
            packets: [(key(), n)].into_iter().collect(),
        }
    }

    fn key() -> RuleKey {
        ("filter".into(), "forward".into(), 4)
    }

    #[test]
    fn a_rule_is_confirmed_only_by_its_counter_advancing_around_the_frame() {
        let frame = (100, 110);
        let after = read((120, 130), Some(7));
        assert_eq!(
            confirm(&key(), frame, Some(&read((10, 20), Some(5))), &after),
            Confirmation::Confirmed(2)
        );
        assert!(matches!(
            confirm(&key(), frame, Some(&read((10, 20), Some(7))), &after),
            Confirmation::Unconfirmed(w) if w.contains("did not advance")
        ));
        // A read that overlapped the frame proves nothing.
        assert!(matches!(
            confirm(&key(), frame, Some(&read((90, 105), Some(5))), &after),
            Confirmation::Unconfirmed(w) if w.contains("no counter read before")
        ));
        assert!(matches!(
            confirm(
                &key(),
                frame,
                Some(&read((10, 20), Some(5))),
                &read((105, 130), Some(7))
            ),
            Confirmation::Unconfirmed(w) if w.contains("no counter read after")
        ));
        assert!(matches!(
            confirm(&key(), frame, Some(&read((10, 20), None)), &read((120, 130), None)),
            Confirmation::Unconfirmed(w) if w.contains("no counter")
        ));
        assert!(matches!(
            confirm(&key(), frame, None, &after),
            Confirmation::Unconfirmed(_)
        ));
    }

    #[test]
    fn rule_texts_lose_the_counter_values_read_with_the_ruleset() {
        assert_eq!(
            without_counts("udp dport 7002 counter packets 1 bytes 29 drop comment \"x\""),
            "udp dport 7002 counter drop comment \"x\""
        );
        assert_eq!(
            without_counts("udp dport 7002 counter"),
            "udp dport 7002 counter"
        );
    }

    #[test]
    fn notes_say_simulated_and_judge_each_rule() {
        let chains = vec![SimulatedChain {
            hook: observer_model::Hook::Forward,
            table: "filter".into(),
            chain: "forward".into(),
            priority: -200,
            verdict: Verdict::Accept,
            rules: vec![(
                key(),
                "udp dport 7002 counter packets 9 bytes 90".into(),
                "continue".into(),
                true,
            )],
            undecidable: None,
        }];
        let n = notes(
            &chains,
            (100, 110),
            Some(&read((10, 20), Some(5))),
            &read((120, 130), Some(6)),
        );
        assert_eq!(n.len(), 2, "{n:?}");
        assert!(n[0].starts_with("bridge-family chain bridge filter forward (FORWARD -200; simulated on the live ruleset, not observed"), "{n:?}");
        assert!(n[0].ends_with(": accept"), "{n:?}");
        assert_eq!(
            n[1],
            "  bridge filter forward handle 4 udp dport 7002 counter => continue (confirmed: its counter advanced by 1 across the frame)"
        );
        // Chains where nothing matched share one line.
        let quiet = vec![
            SimulatedChain {
                rules: Vec::new(),
                ..chains[0].clone()
            };
            2
        ];
        assert_eq!(
            notes(&quiet, (100, 110), None, &read((120, 130), Some(6))),
            [
                "bridge-family chains bridge filter forward (FORWARD), bridge filter forward (FORWARD) (simulated on the live ruleset, not observed): accept, no rule matches"
            ]
        );
        // Never called observed: only "not observed".
        assert!(
            !n.iter()
                .any(|l| l.replace("not observed", "").contains("observed"))
        );
    }
}
