//! Compiles the nft model into [`super::program`] once, so each packet walk only evaluates:
//! chain targets resolved to indices, set contents read against their key types and hashed,
//! literals typed by the expression they meet. Whatever is not modelled becomes an `Unknown`
//! carrying its reason (the walk reports it as undecidable); compiling never fails.

use std::collections::HashMap;
use std::net::IpAddr;

use serde_json::Value;

use super::program::{
    Base, BitOp, CtKey, Expr, FibResult, Field, MapData, MetaKey, NatKind, Op, PChain, PRule, PSet,
    PTable, Program, Rhs, SetRef, Stmt, Target,
};
use super::text::{expr_text, rule_text};
use super::value::{Atom, SetData, Ty, atom, element};
use super::{NftRuleset, NftSet, NftTable};
use observer_model::Hook;

/// Compiles every table of `rs`.
pub fn compile(rs: &NftRuleset) -> Program {
    Program {
        tables: rs.tables.iter().map(compile_table).collect(),
    }
}

struct Cx<'a> {
    chains: HashMap<&'a str, usize>,
    sets: HashMap<&'a str, usize>,
    set_keys: Vec<Vec<Ty>>,
}

/// Each item's index by its name.
fn by_name<T>(items: &[T], name: impl Fn(&T) -> &String) -> HashMap<&str, usize> {
    items
        .iter()
        .enumerate()
        .map(|(i, x)| (name(x).as_str(), i))
        .collect()
}

fn compile_table(t: &NftTable) -> PTable {
    let chains = by_name(&t.chains, |c| &c.name);
    let sets = by_name(&t.sets, |s| &s.name);
    let cx = Cx {
        chains,
        sets,
        set_keys: t
            .sets
            .iter()
            .map(|s| s.key.iter().map(|k| Ty::from_nft(k)).collect())
            .collect(),
    };
    let psets = t.sets.iter().map(|s| compile_named_set(&cx, s)).collect();
    let pchains = t
        .chains
        .iter()
        .map(|c| PChain {
            name: c.name.clone(),
            handle: c.handle,
            base: c.hook.as_deref().and_then(Hook::from_nft).map(|hook| Base {
                hook,
                priority: c
                    .priority
                    .unwrap_or(0)
                    .clamp(i64::from(i32::MIN), i64::from(i32::MAX))
                    as i32,
                nat: c.kind.as_deref() == Some("nat"),
                policy_drop: c.policy.as_deref() == Some("drop"),
            }),
            rules: c
                .rules
                .iter()
                .map(|r| {
                    // One rule's tree at a time (see RawJson).
                    let expr = r.expr.value();
                    let list = expr.as_array().map(Vec::as_slice).unwrap_or_default();
                    PRule {
                        handle: r.handle,
                        text: rule_text(list, r.comment.as_deref()),
                        comment: r.comment.clone(),
                        stmts: list.iter().map(|s| stmt(&cx, s)).collect(),
                    }
                })
                .collect(),
        })
        .collect();
    PTable {
        id: t.id.clone(),
        chains: pchains,
        sets: psets,
        iptables: t.is_iptables(),
    }
}

fn compile_named_set(cx: &Cx<'_>, s: &NftSet) -> PSet {
    let key: Vec<Ty> = s.key.iter().map(|k| Ty::from_nft(k)).collect();
    let elems = s.elems.as_ref().map(|e| e.value());
    let elems = match &elems {
        Some(Value::Array(a)) => a.as_slice(),
        _ => &[],
    };
    let mut p = fill_set(cx, s.name.clone(), key, elems, s.map.as_deref());
    if let Some(k) = s.key.iter().find(|k| Ty::from_nft(k) == Ty::Other) {
        p.unknown
            .get_or_insert(format!("set {} has key type {k}, not modelled", s.name));
    }
    p
}

fn map_value_ty(map: Option<&str>) -> Option<Ty> {
    match map? {
        "verdict" => None,
        t => Some(Ty::from_nft(t)),
    }
}

