//! The JSON line of a [`Traversal`], written by hand into one writer: keys and punctuation
//! as literals, strings escaped only when they need it, addresses written without an
//! intermediate string, snapshots and rules rendered once and copied from then on (they
//! are shared by the reports of a flow). serde's derive on the types is the schema's definition (and
//! what `serde_json::to_value` uses); this writer prints the same bytes, held to it by the
//! tests below, because escaping every key again for every packet was most of the
//! collector's cost of a JSON line.

use std::io::{self, Write};

use serde::Serialize;

use crate::packet::{Endpoint, Headers, Host, Icmp, Packet};
use crate::traversal::{
    Branch, ChainRef, Check, CheckResult, ConntrackView, CtView, Fate, Iface, MarkChange, Marks,
    Nat, NatKind, NatSource, Snapshot, Source, Stage, Traversal, TupleView, ct_state_text,
};

/// A leaf value as serde_json writes it (numbers, and strings that need escaping).
fn serde<W: Write, T: Serialize + ?Sized>(out: &mut W, v: &T) -> io::Result<()> {
    serde_json::to_writer(out, v).map_err(io::Error::from)
}

/// A JSON string: copied between quotes when nothing in it needs escaping (the common
/// case), else escaped by serde_json.
fn string<W: Write>(out: &mut W, s: &str) -> io::Result<()> {
    if s.bytes().all(|b| b >= 0x20 && b != b'"' && b != b'\\') {
        out.write_all(b"\"")?;
        out.write_all(s.as_bytes())?;
        out.write_all(b"\"")
    } else {
        serde(out, s)
    }
}

/// A word that never needs escaping (the schema's enum words, hook names, hex).
fn word<W: Write>(out: &mut W, w: &str) -> io::Result<()> {
    debug_assert!(w.bytes().all(|b| b >= 0x20 && b != b'"' && b != b'\\'));
    out.write_all(b"\"")?;
    out.write_all(w.as_bytes())?;
    out.write_all(b"\"")
}

fn opt<W: Write, T>(
    out: &mut W,
    v: Option<T>,
    f: impl FnOnce(&mut W, T) -> io::Result<()>,
) -> io::Result<()> {
    match v {
        Some(v) => f(out, v),
        None => out.write_all(b"null"),
    }
}

fn opt_string<W: Write>(out: &mut W, s: Option<&str>) -> io::Result<()> {
    opt(out, s, string)
}

/// `"0x1f"`, as the schema writes marks (`{:#x}`).
fn hex<W: Write>(out: &mut W, v: u32) -> io::Result<()> {
    let mut buf = *b"\"0x00000000\"";
    let digits = (32 - v.leading_zeros()).div_ceil(4).max(1) as usize;
    for i in 0..digits {
        let nibble = (v >> (4 * i)) & 0xf;
        buf[2 + digits - i] = b"0123456789abcdef"[nibble as usize];
    }
    buf[3 + digits] = b'"';
    out.write_all(&buf[..4 + digits])
}

fn list<W: Write, T>(
    out: &mut W,
    items: &[T],
    mut f: impl FnMut(&mut W, &T) -> io::Result<()>,
) -> io::Result<()> {
    out.write_all(b"[")?;
    for (i, item) in items.iter().enumerate() {
        if i > 0 {
            out.write_all(b",")?;
        }
        f(out, item)?;
    }
    out.write_all(b"]")
}

fn iface<W: Write>(out: &mut W, i: &Iface) -> io::Result<()> {
    out.write_all(b"{\"iface\":")?;
    string(out, &i.iface)?;
    out.write_all(b"}")
}

fn source(s: Source) -> &'static str {
    match s {
        Source::Observed => "observed",
        Source::Predicted => "predicted",
    }
}

fn snapshot<W: Write>(out: &mut W, s: Option<&Snapshot>) -> io::Result<()> {
    opt(out, s, |out, s| {
        let json = s.json_cache().get_or_init(|| {
            serde_json::to_string(&s.fields())
                .expect("a snapshot serialises")
                .into_boxed_str()
        });
        out.write_all(json.as_bytes())
    })
}

