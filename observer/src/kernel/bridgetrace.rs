//! `--trace-bridge-chains`: what the nft `bridge` family's chains did to a bridged frame,
//! OBSERVED through nf_tables' own trace (no probe can bracket those chains here: BPF
//! netfilter links refuse `NFPROTO_BRIDGE`, and there are no kprobes or fentry).
//!
//! The observer creates its own bridge-family table (`observer_nfstats::nftrace`: owned by
//! its netlink socket, so the kernel removes it when the process ends, however it ends)
//! whose chains, first on every bridge hook, set `meta nftrace` on IP frames and nothing
//! else. nf_tables then reports every bridge-family chain and rule each frame meets. The
//! events are grouped per frame (trace id, split where a hook repeats: the id is a hash of
//! the skb, which a later frame may reuse) and a report takes the oldest group received
//! after its traversal began whose headers are ones the traversal had.
//!
//! Grouping, matching and the notes are pure functions, unit-tested from bytes the kernel
//! sent; only [`BridgeTrace::open`] and [`BridgeTrace::drain`] touch the kernel.

use std::collections::{HashMap, VecDeque};
use std::net::IpAddr;

use observer_model::Traversal;
use observer_nfstats::nftrace::{Flow, TraceEvent, TraceTable, Traced, Verdict};

/// Frames' event groups kept waiting for their report at most (the oldest are dropped
/// first: frames no report asks for, such as those `--filter` leaves out).
const GROUPS_KEPT: usize = 4096;
/// Events kept per frame at most (a frame meets a handful of chains).
const EVENTS_PER_GROUP: usize = 64;
const NFPROTO_BRIDGE: u8 = 7;
/// The trace table's chains' priority: before every other bridge-family chain.
const PRIORITY: i32 = i32::MIN;

/// A rule's identity: (table, chain, handle).
pub type RuleKey = (String, String, u64);

/// What the trace said about one frame.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Group {
    pub id: u32,
    /// When the first of its events was read (CLOCK_MONOTONIC ns): no earlier than the
    /// frame's first hook.
    pub received_ns: u64,
    /// The headers its events carried, as each chain saw them.
    pub flows: Vec<Flow>,
    /// The user's bridge-family chains' events (the trace table's own are left out).
    pub events: Vec<TraceEvent>,
    /// The interface it came in by at its first bridge hook that names one (`NFTA_TRACE_IIF`:
    /// the bridge port, also for a flooded copy, whose first bridge hook is forward).
    pub in_port: Option<u32>,
    /// The interface it left by at its first bridge hook that names one (`NFTA_TRACE_OIF`:
    /// the port a bridged frame, or each flooded copy, was forwarded to).
    pub out_port: Option<u32>,
    /// The trace table's hooks it met so far (`nftrace::BRIDGE_HOOKS` names).
    own_hooks: Vec<String>,
    used: bool,
}

impl Group {
    /// Whether a bridge-family rule or policy dropped the frame.
    pub fn dropped(&self) -> bool {
        self.events.iter().any(TraceEvent::drops)
    }
}

/// Whether an event of the trace table at `hook` belongs to a new frame rather than the
/// open group's: every frame meets a bridge hook once, prerouting only first, and output
/// (a frame the node, or br_netfilter through the bridge device, sends) only before the
/// later hooks.
fn starts_new_frame(seen: &[String], hook: &str) -> bool {
    match hook {
        "prerouting" => true,
        "output" => seen
            .iter()
            .any(|h| matches!(h.as_str(), "output" | "input" | "postrouting")),
        _ => seen.iter().any(|h| h == hook),
    }
}

/// Groups trace events into frames as they arrive.
#[derive(Debug, Default)]
pub struct Grouper {
    own_table: String,
    pub groups: VecDeque<Group>,
    /// Trace id -> the sequence number of its open group.
    open: HashMap<u32, u64>,
    /// Sequence number of `groups[0]`.
    first_seq: u64,
    /// Groups dropped unmatched (beyond [`GROUPS_KEPT`]).
    pub evicted: u64,
}

impl Grouper {
    pub fn new(own_table: &str) -> Self {
        Self {
            own_table: own_table.to_string(),
            ..Self::default()
        }
    }