fn fill_set(cx: &Cx<'_>, name: String, key: Vec<Ty>, elems: &[Value], map: Option<&str>) -> PSet {
    let mut p = PSet {
        name,
        key,
        data: SetData::default(),
        vals: Vec::new(),
        unknown: None,
    };
    for (i, e) in elems.iter().enumerate() {
        // Map elements are `[key, data]` pairs.
        let (k, d) = match e.as_array() {
            Some(pair) if pair.len() == 2 => (&pair[0], Some(&pair[1])),
            _ => (e, None),
        };
        let data = match (d, map) {
            (None, _) => MapData::None,
            (Some(d), Some("verdict")) | (Some(d), None) if verdict_like(d) => {
                MapData::Verdict(target(cx, d))
            }
            (Some(d), m) => match atom(d, map_value_ty(m).unwrap_or(Ty::Int)) {
                Ok(a) => MapData::Value(a),
                Err(why) => {
                    p.unknown.get_or_insert(format!(
                        "set {}, element {}: data {why}",
                        p.name,
                        i + 1
                    ));
                    continue;
                }
            },
        };
        match element(k, &p.key) {
            Ok(pats) => {
                p.data.push(pats);
                p.vals.push(data);
            }
            Err(why) => {
                p.unknown
                    .get_or_insert(format!("set {}, element {}: {why}", p.name, i + 1));
            }
        }
    }
    p
}

fn verdict_like(v: &Value) -> bool {
    [
        "accept", "drop", "continue", "return", "jump", "goto", "queue",
    ]
    .iter()
    .any(|k| v.get(k).is_some())
}

fn target(cx: &Cx<'_>, v: &Value) -> Target {
    let chain = |k: &str| {
        let name = v
            .get(k)
            .and_then(|j| j.get("target"))
            .and_then(Value::as_str)
            .unwrap_or("");
        cx.chains
            .get(name)
            .copied()
            .ok_or_else(|| Target::Missing(name.to_string()))
    };
    if v.get("accept").is_some() {
        Target::Accept
    } else if v.get("drop").is_some() {
        Target::Drop
    } else if v.get("continue").is_some() {
        Target::Continue
    } else if v.get("return").is_some() {
        Target::Return
    } else if v.get("jump").is_some() {
        chain("jump").map_or_else(|e| e, Target::Jump)
    } else if v.get("goto").is_some() {
        chain("goto").map_or_else(|e| e, Target::Goto)
    } else {
        Target::Unknown(format!("verdict {v}"))
    }
}

fn key_of(o: &Value, k: &str) -> Option<String> {
    o.get(k)?
        .get("key")
        .and_then(Value::as_str)
        .map(str::to_string)
}

