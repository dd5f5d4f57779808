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
//! flow and dropped with the ruleset generation it was made under. The key is made of the
//! record's own integers (interfaces by index), so a warm lookup allocates nothing.

use std::cell::RefCell;
use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::Arc;

use observer_model::{self as model, Check, CheckResult, Rules, Snapshot, Verdict};
use observer_rules::{Branch, CtState, LiveNode, Simulator, StageInput};

use crate::decode::{Conntrack, Endpoint, Observation};
use crate::nf_link::NfHook;
use crate::render_cache::Fnv;

/// `IPS_SRC_NAT`, `IPS_DST_NAT`, `IPS_CONFIRMED` (`enum ip_conntrack_status`).
const IPS_SRC_NAT: u64 = 1 << 4;
const IPS_DST_NAT: u64 = 1 << 5;
const IPS_CONFIRMED: u64 = 1 << 3;

/// Entries kept; the cache starts over when full.
const ENTRIES: usize = 65536;

/// What the cache is keyed by: everything of the packet the rules may look at, where the
/// stage is, and what the kernel made of it.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
struct Key {
    hook: NfHook,
    window: (i32, i32),
    src: Endpoint,
    dst: Endpoint,
    has_ports: bool,
    proto: u8,
    mark: u32,
    /// (ctinfo, ct mark, status) of the entry the stage sees (or will see, before conntrack).
    ct: Option<(u32, u32, u64)>,
    ifindex: (u32, u32),
    tcp_flags: u8,
    icmp: Option<(u8, u8)>,
    /// The observed outcome: after-state (addresses, mark) and whether the packet went on.
    after: Option<(Option<Endpoint>, Option<Endpoint>, u32)>,
    went_on: bool,
}

/// The rules of one stage and how they compare with the kernel.
#[derive(Debug)]
pub struct Named {
    pub rules: Rules,
    /// None when no chain runs in the stage (nothing to simulate).
    pub check: Option<Arc<Check>>,
}

/// One stage to name, as the report builder sees it.
pub struct ObservedStage<'a> {
    pub hook: NfHook,
    /// Priorities of the probes before and after the stage.
    pub window: (i32, i32),
    pub before: &'a Observation,
    pub after: Option<&'a Observation>,
    /// The observed stage in the model's words (its snapshots and verdict).
    pub stage: &'a model::Stage,
    /// The connection entry the packet gets at conntrack, for stages before it.
    pub first_ct: Option<Conntrack>,
}

/// The live ruleset of one generation, compiled for simulation, with its cache.
pub struct RuleNamer {
    sim: Simulator<'static>,
    /// Bumped every time the ruleset is read again.
    pub generation: u64,
    cache: RefCell<HashMap<Key, Arc<Named>, Fnv>>,
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
            misses: std::cell::Cell::new(0),
        }
    }

    /// The rules of `s` and their check against the kernel; `ifname` names interfaces.
    pub fn name(&self, s: &ObservedStage, ifname: &dyn Fn(u32) -> String) -> Arc<Named> {
        let b = s.before;
        let ct = b.ct.or(s.first_ct);
        let went_on = s.stage.verdict == Verdict::Accept;
        let key = Key {
            hook: s.hook,
            window: s.window,
            src: b.src.unwrap_or(UNSPECIFIED),
            dst: b.dst.unwrap_or(UNSPECIFIED),
            has_ports: b.has_ports,
            proto: b.proto,
            mark: b.mark,
            ct: ct.map(|c| {
                (
                    c.info,
                    c.mark,
                    c.status & (IPS_SRC_NAT | IPS_DST_NAT | IPS_CONFIRMED),
                )
            }),
            ifindex: (b.ifindex_in, b.ifindex_out),
            tcp_flags: b.tcp_flags,
            icmp: b.icmp,
            after: s.after.map(|a| (a.src, a.dst, a.mark)),
            went_on,
        };
        if let Some(n) = self.cache.borrow().get(&key) {
            return n.clone();
        }
        self.misses.set(self.misses.get() + 1);
        let named = Arc::new(self.simulate(s, ct, ifname));
        let mut cache = self.cache.borrow_mut();
        if cache.len() >= ENTRIES {
            cache.clear();
        }
        cache.insert(key, named.clone());
        named
    }

    fn simulate(
        &self,
        s: &ObservedStage,
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
            proto: b.proto,
            src: src.addr,
            dst: dst.addr,
            sport: b.has_ports.then_some(src.port),
            dport: b.has_ports.then_some(dst.port),
            in_iface: iface(b.ifindex_in),
            out_iface: iface(b.ifindex_out),
            mark: b.mark,
            ct_state: match ct.map(|c| c.state()) {
                Some("established") => CtState::Established,
                Some("related") => CtState::Related,
                Some("untracked") => CtState::Untracked,
                // No entry at all (conntrack not loaded, or before it): a new packet.
                _ => CtState::New,
            },
            ct_mark: Some(ct.map_or(0, |c| c.mark)),
            dnat_done: ct.is_some_and(|c| c.status & IPS_DST_NAT != 0),
            snat_done: ct.is_some_and(|c| c.status & IPS_SRC_NAT != 0),
            tcp_flags: b.tcp_flags,
            icmp: b
                .icmp
                .unwrap_or(if src.addr.is_ipv6() { (128, 0) } else { (8, 0) }),
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
        Named {
            rules: p.rules,
            check: Some(Arc::new(check)),
        }
    }
}

