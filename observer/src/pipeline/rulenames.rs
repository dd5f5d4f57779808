//! Rule naming for observed traversals: for each stage (the chains between two probes),
//! the rules that matched, found by simulating the live ruleset (`observer-rules`) on the
//! packet as the first probe saw it, and the prediction held against what the second probe
//! saw (`observer_model::compare_stage`).
//!
//! Random rules (`statistic`, `numgen`) give several outcomes: the one whose after-state the
//! kernel produced is the one the packet took, and its rules are named; when none is, the
//! most likely one is shown with the disagreement. For packets of confirmed connections the
//! addresses are conntrack's stored translation, not the rules' (nat chains are not walked),
//! so only marks and verdicts are held to the rules there.
//!
//! Cost: one simulation per distinct (stage, packet state, observed outcome), cached per
//! flow in two generations (a working set larger than the cache degrades gradually, it does
//! not thrash) and dropped with the ruleset generation it was made under; rule lists that
//! several flows name are kept once. The key is made of the
//! record's own integers (interfaces by index), so a warm lookup allocates nothing.

use std::cell::RefCell;
use std::collections::HashMap;
use std::sync::Arc;

use observer_model::{self as model, Check, CheckResult, Endpoint, Rules, Snapshot, Verdict};
use observer_rules::{
    Branch, CtState, LiveNode, PacketSpec, PhysOut, SeenPorts, Simulator, StageInput,
};

use crate::pipeline::decode::{Conntrack, Observation};
use crate::pipeline::keys::{Prehashed, Words, addr_words};
use observer_model::Hook as NfHook;

/// `IPS_SRC_NAT`, `IPS_DST_NAT`, `IPS_CONFIRMED` (`enum ip_conntrack_status`).
const IPS_SRC_NAT: u64 = 1 << 4;
const IPS_DST_NAT: u64 = 1 << 5;
const IPS_CONFIRMED: u64 = 1 << 3;
/// `IPS_SRC_NAT_DONE`, `IPS_DST_NAT_DONE`: the nat core has set up that manipulation for the
/// connection (`nf_nat_initialized`) and consults no nat rule for it again.
const IPS_SRC_NAT_DONE: u64 = 1 << 7;
const IPS_DST_NAT_DONE: u64 = 1 << 8;

/// Whether the iptables nat table of `hook` is no longer consulted for a connection whose
/// status is `status`: its manipulation was set up already, by an earlier packet of the
/// connection (two copies of one new frame, or packets racing before it is confirmed).
fn nat_initialized(hook: NfHook, status: u64) -> bool {
    match hook {
        NfHook::PreRouting | NfHook::LocalOut => status & IPS_DST_NAT_DONE != 0,
        NfHook::LocalIn | NfHook::PostRouting => status & IPS_SRC_NAT_DONE != 0,
        NfHook::Forward => false,
    }
}

/// Entries in each of the cache's two generations (about 200 bytes each; the rules
/// themselves are shared between entries that name the same ones).
const ENTRIES: usize = 65536;
/// Distinct rule lists kept for sharing.
const SHARED: usize = 16384;

type Map<V> = HashMap<Key, V, Prehashed>;

/// A bounded cache that does not thrash: when the current generation is full it becomes
/// the old one (the one before is dropped); an entry found in the old generation moves to
/// the current one. A working set up to [`ENTRIES`] stays warm, a larger one degrades
/// gradually instead of missing every time.
#[derive(Default)]
struct TwoGenerations {
    current: Map<Arc<Named>>,
    old: Map<Arc<Named>>,
}

impl TwoGenerations {
    fn get(&mut self, k: &Key) -> Option<Arc<Named>> {
        if let Some(v) = self.current.get(k) {
            return Some(v.clone());
        }
        let v = self.old.remove(k)?;
        self.insert(*k, v.clone());
        Some(v)
    }

    fn insert(&mut self, k: Key, v: Arc<Named>) {
        if self.current.len() >= ENTRIES {
            self.old = std::mem::take(&mut self.current);
        }
        self.current.insert(k, v);
    }
}

/// What the cache is keyed by: everything of the packet the rules may look at, where the
/// stage is, and what the kernel made of it, packed into words.
type Key = Words<16>;

/// The bridge ports of a packet at one stage, by interface index: what `physdev` looks
/// at (br_netfilter's record), as the report builder saw it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum StagePorts {
    /// Not known (`physdev` stays undecidable).
    #[default]
    Unknown,
    /// It did not enter through a bridge port.
    NoBridge,
    /// It entered through port `physin`; `physout` as br_netfilter has it at this stage.
    Port { physin: u32, physout: StageOut },
    /// A copy the bridge made flooding a frame (first seen at its FORWARD): bridged, the
    /// port it came in by not known.
    FloodedCopy { physout: StageOut },
}

