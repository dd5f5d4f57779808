//! Prints nft JSON expressions and rules in `nft list ruleset` syntax, so explain names a
//! native rule the way its author and `nft -a list ruleset` write it (the handle identifies it
//! exactly; the text is for people).

use serde_json::Value;

fn hex_mark(n: u64) -> String {
    format!("{n:#010x}")
}

/// One expression: `ip daddr`, `meta mark & 0x00004000`, `{ 10.0.0.0/8, 10.1.0.1 }`, `@set`...
pub fn expr_text(v: &Value) -> String {
    match v {
        Value::Null => String::new(),
        Value::Bool(b) => b.to_string(),
        Value::Number(n) => n.to_string(),
        Value::String(s) => s.clone(),
        Value::Array(a) => a.iter().map(expr_text).collect::<Vec<_>>().join(","),
        Value::Object(o) => {
            let Some((k, b)) = o.iter().next() else {
                return "{}".into();
            };
            match k.as_str() {
                "payload" => match (b.get("protocol"), b.get("field")) {
                    (Some(p), Some(f)) => format!("{} {}", expr_text(p), expr_text(f)),
                    _ => format!(
                        "@{},{},{}",
                        expr_text(b.get("base").unwrap_or(&Value::Null)),
                        expr_text(b.get("offset").unwrap_or(&Value::Null)),
                        expr_text(b.get("len").unwrap_or(&Value::Null))
                    ),
                },
                "meta" => {
                    let key = expr_text(b.get("key").unwrap_or(&Value::Null));
                    match key.as_str() {
                        "iifname" | "oifname" | "iif" | "oif" => key,
                        _ => format!("meta {key}"),
                    }
                }
                "ct" => {
                    let mut s = "ct".to_string();
                    if let Some(d) = b.get("dir") {
                        s.push(' ');
                        s.push_str(&expr_text(d));
                    }
                    s.push(' ');
                    s.push_str(&expr_text(b.get("key").unwrap_or(&Value::Null)));
                    s
                }
                "fib" => format!(
                    "fib {} {}",
                    match b.get("flags") {
                        Some(Value::Array(a)) =>
                            a.iter().map(expr_text).collect::<Vec<_>>().join(" . "),
                        Some(f) => expr_text(f),
                        None => String::new(),
                    },
                    expr_text(b.get("result").unwrap_or(&Value::Null))
                ),
                "numgen" => {
                    let mut s = format!(
                        "numgen {} mod {}",
                        expr_text(b.get("mode").unwrap_or(&Value::Null)),
                        expr_text(b.get("mod").unwrap_or(&Value::Null))
                    );
                    if let Some(off) = b.get("offset").and_then(Value::as_u64).filter(|&o| o != 0) {
                        s.push_str(&format!(" offset {off}"));
                    }
                    s
                }
                "concat" => b
                    .as_array()
                    .map(|a| a.iter().map(expr_text).collect::<Vec<_>>().join(" . "))
                    .unwrap_or_default(),
                "prefix" => format!(
                    "{}/{}",
                    expr_text(b.get("addr").unwrap_or(&Value::Null)),
                    expr_text(b.get("len").unwrap_or(&Value::Null))
                ),
                "range" => b
                    .as_array()
                    .map(|a| a.iter().map(expr_text).collect::<Vec<_>>().join("-"))
                    .unwrap_or_default(),
                "set" => match b {
                    Value::Array(a) => format!(
                        "{{ {} }}",
                        a.iter().map(elem_text).collect::<Vec<_>>().join(", ")
                    ),
                    other => format!("{{ {} }}", elem_text(other)),
                },
                "elem" => expr_text(b.get("val").unwrap_or(&Value::Null)),
                "map" => format!(
                    "{} map {}",
                    expr_text(b.get("key").unwrap_or(&Value::Null)),
                    expr_text(b.get("data").unwrap_or(&Value::Null))
                ),
                "&" | "|" | "^" | "<<" | ">>" => {
                    let args = b.as_array().map(Vec::as_slice).unwrap_or_default();
                    let left = args.first().map(expr_text).unwrap_or_default();
                    let right = match (args.get(1), args.first()) {
                        (Some(Value::Number(n)), Some(l)) if is_mark(l) => {
                            hex_mark(n.as_u64().unwrap_or(0))
                        }
                        (Some(r), _) => expr_text(r),
                        (None, _) => String::new(),
                    };
                    format!("{left} {k} {right}")
                }
                "jump" | "goto" => {
                    format!("{k} {}", expr_text(b.get("target").unwrap_or(&Value::Null)))
                }
                "accept" | "drop" | "continue" | "return" => k.clone(),
                other => format!("{other} {}", expr_text(b)),
            }
        }
    }
}