/// An endpoint as a JSON string (`"10.0.0.1:53"`), written straight into `out`.
fn endpoint<W: Write>(out: &mut W, e: &Endpoint) -> io::Result<()> {
    if e.plain() {
        out.write_all(b"\"")?;
        e.write_text(out)?;
        out.write_all(b"\"")
    } else {
        string(out, &e.to_string())
    }
}

/// An address alone as a JSON string.
fn host<W: Write>(out: &mut W, h: &Host) -> io::Result<()> {
    match h {
        Host::Ip(_) => {
            out.write_all(b"\"")?;
            h.write_text(out)?;
            out.write_all(b"\"")
        }
        Host::AddressOf(_) => string(out, &h.to_string()),
    }
}

fn port<W: Write>(out: &mut W, p: Option<u16>) -> io::Result<()> {
    opt(out, p, |out, p| serde(out, &p))
}

fn icmp<W: Write>(out: &mut W, i: &Icmp) -> io::Result<()> {
    out.write_all(b"{\"type\":")?;
    serde(out, &i.kind)?;
    out.write_all(b",\"code\":")?;
    serde(out, &i.code)?;
    out.write_all(b",\"id\":")?;
    port(out, i.id)?;
    out.write_all(b"}")
}

/// The keys of one set of headers, without braces.
fn header_keys<W: Write>(out: &mut W, h: &Headers) -> io::Result<()> {
    out.write_all(b"\"src\":")?;
    host(out, &h.src.host)?;
    out.write_all(b",\"dst\":")?;
    host(out, &h.dst.host)?;
    out.write_all(b",\"sport\":")?;
    port(out, h.src.port)?;
    out.write_all(b",\"dport\":")?;
    port(out, h.dst.port)?;
    out.write_all(b",\"icmp\":")?;
    opt(out, h.icmp.as_ref(), icmp)
}

fn packet<W: Write>(out: &mut W, p: &Packet) -> io::Result<()> {
    out.write_all(b"{\"family\":")?;
    word(out, p.family.name())?;
    out.write_all(b",\"proto\":")?;
    string(out, &p.proto.name())?;
    out.write_all(b",")?;
    header_keys(out, &p.first)?;
    out.write_all(b",\"last\":")?;
    opt(out, p.last.as_ref(), |out, h| {
        out.write_all(b"{")?;
        header_keys(out, h)?;
        out.write_all(b"}")
    })?;
    if let Some(id) = p.ip_id {
        write!(out, ",\"ip_id\":{id}")?;
    }
    out.write_all(b"}")
}

fn chain<W: Write>(out: &mut W, c: &ChainRef) -> io::Result<()> {
    out.write_all(b"{\"family\":")?;
    string(out, &c.family)?;
    out.write_all(b",\"name\":")?;
    string(out, &c.name)?;
    out.write_all(b"}")
}

fn ct<W: Write>(out: &mut W, c: &CtView) -> io::Result<()> {
    out.write_all(b"{\"state\":")?;
    word(out, c.state.name())?;
    out.write_all(b",\"mark\":")?;
    opt(out, c.mark, hex)?;
    out.write_all(b"}")
}

fn check<W: Write>(out: &mut W, c: &Check) -> io::Result<()> {
    out.write_all(b"{\"result\":")?;
    word(
        out,
        match c.result {
            CheckResult::Agrees => "agrees",
            CheckResult::Disagrees => "disagrees",
            CheckResult::Undecidable => "undecidable",
        },
    )?;
    out.write_all(b",\"disagreements\":")?;
    list(out, &c.disagreements, |out, d| string(out, d))?;
    out.write_all(b",\"reason\":")?;
    opt_string(out, c.reason.as_deref())?;
    out.write_all(b"}")
}

