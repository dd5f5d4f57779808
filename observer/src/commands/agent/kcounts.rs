//! The always-on mode's metrics: the probes' own counters (observer_common::counts), read
//! once a second and added to [`Metrics`] as increments, labelled with the probe plan in
//! force (which table lies between two points).
//!
//! Pure: it takes the rows as read, so it is unit-tested without a kernel.

use std::collections::HashMap;

use observer_common::counts::{
    self, DNAT_CONNTRACK, DNAT_RULES, MARK_CLEARED, MARK_SET, PACKETS, REASONS, ROW,
    SNAT_CONNTRACK, SNAT_RULES, UNATTRIBUTED,
};

use super::metrics::{Counter, Metrics};
use crate::kernel::plan::HookPlan;
use observer_model::marks::MarkDictionary;

/// Where a counter row's point is: its family, hook, and the tables just before and just
/// after it on the plan.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Place {
    family: &'static str,
    hook: &'static str,
    /// Where packets enter: the first point of PREROUTING or OUTPUT.
    entry: bool,
    before: String,
    after: String,
}

/// The rows of every point on `plans`, with where each one is.
fn places(plans: &[HookPlan]) -> Vec<(usize, Place)> {
    let mut out = Vec::new();
    for p in plans {
        let Some(family) = counts::family_index(p.family.pf() as u8) else {
            continue;
        };
        for (i, &program) in p.programs.iter().enumerate() {
            let name = |t: Option<&crate::kernel::plan::Table>| {
                t.map_or("none".into(), |t| t.name.to_string())
            };
            out.push((
                counts::point(family, p.hook as usize, program),
                Place {
                    family: p.family.name(),
                    hook: p.hook.name(),
                    entry: i == 0
                        && matches!(
                            p.hook,
                            crate::kernel::nf_link::NfHook::PreRouting
                                | crate::kernel::nf_link::NfHook::LocalOut
                        ),
                    before: name(p.table_before(i)),
                    after: name(p.table_after(i)),
                },
            ));
        }
    }
    out
}

/// Turns the kernel's cumulative counters into metric increments.
#[derive(Default)]
pub struct KernelCounts {
    rows: HashMap<usize, [u64; ROW]>,
    drops: HashMap<usize, [u64; REASONS]>,
    /// Packets whose mark changes before some point could not be attributed (see
    /// `counts::UNATTRIBUTED`), since start.
    pub unattributed: u64,
    /// Packets that entered the namespace's hooks (first point of PREROUTING and OUTPUT),
    /// since start.
    pub seen: u64,
}

/// What the agent needs to name things.
pub struct Naming<'a> {
    pub marks: &'a MarkDictionary,
    pub reasons: &'a HashMap<u32, String>,
}

impl KernelCounts {
    /// The rows to read for `plans` (every point of every hook).
    pub fn points(plans: &[HookPlan]) -> Vec<usize> {
        places(plans).into_iter().map(|(row, _)| row).collect()
    }

    /// Adds what grew since the last call to `metrics`. `rows` and `drops` are the sums
    /// read from the kernel (drops include [`counts::UNKNOWN_PLACE`]).
    pub fn apply(
        &mut self,
        plans: &[HookPlan],
        rows: &[(usize, [u64; ROW])],
        drops: &[(usize, [u64; REASONS])],
        names: &Naming,
        metrics: &Metrics,
    ) {
        let places: HashMap<usize, Place> = places(plans).into_iter().collect();
        for (row, now) in rows {
            let prev = self.rows.insert(*row, *now).unwrap_or([0; ROW]);
            let Some(at) = places.get(row) else { continue };
            let d = |i: usize| now[i].saturating_sub(prev[i]);
            let (f, h, t) = (at.family, at.hook, at.before.as_str());
            // A packet at a point goes into the table after it (none after the last point):
            // a packet that table drops is one it had.
            if at.after != "none" && d(PACKETS) > 0 {
                metrics.add(Counter::Packets, &[f, h, &at.after], d(PACKETS));
            }
            for b in 0..32 {
                for (kind, base) in [("set", MARK_SET), ("cleared", MARK_CLEARED)] {
                    let n = d(base + b);
                    if n > 0 {
                        let bit = 1u32 << b;
                        let hex = format!("{bit:#x}");
                        let name = names.marks.name(bit).unwrap_or(&hex);
                        metrics.add(Counter::Marks, &[f, h, t, kind, name], n);
                    }
                }
            }
            for (i, kind, source) in [
                (DNAT_RULES, "dnat", "rules"),
                (DNAT_CONNTRACK, "dnat", "conntrack"),
                (SNAT_RULES, "snat", "rules"),
                (SNAT_CONNTRACK, "snat", "conntrack"),
            ] {
                if d(i) > 0 {
                    metrics.add(Counter::Nat, &[f, h, t, kind, source], d(i));
                }
            }
            self.unattributed += d(UNATTRIBUTED);
            if at.entry {
                self.seen += d(PACKETS);
            }
        }
        for (place, now) in drops {
            let prev = self.drops.insert(*place, *now).unwrap_or([0; REASONS]);
            // A drop after a point happened in the table that follows it (none: after the
            // hook's last table, or not on the plan any more).
            let (f, h, t) = match places.get(place) {
                Some(at) => (at.family, at.hook, at.after.as_str()),
                None => ("other", "none", "none"),
            };
            for (r, (&n, &p)) in now.iter().zip(prev.iter()).enumerate() {
                if n > p {
                    let reason = reason_name(r, names.reasons);
                    metrics.add(Counter::Drops, &[f, h, t, &reason], n - p);
                }
            }
        }
    }
}