fn is_mark(v: &Value) -> bool {
    v.get("meta")
        .or_else(|| v.get("ct"))
        .and_then(|m| m.get("key"))
        .and_then(Value::as_str)
        == Some("mark")
}

fn elem_text(v: &Value) -> String {
    match v.as_array() {
        Some(pair) if pair.len() == 2 => {
            format!("{} : {}", expr_text(&pair[0]), expr_text(&pair[1]))
        }
        _ => expr_text(v),
    }
}

fn is_ifname(v: &Value) -> bool {
    v.get("meta")
        .and_then(|m| m.get("key"))
        .and_then(Value::as_str)
        .is_some_and(|k| matches!(k, "iifname" | "oifname" | "iif" | "oif"))
}

fn right_text(left: &Value, right: &Value) -> String {
    match right {
        // Interface names are quoted, as nft prints them.
        Value::String(name) if is_ifname(left) => format!("\"{name}\""),
        Value::Number(n)
            if is_mark(left) || left.get("&").is_some_and(|a| a.get(0).is_some_and(is_mark)) =>
        {
            hex_mark(n.as_u64().unwrap_or(0))
        }
        _ => expr_text(right),
    }
}

fn stmt_text(s: &Value) -> String {
    let Some((k, b)) = s.as_object().and_then(|o| o.iter().next()) else {
        return expr_text(s);
    };
    match k.as_str() {
        "match" => {
            let left = b.get("left").unwrap_or(&Value::Null);
            let right = b.get("right").unwrap_or(&Value::Null);
            let op = b.get("op").and_then(Value::as_str).unwrap_or("==");
            let r = right_text(left, right);
            match op {
                // nft leaves out the implicit operators.
                "==" | "in" if left.get("&").is_none() => {
                    format!("{} {r}", expr_text(left))
                }
                _ => format!("{} {op} {r}", expr_text(left)),
            }
        }
        "mangle" => {
            let key = b.get("key").unwrap_or(&Value::Null);
            let val = b.get("value").unwrap_or(&Value::Null);
            format!("{} set {}", expr_text(key), right_text(key, val))
        }
        "vmap" => format!(
            "{} vmap {}",
            expr_text(b.get("key").unwrap_or(&Value::Null)),
            expr_text(b.get("data").unwrap_or(&Value::Null))
        ),
        "dnat" | "snat" | "masquerade" | "redirect" => {
            let mut s = k.clone();
            if let Some(f) = b.get("family") {
                s.push_str(&format!(" {}", expr_text(f)));
            }
            let addr = b.get("addr").map(expr_text);
            let port = b.get("port").map(expr_text);
            // An IPv6 address before a port is bracketed, as nft prints it.
            let addr = match (addr, &port) {
                (Some(a), Some(_)) if a.contains(':') => Some(format!("[{a}]")),
                (a, _) => a,
            };
            match (addr, port) {
                (Some(a), Some(p)) => s.push_str(&format!(" to {a}:{p}")),
                (Some(a), None) => s.push_str(&format!(" to {a}")),
                (None, Some(p)) => s.push_str(&format!(" to :{p}")),
                (None, None) => {}
            }
            if let Some(f) = b.get("flags") {
                s.push(' ');
                s.push_str(&expr_text(f));
            }
            s
        }
        "reject" => match (b.get("type"), b.get("expr")) {
            (Some(t), Some(e)) if expr_text(e) != "port-unreachable" => {
                format!("reject with {} {}", expr_text(t), expr_text(e))
            }
            _ => "reject".into(),
        },
        "counter" => match (b.get("packets"), b.get("bytes")) {
            (Some(p), Some(by)) => format!("counter packets {p} bytes {by}"),
            _ => "counter".into(),
        },
        "set" => format!(
            "{} {} {{ {} }}",
            expr_text(b.get("op").unwrap_or(&Value::Null)),
            expr_text(b.get("set").unwrap_or(&Value::Null)),
            expr_text(b.get("elem").unwrap_or(&Value::Null))
        ),
        "xt" => format!(
            "xt {} {}",
            expr_text(b.get("type").unwrap_or(&Value::Null)),
            expr_text(b.get("name").unwrap_or(&Value::Null))
        ),
        "notrack" | "accept" | "drop" | "continue" | "return" => k.clone(),
        "log" | "limit" => match b {
            Value::Null => k.clone(),
            _ => format!("{k} {}", b_text(b)),
        },
        _ => expr_text(s),
    }
}

