//! Where the netfilter probes go: for each (family, hook), the tables the kernel runs there,
//! in priority order, and the probe points that bracket every one of them.
//!
//! A probe at priority `p` sees the packet as every hook function with a lower priority left
//! it, so the record just before and just after a table's priority shows what that table did.

use crate::kernel::nf_link::{NfFamily, NfHook};
use observer_common::NF_SLOTS;

/// Earliest and latest priorities a BPF netfilter link accepts (INT_MIN/INT_MAX are refused).
pub const FIRST: i32 = i32::MIN + 1;
pub const LAST: i32 = i32::MAX - 1;

/// A netfilter table (or other hook user) at a priority.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Table {
    /// `raw`, `conntrack`, `mangle`, `nat`, `filter`, `security`, or `prio:<n>`.
    pub name: std::sync::Arc<str>,
    pub priority: i32,
}

/// Standard tables of a hook, in the kernel's priority order (IPv4 and IPv6 alike): the
/// model's list.
pub fn standard_tables(hook: NfHook) -> Vec<Table> {
    hook.tables()
        .iter()
        .map(|&(name, priority)| Table {
            name: name.into(),
            priority,
        })
        .collect()
}

/// Probe layout of one (family, hook).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HookPlan {
    pub family: NfFamily,
    pub hook: NfHook,
    /// Tables in priority order.
    pub tables: Vec<Table>,
    /// Probe priorities, ascending; the index is the point's position, which is what the
    /// collector and reports use.
    pub points: Vec<i32>,
    /// The probe program attached at each point. The probes decide the filter by program:
    /// at PREROUTING and OUTPUT, program 0 is where a packet enters and program 2 is just
    /// after conntrack, whatever custom chains sit between.
    pub programs: Vec<usize>,
}

/// `ip/PREROUTING: tables [raw -300, ...]`: the plan's hook and its tables, for the
/// capture backends' debug lines.
impl std::fmt::Display for HookPlan {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}: tables [", self.family.name(), self.hook.name())?;
        for (i, t) in self.tables.iter().enumerate() {
            let sep = if i == 0 { "" } else { ", " };
            write!(f, "{sep}{} {}", t.name, t.priority)?;
        }
        f.write_str("]")
    }
}

impl HookPlan {
    /// The plan of one hook. `users`: the priorities of what the namespace runs there (its
    /// nf_tables base chains and legacy x_tables, see [`hook_users`]); a standard table is
    /// bracketed only when it is there (conntrack at PREROUTING and OUTPUT always: its hooks
    /// come with any user of conntrack), any other priority as `prio:<n>`. `None` (the
    /// ruleset could not be read): every standard table.
    ///
    /// A probe after each table; the last table's is the hook's last point (INT_MAX-1), and a
    /// hook without tables has only its first: probes with nothing between them would see
    /// the same packet twice.
    pub fn new(family: NfFamily, hook: NfHook, users: Option<&[i32]>) -> Self {
        let mut tables: Vec<Table> = standard_tables(hook)
            .into_iter()
            .filter(|t| users.is_none_or(|u| &*t.name == "conntrack" || u.contains(&t.priority)))
            .collect();
        for &p in users.unwrap_or_default() {
            if !tables.iter().any(|t| t.priority == p) && p > FIRST && p < LAST {
                tables.push(Table {
                    name: format!("prio:{p}").into(),
                    priority: p,
                });
            }
        }
        tables.sort_by_key(|t| t.priority);
        tables.dedup_by_key(|t| t.priority);
        let mut points = vec![FIRST];
        if let Some((_, rest)) = tables.split_last() {
            for t in rest {
                points.push(t.priority.saturating_add(1));
            }
            points.push(LAST);
        }
        points.sort_unstable();
        points.dedup();
        // A table at p+1 of another would share its probe: drop points that sit on a table.
        points.retain(|p| !tables.iter().any(|t| t.priority == *p));
        // Hooks where packets do not enter leave programs 0 and 2 out (see programs_for).
        let entry = matches!(hook, NfHook::PreRouting | NfHook::LocalOut);
        points.truncate(if entry { NF_SLOTS } else { NF_SLOTS - 2 });
        let programs = programs_for(hook, &points);
        Self {
            family,
            hook,
            tables,
            points,
            programs,
        }
    }

