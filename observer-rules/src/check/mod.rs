//! What `iptables-restore` rejects in a rule, so `observer explain` rejects it too: unknown
//! matches and targets, unknown or ambiguous options (getopt accepts unique prefixes), missing
//! or extra arguments, and values the extensions' own parsers refuse (`--dport 99999`,
//! `-s 300.1.1.1`, `/33`, `--mark 0xzz`, ...). Values are read the way iptables 1.8 reads them
//! (`strtoul` base 0, address autocompletion, case-insensitive prefixes of names) so a valid
//! dump is never refused. Extensions whose options we do not list are accepted as they are:
//! their meaning is "not modelled" later, not an error.

mod names;
mod values;

use names::*;
use values::*;
pub use values::{inet_aton_ok, ipv4_numeric, strtoul0};

use crate::savefile::{Basic, Item, Opt, Rule};

/// The address family of a dump is the model's [`Family`]; `None` where a caller does not
/// say (both are accepted).
pub use observer_model::Family;

/// A problem with one token: its column and the message.
pub(crate) type Problem = (usize, String);

/// Column of each part of a rule, in model order, as the parser records them: the chain;
/// per item its flag and value (`-s` and the address, `-m` and the module name, `-j` and the
/// target), each option as name column, argument count, argument columns; the end of the line.
pub(crate) struct Cols<'a> {
    cols: &'a [usize],
    /// Where each item (and after them, the target) starts in `cols`.
    starts: Vec<usize>,
}

impl<'a> Cols<'a> {
    fn new(rule: &Rule, cols: &'a [usize]) -> Self {
        let mut starts = Vec::with_capacity(rule.items.len() + 1);
        let mut i = 1;
        let skip_opts = |mut i: usize, n: usize| {
            for _ in 0..n {
                i += 2 + cols.get(i + 1).copied().unwrap_or(0);
            }
            i
        };
        for item in &rule.items {
            starts.push(i);
            i += 2;
            if let Item::Module { opts, .. } = item {
                i = skip_opts(i, opts.len());
            }
        }
        starts.push(i);
        Self { cols, starts }
    }
    fn get(&self, i: usize) -> usize {
        self.cols.get(i).copied().unwrap_or(1)
    }
    fn flag(&self, item: usize) -> usize {
        self.get(self.starts[item])
    }
    fn value(&self, item: usize) -> usize {
        self.get(self.starts[item] + 1)
    }
    /// (name column, argument columns) of each option of an item.
    fn opts(&self, item: usize) -> impl Iterator<Item = (usize, &'a [usize])> + '_ {
        let mut i = self.starts[item] + 2;
        std::iter::from_fn(move || {
            let name = *self.cols.get(i)?;
            let n = *self.cols.get(i + 1)?;
            let args = self.cols.get(i + 2..i + 2 + n)?;
            i += 2 + n;
            Some((name, args))
        })
    }
    fn end(&self) -> usize {
        self.cols.last().copied().unwrap_or(1)
    }
}

/// iptables' own long options (`--append`, `--insert`, ...), for getopt's prefixes.
pub(crate) const BASE_LONG_OPTIONS: &[&str] = BASE_LONG;

/// The port of a service name (`http` is 80), as iptables resolves `--dport http`.
pub fn service_port(name: &str) -> Option<u16> {
    SERVICE_PORTS
        .iter()
        .find(|(n, _)| *n == name)
        .map(|&(_, p)| p)
}

/// Tables iptables-restore knows.
pub const TABLES: &[&str] = &["raw", "mangle", "nat", "filter", "security"];

/// The built-in chains of a table.
pub fn builtin_chains(table: &str) -> &'static [&'static str] {
    match table {
        "raw" => &["PREROUTING", "OUTPUT"],
        "mangle" => &["PREROUTING", "INPUT", "FORWARD", "OUTPUT", "POSTROUTING"],
        "nat" => &["PREROUTING", "INPUT", "OUTPUT", "POSTROUTING"],
        "filter" | "security" => &["INPUT", "FORWARD", "OUTPUT"],
        _ => &[],
    }
}

