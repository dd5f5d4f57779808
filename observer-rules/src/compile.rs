//! Gives meaning to parsed rules: each match becomes a [`Cond`] the simulator can evaluate and
//! each target an [`Action`]. Anything we do not model becomes `Cond::Unknown` /
//! `Action::Unknown` holding the original text, so the simulator reports "undecidable" there.

use std::net::IpAddr;

use crate::iptables::{Basic, Item, Opt, Rule, Target};
use crate::net::{Net, parse_mark_mask, parse_u32};
use crate::packet::{
    CT_DNAT, CT_ESTABLISHED, CT_INVALID, CT_NEW, CT_RELATED, CT_SNAT, CT_UNTRACKED, TCP_ACK,
    TCP_FIN, TCP_RST, TCP_SYN, proto_number, tcp_flag,
};

#[derive(Debug, Clone, PartialEq)]
pub enum Cond {
    Src(Net, bool),
    Dst(Net, bool),
    /// Protocol number; `None` is `all`.
    Proto(Option<u8>, bool),
    InIface(String, bool),
    OutIface(String, bool),
    Fragment(bool),
    Mark {
        value: u32,
        mask: u32,
        neg: bool,
    },
    ConnMark {
        value: u32,
        mask: u32,
        neg: bool,
    },
    CtState {
        /// `crate::packet::CT_*` bits.
        states: u16,
        neg: bool,
    },
    Set {
        name: String,
        dirs: Vec<bool>,
        neg: bool,
    },
    AddrType {
        src: bool,
        types: Vec<String>,
        neg: bool,
        limit_in: bool,
        limit_out: bool,
    },
    /// Port ranges; `which`: 0 = source, 1 = destination, 2 = either (multiport --ports).
    Ports {
        which: u8,
        ranges: Vec<(u16, u16)>,
        neg: bool,
    },
    TcpFlags {
        mask: u8,
        comp: u8,
        neg: bool,
    },
    /// `None` type is `any`; code range inclusive.
    IcmpType {
        v6: bool,
        ty: Option<u8>,
        codes: (u8, u8),
        neg: bool,
    },
    Range {
        src: bool,
        from: IpAddr,
        to: IpAddr,
        neg: bool,
    },
    StatRandom {
        p: f64,
        neg: bool,
    },
    /// `-m rpfilter`: the reverse path of the source goes out the input interface.
    RpFilter {
        loose: bool,
        accept_local: bool,
        invert: bool,
    },
    StatNth {
        every: u32,
        neg: bool,
    },
    /// `-m physdev`: the bridge ports br_netfilter recorded (`xt_physdev`). Each option is
    /// present with its `!`; names may end in `+`.
    Physdev(Physdev),
    /// Matches every packet (comment) or is assumed to (limit under its burst); text explains.
    Always(Option<String>),
    /// A field of the connection's tuples (`-m conntrack --ctproto/--ctorig*/--ctrepl*`).
    /// `with_state`: the same match has `--ctstate`, which makes xt_conntrack answer true for
    /// a packet without a conntrack entry once the state matched (false without it).
    CtTuple {
        field: CtField,
        neg: bool,
        with_state: bool,
    },
    /// `-m recent`: a list of recently seen addresses, kept by the kernel across packets.
    Recent {
        cmd: RecentCmd,
        name: String,
        /// `--rdest`: the list holds destinations, not sources.
        rdest: bool,
        /// `--hitcount N`: at least N packets seen (within `--seconds`, when given).
        hitcount: Option<u32>,
        neg: bool,
    },
    /// A stateful match answered under an assumption the explanation states: `answer` is the
    /// match's result when `assumption` holds (`hashlimit` under its rate, ...).
    Assumed {
        answer: bool,
        assumption: String,
    },
    /// `-m pkttype --pkt-type T`: the link-layer class of the packet (lower-case name).
    PktType(String, bool),
    /// A match on a header the simulated packet does not carry (IPv6 routing, hop-by-hop,
    /// destination-options or fragment header): the kernel answers false, even negated.
    NoHeader(String),
    Unknown(String),
}

