//! The parser: tokens -> AST (recursive descent, pcap precedence), each primitive resolved
//! to what one [`Atom`] tests.

use std::net::{IpAddr, Ipv4Addr};

use observer_common::filter::{Atom, MAX_ATOMS, MAX_TERMS, atom, dir};

use super::lexer::{Kind, Token, tokenize};
use super::{FilterError, MAX_DEPTH};

/// The parsed expression. `None` for an empty expression.
pub(super) fn parse(
    expr: &str,
    ifindex: &dyn Fn(&str) -> Option<u32>,
) -> Result<Option<Expr>, FilterError> {
    let toks = tokenize(expr)?;
    if toks.is_empty() {
        return Ok(None);
    }
    let mut p = Parser {
        expr,
        toks,
        i: 0,
        ifindex,
    };
    let (e, _) = p.expr(0)?;
    if let Some(t) = p.peek() {
        let msg = if t.kind == Kind::RParen {
            "unmatched `)`".to_string()
        } else {
            format!(
                "expected `and`, `or` or the end of the filter before `{}` (tcpdump too needs \
                 `and` between primitives)",
                t.text
            )
        };
        return Err(p.err(t, msg));
    }
    Ok(Some(e))
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Expr {
    Prim(Prim),
    Not(Box<Expr>),
    And(Box<Expr>, Box<Expr>),
    Or(Box<Expr>, Box<Expr>),
}

/// One primitive; each becomes exactly one [`Atom`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Prim {
    /// IP protocol, optionally only for one IP version (`icmp` is IPv4's, `icmp6` IPv6's).
    Proto {
        proto: u8,
        version: u8,
    },
    IpVersion(u8),
    /// `host` (full mask) and `net`; `addr` is already masked.
    Addr {
        dir: u8,
        version: u8,
        addr: [u8; 16],
        mask: [u8; 16],
    },
    Port {
        dir: u8,
        lo: u16,
        hi: u16,
    },
    Iface {
        dir: u8,
        ifindex: u32,
    },
    Mark {
        value: u32,
        mask: u32,
    },
}

impl Prim {
    pub(super) fn atom(self, negate: bool) -> Atom {
        let mut a = Atom::EMPTY;
        a.negate = u8::from(negate);
        match self {
            Prim::Proto { proto, version } => {
                a.kind = atom::PROTO;
                a.a = u32::from(proto);
                a.ip_version = version;
            }
            Prim::IpVersion(v) => {
                a.kind = atom::IP_VERSION;
                a.a = u32::from(v);
            }
            Prim::Addr {
                dir,
                version,
                addr,
                mask,
            } => {
                a.kind = atom::ADDR;
                a.dir = dir;
                a.ip_version = version;
                a.addr = addr;
                a.mask = mask;
            }
            Prim::Port { dir, lo, hi } => {
                a.kind = atom::PORT;
                a.dir = dir;
                a.a = u32::from(lo);
                a.b = u32::from(hi);
            }
            Prim::Iface { dir, ifindex } => {
                a.kind = atom::IFINDEX;
                a.dir = dir;
                a.a = ifindex;
            }
            Prim::Mark { value, mask } => {
                a.kind = atom::MARK;
                a.a = value;
                a.b = mask;
            }
        }
        a
    }
}

pub(super) struct Parser<'a> {
    expr: &'a str,
    toks: Vec<Token<'a>>,
    i: usize,
    ifindex: &'a dyn Fn(&str) -> Option<u32>,
}

pub(super) const PRIMITIVES: &str = "`tcp`, `udp`, `sctp`, `icmp`, `icmp6`, `ip`, `ip6`, `proto N`, \
                          `host A`, `net A/LEN`, `port N`, `portrange A-B`, `src ...`, \
                          `dst ...`, `iface NAME`, `mark V[/MASK]`, `not`, `(`";