/// Longest chain name iptables accepts (XT_EXTENSION_MAXNAMELEN - 1).
pub const MAX_CHAIN_LEN: usize = 28;

fn fam_has(f: Option<Family>, common: &[&str], v4: &[&str], v6: &[&str], name: &str) -> bool {
    common.contains(&name)
        || (f != Some(Family::Ipv6) && v4.contains(&name))
        || (f != Some(Family::Ipv4) && v6.contains(&name))
}

pub fn is_match(f: Option<Family>, name: &str) -> bool {
    fam_has(f, MATCHES, MATCHES4, MATCHES6, name)
}

pub fn is_target(f: Option<Family>, name: &str) -> bool {
    fam_has(f, TARGETS, TARGETS4, TARGETS6, name)
}

/// How many arguments an option takes and what they must be.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Arg {
    Flag,
    Any,
    Comment,
    U32,
    U16,
    Mark,
    MarkMask,
    PortRange,
    /// libxt_udp's parser: see [`check_udp_port_range`].
    UdpPortRange,
    PortList,
    CtStates,
    States,
    TcpFlags,
    Icmp4,
    Icmp6,
    AddrTypes,
    IpRange,
    Probability,
    Mode,
    Rate,
    Burst,
    SetArgs,
    NatTo,
    ToPorts,
    Reject,
    Iface,
    LogLevel,
    /// LOG's prefix: no newline (an unterminated quote brings one).
    Prefix,
    /// `--mac-source`: six `:`-separated hex bytes (see [`check_mac`]).
    Mac,
    /// time's `hh:mm[:ss]`.
    DayTime,
    /// time's `--weekdays`: names or numbers 1-7, comma separated.
    Weekdays,
    /// time's `--monthdays`: 1-31, comma separated.
    Monthdays,
}

struct Spec {
    opts: &'static [(&'static str, Arg)],
}