    /// Programs (bits) whose point follows a table that may rewrite the packet's addresses
    /// (nat, or a custom base chain, whose statements are unknown here): they read the
    /// headers again; the others take them from the record (observer-ebpf's nf probes).
    pub fn header_readers(&self) -> u64 {
        self.readers(|t| &*t.name == "nat" || t.name.starts_with("prio:"))
    }

    /// Of [`Self::header_readers`], the programs whose only rewriting table before them is
    /// nat: there the headers change only for a connection with NAT set up (conntrack's
    /// status says so), which lets the probes skip the read for the others.
    pub fn nat_only_readers(&self) -> u64 {
        self.header_readers() & !self.readers(|t| t.name.starts_with("prio:"))
    }

    /// Programs (bits) whose point follows a table `rewrites` picks since the point before.
    fn readers(&self, rewrites: impl Fn(&Table) -> bool) -> u64 {
        let mut mask = 0;
        for (i, &prio) in self.points.iter().enumerate().skip(1) {
            let lo = self.points[i - 1];
            if self
                .tables
                .iter()
                .any(|t| t.priority > lo && t.priority < prio && rewrites(t))
            {
                mask |= 1 << self.programs[i];
            }
        }
        mask
    }

    /// Programs (bits) whose point comes right after the nat table: where the always-on
    /// counters look at the NAT the kernel applied (observer_common::counts).
    pub fn after_nat(&self) -> u64 {
        let mut mask = 0;
        for i in 1..self.points.len() {
            if self.table_before(i).is_some_and(|t| &*t.name == "nat") {
                mask |= 1 << self.programs[i];
            }
        }
        mask
    }

    /// The table between point `i - 1` and point `i` (none before the first point).
    pub fn table_before(&self, i: usize) -> Option<&Table> {
        let (lo, hi) = (*self.points.get(i.checked_sub(1)?)?, *self.points.get(i)?);
        self.tables
            .iter()
            .find(|t| t.priority > lo && t.priority < hi)
    }

    /// The table between point `i` and point `i + 1` (none after the last point).
    pub fn table_after(&self, i: usize) -> Option<&Table> {
        self.table_before(i + 1)
    }

    /// Position of the point where program `program` is attached.
    pub fn point_of(&self, program: usize) -> Option<usize> {
        self.programs.iter().position(|&p| p == program)
    }

    /// Slots of the probes just before and just after `table`.
    pub fn bracket(&self, table: &Table) -> (Option<usize>, Option<usize>) {
        let before = self.points.iter().rposition(|&p| p < table.priority);
        let after = self.points.iter().position(|&p| p > table.priority);
        (before, after)
    }

    /// Priorities a probe at `slot` may move to if its own is taken (EBUSY): the free gap
    /// between the neighbouring tables, nearest first.
    pub fn fallbacks(&self, slot: usize) -> Vec<i32> {
        let p = self.points[slot];
        let lo = self
            .tables
            .iter()
            .rev()
            .find(|t| t.priority < p)
            .map_or(FIRST, |t| t.priority.saturating_add(1));
        let hi = self
            .tables
            .iter()
            .find(|t| t.priority > p)
            .map_or(LAST, |t| t.priority.saturating_sub(1));
        let mut out = Vec::new();
        for d in 1..=8 {
            if p.saturating_add(d) <= hi {
                out.push(p + d);
            }
            if p.saturating_sub(d) >= lo {
                out.push(p - d);
            }
        }
        out
    }
}

