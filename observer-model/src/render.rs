//! The renderers: the readable tree and the one-line summary, for observed and predicted
//! traversals alike (JSON is the type's own serialization). Pure functions of a
//! [`Traversal`].

use std::borrow::Cow;
use std::fmt::Write as _;

use crate::traversal::{
    Branch, CheckResult, CtView, Fate, FateKind, MarkChange, Marks, Nat, NatSource, Stage,
    Traversal, Verdict,
};

/// Whether printing `c` could move the cursor, recolour the terminal or reorder the text:
/// C0 and C1 controls, DEL, and the bidirectional overrides and isolates.
fn is_unsafe(c: char) -> bool {
    c.is_control()
        || matches!(c, '\u{200e}' | '\u{200f}' | '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}')
}

/// Text from outside (rule files, recordings, names) made safe for a terminal: every
/// control character, newlines included, is written as its escape (`\n`, `\u{1b}`).
pub fn escape_controls(s: &str) -> Cow<'_, str> {
    if !s.chars().any(is_unsafe) {
        return Cow::Borrowed(s);
    }
    let mut out = String::with_capacity(s.len() + 8);
    for c in s.chars() {
        if is_unsafe(c) {
            out.extend(c.escape_debug());
        } else {
            out.push(c);
        }
    }
    Cow::Owned(out)
}

/// The renderers' own newlines stay; any control character a field still carries (one not
/// escaped where it was printed) is escaped here.
fn escape_output(s: String) -> String {
    if !s.chars().any(|c| c != '\n' && is_unsafe(c)) {
        return s;
    }
    s.split('\n')
        .map(|l| escape_controls(l).into_owned())
        .collect::<Vec<_>>()
        .join("\n")
}

use escape_controls as e;

fn mark_word(c: &MarkChange, sign: char) -> String {
    format!(
        "{sign}{:#x} {}",
        c.bit,
        e(c.name.as_deref().unwrap_or("(unnamed)"))
    )
}

const CONNTRACK_NOTE: &str = "the nat table is not consulted for this packet because its \
     connection is already established: conntrack applied the stored translation";

/// IPVS's step as `ipvsadm -Ln` lists it: the virtual service, then the real server.
fn ipvs_line(i: &crate::IpvsStep) -> String {
    let mut s = format!("ipvs: {}", i.service);
    match (&i.real_server, &i.forward) {
        (Some(rs), Some(fwd)) => {
            s.push_str(&format!("  -> {rs} {fwd}"));
            if let Some(w) = i.weight {
                s.push_str(&format!(" weight {w}"));
            }
        }
        _ => s.push_str("  -> no real server"),
    }
    match i.chosen_by.as_str() {
        "scheduler" if i.candidates > 1 => s.push_str(&format!(
            "  (one of {} candidates: the scheduler {} picks, see branches)",
            i.candidates, i.scheduler
        )),
        "scheduler" => {}
        "only" => s.push_str("  (its only real server)"),
        "observed" if i.candidates == 1 => s.push_str("  (its only real server)"),
        "reply" => s.push_str("  (a reply: its source given back the virtual service's)"),
        "observed" => s.push_str(&format!(
            "  (scheduled by {} among {})",
            i.scheduler, i.candidates
        )),
        by => s.push_str(&format!("  (chosen by {by})")),
    }
    s
}