/// [`StagePorts::Port`]'s out port at a stage.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StageOut {
    /// Not chosen yet (PREROUTING), or routed rather than bridged.
    None,
    Port(u32),
    /// Bridged, but the port it left by was not seen (it ended before leaving).
    Unseen,
}

impl StagePorts {
    /// One word for the cache key.
    fn word(self) -> u64 {
        const M: u64 = 0x3fff_ffff;
        match self {
            StagePorts::Unknown => 0,
            StagePorts::NoBridge => 1 << 62,
            StagePorts::Port { physin, physout } => {
                let (tag, out) = match physout {
                    StageOut::None => (0, 0),
                    StageOut::Port(o) => (1, u64::from(o)),
                    StageOut::Unseen => (2, 0),
                };
                2 << 62 | tag << 60 | (u64::from(physin) & M) << 30 | (out & M)
            }
            StagePorts::FloodedCopy { physout } => {
                let (tag, out) = match physout {
                    StageOut::None => (0, 0),
                    StageOut::Port(o) => (1, u64::from(o)),
                    StageOut::Unseen => (2, 0),
                };
                3 << 62 | tag << 60 | (out & M)
            }
        }
    }

    fn seen(self, ifname: &dyn Fn(u32) -> String) -> SeenPorts {
        let out = |physout| match physout {
            StageOut::None => PhysOut::None,
            StageOut::Port(o) => PhysOut::Port(ifname(o)),
            StageOut::Unseen => PhysOut::Unknown(
                "physdev: the bridge port it was to leave by was not seen (it ended before)".into(),
            ),
        };
        match self {
            StagePorts::Unknown => SeenPorts::Unknown,
            StagePorts::NoBridge => SeenPorts::NoBridge,
            StagePorts::Port { physin, physout } => SeenPorts::Port {
                physin: ifname(physin),
                physout: out(physout),
            },
            StagePorts::FloodedCopy { physout } => SeenPorts::FloodedCopy {
                physout: out(physout),
            },
        }
    }
}

fn key(
    hook: NfHook,
    window: (i32, i32),
    b: &Observation,
    ct: Option<Conntrack>,
    after: Option<&Observation>,
    went_on: bool,
    ports: StagePorts,
) -> Key {
    let (s0, s1, sp) = addr_words(b.src);
    let (d0, d1, dp) = addr_words(b.dst);
    let (as0, as1, asp) = addr_words(after.and_then(|a| a.src));
    let (ad0, ad1, adp) = addr_words(after.and_then(|a| a.dst));
    let (ic, icmp) = b
        .icmp
        .map_or((0, 0), |(t, c)| (1, u64::from(t) << 8 | u64::from(c)));
    let v6 = b.src.is_some_and(|e| e.addr.is_ipv6());
    let w0 = hook as u64
        | u64::from(b.proto) << 8
        | u64::from(b.has_ports) << 16
        | u64::from(b.tcp_flags) << 17
        | u64::from(went_on) << 25
        | ic << 26
        | icmp << 27
        | u64::from(after.is_some()) << 43
        | u64::from(ct.is_some()) << 44
        | u64::from(v6) << 45;
    let (info, ctmark, status) = ct.map_or((0, 0, 0), |c| {
        (
            c.info,
            c.mark,
            c.status
                & (IPS_SRC_NAT | IPS_DST_NAT | IPS_CONFIRMED | IPS_SRC_NAT_DONE | IPS_DST_NAT_DONE),
        )
    });
    Words::new([
        w0,
        u64::from(window.0 as u32) << 32 | u64::from(window.1 as u32),
        s0,
        s1,
        d0,
        d1,
        u64::from(sp) << 48 | u64::from(dp) << 32 | u64::from(b.mark),
        u64::from(info) << 32 | u64::from(ctmark),
        status << 32 | u64::from(b.ifindex_in),
        u64::from(b.ifindex_out) << 32 | u64::from(after.map_or(0, |a| a.mark)),
        as0,
        as1,
        ad0,
        ad1,
        u64::from(asp) << 16 | u64::from(adp),
        ports.word(),
    ])
}

/// The rules of one stage and how they compare with the kernel.
#[derive(Debug)]
pub struct Named {
    pub rules: Rules,
    /// None when no chain runs in the stage (nothing to simulate).
    pub check: Option<Arc<Check>>,
}