/// Compiles an expression on the left of a match (or a key, or a value to set).
fn expr(cx: &Cx<'_>, v: &Value) -> Expr {
    if let Some(p) = v.get("payload") {
        let proto = p.get("protocol").and_then(Value::as_str).unwrap_or("");
        let field = p.get("field").and_then(Value::as_str).unwrap_or("");
        let f = match (proto, field) {
            ("ip", "saddr") => Field::Saddr(false),
            ("ip", "daddr") => Field::Daddr(false),
            ("ip", "protocol") => Field::Proto(false),
            ("ip6", "saddr") => Field::Saddr(true),
            ("ip6", "daddr") => Field::Daddr(true),
            ("ip6", "nexthdr") => Field::Proto(true),
            ("tcp", "sport") => Field::Sport(Some(6)),
            ("tcp", "dport") => Field::Dport(Some(6)),
            ("udp", "sport") => Field::Sport(Some(17)),
            ("udp", "dport") => Field::Dport(Some(17)),
            ("sctp", "sport") => Field::Sport(Some(132)),
            ("sctp", "dport") => Field::Dport(Some(132)),
            ("th", "sport") => Field::Sport(None),
            ("th", "dport") => Field::Dport(None),
            ("tcp", "flags") => Field::TcpFlags,
            ("ether", "type") => Field::EtherType,
            ("icmp", "type") => Field::IcmpType(1),
            ("icmp", "code") => Field::IcmpCode(1),
            ("icmpv6", "type") => Field::IcmpType(58),
            ("icmpv6", "code") => Field::IcmpCode(58),
            _ => return Expr::Unknown(format!("payload `{}` not modelled", expr_text(v))),
        };
        return Expr::Payload(f);
    }
    if let Some(k) = key_of(v, "meta") {
        return Expr::Meta(match k.as_str() {
            "mark" => MetaKey::Mark,
            "l4proto" => MetaKey::L4Proto,
            "nfproto" => MetaKey::NfProto,
            "protocol" => MetaKey::Protocol,
            "iifname" | "iif" => MetaKey::IifName,
            "oifname" | "oif" => MetaKey::OifName,
            "ibrname" | "ibriport" => MetaKey::IbrName,
            "obrname" | "obriport" => MetaKey::ObrName,
            _ => return Expr::Unknown(format!("meta {k} not modelled")),
        });
    }
    if let Some(c) = v.get("ct") {
        let k = c.get("key").and_then(Value::as_str).unwrap_or("");
        if c.get("dir").is_some() || c.get("family").is_some() {
            return Expr::Unknown(format!("`{}` not modelled", expr_text(v)));
        }
        return Expr::Ct(match k {
            "state" => CtKey::State,
            "status" => CtKey::Status,
            "mark" => CtKey::Mark,
            "direction" => CtKey::Direction,
            _ => return Expr::Unknown(format!("ct {k} not modelled")),
        });
    }
    if let Some(f) = v.get("fib") {
        let flags: Vec<&str> = f
            .get("flags")
            .map(|x| match x {
                Value::Array(a) => a.iter().filter_map(Value::as_str).collect(),
                Value::String(s) => vec![s.as_str()],
                _ => Vec::new(),
            })
            .unwrap_or_default();
        let result = match f.get("result").and_then(Value::as_str) {
            Some("type") => FibResult::Type,
            Some("oif" | "oifname") => FibResult::Oif,
            _ => return Expr::Unknown(format!("`{}` not modelled", expr_text(v))),
        };
        return Expr::Fib {
            saddr: flags.contains(&"saddr"),
            iif: flags.contains(&"iif"),
            oif: flags.contains(&"oif"),
            mark: flags.contains(&"mark"),
            result,
        };
    }
    if let Some(n) = v.get("numgen") {
        let modulus = n.get("mod").and_then(Value::as_u64).unwrap_or(0);
        if modulus == 0 || modulus > 4096 {
            return Expr::Unknown(format!("numgen mod {modulus}"));
        }
        return Expr::Numgen {
            random: n.get("mode").and_then(Value::as_str) == Some("random"),
            modulus: modulus as u32,
            offset: n.get("offset").and_then(Value::as_u64).unwrap_or(0) as u32,
        };
    }
    if let Some(parts) = v.get("concat").and_then(Value::as_array) {
        return Expr::Concat(parts.iter().map(|p| expr(cx, p)).collect());
    }
    if let Some(m) = v.get("map") {
        let key = expr(cx, m.get("key").unwrap_or(&Value::Null));
        let tys = key_types(&key);
        return match set_ref(
            cx,
            m.get("data").unwrap_or(&Value::Null),
            &tys,
            Some("mark"),
        ) {
            Ok(s) => Expr::Map(Box::new(key), s),
            Err(why) => Expr::Unknown(why),
        };
    }
    for (op, b) in [
        ("&", BitOp::And),
        ("|", BitOp::Or),
        ("^", BitOp::Xor),
        ("<<", BitOp::Shl),
        (">>", BitOp::Shr),
    ] {
        if let Some(args) = v.get(op).and_then(Value::as_array) {
            if args.len() != 2 {
                return Expr::Unknown(format!("`{op}` with {} operands", args.len()));
            }
            let inner = expr(cx, &args[0]);
            let ty = key_types(&inner).first().copied().unwrap_or(Ty::Int);
            return match atom(&args[1], ty) {
                Ok(Atom::N(n)) => Expr::Bit(Box::new(inner), b, n),
                _ => Expr::Unknown(format!("`{}` not modelled", expr_text(v))),
            };
        }
    }
    match v {
        Value::Number(_) => atom(v, Ty::Int).map_or_else(Expr::Unknown, Expr::Const),
        _ => Expr::Unknown(format!("`{}` not modelled", expr_text(v))),
    }
}

