//! Walks native nftables base chains: the same packet state as the iptables walk, evaluated
//! the way `nft_do_chain` does. A rule is reported when every statement ran through (the rules
//! `nft monitor trace` names); a failed match or a verdict-map miss ends the rule silently;
//! `jump` pushes a return point, `goto` replaces the current chain, and the end of the base
//! chain (or `return` in it) applies its policy.

use super::{
    CtState, Flow, Frames, Hook, MatchedRule, NftRuleRef, Pkt, Simulator, Stage, TableResult, Tri,
    Verdict,
};
use crate::compile::Action;
use crate::nft::program::{
    BitOp, CtKey, Expr, FibResult, Field, MapData, MetaKey, NatKind, Op, PRule, PSet, PTable, Rhs,
    Scheduled, SetRef, Stmt, Target,
};
use crate::nft::value::{Atom, Look, STATUS_DNAT, STATUS_SNAT};
use crate::route::RouteDecision;

/// A value, or why there is none: `Break` is the kernel's NFT_BREAK (the rule stops, not
/// matched), `Unknown` means the inputs do not say.
enum Ev {
    Val(Atom),
    Break,
    Unknown(String),
}

/// What one rule did.
enum Outcome {
    /// A match failed or a lookup missed: the rule is not reported.
    NoMatch,
    /// Every statement ran; the verdict (Continue when none).
    Matched(Target, String),
    Undecidable(String),
}

fn set_of<'p>(t: &'p PTable, r: &'p SetRef) -> &'p PSet {
    match r {
        SetRef::Named(i) => &t.sets[*i],
        SetRef::Anon(p) => p,
    }
}

fn fib_type_num(t: &str) -> u128 {
    match t {
        "UNICAST" => 1,
        "LOCAL" => 2,
        "BROADCAST" => 3,
        "ANYCAST" => 4,
        "MULTICAST" => 5,
        "BLACKHOLE" => 6,
        "UNREACHABLE" => 7,
        "PROHIBIT" => 8,
        _ => 0,
    }
}

fn addr_num(a: std::net::IpAddr) -> u128 {
    match a {
        std::net::IpAddr::V4(a) => u128::from(u32::from(a)),
        std::net::IpAddr::V6(a) => u128::from(a),
    }
}

