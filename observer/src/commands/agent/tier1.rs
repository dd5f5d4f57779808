//! Tier 1 in the agent (issue 20): what the one `kfree_skb` tracepoint program records
//! while no other probe is attached. Drops counted in the kernel by (location, reason,
//! family, protocol), filtered there by namespace and reason; rate-limited samples of
//! dropped packets (headers, mark, conntrack state and status, interface), each named:
//! a `NETFILTER_DROP` sample names its rule by simulating it against the live ruleset
//! (`observer-rules`), confirmed only when that rule's own counter advanced across the
//! drop (tier 0's read before it, a read after it). Everything here is decoded from bytes
//! and unit-tested; [`Naming`] is the only part that reads the node.

use std::collections::{BTreeMap, HashMap};
use std::net::IpAddr;
use std::sync::mpsc::{Receiver, SyncSender, TrySendError};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use log::warn;
use observer_common::counts::{DropKey, DropSample, SAMPLE_BYTES, SAMPLE_CT, SAMPLE_HEADER};
use observer_rules::{CtState, PacketSpec, Simulator, StageInput, Verdict};
use serde::Serialize;

use observer_model::Hook;

use super::metrics::{Kind, Labels, Snapshot};

/// Samples waiting to be named; past this they are counted as lost.
const QUEUE: usize = 64;
/// The namer reads the ruleset and the counters at most this often.
const BATCH_EVERY: Duration = Duration::from_secs(1);
/// The namer forgets the compiled ruleset after this long without samples...
const SIM_IDLE: Duration = Duration::from_secs(60);
/// ...and reads it again when it is older than this (a changed ruleset read late can only
/// make a naming unconfirmed: the counters must agree).
const SIM_MAX_AGE: Duration = Duration::from_secs(10);
/// Distinct drop locations named (their function looked up in `/proc/kallsyms`).
const LOCATIONS: usize = 4096;

/// A sample, decoded.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Sample {
    pub ts_ns: u64,
    pub reason: String,
    pub location: String,
    #[serde(skip)]
    pub location_addr: u64,
    pub family: u8,
    pub protocol: u8,
    pub src: Option<IpAddr>,
    pub dst: Option<IpAddr>,
    pub sport: Option<u16>,
    pub dport: Option<u16>,
    pub mark: u32,
    pub len: u32,
    pub interface: Option<String>,
    #[serde(skip)]
    pub ifindex: u32,
    /// `enum ip_conntrack_info`, status bits and mark of its connection, if it had one.
    pub ct: Option<Ct>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct Ct {
    pub info: u8,
    pub status: u32,
    pub mark: u32,
}

/// Decodes a sample as the kernel wrote it; `reason` and `location` name the numbers.
pub fn decode(
    bytes: &[u8],
    reason: &dyn Fn(u32) -> String,
    location: &mut dyn FnMut(u64) -> String,
    ifname: &dyn Fn(u32) -> String,
) -> Option<Sample> {
    if bytes.len() < size_of::<DropSample>() {
        return None;
    }
    // SAFETY: DropSample is plain data of this size; read unaligned from the ring's bytes.
    let s: DropSample = unsafe { std::ptr::read_unaligned(bytes.as_ptr().cast()) };
    let mut out = Sample {
        ts_ns: s.ts_ns,
        reason: reason(s.reason),
        location: location(s.location),
        location_addr: s.location,
        family: s.family,
        protocol: s.protocol,
        src: None,
        dst: None,
        sport: None,
        dport: None,
        mark: s.mark,
        len: s.len,
        interface: (s.ifindex != 0).then(|| ifname(s.ifindex)),
        ifindex: s.ifindex,
        ct: (s.flags & SAMPLE_CT != 0).then_some(Ct {
            info: s.ctinfo,
            status: s.ct_status,
            mark: s.ct_mark,
        }),
    };
    if s.flags & SAMPLE_HEADER != 0 {
        headers(&s.header, &mut out);
    }
    Some(out)
}

/// Addresses and ports from the network header (IPv6: ports only right after the fixed
/// header; a fragment past the first has none).
fn headers(h: &[u8; SAMPLE_BYTES], out: &mut Sample) {
    let l4 = match h[0] >> 4 {
        4 => {
            let a = |i: usize| IpAddr::from([h[i], h[i + 1], h[i + 2], h[i + 3]]);
            out.src = Some(a(12));
            out.dst = Some(a(16));
            let frag_off = u16::from_be_bytes([h[6], h[7]]) & 0x1fff;
            let ihl = usize::from(h[0] & 0xf) * 4;
            (frag_off == 0 && ihl >= 20).then_some(ihl)
        }
        6 => {
            let a = |i: usize| {
                let mut b = [0u8; 16];
                b.copy_from_slice(&h[i..i + 16]);
                IpAddr::from(b)
            };
            out.src = Some(a(8));
            out.dst = Some(a(24));
            Some(40)
        }
        _ => None,
    };
    if let Some(o) = l4
        && matches!(out.protocol, 6 | 17 | 132 | 136)
        && o + 4 <= SAMPLE_BYTES
    {
        out.sport = Some(u16::from_be_bytes([h[o], h[o + 1]]));
        out.dport = Some(u16::from_be_bytes([h[o + 2], h[o + 3]]));
    }
}