/// Option lists of the extensions we read; others are accepted unchecked.
fn spec(name: &str) -> Option<Spec> {
    use Arg::*;
    let opts: &'static [(&'static str, Arg)] = match name {
        "comment" => &[("comment", Comment)],
        "mark" | "connmark" => &[("mark", MarkMask)],
        "conntrack" => &[
            ("ctstate", CtStates),
            ("ctproto", Any),
            ("ctorigsrc", Any),
            ("ctorigdst", Any),
            ("ctreplsrc", Any),
            ("ctrepldst", Any),
            ("ctorigsrcport", Any),
            ("ctorigdstport", Any),
            ("ctreplsrcport", Any),
            ("ctrepldstport", Any),
            ("ctstatus", Any),
            ("ctexpire", Any),
            ("ctdir", Any),
        ],
        "state" => &[("state", States)],
        "tcp" => &[
            ("source-port", PortRange),
            ("sport", PortRange),
            ("destination-port", PortRange),
            ("dport", PortRange),
            ("syn", Flag),
            ("tcp-flags", TcpFlags),
            ("tcp-option", U32),
        ],
        "udp" => &[
            ("source-port", UdpPortRange),
            ("sport", UdpPortRange),
            ("destination-port", UdpPortRange),
            ("dport", UdpPortRange),
        ],
        "multiport" => &[
            ("source-ports", PortList),
            ("sports", PortList),
            ("destination-ports", PortList),
            ("dports", PortList),
            ("ports", PortList),
        ],
        "icmp" => &[("icmp-type", Icmp4)],
        "icmp6" => &[("icmpv6-type", Icmp6)],
        "addrtype" => &[
            ("src-type", AddrTypes),
            ("dst-type", AddrTypes),
            ("limit-iface-in", Flag),
            ("limit-iface-out", Flag),
        ],
        "iprange" => &[("src-range", IpRange), ("dst-range", IpRange)],
        "statistic" => &[
            ("mode", Mode),
            ("probability", Probability),
            ("every", U32),
            ("packet", U32),
        ],
        "limit" => &[("limit", Rate), ("limit-burst", Burst)],
        "set" => &[
            ("match-set", SetArgs),
            ("set", SetArgs),
            ("return-nomatch", Flag),
            ("update-counters", Flag),
            ("update-subcounters", Flag),
            ("packets-eq", Any),
            ("packets-lt", Any),
            ("packets-gt", Any),
            ("bytes-eq", Any),
            ("bytes-lt", Any),
            ("bytes-gt", Any),
        ],
        "rpfilter" => &[
            ("loose", Flag),
            ("validmark", Flag),
            ("accept-local", Flag),
            ("invert", Flag),
        ],
        "mac" => &[("mac-source", Mac)],
        // iptables 1.8's options; the `--days`/`--time` of iptables 1.3 are refused as there.
        "time" => &[
            ("datestart", Any),
            ("datestop", Any),
            ("timestart", DayTime),
            ("timestop", DayTime),
            ("monthdays", Monthdays),
            ("weekdays", Weekdays),
            ("localtz", Flag),
            ("kerneltz", Flag),
            ("utc", Flag),
            ("contiguous", Flag),
        ],
        "physdev" => &[
            ("physdev-in", Iface),
            ("physdev-out", Iface),
            ("physdev-is-in", Flag),
            ("physdev-is-out", Flag),
            ("physdev-is-bridged", Flag),
        ],
        // "standard" stands for a jump to a chain, which takes no options.
        "standard" | "ACCEPT" | "DROP" | "RETURN" | "QUEUE" | "NOTRACK" | "TRACE" => &[],
        "MARK" => &[
            ("set-xmark", MarkMask),
            ("set-mark", MarkMask),
            ("and-mark", Mark),
            ("or-mark", Mark),
            ("xor-mark", Mark),
        ],
        "CONNMARK" => &[
            ("set-xmark", MarkMask),
            ("set-mark", MarkMask),
            ("and-mark", Mark),
            ("or-mark", Mark),
            ("xor-mark", Mark),
            ("save-mark", Flag),
            ("restore-mark", Flag),
            ("mask", Mark),
            ("nfmask", Mark),
            ("ctmask", Mark),
        ],
        "DNAT" => &[
            ("to-destination", NatTo),
            ("random", Flag),
            ("random-fully", Flag),
            ("persistent", Flag),
        ],
        "SNAT" => &[
            ("to-source", NatTo),
            ("random", Flag),
            ("random-fully", Flag),
            ("persistent", Flag),
        ],
        "MASQUERADE" => &[
            ("to-ports", ToPorts),
            ("random", Flag),
            ("random-fully", Flag),
        ],
        "REDIRECT" => &[("to-ports", ToPorts), ("random", Flag)],
        "REJECT" => &[("reject-with", Reject)],
        "CT" => &[
            ("notrack", Flag),
            ("helper", Any),
            ("ctevents", Any),
            ("expevents", Any),
            ("zone", Any),
            ("zone-orig", Any),
            ("zone-reply", Any),
            ("timeout", Any),
        ],
        "LOG" => &[
            ("log-level", LogLevel),
            ("log-prefix", Prefix),
            ("log-tcp-sequence", Flag),
            ("log-tcp-options", Flag),
            ("log-ip-options", Flag),
            ("log-uid", Flag),
            ("log-macdecode", Flag),
        ],
        "NFLOG" => &[
            ("nflog-group", U16),
            ("nflog-prefix", Any),
            ("nflog-range", U32),
            ("nflog-size", U32),
            ("nflog-threshold", U16),
        ],
        _ => return None,
    };
    Some(Spec { opts })
}

/// How many arguments option `opt` (exact or unique prefix) of extension `ext` requires,
/// when we know the extension. getopt hands a required argument the next word even when it
/// looks like an option (`--comment -A`), so the parser asks before stopping there.
pub(crate) fn required_args(ext: &str, opt: &str) -> usize {
    let Some(sp) = spec(ext) else { return 0 };
    let kind = match sp.opts.iter().find(|(n, _)| *n == opt) {
        Some((_, k)) => *k,
        None => {
            let mut hits = sp.opts.iter().filter(|(n, _)| n.starts_with(opt));
            match (hits.next(), hits.next()) {
                (Some((_, k)), None) => *k,
                _ => return 0,
            }
        }
    };
    match kind {
        Arg::Flag => 0,
        Arg::TcpFlags | Arg::SetArgs => 2,
        _ => 1,
    }
}

