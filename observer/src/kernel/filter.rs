//! `--filter` expressions: a subset of pcap-filter syntax (plus observer's `iface` and `mark`)
//! compiled into the [`FilterProgram`] the probes evaluate (`observer_common::filter`).
//!
//! Text -> tokens -> AST (recursive descent, pcap precedence) -> negations pushed down to the
//! primitives -> disjunctive normal form -> fixed-size wire program. Every error carries the
//! byte span of the token it is about; `docs/filter.md` describes the language.

use std::net::{IpAddr, Ipv4Addr};

use observer_common::filter::{Atom, FilterProgram, MAX_ATOMS, MAX_TERMS, Term, atom, dir};
use thiserror::Error;

/// A filter that cannot be compiled, with the span of the offending token.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[error("bad filter: {message}\n{}", self.snippet())]
pub struct FilterError {
    /// What is wrong and what was expected.
    pub message: String,
    /// The whole expression.
    pub expr: String,
    /// Byte offset of the offending token in `expr` (`expr.len()` for "at the end").
    pub pos: usize,
    /// Byte length of the offending token (0 at the end).
    pub len: usize,
}

impl FilterError {
    fn new(expr: &str, pos: usize, len: usize, message: impl Into<String>) -> Self {
        Self {
            message: message.into(),
            expr: expr.to_string(),
            pos,
            len,
        }
    }

    /// The expression and a caret line under the offending token, both indented by two.
    fn snippet(&self) -> String {
        // Columns count characters, and control characters print as one space each, so the
        // carets line up under any UTF-8 input.
        let shown: String = self
            .expr
            .chars()
            .map(|c| if c.is_control() { ' ' } else { c })
            .collect();
        let pos = self.pos.min(self.expr.len());
        let end = (pos + self.len).min(self.expr.len());
        let col = self.expr.get(..pos).map_or(0, |s| s.chars().count());
        let width = self
            .expr
            .get(pos..end)
            .map_or(0, |s| s.chars().count())
            .max(1);
        format!("  {shown}\n  {}{}", " ".repeat(col), "^".repeat(width))
    }
}

/// Compiles `expr` into a program for the probes. `ifindex` resolves `iface NAME` (in the
/// network namespace being traced). An empty expression keeps everything. The caller sets
/// [`FilterProgram::sample`] for `--sample`.
pub fn compile(
    expr: &str,
    ifindex: &dyn Fn(&str) -> Option<u32>,
) -> Result<FilterProgram, FilterError> {
    let Some(ast) = parse(expr, ifindex)? else {
        return Ok(FilterProgram::KEEP_ALL);
    };
    let too_complex = |n: String| {
        FilterError::new(
            expr,
            0,
            expr.len(),
            format!(
                "filter too complex: {n} alternatives after expansion, at most {MAX_TERMS} \
                 (every `or` inside an `and` multiplies them; factor the expression)"
            ),
        )
    };
    let raw = count_terms(&ast, false);
    if raw > EXPANSION_LIMIT {
        let n = if raw == u64::MAX {
            "more than 2^64".to_string()
        } else {
            raw.to_string()
        };
        return Err(too_complex(n));
    }
    let terms = simplify(to_dnf(&ast, false));
    if terms.len() > MAX_TERMS {
        return Err(too_complex(terms.len().to_string()));
    }
    if let Some(big) = terms.iter().find(|t| t.len() > MAX_ATOMS) {
        return Err(FilterError::new(
            expr,
            0,
            expr.len(),
            format!(
                "filter too complex: an alternative needs {} conditions after expansion, at \
                 most {MAX_ATOMS}",
                big.len()
            ),
        ));
    }
    if terms.iter().any(Vec::is_empty) {
        return Ok(FilterProgram::KEEP_ALL);
    }
    let mut prog = FilterProgram::KEEP_ALL;
    prog.enabled = 1;
    prog.n_terms = terms.len() as u32;
    for (slot, atoms) in prog.terms.iter_mut().zip(&terms) {
        *slot = Term::EMPTY;
        slot.n_atoms = atoms.len() as u32;
        slot.atoms[..atoms.len()].copy_from_slice(atoms);
    }
    Ok(prog)
}

/// Above this many raw alternatives the expansion is not even attempted.
const EXPANSION_LIMIT: u64 = 4096;

/// Nesting (parentheses, `not`) plus the height of the tree below: the parser and every
/// pass over the tree recurse this deep at most, whatever the input (a filter nested
/// 30,000 deep would overflow the stack of the agent's request handler).
pub const MAX_DEPTH: usize = 100;

