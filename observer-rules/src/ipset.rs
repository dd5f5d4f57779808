//! `ipset save` (and `ipset list`) contents and membership tests. A set whose contents were not
//! given, or whose type we do not model, answers "unknown" so the simulator can say
//! "undecidable" instead of guessing.

use std::collections::BTreeMap;
use std::net::IpAddr;

use crate::check::{inet_aton_ok, strtoul0};
use crate::error::ParseError;
use crate::net::Net;

/// The values a set lookup may need from the packet, per dimension direction.
#[derive(Debug, Clone, Copy)]
pub struct Lookup<'a> {
    pub src: IpAddr,
    pub dst: IpAddr,
    pub proto: u8,
    pub sport: Option<u16>,
    pub dport: Option<u16>,
    pub in_iface: Option<&'a str>,
    pub out_iface: Option<&'a str>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Ipset {
    pub name: String,
    pub kind: String,
    pub create_opts: Vec<String>,
    pub members: Vec<Member>,
}

/// One `add` element, split into its comma-separated dimensions.
#[derive(Debug, Clone, PartialEq)]
pub struct Member {
    pub dims: Vec<String>,
    pub nomatch: bool,
}

#[derive(Debug, Clone, PartialEq, Default)]
pub struct Ipsets {
    pub sets: BTreeMap<String, Ipset>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Dim {
    Ip,
    Net,
    Port,
    Iface,
    Mac,
    Mark,
    Set,
}

fn dims_of(kind: &str) -> Option<Vec<Dim>> {
    let (method, types) = kind.split_once(':')?;
    if method == "list" {
        return Some(vec![Dim::Set]);
    }
    types
        .split(',')
        .map(|t| match t {
            "ip" => Some(Dim::Ip),
            "net" => Some(Dim::Net),
            "port" => Some(Dim::Port),
            "iface" => Some(Dim::Iface),
            "mac" => Some(Dim::Mac),
            "mark" => Some(Dim::Mark),
            _ => None,
        })
        .collect()
}

fn proto_number(p: &str) -> Option<u8> {
    match p {
        "tcp" => Some(6),
        "udp" => Some(17),
        "sctp" => Some(132),
        "udplite" => Some(136),
        _ => None,
    }
}

impl Ipset {
    /// hash:* and bitmap:ip sets hold one family (`family inet` unless told otherwise);
    /// bitmap:port and list:set take any.
    fn family_matches(&self, v6: bool) -> bool {
        if !(self.kind.starts_with("hash:") || self.kind.starts_with("bitmap:ip")) {
            return true;
        }
        let fam = self
            .create_opts
            .windows(2)
            .find(|w| w[0] == "family")
            .map_or("inet", |w| w[1].as_str());
        (fam == "inet6") == v6
    }