/// Extensions whose options make up one argument table in getopt at a point of the rule.
struct Loaded<'a> {
    name: &'a str,
    spec: Option<Spec>,
    /// Options seen so far for this instance, one bit per entry of its spec (no allocation:
    /// a rule may load hundreds of thousands of extensions).
    seen: u32,
    /// statistic's `--mode`, which decides what else it needs.
    mode: Option<&'a Opt>,
    /// time's `--timestart` and `--timestop`, in seconds into the day.
    times: [Option<u32>; 2],
    /// Loaded by `-m` (not by `-p`), with the column of its name.
    explicit: Option<usize>,
}

enum Resolved {
    /// Index of the loaded extension and the option's full name and argument kind.
    Known(usize, &'static str, Arg),
    /// Not ours to judge: some loaded extension is not modelled.
    Unchecked,
}

impl Loaded<'_> {
    fn bit(&self, n: &str) -> u32 {
        self.spec
            .as_ref()
            .and_then(|s| s.opts.iter().position(|(o, _)| *o == n))
            .map_or(0, |i| 1 << i)
    }
    fn saw(&self, n: &str) -> bool {
        self.seen & self.bit(n) != 0
    }
    fn mark(&mut self, n: &str) {
        self.seen |= self.bit(n);
    }
}

/// The extensions loaded so far, as getopt sees them.
#[derive(Default)]
struct Getopt<'a> {
    instances: Vec<Loaded<'a>>,
    /// Latest instance of each distinct extension, oldest first. xtables puts a newly loaded
    /// extension's options before the older ones, so for a name two extensions share the
    /// newest wins. Bounded by the number of extensions, which keeps lookups linear.
    recent: Vec<usize>,
}

impl<'a> Getopt<'a> {
    fn load(&mut self, name: &'a str, explicit: Option<usize>) -> usize {
        let i = self.instances.len();
        self.instances.push(Loaded {
            name,
            spec: spec(name),
            seen: 0,
            mode: None,
            times: [None; 2],
            explicit,
        });
        self.recent.retain(|&r| self.instances[r].name != name);
        self.recent.push(i);
        i
    }

    /// getopt_long: an exact name, else a unique prefix (iptables' own options count too).
    fn resolve(&self, name: &str) -> Result<Resolved, String> {
        let mut prefix_hits: Vec<(usize, &'static str, Arg)> = Vec::new();
        for &i in self.recent.iter().rev() {
            let Some(s) = &self.instances[i].spec else {
                // A newer extension we do not list may own the name (`-m set ... -m recent
                // --set`: recent's `--set` comes first in getopt's table).
                return Ok(Resolved::Unchecked);
            };
            for &(n, a) in s.opts {
                if n == name {
                    return Ok(Resolved::Known(i, n, a));
                }
                if n.starts_with(name) {
                    prefix_hits.push((i, n, a));
                }
            }
        }
        if self
            .recent
            .iter()
            .any(|&i| self.instances[i].spec.is_none())
        {
            return Ok(Resolved::Unchecked);
        }
        let base = BASE_LONG.iter().filter(|b| b.starts_with(name)).count();
        match (prefix_hits.as_slice(), base) {
            ([(i, n, a)], 0) => Ok(Resolved::Known(*i, n, *a)),
            ([], 0) => Err(format!("unknown option `--{name}`")),
            _ => Err(format!("ambiguous option `--{name}`")),
        }
    }
}

/// Context for the checks that look across a rule.
struct RuleFacts<'a> {
    family: Option<Family>,
    /// The rule's `-p` when not negated.
    proto: Option<&'a str>,
}

impl RuleFacts<'_> {
    fn port_proto(&self) -> bool {
        self.proto.is_some_and(|p| {
            matches!(
                p.to_ascii_lowercase().as_str(),
                "tcp" | "udp" | "sctp" | "dccp" | "6" | "17" | "132" | "33"
            )
        })
    }
    fn multiport_proto(&self) -> bool {
        self.port_proto()
            || self
                .proto
                .is_some_and(|p| matches!(p.to_ascii_lowercase().as_str(), "udplite" | "136"))
    }
}