/// `function+0xoff` of kernel addresses, looked up in `/proc/kallsyms` once per new address
/// (the table itself is not kept: it is tens of megabytes), at most [`LOCATIONS`] kept.
#[derive(Default)]
pub struct Locations {
    names: HashMap<u64, String>,
}

impl Locations {
    pub fn name(&mut self, addr: u64) -> String {
        if let Some(n) = self.names.get(&addr) {
            return n.clone();
        }
        let n = crate::kernel::kallsyms::lookup(addr).unwrap_or_else(|| format!("{addr:#x}"));
        if self.names.len() < LOCATIONS {
            self.names.insert(addr, n.clone());
        }
        n
    }
}

/// Tier 1's series: drops by key, and its own counters (`tier="1"` on each).
pub fn series(
    keys: &BTreeMap<DropKey, u64>,
    stats: &[u64],
    reason: &dyn Fn(u32) -> String,
    location: &mut dyn FnMut(u64) -> String,
    naming: &NamingCounts,
) -> Vec<Snapshot> {
    let tier = || -> Labels { vec![("tier", "1".into())] };
    let mut out = vec![Snapshot {
        name: "observer_kernel_drops_total",
        help: "Packets of the observed namespace the kernel dropped, counted by the kfree_skb \
               program alone (tier 1): by the kernel's reason, the function that dropped \
               them, family and IP protocol.",
        kind: Kind::Counter,
        series: keys
            .iter()
            .map(|(k, n)| {
                let family = match k.family {
                    4 => "ipv4",
                    6 => "ipv6",
                    _ => "other",
                };
                let mut l = tier();
                l.extend([
                    ("family", family.to_string()),
                    ("reason", reason(k.reason)),
                    ("location", location(k.location)),
                    ("protocol", protocol_name(k.protocol)),
                ]);
                (l, *n)
            })
            .collect(),
    }];
    let stat = |i: u32| stats.get(i as usize).copied().unwrap_or(0);
    use observer_common::counts::drop_stats as s;
    for (name, help, v) in [
        (
            "observer_kernel_drop_keys_full_total",
            "Drops not counted by key: the kernel's key map was full (they are in no \
             observer_kernel_drops_total series).",
            stat(s::KEYS_FULL),
        ),
        (
            "observer_drop_samples_total",
            "Samples of dropped packets written by the kernel (tier 1).",
            stat(s::SAMPLES),
        ),
        (
            "observer_drop_samples_rate_limited_total",
            "Dropped packets not sampled: the per-CPU rate limit (--drop-sample-gap) left \
             them out.",
            stat(s::SAMPLES_LIMITED),
        ),
        (
            "observer_drop_samples_lost_total",
            "Samples of dropped packets lost: the kernel's sample ring or the naming queue \
             was full.",
            stat(s::SAMPLES_LOST) + naming.lost,
        ),
        (
            "observer_kernel_drops_ignored_total",
            "Drops left out in the kernel by --drop-reasons-ignored.",
            stat(s::REASON_FILTERED),
        ),
    ] {
        out.push(Snapshot::labelled(name, Kind::Counter, help, tier(), v));
    }
    out.push(Snapshot {
        name: "observer_drop_sample_rules_total",
        help: "NETFILTER_DROP samples by how their rule was named: confirmed (the simulated \
               rule's counter advanced across the drop), unconfirmed (it did not, or the \
               counters could not say), undecidable (the simulation could not name one rule).",
        kind: Kind::Counter,
        series: [
            ("confirmed", naming.confirmed),
            ("unconfirmed", naming.unconfirmed),
            ("undecidable", naming.undecidable),
        ]
        .into_iter()
        .map(|(k, v)| {
            let mut l = tier();
            l.push(("naming", k.into()));
            (l, v)
        })
        .collect(),
    });
    out
}

fn protocol_name(p: u8) -> String {
    match p {
        1 => "icmp".into(),
        6 => "tcp".into(),
        17 => "udp".into(),
        58 => "icmpv6".into(),
        132 => "sctp".into(),
        p => p.to_string(),
    }
}

/// How NETFILTER_DROP samples were named, since start.
#[derive(Clone, Copy, Debug, Default)]
pub struct NamingCounts {
    pub confirmed: u64,
    pub unconfirmed: u64,
    pub undecidable: u64,
    /// Samples the naming queue had no room for.
    pub lost: u64,
}

/// A rule, as tier 0 names it (`FORWARD#1`, `chain handle 7`).
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
pub struct RuleId {
    pub family: &'static str,
    pub table: String,
    pub chain: String,
    pub rule: String,
}

/// The rule a NETFILTER_DROP sample names, and how sure that is.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(tag = "naming", rename_all = "lowercase")]
pub enum RuleNaming {
    Confirmed { rule: RuleId },
    Unconfirmed { rule: Option<RuleId>, why: String },
    Undecidable { why: String },
}

/// Drop-rule counters as one read saw them, and when that read began and ended
/// (CLOCK_MONOTONIC, as the samples' times).
#[derive(Clone, Debug, Default)]
pub struct CounterRead {
    pub started_ns: u64,
    pub ended_ns: u64,
    pub packets: HashMap<RuleId, Option<u64>>,
}