    /// Adds one event read at `now` (ns).
    pub fn add(&mut self, e: TraceEvent, now: u64) {
        if e.chain.nfproto != NFPROTO_BRIDGE {
            return;
        }
        let own = e.chain.table == self.own_table;
        let open = self
            .open
            .get(&e.id)
            .and_then(|seq| seq.checked_sub(self.first_seq))
            .map(|i| i as usize)
            .filter(|&i| i < self.groups.len());
        let new = match open {
            None => true,
            Some(i) => {
                own && e.traced.rule().is_some()
                    && starts_new_frame(&self.groups[i].own_hooks, &e.chain.name)
            }
        };
        let i = if new {
            if self.groups.len() >= GROUPS_KEPT {
                self.groups.pop_front();
                self.first_seq += 1;
                self.evicted += 1;
            }
            self.groups.push_back(Group {
                id: e.id,
                received_ns: now,
                ..Group::default()
            });
            self.open
                .insert(e.id, self.first_seq + self.groups.len() as u64 - 1);
            // Ids of groups already dropped are forgotten with them (bounded map).
            if self.open.len() > 2 * GROUPS_KEPT {
                let first = self.first_seq;
                self.open.retain(|_, s| *s >= first);
            }
            self.groups.len() - 1
        } else {
            open.expect("an open group")
        };
        let g = &mut self.groups[i];
        if g.in_port.is_none() {
            g.in_port = e.iif;
        }
        if g.out_port.is_none() {
            g.out_port = e.oif;
        }
        if let Some(f) = e.flow
            && !g.flows.contains(&f)
        {
            g.flows.push(f);
        }
        if own {
            if e.traced.rule().is_some() {
                g.own_hooks.push(e.chain.name);
            }
        } else if g.events.len() < EVENTS_PER_GROUP
            // The end of a chain's rules without a rule (this kernel reports it as a rule
            // event without a handle): the policy event that follows says it.
            && !matches!(e.traced, Traced::Rule { handle: None, .. })
        {
            g.events.push(e);
        }
    }

    /// The oldest group not yet taken, received at or after `since` (ns), whose headers
    /// are among `flows`, whose bridge ports are `ports` (in, out) where both sides know
    /// them, and which began where the frame did: a flooded copy at the bridge's forward
    /// hook (it is a clone made there, out by its own port), a frame that entered by a port
    /// at prerouting (the copies of a flooded frame differ from it and each other only
    /// there); taken.
    pub fn take(
        &mut self,
        flows: &[FlowKey],
        since: u64,
        ports: (Option<u32>, Option<u32>),
        flooded: bool,
    ) -> Option<Group> {
        let agrees = |a: Option<u32>, b: Option<u32>| a.zip(b).is_none_or(|(a, b)| a == b);
        let began = |g: &Group| {
            let first = g.own_hooks.first().map(String::as_str);
            if flooded {
                first == Some("forward") && g.out_port.is_some() == ports.1.is_some()
            } else if ports.0.is_some() {
                first == Some("prerouting")
            } else {
                true
            }
        };
        let g = self.groups.iter_mut().find(|g| {
            !g.used
                && g.received_ns >= since
                && agrees(g.in_port, ports.0)
                && agrees(g.out_port, ports.1)
                && began(g)
                && g.flows.iter().any(|f| flows.contains(&key_of(f)))
        })?;
        g.used = true;
        Some(std::mem::take(g))
    }
}

/// Headers that identify a frame in a report and in a trace event.
pub type FlowKey = (u8, IpAddr, IpAddr, Option<u16>, Option<u16>);

fn key_of(f: &Flow) -> FlowKey {
    (f.proto, f.src, f.dst, f.sport, f.dport)
}