/// One stage to name, as the report builder sees it.
pub struct StageToName<'a> {
    pub hook: NfHook,
    /// Priorities of the probes before and after the stage.
    pub window: (i32, i32),
    pub before: &'a Observation,
    pub after: Option<&'a Observation>,
    /// The observed stage in the model's words (its snapshots and verdict).
    pub stage: &'a model::Stage,
    /// The connection entry the packet gets at conntrack, for stages before it.
    pub first_ct: Option<Conntrack>,
    /// The bridge ports of the packet at this stage.
    pub ports: StagePorts,
}

/// The live ruleset of one generation, compiled for simulation, with its cache.
pub struct RuleNamer {
    sim: Simulator<'static>,
    /// Bumped every time the ruleset is read again.
    pub generation: u64,
    cache: RefCell<TwoGenerations>,
    /// Rule lists by their JSON: the flows of a service name the same rules, kept once.
    shared: RefCell<HashMap<u64, Rules>>,
    /// Misses (simulations run) and hits, for the exit summary and the bench.
    pub misses: std::cell::Cell<u64>,
}

impl RuleNamer {
    pub fn new(node: &LiveNode, generation: u64) -> Self {
        Self::with_simulator(node.simulator(), generation)
    }

    pub fn with_simulator(sim: Simulator<'static>, generation: u64) -> Self {
        Self {
            sim,
            generation,
            cache: RefCell::default(),
            shared: RefCell::default(),
            misses: std::cell::Cell::new(0),
        }
    }

    /// The rules of `s` and their check against the kernel; `ifname` names interfaces.
    /// What IPVS did to a packet observed before its hook (`before`) and after it
    /// (`after`, OUTPUT's first point), named from the node's IPVS state as read with the
    /// ruleset: the virtual service its destination (or mark) reaches, and the real server
    /// its new destination is. None when no virtual service matches.
    pub fn ipvs_step(
        &self,
        proto: u8,
        before: &observer_model::Snapshot,
        after: &observer_model::Snapshot,
    ) -> Option<Arc<observer_model::IpvsStep>> {
        let svc =
            self.sim
                .ipvs
                .lookup(proto, before.dst.host.ip()?, before.dst.port, before.mark)?;
        let to = after.dst.host.ip();
        let rs = svc
            .real_servers
            .iter()
            .find(|r| Some(r.addr) == to && (r.port.is_none() || r.port == after.dst.port));
        // An unchanged destination: direct routing or a tunnel (the outer header is not
        // what the probes read).
        let rs = rs.or_else(|| {
            (after.dst == before.dst)
                .then(|| {
                    let mut c = svc
                        .real_servers
                        .iter()
                        .filter(|r| r.forward != observer_rules::ipvs::Forward::Masq);
                    let one = c.next();
                    one.filter(|_| c.next().is_none())
                })
                .flatten()
        });
        Some(Arc::new(observer_model::IpvsStep {
            service: svc.name(),
            scheduler: svc.scheduler.clone(),
            real_server: rs.map(observer_rules::ipvs::RealServer::endpoint),
            forward: rs.map(|r| r.forward.name().to_string()),
            weight: rs.map(|r| r.weight),
            chosen_by: if rs.is_some() { "observed" } else { "unknown" }.into(),
            candidates: u32::try_from(svc.candidates().count()).unwrap_or(u32::MAX),
        }))
    }

    /// Whether the node has IPVS virtual services.
    pub fn has_ipvs(&self) -> bool {
        !self.sim.ipvs.is_empty()
    }

    /// What IPVS did to a reply at FORWARD (`ip_vs_out_hook`): the real server it came from
    /// (`before`'s source) given back the virtual service's address (`after`'s source).
    /// None when the source did not change to a virtual service's.
    pub fn ipvs_reply_step(
        &self,
        proto: u8,
        before: &observer_model::Snapshot,
        after: &observer_model::Snapshot,
    ) -> Option<Arc<observer_model::IpvsStep>> {
        if before.src == after.src {
            return None;
        }
        let svc = self
            .sim
            .ipvs
            .lookup(proto, after.src.host.ip()?, after.src.port, 0)?;
        let from = before.src.host.ip();
        let rs = svc
            .real_servers
            .iter()
            .find(|r| Some(r.addr) == from && (r.port.is_none() || r.port == before.src.port))?;
        Some(Arc::new(observer_model::IpvsStep {
            service: svc.name(),
            scheduler: svc.scheduler.clone(),
            real_server: Some(rs.endpoint()),
            forward: Some(rs.forward.name().to_string()),
            weight: Some(rs.weight),
            chosen_by: "reply".into(),
            candidates: u32::try_from(svc.candidates().count()).unwrap_or(u32::MAX),
        }))
    }