/// The rule ids and counters of the dropping rules of a tier 0 read.
pub fn drop_counters(rules: &[observer_nfstats::Rule]) -> HashMap<RuleId, Option<u64>> {
    rules
        .iter()
        .filter(|r| {
            matches!(
                r.action,
                observer_nfstats::Action::Drop | observer_nfstats::Action::Reject
            )
        })
        .map(|r| {
            (
                RuleId {
                    family: r.family,
                    table: r.table.clone(),
                    chain: r.chain.clone(),
                    rule: r.name(),
                },
                r.count.map(|c| c.packets),
            )
        })
        .collect()
}

/// Names a sample's rule from the simulated candidates and the counters read before and
/// after the drop: confirmed only when exactly one candidate's counter advanced and the
/// read before ended before the drop (a read that raced the drop proves nothing).
pub fn confirm(
    sample_ns: u64,
    candidates: Result<Vec<RuleId>, String>,
    before: Option<&CounterRead>,
    after: &CounterRead,
) -> RuleNaming {
    let candidates = match candidates {
        Ok(c) if c.is_empty() => {
            return RuleNaming::Undecidable {
                why: "the simulation drops this packet with no rule of the live ruleset".into(),
            };
        }
        Ok(c) => c,
        Err(why) => return RuleNaming::Undecidable { why },
    };
    let Some(before) = before.filter(|b| b.ended_ns < sample_ns && after.started_ns > sample_ns)
    else {
        return RuleNaming::Unconfirmed {
            rule: candidates.first().cloned(),
            why: "no counter read before the drop to compare with".into(),
        };
    };
    let advanced: Vec<&RuleId> = candidates
        .iter()
        .filter(|r| {
            matches!(
                (before.packets.get(*r), after.packets.get(*r)),
                (Some(Some(b)), Some(Some(a))) if a > b
            )
        })
        .collect();
    match advanced.as_slice() {
        [one] => RuleNaming::Confirmed {
            rule: (*one).clone(),
        },
        [] => RuleNaming::Unconfirmed {
            rule: candidates.first().cloned(),
            why: if candidates
                .iter()
                .all(|r| matches!(after.packets.get(r), Some(None)))
            {
                "the rule has no counter".into()
            } else {
                "the rule's counter did not advance across the drop".into()
            },
        },
        _ => RuleNaming::Unconfirmed {
            rule: candidates.first().cloned(),
            why: format!("{} candidate rules' counters advanced", advanced.len()),
        },
    }
}

/// The dropping rules the simulator finds for a sample at each hook its packet could have
/// been dropped at (the tracepoint does not say which): `Err` when a rule on the way could
/// not be decided.
pub fn candidates(sim: &Simulator<'_>, s: &Sample) -> Result<Vec<RuleId>, String> {
    let (Some(src), Some(dst)) = (s.src, s.dst) else {
        return Err("the sample has no IP header".into());
    };
    // As tier 0 names families.
    let family = if src.is_ipv6() { "ipv6" } else { "ipv4" };
    let ct = s.ct.map(|c| c.info);
    let ct_state = match ct {
        None => CtState::New,
        Some(0) | Some(3) => CtState::Established,
        Some(1) | Some(4) => CtState::Related,
        Some(_) => CtState::New,
    };
    let status = s.ct.map_or(0, |c| c.status);
    let mut out = Vec::new();
    for hook in [
        Hook::PreRouting,
        Hook::LocalIn,
        Hook::Forward,
        Hook::LocalOut,
        Hook::PostRouting,
    ] {
        // skb->dev is the input device up to FORWARD, the output device after.
        let input = matches!(hook, Hook::PreRouting | Hook::LocalIn | Hook::Forward);
        let stage = StageInput {
            hook,
            window: (i32::MIN, i32::MAX),
            packet: PacketSpec {
                proto: s.protocol,
                src,
                dst,
                sport: s.sport,
                dport: s.dport,
                in_iface: if input { s.interface.clone() } else { None },
                out_iface: if input { None } else { s.interface.clone() },
                mark: s.mark,
                ct_state,
                ct_mark: s.ct.map(|c| c.mark),
                tcp_flags: Some(0),
                icmp: Some((0, 0)),
                local: false,
            },
            dnat_done: status & (1 << 5) != 0,
            snat_done: status & (1 << 4) != 0,
            // The tracepoint does not say which bridge port: decided from the node's facts.
            ports: observer_rules::SeenPorts::Unknown,
        };
        for b in sim.simulate_stage(&stage) {
            for st in &b.stages {
                if let Some(r) = st.rules.iter().find_map(|r| r.undecidable.as_ref()) {
                    return Err(format!("at {hook:?}: {r}"));
                }
                if st.verdict != Verdict::Drop {
                    continue;
                }
                let table = st.table.to_string();
                let id = match (st.rules.last(), &st.policy) {
                    (_, Some(chain)) => RuleId {
                        family,
                        table,
                        chain: chain.clone(),
                        rule: format!("{chain} policy"),
                    },
                    (Some(r), None) => RuleId {
                        family,
                        table,
                        chain: r.id.chain().to_string(),
                        // As tail names it: a native nftables rule by its handle.
                        rule: match &r.id {
                            observer_model::RuleId::Nft { chain, handle, .. } => {
                                format!("{chain} handle {handle}")
                            }
                            observer_model::RuleId::Iptables { chain, index, .. } => {
                                format!("{chain}#{index}")
                            }
                        },
                    },
                    (None, None) => continue,
                };
                if !out.contains(&id) {
                    out.push(id);
                }
            }
        }
    }
    Ok(out)
}