fn stage<W: Write>(out: &mut W, s: &Stage) -> io::Result<()> {
    out.write_all(b"{\"hook\":")?;
    word(out, s.hook.name())?;
    out.write_all(b",\"table\":")?;
    string(out, &s.table)?;
    out.write_all(b",\"priority\":")?;
    serde(out, &s.priority)?;
    if let Some(c) = &s.chain {
        out.write_all(b",\"chain\":")?;
        chain(out, c)?;
    }
    out.write_all(b",\"before\":")?;
    snapshot(out, s.before.as_deref())?;
    out.write_all(b",\"after\":")?;
    snapshot(out, s.after.as_deref())?;
    out.write_all(b",\"ct\":")?;
    opt(out, s.ct.as_deref(), ct)?;
    out.write_all(b",\"verdict\":")?;
    word(out, s.verdict.name())?;
    out.write_all(b",\"rules\":")?;
    out.write_all(s.rules.json().as_bytes())?;
    if let Some(p) = &s.policy {
        out.write_all(b",\"policy\":")?;
        string(out, p)?;
    }
    if let Some(n) = &s.note {
        out.write_all(b",\"note\":")?;
        string(out, n)?;
    }
    if let Some(i) = &s.ipvs {
        out.write_all(b",\"ipvs\":")?;
        serde(out, &**i)?;
    }
    if let Some(c) = &s.check {
        out.write_all(b",\"check\":")?;
        check(out, c)?;
    }
    out.write_all(b"}")
}

fn fate<W: Write>(out: &mut W, f: &Fate) -> io::Result<()> {
    out.write_all(b"{\"kind\":")?;
    word(out, f.kind.name())?;
    out.write_all(b",\"hook\":")?;
    opt(out, f.hook, |out, h| word(out, h.name()))?;
    out.write_all(b",\"table\":")?;
    opt_string(out, f.table.as_deref())?;
    out.write_all(b",\"reason\":")?;
    opt_string(out, f.reason.as_deref())?;
    out.write_all(b",\"location\":")?;
    opt_string(out, f.location.as_deref())?;
    out.write_all(b",\"after\":")?;
    opt_string(out, f.after.as_deref())?;
    out.write_all(b",\"before\":")?;
    opt_string(out, f.before.as_deref())?;
    if let Some(r) = &f.rule {
        out.write_all(b",\"rule\":{\"naming\":")?;
        word(out, r.naming)?;
        out.write_all(b",\"table\":")?;
        opt_string(out, r.table.as_deref())?;
        out.write_all(b",\"chain\":")?;
        opt_string(out, r.chain.as_deref())?;
        out.write_all(b",\"rule\":")?;
        opt_string(out, r.rule.as_deref())?;
        out.write_all(b",\"why\":")?;
        opt_string(out, r.why.as_deref())?;
        out.write_all(b"}")?;
    }
    out.write_all(b"}")
}

fn mark_change<W: Write>(out: &mut W, c: &MarkChange) -> io::Result<()> {
    out.write_all(b"{\"bit\":")?;
    hex(out, c.bit)?;
    out.write_all(b",\"name\":")?;
    opt_string(out, c.name.as_deref())?;
    out.write_all(b",\"hook\":")?;
    word(out, c.hook.name())?;
    out.write_all(b",\"table\":")?;
    string(out, &c.table)?;
    out.write_all(b"}")
}

fn marks<W: Write>(out: &mut W, m: &Marks) -> io::Result<()> {
    out.write_all(b"{\"set\":")?;
    list(out, &m.set, mark_change)?;
    out.write_all(b",\"cleared\":")?;
    list(out, &m.cleared, mark_change)?;
    out.write_all(b"}")
}

fn nat<W: Write>(out: &mut W, n: &Nat) -> io::Result<()> {
    out.write_all(match n.kind {
        NatKind::Dnat => b"{\"kind\":\"dnat\",\"hook\":",
        NatKind::Snat => b"{\"kind\":\"snat\",\"hook\":",
    })?;
    word(out, n.hook.name())?;
    out.write_all(b",\"table\":")?;
    string(out, &n.table)?;
    out.write_all(b",\"from\":")?;
    endpoint(out, &n.from)?;
    out.write_all(b",\"to\":")?;
    endpoint(out, &n.to)?;
    out.write_all(match n.source {
        NatSource::Rules => b",\"source\":\"rules\"}",
        NatSource::Conntrack => b",\"source\":\"conntrack\"}",
        NatSource::Ipvs => b",\"source\":\"ipvs\"}",
    })
}