    pub fn name(&self, s: &StageToName, ifname: &dyn Fn(u32) -> String) -> Arc<Named> {
        let b = s.before;
        let ct = b.ct.or(s.first_ct);
        let went_on = s.stage.verdict == Verdict::Accept;
        let key = key(s.hook, s.window, b, ct, s.after, went_on, s.ports);
        if let Some(n) = self.cache.borrow_mut().get(&key) {
            return n;
        }
        self.misses.set(self.misses.get() + 1);
        let mut named = self.simulate(s, ct, ifname);
        named.rules = self.share(named.rules);
        let named = Arc::new(named);
        self.cache.borrow_mut().insert(key, named.clone());
        named
    }

    /// The copy of `rules` already kept, if the same list was named before.
    fn share(&self, rules: Rules) -> Rules {
        if rules.is_empty() {
            return rules;
        }
        let text = rules.json();
        let mut h = std::hash::DefaultHasher::new();
        std::hash::Hash::hash(text, &mut h);
        let h = std::hash::Hasher::finish(&h);
        let mut shared = self.shared.borrow_mut();
        if let Some(kept) = shared.get(&h)
            && kept.json() == text
        {
            return kept.clone();
        }
        if shared.len() >= SHARED {
            shared.clear();
        }
        shared.insert(h, rules.clone());
        rules
    }

    fn simulate(
        &self,
        s: &StageToName,
        ct: Option<Conntrack>,
        ifname: &dyn Fn(u32) -> String,
    ) -> Named {
        let b = s.before;
        let (Some(src), Some(dst)) = (b.src, b.dst) else {
            return Named {
                rules: Rules::default(),
                check: Some(Arc::new(undecidable(
                    "the packet's headers could not be read here",
                ))),
            };
        };
        let iface = |i: u32| (i != 0).then(|| ifname(i));
        let input = StageInput {
            hook: s.hook,
            window: s.window,
            packet: PacketSpec {
                proto: b.proto,
                src: src.addr,
                dst: dst.addr,
                sport: b.has_ports.then_some(src.port),
                dport: b.has_ports.then_some(dst.port),
                in_iface: iface(b.ifindex_in),
                out_iface: iface(b.ifindex_out),
                mark: b.mark,
                // No entry at all (conntrack not loaded, or before it): a new packet. A new
                // connection whose manipulation at this hook was set up already walks no nat
                // rule (the window of an iptables nat stage holds that table alone): as for a
                // later packet, conntrack applies what is stored.
                ct_state: match ct {
                    None => CtState::New,
                    Some(c) if &*s.stage.table == "nat" && nat_initialized(s.hook, c.status) => {
                        CtState::Established
                    }
                    Some(c) => c.state(),
                },
                ct_mark: Some(ct.map_or(0, |c| c.mark)),
                tcp_flags: Some(b.tcp_flags),
                // None: echo request, as the simulator defaults it.
                icmp: b.icmp,
                local: false,
            },
            dnat_done: ct.is_some_and(|c| c.status & IPS_DST_NAT != 0),
            snat_done: ct.is_some_and(|c| c.status & IPS_SRC_NAT != 0),
            ports: s.ports.seen(ifname),
        };
        let branches = self.sim.simulate_stage(&input);
        if branches.iter().all(|br| br.stages.is_empty()) {
            return Named {
                rules: Rules::default(),
                check: None,
            };
        }
        let confirmed = ct.is_some_and(|c| c.status & IPS_CONFIRMED != 0);
        // The outcome the kernel produced, else the most likely one.
        let judged: Vec<(model::Stage, Check)> = branches
            .iter()
            .map(|br| {
                let p = predicted(br, s.stage, confirmed);
                let c = model::compare_stage(s.stage, &p);
                (p, c)
            })
            .collect();
        let pick = judged
            .iter()
            .position(|(_, c)| c.result == CheckResult::Agrees)
            .unwrap_or(0);
        let (p, check) = judged.into_iter().nth(pick).expect("one branch at least");
        let check = weigh_assumptions(check, &branches[pick].notes);
        Named {
            rules: p.rules,
            check: Some(Arc::new(check)),
        }
    }
}

fn undecidable(why: &str) -> Check {
    Check {
        result: CheckResult::Undecidable,
        disagreements: Vec::new(),
        reason: Some(why.into()),
    }
}