/// The rule a sample names, as the model says it (`fate.rule`).
fn dropping_rule(n: &RuleNaming) -> observer_model::DroppingRule {
    let (naming, rule, why) = match n {
        RuleNaming::Confirmed { rule } => ("confirmed", Some(rule), None),
        RuleNaming::Unconfirmed { rule, why } => ("unconfirmed", rule.as_ref(), Some(why)),
        RuleNaming::Undecidable { why } => ("undecidable", None, Some(why)),
    };
    observer_model::DroppingRule {
        naming,
        table: rule.map(|r| r.table.clone()),
        chain: rule.map(|r| r.chain.clone()),
        rule: rule.map(|r| r.rule.clone()),
        why: why.cloned(),
    }
}

/// Why a sample is incomplete, as its report says.
pub const SEEN_WHERE_IT_DIED: &str = "seen only where it was dropped: a drop sample of the \
     agent's default mode (tier 1, kfree_skb), which records no path through the tables";

/// A sample as a report (schema 3, like every traversal the agent serves): the packet as it
/// died, where and why, the rule named for it, and incomplete, since its path through the
/// tables was not recorded.
pub fn traversal(s: &Sample, rule: Option<&RuleNaming>) -> observer_model::Traversal {
    use observer_model::{
        Endpoint, Family, Fate, FateKind, Headers, Iface, Marks, Packet, Protocol, Source,
        Traversal,
    };
    let family = match (s.family, s.src) {
        (6, _) | (_, Some(IpAddr::V6(_))) => Family::Ipv6,
        _ => Family::Ipv4,
    };
    let proto = (s.src.is_some()).then(|| Protocol::from_number(s.protocol));
    let packet = match (s.src, s.dst, proto) {
        (Some(src), Some(dst), Some(proto)) => Some(Packet {
            family,
            proto,
            first: Headers {
                src: Endpoint::new(src, s.sport),
                dst: Endpoint::new(dst, s.dport),
                icmp: None,
            },
            last: None,
            ip_id: None,
        }),
        _ => None,
    };
    let mut fate = Fate::new(FateKind::Dropped);
    fate.reason = Some(s.reason.clone());
    fate.location = Some(s.location.clone());
    fate.rule = rule.map(dropping_rule);
    let mut notes = vec![format!(
        "packet mark {:#x}, {} bytes when dropped",
        s.mark, s.len
    )];
    if let Some(ct) = &s.ct {
        notes.push(format!(
            "its connection: ctinfo {}, status {:#x}, ctmark {:#x}",
            ct.info, ct.status, ct.mark
        ));
    }
    Traversal {
        schema: observer_model::SCHEMA,
        source: Source::Observed,
        netns: None,
        family: Some(family),
        proto,
        packet,
        ingress: s.interface.clone().map(|iface| Iface { iface }),
        egress: None,
        route: None,
        bridge: None,
        encap: None,
        stages: Vec::new(),
        fate,
        marks: Marks::default(),
        nat: Vec::new(),
        conntrack: None,
        names: Vec::new(),
        branches: Vec::new(),
        notes,
        lost: 0,
        incomplete: true,
        incomplete_reason: Some(SEEN_WHERE_IT_DIED.into()),
    }
}

/// Names NETFILTER_DROP samples on a thread of its own (the ruleset and counters are read
/// there, at most once per [`BATCH_EVERY`], only while samples come).
pub struct Naming {
    tx: SyncSender<Sample>,
    pub counts: Arc<Mutex<NamingCounts>>,
}

/// The counters' last reads (tier 0's and the namer's), newest last, shared with the
/// namer: a sample is compared with the newest read that ended before its drop.
pub type LastRead = Arc<Mutex<std::collections::VecDeque<CounterRead>>>;

/// Reads kept in [`LastRead`].
const READS_KEPT: usize = 4;

/// Adds a read to `last`, forgetting the oldest past [`READS_KEPT`].
pub fn remember(last: &LastRead, read: CounterRead) {
    let mut l = last.lock().unwrap_or_else(|e| e.into_inner());
    l.push_back(read);
    while l.len() > READS_KEPT {
        l.pop_front();
    }
}

impl Naming {
    /// `done` gets every named sample. Must be called in the observed namespace.
    pub fn spawn(
        last_read: LastRead,
        done: impl Fn(&Sample, &RuleNaming) + Send + 'static,
    ) -> std::io::Result<Self> {
        let (tx, rx) = std::sync::mpsc::sync_channel(QUEUE);
        let counts = Arc::new(Mutex::new(NamingCounts::default()));
        let c = counts.clone();
        std::thread::Builder::new()
            .name("dropnames".into())
            .spawn(move || name_loop(rx, last_read, c, done))?;
        Ok(Self { tx, counts })
    }