    /// `Some(true/false)` when the packet's tuple (chosen by `dirs`, true = src) is a member;
    /// `None` when we cannot tell (type not modelled, or an iface/mac dimension).
    pub fn contains(
        &self,
        sets: &Ipsets,
        dirs: &[bool],
        l: &Lookup<'_>,
        depth: u8,
    ) -> Option<bool> {
        let dims = dims_of(&self.kind)?;
        if dims == [Dim::Set] {
            if depth > 4 {
                return None;
            }
            let mut unknown = false;
            for m in &self.members {
                match sets
                    .sets
                    .get(m.dims.first()?)?
                    .contains(sets, dirs, l, depth + 1)
                {
                    Some(true) => return Some(true),
                    Some(false) => {}
                    None => unknown = true,
                }
            }
            return if unknown { None } else { Some(false) };
        }
        // ip_set_test: fewer flags than the set has dimensions, or another family, never match.
        if dirs.len() < dims.len() || !self.family_matches(l.src.is_ipv6()) {
            return Some(false);
        }
        let mut best: Option<(u32, bool)> = None;
        for m in &self.members {
            if m.dims.len() != dims.len() {
                return None;
            }
            let mut ok = true;
            let mut spec = 0u32;
            for (i, (d, v)) in dims.iter().zip(&m.dims).enumerate() {
                let src = dirs[i];
                let addr = if src { l.src } else { l.dst };
                let hit = match d {
                    Dim::Ip | Dim::Net => {
                        // `ipset save` prints hash:ip ranges as CIDR too.
                        let n = Net::parse(v)?;
                        spec += u32::from(n.len);
                        n.contains(addr)
                    }
                    Dim::Port => {
                        let port = if src { l.sport } else { l.dport };
                        // `tcp:80`, `udp:53`, or a bare `80` which ipset reads as tcp.
                        let (pp, num) = v.split_once(':').unwrap_or(("tcp", v.as_str()));
                        proto_number(pp)? == l.proto
                            && port.is_some_and(|p| num.parse::<u16>().ok() == Some(p))
                    }
                    Dim::Iface => {
                        let iface = if src { l.in_iface } else { l.out_iface };
                        iface? == v
                    }
                    Dim::Mac | Dim::Mark | Dim::Set => return None,
                };
                if !hit {
                    ok = false;
                    break;
                }
            }
            if ok && best.is_none_or(|(s, _)| spec > s) {
                best = Some((spec, m.nomatch));
            }
        }
        Some(matches!(best, Some((_, false))))
    }
}

impl Ipsets {
    /// Membership of the packet in `name`; `None` when the set is unknown or undecidable.
    pub fn contains(&self, name: &str, dirs: &[bool], l: &Lookup<'_>) -> Option<bool> {
        self.sets.get(name)?.contains(self, dirs, l, 0)
    }
}

/// Parses `ipset save` output (`create` / `add` lines), or `ipset list` output
/// (`Name:` / `Type:` / `Members:` blocks).
pub fn parse_ipsets(text: &str) -> Result<Ipsets, ParseError> {
    if text
        .lines()
        .map(str::trim)
        .find(|l| !l.is_empty())
        .is_some_and(|l| l.starts_with("Name:"))
    {
        return parse_list(text);
    }
    let mut sets = Ipsets::default();
    for (i, line) in text.lines().enumerate() {
        let lineno = i + 1;
        let words: Vec<&str> = line.split_whitespace().collect();
        let Some(first) = words.first() else { continue };
        if first.starts_with('#') {
            continue;
        }
        let col = line.len() - line.trim_start().len() + 1;
        match *first {
            "create" | "-N" | "-exist" => {
                let (Some(name), Some(kind)) = (words.get(1), words.get(2)) else {
                    return Err(ParseError::new(
                        lineno,
                        col,
                        "create needs a set name and a type",
                    ));
                };
                if dims_of(kind).is_none() {
                    return Err(ParseError::new(
                        lineno,
                        col,
                        format!("unknown set type `{kind}`"),
                    ));
                }
                if sets.sets.contains_key(*name) {
                    return Err(ParseError::new(
                        lineno,
                        column_of(line, 2),
                        format!("set `{name}` created twice"),
                    ));
                }
                sets.sets.insert(
                    name.to_string(),
                    Ipset {
                        name: name.to_string(),
                        kind: kind.to_string(),
                        create_opts: words[3..].iter().map(|s| s.to_string()).collect(),
                        members: Vec::new(),
                    },
                );
            }
            "add" | "-A" => {
                let (Some(name), Some(elem)) = (words.get(1), words.get(2)) else {
                    return Err(ParseError::new(
                        lineno,
                        col,
                        "add needs a set name and an element",
                    ));
                };
                let Some(set) = sets.sets.get(*name) else {
                    return Err(ParseError::new(
                        lineno,
                        col,
                        format!("add to set `{name}` before its create line"),
                    ));
                };
                let elem_col = column_of(line, 3);
                check_element(set, elem, &sets)
                    .map_err(|m| ParseError::new(lineno, elem_col, format!("set `{name}`: {m}")))?;
                if words[3..].contains(&"nomatch") && !set.kind.contains("net") {
                    return Err(ParseError::new(
                        lineno,
                        column_of(line, 4),
                        format!("`nomatch` is only for net sets, not {}", set.kind),
                    ));
                }
                check_add_options(&words[3..])
                    .map_err(|(i, m)| ParseError::new(lineno, column_of(line, 4 + i), m))?;
                let set = sets.sets.get_mut(*name).expect("looked up above");
                set.members.push(Member {
                    dims: elem.split(',').map(str::to_string).collect(),
                    nomatch: words[3..].contains(&"nomatch"),
                });
            }
            other => {
                return Err(ParseError::new(
                    lineno,
                    col,
                    format!("expected `create` or `add`, found `{other}`"),
                ));
            }
        }
    }
    Ok(sets)
}

/// 1-based column of the `n`th (1-based) whitespace-separated word of `line`.
fn column_of(line: &str, n: usize) -> usize {
    let mut col = 1;
    let mut words = 0;
    let mut in_word = false;
    for c in line.chars() {
        if c.is_whitespace() {
            in_word = false;
        } else if !in_word {
            in_word = true;
            words += 1;
            if words == n {
                return col;
            }
        }
        col += 1;
    }
    col
}

/// An address, `addr/len` (`min_len` up to the family's width) or `from-to` range.
fn check_addr(v6: bool, s: &str, min_len: u64) -> Result<(), String> {
    let one = |a: &str| {
        if v6 {
            a.parse::<std::net::Ipv6Addr>().is_ok()
        } else {
            inet_aton_ok(a)
        }
    };
    let fam = if v6 { "IPv6" } else { "IPv4" };
    if let Some((a, len)) = s.split_once('/') {
        if !one(a) {
            return Err(format!("cannot parse `{a}` as an {fam} address"));
        }
        let max = if v6 { 128 } else { 32 };
        return match strtoul0(len, max) {
            Some(n) if n >= min_len => Ok(()),
            _ => Err(format!(
                "prefix length `{len}` out of range {min_len}-{max}"
            )),
        };
    }
    let (a, b) = s.split_once('-').unwrap_or((s, s));
    if !v6 && a.contains(':') || !one(a) || !one(b) {
        return Err(format!("cannot parse `{s}` as an {fam} address"));
    }
    Ok(())
}

/// `[proto:]port[-port]`, as hash:*,port sets read it.
fn check_port(s: &str) -> Result<(), String> {
    let (proto, ports) = match s.split_once(':') {
        Some((p, n)) => (p, n),
        None => ("tcp", s),
    };
    if matches!(proto, "icmp" | "icmpv6") {
        // icmp:TYPE/CODE or a name; not modelled.
        return Ok(());
    }
    if proto_number(proto).is_none() {
        return Err(format!("cannot parse `{proto}` as a protocol"));
    }
    let (a, b) = ports.split_once('-').unwrap_or((ports, ports));
    if strtoul0(a, 65535).is_none() || strtoul0(b, 65535).is_none() {
        return Err(format!("cannot parse `{ports}` as a {proto} port"));
    }
    Ok(())
}

/// One `add` element against its set's type, the way `ipset restore` checks it.
fn check_element(set: &Ipset, elem: &str, sets: &Ipsets) -> Result<(), String> {
    let Some(dims) = dims_of(&set.kind) else {
        return Ok(());
    };
    let v6 = set
        .create_opts
        .windows(2)
        .any(|w| w[0] == "family" && w[1] == "inet6");
    let parts: Vec<&str> = elem.split(',').collect();
    if parts.len() < dims.len() {
        return Err(format!(
            "element `{elem}` has {} of the {} parts of {}",
            parts.len(),
            dims.len(),
            set.kind
        ));
    }
    for (d, p) in dims.iter().zip(&parts) {
        match d {
            Dim::Ip if set.kind.starts_with("bitmap:") => check_addr(false, p, 1),
            Dim::Ip => check_addr(v6, p, 1),
            Dim::Net => check_addr(v6, p, 1),
            Dim::Port if set.kind.starts_with("bitmap:") => strtoul0(p, 65535)
                .map(|_| ())
                .ok_or_else(|| format!("cannot parse `{p}` as a port")),
            Dim::Port => check_port(p),
            Dim::Iface => {
                let name = p.strip_prefix("physdev:").unwrap_or(p);
                if name.is_empty() || name.len() > 15 {
                    Err(format!(
                        "interface name `{name}` is empty or longer than 15 characters"
                    ))
                } else {
                    Ok(())
                }
            }
            Dim::Mac => {
                let ok = p.split(':').count() == 6
                    && p.split(':')
                        .all(|b| b.len() <= 2 && u8::from_str_radix(b, 16).is_ok());
                if ok {
                    Ok(())
                } else {
                    Err(format!("cannot parse `{p}` as a MAC address"))
                }
            }
            Dim::Mark => strtoul0(p, u64::from(u32::MAX))
                .map(|_| ())
                .ok_or_else(|| format!("cannot parse `{p}` as a mark")),
            Dim::Set => {
                if sets.sets.contains_key(*p) {
                    Ok(())
                } else {
                    Err(format!("set `{p}` does not exist"))
                }
            }
        }?;
    }
    if parts.len() > dims.len() && !dims.contains(&Dim::Set) {
        return Err(format!("element `{elem}` has more parts than {}", set.kind));
    }
    Ok(())
}

/// What may follow an element: `nomatch` and the extensions' `KEY VALUE` pairs.
fn check_add_options(words: &[&str]) -> Result<(), (usize, String)> {
    let mut i = 0;
    while i < words.len() {
        match words[i] {
            "nomatch" | "-exist" => i += 1,
            "timeout" | "packets" | "bytes" | "skbmark" | "skbprio" | "skbqueue" => {
                if words.get(i + 1).is_none() {
                    return Err((i, format!("`{}` needs a value", words[i])));
                }
                i += 2;
            }
            "comment" => {
                // A quoted comment may hold spaces: skip to its closing quote.
                i += 1;
                if words.get(i).is_some_and(|w| w.starts_with('"')) {
                    while i < words.len() && !(words[i].ends_with('"') && words[i].len() > 1) {
                        i += 1;
                    }
                }
                i += 1;
            }
            other => return Err((i, format!("unknown argument `{other}`"))),
        }
    }
    Ok(())
}

fn parse_list(text: &str) -> Result<Ipsets, ParseError> {
    let mut sets = Ipsets::default();
    let mut current: Option<Ipset> = None;
    let mut in_members = false;
    let mut pending_name = false;
    for (i, line) in text.lines().enumerate() {
        let l = line.trim();
        if l.is_empty() {
            continue;
        }
        if let Some(rest) = l.strip_prefix("Name:") {
            if let Some(s) = current.take() {
                sets.sets.insert(s.name.clone(), s);
            }
            in_members = false;
            let name = rest.trim();
            pending_name = name.is_empty();
            current = Some(Ipset {
                name: name.to_string(),
                kind: String::new(),
                create_opts: Vec::new(),
                members: Vec::new(),
            });
            continue;
        }
        let Some(set) = current.as_mut() else {
            return Err(ParseError::new(i + 1, 1, "expected `Name:`"));
        };
        if pending_name {
            // Copied blog text sometimes wraps the name onto its own line.
            set.name = l.to_string();
            pending_name = false;
        } else if let Some(k) = l.strip_prefix("Type:") {
            set.kind = k.trim().to_string();
        } else if let Some(h) = l.strip_prefix("Header:") {
            set.create_opts = h.split_whitespace().map(str::to_string).collect();
        } else if l.starts_with("Members:") {
            in_members = true;
        } else if in_members {
            let mut w = l.split_whitespace();
            let elem = w.next().unwrap_or_default();
            set.members.push(Member {
                dims: elem.split(',').map(str::to_string).collect(),
                nomatch: w.any(|x| x == "nomatch"),
            });
        }
    }
    if let Some(s) = current.take() {
        sets.sets.insert(s.name.clone(), s);
    }
    Ok(sets)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lk(src: &str, dst: &str, dport: u16) -> Lookup<'static> {
        Lookup {
            src: src.parse().unwrap(),
            dst: dst.parse().unwrap(),
            proto: 6,
            sport: Some(40000),
            dport: Some(dport),
            in_iface: Some("eth0"),
            out_iface: None,
        }
    }