/// The parsed expression. `None` for an empty expression.
fn parse(expr: &str, ifindex: &dyn Fn(&str) -> Option<u32>) -> Result<Option<Expr>, FilterError> {
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

// ---------------------------------------------------------------------------------------------
// AST

#[derive(Debug, Clone, PartialEq, Eq)]
enum Expr {
    Prim(Prim),
    Not(Box<Expr>),
    And(Box<Expr>, Box<Expr>),
    Or(Box<Expr>, Box<Expr>),
}

/// One primitive; each becomes exactly one [`Atom`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Prim {
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
    fn atom(self, negate: bool) -> Atom {
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

// ---------------------------------------------------------------------------------------------
// Normal form

/// Alternatives the DNF of `e` (negated if `neg`) has before simplification, saturating.
fn count_terms(e: &Expr, neg: bool) -> u64 {
    match e {
        Expr::Prim(_) => 1,
        Expr::Not(x) => count_terms(x, !neg),
        Expr::And(a, b) | Expr::Or(a, b) => {
            let (x, y) = (count_terms(a, neg), count_terms(b, neg));
            // De Morgan: a negated `and` expands like an `or`.
            if matches!(e, Expr::And(..)) != neg {
                x.saturating_mul(y)
            } else {
                x.saturating_add(y)
            }
        }
    }
}

/// `e` (negated if `neg`) as alternatives of conjunctions of (possibly negated) atoms.
fn to_dnf(e: &Expr, neg: bool) -> Vec<Vec<Atom>> {
    match e {
        Expr::Prim(p) => vec![vec![p.atom(neg)]],
        Expr::Not(x) => to_dnf(x, !neg),
        Expr::And(a, b) | Expr::Or(a, b) => {
            let (x, y) = (to_dnf(a, neg), to_dnf(b, neg));
            if matches!(e, Expr::And(..)) != neg {
                let mut out = Vec::with_capacity(x.len() * y.len());
                for l in &x {
                    for r in &y {
                        out.push(l.iter().chain(r).copied().collect());
                    }
                }
                out
            } else {
                let mut out = x;
                out.extend(y);
                out
            }
        }
    }
}

/// Drops repeated atoms, contradictory terms (`x and not x`) and terms implied by others
/// (`a or (a and b)` is `a`), so that what reaches the limits is what really matters.
fn simplify(terms: Vec<Vec<Atom>>) -> Vec<Vec<Atom>> {
    let mut cleaned: Vec<Vec<Atom>> = Vec::with_capacity(terms.len());
    for t in terms {
        let mut atoms: Vec<Atom> = Vec::with_capacity(t.len());
        for a in t {
            if !atoms.contains(&a) {
                atoms.push(a);
            }
        }
        let contradictory = atoms.iter().any(|a| {
            let mut flipped = *a;
            flipped.negate ^= 1;
            atoms.contains(&flipped)
        });
        if !contradictory {
            cleaned.push(atoms);
        }
    }
    let subset = |small: &Vec<Atom>, big: &Vec<Atom>| small.iter().all(|a| big.contains(a));
    let mut kept: Vec<Vec<Atom>> = Vec::with_capacity(cleaned.len());
    for (i, t) in cleaned.iter().enumerate() {
        // Implied by a term that is kept already, or by a strictly smaller later one.
        let implied = kept.iter().any(|k| subset(k, t))
            || cleaned[i + 1..]
                .iter()
                .any(|o| o.len() < t.len() && subset(o, t));
        if !implied {
            kept.push(t.clone());
        }
    }
    kept
}

// ---------------------------------------------------------------------------------------------
// Tokens

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    LParen,
    RParen,
    Not,
    And,
    Or,
    Word,
}

#[derive(Debug, Clone, Copy)]
struct Token<'a> {
    kind: Kind,
    pos: usize,
    text: &'a str,
}

fn tokenize(expr: &str) -> Result<Vec<Token<'_>>, FilterError> {
    let mut toks = Vec::new();
    let bytes = expr.as_bytes();
    let mut i = 0;
    while i < bytes.len() {
        let c = bytes[i];
        let two = expr.get(i..i + 2);
        let (kind, len) = match c {
            _ if c.is_ascii_whitespace() => {
                i += 1;
                continue;
            }
            b'(' => (Kind::LParen, 1),
            b')' => (Kind::RParen, 1),
            b'!' => (Kind::Not, 1),
            b'&' if two == Some("&&") => (Kind::And, 2),
            b'|' if two == Some("||") => (Kind::Or, 2),
            b'&' | b'|' => {
                let msg = if c == b'&' {
                    "expected `&&` or `and` (bitwise operators are not supported)"
                } else {
                    "expected `||` or `or` (bitwise operators are not supported)"
                };
                return Err(FilterError::new(expr, i, 1, msg));
            }
            _ => {
                let len = expr[i..]
                    .find(|ch: char| ch.is_ascii_whitespace() || "()!&|".contains(ch))
                    .unwrap_or(expr.len() - i);
                let word = &expr[i..i + len];
                let kind = match word {
                    "and" => Kind::And,
                    "or" => Kind::Or,
                    "not" => Kind::Not,
                    _ => Kind::Word,
                };
                (kind, len)
            }
        };
        toks.push(Token {
            kind,
            pos: i,
            text: &expr[i..i + len],
        });
        i += len;
    }
    Ok(toks)
}

// ---------------------------------------------------------------------------------------------
// Parser

struct Parser<'a> {
    expr: &'a str,
    toks: Vec<Token<'a>>,
    i: usize,
    ifindex: &'a dyn Fn(&str) -> Option<u32>,
}

const PRIMITIVES: &str = "`tcp`, `udp`, `sctp`, `icmp`, `icmp6`, `ip`, `ip6`, `proto N`, \
                          `host A`, `net A/LEN`, `port N`, `portrange A-B`, `src ...`, \
                          `dst ...`, `iface NAME`, `mark V[/MASK]`, `not`, `(`";