/// The stage lines of one path, with rules and checks beneath each stage.
fn render_stages(out: &mut String, indent: &str, stages: &[Stage], marks: &Marks, nat: &[Nat]) {
    let mut last_ct: Option<&CtView> = None;
    for s in stages {
        // A change belongs to the stage whose before and after show it: predicted stages of
        // one nftables table share their hook and table name.
        let here = |hook, table: &str| hook == s.hook && table == &*s.table;
        let (b, a) = (s.before.as_deref(), s.after.as_deref());
        let translated = |n: &&Nat| {
            here(n.hook, &n.table)
                && b.zip(a).is_some_and(|(b, a)| match n.kind {
                    crate::NatKind::Dnat => b.dst == n.from && a.dst == n.to,
                    crate::NatKind::Snat => b.src == n.from && a.src == n.to,
                })
        };
        let marked = |c: &&MarkChange, set: bool| {
            here(c.hook, &c.table)
                && b.zip(a).is_some_and(|(b, a)| {
                    (b.mark & c.bit != 0) != set && (a.mark & c.bit != 0) == set
                })
        };
        let mut what = Vec::new();
        let mut note = s.note.as_deref();
        for n in nat.iter().filter(translated) {
            what.push(format!(
                "{} {} -> {} ({})",
                match n.kind {
                    crate::NatKind::Dnat => "DNAT",
                    crate::NatKind::Snat => "SNAT",
                },
                n.from,
                n.to,
                match n.source {
                    NatSource::Rules => "nat rules",
                    NatSource::Conntrack => "conntrack",
                    NatSource::Ipvs => "ipvs",
                }
            ));
            if n.source == NatSource::Conntrack {
                note = Some(CONNTRACK_NOTE);
            }
        }
        for c in marks.set.iter().filter(|c| marked(c, true)) {
            what.push(mark_word(c, '+'));
        }
        for c in marks.cleared.iter().filter(|c| marked(c, false)) {
            what.push(mark_word(c, '-'));
        }
        if s.ct.as_deref() != last_ct {
            if let Some(ct) = &s.ct {
                what.push(match ct.mark {
                    Some(m) => format!("ct {} (ctmark {m:#x})", ct.state.name()),
                    None => format!("ct {}", ct.state.name()),
                });
            }
            last_ct = s.ct.as_deref();
        }
        if let (Some(b), Some(a)) = (
            s.before.as_ref().and_then(|b| b.inner.as_ref()),
            s.after.as_ref().and_then(|a| a.inner.as_ref()),
        ) && b != a
        {
            what.push(format!(
                "quoted packet {} -> {} became {} -> {}",
                b.src, b.dst, a.src, a.dst
            ));
        }
        match s.verdict {
            Verdict::Drop => what.push("dropped here".into()),
            Verdict::Reject => what.push("rejected here".into()),
            Verdict::Stolen => what.push("taken here (stolen)".into()),
            Verdict::Unknown => what.push("not seen after this table".into()),
            Verdict::Undecidable => what.push("undecidable here".into()),
            Verdict::Accept => {}
        }
        if let Some(p) = &s.policy
            && s.verdict != Verdict::Accept
        {
            what.push(format!("policy {}", e(p)));
        }
        if what.is_empty() {
            what.push("-".into());
        }
        let table = match &s.chain {
            Some(c) => format!("{} {} {}", e(&c.family), e(&s.table), e(&c.name)),
            None => e(&s.table).into_owned(),
        };
        let _ = writeln!(
            out,
            "{indent}  {:<12} {:<10} {:>6}  {}",
            s.hook.name(),
            table,
            s.priority,
            what.join(", ")
        );
        if let Some(n) = note {
            let _ = writeln!(out, "{indent}  {:<31}  note: {}", "", e(n));
        }
        if let Some(i) = &s.ipvs {
            let _ = writeln!(out, "{indent}      {}", e(&ipvs_line(i)));
        }
        for r in s.rules.iter() {
            let mut extra = String::new();
            if let Some(k) = &r.k8s {
                let _ = write!(extra, "  [k8s {}]", e(&k.service));
            }
            if let Some(id) = &r.calico {
                let _ = write!(extra, "  [calico {}]", e(id));
            }
            // `-A CHAIN` repeats the place.
            let text = r
                .text
                .strip_prefix("-A ")
                .and_then(|t| t.strip_prefix(r.id.chain()))
                .map_or(r.text.as_str(), str::trim_start);
            let _ = writeln!(
                out,
                "{indent}      {} {}  => {}{extra}",
                e(&r.id.place()),
                e(text),
                e(&r.action)
            );
            if let Some(u) = &r.undecidable {
                let _ = writeln!(out, "{indent}        undecidable: {}", e(u));
            }
        }
        if let Some(c) = &s.check {
            for d in &c.disagreements {
                let _ = writeln!(out, "{indent}      !! {}", e(d));
            }
        }
    }
}