/// The kernel's name of drop reason `r` (the last index counts every higher one).
fn reason_name(r: usize, reasons: &HashMap<u32, String>) -> String {
    if r == REASONS - 1 {
        return "other".into();
    }
    reasons
        .get(&(r as u32))
        .cloned()
        .unwrap_or_else(|| format!("reason_{r}"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernel::nf_link::{NfFamily, NfHook};

    fn plans() -> Vec<HookPlan> {
        // The lab's forwarding path: raw, conntrack and nat at PREROUTING; filter at
        // FORWARD; nat at POSTROUTING.
        vec![
            HookPlan::new(
                NfFamily::Ipv4,
                NfHook::PreRouting,
                Some(&[-300, -200, -100]),
            ),
            HookPlan::new(NfFamily::Ipv4, NfHook::Forward, Some(&[0])),
            HookPlan::new(NfFamily::Ipv4, NfHook::PostRouting, Some(&[100])),
        ]
    }

    fn row_at(plan: &HookPlan, i: usize) -> usize {
        counts::point(0, plan.hook as usize, plan.programs[i])
    }

    #[test]
    fn counters_become_labelled_increments() {
        let plans = plans();
        let (pre, fwd) = (&plans[0], &plans[1]);
        let marks = MarkDictionary::default();
        let reasons: HashMap<u32, String> = [(2, "NO_SOCKET".to_string())].into();
        let names = Naming {
            marks: &marks,
            reasons: &reasons,
        };
        let metrics = Metrics::new("n");
        let mut k = KernelCounts::default();
        // After PREROUTING's nat (its last point): 10 packets, 10 set 0x4000, 10 DNATed by
        // the rules... of which 3 by conntrack.
        let last = pre.points.len() - 1;
        assert_eq!(pre.table_before(last).map(|t| &*t.name), Some("nat"));
        let mut r = [0u64; ROW];
        r[PACKETS] = 10;
        r[MARK_SET + 14] = 10;
        r[DNAT_RULES] = 7;
        r[DNAT_CONNTRACK] = 3;
        // FORWARD's first point: 10 packets reached the hook, no table before it.
        let mut first = [0u64; ROW];
        first[PACKETS] = 10;
        // 4 dropped after FORWARD's first point: inside filter.
        let mut d = [0u64; REASONS];
        d[2] = 4;
        let rows = vec![(row_at(pre, last), r), (row_at(fwd, 0), first)];
        let drops = vec![(row_at(fwd, 0), d)];
        k.apply(&plans, &rows, &drops, &names, &metrics);
        let get = |c, l: &[&str]| metrics.get(c, l);
        // Counted into the table after a point: none after PREROUTING's last one.
        assert_eq!(get(Counter::Packets, &["ipv4", "PREROUTING", "nat"]), 0);
        assert_eq!(get(Counter::Packets, &["ipv4", "FORWARD", "filter"]), 10);
        assert_eq!(k.seen, 0, "no packets at PREROUTING's first point yet");
        let name = marks.name(0x4000).unwrap_or("0x4000");
        assert_eq!(
            get(Counter::Marks, &["ipv4", "PREROUTING", "nat", "set", name]),
            10
        );
        assert_eq!(
            get(
                Counter::Nat,
                &["ipv4", "PREROUTING", "nat", "dnat", "rules"]
            ),
            7
        );
        assert_eq!(
            get(
                Counter::Nat,
                &["ipv4", "PREROUTING", "nat", "dnat", "conntrack"]
            ),
            3
        );
        assert_eq!(
            get(Counter::Drops, &["ipv4", "FORWARD", "filter", "NO_SOCKET"]),
            4
        );
        // Read again with more: only the growth is added.
        first[PACKETS] = 15;
        d[2] = 5;
        let rows = vec![(row_at(fwd, 0), first)];
        let drops = vec![
            (row_at(fwd, 0), d),
            (counts::UNKNOWN_PLACE, {
                let mut u = [0u64; REASONS];
                u[REASONS - 1] = 2;
                u
            }),
        ];
        k.apply(&plans, &rows, &drops, &names, &metrics);
        assert_eq!(get(Counter::Packets, &["ipv4", "FORWARD", "filter"]), 15);
        assert_eq!(
            get(Counter::Drops, &["ipv4", "FORWARD", "filter", "NO_SOCKET"]),
            5
        );
        assert_eq!(get(Counter::Drops, &["other", "none", "none", "other"]), 2);
        // A drop after a hook's last point is after its tables.
        let post = &plans[2];
        let lastp = post.points.len() - 1;
        let mut d2 = [0u64; REASONS];
        d2[2] = 1;
        k.apply(&plans, &[], &[(row_at(post, lastp), d2)], &names, &metrics);
        assert_eq!(
            get(
                Counter::Drops,
                &["ipv4", "POSTROUTING", "none", "NO_SOCKET"]
            ),
            1
        );
    }

    #[test]
    fn every_point_has_its_own_row() {
        let plans = plans();
        let rows = KernelCounts::points(&plans);
        let n: usize = plans.iter().map(|p| p.points.len()).sum();
        assert_eq!(rows.len(), n);
        let mut unique = rows.clone();
        unique.sort_unstable();
        unique.dedup();
        assert_eq!(unique.len(), n);
    }
}