    #[test]
    fn save_format_membership() {
        let s = parse_ipsets(
            "create n hash:net family inet hashsize 1024 maxelem 65536\nadd n 10.0.0.0/8\nadd n 10.1.0.0/16 nomatch\n\
             create ipp hash:ip,port family inet\nadd ipp 10.1.1.1,tcp:80\n\
             create l list:set\nadd l n\n",
        )
        .unwrap();
        assert_eq!(
            s.contains("n", &[true], &lk("10.2.0.1", "1.1.1.1", 80)),
            Some(true)
        );
        assert_eq!(
            s.contains("n", &[true], &lk("10.1.0.1", "1.1.1.1", 80)),
            Some(false)
        );
        assert_eq!(
            s.contains("n", &[false], &lk("10.2.0.1", "1.1.1.1", 80)),
            Some(false)
        );
        assert_eq!(
            s.contains("ipp", &[false, false], &lk("1.1.1.1", "10.1.1.1", 80)),
            Some(true)
        );
        assert_eq!(
            s.contains("ipp", &[false, false], &lk("1.1.1.1", "10.1.1.1", 81)),
            Some(false)
        );
        assert_eq!(
            s.contains("l", &[true], &lk("10.2.0.1", "1.1.1.1", 80)),
            Some(true)
        );
        assert_eq!(
            s.contains("missing", &[true], &lk("10.2.0.1", "1.1.1.1", 80)),
            None
        );
        // One flag for a two-dimension set never matches (kernel ip_set_test).
        assert_eq!(
            s.contains("ipp", &[false], &lk("1.1.1.1", "10.1.1.1", 80)),
            Some(false)
        );
        // An IPv4 set never matches an IPv6 packet.
        let mut v6 = lk("10.2.0.1", "1.1.1.1", 80);
        v6.src = "::1".parse().unwrap();
        assert_eq!(s.contains("n", &[true], &v6), Some(false));
    }