/// `N rules named, all stages agree` or what disagrees, for an observed traversal whose
/// stages were checked; None when none was.
pub fn rules_summary(stages: &[Stage]) -> Option<String> {
    let checked: Vec<_> = stages
        .iter()
        .filter_map(|s| s.check.as_ref().map(|c| (s, c)))
        .collect();
    if checked.is_empty() {
        return None;
    }
    let named: usize = stages.iter().map(|s| s.rules.len()).sum();
    let at = |r: CheckResult| -> Vec<String> {
        checked
            .iter()
            .filter(|(_, c)| c.result == r)
            .map(|(s, _)| format!("{}/{}", s.hook.name(), s.table))
            .collect()
    };
    let (dis, und) = (at(CheckResult::Disagrees), at(CheckResult::Undecidable));
    let mut text = format!("{named} rule{} named", if named == 1 { "" } else { "s" });
    if dis.is_empty() && und.is_empty() {
        text.push_str(", the rules agree with the kernel at every stage");
    }
    if !dis.is_empty() {
        let _ = write!(text, ", DISAGREE with the kernel at {}", dis.join(", "));
    }
    if !und.is_empty() {
        let _ = write!(text, ", undecidable at {}", und.join(", "));
    }
    Some(text)
}

/// What ended the traversal, in words.
/// `, by rule filter FORWARD#2 (confirmed by its counter)`, and the like.
fn dropping_rule_text(r: &crate::DroppingRule) -> String {
    let rule = match (&r.table, &r.rule) {
        (Some(t), Some(rule)) => format!("{t} {rule}"),
        (None, Some(rule)) => rule.clone(),
        _ => String::new(),
    };
    let why = r.why.as_deref().unwrap_or("");
    match (r.naming, rule.is_empty()) {
        ("confirmed", false) => format!(", by rule {rule} (confirmed by its counter)"),
        (_, false) => format!(", by rule {rule} (simulated, not confirmed: {why})"),
        (_, true) => format!(", rule not named: {why}"),
    }
}

pub fn fate_text(f: &Fate, egress: Option<&str>, incomplete_reason: Option<&str>) -> String {
    let place = match (f.hook, &f.table) {
        (Some(h), Some(t)) => format!(" in {}/{t}", h.name()),
        (Some(h), None) => format!(" after {}", h.name()),
        (None, _) => f
            .after
            .as_deref()
            .map_or(String::new(), |a| format!(" after {a}")),
    };
    let func = |sep: &str| {
        f.location
            .as_deref()
            .map_or(String::new(), |l| format!("{sep}in {l}"))
    };
    match f.kind {
        FateKind::Dropped => format!(
            "DROPPED{place}{}: {}{}",
            func(", "),
            f.reason.as_deref().unwrap_or("no reason given"),
            f.rule.as_ref().map_or(String::new(), dropping_rule_text)
        ),
        FateKind::Rejected => format!(
            "REJECTED{place}: {}",
            f.reason.as_deref().unwrap_or("no reason given")
        ),
        FateKind::Consumed => format!("consumed by the kernel{place}{}", func(", ")),
        FateKind::Forwarded | FateKind::Sent => match egress {
            Some(e) => format!("{} out {e}", f.kind.name()),
            None => f.kind.name().to_string(),
        },
        FateKind::Delivered => "delivered to a local socket".into(),
        FateKind::Looped => {
            "looped back to this host (left POSTROUTING without an interface)".into()
        }
        FateKind::Reassembled => {
            "fragment merged by defragmentation (PREROUTING, priority -400)".into()
        }
        FateKind::Undecidable => format!(
            "UNDECIDABLE{place}: {}",
            f.reason.as_deref().unwrap_or("the rules cannot tell")
        ),
        FateKind::Incomplete => format!(
            "INCOMPLETE{place}: {}",
            incomplete_reason.unwrap_or("end not seen")
        ),
    }
}