/// Program per point: identity, except that at PREROUTING and OUTPUT the first point after
/// conntrack (-200) gets program 2, which the probes use to decide the filter with the
/// connection's tuples (see observer-ebpf's `Decide`).
fn programs_for(hook: NfHook, points: &[i32]) -> Vec<usize> {
    if !matches!(hook, NfHook::PreRouting | NfHook::LocalOut) {
        // Programs 0 and 2 decide the filter, so they run only where packets enter: a probe
        // knows from its program alone whether it decides, before reading anything.
        return (0..NF_SLOTS)
            .filter(|p| *p != 0 && *p != 2)
            .take(points.len())
            .collect();
    }
    let mut programs: Vec<usize> = (0..points.len()).collect();
    if matches!(hook, NfHook::PreRouting | NfHook::LocalOut)
        && let Some(after_ct) = points.iter().position(|&p| p > -200)
        && after_ct != 2
        && points.len() > 2
    {
        programs.swap(after_ct, 2);
    }
    programs
}

/// `ip_vs_out_hook` on FORWARD (net/netfilter/ipvs/ip_vs_core.c): replies of masquerade
/// connections get the virtual service's address back as their source there; bracketed like
/// a table where the node has virtual services.
pub const IPVS_FORWARD: i32 = 100;

/// The whole plan: every family and hook, for the hook users found (`None`: unknown, every
/// standard table is bracketed).
pub fn full_plan(users: Option<&[(NfFamily, NfHook, i32)]>) -> Vec<HookPlan> {
    let mut out = Vec::new();
    for family in NfFamily::ALL {
        for hook in NfHook::ALL {
            let prios: Option<Vec<i32>> = users.map(|u| {
                u.iter()
                    .filter(|(f, h, _)| *f == family && *h == hook)
                    .map(|(_, _, p)| *p)
                    .collect()
            });
            out.push(HookPlan::new(family, hook, prios.as_deref()));
        }
    }
    out
}

/// The legacy x_tables loaded in a namespace (`/proc/net/ip_tables_names`,
/// `ip6_tables_names`): each runs at every hook its table has, at its standard priority.
pub fn legacy_users(family: NfFamily, names: &str) -> Vec<(NfFamily, NfHook, i32)> {
    let mut out = Vec::new();
    for name in names.split_whitespace() {
        for hook in NfHook::ALL {
            if let Some(t) = standard_tables(hook).iter().find(|t| &*t.name == name) {
                out.push((family, hook, t.priority));
            }
        }
    }
    out
}

