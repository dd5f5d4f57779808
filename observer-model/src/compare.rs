//! Observed against predicted: the same [`Stage`] type on both sides, compared field by
//! field (addresses, mark, verdict). Disagreements are sentences with both sides, the
//! rules' first: "rules predict mark 0x4000, the kernel set 0x0".

use crate::traversal::{Check, CheckResult, Snapshot, Stage, Traversal, Verdict};

/// Holds the prediction for one stage against what the kernel did there. The prediction
/// starts from the observed before-state, so only its after-state and verdict can differ.
pub fn compare_stage(observed: &Stage, predicted: &Stage) -> Check {
    if predicted.verdict == Verdict::Undecidable {
        return Check {
            result: CheckResult::Undecidable,
            disagreements: Vec::new(),
            reason: predicted
                .note
                .clone()
                .or_else(|| predicted.rules.iter().find_map(|r| r.undecidable.clone())),
        };
    }
    let mut d = Vec::new();
    let went_on = |v: Verdict| v == Verdict::Accept;
    match (observed.verdict, predicted.verdict) {
        // The end was not seen, or the packet was queued: nothing to hold the rules to.
        (Verdict::Unknown | Verdict::Stolen, _) => {}
        (o, p) if went_on(o) != went_on(p) => d.push(format!(
            "rules predict {}, the kernel {}",
            p.name(),
            if went_on(o) {
                "let the packet through"
            } else {
                "dropped the packet"
            }
        )),
        _ => {}
    }
    if let (Some(o), Some(p)) = (&observed.after, &predicted.after)
        && went_on(observed.verdict)
    {
        snapshot_diff(p, o, &mut d);
    }
    Check {
        result: if d.is_empty() {
            CheckResult::Agrees
        } else {
            CheckResult::Disagrees
        },
        disagreements: d,
        reason: None,
    }
}

fn snapshot_diff(predicted: &Snapshot, observed: &Snapshot, d: &mut Vec<String>) {
    if predicted.mark != observed.mark {
        d.push(format!(
            "rules predict mark {:#x}, the kernel set {:#x}",
            predicted.mark, observed.mark
        ));
    }
    for (what, p, o) in [
        ("source", &predicted.src, &observed.src),
        ("destination", &predicted.dst, &observed.dst),
    ] {
        // An unknown address (`<address of eth0>`) is what the rules could not resolve.
        if p != o && !matches!(p.host, crate::Host::AddressOf(_)) {
            d.push(format!("rules predict {what} {p}, the kernel made it {o}"));
        }
    }
}

/// Compares two whole traversals stage by stage (matched by hook and table, in order):
/// every disagreement, prefixed with the stage, and the stages only one side has.
pub fn compare(observed: &Traversal, predicted: &Traversal) -> Vec<String> {
    let mut out = Vec::new();
    let mut rest = predicted.stages.iter().peekable();
    for o in &observed.stages {
        let found = rest
            .clone()
            .position(|p| p.hook == o.hook && p.table == o.table);
        // Observed only (conntrack, a table without rules in the prediction): nothing to
        // compare.
        if let Some(skip) = found {
            for p in rest.by_ref().take(skip) {
                out.push(format!(
                    "{}/{}: predicted, not observed",
                    p.hook.name(),
                    p.table
                ));
            }
            let p = rest.next().expect("found above");
            for d in compare_stage(o, p).disagreements {
                out.push(format!("{}/{}: {d}", o.hook.name(), o.table));
            }
        }
    }
    for p in rest {
        out.push(format!(
            "{}/{}: predicted, not observed",
            p.hook.name(),
            p.table
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::vocab::Hook;
    use std::sync::Arc;

    fn ep(text: &str) -> crate::Endpoint {
        match text.parse::<std::net::SocketAddr>() {
            Ok(sa) => crate::Endpoint::new(sa.ip(), Some(sa.port())),
            Err(_) => crate::Endpoint {
                host: crate::Host::AddressOf(text.into()),
                port: None,
            },
        }
    }

    fn stage(after_mark: u32, dst: &str, verdict: Verdict) -> Stage {
        Stage {
            hook: Hook::PreRouting,
            table: "nat".into(),
            priority: -100,
            chain: None,
            before: Some(Arc::new(Snapshot::new(
                ep("1.1.1.1:1"),
                ep("10.10.10.2:22"),
                0,
                None,
                None,
            ))),
            after: Some(Arc::new(Snapshot::new(
                ep("1.1.1.1:1"),
                ep(dst),
                after_mark,
                None,
                None,
            ))),
            ct: None,
            verdict,
            rules: Default::default(),
            policy: None,
            note: None,
            ipvs: None,
            check: None,
        }
    }

    #[test]
    fn agreement_and_both_sides_of_a_disagreement() {
        let kernel = stage(0, "172.17.0.5:22", Verdict::Accept);
        let same = stage(0, "172.17.0.5:22", Verdict::Accept);
        assert_eq!(compare_stage(&kernel, &same).result, CheckResult::Agrees);
        let rules = stage(0x4000, "172.17.0.6:22", Verdict::Accept);
        let c = compare_stage(&kernel, &rules);
        assert_eq!(c.result, CheckResult::Disagrees);
        assert_eq!(
            c.disagreements,
            [
                "rules predict mark 0x4000, the kernel set 0x0",
                "rules predict destination 172.17.0.6:22, the kernel made it 172.17.0.5:22"
            ]
        );
        let dropped = stage(0, "172.17.0.5:22", Verdict::Drop);
        assert_eq!(
            compare_stage(&kernel, &dropped).disagreements,
            ["rules predict drop, the kernel let the packet through"]
        );
        assert_eq!(
            compare_stage(&dropped, &kernel).disagreements,
            ["rules predict accept, the kernel dropped the packet"]
        );
        let mut unsure = stage(0, "?", Verdict::Undecidable);
        unsure.note = Some("ipset x unknown".into());
        let c = compare_stage(&kernel, &unsure);
        assert_eq!(c.result, CheckResult::Undecidable);
        assert_eq!(c.reason.as_deref(), Some("ipset x unknown"));
    }

    #[test]
    fn whole_traversals_compare_stage_by_stage() {
        let t = |stages: Vec<Stage>| Traversal {
            schema: crate::SCHEMA,
            source: crate::Source::Observed,
            netns: None,
            family: None,
            proto: Some(crate::Protocol::Tcp),
            packet: None,
            ingress: None,
            egress: None,
            route: None,
            bridge: None,
            encap: None,
            stages,
            fate: crate::Fate::new(crate::FateKind::Forwarded),
            marks: Default::default(),
            nat: Vec::new(),
            conntrack: None,
            names: Vec::new(),
            branches: Vec::new(),
            notes: Vec::new(),
            lost: 0,
            incomplete: false,
            incomplete_reason: None,
        };
        let mut extra = stage(0, "172.17.0.5:22", Verdict::Accept);
        extra.hook = Hook::Forward;
        extra.table = "filter".into();
        let observed = t(vec![stage(0, "172.17.0.5:22", Verdict::Accept)]);
        let predicted = t(vec![stage(0x4000, "172.17.0.5:22", Verdict::Accept), extra]);
        assert_eq!(
            compare(&observed, &predicted),
            [
                "PREROUTING/nat: rules predict mark 0x4000, the kernel set 0x0",
                "FORWARD/filter: predicted, not observed"
            ]
        );
        assert!(compare(&observed, &observed).is_empty());
    }
}