    #[test]
    fn list_format_from_the_seed() {
        let s = parse_ipsets(
            "Name:\ncali40masq-ipam-pools\nType: hash:net\nRevision: 3\nHeader: family inet hashsize 1024\n\
             Members:\n192.170.0.0/16\n\nName: b\nType: hash:ip\nMembers:\n",
        )
        .unwrap();
        assert_eq!(
            s.contains(
                "cali40masq-ipam-pools",
                &[true],
                &lk("192.170.3.4", "1.1.1.1", 1)
            ),
            Some(true)
        );
        assert_eq!(
            s.contains("b", &[true], &lk("192.170.3.4", "1.1.1.1", 1)),
            Some(false)
        );
    }

    #[test]
    fn invalid_entries_are_errors_as_in_ipset_restore() {
        // Each was checked with `ipset restore` (v7.17) in a throwaway namespace.
        let add = |kind: &str, e: &str| {
            parse_ipsets(&format!("create s {kind} family inet\nadd s {e}\n")).map(|_| ())
        };
        let e = add("hash:net", "1.2.3.400").unwrap_err();
        assert_eq!((e.line, e.column), (2, 7));
        assert!(add("hash:net", "1.2.3.4/33").is_err());
        assert!(add("hash:net", "1.2.3.4/0").is_err());
        assert!(add("hash:ip,port", "1.2.3.4,udp:99999").is_err());
        assert!(add("hash:ip,port", "1.2.3.4,foo:80").is_err());
        assert!(add("hash:ip,port", "1.2.3.4").is_err());
        assert!(add("hash:net", "1.2.3.4 junk").is_err());
        assert!(parse_ipsets("create s hash:net family inet6\nadd s fd00::/129\n").is_err());
        assert!(parse_ipsets("create s hash:net family inet6\nadd s 1.2.3.4\n").is_err());
        assert!(parse_ipsets("create l list:set\nadd l nosuch\n").is_err());
        assert!(parse_ipsets("create s hash:ip\ncreate s hash:ip\n").is_err());
        for ok in [
            "10.1",
            "1.2.3.4-1.2.3.9",
            "10.0.0.0/8 nomatch",
            "10.0.0.0/8 timeout 5",
        ] {
            add("hash:net", ok).unwrap_or_else(|e| panic!("{ok}: {e}"));
        }
        add("hash:ip,port", "1.2.3.4,80").unwrap();
    }

    #[test]
    fn malformed_lines_report_position() {
        let e = parse_ipsets("create a hash:ip\n  add b 1.2.3.4\n").unwrap_err();
        assert_eq!((e.line, e.column), (2, 3));
        assert!(parse_ipsets("create a hash:wat\n").is_err());
        assert!(parse_ipsets("flush\n").is_err());
    }
}