/// Every base chain's (family, hook, priority) of an nftables ruleset (as the live reader
/// parsed it), native and iptables-nft tables alike. Families `inet` count for both.
pub fn base_chains(nft: &observer_rules::NftRuleset) -> Vec<(NfFamily, NfHook, i32)> {
    let mut out = Vec::new();
    for t in &nft.tables {
        let families: &[NfFamily] = match t.id.family.as_str() {
            "ip" => &[NfFamily::Ipv4],
            "ip6" => &[NfFamily::Ipv6],
            "inet" => &NfFamily::ALL,
            _ => continue,
        };
        for c in &t.chains {
            let (Some(hook), Some(prio)) =
                (c.hook.as_deref().and_then(NfHook::from_nft), c.priority)
            else {
                continue;
            };
            let Ok(prio) = i32::try_from(prio) else {
                continue;
            };
            for &f in families {
                out.push((f, hook, prio));
            }
        }
    }
    out.sort();
    out.dedup();
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prerouting_brackets_every_table() {
        let p = HookPlan::new(NfFamily::Ipv4, NfHook::PreRouting, None);
        // The last table's after is the hook's last point.
        assert_eq!(p.points, vec![FIRST, -299, -199, -149, LAST]);
        for t in &p.tables {
            let (b, a) = p.bracket(t);
            let (b, a) = (b.unwrap(), a.unwrap());
            assert!(
                p.points[b] < t.priority && p.points[a] > t.priority,
                "{t:?}"
            );
            assert_eq!(a, b + 1, "nothing between the two probes of {}", t.name);
        }
    }

    #[test]
    fn custom_priority_is_bracketed() {
        let p = HookPlan::new(NfFamily::Ipv4, NfHook::Forward, Some(&[-150, 0, 50, -5]));
        assert!(p.tables.iter().any(|t| &*t.name == "prio:-5"));
        let t = p.tables.iter().find(|t| t.priority == -5).unwrap();
        let (b, a) = p.bracket(t);
        assert_eq!(p.points[b.unwrap()], -149);
        assert_eq!(p.points[a.unwrap()], -4);
    }

    #[test]
    fn the_after_conntrack_point_is_always_program_2() {
        let p = HookPlan::new(NfFamily::Ipv4, NfHook::PreRouting, None);
        assert_eq!(p.programs, (0..p.points.len()).collect::<Vec<_>>());
        // A custom chain between raw and conntrack moves the point, not the program.
        let p = HookPlan::new(
            NfFamily::Ipv4,
            NfHook::PreRouting,
            Some(&[-300, -250, -280, -150, -100]),
        );
        let at = p.point_of(2).unwrap();
        assert_eq!(
            p.points[at], -199,
            "program 2 sits just after conntrack: {p:?}"
        );
        assert_eq!(p.point_of(0), Some(0), "program 0 stays at the entry");
        let mut sorted = p.programs.clone();
        sorted.sort_unstable();
        assert_eq!(
            sorted,
            (0..p.points.len()).collect::<Vec<_>>(),
            "each program once"
        );
        // Elsewhere, neither 0 nor 2: those decide the filter.
        let f = HookPlan::new(NfFamily::Ipv4, NfHook::Forward, Some(&[-150, 0, 50, -250]));
        assert_eq!(f.points, vec![FIRST, -249, -149, 1, LAST]);
        assert_eq!(f.programs, vec![1, 3, 4, 5, 6]);
    }

    #[test]
    fn fallbacks_stay_between_neighbouring_tables() {
        let p = HookPlan::new(NfFamily::Ipv4, NfHook::PreRouting, None);
        let slot = p.points.iter().position(|&x| x == -149).unwrap();
        let f = p.fallbacks(slot);
        assert!(!f.is_empty());
        assert!(f.iter().all(|&x| x > -150 && x < -100), "{f:?}");
    }

    #[test]
    fn reads_custom_priorities_from_nft_json() {
        let json = r#"{"nftables":[{"metainfo":{}},
          {"table":{"family":"inet","name":"t","handle":1}},
          {"table":{"family":"ip","name":"nat","handle":2}},
          {"table":{"family":"ip","name":"t","handle":3}},
          {"chain":{"family":"inet","table":"t","name":"c","handle":1,"type":"filter","hook":"forward","prio":-5,"policy":"accept"}},
          {"chain":{"family":"ip","table":"nat","name":"PREROUTING","handle":2,"type":"nat","hook":"prerouting","prio":-100,"policy":"accept"}},
          {"chain":{"family":"ip","table":"t","name":"plain","handle":3}}]}"#;
        let c = base_chains(&observer_rules::parse_nft_json(json).unwrap());
        assert_eq!(
            c,
            vec![
                (NfFamily::Ipv4, NfHook::PreRouting, -100),
                (NfFamily::Ipv4, NfHook::Forward, -5),
                (NfFamily::Ipv6, NfHook::Forward, -5)
            ]
        );
    }

    #[test]
    fn headers_are_read_again_after_nat_and_custom_chains_only() {
        let p = HookPlan::new(NfFamily::Ipv4, NfHook::PreRouting, None);
        // Points FIRST, -299, -199, -149, LAST: only LAST follows nat.
        assert_eq!(p.header_readers(), 1 << 4);
        assert_eq!(
            p.nat_only_readers(),
            1 << 4,
            "nat alone: NAT status decides"
        );
        let f = HookPlan::new(NfFamily::Ipv4, NfHook::Forward, Some(&[-150, 0, 50, -5]));
        let after_custom = f.points.iter().position(|&x| x == -4).unwrap();
        assert_eq!(f.header_readers(), 1 << f.programs[after_custom]);
        assert_eq!(
            f.nat_only_readers(),
            0,
            "a custom chain may rewrite anything"
        );
        // A custom chain beside nat (between the same two points) is read after, always.
        let both = HookPlan::new(NfFamily::Ipv4, NfHook::PostRouting, Some(&[100, 100]));
        let mixed = HookPlan {
            tables: vec![
                Table {
                    name: "nat".into(),
                    priority: 100,
                },
                Table {
                    name: "prio:100".into(),
                    priority: 100,
                },
            ],
            ..both
        };
        assert_ne!(mixed.header_readers(), 0);
        assert_eq!(mixed.nat_only_readers(), 0);
    }

    #[test]
    fn plan_fits_slots() {
        for p in full_plan(None) {
            assert!(p.points.len() <= NF_SLOTS);
            assert_eq!(p.points.first(), Some(&FIRST));
            assert_eq!(p.points.last(), Some(&LAST));
        }
    }

    #[test]
    fn only_the_tables_a_namespace_has_are_bracketed() {
        // The lab's iptables-nft node: raw, nat and filter tables; no mangle, no security.
        let json = r#"{"nftables":[
          {"table":{"family":"ip","name":"raw","handle":1}},
          {"table":{"family":"ip","name":"nat","handle":2}},
          {"table":{"family":"ip","name":"filter","handle":3}},
          {"chain":{"family":"ip","table":"raw","name":"PREROUTING","hook":"prerouting","prio":-300}},
          {"chain":{"family":"ip","table":"nat","name":"PREROUTING","hook":"prerouting","prio":-100}},
          {"chain":{"family":"ip","table":"nat","name":"POSTROUTING","hook":"postrouting","prio":100}},
          {"chain":{"family":"ip","table":"filter","name":"FORWARD","hook":"forward","prio":0}}]}"#;
        let users = base_chains(&observer_rules::parse_nft_json(json).unwrap());
        let plans = full_plan(Some(&users));
        let plan = |f, h| plans.iter().find(|p| p.family == f && p.hook == h).unwrap();
        let names = |p: &HookPlan| {
            p.tables
                .iter()
                .map(|t| t.name.to_string())
                .collect::<Vec<_>>()
        };
        let pre = plan(NfFamily::Ipv4, NfHook::PreRouting);
        assert_eq!(names(pre), ["raw", "conntrack", "nat"]);
        assert_eq!(pre.points, vec![FIRST, -299, -199, LAST]);
        assert_eq!(pre.point_of(2), Some(2), "program 2 just after conntrack");
        let fwd = plan(NfFamily::Ipv4, NfHook::Forward);
        assert_eq!(names(fwd), ["filter"]);
        assert_eq!(fwd.points, vec![FIRST, LAST]);
        assert_eq!(fwd.bracket(&fwd.tables[0]), (Some(0), Some(1)));
        // No table at all: one probe sees the packet pass.
        let in6 = plan(NfFamily::Ipv6, NfHook::Forward);
        assert!(in6.tables.is_empty());
        assert_eq!(in6.points, vec![FIRST]);
        // Conntrack stays bracketed where packets enter, even with no table there.
        let out6 = plan(NfFamily::Ipv6, NfHook::LocalOut);
        assert_eq!(names(out6), ["conntrack"]);
        assert_eq!(out6.points, vec![FIRST, LAST]);
    }

    #[test]
    fn legacy_tables_run_at_every_hook_of_their_kind() {
        let u = legacy_users(NfFamily::Ipv4, "filter\nnat\n");
        let mut hooks: Vec<_> = u.iter().map(|(_, h, p)| (h.name(), *p)).collect();
        hooks.sort();
        assert_eq!(
            hooks,
            [
                ("FORWARD", 0),
                ("INPUT", 0),
                ("INPUT", 100),
                ("OUTPUT", -100),
                ("OUTPUT", 0),
                ("POSTROUTING", 100),
                ("PREROUTING", -100)
            ]
        );
        assert!(legacy_users(NfFamily::Ipv6, "").is_empty());
    }
}