/// The types of an expression's fields (several for a concatenation).
pub fn key_types(e: &Expr) -> Vec<Ty> {
    match e {
        Expr::Payload(f) => vec![match f {
            Field::Saddr(v6) | Field::Daddr(v6) => {
                if *v6 {
                    Ty::Ipv6
                } else {
                    Ty::Ipv4
                }
            }
            Field::Proto(_) => Ty::Proto,
            Field::Sport(_) | Field::Dport(_) => Ty::Port,
            Field::IcmpType(_) => Ty::IcmpType,
            Field::IcmpCode(_) => Ty::Int,
            Field::TcpFlags => Ty::TcpFlags,
            Field::EtherType => Ty::EtherType,
        }],
        Expr::Meta(k) => vec![match k {
            MetaKey::Mark => Ty::Int,
            MetaKey::L4Proto => Ty::Proto,
            MetaKey::NfProto => Ty::NfProto,
            MetaKey::Protocol => Ty::EtherType,
            MetaKey::IifName | MetaKey::OifName | MetaKey::IbrName | MetaKey::ObrName => Ty::Iface,
        }],
        Expr::Ct(k) => vec![match k {
            CtKey::State => Ty::CtState,
            CtKey::Status => Ty::CtStatus,
            CtKey::Mark => Ty::Int,
            CtKey::Direction => Ty::CtDir,
        }],
        Expr::Fib { result, .. } => vec![match result {
            FibResult::Type => Ty::FibType,
            FibResult::Oif => Ty::Iface,
        }],
        Expr::Bit(inner, ..) => key_types(inner),
        Expr::Concat(parts) => parts.iter().flat_map(key_types).collect(),
        Expr::Numgen { .. } | Expr::Map(..) | Expr::Const(_) => vec![Ty::Int],
        Expr::Unknown(_) => vec![Ty::Other],
    }
}

/// `"@name"` or an anonymous `{"set": [...]}` (a single literal is a one-element set).
fn set_ref(cx: &Cx<'_>, v: &Value, key: &[Ty], map: Option<&str>) -> Result<SetRef, String> {
    if let Some(name) = v.as_str().and_then(|s| s.strip_prefix('@')) {
        let &i = cx
            .sets
            .get(name)
            .ok_or_else(|| format!("set @{name} is not in the dump (its contents are unknown)"))?;
        if cx.set_keys[i].len() != key.len() {
            return Err(format!("set @{name} has a key of another shape"));
        }
        return Ok(SetRef::Named(i));
    }
    let elems: Vec<Value> = match v.get("set") {
        Some(Value::Array(a)) => a.clone(),
        Some(one) => vec![one.clone()],
        None => vec![v.clone()],
    };
    let p = fill_set(cx, "{ ... }".into(), key.to_vec(), &elems, map);
    if let Some(why) = &p.unknown {
        return Err(why.clone());
    }
    Ok(SetRef::Anon(Box::new(p)))
}