fn tuple<W: Write>(out: &mut W, t: &TupleView) -> io::Result<()> {
    out.write_all(b"{\"src\":")?;
    endpoint(out, &t.src)?;
    out.write_all(b",\"dst\":")?;
    endpoint(out, &t.dst)?;
    out.write_all(b",\"proto\":")?;
    string(out, &t.proto.name())?;
    out.write_all(b"}")
}

fn conntrack<W: Write>(out: &mut W, c: &ConntrackView) -> io::Result<()> {
    out.write_all(b"{\"state\":")?;
    word(out, &ct_state_text(c.state))?;
    out.write_all(b",\"mark\":")?;
    opt(out, c.mark, hex)?;
    out.write_all(b",\"original\":")?;
    tuple(out, &c.original)?;
    out.write_all(b",\"reply\":")?;
    tuple(out, &c.reply)?;
    out.write_all(b"}")
}

/// Stages, fate, marks and nat: what a traversal and a branch share, in this order.
fn outcome<W: Write>(
    out: &mut W,
    stages: &[Stage],
    f: &Fate,
    m: &Marks,
    n: &[Nat],
) -> io::Result<()> {
    out.write_all(b",\"stages\":")?;
    list(out, stages, stage)?;
    out.write_all(b",\"fate\":")?;
    fate(out, f)?;
    out.write_all(b",\"marks\":")?;
    marks(out, m)?;
    out.write_all(b",\"nat\":")?;
    list(out, n, nat)
}

fn route<W: Write>(out: &mut W, r: Option<crate::Route>) -> io::Result<()> {
    out.write_all(b",\"route\":")?;
    opt(out, r, |out, r| word(out, r.name()))
}

fn branch<W: Write>(out: &mut W, b: &Branch) -> io::Result<()> {
    out.write_all(b"{\"probability\":")?;
    serde(out, &b.probability)?;
    route(out, b.route)?;
    out.write_all(b",\"egress\":")?;
    opt(out, b.egress.as_ref(), iface)?;
    outcome(out, &b.stages, &b.fate, &b.marks, &b.nat)?;
    out.write_all(b",\"notes\":")?;
    list(out, &b.notes, |out, n| string(out, n))?;
    out.write_all(b"}")
}

/// Writes `t` as one JSON object (no newline).
pub fn write_traversal<W: Write>(out: &mut W, t: &Traversal) -> io::Result<()> {
    out.write_all(b"{\"schema\":")?;
    serde(out, &t.schema)?;
    out.write_all(b",\"source\":")?;
    word(out, source(t.source))?;
    out.write_all(b",\"netns\":")?;
    opt_string(out, t.netns.as_deref())?;
    out.write_all(b",\"family\":")?;
    opt(out, t.family, |out, f| word(out, f.name()))?;
    out.write_all(b",\"proto\":")?;
    opt(out, t.proto, |out, p| string(out, &p.name()))?;
    out.write_all(b",\"packet\":")?;
    opt(out, t.packet.as_ref(), packet)?;
    out.write_all(b",\"ingress\":")?;
    opt(out, t.ingress.as_ref(), iface)?;
    out.write_all(b",\"egress\":")?;
    opt(out, t.egress.as_ref(), iface)?;
    route(out, t.route)?;
    if let Some(b) = &t.bridge {
        out.write_all(b",\"bridge\":{\"name\":")?;
        string(out, &b.name)?;
        out.write_all(b",\"physdev_in\":")?;
        opt_string(out, b.physdev_in.as_deref())?;
        out.write_all(b",\"physdev_out\":")?;
        opt_string(out, b.physdev_out.as_deref())?;
        out.write_all(if b.flooded {
            b",\"flooded\":true}"
        } else {
            b",\"flooded\":false}"
        })?;
    }
    if let Some(e) = &t.encap {
        out.write_all(b",\"encap\":")?;
        serde(out, e)?;
    }
    outcome(out, &t.stages, &t.fate, &t.marks, &t.nat)?;
    out.write_all(b",\"conntrack\":")?;
    opt(out, t.conntrack.as_deref(), conntrack)?;
    if !t.names.is_empty() {
        out.write_all(b",\"names\":")?;
        list(out, &t.names, |out, n| {
            out.write_all(b"{\"endpoint\":")?;
            endpoint(out, &n.endpoint)?;
            out.write_all(b",\"kind\":")?;
            word(out, n.kind.name())?;
            out.write_all(b",\"name\":")?;
            string(out, &n.name)?;
            out.write_all(b"}")
        })?;
    }
    if !t.branches.is_empty() {
        out.write_all(b",\"branches\":")?;
        list(out, &t.branches, branch)?;
    }
    if !t.notes.is_empty() {
        out.write_all(b",\"notes\":")?;
        list(out, &t.notes, |out, n| string(out, n))?;
    }
    out.write_all(b",\"lost\":")?;
    serde(out, &t.lost)?;
    out.write_all(if t.incomplete {
        b",\"incomplete\":true,\"incomplete_reason\":"
    } else {
        b",\"incomplete\":false,\"incomplete_reason\":"
    })?;
    opt_string(out, t.incomplete_reason.as_deref())?;
    out.write_all(b"}")
}