fn b_text(b: &Value) -> String {
    match b.as_object() {
        Some(o) => o
            .iter()
            .map(|(k, v)| format!("{k} {}", expr_text(v)))
            .collect::<Vec<_>>()
            .join(" "),
        None => expr_text(b),
    }
}

/// A whole rule, with its comment as `nft` prints it.
pub fn rule_text(stmts: &[Value], comment: Option<&str>) -> String {
    let mut s = stmts.iter().map(stmt_text).collect::<Vec<_>>().join(" ");
    if let Some(c) = comment {
        s.push_str(&format!(" comment \"{c}\""));
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn prints_like_nft() {
        let r = json!([{"match": {"op": "==", "left": {"&": [{"meta": {"key": "mark"}}, 16384]}, "right": 0}}, {"return": null}]);
        assert_eq!(
            rule_text(r.as_array().unwrap(), None),
            "meta mark & 0x00004000 == 0x00000000 return"
        );
        let r = json!([{"vmap": {"key": {"concat": [{"payload": {"protocol": "ip", "field": "daddr"}}, {"meta": {"key": "l4proto"}}, {"payload": {"protocol": "th", "field": "dport"}}]}, "data": "@service-ips"}}]);
        assert_eq!(
            rule_text(r.as_array().unwrap(), None),
            "ip daddr . meta l4proto . th dport vmap @service-ips"
        );
        let r = json!([{"match": {"op": "!=", "left": {"payload": {"protocol": "ip", "field": "saddr"}}, "right": {"set": [{"prefix": {"addr": "10.201.0.0", "len": 24}}, "1.2.3.4"]}}}, {"drop": null}]);
        assert_eq!(
            rule_text(r.as_array().unwrap(), Some("fw")),
            "ip saddr != { 10.201.0.0/24, 1.2.3.4 } drop comment \"fw\""
        );
        let r = json!([{"match": {"op": "==", "left": {"meta": {"key": "l4proto"}}, "right": "tcp"}}, {"dnat": {"addr": "10.180.0.1", "port": 80}}]);
        assert_eq!(
            rule_text(r.as_array().unwrap(), None),
            "meta l4proto tcp dnat to 10.180.0.1:80"
        );
        let r = json!([{"match": {"op": "==", "left": {"meta": {"key": "iifname"}}, "right": "cali*"}}, {"accept": null}]);
        assert_eq!(
            rule_text(r.as_array().unwrap(), None),
            "iifname \"cali*\" accept"
        );
    }
}