/// Every set of headers the traversal had, as [`FlowKey`]s.
pub fn flows_of(t: &Traversal) -> Vec<FlowKey> {
    let Some(proto) = t.proto.map(|p| p.number()) else {
        return Vec::new();
    };
    let packet = t
        .packet
        .iter()
        .flat_map(|p| [Some(&p.first), p.last.as_ref()])
        .flatten()
        .map(|h| (&h.src, &h.dst));
    let stages = t
        .stages
        .iter()
        .flat_map(|s| [s.before.as_deref(), s.after.as_deref()])
        .flatten()
        .map(|h| (&h.src, &h.dst));
    let mut out = Vec::new();
    for (s, d) in packet.chain(stages) {
        let (Some(src), Some(dst)) = (s.host.ip(), d.host.ip()) else {
            continue;
        };
        let k = (proto, src, dst, s.port, d.port);
        if !out.contains(&k) {
            out.push(k);
        }
    }
    out
}

/// What the report says of a rule or chain: its text from the live ruleset, and its base
/// chain's hook and priority.
#[derive(Clone, Debug, Default)]
pub struct Names {
    pub rules: HashMap<RuleKey, String>,
    /// (table, chain) -> (hook, priority) of base chains.
    pub chains: HashMap<(String, String), (String, i64)>,
}

impl Names {
    /// The bridge family's rules and base chains of `nft`.
    pub fn of(nft: Option<&observer_rules::nft::NftRuleset>) -> Self {
        let mut n = Self::default();
        for t in nft.iter().flat_map(|r| &r.tables) {
            if t.id.family != "bridge" {
                continue;
            }
            for c in &t.chains {
                if let (Some(h), Some(p)) = (&c.hook, c.priority) {
                    n.chains
                        .insert((t.id.name.clone(), c.name.clone()), (h.clone(), p));
                }
                for r in &c.rules {
                    let v = r.expr.value();
                    let text = observer_rules::nft::text::rule_text(
                        v.as_array().map_or(&[][..], Vec::as_slice),
                        r.comment.as_deref(),
                    );
                    n.rules
                        .insert((t.id.name.clone(), c.name.clone(), r.handle), text);
                }
            }
        }
        n
    }
}

/// The report's notes for one frame's group: per chain met, in order, its verdict; per
/// rule matched, its text and verdict. Said "observed".
pub fn notes(g: &Group, names: &Names) -> Vec<String> {
    let mut out = Vec::new();
    // Chains in the order first met, each with its events.
    let mut chains: Vec<((&str, &str), Vec<&TraceEvent>)> = Vec::new();
    for e in &g.events {
        let k = (e.chain.table.as_str(), e.chain.name.as_str());
        match chains.last_mut() {
            Some((last, evs)) if *last == k => evs.push(e),
            _ => chains.push((k, vec![e])),
        }
    }
    if chains.is_empty() {
        out.push("bridge-family chains (observed by nf_tables trace): the frame met none".into());
        return out;
    }
    for ((table, chain), evs) in &chains {
        let at = names
            .chains
            .get(&(table.to_string(), chain.to_string()))
            .map(|(h, p)| format!("{} {p}", hook_name(h)))
            .unwrap_or_else(|| "regular chain".into());
        let end = evs
            .iter()
            .rev()
            .find(|e| {
                matches!(e.traced, Traced::Policy(_))
                    || matches!(e.traced.verdict(), Some(Verdict::Drop | Verdict::Accept))
            })
            .map(|e| match e.traced {
                Traced::Policy(_) => format!("{} (policy)", e.verdict_name()),
                _ => format!(
                    "{} by rule handle {}",
                    e.verdict_name(),
                    e.traced.rule().unwrap_or_default()
                ),
            })
            .unwrap_or_else(|| {
                evs.last()
                    .map_or_else(|| "continue".into(), |e| e.verdict_name())
            });
        out.push(format!(
            "bridge-family chain bridge {table} {chain} ({at}; observed by nf_tables trace): {end}"
        ));
        for e in evs {
            let Some(handle) = e.traced.rule() else {
                continue;
            };
            let text = names
                .rules
                .get(&(table.to_string(), chain.to_string(), handle))
                .map_or("(not in the ruleset read)", String::as_str);
            out.push(format!(
                "  bridge {table} {chain} handle {handle} {} => {} (observed)",
                super::bridgechains::without_counts(text),
                e.verdict_name()
            ));
        }
    }
    out
}

fn flooded_in_port_note(name: &str, index: u32) -> String {
    format!(
        "the bridge port this flooded copy's frame came in by: {name} (ifindex {index}), as nf_tables trace saw it at the bridge hooks"
    )
}