/// pcap keywords this subset does not implement (so they get a precise error).
pub(super) const UNSUPPORTED: &[&str] = &[
    "ether",
    "arp",
    "rarp",
    "vlan",
    "mpls",
    "pppoed",
    "pppoes",
    "geneve",
    "len",
    "less",
    "greater",
    "gateway",
    "broadcast",
    "multicast",
    "inbound",
    "outbound",
    "ifname",
    "on",
    "protochain",
    "igmp",
    "igrp",
    "pim",
    "vrrp",
    "carp",
    "ah",
    "esp",
    "atalk",
    "decnet",
    "iso",
    "stp",
    "ipx",
    "llc",
    "wlan",
    "link",
    "fddi",
    "tr",
    "ppp",
    "slip",
    "radio",
];

impl<'a> Parser<'a> {
    fn peek(&self) -> Option<Token<'a>> {
        self.toks.get(self.i).copied()
    }

    fn peek_word(&self, offset: usize) -> Option<&'a str> {
        self.toks
            .get(self.i + offset)
            .filter(|t| t.kind == Kind::Word)
            .map(|t| t.text)
    }

    fn bump(&mut self) -> Option<Token<'a>> {
        let t = self.peek();
        self.i += usize::from(t.is_some());
        t
    }

    fn err(&self, t: Token<'_>, msg: impl Into<String>) -> FilterError {
        FilterError::new(self.expr, t.pos, t.text.len(), msg)
    }

    /// An error at the next token, or at the end when there is none.
    fn err_next(&self, msg: impl Into<String>) -> FilterError {
        match self.peek() {
            Some(t) => self.err(t, msg),
            None => FilterError::new(self.expr, self.expr.len(), 0, msg),
        }
    }

    /// The next token, which must be a word, for the value of `after`.
    fn value(&mut self, expected: &str, after: &str) -> Result<Token<'a>, FilterError> {
        match self.peek() {
            Some(t) if t.kind == Kind::Word => {
                self.i += 1;
                Ok(t)
            }
            _ => Err(self.err_next(format!("expected {expected} after `{after}`"))),
        }
    }

    /// pcap: `and` and `or` have the same precedence and group left to right, so
    /// `tcp or udp and port 53` is `(tcp or udp) and port 53`; `not` binds tightest.
    /// `level`: the parentheses and `not`s around; returns the expression and its height,
    /// both bounded by [`MAX_DEPTH`] (the parser and every pass over the tree recurse).
    fn expr(&mut self, level: usize) -> Result<(Expr, usize), FilterError> {
        let (mut lhs, mut height) = self.unary(level)?;
        while let Some(t) = self.peek() {
            let make: fn(Box<Expr>, Box<Expr>) -> Expr = match t.kind {
                Kind::And => Expr::And,
                Kind::Or => Expr::Or,
                _ => break,
            };
            self.i += 1;
            let (rhs, h) = self.unary(level)?;
            height = height.max(h) + 1;
            if level + height > MAX_DEPTH {
                return Err(self.too_deep(t));
            }
            lhs = make(Box::new(lhs), Box::new(rhs));
        }
        Ok((lhs, height))
    }

    fn too_deep(&self, t: Token<'_>) -> FilterError {
        self.err(
            t,
            format!(
                "filter too deep: more than {MAX_DEPTH} levels here (each `(`, `not`, `and` \
                 and `or` is one); a filter the probes can run needs far fewer \
                 (at most {MAX_TERMS} alternatives of {MAX_ATOMS} conditions)"
            ),
        )
    }

    fn unary(&mut self, level: usize) -> Result<(Expr, usize), FilterError> {
        let Some(t) = self.peek() else {
            let msg = match self.toks.last() {
                Some(last) => format!("expected a primitive after `{}`", last.text),
                None => "empty filter".to_string(),
            };
            return Err(self.err_next(msg));
        };
        if matches!(t.kind, Kind::Not | Kind::LParen) && level + 1 > MAX_DEPTH {
            return Err(self.too_deep(t));
        }
        match t.kind {
            Kind::Not => {
                self.i += 1;
                let (e, h) = self.unary(level + 1)?;
                Ok((Expr::Not(Box::new(e)), h + 1))
            }
            Kind::LParen => {
                self.i += 1;
                let (e, h) = self.expr(level + 1)?;
                match self.peek() {
                    Some(c) if c.kind == Kind::RParen => {
                        self.i += 1;
                        Ok((e, h))
                    }
                    _ => Err(self.err(t, "this `(` is not closed: expected `)`")),
                }
            }
            Kind::Word => {
                self.i += 1;
                Ok((self.primitive(t)?, 1))
            }
            Kind::RParen | Kind::And | Kind::Or => Err(self.err(
                t,
                format!(
                    "expected a primitive before `{}`: one of {PRIMITIVES}",
                    t.text
                ),
            )),
        }
    }

    fn primitive(&mut self, t: Token<'a>) -> Result<Expr, FilterError> {
        let prim = |p| Ok(Expr::Prim(p));
        match t.text {
            "tcp" | "udp" | "sctp" => {
                let proto = match t.text {
                    "tcp" => 6,
                    "udp" => 17,
                    _ => 132,
                };
                let p = Expr::Prim(Prim::Proto { proto, version: 0 });
                match self.peek_word(0) {
                    Some("port" | "portrange" | "src" | "dst") => {
                        let q = self.bump().expect("peeked");
                        let ports = self.qualified(q, Qualifier::Ports(t.text))?;
                        Ok(Expr::And(Box::new(p), Box::new(ports)))
                    }
                    Some(w @ ("host" | "net")) => Err(self.err_next(format!(
                        "`{}` cannot qualify `{w}` (tcpdump refuses it too); write `{} and {w} \
                         ...`",
                        t.text, t.text
                    ))),
                    _ => Ok(p),
                }
            }
            "icmp" => prim(Prim::Proto {
                proto: 1,
                version: 4,
            }),
            "icmp6" => prim(Prim::Proto {
                proto: 58,
                version: 6,
            }),
            "ip" | "ip6" => {
                let version = if t.text == "ip" { 4 } else { 6 };
                match self.peek_word(0) {
                    Some("host" | "net" | "src" | "dst" | "proto" | "port" | "portrange") => {
                        let q = self.bump().expect("peeked");
                        self.qualified(q, Qualifier::Family(t.text, version))
                    }
                    _ => prim(Prim::IpVersion(version)),
                }
            }
            "proto" | "host" | "net" | "port" | "portrange" | "src" | "dst" => {
                self.qualified(t, Qualifier::None)
            }
            "iface" => {
                let name = self.value("an interface name", "iface")?;
                match (self.ifindex)(name.text) {
                    Some(ifindex) => prim(Prim::Iface {
                        dir: dir::EITHER,
                        ifindex,
                    }),
                    None => Err(self.err(
                        name,
                        format!(
                            "no interface named `{}` (in the traced network namespace)",
                            name.text
                        ),
                    )),
                }
            }
            "mark" => {
                let v = self.value("a mark like 0x4000 or 0x4000/0xc000", "mark")?;
                let (value, mask) = self.mark(v)?;
                prim(Prim::Mark { value, mask })
            }
            w => Err(self.err(t, unknown_word(w))),
        }
    }

    /// `host`, `net`, `port`, `portrange`, `proto` or a `src`/`dst` qualifier (already
    /// consumed as `t`) and what follows, under an optional protocol or family qualifier.
    fn qualified(&mut self, t: Token<'a>, q: Qualifier<'_>) -> Result<Expr, FilterError> {
        let (d, both, kw) = if matches!(t.text, "src" | "dst") {
            let (d, both) = self.direction(t);
            let kw = match self.peek_word(0) {
                Some(w @ ("host" | "net" | "port" | "portrange")) => {
                    let k = self.bump().expect("peeked");
                    debug_assert_eq!(k.text, w);
                    Some(k)
                }
                // pcap: `src 10.0.0.1` means `src host 10.0.0.1`.
                _ => None,
            };
            (d, both, kw)
        } else {
            (dir::EITHER, false, Some(t))
        };
        let what = kw.map_or("host", |k| k.text);
        match (q, what) {
            (Qualifier::Ports(p), "host" | "net" | "proto") => {
                let at = kw.unwrap_or(t);
                return Err(self.err(
                    at,
                    format!(
                        "`{p}` qualifies only `port` and `portrange`; write `{p} and {what} ...`"
                    ),
                ));
            }
            (Qualifier::Family(f, _), "port" | "portrange") => {
                let at = kw.unwrap_or(t);
                return Err(self.err(
                    at,
                    format!("`{f}` cannot qualify `{what}`; write `{f} and {what} ...`"),
                ));
            }
            _ => {}
        }
        let version = match q {
            Qualifier::Family(_, v) => v,
            _ => 0,
        };
        let after = kw.unwrap_or(t).text;
        let one = |p: &mut Self, d: u8| -> Result<Prim, FilterError> {
            match what {
                "host" => p.host(d, after, q),
                "net" => p.net(d, q),
                "port" => p.port(d),
                "portrange" => p.portrange(d),
                _ => p.proto(version),
            }
        };
        let first = one(self, d)?;
        if both {
            // `src and dst host A`: both must hold.
            let mut second = first;
            match &mut second {
                Prim::Addr { dir, .. } | Prim::Port { dir, .. } => *dir = dir::DST,
                _ => {}
            }
            let mut first = first;
            if let Prim::Addr { dir, .. } | Prim::Port { dir, .. } = &mut first {
                *dir = dir::SRC;
            }
            return Ok(Expr::And(
                Box::new(Expr::Prim(first)),
                Box::new(Expr::Prim(second)),
            ));
        }
        Ok(Expr::Prim(first))
    }

    /// After `src`/`dst` (consumed as `t`): the direction, and whether both must match
    /// (`src and dst`). `src or dst` is the default "either".
    fn direction(&mut self, t: Token<'a>) -> (u8, bool) {
        let other = if t.text == "src" { "dst" } else { "src" };
        let joined = self.peek().map(|j| j.kind);
        if matches!(joined, Some(Kind::And | Kind::Or)) && self.peek_word(1) == Some(other) {
            self.i += 2;
            return (dir::EITHER, joined == Some(Kind::And));
        }
        (if t.text == "src" { dir::SRC } else { dir::DST }, false)
    }

    fn host(&mut self, d: u8, after: &str, q: Qualifier<'_>) -> Result<Prim, FilterError> {
        let v = self.value("an IPv4 or IPv6 address", after)?;
        if v.text.contains('/') {
            return Err(self.err(
                v,
                format!(
                    "a host takes no prefix length (tcpdump: mask syntax for networks only); \
                     write `net {}`",
                    v.text
                ),
            ));
        }
        let Ok(ip) = v.text.parse::<IpAddr>() else {
            let msg = if v.text.chars().any(|c| c.is_ascii_alphabetic()) && !v.text.contains(':') {
                format!(
                    "expected an IPv4 or IPv6 address after `{after}`; host names like `{}` \
                     are not resolved",
                    v.text
                )
            } else {
                format!("expected an IPv4 or IPv6 address after `{after}`")
            };
            return Err(self.err(v, msg));
        };
        let bits = if ip.is_ipv4() { 32 } else { 128 };
        self.masked(v, d, ip, prefix_mask(ip, bits), q)
    }

    fn net(&mut self, d: u8, q: Qualifier<'_>) -> Result<Prim, FilterError> {
        let v = self.value("a network like 10.0.0.0/8 or 2001:db8::/32", "net")?;
        let (addr_text, len_text) = match v.text.split_once('/') {
            Some((a, l)) => (a, Some(l)),
            None => (v.text, None),
        };
        let Ok(ip) = addr_text.parse::<IpAddr>() else {
            return Err(self.err(
                v,
                "expected a network like 10.0.0.0/8 or 2001:db8::/32 after `net` (tcpdump's \
                 abbreviated `net 10` is not supported: write `net 10.0.0.0/8`)",
            ));
        };
        let max = if ip.is_ipv4() { 32 } else { 128 };
        if let Some(l) = len_text {
            return match l.parse::<u32>() {
                Ok(bits) if bits <= max && !l.starts_with('+') => {
                    self.masked(v, d, ip, prefix_mask(ip, bits), q)
                }
                _ => Err(self.err(
                    v,
                    format!("expected a prefix length from 0 to {max} after `/`"),
                )),
            };
        }
        if self.peek_word(0) == Some("mask") {
            let kw = self.bump().expect("peeked");
            let m = self.value("a dotted IPv4 mask like 255.255.0.0", "mask")?;
            let (IpAddr::V4(_), Ok(mask)) = (ip, m.text.parse::<Ipv4Addr>()) else {
                return Err(self.err(
                    if ip.is_ipv4() { m } else { kw },
                    "`mask` takes a dotted IPv4 mask like 255.255.0.0 and applies only to \
                     IPv4 networks",
                ));
            };
            let mut mb = [0; 16];
            mb[..4].copy_from_slice(&mask.octets());
            return self.masked(v, d, ip, mb, q);
        }
        self.masked(v, d, ip, prefix_mask(ip, max), q)
    }

    fn masked(
        &self,
        v: Token<'_>,
        d: u8,
        ip: IpAddr,
        mask: [u8; 16],
        q: Qualifier<'_>,
    ) -> Result<Prim, FilterError> {
        let (version, addr) = match ip {
            IpAddr::V4(a) => {
                let mut o = [0; 16];
                o[..4].copy_from_slice(&a.octets());
                (4, o)
            }
            IpAddr::V6(a) => (6, a.octets()),
        };
        if let Qualifier::Family(f, want) = q
            && want != version
        {
            let fam = if version == 4 { "an IPv4" } else { "an IPv6" };
            return Err(self.err(v, format!("`{f}` applied to {fam} address")));
        }
        if addr.iter().zip(&mask).any(|(a, m)| a & !m != 0) {
            return Err(self.err(
                v,
                format!(
                    "non-network bits set in `{}` (tcpdump refuses it too)",
                    v.text
                ),
            ));
        }
        Ok(Prim::Addr {
            dir: d,
            version,
            addr,
            mask,
        })
    }

    fn port(&mut self, d: u8) -> Result<Prim, FilterError> {
        let v = self.value("a port number", "port")?;
        let p = self.number(v, "a port number after `port`", u64::from(u16::MAX))? as u16;
        Ok(Prim::Port {
            dir: d,
            lo: p,
            hi: p,
        })
    }

    fn portrange(&mut self, d: u8) -> Result<Prim, FilterError> {
        let expected = "a port range like 1024-65535";
        let v = self.value(expected, "portrange")?;
        let Some((a, b)) = v.text.split_once('-') else {
            return Err(self.err(v, format!("expected {expected} after `portrange`")));
        };
        let parse = |s: &str| parse_number(s).ok().filter(|&n| n <= u64::from(u16::MAX));
        let (Some(a), Some(b)) = (parse(a), parse(b)) else {
            return Err(self.err(v, format!("expected {expected} after `portrange`")));
        };
        // pcap accepts the bounds in either order.
        let (lo, hi) = (a.min(b) as u16, a.max(b) as u16);
        Ok(Prim::Port { dir: d, lo, hi })
    }

    fn proto(&mut self, version: u8) -> Result<Prim, FilterError> {
        let v = self.value("a protocol number", "proto")?;
        let n = self.number(v, "a protocol number (0-255) after `proto`", 255)? as u8;
        Ok(Prim::Proto { proto: n, version })
    }

    fn mark(&self, v: Token<'_>) -> Result<(u32, u32), FilterError> {
        let expected = "expected a mark like 0x4000 or 0x4000/0xc000 after `mark`";
        let (val, mask) = match v.text.split_once('/') {
            Some((a, m)) => (a, Some(m)),
            None => (v.text, None),
        };
        let max = u64::from(u32::MAX);
        let num = |s: &str| parse_number(s).ok().filter(|&n| n <= max).map(|n| n as u32);
        let value = num(val).ok_or_else(|| self.err(v, expected))?;
        let mask = match mask {
            Some(m) => num(m).ok_or_else(|| self.err(v, expected))?,
            None => u32::MAX,
        };
        if value & !mask != 0 {
            return Err(self.err(
                v,
                format!(
                    "mark value {value:#x} has bits outside the mask {mask:#x}, so it could \
                     never match"
                ),
            ));
        }
        Ok((value, mask))
    }

    fn number(&self, v: Token<'_>, expected: &str, max: u64) -> Result<u64, FilterError> {
        match parse_number(v.text) {
            Ok(n) if n <= max => Ok(n),
            Ok(n) => Err(self.err(v, format!("expected {expected}: {n} is more than {max}"))),
            Err(NumError::Octal) => Err(self.err(
                v,
                format!(
                    "expected {expected}: tcpdump reads a leading 0 as octal; write the \
                     number without it, or in hex with 0x"
                ),
            )),
            Err(NumError::Invalid) => Err(self.err(v, format!("expected {expected}"))),
        }
    }
}