fn render_branch(out: &mut String, i: usize, n: usize, b: &Branch) {
    let _ = writeln!(
        out,
        "  branch {} of {n} (probability {:.4}): {}",
        i + 1,
        b.probability,
        e(&fate_text(
            &b.fate,
            b.egress.as_ref().map(|e| e.iface.as_str()),
            None
        ))
    );
    render_stages(out, "  ", &b.stages, &b.marks, &b.nat);
    for note in &b.notes {
        let _ = writeln!(out, "    note: {}", e(note));
    }
}

impl Traversal {
    /// The readable tree: a header line, one line per table with what it changed (NAT, mark
    /// bits by name, conntrack state), the rules that matched there and any disagreement
    /// between them and the kernel, then the packet's fate and its connection.
    pub fn render_tree(&self) -> String {
        escape_output(self.tree())
    }

    fn tree(&self) -> String {
        let mut out = String::new();
        let _ = write!(
            out,
            "{} {} {}",
            self.family.map_or("?", |f| f.name()),
            self.proto_text(),
            e(&self.flow())
        );
        if let Some(i) = &self.ingress {
            let _ = write!(out, "  in {}", e(&i.iface));
        }
        if let Some(o) = &self.egress {
            let _ = write!(out, "  out {}", e(&o.iface));
        }
        if let Some(r) = self.route {
            let _ = write!(out, "  route {}", r.name());
        }
        if let Some(b) = &self.bridge {
            let _ = match (&b.physdev_in, &b.physdev_out) {
                (Some(i), Some(o)) => write!(out, "  bridge {} {i} -> {o}", b.name),
                (Some(i), None) => write!(out, "  bridge {} from {i}", b.name),
                (None, Some(o)) => write!(out, "  bridge {} to {o}", b.name),
                (None, None) => write!(out, "  bridge {}", b.name),
            };
            if b.flooded {
                out.push_str(" (flooded copy)");
            }
        }
        if let Some(x) = &self.encap {
            let _ = write!(
                out,
                "  {} {} vni {} {} -> {} carrying {} {} -> {}",
                x.kind,
                x.direction.unwrap_or("seen"),
                x.vni,
                e(&x.outer_src.to_string()),
                e(&x.outer_dst.to_string()),
                x.inner.proto.name(),
                e(&x.inner.src.to_string()),
                e(&x.inner.dst.to_string()),
            );
            if let Some(o) = &x.overlay {
                let _ = write!(out, " by {}", e(o));
            }
        }
        if self.source == crate::Source::Predicted {
            out.push_str("  (predicted from the rules)");
        }
        if self.lost > 0 {
            let _ = write!(out, "  [{} packets lost in kernel]", self.lost);
        }
        if self.incomplete && self.fate.kind != FateKind::Incomplete {
            let _ = write!(
                out,
                "  [incomplete: {}]",
                self.incomplete_reason.as_deref().unwrap_or("?")
            );
        }
        out.push('\n');
        for n in &self.notes {
            let _ = writeln!(out, "  note: {}", e(n));
        }
        if self.branches.len() > 1 {
            for (i, b) in self.branches.iter().enumerate() {
                render_branch(&mut out, i, self.branches.len(), b);
            }
            return out;
        }
        render_stages(&mut out, "", &self.stages, &self.marks, &self.nat);
        let _ = writeln!(out, "  => {}", e(&self.fate_text()));
        if let Some(s) = rules_summary(&self.stages) {
            let _ = writeln!(out, "  rules: {s}");
        }
        if let Some(ct) = &self.conntrack {
            let mark = ct
                .mark
                .map_or(String::new(), |m| format!(" (ctmark {m:#x})"));
            let _ = writeln!(
                out,
                "  conntrack: {}{mark}, original {} -> {}, reply {} -> {}",
                ct.state_text(),
                ct.original.src,
                ct.original.dst,
                ct.reply.src,
                ct.reply.dst
            );
        }
        if !self.names.is_empty() {
            let names: Vec<String> = self
                .names
                .iter()
                .map(|n| {
                    format!(
                        "{} = {} {}",
                        e(&n.endpoint.to_string()),
                        n.kind.name(),
                        e(&n.name)
                    )
                })
                .collect();
            let _ = writeln!(out, "  names: {}", names.join(", "));
        }
        out
    }

