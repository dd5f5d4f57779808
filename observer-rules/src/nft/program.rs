//! The compiled form of a native ruleset (built by [`super::compile`]): typed expressions and
//! statements, tables whose chain targets are indices, and the schedule of base chains on each
//! hook in the kernel's order.

use std::net::IpAddr;

use super::TableId;
use super::value::{Atom, SetData, Ty};
use observer_model::Hook;

/// Packet fields read by `payload` expressions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Field {
    /// `ip saddr` (false) / `ip6 saddr` (true).
    Saddr(bool),
    Daddr(bool),
    /// `ip protocol` / `ip6 nexthdr`.
    Proto(bool),
    /// Transport ports; `Some(p)` when the header implies protocol `p` (`tcp dport`), None for `th`.
    Sport(Option<u8>),
    Dport(Option<u8>),
    /// `icmp type` (1) / `icmpv6 type` (58).
    IcmpType(u8),
    IcmpCode(u8),
    TcpFlags,
    /// `ether type` (bridge tables, ebtables-nft's `-p IPv4`).
    EtherType,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MetaKey {
    Mark,
    L4Proto,
    NfProto,
    Protocol,
    IifName,
    OifName,
    /// `meta ibrname` / `obrname`: the bridge of the in / out port (bridge family only).
    IbrName,
    ObrName,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CtKey {
    State,
    Status,
    Mark,
    Direction,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FibResult {
    Type,
    Oif,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BitOp {
    And,
    Or,
    Xor,
    Shl,
    Shr,
}

#[derive(Debug, Clone)]
pub enum Expr {
    Payload(Field),
    Meta(MetaKey),
    Ct(CtKey),
    Fib {
        saddr: bool,
        iif: bool,
        oif: bool,
        mark: bool,
        result: FibResult,
    },
    Numgen {
        random: bool,
        modulus: u32,
        offset: u32,
    },
    Bit(Box<Expr>, BitOp, u128),
    Concat(Vec<Expr>),
    /// `KEY map @m` / `KEY map { ... }`: the value stored for the key.
    Map(Box<Expr>, SetRef),
    Const(Atom),
    Unknown(String),
}

/// A named set (index in its table) or an anonymous one compiled in place.
#[derive(Debug, Clone)]
pub enum SetRef {
    Named(usize),
    Anon(Box<PSet>),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    Eq,
    Ne,
    Lt,
    Gt,
    Le,
    Ge,
    /// Bit test: `ct state new` is `ct state & new != 0`.
    Flags,
}

#[derive(Debug, Clone)]
pub enum Rhs {
    Set(SetRef),
    Num(u128),
    Unknown(String),
}

/// Where a verdict sends the walk; chains are indices in the rule's table.
#[derive(Debug, Clone, PartialEq)]
pub enum Target {
    Accept,
    Drop,
    Reject,
    Continue,
    Return,
    Jump(usize),
    Goto(usize),
    /// A jump to a chain not in the dump.
    Missing(String),
    Unknown(String),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NatKind {
    Dnat,
    Snat,
    Masquerade,
    Redirect,
}

/// What a map element holds.
#[derive(Debug, Clone, PartialEq)]
pub enum MapData {
    None,
    Verdict(Target),
    Value(Atom),
}

#[derive(Debug, Clone)]
pub enum Stmt {
    Match {
        left: Expr,
        op: Op,
        right: Rhs,
    },
    Verdict(Target),
    Vmap {
        key: Expr,
        map: SetRef,
    },
    /// `meta mark set EXPR` (ct false) / `ct mark set EXPR` (ct true).
    SetMark {
        ct: bool,
        value: Expr,
    },
    Nat {
        kind: NatKind,
        addr: Option<IpAddr>,
        port: Option<u16>,
        text: String,
    },
    Notrack,
    /// No effect on the path (counter, log, limit, set updates, other mangles): its words.
    Effect(String),
    Unknown(String),
}

#[derive(Debug, Clone)]
pub struct PSet {
    pub name: String,
    pub key: Vec<Ty>,
    pub data: SetData,
    pub vals: Vec<MapData>,
    /// Why lookups cannot be answered (an element we cannot read), if so.
    pub unknown: Option<String>,
}

#[derive(Debug, Clone)]
pub struct PRule {
    pub handle: u64,
    pub text: String,
    pub comment: Option<String>,
    pub stmts: Vec<Stmt>,
}

#[derive(Debug, Clone)]
pub struct PChain {
    pub name: String,
    pub handle: u64,
    pub base: Option<Base>,
    pub rules: Vec<PRule>,
}

/// A base chain's registration.
#[derive(Debug, Clone)]
pub struct Base {
    pub hook: Hook,
    pub priority: i32,
    /// nat chains run inside the nat core, see `Program::hook_chains`.
    pub nat: bool,
    pub policy_drop: bool,
}

#[derive(Debug, Clone)]
pub struct PTable {
    /// Its handle orders hooks of equal priority (see `hook_chains`).
    pub id: TableId,
    pub chains: Vec<PChain>,
    pub sets: Vec<PSet>,
    /// A table iptables-nft manages (`ip filter`, `ip6 nat`...).
    pub iptables: bool,
}

/// The compiled ruleset.
#[derive(Debug, Clone, Default)]
pub struct Program {
    pub tables: Vec<PTable>,
}

/// A base chain scheduled on a hook: table and chain indices, the priority where the kernel
/// runs it and its own priority.
#[derive(Debug, Clone, Copy)]
pub struct Scheduled {
    pub table: usize,
    pub chain: usize,
    pub at: i32,
    pub priority: i32,
    /// (table handle, chain handle): at equal priority the later registration runs first.
    pub created: (u64, u64),
}

impl Program {
    /// Native base chains of `family` (`ip`/`ip6`; `inet` serves both) on `hook`, in the order the
    /// kernel runs them. nat chains are not hooks of their own: the nat core runs at -100
    /// (PREROUTING, OUTPUT) or 100 (INPUT, POSTROUTING) and calls every nat chain, iptables'
    /// nat table included, in their priority order (`nf_nat_inet_fn`). At equal priority a new
    /// hook is inserted before the existing ones (`nf_hook_entries_grow`), so the chain created
    /// last runs first; creation order is read from the handles. `skip_iptables` leaves out
    /// iptables-nft tables simulated from iptables-save.
    pub fn hook_chains(&self, v6: bool, hook: Hook, skip_iptables: bool) -> Vec<Scheduled> {
        let fam = if v6 { "ip6" } else { "ip" };
        let mut out = Vec::new();
        for (ti, t) in self.tables.iter().enumerate() {
            if !(t.id.family == fam || t.id.family == "inet") || (t.iptables && skip_iptables) {
                continue;
            }
            for (ci, c) in t.chains.iter().enumerate() {
                let Some(b) = &c.base else { continue };
                if b.hook != hook {
                    continue;
                }
                out.push(Scheduled {
                    table: ti,
                    chain: ci,
                    at: if b.nat {
                        nat_core_priority(hook)
                    } else {
                        b.priority
                    },
                    priority: b.priority,
                    created: (t.id.handle, c.handle),
                });
            }
        }
        out.sort_by_key(|s| (s.at, s.priority, std::cmp::Reverse(s.created)));
        out
    }

    /// Base chains of `bridge` tables on `hook`, in the order the kernel runs them
    /// (priority, then the chain created last first). Where br_netfilter's own hooks sit
    /// among them is the walk's business (`sim/bridged.rs`).
    pub fn bridge_chains(&self, hook: Hook) -> Vec<Scheduled> {
        let mut out = Vec::new();
        for (ti, t) in self.tables.iter().enumerate() {
            if t.id.family != "bridge" {
                continue;
            }
            for (ci, c) in t.chains.iter().enumerate() {
                let Some(b) = c.base.as_ref().filter(|b| b.hook == hook) else {
                    continue;
                };
                out.push(Scheduled {
                    table: ti,
                    chain: ci,
                    at: b.priority,
                    priority: b.priority,
                    created: (t.id.handle, c.handle),
                });
            }
        }
        out.sort_by_key(|s| (s.priority, std::cmp::Reverse(s.created)));
        out
    }

    /// (table handle, chain handle) of an iptables-nft base chain, if the dump has it.
    pub fn created(&self, v6: bool, table: &str, chain: &str) -> Option<(u64, u64)> {
        let fam = if v6 { "ip6" } else { "ip" };
        let t = self
            .tables
            .iter()
            .find(|t| t.id.family == fam && t.id.name == table)?;
        let c = t.chains.iter().find(|c| c.name == chain)?;
        Some((t.id.handle, c.handle))
    }
}

pub fn nat_core_priority(hook: Hook) -> i32 {
    match hook {
        Hook::PreRouting | Hook::LocalOut => -100,
        _ => 100,
    }
}