fn check_args(
    facts: &RuleFacts<'_>,
    owner: &str,
    name: &str,
    kind: Arg,
    o: &Opt,
    cols: (usize, &[usize]),
) -> Result<(), Problem> {
    let (name_col, arg_cols) = cols;
    let want = match kind {
        Arg::Flag => 0,
        Arg::TcpFlags | Arg::SetArgs => 2,
        _ => 1,
    };
    if o.args.len() < want {
        return Err((
            name_col,
            format!("option `--{}` requires an argument", o.name),
        ));
    }
    if o.args.len() > want {
        return Err((
            arg_cols.get(want).copied().unwrap_or(name_col),
            format!("bad argument `{}`", o.args[want]),
        ));
    }
    let a = o.args.first().map_or("", String::as_str);
    let col = arg_cols.first().copied().unwrap_or(name_col);
    let fam = facts.family;
    let r = match kind {
        Arg::Flag | Arg::Any => Ok(()),
        Arg::Prefix => {
            if a.contains('\n') {
                Err("newlines are not allowed in --log-prefix".into())
            } else {
                Ok(())
            }
        }
        Arg::Comment => {
            if a.len() > 255 {
                Err("comment longer than 255 characters".into())
            } else {
                Ok(())
            }
        }
        Arg::U32 => strtoul0(a, u64::from(u32::MAX))
            .map(|_| ())
            .ok_or_else(|| format!("bad value `{a}` for `--{name}` (0-4294967295)")),
        Arg::U16 => strtoul0(a, 65535)
            .map(|_| ())
            .ok_or_else(|| format!("bad value `{a}` for `--{name}` (0-65535)")),
        Arg::Burst => strtoul0(a, 10000)
            .map(|_| ())
            .ok_or_else(|| format!("bad value `{a}` for `--{name}` (0-10000)")),
        Arg::Mark => check_mark(a, false),
        Arg::MarkMask => check_mark(a, true),
        Arg::PortRange => check_port_range(a),
        Arg::UdpPortRange => check_udp_port_range(a),
        Arg::PortList => {
            if facts.multiport_proto() {
                check_multiport(a)
            } else {
                Err(
                    "multiport needs `-p tcp`, `-p udp`, `-p udplite`, `-p sctp` or `-p dccp`"
                        .into(),
                )
            }
        }
        Arg::CtStates => check_list(a, CT_STATES, "ctstate"),
        Arg::States => check_list(a, STATES, "state"),
        Arg::TcpFlags => check_tcp_flags(a).and_then(|()| check_tcp_flags(&o.args[1])),
        Arg::Icmp4 => check_icmp(a, ICMP4_NAMES),
        Arg::Icmp6 => check_icmp(a, ICMP6_NAMES),
        Arg::AddrTypes => check_list(a, ADDR_TYPES, "address type"),
        Arg::IpRange => check_iprange(fam, a),
        Arg::Probability => match a.parse::<f64>() {
            Ok(p) if (0.0..=1.0).contains(&p) => Ok(()),
            _ => Err(format!("bad probability `{a}` (0-1)")),
        },
        Arg::Mode => {
            if a == "random" || a == "nth" {
                Ok(())
            } else {
                Err(format!("bad mode `{a}` (random or nth)"))
            }
        }
        Arg::Rate => check_rate(a),
        Arg::SetArgs => {
            let flags: Vec<&str> = o.args[1].split(',').collect();
            if flags.len() > 6 || flags.iter().any(|f| *f != "src" && *f != "dst") {
                Err(format!(
                    "bad set flags `{}` (src/dst, comma separated)",
                    o.args[1]
                ))
            } else {
                Ok(())
            }
        }
        Arg::NatTo => check_nat_to(fam, a, facts.port_proto()),
        Arg::ToPorts => {
            if facts.port_proto() {
                check_to_ports(a)
            } else {
                Err("--to-ports needs -p tcp, udp, sctp or dccp in the rule".into())
            }
        }
        Arg::Reject => {
            let names: Vec<&str> = match fam {
                Some(Family::Ipv4) => REJECT4.to_vec(),
                Some(Family::Ipv6) => REJECT6.to_vec(),
                None => REJECT4.iter().chain(REJECT6).copied().collect(),
            };
            if prefix_of(&names, a) {
                Ok(())
            } else {
                Err(format!("unknown reject type `{a}`"))
            }
        }
        Arg::Iface => {
            if a.len() > 15 {
                Err(format!("interface name `{a}` longer than 15 characters"))
            } else {
                Ok(())
            }
        }
        Arg::Mac => check_mac(a),
        Arg::DayTime => check_daytime(a),
        Arg::Weekdays => check_weekdays(a),
        Arg::Monthdays => check_monthdays(a),
        Arg::LogLevel => {
            if strtoul0(a, 7).is_some() || LOG_LEVELS.contains(&a) {
                Ok(())
            } else {
                Err(format!("log level `{a}` unknown"))
            }
        }
    };
    r.map_err(|m| (col, format!("{owner}: {m}")))
}