const UNSPECIFIED: Endpoint = Endpoint {
    addr: IpAddr::V4(std::net::Ipv4Addr::UNSPECIFIED),
    port: 0,
};

fn undecidable(why: &str) -> Check {
    Check {
        result: CheckResult::Undecidable,
        disagreements: Vec::new(),
        reason: Some(why.into()),
    }
}

/// `a.b.c.d:port` / `[v6]:port` without the port.
fn address(endpoint: &str) -> &str {
    match endpoint.rsplit_once(':') {
        Some((a, _)) if !a.contains(':') || a.ends_with(']') => a,
        _ => endpoint,
    }
}

fn same_address(a: &str, b: &str) -> bool {
    address(a) == address(b)
}

/// The branch's chains as one predicted stage shaped like the observed one.
fn predicted(br: &Branch, observed: &model::Stage, confirmed: bool) -> model::Stage {
    let rules: Rules = br
        .stages
        .iter()
        .flat_map(|st| &st.rules)
        .map(observer_rules::explain::model_rule)
        .collect();
    let last = br.stages.last();
    let after = match (last, observed.after.as_ref()) {
        (Some(l), Some(o)) if confirmed => {
            // Addresses of a confirmed connection are conntrack's translation.
            Some(Arc::new(Snapshot::new(
                o.src.clone(),
                o.dst.clone(),
                l.after.mark,
                None,
                None,
            )))
        }
        (Some(l), o) => {
            // A NAT rule applied: the kernel keeps the port when it can, and picks another
            // when the rule asks for a random one (`fully-random`, `--random`) or the tuple
            // is taken. The address is the rules'; the port is the kernel's choice.
            let natted = br.stages.iter().any(|st| st.nat.is_some());
            let port_of_kernel = |p: &String, o: Option<&String>| match o {
                Some(o) if natted && same_address(p, o) => o.clone(),
                _ => p.clone(),
            };
            Some(Arc::new(Snapshot::new(
                port_of_kernel(&l.after.src, o.map(|o| &o.src)),
                port_of_kernel(&l.after.dst, o.map(|o| &o.dst)),
                l.after.mark,
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
        verdict: br.verdict,
        rules,
        policy: None,
        note: br.stages.iter().find_map(|st| st.note.clone()),
        check: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ports_are_told_from_addresses() {
        assert_eq!(address("169.254.1.1:35318"), "169.254.1.1");
        assert_eq!(address("[2001:db8::1]:80"), "[2001:db8::1]");
        assert_eq!(address("2001:db8::1"), "2001:db8::1");
        assert_eq!(address("10.0.0.1"), "10.0.0.1");
        assert!(same_address("169.254.1.1:35318", "169.254.1.1:24278"));
        assert!(!same_address("169.254.1.1:35318", "169.254.1.2:35318"));
    }
}