fn stmt(cx: &Cx<'_>, s: &Value) -> Stmt {
    let Some((name, body)) = s.as_object().and_then(|o| o.iter().next()) else {
        return Stmt::Unknown(format!("statement {s}"));
    };
    match name.as_str() {
        "match" => {
            let left = expr(cx, body.get("left").unwrap_or(&Value::Null));
            let right = body.get("right").unwrap_or(&Value::Null);
            let op = match body.get("op").and_then(Value::as_str).unwrap_or("==") {
                "==" => Op::Eq,
                "!=" => Op::Ne,
                "<" => Op::Lt,
                ">" => Op::Gt,
                "<=" => Op::Le,
                ">=" => Op::Ge,
                "in" => Op::Flags,
                o => return Stmt::Unknown(format!("match operator {o}")),
            };
            let tys = key_types(&left);
            // An empty concatenation has no type; it compares as nothing modelled.
            let ty0 = tys.first().copied().unwrap_or(Ty::Other);
            let is_set =
                right.get("set").is_some() || right.as_str().is_some_and(|r| r.starts_with('@'));
            let (op, rhs) = match op {
                // `in` with a set is membership; otherwise a bit test.
                Op::Flags if is_set => (Op::Eq, None),
                Op::Flags => (
                    Op::Flags,
                    Some(match atom(right, ty0) {
                        Ok(Atom::N(n)) => Rhs::Num(n),
                        Ok(_) | Err(_) => Rhs::Unknown(format!("bit test against {right}")),
                    }),
                ),
                Op::Lt | Op::Gt | Op::Le | Op::Ge => (
                    op,
                    Some(match atom(right, ty0) {
                        Ok(Atom::N(n)) => Rhs::Num(n),
                        _ => Rhs::Unknown(format!("comparison with {right}")),
                    }),
                ),
                _ => (op, None),
            };
            let right = match rhs {
                Some(r) => r,
                None => match set_ref(cx, right, &tys, None) {
                    Ok(s) => Rhs::Set(s),
                    Err(why) => Rhs::Unknown(why),
                },
            };
            Stmt::Match { left, op, right }
        }
        "accept" | "drop" | "continue" | "return" | "jump" | "goto" => Stmt::Verdict(target(cx, s)),
        "reject" => Stmt::Verdict(Target::Reject),
        "vmap" => {
            let key = expr(cx, body.get("key").unwrap_or(&Value::Null));
            match set_ref(
                cx,
                body.get("data").unwrap_or(&Value::Null),
                &key_types(&key),
                Some("verdict"),
            ) {
                Ok(map) => Stmt::Vmap { key, map },
                Err(why) => Stmt::Unknown(why),
            }
        }
        "mangle" => {
            let k = body.get("key").unwrap_or(&Value::Null);
            let value = expr(cx, body.get("value").unwrap_or(&Value::Null));
            match (key_of(k, "meta").as_deref(), key_of(k, "ct").as_deref()) {
                (Some("mark"), _) => Stmt::SetMark { ct: false, value },
                (_, Some("mark")) if k["ct"].get("dir").is_none() => {
                    Stmt::SetMark { ct: true, value }
                }
                // nftrace, priority, dscp...: they do not change which rules a packet meets.
                _ => Stmt::Effect(format!("{} set", expr_text(k))),
            }
        }
        "dnat" | "snat" | "masquerade" | "redirect" => nat(name, body),
        "notrack" => Stmt::Notrack,
        "counter" | "log" | "set" | "limit" | "ct helper" | "ct timeout" | "ct expectation" => {
            Stmt::Effect(name.clone())
        }
        "xt" => {
            let n = body.get("name").and_then(Value::as_str).unwrap_or("?");
            if n == "comment" {
                Stmt::Effect("comment".into())
            } else {
                Stmt::Unknown(format!(
                    "iptables-nft extension `{n}` (pass iptables-save output to simulate it)"
                ))
            }
        }
        other => Stmt::Unknown(format!("statement `{other}` not modelled")),
    }
}

fn nat(name: &str, body: &Value) -> Stmt {
    let kind = match name {
        "dnat" => NatKind::Dnat,
        "snat" => NatKind::Snat,
        "masquerade" => NatKind::Masquerade,
        _ => NatKind::Redirect,
    };
    let addr = match body.get("addr") {
        None => None,
        Some(Value::String(s)) => match s.parse::<IpAddr>() {
            Ok(a) => Some(a),
            Err(_) => return Stmt::Unknown(format!("{name} to `{s}` not modelled")),
        },
        Some(other) => {
            return Stmt::Unknown(format!("{name} to `{}` not modelled", expr_text(other)));
        }
    };
    let port = match body.get("port") {
        None => None,
        Some(Value::Number(n)) => match n.as_u64().and_then(|p| u16::try_from(p).ok()) {
            Some(p) => Some(p),
            None => return Stmt::Unknown(format!("{name} port {n}")),
        },
        // A port range: the kernel keeps the port when it is inside, else picks one.
        Some(other) => {
            return Stmt::Unknown(format!("{name} port `{}` not modelled", expr_text(other)));
        }
    };
    if matches!(kind, NatKind::Dnat | NatKind::Snat) && addr.is_none() {
        return Stmt::Unknown(format!("{name} without an address"));
    }
    let mut text = String::new();
    if let Some(a) = addr {
        text = if a.is_ipv6() && port.is_some() {
            format!("[{a}]")
        } else {
            a.to_string()
        };
    }
    if let Some(p) = port {
        text = format!("{text}:{p}");
    }
    Stmt::Nat {
        kind,
        addr,
        port,
        text,
    }
}