/// What must hold once all of an extension's options are read.
fn check_complete(l: &Loaded<'_>) -> Result<(), String> {
    let o = l.mode;
    let has = |n: &str| l.saw(n);
    let any = |ns: &[&str]| ns.iter().any(|n| has(n));
    let name = l.name;
    match name {
        "comment" if !has("comment") => Err("comment: option `--comment` must be specified".into()),
        "mark" | "connmark" if !has("mark") => {
            Err(format!("{name}: option `--mark` must be specified"))
        }
        "conntrack" if l.seen == 0 => Err("conntrack: at least one option is required".into()),
        "state" if !has("state") => Err("state: option `--state` must be specified".into()),
        "icmp" if !has("icmp-type") => Err("icmp: option `--icmp-type` must be specified".into()),
        "icmp6" if !has("icmpv6-type") => {
            Err("icmp6: option `--icmpv6-type` must be specified".into())
        }
        "addrtype" if !any(&["src-type", "dst-type"]) => {
            Err("addrtype: you must specify --src-type or --dst-type".into())
        }
        "iprange" if l.seen == 0 => Err("iprange: a range is required".into()),
        "multiport" if l.seen == 0 => Err("multiport: no ports specified".into()),
        "set" if !any(&["match-set", "set"]) => {
            Err("set: you must specify --match-set".into())
        }
        "physdev" if l.seen == 0 => Err("physdev: no physdev option specified".into()),
        "mac" if !has("mac-source") => Err("mac: option `--mac-source` must be specified".into()),
        "time" if has("utc") && any(&["localtz", "kerneltz"]) => {
            Err("time: --utc cannot be used together with --kerneltz (or --localtz)".into())
        }
        "time" if has("contiguous") && !contiguous_ok(l) => Err(
            "time: --contiguous only makes sense when stoptime is smaller than starttime".into(),
        ),
        "statistic" => {
            let mode = o.map(|o| o.args.first().map_or("", String::as_str));
            match mode {
                None => Err("statistic: no mode specified".into()),
                Some("random") if !has("probability") => {
                    Err("statistic: --probability must be specified when using random mode".into())
                }
                Some("nth") if !has("every") => {
                    Err("statistic: --every must be specified when using nth mode".into())
                }
                _ => Ok(()),
            }
        }
        "MARK" => match l.seen.count_ones() {
            0 => Err("MARK: one of --set-xmark, --set-mark, --and-mark, --or-mark or --xor-mark is required".into()),
            1 => Ok(()),
            _ => Err("MARK: only one of --set-xmark, --set-mark, --and-mark, --or-mark or --xor-mark".into()),
        },
        "CONNMARK" => {
            let masks = ["mask", "nfmask", "ctmask"];
            let ops = l.seen.count_ones() as usize - masks.iter().filter(|m| has(m)).count();
            match ops {
                0 => Err("CONNMARK: no operation specified".into()),
                1 => Ok(()),
                _ => Err("CONNMARK: only one operation".into()),
            }
        }
        "DNAT" if !has("to-destination") => {
            Err("DNAT: option `--to-destination` must be specified".into())
        }
        "SNAT" if !has("to-source") => Err("SNAT: option `--to-source` must be specified".into()),
        _ => Ok(()),
    }
}