/// A prediction that rests on an assumption (`assumed ...` notes: a `recent` list, a
/// `hashlimit` rate, a MAC address) and differs from what the kernel did is undecidable, not
/// a disagreement: the kernel's state may simply not be the assumed one. Both are said.
fn weigh_assumptions(check: Check, notes: &[String]) -> Check {
    let assumed: Vec<&str> = notes
        .iter()
        .filter(|n| n.starts_with("assumed"))
        .map(String::as_str)
        .collect();
    if check.result != CheckResult::Disagrees || assumed.is_empty() {
        return check;
    }
    undecidable(&format!(
        "{}; but the rules were answered under an assumption the kernel's state may not share: {}",
        check.disagreements.join("; "),
        assumed.join("; ")
    ))
}

/// The branch's chains as one predicted stage shaped like the observed one.
fn predicted(br: &Branch, observed: &model::Stage, confirmed: bool) -> model::Stage {
    let rules: Rules = br
        .stages
        .iter()
        .flat_map(|st| st.rules.iter().cloned())
        .collect();
    let last = br.stages.last().and_then(|l| l.after.as_ref());
    let after = match (last, observed.after.as_ref()) {
        (Some(l), Some(o)) if confirmed => {
            // Addresses of a confirmed connection are conntrack's translation.
            Some(Arc::new(Snapshot::new(
                o.src.clone(),
                o.dst.clone(),
                l.mark,
                None,
                None,
            )))
        }
        (Some(l), o) => {
            // A NAT rule applied: the kernel keeps the port when it can, and picks another
            // when the rule asks for a random one (`fully-random`, `--random`) or the tuple
            // is taken. The address is the rules'; the port is the kernel's choice.
            let natted = !br.nat.is_empty();
            let port_of_kernel = |p: &Endpoint, o: Option<&Endpoint>| match o {
                Some(o) if natted && p.host == o.host => o.clone(),
                _ => p.clone(),
            };
            Some(Arc::new(Snapshot::new(
                port_of_kernel(&l.src, o.map(|o| &o.src)),
                port_of_kernel(&l.dst, o.map(|o| &o.dst)),
                l.mark,
                None,
                None,
            )))
        }
        (None, _) => None,
    };
    model::Stage {
        hook: observed.hook,
        table: observed.table.clone(),
        priority: observed.priority,
        chain: None,
        before: observed.before.clone(),
        after,
        ct: None,
        verdict: observer_rules::sim::verdict_of(br),
        rules,
        policy: None,
        note: br.stages.iter().find_map(|st| st.note.clone()),
        ipvs: br.stages.iter().find_map(|st| st.ipvs.clone()),
        check: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cache_keeps_a_working_set_larger_than_one_generation() {
        let mut c = TwoGenerations::default();
        let key = |i: u64| {
            let mut k = [0u64; 16];
            k[0] = i;
            Words::new(k)
        };
        let named = || {
            Arc::new(Named {
                rules: Rules::default(),
                check: None,
            })
        };
        let n = ENTRIES as u64;
        for i in 0..n {
            c.insert(key(i), named());
        }
        // A working set of one generation stays warm.
        assert!((0..n).all(|i| c.get(&key(i)).is_some()));
        // Half a generation more: the cycle still finds at least half of them (a cache
        // that started over when full would find none).
        for i in n..n + n / 2 {
            c.insert(key(i), named());
        }
        let found = (0..n).filter(|&i| c.get(&key(i)).is_some()).count() as u64;
        assert!(found >= n / 2, "{found} of {n}");
        // Two generations further on, the first keys are gone: memory is bounded.
        for i in 2 * n..4 * n {
            c.insert(key(i), named());
        }
        assert!(c.get(&key(0)).is_none());
        assert!(c.current.len() + c.old.len() <= 2 * ENTRIES);
    }

    #[test]
    fn a_disagreement_under_an_assumption_is_undecidable() {
        let disagrees = || Check {
            result: CheckResult::Disagrees,
            disagreements: vec!["rules predict accept, the kernel dropped the packet".into()],
            reason: None,
        };
        let note = "assumed at filter ufw-user-input#2: recent `DEFAULT`: no earlier packet of this source (fewer than 6 hits)".to_string();
        let c = weigh_assumptions(disagrees(), std::slice::from_ref(&note));
        assert_eq!(c.result, CheckResult::Undecidable);
        let why = c.reason.unwrap();
        assert!(why.starts_with("rules predict accept"), "{why}");
        assert!(why.contains("recent `DEFAULT`"), "{why}");
        // Without an assumption a disagreement stays one; an agreement stays one.
        assert_eq!(
            weigh_assumptions(disagrees(), &[]).result,
            CheckResult::Disagrees
        );
        let agrees = Check {
            result: CheckResult::Agrees,
            disagreements: Vec::new(),
            reason: None,
        };
        assert_eq!(
            weigh_assumptions(agrees, &[note]).result,
            CheckResult::Agrees
        );
    }
}