impl Traversal {
    /// The JSON line (no newline): the same bytes as `serde_json::to_string(self)`.
    pub fn to_json_line(&self) -> String {
        let mut out = Vec::with_capacity(4096);
        self.write_json(&mut out)
            .expect("writing into memory cannot fail");
        String::from_utf8(out).expect("JSON written from strings is UTF-8")
    }

    /// Writes the JSON line (no newline) straight into `out`, without an intermediate string
    /// (the same bytes as `serde_json::to_writer`).
    pub fn write_json<W: Write>(&self, mut out: W) -> io::Result<()> {
        write_traversal(&mut out, self)
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::traversal::{EndpointName, K8s, NameKind, Quoted, Rule, RuleId, Rules};
    use crate::{CtState, Family, FateKind, Hook, Protocol, Route, Verdict};

    /// `a.b.c.d[:port]`, `[v6]:port` or a bare v6 address; anything else is an unknown
    /// address named by that text.
    fn ep(text: &str) -> Endpoint {
        if let Ok(sa) = text.parse::<std::net::SocketAddr>() {
            return Endpoint::new(sa.ip(), Some(sa.port()));
        }
        if let Ok(a) = text.parse() {
            return Endpoint::new(a, None);
        }
        Endpoint {
            host: Host::AddressOf(text.into()),
            port: Some(7),
        }
    }

    /// The writer and serde's derive print the same bytes for `t`.
    fn same(t: &Traversal) {
        let derived = serde_json::to_string(t).unwrap();
        assert_eq!(t.to_json_line(), derived);
        let mut w = Vec::new();
        t.write_json(&mut w).unwrap();
        assert_eq!(String::from_utf8(w).unwrap(), derived);
    }

    /// Text that needs every kind of escape, and some that needs none but is not ASCII.
    const AWKWARD: &str =
        "a \"quoted\" back\\slash, new\nline\ttab\r\u{1}\u{8}\u{c}\u{1f} é ✓ \u{7f} /";

    fn snap(src: &str, dst: &str, mark: u32, len: Option<u32>, inner: bool) -> Arc<Snapshot> {
        Arc::new(Snapshot::new(
            ep(src),
            ep(dst),
            mark,
            len,
            inner.then(|| Quoted {
                src: ep("10.0.0.1:53"),
                dst: ep("10.0.0.2:40000"),
                proto: Protocol::Udp,
            }),
        ))
    }

    fn rules() -> Rules {
        Rules::new(vec![
            Rule {
                id: RuleId::Iptables {
                    table: "nat".into(),
                    chain: "KUBE-SEP-X".into(),
                    index: 2,
                },
                text: format!("-A KUBE-SEP-X -m comment --comment {AWKWARD}"),
                action: "DNAT 172.17.0.5:22".into(),
                mark: Some((0, 0x4000)),
                undecidable: None,
                iptables_nft: Some(("ip".into(), 17)),
                k8s: Some(K8s {
                    service: "default/registry:ssh".into(),
                    endpoint: Some("172.17.0.5:22".into()),
                }),
                calico: None,
            },
            Rule {
                id: RuleId::Nft {
                    family: "inet".into(),
                    table: "kube-proxy".into(),
                    chain: "services".into(),
                    handle: u64::MAX,
                },
                text: "ip daddr 10.10.10.2 goto svc".into(),
                action: "goto svc".into(),
                mark: None,
                undecidable: Some(AWKWARD.into()),
                iptables_nft: None,
                k8s: Some(K8s {
                    service: "kube-system/dns".into(),
                    endpoint: None,
                }),
                calico: Some("abc_123".into()),
            },
        ])
    }

    fn stages() -> Vec<Stage> {
        let plain = snap("198.51.100.10:40000", "10.10.10.2:22", 0, Some(60), false);
        vec![
            Stage {
                hook: Hook::PreRouting,
                table: "raw".into(),
                priority: -300,
                chain: None,
                before: Some(plain.clone()),
                after: Some(plain),
                ct: None,
                verdict: Verdict::Accept,
                rules: Rules::default(),
                policy: None,
                note: None,
                ipvs: None,
                check: None,
            },
            Stage {
                hook: Hook::Forward,
                table: AWKWARD.into(),
                priority: i32::MIN,
                chain: Some(ChainRef {
                    family: "ip6".into(),
                    name: AWKWARD.into(),
                }),
                before: Some(snap("[2001:db8::1]:80", "fe80::1", u32::MAX, None, true)),
                after: None,
                ct: Some(Arc::new(CtView {
                    state: CtState::Established,
                    mark: Some(0xdead_beef),
                })),
                verdict: Verdict::Undecidable,
                rules: rules(),
                policy: Some("DROP".into()),
                note: Some(AWKWARD.into()),
                ipvs: None,
                check: Some(Arc::new(Check {
                    result: CheckResult::Disagrees,
                    disagreements: vec!["one".into(), AWKWARD.into()],
                    reason: Some(AWKWARD.into()),
                })),
            },
            Stage {
                hook: Hook::PostRouting,
                table: "prio:7".into(),
                priority: i32::MAX,
                chain: None,
                before: None,
                after: Some(snap("1.2.3.4", "5.6.7.8", 0x10, Some(0), false)),
                ct: Some(Arc::new(CtView {
                    state: CtState::Invalid,
                    mark: None,
                })),
                verdict: Verdict::Stolen,
                rules: Rules::new(Vec::new()),
                policy: None,
                note: None,
                ipvs: None,
                check: Some(Arc::new(Check {
                    result: CheckResult::Undecidable,
                    disagreements: Vec::new(),
                    reason: None,
                })),
            },
        ]
    }

    fn fate() -> Fate {
        Fate {
            kind: FateKind::Dropped,
            hook: Some(Hook::Forward),
            table: Some(AWKWARD.into()),
            reason: Some("NETFILTER_DROP".into()),
            location: Some(AWKWARD.into()),
            after: Some("FORWARD/-149".into()),
            before: Some("FORWARD/1".into()),
            rule: None,
        }
    }

    fn marks() -> Marks {
        Marks {
            set: vec![MarkChange {
                bit: 0x4000,
                name: Some("kube-proxy:masquerade".into()),
                hook: Hook::PreRouting,
                table: "nat".into(),
            }],
            cleared: vec![
                MarkChange {
                    bit: 1,
                    name: None,
                    hook: Hook::LocalOut,
                    table: AWKWARD.into(),
                },
                MarkChange {
                    bit: 0x8000_0000,
                    name: Some(AWKWARD.into()),
                    hook: Hook::LocalIn,
                    table: "mangle".into(),
                },
            ],
        }
    }

    fn nat() -> Vec<Nat> {
        vec![
            Nat {
                kind: NatKind::Dnat,
                hook: Hook::PreRouting,
                table: "nat".into(),
                from: ep("10.10.10.2:22"),
                to: ep(AWKWARD),
                source: NatSource::Rules,
            },
            Nat {
                kind: NatKind::Snat,
                hook: Hook::PostRouting,
                table: "nat".into(),
                from: ep("[2001:db8::1]:80"),
                to: ep("172.17.0.1:40000"),
                source: NatSource::Conntrack,
            },
        ]
    }

    fn full() -> Traversal {
        Traversal {
            schema: crate::SCHEMA,
            source: Source::Observed,
            netns: Some(AWKWARD.into()),
            family: Some(Family::Ipv6),
            proto: Some(Protocol::Other(253)),
            packet: Some(Packet {
                family: Family::Ipv6,
                proto: Protocol::Icmpv6,
                first: Headers {
                    src: ep("2001:db8::1"),
                    dst: ep("ff02::1"),
                    icmp: Some(Icmp {
                        kind: 128,
                        code: 0,
                        id: Some(65535),
                    }),
                },
                last: Some(Headers {
                    src: ep(AWKWARD),
                    dst: ep("[2001:db8::2]:0"),
                    icmp: Some(Icmp {
                        kind: 1,
                        code: 4,
                        id: None,
                    }),
                }),
                ip_id: Some(65535),
            }),
            ingress: Some(Iface {
                iface: "eth0".into(),
            }),
            egress: Some(Iface {
                iface: AWKWARD.into(),
            }),
            route: Some(Route::Forward),
            bridge: Some(crate::BridgeCrossing {
                name: "cni0".into(),
                physdev_in: Some("veth1a2b3c4d".into()),
                physdev_out: None,
                flooded: false,
            }),
            encap: Some(crate::Encapsulation {
                kind: "vxlan",
                direction: Some("decapsulated"),
                vni: 1,
                outer_src: ep("192.168.60.1:49774"),
                outer_dst: ep("192.168.60.2:4789"),
                inner: crate::Quoted {
                    src: ep("10.244.0.5:40000"),
                    dst: ep("10.244.1.5:8080"),
                    proto: Protocol::Tcp,
                },
                overlay: Some(AWKWARD.into()),
                inner_ip_id: None,
            }),
            stages: stages(),
            fate: fate(),
            marks: marks(),
            nat: nat(),
            conntrack: Some(Arc::new(ConntrackView {
                state: (CtState::Established, true),
                mark: Some(0),
                original: TupleView {
                    src: ep("198.51.100.10:40000"),
                    dst: ep("10.10.10.2:22"),
                    proto: Protocol::Tcp,
                },
                reply: TupleView {
                    src: ep(AWKWARD),
                    dst: ep("fe80::1"),
                    proto: Protocol::Other(58),
                },
            })),
            names: vec![
                EndpointName {
                    endpoint: ep("10.10.10.10:53"),
                    kind: NameKind::Service,
                    name: "kube-system/kube-dns:dns".into(),
                },
                EndpointName {
                    endpoint: ep(AWKWARD),
                    kind: NameKind::Pod,
                    name: AWKWARD.into(),
                },
            ],
            branches: Vec::new(),
            notes: vec![AWKWARD.into(), "plain".into()],
            lost: u64::MAX,
            incomplete: true,
            incomplete_reason: Some(AWKWARD.into()),
        }
    }

    #[test]
    fn the_writer_prints_what_serde_prints() {
        let t = full();
        same(&t);
        // A drop seen only where it died, its rule named.
        let mut sampled = full();
        sampled.fate.rule = Some(crate::DroppingRule {
            naming: "unconfirmed",
            table: Some("filter".into()),
            chain: None,
            rule: Some(AWKWARD.into()),
            why: Some(AWKWARD.into()),
        });
        same(&sampled);
        // Every optional part absent or empty.
        let bare = Traversal {
            source: Source::Predicted,
            netns: None,
            family: None,
            proto: None,
            packet: None,
            ingress: None,
            egress: None,
            route: None,
            bridge: None,
            stages: Vec::new(),
            fate: Fate::new(FateKind::Incomplete),
            marks: Marks::default(),
            nat: Vec::new(),
            conntrack: None,
            names: Vec::new(),
            notes: Vec::new(),
            lost: 0,
            incomplete: false,
            incomplete_reason: None,
            ..full()
        };
        same(&bare);
        // Random branches, with probabilities that print long.
        let branches = Traversal {
            branches: [1.0 / 3.0, 0.5, 1e-7, 1.0, 0.0]
                .into_iter()
                .enumerate()
                .map(|(i, p)| Branch {
                    probability: p,
                    route: [None, Some(Route::Unroutable), Some(Route::Unknown)][i % 3],
                    egress: (i % 2 == 0).then(|| Iface {
                        iface: format!("cali{i}"),
                    }),
                    stages: if i == 0 { stages() } else { Vec::new() },
                    fate: if i == 1 {
                        fate()
                    } else {
                        Fate::new(FateKind::Sent)
                    },
                    marks: if i == 2 { marks() } else { Marks::default() },
                    nat: if i == 3 { nat() } else { Vec::new() },
                    bridge: None,
                    notes: if i == 4 {
                        vec![AWKWARD.into()]
                    } else {
                        Vec::new()
                    },
                })
                .collect(),
            ..bare
        };
        same(&branches);
    }

    #[test]
    fn every_word_of_the_schema_prints_as_serde_spells_it() {
        let fates = [
            FateKind::Delivered,
            FateKind::Forwarded,
            FateKind::Sent,
            FateKind::Dropped,
            FateKind::Rejected,
            FateKind::Consumed,
            FateKind::Looped,
            FateKind::Reassembled,
            FateKind::Incomplete,
            FateKind::Undecidable,
        ];
        let verdicts = [
            Verdict::Accept,
            Verdict::Drop,
            Verdict::Reject,
            Verdict::Stolen,
            Verdict::Unknown,
            Verdict::Undecidable,
        ];
        let routes = [
            Route::Input,
            Route::Forward,
            Route::Output,
            Route::Bridged,
            Route::Unroutable,
            Route::Unknown,
        ];
        let checks = [
            CheckResult::Agrees,
            CheckResult::Disagrees,
            CheckResult::Undecidable,
        ];
        for (i, kind) in fates.into_iter().enumerate() {
            let mut t = full();
            t.fate.kind = kind;
            t.fate.hook = Some(Hook::ALL[i % 5]);
            t.route = Some(routes[i % routes.len()]);
            t.source = [Source::Observed, Source::Predicted][i % 2];
            t.family = Some(Family::ALL[i % 2]);
            for (j, s) in t.stages.iter_mut().enumerate() {
                s.verdict = verdicts[(i + j) % verdicts.len()];
                s.hook = Hook::ALL[(i + j) % 5];
                if let Some(c) = &mut s.check {
                    Arc::make_mut(c).result = checks[(i + j) % checks.len()];
                }
                // Every other stage an IPVS step, with a real server or without one.
                s.ipvs = ((i + j) % 2 == 0).then(|| {
                    Arc::new(crate::IpvsStep {
                        service: "TCP  10.10.10.2:22 rr".into(),
                        scheduler: "rr".into(),
                        real_server: (j % 2 == 0).then(|| "172.17.0.5:22".into()),
                        forward: (j % 2 == 0).then(|| "Masq".into()),
                        weight: (j % 2 == 0).then_some(1),
                        chosen_by: "scheduler".into(),
                        candidates: 2,
                    })
                });
            }
            for (j, n) in t.nat.iter_mut().enumerate() {
                n.kind = [NatKind::Dnat, NatKind::Snat][(i + j) % 2];
                n.source =
                    [NatSource::Rules, NatSource::Conntrack, NatSource::Ipvs][(i / 2 + j) % 3];
                n.hook = Hook::ALL[(i + j + 1) % 5];
            }
            same(&t);
        }
    }

    #[test]
    fn marks_print_in_hex_like_format() {
        for v in [
            0,
            1,
            9,
            0xa,
            0xf,
            0x10,
            0xff,
            0x4000,
            0x14000,
            0x8000_0000,
            u32::MAX,
        ] {
            let mut w = Vec::new();
            hex(&mut w, v).unwrap();
            assert_eq!(String::from_utf8(w).unwrap(), format!("\"{v:#x}\""));
        }
    }
}