impl Simulator<'_> {
    /// Runs one native base chain (and what it jumps to) for the packet.
    pub(super) fn run_nft_chain(
        &self,
        s: Scheduled,
        hook: Hook,
        pkt: &mut Pkt,
        stage: &mut Stage,
        ch: &mut super::Chooser,
    ) -> TableResult {
        let Some(prog) = &self.nft else {
            return TableResult::Verdict(Verdict::Accept);
        };
        let t = &prog.tables[s.table];
        let base = &t.chains[s.chain];
        let policy_drop = base.base.as_ref().is_some_and(|b| b.policy_drop);
        let mut frames = Frames::new(s.chain);
        loop {
            let Some((ci, ri)) = frames.next(|ci| t.chains[ci].rules.len()) else {
                stage.policy = Some(if policy_drop { "drop" } else { "accept" }.into());
                return TableResult::Verdict(if policy_drop {
                    Verdict::Drop
                } else {
                    Verdict::Accept
                });
            };
            if !ch.step() {
                return ch.out_of_steps(stage);
            }
            let chain = &t.chains[ci];
            let rule = &chain.rules[ri];
            let mark_before = pkt.mark;
            let (target, desc) = match self.nft_rule(t, rule, hook, pkt, stage, ch) {
                Outcome::NoMatch => continue,
                Outcome::Undecidable(why) => {
                    let mut m = nft_matched(t, &chain.name, rule, ri, "undecidable".into());
                    m.undecidable = Some(why.clone());
                    stage.rules.push(m);
                    return TableResult::Undecidable(format!(
                        "{} {} {} handle {}: {why}",
                        t.id.family, t.id.name, chain.name, rule.handle
                    ));
                }
                Outcome::Matched(target, desc) => (target, desc),
            };
            let mut m = nft_matched(t, &chain.name, rule, ri, desc);
            if pkt.mark != mark_before {
                m.mark = Some((mark_before, pkt.mark));
            }
            stage.rules.push(m);
            match target {
                Target::Continue => {}
                Target::Accept => return TableResult::Verdict(Verdict::Accept),
                Target::Drop => return TableResult::Verdict(Verdict::Drop),
                Target::Reject => return TableResult::Verdict(Verdict::Reject),
                Target::Return => frames.ret(),
                Target::Jump(c) => {
                    if let Err(why) = frames.jump(c) {
                        return TableResult::Undecidable(why);
                    }
                }
                Target::Goto(c) => frames.goto(c),
                Target::Missing(name) => {
                    return TableResult::Undecidable(format!("jump to missing chain {name}"));
                }
                Target::Unknown(why) => {
                    if let Some(m) = stage.rules.last_mut() {
                        m.undecidable = Some(why.clone());
                    }
                    return TableResult::Undecidable(why);
                }
            }
        }
    }

    fn nft_rule(
        &self,
        t: &PTable,
        rule: &PRule,
        hook: Hook,
        pkt: &mut Pkt,
        stage: &mut Stage,
        ch: &mut super::Chooser,
    ) -> Outcome {
        let mut said: Vec<String> = Vec::new();
        for (i, st) in rule.stmts.iter().enumerate() {
            match st {
                Stmt::Match { left, op, right } => {
                    match self.nft_match(t, left, *op, right, hook, pkt, ch) {
                        Tri::Yes => {}
                        Tri::No => return Outcome::NoMatch,
                        Tri::Unknown(why) => {
                            // A later match that fails for certain still decides the rule.
                            if self.later_fails(t, &rule.stmts[i + 1..], hook, pkt) {
                                return Outcome::NoMatch;
                            }
                            return Outcome::Undecidable(why);
                        }
                    }
                }
                Stmt::Verdict(v) => {
                    return Outcome::Matched(v.clone(), verdict_desc(t, v, &said));
                }
                Stmt::Vmap { key, map } => {
                    let set = set_of(t, map);
                    let look = match self.lookup(t, key, set, hook, pkt, ch) {
                        Ok(l) => l,
                        Err(Ev::Break) => return Outcome::NoMatch,
                        Err(Ev::Unknown(why)) => return Outcome::Undecidable(why),
                        Err(Ev::Val(_)) => unreachable!("lookup errors are Break or Unknown"),
                    };
                    match look {
                        Look::Miss => return Outcome::NoMatch,
                        Look::Unknown(why) => return Outcome::Undecidable(why),
                        Look::Hit(e) => match &set.vals[e] {
                            MapData::Verdict(v) => {
                                return Outcome::Matched(v.clone(), verdict_desc(t, v, &said));
                            }
                            _ => {
                                return Outcome::Undecidable(format!(
                                    "vmap {} holds no verdict",
                                    set.name
                                ));
                            }
                        },
                    }
                }
                Stmt::SetMark { ct, value } => {
                    let v = match self.value(t, value, hook, pkt, ch) {
                        Ev::Val(Atom::N(v)) => v as u32,
                        Ev::Val(Atom::S(_)) => {
                            return Outcome::Undecidable("mark set to a name".into());
                        }
                        Ev::Break => return Outcome::NoMatch,
                        Ev::Unknown(why) => return Outcome::Undecidable(why),
                    };
                    if *ct {
                        // nft_ct_set_eval does nothing without a conntrack entry.
                        if pkt.has_ct() {
                            let old = pkt.ct_mark;
                            pkt.ct_mark = Some(v);
                            said.push(match old {
                                Some(o) => format!("ctmark {o:#x} -> {v:#x}"),
                                None => format!("ctmark -> {v:#x}"),
                            });
                        } else {
                            said.push("no conntrack entry: ct mark not set".into());
                        }
                    } else {
                        said.push(format!("mark {:#x} -> {v:#x}", pkt.mark));
                        pkt.mark = v;
                    }
                }
                Stmt::Nat {
                    kind,
                    addr,
                    port,
                    text,
                } => {
                    let action = match kind {
                        NatKind::Dnat => Action::Dnat {
                            addr: *addr,
                            port: *port,
                            text: text.clone(),
                        },
                        NatKind::Snat => Action::Snat {
                            addr: *addr,
                            port: *port,
                            text: text.clone(),
                        },
                        NatKind::Masquerade => Action::Masquerade { port: *port },
                        NatKind::Redirect => Action::Redirect { port: *port },
                    };
                    let (desc, flow) = self.apply(&action, hook, pkt, stage);
                    said.push(desc.to_ascii_lowercase());
                    let v = match flow {
                        Flow::Stop(Verdict::Accept) => Target::Accept,
                        _ => Target::Continue,
                    };
                    return Outcome::Matched(v, said.join(", "));
                }
                Stmt::Notrack => {
                    pkt.state = CtState::Untracked;
                    pkt.ct_mark = None;
                    said.push("notrack".into());
                }
                Stmt::Effect(_) => {}
                Stmt::Unknown(why) => {
                    if self.later_fails(t, &rule.stmts[i + 1..], hook, pkt) {
                        return Outcome::NoMatch;
                    }
                    return Outcome::Undecidable(why.clone());
                }
            }
        }
        let desc = if said.is_empty() {
            "continue".to_string()
        } else {
            said.join(", ")
        };
        Outcome::Matched(Target::Continue, desc)
    }

    /// True when one of the following matches fails whatever the random draws (no side effects).
    fn later_fails(&self, t: &PTable, rest: &[Stmt], hook: Hook, pkt: &Pkt) -> bool {
        let mut probe = pkt.clone();
        let mut ch = super::Chooser::new(Vec::new(), usize::MAX);
        rest.iter()
            .take_while(|s| matches!(s, Stmt::Match { .. }))
            .any(|s| match s {
                Stmt::Match { left, op, right } if !has_numgen(left) => matches!(
                    self.nft_match(t, left, *op, right, hook, &mut probe, &mut ch),
                    Tri::No
                ),
                _ => false,
            })
    }

    #[expect(
        clippy::too_many_arguments,
        reason = "the walk state is threaded explicitly, as in the iptables walk"
    )]
    fn nft_match(
        &self,
        t: &PTable,
        left: &Expr,
        op: Op,
        right: &Rhs,
        hook: Hook,
        pkt: &mut Pkt,
        ch: &mut super::Chooser,
    ) -> Tri {
        match right {
            Rhs::Unknown(why) => Tri::Unknown(why.clone()),
            Rhs::Set(r) => {
                let set = set_of(t, r);
                match self.lookup(t, left, set, hook, pkt, ch) {
                    Ok(Look::Hit(_)) => tri(op != Op::Ne),
                    Ok(Look::Miss) => tri(op == Op::Ne),
                    Ok(Look::Unknown(why)) | Err(Ev::Unknown(why)) => Tri::Unknown(why),
                    Err(_) => Tri::No,
                }
            }
            Rhs::Num(n) => match self.value(t, left, hook, pkt, ch) {
                Ev::Val(Atom::N(v)) => tri(match op {
                    Op::Flags => v & n != 0,
                    Op::Lt => v < *n,
                    Op::Gt => v > *n,
                    Op::Le => v <= *n,
                    Op::Ge => v >= *n,
                    Op::Eq => v == *n,
                    Op::Ne => v != *n,
                }),
                Ev::Val(Atom::S(_)) => Tri::Unknown("numeric comparison of a name".into()),
                Ev::Break => Tri::No,
                Ev::Unknown(why) => Tri::Unknown(why),
            },
        }
    }

    /// Looks the key up in `set`; Err(Break) when the key cannot be built (the rule stops).
    fn lookup(
        &self,
        t: &PTable,
        key: &Expr,
        set: &PSet,
        hook: Hook,
        pkt: &mut Pkt,
        ch: &mut super::Chooser,
    ) -> Result<Look, Ev> {
        if let Some(why) = &set.unknown {
            return Ok(Look::Unknown(why.clone()));
        }
        let parts: Vec<&Expr> = match key {
            Expr::Concat(p) => p.iter().collect(),
            k => vec![k],
        };
        let mut atoms = Vec::with_capacity(parts.len());
        let mut unknown = None;
        for p in parts {
            match self.value(t, p, hook, pkt, ch) {
                Ev::Val(a) => atoms.push(Some(a)),
                Ev::Break => return Err(Ev::Break),
                Ev::Unknown(why) => {
                    unknown.get_or_insert(why);
                    atoms.push(None);
                }
            }
        }
        Ok(match set.data.lookup(&atoms) {
            Look::Unknown(_) => {
                Look::Unknown(unknown.unwrap_or_else(|| "lookup key unknown".into()))
            }
            l => l,
        })
    }

    fn value(
        &self,
        t: &PTable,
        e: &Expr,
        hook: Hook,
        pkt: &mut Pkt,
        ch: &mut super::Chooser,
    ) -> Ev {
        let n = |v: u128| Ev::Val(Atom::N(v));
        match e {
            Expr::Payload(f) => match *f {
                Field::Saddr(v6) | Field::Daddr(v6) if v6 != pkt.v6 => Ev::Break,
                Field::Saddr(_) if pkt.src_label.is_some() => {
                    Ev::Unknown("the source address after MASQUERADE is unknown".into())
                }
                Field::Daddr(_) if pkt.dst_label.is_some() => {
                    Ev::Unknown("the destination address after REDIRECT is unknown".into())
                }
                Field::Saddr(_) => n(addr_num(pkt.src)),
                Field::Daddr(_) => n(addr_num(pkt.dst)),
                Field::Proto(v6) if v6 != pkt.v6 => Ev::Break,
                Field::Proto(_) => n(u128::from(pkt.proto)),
                Field::Sport(Some(p)) | Field::Dport(Some(p)) if p != pkt.proto => Ev::Break,
                Field::Sport(_) if pkt.sport.is_some() => n(u128::from(pkt.sport.unwrap_or(0))),
                Field::Dport(_) if pkt.dport.is_some() => n(u128::from(pkt.dport.unwrap_or(0))),
                // `th sport` of an ICMP packet reads its type and code, `th dport` its checksum.
                Field::Sport(None) if matches!(pkt.proto, 1 | 58) => {
                    n(u128::from(pkt.icmp.0) << 8 | u128::from(pkt.icmp.1))
                }
                Field::Sport(_) | Field::Dport(_) => Ev::Unknown(format!(
                    "th port of a protocol {} packet (no ports)",
                    pkt.proto
                )),
                Field::IcmpType(p) | Field::IcmpCode(p) if p != pkt.proto => Ev::Break,
                Field::IcmpType(_) => n(u128::from(pkt.icmp.0)),
                Field::IcmpCode(_) => n(u128::from(pkt.icmp.1)),
                Field::TcpFlags if pkt.proto != 6 => Ev::Break,
                Field::TcpFlags => n(u128::from(pkt.tcp_flags)),
                // The frame's own type: only bridge (and netdev) tables see an Ethernet header.
                Field::EtherType if pkt.bridge_family.is_some() => {
                    n(if pkt.v6 { 0x86dd } else { 0x0800 })
                }
                Field::EtherType => Ev::Unknown("ether type outside a bridge table".into()),
            },
            Expr::Meta(k) => match k {
                MetaKey::Mark => n(u128::from(pkt.mark)),
                MetaKey::L4Proto => n(u128::from(pkt.proto)),
                MetaKey::NfProto => n(if pkt.v6 { 10 } else { 2 }),
                MetaKey::Protocol => n(if pkt.v6 { 0x86dd } else { 0x0800 }),
                MetaKey::IifName => Ev::Val(Atom::S(in_if(hook, pkt).unwrap_or("").to_string())),
                MetaKey::OifName if pkt.bridge_family.is_some() && out_if(hook, pkt).is_none() => {
                    match &pkt.out_port_unknown {
                        Some(why) => Ev::Unknown(format!("oifname: {why}")),
                        None => Ev::Val(Atom::S(String::new())),
                    }
                }
                MetaKey::OifName => Ev::Val(Atom::S(out_if(hook, pkt).unwrap_or("").to_string())),
                // nft_meta_bridge: the bridge of the port, "" without one.
                MetaKey::IbrName | MetaKey::ObrName if t.id.family == "bridge" => {
                    let port = if *k == MetaKey::IbrName {
                        in_if(hook, pkt)
                    } else {
                        out_if(hook, pkt)
                    };
                    let br = port.and_then(|p| self.bridges.bridge_of(p));
                    Ev::Val(Atom::S(br.unwrap_or("").to_string()))
                }
                MetaKey::IbrName | MetaKey::ObrName => Ev::Unknown(
                    "meta ibrname/obrname outside a bridge table (the kernel only has them there)"
                        .into(),
                ),
            },
            Expr::Ct(_) if pkt.bridge_family.is_some() => {
                Ev::Unknown("ct in a bridge table is not modelled".into())
            }
            Expr::Ct(k) => self.ct_value(*k, pkt),
            Expr::Fib {
                saddr,
                iif,
                oif,
                mark: _,
                result,
            } => self.fib(*saddr, *iif, *oif, *result, hook, pkt),
            Expr::Numgen {
                random: _,
                modulus,
                offset,
            } => {
                // Every value is a branch: value k with probability 1/modulus.
                let m = *modulus;
                let mut k = m - 1;
                for i in 0..m - 1 {
                    if ch.choose(1.0 / f64::from(m - i)) {
                        k = i;
                        break;
                    }
                }
                n(u128::from(offset.wrapping_add(k)))
            }
            Expr::Bit(inner, op, arg) => match self.value(t, inner, hook, pkt, ch) {
                Ev::Val(Atom::N(v)) => {
                    // Registers are 32 bits wide for marks and the like.
                    let shift = u32::try_from(*arg).unwrap_or(u32::MAX);
                    n(match op {
                        BitOp::And => v & arg,
                        BitOp::Or => v | arg,
                        BitOp::Xor => v ^ arg,
                        BitOp::Shl => v.checked_shl(shift).unwrap_or(0) & 0xffff_ffff,
                        BitOp::Shr => v.checked_shr(shift).unwrap_or(0),
                    })
                }
                Ev::Val(Atom::S(_)) => Ev::Unknown("bit operation on a name".into()),
                other => other,
            },
            Expr::Concat(_) => Ev::Unknown("a concatenation outside a lookup".into()),
            Expr::Map(key, r) => {
                let set = set_of(t, r);
                match self.lookup(t, key, set, hook, pkt, ch) {
                    Ok(Look::Hit(i)) => match &set.vals[i] {
                        MapData::Value(a) => Ev::Val(a.clone()),
                        _ => Ev::Unknown(format!("map {} holds no value", set.name)),
                    },
                    Ok(Look::Miss) => Ev::Break,
                    Ok(Look::Unknown(why)) => Ev::Unknown(why),
                    Err(e) => e,
                }
            }
            Expr::Const(a) => Ev::Val(a.clone()),
            Expr::Unknown(why) => Ev::Unknown(why.clone()),
        }
    }

    fn ct_value(&self, k: CtKey, pkt: &Pkt) -> Ev {
        let n = |v: u128| Ev::Val(Atom::N(v));
        if k == CtKey::State {
            // nft_ct_get_eval: no entry reads as invalid (before conntrack) or untracked.
            return n(u128::from(pkt.ct_state_bit()));
        }
        // Every other ct key breaks the rule when there is no entry.
        if !pkt.has_ct() {
            return Ev::Break;
        }
        match k {
            CtKey::Mark => match pkt.ct_mark {
                Some(m) => n(u128::from(m)),
                None => Ev::Unknown(
                    "ct mark of a connection whose mark was not given (add `ctmark`)".into(),
                ),
            },
            CtKey::Status if pkt.state == CtState::New => {
                n(if pkt.dnat_done { STATUS_DNAT } else { 0 }
                    | if pkt.snat_done { STATUS_SNAT } else { 0 })
            }
            CtKey::Status => Ev::Unknown(format!(
                "ct status of an {} connection is not in the packet description",
                pkt.state.name()
            )),
            CtKey::Direction if pkt.state == CtState::New => n(0),
            CtKey::Direction => Ev::Unknown(format!(
                "ct direction of an {} packet is not in the packet description",
                pkt.state.name()
            )),
            CtKey::State => unreachable!("handled above"),
        }
    }

    fn fib(
        &self,
        saddr: bool,
        iif: bool,
        oif: bool,
        result: FibResult,
        hook: Hook,
        pkt: &Pkt,
    ) -> Ev {
        if self.routes.is_empty() {
            return Ev::Unknown("fib needs routes (`ip -j route show table all`)".into());
        }
        let addr = if saddr { pkt.src } else { pkt.dst };
        let dev = if iif {
            in_if(hook, pkt)
        } else if oif {
            out_if(hook, pkt)
        } else {
            None
        };
        match result {
            FibResult::Type => match self.routes.addr_type(addr, dev) {
                Some(Ok(t)) => Ev::Val(Atom::N(fib_type_num(t))),
                Some(Err(why)) => Ev::Unknown(format!("fib type: {why}")),
                None => Ev::Unknown("fib type needs routes of this family".into()),
            },
            // The interface the route to `addr` leaves by; with `iif` only when that is the
            // input interface (the reverse-path check), else none.
            FibResult::Oif => match self.routes.lookup(addr) {
                RouteDecision::Out { dev: d, .. } => {
                    let hit = match (iif || oif, dev) {
                        (false, _) => true,
                        (true, Some(x)) => x == d,
                        (true, None) => false,
                    };
                    Ev::Val(Atom::S(if hit { d } else { String::new() }))
                }
                // `lookup` never returns LocalIf (only `input` does).
                RouteDecision::Local { .. } | RouteDecision::LocalIf { .. } => {
                    Ev::Val(Atom::S(String::new()))
                }
                RouteDecision::Unroutable(why) if why.starts_with("no route") => {
                    Ev::Val(Atom::S(String::new()))
                }
                RouteDecision::Unroutable(why) | RouteDecision::Unknown(why) => {
                    Ev::Unknown(format!("fib oif through a {why}"))
                }
            },
        }
    }
}