/// `--contiguous` as iptables-restore 1.8.9 was seen to judge it: refused alone and when
/// `--timestop` is after `--timestart`, accepted with only one of the two.
fn contiguous_ok(l: &Loaded<'_>) -> bool {
    match (l.saw("timestart"), l.saw("timestop"), l.times) {
        (false, false, _) => false,
        (true, true, [Some(start), Some(stop)]) => stop < start,
        _ => true,
    }
}

/// Checks a parsed rule of `table` against what iptables-restore accepts. `is_chain` says
/// whether a name is a user chain declared (before this line) in the same table.
pub(crate) fn check_rule<'r>(
    rule: &'r Rule,
    cols: &[usize],
    family: Option<Family>,
    table: Option<&str>,
    is_chain: &dyn Fn(&str) -> bool,
) -> Result<(), Problem> {
    let cols = Cols::new(rule, cols);
    let mut proto = None;
    let mut any_proto: Option<&str> = None;
    let mut seen_basic = [false; 5];
    for (k, item) in rule.items.iter().enumerate() {
        if let Item::Basic { neg, kind, value } = item {
            if std::mem::replace(&mut seen_basic[*kind as usize], true) {
                return Err((
                    cols.flag(k),
                    format!("multiple {} flags not allowed", flag(*kind)),
                ));
            }
            match kind {
                Basic::Src | Basic::Dst if *neg && value.contains(',') => {
                    Err("! not allowed with multiple source or destination addresses".into())
                }
                Basic::Src | Basic::Dst => check_host_net(family, value),
                Basic::Proto => {
                    any_proto = Some(value.as_str());
                    if !neg {
                        proto = Some(value.as_str());
                    }
                    check_proto(value)
                }
                // The kernel has no input device there (or no output device yet).
                Basic::InIface if matches!(rule.chain.as_str(), "OUTPUT" | "POSTROUTING") => {
                    return Err((cols.flag(k), format!("can't use -i with {}", rule.chain)));
                }
                Basic::OutIface if matches!(rule.chain.as_str(), "PREROUTING" | "INPUT") => {
                    return Err((cols.flag(k), format!("can't use -o with {}", rule.chain)));
                }
                Basic::InIface | Basic::OutIface => {
                    if value.len() > 15 {
                        Err(format!(
                            "interface name `{value}` longer than 15 characters"
                        ))
                    } else {
                        Ok(())
                    }
                }
            }
            .map_err(|m| (cols.value(k), m))?;
        }
    }
    let facts = RuleFacts { family, proto };
    let mut loaded = Getopt::default();
    // An option no loaded extension knows makes iptables load the match of `-p` once and
    // try again (`-p ipv6-icmp -m udp --icmpv6-type 128` is valid); the parser already
    // created that match when options followed `-p` directly.
    let mut proto_used = rule
        .items
        .iter()
        .any(|i| matches!(i, Item::Module { implicit: true, .. }));
    let mut check_opts = |loaded: &mut Getopt<'r>, owner: &str, opts: &'r [Opt], at: usize| {
        for (o, (ncol, acols)) in opts.iter().zip(cols.opts(at)) {
            let resolved = match loaded.resolve(&o.name) {
                Err(m) => match proto.map(implicit_match) {
                    Some(ext) if !proto_used && is_match(family, ext) => {
                        proto_used = true;
                        loaded.load(ext, None);
                        loaded.resolve(&o.name).map_err(|m| (ncol, m))?
                    }
                    _ => return Err((ncol, m)),
                },
                Ok(r) => r,
            };
            if let Resolved::Known(i, full, kind) = resolved {
                let inst = &mut loaded.instances[i];
                if inst.saw(full) {
                    return Err((
                        ncol,
                        format!("{}: option `--{full}` can only be used once", inst.name),
                    ));
                }
                inst.mark(full);
                match full {
                    "mode" => inst.mode = Some(o),
                    "timestart" | "timestop" => {
                        let at = usize::from(full == "timestop");
                        inst.times[at] = o.args.first().and_then(|a| daytime_seconds(a));
                    }
                    _ => {}
                }
                check_args(&facts, owner, full, kind, o, (ncol, acols))?;
            }
        }
        Ok::<(), Problem>(())
    };
    for (k, item) in rule.items.iter().enumerate() {
        if let Item::Module {
            name,
            implicit,
            opts,
        } = item
        {
            let ext = if *implicit {
                implicit_match(name)
            } else {
                name.as_str()
            };
            if !*implicit && !is_match(family, ext) {
                return Err((cols.value(k), format!("unknown match `{name}`")));
            }
            loaded.load(ext, (!*implicit).then(|| cols.value(k)));
            check_opts(&mut loaded, ext, opts, k)?;
        }
    }
    let at = rule.items.len();
    let mut target_idx = None;
    if let Some(t) = &rule.target {
        let chain = is_chain(&t.name);
        if t.goto && !chain {
            return Err((cols.value(at), format!("goto `{}` is not a chain", t.name)));
        }
        if table == Some("nat") && t.name == "DROP" {
            return Err((
                cols.value(at),
                "the nat table is not intended for filtering: DROP is refused there".into(),
            ));
        }
        if chain {
            // A jump takes no options of its own.
            loaded.load("standard", None);
        } else {
            if table.is_some() && crate::savefile::is_builtin_chain(&t.name) {
                return Err((
                    cols.value(at),
                    format!("cannot jump to the built-in chain `{}`", t.name),
                ));
            }
            if !is_target(family, &t.name) {
                return Err((
                    cols.value(at),
                    format!(
                        "`{}` is neither a chain declared before this line nor a target",
                        t.name
                    ),
                ));
            }
            target_idx = Some(loaded.load(&t.name, None));
        }
        check_opts(&mut loaded, &t.name, &t.opts, at)?;
    }
    for (i, l) in loaded.instances.iter().enumerate() {
        // The nft back end wants `-p tcp` (negated or not) when tcp's options are used,
        // udp alike.
        if let (Some(col), "tcp" | "udp", true) = (l.explicit, l.name, l.seen != 0) {
            let num = if l.name == "tcp" { "6" } else { "17" };
            if !any_proto.is_some_and(|p| p.eq_ignore_ascii_case(l.name) || p == num) {
                return Err((
                    col,
                    format!("the {} match requires `-p {}`", l.name, l.name),
                ));
            }
        }
        if l.spec.is_none() {
            continue;
        }
        let col = if Some(i) == target_idx {
            cols.value(at)
        } else {
            cols.end()
        };
        check_complete(l).map_err(|m| (col, m))?;
    }
    Ok(())
}