fn hook_name(h: &str) -> String {
    match h {
        "input" => "INPUT".into(),
        "output" => "OUTPUT".into(),
        other => other.to_uppercase(),
    }
}

/// What the trace showed, for the summary.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct TraceCounts {
    /// Reports whose bridge-family chains were observed.
    pub observed: u64,
    /// Of those, frames a bridge-family rule or policy dropped.
    pub dropped: u64,
    /// Bridged reports no trace event matched (simulated instead).
    pub unmatched: u64,
    /// Times the trace socket's queue overflowed (events lost).
    pub overruns: u64,
}

/// The live side: the trace table (and its socket), the groups waiting for their report,
/// the rules' names.
pub struct BridgeTrace {
    table: TraceTable,
    grouper: Grouper,
    names: Names,
    pub counts: TraceCounts,
}

impl BridgeTrace {
    /// Creates the trace table in the calling thread's namespace, named after this process.
    pub fn open(live: &observer_rules::LiveNode) -> anyhow::Result<Self> {
        let name = format!("observer-trace-{}", std::process::id());
        let hooks: Vec<u32> = observer_nfstats::nftrace::BRIDGE_HOOKS
            .iter()
            .map(|h| h.0)
            .collect();
        let table = TraceTable::create(&name, &hooks, PRIORITY).map_err(|e| {
            anyhow::anyhow!(
                "--trace-bridge-chains: creating the trace table `bridge {name}`: {e} (it needs \
                 CAP_NET_ADMIN and a kernel with nf_tables' bridge family, CONFIG_NF_TABLES_BRIDGE; \
                 without the flag the bridge chains are simulated instead)"
            )
        })?;
        log::info!(
            "--trace-bridge-chains: table `bridge {name}` sets nftrace on bridged IP frames; the \
             kernel removes it when observer exits"
        );
        Ok(Self {
            grouper: Grouper::new(&name),
            table,
            names: Names::of(live.ruleset.nft.as_ref()),
            counts: TraceCounts::default(),
        })
    }

    pub fn table_name(&self) -> &str {
        &self.table.name
    }

    /// The rules' names from the node as read again.
    pub fn names_from(&mut self, live: &observer_rules::LiveNode) {
        self.names = Names::of(live.ruleset.nft.as_ref());
    }

    /// Reads every trace event waiting.
    pub fn drain(&mut self) {
        let now = crate::kernel::upkeep::now_ns();
        let grouper = &mut self.grouper;
        if let Err(e) = self.table.drain(|e, _| grouper.add(e, now)) {
            log::warn!("--trace-bridge-chains: reading trace events: {e}");
        }
        self.counts.overruns = self.table.overruns();
    }

    /// The observed notes for a bridged report whose traversal began at `since` (ns), and
    /// whether a bridge-family rule dropped it; `None` when no traced frame matches.
    pub fn annotate(&mut self, t: &Traversal, since: u64) -> Option<(Vec<String>, bool)> {
        self.drain();
        let port = |p: Option<&String>| p.and_then(|n| crate::kernel::netns::ifindex(n));
        let ports = t.bridge.as_ref().map_or((None, None), |b| {
            (port(b.physdev_in.as_ref()), port(b.physdev_out.as_ref()))
        });
        let flooded = t.bridge.as_ref().is_some_and(|b| b.flooded);
        let Some(g) = self.grouper.take(&flows_of(t), since, ports, flooded) else {
            self.counts.unmatched += 1;
            return None;
        };
        let dropped = g.dropped();
        self.counts.observed += 1;
        self.counts.dropped += u64::from(dropped);
        let mut out = notes(&g, &self.names);
        // A flooded copy's in port: the probes cannot read it (br_netfilter keeps it in the
        // skb's extensions), the trace's first bridge hook names it.
        if let (Some(b), Some(port)) = (&t.bridge, g.in_port)
            && b.physdev_in.is_none()
            && b.flooded
        {
            out.insert(
                0,
                flooded_in_port_note(&crate::kernel::netns::ifname(port), port),
            );
        }
        Some((out, dropped))
    }
}