/// What a protocol or family keyword in front of a primitive allows.
#[derive(Debug, Clone, Copy)]
pub(super) enum Qualifier<'a> {
    None,
    /// `tcp`/`udp`/`sctp` in front of `port`/`portrange`.
    Ports(&'a str),
    /// `ip`/`ip6` (and its version) in front of `host`/`net`/`proto`.
    Family(&'a str, u8),
}

#[derive(Debug, PartialEq, Eq)]
pub(super) enum NumError {
    Invalid,
    /// `023`: pcap would read octal; refusing is better than disagreeing.
    Octal,
}

/// Decimal or `0x` hex.
pub(super) fn parse_number(s: &str) -> Result<u64, NumError> {
    if let Some(hex) = s.strip_prefix("0x").or_else(|| s.strip_prefix("0X")) {
        if hex.is_empty() || !hex.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err(NumError::Invalid);
        }
        return u64::from_str_radix(hex, 16).map_err(|_| NumError::Invalid);
    }
    if s.is_empty() || !s.bytes().all(|b| b.is_ascii_digit()) {
        return Err(NumError::Invalid);
    }
    if s.len() > 1 && s.starts_with('0') {
        return Err(NumError::Octal);
    }
    s.parse().map_err(|_| NumError::Invalid)
}

pub(super) fn unknown_word(w: &str) -> String {
    if w.contains('[') {
        return format!("packet byte accessors like `{w}` are not supported; use {PRIMITIVES}");
    }
    if w.contains(['<', '>', '=']) {
        return format!("comparisons like `{w}` are not supported; use {PRIMITIVES}");
    }
    if UNSUPPORTED.contains(&w) {
        return format!("`{w}` is a tcpdump keyword that observer does not support");
    }
    if w.parse::<IpAddr>().is_ok() || parse_number(w).is_ok() || w.contains('/') {
        return format!(
            "`{w}` needs a keyword before it, like `host {w}` or `port {w}` (tcpdump's reuse \
             of the previous keyword is not supported)"
        );
    }
    format!("unknown keyword `{w}`: expected one of {PRIMITIVES}")
}

/// The mask of a `bits`-long prefix of `ip`'s family, left-aligned in 16 bytes.
fn prefix_mask(ip: IpAddr, bits: u32) -> [u8; 16] {
    let total = if ip.is_ipv4() { 32 } else { 128 };
    let m: u128 = if bits == 0 {
        0
    } else {
        u128::MAX << (128 - bits)
    };
    let mut mask = [0; 16];
    mask[..total as usize / 8].copy_from_slice(&m.to_be_bytes()[..total as usize / 8]);
    mask
}