fn has_numgen(e: &Expr) -> bool {
    match e {
        Expr::Numgen { .. } => true,
        Expr::Bit(i, ..) | Expr::Map(i, _) => has_numgen(i),
        Expr::Concat(p) => p.iter().any(has_numgen),
        _ => false,
    }
}

fn tri(b: bool) -> Tri {
    if b { Tri::Yes } else { Tri::No }
}

/// The input device the hook sees (see the iptables walk: POSTROUTING keeps it).
fn in_if(hook: Hook, pkt: &Pkt) -> Option<&str> {
    match hook {
        Hook::LocalOut => None,
        Hook::PostRouting if pkt.bridged => None,
        _ => pkt.in_iface.as_deref(),
    }
}

fn out_if(hook: Hook, pkt: &Pkt) -> Option<&str> {
    match hook {
        Hook::Forward | Hook::LocalOut | Hook::PostRouting => pkt.out_iface.as_deref(),
        _ => None,
    }
}

fn verdict_desc(t: &PTable, v: &Target, said: &[String]) -> String {
    let name = |c: &usize| t.chains.get(*c).map_or("?", |c| c.name.as_str());
    let v = match v {
        Target::Accept => "accept".to_string(),
        Target::Drop => "drop".into(),
        Target::Reject => "reject".into(),
        Target::Continue => "continue".into(),
        Target::Return => "return".into(),
        Target::Jump(c) => format!("jump {}", name(c)),
        Target::Goto(c) => format!("goto {}", name(c)),
        Target::Missing(c) => format!("jump {c} (missing)"),
        Target::Unknown(w) => w.clone(),
    };
    if said.is_empty() {
        v
    } else {
        format!("{}, {v}", said.join(", "))
    }
}

fn nft_matched(t: &PTable, chain: &str, rule: &PRule, ri: usize, action: String) -> MatchedRule {
    MatchedRule {
        table: t.id.name.clone(),
        chain: chain.to_string(),
        index: ri + 1,
        text: rule.text.clone(),
        action,
        undecidable: None,
        comments: rule.comment.iter().cloned().collect(),
        mark: None,
        nft: Some(NftRuleRef {
            family: t.id.family.clone(),
            handle: rule.handle,
            native: true,
        }),
    }
}