/// The options of one `-m physdev` match, each `(value, negated)`.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Physdev {
    pub physin: Option<(String, bool)>,
    pub physout: Option<(String, bool)>,
    pub is_in: Option<bool>,
    pub is_out: Option<bool>,
    pub is_bridged: Option<bool>,
}

/// One field of a conntrack entry's tuples; `reply` selects the reply tuple, `src` the source.
#[derive(Debug, Clone, PartialEq)]
pub enum CtField {
    Proto(u8),
    Addr {
        reply: bool,
        src: bool,
        net: Net,
    },
    Port {
        reply: bool,
        src: bool,
        lo: u16,
        hi: u16,
    },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RecentCmd {
    Set,
    Check,
    Update,
    Remove,
}

#[derive(Debug, Clone, PartialEq)]
pub enum Action {
    None,
    Accept,
    Drop,
    Reject,
    Return,
    Jump(String),
    Goto(String),
    /// `mark = (mark & !mask) ^ value`, how the kernel applies every MARK form.
    Mark {
        value: u32,
        mask: u32,
    },
    ConnMarkSet {
        value: u32,
        mask: u32,
    },
    /// `--save-mark`: ctmark = (ctmark & !ctmask) | (mark & nfmask & ctmask)... see sim.
    ConnMarkSave {
        nfmask: u32,
        ctmask: u32,
    },
    ConnMarkRestore {
        nfmask: u32,
        ctmask: u32,
    },
    NoTrack,
    Dnat {
        addr: Option<IpAddr>,
        port: Option<u16>,
        text: String,
    },
    Snat {
        addr: Option<IpAddr>,
        port: Option<u16>,
        text: String,
    },
    Masquerade {
        port: Option<u16>,
    },
    Redirect {
        port: Option<u16>,
    },
    /// LOG, NFLOG, TRACE, CT --zone and other targets that only observe or annotate.
    Continue(String),
    Unknown(String),
}

impl Action {
    pub fn is_terminal(&self) -> bool {
        matches!(
            self,
            Action::Accept
                | Action::Drop
                | Action::Reject
                | Action::Dnat { .. }
                | Action::Snat { .. }
                | Action::Masquerade { .. }
                | Action::Redirect { .. }
        )
    }
}

/// A rule with its meaning attached.
#[derive(Debug, Clone)]
pub struct Compiled {
    pub conds: Vec<Cond>,
    pub action: Action,
}

fn first_arg(o: &Opt) -> &str {
    o.args.first().map_or("", String::as_str)
}

/// A port number or a service name (`http`), as iptables reads them.
fn port(s: &str) -> Option<u16> {
    s.parse().ok().or_else(|| crate::check::service_port(s))
}

fn parse_ports(s: &str) -> Option<Vec<(u16, u16)>> {
    s.split(',')
        .map(|p| match p.split_once(':') {
            Some((a, b)) => Some((
                if a.is_empty() { 0 } else { port(a)? },
                if b.is_empty() { u16::MAX } else { port(b)? },
            )),
            None => {
                let n = port(p)?;
                Some((n, n))
            }
        })
        .collect()
}

fn tcp_flag_bits(s: &str) -> Option<u8> {
    let mut f = 0u8;
    for n in s.split(',') {
        f |= match n {
            "ALL" => 0x3f,
            "NONE" => 0,
            // Upper-case, as iptables-save writes them.
            _ if n == n.to_ascii_uppercase() => tcp_flag(&n.to_ascii_lowercase())?,
            _ => return None,
        };
    }
    Some(f)
}

fn ct_states(s: &str) -> Option<u16> {
    let mut st = 0;
    for n in s.split(',') {
        st |= match n {
            "NEW" => CT_NEW,
            "ESTABLISHED" => CT_ESTABLISHED,
            "RELATED" => CT_RELATED,
            "INVALID" => CT_INVALID,
            "UNTRACKED" => CT_UNTRACKED,
            "SNAT" => CT_SNAT,
            "DNAT" => CT_DNAT,
            _ => return None,
        };
    }
    Some(st)
}

fn icmp_type(v6: bool, s: &str) -> Option<(Option<u8>, (u8, u8))> {
    if s == "any" {
        return Some((None, (0, 255)));
    }
    if let Some((t, c)) = s.split_once('/') {
        let c: u8 = c.parse().ok()?;
        return Some((Some(t.parse().ok()?), (c, c)));
    }
    if let Ok(t) = s.parse() {
        return Some((Some(t), (0, 255)));
    }
    let named: &[(&str, u8, Option<u8>)] = if v6 {
        &[
            ("destination-unreachable", 1, None),
            ("packet-too-big", 2, None),
            ("time-exceeded", 3, None),
            ("echo-request", 128, None),
            ("echo-reply", 129, None),
            ("router-solicitation", 133, None),
            ("router-advertisement", 134, None),
            ("neighbour-solicitation", 135, None),
            ("neighbor-solicitation", 135, None),
            ("neighbour-advertisement", 136, None),
            ("neighbor-advertisement", 136, None),
        ]
    } else {
        &[
            ("echo-reply", 0, None),
            ("destination-unreachable", 3, None),
            ("port-unreachable", 3, Some(3)),
            ("host-unreachable", 3, Some(1)),
            ("fragmentation-needed", 3, Some(4)),
            ("source-quench", 4, None),
            ("redirect", 5, None),
            ("echo-request", 8, None),
            ("time-exceeded", 11, None),
            ("parameter-problem", 12, None),
            ("timestamp-request", 13, None),
            ("timestamp-reply", 14, None),
        ]
    };
    let (_, t, c) = named.iter().find(|(n, _, _)| *n == s)?;
    Some((Some(*t), c.map_or((0, 255), |c| (c, c))))
}

fn unknown(what: &str, o: &Opt) -> Cond {
    Cond::Unknown(format!(
        "{what} {}--{} {}",
        if o.neg { "! " } else { "" },
        o.name,
        o.args.join(" ")
    ))
}

fn compile_module(name: &str, opts: &[Opt], v6: bool, out: &mut Vec<Cond>) {
    if name == "addrtype" {
        // limit-iface-* qualifies both type options, so read the module as a whole.
        let limit_in = opts.iter().any(|o| o.name == "limit-iface-in");
        let limit_out = opts.iter().any(|o| o.name == "limit-iface-out");
        for o in opts {
            match o.name.as_str() {
                "src-type" | "dst-type" => out.push(Cond::AddrType {
                    src: o.name == "src-type",
                    types: first_arg(o).split(',').map(str::to_string).collect(),
                    neg: o.neg,
                    limit_in,
                    limit_out,
                }),
                "limit-iface-in" | "limit-iface-out" => {}
                _ => out.push(unknown(name, o)),
            }
        }
        return;
    }
    if name == "rpfilter" {
        let has = |n: &str| opts.iter().any(|o| o.name == n);
        // --validmark only matters with mark-based policy routing, which we do not model.
        if let Some(o) = opts.iter().find(|o| {
            !matches!(
                o.name.as_str(),
                "loose" | "validmark" | "accept-local" | "invert"
            )
        }) {
            out.push(unknown(name, o));
        } else {
            out.push(Cond::RpFilter {
                loose: has("loose"),
                accept_local: has("accept-local"),
                invert: has("invert"),
            });
        }
        return;
    }
    if name == "physdev" {
        let mut p = Physdev::default();
        for o in opts {
            match o.name.as_str() {
                "physdev-in" => p.physin = Some((first_arg(o).to_string(), o.neg)),
                "physdev-out" => p.physout = Some((first_arg(o).to_string(), o.neg)),
                "physdev-is-in" => p.is_in = Some(o.neg),
                "physdev-is-out" => p.is_out = Some(o.neg),
                "physdev-is-bridged" => p.is_bridged = Some(o.neg),
                _ => {
                    out.push(unknown(name, o));
                    return;
                }
            }
        }
        out.push(Cond::Physdev(p));
        return;
    }
    if name == "conntrack" {
        let with_state = opts.iter().any(|o| o.name == "ctstate");
        for o in opts {
            let a = first_arg(o);
            let tuple = |field: Option<CtField>| match field {
                Some(field) => Cond::CtTuple {
                    field,
                    neg: o.neg,
                    with_state,
                },
                None => unknown(name, o),
            };
            let addr =
                |reply, src| tuple(Net::parse(a).map(|net| CtField::Addr { reply, src, net }));
            let port = |reply, src| {
                let (lo, hi) = match a.split_once(':') {
                    Some((l, h)) => (port(l), port(h)),
                    None => (port(a), port(a)),
                };
                tuple(
                    lo.zip(hi)
                        .map(|(lo, hi)| CtField::Port { reply, src, lo, hi }),
                )
            };
            out.push(match o.name.as_str() {
                "ctstate" => match ct_states(a) {
                    Some(states) => Cond::CtState { states, neg: o.neg },
                    None => unknown(name, o),
                },
                "ctproto" => tuple(proto_number(a).map(CtField::Proto)),
                "ctorigsrc" => addr(false, true),
                "ctorigdst" => addr(false, false),
                "ctreplsrc" => addr(true, true),
                "ctrepldst" => addr(true, false),
                "ctorigsrcport" => port(false, true),
                "ctorigdstport" => port(false, false),
                "ctreplsrcport" => port(true, true),
                "ctrepldstport" => port(true, false),
                _ => unknown(name, o),
            });
        }
        return;
    }
    if name == "recent" {
        let get = |n: &str| opts.iter().find(|o| o.name == n);
        let cmds = [
            ("set", RecentCmd::Set),
            ("rcheck", RecentCmd::Check),
            ("update", RecentCmd::Update),
            ("remove", RecentCmd::Remove),
        ];
        let cmd = cmds.iter().find_map(|(n, c)| get(n).map(|o| (*c, o.neg)));
        let hitcount = get("hitcount").map(|o| first_arg(o).parse::<u32>().ok());
        match (cmd, hitcount) {
            (Some((cmd, neg)), hitcount) if hitcount.is_none_or(|h| h.is_some()) => {
                out.push(Cond::Recent {
                    cmd,
                    name: get("name").map_or("DEFAULT", first_arg).to_string(),
                    rdest: get("rdest").is_some(),
                    hitcount: hitcount.flatten(),
                    neg,
                });
            }
            _ => out.push(Cond::Unknown("recent without a command".into())),
        }
        return;
    }
    if name == "hashlimit" {
        let get = |n: &str| opts.iter().find(|o| o.name == n);
        let label = get("hashlimit-name").map_or("", first_arg);
        // Under its rate: `--hashlimit-upto` (and the old `--hashlimit`) matches,
        // `--hashlimit-above` does not.
        let (answer, rate) = match (
            get("hashlimit-upto").or(get("hashlimit")),
            get("hashlimit-above"),
        ) {
            (Some(o), _) => (!o.neg, first_arg(o)),
            (None, Some(o)) => (o.neg, first_arg(o)),
            (None, None) => {
                out.push(Cond::Unknown("hashlimit without a rate".into()));
                return;
            }
        };
        out.push(Cond::Assumed {
            answer,
            assumption: format!(
                "hashlimit `{label}` under its rate of {rate} (the kernel counts earlier packets)"
            ),
        });
        return;
    }
    if name == "mac" {
        // The packet spec carries no link-layer address: answer as for any other sender.
        for o in opts {
            out.push(Cond::Assumed {
                answer: o.neg,
                assumption: format!(
                    "mac: the source MAC is not {} (the packet gives no MAC address)",
                    first_arg(o)
                ),
            });
        }
        return;
    }
    if name == "pkttype" {
        for o in opts {
            out.push(match o.name.as_str() {
                "pkt-type" => Cond::PktType(first_arg(o).to_ascii_lowercase(), o.neg),
                _ => unknown(name, o),
            });
        }
        return;
    }
    if matches!(name, "rt" | "frag" | "hbh" | "dst") && v6 {
        let what = match name {
            "rt" => "routing",
            "frag" => "fragment",
            "hbh" => "hop-by-hop options",
            _ => "destination options",
        };
        out.push(Cond::NoHeader(format!(
            "-m {name}: the packet has no IPv6 {what} header"
        )));
        return;
    }
    if name == "statistic" {
        let get = |n: &str| opts.iter().find(|o| o.name == n);
        let neg = get("mode").is_some_and(|o| o.neg)
            || get("probability").is_some_and(|o| o.neg)
            || get("every").is_some_and(|o| o.neg);
        match get("mode").map(first_arg) {
            Some("random") => {
                match get("probability").and_then(|o| first_arg(o).parse::<f64>().ok()) {
                    Some(p) if (0.0..=1.0).contains(&p) => out.push(Cond::StatRandom { p, neg }),
                    _ => out.push(Cond::Unknown(
                        "statistic without a valid --probability".into(),
                    )),
                }
            }
            Some("nth") => match get("every").and_then(|o| first_arg(o).parse::<u32>().ok()) {
                Some(every) if every > 0 => out.push(Cond::StatNth { every, neg }),
                _ => out.push(Cond::Unknown("statistic nth without --every".into())),
            },
            _ => out.push(Cond::Unknown("statistic mode".into())),
        }
        return;
    }
    for o in opts {
        let a = first_arg(o);
        let c = match (name, o.name.as_str()) {
            ("comment", "comment") => Cond::Always(None),
            ("mark", "mark") => match parse_mark_mask(a) {
                Some((value, mask)) => Cond::Mark {
                    value,
                    mask,
                    neg: o.neg,
                },
                None => unknown(name, o),
            },
            ("connmark", "mark") => match parse_mark_mask(a) {
                Some((value, mask)) => Cond::ConnMark {
                    value,
                    mask,
                    neg: o.neg,
                },
                None => unknown(name, o),
            },
            ("conntrack", "ctstate") | ("state", "state") => match ct_states(a) {
                Some(states) => Cond::CtState { states, neg: o.neg },
                None => unknown(name, o),
            },
            ("set", "match-set") => match o.args.get(1) {
                Some(flags) => {
                    let dirs: Option<Vec<bool>> = flags
                        .split(',')
                        .map(|f| match f {
                            "src" => Some(true),
                            "dst" => Some(false),
                            _ => None,
                        })
                        .collect();
                    match dirs {
                        Some(dirs) => Cond::Set {
                            name: a.to_string(),
                            dirs,
                            neg: o.neg,
                        },
                        None => unknown(name, o),
                    }
                }
                None => unknown(name, o),
            },
            // Counters and timeouts of the set match do not change membership.
            ("set", "return-nomatch" | "update-counters" | "update-subcounters") => {
                Cond::Always(None)
            }
            (
                "tcp" | "udp" | "sctp" | "udplite",
                "sport" | "source-port" | "dport" | "destination-port",
            )
            | ("multiport", "sports" | "source-ports" | "dports" | "destination-ports" | "ports") =>
            {
                match parse_ports(a) {
                    Some(ranges) => Cond::Ports {
                        // s(ource), d(estination), or either (multiport --ports).
                        which: match o.name.as_bytes()[0] {
                            b's' => 0,
                            b'd' => 1,
                            _ => 2,
                        },
                        ranges,
                        neg: o.neg,
                    },
                    None => unknown(name, o),
                }
            }
            ("tcp", "tcp-flags") => match (
                tcp_flag_bits(a),
                o.args.get(1).and_then(|c| tcp_flag_bits(c)),
            ) {
                (Some(mask), Some(comp)) => Cond::TcpFlags {
                    mask,
                    comp,
                    neg: o.neg,
                },
                _ => unknown(name, o),
            },
            ("tcp", "syn") => Cond::TcpFlags {
                mask: TCP_FIN | TCP_SYN | TCP_RST | TCP_ACK,
                comp: TCP_SYN,
                neg: o.neg,
            },
            ("icmp", "icmp-type") | ("icmp6" | "icmpv6", "icmpv6-type") => {
                match icmp_type(name != "icmp", a) {
                    Some((ty, codes)) => Cond::IcmpType {
                        v6: name != "icmp",
                        ty,
                        codes,
                        neg: o.neg,
                    },
                    None => unknown(name, o),
                }
            }
            ("iprange", "src-range" | "dst-range") => {
                match a
                    .split_once('-')
                    .and_then(|(f, t)| Some((f.parse().ok()?, t.parse().ok()?)))
                {
                    Some((from, to)) => Cond::Range {
                        src: o.name == "src-range",
                        from,
                        to,
                        neg: o.neg,
                    },
                    None => unknown(name, o),
                }
            }
            // Under its burst a limit match lets packets through; a single explained packet is.
            ("limit", "limit" | "limit-burst") => {
                Cond::Always(Some("limit assumed not exceeded".into()))
            }
            _ => unknown(name, o),
        };
        out.push(c);
    }
}

fn nat_addr(s: &str) -> (Option<IpAddr>, Option<u16>) {
    // ip[-ip][:port[-port]] or [v6][-[v6]]:port; the first address/port of a range is shown.
    if let Some(rest) = s.strip_prefix('[') {
        let (a, tail) = rest.split_once(']').unwrap_or((rest, ""));
        let port = tail
            .strip_prefix(':')
            .and_then(|p| p.split('-').next()?.parse().ok());
        return (a.parse().ok(), port);
    }
    if s.matches(':').count() > 1 {
        // A bare IPv6 address or range: no port without brackets.
        return (s.split('-').next().and_then(|x| x.parse().ok()), None);
    }
    let (a, p) = match s.split_once(':') {
        Some((a, p)) => (a, Some(p)),
        None => (s, None),
    };
    let addr = a.split('-').next().and_then(|x| x.parse().ok());
    (addr, p.and_then(|p| p.split('-').next()?.parse().ok()))
}

fn compile_target(t: &Target, is_chain: &dyn Fn(&str) -> bool) -> Action {
    if is_chain(&t.name) {
        return if t.goto {
            Action::Goto(t.name.clone())
        } else {
            Action::Jump(t.name.clone())
        };
    }
    // getopt lets users abbreviate (`--to` for `--to-destination`), so try both spellings.
    let arg = |n: &str| t.opt(n).map(first_arg);
    let unknown = || {
        Action::Unknown(format!(
            "-j {} {}",
            t.name,
            t.opts
                .iter()
                .map(|o| format!("--{} {}", o.name, o.args.join(" ")))
                .collect::<Vec<_>>()
                .join(" ")
        ))
    };
    match t.name.as_str() {
        "ACCEPT" => Action::Accept,
        "DROP" => Action::Drop,
        "REJECT" => Action::Reject,
        "RETURN" => Action::Return,
        "MARK" => {
            let m = |v: Option<(u32, u32)>, f: fn(u32, u32) -> (u32, u32)| v.map(|(a, b)| f(a, b));
            let r = if let Some(v) = arg("set-xmark") {
                m(parse_mark_mask(v), |v, m| (v, m))
            } else if let Some(v) = arg("set-mark") {
                // --set-mark v/m zeroes the masked bits then ORs: same as xmark v/(m|v).
                m(parse_mark_mask(v), |v, m| (v, m | v))
            } else if let Some(v) = arg("or-mark") {
                parse_u32(v).map(|v| (v, v))
            } else if let Some(v) = arg("and-mark") {
                parse_u32(v).map(|v| (0, !v))
            } else if let Some(v) = arg("xor-mark") {
                parse_u32(v).map(|v| (v, 0))
            } else {
                None
            };
            r.map_or_else(unknown, |(value, mask)| Action::Mark { value, mask })
        }
        "CONNMARK" => {
            let masks = || {
                let nf = arg("nfmask")
                    .or(arg("mask"))
                    .map_or(Some(u32::MAX), parse_u32);
                let ct = arg("ctmask")
                    .or(arg("mask"))
                    .map_or(Some(u32::MAX), parse_u32);
                Some((nf?, ct?))
            };
            if let Some(v) = arg("set-xmark") {
                parse_mark_mask(v)
                    .map_or_else(unknown, |(value, mask)| Action::ConnMarkSet { value, mask })
            } else if let Some(v) = arg("set-mark") {
                parse_mark_mask(v).map_or_else(unknown, |(value, mask)| Action::ConnMarkSet {
                    value,
                    mask: mask | value,
                })
            } else if t.opt("save-mark").is_some() {
                masks().map_or_else(unknown, |(nfmask, ctmask)| Action::ConnMarkSave {
                    nfmask,
                    ctmask,
                })
            } else if t.opt("restore-mark").is_some() {
                masks().map_or_else(unknown, |(nfmask, ctmask)| Action::ConnMarkRestore {
                    nfmask,
                    ctmask,
                })
            } else {
                unknown()
            }
        }
        "NOTRACK" => Action::NoTrack,
        "CT" if t.opt("notrack").is_some() => Action::NoTrack,
        "CT" => Action::Continue("CT".into()),
        "DNAT" => match arg("to-destination")
            .or_else(|| arg("to"))
            .or_else(|| arg("to"))
        {
            Some(v) => {
                let (addr, port) = nat_addr(v);
                Action::Dnat {
                    addr,
                    port,
                    text: v.to_string(),
                }
            }
            None => unknown(),
        },
        "SNAT" => match arg("to-source").or_else(|| arg("to")) {
            Some(v) => {
                let (addr, port) = nat_addr(v);
                Action::Snat {
                    addr,
                    port,
                    text: v.to_string(),
                }
            }
            None => unknown(),
        },
        "MASQUERADE" => Action::Masquerade {
            port: arg("to-ports")
                .or_else(|| arg("to"))
                .or_else(|| arg("to"))
                .and_then(|p| p.split('-').next()?.parse().ok()),
        },
        "REDIRECT" => Action::Redirect {
            port: arg("to-ports")
                .or_else(|| arg("to"))
                .or_else(|| arg("to"))
                .and_then(|p| p.split('-').next()?.parse().ok()),
        },
        // These only log, count, trace or change fields the simulator does not follow.
        "LOG"
        | "NFLOG"
        | "ULOG"
        | "TRACE"
        | "AUDIT"
        | "TCPMSS"
        | "DSCP"
        | "TOS"
        | "TTL"
        | "HL"
        | "CHECKSUM"
        | "CLASSIFY"
        | "SECMARK"
        | "CONNSECMARK"
        | "SET"
        | "NFQUEUE-BYPASS-NEVER" => Action::Continue(t.name.clone()),
        _ => unknown(),
    }
}

/// Compiles one rule. `is_chain` tells user chains of the same table from target extensions.
pub fn compile(rule: &Rule, v6: bool, is_chain: &dyn Fn(&str) -> bool) -> Compiled {
    let mut conds = Vec::new();
    for item in &rule.items {
        match item {
            Item::Basic { neg, kind, value } => {
                let neg = *neg;
                conds.push(match kind {
                    Basic::Src | Basic::Dst => match Net::parse(value) {
                        Some(n) if *kind == Basic::Src => Cond::Src(n, neg),
                        Some(n) => Cond::Dst(n, neg),
                        None => Cond::Unknown(format!("address {value}")),
                    },
                    Basic::Proto => match value.as_str() {
                        "all" => Cond::Proto(None, neg),
                        p => match proto_number(p) {
                            // `-p 0` (`ip`, `hopopt`) is "all" to iptables.
                            Some(0) => Cond::Proto(None, neg),
                            Some(n) => Cond::Proto(Some(n), neg),
                            None => Cond::Unknown(format!("protocol {p}")),
                        },
                    },
                    Basic::InIface => Cond::InIface(value.clone(), neg),
                    Basic::OutIface => Cond::OutIface(value.clone(), neg),
                });
            }
            Item::Fragment { neg } => conds.push(Cond::Fragment(*neg)),
            Item::Module { name, opts, .. } => compile_module(name, opts, v6, &mut conds),
        }
    }
    let action = match &rule.target {
        None => Action::None,
        Some(t) => compile_target(t, is_chain),
    };
    Compiled { conds, action }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::iptables::parse_rule;

    fn c(s: &str) -> Compiled {
        compile(&parse_rule(s).unwrap(), false, &|n| {
            n.starts_with("KUBE-") || n.starts_with("cali-")
        })
    }

    #[test]
    fn mark_forms_match_the_kernel_encoding() {
        // iptables-nft prints these back as --set-xmark v/m; the same pairs must come out.
        assert_eq!(
            c("-A X -j MARK --set-mark 0x5").action,
            Action::Mark {
                value: 5,
                mask: u32::MAX
            }
        );
        assert_eq!(
            c("-A X -j MARK --or-mark 0x2").action,
            Action::Mark { value: 2, mask: 2 }
        );
        assert_eq!(
            c("-A X -j MARK --and-mark 0x3").action,
            Action::Mark {
                value: 0,
                mask: 0xffff_fffc
            }
        );
        assert_eq!(
            c("-A X -j MARK --xor-mark 0x3").action,
            Action::Mark { value: 3, mask: 0 }
        );
        assert_eq!(
            c("-A X -j MARK --set-xmark 0x4000/0x4000").action,
            Action::Mark {
                value: 0x4000,
                mask: 0x4000
            }
        );
    }

    #[test]
    fn targets_and_matches() {
        assert_eq!(
            c("-A X -j KUBE-SVC-A").action,
            Action::Jump("KUBE-SVC-A".into())
        );
        assert_eq!(c("-A X -g cali-x").action, Action::Goto("cali-x".into()));
        assert!(matches!(
            c("-A X -j WEIRD --foo").action,
            Action::Unknown(_)
        ));
        let d = c("-A X -j DNAT --to-destination 172.17.0.5:22").action;
        assert!(matches!(d, Action::Dnat { port: Some(22), .. }));
        let d = c("-A X -j DNAT --to-destination 2001:db8::5").action;
        assert!(matches!(
            d,
            Action::Dnat {
                addr: Some(IpAddr::V6(_)),
                port: None,
                ..
            }
        ));
        let d = c("-A X -j SNAT --to-source 10.0.0.1-10.0.0.9:1000-2000").action;
        assert!(matches!(
            d,
            Action::Snat {
                addr: Some(IpAddr::V4(_)),
                port: Some(1000),
                ..
            }
        ));
        let d = c("-A X -j DNAT --to-destination [2001:db8::5]:8080").action;
        assert!(matches!(
            d,
            Action::Dnat {
                addr: Some(IpAddr::V6(_)),
                port: Some(8080),
                ..
            }
        ));
        let r = c(
            "-A X -p tcp -m multiport --dports 30000:32767,80 -m tcp --tcp-flags SYN,RST SYN -m conntrack ! --ctstate INVALID,UNTRACKED",
        );
        assert_eq!(
            r.conds[1],
            Cond::Ports {
                which: 1,
                ranges: vec![(30000, 32767), (80, 80)],
                neg: false
            }
        );
        assert_eq!(
            r.conds[2],
            Cond::TcpFlags {
                mask: TCP_SYN | TCP_RST,
                comp: TCP_SYN,
                neg: false
            }
        );
        assert_eq!(
            r.conds[3],
            Cond::CtState {
                states: CT_INVALID | CT_UNTRACKED,
                neg: true
            }
        );
        let s = c("-A X -m statistic --mode random --probability 0.33333333349 -j KUBE-SEP-A");
        assert!(matches!(s.conds[0], Cond::StatRandom { neg: false, .. }));
        assert!(matches!(
            c("-A X -m physdev --physdev-is-bridged ! --physdev-in veth+").conds[0],
            Cond::Physdev(Physdev {
                is_bridged: Some(false),
                physin: Some((ref n, true)),
                physout: None,
                ..
            }) if n == "veth+"
        ));
        assert!(
            matches!(c("-A X -m set ! --match-set s src,dst").conds[0], Cond::Set { neg: true, ref dirs, .. } if *dirs == vec![true, false])
        );
    }
}