/// The notes of a bridged report on the bridge-family chains: observed where `trace` has
/// the frame's events; else said so, and simulated where `sim` is given (tail without
/// `--no-rules`, the agent). `None` for a report that crossed no bridge, or with nothing
/// to say.
pub fn bridged_notes(
    trace: Option<&mut BridgeTrace>,
    sim: Option<&mut Option<crate::kernel::bridgechains::BridgeChains>>,
    t: &Traversal,
    frame: (u64, u64),
) -> Option<Vec<String>> {
    t.bridge.as_ref()?;
    let mut out = Vec::new();
    if let Some(trace) = trace {
        if let Some((notes, _dropped)) = trace.annotate(t, frame.0) {
            return Some(notes);
        }
        out.push(
            "bridge-family chains: no nf_tables trace event matched this frame (not an IP \
             frame the trace table marks, or its events were lost)"
                .to_string(),
        );
    }
    if let Some(sim) = sim
        && let Some(notes) = sim
            .get_or_insert_with(crate::kernel::bridgechains::BridgeChains::read)
            .annotate(t, frame)
    {
        out.extend(notes);
    }
    (!out.is_empty()).then_some(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use observer_nfstats::nft::Chain;
    use observer_nfstats::nftrace::parse;

    fn hex(s: &str) -> Vec<u8> {
        (0..s.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
            .collect()
    }

    /// Captured on kernel 6.18 in the bridge lab (`--bridge-chains`): udp 10.244.0.5 ->
    /// 10.244.0.6:7003 dropped by `bridge obs-l2 forward` rule handle 5.
    const DROP: &str = "0700000008000f0000000007080004000000000308000600dee16b050c000200666f7277617264000b0001006f62732d6c3200000c00030000000000000000050c000500080001000000000008000a000000000506000b000001000008000c000000000606000d0000010000180008004500001fa20b4000401182d00af400050af400060f00090084321b5b000b160f68690a001200070062faedae88dee60107ac70250800000008001500000000080500130000000000080012009f28a8c60800140000000100";

    const TRACE: u16 = (10 << 8) | 17;

    fn ev(table: &str, chain: &str, traced: Traced) -> TraceEvent {
        TraceEvent {
            id: 7,
            chain: Chain {
                nfproto: NFPROTO_BRIDGE,
                table: table.into(),
                name: chain.into(),
            },
            traced,
            iif: None,
            oif: None,
            flow: None,
        }
    }

    fn rule(handle: Option<u64>, verdict: Option<Verdict>) -> Traced {
        Traced::Rule { handle, verdict }
    }

    #[test]
    fn a_drop_event_from_the_kernel_parses_with_its_rule_and_headers() {
        let e = parse(TRACE, &hex(DROP)).expect("a trace event");
        assert_eq!(
            (
                e.chain.nfproto,
                e.chain.table.as_str(),
                e.chain.name.as_str()
            ),
            (7, "obs-l2", "forward")
        );
        assert_eq!(e.traced, rule(Some(5), Some(Verdict::Drop)));
        assert!(e.drops());
        assert_eq!(e.verdict_name(), "drop");
        assert_eq!((e.iif, e.oif), (Some(5), Some(6)));
        let f = e.flow.unwrap();
        assert_eq!(
            key_of(&f),
            (
                17,
                "10.244.0.5".parse().unwrap(),
                "10.244.0.6".parse().unwrap(),
                Some(33842),
                Some(7003)
            )
        );
        assert_eq!(f.ip_id, Some(0xa20b));
        // Any other message is not a trace event.
        assert_eq!(parse((10 << 8) | 6, &hex(DROP)), None);
    }

    #[test]
    fn events_group_per_frame_without_the_trace_tables_own() {
        let mut g = Grouper::new("observer-trace-1");
        let drop = TraceEvent {
            id: 7,
            ..parse(TRACE, &hex(DROP)).unwrap()
        };
        let mut first = drop.clone();
        first.chain.table = "observer-trace-1".into();
        first.chain.name = "prerouting".into();
        first.traced = rule(Some(2), Some(Verdict::Continue));
        g.add(first.clone(), 100);
        g.add(
            ev("obs-l2", "prerouting", rule(None, Some(Verdict::Continue))),
            100,
        );
        g.add(
            ev(
                "obs-l2",
                "prerouting",
                Traced::Policy(Some(Verdict::Accept)),
            ),
            100,
        );
        g.add(drop, 100);
        // An IP-family event of the same frame is not the bridge's.
        g.add(
            TraceEvent {
                chain: Chain {
                    nfproto: 2,
                    ..ev("filter", "FORWARD", rule(Some(7), Some(Verdict::Continue))).chain
                },
                ..ev("filter", "FORWARD", rule(Some(7), Some(Verdict::Continue)))
            },
            100,
        );
        // The same id entering prerouting again: a new frame (the skb was reused).
        let mut second = first.clone();
        second.flow.as_mut().unwrap().dst = "10.244.0.7".parse().unwrap();
        g.add(second, 200);
        assert_eq!(g.groups.len(), 2);
        let a = &g.groups[0];
        assert_eq!(a.events.len(), 2, "{a:?}");
        assert!(a.dropped());
        assert_eq!(a.own_hooks, ["prerouting"]);
        // Taken by headers, once, and only by a traversal that began before it was read.
        let k = key_of(&a.flows[0]);
        assert!(
            g.take(&[k], 150, (None, None), false).is_none(),
            "read before the traversal began"
        );
        assert!(
            g.take(&[k], 50, (None, Some(5)), false).is_none(),
            "a copy that left by another port"
        );
        assert!(
            g.take(&[k], 50, (None, Some(6)), true).is_none(),
            "a flooded copy's group begins at forward"
        );
        let taken = g
            .take(&[k], 50, (Some(5), Some(6)), false)
            .expect("matches");
        assert_eq!(
            (taken.in_port, taken.out_port),
            (Some(5), Some(6)),
            "the iif and oif of its first bridge hooks"
        );
        assert_eq!(taken.events[1].traced.rule(), Some(5));
        assert!(
            g.take(&[k], 50, (None, None), false).is_none(),
            "taken once"
        );
        // A flooded copy: a clone first met at forward, out by its own port.
        let copy = TraceEvent {
            id: 8,
            chain: Chain {
                name: "forward".into(),
                ..first.chain.clone()
            },
            oif: Some(9),
            ..first.clone()
        };
        g.add(copy, 300);
        let c = g
            .take(&[k], 50, (None, Some(9)), true)
            .expect("the copy's group");
        assert_eq!((c.id, c.in_port, c.out_port), (8, Some(5), Some(9)));
        // Output after prerouting is the same frame (br_netfilter sending through the
        // bridge device); output twice is not.
        assert!(!starts_new_frame(&["prerouting".into()], "output"));
        assert!(starts_new_frame(&["output".into()], "output"));
        assert!(starts_new_frame(&["forward".into()], "forward"));
        assert!(!starts_new_frame(&["prerouting".into()], "forward"));
    }

    #[test]
    fn notes_name_each_chain_and_rule_and_say_observed() {
        let mut names = Names::default();
        names.chains.insert(
            ("obs-l2".into(), "forward".into()),
            ("forward".into(), -200),
        );
        names.chains.insert(
            ("obs-l2".into(), "prerouting".into()),
            ("prerouting".into(), -300),
        );
        names.rules.insert(
            ("obs-l2".into(), "forward".into(), 5),
            "udp dport 7003 counter packets 1 bytes 31 drop".into(),
        );
        let g = Group {
            events: vec![
                ev(
                    "obs-l2",
                    "prerouting",
                    Traced::Policy(Some(Verdict::Accept)),
                ),
                ev("obs-l2", "forward", rule(Some(5), Some(Verdict::Drop))),
            ],
            ..Group::default()
        };
        assert_eq!(
            notes(&g, &names),
            [
                "bridge-family chain bridge obs-l2 prerouting (PREROUTING -300; observed by nf_tables trace): accept (policy)",
                "bridge-family chain bridge obs-l2 forward (FORWARD -200; observed by nf_tables trace): drop by rule handle 5",
                "  bridge obs-l2 forward handle 5 udp dport 7003 counter drop => drop (observed)",
            ]
        );
    }
}