    /// Queues a NETFILTER_DROP sample; counted as lost when the queue is full.
    pub fn push(&self, s: Sample) {
        if let Err(TrySendError::Full(_) | TrySendError::Disconnected(_)) = self.tx.try_send(s) {
            self.counts.lock().unwrap_or_else(|e| e.into_inner()).lost += 1;
        }
    }
}

fn name_loop(
    rx: Receiver<Sample>,
    last_read: LastRead,
    counts: Arc<Mutex<NamingCounts>>,
    done: impl Fn(&Sample, &RuleNaming),
) {
    let mut reader: Option<observer_nfstats::RuleReader> = None;
    // The compiled ruleset, kept while drops keep coming (it is large: dropped after
    // SIM_IDLE without samples) and read again after SIM_MAX_AGE.
    let mut sim: Option<(Simulator<'static>, std::time::Instant)> = None;
    loop {
        let first = match rx.recv_timeout(SIM_IDLE) {
            Ok(s) => s,
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {
                sim = None;
                continue;
            }
            Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => return,
        };
        // Drops that come together are named together, after the batch's interval.
        std::thread::sleep(BATCH_EVERY);
        let mut batch = vec![first];
        batch.extend(rx.try_iter().take(QUEUE));
        let reads = last_read.lock().unwrap_or_else(|e| e.into_inner()).clone();
        if sim
            .as_ref()
            .is_none_or(|(_, at)| at.elapsed() > SIM_MAX_AGE)
        {
            // The old one goes before the new one is built (never two at once).
            drop(sim.take());
            // Only the tables that can drop, compiled off the event loop's thread, one copy
            // of them at a time (super::drop_rules).
            sim = Some((
                super::drop_rules::read().into_simulator(),
                std::time::Instant::now(),
            ));
        }
        let Some((sim_now, _)) = sim.as_ref() else {
            continue;
        };
        let named: Vec<Result<Vec<RuleId>, String>> =
            batch.iter().map(|s| candidates(sim_now, s)).collect();
        if reader.is_none() {
            reader = observer_nfstats::RuleReader::new()
                .map_err(|e| warn!("naming drop samples' rules: {e}"))
                .ok();
        }
        let started_ns = crate::kernel::upkeep::now_ns();
        let after = reader.as_mut().and_then(|r| {
            r.read()
                .map_err(|e| warn!("reading the rules' counters for drop samples: {e}"))
                .ok()
        });
        let after = CounterRead {
            started_ns,
            ended_ns: crate::kernel::upkeep::now_ns(),
            packets: after.as_deref().map(drop_counters).unwrap_or_default(),
        };
        for (s, c) in batch.iter().zip(named) {
            let before = reads.iter().rev().find(|r| r.ended_ns < s.ts_ns);
            let n = confirm(s.ts_ns, c, before, &after);
            {
                let mut k = counts.lock().unwrap_or_else(|e| e.into_inner());
                match n {
                    RuleNaming::Confirmed { .. } => k.confirmed += 1,
                    RuleNaming::Unconfirmed { .. } => k.unconfirmed += 1,
                    RuleNaming::Undecidable { .. } => k.undecidable += 1,
                }
            }
            done(s, &n);
        }
        // This read may be a later batch's "before".
        remember(&last_read, after);
    }
}

/// Tier 1 as the agent drives it: started once the drop program is loaded, polled on each
/// tick of the event loop.
pub struct Tier1 {
    ring: aya::maps::RingBuf<aya::maps::MapData>,
    locations: Locations,
    naming: Naming,
    reasons: HashMap<u32, String>,
    /// When the series were last read.
    rendered: Option<std::time::Instant>,
    /// Tier 2's input: drops by reason at the last read, and when it was.
    totals: Option<(std::time::Instant, HashMap<String, u64>)>,
    /// Flows sampled since the last read, by reason (at most tier2::MAX_FLOWS each).
    flows: HashMap<String, Vec<(IpAddr, IpAddr)>>,
    /// Each reason's rate over the last two reads, until tier 2 takes it.
    rates: Option<Vec<super::tier2::ReasonRate>>,
}

/// The series are read from the kernel at most this often (a per-CPU hash
/// map of up to 4,096 keys costs two syscalls a key).
const RENDER_EVERY: Duration = Duration::from_secs(1);

/// Samples read from the ring per poll at most (the ring is drained over later polls).
const SAMPLES_PER_POLL: usize = 256;

impl Tier1 {
    /// Turns tier 1 on in the kernel and starts the namer. Call in the observed namespace.
    pub fn start(
        probes: &mut crate::kernel::probes::Probes,
        gap: Option<Duration>,
        ignored: &[String],
        reasons: HashMap<u32, String>,
        hub: Arc<super::hub::Hub>,
        last_read: LastRead,
    ) -> anyhow::Result<Self> {
        let mut ids = Vec::new();
        for name in ignored {
            let Some((&id, _)) = reasons.iter().find(|(_, n)| *n == name) else {
                anyhow::bail!(
                    "--drop-reasons-ignored {name}: this kernel has no such drop reason \
                     (names are enum skb_drop_reason's without SKB_DROP_REASON_, e.g. \
                     NOT_SPECIFIED)"
                );
            };
            ids.push(id);
        }
        probes.enable_tier1(gap, &ids)?;
        let ring = probes.take_drop_samples()?;
        let naming = Naming::spawn(last_read, move |s, n| hold(&hub, s, Some(n)))?;
        Ok(Self {
            ring,
            locations: Locations::default(),
            naming,
            reasons,
            rendered: None,
            totals: None,
            flows: HashMap::new(),
            rates: None,
        })
    }

    /// Each drop reason's rate between tier 1's last two reads (once per read), with the
    /// flows sampled meanwhile: tier 2's `--arm-drop-rate`.
    pub fn take_rates(&mut self) -> Option<Vec<super::tier2::ReasonRate>> {
        self.rates.take()
    }

    /// Turns a read of the keyed counts into rates by reason, against the read before.
    fn rates_from(&mut self, keys: &BTreeMap<DropKey, u64>) {
        let mut totals: HashMap<String, u64> = HashMap::new();
        for (k, n) in keys {
            let name = self
                .reasons
                .get(&k.reason)
                .cloned()
                .unwrap_or_else(|| k.reason.to_string());
            *totals.entry(name).or_default() += n;
        }
        let now = std::time::Instant::now();
        let flows = std::mem::take(&mut self.flows);
        if let Some((at, before)) = &self.totals {
            let secs = now.duration_since(*at).as_secs_f64().max(1e-3);
            self.rates = Some(
                totals
                    .iter()
                    .map(|(reason, n)| super::tier2::ReasonRate {
                        reason: reason.clone(),
                        per_second: n.saturating_sub(before.get(reason).copied().unwrap_or(0))
                            as f64
                            / secs,
                        flows: flows.get(reason).cloned().unwrap_or_default(),
                    })
                    .collect(),
            );
        }
        self.totals = Some((now, totals));
    }

    /// Reads the samples that came, hands them on (NETFILTER_DROP ones to the namer), and
    /// reads the series.
    pub fn poll(
        &mut self,
        probes: &crate::kernel::probes::Probes,
        hub: &super::hub::Hub,
        metrics: &super::metrics::Metrics,
    ) {
        let mut taken = 0;
        while taken < SAMPLES_PER_POLL {
            let Some(item) = self.ring.next() else {
                break;
            };
            taken += 1;
            let reasons = &self.reasons;
            let reason = |r: u32| reasons.get(&r).cloned().unwrap_or_else(|| r.to_string());
            let locations = &mut self.locations;
            let Some(s) = decode(
                &item,
                &reason,
                &mut |a| locations.name(a),
                &crate::kernel::netns::ifname,
            ) else {
                continue;
            };
            drop(item);
            if let (Some(src), Some(dst)) = (s.src, s.dst) {
                let f = self.flows.entry(s.reason.clone()).or_default();
                if f.len() < super::tier2::MAX_FLOWS && !f.contains(&(src, dst)) {
                    f.push((src, dst));
                }
            }
            if s.reason == "NETFILTER_DROP" {
                self.naming.push(s);
            } else {
                hold(hub, &s, None);
            }
        }
        if self.rendered.is_some_and(|t| t.elapsed() < RENDER_EVERY) {
            return;
        }
        self.rendered = Some(std::time::Instant::now());
        let keys = match probes.drop_keyed() {
            Ok(k) => k,
            Err(e) => {
                warn!("reading tier 1's drop counts: {e:#}");
                return;
            }
        };
        self.rates_from(&keys);
        let stats = probes.drop_stats().unwrap_or_default();
        let naming = *self.naming.counts.lock().unwrap_or_else(|e| e.into_inner());
        let reasons = std::mem::take(&mut self.reasons);
        let reason = |r: u32| reasons.get(&r).cloned().unwrap_or_else(|| r.to_string());
        let locations = &mut self.locations;
        let series = series(&keys, &stats, &reason, &mut |a| locations.name(a), &naming);
        self.reasons = reasons;
        metrics.set_tier1(series);
    }
}

/// Puts a sample in the flight recorder, rendered in every output as a report.
fn hold(hub: &super::hub::Hub, s: &Sample, rule: Option<&RuleNaming>) {
    // SAFETY: TraversalRecord is plain integers; zero is a valid, empty record.
    let mut rec: observer_common::traversal::TraversalRecord = unsafe { std::mem::zeroed() };
    rec.family = if s.family == 6 {
        observer_common::family::IPV6
    } else {
        observer_common::family::IPV4
    };
    rec.end = observer_common::traversal::end::DROPPED;
    rec.incomplete = observer_common::traversal::missing::START;
    rec.location = s.location_addr;
    rec.ts_first = s.ts_ns;
    rec.ts_last = s.ts_ns;
    // One step with the packet as it died, so that a client's --filter applies to it.
    if let (Some(src), Some(dst)) = (s.src, s.dst) {
        let bytes = |a: IpAddr| match a {
            IpAddr::V4(a) => {
                let mut b = [0u8; 16];
                b[..4].copy_from_slice(&a.octets());
                b
            }
            IpAddr::V6(a) => a.octets(),
        };
        rec.nvisits = 1;
        rec.visits[0].ifindex_in = s.ifindex;
        rec.nsteps = 1;
        let st = &mut rec.steps[0];
        st.ip_version = if src.is_ipv6() { 6 } else { 4 };
        st.l4proto = s.protocol;
        st.saddr = bytes(src);
        st.daddr = bytes(dst);
        st.sport = s.sport.unwrap_or(0);
        st.dport = s.dport.unwrap_or(0);
        st.mark = s.mark;
        st.len = s.len;
        if s.sport.is_none() {
            st.flags |= observer_common::flags::NO_L4;
        }
    }
    hub.flight
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .push(super::hub::Held {
            rec,
            rendered: {
                let t = traversal(s, rule);
                let render = |o| bytes::Bytes::from(crate::pipeline::write(&t, o));
                super::hub::Rendered {
                    json: render(crate::pipeline::Output::Json),
                    tree: Some(render(crate::pipeline::Output::Tree)),
                    line: Some(render(crate::pipeline::Output::Line)),
                }
            },
        });
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample_bytes(f: impl FnOnce(&mut DropSample)) -> Vec<u8> {
        let mut s = DropSample::ZERO;
        f(&mut s);
        // SAFETY: plain data.
        unsafe {
            std::slice::from_raw_parts((&raw const s).cast::<u8>(), size_of::<DropSample>())
                .to_vec()
        }
    }

    #[test]
    fn a_sample_is_a_schema_3_report_in_every_output() {
        let s = Sample {
            ts_ns: 5,
            reason: "NETFILTER_DROP".into(),
            location: "nf_hook_slow+0x9e".into(),
            location_addr: 1,
            family: 4,
            protocol: 17,
            src: Some("198.51.100.10".parse().unwrap()),
            dst: Some("172.17.0.5".parse().unwrap()),
            sport: Some(40000),
            dport: Some(7777),
            mark: 0x4000,
            len: 38,
            interface: Some("eth0".into()),
            ifindex: 3,
            ct: None,
        };
        let rule = RuleNaming::Confirmed {
            rule: RuleId {
                family: "ipv4",
                table: "filter".into(),
                chain: "FORWARD".into(),
                rule: "FORWARD#2".into(),
            },
        };
        let t = traversal(&s, Some(&rule));
        let json: serde_json::Value =
            serde_json::from_slice(&crate::pipeline::write(&t, crate::pipeline::Output::Json))
                .unwrap();
        assert_eq!(json["schema"], observer_model::SCHEMA);
        assert_eq!(json["packet"]["dst"], "172.17.0.5");
        assert_eq!(json["packet"]["dport"], 7777);
        assert_eq!(json["ingress"]["iface"], "eth0");
        assert_eq!(json["incomplete"], true);
        assert_eq!(json["incomplete_reason"], SEEN_WHERE_IT_DIED);
        assert_eq!(json["fate"]["kind"], "dropped");
        assert_eq!(json["fate"]["rule"]["naming"], "confirmed");
        assert_eq!(json["fate"]["rule"]["rule"], "FORWARD#2");
        let tree =
            String::from_utf8(crate::pipeline::write(&t, crate::pipeline::Output::Tree)).unwrap();
        assert!(
            tree.starts_with("ipv4 udp 198.51.100.10:40000 -> 172.17.0.5:7777"),
            "{tree}"
        );
        assert!(
            tree.contains(
                "DROPPED, in nf_hook_slow+0x9e: NETFILTER_DROP, by rule filter FORWARD#2 \
                 (confirmed by its counter)"
            ),
            "{tree}"
        );
        let line =
            String::from_utf8(crate::pipeline::write(&t, crate::pipeline::Output::Line)).unwrap();
        assert!(line.contains("by rule filter FORWARD#2"), "{line}");
        assert_eq!(line.lines().count(), 1, "{line}");
        // Not named: said so, never a rule guessed.
        let t = traversal(
            &s,
            Some(&RuleNaming::Undecidable {
                why: "no ruleset read".into(),
            }),
        );
        let tree =
            String::from_utf8(crate::pipeline::write(&t, crate::pipeline::Output::Tree)).unwrap();
        assert!(tree.contains("rule not named: no ruleset read"), "{tree}");
    }

    #[test]
    fn decodes_an_ipv4_udp_sample() {
        let b = sample_bytes(|s| {
            s.ts_ns = 5;
            s.reason = 6;
            s.location = 0xffff_0010;
            s.family = 4;
            s.protocol = 17;
            s.mark = 0x4000;
            s.ifindex = 3;
            s.flags = SAMPLE_HEADER | SAMPLE_CT;
            s.ctinfo = 2;
            s.ct_status = 1 << 5;
            let h = [
                0x45, 0, 0, 38, 0, 0, 0x40, 0, 64, 17, 0, 0, 198, 51, 100, 10, 172, 17, 0, 5, 0x9c,
                0x40, 0x1e, 0x61,
            ];
            s.header[..h.len()].copy_from_slice(&h);
        });
        let s = decode(&b, &|r| format!("R{r}"), &mut |a| format!("{a:#x}"), &|i| {
            format!("if{i}")
        })
        .unwrap();
        assert_eq!(s.reason, "R6");
        assert_eq!(s.location, "0xffff0010");
        assert_eq!(s.src, Some("198.51.100.10".parse().unwrap()));
        assert_eq!(s.dst, Some("172.17.0.5".parse().unwrap()));
        assert_eq!((s.sport, s.dport), (Some(40000), Some(7777)));
        assert_eq!(s.interface.as_deref(), Some("if3"));
        assert_eq!(
            s.ct,
            Some(Ct {
                info: 2,
                status: 1 << 5,
                mark: 0
            })
        );
        assert!(
            decode(
                &b[..10],
                &|_| String::new(),
                &mut |_| String::new(),
                &|_| { String::new() }
            )
            .is_none()
        );
    }

    #[test]
    fn a_later_fragment_has_no_ports() {
        let b = sample_bytes(|s| {
            s.protocol = 17;
            s.flags = SAMPLE_HEADER;
            let h = [
                0x45, 0, 0, 38, 0, 0, 0x00, 0x10, 64, 17, 0, 0, 10, 0, 0, 1, 10, 0, 0, 2, 1, 2, 3,
                4,
            ];
            s.header[..h.len()].copy_from_slice(&h);
        });
        let s = decode(&b, &|_| String::new(), &mut |_| String::new(), &|_| {
            String::new()
        })
        .unwrap();
        assert_eq!(s.src, Some("10.0.0.1".parse().unwrap()));
        assert_eq!(s.dport, None);
    }

    fn id(rule: &str) -> RuleId {
        RuleId {
            family: "ip",
            table: "filter".into(),
            chain: "FORWARD".into(),
            rule: rule.into(),
        }
    }

    fn read(start: u64, end: u64, c: &[(&str, Option<u64>)]) -> CounterRead {
        CounterRead {
            started_ns: start,
            ended_ns: end,
            packets: c.iter().map(|(r, n)| (id(r), *n)).collect(),
        }
    }

    #[test]
    fn confirmed_only_when_the_one_rules_counter_advanced_across_the_drop() {
        let before = read(1, 2, &[("FORWARD#1", Some(3)), ("FORWARD#2", Some(0))]);
        let after = read(10, 11, &[("FORWARD#1", Some(4)), ("FORWARD#2", Some(0))]);
        let c = || Ok(vec![id("FORWARD#1")]);
        assert_eq!(
            confirm(5, c(), Some(&before), &after),
            RuleNaming::Confirmed {
                rule: id("FORWARD#1")
            }
        );
        // The simulation names a rule whose counter stood still: not confirmed.
        assert!(matches!(
            confirm(5, Ok(vec![id("FORWARD#2")]), Some(&before), &after),
            RuleNaming::Unconfirmed { rule: Some(r), .. } if r == id("FORWARD#2")
        ));
        // A read before that ended after the drop proves nothing.
        assert!(matches!(
            confirm(1, c(), Some(&before), &after),
            RuleNaming::Unconfirmed { .. }
        ));
        assert!(matches!(
            confirm(5, c(), None, &after),
            RuleNaming::Unconfirmed { .. }
        ));
        // Two candidates that both advanced: which one dropped it is not known.
        let after2 = read(10, 11, &[("FORWARD#1", Some(4)), ("FORWARD#2", Some(1))]);
        assert!(matches!(
            confirm(
                5,
                Ok(vec![id("FORWARD#1"), id("FORWARD#2")]),
                Some(&before),
                &after2
            ),
            RuleNaming::Unconfirmed { .. }
        ));
        assert!(matches!(
            confirm(5, Err("xt match".into()), Some(&before), &after),
            RuleNaming::Undecidable { .. }
        ));
        assert!(matches!(
            confirm(5, Ok(vec![]), Some(&before), &after),
            RuleNaming::Undecidable { .. }
        ));
        // A rule without a counter can never be confirmed.
        let nc = read(1, 2, &[("FORWARD#1", None)]);
        assert!(matches!(
            confirm(5, c(), Some(&nc), &read(10, 11, &[("FORWARD#1", None)])),
            RuleNaming::Unconfirmed { why, .. } if why.contains("no counter")
        ));
    }

    #[test]
    fn renders_keys_with_names() {
        let mut keys = BTreeMap::new();
        keys.insert(
            DropKey {
                location: 1,
                reason: 6,
                family: 4,
                protocol: 17,
                pad: 0,
            },
            7,
        );
        let m = super::super::metrics::Metrics::new("n1");
        m.set_tier1(series(
            &keys,
            &[0, 2, 0, 1, 0],
            &|_| "NETFILTER_DROP".into(),
            &mut |_| "nf_hook_slow+0x8c".into(),
            &NamingCounts::default(),
        ));
        let text = m.render();
        assert!(text.contains(
            "observer_kernel_drops_total{node=\"n1\",tier=\"1\",family=\"ipv4\",\
             reason=\"NETFILTER_DROP\",location=\"nf_hook_slow+0x8c\",protocol=\"udp\"} 7"
        ));
        assert!(
            text.contains("observer_drop_samples_rate_limited_total{node=\"n1\",tier=\"1\"} 2")
        );
    }
}
