//! `whatif --observed AFTER`: the same flows as the kernel walked them before and after a
//! change, from two recordings, compared as whatif compares predictions (the same fold, the
//! same [`classify`]). This is how a prediction is checked against the kernel: record,
//! predict, apply, send the same traffic again while recording, and hold the two sets of
//! changed flows side by side.
//!
//! A flow of the first recording is matched with the second's by its [`FlowKey::entry`]: the
//! packet as it entered, without what the rules decided for it (its way out, the
//! translation conntrack stored), which a change may move.

use std::collections::HashMap;
use std::sync::Arc;

use observer_model::Traversal;

use super::{Changed, Compare, Findings, FlowKey, Folded, classify};

/// Holds every flow of `before` (recorded before the change) against the same flow
/// recorded in `after`. A flow `after` does not hold is counted as not seen again, never
/// as unchanged; a flow only `after` holds is counted as new. Both are recordings (a capture
/// window's reports are not traversals to compare: `run` refuses them first).
pub fn judge(before: &Folded, after: &Folded, mode: Compare, mask: u32) -> Findings {
    let mut seen: HashMap<FlowKey, Vec<&Arc<Traversal>>> = HashMap::new();
    for (k, _, t) in &after.flows {
        if let Some(t) = t.traversal() {
            seen.entry(k.entry()).or_default().push(t);
        }
    }
    let mut f = Findings {
        traversals: before.traversals,
        unusable: before.unusable,
        // The flows are written as they entered: their way out is the kernel's.
        routes_known: true,
        ..Default::default()
    };
    let mut matched = std::collections::HashSet::new();
    for (key, count, seen_first) in &before.flows {
        let Some(observed) = seen_first.traversal() else {
            continue;
        };
        let entry = key.entry();
        let Some(afters) = seen.get(&entry) else {
            f.unseen_flows += 1;
            f.unseen_packets += count;
            listed(&mut f.notes, "not seen again", key, f.unseen_flows);
            continue;
        };
        matched.insert(entry);
        // A flow the kernel walked more than one way after the change (a random endpoint):
        // the first way that differs is its change.
        let change = afters.iter().find_map(|a| {
            classify(observed, a, mode, mask).map(|change| Changed {
                key: key.clone(),
                count: *count,
                change,
                observed: seen_first.clone(),
                before: (**observed).clone(),
                after: (***a).clone(),
            })
        });
        f.add(change, *count);
    }
    for (k, n, _) in &after.flows {
        if !matched.contains(&k.entry()) {
            f.new_flows += 1;
            f.new_packets += n;
            listed(&mut f.notes, "seen only after", k, f.new_flows);
        }
    }
    f.notes.push(
        "observed: each flow's before and after are what the kernel did, from the two \
         recordings (no simulation)"
            .into(),
    );
    f
}

/// The first few flows one recording holds and the other does not, named in the notes
/// (the summary counts them all).
fn listed(notes: &mut Vec<String>, what: &str, key: &FlowKey, nth: u64) {
    const LISTED: u64 = 10;
    if nth <= LISTED {
        notes.push(format!("{what}: {}", key.describe(true)));
    } else if nth == LISTED + 1 {
        notes.push(format!("{what}: more, counted in the summary"));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::commands::whatif::{Change, tests_support::recorded_flows};

    #[test]
    fn a_recording_against_itself_changes_nothing_and_every_flow_is_matched() {
        let f = recorded_flows();
        let j = judge(&f, &f, Compare::Path, u32::MAX);
        assert!(!j.any(), "{}", j.summary());
        assert_eq!(j.unchanged_flows, f.flows.len() as u64);
        assert_eq!((j.unseen_flows, j.new_flows), (0, 0));
    }

    #[test]
    fn a_flow_whose_observed_fate_differs_is_a_change_and_missing_flows_are_counted() {
        let f = recorded_flows();
        // The same recording with its first forwarded flow dropped in FORWARD instead, and
        // its last flow gone.
        let mut after = Folded::default();
        let i = f
            .flows
            .iter()
            .position(|(_, _, t)| {
                t.traversal().unwrap().fate.kind == observer_model::FateKind::Forwarded
            })
            .expect("a forwarded flow");
        for (n, (_, _, t)) in f.flows.iter().enumerate().take(f.flows.len() - 1) {
            let mut t = (**t.traversal().unwrap()).clone();
            if n == i {
                t.fate.kind = observer_model::FateKind::Dropped;
                t.egress = None;
            }
            after.add(&Arc::new(t), 0);
        }
        let j = judge(&f, &after, Compare::Outcome, u32::MAX);
        let changed = &j.groups[&Change::AcceptedToDropped];
        assert_eq!(changed.len(), 1);
        assert_eq!(changed[0].key, f.flows[i].0);
        assert_eq!(j.unseen_flows, 1);
        assert_eq!(j.unseen_packets, f.flows.last().unwrap().1);
        assert!(j.summary().contains("not seen again"), "{}", j.summary());
    }
}