    /// `src -> dst` as first seen (`?` when no IP header was read).
    pub fn flow(&self) -> String {
        self.packet
            .as_ref()
            .map_or_else(|| "?".into(), |p| p.flow())
    }

    /// The protocol's name (`unknown` when no IP header was read).
    pub fn proto_text(&self) -> std::borrow::Cow<'static, str> {
        self.proto.map_or("unknown".into(), |p| p.name())
    }

    pub fn fate_text(&self) -> String {
        fate_text(
            &self.fate,
            self.egress.as_ref().map(|e| e.iface.as_str()),
            self.incomplete_reason.as_deref(),
        )
    }

    /// One line per packet: flow, interfaces, route, NAT, mark changes, rules, fate.
    pub fn render_line(&self) -> String {
        // One line: a newline carried by a field is escaped too.
        escape_controls(&self.line()).into_owned()
    }

    fn line(&self) -> String {
        let mut parts = vec![format!(
            "{} {} {} [{} -> {}] {}",
            self.family.map_or("?", |f| f.name()),
            self.proto_text(),
            self.flow(),
            self.ingress.as_ref().map_or("-", |i| i.iface.as_str()),
            self.egress.as_ref().map_or("-", |i| i.iface.as_str()),
            self.route.map_or("-", |r| r.name()),
        )];
        if let Some(b) = &self.bridge {
            parts.push(format!("via {}", b.name));
        }
        if let Some(x) = &self.encap {
            parts.push(format!(
                "{} vni {} {}->{}",
                x.kind, x.vni, x.inner.src, x.inner.dst
            ));
        }
        let nat: Vec<String> = self
            .nat
            .iter()
            .map(|n| {
                format!(
                    "{} {}->{}@{}/{}({})",
                    match n.kind {
                        crate::NatKind::Dnat => "DNAT",
                        crate::NatKind::Snat => "SNAT",
                    },
                    n.from,
                    n.to,
                    n.hook.name(),
                    n.table,
                    n.source.name()
                )
            })
            .collect();
        if !nat.is_empty() {
            parts.push(nat.join(" "));
        }
        let marks: Vec<String> = self
            .marks
            .set
            .iter()
            .map(|c| (c, '+'))
            .chain(self.marks.cleared.iter().map(|c| (c, '-')))
            .map(|(c, sign)| format!("{}@{}/{}", mark_word(c, sign), c.hook.name(), c.table))
            .collect();
        if !marks.is_empty() {
            parts.push(marks.join(" "));
        }
        if let Some(s) = rules_summary(&self.stages) {
            parts.push(format!("rules: {s}"));
        }
        parts.push(self.fate_text());
        parts.join(" | ")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::traversal::{ChainRef, Rule, RuleId, Rules, Snapshot, Source};
    use crate::{Hook, NatKind};
    use std::sync::Arc;

    fn ep(text: &str) -> crate::Endpoint {
        let sa: std::net::SocketAddr = text.parse().unwrap();
        crate::Endpoint::new(sa.ip(), Some(sa.port()))
    }

    fn snap(dst: &str, mark: u32) -> Option<Arc<Snapshot>> {
        Some(Arc::new(Snapshot::new(
            ep("10.201.0.7:40000"),
            ep(dst),
            mark,
            None,
            None,
        )))
    }

    fn chain(
        name: &str,
        prio: i32,
        before: (&str, u32),
        after: (&str, u32),
        rules: Rules,
    ) -> Stage {
        Stage {
            hook: Hook::PreRouting,
            table: "kube-proxy".into(),
            priority: prio,
            chain: Some(ChainRef {
                family: "ip".into(),
                name: name.into(),
            }),
            before: snap(before.0, before.1),
            after: snap(after.0, after.1),
            ct: None,
            verdict: Verdict::Accept,
            rules,
            policy: None,
            note: None,
            ipvs: None,
            check: None,
        }
    }

    #[test]
    fn changes_go_to_the_chain_that_made_them_and_rules_sit_beneath() {
        let dnat = Rule {
            id: RuleId::Nft {
                family: "ip".into(),
                table: "kube-proxy".into(),
                chain: "endpoint-X".into(),
                handle: 41,
            },
            text: "meta l4proto tcp dnat to 172.17.0.5:22".into(),
            action: "dnat 172.17.0.5:22".into(),
            mark: None,
            undecidable: None,
            iptables_nft: None,
            k8s: Some(crate::K8s {
                service: "default/registry:ssh".into(),
                endpoint: Some("172.17.0.5:22".into()),
            }),
            calico: None,
        };
        let stages = vec![
            chain(
                "filter-prerouting-pre-dnat",
                -110,
                ("10.10.10.2:22", 0),
                ("10.10.10.2:22", 0),
                Rules::default(),
            ),
            chain(
                "nat-prerouting",
                -100,
                ("10.10.10.2:22", 0),
                ("172.17.0.5:22", 0x4000),
                Rules::new(vec![dnat]),
            ),
        ];
        let t = Traversal {
            schema: crate::SCHEMA,
            source: Source::Predicted,
            netns: None,
            family: Some(crate::Family::Ipv4),
            proto: Some(crate::Protocol::Tcp),
            packet: Some(crate::Packet {
                family: crate::Family::Ipv4,
                proto: crate::Protocol::Tcp,
                first: crate::Headers {
                    src: ep("10.201.0.7:40000"),
                    dst: ep("10.10.10.2:22"),
                    icmp: None,
                },
                last: None,
                ip_id: None,
            }),
            ingress: None,
            egress: None,
            route: Some(crate::Route::Forward),
            bridge: None,
            encap: None,
            marks: crate::mark_changes(&stages, &crate::MarkDictionary::default()),
            nat: vec![Nat {
                kind: NatKind::Dnat,
                hook: Hook::PreRouting,
                table: "kube-proxy".into(),
                from: ep("10.10.10.2:22"),
                to: ep("172.17.0.5:22"),
                source: NatSource::Rules,
            }],
            stages,
            fate: Fate::new(FateKind::Forwarded),
            conntrack: None,
            names: Vec::new(),
            branches: Vec::new(),
            notes: Vec::new(),
            lost: 0,
            incomplete: false,
            incomplete_reason: None,
        };
        let tree = t.render_tree();
        let lines: Vec<&str> = tree.lines().collect();
        assert!(
            lines[0].starts_with("ipv4 tcp 10.201.0.7:40000 -> 10.10.10.2:22")
                && lines[0].ends_with("(predicted from the rules)"),
            "{tree}"
        );
        assert!(
            lines[1].contains("filter-prerouting-pre-dnat") && lines[1].ends_with(" -"),
            "{tree}"
        );
        assert!(
            lines[2].contains("nat-prerouting")
                && lines[2].contains("DNAT 10.10.10.2:22 -> 172.17.0.5:22 (nat rules)")
                && lines[2].contains("+0x4000 kube-proxy:masquerade"),
            "{tree}"
        );
        assert_eq!(
            lines[3].trim(),
            "endpoint-X handle 41 meta l4proto tcp dnat to 172.17.0.5:22  => dnat 172.17.0.5:22  [k8s default/registry:ssh]"
        );
        assert!(
            t.render_line()
                .contains("DNAT 10.10.10.2:22->172.17.0.5:22@PREROUTING/kube-proxy(rules)")
        );
        // A bridged frame names the bridge and its ports in the header, the bridge in a line.
        let mut b = t.clone();
        b.route = Some(crate::Route::Bridged);
        b.bridge = Some(crate::BridgeCrossing {
            name: "cni0".into(),
            physdev_in: Some("veth2c3d4e5f".into()),
            physdev_out: Some("veth1a2b3c4d".into()),
            flooded: false,
        });
        let tree = b.render_tree();
        assert!(
            tree.lines()
                .next()
                .unwrap()
                .contains("  route bridged  bridge cni0 veth2c3d4e5f -> veth1a2b3c4d  (predicted"),
            "{tree}"
        );
        assert!(
            b.render_line().contains("] bridged | via cni0"),
            "{}",
            b.render_line()
        );
        b.bridge.as_mut().unwrap().physdev_out = None;
        assert!(b.render_tree().contains("  bridge cni0 from veth2c3d4e5f"));
        let copy = b.bridge.as_mut().unwrap();
        (copy.physdev_in, copy.physdev_out, copy.flooded) =
            (None, Some("veth2c3d4e5f".into()), true);
        assert!(
            b.render_tree()
                .contains("  bridge cni0 to veth2c3d4e5f (flooded copy)"),
            "{}",
            b.render_tree()
        );
    }

    #[test]
    fn control_characters_from_rules_and_names_are_escaped() {
        let rule = Rule {
            id: RuleId::Iptables {
                table: "filter".into(),
                chain: "IN\x1b[2J".into(),
                index: 1,
            },
            text: "-A IN\x1b[2J -m comment --comment \"a\nb\u{202e}c\"".into(),
            action: "accept\r".into(),
            mark: None,
            undecidable: Some("why\x07".into()),
            iptables_nft: None,
            k8s: None,
            calico: None,
        };
        let mut st = chain(
            "evil\nchain",
            0,
            ("10.0.0.1:80", 0),
            ("10.0.0.1:80", 0),
            Rules::new(vec![rule]),
        );
        st.note = Some("note\x1b]0;title\x07".into());
        let t = Traversal {
            schema: crate::SCHEMA,
            source: Source::Predicted,
            netns: None,
            family: Some(crate::Family::Ipv4),
            proto: Some(crate::Protocol::Tcp),
            packet: Some(crate::Packet {
                family: crate::Family::Ipv4,
                proto: crate::Protocol::Tcp,
                first: crate::Headers {
                    src: ep("10.0.0.9:1"),
                    dst: ep("10.0.0.1:80"),
                    icmp: None,
                },
                last: None,
                ip_id: None,
            }),
            ingress: Some(crate::traversal::Iface {
                iface: "eth0\x1b[31m".into(),
            }),
            egress: None,
            route: None,
            bridge: None,
            encap: None,
            marks: Default::default(),
            nat: Vec::new(),
            stages: vec![st],
            fate: Fate::new(FateKind::Forwarded),
            conntrack: None,
            names: Vec::new(),
            branches: Vec::new(),
            notes: vec!["from a recording\n  => ACCEPTED".into()],
            lost: 0,
            incomplete: false,
            incomplete_reason: None,
        };
        for out in [t.render_tree(), t.render_line()] {
            assert!(!out.chars().any(|c| c != '\n' && is_unsafe(c)), "{out:?}");
            assert!(out.contains("eth0\\u{1b}[31m"), "{out}");
        }
        let tree = t.render_tree();
        assert!(tree.contains("IN\\u{1b}[2J"), "{tree}");
        assert!(tree.contains("a\\nb\\u{202e}c"), "{tree}");
        assert!(tree.contains("evil\\nchain"), "{tree}");
        // A newline in data never starts a line of its own.
        assert!(
            !tree
                .lines()
                .any(|l| l.trim_start().starts_with("=> ACCEPTED")),
            "{tree}"
        );
        assert_eq!(t.render_line().lines().count(), 1);
    }
}