/// pcap keywords this subset does not implement (so they get a precise error).
const UNSUPPORTED: &[&str] = &[
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
        self.addr_prim(v, d, ip, bits, q)
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
                Ok(bits) if bits <= max && !l.starts_with('+') => self.addr_prim(v, d, ip, bits, q),
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
        self.addr_prim(v, d, ip, max, q)
    }

    fn addr_prim(
        &self,
        v: Token<'_>,
        d: u8,
        ip: IpAddr,
        bits: u32,
        q: Qualifier<'_>,
    ) -> Result<Prim, FilterError> {
        let total = if ip.is_ipv4() { 32 } else { 128 };
        let m: u128 = if bits == 0 {
            0
        } else {
            u128::MAX << (128 - bits)
        };
        let mut mask = [0; 16];
        mask[..total as usize / 8].copy_from_slice(&m.to_be_bytes()[..total as usize / 8]);
        self.masked(v, d, ip, mask, q)
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
enum Qualifier<'a> {
    None,
    /// `tcp`/`udp`/`sctp` in front of `port`/`portrange`.
    Ports(&'a str),
    /// `ip`/`ip6` (and its version) in front of `host`/`net`/`proto`.
    Family(&'a str, u8),
}

#[derive(Debug, PartialEq, Eq)]
enum NumError {
    Invalid,
    /// `023`: pcap would read octal; refusing is better than disagreeing.
    Octal,
}

/// Decimal or `0x` hex.
fn parse_number(s: &str) -> Result<u64, NumError> {
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

fn unknown_word(w: &str) -> String {
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

#[cfg(test)]
mod tests {
    use std::{fmt, net::Ipv6Addr};

    use observer_common::filter::{FilterInput, eval};

    use super::*;

    const IFACES: [(&str, u32); 3] = [("lo", 1), ("eth0", 2), ("cali1a2b", 7)];

    fn ifs(name: &str) -> Option<u32> {
        IFACES.iter().find(|(n, _)| *n == name).map(|&(_, i)| i)
    }

    fn compile_ok(expr: &str) -> FilterProgram {
        compile(expr, &ifs).unwrap_or_else(|e| panic!("{expr:?} should compile:\n{e}"))
    }

    fn parse_ok(expr: &str) -> Expr {
        parse(expr, &ifs)
            .unwrap_or_else(|e| panic!("{expr:?} should parse:\n{e}"))
            .expect("not empty")
    }

    fn compile_err(expr: &str) -> FilterError {
        match compile(expr, &ifs) {
            Ok(p) => panic!("{expr:?} should not compile, got {p:?}"),
            Err(e) => e,
        }
    }

    /// xorshift64*: small, deterministic, good enough to pick test values.
    struct Rng(u64);

    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 >> 12;
            self.0 ^= self.0 << 25;
            self.0 ^= self.0 >> 27;
            self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
        }

        fn below(&mut self, n: usize) -> usize {
            (self.next() % n as u64) as usize
        }

        fn pick<T: Copy>(&mut self, items: &[T]) -> T {
            items[self.below(items.len())]
        }

        fn chance(&mut self, percent: u64) -> bool {
            self.next() % 100 < percent
        }
    }

    const V4: [[u8; 4]; 5] = [
        [10, 0, 0, 1],
        [10, 0, 0, 2],
        [10, 1, 2, 3],
        [192, 168, 0, 9],
        [172, 17, 0, 5],
    ];
    const V6: [&str; 4] = ["2001:db8::1", "2001:db8::2", "fe80::1", "2001:db8:1::5"];
    const PROTOS: [u8; 6] = [6, 17, 1, 58, 132, 47];
    const PORTS: [u16; 8] = [22, 23, 53, 80, 443, 1024, 40000, 65535];
    const MARKS: [u32; 5] = [0, 0x4000, 0x14000, 0x10000, 0xdead];

    fn addr(rng: &mut Rng, version: u8) -> [u8; 16] {
        let mut o = [0; 16];
        match version {
            4 => o[..4].copy_from_slice(&rng.pick(&V4)),
            6 => o = rng.pick(&V6).parse::<Ipv6Addr>().expect("v6").octets(),
            _ => {}
        }
        o
    }

    fn packet(rng: &mut Rng) -> FilterInput {
        let ip_version = if rng.chance(3) { 0 } else { rng.pick(&[4, 6]) };
        FilterInput {
            saddr: addr(rng, ip_version),
            daddr: addr(rng, ip_version),
            ifindex_in: rng.pick(&[0, 1, 2, 7]),
            ifindex_out: rng.pick(&[0, 1, 2, 7]),
            mark: rng.pick(&MARKS),
            sport: rng.pick(&PORTS),
            dport: rng.pick(&PORTS),
            ip_version,
            l4proto: rng.pick(&PROTOS),
            has_ports: u8::from(rng.chance(85)),
            _pad: 0,
            _pad2: 0,
        }
    }

    fn packets(seed: u64, n: usize) -> Vec<FilterInput> {
        let mut rng = Rng(seed);
        (0..n).map(|_| packet(&mut rng)).collect()
    }

    /// pcap semantics straight from the AST, written independently of the wire evaluator.
    fn reference(e: &Expr, x: &FilterInput) -> bool {
        match e {
            Expr::Not(a) => !reference(a, x),
            Expr::And(a, b) => reference(a, x) && reference(b, x),
            Expr::Or(a, b) => reference(a, x) || reference(b, x),
            Expr::Prim(p) => {
                let is_ip = x.ip_version == 4 || x.ip_version == 6;
                let pick = |d: u8, s: bool, t: bool| match d {
                    dir::SRC => s,
                    dir::DST => t,
                    _ => s || t,
                };
                match *p {
                    Prim::Proto { proto, version } => {
                        is_ip && x.l4proto == proto && (version == 0 || version == x.ip_version)
                    }
                    Prim::IpVersion(v) => x.ip_version == v,
                    Prim::Addr {
                        dir,
                        version,
                        addr,
                        mask,
                    } => {
                        let (net, m) = (u128::from_be_bytes(addr), u128::from_be_bytes(mask));
                        let hit = |a: [u8; 16]| u128::from_be_bytes(a) & m == net;
                        x.ip_version == version && pick(dir, hit(x.saddr), hit(x.daddr))
                    }
                    Prim::Port { dir, lo, hi } => {
                        let r = lo..=hi;
                        is_ip
                            && x.has_ports == 1
                            && [6, 17, 132].contains(&x.l4proto)
                            && pick(dir, r.contains(&x.sport), r.contains(&x.dport))
                    }
                    Prim::Iface { dir, ifindex } => {
                        pick(dir, x.ifindex_in == ifindex, x.ifindex_out == ifindex)
                    }
                    Prim::Mark { value, mask } => x.mark & mask == value,
                }
            }
        }
    }

    /// Fails unless the compiled program agrees with the reference on every packet; returns
    /// how many packets matched.
    fn check_equivalent(text: &str, ast: &Expr, pkts: &[FilterInput]) -> usize {
        let prog = compile_ok(text);
        let mut hits = 0;
        for x in pkts {
            let want = reference(ast, x);
            assert_eq!(eval(&prog, x), want, "{text:?} on {x:?}");
            hits += usize::from(want);
        }
        hits
    }

    /// pcap text for an AST: every binary node parenthesised, spellings chosen at random.
    struct Render<'a>(&'a Expr, u64);

    impl fmt::Display for Render<'_> {
        fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            let mut rng = Rng(self.1 | 1);
            let sub = |e, rng: &mut Rng| Render(e, rng.next());
            match self.0 {
                Expr::Prim(p) => render_prim(p, &mut rng, f),
                Expr::Not(a) => {
                    let kw = rng.pick(&["not ", "!", "! "]);
                    write!(f, "{kw}{}", sub(a, &mut rng))
                }
                Expr::And(a, b) => {
                    let op = rng.pick(&["and", "&&"]);
                    write!(f, "({} {op} {})", sub(a, &mut rng), sub(b, &mut rng))
                }
                Expr::Or(a, b) => {
                    let op = rng.pick(&["or", "||"]);
                    write!(f, "({} {op} {})", sub(a, &mut rng), sub(b, &mut rng))
                }
            }
        }
    }

    fn render_prim(p: &Prim, rng: &mut Rng, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut dir_word = |d: u8| match d {
            dir::SRC => "src ",
            dir::DST => "dst ",
            _ => rng.pick(&["", "src or dst ", "dst or src "]),
        };
        match *p {
            Prim::Proto {
                proto: 1,
                version: 4,
            } => write!(f, "icmp"),
            Prim::Proto {
                proto: 58,
                version: 6,
            } => write!(f, "icmp6"),
            Prim::Proto {
                proto: 6,
                version: 0,
            } => write!(f, "tcp"),
            Prim::Proto {
                proto: 17,
                version: 0,
            } => write!(f, "udp"),
            Prim::Proto {
                proto: 132,
                version: 0,
            } => write!(f, "sctp"),
            Prim::Proto { proto, version } => match version {
                4 => write!(f, "ip proto {proto}"),
                6 => write!(f, "ip6 proto {proto}"),
                _ => write!(f, "proto {proto}"),
            },
            Prim::IpVersion(4) => write!(f, "ip"),
            Prim::IpVersion(_) => write!(f, "ip6"),
            Prim::Addr {
                dir,
                version,
                addr,
                mask,
            } => {
                let ip: IpAddr = if version == 4 {
                    Ipv4Addr::new(addr[0], addr[1], addr[2], addr[3]).into()
                } else {
                    Ipv6Addr::from(addr).into()
                };
                let bits: u32 = mask.iter().map(|b| b.count_ones()).sum();
                let full = if version == 4 { 32 } else { 128 };
                let d = dir_word(dir);
                if bits == full {
                    // `src 10.0.0.1` is pcap for `src host 10.0.0.1`.
                    let host = if d.is_empty() || rng.chance(50) {
                        "host "
                    } else {
                        ""
                    };
                    write!(f, "{d}{host}{ip}")
                } else {
                    write!(f, "{d}net {ip}/{bits}")
                }
            }
            Prim::Port { dir, lo, hi } if lo == hi => write!(f, "{}port {lo}", dir_word(dir)),
            Prim::Port { dir, lo, hi } => {
                write!(f, "{}portrange {lo}-{hi}", dir_word(dir))
            }
            Prim::Iface { ifindex, .. } => {
                let name = IFACES.iter().find(|(_, i)| *i == ifindex).expect("known").0;
                write!(f, "iface {name}")
            }
            Prim::Mark {
                value,
                mask: u32::MAX,
            } if rng.chance(50) => write!(f, "mark {value:#x}"),
            Prim::Mark { value, mask } => write!(f, "mark {value:#x}/{mask:#x}"),
        }
    }

    fn random_prim(rng: &mut Rng) -> Prim {
        let d = rng.pick(&[dir::SRC, dir::DST, dir::EITHER]);
        match rng.below(9) {
            0 => Prim::Proto {
                proto: rng.pick(&[6, 17, 132]),
                version: 0,
            },
            1 => {
                let gre = rng.pick(&[0, 4, 6]);
                rng.pick(&[
                    Prim::Proto {
                        proto: 1,
                        version: 4,
                    },
                    Prim::Proto {
                        proto: 58,
                        version: 6,
                    },
                    Prim::Proto {
                        proto: 47,
                        version: gre,
                    },
                ])
            }
            2 => Prim::IpVersion(rng.pick(&[4, 6])),
            3 | 4 => {
                let version = rng.pick(&[4, 6]);
                let total = if version == 4 { 32 } else { 128 };
                let bits = if rng.chance(50) {
                    total
                } else {
                    rng.below(total as usize + 1) as u32
                };
                let m: u128 = if bits == 0 {
                    0
                } else {
                    u128::MAX << (128 - bits)
                };
                let mut mask = [0; 16];
                let n = total as usize / 8;
                mask[..n].copy_from_slice(&m.to_be_bytes()[..n]);
                let mut a = addr(rng, version);
                for (b, m) in a.iter_mut().zip(&mask) {
                    *b &= m;
                }
                Prim::Addr {
                    dir: d,
                    version,
                    addr: a,
                    mask,
                }
            }
            5 => {
                let (a, b) = (rng.pick(&PORTS), rng.pick(&PORTS));
                let (lo, hi) = if rng.chance(50) {
                    (a, a)
                } else {
                    (a.min(b), a.max(b))
                };
                Prim::Port { dir: d, lo, hi }
            }
            6 => Prim::Iface {
                dir: dir::EITHER,
                ifindex: rng.pick(&IFACES).1,
            },
            _ => {
                let (value, mask) = rng.pick(&[
                    (0x4000, 0x4000),
                    (0, 0x4000),
                    (0x10000, 0x10000),
                    (0x14000, u32::MAX),
                    (0, u32::MAX),
                ]);
                Prim::Mark { value, mask }
            }
        }
    }

    fn random_expr(rng: &mut Rng, depth: u32) -> Expr {
        if depth == 0 || rng.chance(30) {
            return Expr::Prim(random_prim(rng));
        }
        let a = Box::new(random_expr(rng, depth - 1));
        match rng.below(5) {
            0 => Expr::Not(a),
            1 | 2 => Expr::And(a, Box::new(random_expr(rng, depth - 1))),
            _ => Expr::Or(a, Box::new(random_expr(rng, depth - 1))),
        }
    }

    #[test]
    fn random_expressions_round_trip_and_compile_to_equivalent_programs() {
        let pkts = packets(0x5eed, 1500);
        let mut rng = Rng(0x00b5_e4e4);
        let (mut compiled, mut too_complex, mut matched_some, mut missed_some) = (0, 0, 0, 0);
        for _ in 0..600 {
            let ast = random_expr(&mut rng, 4);
            let text = Render(&ast, rng.next()).to_string();
            // The parser gives back exactly the tree that was printed.
            assert_eq!(parse_ok(&text), ast, "{text}");
            match compile(&text, &ifs) {
                Ok(_) => {
                    let hits = check_equivalent(&text, &ast, &pkts);
                    compiled += 1;
                    matched_some += usize::from(hits > 0);
                    missed_some += usize::from(hits < pkts.len());
                }
                Err(e) => {
                    assert!(e.message.starts_with("filter too complex"), "{text}: {e}");
                    too_complex += 1;
                }
            }
        }
        // The generator must exercise the interesting cases, not just trivial programs.
        assert!(
            compiled >= 400,
            "only {compiled} compiled, {too_complex} too complex"
        );
        assert!(too_complex > 0, "no expression hit the limits");
        assert!(
            matched_some >= 200 && missed_some >= 200,
            "{matched_some} {missed_some}"
        );
    }

    #[test]
    fn handwritten_expressions_match_the_reference() {
        let pkts = packets(42, 4000);
        let exprs = [
            "tcp",
            "udp",
            "sctp",
            "icmp",
            "icmp6",
            "ip",
            "ip6",
            "proto 47",
            "ip proto 6",
            "ip6 proto 17",
            "host 10.0.0.1",
            "src host 10.0.0.1",
            "dst host 10.0.0.2",
            "src 10.0.0.1",
            "host 2001:db8::1",
            "net 10.0.0.0/8",
            "src net 10.0.0.0/24",
            "dst net 192.168.0.0/16",
            "net 2001:db8::/32",
            "net 10.0.0.0 mask 255.0.0.0",
            "net 0.0.0.0/0",
            "port 53",
            "src port 40000",
            "dst port 22",
            "portrange 1-1024",
            "src portrange 1024-65535",
            "dst portrange 80-443",
            "tcp port 80",
            "udp dst port 53",
            "src or dst port 22",
            "src and dst net 10.0.0.0/8",
            "iface eth0",
            "mark 0x4000/0x4000",
            "mark 0x14000",
            "tcp and port 23",
            "not port 22",
            "not (tcp or udp)",
            "!tcp && !udp",
            "tcp or udp and port 53",
            "not tcp and udp",
            "host 10.0.0.1 and not (port 22 or port 80)",
            "(tcp and dst port 443) or (udp and dst port 53) or icmp",
            "not (host 10.0.0.1 and (port 22 or mark 0x4000/0x4000))",
            "ip6 and not icmp6 and src net 2001:db8::/32",
            "iface cali1a2b and mark 0/0x10000 and not src 10.0.0.1",
        ];
        for text in exprs {
            let hits = check_equivalent(text, &parse_ok(text), &pkts);
            assert!(hits > 0 && hits < pkts.len(), "{text:?} matched {hits}");
        }
    }

    #[test]
    fn and_and_or_have_equal_precedence_left_to_right_like_pcap() {
        assert_eq!(
            parse_ok("tcp or udp and port 53"),
            parse_ok("(tcp or udp) and port 53")
        );
        assert_eq!(
            parse_ok("tcp and udp or port 53"),
            parse_ok("(tcp and udp) or port 53")
        );
        assert_ne!(
            parse_ok("tcp or udp and port 53"),
            parse_ok("tcp or (udp and port 53)")
        );
        assert_eq!(parse_ok("not tcp and udp"), parse_ok("(not tcp) and udp"));
        assert_eq!(parse_ok("not not tcp"), parse_ok("not (not tcp)"));
        assert_eq!(
            parse_ok("!tcp&&udp||icmp"),
            parse_ok("not tcp and udp or icmp")
        );
    }

    fn v4(a: [u8; 4]) -> [u8; 16] {
        let mut o = [0; 16];
        o[..4].copy_from_slice(&a);
        o
    }

    fn tcp(s: [u8; 4], sport: u16, d: [u8; 4], dport: u16) -> FilterInput {
        FilterInput {
            saddr: v4(s),
            daddr: v4(d),
            sport,
            dport,
            ip_version: 4,
            l4proto: 6,
            has_ports: 1,
            ..FilterInput::default()
        }
    }

    fn keeps(expr: &str, x: &FilterInput) -> bool {
        eval(&compile_ok(expr), x)
    }

    #[test]
    fn every_keyword_on_crafted_packets() {
        let mut x = tcp([10, 0, 0, 1], 40000, [172, 17, 0, 5], 23);
        x.ifindex_in = 2;
        x.ifindex_out = 7;
        x.mark = 0x14000;
        for yes in [
            "tcp",
            "ip",
            "proto 6",
            "ip proto 6",
            "host 10.0.0.1",
            "host 172.17.0.5",
            "src host 10.0.0.1",
            "dst host 172.17.0.5",
            "src 10.0.0.1",
            "dst 172.17.0.5",
            "net 172.16.0.0/12",
            "src net 10.0.0.0/8",
            "dst net 172.17.0.0 mask 255.255.0.0",
            "port 23",
            "port 40000",
            "src port 40000",
            "dst port 23",
            "portrange 20-25",
            "portrange 25-20",
            "src portrange 39999-40001",
            "dst portrange 0x10-0x20",
            "tcp port 23",
            "tcp dst port 23",
            "src or dst port 23",
            "iface eth0",
            "iface cali1a2b",
            "mark 0x4000/0x4000",
            "mark 0x14000",
            "mark 81920",
            "tcp and port 23",
            "tcp && port 23",
            "udp || port 23",
            "not udp",
            "! udp",
            "(udp or tcp) and (host 10.0.0.1)",
            "",
            "   ",
        ] {
            assert!(keeps(yes, &x), "{yes:?} should keep {x:?}");
        }
        for no in [
            "udp",
            "sctp",
            "icmp",
            "icmp6",
            "ip6",
            "ip6 proto 6",
            "proto 17",
            "host 10.0.0.2",
            "src host 172.17.0.5",
            "dst host 10.0.0.1",
            "host 2001:db8::1",
            "net 192.168.0.0/16",
            "dst net 10.0.0.0/8",
            "port 22",
            "src port 23",
            "dst port 40000",
            "portrange 24-39999",
            "udp port 23",
            "tcp src port 23",
            "src and dst port 23",
            "src and dst net 10.0.0.0/8",
            "iface lo",
            "mark 0x4000",
            "mark 0x20000/0x30000",
            "not tcp",
            "tcp and not port 23",
        ] {
            assert!(!keeps(no, &x), "{no:?} should not keep {x:?}");
        }
        // ICMP: pcap's `port` never matches it, even though the probes put id/type in ports.
        let mut icmp = x;
        icmp.l4proto = 1;
        assert!(keeps("icmp", &icmp) && !keeps("port 23", &icmp) && keeps("not port 23", &icmp));
        // A non-first fragment has no ports.
        let mut frag = x;
        frag.has_ports = 0;
        assert!(keeps("tcp", &frag) && !keeps("port 23", &frag));
        // IPv6.
        let mut six = x;
        six.ip_version = 6;
        six.saddr = "2001:db8::1".parse::<Ipv6Addr>().expect("v6").octets();
        six.daddr = "fe80::1".parse::<Ipv6Addr>().expect("v6").octets();
        for yes in [
            "ip6",
            "tcp",
            "host 2001:db8::1",
            "src host 2001:db8::1",
            "dst fe80::1",
            "net 2001:db8::/32",
            "ip6 host fe80::1",
            "ip6 net fe80::/10",
            "ip6 proto 6",
        ] {
            assert!(keeps(yes, &six), "{yes:?} should keep {six:?}");
        }
        for no in [
            "ip",
            "host 10.0.0.1",
            "net 0.0.0.0/0",
            "dst host 2001:db8::1",
            "ip proto 6",
        ] {
            assert!(!keeps(no, &six), "{no:?} should not keep {six:?}");
        }
        six.l4proto = 58;
        assert!(keeps("icmp6", &six) && !keeps("icmp", &six));
    }

    #[test]
    fn empty_filter_keeps_all_and_contradictions_keep_nothing() {
        assert_eq!(compile_ok(""), FilterProgram::KEEP_ALL);
        assert_eq!(compile_ok("tcp or not tcp").n_terms, 2);
        let never = compile_ok("tcp and not tcp");
        assert_eq!((never.enabled, never.n_terms), (1, 0));
        assert!(!eval(&never, &tcp([1, 1, 1, 1], 1, [2, 2, 2, 2], 2)));
    }

    #[test]
    fn simplification_drops_repeats_and_implied_terms() {
        let p = compile_ok("tcp or (tcp and port 80) or tcp");
        assert_eq!(p.n_terms, 1);
        assert_eq!(p.terms[0].n_atoms, 1);
        let p = compile_ok("(port 80 and tcp) or (tcp and port 80 and tcp)");
        assert_eq!((p.n_terms, p.terms[0].n_atoms), (1, 2));
        // Nine repeated alternatives are one after simplification, so within the limits.
        let nine = ["port 53"; 9].join(" or ");
        assert_eq!(compile_ok(&nine).n_terms, 1);
    }

    #[test]
    fn limits_give_a_clear_error() {
        let e = compile_err(
            "(host 10.0.0.1 or host 10.0.0.2 or host 10.0.0.3) and (port 1 or port 2 or port 3)",
        );
        assert_eq!(
            e.message,
            "filter too complex: 9 alternatives after expansion, at most 8 (every `or` inside \
             an `and` multiplies them; factor the expression)"
        );
        assert_eq!((e.pos, e.len), (0, e.expr.len()));
        let eight = "(host 10.0.0.1 or host 10.0.0.2) and (port 1 or port 2) and (tcp or udp)";
        assert_eq!(compile_ok(eight).n_terms, 8);
        // An expansion far too large to build is refused from its size alone.
        let huge = vec!["(port 1 or port 2)"; 40].join(" and ");
        assert!(
            compile_err(&huge)
                .message
                .contains("1099511627776 alternatives")
        );
        let atoms: Vec<String> = (1..=9).map(|p| format!("not port {p}")).collect();
        let e = compile_err(&atoms.join(" and "));
        assert!(
            e.message
                .starts_with("filter too complex: an alternative needs 9 conditions"),
            "{e}"
        );
        let eight: Vec<String> = (1..=8).map(|p| format!("not port {p}")).collect();
        assert_eq!(compile_ok(&eight.join(" and ")).terms[0].n_atoms, 8);
    }

    #[test]
    fn deep_filters_are_refused_without_deep_recursion() {
        let n = 30_000;
        let cases = [
            format!("{}tcp{}", "(".repeat(n), ")".repeat(n)),
            format!("{}tcp", "not ".repeat(n)),
            vec!["tcp"; n].join(" and "),
            format!("{}tcp{}", "(tcp and ".repeat(n), ")".repeat(n)),
        ];
        // A quarter of a tokio worker's 2 MiB stack, in a debug build: recursion as deep
        // as the input would overflow it long before 30,000 levels.
        let errors = std::thread::Builder::new()
            .stack_size(512 << 10)
            .spawn(move || cases.iter().map(|c| compile_err(c)).collect::<Vec<_>>())
            .unwrap()
            .join()
            .expect("no stack overflow");
        for e in errors {
            assert!(
                e.message.starts_with("filter too deep: more than 100 levels"),
                "{}",
                e.message
            );
            // The caret sits on the token that went one level too far.
            assert!(e.pos > 0 && e.pos < e.expr.len(), "{}", e.pos);
        }
        // Within the limit: parsed and compiled as before.
        let deep_ok = format!("{}tcp{}", "(".repeat(99), ")".repeat(99));
        assert_eq!(compile_ok(&deep_ok).n_terms, 1);
        let chain_ok = vec!["tcp"; 99].join(" and ");
        assert_eq!(compile_ok(&chain_ok).n_terms, 1);
        let e = compile_err(&format!("{}tcp{}", "(".repeat(101), ")".repeat(101)));
        assert_eq!(e.pos, 100, "at the 101st `(`");
    }

    #[test]
    fn error_renders_the_expression_and_a_caret_under_the_token() {
        let e = compile_err("tcp and port foo");
        assert_eq!(
            e.to_string(),
            "bad filter: expected a port number after `port`\n  tcp and port foo\n               ^^^"
        );
        assert_eq!((e.pos, e.len), (13, 3));
        // At the end of the expression the caret sits just past it.
        let e = compile_err("tcp and port");
        assert_eq!(
            e.to_string(),
            "bad filter: expected a port number after `port`\n  tcp and port\n              ^"
        );
        // Columns count characters, not bytes.
        let e = compile_err("iface é0 or port x");
        assert!(
            e.to_string()
                .ends_with("\n  iface é0 or port x\n        ^^"),
            "{e}"
        );
    }

    /// (expression, message fragment, offending token).
    const ERRORS: &[(&str, &str, &str)] = &[
        ("port", "expected a port number after `port`", ""),
        ("port 70000", "70000 is more than 65535", "70000"),
        ("port 023", "leading 0 as octal", "023"),
        ("port ssh", "expected a port number after `port`", "ssh"),
        (
            "portrange 10",
            "expected a port range like 1024-65535",
            "10",
        ),
        ("portrange 1-x", "expected a port range", "1-x"),
        ("proto 300", "300 is more than 255", "300"),
        ("host", "expected an IPv4 or IPv6 address after `host`", ""),
        (
            "host example.com",
            "host names like `example.com`",
            "example.com",
        ),
        ("host 10.0.0.0/8", "write `net 10.0.0.0/8`", "10.0.0.0/8"),
        ("src", "expected an IPv4 or IPv6 address after `src`", ""),
        ("net 10", "abbreviated `net 10` is not supported", "10"),
        (
            "net 10.0.0.1/8",
            "non-network bits set in `10.0.0.1/8`",
            "10.0.0.1/8",
        ),
        (
            "net 10.0.0.0/33",
            "prefix length from 0 to 32",
            "10.0.0.0/33",
        ),
        (
            "net 2001:db8::/129",
            "prefix length from 0 to 128",
            "2001:db8::/129",
        ),
        (
            "net 10.0.0.0 mask 255.0.0.x",
            "dotted IPv4 mask",
            "255.0.0.x",
        ),
        (
            "net 2001:db8:: mask 255.0.0.0",
            "applies only to IPv4",
            "mask",
        ),
        ("ip host ::1", "`ip` applied to an IPv6 address", "::1"),
        (
            "ip6 net 10.0.0.0/8",
            "`ip6` applied to an IPv4 address",
            "10.0.0.0/8",
        ),
        ("ip port 80", "`ip` cannot qualify `port`", "port"),
        ("tcp host 10.0.0.1", "`tcp` cannot qualify `host`", "host"),
        (
            "tcp src 10.0.0.1",
            "`tcp` qualifies only `port` and `portrange`",
            "src",
        ),
        (
            "tcp udp",
            "expected `and`, `or` or the end of the filter before `udp`",
            "udp",
        ),
        ("(tcp", "this `(` is not closed", "("),
        ("tcp)", "unmatched `)`", ")"),
        ("tcp and", "expected a primitive after `and`", ""),
        ("and tcp", "expected a primitive before `and`", "and"),
        ("()", "expected a primitive before `)`", ")"),
        ("tcp & udp", "expected `&&` or `and`", "&"),
        ("tcp | udp", "expected `||` or `or`", "|"),
        (
            "ether host 1",
            "`ether` is a tcpdump keyword that observer does not support",
            "ether",
        ),
        ("len > 100", "`len` is a tcpdump keyword", "len"),
        (
            "tcp[13] == 2",
            "packet byte accessors like `tcp[13]`",
            "tcp[13]",
        ),
        ("frobnicate", "unknown keyword `frobnicate`", "frobnicate"),
        ("TCP", "unknown keyword `TCP`", "TCP"),
        (
            "host 10.0.0.1 or 10.0.0.2",
            "`10.0.0.2` needs a keyword before it",
            "10.0.0.2",
        ),
        ("iface", "expected an interface name after `iface`", ""),
        ("tcp and iface nope0", "no interface named `nope0`", "nope0"),
        ("mark", "expected a mark", ""),
        ("mark foo", "expected a mark like 0x4000", "foo"),
        (
            "mark 0x5/0x4",
            "0x5 has bits outside the mask 0x4",
            "0x5/0x4",
        ),
        ("mark 0x100000000", "expected a mark", "0x100000000"),
    ];

    #[test]
    fn every_error_points_at_the_offending_token() {
        for &(expr, fragment, token) in ERRORS {
            let e = compile_err(expr);
            assert!(e.message.contains(fragment), "{expr:?}: got {e}");
            let at = e.expr.get(e.pos..e.pos + e.len);
            assert_eq!(at, Some(token), "{expr:?}: wrong span in {e}");
            if token.is_empty() {
                assert_eq!(e.pos, expr.len(), "{expr:?}: should point at the end");
            }
            assert!(e.to_string().starts_with("bad filter: "), "{e}");
        }
    }

    #[test]
    fn wire_atoms_are_what_the_evaluator_expects() {
        let p = compile_ok("src net 10.0.0.0/8 and not dst port 53");
        assert_eq!((p.enabled, p.n_terms, p.sample), (1, 1, 0));
        let t = &p.terms[0];
        assert_eq!(t.n_atoms, 2);
        let net = &t.atoms[0];
        assert_eq!(
            (net.kind, net.dir, net.ip_version, net.negate),
            (atom::ADDR, dir::SRC, 4, 0)
        );
        assert_eq!(net.addr, v4([10, 0, 0, 0]));
        assert_eq!(net.mask, v4([255, 0, 0, 0]));
        let port = &t.atoms[1];
        assert_eq!(
            (port.kind, port.dir, port.a, port.b, port.negate),
            (atom::PORT, dir::DST, 53, 53, 1)
        );
        // Unused slots stay zero, so the map value is deterministic.
        assert!(t.atoms[2..].iter().all(|a| *a == Atom::EMPTY));
        assert!(p.terms[1..].iter().all(|t| *t == Term::EMPTY));
    }
}