/// The short flag for `--NAME` when NAME is a unique prefix of one of iptables' own long
/// options that the parser reads (`--j` -> `-j`) and no option of the loaded extensions
/// `exts` begins with it. Exact long names are left to the parser.
pub(crate) fn base_option(name: &str, exts: &[String]) -> Option<&'static str> {
    let mut hits = BASE_LONG.iter().filter(|b| b.starts_with(name));
    let (Some(full), None) = (hits.next(), hits.next()) else {
        return None;
    };
    if *full == name {
        return None;
    }
    let clash = exts
        .iter()
        .any(|e| spec(e).is_some_and(|s| s.opts.iter().any(|(o, _)| o.starts_with(name))));
    if clash {
        return None;
    }
    Some(match *full {
        "source" | "src" => "-s",
        "destination" | "dst" => "-d",
        "protocol" => "-p",
        "in-interface" => "-i",
        "out-interface" => "-o",
        "jump" => "-j",
        "goto" => "-g",
        "match" => "-m",
        "fragment" => "-f",
        _ => return None,
    })
}

/// The match `-p NAME` loads when its options follow without `-m`.
pub(crate) fn implicit_match(proto: &str) -> &str {
    match proto {
        "ipv6-icmp" | "icmpv6" => "icmp6",
        n => n,
    }
}

fn flag(k: Basic) -> &'static str {
    match k {
        Basic::Src => "-s",
        Basic::Dst => "-d",
        Basic::Proto => "-p",
        Basic::InIface => "-i",
        Basic::OutIface => "-o",
    }
}
