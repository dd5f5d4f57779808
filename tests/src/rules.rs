//! Rule counters as the kernel keeps them and as the reports name the rules, keyed (table,
//! chain, 1-based index), for the tests that hold the named rules against the counters.

use std::collections::BTreeMap;

use serde_json::Value;

use crate::lab::Lab;
use crate::run;

/// Packets per rule, keyed (table, chain, index).
pub type Counts = BTreeMap<(String, String, usize), u64>;

/// The packet counter of every rule of a `-save -c` dump.
pub fn rule_counters(file: &observer_rules::SaveFile) -> Counts {
    let mut counts = Counts::new();
    for t in &file.tables {
        for c in &t.chains {
            for (i, r) in c.rules.iter().enumerate() {
                let k = r.counters.expect("-c prints counters");
                counts.insert((t.name.clone(), c.name.clone(), i + 1), k.packets);
            }
        }
    }
    counts
}

/// The rule counters `save` (`iptables-save` or `ip6tables-save`) prints in the lab
/// namespace `role`.
pub fn lab_counters(lab: &Lab, role: &str, save: &str) -> Counts {
    counters_in(&lab.ns(role), save)
}

/// The rule counters `save` prints in the namespace named `netns`.
pub fn counters_in(netns: &str, save: &str) -> Counts {
    let out = run(&["ip", "netns", "exec", netns, save, "-c"]);
    let text = String::from_utf8_lossy(&out.stdout);
    let file = observer_rules::parse_save(&text)
        .unwrap_or_else(|e| panic!("{save} -c does not parse: {e}\n{text}"));
    rule_counters(&file)
}

/// What each counter grew by from `before` to `after` (the rules that counted).
pub fn increments(before: &Counts, after: &Counts) -> Counts {
    after
        .iter()
        .filter_map(|(k, v)| {
            let d = v - before.get(k).copied().unwrap_or(0);
            (d > 0).then(|| (k.clone(), d))
        })
        .collect()
}

/// The rules named in the `family` (`ipv4`, `ipv6`) traversals of `reports`, once per
/// stage naming them.
pub fn named(reports: &[Value], family: &str) -> Counts {
    let mut counts = Counts::new();
    for r in reports.iter().filter(|r| r["family"] == family) {
        for s in r["stages"].as_array().into_iter().flatten() {
            for rule in s["rules"].as_array().into_iter().flatten() {
                let Some(index) = rule["index"].as_u64() else {
                    continue;
                };
                let key = (
                    rule["table"].as_str().unwrap().to_string(),
                    rule["chain"].as_str().unwrap().to_string(),
                    index as usize,
                );
                *counts.entry(key).or_default() += 1;
            }
        }
    }
    counts
}

/// Each rule whose count differs between the kernel's counters and tail's naming, with
/// both counts.
pub fn diff(kernel: &Counts, tail: &Counts) -> Vec<String> {
    kernel
        .keys()
        .chain(tail.keys())
        .collect::<std::collections::BTreeSet<_>>()
        .into_iter()
        .filter(|k| kernel.get(*k) != tail.get(*k))
        .map(|k| {
            format!(
                "{}/{}#{}: kernel {}, tail {}",
                k.0,
                k.1,
                k.2,
                kernel.get(k).copied().unwrap_or(0),
                tail.get(k).copied().unwrap_or(0)
            )
        })
        .collect()
}
